"""Small fixed-shape batches from DataLoader workers to the main process through
a per-worker shared-memory ring: only a descriptor crosses the worker queue.

Why: a batch pickled by value crosses the queue's 64 KiB pipe in pieces, and
the main process spends its time in ``read`` waiting for each piece (measured on
256 images of 32x32: ~14 reads and ~1.6 ms of the main process per batch, which
capped a raw store at ~80k images/s); a tensor in torch shared memory costs a
new segment plus a descriptor round trip to the (busy) worker per batch.

Protocol. Each worker owns one ring: a ``memfd`` (anonymous shared memory, gone
with its last mapping) of ``SLOTS`` slots plus a header of state bytes:

* byte 0 is set to 1 by the main process once it has mapped the ring; until
  then every batch travels by value and carries the ring's descriptor
  (pid, fd, inode), so the main process maps it at its first batch;
* byte 1 + s is slot s's state: the worker takes a free slot (0 -> 1), copies
  the batch in and sends (pid, inode, slot); the main process wraps the slot in
  an array *without copying* and sets the byte back to 0 when that array (and
  every tensor viewing it) is garbage collected.

A worker that finds no free slot (the training loop still holds older batches)
sends by value, so holding batches never blocks or corrupts anything. Each
state byte has one writer at a time (the worker only writes free slots, the
main process only slots it holds), so no lock is needed.
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np
import psutil

SLOTS = 8
_HEADER = 64
_PAGE = mmap.PAGESIZE


class WorkerRing:
    """The ring of one DataLoader worker (created lazily, in the worker)."""

    def __init__(self, slot_bytes: int):
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        size = _HEADER + SLOTS * self.slot_bytes
        self.fd = os.memfd_create("fastdata-batch-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.pid = os.getpid()
        self.inode = os.fstat(self.fd).st_ino
        self._array = np.frombuffer(self.map, np.uint8)
        #: slots whose contents went to the main process (it frees them), see :func:`lend`
        self.sent: set[int] = set()
        #: slots lent whose array is still alive in this worker (never reused until it dies:
        #: a transform may keep a sample, e.g. a mosaic buffer)
        self.lent: set[int] = set()
        #: address of the mapping in this process (to find the slot a tensor views)
        self.address = self._array.ctypes.data

    @property
    def attached(self) -> bool:
        """Whether the main process has mapped this ring."""
        return self.map[0] == 1

    def acquire(self) -> int | None:
        """Take the lowest free slot (0 -> 1; the lowest, so that only as many slots as
        batches are in flight ever get touched); its number, or None if none is free."""
        for slot in range(SLOTS):
            if self.map[1 + slot] == 0 and slot not in self.lent:
                self.map[1 + slot] = 1
                return slot
        return None

    def release(self, slot: int) -> None:
        """Give back a slot this worker took and never sent (the main process frees sent ones)."""
        if not self.map.closed:
            self.map[1 + slot] = 0

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``slot``, writable, in this worker."""
        return self._array[_HEADER + slot * self.slot_bytes:_HEADER + slot * self.slot_bytes + nbytes]

    def locate(self, address: int) -> tuple[int, int] | None:
        """``(slot, offset in it)`` of a byte at ``address`` inside this ring's slots, else None."""
        offset = address - self.address - _HEADER
        if self.map.closed or not 0 <= offset < SLOTS * self.slot_bytes:
            return None
        return offset // self.slot_bytes, offset % self.slot_bytes

    def put(self, data: np.ndarray) -> int | None:
        """Copy ``data`` (contiguous uint8) into a free slot; its number, or None if none is free."""
        slot = self.acquire()
        if slot is not None:
            self.view(slot, data.nbytes)[:] = data.reshape(-1)
        return slot

    def descriptor(self) -> tuple[int, int, int]:
        return self.pid, self.fd, self.inode

    def close(self) -> None:
        # batches the main process still holds keep their own mapping
        del self._array
        os.close(self.fd)
        try:
            self.map.close()
        except BufferError:  # arrays of this worker still view a slot: unmapped when they go
            pass


_worker_ring: WorkerRing | None = None
_ring_unavailable = False


def set_enabled(enabled: bool) -> None:
    """Let this process send batches through a ring (the default where the OS has memfd), or not.

    Off, this process makes no ring and closes the one it has (batches it sends travel pickled,
    as they do where there is no memfd); DataLoader workers forked from it afterwards inherit
    the setting, spawned ones start with the default. On again, the next batch makes a new ring
    where memfd exists.

    Args:
        enabled (bool): whether to use rings from now on.
    """
    global _ring_unavailable
    drop_ring()
    _ring_unavailable = not enabled


def ring_enabled() -> bool:
    """Whether this process may still send batches through a ring (False once turned off with
    :func:`set_enabled`, or once making a ring failed: no memfd, or no shared memory).

    Returns:
        bool: whether a ring is used or may still be made.
    """
    return not _ring_unavailable


def drop_ring() -> None:
    """Close and forget this process's ring, if it has one; the next batch makes a new one, which
    the main process has not mapped yet (so that batch travels pickled and announces the ring).
    Batches that still view the old ring's slots keep its memory alive."""
    global _worker_ring
    ring = current_ring()
    _worker_ring = None
    if ring is not None:
        ring.close()


def current_ring() -> WorkerRing | None:
    """This worker's ring if it has one (None in the main process)."""
    ring = _worker_ring
    return ring if ring is not None and ring.pid == os.getpid() else None


def lend(nbytes: int) -> np.ndarray | None:
    """A writable ``nbytes`` array in a free slot of this worker's ring (made or grown
    with headroom as needed), for a batch built in place; None when there is no ring, the
    main process has not mapped it yet, or every slot is taken.

    Pickling a tensor that views it (:class:`fastdata.reader.batching.PackedBatch`) hands the
    slot to the main process (:attr:`WorkerRing.sent`), which frees it when done; a slot
    whose array dies in the worker without being sent is freed by the worker. Either way
    the slot is not lent again while any array viewing it lives in this worker."""
    import weakref

    ring = worker_ring(nbytes, headroom=1.5)
    if ring is None or not ring.attached:
        return None
    slot = ring.acquire()
    if slot is None:
        return None
    array = ring.view(slot, nbytes)
    ring.lent.add(slot)
    weakref.finalize(array, _dropped, ring, slot)
    return array


def _dropped(ring: WorkerRing, slot: int) -> None:
    ring.lent.discard(slot)
    if slot in ring.sent:
        ring.sent.discard(slot)  # the main process owns it now
    else:
        ring.release(slot)


def worker_ring(nbytes: int, headroom: float = 1.0) -> WorkerRing | None:
    """This worker's ring, (re)made when a batch of ``nbytes`` does not fit (with slots of
    ``headroom`` times that, for batches whose size varies); None where memfd is unavailable."""
    global _worker_ring, _ring_unavailable
    if _ring_unavailable:
        return None
    ring = _worker_ring
    if ring is not None and ring.pid == os.getpid() and ring.slot_bytes >= nbytes:
        return ring
    if ring is not None and ring.pid == os.getpid():
        ring.close()
    try:
        _worker_ring = WorkerRing(int(nbytes * headroom))
    except (AttributeError, OSError):  # no os.memfd_create (not Linux) or no shared memory
        _worker_ring, _ring_unavailable = None, True
    return _worker_ring


class AttachedRing:
    """A worker's ring as mapped in the main process."""

    def __init__(self, pid: int, fd: int, inode: int):
        # /proc/<pid>/fd/<fd> opens the worker's memfd itself (same user: allowed)
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(handle)
            if st.st_ino != inode:
                raise OSError(f"/proc/{pid}/fd/{fd} is not the announced ring")
            self.map = mmap.mmap(handle, st.st_size)
        finally:
            os.close(handle)  # the mapping stays valid
        self.slot_bytes = (st.st_size - _HEADER) // SLOTS
        self.map[0] = 1

    def take(self, slot: int, nbytes: int) -> np.ndarray:
        """Slot ``slot`` as an array; the slot is freed when the array is collected."""
        arr = np.frombuffer(self.map, np.uint8, nbytes, _HEADER + slot * self.slot_bytes)
        weakref.finalize(arr, self._free, slot, os.getpid())
        return arr

    def _free(self, slot: int, owner: int) -> None:
        # a process forked from the holder shares the mapping: only the holder frees
        if os.getpid() == owner and not self.map.closed:
            self.map[1 + slot] = 0


#: batches this (main) process received through a ring / by value (for tests and diagnosis)
received = {"ring": 0, "by_value": 0}
_attached: dict[tuple[int, int], AttachedRing] = {}
_failed: set[tuple[int, int]] = set()
_attached_by = os.getpid()


def attach(pid: int, fd: int, inode: int) -> AttachedRing | None:
    """Map a worker's ring in this (the main) process, once; None if it cannot be."""
    global _attached_by
    if _attached_by != os.getpid():  # forked: the parent's rings are not ours to use
        _attached.clear()
        _failed.clear()
        _attached_by = os.getpid()
    key = (pid, inode)
    ring = _attached.get(key)
    if ring is not None or key in _failed:
        return ring
    try:
        ring = AttachedRing(pid, fd, inode)
    except (OSError, ValueError):
        _failed.add(key)
        return None
    for old in [k for k in _attached if k[0] == pid or not psutil.pid_exists(k[0])]:
        # a worker that made a new ring never sends into its old one again;
        # batches still viewing an old mapping keep it alive themselves
        del _attached[old]
    _attached[key] = ring
    return ring


def ring_array(pid: int, fd: int, inode: int, slot: int, nbytes: int) -> np.ndarray:
    """The pixels a worker put into ``slot`` of its ring (zero-copy)."""
    ring = attach(pid, fd, inode)
    if ring is None:  # cannot happen: the worker only uses slots after we mapped the ring
        raise RuntimeError(f"fastdata: lost the batch ring of DataLoader worker {pid}")
    received["ring"] += 1
    return ring.take(slot, nbytes)
