"""Write one LMDB shard (layout in ``spec.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import lmdb
import msgpack
import numpy as np

from fastdata.common import portable
from fastdata.common.fileio import fsync_file
from fastdata.common.writeback import Writeback
from fastdata.format.backends.base import ShardWriter, StorageSpec
from fastdata.format.backends.lmdb import spec
from fastdata.format.chunks import PendingChunks
from fastdata.format.record import IndexBuilder, SampleIndex, SampleIndexBuilder, ShardIndex, encode_record


def _address_in(mappings: list[tuple[int, int, int]], view) -> int | None:
    """The file offset of the buffer ``view`` into the map, or None outside every mapping."""
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    where = next(((a, off) for a, b, off in mappings if a <= address and address + len(view) <= b), None)
    return None if where is None else address - where[0] + where[1]


def _spans_of_keys(env, db, path: str, keys: list[bytes]) -> np.ndarray | None:
    """``[len(keys), 2]`` uint64: the file offset and length of the value under each of ``keys`` in
    ``db``, as it lies in the finished file ``path`` (read back through LMDB's map, whose pages the
    write just left in the page cache; an empty value: ``(0, 0)``, nothing to read ahead); None
    where that cannot be learned (the OS lists no mappings with their offsets:
    :func:`~fastdata.common.portable.file_mappings`; a key missing, a value outside the map).

    py-lmdb does not expose the map's address, so the address of each value (a buffer into the
    map) is located in this process's mappings of the file."""
    out = np.zeros((len(keys), 2), dtype="<u8")
    if not keys:
        return out
    try:
        mappings = portable.file_mappings(path)
    except OSError:
        return None
    try:
        with env.begin(db=db, buffers=True) as txn:
            for i, key in enumerate(keys):
                view = txn.get(key)
                if view is None:
                    return None
                if not len(view):
                    continue
                at = _address_in(mappings, view)
                if at is None:
                    return None
                out[i] = (at, len(view))
    except lmdb.Error:
        return None
    return out


def value_spans(env, db, path: str, count: int) -> np.ndarray | None:
    """``[count, 2]`` uint64: the file offset and length of the values under keys ``0..count-1``
    of ``db`` (see :func:`_spans_of_keys`)."""
    return _spans_of_keys(env, db, path, [spec.encode_key(i) for i in range(count)])


def tail_spans(env, db, path: str, parts: list[int]) -> np.ndarray | None:
    """``[n, k, 2]`` uint64 (``k``: the most parts any record has, at least 1): the file offset and
    length of each tail part of each record (``parts[i]`` of them; ``(0, 0)`` past the last), as
    :func:`_spans_of_keys` learns them. One span per part, not per record: a record's parts are
    often on two leaf pages far apart in the file (LMDB takes a new page from its free list, where
    an earlier commit left one), and a span covering only the first would leave the second to a
    synchronous page fault on a cold read."""
    out = np.zeros((len(parts), max(1, max(parts, default=0)), 2), dtype="<u8")
    where = [(i, part) for i, count in enumerate(parts) for part in range(count)]
    spans = _spans_of_keys(env, db, path, [spec.tail_key(i, part) for i, part in where])
    if spans is None:
        return None
    if where:
        rows, cols = np.array(where, dtype=np.int64).T
        out[rows, cols] = spans
    return out


def record_ranges(records: np.ndarray | None, tails: np.ndarray | None) -> np.ndarray | None:
    """The store index file's ``record_ranges`` of a shard (``[n, 1 + k, 2]``: each record's head,
    then its tail parts, in the order they are joined) from its head spans (``[n, 2]``) and tail spans
    (``[n, k, 2]``: :func:`tail_spans`); None when either could not be learned."""
    if records is None or tails is None or len(tails) != len(records):
        return None
    if not tails[:, :, 1].any():  # no record has a tail: one piece each
        return np.ascontiguousarray(records.reshape(-1, 1, 2), dtype="<u8")
    return np.ascontiguousarray(np.concatenate([records.reshape(-1, 1, 2), tails], axis=1), dtype="<u8")


class LMDBShardWriter(ShardWriter):
    """Appends records with ``append=True`` in one write transaction per batch (layout version 3:
    a record that would waste most of its last overflow page is cut into a page-exact head and
    inline tail parts, :func:`~spec.split_point`); grows the map on ``MapFullError`` and retries
    the batch."""

    io_errors = (lmdb.Error,)

    def __init__(self, path: str, storage: StorageSpec, *, initial_map_size: int | None = None, **options):
        super().__init__(path, storage, **options)
        self.map_size = int(initial_map_size or spec.DEFAULT_INITIAL_MAP_SIZE)
        # lock=False: the store-level lock already guarantees a single writer.
        # sync=False: we sync once at close (env.sync + fsync) instead of per commit.
        self.env = lmdb.open(path, subdir=False, map_size=self.map_size, max_dbs=4, lock=False,
                             sync=False, metasync=False, readahead=False, meminit=True)
        self.records = self.env.open_db(spec.RECORDS_DB)
        self.index_db = self.env.open_db(spec.INDEX_DB)
        self.tails_db = self.env.open_db(spec.TAILS_DB)
        self.psize = int(self.env.stat()["psize"])
        #: tail parts of each record written (0: kept whole)
        self.tail_parts: list[int] = []
        #: bytes left in the ``tails`` database's last leaf page, as :func:`~spec.cut_tail` counts
        self.tail_free = self.psize - spec.PAGE_HEADER
        self.chunks_db = self.env.open_db(spec.CHUNKS_DB) if self.schema and self.schema.chunked_fields() else None
        self.next_chunk = 0
        self.index: IndexBuilder | SampleIndexBuilder = (
            IndexBuilder() if self.schema is None else SampleIndexBuilder(self.schema))
        self.map_growths = 0
        self.writeback = Writeback(path)

    def _commit(self, fill) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fill(txn)
                return
            except lmdb.MapFullError:
                self.map_size *= 2
                self.map_growths += 1
                self.env.set_mapsize(self.map_size)

    def put_chunks(self, pending: PendingChunks) -> int:
        """Chunks go to the ``chunks`` database under consecutive keys, committed every
        :data:`~spec.CHUNK_COMMIT_BYTES` so that a large value never sits in one transaction."""
        first = self.next_chunk
        batch: list[bytes] = []
        size = 0

        def flush() -> None:
            base = self.next_chunk

            def fill(txn):
                for k, value in enumerate(batch):
                    if not txn.put(spec.encode_key(base + k), value, db=self.chunks_db, append=True):
                        raise RuntimeError(f"{self.path}: duplicate chunk key {base + k}")

            self._commit(fill)
            self.writeback.wrote(sum(map(len, batch)))
            self.next_chunk += len(batch)
            batch.clear()

        for data in pending.stored():
            batch.append(data)
            size += len(data)
            if size >= spec.CHUNK_COMMIT_BYTES:
                flush()
                size = 0
        if batch:
            flush()
        return first

    def put(self, samples: Sequence) -> None:
        start = len(self.index)
        if self.schema is not None:  # version 2: the records are already packed
            values = [s.record for s in samples]
            whole = [False] * len(values)
        else:
            values = [
                encode_record(s.image, label=s.label, width=s.width, height=s.height, fmt=s.fmt,
                              relpath=s.relpath, xxh=s.xxh)
                for s in samples
            ]
            # raw pixels stay whole: readers hand them to the decoder as views of the map
            whole = [s.fmt == "PPM" for s in samples]
        cuts = [len(v) if keep else spec.split_point(len(v), self.psize) for v, keep in zip(values, whole, strict=True)]
        tails = []
        for value, cut in zip(values, cuts, strict=True):
            sizes, self.tail_free = spec.cut_tail(len(value) - cut, self.tail_free, self.psize)
            at = np.cumsum([cut, *sizes]).tolist()
            tails.append([value[a:b] for a, b in zip(at, at[1:], strict=False)])

        def fill(txn):
            for offset, (value, cut, parts) in enumerate(zip(values, cuts, tails, strict=True)):
                local = start + offset
                head = value if cut == len(value) else memoryview(value)[:cut]
                if not txn.put(spec.encode_key(local), head, db=self.records, append=True):
                    raise RuntimeError(f"{self.path}: duplicate key {local}")
                for part, data in enumerate(parts):
                    if not txn.put(spec.tail_key(local, part), data, db=self.tails_db, append=True):
                        raise RuntimeError(f"{self.path}: duplicate tail key {local}/{part}")

        self._commit(fill)
        self.tail_parts.extend(len(p) for p in tails)
        self.writeback.wrote(sum(len(v) for v in values))
        if isinstance(self.index, SampleIndexBuilder):
            for s in samples:
                self.index.add(s, self.place_chunks(s))
            return
        for s in samples:
            self.index.add(label=s.label, xxh=s.xxh, width=s.width, height=s.height, fmt=s.fmt,
                           nbytes=len(s.image), relpath=s.relpath, dtype=s.dtype, channels=s.channels)

    def close(self) -> ShardIndex | SampleIndex:
        index = self.index.build()
        header = msgpack.packb({"layout": spec.LAYOUT, "version": spec.VERSION_TAILS, "count": len(index)})
        if isinstance(index, SampleIndex):
            arrays = {key: np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")) for key, arr in
                      index.arrays.items()}
        else:
            arrays = {name: np.ascontiguousarray(getattr(index, name), dtype=dtype)
                      for name, dtype in spec.INDEX_ARRAYS.items()}

        spans = {spec.RECORD_SPANS_KEY: value_spans(self.env, self.records, self.path, len(index)),
                 spec.TAIL_SPANS_KEY: tail_spans(self.env, self.tails_db, self.path, self.tail_parts)}
        if self.chunks_db is not None:
            spans[spec.CHUNK_SPANS_KEY] = value_spans(self.env, self.chunks_db, self.path, self.next_chunk)

        def fill(txn):
            txn.put(spec.HEADER_KEY, header, db=self.index_db)
            for name, arr in arrays.items():
                txn.put(name.encode(), arr.tobytes(), db=self.index_db)
            for key, span in spans.items():
                if span is not None:
                    txn.put(key, span.tobytes(), db=self.index_db)

        self._commit(fill)
        # learnt from the finished file: the index-only commit above moves no record's pages
        index.record_ranges = record_ranges(spans[spec.RECORD_SPANS_KEY], spans[spec.TAIL_SPANS_KEY])
        self.writeback.close()
        self.env.sync(True)
        self.env.close()
        fsync_file(self.path)
        return index

    def abort(self) -> None:
        try:
            self.env.close()
        except lmdb.Error:
            pass
        try:
            self.writeback.close()
        except OSError:
            pass
