"""The chunk grid of a ``chunked`` field, and its per-sample chunk table.

A chunked value of shape ``S`` (``ndim`` axes) with the field's chunk shape ``C`` is cut
into a regular grid of ``ceil(S[k] / C[k])`` chunks along each axis, numbered in C
order (the last axis fastest). Chunks at the far edge of an axis are *truncated* to
what is left of the array (unlike zarr, which pads them): a chunk's decoded shape is
``min(C[k], S[k] - start[k])`` on each axis, so nothing is stored that the array
does not hold.

The sample's record holds the *chunk table*: for chunk ``j`` in grid order, its stored
length (``uint32`` little-endian) and the xxh3-64 of its stored bytes (``uint64``
little-endian), packed as 12-byte entries. The shard index holds the value's shape
(``fields/<name>.shape``) and where its first chunk is (``fields/<name>.first``); the
backends say what ``first`` means (see their ``spec.py``).

Everything a hostile index or record could use to make a reader allocate or loop is
checked here first: shapes, chunk counts, table lengths.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from fastdata.errors import CorruptRecordError

#: one table entry: stored length and checksum of one chunk
TABLE_ENTRY = np.dtype([("nbytes", "<u4"), ("xxh", "<u8")])
#: most decoded bytes of one chunk (a chunk is decoded whole into memory)
MAX_CHUNK_BYTES = 256 << 20
#: most chunks of one value (its table lives in the record: 12 bytes each)
MAX_CHUNKS = 1 << 22
#: most stored bytes of one chunk (it must fit the table's uint32)
MAX_STORED_CHUNK_BYTES = (1 << 32) - 1


def grid_shape(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
    """Chunks along each axis of a value of ``shape`` (Python ints: nothing is iterated)."""
    return tuple(-(-int(s) // int(c)) for s, c in zip(shape, chunks, strict=True))


def is_empty(shape: Sequence[int]) -> bool:
    """Whether a value of ``shape`` has no element (an axis of size 0, whatever the others:
    ``[2**40, 0, 20]`` is empty and has no chunk)."""
    return any(int(s) == 0 for s in shape)


def chunk_count(shape: Sequence[int], chunks: Sequence[int]) -> int:
    """Chunks of a value of ``shape`` (0 when any axis is empty), with Python ints."""
    if is_empty(shape):
        return 0
    return math.prod(grid_shape(shape, chunks))


def chunk_region(position: Sequence[int], shape: Sequence[int], chunks: Sequence[int]) -> tuple[slice, ...]:
    """The slices of the value a chunk at grid ``position`` covers (truncated at the edges)."""
    return tuple(slice(p * c, min((p + 1) * c, s)) for p, s, c in zip(position, shape, chunks, strict=True))


def iter_grid(shape: Sequence[int], chunks: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Grid positions of every chunk, in storage (C) order (none for an empty value: the other
    axes' ranges are never walked, which ``itertools.product`` would do before yielding)."""
    if is_empty(shape):
        return iter(())
    return itertools.product(*(range(n) for n in grid_shape(shape, chunks)))


def linear_index(position: Sequence[int], grid: Sequence[int]) -> int:
    """The storage number of the chunk at grid ``position``."""
    index = 0
    for p, n in zip(position, grid, strict=True):
        index = index * n + p
    return index


def check_shape(shape: object, chunks: Sequence[int], itemsize: int, where: str) -> tuple[int, ...]:
    """A stored value's shape (from the index), refused unless it has the field's number of
    axes, no negative side and at most :data:`MAX_CHUNKS` chunks.

    Raises:
        CorruptRecordError: naming ``where``.
    """
    dims = tuple(int(s) for s in np.asarray(shape).reshape(-1).tolist())
    if len(dims) != len(chunks) or any(s < 0 for s in dims):
        raise CorruptRecordError(f"{where}: stored shape {list(dims)} is not {len(chunks)} non-negative sides")
    if chunk_count(dims, chunks) > MAX_CHUNKS:
        raise CorruptRecordError(f"{where}: stored shape {list(dims)} would have {chunk_count(dims, chunks):,} "
                                 f"chunks, more than the {MAX_CHUNKS:,} a value may have")
    return dims


@dataclass(frozen=True)
class ChunkTable:
    """What a chunked value's record holds: its shape (from the index) and per chunk, in
    grid order, the stored length and the xxh3-64 of the stored bytes."""

    shape: tuple[int, ...]
    nbytes: np.ndarray  # uint32 [chunks]
    xxh: np.ndarray  # uint64 [chunks]
    _starts: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def stored_bytes(self) -> int:
        return int(self.nbytes.sum(dtype=np.int64))

    def starts_of(self, chunk: int) -> int:
        """Chunk ``chunk``'s byte offset from the first one's, when they are stored back to back."""
        if self._starts is None:
            object.__setattr__(self, "_starts", self.starts())
        return int(self._starts[chunk])  # type: ignore[index]

    def starts(self) -> np.ndarray:
        """Each chunk's byte offset from the first one's, when they are stored back to back."""
        out = np.zeros(len(self.nbytes), dtype=np.int64)
        np.cumsum(self.nbytes[:-1], out=out[1:])
        return out

    def to_bytes(self) -> bytes:
        entries = np.empty(len(self.nbytes), dtype=TABLE_ENTRY)
        entries["nbytes"] = self.nbytes
        entries["xxh"] = self.xxh
        return entries.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, shape: tuple[int, ...], chunks: Sequence[int], where: str) -> ChunkTable:
        """The table of a value of ``shape`` (already checked by :func:`check_shape`).

        Raises:
            CorruptRecordError: the table's length does not match the shape's chunk count.
        """
        count = chunk_count(shape, chunks)
        if type(data) is not bytes or len(data) != count * TABLE_ENTRY.itemsize:
            raise CorruptRecordError(f"{where}: chunk table of {len(data) if isinstance(data, bytes) else '?'} "
                                     f"bytes, expected {count} entries of {TABLE_ENTRY.itemsize} for shape "
                                     f"{list(shape)}")
        entries = np.frombuffer(data, dtype=TABLE_ENTRY)
        return cls(shape, entries["nbytes"].astype(np.uint32), entries["xxh"].astype(np.uint64))


@dataclass(frozen=True)
class PendingChunks:
    """A chunked field's stored chunks waiting, back to back in a file of their own, for
    the shard writer (which stores them, then deletes the file). The writer's worker
    processes compress chunks into such files so that no process holds a whole value."""

    field: str
    path: str
    table: ChunkTable

    def stored(self) -> Iterator[bytes]:
        """The stored chunks, one at a time, in grid order (the file is read sequentially: a
        chunk at a time is all that is ever in memory).

        Raises:
            OSError: the file is shorter than its table says.
        """
        with open(self.path, "rb") as fh:
            for j, size in enumerate(self.table.nbytes.tolist()):
                data = fh.read(size)
                if len(data) != size:
                    raise OSError(f"{self.path}: chunk {j} of field {self.field!r} is cut short "
                                  f"({len(data)} of {size} bytes)")
                yield data

