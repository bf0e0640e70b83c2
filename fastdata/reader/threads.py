"""Thread workers: a DataLoader iterator whose workers are threads of the training process.

``fastdata.loader(ds, num_workers=8, worker_type="thread")`` builds its batches with
:class:`ThreadLoaderIter` instead of torch's worker processes. Why threads: fastdata's decoders
(Pillow, simplejpeg, OpenCV) and its fused crops and resizes release the GIL while they work, so
threads decode in parallel; and one process means no worker start-up (a spawned interpreter that
imports torch takes seconds on macOS and Windows), no copy of each batch between processes, and
one copy of the interpreter, torch and the dataset's index instead of one per worker.

What stays exactly as with worker processes (the tests compare the two batch for batch):

* the indices: drawn in the training thread from the loader's own ``_index_sampler`` (the same
  sampler, batch sampler, epoch tags and resume skip), after the same draw of the base seed from
  the loader's ``generator``, so the order of an epoch is the same;
* the batches: each is ``dataset.__getitems__(indices)`` (or one ``dataset[i]`` per index), then
  ``collate_fn``, then pinning, the same fetch a worker process runs; random crops come from
  per-sample streams keyed by ``(seed, epoch, index)``, so they do not depend on which thread
  builds a batch;
* the order: batches are handed out in the order their indices were drawn (as the DataLoader's
  default ``in_order=True``), at most ``num_workers * prefetch_factor`` in flight;
* ``state_dict``: counted from the batches handed to the training loop (``_num_yielded``);
* errors: an exception raised building a batch is raised by ``next()`` when that batch's turn
  comes, with its own type and traceback; ``timeout`` bounds the wait for one batch;
* ``persistent_workers=True``: the thread pool is kept from one epoch to the next.

The first batch of an epoch is split: each thread reads and decodes a part of it (a fastdata
dataset's ``__getitems__`` of consecutive parts of the indices), and the parts are joined into the
batch the whole would have given (:func:`fastdata.reader.batching.concat_parts`), so that the
first batch comes after a part's decoding, not a whole batch's. Later batches are built whole, one
per thread, while the training loop works on the earlier ones.

What differs, by nature: ``torch.utils.data.get_worker_info()`` is None in a thread (there is no
worker process); a ``worker_init_fn`` is called in each thread when it starts (as in each worker
process), except :func:`fastdata.seed_worker`, which seeds process-wide generators: in a thread
that would reseed the training process's own. Process-wide state a ``worker_init_fn`` sets is
shared by every thread.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from torch.utils.data import _utils
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from fastdata.reader.batching import concat_parts
from fastdata.reader.seeding import EpochIndex, seed_worker

__all__ = ["ThreadLoaderIter"]

#: batches in flight per thread when the loader has no ``prefetch_factor`` (torch's default)
DEFAULT_PREFETCH = 2

#: torch's intra-op threads are OpenMP's, whose thread count is a setting of each calling thread
#: (elsewhere, torch's own pool has one count for the process, which must not change once used)
_PER_THREAD_OP_THREADS = "OpenMP" in torch.__config__.parallel_info()


def _one_op_thread_each(pool: ThreadPoolExecutor, threads: int) -> None:
    """Make each of ``pool``'s ``threads`` threads run torch's operators on one thread, as torch's
    worker loop does in each DataLoader worker process (``torch.set_num_threads(1)``), and leave
    the training thread's count as it was.

    Why: an antialiased resize of a crop to 224 px takes as long on two OpenMP threads as on one
    (214 us) but twice the CPU, so two loader threads each running it on two kept both cores busy
    for the work of one (thread workers from a raw store: 3240 against 2969 img/s with one). In
    OpenMP the count is each thread's own, but ``torch.set_num_threads`` also sets the default
    that threads take at their first operator; so every pool thread sets its own while the
    training thread waits at a barrier, and the training thread then sets its count back, which
    restores that default (a thread of the user's that ran its first operator in between would
    have taken one thread: microseconds, once per pool).
    """
    if not _PER_THREAD_OP_THREADS:
        return
    training = torch.get_num_threads()
    if training == 1:
        return
    barrier = threading.Barrier(threads + 1)

    def one_thread() -> None:
        torch.get_num_threads()  # (this thread's first call takes the default now, not at its first operator)
        torch.set_num_threads(1)
        try:
            barrier.wait(timeout=30)  # (so each pool thread takes one of these tasks)
        except threading.BrokenBarrierError:
            pass

    for _ in range(threads):
        pool.submit(one_thread)
    try:
        barrier.wait(timeout=30)
    except threading.BrokenBarrierError:  # a thread could not start: the counts are only a matter of speed
        barrier.abort()
    torch.set_num_threads(training)


class _Parts:
    """A batch in flight as parts, one future each (the first batch of an epoch)."""

    __slots__ = ("index", "futures")

    def __init__(self, index: list, futures: list[Future]) -> None:
        self.index, self.futures = index, futures

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


def split_indices(index: list, parts: int) -> list[list]:
    """``index`` cut into ``parts`` consecutive, nearly equal parts, each one's first index tagged with
    the epoch of the batch's first (a fastdata dataset reads a batch's epoch from its first index)."""
    bounds = [len(index) * k // parts for k in range(parts + 1)]
    out = [list(index[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    first = index[0]
    if isinstance(first, EpochIndex):
        for part in out[1:]:
            if not isinstance(part[0], EpochIndex):
                part[0] = EpochIndex(part[0], first.epoch)
    return out


class ThreadLoaderIter(_BaseDataLoaderIter):
    """The iterator of a :class:`fastdata.reader.loader.Loader` with ``worker_type="thread"``.

    Args:
        loader: the loader (its ``num_workers`` is the number of threads).
    """

    def __init__(self, loader) -> None:
        super().__init__(loader)
        self._fetcher = _DatasetKind.create_fetcher(self._dataset_kind, self._dataset, self._auto_collation,
                                                    self._collate_fn, self._drop_last)
        self._depth = max(1, self._num_workers * (loader.prefetch_factor or DEFAULT_PREFETCH))
        init = loader.worker_init_fn
        self._worker_init = None if init is None or init is seed_worker else init
        self._thread_ids: dict[int, int] = {}  # thread ident -> worker id, for worker_init_fn
        self._ids_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future | _Parts] = deque()
        self._exhausted = False
        self._split_next = True  # the first batch of each epoch is split across the threads
        getitems = getattr(type(self._dataset), "__getitems__", None)
        # only a fastdata dataset's batches can be joined back into what the whole would have given
        self._splits = (self._auto_collation and self._num_workers > 1 and callable(getitems)
                        and getattr(getitems, "__module__", "").startswith("fastdata."))
        self._start_pool()

    # -- the pool ---------------------------------------------------------------------------
    def _start_pool(self) -> None:
        self._pool = ThreadPoolExecutor(self._num_workers, thread_name_prefix="fastdata-loader")
        self._thread_ids = {}
        _one_op_thread_each(self._pool, self._num_workers)

    def _first_call_in_thread(self) -> None:
        with self._ids_lock:
            worker_id = self._thread_ids.setdefault(threading.get_ident(), len(self._thread_ids))
        if self._worker_init is not None:
            self._worker_init(worker_id)

    def _fetch(self, index) -> Any:
        if threading.get_ident() not in self._thread_ids:
            self._first_call_in_thread()
        data = self._fetcher.fetch(index)
        if self._pin_memory:
            data = _utils.pin_memory.pin_memory(data, self._pin_memory_device)
        return data

    def _fetch_part(self, part: list) -> Any:
        if threading.get_ident() not in self._thread_ids:
            self._first_call_in_thread()
        return getattr(self._dataset, "__getitems__")(part)  # noqa: B009 - (Dataset's stub has no __getitems__)

    def _submit(self, pool: ThreadPoolExecutor, index) -> Future | _Parts:
        split, self._split_next = self._split_next, False
        if split and self._splits and len(index) >= 2 * self._num_workers:
            return _Parts(index, [pool.submit(self._fetch_part, part)
                                  for part in split_indices(index, self._num_workers)])
        return pool.submit(self._fetch, index)

    def _wait(self, future: Future) -> Any:
        return future.result(timeout=self._timeout if self._timeout > 0 else None)

    def _joined(self, parts: _Parts) -> Any:
        joined = concat_parts([self._wait(future) for future in parts.futures])
        if joined is None:  # parts of a kind that cannot be joined: read the batch whole
            return self._fetch(parts.index)
        data = self._collate_fn(joined)
        if self._pin_memory:
            data = _utils.pin_memory.pin_memory(data, self._pin_memory_device)
        return data

    def _fill(self) -> None:
        """Submit batches until ``num_workers * prefetch_factor`` are in flight or the sampler ends."""
        pool = self._pool
        assert pool is not None
        while not self._exhausted and len(self._pending) < self._depth:
            try:
                index = self._next_index()
            except StopIteration:
                self._exhausted = True
                break
            self._pending.append(self._submit(pool, index))

    def _next_data(self) -> Any:
        if self._pool is None:
            raise StopIteration
        self._fill()
        if not self._pending:
            if not self._persistent_workers:
                self._shutdown()
            raise StopIteration
        pending = self._pending.popleft()
        try:
            data = self._joined(pending) if isinstance(pending, _Parts) else self._wait(pending)
        except FutureTimeout:
            self._shutdown()
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds (thread workers)") from None
        except BaseException:
            self._shutdown()
            raise
        self._fill()  # keep the threads busy while the training loop uses this batch
        return data

    # -- epochs and shutdown ------------------------------------------------------------------
    def _reset(self, loader, first_iter: bool = False) -> None:
        # persistent_workers: DataLoader.__iter__ resets this iterator for the next epoch
        self._drain()
        super()._reset(loader, first_iter)
        self._exhausted = False
        self._split_next = True
        if self._pool is None:
            self._start_pool()

    def _drain(self) -> None:
        """Drop the batches in flight (cancelled if not started, else waited for and discarded)."""
        pending, self._pending = self._pending, deque()
        futures = [f for item in pending for f in (item.futures if isinstance(item, _Parts) else [item])]
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - a discarded batch's error is not this epoch's
                    pass

    def _shutdown(self) -> None:
        pool, self._pool = self._pool, None
        # list(), not a new deque: at interpreter exit __del__ may run after module globals are cleared
        pending = list(self._pending)
        self._pending.clear()
        for item in pending:
            item.cancel()
        if pool is not None:
            # no wait: a batch still being built finishes in its thread and is dropped
            pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        if not _finalizing():  # at interpreter exit the pool's threads are joined by concurrent.futures
            self._shutdown()

