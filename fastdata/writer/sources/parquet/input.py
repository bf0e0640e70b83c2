"""Arrow rows as write sources: Parquet files (:class:`ParquetInput`, ``fastdata convert``), and
what a ``datasets.Dataset`` shares with them (:class:`ArrowInput`; the Dataset itself is
:class:`fastdata.writer.sources.hf.DatasetInput`).

Parquet: the plan is made from the files' footers alone; a shard holds whole row groups (a
row group is a plan unit, so ``resume=True`` keeps or rewrites whole ones), about ``shard_size``
bytes of them. The workers open the files themselves and read their chunk's rows a page at
a time (:func:`encode_parquet_chunk`): a worker keeps one open row group cursor, which moves
forward to the next chunk it is given in that row group, so memory stays a chunk's rows
whatever the size of the files and of their row groups. (Parquet pages cannot be skipped
unread: the rows before its chunk that other workers took are read and dropped, which costs
their decompression, not their image decoding.)

Every row is encoded by :func:`encode_rows`: its image bytes stored as they are, each fully
decoded once to be validated (an unusable image rejects the row, reported in
``rejected.tsv``; ``strict=True`` stops at it), the other values checked against the schema
(:mod:`~fastdata.writer.sources.parquet.columns`).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from fastdata.common.imageio import ImageDecodeError, inspect_image
from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.fields import SchemaError
from fastdata.format.manifest import CLASS_TABLES_KEY, target_field
from fastdata.format.record import EncodedSample, encode_sample
from fastdata.writer.ingest import spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource, ShardResult, count_labels
from fastdata.writer.plan import ShardPlan, plan_shards
from fastdata.writer.resume import RecordedRun, RunOptions
from fastdata.writer.sources.base import WriteSource, record_run, refuse_changed_resume
from fastdata.writer.sources.parquet.columns import Layout, make_layout, row_values
from fastdata.writer.sources.parquet.files import (
    ParquetFileInfo,
    column_minimum,
    first_value,
    hf_features,
    null_counts,
    open_parquet,
    read_footers,
)

__all__ = ["ArrowInput", "ParquetInput", "ParquetRows", "encode_parquet_chunk", "encode_rows", "set_parquet"]

#: bytes a row is planned to add besides its column bytes (record and index overhead)
ROW_OVERHEAD = 64


# --------------------------------------------------------------------------- encoding (workers)


def encode_rows(layout: Layout, table: pa.Table, start: int, name_of: Callable[[int], str],
                base_dir: str = "") -> tuple[list[EncodedSample | str], int]:
    """Rows ``start ..`` (``table``) as records, or the reason each unusable one is rejected (``str``);
    and the image bytes read. ``name_of(i)`` names row ``i`` (the record's path when it has no image path)."""
    rows, paths = row_values(layout, table, base_dir)
    images = [c for c in layout.columns if c.role == "image"]
    results: list[EncodedSample | str] = []
    nbytes = 0
    for k, row in enumerate(rows):
        if isinstance(row, str):
            results.append(row)
            continue
        where = name_of(start + k)
        try:
            infos = {}
            for col in images:
                data = row[col.field_name]
                nbytes += len(data)
                try:
                    info = inspect_image(data)
                except ImageDecodeError as err:
                    raise RejectedInputError(f"column {col.name!r}: not a usable image ({err})") from None
                infos[col.field_name] = (info.format, info.width, info.height, info.dtype, info.channels)
            checked = layout.schema.check(row, where)
            path = paths[k]
            relpath = os.fsencode(path if path else where)
            results.append(encode_sample(layout.schema, checked, infos, relpath))
        except (RejectedInputError, SchemaError) as err:
            results.append(str(err).removeprefix(f"{where} "))
    return results, nbytes


class ParquetRows:
    """What every worker reads Parquet rows with: the files' footers and the layout (no handle:
    the files are opened in the worker)."""

    def __init__(self, files: list[ParquetFileInfo], layout: Layout, names: list[str]):
        self.files, self.layout, self.names = files, layout, names

    def open_file(self, file_index: int) -> pq.ParquetFile:
        """File ``file_index`` opened for reading row groups (in the worker; a remote source's
        rows open a URL)."""
        return open_parquet(self.files[file_index].path)


class _Cursor:
    """An open row group of one file, read forward a batch at a time."""

    def __init__(self, rows: ParquetRows, file_index: int, group: int, batch_rows: int):
        info = self.info = rows.files[file_index]
        self.key = (file_index, group)
        self.file = rows.open_file(file_index)
        meta = self.file.metadata
        if meta.num_row_groups != len(info.row_groups) or meta.row_group(group).num_rows != info.row_groups[group]:
            self.file.close()
            raise SourceError(f"{info.path} changed since the conversion started (its row groups differ); "
                              "convert it again with overwrite=True")
        # every column (each is a field): names are not given, since a name with a dot such as
        # "image.path" would also select the nested field "path" of a column "image"
        self.batches = self.file.iter_batches(batch_size=max(1, batch_rows), row_groups=[group], use_threads=False)
        self.pos = 0
        self.held: pa.RecordBatch | None = None

    def take(self, a: int, b: int) -> pa.Table:
        """Rows ``a .. b-1`` of the row group (``a`` at or after the rows already taken)."""
        parts = []
        while self.pos < b:
            batch = self.held if self.held is not None else next(self.batches, None)
            self.held = None
            if batch is None:
                raise SourceError(f"{self.info.path} row group {self.key[1]}: ends at row {self.pos}, its footer "
                                  f"says {self.info.row_groups[self.key[1]]} rows (the file is damaged)")
            end = self.pos + batch.num_rows
            if end > b:
                self.held, batch, end = batch.slice(b - self.pos), batch.slice(0, b - self.pos), b
            if end > a:
                parts.append(batch.slice(max(a - self.pos, 0)))
            self.pos = end
        return pa.Table.from_batches(parts)

    def close(self) -> None:
        self.file.close()


#: the Parquet rows of this worker process (set by the pool initializer), and its open row group
_ROWS: ParquetRows | None = None
_CURSOR: _Cursor | None = None


def set_parquet(rows: ParquetRows | None) -> None:
    """Worker initializer: keep the files' description for :func:`encode_parquet_chunk` (None:
    let it go, closing the open file)."""
    global _ROWS, _CURSOR
    _ROWS = rows
    if _CURSOR is not None:
        _CURSOR.close()
        _CURSOR = None


def _read_rows(rows: ParquetRows, file_index: int, group: int, a: int, b: int) -> pa.Table:
    global _CURSOR
    cursor = _CURSOR
    if cursor is None or cursor.key != (file_index, group) or cursor.pos > a:
        if cursor is not None:
            cursor.close()
        _CURSOR = None
        cursor = _CURSOR = _Cursor(rows, file_index, group, b - a)
    try:
        return cursor.take(a, b)
    except (pa.ArrowException, OSError) as err:
        path = rows.files[file_index].path
        raise SourceError(f"{path} row group {group}: cannot be read ({type(err).__name__}: {err}); the file is "
                          "damaged") from None


def encode_parquet_chunk(file_index: int, group: int, a: int, b: int, start: int, spill_dir: str | None):
    """Worker entry point: rows ``a .. b-1`` of row group ``group`` of file ``file_index`` (store
    rows ``start ..``) as records or rejection reasons; see :class:`~fastdata.writer.pipeline.ChunkSource`."""
    rows = _ROWS
    assert rows is not None, "encode_parquet_chunk runs in workers started with set_parquet"
    results: list = []
    nbytes = 0
    if b > a:
        table = _read_rows(rows, file_index, group, a, b)
        name = rows.names[file_index]
        first_row = a + sum(rows.files[file_index].row_groups[:group])
        results, nbytes = encode_rows(rows.layout, table, first_row, lambda r: f"{name} row {r}",
                                      os.path.dirname(rows.files[file_index].path))
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class ParquetChunks(ChunkSource):
    """The pipeline's feed: row ranges within one row group, read by the workers themselves."""

    worker = staticmethod(encode_parquet_chunk)

    def __init__(self, rows: ParquetRows, units: list[tuple[int, int, int]], chunk_size: int):
        self.rows, self.units, self.chunk_size = rows, units, chunk_size
        #: store row where each unit (file, row group, rows) starts
        self.starts = np.concatenate([[0], np.cumsum([u[2] for u in units], dtype=np.int64)]).tolist()
        #: store row where each file starts
        self.file_starts = np.concatenate([[0], np.cumsum([sum(f.row_groups) for f in rows.files],
                                                          dtype=np.int64)]).tolist()
        self.worker_init = (set_parquet, (rows,))

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            if plan.start == plan.stop:
                yield Chunk(plan, plan.start, plan.stop, True, (0, 0, 0, 0, plan.start))
                continue
            u = bisect.bisect_right(self.starts, plan.start) - 1
            while u < len(self.units) and self.starts[u] < plan.stop:
                file_index, group, count = self.units[u]
                for a in range(0, count, self.chunk_size):
                    b = min(a + self.chunk_size, count)
                    first = self.starts[u] + a
                    yield Chunk(plan, first, first + b - a, first + b - a == plan.stop,
                                (file_index, group, a, b, first))
                u += 1

    def _locate(self, i: int) -> tuple[int, int]:
        f = bisect.bisect_right(self.file_starts, i) - 1
        return f, i - self.file_starts[f]

    def describe(self, start: int, stop: int) -> str:
        f, row = self._locate(start)
        return f"{self.rows.files[f].path} rows {row} .. {row + stop - start - 1}"

    def input_name(self, i: int) -> str:
        f, row = self._locate(i)
        return f"{self.rows.names[f]} row {row}"

    def input_path(self, i: int) -> str:
        f, row = self._locate(i)
        return f"{self.rows.files[f].path} row {row}"


# --------------------------------------------------------------------------- the sources


class ArrowInput(WriteSource):
    """What the Arrow sources share: a general store of the layout's schema, every class field's
    names in ``class_tables`` (``classes``: the single-label one's), class counts from the shards."""

    unit = "samples"
    torchrun_refusal = "Parquet files and datasets objects convert on one machine: run it without torchrun"

    def __init__(self, recorded_source: str):
        super().__init__(recorded_source)
        self.layout: Layout | None = None
        #: lines for the summary
        self.notes: list[str] = []
        #: the manifest's ``metadata`` (None: none)
        self.metadata: dict[str, Any] | None = None

    def _layout(self) -> Layout:
        assert self.layout is not None, "plan makes the layout first"
        return self.layout

    def _set_layout(self, layout: Layout, where: str, features_from: str) -> None:
        self.layout, self.schema = layout, layout.schema
        self.warnings.extend(f"{where}: {remark}" for remark in layout.remarks)
        for col in layout.columns:
            if col.role == "image":
                self.notes.append(f"{col.field_name}: the image bytes as they are (not re-encoded), each decoded "
                                  "once to check it")
            elif col.role in ("class", "multilabel"):
                self.notes.append(f"{col.field_name}: {'multi-label ' if col.role == 'multilabel' else ''}class "
                                  f"field of {len(col.classes)} names from {features_from}")

    def _target(self) -> str | None:
        layout = self._layout()
        return target_field(layout.schema, layout.class_tables)

    def classes(self) -> list[str]:
        target = self._target()
        return list(self._layout().class_tables[target]) if target is not None else []

    def remarks(self) -> list[tuple[str, str]]:
        return [(self.recorded_source, remark) for remark in self._layout().remarks]

    def manifest_extra(self) -> dict[str, Any]:
        layout = self._layout()
        extra: dict[str, Any] = {CLASS_TABLES_KEY: layout.class_tables}
        metadata = dict(self.metadata or {})
        if layout.class_names:  # ClassLabel columns holding -1, stored as plain ints
            metadata["class_names"] = layout.class_names
        if metadata or self.metadata is not None:
            extra["metadata"] = metadata
        return extra

    def report_notes(self) -> list[str]:
        return list(self.notes)

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Each shard's ``class_counts`` from the single-label class field of its index sidecar."""
        target = self._target()
        if target is None:
            for r in results:
                r.class_counts = []
            return
        count_labels(dst, backend, results, self._layout().schema, len(self.classes()), target)


class ParquetInput(ArrowInput):
    """Parquet files (one schema) as a general store; ``image_columns`` names columns to store as
    images besides those recognised (see :mod:`~fastdata.writer.sources.parquet.columns`)."""

    def __init__(self, src: str, files: list[str], image_columns: tuple[str, ...] = ()):
        super().__init__(os.path.abspath(src))
        self.src, self.paths, self.image_columns = src, files, image_columns
        self.rows: ParquetRows | None = None
        self.units: list[tuple[int, int, int]] = []

    def _rows(self) -> ParquetRows:
        assert self.rows is not None, "plan reads the footers first"
        return self.rows

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        infos, schema, metas = read_footers(self.paths)
        features, found = hf_features(schema, self.paths, self.warnings)
        where = self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (and {len(self.paths) - 1} more)"
        layout = make_layout(schema, features, self.image_columns, null_counts(schema, metas),
                             lambda column: first_value(infos[0], column), where,
                             lambda column: column_minimum(infos, metas, column))
        self._set_layout(layout, self.recorded_source, found or "the Parquet files")
        names = [os.path.basename(p) for p in self.paths]
        if len(set(names)) < len(names):  # files of several folders: named relative to their common folder
            common = os.path.commonpath([i.path for i in infos])
            names = [os.path.relpath(i.path, common) for i in infos]
        self.rows = ParquetRows(infos, layout, names)
        return self._plan_units(run, infos, names)

    def _plan_units(self, run: RunOptions, infos: list[ParquetFileInfo], names: list[str]) -> list[ShardPlan]:
        """Shards of whole row groups of ``infos`` (the files' footers), about ``shard_size`` bytes each."""
        self.units = [(f, g, rows) for f, info in enumerate(infos) for g, rows in enumerate(info.row_groups) if rows]
        sizes = np.asarray([infos[f].group_bytes[g] + ROW_OVERHEAD * rows for f, g, rows in self.units],
                           dtype=np.int64)
        self.metadata = {"parquet": {"files": names}}
        if not self.units:
            return [ShardPlan(0, 0, 0)]
        groups = plan_shards(sizes, run.shard_size.bytes)  # shards of whole row groups
        check_shard_count(groups, int(sizes.sum()), run.shard_size)
        starts = np.concatenate([[0], np.cumsum([u[2] for u in self.units])]).tolist()
        return [ShardPlan(p.shard_id, starts[p.start], starts[p.stop]) for p in groups]

    def fingerprint(self, run: RunOptions) -> str:
        """A hash of what decides the store's content: backend, shard size, the layout, and every
        file's path, size, modification time and row groups, for ``resume=True``."""
        rows = self._rows()
        h = xxhash.xxh3_128()
        h.update(json.dumps([run.backend, run.shard_size.bytes, rows.layout.to_json(),
                             [[i.path, i.size, i.mtime_ns, list(i.row_groups)] for i in rows.files]]).encode())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> ParquetChunks:
        return ParquetChunks(self._rows(), self.units, chunk_size)

    def options_text(self, run: RunOptions) -> str:
        return f"{run.backend}, shard size {run.shard_size}" + (", strict=True" if run.strict else "")

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        """Refuse a resume whose options or Parquet files differ from the interrupted run's, naming the options."""
        refuse_changed_resume(dst, recorded, run, fingerprint, f"the Parquet files {self.src} changed")

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        """What a later ``resume=True`` reuses (the options) and compares against (the fingerprint)."""
        record_run(dst, self.recorded_source, run, fingerprint)
