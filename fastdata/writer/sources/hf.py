"""Hugging Face ``datasets`` objects as write sources (``fastdata.write(ds)``), their encoded
image bytes kept as they are.

* A ``datasets.Dataset`` is Arrow rows: it is read through its Arrow form
  (``ds.with_format("arrow")``), so an ``Image`` column's ``{bytes, path}`` values are never
  decoded to PIL images (as ``Image(decode=False)`` gives them) and its fields come from its
  ``features`` the way a Parquet file's do (:mod:`fastdata.writer.sources.parquet.columns`:
  ``ClassLabel`` -> a class field with its names, ``List``/``Sequence`` -> ragged arrays,
  ``Array2D``/``Array3D`` -> fixed-shape arrays). This process slices the rows into chunks that
  travel to the workers as Arrow IPC bytes (the dataset itself is never sent to each worker);
  the plan is index ranges, so ``resume=True`` works as for a map-style dataset
  (:class:`DatasetInput`). A transform set with ``set_transform``/``with_transform`` is not
  applied: the stored values are the dataset's own.
* A ``DatasetDict`` needs ``split=`` (the error lists its splits).
* An ``IterableDataset`` (streaming) is an iterable (:class:`IterableInput`): its ``Image``
  columns are cast to ``Image(decode=False)`` so their bytes arrive as they are; an image that
  arrives decoded anyway (a PIL image) is re-encoded losslessly as PNG here, and the summary
  says how many and what that cost.

``datasets`` is never imported by fastdata itself: only objects of it are handled here.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from fastdata.common.units import format_size
from fastdata.format.fields import SchemaError
from fastdata.format.manifest import CLASS_TABLES_KEY, canonical_json, target_field
from fastdata.writer.ingest import spill
from fastdata.writer.pipeline import WRITE_SOURCE, Chunk, ChunkSource, ShardResult, count_labels
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.base import WriteSource
from fastdata.writer.sources.parquet.columns import Layout, make_layout, plain_table
from fastdata.writer.sources.parquet.detect import hf_kind
from fastdata.writer.sources.parquet.input import ROW_OVERHEAD, ArrowInput, encode_rows
from fastdata.writer.sources.python import IterInput

__all__ = ["DatasetInput", "IterableInput", "hf_source", "encode_arrow_chunk"]


# --------------------------------------------------------------------------- datasets.Dataset


def _ipc(table: pa.Table) -> bytes:
    """``table`` as Arrow IPC stream bytes (only its own rows: a slice does not carry its parent's buffers)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def encode_arrow_chunk(layout: Layout, data: bytes, start: int, spill_dir: str | None):
    """Worker entry point: the rows of ``data`` (Arrow IPC bytes; dataset rows ``start ..``) as
    records or rejection reasons; see :class:`~fastdata.writer.pipeline.ChunkSource`."""
    results: list = []
    nbytes = 0
    if data:
        table = pa.ipc.open_stream(data).read_all()
        results, nbytes = encode_rows(layout, table, start, lambda i: f"sample {i}")
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class DatasetChunks(ChunkSource):
    """The pipeline's feed: ``chunk_size`` rows of the dataset at a time, sliced here as Arrow."""

    worker = staticmethod(encode_arrow_chunk)

    def __init__(self, view: Any, layout: Layout, chunk_size: int):
        self.view, self.layout, self.chunk_size = view, layout, chunk_size

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            if plan.start == plan.stop:
                yield Chunk(plan, plan.start, plan.stop, True, (self.layout, b"", plan.start))
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop, (self.layout, _ipc(plain_table(self.view[a:b])), a))

    def describe(self, start: int, stop: int) -> str:
        return f"samples {start} .. {stop - 1}"

    def input_name(self, i: int) -> str:
        return f"sample {i}"


class DatasetInput(ArrowInput):
    """A ``datasets.Dataset`` as a general store (see the module docstring); ``metadata`` as
    :func:`fastdata.write` takes it."""

    progress_label = "write"
    made_from = "written from other samples or options"
    reuses_recorded_options = False
    staging_source = WRITE_SOURCE

    def __init__(self, ds: Any, metadata: Mapping[str, Any] | None = None):
        super().__init__(WRITE_SOURCE)
        self.ds = ds
        self.view = ds.with_format("arrow")  # Arrow rows: images stay {bytes, path}, never PIL
        self.metadata = dict(metadata) if metadata is not None else None
        self.count = len(ds)

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        table = self.ds.data  # the whole Arrow table behind the dataset (rows before any select/shuffle)
        schema = table.schema
        nulls = {name: int(table.column(name).null_count) for name in schema.names}

        def first_binary(column: str) -> Any:
            for a in range(0, min(self.count, 1024), 64):
                value = next((v for v in self.view[a:a + 64].column(column).to_pylist() if v is not None), None)
                if value is not None:
                    return value
            return None

        def minimum(column: str) -> int | None:
            values = self.view.select_columns([column])[:].column(column)  # the rows it selects, one column
            return pc.min(values).as_py() if len(values) else None

        layout = make_layout(schema, self.ds.features.to_dict(), (), nulls, first_binary, "the datasets.Dataset",
                             minimum)
        self._set_layout(layout, WRITE_SOURCE, "its ClassLabel features")
        per_row = (int(table.nbytes) // max(1, table.num_rows)) + ROW_OVERHEAD
        per_shard = max(1, run.shard_size.bytes // per_row)
        plans = [ShardPlan(k, a, min(a + per_shard, self.count)) for k, a in enumerate(range(0, self.count, per_shard))]
        return plans or [ShardPlan(0, 0, 0)]

    def fingerprint(self, run: RunOptions) -> str:
        """What identifies the write for ``resume=True``: backend, shard size, length, layout, metadata
        and the values of a few rows spread over the dataset (first, quartiles, last); as for a
        map-style dataset, a change elsewhere is not detected (the price of not reading it twice)."""
        h = xxhash.xxh3_128()
        h.update(repr((run.backend, run.shard_size.bytes, self.count, self._layout().to_json())).encode())
        if self.metadata is not None:
            h.update(canonical_json(self.metadata))
        count = self.count
        for i in sorted({0, count // 4, count // 2, 3 * count // 4, count - 1}) if count else []:
            h.update(repr(plain_table(self.view[i:i + 1]).to_pylist()).encode())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> DatasetChunks:
        return DatasetChunks(self.view, self._layout(), chunk_size)

    def options_text(self, run: RunOptions) -> str:
        return f"{run.backend}, shard size {run.shard_size}"

    def manifest_options(self) -> dict[str, Any]:
        return {"resumable": True}


# --------------------------------------------------------------------------- datasets.IterableDataset


class _Examples:
    """The examples of an iterable dataset as samples: ``{bytes, path}`` image values as their bytes
    (or path), columns renamed as the layout says; PIL images re-encoded as PNG, counted."""

    def __init__(self, examples: Iterable[Mapping[str, Any]], layout: Layout | None):
        self.examples, self.layout = examples, layout
        self.images = [c.name for c in layout.columns if c.role == "image"] if layout is not None else None
        self.renamed = {c.name: c.field_name for c in layout.columns} if layout is not None else {}
        self.labels = [c.name for c in layout.columns if c.role == "class"] if layout is not None else []
        self.seen = 0
        self.pil_count = self.pil_bytes = self.pil_pixel_bytes = 0

    def _image(self, value: Any) -> Any:
        if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
            return value.get("bytes") or value.get("path")
        if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
            # decoded before it reached us: PNG keeps its pixels (the original bytes are gone)
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            self.pil_count += 1
            self.pil_bytes += buf.tell()
            self.pil_pixel_bytes += np.asarray(value).nbytes
            return buf.getvalue()
        return value

    def __iter__(self) -> Iterator[dict]:
        for example in self.examples:
            if not isinstance(example, Mapping):
                yield example  # (the schema check names what it is)
                continue
            for name in self.labels:
                if isinstance(example.get(name), int) and example[name] < 0:
                    raise SchemaError(
                        f"sample {self.seen} field {name!r}: label {example[name]} (no label) in a ClassLabel column, "
                        "whose every sample a class field holds in a class; write it as plain integers: "
                        f"ds.cast_column({name!r}, datasets.Value('int64'))")
            self.seen += 1
            images = self.images if self.images is not None else [
                k for k, v in example.items() if isinstance(v, Mapping) and "bytes" in v
                or type(v).__module__.startswith("PIL.")]
            yield {self.renamed.get(k, k): self._image(v) if k in images else v for k, v in example.items()}


class IterableInput(IterInput):
    """A ``datasets.IterableDataset`` as an iterable of samples (see the module docstring)."""

    def __init__(self, ids: Any, metadata: Mapping[str, Any] | None = None):
        layout = None
        features = getattr(ids, "features", None)
        if features is not None:
            for name, feature in features.items():
                if type(feature).__name__ == "Image" and getattr(feature, "decode", False):
                    ids = ids.cast_column(name, type(feature)(decode=False))  # keep the encoded bytes
            layout = make_layout(features.arrow_schema, features.to_dict(), (), {}, lambda column: None,
                                 "the datasets.IterableDataset")
        self.examples = _Examples(ids, layout)
        self.layout = layout
        super().__init__(self.examples, layout.schema if layout is not None else None, metadata)
        if layout is not None:
            self.warnings.extend(f"{WRITE_SOURCE}: {remark}" for remark in layout.remarks)

    def _tables(self) -> dict[str, list[str]]:
        return self.layout.class_tables if self.layout is not None else {}

    def _target(self) -> str | None:
        return target_field(self.schema, self._tables()) if self.schema is not None else None

    def classes(self) -> list[str]:
        target = self._target()
        return list(self._tables()[target]) if target is not None else []

    def manifest_extra(self) -> dict[str, Any] | None:
        extra = dict(super().manifest_extra() or {})
        if self._tables():
            extra[CLASS_TABLES_KEY] = self._tables()
        return extra or None

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        target = self._target()
        if target is None or self.schema is None:
            return
        count_labels(dst, backend, results, self.schema, len(self.classes()), target)

    def report_notes(self) -> list[str]:
        e = self.examples
        if not e.pil_count:
            return []
        return [f"{e.pil_count} image(s) arrived decoded (PIL images, their original bytes gone) and were re-encoded "
                f"losslessly as PNG: {format_size(e.pil_bytes)} stored for {format_size(e.pil_pixel_bytes)} of pixels; "
                "cast image columns with datasets.Image(decode=False) to keep the original bytes"]


# --------------------------------------------------------------------------- dispatch


def hf_source(obj: Any, split: str | None = None, schema: Any = None,
              metadata: Mapping[str, Any] | None = None) -> WriteSource:
    """The write source of a ``datasets`` object (``split`` picks one of a ``DatasetDict``).

    Raises:
        ValueError: a dict without ``split`` (listing its splits), a ``split`` it does not have, or
            ``schema`` given (the dataset's ``features`` decide the fields).
    """
    kind = hf_kind(obj)
    if kind in ("DatasetDict", "IterableDatasetDict"):
        splits = ", ".join(map(repr, obj.keys()))
        if split is None:
            raise ValueError(f"a datasets.{kind} holds several splits ({splits}): pass split= to write one, "
                             f"e.g. fastdata.write(ds, dst, split={next(iter(obj.keys()), 'train')!r})")
        if split not in obj:
            raise ValueError(f"the datasets.{kind} has no split {split!r}; its splits are {splits}")
        obj, kind = obj[split], hf_kind(obj[split])
    elif split is not None:
        raise ValueError(f"split= picks a split of a datasets.DatasetDict; this is a datasets.{kind}")
    if schema is not None:
        raise SchemaError(f"schema= does not apply to a datasets.{kind}: its features decide the fields "
                          "(cast columns with ds.cast_column first to change them)")
    if kind == "Dataset":
        return DatasetInput(obj, metadata)
    return IterableInput(obj, metadata)

