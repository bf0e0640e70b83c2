"""Samples (dicts of typed fields) from Python as write sources (``fastdata.write``).

The samples go through the same write session and pipeline as ``fastdata convert``
(worker pool, bounded window, one writer per shard, sidecars, lock, atomic
publish, manifest last) as one of two inputs:

* a *map-style* input (``__len__`` and ``__getitem__``: a list, a
  ``torch.utils.data.Dataset``) is handed to every worker once (pickled like a
  DataLoader's dataset, or inherited through fork); workers receive index ranges
  and call ``samples[i]`` themselves, so reading, image validation and encoding
  all run in parallel, and the plan (shards as index ranges) is known up front,
  which makes ``resume=True`` possible (:class:`MapInput`);
* any other *iterable* is iterated in this process and sent to the workers in
  chunks; it cannot be resumed (an iterator cannot be re-read from where it
  stopped): ``resume=True`` refuses it, rerun with ``overwrite=True`` (:class:`IterInput`).

Every sample is checked against the schema (inferred from the first sample when
not given); the first mismatch stops the write with a :class:`SchemaError`
naming the sample and the field, and nothing is published.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import xxhash

from fastdata.common.imageio import ARRAY_IMAGE_DTYPES, ImageDecodeError, ImageInfo, encode_lossless, inspect_image
from fastdata.errors import RejectedInputError
from fastdata.format.fields import Chunked, Schema, SchemaError
from fastdata.format.record import EncodedSample, encode_sample
from fastdata.format.manifest import canonical_json
from fastdata.writer.ingest import Rejected, read_bytes, spill
from fastdata.writer.chunking import portable, write_chunks
from fastdata.writer.pipeline import WRITE_SOURCE, Chunk, ChunkSource, staging_path
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.base import WriteSource


class MapStyle(Protocol):
    """A map-style dataset (``__len__`` and ``__getitem__``, like a torch ``Dataset``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


#: the map-style dataset of this worker process (set by the pool initializer)
_SAMPLES: Any = None


def set_samples(samples: Any) -> None:
    """Worker initializer: keep the map-style dataset for :func:`encode_chunk` (None: let it go)."""
    global _SAMPLES
    _SAMPLES = samples


#: PIL modes whose pixels a PNG cannot hold exactly (16-bit, 32-bit integer and float grayscale):
#: stored from their array by :func:`~fastdata.common.imageio.encode_lossless`
_DEEP_PIL_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})


def _as_pixel_array(value: Any) -> np.ndarray | None:
    """The pixels of a numpy array or a torch tensor image value (a CPU copy of a tensor), else None."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return None


def _array_image(array: np.ndarray, where: str) -> tuple[bytes, ImageInfo]:
    """An image array (HxW or HxWxC of :data:`~fastdata.common.imageio.ARRAY_IMAGE_DTYPES`, any
    channel count) encoded losslessly (:func:`~fastdata.common.imageio.encode_lossless`: a PNG for
    8-bit images of up to 4 channels, else a zstd TIFF), with what the index records of it."""
    if array.dtype.name not in ARRAY_IMAGE_DTYPES or array.ndim not in (2, 3) or 0 in array.shape:
        raise SchemaError(f"{where}: an image array must be HxW or HxWxC (channels last) of dtype "
                          f"{', '.join(ARRAY_IMAGE_DTYPES)}; got {array.dtype} of shape {tuple(array.shape)}")
    if array.dtype.byteorder == ">":  # (the stored file has its own byte order; the values are what count)
        array = array.astype(array.dtype.newbyteorder("="))
    data, fmt = encode_lossless(array)
    channels = 1 if array.ndim == 2 else int(array.shape[2])
    return data, ImageInfo(fmt, int(array.shape[1]), int(array.shape[0]), array.dtype.name, channels)


class SourcedBytes(bytes):
    """An image's bytes read from elsewhere than a local path (a URL), with where they came from
    (``source``, UTF-8): kept as the sample's source path, as a path value's path is."""

    source: bytes = b""


def encoded_image_bytes(value: Any, where: str) -> tuple[bytes, bytes, ImageInfo | None]:
    """``(encoded bytes, relpath, info)`` of an image field value: bytes as they are, a path
    read (its path kept as the sample's source path), a PIL image encoded as PNG (16-bit, 32-bit
    and float grayscale ones losslessly as TIFF), a numpy array or torch tensor encoded losslessly
    (:func:`_array_image`). ``info`` is known for the values encoded here (None: validate the bytes)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), getattr(value, "source", b""), None  # (SourcedBytes: fetched from a URL)
    if isinstance(value, str | os.PathLike):
        path = os.fsencode(value)
        try:
            return read_bytes(path), path, None
        except Rejected as why:
            raise RejectedInputError(f"{where}: {os.fsdecode(path)}: {why}") from None
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
        if value.mode in _DEEP_PIL_MODES:
            pixels = np.array(value)
            data, info = _array_image(pixels.astype(np.uint16) if value.mode.startswith("I;16") else pixels, where)
            return data, b"", info
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue(), b"", None
    array = _as_pixel_array(value)
    if array is not None:
        data, info = _array_image(array, where)
        return data, b"", info
    raise SchemaError(f"{where}: an image field takes bytes, a path, a PIL image, a numpy array or a torch tensor, "
                      f"got {type(value).__name__}")


def prepare_sample(schema: Schema, sample: Any, index: int, chunk_dir: str | None = None) -> EncodedSample:
    """One sample read, validated and encoded as a version-2 record (runs in workers).

    Image values are turned into encoded bytes and fully decoded under the image
    policy (:func:`fastdata.common.imageio.inspect_image`), which gives their stored format,
    size, dtype and channels (arrays encoded here are not decoded again: their
    encoding is lossless and their shape and dtype known); then :meth:`Schema.check`
    validates every field. Chunked fields are read and compressed chunk by chunk into files in
    ``chunk_dir`` (:func:`fastdata.writer.chunking.write_chunks`; None: measured, not kept).

    Raises:
        SchemaError: the sample does not match the schema (names the sample and field).
        RejectedInputError: an image is unreadable or not a usable image.
    """
    where = f"sample {index}"
    if not isinstance(sample, Mapping):
        raise SchemaError(f"{where}: expected a dict of field name -> value, got {type(sample).__name__}")
    values = dict(sample)
    images: dict[str, tuple] = {}
    relpath = b""
    for name in schema.image_fields():
        if name not in values:
            continue  # Schema.check names the missing key
        field_where = f"{where} field {name!r}"
        data, path, info = encoded_image_bytes(values[name], field_where)
        relpath = relpath or path
        if info is None:
            try:
                info = inspect_image(data)
            except ImageDecodeError as err:
                named = f"{field_where}: {os.fsdecode(path)}" if path else field_where
                raise RejectedInputError(f"{named}: not a usable image ({err})") from None
        images[name] = (info.format, info.width, info.height, info.dtype, info.channels)
        values[name] = data
    checked = schema.check(values, where)
    pending = []
    try:
        for name in schema.chunked_fields():
            field = schema[name]
            assert isinstance(field, Chunked)
            checked[name], waiting = write_chunks(field, name, checked[name], f"{where} field {name!r}", chunk_dir)
            if waiting is not None:
                pending.append(waiting)
        return encode_sample(schema, checked, images, relpath or str(index).encode(), tuple(pending))
    except BaseException:
        for waiting in pending:
            os.unlink(waiting.path)
        raise


def prepare_or_reject(schema: Schema, sample: Any, index: int, strict: bool,
                      chunk_dir: str | None = None) -> EncodedSample | str:
    """:func:`prepare_sample`, or with ``strict=False`` the reason (``str``) why an image
    value is unusable (unreadable file, not an image): the pipeline skips and reports it."""
    try:
        return prepare_sample(schema, sample, index, chunk_dir)
    except RejectedInputError as err:
        if strict:
            raise
        return str(err)


def _item_or_reject(schema: Schema, samples: Any, k: int, index: int, strict: bool,
                    chunk_dir: str | None = None) -> EncodedSample | str:
    """:func:`prepare_or_reject` of ``samples[k]`` (sample ``index``); a map-style dataset may reject
    an item itself by raising :class:`RejectedInputError` from ``__getitem__`` (reported unless ``strict``)."""
    try:
        item = samples[k]
    except RejectedInputError as err:
        if strict:
            raise
        return str(err)
    return prepare_or_reject(schema, item, index, strict, chunk_dir)


def encode_chunk(schema: Schema, start: int, stop: int, items: list | None, strict: bool, chunk_dir: str | None,
                 spill_dir: str | None):
    """Worker entry point: samples ``start .. stop-1`` (``items``, or from the map-style
    dataset given to this worker) as :class:`EncodedSample` objects (or rejection reasons
    when not ``strict``), the chunks of chunked fields written into files in ``chunk_dir``;
    see :class:`~fastdata.writer.pipeline.ChunkSource` for the return value. A dataset with a
    ``prefetch(start, stop)`` method is told the range first (a remote source starts its GETs)."""
    prefetch = getattr(_SAMPLES, "prefetch", None) if items is None else None
    if prefetch is not None:
        prefetch(start, stop)
    results = [_item_or_reject(schema, items if items is not None else _SAMPLES, k if items is not None else start + k,
                               start + k, strict, chunk_dir) for k in range(stop - start)]
    nbytes = sum(r.stored_bytes for r in results if not isinstance(r, str))
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class _SampleSource(ChunkSource):
    worker = staticmethod(encode_chunk)

    def describe(self, start: int, stop: int) -> str:
        return f"samples {start} .. {stop - 1}"

    def input_name(self, i: int) -> str:
        return f"sample {i}"


def portable_samples(samples: Any, schema: Schema) -> Any:
    """A list or tuple of sample dicts with its chunked values in a form that pickles light
    (:func:`fastdata.writer.chunking.portable`: memmaps and h5py datasets as references), since
    the samples travel to every worker process; any other map-style dataset as it is (it makes
    its values in the workers, from ``__getitem__``)."""
    chunked = schema.chunked_fields()
    if not chunked or not isinstance(samples, list | tuple):
        return samples
    return [{k: portable(v) if k in chunked else v for k, v in s.items()} if isinstance(s, Mapping) else s
            for s in samples]


class MapSource(_SampleSource):
    """A map-style dataset, split into index ranges (the plans) the workers read themselves."""

    def __init__(self, samples: Any, schema: Schema, chunk_size: int, strict: bool = True,
                 chunk_dir: str | None = None):
        self.schema, self.chunk_size, self.strict, self.chunk_dir = schema, chunk_size, strict, chunk_dir
        self.worker_init = (set_samples, (portable_samples(samples, schema),))
        # a dataset may name its inputs (e.g. a COCO image's file name) for rejected.tsv
        self._names = getattr(samples, "input_name", None)

    def input_name(self, i: int) -> str:
        return str(self._names(i)) if callable(self._names) else super().input_name(i)

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            if plan.start == plan.stop:
                yield Chunk(plan, plan.start, plan.stop, True,
                            (self.schema, plan.start, plan.stop, None, self.strict, self.chunk_dir))
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop, (self.schema, a, b, None, self.strict, self.chunk_dir))


class IterSource(_SampleSource):
    """An iterable, iterated here; shards of ``per_shard`` samples, the last one shorter (it
    makes its shards as it goes: given no plans)."""

    def __init__(self, iterator: Iterator, schema: Schema, per_shard: int, chunk_size: int,
                 chunk_dir: str | None = None):
        self.iterator, self.schema, self.per_shard, self.chunk_size = iterator, schema, per_shard, chunk_size
        self.chunk_dir = chunk_dir
        self._chunked = schema.chunked_fields()

    def _portable(self, sample: Any) -> Any:
        """``sample`` with its chunked values in a form that pickles light (memmaps and h5py
        datasets as references the worker reopens: :func:`fastdata.writer.chunking.portable`)."""
        if not self._chunked or not isinstance(sample, Mapping):
            return sample
        return {k: portable(v) if k in self._chunked else v for k, v in sample.items()}

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        end = object()
        nxt = next(self.iterator, end)
        if nxt is end:
            yield Chunk(ShardPlan(0, 0, 0), 0, 0, True, (self.schema, 0, 0, [], True, self.chunk_dir))
            return
        pos, shard = 0, 0
        while nxt is not end:
            first = pos
            while nxt is not end and pos - first < self.per_shard:
                items: list = []
                a = pos
                while nxt is not end and len(items) < self.chunk_size and pos - first < self.per_shard:
                    items.append(self._portable(nxt))
                    pos += 1
                    nxt = next(self.iterator, end)
                last = nxt is end or pos - first >= self.per_shard
                yield Chunk(ShardPlan(shard, first, pos), a, pos, last,
                            (self.schema, a, pos, items, True, self.chunk_dir))
            shard += 1


def is_map_style(samples: Any) -> bool:
    """Whether ``samples`` is a map-style dataset (``__len__`` and ``__getitem__``, not a dict or a string)."""
    return (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
            and not isinstance(samples, Mapping | str | bytes))


def _estimate(encoded: list[EncodedSample]) -> int:
    """Bytes a sample takes in a shard (record plus index entries), from a few encoded ones."""
    if not encoded:
        return 1
    return max(1, int(np.mean([e.stored_bytes + len(e.relpath) + 16 + 8 * len(e.index) for e in encoded])))


def _fingerprint(backend: str, shard_bytes: int, count: int, schema: Schema, encoded: list[EncodedSample],
                 metadata: Mapping[str, Any] | None = None) -> str:
    """What identifies a map-style write for ``resume``: backend, shard size, length,
    schema, and the encoded records of a few samples spread over the dataset (first,
    quartiles, last). A resume whose dataset differs in any of these is refused; a
    change elsewhere in a large dataset is not detected (the price of not reading it twice)."""
    h = xxhash.xxh3_128()
    h.update(repr((backend, shard_bytes, count, schema.to_json())).encode())
    if metadata is not None:
        h.update(canonical_json(dict(metadata)))
    for e in encoded:
        h.update(e.record)
        h.update(repr(sorted((k, np.asarray(v).tolist()) for k, v in e.index.items())).encode())
    return h.hexdigest()


def _chain(first: list, rest: Iterator) -> Iterator:
    yield from first
    yield from rest


class _SamplesInput(WriteSource):
    """What both Python inputs share: a general store of ``schema`` (inferred from the first
    sample when None), ``metadata`` kept in the manifest, the Python spelling of the flags."""

    unit = "samples"
    progress_label = "write"
    made_from = "written from other samples or options"
    reuses_recorded_options = False
    staging_source = WRITE_SOURCE
    #: whether the manifest says a resume is possible
    resumable = True

    def __init__(self, samples: Any, schema: Schema | Mapping[str, Any] | None = None,
                 metadata: Mapping[str, Any] | None = None):
        super().__init__(WRITE_SOURCE)
        self.samples, self.declared, self.metadata = samples, schema, metadata
        self.per_shard = 1
        #: where the workers leave chunks of chunked fields for the shard writer (set by plan)
        self.chunk_dir: str | None = None

    def _schema(self, first: list) -> Schema:
        if self.declared is not None:
            return Schema.of(self.declared)
        if not first:
            raise SchemaError("cannot infer a schema from no samples: pass schema=")
        return Schema.of(Schema.infer(first[0], "sample 0"))

    def _checked_schema(self) -> Schema:
        assert self.schema is not None, "the schema is known once planned"
        return self.schema

    def options_text(self, run: RunOptions) -> str:
        return f"{run.backend}, shard size {run.shard_size}"

    def manifest_options(self) -> dict[str, Any]:
        return {"resumable": self.resumable}

    def manifest_extra(self) -> dict[str, Any] | None:
        return {"metadata": dict(self.metadata)} if self.metadata is not None else None


class MapInput(_SamplesInput):
    """A map-style dataset (``samples[i]`` for ``i < len(samples)``): planned up front as index
    ranges of about ``shard_size`` bytes (estimated from a few encoded samples), resumable."""

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.chunk_dir = staging_path(dst)
        samples = self.samples
        count = self.count = len(samples)
        schema = self.schema = self._schema([samples[0]] if count and self.declared is None else [])
        picks = sorted({0, count // 4, count // 2, 3 * count // 4, count - 1}) if count else []
        prepared = [_item_or_reject(schema, samples, i, i, run.strict) for i in picks]
        self.probe = [p for p in prepared if not isinstance(p, str)]
        per_shard = max(1, run.shard_size.bytes // _estimate(self.probe))
        plans = [ShardPlan(k, a, min(a + per_shard, count)) for k, a in enumerate(range(0, count, per_shard))]
        return plans or [ShardPlan(0, 0, 0)]

    def fingerprint(self, run: RunOptions) -> str:
        return _fingerprint(run.backend, run.shard_size.bytes, self.count, self._checked_schema(), self.probe,
                            self.metadata)

    def chunks(self, run: RunOptions, chunk_size: int) -> MapSource:
        return MapSource(self.samples, self._checked_schema(), chunk_size, run.strict, self.chunk_dir)


class IterInput(_SamplesInput):
    """An iterable, iterated in this process: shards of about ``shard_size`` bytes (estimated
    from the first sample) made as it goes; not resumable."""

    resume_refusal = ("resume=True needs a map-style dataset (__len__ and __getitem__): an iterable cannot be "
                      "re-read from where it stopped; rerun with overwrite=True to write it from scratch")
    resumable = False

    def plan(self, run: RunOptions, dst: str) -> None:
        self.chunk_dir = staging_path(dst)
        iterator = iter(self.samples)
        first = [s for s in [next(iterator, None)] if s is not None]
        self.iterator = _chain(first, iterator)
        schema = self.schema = self._schema(first)
        probe = [prepare_sample(schema, first[0], 0)] if first else []
        self.per_shard = max(1, run.shard_size.bytes // _estimate(probe))
        return None

    def fingerprint(self, run: RunOptions) -> str:
        return os.urandom(16).hex()  # an iterable is never resumed: no run matches another

    def chunks(self, run: RunOptions, chunk_size: int) -> IterSource:
        return IterSource(self.iterator, self._checked_schema(), self.per_shard, chunk_size, self.chunk_dir)


__all__ = ["IterInput", "MapInput", "is_map_style", "prepare_sample"]
