"""``PatchDataset``: patches cut from the N-D array fields of any map-style dataset.

A base dataset's item ``i`` is a dict whose array fields (numpy arrays, torch tensors, or the
lazy chunked arrays of a fastdata store: anything with ``shape``, ``ndim`` and ``__getitem__``
taking a tuple of slices) are volumes or slides. :class:`PatchDataset` turns it into a dataset
of patches: item ``p`` is the dict of patch ``p``, every cut field cut at the same place, the
other fields passed through, plus ``"sample"`` (the base index) and ``"position"`` (the patch's
start on each axis of ``patch_size``), so that outputs can be stitched (:class:`Stitcher`).
Only the region a patch covers is read from a lazy array.

Samplers (how patch ``p`` is placed):

* ``"uniform"``: the start is uniform over every start that keeps the patch inside the sample
  (MONAI ``RandSpatialCrop``, torchio ``UniformSampler``). ``len = len(base) * patches_per_sample``,
  patch ``p`` is cut from sample ``p // patches_per_sample``.
* ``"grid"``: tiles covering each sample, neighbours sharing ``overlap`` voxels, the last tile of
  each axis aligned to the far edge (no tile leaves the sample); ``len`` is the number of tiles
  of all samples (MONAI ``GridPatch``/sliding window, torchio ``GridSampler``).
* ``"weighted"``: the patch is centred on a voxel drawn from ``weight_field`` (MONAI
  ``RandCropByPosNegLabel``; torchio ``WeightedSampler`` with ``pos_ratio=None``); see
  :class:`PatchDataset` for the exact semantics and the bounded reads.

Determinism. Patch ``p``'s position depends only on ``(seed, epoch, p)``: it is drawn from
:func:`fastdata.reader.seeding.sample_rng` (never a process-wide stream), the epoch coming from
the indices (:class:`fastdata.reader.seeding.EpochIndex`, as :func:`fastdata.loader` tags them) or
:meth:`PatchDataset.set_epoch`. So patches are the same with any number of workers, batch size,
start method or resume point.

MONAI and torchio. ``channel_first`` gives each cut field a leading channel axis, ``dtype`` casts the
cut fields (in the process that cuts them: the DataLoader's workers), the sample's affine
(``affine_field``) becomes the patch's own, and ``output="monai"`` makes the cut fields
``monai.data.MetaTensor`` objects that MONAI's dictionary transforms take (MONAI is imported only
then); :func:`fastdata.collate` batches them as MONAI's ``list_data_collate`` does.

Pickling. Per-sample state is numpy arrays only (shapes and patch offsets); the per-process cache
of foreground maps is dropped when pickled. The base dataset is pickled as it is (fastdata
datasets pickle without handles).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from fastdata.errors import CorruptRecordError, MissingExtraError, ReadLimitError
from fastdata.reader.batching import Samples
from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.seeding import EpochIndex, epoch_of, sample_rng

__all__ = ["PatchDataset", "Stitcher", "stitch", "SAMPLERS", "SAMPLE_KEY", "POSITION_KEY"]

SAMPLERS = ("uniform", "grid", "weighted")
OUTPUTS = ("numpy", "tensor", "monai")
#: the key of an item's base sample index
SAMPLE_KEY = "sample"
#: the key of an item's start coordinates (int64, one per entry of ``patch_size``)
POSITION_KEY = "position"

# Patch streams are keyed by a seed derived from the dataset's seed: a base store dataset keys
# its own decode-time crops by sample_rng(seed, epoch, sample index), and patch p must not reuse
# sample p's stream (its position would be correlated with that sample's crop).
_TAG_PATCH = 0x5EED_0A7C
_U64 = (1 << 64) - 1
#: most elements (spatial voxels x trailing elements) read at once while a foreground map is built
MAP_BLOCK_ELEMENTS = 1 << 22
#: most tiles one sample's grid may have (counted with Python ints: an int64 product would wrap)
MAX_GRID_TILES = 1 << 32


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_array_like(value: Any) -> bool:
    """numpy arrays, tensors and lazy arrays (``shape``, ``ndim``, ``__getitem__``); not str/bytes."""
    return (hasattr(value, "shape") and hasattr(value, "ndim") and hasattr(value, "__getitem__")
            and not isinstance(value, (str, bytes)))


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _numpy_dtype(value: Any, what: str) -> np.dtype:
    """``value`` (a numpy dtype or its name, or a ``torch.dtype``) as a numpy dtype."""
    try:
        if isinstance(value, torch.dtype):
            return torch.empty(0, dtype=value).numpy().dtype
        return np.dtype(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{what}: {value!r} is not a numpy or torch dtype ({err})") from None


def _meta_tensor_class() -> type:
    """``monai.data.MetaTensor`` (imported here, only for ``output="monai"``: MONAI is optional)."""
    try:
        from monai.data import MetaTensor
    except ImportError as err:
        raise MissingExtraError(f"PatchDataset(output='monai') needs MONAI, which is not importable ({err}): "
                                "pip install monai") from None
    return MetaTensor


def _pad_fill(value: Any, dtype: np.dtype, field: str) -> Any:
    """``value`` as a ``dtype`` scalar; refused where the cast would change it (-1 in uint8)."""
    try:
        cast = np.asarray(value).astype(dtype)
    except (OverflowError, ValueError, TypeError) as err:
        raise ValueError(f"pad_value {value!r} of field {field!r} is not a {dtype} value ({err})") from None
    if not np.array_equal(cast, np.asarray(value), equal_nan=cast.dtype.kind in "fc"):
        raise ValueError(f"pad_value {value!r} of field {field!r} cannot be stored in its dtype {dtype} "
                         f"(it would become {cast.item()!r})")
    return cast.item()


class _ForegroundMap(NamedTuple):
    """One sample's coarse map of ``weight_field`` (cached per process, bounded LRU)."""

    spatial: tuple[int, ...]  # sizes of the cut axes
    cell: tuple[int, ...]  # cell extent on each cut axis
    grid: tuple[int, ...]  # cells on each cut axis
    positive: np.ndarray  # cumulative positive counts (label mode) or weights, cells in C order
    negative: np.ndarray | None  # cumulative non-positive counts (label mode), else None


class PatchDataset(Dataset):
    """Patches of the N-D array fields of a map-style dataset of dicts (see the module docstring).

    Args:
        base: a map-style dataset (``__len__``, ``__getitem__``) whose items are dicts; its array
            fields may be numpy arrays, tensors or lazy arrays (only the patch's region is read).
        patch_size: the patch extent on each leading axis, e.g. ``(96, 96, 96)`` for a DxHxW volume
            or ``(256, 256)`` for an HxWx3 slide (axes beyond ``len(patch_size)`` are taken whole:
            the RGB axis). An entry ``None`` takes that whole axis (``(None, 96, 96, 96)`` for a
            channel-first CxDxHxW volume). The axes with an int entry are the *cut axes*.
        fields: the fields to cut (a name or a sequence of names). ``None``: every value of the
            sample that is array-like with at least ``len(patch_size)`` axes, decided sample by
            sample (a boxes array ``(N, 4)`` qualifies for a 2-D patch: name the fields then).
            Every cut field of a sample must have the same sizes on the cut axes (an image and its
            label volume); they are cut at the same place. Other fields are passed through as the
            base returned them (a lazy array stays lazy).
        sampler: ``"uniform"``, ``"grid"`` or ``"weighted"`` (module docstring).
        patches_per_sample: patches drawn from each sample per epoch (uniform and weighted); patch
            ``p`` belongs to sample ``p // patches_per_sample``. Must be 1 for ``"grid"``.
        overlap: ``"grid"`` only: voxels neighbouring tiles share on each cut axis, an int (voxels),
            a float in ``[0, 1)`` (a fraction of the patch, rounded down, as MONAI's ``overlap``)
            or one such value per entry of ``patch_size`` (ignored on ``None`` axes). Must leave a
            step of at least one voxel.
        weight_field: ``"weighted"`` only (and required there): the field positions are drawn from
            (a label, or a weight map with ``pos_ratio=None``). It must have the cut fields' sizes on
            the cut axes; its values are reduced over its other axes by ``max`` (a voxel of a
            multi-channel label is positive when any channel is). Listed in ``fields`` or not (then
            it is passed through uncut).
        pos_ratio: ``"weighted"``: the probability that a patch is centred on a positive voxel
            (value > 0) rather than a non-positive one (MONAI's ``pos / (pos + neg)``; default 0.5).
            ``None``: centre voxels drawn with probability proportional to the (non-negative)
            weights (torchio's ``WeightedSampler``).
        cell_size: ``"weighted"``: extent on each cut axis (an int for all, or one per cut axis) of
            the cells of the coarse foreground map. ``None``: the weight array's ``chunks`` when it
            has them (h5py, zarr: one cell is one chunk), else the patch size.
        map_cache_size: foreground maps (one per sample) kept per process, least recently used
            dropped first.
        pad_value: ``None``: a patch larger than a sample on a cut axis is an error. A number (for
            every cut field) or a dict ``field -> number``: such an axis is padded with it, the
            sample centred in the patch (``position`` is then negative there: ``(size - patch) //
            2``). Patches never otherwise leave the sample.
        seed: seed of the patch positions. ``None``: the base's ``seed`` when it has one (a fastdata
            store dataset), else ``torch.initial_seed()``; ``fastdata.loader(seed=...)`` sets it.
        transform: called with each finished patch dict (after ``dtype``, ``channel_first`` and
            ``output``), in the process that cuts it (a DataLoader worker); its result is the item.
            A MONAI ``Compose`` of dictionary transforms fits here.
        output: ``"numpy"`` (patches and positions as numpy arrays), ``"tensor"`` (torch tensors) or
            ``"monai"``: the cut fields as ``monai.data.MetaTensor`` (the patch's affine, when the
            sample has one, and meta ``filename_or_obj``: the base's ``relpath(sample)`` when it has
            that method, as a fastdata store does; ``original_channel_dim`` as MONAI's loader sets
            it, so ``EnsureChannelFirstd`` works), positions and affines as tensors. Needs MONAI
            (``MissingExtraError`` here otherwise); no other output imports it.
        channel_first: give every cut field a leading channel axis (MONAI's and torchio's ``CxDxHxW``):
            a field with exactly the axes of ``patch_size`` gains a size-1 axis in front (MONAI
            ``EnsureChannelFirst(channel_dim="no_channel")``), a field with one more axis after them
            (an RGB slide's ``HxWx3``, a 4-D volume's time points) has that axis moved to the front
            (``channel_dim=-1``). A field with more axes after those of ``patch_size`` is an error,
            and so is ``channel_first`` with a ``patch_size`` whose first entry is ``None`` (the
            fields are channel-first already). ``position`` is unchanged (the cut axes only).
        dtype: cast the cut fields, patch by patch where they are cut (the DataLoader's workers):
            one dtype for every cut field (``np.float32``, ``"float32"`` or ``torch.float32``), or a
            dict ``field -> dtype`` for some of them (``{"image": np.float32}``; a named field a
            sample does not cut is an error). ``None`` keeps the stored dtypes (a CT's ``uint16``,
            which most torch operations refuse). Padding is applied before the cast, in the stored
            dtype.
        affine_field: the field holding a sample's voxel-to-world affine (a fastdata volume store's
            ``"affine"``: ``(d + 1) x (d + 1)``, mapping the voxel indices of ``d`` spatial axes).
            When a sample has it, the item's value is the **patch's** affine,
            ``affine @ T(start)`` with ``T`` the translation by the patch's start on the spatial axes
            (the axes of ``patch_size`` after its leading ``None`` entries, a channel axis; 0 on
            spatial axes beyond ``patch_size``), float64: it maps the patch's voxel ``(0, 0, 0)`` to
            the world position of the sample's voxel ``start``, as MONAI's ``SpatialCrop`` updates a
            MetaTensor's affine. A numpy array for ``output="numpy"``, else a tensor. It is never cut
            (``fields=None`` leaves it out). ``None``: no field is taken as an affine.

    Raises:
        ValueError: settings that do not fit together (each message says which); for
            ``"grid"``, a sample smaller than the patch without ``pad_value``.

    Weighted semantics (``pos_ratio`` a float). For patch ``p`` of sample ``i``: with probability
    ``pos_ratio`` the centre is a voxel drawn uniformly among the voxels of ``weight_field`` whose
    value is > 0, otherwise uniformly among those whose value is <= 0; the patch's start is
    ``centre - patch // 2`` on each cut axis, moved (as MONAI's ``correct_crop_centers``) just enough
    to keep the patch inside the sample, so the centre voxel is always inside the patch, and at its
    centre unless it lies within half a patch of the border. A sample with no positive voxel
    (or no non-positive one) uses the other kind, with one ``RuntimeWarning`` per process. With
    ``pos_ratio=None`` the centre is drawn with probability proportional to the weights (all-zero
    weights: uniform over the voxels, with a warning).

    Bounded reads. The first patch of sample ``i`` in a process reads ``weight_field`` once, in
    blocks of at most :data:`MAP_BLOCK_ELEMENTS` elements, into a coarse map: positives (or weight
    sums) per cell. Each patch then draws a cell with probability proportional to its count of the
    chosen kind and reads only that cell to pick the voxel, which is exactly the uniform draw above
    in two steps. Maps are cached per process (``map_cache_size`` samples).
    """

    def __init__(
        self,
        base: Any,
        patch_size: Sequence[int | None],
        fields: str | Sequence[str] | None = None,
        sampler: str = "uniform",
        patches_per_sample: int = 1,
        overlap: int | float | Sequence[int | float] = 0,
        weight_field: str | None = None,
        pos_ratio: float | None = 0.5,
        pad_value: float | Mapping[str, float] | None = None,
        seed: int | None = None,
        transform: Callable | None = None,
        output: str = "numpy",
        *,
        cell_size: int | Sequence[int] | None = None,
        map_cache_size: int = 256,
        channel_first: bool = False,
        dtype: Any = None,
        affine_field: str | None = "affine",
    ) -> None:
        if isinstance(patch_size, (str, bytes)) or not isinstance(patch_size, Sequence) or not patch_size:
            raise ValueError(f"patch_size must be a non-empty sequence of ints >= 1 or None (e.g. (96, 96, 96)), "
                             f"got {patch_size!r}")
        if any(not (p is None or (_is_int(p) and p >= 1)) for p in patch_size):
            raise ValueError(f"patch_size entries must be ints >= 1 or None (the whole axis), got {patch_size!r}")
        if all(p is None for p in patch_size):
            raise ValueError(f"patch_size {patch_size!r} cuts nothing: give an int on at least one axis")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if not _is_int(patches_per_sample) or patches_per_sample < 1:
            raise ValueError(f"patches_per_sample must be an int >= 1, got {patches_per_sample!r}")
        if sampler == "grid" and patches_per_sample != 1:
            raise ValueError("patches_per_sample applies to the random samplers; a grid has its own tile count")
        if sampler == "weighted":
            if weight_field is None:
                raise ValueError("sampler='weighted' needs weight_field= (the label or weight field)")
            if pos_ratio is not None and not (isinstance(pos_ratio, numbers.Real) and 0 <= pos_ratio <= 1):
                raise ValueError(f"pos_ratio must be a number in [0, 1] or None, got {pos_ratio!r}")
        elif weight_field is not None or cell_size is not None:
            raise ValueError("weight_field and cell_size apply only to sampler='weighted'")
        if not _is_int(map_cache_size) or map_cache_size < 1:
            raise ValueError(f"map_cache_size must be an int >= 1, got {map_cache_size!r}")
        self.base = base
        self.patch_size: tuple[int | None, ...] = tuple(None if p is None else int(p) for p in patch_size)
        #: the cut axes: those of ``patch_size`` with an int entry
        self.cut_axes: tuple[int, ...] = tuple(j for j, p in enumerate(self.patch_size) if p is not None)
        if isinstance(fields, str):
            fields = (fields,)
        if fields is not None:
            fields = tuple(fields)
            if not fields or not all(isinstance(f, str) for f in fields):
                raise ValueError(f"fields must be None, a field name or a non-empty sequence of names, got {fields!r}")
            if len(set(fields)) != len(fields):
                raise ValueError(f"fields names a field twice: {fields!r}")
        self.fields: tuple[str, ...] | None = fields
        if affine_field is not None and not isinstance(affine_field, str):
            raise ValueError(f"affine_field must be a field name or None, got {affine_field!r}")
        if affine_field is not None and fields is not None and affine_field in fields:
            raise ValueError(f"fields names the affine field {affine_field!r}: an affine is not cut, the patch gets "
                             "its own (pass affine_field=None to cut a field of that name)")
        self.affine_field = affine_field
        if not isinstance(channel_first, bool):
            raise ValueError(f"channel_first must be True or False, got {channel_first!r}")
        if channel_first and self.patch_size[0] is None:
            raise ValueError(f"channel_first=True with patch_size {self.patch_size}: a first entry None takes a "
                             "channel axis that is first already; leave channel_first False")
        self.channel_first = channel_first
        self.dtype = self._check_dtype(dtype)
        self.sampler = sampler
        self.patches_per_sample = int(patches_per_sample)
        self.weight_field = weight_field
        self.pos_ratio = None if pos_ratio is None else float(pos_ratio)
        self.pad_value = self._check_pad_value(pad_value)
        self.cell_size = self._per_cut_axis(cell_size, "cell_size") if cell_size is not None else None
        self.map_cache_size = int(map_cache_size)
        self.transform = transform
        self.output = output
        if output == "monai":
            _meta_tensor_class()  # a missing MONAI is said here, not in a DataLoader worker
        base_seed: Any = getattr(base, "seed", None)
        if seed is not None and not _is_int(seed):
            raise ValueError(f"seed must be None or an int, got {seed!r}")
        #: seed of the patch positions (fastdata.loader(seed=...) sets it)
        self.seed = int(seed) if seed is not None else int(base_seed) if _is_int(base_seed) else torch.initial_seed()
        #: epoch of the patch positions; None until set_epoch (then epoch 0's positions are used)
        self.epoch: int | None = None
        self._n = len(base)
        self.overlap = self._resolve_overlap(overlap) if sampler == "grid" else None
        if sampler != "grid" and overlap != 0:
            raise ValueError("overlap applies only to sampler='grid'")
        # sizes of the leading len(patch_size) axes per sample, -1 = not known yet; filled from
        # base.array_shapes (the store's index) or by reading samples, never a dict per sample
        self._shapes = np.full((self._n, len(self.patch_size)), -1, dtype=np.int64)
        if sampler == "grid":
            self._fill_all_shapes()
            self._tile_counts = self._grid_counts(self._shapes)
            per_sample = self._tile_totals(self._tile_counts)
        else:
            self._tile_counts = np.zeros((0, len(self.patch_size)), dtype=np.int64)
            per_sample = np.full(self._n, self.patches_per_sample, dtype=np.int64)
        #: first patch index of each sample, and the total at the end (length len(base) + 1)
        self.patch_starts = np.concatenate([[0], np.cumsum(per_sample)]).astype(np.int64)
        self._maps: OrderedDict[int, _ForegroundMap] = OrderedDict()
        self._warned: set[str] = set()
        self._patch_key: tuple[int | None, int] = (None, 0)  # (seed, the patch streams' seed derived from it)

    # -- settings ---------------------------------------------------------------------------
    def _per_cut_axis(self, value: Any, name: str) -> tuple[int, ...]:
        """An int >= 1 for every cut axis, or one per cut axis."""
        values = ([value] * len(self.cut_axes) if _is_int(value)
                  else list(value) if isinstance(value, Sequence) else None)
        if values is None or len(values) != len(self.cut_axes) or not all(_is_int(v) and v >= 1 for v in values):
            raise ValueError(f"{name} must be an int >= 1 or one per cut axis ({len(self.cut_axes)}), got {value!r}")
        return tuple(int(v) for v in values)

    def _check_dtype(self, dtype: Any) -> np.dtype | dict[str, np.dtype] | None:
        if dtype is None:
            return None
        if isinstance(dtype, Mapping):
            if not dtype or not all(isinstance(k, str) for k in dtype):
                raise ValueError(f"dtype must be a dtype or a non-empty dict field name -> dtype, got {dtype!r}")
            out = {name: _numpy_dtype(d, f"dtype of field {name!r}") for name, d in dtype.items()}
            if self.fields is not None:
                uncut = [name for name in out if name not in self.fields]
                if uncut:
                    raise ValueError(f"dtype names {', '.join(map(repr, uncut))}, not among the fields cut "
                                     f"{self.fields}")
            return out
        return _numpy_dtype(dtype, "dtype")

    def _check_pad_value(self, pad_value: Any) -> float | dict[str, float] | None:
        if pad_value is None:
            return None
        if isinstance(pad_value, Mapping):
            if not all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in pad_value.values()):
                raise ValueError(f"pad_value must map field names to numbers, got {pad_value!r}")
            return dict(pad_value)
        if not isinstance(pad_value, numbers.Number) or isinstance(pad_value, bool):
            raise ValueError(f"pad_value must be None, a number or a dict field -> number, got {pad_value!r}")
        return pad_value  # type: ignore[return-value]  # a numbers.Number (int, float, numpy scalar)

    def _resolve_overlap(self, overlap: Any) -> tuple[int, ...]:
        """Overlap in voxels on each axis of ``patch_size`` (0 on ``None`` axes)."""
        values = list(overlap) if isinstance(overlap, Sequence) and not isinstance(overlap, str) else (
            [overlap] * len(self.patch_size))
        if len(values) != len(self.patch_size):
            raise ValueError(f"overlap must be one value or one per entry of patch_size ({len(self.patch_size)}), "
                             f"got {overlap!r}")
        out = []
        for j, (value, patch) in enumerate(zip(values, self.patch_size, strict=True)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"overlap must be ints (voxels) or floats in [0, 1) (fractions), got {overlap!r}")
            if patch is None:
                out.append(0)
                continue
            if _is_int(value):
                voxels = int(cast(int, value))  # an Integral: exact
            elif value < 1:
                voxels = math.floor(float(value) * patch)
            else:
                raise ValueError(f"overlap {value!r} on axis {j}: a float is a fraction of the patch, in [0, 1)")
            if voxels >= patch:
                raise ValueError(f"overlap {voxels} on axis {j} leaves no step: it must be smaller than the "
                                 f"patch ({patch})")
            out.append(voxels)
        return tuple(out)

    # -- shapes -----------------------------------------------------------------------------
    def _shape_field(self) -> str:
        """The field whose shape is each sample's shape when shapes are needed before reading it
        (grid): the weight field, else the first of ``fields``, else the first field of ``base[0]``
        that would be cut."""
        if self.weight_field is not None:
            return self.weight_field
        if self.fields is not None:
            return self.fields[0]
        if self._n == 0:
            return ""
        sample = self.base[0]
        names = self._cut_names(sample, 0)
        return names[0]

    def _indexed_shapes(self, name: str) -> np.ndarray | None:
        """Every sample's leading sizes from ``base.array_shapes(name)`` (the store's index: no record
        opened), or None when the base has no such method or it does not know the field."""
        array_shapes = getattr(self.base, "array_shapes", None)
        if not callable(array_shapes) or not name:
            return None
        try:
            shapes = np.asarray(array_shapes(name))
        except (KeyError, ValueError):  # a field the index has no shapes of: the caller reads samples
            return None
        k = len(self.patch_size)
        if shapes.ndim != 2 or shapes.shape[0] != self._n or not np.issubdtype(shapes.dtype, np.integer):
            raise ValueError(f"base.array_shapes({name!r}) returned an array of shape {shapes.shape} and dtype "
                             f"{shapes.dtype}; expected ({self._n}, ndim) ints")
        if shapes.shape[1] < k:
            raise ValueError(f"field {name!r} has {shapes.shape[1]} axes, fewer than patch_size {self.patch_size}")
        return shapes[:, :k].astype(np.int64)

    def _fill_all_shapes(self) -> None:
        """Every sample's leading sizes (a grid's layout needs them all): from the store's index when
        it has them, else from ``base[i][field].shape`` sample by sample."""
        if self._n == 0:
            return
        name = self._shape_field()
        shapes = self._indexed_shapes(name)
        if shapes is not None:
            self._shapes[:] = shapes
            return
        for i in range(self._n):
            self._shapes[i] = self._leading_shape(self.base[i], i, name)

    def _leading_shape(self, sample: Mapping, index: int, name: str) -> tuple[int, ...]:
        if name not in sample:
            raise KeyError(f"sample {index} has no field {name!r} (fields: {', '.join(map(str, sample))})")
        value = sample[name]
        if not _is_array_like(value) or value.ndim < len(self.patch_size):
            raise ValueError(f"sample {index}: field {name!r} is not an array with at least {len(self.patch_size)} "
                             f"axes (patch_size {self.patch_size}), got {type(value).__name__} "
                             f"{getattr(value, 'shape', '')}")
        return tuple(int(s) for s in value.shape[:len(self.patch_size)])

    def spatial_shape(self, sample: int) -> tuple[int, ...]:
        """The sizes of sample ``sample``'s leading ``len(patch_size)`` axes.

        Args:
            sample: a base index.

        Returns:
            tuple[int, ...]: from the base's ``array_shapes`` or the sample itself (read once, then
            cached in this process).
        """
        i = self._check_sample(sample)
        if self._shapes[i, 0] < 0:
            name = self.weight_field or (self.fields[0] if self.fields is not None else "")
            shapes = self._indexed_shapes(name)
            if shapes is not None:
                self._shapes[:] = shapes
            else:
                item = self.base[i]
                self._shapes[i] = self._leading_shape(item, i, name or self._cut_names(item, i)[0])
        return tuple(int(s) for s in self._shapes[i])

    def _extent(self, shape: Sequence[int]) -> np.ndarray:
        """The patch's extent on each axis of ``patch_size`` for a sample of leading sizes ``shape``."""
        return np.array([s if p is None else p for s, p in zip(shape, self.patch_size, strict=True)],
                        dtype=np.int64)

    def _grid_counts(self, shapes: np.ndarray) -> np.ndarray:
        """Tiles on each axis for every sample (n, len(patch_size)); a sample smaller than the patch
        without ``pad_value`` is refused here, before any epoch starts."""
        if not len(shapes):
            return np.zeros((0, len(self.patch_size)), dtype=np.int64)
        assert self.overlap is not None
        extent = np.where(np.array([p is None for p in self.patch_size])[None, :], shapes,
                          np.array([p or 0 for p in self.patch_size])[None, :])
        if self.pad_value is None:
            short = np.argwhere(shapes < extent)
            if len(short):
                i, j = (int(v) for v in short[0])
                self._too_small(i, self._shape_field(), j, int(shapes[i, j]), int(extent[i, j]))
        step = np.maximum(extent - np.array(self.overlap)[None, :], 1)
        more = np.maximum(shapes - extent, 0)
        return (1 + -(-more // step)).astype(np.int64)

    def _tile_totals(self, counts: np.ndarray) -> np.ndarray:
        """Tiles of each sample's grid (the product of ``counts``' rows), refused for a sample with
        more than :data:`MAX_GRID_TILES`: the products are checked with Python ints wherever an int64
        product could come near the bound (a stored shape such as ``[2**40, 2**40, 0]`` would wrap
        to no tile at all).

        Raises:
            ReadLimitError: naming the sample, its shape and tile counts.
        """
        if not len(counts):
            return np.zeros(0, dtype=np.int64)
        rough = counts.astype(np.float64).prod(axis=1)  # no wrap; exact enough to find candidates
        for i in np.flatnonzero(rough > MAX_GRID_TILES / 2).tolist():
            tiles = math.prod(int(n) for n in counts[i].tolist())
            if tiles > MAX_GRID_TILES:
                raise ReadLimitError(
                    f"sample {i}: field {self._shape_field()!r} of leading shape {self._shapes[i].tolist()} makes a "
                    f"grid of {counts[i].tolist()} = {tiles:,} tiles of patch_size {self.patch_size}, more than the "
                    f"{MAX_GRID_TILES:,} one sample may have (fastdata.reader.patches.MAX_GRID_TILES)")
        totals = counts.prod(axis=1)
        if sum(int(t) for t in totals.tolist()) >= 1 << 62:
            raise ReadLimitError(f"the grid's tiles over {len(counts)} samples are too many to index")
        return totals

    def _too_small(self, sample: int, field: str, axis: int, size: int, patch: int) -> None:
        raise ValueError(
            f"sample {sample}: field {field!r} has {size} voxels on axis {axis}, fewer than the patch's {patch} "
            f"(patch_size {self.patch_size}); pass pad_value= (e.g. pad_value=0) to pad such samples, or use a "
            "smaller patch")

    # -- indices ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.patch_starts[-1])

    def _check_index(self, index: Any) -> int:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} patches")
        return i

    def _check_sample(self, sample: Any) -> int:
        if not _is_int(sample) or not 0 <= int(sample) < self._n:
            raise IndexError(f"sample {sample!r} out of range for a base of {self._n} samples")
        return int(sample)

    def sample_of(self, index: int) -> int:
        """The base index patch ``index`` is cut from.

        Args:
            index: a patch index (negative counts from the end).

        Returns:
            int: the sample index.
        """
        i = self._check_index(index)
        if self.sampler != "grid":
            return i // self.patches_per_sample
        return int(np.searchsorted(self.patch_starts, i, side="right")) - 1

    def patches_of(self, sample: int) -> range:
        """The patch indices of sample ``sample`` (for a grid: its tiles, in their order), e.g.
        ``torch.utils.data.Subset(ds, ds.patches_of(i))`` to run one volume's tiles.

        Args:
            sample: a base index.

        Returns:
            range: consecutive patch indices.
        """
        i = self._check_sample(sample)
        return range(int(self.patch_starts[i]), int(self.patch_starts[i + 1]))

    @property
    def shard_starts(self) -> np.ndarray | None:
        """The base's shards as patch index ranges: the first patch index of each shard (None when
        the base has no ``shard_starts``), so that :class:`fastdata.DistributedShardSampler`'s
        ``shard_window`` mode and its resume work on patches as on the base's samples."""
        starts = getattr(self.base, "shard_starts", None)
        if starts is None:
            return None
        return self.patch_starts[np.asarray(starts, dtype=np.int64)]

    def prefetch_shards(self, shards: Sequence[int], keep: Sequence[int] = ()) -> None:
        """The base's ``prefetch_shards`` (a remote store: download ``shards`` in the background);
        nothing for a base without it. Shard numbers are the base's (see :attr:`shard_starts`)."""
        prefetch = getattr(self.base, "prefetch_shards", None)
        if callable(prefetch):
            prefetch(shards, keep)

    @property
    def skipped(self) -> int:
        """The base's count of damaged samples replaced (``on_error="skip"``), 0 without one."""
        return int(getattr(self.base, "skipped", 0))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose patch positions the next reads use (and the base's epoch).

        :func:`fastdata.loader` and :class:`fastdata.DistributedShardSampler` call this for you, and
        send the epoch to the workers with the indices. Until it is called, positions are epoch 0's,
        every epoch: call it at the start of each epoch with a plain DataLoader.

        Args:
            epoch (int): a non-negative epoch number.

        Raises:
            ValueError: a negative or non-int epoch.
        """
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = int(epoch)
        set_base_epoch = getattr(self.base, "set_epoch", None)
        if callable(set_base_epoch):
            set_base_epoch(self.epoch)

    # -- reading ----------------------------------------------------------------------------
    def _base_sample(self, sample: int, epoch: int | None) -> Mapping:
        item = self.base[EpochIndex(sample, epoch) if epoch is not None else sample]
        if not isinstance(item, Mapping):
            raise ValueError(f"base item {sample} is a {type(item).__name__}, not a dict of fields; PatchDataset "
                             "cuts the array fields of dict samples")
        return item

    def __getitem__(self, index: int):
        epoch = epoch_of(index, self.epoch)
        p = self._check_index(index)
        sample = self.sample_of(p)
        return self._patch_or_replace(p, sample, lambda: self._base_sample(sample, epoch), epoch)

    def _patch_or_replace(self, p: int, sample: int, load: Callable[[], Mapping], epoch: int | None) -> Any:
        """Patch ``p`` of ``sample`` (``load()`` gives the sample); a damaged chunk found while cutting it
        goes to the base's ``on_error`` policy (``replace_damaged``): raised, or the same patch number
        cut from the next readable sample (uniform and weighted samplers; a grid tile belongs to its
        sample's shape, so damage under the grid sampler is always raised)."""
        try:
            return self._patch(p, sample, load(), epoch)
        except CorruptRecordError as err:
            replace = getattr(self.base, "replace_damaged", None)
            if replace is None or self.sampler == "grid":
                raise
            return replace(sample, err, lambda k: self._patch(p, k, self._base_sample(k, epoch), epoch))[1]

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        """A batch of patch dicts (the DataLoader calls this): each distinct sample of the batch is
        read once (through the base's ``__getitems__`` when it has one), in the order asked.
        Passthrough values of one sample are the same objects in each of its patches; ``self[p]``
        for each patch when a subclass overrides ``__getitem__`` (:mod:`fastdata.reader.overrides`)."""
        if overrides_getitem(type(self)):
            return each_sample(self, indices, epoch_of(indices, self.epoch))
        epoch = epoch_of(indices, self.epoch)
        patches = [self._check_index(i) for i in indices]
        samples = [self.sample_of(p) for p in patches]
        distinct = list(dict.fromkeys(samples))
        wanted = [EpochIndex(distinct[0], epoch)] + distinct[1:] if distinct and epoch is not None else distinct
        get_many = getattr(self.base, "__getitems__", None)
        loaded = get_many(wanted) if callable(get_many) else [self.base[i] for i in wanted]
        by_sample = dict(zip(distinct, loaded, strict=True))
        before = self.skipped
        out = Samples(self._patch_or_replace(p, s, functools.partial(by_sample.__getitem__, s), epoch)
                      for p, s in zip(patches, samples, strict=True))
        out.skips = int(getattr(loaded, "skips", 0)) + self.skipped - before
        out.token = str(getattr(loaded, "token", ""))
        out.ragged = tuple(getattr(loaded, "ragged", ()))
        return out

    def _cut_names(self, sample: Mapping, index: int) -> tuple[str, ...]:
        if self.fields is not None:
            missing = [f for f in self.fields if f not in sample]
            if missing:
                raise KeyError(f"sample {index} has no field {', '.join(map(repr, missing))} to cut (fields: "
                               f"{', '.join(map(str, sample))})")
            return self.fields
        k = len(self.patch_size)
        names = tuple(name for name, value in sample.items()
                      if _is_array_like(value) and value.ndim >= k and name != self.affine_field)
        if not names:
            raise ValueError(f"sample {index} has no array field with at least {k} axes to cut (patch_size "
                             f"{self.patch_size}); its fields: {', '.join(map(str, sample))}")
        return names

    def _checked_shape(self, sample: Mapping, index: int, names: tuple[str, ...]) -> tuple[int, ...]:
        """The sample's leading sizes; every cut field (and the weight field) must agree on the cut
        axes."""
        k = len(self.patch_size)
        reference = self.weight_field if self.weight_field is not None else names[0]
        checked = names if reference in names else (reference, *names)
        shapes = {}
        for name in checked:
            shapes[name] = self._leading_shape(sample, index, name)
        cut = {name: tuple(shape[j] for j in self.cut_axes) for name, shape in shapes.items()}
        if len(set(cut.values())) > 1:
            listing = ", ".join(f"{name} {tuple(getattr(sample[name], 'shape', ()))}" for name in checked)
            raise ValueError(f"sample {index}: the fields cut together differ in size on the cut axes "
                             f"{self.cut_axes} ({listing}); they must match (resample them, or cut one with "
                             "fields=)")
        shape = shapes[reference]
        known = self._shapes[index]
        laid_out = tuple(int(known[j]) for j in self.cut_axes)
        if self.sampler == "grid" and laid_out != cut[reference]:
            raise ValueError(f"sample {index}: field {reference!r} has shape {shape[:k]} but the grid was laid out "
                             f"for {tuple(int(s) for s in known)} (from base.array_shapes or an earlier read); the "
                             "base changed: build the PatchDataset again")
        if known[0] < 0:
            self._shapes[index] = shape
        return shape

    def _patch(self, p: int, index: int, sample: Mapping, epoch: int | None) -> Any:
        for key in (SAMPLE_KEY, POSITION_KEY):
            if key in sample:
                raise ValueError(f"sample {index} already has a field {key!r}, which PatchDataset adds to each patch; "
                                 "rename it in the base's transform")
        names = self._cut_names(sample, index)
        shape = self._checked_shape(sample, index, names)
        extent = self._extent(shape)
        for j in self.cut_axes:
            if shape[j] < extent[j] and self.pad_value is None:
                self._too_small(index, names[0], j, shape[j], int(extent[j]))
        start = self._start(p, index, sample, shape, extent, epoch)
        if isinstance(self.dtype, dict):
            uncut = [name for name in self.dtype if name not in names]
            if uncut:
                raise ValueError(f"sample {index}: dtype names {', '.join(map(repr, uncut))}, which this sample does "
                                 f"not cut (it cuts {', '.join(names)})")
        as_tensors = self.output != "numpy"
        affine = None
        item: dict[str, Any] = {}
        for name, value in sample.items():
            if name in names:
                item[name] = self._shaped(self._cut(value, name, start, extent, shape), name, index)
            elif name == self.affine_field:
                affine = self._patch_affine(value, index, start)
                item[name] = torch.from_numpy(affine) if as_tensors else affine
            else:
                item[name] = value
        if self.output == "tensor":
            for name in names:
                item[name] = torch.from_numpy(item[name])
        elif self.output == "monai":
            self._as_meta_tensors(item, names, index, affine)
        item[SAMPLE_KEY] = index
        position = start.astype(np.int64)
        item[POSITION_KEY] = torch.from_numpy(position) if as_tensors else position
        return self.transform(item) if self.transform is not None else item

    def _shaped(self, region: np.ndarray, name: str, index: int) -> np.ndarray:
        """A cut region with ``channel_first`` and ``dtype`` applied, C-contiguous (one copy at most)."""
        if self.channel_first:
            rest = region.ndim - len(self.patch_size)
            if rest == 0:
                region = region[None]
            elif rest == 1:
                region = np.moveaxis(region, -1, 0)
            else:
                raise ValueError(f"sample {index}: field {name!r} has {rest} axes after the {len(self.patch_size)} of "
                                 f"patch_size {self.patch_size}; channel_first moves at most one (the channels) "
                                 "to the front")
        dtype = self.dtype.get(name) if isinstance(self.dtype, dict) else self.dtype
        return np.ascontiguousarray(region, dtype=dtype)

    def _spatial_axes(self) -> int:
        """The first spatial axis of a sample: after ``patch_size``'s leading ``None`` entries (channels)."""
        lead = 0
        while self.patch_size[lead] is None:
            lead += 1
        return lead

    def _patch_affine(self, value: Any, index: int, start: np.ndarray) -> np.ndarray:
        """The sample's affine moved to the patch: ``affine @ T(start)`` (see ``affine_field``)."""
        affine = _as_numpy(value)
        if (affine.ndim != 2 or affine.shape[0] != affine.shape[1] or affine.shape[0] < 2
                or affine.dtype.kind not in "iuf"):
            raise ValueError(f"sample {index}: field {self.affine_field!r} is taken as the affine (affine_field) but "
                             f"is a {affine.dtype} array of shape {affine.shape}, not a square (d + 1) x (d + 1) "
                             "matrix; pass affine_field=None (or the affine's name)")
        d = affine.shape[0] - 1
        lead = self._spatial_axes()
        shift = np.zeros(d, dtype=np.float64)
        spatial = start[lead:lead + d]
        shift[:len(spatial)] = spatial
        translation = np.eye(d + 1, dtype=np.float64)
        translation[:d, d] = shift
        return affine.astype(np.float64) @ translation

    def _as_meta_tensors(self, item: dict[str, Any], names: Sequence[str], index: int,
                         affine: np.ndarray | None) -> None:
        """The cut fields of ``item`` as MONAI MetaTensors (``output="monai"``)."""
        meta_tensor = _meta_tensor_class()
        relpath = getattr(self.base, "relpath", None)
        filename = relpath(index) if callable(relpath) else None
        for name in names:
            region = item[name]
            meta: dict[str, Any] = {}
            if filename:
                meta["filename_or_obj"] = filename
            # where MONAI's EnsureChannelFirst finds the channels (as its image loader records them)
            rest = region.ndim - len(self.patch_size)
            meta["original_channel_dim"] = (0 if self.channel_first or self.patch_size[0] is None
                                            else "no_channel" if rest == 0 else -1)
            item[name] = meta_tensor(torch.from_numpy(region), meta=meta,
                                     affine=None if affine is None else torch.from_numpy(affine.copy()))

    def _cut(self, value: Any, name: str, start: np.ndarray, extent: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        """The region ``[start, start + extent)`` of ``value`` on the leading axes (its other axes
        whole), padded where it leaves the sample; a lazy array reads only that region."""
        key, pads = [], []
        for a, e, s in zip(start.tolist(), extent.tolist(), shape, strict=True):
            lo, hi = max(a, 0), min(a + e, s)
            key.append(slice(lo, hi))
            pads.append((lo - a, a + e - hi))
        rest = value.ndim - len(key)
        region = _as_numpy(value[tuple(key) + (slice(None),) * rest])
        if not region.flags.owndata:
            region = region.copy()  # a view of the base's array: the patch must not alias (or pin) it
        if any(before or after for before, after in pads):
            assert self.pad_value is not None  # checked before the start was chosen
            fill = self.pad_value.get(name) if isinstance(self.pad_value, dict) else self.pad_value
            if fill is None:
                raise ValueError(f"pad_value names no value for field {name!r}, which needs padding "
                                 f"(pad_value={self.pad_value!r})")
            region = np.pad(region, pads + [(0, 0)] * rest, constant_values=_pad_fill(fill, region.dtype, name))
        return region

    # -- positions --------------------------------------------------------------------------
    def _rng(self, p: int, epoch: int | None) -> np.random.Generator:
        # ``seed`` is a public attribute (fastdata.loader sets it): the derived key follows it
        if self._patch_key[0] != self.seed:
            derived = np.random.SeedSequence([self.seed & _U64, _TAG_PATCH]).generate_state(1, np.uint64)[0]
            self._patch_key = (self.seed, int(derived))
        return sample_rng(self._patch_key[1], 0 if epoch is None else epoch, p)

    def _start(self, p: int, index: int, sample: Mapping, shape: Sequence[int], extent: np.ndarray,
               epoch: int | None) -> np.ndarray:
        size = np.asarray(shape, dtype=np.int64)
        # an axis shorter than the patch (padded): the sample centred in the patch, whatever the sampler
        centred = (size - extent) // 2
        room = size - extent  # the largest start keeping the patch inside, on axes long enough
        if self.sampler == "grid":
            local = p - int(self.patch_starts[index])
            tile = np.array(np.unravel_index(local, tuple(self._tile_counts[index].tolist())), dtype=np.int64)
            assert self.overlap is not None
            step = np.maximum(extent - np.array(self.overlap), 1)
            start = np.minimum(tile * step, room)
        elif self.sampler == "uniform":
            start = self._rng(p, epoch).integers(0, np.maximum(room, 0) + 1)
        else:
            centre = self._weighted_centre(self._rng(p, epoch), index, sample, shape)
            start = np.clip(centre - extent // 2, 0, np.maximum(room, 0))
        start = np.where(room < 0, centred, start)
        start[[j for j, q in enumerate(self.patch_size) if q is None]] = 0
        return start.astype(np.int64)

    # -- weighted ---------------------------------------------------------------------------
    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"fastdata: {message} (said once per process)", RuntimeWarning, stacklevel=5)

    def _weights(self, region: Any) -> np.ndarray:
        """A region of the weight field as one value per voxel of the cut axes: max over the others."""
        values = _as_numpy(region)
        others = tuple(j for j in range(values.ndim) if j not in self.cut_axes)
        if others:
            values = values.max(axis=others)
        if self.pos_ratio is not None:
            return values > 0
        if values.dtype.kind not in "biuf":
            raise ValueError(f"weight_field {self.weight_field!r} holds {values.dtype} values, not numbers")
        return values

    def _cell_of(self, array: Any, spatial: tuple[int, ...]) -> tuple[int, ...]:
        if self.cell_size is not None:
            return self.cell_size
        chunks = getattr(array, "chunks", None)
        if isinstance(chunks, tuple) and len(chunks) >= len(self.patch_size) and all(_is_int(c) for c in chunks):
            return tuple(max(1, int(chunks[j])) for j in self.cut_axes)
        patch = self.patch_size
        return tuple(min(int(patch[j] or 1), max(1, s)) for j, s in zip(self.cut_axes, spatial, strict=True))

    def _foreground_map(self, index: int, array: Any, shape: Sequence[int]) -> _ForegroundMap:
        """Sample ``index``'s coarse map, from the cache or built now by reading the weight field
        once, in blocks of whole cells of at most :data:`MAP_BLOCK_ELEMENTS` elements."""
        cached = self._maps.get(index)
        spatial = tuple(int(shape[j]) for j in self.cut_axes)
        if cached is not None and cached.spatial == spatial:
            self._maps.move_to_end(index)
            return cached
        cell = self._cell_of(array, spatial)
        grid = tuple(-(-s // c) for s, c in zip(spatial, cell, strict=True))
        label = self.pos_ratio is not None
        sums = np.zeros(grid, dtype=np.int64 if label else np.float64)
        others = math.prod(int(s) for j, s in enumerate(array.shape) if j not in self.cut_axes)
        # cells per block on each cut axis: grow from the last axis (contiguous in C order) while it fits
        per_block, elements = [1] * len(grid), math.prod(cell) * others
        for a in reversed(range(len(grid))):
            factor = min(grid[a], max(1, MAP_BLOCK_ELEMENTS // elements))
            per_block[a], elements = factor, elements * factor
            if factor < grid[a]:
                break
        blocks = tuple(-(-g // b) for g, b in zip(grid, per_block, strict=True))
        for block in np.ndindex(*blocks):
            first = [b * n for b, n in zip(block, per_block, strict=True)]  # first cell of the block
            cells = [slice(f, min(f + n, g)) for f, n, g in zip(first, per_block, grid, strict=True)]
            region = self._weights(array[self._region_key(array, [
                slice(c.start * e, min(c.stop * e, s)) for c, e, s in zip(cells, cell, spatial, strict=True)])])
            if not label and (region < 0).any():
                raise ValueError(f"sample {index}: weight_field {self.weight_field!r} has negative weights")
            block_sums = region.astype(sums.dtype)
            for a, e in enumerate(cell):
                block_sums = np.add.reduceat(block_sums, np.arange(0, block_sums.shape[a], e), axis=a)
            sums[tuple(cells)] = block_sums
        flat = sums.ravel()
        negative = None
        if label:
            sizes = np.ones(grid, dtype=np.int64)
            for a, (e, s, g) in enumerate(zip(cell, spatial, grid, strict=True)):
                along = np.full(g, e, dtype=np.int64)
                along[-1] = s - e * (g - 1)
                sizes = sizes * along.reshape([-1 if b == a else 1 for b in range(len(grid))])
            negative = np.cumsum(sizes.ravel() - flat)
        entry = _ForegroundMap(spatial, cell, grid, np.cumsum(flat), negative)
        self._maps[index] = entry
        while len(self._maps) > self.map_cache_size:
            self._maps.popitem(last=False)
        return entry

    def _region_key(self, array: Any, cut: Sequence[slice]) -> tuple[slice, ...]:
        """The full index of ``array`` taking ``cut`` on the cut axes and every other axis whole."""
        key = [slice(None)] * array.ndim
        for j, s in zip(self.cut_axes, cut, strict=True):
            key[j] = s
        return tuple(key)

    def _weighted_centre(self, rng: np.random.Generator, index: int, sample: Mapping,
                         shape: Sequence[int]) -> np.ndarray:
        assert self.weight_field is not None
        array = sample[self.weight_field]
        fmap = self._foreground_map(index, array, shape)
        want_positive = True
        cumulative = fmap.positive
        if self.pos_ratio is not None:
            assert fmap.negative is not None
            want_positive = bool(rng.random() < self.pos_ratio)
            if want_positive and fmap.positive[-1] == 0:
                self._warn_once("no-positive", f"sample {index} has no voxel > 0 in {self.weight_field!r}: its "
                                "patches are centred on non-positive voxels (as are those of any other such sample)")
                want_positive = False
            elif not want_positive and fmap.negative[-1] == 0:
                self._warn_once("no-negative", f"sample {index} has no voxel <= 0 in {self.weight_field!r}: its "
                                "patches are centred on positive voxels (as are those of any other such sample)")
                want_positive = True
            cumulative = fmap.positive if want_positive else fmap.negative
            cell = int(np.searchsorted(cumulative, rng.integers(cumulative[-1]), side="right"))
        elif fmap.positive[-1] > 0:
            cell = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
            cell = min(cell, int(np.searchsorted(cumulative, cumulative[-1], side="left")))  # rounding at the top
        else:
            self._warn_once("zero-weights", f"sample {index} has only zero weights in {self.weight_field!r}: its "
                            "patches are centred uniformly (as are those of any other such sample)")
            cell = int(rng.integers(len(cumulative)))
        corner = np.array(np.unravel_index(cell, fmap.grid), dtype=np.int64) * np.array(fmap.cell)
        cut = [slice(int(c), min(int(c) + e, s)) for c, e, s in zip(corner, fmap.cell, fmap.spatial, strict=True)]
        values = self._weights(array[self._region_key(array, cut)])
        if self.pos_ratio is not None:
            chosen = np.flatnonzero(values.ravel() if want_positive else ~values.ravel())
            if not len(chosen):
                raise ValueError(f"sample {index}: a cell of {self.weight_field!r} no longer holds the voxels its "
                                 "foreground map counted; the base changed under this process")
            flat = int(chosen[rng.integers(len(chosen))])
        elif fmap.positive[-1] > 0:
            weights = np.cumsum(values.ravel().astype(np.float64))
            flat = int(np.searchsorted(weights, rng.random() * weights[-1], side="right"))
            flat = min(flat, int(np.searchsorted(weights, weights[-1], side="left")))
        else:
            flat = int(rng.integers(values.size))
        local = np.array(np.unravel_index(flat, values.shape), dtype=np.int64)
        centre = np.zeros(len(self.patch_size), dtype=np.int64)
        centre[list(self.cut_axes)] = corner + local
        return centre

    # -- stitching, pickling, repr ------------------------------------------------------------
    def stitcher(self, sample: int, *, dtype: Any = np.float64, channels_first: bool = False) -> Stitcher:
        """A :class:`Stitcher` for sample ``sample``'s patches (its sizes on the cut axes; the other
        axes take the tiles' own extents).

        Args:
            sample: a base index.
            dtype: the accumulator's dtype (float64; float32 halves the memory).
            channels_first: the tiles to add have a leading channel axis before the patch's axes
                (a model's CxDxHxW output), which the result keeps first.

        Returns:
            Stitcher: add each tile's output with its ``position``, then call ``result()``.
        """
        shape = self.spatial_shape(sample)
        return Stitcher(tuple(s if p is not None else None for s, p in zip(shape, self.patch_size, strict=True)),
                        dtype=dtype, channels_first=channels_first)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # a per-process cache: rebuilt where it is used
        state["_warned"] = set()
        state["_patch_key"] = (None, 0)
        return state

    def __repr__(self) -> str:
        lines = [f"Number of patches: {len(self)}", f"Samples: {self._n}", f"Patch size: {self.patch_size}",
                 f"Sampler: {self.sampler}"]
        if self.sampler != "grid":
            lines.append(f"Patches per sample: {self.patches_per_sample}")
        else:
            lines.append(f"Overlap: {self.overlap}")
        if self.weight_field is not None:
            lines.append(f"Weight field: {self.weight_field} (pos_ratio {self.pos_ratio})")
        if self.fields is not None:
            lines.append(f"Fields: {', '.join(self.fields)}")
        if self.pad_value is not None:
            lines.append(f"Pad value: {self.pad_value}")
        if self.channel_first:
            lines.append("Channel first: True")
        if self.dtype is not None:
            lines.append(f"Dtype: {self.dtype}")
        if self.output != "numpy":
            lines.append(f"Output: {self.output}")
        return "\n".join([f"Dataset {type(self).__name__}"] + ["    " + line for line in lines])


class Stitcher:
    """Stitch per-patch outputs back into one array, averaging where patches overlap (MONAI's
    sliding-window averaging, torchio's ``GridAggregator``)::

        out = ds.stitcher(i)
        for batch in loader(Subset(ds, ds.patches_of(i)), shuffle=False):
            out.add_batch(batch["position"], model(batch["image"]))
        volume = out.result()

    Args:
        shape: the result's size on each positioned axis (one per entry of a patch's ``position``);
            ``None``: the tiles' own extent on that axis (it must be the same for every tile). Axes
            of the tiles beyond these are kept whole (their sizes from the first tile).
        dtype: the accumulator's dtype.
        channels_first: tiles carry a leading channel axis before the positioned axes; the result
            keeps it first.

    Memory: the result's size in ``dtype`` plus an int32 count per positioned voxel.
    """

    def __init__(self, shape: Sequence[int | None], *, dtype: Any = np.float64, channels_first: bool = False):
        if not shape or not all(s is None or (_is_int(s) and s >= 0) for s in shape):
            raise ValueError(f"shape must be a non-empty sequence of sizes >= 0 or None, got {shape!r}")
        self.shape: tuple[int | None, ...] = tuple(None if s is None else int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.channels_first = bool(channels_first)
        self._sum: np.ndarray | None = None
        self._count: np.ndarray | None = None

    def add(self, position: Sequence[int] | np.ndarray | torch.Tensor, tile: Any) -> None:
        """Add one patch's output at ``position`` (the item's ``"position"``; parts outside the
        result, padding, are dropped).

        Args:
            position: the patch's start on each positioned axis (may be negative).
            tile: an array or tensor whose leading axes (after the channel axis, with
                ``channels_first``) are the positioned axes.

        Raises:
            ValueError: a position of the wrong length, a tile entirely outside the result, or a tile
                whose other axes differ from the first tile's.
        """
        start = [int(v) for v in _as_numpy(position).reshape(-1).tolist()]
        k = len(self.shape)
        if len(start) != k:
            raise ValueError(f"position {start} has {len(start)} entries; this stitcher positions {k} axes")
        values = _as_numpy(tile)
        if self.channels_first:
            values = np.moveaxis(values, 0, -1)
        if values.ndim < k:
            raise ValueError(f"tile of shape {values.shape} has fewer than the {k} positioned axes")
        if self._sum is None:
            full = tuple(values.shape[j] if s is None else s for j, s in enumerate(self.shape))
            self._sum = np.zeros(full + values.shape[k:], dtype=self.dtype)
            self._count = np.zeros(full, dtype=np.int32)
        assert self._count is not None
        if values.shape[k:] != self._sum.shape[k:]:
            raise ValueError(f"tile of shape {values.shape} does not match the first tile's other axes "
                             f"{self._sum.shape[k:]}")
        target, source = [], []
        for j, (a, e) in enumerate(zip(start, values.shape[:k], strict=False)):
            if self.shape[j] is None and (a != 0 or e != self._sum.shape[j]):
                raise ValueError(f"axis {j} takes the tiles' own extent ({self._sum.shape[j]}); this tile has "
                                 f"{e} at {a}")
            lo, hi = max(a, 0), min(a + e, self._sum.shape[j])
            if hi <= lo:
                raise ValueError(f"tile of shape {values.shape} at {start} lies outside the result "
                                 f"{self._sum.shape[:k]}")
            target.append(slice(lo, hi))
            source.append(slice(lo - a, hi - a))
        self._sum[tuple(target)] += values[tuple(source)]
        self._count[tuple(target)] += 1

    def add_batch(self, positions: Any, tiles: Any) -> None:
        """:meth:`add` for each row of a batch: ``positions`` (B, k), ``tiles`` (B, ...).

        Args:
            positions: a batch's ``"position"`` (array or tensor).
            tiles: the batch's outputs, first axis the batch.
        """
        for position, tile in zip(_as_numpy(positions), _as_numpy(tiles), strict=True):
            self.add(position, tile)

    @property
    def coverage(self) -> np.ndarray:
        """How many tiles covered each positioned voxel so far (int32)."""
        if self._count is None:
            raise ValueError("no tile was added yet")
        return self._count

    def result(self) -> np.ndarray:
        """The average of the tiles added at each voxel.

        Returns:
            np.ndarray: of ``dtype`` (channel axis first with ``channels_first``).

        Raises:
            ValueError: no tile was added, or some voxel was covered by none (a missing tile).
        """
        if self._sum is None or self._count is None:
            raise ValueError("no tile was added yet")
        missing = int((self._count == 0).sum())
        if missing:
            raise ValueError(f"{missing} of {self._count.size} voxels were covered by no tile: add every patch of "
                             "the sample (PatchDataset.patches_of)")
        count = self._count.reshape(self._count.shape + (1,) * (self._sum.ndim - self._count.ndim))
        out = (self._sum / count).astype(self.dtype, copy=False)
        return np.moveaxis(out, -1, 0) if self.channels_first else out


def stitch(dataset: PatchDataset, sample: int, items: Iterable[Mapping[str, Any]], key: str) -> np.ndarray:
    """Stitch field ``key`` of ``items`` (patch dicts of sample ``sample``, e.g. a grid's tiles after
    a per-tile function) into one array, averaging overlaps.

    Args:
        dataset: the PatchDataset the items came from.
        sample: the base index they belong to.
        items: patch dicts holding ``"position"`` and ``key``.
        key: the field to stitch.

    Returns:
        np.ndarray: float64, the sample's sizes on the cut axes.

    Raises:
        ValueError: an item of another sample, or voxels no item covers.
    """
    out = dataset.stitcher(sample)
    for item in items:
        if int(item[SAMPLE_KEY]) != sample:
            raise ValueError(f"an item of sample {int(item[SAMPLE_KEY])} was given to stitch sample {sample}")
        out.add(item[POSITION_KEY], item[key])
    return out.result()
