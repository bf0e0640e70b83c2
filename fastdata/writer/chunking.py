"""Writing a chunked field: an array-like read and compressed chunk by chunk.

Runs in the writer's worker processes (:func:`fastdata.writer.sources.python.prepare_sample`).
The value is read in *slabs*: all chunks that share a position along the first axis
(e.g. 64 slices of a volume, 512 rows of a slide), when such a slab is at most
:data:`SLAB_BYTES`; otherwise chunk by chunk. Slabs keep the number of reads small for
sources where each read has a cost of its own (a NIfTI file's ``dataobj``, a tiled TIFF,
an HDF5 dataset); the bound keeps the memory of a worker at one slab plus one chunk,
whatever the size of the value.

An ``np.memmap`` is read with ``pread`` instead of through its mapping: pages touched
through a mapping stay in the process (its RSS grows to the whole file), pages read
with ``pread`` stay in the page cache only.

Each chunk is compressed at once and appended to a file of its own in the staging
folder (a :class:`~fastdata.format.chunks.PendingChunks`), which the shard writer
copies into the shard and deletes; only the chunk table travels back to the converter.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from typing import Any

import numpy as np

from fastdata.common.portable import O_BINARY, preadinto
from fastdata.format.chunks import (
    MAX_CHUNKS,
    MAX_STORED_CHUNK_BYTES,
    ChunkTable,
    PendingChunks,
    chunk_count,
    chunk_region,
    iter_grid,
)
from fastdata.format.chunk_codecs import chunk_codec
from fastdata.format.fields import Chunked, SchemaError
from fastdata.format.record import checksum
from fastdata.writer.ingest import SPILL_PREFIX, SPILL_SUFFIX

#: most bytes read from a source at once (one slab of chunks along the first axis)
SLAB_BYTES = 64 << 20
#: chunks a probe reads (spread over the value) to estimate its stored size
PROBE_CHUNKS = 8


def _exact(block: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """``block`` as a C-contiguous array of ``dtype`` (little-endian), refused unless every value
    survives the cast exactly (floats with NaN compare as equal)."""
    if block.dtype.kind not in "biuf":
        raise SchemaError(f"{where}: the array-like returned dtype {block.dtype}, which is not numeric")
    if block.dtype != dtype:
        cast = block.astype(dtype)
        if block.size and not np.array_equal(cast.astype(block.dtype), block, equal_nan=block.dtype.kind == "f"):
            raise SchemaError(f"{where}: values of dtype {block.dtype} do not fit {dtype.name} exactly; declare "
                              f"Chunked({block.dtype.name!r}, ...) or convert the values first")
        block = cast
    return np.ascontiguousarray(block)


class _MemmapSlabs:
    """Reads regions of a C-contiguous ``np.memmap`` with ``pread`` (see the module docstring)."""

    def __init__(self, array: np.memmap):
        self.path = os.fspath(array.filename)  # type: ignore[arg-type]
        self.offset = int(array.offset)
        self.shape = tuple(array.shape)
        self.dtype = array.dtype
        self.row = math.prod(self.shape[1:]) * self.dtype.itemsize

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        size = (stop - start) * self.row
        fd = os.open(self.path, os.O_RDONLY | O_BINARY)
        try:
            data = bytearray(size)
            view = memoryview(data)
            done = 0
            while done < size:
                got = preadinto(fd, view[done:], self.offset + start * self.row + done)
                if got <= 0:
                    raise OSError(f"{self.path}: ends before the memmap's {self.shape} {self.dtype} values")
                done += got
        finally:
            os.close(fd)
        return np.frombuffer(data, dtype=self.dtype).reshape((stop - start, *self.shape[1:]))


def _memmap_reader(value: Any) -> _MemmapSlabs | None:
    """A ``pread`` reader of ``value`` when it is an ``np.memmap`` made directly over its file (its
    base the mapping itself, so that ``offset`` is where its values start), C-contiguous; else None
    (a view of a memmap is read through its mapping, like any array)."""
    if (isinstance(value, np.memmap) and isinstance(value.base, mmap.mmap) and value.filename
            and value.flags.c_contiguous and value.ndim >= 1):
        return _MemmapSlabs(value)
    return None


def _regions(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int):
    """``(region, chunk positions)`` pairs in storage order: slabs along the first axis when a
    slab is at most :data:`SLAB_BYTES`, else single chunks."""
    slab = chunks[0] * math.prod(shape[1:]) * itemsize
    if slab <= SLAB_BYTES:
        grid0 = -(-shape[0] // chunks[0])
        rest = list(iter_grid(shape[1:], chunks[1:]))
        for p0 in range(grid0):
            rows = slice(p0 * chunks[0], min((p0 + 1) * chunks[0], shape[0]))
            yield (rows, *(slice(0, s) for s in shape[1:])), [(p0, *r) for r in rest]
        return
    for position in iter_grid(shape, chunks):
        yield chunk_region(position, shape, chunks), [position]


def _read(value: Any, memmap: _MemmapSlabs | None, region: tuple[slice, ...]) -> np.ndarray:
    if memmap is not None and all(r.start == 0 and r.stop == s for r, s in zip(region[1:], memmap.shape[1:],
                                                                                strict=True)):
        return memmap.read_rows(region[0].start, region[0].stop)
    return np.asarray(value[region])


def write_chunks(field: Chunked, name: str, value: Any, where: str,
                 chunk_dir: str | None) -> tuple[ChunkTable, PendingChunks | None]:
    """Read ``value`` (checked by :meth:`Chunked.check`) chunk by chunk, compress each chunk with
    the field's codec and append it to a new file in ``chunk_dir``.

    Args:
        field: the field's schema entry.
        name: the field's name (for the pending chunks and messages).
        value: a numpy array or array-like with ``shape``, ``dtype`` and slicing.
        where: the sample and field, for messages (``"sample 3 field 'ct'"``).
        chunk_dir: where the chunks wait for the shard writer; None: a *probe* (the writer
            sizing its shards from a few samples): only :data:`PROBE_CHUNKS` chunks spread over
            the value are read and compressed, the others' lengths estimated from them (their
            checksums left 0), and nothing is kept.

    Returns:
        The value's chunk table and its pending chunks (None when ``chunk_dir`` is None).

    Raises:
        SchemaError: a slice of the array-like has another shape than asked for, a dtype that is
            not numeric or values the field's dtype cannot hold, the value has too many chunks,
            or a chunk compresses to more than 4 GiB (naming the sample, field and chunk).
    """
    if isinstance(value, MemmapRef):
        value = value.open()
    shape = tuple(int(s) for s in value.shape)
    count = chunk_count(shape, field.chunks)
    if count > MAX_CHUNKS:
        raise SchemaError(f"{where}: shape {list(shape)} in chunks of {list(field.chunks)} makes {count:,} chunks, "
                          f"more than the {MAX_CHUNKS:,} a value may have: use larger chunks")
    codec = chunk_codec(field.codec)
    nbytes = np.zeros(count, dtype=np.uint32)
    xxh = np.zeros(count, dtype=np.uint64)
    path = None
    out = None
    if chunk_dir is not None:
        fd, path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=SPILL_SUFFIX, dir=chunk_dir)
        out = os.fdopen(fd, "wb")
    if chunk_dir is None:
        return _probe(field, value, shape, count, where), None
    try:
        memmap = _memmap_reader(value)
        j = 0
        for region, positions in _regions(shape, field.chunks, field.dtype.itemsize) if count else ():
            block = _read(value, memmap, region)
            want = tuple(r.stop - r.start for r in region)
            if block.shape != want:
                raise SchemaError(f"{where}: the array-like returned shape {block.shape} for region "
                                  f"{[(r.start, r.stop) for r in region]}, expected {want}")
            block = _exact(block, field.dtype, f"{where} chunk {j}")
            for position in positions:
                local = tuple(slice(c.start - r.start, c.stop - r.start) for c, r in
                              zip(chunk_region(position, shape, field.chunks), region, strict=True))
                chunk = np.ascontiguousarray(block[local])
                stored = codec.encode(chunk, field.level)
                if len(stored) > MAX_STORED_CHUNK_BYTES:
                    raise SchemaError(f"{where} chunk {j}: {len(stored):,} stored bytes, more than a chunk may take")
                nbytes[j] = len(stored)
                xxh[j] = checksum(stored)
                if out is not None:
                    out.write(stored)
                j += 1
        if out is not None:
            out.close()
            out = None
    except BaseException:
        if out is not None:
            out.close()
        if path is not None:
            os.unlink(path)
        raise
    table = ChunkTable(shape, nbytes, xxh)
    return table, (PendingChunks(name, path, table) if path is not None else None)


def _probe(field: Chunked, value: Any, shape: tuple[int, ...], count: int, where: str) -> ChunkTable:
    """The chunk table of a probe (see :func:`write_chunks`): a few chunks measured, the rest estimated."""
    codec = chunk_codec(field.codec)
    nbytes = np.zeros(count, dtype=np.uint32)
    xxh = np.zeros(count, dtype=np.uint64)
    if _memmap_reader(value) is not None:
        # a mapping of its own per chunk, unmapped after it: the caller's memmap (probed in the
        # converter's main process) would keep every page the probe touched in that process
        value = MemmapRef(value)
    if count:
        picks = sorted(set(np.linspace(0, count - 1, min(count, PROBE_CHUNKS)).round().astype(int).tolist()))
        grid = list(iter_grid(shape, field.chunks)) if count <= 4 * PROBE_CHUNKS else None
        for j in picks:
            position = grid[j] if grid is not None else np.unravel_index(j, tuple(
                -(-s // c) for s, c in zip(shape, field.chunks, strict=True)))
            region = chunk_region(tuple(int(p) for p in position), shape, field.chunks)
            block = np.asarray(value[region])
            want = tuple(r.stop - r.start for r in region)
            if block.shape != want:
                raise SchemaError(f"{where}: the array-like returned shape {block.shape} for region "
                                  f"{[(r.start, r.stop) for r in region]}, expected {want}")
            stored = codec.encode(_exact(block, field.dtype, f"{where} chunk {j}"), field.level)
            nbytes[j], xxh[j] = len(stored), checksum(stored)
        measured = nbytes[picks]
        estimate = int(measured.mean())
        rest = np.ones(count, dtype=bool)
        rest[picks] = False
        nbytes[rest] = estimate
    return ChunkTable(shape, nbytes, xxh)


class MemmapRef:
    """An ``np.memmap`` as it travels to a worker process: its file and layout, reopened there
    (a memmap pickles as a copy of all its values)."""

    def __init__(self, array: np.memmap):
        self.path = os.fspath(array.filename)  # type: ignore[arg-type]
        self.offset = int(array.offset)
        self.shape = tuple(array.shape)
        self.dtype = array.dtype

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.asarray(self.open()[key])


class H5DatasetRef:
    """An h5py dataset as it travels to a worker process (h5py objects do not pickle): its file
    and name, opened read-only there."""

    def __init__(self, dataset: Any):
        self.path = os.fspath(dataset.file.filename)
        self.name = dataset.name
        self.shape = tuple(dataset.shape)
        self.dtype = dataset.dtype
        self._dataset: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None}

    def __getitem__(self, key: Any) -> np.ndarray:
        if self._dataset is None:
            import h5py

            # h5py's default locking, as the caller opened it: in a process that still has the file
            # open (the converter itself may write a chunk of samples), other flags fail to open it
            self._dataset = h5py.File(self.path, "r")[self.name]
        return np.asarray(self._dataset[key])


def portable(value: Any) -> Any:
    """``value`` in a form that pickles light for a worker process: a direct ``np.memmap`` as a
    :class:`MemmapRef`, an h5py dataset as an :class:`H5DatasetRef`; anything else as it is."""
    if _memmap_reader(value) is not None:
        return MemmapRef(value)
    if type(value).__module__.startswith("h5py") and hasattr(value, "file") and hasattr(value, "name"):
        return H5DatasetRef(value)
    return value
