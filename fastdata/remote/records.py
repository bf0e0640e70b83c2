"""Single records of a remote store, read with ranged requests instead of whole shards.

``open_dataset(url, cache="records")``: a record is read from its shard object with one ranged GET
(an LMDB record whose tail parts lie far from its head: a few, concurrently), never downloading the
shard. Where a record lies comes from the store index file's ``record_ranges``
(:data:`fastdata.format.record.RECORD_RANGES`, written by the shard writers from the finished file):
no shard is opened to learn it.

What a ranged read trusts and checks (the store is untrusted input):

* every piece the index gives a record must lie inside the shard's size as the manifest declares
  it, and their total must be a size the record's index entries allow
  (:meth:`~fastdata.format.backends.base.ShardReader.stored_value_bounds`); otherwise a
  :class:`~fastdata.errors.CorruptRecordError` naming the shard and record, before any request;
* each reply must be exactly the range asked for (:meth:`RemoteLocation.read_range` reads no more);
* the bytes are checked as the shard reader checks them (the index's xxh3-64 checksum;
  :meth:`~fastdata.format.backends.base.ShardReader.from_stored_value`). A mismatch first asks
  whether the store was rewritten on the server since it was opened
  (:class:`~fastdata.errors.StoreChangedError`), as a shard download does; else it is damage.

Requests are bounded per process (``$FASTDATA_REMOTE_RECORD_REQUESTS``, default 8, across every
store and thread of the process) and retried with backoff by :meth:`RemoteLocation.call`.
Nothing here survives pickling or a fork: the thread pool and the semaphore are made per process,
on first use.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastdata.errors import CorruptRecordError
from fastdata.format.backends.base import ShardReader, StorageSpec
from fastdata.remote.location import RemoteLocation

#: concurrent ranged requests of one process, by default
DEFAULT_RECORD_REQUESTS = 8
#: a record's pieces are joined into one request while it moves fewer than this many times the
#: record's bytes (the gaps between them come along); beyond, it is cut at its largest gaps
MAX_READ_FACTOR = 2
#: requests of one batch at most this far apart are merged (neighbouring records in one GET)
MERGE_GAP = 4 << 10
#: a merged request is not grown past this (a long run of records is read in parallel pieces)
MAX_MERGED_BYTES = 4 << 20


def record_requests() -> int:
    """Ranged requests one process makes at once: ``$FASTDATA_REMOTE_RECORD_REQUESTS`` (default 8, at least 1)."""
    value = os.environ.get("FASTDATA_REMOTE_RECORD_REQUESTS", "")
    try:
        return max(1, int(value)) if value else DEFAULT_RECORD_REQUESTS
    except ValueError:
        raise ValueError(f"$FASTDATA_REMOTE_RECORD_REQUESTS: {value!r} is not a number of requests") from None


class _Requests:
    """This process's bound on ranged requests: a semaphore every request holds, and a pool that
    runs a batch's requests side by side (made on first use; new ones in a forked child)."""

    def __init__(self) -> None:
        self.pid = -1
        self.lock = threading.Lock()
        self.pool: cf.ThreadPoolExecutor | None = None
        self.slots: threading.BoundedSemaphore | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # (the parent's pool threads do not exist here, and a lock another thread held at the fork
        # would never be released)
        self.lock, self.pool, self.slots, self.pid = threading.Lock(), None, None, -1

    def _ready(self) -> tuple[cf.ThreadPoolExecutor, threading.BoundedSemaphore]:
        if self.pid != os.getpid() or self.pool is None or self.slots is None:
            with self.lock:
                if self.pid != os.getpid() or self.pool is None or self.slots is None:
                    n = record_requests()
                    self.pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastdata-record")
                    self.slots = threading.BoundedSemaphore(n)
                    self.pid = os.getpid()
        return self.pool, self.slots

    def one(self, fetch: Callable[[], bytes]) -> bytes:
        _pool, slots = self._ready()
        with slots:
            return fetch()

    def many(self, fetches: list[Callable[[], bytes]]) -> list[bytes]:
        """Each fetch's bytes, run side by side up to the bound; the first error is raised."""
        if len(fetches) == 1:
            return [self.one(fetches[0])]
        pool, _slots = self._ready()
        futures = [pool.submit(self.one, fetch) for fetch in fetches]
        return [future.result() for future in futures]


REQUESTS = _Requests()


def plan_record(pieces: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte ranges to request for one record's ``pieces`` (rows ``(offset,
    length)``, already checked to lie in the file): the fewest whose bytes stay below
    :data:`MAX_READ_FACTOR` times the record's, its pieces joined across the smallest gaps first
    (one range when the whole span is small enough: always for an HDF5 record, one piece)."""
    spans = sorted((int(a), int(a) + int(n)) for a, n in pieces.tolist() if n)
    merged: list[list[int]] = []
    for a, b in spans:  # overlapping or touching pieces are one span
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return []
    size = sum(b - a for a, b in spans)
    gaps = sorted((merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1))
    extra, joined = 0, set()
    for gap, i in gaps:  # smallest first: the most joins for the bytes allowed
        if size + extra + gap >= MAX_READ_FACTOR * size:
            break
        extra += gap
        joined.add(i)
    out = [(merged[0][0], merged[0][1])]
    for i in range(1, len(merged)):
        if i - 1 in joined:
            out[-1] = (out[-1][0], merged[i][1])
        else:
            out.append((merged[i][0], merged[i][1]))
    return out


def merge_requests(requests: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A batch's requests in offset order, those at most :data:`MERGE_GAP` apart merged (up to
    :data:`MAX_MERGED_BYTES` a request)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(set(requests)):
        if out and a - out[-1][1] <= MERGE_GAP and max(b, out[-1][1]) - out[-1][0] <= MAX_MERGED_BYTES:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


class RangedShardReader(ShardReader):
    """Reads records of one shard of a remote store with ranged requests (the
    :class:`~fastdata.format.backends.base.ShardReader` interface, so datasets read through it as
    through a shard file's reader). Holds no OS handle; made per process by
    :class:`fastdata.reader.shards.ShardHandles`, never pickled.

    Args:
        location: the store's location.
        name: the shard object's name.
        shard_bytes: the shard's size as the manifest declares it (no piece may lie past it).
        ranges: the shard's ``record_ranges`` (``uint64 [n, k, 2]``).
        checksums: the index's checksum of each record (what :meth:`get` checks against).
        nbytes: the index's ``nbytes`` of each record.
        path_bytes: the length of each record's stored path.
        reader_cls: the backend's shard reader class (how a stored value is checked and decoded).
        storage: the store's storage spec.
        schema: a general store's schema; None for a classification store.
        check_rewritten: raises StoreChangedError when the store at the URL is no longer the one
            opened (called before a damaged or missing record is reported).
    """

    def __init__(self, *, location: RemoteLocation, name: str, shard_bytes: int, ranges: np.ndarray,
                 checksums: np.ndarray, nbytes: np.ndarray, path_bytes: np.ndarray, reader_cls: type[ShardReader],
                 storage: StorageSpec, schema: Any, check_rewritten: Callable[[], None]):
        super().__init__(location.child(name), storage, schema=schema, expected_count=len(checksums))
        self.location, self.name, self.shard_bytes = location, name, int(shard_bytes)
        self._ranges, self._checksums, self._nbytes, self._path_bytes = ranges, checksums, nbytes, path_bytes
        self._reader_cls = reader_cls
        self._check_rewritten = check_rewritten
        #: ranged requests made by this reader (for tests and diagnosis)
        self.requests = 0

    def _where(self, j: int) -> str:
        return f"{self.path} record {j}"

    def _pieces(self, j: int) -> tuple[np.ndarray, int]:
        """Record ``j``'s pieces and size, checked against the shard's size and the record's index
        entries before anything is read."""
        if not 0 <= j < len(self._checksums):
            raise CorruptRecordError(f"{self._where(j)}: the shard has no such record", shard=self.path, index=j)
        rows = self._ranges[j]
        rows = rows[rows[:, 1] > 0]
        size = 0
        for offset, length in rows.tolist():  # (Python ints: a crafted offset cannot wrap)
            if offset + length > self.shard_bytes:
                raise CorruptRecordError(
                    f"{self._where(j)}: the store index places it at bytes {offset:,}-{offset + length - 1:,}, past "
                    f"the end of the shard ({self.shard_bytes:,} bytes, as the manifest says): the index is damaged "
                    "or was crafted; nothing was read. Run 'fastdata verify' on the store", shard=self.path, index=j)
            size += length
        lo, hi = self._reader_cls.stored_value_bounds(int(self._nbytes[j]), int(self._path_bytes[j]),
                                                      schema=self.schema)
        if not lo <= size <= hi:
            raise CorruptRecordError(
                f"{self._where(j)}: the store index gives it {size:,} stored bytes, where its index entries allow "
                f"{lo:,} to {hi:,}: the index is damaged or was crafted; nothing was read. Run 'fastdata verify' on "
                "the store", shard=self.path, index=j)
        return rows, size

    def _fetch(self, requests: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        self.requests += len(requests)
        fetches: list[Callable[[], bytes]] = [functools.partial(self.location.read_range, self.name, a, b)
                                              for a, b in requests]
        try:
            return dict(zip(requests, REQUESTS.many(fetches), strict=True))
        except Exception:
            self._check_rewritten()  # a missing object, or one shorter than the index says: rewritten?
            raise

    @staticmethod
    def _value(rows: np.ndarray, got: dict[tuple[int, int], bytes], starts: list[tuple[int, int]]) -> bytes:
        """The record's stored bytes: its pieces, in the index's order, sliced out of the replies
        (``starts``: the requests in offset order; each piece lies inside one of them)."""
        parts = []
        for offset, length in rows.tolist():
            a, b = starts[bisect.bisect_right(starts, (offset, 1 << 64)) - 1]
            parts.append(got[(a, b)][offset - a:offset - a + length])
        return b"".join(parts)

    def _checked(self, j: int, value: bytes) -> bytes:
        try:
            return self._reader_cls.from_stored_value(value, j, int(self._checksums[j]), schema=self.schema,
                                                      where=self._where(j))
        except CorruptRecordError as err:
            self._check_rewritten()  # the store rewritten on the server since it was opened, or damage
            raise CorruptRecordError(f"{err} (read with a ranged request)", shard=self.path, index=j) from None

    def read_index(self):
        raise NotImplementedError("a ranged reader reads records; the index comes from the store index file")

    def get(self, local_index: int) -> bytes:
        """Record ``local_index``'s bytes (as the shard's own reader gives them), checked; one ranged
        request (an LMDB record whose pieces lie far apart: one per group of pieces, side by side)."""
        j = int(local_index)
        rows, _size = self._pieces(j)
        requests = plan_record(rows)
        return self._checked(j, self._value(rows, self._fetch(requests), requests))

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """The records' bytes in the order given: every record's requests planned as :meth:`get`
        plans them, those of neighbouring records merged (:func:`merge_requests`), all made side by
        side up to the process's bound. The first damaged record raises (the dataset then reads the
        batch's records one by one)."""
        ids = [int(i) for i in local_indices]
        planned = {j: self._pieces(j)[0] for j in dict.fromkeys(ids)}
        requests = merge_requests([r for rows in planned.values() for r in plan_record(rows)])
        got = self._fetch(requests)
        values = {j: self._checked(j, self._value(rows, got, requests)) for j, rows in planned.items()}
        return [values[j] for j in ids]

    def close(self) -> None:
        """Nothing to release (the process's request pool is shared)."""
