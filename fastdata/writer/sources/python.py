"""``fastdata.write``: store any samples (dicts of typed fields) from Python.

The samples feed the same writer pipeline as ``fastdata convert`` (``pipeline.py``:
worker pool, bounded window, one writer per shard, sidecars, lock, atomic
publish, manifest last) through a :class:`~fastdata.writer.pipeline.ChunkSource`:

* a *map-style* input (``__len__`` and ``__getitem__``: a list, a
  ``torch.utils.data.Dataset``) is handed to every worker once (pickled like a
  DataLoader's dataset, or inherited through fork); workers receive index ranges
  and call ``samples[i]`` themselves, so reading, image validation and encoding
  all run in parallel, and the plan (shards as index ranges) is known up front,
  which makes ``resume=True`` possible;
* any other *iterable* is iterated in this process and sent to the workers in
  chunks; it cannot be resumed (an iterator cannot be re-read from where it
  stopped): ``resume=True`` refuses it, rerun with ``overwrite=True``.

Every sample is checked against the schema (inferred from the first sample when
not given); the first mismatch stops the write with a :class:`SchemaError`
naming the sample and the field, and nothing is published.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import xxhash

from fastdata.common.imageio import ImageDecodeError, validate_image
from fastdata.errors import RejectedInputError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.fields import Schema, SchemaError
from fastdata.format.record import EncodedSample, encode_sample
from fastdata.writer.ingest import Rejected, read_bytes
from fastdata.writer.pipeline import Chunk, ChunkSource
from fastdata.writer.plan import ShardPlan


class MapStyle(Protocol):
    """A map-style dataset (``__len__`` and ``__getitem__``, like a torch ``Dataset``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


#: samples whose encodings the resume fingerprint hashes (spread over the dataset)
FINGERPRINT_SAMPLES = 5
#: the map-style dataset of this worker process (set by the pool initializer)
_SAMPLES: Any = None


def _set_samples(samples: Any) -> None:
    """Worker initializer: keep the map-style dataset for :func:`encode_chunk`."""
    global _SAMPLES
    _SAMPLES = samples


def _image_bytes(value: Any, where: str) -> tuple[bytes, bytes]:
    """``(encoded bytes, relpath)`` of an image field value: bytes as they are, a path
    read (its path kept as the sample's source path), a PIL image or an HWC/HW uint8
    array encoded losslessly as PNG."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), b""
    if isinstance(value, str | os.PathLike):
        path = os.fsencode(value)
        try:
            return read_bytes(path), path
        except Rejected as why:
            raise RejectedInputError(f"{where}: {os.fsdecode(path)}: {why}") from None
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue(), b""
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] not in (1, 3, 4)):
            raise SchemaError(f"{where}: an image array must be uint8 HxW or HxWxC (C in 1, 3, 4), "
                              f"got {value.dtype} {value.shape}")
        from PIL import Image as PILImage

        buf = io.BytesIO()
        PILImage.fromarray(value[..., 0] if value.ndim == 3 and value.shape[2] == 1 else value).save(buf, "PNG")
        return buf.getvalue(), b""
    raise SchemaError(f"{where}: an image field takes bytes, a path, a PIL image or a uint8 array, "
                      f"got {type(value).__name__}")


def prepare_sample(schema: Schema, sample: Any, index: int) -> EncodedSample:
    """One sample read, validated and encoded as a version-2 record (runs in workers).

    Image values are turned into encoded bytes and fully decoded under the image
    policy (:func:`fastdata.common.imageio.open_image`), which gives their stored format
    and size; then :meth:`Schema.check` validates every field.

    Raises:
        SchemaError: the sample does not match the schema (names the sample and field).
        RejectedInputError: an image is unreadable or not a usable image.
    """
    where = f"sample {index}"
    if not isinstance(sample, Mapping):
        raise SchemaError(f"{where}: expected a dict of field name -> value, got {type(sample).__name__}")
    values = dict(sample)
    images: dict[str, tuple[str, int, int]] = {}
    relpath = b""
    for name in schema.image_fields():
        if name not in values:
            continue  # Schema.check names the missing key
        field_where = f"{where} field {name!r}"
        data, path = _image_bytes(values[name], field_where)
        relpath = relpath or path
        try:
            images[name] = validate_image(data)
        except ImageDecodeError as err:
            named = f"{field_where}: {os.fsdecode(path)}" if path else field_where
            raise RejectedInputError(f"{named}: not a usable image ({err})") from None
        values[name] = data
    checked = schema.check(values, where)
    return encode_sample(schema, checked, images, relpath or str(index).encode())


def prepare_or_reject(schema: Schema, sample: Any, index: int, strict: bool) -> EncodedSample | str:
    """:func:`prepare_sample`, or with ``strict=False`` the reason (``str``) why an image
    value is unusable (unreadable file, not an image): the pipeline skips and reports it."""
    try:
        return prepare_sample(schema, sample, index)
    except RejectedInputError as err:
        if strict:
            raise
        return str(err)


def encode_chunk(schema: Schema, start: int, stop: int, items: list | None, strict: bool, spill_dir: str | None):
    """Worker entry point: samples ``start .. stop-1`` (``items``, or from the map-style
    dataset given to this worker) as :class:`EncodedSample` objects (or rejection reasons
    when not ``strict``); see :class:`~fastdata.writer.pipeline.ChunkSource` for the return value."""
    from fastdata.writer.ingest import spill

    if items is None:
        items = [_SAMPLES[i] for i in range(start, stop)]
    results = [prepare_or_reject(schema, item, start + k, strict) for k, item in enumerate(items)]
    nbytes = sum(len(r.record) for r in results if not isinstance(r, str))
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class _SampleSource(ChunkSource):
    worker = staticmethod(encode_chunk)

    def describe(self, start: int, stop: int) -> str:
        return f"samples {start} .. {stop - 1}"

    def input_name(self, i: int) -> str:
        return f"sample {i}"


class MapSource(_SampleSource):
    """A map-style dataset, split into index ranges (``plans``) the workers read themselves."""

    def __init__(self, samples: Any, schema: Schema, plans: list[ShardPlan], chunk_size: int, strict: bool = True):
        self.schema, self.plans, self.chunk_size, self.strict = schema, plans, chunk_size, strict
        self.worker_init = (_set_samples, (samples,))
        # a dataset may name its inputs (e.g. a COCO image's file name) for rejected.tsv
        self._names = getattr(samples, "input_name", None)

    def input_name(self, i: int) -> str:
        return str(self._names(i)) if callable(self._names) else super().input_name(i)

    def chunks(self) -> Iterator[Chunk]:
        for plan in self.plans:
            if plan.start == plan.stop:
                yield Chunk(plan, plan.start, plan.stop, True, (self.schema, plan.start, plan.stop, None, self.strict))
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop, (self.schema, a, b, None, self.strict))


class IterSource(_SampleSource):
    """An iterable, iterated here; shards of ``per_shard`` samples, the last one shorter."""

    def __init__(self, iterator: Iterator, schema: Schema, per_shard: int, chunk_size: int):
        self.iterator, self.schema, self.per_shard, self.chunk_size = iterator, schema, per_shard, chunk_size

    def chunks(self) -> Iterator[Chunk]:
        end = object()
        nxt = next(self.iterator, end)
        if nxt is end:
            yield Chunk(ShardPlan(0, 0, 0), 0, 0, True, (self.schema, 0, 0, [], True))
            return
        pos, shard = 0, 0
        while nxt is not end:
            first = pos
            while nxt is not end and pos - first < self.per_shard:
                items: list = []
                a = pos
                while nxt is not end and len(items) < self.chunk_size and pos - first < self.per_shard:
                    items.append(nxt)
                    pos += 1
                    nxt = next(self.iterator, end)
                last = nxt is end or pos - first >= self.per_shard
                yield Chunk(ShardPlan(shard, first, pos), a, pos, last, (self.schema, a, pos, items, True))
            shard += 1


def _is_map_style(samples: Any) -> bool:
    return (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
            and not isinstance(samples, Mapping | str | bytes))


def _estimate(encoded: list[EncodedSample]) -> int:
    """Bytes a sample takes in a shard (record plus index entries), from a few encoded ones."""
    if not encoded:
        return 1
    return max(1, int(np.mean([len(e.record) + len(e.relpath) + 16 + 8 * len(e.index) for e in encoded])))


def _fingerprint(backend: str, shard_bytes: int, count: int, schema: Schema, encoded: list[EncodedSample],
                 metadata: Mapping[str, Any] | None = None) -> str:
    """What identifies a map-style write for ``resume``: backend, shard size, length,
    schema, and the encoded records of a few samples spread over the dataset (first,
    quartiles, last). A resume whose dataset differs in any of these is refused; a
    change elsewhere in a large dataset is not detected (the price of not reading it twice)."""
    h = xxhash.xxh3_128()
    h.update(repr((backend, shard_bytes, count, schema.to_json())).encode())
    if metadata is not None:
        from fastdata.format.manifest import canonical_json

        h.update(canonical_json(dict(metadata)))
    for e in encoded:
        h.update(e.record)
        h.update(repr(sorted((k, np.asarray(v).tolist()) for k, v in e.index.items())).encode())
    return h.hexdigest()


def write(
    samples: Iterable[Mapping[str, Any]] | MapStyle,
    dst: str | os.PathLike,
    schema: Schema | Mapping[str, Any] | None = None,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    chunk_size: int = 32,
    strict: bool = True,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
):
    """Write ``samples`` (dicts of field name -> value) into a general fastdata store.

    Args:
        samples: a map-style dataset (``__len__`` + ``__getitem__``: a list, a torch
            ``Dataset``) or any iterable of dicts. Image values may be encoded bytes, a
            path (read in a worker), a PIL image or an HWC uint8 array (both stored as PNG).
        dst: destination directory, or a URL (``s3://bucket/x.lmdb``: shards are staged locally
            and uploaded as each finishes, manifest last; see :mod:`fastdata.writer.remote_sink`);
            its suffix picks the backend unless ``format`` is given.
        schema: a :class:`~fastdata.format.fields.Schema` or ``{name: Field}``; inferred from the
            first sample when None (:meth:`Schema.infer`).
        format: a backend name (``"lmdb"``, ``"hdf5"``).
        workers: worker processes (None: all cores; 0: everything in this process).
        shard_size: target bytes per shard (``int`` or e.g. ``"512MiB"``; default 1GiB);
            samples per shard are estimated from a few encoded samples.
        resume: finish an interrupted write of the same map-style dataset (same length,
            schema and sampled contents, see :func:`_fingerprint`), keeping its finished
            shards. An iterable cannot be resumed: it is refused (rerun with ``overwrite``).
        overwrite: replace an existing store at ``dst``.
        progress: show a progress bar (default: when stderr is a terminal).
        chunk_size: samples per worker task.
        strict: True (default): an unusable image value (unreadable file, not an image) stops
            the write; False: that sample is skipped and reported (``report.rejected_items``,
            the manifest's ``rejected`` list and ``rejected.tsv``, named ``sample <index>``).
            Map-style inputs only; an iterable is always strict.
        metadata: a JSON object stored in the manifest under ``"metadata"`` (e.g. class
            names, a COCO file's categories); part of what ``resume`` compares.
        storage_options: fsspec options for a URL ``dst`` (endpoint, credentials, ...).
        staging_dir: local directory shards of a URL ``dst`` are written in before upload
            (default: under the cache directory).

    Returns:
        A :class:`~fastdata.writer.convert.ConvertReport` (``images`` counts samples).

    Raises:
        SchemaError: a sample does not match the schema (names the sample and field); nothing is published.
        RejectedInputError: an image value is unreadable or not a usable image.
        FastdataError subclasses for the destination (exists, locked, I/O).
    """
    from fastdata.common.paths import check_local_path
    from fastdata.common.units import parse_size_spec
    from fastdata.format.names import MANIFEST_NAME
    from fastdata.writer.convert import (
        DEFAULT_SHARD_SIZE,
        _check_all_finished,
        _fill_report,
        _locked_destination,
        _remote_destination,
        _resume_published,
        _shards_to_do,
        check_shard_size,
        choose_backend,
    )
    from fastdata.writer.lock import raise_if_locked
    from fastdata.writer.pipeline import WRITE_SOURCE, prepare_staging, publish, remove_temporaries, run_shards
    from fastdata.writer.report import ConvertReport, ProgressBar

    dst = os.fspath(dst)
    remote = _remote_destination("", dst, storage_options, staging_dir, resume=resume, overwrite=overwrite)
    if remote is not None:
        return remote(lambda local: write(
            samples, local, schema, format=format, workers=workers,
            shard_size=shard_size, resume=resume, progress=progress, chunk_size=chunk_size, strict=strict,
            metadata=metadata))
    check_local_path(dst, "destination", must_exist=False)
    raise_if_locked(dst)
    backend = choose_backend(dst, format)
    size = check_shard_size(parse_size_spec(shard_size if shard_size is not None else DEFAULT_SHARD_SIZE))
    if workers is None:
        workers = os.cpu_count() or 1
    if int(workers) < 0:
        raise ValueError(f"workers must be 0 (in this process) or a positive number of processes, got {workers}")
    workers = int(workers)
    started = time.perf_counter()
    dst = os.path.abspath(dst)
    map_style = _is_map_style(samples)
    if resume and not map_style:
        raise ValueError("resume=True needs a map-style dataset (__len__ and __getitem__): an iterable cannot be "
                         "re-read from where it stopped; rerun with overwrite=True to write it from scratch")
    iterator: Iterator | None = None
    first: list = []
    if map_style:
        count = len(samples)  # type: ignore[arg-type]
        if count and schema is None:
            first = [samples[0]]  # type: ignore[index]
    else:
        iterator = iter(samples)
        first = [s for s in [next(iterator, None)] if s is not None]
        iterator = _chain(first, iterator)
    if schema is None:
        if not first:
            raise SchemaError("cannot infer a schema from no samples: pass schema=")
        schema = Schema.infer(first[0], "sample 0")
    schema = Schema.of(schema)
    if map_style:
        picks = sorted({0, count // 4, count // 2, 3 * count // 4, count - 1}) if count else []
        prepared = [prepare_or_reject(schema, samples[i], i, strict) for i in picks]  # type: ignore[index]
        probe = [p for p in prepared if not isinstance(p, str)]
    else:
        probe = [prepare_sample(schema, first[0], 0)] if first else []
    per_shard = max(1, size.bytes // _estimate(probe))
    fingerprint = (_fingerprint(backend, size.bytes, count, schema, probe, metadata) if map_style
                   else os.urandom(16).hex())
    report = ConvertReport(dst=dst, backend=backend, options=f"{backend}, shard size {size}", unit="samples")
    with _locked_destination(dst, report, resume=resume, overwrite=overwrite):
        if resume and os.path.exists(os.path.join(dst, MANIFEST_NAME)):
            return _resume_published(report, dst, started, fingerprint=fingerprint,
                                     mismatch=f"{dst} is a complete store written from other samples or options; "
                                              "use overwrite=True to replace it")
        prepare_staging(dst, fingerprint, resume, WRITE_SOURCE)
        remove_temporaries(dst)
        source: ChunkSource
        finished: dict = {}
        if map_style:
            plans = [ShardPlan(k, a, min(a + per_shard, count)) for k, a in enumerate(range(0, count, per_shard))]
            plans = plans or [ShardPlan(0, 0, 0)]
            finished, todo = _shards_to_do(dst, backend, plans, resume)
            source = MapSource(samples, schema, todo, chunk_size, strict)
            total = sum(p.stop - p.start for p in todo)
            if workers == 0:
                _set_samples(samples)
        else:
            assert iterator is not None
            source = IterSource(iterator, schema, per_shard, chunk_size)
            total = None
        try:
            with ProgressBar(total or 0, progress, desc="write") as bar:
                stats = run_shards(dst=dst, backend=backend, storage=StorageSpec(), workers=workers, strict=strict,
                                   writer_options={}, on_progress=bar.update_counts, chunk_size=chunk_size,
                                   source=source, schema=schema)
        finally:
            _set_samples(None)
        results = list(finished.values()) + stats.results
        if map_style:
            _check_all_finished(dst, plans, results, rerun="resume=True")
        options = {"source": WRITE_SOURCE, "shard_size": size.bytes, "shard_size_unit": size.unit,
                   "strict": True, "fingerprint": fingerprint, "resumable": map_style}
        manifest = publish(dst=dst, backend=backend, scan=None, storage=StorageSpec(), results=results,
                           options=options, schema=schema,
                           extra={"metadata": dict(metadata)} if metadata is not None else None)
    _fill_report(report, manifest, stats, finished, started)
    return report


def _chain(first: list, rest: Iterator) -> Iterator:
    yield from first
    yield from rest


__all__ = ["write", "prepare_sample"]
