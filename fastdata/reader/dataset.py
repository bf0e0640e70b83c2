"""Map-style Datasets over fastdata stores, correct under any DataLoader setting.

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
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fastdata.common.callers import user_stacklevel
from fastdata.common.imageio import decoded_bytes_limit, pixel_limit
from fastdata.common.imagemodes import IMAGE_MODES, MODE_CHANNELS, check_mode
from fastdata.errors import CorruptRecordError, FastdataError, FormatError, ImageModeError, StoreChangedError
from fastdata.format.manifest import is_classification, label_map_of
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.format.record import FORMAT_NAMES, IMAGE_DTYPE_CODES, IMAGE_DTYPE_NAMES, NOT_RECORDED
from fastdata.reader import transforms as fd_transforms
from fastdata.reader.batching import WORKER_SKIPS, Batch, Samples, build_batch
from fastdata.reader.decode import decode_numpy, decode_numpy_into, decode_pil, pil_of, squeezed, to_tensor
from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.seeding import epoch_of, sample_rng
from fastdata.reader.shards import ShardHandles
from fastdata.reader.subset import StoreSubset, code_names, read_only
from fastdata.remote.store import StoreLocation, locate_store

OUTPUTS = ("pil", "numpy", "tensor")
#: what :meth:`StoreDataset.column` reads from a classification store's index
CLASSIFICATION_COLUMNS = ("label", "width", "height", "channels", "dtype", "format", "nbytes")


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
    """Shared implementation; use :class:`LMDBImageDataset`, :class:`HDF5ImageDataset`
    or :func:`open_dataset`."""

    backend: str = ""
    #: the schema shard readers are opened with: None for classification (version-1) stores
    _schema = None

    def __init__(
        self,
        path: str | os.PathLike | StoreLocation,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        output: str = "pil",
        decode: Callable | None = None,
        *,
        on_error: str = "raise",
        readahead: bool | None = None,
        seed: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        max_open_shards: int | None = None,
        image_mode: str | Mapping[str, str] | None = None,
    ):
        """Open the store's metadata.

        Args:
            path: a store directory written by ``fastdata convert``, or its URL
                (``s3://bucket/train.lmdb``, ``gs://``, ``az://``, ``https://``): a remote
                store's shards are downloaded whole on first use into a shared local
                cache, checked against the manifest's checksums (see :mod:`fastdata.remote`).
            transform: applied to the image after decoding (torchvision-style).
            target_transform: applied to the integer label.
            output: ``"pil"`` (a PIL image), ``"numpy"`` (HWC array; HxW for a one-channel
                image outside ``"RGB"`` mode) or ``"tensor"`` (CHW ``torch.Tensor``), in the
                image mode's dtype (uint8 except ``"unchanged"``).
            decode: a decode-time transform (``fastdata.reader.transforms``) mapping
                encoded bytes to an HWC uint8 array; ``None`` = full decode. Any
                other callable ``decode(bytes) -> array`` is user code: its
                exceptions propagate unchanged.
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
            storage_options: fsspec options of a remote store (endpoint, credentials...);
                the standard environment variables (``AWS_ENDPOINT_URL``...) work too.
            cache_dir: cache directory of a remote store's shards (default
                ``$FASTDATA_CACHE_DIR`` or ``~/.cache/fastdata``), shared by every process.
            cache_limit: most bytes that cache holds (an int or ``"50GiB"``); None = no limit.
            max_open_shards: shards each process keeps open (and pinned in the cache) at once;
                the least recently used one is closed beyond it. None = all for a local
                store, 4 for a remote one (fewer under a ``cache_limit`` that could not hold
                4 of the largest shards for every DataLoader worker and local rank; at least 1).
            image_mode: how images are decoded (see :mod:`fastdata.common.imagemodes`): ``"RGB"``
                (ImageFolder's ``convert("RGB")``: 8-bit RGB, a 16-bit image reduced as Pillow does),
                ``"L"``, ``"RGBA"``, or ``"unchanged"`` (the stored dtype and channels: uint16,
                float32, 1-N channels). A str applies to every image field, a dict maps field
                names to modes. None: the store's recorded default, else ``"RGB"`` for the field
                named ``image`` and ``"unchanged"`` for any other image field. Reading a store of
                images deeper than 8 bits or of more than 4 bands in a default Pillow mode warns once
                (:class:`ImagesReducedWarning`; CMYK and alpha do not count, as for ImageFolder).
        """
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError("on_error must be 'raise' or 'skip'")
        store = path if isinstance(path, StoreLocation) else locate_store(
            path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
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
        self.transform = transform
        self.target_transform = target_transform
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
        self.classes: list[str] = list(manifest["classes"])
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._shard_files: tuple[str, ...] = tuple(s["name"] for s in manifest["shards"])
        self.shard_starts = np.array([s["first_index"] for s in manifest["shards"]], dtype=np.int64)
        self._load_index(manifest)
        #: the read mode of each image field (see ``image_mode=``)
        self.image_modes: dict[str, str] = self._resolve_modes(image_mode, manifest)
        self._warn_if_reduced(chosen=self.image_modes if isinstance(image_mode, str) else (image_mode or {}))
        #: ``(first sample, source)`` of each conversion that wrote the shards: the first, then each append
        self._sources = _source_spans(manifest)
        self._shards = ShardHandles(store, self.backend, self.storage, schema=self._schema, max_open=max_open_shards,
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

    def extra_repr(self) -> str:
        """Lines :meth:`__repr__` adds after the root, as torchvision's ``extra_repr``."""
        lines = [f"Backend: {self.backend}", f"Output: {self.output}"]
        if any(mode != "RGB" for mode in self.image_modes.values()):
            lines.append("Image mode: " + ", ".join(f"{k}={v}" for k, v in self.image_modes.items()))
        if self.decode is not None:
            lines.append(f"Decode: {self.decode!r}")
        if self.on_error != "raise":
            lines.append(f"On error: {self.on_error}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        """torchvision's ``VisionDataset`` layout: name, size, root, extras, transforms."""
        body = [f"Number of datapoints: {len(self)}", f"Root location: {self.root}"]
        body += self.extra_repr().splitlines()
        if self.transform is not None or self.target_transform is not None:
            body.append(_standard_transform_repr(self.transform, self.target_transform))
        return "\n".join([f"Dataset {type(self).__name__}"] + ["    " + line for line in body])

    # -- metadata ---------------------------------------------------------------------------
    def _load_index(self, manifest: dict) -> None:
        if not is_classification(manifest):
            raise FormatError(f"{self.root} is a general store (layout version {manifest['version']}, fields "
                              f"{', '.join(f['name'] for f in manifest.get('schema', []))}): open it with "
                              "fastdata.open_dataset(), which returns a SampleDataset")
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("labels", "formats", "nbytes", "widths", "heights",
                                                              "dtypes", "channels")}
        paths, path_offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        indexes = self._store.shard_indexes(reader_class(self.backend), self.storage, None)
        for shard, index in zip(manifest["shards"], indexes, strict=True):
            if len(index) != shard["count"]:
                raise CorruptRecordError(f"{self.root}/{shard['name']}: holds {len(index)} records, the manifest "
                                         f"says {shard['count']}; run 'fastdata verify'", store=self.root,
                                         shard=shard["name"])
            for key in parts:
                parts[key].append(getattr(index, key))
            label_map = label_map_of(shard)
            if label_map is not None:  # a merged store's shard: its stored labels index its own store's classes
                if len(index) and int(index.labels.max()) >= len(label_map):
                    raise CorruptRecordError(f"{self.root}/{shard['name']}: a label is outside the shard's label_map "
                                             f"of {len(label_map)} classes; run 'fastdata verify'", store=self.root,
                                             shard=shard["name"])
                parts["labels"][-1] = np.asarray(label_map, dtype=np.int64)[index.labels]
            paths.append(index.relpaths)
            path_offsets.append(index.relpath_offsets[1:] + base)
            base += len(index.relpaths)
        cat = lambda arrs, dt: np.concatenate(arrs).astype(dt) if arrs else np.zeros(0, dtype=dt)  # noqa: E731
        #: ImageFolder's ``targets`` (one label per sample, same values) as a read-only int64 numpy array, not a
        #: list: indexable, iterable and ``len()`` alike, but a list of Python ints would be copied into every
        #: forked DataLoader worker page by page as reference counts touch it. Not a list in that ``==`` compares
        #: elementwise, ``+`` adds, there is no ``.count``/``.index``, and JSON needs ``targets.tolist()``. Read-only
        #: because ``ds[i]`` reads its label here: a write would change the labels (ImageFolder's would not)
        self.targets = read_only(cat(parts["labels"], np.int64))
        if len(self.targets) != manifest["num_samples"] or (
                len(self.targets) and int(self.targets.max()) >= len(self.classes)):
            raise CorruptRecordError(f"{self.root}: index disagrees with the manifest; run 'fastdata verify'",
                                     store=self.root)
        self._formats = cat(parts["formats"], np.uint8)
        self._nbytes = cat(parts["nbytes"], np.int64)
        widths, heights = cat(parts["widths"], np.int32), cat(parts["heights"], np.int32)
        # kept for column("width") / column("height"): subsets and splits by size without a read
        self._widths, self._heights = widths, heights
        #: per image field: (dtype codes, channel counts) from the index (0: not recorded, an older store)
        self._pixel_meta = {"image": (cat(parts["dtypes"], np.uint8), cat(parts["channels"], np.uint16))}
        self._check_raw_sizes(self._nbytes)
        #: (H, W) when every stored image has the same size (e.g. CIFAR-like data), else None
        self.uniform_shape = (int(heights[0]), int(widths[0])) if len(widths) and (
            (widths == widths[0]).all() and (heights == heights[0]).all()) else None
        self._relpaths = cat(paths, np.uint8)
        self._relpath_offsets = np.concatenate(path_offsets).astype(np.int64)

    def _image_field_names(self) -> tuple[str, ...]:
        return ("image",)

    def _default_mode(self, name: str, manifest: dict) -> str:
        """A classification store's recorded default (manifest ``image_modes``), else ``"RGB"``."""
        recorded = manifest.get("image_modes")
        if recorded is None:
            return "RGB"
        mode = recorded.get(name, "RGB") if isinstance(recorded, dict) else None
        if mode not in IMAGE_MODES:
            raise FormatError(f"{self.root}: the manifest's image_modes {recorded!r:.80} is not a map of image "
                              f"field -> one of {', '.join(IMAGE_MODES)}")
        return mode

    def _resolve_modes(self, image_mode: str | Mapping[str, str] | None, manifest: dict) -> dict[str, str]:
        names = self._image_field_names()
        modes = {name: self._default_mode(name, manifest) for name in names}
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

    def _check_raw_sizes(self, nbytes: np.ndarray) -> None:
        """A raw store: every record exactly H x W x 3 bytes of ``raw_shape`` (the index's ``nbytes``,
        read from the shard), checked before a batch is allocated from ``raw_shape``; the manifest's
        own check bounds ``raw_shape`` (at most a record's limit, and no more than the shards hold)."""
        if not self.storage.mode.holds_fixed_size_pixels:
            return
        h, w = self.storage.raw_hw()
        bad = np.flatnonzero(nbytes != h * w * 3)
        if len(bad):
            i = int(bad[0])
            shard, local = self.locate(i)
            name = self._shard_files[shard]
            raise CorruptRecordError(
                f"{self.root}: shard {name} record {local} (sample {i}) holds {int(nbytes[i])} bytes, but the "
                f"manifest's raw_shape {h}x{w} needs {h * w * 3}; the store is damaged (run 'fastdata verify')",
                store=self.root, shard=name, index=i)

    def __len__(self) -> int:
        return len(self.targets)

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

    # -- index columns and subsets ----------------------------------------------------------
    def columns(self) -> tuple[str, ...]:
        """The names :meth:`column` accepts for this store.

        Returns:
            tuple[str, ...]: for a classification store ``label``, ``width``, ``height``,
            ``channels``, ``dtype``, ``format`` and ``nbytes``.
        """
        return CLASSIFICATION_COLUMNS

    def column(self, name: str) -> np.ndarray:
        """One value per sample of a field the index holds, without reading a record.

        Classification stores: ``"label"`` (int64, equal to :attr:`targets`), ``"width"`` and
        ``"height"`` (int32, of the image as stored), ``"channels"`` (uint16, the stored channel
        count), ``"dtype"`` (the numpy dtype name of the stored pixels, e.g. ``"uint8"``, as a
        str array), ``"format"`` (the stored format's name, ``"JPEG"``, ``"PNG"``, ``"RAW"``...)
        and ``"nbytes"`` (int64, the stored record's size). ``channels`` 0 and ``dtype`` ``""``
        mean "not recorded" (a store written before fastdata recorded them). Names, not the
        index's 1-byte codes: ``ds.column("dtype") == "uint16"`` needs no code table, and the
        array is built only when asked for. General stores: see :meth:`SampleDataset.column`.

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
        codes, channels = self._pixel_meta["image"]
        arrays = {"label": lambda: self.targets, "width": lambda: self._widths, "height": lambda: self._heights,
                  "channels": lambda: channels, "nbytes": lambda: self._nbytes,
                  "dtype": lambda: code_names(codes, IMAGE_DTYPE_NAMES),
                  "format": lambda: code_names(self._formats, FORMAT_NAMES)}
        get = arrays.get(name)
        return None if get is None else get()

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

    def _undecodable(self, index: int, err: Exception) -> CorruptRecordError:
        shard, local = self.locate(index)
        fmt = FORMAT_NAMES[int(self._formats[index])]
        return CorruptRecordError(
            f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index}): cannot decode "
            f"{fmt} image ({type(err).__name__}: {err}); verify the store with decode=True",
            store=self.root, shard=self._shard_files[shard], index=index)

    def _run_decoder(self, data: bytes, index: int, epoch: int | None, out: np.ndarray | None):
        """Decode stored ``data`` of sample ``index`` into ``out`` [H,W,C] or a new image."""
        fmt = FORMAT_NAMES[int(self._formats[index])]
        mode = self.image_modes["image"]
        if self.decode is None:
            if out is not None:
                decode_numpy_into(data, fmt, out, self.storage.raw_shape, mode)
                return out
            if self.output == "pil":
                return decode_pil(data, fmt, self.storage.raw_shape, mode)
            return decode_numpy(data, fmt, self.storage.raw_shape, mode)
        # fastdata's transforms take the read mode; RGB is their default (a user's own
        # DecodeTransform subclass written before modes existed keeps working in RGB mode)
        moded = {} if mode == "RGB" or not self._decode_is_ours else {"mode": mode}
        if self._decode_takes_rng:
            transform: fd_transforms.DecodeTransform = self.decode  # type: ignore[assignment]
            rng = None if epoch is None else sample_rng(self.seed, epoch, index)
            if out is not None:
                transform.decode_into(data, out, rng, **moded)
                return out
            return squeezed(transform(data, rng, **moded), mode)
        if out is not None and hasattr(self.decode, "decode_into"):
            self.decode.decode_into(data, out, **moded)
            return out
        array = squeezed(self.decode(data, **moded), mode)
        if out is not None:
            out[...] = array
            return out
        return array

    def _decode(self, data: bytes, index: int, epoch: int | None, out: np.ndarray | None = None):
        """:meth:`_run_decoder`, with fastdata's own decoders' failures named as damage
        (:class:`CorruptRecordError`) and a user's decode callable's left as they are."""
        if not self._decode_is_ours:
            return self._run_decoder(data, index, epoch, out)
        try:
            return self._run_decoder(data, index, epoch, out)
        except ImageModeError as err:  # sound bytes the read mode cannot give: not damage, never skipped
            shard, local = self.locate(index)
            raise ImageModeError(f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index}): "
                                 f"{err}") from None
        except FastdataError:
            raise
        except Exception as err:  # noqa: BLE001 - decoders raise many types on damaged data
            raise self._undecodable(index, err) from err

    def _image(self, index: int, epoch: int | None):
        """The decoded image of sample ``index`` before ``transform``; damage raises CorruptRecordError."""
        return self._as_pil_if_asked(self._decode(self._raw_bytes(index), index, epoch))

    def _as_pil_if_asked(self, image):
        if self.decode is not None and self.output == "pil":
            return pil_of(image)
        return image

    def _finish(self, image, index: int):
        if self.output == "tensor" and isinstance(image, np.ndarray):
            image = to_tensor(image)
        if self.transform is not None:
            image = self.transform(image)
        target = int(self.targets[index])
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def _load(self, epoch: int | None, index: int):
        return self._finish(self._image(index, epoch), index)

    def _load_into(self, out: np.ndarray, epoch: int | None, index: int) -> None:
        self._decode(self._raw_bytes(index), index, epoch, out)

    def __getitem__(self, index: int):
        epoch = epoch_of(index, self.epoch)
        index = self._check_index(index)
        try:
            image = self._image(index, epoch)
        except CorruptRecordError as err:
            return self._skip_to_next(index, err, functools.partial(self._load, epoch))[1]
        return self._finish(image, index)

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

    def __getitems__(self, indices: Sequence[int]):
        """Fetch a whole batch (the DataLoader calls this with a batch of indices).

        Storage is read shard by shard in key/offset order (one LMDB read
        transaction per shard; contiguous HDF5 ranges merged), and samples come
        back in the order asked. With a fixed output shape (raw stores, or a
        ``decode`` transform with ``output_size``), ``output`` numpy/tensor and
        no ``transform``, the images are decoded into one preallocated batch
        array: a :class:`Batch`; otherwise a :class:`Samples` list. Both carry the
        number of damaged samples replaced (``skips``) for :func:`collate`.

        A subclass that overrides ``__getitem__`` (and not this) gets a :class:`Samples` of
        ``self[i]`` for each index instead: its override is what the batch goes through
        (:mod:`fastdata.reader.overrides`).
        """
        epoch = epoch_of(indices, self.epoch)
        before = self._skips
        if overrides_getitem(type(self)):
            samples = each_sample(self, indices, epoch)
            samples.skips, samples.token = self._skips - before, self._token
            return samples
        idx = self._check_indices(indices)
        shape = self._fixed_shape()
        layout = self._pixel_layout("image", idx) if shape is not None else None
        out = (self._fixed_batch(idx, shape, layout, epoch) if shape is not None and layout is not None
               else self._sample_list(idx, epoch))
        out.skips, out.token = self._skips - before, self._token
        return out

    def _sample_list(self, idx: np.ndarray, epoch: int | None) -> Samples:
        out = Samples()
        load = functools.partial(self._load, epoch)
        for i, data in zip(idx.tolist(), self._read_batch(idx), strict=False):
            try:
                if isinstance(data, CorruptRecordError):
                    raise data
                image = self._as_pil_if_asked(self._decode(data, i, epoch))
            except CorruptRecordError as err:
                out.append(self._skip_to_next(i, err, load)[1])
                continue
            out.append(self._finish(image, i))
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

    def _fixed_shape(self) -> tuple[int, int] | None:
        if self.transform is not None or self.output == "pil":
            return None
        if self.storage.mode.holds_fixed_size_pixels:
            return self.storage.raw_hw() if self.image_modes["image"] in ("RGB", "unchanged") else None
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
                           dtype=dtype, squeeze=self.image_modes["image"] != "RGB")

    def _fill(self, idx: np.ndarray, arr: np.ndarray, epoch: int | None) -> np.ndarray | None:
        """Write the pixels of samples ``idx`` into the batch array ``arr`` [n,H,W,3].

        Returns the targets of the samples actually written when a damaged one was
        replaced (its substitute brings its own label), else None.
        """
        if self.storage.mode.holds_fixed_size_pixels and self.image_modes["image"] in ("RGB", "unchanged"):
            return self._fill_raw(idx, arr)
        damaged: dict[int, CorruptRecordError] = {}

        def decode_into_slot(j: int, data) -> None:
            # inside the shard's read (``data`` may be a view of it): decode only, the policy after
            if isinstance(data, CorruptRecordError):
                damaged[j] = data
                return
            try:
                self._decode(data, int(idx[j]), epoch, arr[j])
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


def _standard_transform_repr(transform: Callable | None, target_transform: Callable | None) -> str:
    """torchvision's ``StandardTransform.__repr__``."""
    body = ["StandardTransform"]
    for head, fn in (("Transform: ", transform), ("Target transform: ", target_transform)):
        if fn is not None:
            lines = repr(fn).splitlines()
            body += [head + lines[0]] + [" " * len(head) + line for line in lines[1:]]
    return "\n".join(body)


class LMDBImageDataset(StoreDataset):
    """A fastdata LMDB store as a ``torch.utils.data.Dataset`` (drop-in for ImageFolder)."""

    backend = "lmdb"


class HDF5ImageDataset(StoreDataset):
    """A fastdata HDF5 store as a ``torch.utils.data.Dataset`` (drop-in for ImageFolder)."""

    backend = "hdf5"


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
