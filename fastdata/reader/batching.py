"""Batches on their way from a Dataset's ``__getitems__`` to the training loop.

What crosses a DataLoader worker's queue, and how: :class:`Batch` (a fixed-shape
batch already stacked in one array), :class:`Samples` (a plain list of samples),
:func:`build_batch` (allocates a fixed-shape batch where it will travel from),
:class:`_InlineBatch` (a small batch sent through the worker's ring of
:mod:`fastdata.reader.batch_ring`, or by value) and :func:`collate`, the ``collate_fn``
that passes all of these through and carries the count of damaged samples a
worker replaced back to the main process (:data:`WORKER_SKIPS`).

The datasets only build these; nothing here knows about stores. The functions
that unpickle a batch (``_rebuild_inline``, ``_rebuild_from_ring``,
``_receive_skips``) live here, so workers and the main process resolve them by
this module's name.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from fastdata.reader import batch_ring
from fastdata.reader.chunked import ChunkedArray, check_batch_bytes

#: skips counted in DataLoader workers, received with their batches: dataset token -> count
WORKER_SKIPS: defaultdict[str, int] = defaultdict(int)


class Batch(list):
    """What ``__getitems__`` returns on the fixed-shape fast path.

    A list of ``(image, label)`` pairs (so ``default_collate`` still works) that
    also carries the already-stacked ``images`` and ``labels`` tensors; with
    :func:`collate` (the default of :func:`fastdata.loader`) the DataLoader
    uses those directly and nothing is copied again.
    """

    images: Any  # N,C,H,W tensor (channels_last strides) or N,H,W,C numpy array, of the read mode's dtype
    labels: torch.Tensor
    pixels: np.ndarray  # the N,H,W,C array the images view (N,H,W,1 for one-channel images)
    inline: bool  # built in a worker, small: crosses the queue as an _InlineBatch (see collate)
    squeeze: bool = False  # numpy output of one-channel images: [N, H, W] (see build_batch)
    skips: int = 0  # damaged samples replaced while building this batch (on_error="skip")
    token: str = ""  # the dataset's skip-counter token (see StoreDataset.skipped)
    #: a mix's batch (fastdata.mix): each sample's source id, int64; collate adds it as a third tensor
    sources: np.ndarray | None = None


class Samples(list):
    """What ``__getitems__`` returns otherwise: a plain list of samples (``(image, target)``
    pairs, or a general store's sample dicts) that also says how many damaged samples it
    replaced (``skips``), so that :func:`collate` can carry that count from a worker to the
    main process, and how :func:`collate` should collate it."""

    skips: int = 0
    token: str = ""  # the dataset's skip-counter token (see StoreDataset.skipped)
    #: ``(image, target)`` detection samples: :func:`collate` returns lists of both
    detection: bool = False
    #: the schema's ragged fields: always collated as lists (their lengths only
    #: happen to agree in some batches; a batch's type must not depend on that)
    ragged: tuple[str, ...] = ()


#: batches up to this size cross the worker queue as an :class:`_InlineBatch`
INLINE_BATCH_BYTES = 4 << 20


class _InlineBatch:
    """A small fixed-shape batch on its way from a worker to the main process.

    A tensor sent through a DataLoader queue travels as a shared-memory segment
    whose descriptor the main process fetches with a round trip to a helper
    thread of the (busy) worker; for small batches (e.g. 256 images of 32x32)
    that round trip costs more than the data. This object travels through the
    worker's batch ring (:mod:`fastdata.reader.batch_ring`: only a descriptor is
    pickled) or, while the ring is not mapped yet or full, by value, and
    unpickles straight into ``(images, labels)``.
    """

    __slots__ = ("images", "labels", "channels_first", "squeeze", "sources")

    def __init__(self, images: np.ndarray, labels: np.ndarray, channels_first: bool, squeeze: bool = False,
                 sources: np.ndarray | None = None):
        self.images, self.labels, self.channels_first, self.squeeze = images, labels, channels_first, squeeze
        self.sources = sources

    def __reduce__(self):
        images = np.ascontiguousarray(self.images)
        labels = self.labels.tobytes()
        # the pixels travel as bytes; dtype and squeeze travel beside them
        layout = (images.shape, images.dtype.str, self.channels_first, self.squeeze)
        sources = None if self.sources is None else np.asarray(self.sources, dtype=np.int64).tobytes()
        ring = batch_ring.worker_ring(images.nbytes) if torch.utils.data.get_worker_info() is not None else None
        if ring is not None and ring.attached:
            slot = ring.put(images.reshape(-1).view(np.uint8))
            if slot is not None:
                return _rebuild_from_ring, (ring.descriptor(), slot, layout, labels, sources)
        announce = ring.descriptor() if ring is not None else None
        return _rebuild_inline, (images.tobytes(), layout, labels, announce, sources)


def _rebuild_inline(image_bytes: bytes, layout: tuple, label_bytes: bytes, ring: tuple | None = None,
                    source_bytes: bytes | None = None):
    if ring is not None:
        batch_ring.attach(*ring)  # from now on that worker sends through its ring
    batch_ring.received["by_value"] += 1
    shape, dtype, channels_first, squeeze = layout
    images = np.frombuffer(bytearray(image_bytes), dtype=np.dtype(dtype)).reshape(shape)
    return _as_output(images, label_bytes, channels_first, squeeze, source_bytes)


def _rebuild_from_ring(ring: tuple[int, int, int], slot: int, layout: tuple, label_bytes: bytes,
                       source_bytes: bytes | None = None):
    shape, dtype, channels_first, squeeze = layout
    dtype = np.dtype(dtype)
    images = batch_ring.ring_array(*ring, slot, int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)
    return _as_output(images, label_bytes, channels_first, squeeze, source_bytes)


def _as_output(images: np.ndarray, label_bytes: bytes, channels_first: bool, squeeze: bool = False,
               source_bytes: bytes | None = None):
    labels = torch.from_numpy(np.frombuffer(bytearray(label_bytes), dtype=np.int64))
    if channels_first:
        out: tuple = torch.from_numpy(images).permute(0, 3, 1, 2), labels
    else:
        out = (images[..., 0] if squeeze and images.shape[-1] == 1 else images), labels
    if source_bytes is None:
        return out
    return (*out, _int64_tensor(source_bytes))


def _int64_tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.int64))


class _ByValue:
    """A small int64 tensor (a mix batch's source ids) on its way from a worker: pickled as bytes,
    unpickled as a tensor. Sent as a tensor it would be a shared-memory segment of its own,
    whose descriptor the main process fetches with a round trip to the worker."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype=np.int64)

    def __reduce__(self):
        return _int64_tensor, (self.array.tobytes(),)


def _source_ids(sources: np.ndarray):
    """A mix batch's source ids as collate returns them: an int64 tensor (by value from a worker)."""
    if torch.utils.data.get_worker_info() is not None:
        return _ByValue(sources)
    return torch.from_numpy(np.ascontiguousarray(sources, dtype=np.int64))


def collate(batch):
    """``collate_fn`` that passes a :class:`Batch` through without copying, collates
    samples that are dicts, or tuples holding a dict (``(image, target_dict)``), with
    :func:`collate_samples`, collates detection batches (a COCO store's, or
    ``(image, [annotation dict, ...])`` samples) with :func:`collate_detection` into
    ``(list of images, list of targets)``, and defers to ``default_collate`` for anything else
    (``(image, class)`` pairs). A :class:`Batch` of a mix (:func:`fastdata.mix`, which sets its
    ``sources``) gives ``(images, labels, sources)``, ``sources`` an int64 tensor of source ids.

    In a DataLoader worker, a batch in which damaged samples were replaced
    (``on_error="skip"``) also carries that count to the main process, where it
    is added to the dataset's ``skipped``; the tensors of a detection or dict batch cross
    the worker's queue packed in one shared-memory segment (see :class:`PackedBatch`).

    Samples holding ``monai.data.MetaTensor`` values (``PatchDataset(output="monai")``, or MONAI
    transforms) are collated by MONAI's own ``list_data_collate``: MetaTensors stay MetaTensors,
    batched, with each sample's affine stacked (``batch["image"].affine``: B x 4 x 4) and their meta
    data listed. MONAI is never imported for this: a batch can only hold MetaTensors once something
    else has imported it."""
    out: Any
    if _holds_meta_tensors(batch):
        from monai.data.utils import list_data_collate

        out = list_data_collate(list(batch))
    elif isinstance(batch, Batch):
        sources = getattr(batch, "sources", None)
        if getattr(batch, "inline", False):
            out = _InlineBatch(batch.pixels, batch.labels.numpy(), isinstance(batch.images, torch.Tensor),
                               getattr(batch, "squeeze", False), sources)
        else:
            out = batch.images, batch.labels
            if sources is not None:
                out = (*out, _source_ids(sources))
    elif getattr(batch, "detection", False) or _holds_annotation_lists(batch):
        out = _packed_in_worker(collate_detection(batch))
    elif _holds_dicts(batch):
        out = _packed_in_worker(collate_samples(batch, ragged=getattr(batch, "ragged", ())))
    else:
        out = torch.utils.data.default_collate(batch)
    return _with_skips(batch, out)


def _holds_meta_tensors(batch: Any) -> bool:
    """Whether the first sample of ``batch`` (a dict, a tuple/list, or a value) holds a MONAI MetaTensor."""
    meta_tensor = sys.modules.get("monai.data.meta_tensor")  # not imported: no sample can hold one
    if meta_tensor is None or isinstance(batch, Batch) or not isinstance(batch, Sequence) or not len(batch):
        return False
    first = batch[0]
    values = first.values() if isinstance(first, Mapping) else first if isinstance(first, (tuple, list)) else (first,)
    return any(isinstance(v, meta_tensor.MetaTensor) for v in values)


def _with_skips(batch, out):
    """``out``, carrying the skips made building ``batch`` when this runs in a DataLoader worker."""
    skips = getattr(batch, "skips", 0)
    if skips and torch.utils.data.get_worker_info() is not None:
        return _CountedSkips(out, batch.token, skips)
    return out


def collate_lists(batch):
    """``collate_fn`` for ``(image, label)`` samples whose images cannot always be stacked:
    ``(images, labels)`` where ``images`` is one stacked tensor when every image is a tensor of
    the same shape, else the list of images as they came (PIL images, tensors of different
    sizes), and ``labels`` an int64 tensor. A fixed-shape :class:`Batch` passes through as
    ``(images, labels)``. Skip counts reach ``dataset.skipped`` as with :func:`collate`."""
    if isinstance(batch, Batch):
        return _with_skips(batch, (batch.images, batch.labels))
    images = [item[0] for item in batch]
    labels = torch.as_tensor([int(item[1]) for item in batch])
    if images and all(isinstance(im, torch.Tensor) for im in images) and \
            len({tuple(im.shape) for im in images}) == 1:
        return _with_skips(batch, (torch.stack(images), labels))
    return _with_skips(batch, (images, labels))


class _CountedSkips:
    """A collated batch on its way from a worker, plus the skips made building it:
    unpickled in the main process, it adds them to :data:`WORKER_SKIPS` and
    turns back into the batch itself."""

    __slots__ = ("batch", "token", "skips")

    def __init__(self, batch, token: str, skips: int):
        self.batch, self.token, self.skips = batch, token, skips

    def __reduce__(self):
        return _receive_skips, (self.batch, self.token, self.skips)


def _receive_skips(batch, token: str, skips: int):
    WORKER_SKIPS[token] += skips
    return batch


_local = threading.local()


@contextmanager
def private_batches() -> Iterator[None]:
    """Within it, :func:`build_batch` allocates in this process's private memory even in a
    DataLoader worker: for a batch that is only a part of another (a mix's per-source parts,
    :mod:`fastdata.reader.mix`), copied into that one before anything travels. A fresh
    shared-memory segment per part would cost its creation and first-touch faults, where private
    memory is reused by the allocator from batch to batch: ``benchmarks/bench_mix.py`` (1000
    photos, RandomResizedCrop(224), 2 workers, batch 64, 2 cores) measured a mix of two stores at
    0.91x the direct read with shared parts, 0.96x with private ones."""
    previous = getattr(_local, "private", False)
    _local.private = True
    try:
        yield
    finally:
        _local.private = previous


def build_batch(targets: np.ndarray, shape: tuple[int, ...], fill: Callable[[np.ndarray], np.ndarray | None], *,
                channels_first: bool, target_transform: Callable | None = None, dtype: np.dtype | None = None,
                squeeze: bool = False) -> Batch:
    """Allocate a fixed-shape batch where it will travel from, let ``fill(arr)``
    write the pixels into ``arr`` ([n, H, W, C] of ``dtype``; ``shape`` is ``(H, W)`` for C = 3 or
    ``(H, W, C)``; ``dtype`` None = uint8), and wrap it as a :class:`Batch`. ``squeeze``: numpy
    output of one-channel images is [n, H, W] (as each sample's HxW array would stack).
    ``fill`` may return the batch's targets when they differ from ``targets``
    (damaged samples replaced by others), else None.

    In a DataLoader worker a batch up to :data:`INLINE_BATCH_BYTES` is built in
    private memory and crosses the queue as an :class:`_InlineBatch` (through the
    worker's batch ring, or by value); a larger
    one is built directly in shared memory with the labels in the same segment
    (each shared storage costs the main process a round trip to fetch its
    descriptor). In the main process it is plain memory.
    """
    h, w, c = shape if len(shape) == 3 else (*shape, 3)
    dtype = np.dtype(np.uint8 if dtype is None else dtype)
    torch_dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    n = len(targets)
    labels = None
    in_worker = torch.utils.data.get_worker_info() is not None and not getattr(_local, "private", False)
    nbytes = n * h * w * c * dtype.itemsize
    inline = in_worker and nbytes <= INLINE_BATCH_BYTES
    if in_worker and not inline:
        label_offset = -(-nbytes // 8)
        storage = torch.UntypedStorage._new_shared(8 * (label_offset + n))
        # torch's stubs declare set_(storage, offset, size) only with a stride too; contiguous is the default
        images = torch.empty(0, dtype=torch_dtype).set_(storage, 0, (n, h, w, c))  # type: ignore[call-overload]
        labels = torch.empty(0, dtype=torch.int64).set_(storage, label_offset, (n,))  # type: ignore[call-overload]
        labels.numpy()[:] = targets
    else:
        images = torch.empty((n, h, w, c), dtype=torch_dtype)
    arr = images.numpy()
    replaced = fill(arr)
    if replaced is not None:
        targets = replaced
        if labels is not None:
            labels.numpy()[:] = targets
    if labels is None:
        labels = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64))
    batch = Batch()
    images_out = images.permute(0, 3, 1, 2) if channels_first else (arr[..., 0] if squeeze and c == 1 else arr)
    batch.squeeze = squeeze
    batch.images = images_out
    batch.labels = labels
    batch.pixels = arr
    batch.inline = inline
    if target_transform is None:
        batch.extend(zip(images_out, labels.tolist(), strict=False))
    else:
        batch.extend((img, target_transform(int(t))) for img, t in zip(images_out, labels.tolist(), strict=False))
        batch.labels = torch.as_tensor([t for _, t in batch]) if batch else labels
    return batch


def concat_parts(parts: Sequence[Any]) -> Batch | Samples | None:
    """The batch that ``__getitems__`` of the concatenated indices would have returned, from what it
    returned for consecutive parts of them (:mod:`fastdata.reader.threads` splits the first batch of
    an epoch across its threads): :class:`Samples` joined (skips summed), or :class:`Batch` pixels
    copied into one new batch of the same layout. None when the parts are of another type, or
    batches of different layouts: then they cannot be joined, and the caller reads the batch whole."""
    if parts and all(type(p) is Samples for p in parts):
        first = parts[0]
        if any((p.token, p.detection) != (first.token, first.detection) for p in parts):
            return None
        out = Samples(item for p in parts for item in p)
        out.skips, out.token, out.detection = sum(p.skips for p in parts), first.token, first.detection
        out.ragged = tuple(sorted({name for p in parts for name in p.ragged}))
        return out
    if not parts or not all(type(p) is Batch for p in parts):
        return None
    first = parts[0]

    def layout(b: Batch) -> tuple:
        return (b.pixels.shape[1:], b.pixels.dtype, isinstance(b.images, torch.Tensor), bool(b.squeeze),
                b.sources is None, b.labels.dtype, b.token)

    if any(layout(p) != layout(first) for p in parts) or first.labels.dtype != torch.int64:
        return None
    pixels_shape, dtype, channels_first, squeeze = layout(first)[:4]
    # build_batch's shape: (H, W) for 3 channels, else (H, W, C); a squeezed batch's pixels keep their C of 1
    shape = tuple(pixels_shape[:2]) if pixels_shape[2] == 3 else tuple(pixels_shape)
    labels = np.concatenate([p.labels.numpy() for p in parts])

    def fill(arr: np.ndarray) -> None:
        start = 0
        for p in parts:
            arr[start:start + len(p.pixels)] = p.pixels
            start += len(p.pixels)

    batch = build_batch(labels, shape, fill, channels_first=channels_first, dtype=dtype, squeeze=squeeze)
    # the samples as the parts listed them (a target_transform's targets, a mix's source ids), over the new pixels
    batch[:] = [(image, *item[1:]) for image, item in zip(batch.images, (i for p in parts for i in p), strict=True)]
    if first.sources is not None:
        batch.sources = np.concatenate([p.sources for p in parts])
    batch.skips, batch.token = sum(p.skips for p in parts), first.token
    return batch


# -- samples beyond (image, class) ---------------------------------------------------------------
def _holds_dicts(batch: Sequence) -> bool:
    """Whether the batch's samples are dicts, or tuples/lists with a dict in them."""
    if not len(batch):
        return False
    first = batch[0]
    return isinstance(first, Mapping) or (
        isinstance(first, (tuple, list)) and any(isinstance(v, Mapping) for v in first))


def collate_samples(batch: Sequence, *, ragged: Collection[str] = ()) -> Any:
    """Collate samples that are dicts of fields, or ``(image, target_dict)`` tuples.

    The ``collate_fn`` for general stores (``ds[i]`` a dict of fields) and for
    detection-style samples (torchvision transforms v2: an image and a dict of
    boxes, labels, ...). :func:`collate` calls it for such batches.

    Structure:

    * dict samples -> one dict with the same keys (in the first sample's order),
      each value the collation of that field over the batch (rule below); every
      sample must have the same keys;
    * tuple/list samples -> a tuple with one entry per position, each collated by
      the rule below, except that a position holding dicts stays a *list of dicts*
      (``(image, target)`` -> ``(stacked or listed images, [target, ...])``, what
      torchvision's detection models take); every sample must have the same length.

    Values of one field (or position) over the batch become:

    1. a **list** when the field's name is in ``ragged``, whatever the shapes (numpy
       numeric arrays turned into tensors without copying);
    2. one **stacked tensor** when all are ``torch.Tensor`` of the same shape and
       dtype, or all numpy arrays of a numeric/bool dtype with the same shape and
       dtype (converted like ``default_collate``: ``torch.as_tensor``);
    3. a **list of tensors** when they are all tensors / numeric numpy arrays but
       their shapes or dtypes differ (ragged fields such as boxes ``(N, 4)``);
    4. a **tensor** for numbers: Python ``bool`` -> bool, ``int`` -> int64,
       ``float`` (or a mix of ints and floats) -> float64, numpy scalars -> their dtype;
    5. a **list** of the values for anything else: strings, bytes, JSON values
       (dicts, lists), PIL images, ``None``, or a mix of types.

    A chunked field's lazy arrays (:class:`~fastdata.reader.chunked.ChunkedArray`) are read whole
    first, where the batch is collated (in a DataLoader worker), then collated as numpy arrays:
    to train on parts of them, cut patches with :class:`fastdata.PatchDataset`. Together they
    may decode at most ``FASTDATA_MAX_BATCH_BYTES`` (default 4 GiB), checked before any is read.

    Rule 3 depends on the batch: a ragged field whose samples happen to share a
    length (every image with 2 boxes) is stacked by rule 2. Name such fields in
    ``ragged`` (``functools.partial(collate_samples, ragged={"boxes", "labels"})``)
    for a list every time.

    Args:
        batch (Sequence): the samples of one batch (non-empty).
        ragged (Collection[str]): dict keys always collated into lists.

    Returns:
        dict | tuple: the collated batch.

    Raises:
        ValueError: an empty batch, or samples whose keys or lengths differ (names
            the first differing sample).
        ReadLimitError: the batch's chunked values would decode more than the batch limit.
    """
    if not len(batch):
        raise ValueError("collate_samples: the batch is empty")
    first = batch[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for i, sample in enumerate(batch):
            if not isinstance(sample, Mapping) or list(sample) != keys:
                raise ValueError(f"collate_samples: sample {i} of the batch has keys {_keys_of(sample)}, "
                                 f"sample 0 has {keys}; every sample of a batch needs the same fields")
        check_batch_bytes([s[key] for s in batch for key in keys])  # before any lazy value is read
        columns = {key: _read_lazy([s[key] for s in batch]) for key in keys}
        stacked = _stack_in_ring({key: values for key, values in columns.items() if key not in ragged})
        return {key: stacked[key] if key in stacked else _collate_values(values, key in ragged)
                for key, values in columns.items()}
    if isinstance(first, (tuple, list)):
        for i, sample in enumerate(batch):
            if not isinstance(sample, (tuple, list)) or len(sample) != len(first):
                raise ValueError(f"collate_samples: sample {i} of the batch is not a tuple of {len(first)} "
                                 "items like sample 0")
        check_batch_bytes([v for s in batch for v in s])
        positions = zip(*batch, strict=True)
        return tuple(list(col) if isinstance(col[0], Mapping) else _collate_values(list(col), False)
                     for col in positions)
    check_batch_bytes(batch)
    return _collate_values(list(batch), False)


def _holds_annotation_lists(batch: Sequence) -> bool:
    """Whether every sample is ``(image, [annotation dict, ...])`` (``CocoDetection``'s samples)."""
    return bool(len(batch)) and all(
        isinstance(s, tuple | list) and len(s) == 2 and isinstance(s[1], list)
        and all(isinstance(a, Mapping) for a in s[1]) for s in batch)


def collate_detection(batch: Sequence) -> Any:
    """``(images, targets)`` as two lists, like torchvision's detection references
    (``tuple(zip(*batch))``): images keep their own sizes, targets (annotation lists or
    target dicts) stay as they are. Samples that are not 2-tuples go to :func:`collate_samples`.

    Args:
        batch (Sequence): ``(image, target)`` samples (e.g. a COCO store's batch).

    Returns:
        tuple[list, list] | Any: the images and the targets.
    """
    if len(batch) and all(isinstance(s, tuple | list) and len(s) == 2 for s in batch):
        return [s[0] for s in batch], [s[1] for s in batch]
    return collate_samples(batch)


def _keys_of(sample: Any) -> Any:
    return list(sample) if isinstance(sample, Mapping) else type(sample).__name__


def _is_numeric_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind in "biuf"


def _as_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A tensor viewing ``value``; a read-only or non-native-endian array (decoded
    straight from a record) is copied first, which torch requires."""
    if isinstance(value, torch.Tensor):
        return value
    if not value.flags.writeable or not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return torch.from_numpy(value)


def _read_lazy(values: list) -> list:
    """``values`` with lazy chunked arrays read whole: here, in the worker that collates (a lazy
    array sent on to the main process would be read there, by one process, whatever the worker
    count)."""
    if values and all(isinstance(v, ChunkedArray) for v in values):
        return [v[...] for v in values]
    return values


def _stack_in_ring(columns: dict[str, list]) -> dict[str, torch.Tensor]:
    """In a DataLoader worker, the fields of ``columns`` whose values all are numeric arrays or
    tensors of one shape and dtype, stacked together into one slot of the worker's batch ring
    (:func:`fastdata.reader.batch_ring.lend`); empty where there is no such field, outside a
    worker, or while the ring is not mapped by the main process or has no free slot (the fields
    are then collated one by one).

    Why: ``default_collate`` stacks each field into a shared-memory segment of its own, made for
    that batch, and the main process fetches each segment's descriptor with a round trip to the
    worker (measured on batches of four 96^3 patches of a CT and a label volume: 4 round trips
    and ~1.1 ms of the main process per patch, plus the page faults of ~10 MB of fresh segments
    in the worker). A ring slot is mapped once and reused: only its number crosses the queue."""
    if torch.utils.data.get_worker_info() is None:
        return {}
    stackable: dict[str, list[torch.Tensor]] = {}
    for key, values in columns.items():
        if values and all(isinstance(v, torch.Tensor) or _is_numeric_array(v) for v in values):
            tensors = [_as_tensor(v) for v in values]
            first = tensors[0]
            if (all(t.shape == first.shape and t.dtype == first.dtype for t in tensors) and first.device.type == "cpu"
                    and not any(t.requires_grad for t in tensors)):
                stackable[key] = tensors
    if not stackable:
        return {}
    sizes = {key: len(ts) * ts[0].numel() * ts[0].element_size() for key, ts in stackable.items()}
    slot = batch_ring.lend(max(1, sum(aligned(n) for n in sizes.values())))
    if slot is None:
        return {}
    flat = torch.from_numpy(slot)  # keeps the slot's array (and so the slot) alive
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for key, tensors in stackable.items():
        view = flat[offset:offset + sizes[key]].view(tensors[0].dtype).view(len(tensors), *tensors[0].shape)
        torch.stack(tensors, out=view)
        out[key] = view
        offset += aligned(sizes[key])
    return out


def _collate_values(values: list, always_list: bool) -> Any:
    """One field over the batch, by the rule of :func:`collate_samples`."""
    values = _read_lazy(values)
    if all(isinstance(v, torch.Tensor) or _is_numeric_array(v) for v in values):
        tensors = [_as_tensor(v) for v in values]
        if not always_list and len({(t.shape, t.dtype) for t in tensors}) == 1:
            # default_collate stacks straight into shared memory inside a worker (no copy on the queue)
            return torch.utils.data.default_collate(tensors)
        return tensors
    if always_list:
        return values
    if all(isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.bool)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.float64)
    if all(isinstance(v, np.generic) and v.dtype.kind in "biuf" for v in values) and \
            len({v.dtype for v in values}) == 1:
        return torch.as_tensor(np.array(values))
    return values


# -- one shared segment per batch of ragged tensors ----------------------------------------------
#: containers this deep below the batch are searched for tensors (a detection batch:
#: tuple -> list of targets -> target dict -> tensor)
_PACK_DEPTH = 4
_PACK_ALIGN = 64
_SCALARS = (int, float, str, bytes, bool, type(None))
#: tensors a packed batch would copy into a new segment travel inside the pickle instead up to
#: this many bytes in all
BY_VALUE_BYTES = 64 << 10
#: batches received packed in this (main) process (for tests and diagnosis)
received_packed = 0


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment pieces of a packed segment start at."""
    return -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN


def new_segment(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` (at least 1) in a shared-memory segment of its own."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)))


class _Slot:
    """Where the ``k``-th packed tensor goes back into the batch."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __reduce__(self):
        return _Slot, (self.k,)


class PackedBatch:
    """A collated batch on its way from a DataLoader worker, its tensors in few segments.

    torch sends every tensor of a batch as a shared-memory segment of its own, whose
    descriptor the main process then fetches with a round trip to a helper thread of the
    (busy) worker, even for tensors that view one segment: a detection batch of 32 images
    of different sizes plus their boxes and labels is about a hundred segments and round
    trips. Pickled, this object sends each shared-memory segment its tensors view once
    (images a dataset decoded straight into one batch segment), copies the other tensors
    into one new segment, each in its own memory order (a CHW view of HWC pixels keeps its
    strides), and unpickles every tensor as a view with its original shape, strides and
    dtype. A segment lives as long as any tensor viewing it does.

    CPU tensors without gradients are handled, found in tuples, lists and dicts down to
    :data:`_PACK_DEPTH` levels; a subclass (torchvision's ``tv_tensors``) comes back as its
    class with its attributes (``format``, ``canvas_size``...). Anything else (PIL images:
    packing their pixels measured no faster than pickling them) travels as torch sends
    it. In the main process nothing is pickled and the batch is used as it is.
    """

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch

    def __reduce__(self):
        tensors: list[torch.Tensor] = []
        skeleton = _extract(self.batch, tensors)
        ring = batch_ring.current_ring()
        if len(tensors) < 2 and (ring is None or ring.attached):  # nothing to gain
            return _identity, (self.batch,)
        # flat uint8 tensors over whole storages, or (ring descriptor, slot, slot bytes)
        segments: list[Any] = []
        segment_of: dict[Any, int] = {}
        metas: list[tuple] = []
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (tensor, its memory block, byte offset)
        fresh = 0
        for t in tensors:
            wrap: tuple | None = None
            if type(t) is not torch.Tensor:
                # a subclass (tv_tensors.BoundingBoxes...) travels as its data plus its class and
                # attributes (what torch's own pickling of it keeps)
                wrap = (type(t), dict(t.__dict__))
                t = t.as_subclass(torch.Tensor)
            where = ring.locate(t.data_ptr()) if ring is not None and t.numel() else None
            if where is not None and ring is not None:  # decoded into a slot lent by the ring
                slot, offset = where
                k = segment_of.get(("ring", slot))
                if k is None:
                    k = segment_of[("ring", slot)] = len(segments)
                    segments.append((ring.descriptor(), slot, ring.slot_bytes))
                    ring.sent.add(slot)
                metas.append((k, offset // t.element_size(), t.dtype, tuple(t.shape), t.stride(), wrap))
                continue
            if t.is_shared():
                storage = t.untyped_storage()
                k = segment_of.get(storage.data_ptr())
                if k is None:
                    k = segment_of[storage.data_ptr()] = len(segments)
                    segments.append(torch.empty(0, dtype=torch.uint8).set_(storage))
                metas.append((k, t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), wrap))
                continue
            block = _memory_block(t)
            if block is None:  # overlapping or strided: sent as a contiguous copy
                t = t.contiguous()
                block = t
            metas.append((-1, fresh // t.element_size(), t.dtype, tuple(t.shape), t.stride(), wrap))
            copies.append((t, block, fresh))
            fresh += aligned(block.numel() * block.element_size())
        if copies and fresh <= BY_VALUE_BYTES:
            # a few small tensors (sample numbers, positions): bytes in the pickle cost less than a
            # new segment and a descriptor round trip to the worker
            flat = torch.empty(fresh, dtype=torch.uint8)
            for t, block, offset in copies:
                nbytes = block.numel() * block.element_size()
                flat[offset:offset + nbytes].view(t.dtype).view(block.shape).copy_(block)
            metas = [(len(segments), *m[1:]) if m[0] == -1 else m for m in metas]
            segments.append(flat.numpy().tobytes())
        elif copies:
            flat = new_segment(fresh)
            for t, block, offset in copies:
                nbytes = block.numel() * block.element_size()
                flat[offset:offset + nbytes].view(t.dtype).view(block.shape).copy_(block)
            metas = [(len(segments), *m[1:]) if m[0] == -1 else m for m in metas]
            segments.append(flat)
        # a ring the main process has not mapped yet: announced, so the next batches can use it
        announce = ring.descriptor() if ring is not None and not ring.attached else None
        return _rebuild_packed, (skeleton, segments, metas, announce)


def _memory_block(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` permuted into the order its elements lie in memory, when that is one contiguous
    block (a CHW view of HWC pixels: its HWC block); None for a strided or overlapping view."""
    strides, sizes = t.stride(), t.shape
    block = t.permute(sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d])))
    return block if block.is_contiguous() else None


def _packable(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad)


def _replace_leaves(obj: Any, leaf: Callable[[Any], Any], depth: int = 0) -> Any:
    """``obj`` with every value ``leaf`` maps to something other than itself replaced, found
    in tuples, lists and dicts down to :data:`_PACK_DEPTH` levels (a list that starts with a
    number or text, such as a polygon, is not searched)."""
    new = leaf(obj)
    if new is not obj or depth >= _PACK_DEPTH:
        return new
    kind = type(obj)
    if kind is list or kind is tuple:
        if obj and isinstance(obj[0], _SCALARS):
            return obj
        items = [_replace_leaves(v, leaf, depth + 1) for v in obj]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {k: _replace_leaves(v, leaf, depth + 1) for k, v in obj.items()}
    return obj


def _extract(obj: Any, out: list) -> Any:
    """``obj`` with its packable tensors replaced by :class:`_Slot` markers (appended to ``out``)."""
    def to_slot(value: Any) -> Any:
        if not _packable(value):
            return value
        out.append(value)
        return _Slot(len(out) - 1)

    return _replace_leaves(obj, to_slot)


def _fill(skeleton: Any, tensors: list) -> Any:
    """The batch again: every :class:`_Slot` of ``skeleton`` replaced by its tensor."""
    return _replace_leaves(skeleton, lambda value: tensors[value.k] if type(value) is _Slot else value)


def _rebuild_packed(skeleton: Any, segments: list[Any], metas: list[tuple], announce: tuple | None = None) -> Any:
    global received_packed
    if announce is not None:
        batch_ring.attach(*announce)
    received_packed += 1
    storages = [_segment_storage(segment) for segment in segments]
    tensors: list[torch.Tensor] = []
    for k, offset, dtype, shape, stride, wrap in metas:
        tensor = torch.empty(0, dtype=dtype).set_(storages[k], offset, shape, stride)
        if wrap is not None:
            cls, state = wrap
            tensor = tensor.as_subclass(cls)
            tensor.__dict__.update(state)
        tensors.append(tensor)
    return _fill(skeleton, tensors)


def _segment_storage(segment: Any) -> torch.UntypedStorage:
    """The storage a packed segment arrives as: a shared tensor's, or a ring slot's (the
    slot is freed when every tensor viewing it is gone)."""
    if isinstance(segment, bytes):
        return torch.frombuffer(bytearray(segment), dtype=torch.uint8).untyped_storage()
    if isinstance(segment, tuple):
        (pid, fd, inode), slot, nbytes = segment
        return torch.from_numpy(batch_ring.ring_array(pid, fd, inode, slot, nbytes)).untyped_storage()
    return segment.untyped_storage()


def _identity(batch: Any) -> Any:
    return batch


def _packed_in_worker(out: Any) -> Any:
    """``out`` as a :class:`PackedBatch` inside a DataLoader worker, else unchanged."""
    return PackedBatch(out) if torch.utils.data.get_worker_info() is not None else out
