"""Truthful memory measurement for a process and its DataLoader workers.

RSS lies for forked workers and mmap'd stores: every worker's RSS counts the pages it
shares with the parent (copy-on-write memory, LMDB's page cache mapping), so summing
RSS over workers counts the same physical pages many times. PSS (proportional set
size) divides each shared page among its sharers, so the PSS of a process tree sums to
the memory it really uses; USS is what each process holds alone (what killing it
would free). Both come from ``psutil.Process.memory_full_info()`` (Linux
``/proc/PID/smaps_rollup``).

:func:`process_tree_memory` takes one snapshot of a process and all its descendants;
:class:`MemorySampler` samples in a background thread and keeps peaks and marked
moments (epoch boundaries).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass

import psutil

__all__ = ["ProcessMemory", "MemorySnapshot", "process_tree_memory", "MemorySampler", "pss_split"]

_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)

# multiprocessing's own service processes are children too; they are not workers.
_HELPER_MARKERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "multiprocessing.semaphore_tracker",
)


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in bytes.

    Attributes:
        pid: process id.
        role: ``"main"`` (the measured root), ``"worker"`` (any descendant) or
            ``"helper"`` (multiprocessing's resource tracker or forkserver).
        rss: resident set size (counts shared pages in full).
        pss: proportional set size (shared pages divided among sharers); equals ``uss``
            where the OS reports no PSS (see :attr:`MemorySnapshot.pss_exact`).
        uss: unique set size (private pages only).
        pss_anon, pss_file, pss_shmem: the PSS split into anonymous memory (heap, batches,
            copy-on-write copies), mapped files (libraries, a store's pages: page cache the kernel
            can drop) and shared memory (``/dev/shm`` and memfd pages: process workers' batches
            on their way to the main process, which the kernel cannot drop either); 0 where the
            OS has no ``/proc/PID/smaps_rollup`` (macOS, Windows).
    """

    pid: int
    role: str
    rss: int
    pss: int
    uss: int
    pss_anon: int = 0
    pss_file: int = 0
    pss_shmem: int = 0


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of a process tree at one moment.

    Attributes:
        t: ``time.monotonic()`` when the snapshot started.
        processes: one entry per process that could be read (the root first).
        pss_exact: False where the platform has no PSS (macOS, Windows): PSS is then
            USS, which undercounts shared memory.
    """

    t: float
    processes: tuple[ProcessMemory, ...]
    pss_exact: bool = True

    @property
    def total_pss(self) -> int:
        """Sum of PSS over the tree: the physical memory the tree really uses."""
        return sum(p.pss for p in self.processes)

    @property
    def total_uss(self) -> int:
        """Sum of USS over the tree: memory no other process shares."""
        return sum(p.uss for p in self.processes)

    @property
    def total_pss_anon(self) -> int:
        """Sum of the anonymous part of PSS over the tree (0 without ``smaps_rollup``)."""
        return sum(p.pss_anon for p in self.processes)

    @property
    def total_pss_shmem(self) -> int:
        """Sum of the shared-memory part of PSS over the tree (0 without ``smaps_rollup``)."""
        return sum(p.pss_shmem for p in self.processes)

    @property
    def total_pss_file(self) -> int:
        """Sum of the mapped-file part of PSS over the tree (0 without ``smaps_rollup``)."""
        return sum(p.pss_file for p in self.processes)

    @property
    def total_rss(self) -> int:
        """Sum of RSS over the tree (overcounts shared pages; shown to expose the lie)."""
        return sum(p.rss for p in self.processes)

    @property
    def workers(self) -> tuple[ProcessMemory, ...]:
        """The entries whose role is ``"worker"``."""
        return tuple(p for p in self.processes if p.role == "worker")

    @property
    def main(self) -> ProcessMemory | None:
        """The root's entry (None only if it could not be read)."""
        for p in self.processes:
            if p.role == "main":
                return p
        return None


_role_cache: dict[tuple[int, float], str] = {}
_role_lock = threading.Lock()


def _parent_is_forkserver(proc: psutil.Process) -> bool:
    try:
        parent = proc.parent()
        return parent is not None and "multiprocessing.forkserver" in " ".join(parent.cmdline())
    except _GONE:
        return False


def _child_role(proc: psutil.Process) -> str:
    """'worker' or 'helper', cached per (pid, create_time) since cmdline costs a read."""
    try:
        key = (proc.pid, proc.create_time())
    except _GONE:
        return "worker"
    with _role_lock:
        role = _role_cache.get(key)
    if role is None:
        try:
            cmdline = " ".join(proc.cmdline())
        except _GONE:
            cmdline = ""
        role = "helper" if any(m in cmdline for m in _HELPER_MARKERS) else "worker"
        if role == "helper" and "multiprocessing.forkserver" in cmdline and _parent_is_forkserver(proc):
            role = "worker"  # forked by the forkserver: a worker that kept the server's command line
        with _role_lock:
            if len(_role_cache) > 10_000:  # pids come and go over long runs
                _role_cache.clear()
            _role_cache[key] = role
    return role


def _smaps_rollup(pid: int) -> dict[str, int] | None:
    """PSS, USS and the PSS split of ``pid`` from one read of ``/proc/PID/smaps_rollup``, in bytes
    (None where it cannot be read: no such file on macOS or Windows, an exited process). USS is the
    sum of the ``Private_*`` lines, as ``psutil.Process.memory_full_info()`` computes it from the
    same file: reading it once here instead of through psutil and again for the split halves the
    sampler's reads."""
    pss = uss = anon = file = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith(b"Pss_Anon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(b"Pss_File:"):
                    file = int(line.split()[1]) * 1024
                elif line.startswith(b"Pss_Shmem:"):
                    shmem = int(line.split()[1]) * 1024
                elif line.startswith(b"Private_"):
                    uss += int(line.split()[1]) * 1024
    except OSError:
        return None
    return {"pss": pss, "uss": uss, "anon": anon, "file": file, "shmem": shmem}


def _measure(proc: psutil.Process, role: str) -> tuple[ProcessMemory, bool]:
    """One process's entry, and whether its PSS is exact; psutil's errors (the process is gone or
    not ours) go to the caller."""
    rollup = _smaps_rollup(proc.pid)
    if rollup is not None:
        return ProcessMemory(proc.pid, role, int(proc.memory_info().rss), rollup["pss"], rollup["uss"],
                             rollup["anon"], rollup["file"], rollup["shmem"]), True
    info = proc.memory_full_info()
    pss = getattr(info, "pss", None)
    uss = int(info.uss)
    return ProcessMemory(proc.pid, role, int(info.rss), uss if pss is None else int(pss), uss), pss is not None


def _read(proc: psutil.Process, role: str) -> tuple[ProcessMemory | None, bool]:
    try:
        return _measure(proc, role)
    except _GONE:  # exited (or became a zombie) between listing and reading
        return None, True


def _proc_children_pids(pid: int) -> list[int] | None:
    """Descendant pids from /proc/PID/task/TID/children, or None where unavailable.

    psutil's children(recursive=True) reads /proc/*/stat for every process on the
    machine (~6 ms for 90 processes), which a sampler pays every interval while it
    competes for the GIL with the loop it measures; this reads only the tree.
    Like any /proc listing it can miss a process forked during the read.
    """
    out: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            if parent == pid:
                return None
            continue  # exited meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                if parent == pid and tid == str(pid):
                    return None  # kernel without CONFIG_PROC_CHILDREN
                continue
            except OSError:
                continue
            for token in data.split():
                child = int(token)
                out.append(child)
                stack.append(child)
    return out


def _descendants(root: psutil.Process) -> list[psutil.Process]:
    pids = _proc_children_pids(root.pid) if os.path.isdir("/proc") else None
    if pids is None:
        try:
            return root.children(recursive=True)
        except psutil.NoSuchProcess:
            raise
        except psutil.AccessDenied:
            return []
    procs = []
    for child in dict.fromkeys(pids):
        try:
            procs.append(psutil.Process(child))
        except _GONE:
            continue
    return procs


def process_tree_memory(pid: int | None = None) -> MemorySnapshot:
    """Measure a process and all its descendants (``children(recursive=True)``).

    Descendants that exit while being read are left out; the root must exist.

    Args:
        pid: the root process; ``None`` for the current process.

    Returns:
        MemorySnapshot: per-process RSS/PSS/USS (root first, role ``"main"``) and totals.

    Raises:
        psutil.NoSuchProcess: the root process does not exist.
        psutil.AccessDenied: the root process cannot be read (another user's).
    """
    t = time.monotonic()
    root = psutil.Process(os.getpid() if pid is None else pid)
    children = _descendants(root)
    root_entry, exact = _measure(root, "main")  # the root must be readable: let its errors out
    entries = [root_entry]
    for child in children:
        entry, has_pss = _read(child, _child_role(child))
        if entry is not None:
            entries.append(entry)
            exact = exact and has_pss
    return MemorySnapshot(t=t, processes=tuple(entries), pss_exact=exact)


class MemorySampler:
    """Sample a process tree's memory in a background thread.

    Use as a context manager (or ``start()``/``stop()``)::

        with MemorySampler(interval=0.05) as mem:
            for epoch in range(3):
                for batch in loader: ...
                mem.mark(f"epoch{epoch}")
        print(mem.peak_pss, mem.peak_uss_per_worker)

    Attributes:
        samples: ``(t, total_pss, total_uss, total_rss)`` tuples sorted by ``t``
            (seconds since start).
        marks: ``(label, t, MemorySnapshot)`` for each :meth:`mark` call.
        peak_pss, peak_rss, peak_uss: maxima of the tree totals over all samples.
        peak_pss_anon, peak_pss_file, peak_pss_shmem: maxima of the tree's PSS split
            (:func:`pss_split`): anonymous memory (heap, batches, copy-on-write copies), mapped
            files (libraries, a store's pages: page cache the kernel can drop) and shared memory
            (process workers' batches in flight). All 0 where the OS has no
            ``/proc/PID/smaps_rollup`` (macOS, Windows).
        peak_pss_held: the maximum of anonymous plus shared memory: what the tree holds that the
            kernel cannot drop. Compare loaders by this, not by ``peak_pss_anon``: batches that
            process workers pass through shared memory are not anonymous memory, while the same
            batches built by thread workers are.
        peak_uss_per_worker: the largest USS any single worker reached.
        max_workers: the most workers seen in one sample.
        error: an unexpected exception that stopped the thread, else None (the root
            exiting just ends sampling).
    """

    def __init__(self, interval: float = 0.05, pid: int | None = None):
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = float(interval)
        self.pid = os.getpid() if pid is None else int(pid)
        self.samples: list[tuple[float, int, int, int]] = []
        self.marks: list[tuple[str, float, MemorySnapshot]] = []
        self.peak_pss = 0
        self.peak_rss = 0
        self.peak_uss = 0
        self.peak_uss_per_worker = 0
        self.peak_pss_anon = 0
        self.peak_pss_file = 0
        self.peak_pss_shmem = 0
        self.peak_pss_held = 0
        self.max_workers = 0
        self.error: BaseException | None = None
        self.root_exited = False
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- recording

    def _record(self, snap: MemorySnapshot) -> None:
        t = snap.t - (self._t0 or snap.t)
        row = (t, snap.total_pss, snap.total_uss, snap.total_rss)
        workers = snap.workers
        with self._lock:
            self.peak_pss_anon = max(self.peak_pss_anon, snap.total_pss_anon)
            self.peak_pss_file = max(self.peak_pss_file, snap.total_pss_file)
            self.peak_pss_shmem = max(self.peak_pss_shmem, snap.total_pss_shmem)
            self.peak_pss_held = max(self.peak_pss_held, snap.total_pss_anon + snap.total_pss_shmem)
            bisect.insort(self.samples, row)
            self.peak_pss = max(self.peak_pss, row[1])
            self.peak_uss = max(self.peak_uss, row[2])
            self.peak_rss = max(self.peak_rss, row[3])
            self.max_workers = max(self.max_workers, len(workers))
            if workers:
                top = max(w.uss for w in workers)
                self.peak_uss_per_worker = max(self.peak_uss_per_worker, top)

    def _sample_once(self) -> MemorySnapshot | None:
        try:
            snap = process_tree_memory(self.pid)
        except _GONE:
            self.root_exited = True
            return None
        self._record(snap)
        return snap

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                if self._sample_once() is None:
                    return
        except Exception as exc:  # keep it for stop(): a thread's exception is otherwise lost
            self.error = exc

    # -- public

    def start(self) -> MemorySampler:
        """Take a first sample now and start the background thread."""
        if self._thread is not None:
            raise RuntimeError("MemorySampler already started")
        self._t0 = time.monotonic()
        self._sample_once()
        self._thread = threading.Thread(
            target=self._run, name="fastdata-memory-sampler", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a final sample. Re-raises an error the thread hit."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if not self.root_exited:
            self._sample_once()
        if self.error is not None:
            raise self.error

    def mark(self, label: str) -> MemorySnapshot | None:
        """Record a labelled snapshot now (e.g. at an epoch boundary).

        Returns:
            MemorySnapshot | None: the snapshot, or None if the root has exited.
        """
        if self._t0 is None:
            self._t0 = time.monotonic()
        snap = self._sample_once()
        if snap is not None:
            with self._lock:
                self.marks.append((label, snap.t - self._t0, snap))
        return snap

    def summary(self) -> dict:
        """A JSON-ready dict: peaks, sample count and the marks' totals."""
        with self._lock:
            return {
                "interval_s": self.interval,
                "n_samples": len(self.samples),
                "peak_pss": self.peak_pss,
                "peak_uss": self.peak_uss,
                "peak_rss": self.peak_rss,
                "peak_uss_per_worker": self.peak_uss_per_worker,
                "peak_pss_anon": self.peak_pss_anon,
                "peak_pss_file": self.peak_pss_file,
                "peak_pss_shmem": self.peak_pss_shmem,
                "peak_pss_held": self.peak_pss_held,
                "max_workers": self.max_workers,
                "marks": [
                    {
                        "label": label,
                        "t": t,
                        "total_pss": s.total_pss,
                        "total_uss": s.total_uss,
                        "total_rss": s.total_rss,
                        "workers": len(s.workers),
                    }
                    for label, t, s in self.marks
                ],
            }

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pss_split(pids: list[int]) -> dict[str, int]:
    """PSS summed over ``pids``, split into ``anon`` (heap, copy-on-write copies: what the processes
    really hold), ``file`` (mapped files: libraries, a store's or a memmap's pages, which the
    kernel can drop) and ``shmem`` (``/dev/shm`` and memfd pages, such as process workers' batches
    in flight, which it cannot drop), in bytes, from ``/proc/PID/smaps_rollup`` (0 for a process
    that cannot be read)."""
    out = {"anon": 0, "file": 0, "shmem": 0}
    for pid in pids:
        rollup = _smaps_rollup(pid)
        if rollup is not None:
            for part in out:
                out[part] += rollup[part]
    return out
