"""A JSONL or CSV/TSV list with any fields (parsed by :mod:`fastdata.writer.sources.table.reader`)
as a write source: a general store (layout version 2).

Workers read and fully decode each row's image and encode the row with its other
values (:func:`encode_table_chunk`); records keep the image path as written in the
list. The manifest holds every class field's table under ``class_tables`` and the
single-label one's under ``classes``, with ``class_counts`` counted from the shards'
index sidecars (:meth:`TableInput.finish_results`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from fastdata.common.imageio import ImageDecodeError, inspect_image
from fastdata.errors import RejectedInputError
from fastdata.format.manifest import CLASS_TABLES_KEY, target_field
from fastdata.format.record import FIELD_PREFIX, EncodedSample, SampleIndex, encode_sample
from fastdata.format.store_index import decode_shard_index
from fastdata.writer.ingest import Rejected, read_bytes, spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource, ShardResult, shard_index_bytes
from fastdata.writer.plan import ShardPlan, plan_shards
from fastdata.writer.resume import RecordedRun, RunOptions
from fastdata.writer.sources.base import WriteSource, record_run, refuse_changed_resume
from fastdata.writer.sources.table.reader import TableSource, is_table_list, scan_table

#: the list source of this worker process (set by the pool initializer)
_TABLE: TableSource | None = None


def is_general_list(src: str, schema) -> bool:
    """Whether ``src`` becomes a general (layout version 2) store: a ``schema`` was
    given, or ``src`` is a JSONL file or a CSV/TSV whose header names more than
    ``path,label`` (:func:`fastdata.writer.sources.table.reader.is_table_list`)."""
    if schema is not None:
        return True
    return os.path.isfile(src) and is_table_list(src, None)


def set_table(table: TableSource | None) -> None:
    """Worker initializer: keep the list source for :func:`encode_table_chunk` (None: let it go)."""
    global _TABLE
    _TABLE = table


def _table_row(table: TableSource, i: int) -> dict | str:
    """Row ``i`` of the list with its image read (bytes), or why the image is unusable."""
    row = table.row(i)
    try:
        row["image"] = read_bytes(table.path(i))
    except Rejected as why:
        return str(why)
    return row


def encode_table_row(schema, row: dict, i: int, relpath: bytes) -> EncodedSample:
    """Row ``i`` (its first image already read) validated and encoded as a version-2
    record keeping ``relpath``: every image fully decoded under the image policy (which
    gives its stored format, size, dtype and channels), the other values checked against the schema."""
    images: dict[str, tuple] = {}
    for name in schema.image_fields():
        data = row[name]
        if isinstance(data, str):  # a second image column: its absolute path
            try:
                data = row[name] = read_bytes(os.fsencode(data))
            except Rejected as why:
                raise RejectedInputError(f"field {name!r}: {data}: {why}") from None
        try:
            info = inspect_image(data)
        except ImageDecodeError as err:
            raise RejectedInputError(f"field {name!r}: not a usable image ({err})") from None
        images[name] = (info.format, info.width, info.height, info.dtype, info.channels)
    return encode_sample(schema, schema.check(row, f"sample {i}"), images, relpath)


def encode_table_chunk(schema, start: int, stop: int, spill_dir: str | None):
    """Worker entry point: rows ``start .. stop-1`` of the list source given to this
    worker, each an :class:`~fastdata.format.record.EncodedSample` keeping the path as written
    in the list, or the reason (``str``, naming the list line) it is rejected."""
    table = _TABLE
    assert table is not None, "encode_table_chunk runs in workers started with set_table"
    results: list = []
    nbytes = 0
    for i in range(start, stop):
        line = f"{os.path.basename(table.list_file)}:{int(table.lines[i])}"
        row = _table_row(table, i)
        if isinstance(row, str):
            results.append(f"{row} ({line})")
            continue
        nbytes += len(row["image"])
        try:
            results.append(encode_table_row(schema, row, i, table.relpaths[i]))
        except RejectedInputError as err:  # an image that does not decode, or a second image file unreadable
            results.append(f"{err} ({line})")
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class TableChunks(ChunkSource):
    """The pipeline's feed for a list: index ranges the workers read themselves from the
    list source they received once."""

    worker = staticmethod(encode_table_chunk)

    def __init__(self, table: TableSource, chunk_size: int):
        self.table, self.chunk_size = table, chunk_size
        self.worker_init = (set_table, (table,))

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop, (self.table.schema, a, b))

    def describe(self, start: int, stop: int) -> str:
        return f"{self.table.list_file} lines {int(self.table.lines[start])} .. {int(self.table.lines[stop - 1])}"

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.table.relpaths[i])


class TableInput(WriteSource):
    """A JSONL or CSV/TSV list ``src`` with fields (typed by inference or by ``schema``, as
    :func:`fastdata.writer.sources.table.spec.parse_schema` takes it) as a general store."""

    torchrun_refusal = "a list with more fields than path,label converts on one machine: run it without torchrun"

    def __init__(self, src: str, schema=None):
        super().__init__(os.path.abspath(src))
        self.src, self.declared = src, schema
        self.table: TableSource | None = None
        self.target: str | None = None

    def _table(self) -> TableSource:
        assert self.table is not None, "TableInput.plan parses the list first"
        return self.table

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        table = self.table = scan_table(self.src, self.declared)
        self.schema = table.schema
        self.target = target_field(table.schema, table.class_tables)
        # planned from the image file sizes plus a little for the other fields (exact sizes are known only once encoded)
        sizes = table.sizes.clip(min=0) + 64
        plans = plan_shards(sizes, run.shard_size.bytes)
        check_shard_count(plans, int(sizes.sum()), run.shard_size)
        return plans

    def fingerprint(self, run: RunOptions) -> str:
        """A hash of what decides a list store's content (the list file's bytes, its schema
        and class tables, the image sizes, backend and shard size), for ``resume=True``."""
        table = self._table()
        h = xxhash.xxh3_128()
        h.update(json.dumps([run.backend, run.shard_size.bytes, table.schema.to_json(), table.class_tables]).encode())
        with open(table.list_file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(table.sizes.astype("<i8").tobytes())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> TableChunks:
        return TableChunks(self._table(), chunk_size)

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        """Refuse a resume of a list conversion whose options or list differ, naming the options."""
        refuse_changed_resume(dst, recorded, run, fingerprint, f"the list {self.src} or its image files changed")

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        """What a later ``resume=True`` reuses (the options) and compares against (the fingerprint)."""
        record_run(dst, os.path.abspath(self.src), run, fingerprint)

    def classes(self) -> list[str]:
        return self._table().class_tables[self.target] if self.target is not None else []

    def manifest_extra(self) -> dict[str, Any]:
        return {CLASS_TABLES_KEY: self._table().class_tables}

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Fill each shard result's ``class_counts`` from the class indices its shard holds
        (rejected rows are not in it), for the manifest's ``class_counts``."""
        table = self._table()
        for r in results:
            if self.target is None:
                r.class_counts = []
                continue
            # from the index sidecar, not the shard: a shard uploaded to a URL destination is no longer here
            index = decode_shard_index(shard_index_bytes(dst, backend, r.name, table.schema), table.schema, r.name)
            assert isinstance(index, SampleIndex), "a general store's shards hold a SampleIndex"
            labels = np.asarray(index.arrays[FIELD_PREFIX + self.target], dtype=np.int64)
            r.class_counts = np.bincount(labels, minlength=len(table.class_tables[self.target])).tolist()
