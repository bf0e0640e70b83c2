"""Map-style Datasets over fastdata stores, correct under any DataLoader setting.

:class:`StoreDataset` reads every store through one record model (:mod:`fastdata.format.legacy`
presents an image-classification store as a general one of schema ``{image, label}``);
:class:`ImageFolderDataset` (``LMDBImageDataset``, ``HDF5ImageDataset``) is the thin layer that
gives ImageFolder's ``(image, target)`` items, ``classes``, ``targets`` and ``samples``.

Rules this module follows (how LMDB, HDF5 and the DataLoader behave under fork/spawn):

* The constructor reads the manifest and each shard's small index into numpy
  arrays, then closes everything it opened: no OS handle survives ``__init__``.
* Shard readers open lazily on first access *in each process* and are cached
  per process id, by :class:`fastdata.reader.shards.ShardHandles`. A dataset used
  in the parent and then forked into workers never touches the parent's handles in
  the child (they are parked, untouched, so not even their destructors run there).
  Pickling drops handles, so spawn/forkserver pickles stay small (metadata arrays
  only, no image data).
* Per-sample attributes are numpy arrays, never Python lists/dicts of objects,
  so forked workers do not copy-on-write the index page by page
  (pytorch/pytorch#13246).
* Every record is checked against its checksum; a bad one raises
  :class:`~fastdata.errors.CorruptRecordError` naming store, shard and index
  (or, with ``on_error="skip"``, is replaced by the next readable sample and
  counted in ``skipped``). Only storage damage counts: a checksum failure, or
  stored bytes that fastdata's own decoders (the default decode, or an instance
  of a class from :mod:`fastdata.reader.transforms`) cannot decode. Exceptions from the
  user's ``decode=`` callable, ``transform`` or ``target_transform`` propagate
  unchanged, whatever ``on_error`` says.
* Random decode-time transforms get a generator that is a pure function of
  ``(seed, epoch, index)`` (:func:`fastdata.reader.seeding.sample_rng`), so the same
  epoch gives the same crops whatever the number of workers, the batch size,
  the start method or the resume point.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fastdata.common.callers import user_stacklevel
from fastdata.common.imageio import decoded_bytes_limit, pixel_limit
from fastdata.common.imagemodes import MODE_CHANNELS, check_mode
from fastdata.errors import CorruptRecordError, FastdataError, FormatError, ImageModeError, StoreChangedError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.format.chunks import ChunkTable, check_shape
from fastdata.format.added import ADDED_FIELDS_KEY
from fastdata.format.fields import Chunked, Float, Image, Int, NDArray, Ragged, Schema
from fastdata.format.legacy import NBYTES, PATH_OFFSETS, PATHS, record_model
from fastdata.format.manifest import target_field
from fastdata.format.record import (
    FIELD_PREFIX,
    FORMAT_NAMES,
    IMAGE_DTYPE_CODES,
    IMAGE_DTYPE_NAMES,
    IMAGE_META,
    NOT_RECORDED,
    chunk_first_key,
    chunk_shape_key,
    index_layout,
)
from fastdata.reader import batch_ring
from fastdata.reader.added import AddedValues
from fastdata.reader import transforms as fd_transforms
from fastdata.reader.batching import WORKER_SKIPS, Batch, Samples, aligned, build_batch, new_segment
from fastdata.reader.chunked import ChunkedArray
from fastdata.reader.decode import decode_numpy, decode_numpy_into, decode_pil, pil_of, squeezed, to_tensor
from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.seeding import epoch_of, reused_sample_rng, sample_rng
from fastdata.reader.shards import ShardHandles
from fastdata.reader.subset import StoreSubset, code_names, read_only
from fastdata.remote.store import StoreLocation, locate_store

OUTPUTS = ("pil", "numpy", "tensor", "bytes")
#: how a field of a sample is read (see :meth:`StoreDataset._field_plan`): an image decoded, an int
#: or float of the index, an array of the index, another index value, an array or a chunk table
#: of the record, another record value; an added field's array, value or image (from its field file)
(_IMAGE, _SCALAR, _INDEX_ARRAY, _INDEX_VALUE, _RECORD_ARRAY, _CHUNKED, _RECORD_VALUE, _ADDED_ARRAY,
 _ADDED_VALUE, _ADDED_IMAGE, _ADDED_CHUNKED) = range(11)
#: the columns of :class:`ImageFolderDataset` (ImageFolder-like stores), in this order
CLASSIFICATION_COLUMNS = ("label", "width", "height", "channels", "dtype", "format", "nbytes")


#: guards the skip counters of every dataset in this process (thread workers count from several threads)
_SKIP_LOCK = threading.Lock()


class ImagesReducedWarning(UserWarning):
    """A store's images are deeper than 8 bits or have more bands than the dataset's default Pillow
    mode (``"RGB"`` for the field ``image``) can represent, so that mode loses data;
    ``image_mode="unchanged"`` reads them as stored. Not for what ImageFolder's ``convert("RGB")``
    does silently (CMYK converted, an alpha channel dropped). Points at the caller's line."""


#: records at least this large (mean) span several pages: read ahead whatever the store's size
READAHEAD_RECORD_BYTES = 16 << 10


def machine_memory() -> int:
    """This machine's physical memory in bytes, or the cgroup (v2) limit of this container
    when lower: what :func:`wants_readahead` compares a store's size with."""
    import psutil

    total = int(psutil.virtual_memory().total)
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def wants_readahead(manifest: Mapping[str, Any], memory_bytes: int | None = None) -> bool:
    """Whether LMDB readers of this store let the OS read ahead (the default of
    ``readahead=None``).

    py-lmdb touches every page of a value inside ``get`` (its "preload"), so the pages of
    a cold record are faulted in one by one; without readahead (LMDB's ``MADV_RANDOM``)
    each fault is one synchronous 4 KiB read: a 60 KB image is 15 of them, and advice
    given after ``get`` comes too late. With readahead the first fault brings in the
    record and its neighbours, which a store that fits in memory reads later anyway.
    Off only where it costs: small records (one or two pages each) in a store larger than
    half the memory, where the neighbours would push out pages that are still wanted.

    Args:
        manifest: the store's manifest (its shards' ``bytes`` and ``count``).
        memory_bytes: the machine's memory; None = measured (cgroup limit included).

    Returns:
        bool: True to open LMDB environments with ``readahead=True``.
    """
    shards = manifest.get("shards") or []
    store_bytes = sum(int(s.get("bytes", 0)) for s in shards)
    records = sum(int(s.get("count", 0)) for s in shards)
    if records and store_bytes / records >= READAHEAD_RECORD_BYTES:
        return True
    memory = machine_memory() if memory_bytes is None else memory_bytes
    return store_bytes <= memory // 2


def _is_fastdata_decoder(decode: Callable) -> bool:
    """Whether ``decode`` is fastdata's own code: an instance of a class defined in
    :mod:`fastdata.reader.transforms` (not a subclass defined elsewhere) or a function
    defined there (``full_decode``). Its failures on stored bytes mean damage."""
    module = decode.__module__ if inspect.isfunction(decode) else type(decode).__module__
    return module == fd_transforms.__name__


class StoreDataset(Dataset):
    """Any fastdata store as a map-style Dataset; :func:`fastdata.open_dataset` opens each store
    with the presentation it was written for.

    ``ds[i]`` is a dict of the stored fields in schema order: image fields decoded per
    ``output`` (``"pil"``, ``"numpy"`` HWC, ``"tensor"`` CHW), ints and floats as Python scalars,
    fixed-shape and ragged arrays as numpy arrays (tensors with ``output="tensor"``), strings and
    JSON values as written, chunked fields as lazy :class:`~fastdata.reader.chunked.ChunkedArray`
    objects that read a region's chunks when indexed. ``transform`` receives that dict. An
    image-classification store reads as ``{"image": ..., "label": int}``
    (:class:`ImageFolderDataset` gives ImageFolder's ``(image, target)`` instead).
    """

    backend: str = ""
    #: applied to the target by the presentations that have one (ImageFolder's, CocoDetection's)
    target_transform: Callable | None = None

    def __init__(
        self,
        path: str | os.PathLike | StoreLocation,
        transform: Callable | None = None,
        output: str = "pil",
        decode: Callable | None = None,
        *,
        on_error: str = "raise",
        readahead: bool | None = None,
        seed: int | None = None,
        image_mode: str | Mapping[str, str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        max_open_shards: int | None = None,
        cache: str = "shards",
    ):
        """Open the store's metadata.

        Args:
            path: a store directory written by fastdata, or its URL (``s3://bucket/train.lmdb``,
                ``gs://``, ``az://``, ``https://``): a remote store's shards are downloaded whole
                on first use into a shared local cache, checked against the manifest's checksums
                (see :mod:`fastdata.remote`).
            transform: called with each sample (after decoding); its result is returned.
            output: ``"pil"`` (a PIL image), ``"numpy"`` (HWC array; HxW for a one-channel
                image outside ``"RGB"`` mode) or ``"tensor"`` (CHW ``torch.Tensor``, and array
                fields as tensors), in the image mode's dtype (uint8 except ``"unchanged"``); or
                ``"bytes"``: each image's stored bytes (JPEG, PNG, ... as written), not decoded,
                for a consumer that decodes them itself (not with ``decode=`` or a store of raw pixels).
            decode: a decode-time transform (``fastdata.reader.transforms``) mapping encoded
                bytes to an HWC uint8 array; ``None`` = full decode. Any other callable
                ``decode(bytes) -> array`` is user code: its exceptions propagate unchanged.
                Refused when the schema holds anything but images and index scalars, since a
                fused crop would move the image but not, e.g., its boxes.
            on_error: ``"raise"`` (default) or ``"skip"``: replace a damaged record
                (checksum failure, or stored bytes fastdata's decoders cannot decode)
                by the next readable sample, warn, and count it in :attr:`skipped`.
            readahead: let the OS read ahead of each page fault in an LMDB shard's map.
                ``None`` (default) decides from the manifest (see :func:`wants_readahead`):
                on unless the records are small and the store is larger than half the
                machine's memory (then each read fetching its neighbours would only
                crowd the page cache). HDF5 shards ignore it (their reads are advised
                per batch). LMDB allows one environment per file per process, so when two
                datasets of one process open the same shard, the first one's setting holds.
            seed: seed of the per-sample random streams of ``decode`` transforms
                (see :meth:`set_epoch`); ``None`` = ``torch.initial_seed()`` of the
                process creating the dataset (``fastdata.loader(seed=...)`` overrides it).
            image_mode: how images are decoded (see :mod:`fastdata.common.imagemodes`): ``"RGB"``
                (ImageFolder's ``convert("RGB")``: 8-bit RGB, a 16-bit image reduced as Pillow does),
                ``"L"``, ``"RGBA"``, or ``"unchanged"`` (the stored dtype and channels: uint16,
                float32, 1-N channels). A str applies to every image field, a dict maps field
                names to modes. None: the store's recorded default (a general store's
                ``Image(mode=...)``), else ``"RGB"`` for the field named ``image`` and
                ``"unchanged"`` for any other image field (a mask comes back as stored). Reading a
                store of images deeper than 8 bits or of more than 4 bands in a default Pillow mode
                warns once (:class:`ImagesReducedWarning`; CMYK and alpha do not count, as for
                ImageFolder).
            storage_options: fsspec options of a remote store (endpoint, credentials...);
                the standard environment variables (``AWS_ENDPOINT_URL``...) work too.
            cache_dir: cache directory of a remote store's shards (default
                ``$FASTDATA_CACHE_DIR`` or ``~/.cache/fastdata``), shared by every process.
            cache_limit: most bytes that cache holds (an int or ``"50GiB"``); None = no limit.
            cache: how a remote store is read: ``"shards"`` (default: each shard downloaded whole
                into the cache on first use, the way to train) or ``"records"`` (each record read
                with a ranged request for its bytes, checked against its checksum, nothing written
                to the cache: for a few samples of a large store, e.g. evaluation, debugging, a
                notebook; see :mod:`fastdata.remote.records`). No effect on a local store.
            max_open_shards: shards each process keeps open (and pinned in the cache) at once;
                the least recently used one is closed beyond it. None = all for a local
                store, 4 for a remote one (fewer under a ``cache_limit`` that could not hold
                4 of the largest shards for every DataLoader worker and local rank; at least 1).
        """
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError("on_error must be 'raise' or 'skip'")
        store = path if isinstance(path, StoreLocation) else locate_store(
            path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit, cache=cache)
        self._store = store
        #: the store's directory, or its URL
        self.root = store.root
        manifest = store.manifest
        if self.backend and manifest["backend"] != self.backend:
            raise FormatError(f"{self.root} is a {manifest['backend']} store; open it with open_dataset() "
                              f"or the matching class")
        self.backend = manifest["backend"]
        self.storage = StorageSpec.from_json(manifest["storage"])
        if decode is not None and self.storage.mode.holds_fixed_size_pixels:
            raise ValueError(f"{self.root} stores raw pixels; decode-time transforms need encoded images")
        if output == "bytes" and (decode is not None or self.storage.mode.holds_fixed_size_pixels):
            raise ValueError(f"{self.root}: output='bytes' gives each image's encoded bytes, not decoded: "
                             + ("leave out decode=" if decode is not None else
                                "this store keeps raw pixels (use output='numpy')"))
        self.transform = transform
        self.output = output
        self.decode = decode
        # fastdata's own decoders: their failures on stored bytes mean a damaged record
        self._decode_is_ours = decode is None or _is_fastdata_decoder(decode)
        # DecodeTransform promises an ``rng`` argument: it gets the per-sample stream, except
        # fastdata's deterministic ones (a generator costs ~15 us a sample for nothing there)
        self._decode_takes_rng = isinstance(decode, fd_transforms.DecodeTransform) and type(decode) not in (
            fd_transforms.CenterCrop, fd_transforms.Resize)
        self.seed = int(torch.initial_seed() if seed is None else seed)
        #: epoch of the per-sample crop streams; None until set_epoch: unkeyed per-process streams
        self.epoch: int | None = None
        self.on_error = on_error
        # how this store's shards and records are read into the one model: chosen once, here
        self._records = record_model(manifest, self.root)
        #: the values of fields added to the store after it was written (``fastdata.add_fields``)
        self._added = AddedValues(store, manifest, self.root) if ADDED_FIELDS_KEY in manifest else None
        #: the fields every sample has (an image-classification store: ``image`` and ``label``),
        #: then the fields added to it since, in the order they were added
        self.schema = self._records.schema if self._added is None else Schema(
            self._records.schema.fields + tuple((a.name, a.field) for a in self._added.fields))
        self._ragged_fields = tuple(name for name, f in self.schema if isinstance(f, Ragged))
        # (an added field is never an image's geometry, unless it is a ragged array such as boxes)
        others = [name for name, f in self.schema if not isinstance(f, Image | Int | Float)
                  and (name in self._records.schema or isinstance(f, Ragged))]
        if decode is not None and others:
            raise ValueError(
                f"{self.root}: decode= is refused for a store with fields {', '.join(others)}: a fused crop "
                "would move the image but not its boxes: use transform= with torchvision.transforms.v2")
        self.classes: list[str] = list(manifest["classes"])
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._shard_files: tuple[str, ...] = tuple(s["name"] for s in manifest["shards"])
        self.shard_starts = np.array([s["first_index"] for s in manifest["shards"]], dtype=np.int64)
        self._load_index(manifest)
        #: the read mode of each image field (see ``image_mode=``)
        self.image_modes: dict[str, str] = self._resolve_modes(image_mode)
        self._warn_if_reduced(chosen=self.image_modes if isinstance(image_mode, str) else (image_mode or {}))
        #: ``(first sample, source)`` of each conversion that wrote the shards: the first, then each append
        self._sources = _source_spans(manifest)
        self._shards = ShardHandles(store, self.backend, self.storage, schema=self._records.reader_schema,
                                    max_open=max_open_shards,
                                    readahead=wants_readahead(manifest) if readahead is None else bool(readahead))
        store.slim()
        self._samples: list[tuple[str, int]] | None = None
        self._skips = 0
        # names this dataset's skip count in the main process (shared with its worker copies)
        self._token = os.urandom(8).hex()

    # -- epochs and counters ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose random crops the next reads use.

        From then on, the generator a random ``decode`` transform draws from for sample
        ``i`` is :func:`fastdata.reader.seeding.sample_rng` ``(self.seed, epoch, i)``, so crops
        depend on nothing else (not on workers, batch size, start method or resume point).
        Until an epoch is set (by this call or by indices that carry one), crops come from
        :func:`fastdata.reader.seeding.get_rng`, a per-process stream: random in every epoch, as
        with torchvision, but not reproducible.
        :class:`~fastdata.DistributedShardSampler` ``.set_epoch`` and each new iteration of
        :func:`fastdata.loader` call this for you. Worker processes learn the epoch from the
        indices they are given (:func:`fastdata.loader` tags each batch's first index, a
        :class:`fastdata.reader.seeding.EpochIndex`); with plain int indices they use their own copy
        of ``epoch``, which is only current if the workers were started after this call
        (another DataLoader with ``persistent_workers=False``).

        Args:
            epoch (int): a non-negative epoch number.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = int(epoch)

    @property
    def skipped(self) -> int:
        """Damaged samples replaced so far under ``on_error="skip"``.

        Counts the skips made in this process plus those made in DataLoader workers
        for batches the main process has received, when the loader's ``collate_fn`` is
        :func:`fastdata.collate` (the default of :func:`fastdata.loader`), which carries
        each batch's count along with it. A batch is counted when it arrives, which with
        prefetching can be a little before the training loop sees it.
        """
        return self._skips + WORKER_SKIPS.get(self._token, 0)

    # -- ImageFolder attributes -------------------------------------------------------------
    @property
    def samples(self) -> list[tuple[str, int]]:
        """``[(path, target), ...]`` as ImageFolder's ``samples``, built on first access.

        Paths are the absolute source paths recorded at conversion (the source folder,
        or the list file's folder for a CSV/TSV list, joined with each record's stored
        path); they need not exist on this machine. A store whose manifest records no
        source gives the stored paths, relative to the converted root (:meth:`relpath`).
        The list is never pickled: spawned workers do not receive it (forked ones inherit
        it only if it was built before they started).
        """
        if self._samples is None:
            targets = self.targets.tolist()
            ends = [start for start, _ in self._sources[1:]] + [len(targets)]
            samples: list[tuple[str, int]] = []
            for (start, source), end in zip(self._sources, ends, strict=True):  # an append's records: its source
                base = _source_base(source)
                samples += [(os.path.join(base, self.relpath(i)) if base else self.relpath(i), int(targets[i]))
                            for i in range(start, end)]
            self._samples = samples
        return self._samples

    @property
    def imgs(self) -> list[tuple[str, int]]:
        """Alias of :attr:`samples`, as in ImageFolder."""
        return self.samples

    def _repr_lines(self) -> list[str]:
        lines = [f"Backend: {self.backend}", f"Output: {self.output}"]
        if any(mode != "RGB" for mode in self.image_modes.values()):
            lines.append("Image mode: " + ", ".join(f"{k}={v}" for k, v in self.image_modes.items()))
        if self.decode is not None:
            lines.append(f"Decode: {self.decode!r}")
        if self.on_error != "raise":
            lines.append(f"On error: {self.on_error}")
        return lines

    def extra_repr(self) -> str:
        """Lines :meth:`__repr__` adds after the root, as torchvision's ``extra_repr``."""
        return "\n".join(self._repr_lines() + ["Fields: " + ", ".join(f"{n} ({f.kind})" for n, f in self.schema)])

    def __repr__(self) -> str:
        """torchvision's ``VisionDataset`` layout: name, size, root, extras, transforms."""
        body = [f"Number of datapoints: {len(self)}", f"Root location: {self.root}"]
        body += self.extra_repr().splitlines()
        if self.transform is not None or self.target_transform is not None:
            body.append(_standard_transform_repr(self.transform, self.target_transform))
        return "\n".join([f"Dataset {type(self).__name__}"] + ["    " + line for line in body])

    # -- metadata ---------------------------------------------------------------------------
    def _load_index(self, manifest: dict) -> None:
        """Every shard's index, concatenated into :attr:`index_arrays` (keyed as a general
        index, whatever the store's record model), the stored paths, and the targets."""
        parts: dict[str, list[np.ndarray]] = {}
        paths, path_offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        indexes = self._store.shard_indexes(reader_class(self.backend), self.storage, self._records.reader_schema)
        for shard, index in zip(manifest["shards"], indexes, strict=True):
            if len(index) != shard["count"]:
                raise CorruptRecordError(f"{self.root}/{shard['name']}: holds {len(index)} records, the manifest "
                                         f"says {shard['count']}; run 'fastdata verify'", store=self.root,
                                         shard=shard["name"])
            arrays = self._records.shard_arrays(index, shard, self.root)
            for key, arr in arrays.items():
                if key not in (PATHS, PATH_OFFSETS):
                    parts.setdefault(key, []).append(arr)
            paths.append(arrays[PATHS])
            path_offsets.append(arrays[PATH_OFFSETS][1:] + base)
            base += len(arrays[PATHS])
        self._count = int(manifest["num_samples"])
        #: index-resident arrays by key (``fields/<name>``, ``fields/<image>.format``, ...)
        self.index_arrays = {key: np.concatenate(arrs) for key, arrs in parts.items()}
        if not parts:  # a store without shards: its fields' arrays, empty
            self.index_arrays = {key: np.zeros((0, *shape), dtype=dtype) for key, (dtype, shape)
                                 in index_layout(self.schema).items() if key.startswith(FIELD_PREFIX)}
        if self._added is not None:  # fixed-size added fields: index columns like the written ones
            self.index_arrays.update({FIELD_PREFIX + name: arr for name, arr in self._added.arrays.items()})
        if any(len(arr) != self._count for arr in self.index_arrays.values()):
            raise CorruptRecordError(f"{self.root}: index disagrees with the manifest; run 'fastdata verify'",
                                     store=self.root)
        self._relpaths = np.concatenate(paths).astype(np.uint8) if paths else np.zeros(0, dtype=np.uint8)
        self._relpath_offsets = np.concatenate(path_offsets).astype(np.int64)
        #: field name -> class names, for each class field (``classes`` is the targets' table)
        self.class_tables: dict[str, list[str]] = self._records.class_tables
        target = target_field(self.schema, self.class_tables)
        #: the class field whose indices are :attr:`targets` (None: the store has none)
        self.target_field = target
        #: ImageFolder's ``targets`` (one label per sample, same values) as a read-only int64 numpy array, not a
        #: list: indexable, iterable and ``len()`` alike, but a list of Python ints would be copied into every
        #: forked DataLoader worker page by page as reference counts touch it. Not a list in that ``==`` compares
        #: elementwise, ``+`` adds, there is no ``.count``/``.index``, and JSON needs ``targets.tolist()``. Empty
        #: when the store has no single-label class field
        self.targets = read_only(self.index_arrays[FIELD_PREFIX + target].astype(np.int64) if target is not None
                                 else np.zeros(0, dtype=np.int64))
        self._records.check_targets(self.targets, manifest, self.root)
        #: per image field: (dtype codes, channel counts) from the index (0: not recorded, an older store)
        self._pixel_meta = {name: (self.index_arrays[f"{FIELD_PREFIX}{name}.dtype"],
                                   self.index_arrays[f"{FIELD_PREFIX}{name}.channels"])
                            for name in self.schema.image_fields()}
        #: (H, W) when every stored image has the same size (e.g. CIFAR-like data), else None; set by the
        #: presentations whose batches stack images (:class:`ImageFolderDataset`)
        self.uniform_shape: tuple[int, int] | None = None
        self._plan = self._field_plan()

    def _resolve_modes(self, image_mode: str | Mapping[str, str] | None) -> dict[str, str]:
        names = self.schema.image_fields()
        added = {a.name: a.field for a in self._added.fields if isinstance(a.field, Image)} if self._added else {}
        modes = {name: added[name].default_mode(name) if name in added  # (an added image: its declared mode)
                 else self._records.default_mode(name, self.root) for name in names}
        if isinstance(image_mode, str):
            check_mode(image_mode)
            return dict.fromkeys(names, image_mode)
        if isinstance(image_mode, Mapping):
            unknown = [k for k in image_mode if k not in names]
            if unknown:
                raise ValueError(f"image_mode names {', '.join(map(repr, unknown))}, which are not image fields of "
                                 f"{self.root} (image fields: {', '.join(names) or 'none'})")
            for name, mode in image_mode.items():
                modes[name] = check_mode(mode, f"image_mode[{name!r}]")
        elif image_mode is not None:
            raise ValueError(f"image_mode must be a str, a dict of field -> mode, or None; got {image_mode!r:.60}")
        return modes

    @property
    def image_mode(self) -> str:
        """The read mode of the field named ``image`` (or of the only image field); see ``image_mode=``."""
        modes = self.image_modes
        return modes.get("image") or next(iter(modes.values()), "RGB")

    def _warn_if_reduced(self, chosen: Mapping[str, str]) -> None:
        """Warn once, at the caller's line, when a field read in its default Pillow mode (not one
        named in ``chosen``, the caller's ``image_mode``) holds images that mode really loses, as
        the index records them: deeper than 8 bits, colour read as ``"L"``, or more bands than the
        mode can represent.

        Not warned: what ImageFolder's ``convert("RGB")`` does silently to 8-bit images, which
        every web-scraped store has (ImageNet's train set holds 22 CMYK JPEGs): gray and palette
        expanded, CMYK/YCbCr converted, the alpha of LA/RGBA dropped. The index records only dtype
        and channel count, so a 4-band uint8 image is taken for RGBA or CMYK; one that is neither
        (a 4-band TIFF Pillow cannot open) raises ImageModeError when read."""
        for name, mode in self.image_modes.items():
            if mode == "unchanged" or name not in self._pixel_meta or name in chosen:
                continue
            codes, channels = self._pixel_meta[name]
            deep = (codes != NOT_RECORDED) & (codes != IMAGE_DTYPE_CODES["uint8"])
            kept = {"RGB": (1, 2, 3, 4), "L": (1, 2), "RGBA": (1, 2, 3, 4)}[mode]
            extra = (channels != NOT_RECORDED) & ~np.isin(channels, kept)
            if not (deep.any() or extra.any()):
                continue
            kinds = []
            if deep.any():
                dtypes = sorted({IMAGE_DTYPE_NAMES[int(c)] for c in np.unique(codes[deep])})
                kinds.append(f"{int(deep.sum())} of {len(codes)} are {'/'.join(dtypes)}")
            if extra.any():
                counts = sorted(int(c) for c in np.unique(channels[extra]))
                kinds.append(f"{int(extra.sum())} have {'/'.join(map(str, counts))} channels"
                             + ("" if mode == "L" else f", which image_mode={mode!r} cannot read (ImageModeError)"))
            warnings.warn(
                f"fastdata: {self.root}: image field {name!r} is read in image_mode={mode!r}, which reduces its "
                f"images to 8-bit {mode} as Pillow's convert({mode!r}) does ({'; '.join(kinds)}); open it with "
                f"image_mode='unchanged' to read them as stored", ImagesReducedWarning, stacklevel=user_stacklevel())

    def _pixel_layout(self, name: str, idx: np.ndarray | None = None) -> tuple[int, np.dtype] | None:
        """(channels, dtype) every decode of image field ``name`` gives in its read mode (for the
        samples ``idx``, None = all), or None when they differ or the index does not record them."""
        mode = self.image_modes[name]
        if mode in MODE_CHANNELS:
            return MODE_CHANNELS[mode], np.dtype(np.uint8)
        codes, channels = self._pixel_meta[name]
        if idx is not None:
            codes, channels = codes[idx], channels[idx]
        if not len(codes) or (codes == NOT_RECORDED).any() or (channels == NOT_RECORDED).any():
            return None
        if (codes != codes[0]).any() or (channels != channels[0]).any():
            return None
        return int(channels[0]), np.dtype(IMAGE_DTYPE_NAMES[int(codes[0])])

    def _check_batch_shape(self, idx: np.ndarray, shape: tuple[int, int], field: str = "widths/heights", *,
                           channels: int = 3, itemsize: int = 1) -> None:
        """Refuse (CorruptRecordError naming the store, shard, record and index field) a batch
        shape taken from the index that is not positive or is over
        :func:`fastdata.common.imageio.pixel_limit` (or, with its channels and dtype, over
        :func:`fastdata.common.imageio.decoded_bytes_limit`), before the batch is allocated from
        it (Python ints: no product can wrap)."""
        h, w = shape
        if h > 0 and w > 0 and h * w <= pixel_limit() and h * w * channels * itemsize <= decoded_bytes_limit():
            return
        i = int(idx[0]) if len(idx) else 0
        shard, local = self.locate(i)
        name = self._shard_files[shard]
        if h > 0 and w > 0 and h * w <= pixel_limit():  # the pixels fit: the channels and dtype do not
            raise CorruptRecordError(
                f"{self.root}: shard {name} record {local} (sample {i}): the index's {field}, channels and dtypes "
                f"say {w}x{h} with {channels} channel(s) of {itemsize} byte(s), {h * w * channels * itemsize:,} "
                f"bytes decoded: more than the {decoded_bytes_limit():,} an image may hold (refused as a "
                "decompression bomb); nothing was allocated for it", store=self.root, shard=name, index=i)
        raise CorruptRecordError(
            f"{self.root}: shard {name} record {local} (sample {i}): the index's {field} say {w}x{h}, not a "
            f"size an image may have (1 to {pixel_limit():,} pixels: larger is refused as a decompression "
            "bomb); nothing was allocated for it", store=self.root, shard=name, index=i)

    def __len__(self) -> int:
        return self._count

    # -- index columns and subsets ----------------------------------------------------------
    def _column_keys(self) -> dict[str, str]:
        """Column name -> its key in :attr:`index_arrays`: every index-resident field by name,
        ``<image>.format|width|height|dtype|channels`` per image field, ``<chunked>.shape`` per
        chunked field; with one image field also its metadata without the prefix, and
        ``label`` for the class field, unless a field already has that name; then the record
        model's own (an image-classification store's ``nbytes``)."""
        keys = {name: FIELD_PREFIX + name for name in self.schema.index_fields()}
        images = self.schema.image_fields()
        for name in images:
            keys.update({f"{name}.{meta}": f"{FIELD_PREFIX}{name}.{meta}" for meta in IMAGE_META})
        for name in self.schema.chunked_fields():
            keys[f"{name}.shape"] = chunk_shape_key(name)
        if len(images) == 1:
            for meta in IMAGE_META:
                keys.setdefault(meta, f"{FIELD_PREFIX}{images[0]}.{meta}")
        if self.target_field is not None:
            keys.setdefault("label", FIELD_PREFIX + self.target_field)
        for name, key in self._records.extra_columns.items():
            keys.setdefault(name, key)
        return {name: key for name, key in keys.items() if key in self.index_arrays}

    def columns(self) -> tuple[str, ...]:
        """The names :meth:`column` accepts for this store (see there)."""
        return tuple(self._column_keys())

    def column(self, name: str) -> np.ndarray:
        """One value per sample of an index-resident field, without reading a record.

        Names: every field the index holds (ints, floats, small fixed-shape arrays: ``(n, *shape)``
        rows), the class field included; per image field ``<image>.width``, ``.height``,
        ``.channels`` (0: not recorded), ``.dtype`` (the numpy dtype name of the stored pixels,
        ``""``: not recorded) and ``.format`` (``"JPEG"``, ``"PNG"``...); per chunked field
        ``<field>.shape`` (``(n, ndim)``). With a single image field also ``width``, ``height``,
        ``channels``, ``dtype``, ``format``; with a class field also ``label`` (unless a field
        has that name); an image-classification store also ``nbytes`` (int64, the stored image's
        size). Names, not the index's 1-byte codes: ``ds.column("dtype") == "uint16"`` needs no
        code table, and the array is built only when asked for.

        Args:
            name (str): a column name (:meth:`columns` lists them).

        Returns:
            np.ndarray: ``len(self)`` values (rows of a fixed-shape field), read-only.

        Raises:
            KeyError: no such column; the message lists the available ones.
        """
        array = self._column(name) if isinstance(name, str) else None
        if array is None:
            raise KeyError(f"{self.root} has no column {name!r}; its columns are: {', '.join(self.columns())}")
        return read_only(array)

    def _column(self, name: str) -> np.ndarray | None:
        """The array of column ``name`` (may share memory with the index), None when unknown."""
        key = self._column_keys().get(name)
        if key is None:
            return None
        array = self.index_arrays[key]
        field, _, meta = key[len(FIELD_PREFIX):].partition(".")
        if key.startswith(FIELD_PREFIX) and field in self.schema.image_fields() and meta in ("dtype", "format"):
            return code_names(array, IMAGE_DTYPE_NAMES if meta == "dtype" else FORMAT_NAMES)  # codes -> names
        return array

    def array_shapes(self, name: str) -> np.ndarray:
        """Every sample's shape of chunked field ``name``, ``(len(self), ndim)`` int64, from the
        index (no record is read): what a patch sampler needs to place patches.

        Raises:
            KeyError: ``name`` is not a chunked field of this store.
        """
        if name not in self.schema or not isinstance(self.schema[name], Chunked):
            raise KeyError(f"{name!r} is not a chunked field of {self.root} (chunked fields: "
                           f"{', '.join(self.schema.chunked_fields()) or 'none'})")
        return self.index_arrays[chunk_shape_key(name)]

    def relpath(self, index: int) -> str:
        """Source path of sample ``index`` relative to the converted root."""
        index = self._check_index(index)
        a, b = self._relpath_offsets[index], self._relpath_offsets[index + 1]
        return os.fsdecode(self._relpaths[a:b].tobytes())

    def _check_index(self, index) -> int:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        return i

    def _check_indices(self, indices: Sequence[int]) -> np.ndarray:
        """Vectorised :meth:`_check_index` for a batch (negative indices wrap)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(np.asarray(indices).reshape(-1)[np.flatnonzero((idx < 0) | (idx >= n))[0]])
            raise IndexError(f"index {bad} out of range for a dataset of {n} samples")
        return idx

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, index within that shard) of a global sample index."""
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        return shard, index - int(self.shard_starts[shard])

    def subset(self, indices: Sequence[int] | np.ndarray) -> StoreSubset:
        """A view of this dataset over ``indices`` (see :class:`fastdata.reader.subset.StoreSubset`).

        Args:
            indices: sample indices (ints, negative ones counting from the end; repeats allowed)
                or a bool mask of ``len(self)`` values. Sorted indices keep reads in storage
                order and give the view ``shard_starts`` (for ``DistributedShardSampler``'s
                ``shard_window``).

        Returns:
            StoreSubset: ``view[i]`` is ``self[indices[i]]``, crops included (same seed and epoch).

        Raises:
            IndexError: an index out of range.
            ValueError: indices that are not integers or a bool mask of the right length.
        """
        return StoreSubset(self, indices)

    # -- handles ----------------------------------------------------------------------------
    @property
    def readahead(self) -> bool:
        """Whether LMDB shards open with the OS's readahead (see ``readahead=``); a change
        applies to the shards opened after it."""
        return self._shards.readahead

    @readahead.setter
    def readahead(self, value: bool) -> None:
        self._shards.readahead = value

    @property
    def max_open_shards(self) -> int | None:
        """Shards each process keeps open at once, as given (None = the store's default); a
        change applies from a process's first read after a fork or :meth:`close`."""
        return self._shards.max_open

    @max_open_shards.setter
    def max_open_shards(self, value: int | None) -> None:
        self._shards.max_open = value

    def _reader(self, shard: int):
        """This process's reader of shard ``shard`` (opened now if need be)."""
        return self._shards.get(shard)

    def prefetch_shards(self, shards: Sequence[int], keep: Sequence[int] = ()) -> None:
        """Start downloading ``shards`` (shard numbers) of a remote store in the background, so
        they are cached when read; nothing for a local store. Samplers that know their next
        shards call this (e.g. :class:`~fastdata.reader.sampler.DistributedShardSampler` with a
        ``shard_window``). Making room for them never evicts ``shards`` or ``keep``."""
        self._store.prefetch(shards, keep)

    def close(self) -> None:
        """Close this process's handles (they reopen lazily on next access)."""
        self._shards.close()
        added = getattr(self, "_added", None)
        if added is not None:
            added.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_samples"] = None  # rebuilt on demand; workers should not carry a list per sample
        return state

    # -- reading ----------------------------------------------------------------------------
    def _raw_bytes(self, index: int) -> bytes:
        shard, local = self.locate(index)
        try:
            return self._shards.get(shard).get(local)
        except CorruptRecordError as err:
            raise self._named(err, shard, local, index) from None
        except StoreChangedError:
            raise
        except FormatError as err:
            raise CorruptRecordError(f"{self.root} sample {index}: {err}", store=self.root,
                                     shard=self._shard_files[shard], index=index) from None

    def _named(self, err: CorruptRecordError, shard: int, local: int, index: int) -> CorruptRecordError:
        return CorruptRecordError(
            f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index}) is damaged: {err}; "
            "run 'fastdata verify' on the store", store=self.root, shard=self._shard_files[shard], index=index)

    def _where(self, index: int) -> str:
        shard, local = self.locate(index)
        return f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index})"

    def _decode_image(self, data: bytes, fmt: str, index: int, name: str, epoch: int | None,
                      into: np.ndarray | None = None):
        """Image field ``name`` of sample ``index`` decoded per ``output``/``decode`` (straight into
        ``into``, an HWC array, when given); fastdata's own decoders' failures become
        :class:`CorruptRecordError` (a user's decode callable's propagate unchanged)."""
        if not self._decode_is_ours:
            return self._run_decoder(data, fmt, index, name, epoch, into)
        try:
            return self._run_decoder(data, fmt, index, name, epoch, into)
        except ImageModeError as err:  # sound bytes the read mode cannot give: not damage, never skipped
            raise ImageModeError(f"{self._where(index)} image field {name!r}: {err}") from None
        except FastdataError:
            raise
        except Exception as err:  # noqa: BLE001 - decoders raise many types on damaged data
            shard, _ = self.locate(index)
            raise CorruptRecordError(
                f"{self._where(index)}: cannot decode {fmt} image field {name!r} ({type(err).__name__}: {err}); "
                "verify the store with decode=True", store=self.root, shard=self._shard_files[shard],
                index=index) from err

    def _run_decoder(self, data: bytes, fmt: str, index: int, name: str, epoch: int | None,
                     into: np.ndarray | None):
        if self.output == "bytes":
            return bytes(data)  # as stored: the consumer decodes
        mode = self.image_modes[name]
        raw_shape = self.storage.raw_shape  # (H, W) of a store of fixed-size pixels, else None
        if self.decode is None:
            if into is not None:
                decode_numpy_into(data, fmt, into, raw_shape, mode)
                return into
            if self.output == "pil":
                return decode_pil(data, fmt, raw_shape, mode)
            return decode_numpy(data, fmt, raw_shape, mode)
        # fastdata's transforms take the read mode; RGB is their default (a user's own
        # DecodeTransform subclass written before modes existed keeps working in RGB mode)
        moded = {} if mode == "RGB" or not self._decode_is_ours else {"mode": mode}
        if self._decode_takes_rng:
            transform: fd_transforms.DecodeTransform = self.decode  # type: ignore[assignment]
            # (fastdata's transforms keep nothing of the generator: this thread's can be reused)
            stream = reused_sample_rng if self._decode_is_ours else sample_rng
            rng = None if epoch is None else stream(self.seed, epoch, index)
            if into is not None:
                transform.decode_into(data, into, rng, **moded)
                return into
            image = transform(data, rng, **moded)
        elif into is not None and hasattr(self.decode, "decode_into"):
            self.decode.decode_into(data, into, **moded)
            return into
        else:
            image = self.decode(data, **moded)
        image = squeezed(image, mode)
        if into is not None:
            into[...] = image
            return into
        return pil_of(image) if self.output == "pil" else image

    def _as_output(self, value: Any):
        if self.output == "tensor":
            if isinstance(value, np.ndarray):
                return torch.from_numpy(np.array(value))  # a writable copy
        return value

    def _field_plan(self) -> list[tuple[str, int, Any, np.ndarray | None]]:
        """How each field of a sample is read, decided once when the store is opened:
        ``(name, how, field, its index array or None)`` in schema order."""
        plan: list[tuple[str, int, Any, np.ndarray | None]] = []
        for name, field in self.schema:
            if isinstance(field, Image):
                added = self._added is not None and name in self._added.record_fields  # (its bytes: a field file)
                plan.append((name, _ADDED_IMAGE if added else _IMAGE, field,
                             self.index_arrays[f"{FIELD_PREFIX}{name}.format"]))
            elif field.index_shape is not None:
                how = _INDEX_ARRAY if isinstance(field, NDArray) else _SCALAR if isinstance(field, Int | Float) \
                    else _INDEX_VALUE
                plan.append((name, how, field, self.index_arrays[FIELD_PREFIX + name]))
            elif self._added is not None and name in self._added.record_fields:
                how = _ADDED_ARRAY if isinstance(field, NDArray | Ragged) else _ADDED_CHUNKED if isinstance(
                    field, Chunked) else _ADDED_VALUE
                plan.append((name, how, field, None))
            else:
                how = _RECORD_ARRAY if isinstance(field, NDArray | Ragged) else _CHUNKED if isinstance(field, Chunked) \
                    else _RECORD_VALUE
                plan.append((name, how, field, None))
        return plan

    def _build(self, data: bytes, index: int, epoch: int | None, slots: dict | None = None) -> dict:
        """The sample dict of record ``data`` (sample ``index``), before ``transform``;
        ``slots``: image field -> HWC tensor to decode that image into (see :meth:`_image_slots`)."""
        record = self._records.record_fields(data, lambda: self._where(index))
        out: dict[str, Any] = {}
        for name, how, field, array in self._plan:
            if how == _IMAGE or how == _ADDED_IMAGE:
                fmt = FORMAT_NAMES[int(array[index])]  # type: ignore[index]
                data = record[name] if how == _IMAGE else self._added_value(name, index)
                slot = slots.get(name) if slots else None
                if slot is not None:
                    self._decode_image(data, fmt, index, name, epoch, into=slot.numpy())
                    out[name] = slot.permute(2, 0, 1)
                    continue
                image = self._decode_image(data, fmt, index, name, epoch)
                if self.output == "tensor" and isinstance(image, np.ndarray):
                    image = to_tensor(np.ascontiguousarray(image))
                out[name] = image
            elif how == _SCALAR:
                out[name] = field.python_type(array[index])  # type: ignore[index]
            elif how == _INDEX_ARRAY:
                out[name] = self._as_output(np.array(array[index]))  # type: ignore[index]
            elif how == _INDEX_VALUE:
                out[name] = field.decode(array[index], self._where(index))  # type: ignore[index]
            elif how == _RECORD_ARRAY:
                out[name] = self._as_output(record[name])
            elif how == _CHUNKED:
                out[name] = self._chunked(name, field, record[name], index, f"{self._where(index)} field {name!r}")
            elif how == _ADDED_CHUNKED:
                out[name] = self._added_chunked(name, field, index)
            elif how == _ADDED_ARRAY or how == _ADDED_VALUE:
                value = self._added_value(name, index)
                out[name] = self._as_output(value) if how == _ADDED_ARRAY else value
            else:
                out[name] = record[name]
        return out

    def _added_value(self, name: str, index: int) -> Any:
        """Record-resident added field ``name`` of sample ``index`` (from its field file)."""
        assert self._added is not None
        try:
            return self._added.value(name, index, f"{self.root} sample {index}")
        except CorruptRecordError as err:
            shard, _ = self.locate(index)
            raise CorruptRecordError(f"{err}; run 'fastdata verify' on the store", store=self.root,
                                     shard=self._shard_files[shard], index=index) from None

    def _added_chunked(self, name: str, field: Chunked, index: int) -> ChunkedArray:
        """The lazy array of added chunked field ``name`` of sample ``index``: read by region from
        its field file as a written one is from its shard."""
        assert self._added is not None
        where = f"{self._where(index)} added field {name!r}"
        try:
            shard, table = self._added.chunk_table(name, index, f"{self.root} sample {index}")
        except CorruptRecordError as err:
            shard, _ = self.locate(index)
            raise CorruptRecordError(f"{err}; run 'fastdata verify' on the store", store=self.root,
                                     shard=self._shard_files[shard], index=index) from None
        return ChunkedArray(self._added.chunk_source(name), shard,
                            int(self.index_arrays[chunk_first_key(name)][index]), table, field, where)

    def _chunked(self, name: str, field: Chunked, table: bytes, index: int, where: str) -> ChunkedArray:
        """The lazy array of chunked field ``name`` of sample ``index`` (shape and table checked)."""
        shape = check_shape(self.index_arrays[chunk_shape_key(name)][index], field.chunks, field.dtype.itemsize,
                            where)
        shard, _local = self.locate(index)
        return ChunkedArray(self._shards, shard, int(self.index_arrays[chunk_first_key(name)][index]),
                            ChunkTable.from_bytes(table, shape, field.chunks, where), field, where)

    def _finish_sample(self, sample: dict):
        """What ``self[i]`` returns for the sample dict: ``transform(sample)`` (the presentations
        override this: ImageFolder's ``(image, target)``, CocoDetection's)."""
        return self.transform(sample) if self.transform is not None else sample

    def _load(self, epoch: int | None, index: int):
        return self._finish_sample(self._build(self._raw_bytes(index), index, epoch))

    def __getitem__(self, index: int):
        epoch = epoch_of(index, self.epoch)
        index = self._check_index(index)
        try:
            sample = self._build(self._raw_bytes(index), index, epoch)
        except CorruptRecordError as err:
            return self._skip_to_next(index, err, functools.partial(self._load, epoch))[1]
        return self._finish_sample(sample)

    def replace_damaged(self, index: int, err: CorruptRecordError, load: Callable[[int], Any]) -> tuple[int, Any]:
        """What a dataset built on this one (e.g. :class:`fastdata.PatchDataset`, which finds a damaged
        chunk only when it reads a patch) does with damage in sample ``index``: this dataset's
        ``on_error`` policy, as for its own reads (raise ``err``, or count, warn and return
        ``(k, load(k))`` for the next readable sample ``k``)."""
        return self._skip_to_next(index, err, load)

    def _skip_to_next(self, index: int, err: CorruptRecordError, load: Callable[[int], Any]) -> tuple[int, Any]:
        """The one ``on_error`` policy for a damaged sample, shared by every read path.

        Raise ``err``; or (``"skip"``) count and warn, then return ``(k, load(k))`` for
        the first readable ``k`` of the next 63 samples. ``load`` produces the
        substitute in the caller's own form (an ``(image, target)`` pair, or pixels
        written into a batch slot), so the substitute always has the shape the
        caller's original would have had.
        """
        if self.on_error != "skip":
            raise err
        n = len(self)
        with _SKIP_LOCK:  # (thread workers: += is a read and a write, another thread may come between)
            self._skips += 1
        warnings.warn(f"fastdata: skipping damaged sample {index} ({err})", RuntimeWarning, stacklevel=4)
        for step in range(1, min(n, 64)):
            k = (index + step) % n
            try:
                return k, load(k)
            except CorruptRecordError:
                continue
        raise CorruptRecordError(f"{self.root}: sample {index} and the 63 after it are all damaged; "
                                 "run 'fastdata verify'", store=self.root, index=index)

    def _image_slots(self, idx: np.ndarray) -> list[dict[str, torch.Tensor]] | None:
        """In a DataLoader worker with ``output="tensor"`` and full decodes: one HWC
        slot per image of the batch, all in one piece of shared memory sized from the
        index's widths, heights, channels and dtypes (per the read mode), so that images are
        decoded where they travel from (:class:`fastdata.reader.batching.PackedBatch` sends it
        once). None otherwise (and when the index does not record what a mode needs)."""
        if self.output != "tensor" or self.decode is not None or torch.utils.data.get_worker_info() is None:
            return None
        names = [name for name, field in self.schema if isinstance(field, Image)]
        if not names or not len(idx):
            return None
        layouts = {}
        for name in names:
            layout = self._pixel_layout(name, idx)
            if layout is None:
                return None  # dtypes/channels differ or are not recorded: each image decoded on its own
            layouts[name] = layout
        shapes = [{name: (int(self.index_arrays[f"{FIELD_PREFIX}{name}.height"][i]),
                          int(self.index_arrays[f"{FIELD_PREFIX}{name}.width"][i])) for name in names}
                  for i in idx.tolist()]
        limit, byte_limit = pixel_limit(), decoded_bytes_limit()
        if any(not (h > 0 and w > 0 and h * w <= limit
                    and h * w * layouts[name][0] * layouts[name][1].itemsize <= byte_limit)
               for sample in shapes for name, (h, w) in sample.items()):
            return None  # sizes no image may have: decoded one by one (where bombs are refused), nothing allocated
        size = {name: channels * dtype.itemsize for name, (channels, dtype) in layouts.items()}
        total = max(1, sum(aligned(h * w * size[name]) for sample in shapes for name, (h, w) in sample.items()))
        # a slot of the worker's ring: shared memory already mapped and touched by earlier
        # batches; a new segment (its creation and first-touch faults cost ~0.4 ms an image
        # of 400x350) only until the main process has mapped the ring, or when it is full
        lent = batch_ring.lend(total)
        flat = torch.from_numpy(lent) if lent is not None else new_segment(total)
        slots, offset = [], 0
        for sample in shapes:
            mine = {}
            for name, (h, w) in sample.items():
                channels, dtype = layouts[name]
                nbytes = h * w * size[name]
                torch_dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
                mine[name] = flat[offset:offset + nbytes].view(torch_dtype).view(h, w, channels)
                offset += aligned(nbytes)
            slots.append(mine)
        return slots

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        """Fetch a whole batch (the DataLoader calls this with a batch of indices).

        Storage is read shard by shard in key/offset order (one LMDB read transaction per
        shard; contiguous HDF5 ranges merged), and samples come back in the order asked, as a
        :class:`Samples` list that carries the number of damaged samples replaced (``skips``)
        for :func:`collate`. A subclass that overrides ``__getitem__`` (and not this) gets a
        :class:`Samples` of ``self[i]`` for each index instead: its override is what the batch
        goes through (:mod:`fastdata.reader.overrides`).
        """
        epoch = epoch_of(indices, self.epoch)
        before = self._skips
        if overrides_getitem(type(self)):
            samples = each_sample(self, indices, epoch)
            samples.skips, samples.token, samples.ragged = self._skips - before, self._token, self._ragged_fields
            return samples
        idx = self._check_indices(indices)
        out = Samples()
        load = functools.partial(self._load, epoch)
        slots = self._image_slots(idx)
        for k, (i, data) in enumerate(zip(idx.tolist(), self._read_batch(idx), strict=True)):
            try:
                if isinstance(data, CorruptRecordError):
                    raise data
                sample = self._build(data, i, epoch, slots[k] if slots else None)
            except CorruptRecordError as err:
                out.append(self._skip_to_next(i, err, load)[1])
                continue
            out.append(self._finish_sample(sample))
        out.skips, out.token = self._skips - before, self._token
        out.ragged = self._ragged_fields
        return out

    def _read_batch(self, idx: np.ndarray) -> list:
        """Stored bytes for ``idx`` (CorruptRecordError objects in place of bad ones)."""
        out: list = [None] * len(idx)
        self._read_each(idx, out.__setitem__, views=False)
        return out

    def _read_each(self, idx: np.ndarray, consume: Callable[[int, Any], None], views: bool) -> None:
        """``consume(j, data)`` for the ``j``-th of ``idx``: its stored bytes, or the
        CorruptRecordError naming it when it is damaged. With ``views``, ``data`` may be a view
        into the shard, valid only during the call (see ``ShardReader.read_images``): ``consume``
        must use it there and read nothing from the store itself."""
        shards = np.searchsorted(self.shard_starts, idx, side="right") - 1
        for shard in np.unique(shards).tolist():
            pos = np.flatnonzero(shards == shard)
            local = idx[pos] - self.shard_starts[shard]
            reader = self._shards.get(shard)
            try:
                if views:
                    reader.read_images(local, lambda k, data, pos=pos: consume(int(pos[k]), data))
                else:
                    for p, data in zip(pos.tolist(), reader.get_many(local), strict=False):
                        consume(p, data)
                continue
            except CorruptRecordError:
                pass
            # a damaged record in the group: each one again, on its own (the others consumed twice)
            for p, loc in zip(pos.tolist(), local.tolist(), strict=False):
                try:
                    data = reader.get(loc)
                except CorruptRecordError as err:
                    data = self._named(err, shard, loc, int(idx[p]))
                consume(p, data)


class ImageFolderDataset(StoreDataset):
    """A store of images and class labels read as ``torchvision.datasets.ImageFolder`` reads a
    folder: ``ds[i]`` is ``(transform(image), target_transform(target))``, with ``classes``,
    ``class_to_idx``, ``targets``, ``samples`` and ``imgs``. A thin layer over
    :class:`StoreDataset` (its image field and class field); batches of one image size
    (raw stores, a ``decode`` transform with ``output_size``, a store of equal sizes) are decoded
    into one preallocated array (a :class:`Batch`). Use :class:`LMDBImageDataset`,
    :class:`HDF5ImageDataset` or :func:`fastdata.open_dataset`."""

    def __init__(
        self,
        path: str | os.PathLike | StoreLocation,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        output: str = "pil",
        decode: Callable | None = None,
        **options: Any,
    ):
        """Open the store's metadata.

        Args:
            path: a store of images and class labels (``fastdata convert`` of an image folder or
                a path,label list), or its URL.
            transform: applied to the image after decoding (torchvision-style).
            target_transform: applied to the integer label.
            output, decode: as :class:`StoreDataset`.
            options: ``on_error``, ``readahead``, ``seed``, ``image_mode``, ``storage_options``,
                ``cache_dir``, ``cache_limit``, ``max_open_shards``, ``cache``: as :class:`StoreDataset`.

        Raises:
            FormatError: the store has no image field or no single-label class field.
        """
        super().__init__(path, transform=transform, output=output, decode=decode, **options)
        self.target_transform = target_transform

    def _load_index(self, manifest: dict) -> None:
        super()._load_index(manifest)
        images = self.schema.image_fields()
        name = "image" if "image" in images else (images[0] if len(images) == 1 else None)
        if name is None or self.target_field is None:
            raise FormatError(f"{self.root} holds fields {', '.join(n for n, _ in self.schema)}, not an image and a "
                              "class label: open it with fastdata.open_dataset()")
        #: the image field ``ds[i]`` gives, and its stored formats
        self._image_name = name
        self._image_formats = self.index_arrays[f"{FIELD_PREFIX}{name}.format"]
        widths = self.index_arrays[f"{FIELD_PREFIX}{name}.width"]
        heights = self.index_arrays[f"{FIELD_PREFIX}{name}.height"]
        self.uniform_shape = (int(heights[0]), int(widths[0])) if len(widths) and (
            (widths == widths[0]).all() and (heights == heights[0]).all()) else None
        self._check_raw_sizes(self.index_arrays[NBYTES])

    def columns(self) -> tuple[str, ...]:
        """The names :meth:`column` accepts: ``label``, ``width``, ``height``, ``channels``, ``dtype``,
        ``format`` and ``nbytes`` for a store converted from an image folder or list (see
        :meth:`StoreDataset.column`)."""
        keys = self._column_keys()
        return tuple(name for name in CLASSIFICATION_COLUMNS if name in keys) + tuple(
            name for name in keys if name not in CLASSIFICATION_COLUMNS and "." not in name)

    def extra_repr(self) -> str:
        return "\n".join(self._repr_lines())

    def _finish_sample(self, sample: dict):
        image = sample[self._image_name]
        if self.transform is not None:
            image = self.transform(image)
        target = int(sample[self.target_field])
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def _image_slots(self, idx: np.ndarray) -> None:
        return None  # (image, target) pairs travel as they are; fixed-size batches use one array instead

    def __getitems__(self, indices: Sequence[int]):
        """Fetch a whole batch (the DataLoader calls this with a batch of indices).

        As :meth:`StoreDataset.__getitems__`; in addition, with a fixed output shape (raw stores,
        a ``decode`` transform with ``output_size``, or a store whose images all have one size),
        ``output`` numpy/tensor and no ``transform``, the images are decoded into one
        preallocated batch array: a :class:`Batch` (with the targets), which carries ``skips`` too.
        """
        shape = None if overrides_getitem(type(self)) else self._fixed_shape()
        if shape is not None:
            idx = self._check_indices(indices)
            layout = self._pixel_layout(self._image_name, idx)
            if layout is not None:
                epoch, before = epoch_of(indices, self.epoch), self._skips
                out = self._fixed_batch(idx, shape, layout, epoch)
                out.skips, out.token = self._skips - before, self._token
                return out
        return super().__getitems__(indices)

    def _decode_into(self, data, index: int, epoch: int | None, out: np.ndarray) -> np.ndarray:
        """Decode the image of record ``data`` (sample ``index``) into ``out`` [H,W,C]."""
        name = self._image_name
        image = self._records.record_fields(data, lambda: self._where(index))[name]
        fmt = FORMAT_NAMES[int(self._image_formats[index])]
        return self._decode_image(image, fmt, index, name, epoch, into=out)

    def _load_into(self, out: np.ndarray, epoch: int | None, index: int) -> None:
        self._decode_into(self._raw_bytes(index), index, epoch, out)

    def _check_raw_sizes(self, nbytes: np.ndarray) -> None:
        """A raw store: every record exactly H x W x 3 bytes of ``raw_shape`` (the index's ``nbytes``,
        read from the shard), checked before a batch is allocated from ``raw_shape``; the manifest's
        own check bounds ``raw_shape`` (at most a record's limit, and no more than the shards hold)."""
        if not self.storage.mode.holds_fixed_size_pixels:
            return
        h, w = self.storage.fixed_pixel_shape()
        bad = np.flatnonzero(nbytes != h * w * 3)
        if len(bad):
            i = int(bad[0])
            shard, local = self.locate(i)
            name = self._shard_files[shard]
            raise CorruptRecordError(
                f"{self.root}: shard {name} record {local} (sample {i}) holds {int(nbytes[i])} bytes, but the "
                f"manifest's raw_shape {h}x{w} needs {h * w * 3}; the store is damaged (run 'fastdata verify')",
                store=self.root, shard=name, index=i)

    def _fixed_shape(self) -> tuple[int, int] | None:
        if self.transform is not None or self.output in ("pil", "bytes"):
            return None
        if self.storage.mode.holds_fixed_size_pixels:
            pixels_as_stored = self.image_modes[self._image_name] in ("RGB", "unchanged")
            return self.storage.fixed_pixel_shape() if pixels_as_stored else None
        if self.decode is None:
            return self.uniform_shape
        size = getattr(self.decode, "output_size", None)
        return tuple(size) if size else None

    def _fixed_batch(self, idx: np.ndarray, shape: tuple[int, int], layout: tuple[int, np.dtype],
                     epoch: int | None) -> Batch:
        channels, dtype = layout
        if self.decode is None and not self.storage.mode.holds_fixed_size_pixels:  # the index's uniform_shape
            self._check_batch_shape(idx, shape, channels=channels, itemsize=dtype.itemsize)
        return build_batch(self.targets[idx], (*shape, channels), lambda arr: self._fill(idx, arr, epoch),
                           channels_first=self.output == "tensor", target_transform=self.target_transform,
                           dtype=dtype, squeeze=self.image_modes[self._image_name] != "RGB")

    def _fill(self, idx: np.ndarray, arr: np.ndarray, epoch: int | None) -> np.ndarray | None:
        """Write the pixels of samples ``idx`` into the batch array ``arr`` [n,H,W,3].

        Returns the targets of the samples actually written when a damaged one was
        replaced (its substitute brings its own label), else None.
        """
        if self.storage.mode.holds_fixed_size_pixels and self.image_modes[self._image_name] in ("RGB", "unchanged"):
            return self._fill_raw(idx, arr)
        damaged: dict[int, CorruptRecordError] = {}

        def decode_into_slot(j: int, data) -> None:
            # inside the shard's read (``data`` may be a view of it): decode only, the policy after
            if isinstance(data, CorruptRecordError):
                damaged[j] = data
                return
            try:
                self._decode_into(data, int(idx[j]), epoch, arr[j])
                damaged.pop(j, None)  # (read again after a damaged neighbour: fine now)
            except CorruptRecordError as err:
                damaged[j] = err

        self._read_each(idx, decode_into_slot, views=True)
        sources = None
        for j, err in sorted(damaged.items()):
            k, _ = self._skip_to_next(int(idx[j]), err, functools.partial(self._load_into, arr[j], epoch))
            sources = idx.copy() if sources is None else sources
            sources[j] = k
        return None if sources is None else self.targets[sources]

    def _fill_raw(self, idx: np.ndarray, arr: np.ndarray) -> np.ndarray | None:
        shards = np.searchsorted(self.shard_starts, idx, side="right") - 1
        sources = None
        for shard in np.unique(shards).tolist():
            pos = np.flatnonzero(shards == shard)
            local = idx[pos] - self.shard_starts[shard]
            whole = len(pos) == len(idx)  # one shard (the common case): read straight into the batch
            block = arr if whole else np.empty((len(pos),) + arr.shape[1:], dtype=np.uint8)
            try:
                self._shards.get(shard).get_raw_batch(local, block)
            except CorruptRecordError:
                # find the damaged record(s): per sample, raising or substituting as the policy says
                for b, p in enumerate(pos.tolist()):
                    i = int(idx[p])
                    try:
                        block[b] = self._raw_pixels(i)
                    except CorruptRecordError as err:
                        k, block[b] = self._skip_to_next(i, err, self._raw_pixels)
                        sources = idx.copy() if sources is None else sources
                        sources[p] = k
            if not whole:
                arr[pos] = block
        return None if sources is None else self.targets[sources]

    def _raw_pixels(self, index: int) -> np.ndarray:
        return decode_numpy(self._raw_bytes(index), "RAW", self.storage.raw_shape)


class LMDBImageDataset(ImageFolderDataset):
    """A fastdata LMDB store as a ``torch.utils.data.Dataset`` (drop-in for ImageFolder)."""

    backend = "lmdb"


class HDF5ImageDataset(ImageFolderDataset):
    """A fastdata HDF5 store as a ``torch.utils.data.Dataset`` (drop-in for ImageFolder)."""

    backend = "hdf5"


def _standard_transform_repr(transform: Callable | None, target_transform: Callable | None) -> str:
    """torchvision's ``StandardTransform.__repr__``."""
    body = ["StandardTransform"]
    for head, fn in (("Transform: ", transform), ("Target transform: ", target_transform)):
        if fn is not None:
            lines = repr(fn).splitlines()
            body += [head + lines[0]] + [" " * len(head) + line for line in lines[1:]]
    return "\n".join(body)


def _source_base(source: str | None) -> str | None:
    """The folder a conversion's stored paths are relative to: its source folder, or a list's folder."""
    if not isinstance(source, str) or not source:
        return None
    if source.lower().endswith((".csv", ".tsv", ".jsonl", ".ndjson")):  # a list: paths relative to its folder
        return os.path.dirname(source)
    return source


def _source_spans(manifest: dict) -> list[tuple[int, str | None]]:
    """``(first sample, source)`` of the conversion that wrote each run of shards: the store's own,
    then each append's (``options.appends``, in order, each naming how many shards it added). A
    list that does not add up to the store's shards is ignored (every record: the first source)."""
    options = manifest.get("options") or {}
    spans: list[tuple[int, str | None]] = [(0, options.get("source"))]
    appends, shards = options.get("appends"), manifest["shards"]
    if not isinstance(appends, list) or not appends or not all(isinstance(a, dict) for a in appends):
        return spans
    counts = [a.get("shards") for a in appends]
    if not all(type(c) is int and c >= 0 for c in counts) or sum(counts) > len(shards):
        return spans
    k = len(shards) - sum(counts)
    for append, count in zip(appends, counts, strict=True):
        if count:
            spans.append((int(shards[k]["first_index"]), append.get("source")))
        k += count
    return spans
