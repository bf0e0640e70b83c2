"""Reading a store's added fields (``fastdata.add_fields``) from their field files.

Fixed-size fields (numbers, small arrays) are read whole when the store is opened, checked
against their checksums, and join the store's index arrays: ``ds.column(name)``, subsets and
samplers read them without opening a shard or a record. Any other field keeps, per shard, its
value offsets and checksums in memory and reads one value with one ``pread`` of the field file,
checked against its checksum. No file descriptor is kept past ``__init__``: each process opens a
field file on its first read (a DataLoader worker opens its own).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from fastdata.common import portable
from fastdata.common.fileio import open_regular
from fastdata.errors import CorruptRecordError, StoreChangedError
from fastdata.format.fields import Chunked, Image
from fastdata.format.added import (
    CHUNKED_ARRAYS,
    IMAGE_META_ARRAYS,
    AddedField,
    ArrayEntry,
    added_fields,
    array_of,
    check_image_meta,
    check_offsets,
    chunked_tables,
    decode_value,
    field_files,
    header_bytes,
    parse_header,
)


class _ValueFile:
    """One shard's values of one record-resident added field."""

    __slots__ = ("checksums", "data", "offsets", "path")

    def __init__(self, path: str, offsets: np.ndarray, checksums: np.ndarray, data: ArrayEntry):
        self.path, self.offsets, self.checksums, self.data = path, offsets, checksums, data


class AddedValues:
    """The added fields of an opened store version: the fixed ones' arrays, the others' readers.

    Args:
        store: the store's location (:class:`~fastdata.remote.store.StoreLocation`): gives each
            field file's local path (a remote store's are downloaded into its cache, checked).
        manifest: the (validated) manifest of the version opened.
        where: the store's name in messages.
    """

    def __init__(self, store: Any, manifest: dict, where: str):
        self.where = where
        #: the added fields, in the order they were added
        self.fields: list[AddedField] = added_fields(manifest, where)
        #: fixed-size field name -> its values for every sample (the store's order)
        self.arrays: dict[str, np.ndarray] = {}
        #: record-resident field name -> one _ValueFile a shard
        self._values: dict[str, list[_ValueFile]] = {}
        self.shard_starts = np.array([s["first_index"] for s in manifest["shards"]], dtype=np.int64)
        parts: dict[str, list[np.ndarray]] = {a.name: [] for a in self.fields if a.fixed}
        #: (dtype, row shape) of each array of ``self.arrays``: the fixed fields' values, and each
        #: added image field's per-sample format, size, dtype and channels (``<name>.<meta>``)
        layouts: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
            a.name: a.field.index_shape for a in self.fields if a.fixed}  # type: ignore[misc]
        for a in self.fields:
            if isinstance(a.field, Image):
                for meta, code in IMAGE_META_ARRAYS.items():
                    parts[f"{a.name}.{meta}"] = []
                    layouts[f"{a.name}.{meta}"] = (np.dtype(code), ())
            if isinstance(a.field, Chunked):  # its shapes and first chunks: index arrays, as written ones have
                chunked_layouts: tuple[tuple[str, tuple[int, ...]], ...] = (("shape", (a.field.ndim,)), ("first", ()))
                for part, shape in chunked_layouts:
                    parts[f"{a.name}.{part}"] = []
                    layouts[f"{a.name}.{part}"] = (np.dtype(CHUNKED_ARRAYS[part]), shape)
        #: chunked field name -> per shard, (its field file's path, the ``<key>.chunks`` array's place)
        self._chunks: dict[str, list[tuple[str, ArrayEntry]]] = {}
        for shard in manifest["shards"]:
            files = field_files(shard)
            for gen in sorted({a.generation for a in self.fields}):
                entry = files[gen]
                mine = [a for a in self.fields if a.generation == gen]
                path = store.field_file(entry["name"], entry["bytes"], entry["xxh"])
                self._read_file(path, mine, shard, entry, parts)
        for name, arrays in parts.items():
            dtype, shape = layouts[name]
            self.arrays[name] = (np.concatenate(arrays).astype(dtype, copy=False) if arrays
                                 else np.zeros((0, *shape), dtype=dtype))
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _read_file(self, path: str, fields: list[AddedField], shard: dict, entry: dict,
                   parts: dict[str, list[np.ndarray]]) -> None:
        where = f"{self.where}: field file {entry['name']}"
        fd = open_regular(path, "field file")
        try:
            size = os.fstat(fd).st_size
            if size != entry["bytes"]:
                raise CorruptRecordError(f"{where} is {size} bytes, the manifest says {entry['bytes']}; the store is "
                                         "damaged (run 'fastdata verify')", store=self.where)
            first = portable.pread(fd, 16, 0)
            head = portable.pread(fd, header_bytes(first), 0)
            arrays = parse_header(head, size, fields, shard["count"], where)
            for a in fields:
                if a.fixed:
                    e = arrays[a.key]
                    parts[a.name].append(array_of(e, portable.pread(fd, e.nbytes, e.offset), where, a.key))
                    continue
                offs, sums = arrays[a.key + ".offsets"], arrays[a.key + ".checksums"]
                offsets = array_of(offs, portable.pread(fd, offs.nbytes, offs.offset), where, a.key + ".offsets")
                data = arrays[a.key + ".data"]
                check_offsets(offsets, data.nbytes, where, a.name)
                checksums = array_of(sums, portable.pread(fd, sums.nbytes, sums.offset), where, a.key + ".checksums")
                self._values.setdefault(a.name, []).append(_ValueFile(path, offsets, checksums, data))
                if isinstance(a.field, Image):  # its index arrays, as a written image field has them
                    meta = {}
                    for part in IMAGE_META_ARRAYS:
                        e = arrays[f"{a.key}.{part}"]
                        meta[part] = array_of(e, portable.pread(fd, e.nbytes, e.offset), where, f"{a.key}.{part}")
                        parts[f"{a.name}.{part}"].append(meta[part])
                    check_image_meta(meta, where, a.name)
                if isinstance(a.field, Chunked):  # shapes, first chunks; tables checked against them when read
                    for part in ("shape", "first"):
                        e = arrays[f"{a.key}.{part}"]
                        parts[f"{a.name}.{part}"].append(
                            array_of(e, portable.pread(fd, e.nbytes, e.offset), where, f"{a.key}.{part}"))
                    self._chunks.setdefault(a.name, []).append((path, arrays[a.key + ".chunks"]))
        finally:
            os.close(fd)

    @property
    def record_fields(self) -> tuple[str, ...]:
        """The added fields read one value at a time (not fixed-size)."""
        return tuple(self._values)

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors are not ours to share,
            self._fds, self._pid = {}, os.getpid()  # and its lock may have been held by a thread at the fork
            self._lock = threading.Lock()
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = open_regular(path, "field file")
        return fd

    def value(self, name: str, index: int, where: str) -> Any:
        """Record-resident added field ``name`` of sample ``index``, checked and decoded.

        Raises:
            CorruptRecordError: the value's bytes do not match their checksum or do not decode.
        """
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        vf = self._values[name][shard]
        local = index - int(self.shard_starts[shard])
        start, end = int(vf.offsets[local]), int(vf.offsets[local + 1])
        try:
            raw = portable.pread(self._fd(vf.path), end - start, vf.data.offset + start)
        except FileNotFoundError:
            raise StoreChangedError(f"{self.where} was changed since it was opened: the field file "
                                    f"{os.path.basename(vf.path)} of added field {name!r} is gone (removed by "
                                    "fastdata.gc, or a later add_fields); open it again") from None
        field = next(a.field for a in self.fields if a.name == name)
        return decode_value(field, raw, int(vf.checksums[local]), f"{where} added field {name!r}")

    def chunk_table(self, name: str, index: int, where: str) -> tuple[int, Any]:
        """Added chunked field ``name`` of sample ``index``: ``(shard, its ChunkTable)``, the table
        checked against the value's shape and the field file's chunks."""
        field = next(a.field for a in self.fields if a.name == name)
        assert isinstance(field, Chunked)
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        table = self.value(name, index, where)
        shape = self.arrays[f"{name}.shape"][index:index + 1]
        first = self.arrays[f"{name}.first"][index:index + 1]
        return shard, chunked_tables(field, shape, first, self._chunks[name][shard][1].nbytes, [table],
                                     f"{where} ({os.path.basename(self._chunks[name][shard][0])})", name)[0]

    def chunk_source(self, name: str) -> _AddedChunks:
        """What a :class:`~fastdata.reader.chunked.ChunkedArray` of added chunked field ``name``
        reads its chunks through (in place of the dataset's shard handles)."""
        return _AddedChunks(self, name)

    def read_chunks(self, name: str, shard: int, first: int, table: Any, chunks: Any, where: str, consume) -> None:
        """``consume(k, stored bytes)`` for the ``k``-th of chunks ``chunks`` of a value of added
        chunked field ``name`` in shard ``shard`` whose chunks start at byte ``first`` of the
        field file's chunks: one ``pread`` each, checked against the table (length, xxh3-64)."""
        import xxhash

        path, entry = self._chunks[name][shard]
        try:
            fd = self._fd(path)
        except FileNotFoundError:
            raise self._gone(path, name) from None
        chunks = [int(j) for j in chunks]
        k = 0
        while k < len(chunks):  # chunks with consecutive numbers lie back to back: one read for each run
            end = k + 1
            while end < len(chunks) and chunks[end] == chunks[end - 1] + 1:
                end += 1
            start = first + table.starts_of(chunks[k])
            stop = first + table.starts_of(chunks[end - 1]) + int(table.nbytes[chunks[end - 1]])
            if stop > entry.nbytes:  # (checked when the table was read: a guard)
                raise CorruptRecordError(f"{where} chunk {chunks[end - 1]}: lies past the field file's chunks")
            span = memoryview(portable.pread(fd, stop - start, entry.offset + start))
            if len(span) != stop - start:
                raise CorruptRecordError(f"{where}: the field file {os.path.basename(path)} is cut short")
            for i in range(k, end):
                j = chunks[i]
                at = first + table.starts_of(j) - start
                data = span[at:at + int(table.nbytes[j])]
                if xxhash.xxh3_64_intdigest(data) != int(table.xxh[j]):
                    raise CorruptRecordError(f"{where} chunk {j}: does not match its checksum (in "
                                             f"{os.path.basename(path)}); run 'fastdata verify'")
                consume(i, data)
            k = end

    def _gone(self, path: str, name: str) -> StoreChangedError:
        return StoreChangedError(f"{self.where} was changed since it was opened: the field file "
                                 f"{os.path.basename(path)} of added field {name!r} is gone (removed by "
                                 "fastdata.gc, or a later add_fields); open it again")

    def close(self) -> None:
        """Close this process's field files (reopened on the next read)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


class _AddedChunks:
    """The shard handles a :class:`~fastdata.reader.chunked.ChunkedArray` of an added chunked field
    reads through: ``get(shard).read_chunks(...)`` reads from the shard's field file instead of the
    shard (no OS handle of its own: the :class:`AddedValues` opens files per process)."""

    __slots__ = ("name", "values")

    def __init__(self, values: AddedValues, name: str):
        self.values, self.name = values, name

    def get(self, shard: int) -> _AddedChunkShard:
        return _AddedChunkShard(self.values, self.name, shard)

    def __getstate__(self) -> tuple:
        return (self.values, self.name)

    def __setstate__(self, state: tuple) -> None:
        self.values, self.name = state


class _AddedChunkShard:
    __slots__ = ("name", "shard", "values")

    def __init__(self, values: AddedValues, name: str, shard: int):
        self.values, self.name, self.shard = values, name, shard

    def read_chunks(self, first: int, table: Any, chunks: Any, where: str, consume) -> None:
        self.values.read_chunks(self.name, self.shard, first, table, chunks, where, consume)
