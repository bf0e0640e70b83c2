"""``ChunkedArray``: a chunked field's value, read by region.

``ds[i]["ct"]`` of a store with a ``Chunked`` field is one of these: it knows the
value's shape, dtype and chunk table (from the index and the record) and reads nothing
more until it is indexed. ``arr[10:106, 20:116, 30:126]`` fetches and decodes only the
chunks that region touches (steps too: a chunk no selected index falls in is not
read), checks each chunk's length and xxh3-64 against the table, and returns a numpy
array equal to the same slice of the array that was written.

It holds no OS handle of its own: it reads through its dataset's per-process shard
handles (:class:`fastdata.reader.shards.ShardHandles`), so it pickles light, opens the
shard lazily in whichever process indexes it, and is safe across fork and spawn like
the datasets.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdata.errors import CorruptRecordError, FastdataError, ReadLimitError, StoreChangedError
from fastdata.format.chunks import ChunkTable, chunk_region, grid_shape, linear_index
from fastdata.format.chunk_codecs import chunk_codec
from fastdata.format.fields import Chunked

#: chunks fetched from the shard at once (one read transaction / one readahead advice)
FETCH_BATCH = 64
#: most bytes one read may return unless ``FASTDATA_MAX_REGION_BYTES`` says otherwise
DEFAULT_MAX_REGION_BYTES = 2 << 30
#: most bytes the lazy chunked values of one collated batch may decode together unless
#: ``FASTDATA_MAX_BATCH_BYTES`` says otherwise
DEFAULT_MAX_BATCH_BYTES = 4 << 30
#: the environment variables that set the two limits (bytes, a decimal integer)
REGION_LIMIT_ENV = "FASTDATA_MAX_REGION_BYTES"
BATCH_LIMIT_ENV = "FASTDATA_MAX_BATCH_BYTES"


def _limit(env: str, default: int) -> int:
    try:
        value = int(os.environ.get(env, default))
    except ValueError:
        return default
    return value if value > 0 else default


def max_region_bytes() -> int:
    """The most bytes one region read may allocate (``FASTDATA_MAX_REGION_BYTES``, default 2 GiB):
    a stored shape is not trusted to size an allocation by itself, and only the user (the
    environment of the reading process), never a store, raises it."""
    return _limit(REGION_LIMIT_ENV, DEFAULT_MAX_REGION_BYTES)


def max_batch_bytes() -> int:
    """The most bytes the lazy chunked values of one batch may decode together when collated
    (``FASTDATA_MAX_BATCH_BYTES``, default 4 GiB)."""
    return _limit(BATCH_LIMIT_ENV, DEFAULT_MAX_BATCH_BYTES)


def check_batch_bytes(values: Sequence[Any]) -> None:
    """Refuse, before anything is read, a batch whose lazy chunked values (``ChunkedArray`` among
    ``values``; other values are ignored) would decode to more than :func:`max_batch_bytes` in all
    (each one is also held to :func:`max_region_bytes` when it is read).

    Raises:
        ReadLimitError: naming the largest value (its store, record, sample and field) and the setting.
    """
    lazy = [v for v in values if isinstance(v, ChunkedArray)]
    if not lazy:
        return
    total = sum(v.nbytes for v in lazy)  # Python ints: no product or sum can wrap
    limit = max_batch_bytes()
    if total > limit:
        largest = max(lazy, key=lambda v: v.nbytes)
        raise ReadLimitError(f"a batch of {len(lazy)} chunked values would decode {total:,} bytes, more than the "
                             f"{limit:,} one batch may ({BATCH_LIMIT_ENV}); the largest is {largest._where} of shape "
                             f"{list(largest.shape)} {largest.dtype.name} ({largest.nbytes:,} bytes): set "
                             f"{BATCH_LIMIT_ENV} higher or use a smaller batch")


class _Axis:
    """The selection along one axis: an increasing arithmetic run ``lo, lo + step, ...`` of
    ``count`` indices (reversed afterwards when ``flip``), or one index dropped from the result."""

    __slots__ = ("lo", "step", "count", "flip", "drop")

    def __init__(self, lo: int, step: int, count: int, flip: bool = False, drop: bool = False):
        self.lo, self.step, self.count, self.flip, self.drop = lo, step, count, flip, drop

    def pieces(self, chunk: int, size: int) -> list[tuple[int, slice, slice]]:
        """``(chunk number, slice inside the chunk, slice of the output)`` for every chunk this
        selection takes at least one index from, and no other: a step of a chunk or more takes
        one index per chunk (``count`` pieces), a smaller step takes at least one index from
        every chunk between its first and last (so at most ``count`` pieces either way, and at
        most the axis' chunk count)."""
        if self.count == 0:
            return []
        hi = self.lo + (self.count - 1) * self.step
        out = []
        if self.step >= chunk:
            for k in range(self.count):
                i = self.lo + k * self.step
                c, inside = divmod(i, chunk)
                out.append((c, slice(inside, inside + 1), slice(k, k + 1)))
            return out
        for c in range(self.lo // chunk, hi // chunk + 1):
            begin, end = c * chunk, min((c + 1) * chunk, size)
            first = self.lo if begin <= self.lo else self.lo + -(-(begin - self.lo) // self.step) * self.step
            if first >= end or first > hi:
                continue
            last = min(end - 1, hi)
            n = (last - first) // self.step + 1
            o = (first - self.lo) // self.step
            out.append((c, slice(first - begin, first - begin + (n - 1) * self.step + 1, self.step),
                        slice(o, o + n)))
        return out


def _axes(key: Any, shape: tuple[int, ...]) -> list[_Axis]:
    """Basic numpy indexing (ints, slices with any step, ``...``) as one :class:`_Axis` per axis.

    Raises:
        IndexError: an index out of range, too many indices, or an index of another kind.
    """
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise IndexError(f"too many indices: {len(items)} for an array of {len(shape)} axes")
    items += [slice(None)] * (len(shape) - len(items))
    axes = []
    for axis, (item, size) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            run = range(start, stop, step)
            if len(run) == 0:
                axes.append(_Axis(0, 1, 0))
            elif step > 0:
                axes.append(_Axis(run[0], step, len(run)))
            else:
                axes.append(_Axis(run[-1], -step, len(run), flip=True))
        elif isinstance(item, int | np.integer) and not isinstance(item, bool | np.bool_):
            i = int(item) + size if int(item) < 0 else int(item)
            if not 0 <= i < size:
                raise IndexError(f"index {int(item)} is out of bounds for axis {axis} with size {size}")
            axes.append(_Axis(i, 1, 1, drop=True))
        else:
            raise IndexError(f"a chunked array takes ints, slices and '...' (basic indexing), not "
                             f"{type(item).__name__}; read a region first (np.asarray(arr[...])) for fancy indexing")
    return axes


class ChunkedArray:
    """A lazy, read-only N-D array over a chunked field of one stored sample.

    Attributes:
        shape, dtype, ndim, size, nbytes: as numpy's (``dtype`` in native byte order).
        chunks: the field's chunk shape.
        chunks_read: how many chunks this object has fetched and decoded so far (what a region
            read cost, for tests and benchmarks).
    """

    def __init__(self, shards: Any, shard: int, first: int, table: ChunkTable, field: Chunked, where: str,
                 on_damage: Any = None):
        """Made by the datasets (``ds[i][name]``), not by users.

        Args:
            shards: the dataset's :class:`~fastdata.reader.shards.ShardHandles`.
            shard: the shard number the value is stored in.
            first: the value's ``.first`` index entry (where its chunks start in that shard).
            table: its chunk table.
            field: the field's schema entry.
            where: the store, shard, record, sample and field, for messages.
            on_damage: called with the :class:`CorruptRecordError` of a damaged chunk before it is
                raised (the dataset counts it), or None.
        """
        self._shards = shards
        self._shard = shard
        self._first = int(first)
        self._table = table
        self._field = field
        self._codec = chunk_codec(field.codec)
        self._where = where
        self._on_damage = on_damage
        self.shape = tuple(table.shape)
        self.dtype = field.dtype.newbyteorder("=")
        self.chunks = field.chunks
        self.chunks_read = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        """Bytes the value's chunks take in the store."""
        return self._table.stored_bytes

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of an array without axes")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"ChunkedArray(shape={self.shape}, dtype={self.dtype.name}, chunks={self.chunks}, "
                f"codec={self._field.codec!r})")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> np.ndarray:
        """The region ``key`` (ints, slices with any step, ``...``) as a new numpy array.

        Raises:
            IndexError: a bad index (out of range, not basic indexing).
            CorruptRecordError: a chunk it needs is missing or damaged (naming the sample, field and chunk).
            ReadLimitError: the region is larger than :func:`max_region_bytes` (a ``ValueError`` too).
        """
        axes = _axes(key, self.shape)
        out_shape = tuple(a.count for a in axes)
        result_shape = tuple(n for n, a in zip(out_shape, axes, strict=True) if not a.drop)
        elements = math.prod(out_shape)  # Python ints, from the shape alone
        if elements == 0:  # an empty value or region: nothing to read, whatever the other axes' sizes
            return np.empty(result_shape, dtype=self.dtype)
        size = elements * self.dtype.itemsize
        if size > max_region_bytes():
            raise ReadLimitError(f"{self._where}: a region of {list(out_shape)} {self.dtype.name} is {size:,} bytes, "
                                 f"more than the {max_region_bytes():,} one read may allocate ({REGION_LIMIT_ENV}); "
                                 f"read it in parts or set {REGION_LIMIT_ENV} higher")
        out = np.empty(out_shape, dtype=self.dtype)
        per_axis = [a.pieces(c, s) for a, c, s in zip(axes, self.chunks, self.shape, strict=True)]
        grid = grid_shape(self.shape, self.chunks)
        jobs = [(linear_index(tuple(p[0] for p in combo), grid), combo) for combo in itertools.product(*per_axis)]
        # one decode buffer, the size of the largest chunk this value has, viewed at each chunk's own
        # (edge-truncated) shape: bounded by the chunk shape however many edge shapes there are
        largest = math.prod(min(int(c), int(s)) for c, s in zip(self.chunks, self.shape, strict=True))
        scratch = np.empty(largest, dtype=self._field.dtype)

        def place(k: int, data: Any) -> None:
            j, combo = batch[k]
            position = tuple(p[0] for p in combo)
            shape = tuple(r.stop - r.start for r in chunk_region(position, self.shape, self.chunks))
            decoded = scratch[:math.prod(shape)].reshape(shape)
            self._codec.decode_into(data, decoded, f"{self._where} chunk {j}")  # damage: reported by _read
            out[tuple(p[2] for p in combo)] = decoded[tuple(p[1] for p in combo)]

        for start in range(0, len(jobs), FETCH_BATCH):
            batch = jobs[start:start + FETCH_BATCH]
            self._read([j for j, _ in batch], place)
            self.chunks_read += len(batch)
        flips = tuple(slice(None, None, -1) if a.flip else slice(None) for a in axes)
        if any(a.flip for a in axes):
            out = np.ascontiguousarray(out[flips])
        return out.reshape(result_shape) if len(result_shape) != len(out_shape) else out

    def read(self, start: Sequence[int], size: Sequence[int]) -> np.ndarray:
        """The box of ``size`` starting at ``start`` (one entry per axis), refused unless it lies
        inside the array (where ``arr[a:b]`` would clip like numpy).

        Raises:
            IndexError: the box reaches outside the array (naming the sample, field and axis).
        """
        if len(start) != self.ndim or len(size) != self.ndim:
            raise IndexError(f"{self._where}: read() takes {self.ndim} starts and sizes, got {len(start)} and "
                             f"{len(size)}")
        for axis, (a, n, s) in enumerate(zip(start, size, self.shape, strict=True)):
            if a < 0 or n < 0 or a + n > s:
                raise IndexError(f"{self._where}: region [{a}, {a + n}) is outside axis {axis} of size {s} "
                                 f"(shape {self.shape})")
        return self[tuple(slice(int(a), int(a) + int(n)) for a, n in zip(start, size, strict=True))]

    def _read(self, chunks: Sequence[int], consume) -> None:
        """``consume(k, stored bytes)`` for each of ``chunks``, decoded where they lie (see
        :meth:`~fastdata.format.backends.base.ShardReader.read_chunks`)."""
        try:
            self._shards.get(self._shard).read_chunks(self._first, self._table, chunks, self._where, consume)
        except CorruptRecordError as err:
            raise self._damaged(err) from None
        except (StoreChangedError, FastdataError):
            raise

    def _damaged(self, err: CorruptRecordError) -> CorruptRecordError:
        if self._on_damage is not None:
            self._on_damage(err)
        return err

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_on_damage"] = None  # a bound method of the dataset would drag the dataset along
        return state
