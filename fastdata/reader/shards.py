"""``ShardHandles``: the shard readers one process has open on one store.

A dataset keeps one of these; it is the only thing in a dataset that holds OS handles
(LMDB environments, HDF5 files, cache pins of a remote store's shards), and it follows
the rules that make a dataset safe under any DataLoader setting:

* Nothing is open until :meth:`ShardHandles.get` asks for a shard, in each process: a
  new instance, and one just unpickled, hold no handle.
* Handles belong to the process that opened them (its pid). After a fork the child's
  copy sees another pid and opens its own; the parent's are parked, untouched (not
  closed, not even freed, so that no destructor runs on them in the child).
* Pickling (spawn/forkserver workers) drops the handles: the pickle holds the
  settings only.
* At most ``max_open`` readers stay open per process (least recently used closed
  first); ``None`` takes the store's default (all for a local store, a few for a
  remote one, see :meth:`fastdata.remote.store.StoreLocation.open_shards_per_process`).
* Thread workers (``worker_type="thread"``) share one instance: opening, closing and the LRU
  order are done under a lock, and the LRU never closes a reader another thread took last
  (each thread reads one shard at a time, so the reader it took last is the one it may be
  reading): the cap may then be exceeded by at most one reader per thread, until that thread
  takes another shard.
* A reader reads the store version the dataset opened, or raises
  :class:`~fastdata.errors.StoreChangedError`: every open of a shard (a worker's first
  read, a re-open after the LRU closed it) checks the file against the identity the
  store location recorded, with a ``stat`` just before the backend opens it and one just
  after (the backends open by path and do not expose their descriptor, so the second
  ``stat`` is what proves the file opened is the recorded one), plus a ``stat`` of the
  manifest; readers already open check the manifest's ``stat`` at most every
  :data:`CHECK_INTERVAL_S` (they hold the old files, so what they read until then is the
  old version whole, never a mix). See :mod:`fastdata.remote.store`.
"""

from __future__ import annotations

import threading
from os import getpid
from time import monotonic
from typing import Any

from fastdata.common import portable
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.remote.store import StoreLocation

#: handles inherited from a parent process: kept referenced so that neither we
#: nor the garbage collector ever touches them in the child
_INHERITED_HANDLES: list = []
#: held while a process takes a ShardHandles over (its first get there): two loader threads that
#: both did would each replace its lock and readers, the second while the first held and used them
_ADOPTING = threading.Lock()


def _new_adopting_lock() -> None:  # (one held by another thread at a fork is never released in the child)
    global _ADOPTING
    _ADOPTING = threading.Lock()


portable.at_fork_in_child(_new_adopting_lock)
#: seconds between two checks of the manifest by the readers already open in a process
#: (a ``stat``, ~1 us; each shard open always checks)
CHECK_INTERVAL_S = 0.01


class ShardHandles:
    """Lazily opened, per-process, LRU-capped shard readers of one store.

    Args:
        store: where the store lives (gives each shard's local path and cache pin).
        backend: the store's backend name (``"lmdb"``, ``"hdf5"``).
        storage: the store's storage spec, passed to each reader.
        readahead: the readers' ``readahead`` (LMDB only).
        schema: the schema of a general (version-2) store; None for a classification store.
        max_open: readers kept open at once in a process; None = the store's default.
    """

    def __init__(self, store: StoreLocation, backend: str, storage: StorageSpec, *, readahead: bool,
                 schema: Any = None, max_open: int | None = None):
        self.store = store
        self.backend = backend
        self.storage = storage
        self.readahead = readahead
        self.schema = schema
        self.max_open = max_open
        self._cap: int | None = None  # this process's max_open (the store's default when None)
        self._readers: dict[int, Any] = {}  # in LRU order when capped: least recently used first
        self._pins: dict[int, Any] = {}
        self._pid: int | None = None
        self._checked = 0.0  # monotonic time of this process's last check of the manifest
        self._lock = threading.RLock()
        self._taken: dict[int, int] = {}  # thread ident -> the shard that thread took last

    def get(self, shard: int):
        """This process's reader of shard number ``shard``, opened now if it is not open
        (closing the least recently used one first when ``max_open`` are open).

        Raises:
            StoreChangedError: the store was rewritten since it was opened.
        """
        if self._pid != getpid():
            with _ADOPTING:  # (loader threads' first reads: one adopts, the others then see its pid)
                if self._pid != getpid():
                    self._adopt_process()
        with self._lock:
            self._taken[threading.get_ident()] = shard
            reader = self._readers.get(shard)
            if reader is not None:
                if not self.store.remote:
                    now = monotonic()
                    if now - self._checked >= CHECK_INTERVAL_S:
                        self.store.check_current()
                        self._checked = now
                if self._cap:  # moved last: dict order is the LRU order the cap closes by
                    self._readers[shard] = self._readers.pop(shard)
                return reader
            return self._open(shard)

    def _adopt_process(self) -> None:
        # (a lock held by another thread when this process was forked would never be released here)
        self._lock = threading.RLock()
        self._taken = {}
        if self._readers:
            # Inherited through fork: never use, close or even free them here. (Their cache
            # pins are not held here: the cache closes a forked child's copies of its lock
            # files, so the parent's release is what unpins a shard.)
            _INHERITED_HANDLES.append((self._readers, self._pins))
        self._readers = {}
        self._pins = {}
        self._pid = getpid()
        self._cap = self.max_open or self.store.open_shards_per_process(_loader_processes())

    def _evictable(self) -> list[int]:
        """Open shards no other live thread took last, least recently used first (a thread that has
        ended reads nothing: its mark is dropped, or each epoch's new pool would pin more shards)."""
        me = threading.get_ident()
        alive = {thread.ident for thread in threading.enumerate()}
        self._taken = {thread: shard for thread, shard in self._taken.items() if thread in alive}
        busy = {shard for thread, shard in self._taken.items() if thread != me}
        return [shard for shard in self._readers if shard not in busy]

    def _open(self, shard: int):
        if self._cap and len(self._readers) >= self._cap:
            # least recently used first, down to the cap again once readers other threads held are free
            idle = self._evictable()
            while idle and len(self._readers) >= self._cap:
                self._close(idle.pop(0))
        ranged = self.store.record_reader(shard)  # (a remote store read record by record: no shard file)
        if ranged is not None:
            self._readers[shard] = ranged
            return ranged
        path, pin = self.store.open_shard(shard, release_idle=self._close_all)
        try:
            self.store.check_shard(shard, path)
            reader = reader_class(self.backend)(path, self.storage, readahead=self.readahead, schema=self.schema,
                                                expected_count=self.store.manifest["shards"][shard]["count"])
            try:
                self.store.check_shard(shard, path, manifest=False)  # the file it opened is the recorded one
            except BaseException:
                reader.close()
                raise
        except BaseException:
            pin.release()
            raise
        self._checked = monotonic()
        self._pins[shard] = pin
        self._readers[shard] = reader
        return reader

    def open_readers(self) -> dict[int, Any]:
        """Shard number -> reader for the readers this process has open, least recently used
        first (a new dict; empty in a process that has opened none, e.g. a forked child)."""
        with self._lock:
            return dict(self._readers) if self._pid == getpid() else {}

    def _close(self, shard: int) -> None:
        reader = self._readers.pop(shard)
        try:
            reader.close()
        finally:
            pin = self._pins.pop(shard, None)
            if pin is not None:
                pin.release()

    def _close_all(self) -> None:
        """Close this process's readers (and release their cache pins): also called when a
        remote shard finds no room in the cache, so idle pins of this process never block it
        (readers another thread may be reading stay open)."""
        with self._lock:
            for shard in self._evictable():
                self._close(shard)

    def close(self) -> None:
        """Close this process's readers (handles inherited through fork are left alone);
        the next :meth:`get` opens again. Not while thread workers are reading."""
        with self._lock:
            if self._pid == getpid():
                for shard in list(self._readers):
                    self._close(shard)
            self._readers = {}
            self._pins = {}
            self._taken = {}
            self._pid = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_readers"] = {}
        state["_pins"] = {}
        state["_pid"] = None
        state["_checked"] = 0.0
        state["_taken"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()


def _loader_processes() -> int:
    """How many processes of this DataLoader read the store: its worker count inside a worker, else 1."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return info.num_workers if info is not None else 1
