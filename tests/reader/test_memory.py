"""Tests for fastdata.bench.memory: PSS sees private memory, RSS overcounts shared pages."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from fastdata.bench.memory import MemorySampler, process_tree_memory

MB = 1 << 20
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PSS is a Linux measure"
)

# A child that allocates and touches `n` MB of private memory, says "ready", then waits
# for stdin to close (or sleeps `hold` seconds when given).
_ALLOCATOR = """
import sys, time
n, hold = int(sys.argv[1]), float(sys.argv[2])
buf = b"\\x01" * (n << 20)  # bytes * n writes every page
sys.stdout.write("ready\\n"); sys.stdout.flush()
if hold > 0:
    time.sleep(hold)
else:
    sys.stdin.read()
"""


def _spawn_allocator(mb: int, hold: float = 0.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ALLOCATOR, str(mb), str(hold)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _finish(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)


def test_snapshot_of_this_process():
    snap = process_tree_memory()
    main = snap.main
    assert main is not None and main.pid == os.getpid()
    assert snap.processes[0] is main
    assert snap.pss_exact
    assert 0 < main.uss <= main.pss <= main.rss
    assert snap.total_rss >= snap.total_pss >= snap.total_uss > 0


def test_private_memory_of_a_child_shows_up_in_pss():
    before = process_tree_memory()
    proc = _spawn_allocator(200)
    try:
        during = process_tree_memory()
        workers = {p.pid: p for p in during.workers}
        assert proc.pid in workers
        assert workers[proc.pid].uss >= 190 * MB
        assert during.total_pss - before.total_pss >= 150 * MB
    finally:
        _finish(proc)
    after = process_tree_memory()
    assert proc.pid not in {p.pid for p in after.processes}
    assert after.total_pss - before.total_pss < 50 * MB


def _reader(arr, ready, done):
    arr.sum()  # read every page of the parent's buffer, write none
    ready.set()
    done.wait(20)


def test_shared_copy_on_write_pages_inflate_rss_not_pss():
    """The RSS lie: a forked reader 'uses' the buffer per RSS, but adds almost nothing."""
    size = 200 * MB
    arr = np.ones(size // 8, dtype=np.float64)  # written, so resident in the parent
    before = process_tree_memory()
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_reader, args=(arr, ready, done))
    child.start()
    try:
        assert ready.wait(20)
        during = process_tree_memory()
        assert child.pid in {p.pid for p in during.workers}
        rss_growth = during.total_rss - before.total_rss
        pss_growth = during.total_pss - before.total_pss
        # Summed RSS counts the shared buffer twice ...
        assert rss_growth >= 0.9 * size, rss_growth / MB
        # ... PSS splits it between parent and child, so the tree barely grows.
        assert pss_growth <= 0.25 * size, pss_growth / MB
        child_entry = next(p for p in during.workers if p.pid == child.pid)
        assert child_entry.rss >= 0.9 * size and child_entry.uss < 0.25 * size
    finally:
        done.set()
        child.join(10)
    del arr


def test_vanishing_child_is_tolerated(monkeypatch):
    proc = _spawn_allocator(1)
    try:
        def flaky(real):
            def read(self):
                if self.pid == proc.pid:  # as if it exited between listing and reading
                    raise psutil.NoSuchProcess(self.pid)
                return real(self)
            return read

        for method in ("memory_info", "memory_full_info"):
            monkeypatch.setattr(psutil.Process, method, flaky(getattr(psutil.Process, method)))
        snap = process_tree_memory()
        assert proc.pid not in {p.pid for p in snap.processes}
        assert snap.main.pid == os.getpid()
        monkeypatch.undo()
        assert proc.pid in {p.pid for p in process_tree_memory().processes}  # control
    finally:
        _finish(proc)


def test_missing_root_raises():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(psutil.NoSuchProcess):
        process_tree_memory(proc.pid)


def test_grandchildren_are_counted():
    code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {_ALLOCATOR!r}, '60', '0'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "print(p.stdout.readline().strip(), p.pid, flush=True)\n"
        "sys.stdin.read(); p.stdin.close(); p.wait()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        status, grandchild = proc.stdout.readline().split()
        assert status == "ready"
        entries = {p.pid: p for p in process_tree_memory().processes}
        assert int(grandchild) in entries and entries[int(grandchild)].role == "worker"
        assert entries[int(grandchild)].uss >= 55 * MB
    finally:
        _finish(proc)


def test_sampler_catches_a_short_spike_and_marks():
    with MemorySampler(interval=0.02) as mem:
        time.sleep(0.1)
        base = process_tree_memory().total_pss
        mem.mark("before")
        proc = _spawn_allocator(200, hold=0.3)  # exits on its own after 0.3 s
        proc.wait(timeout=10)
        time.sleep(0.1)
        mem.mark("after")
    assert mem.error is None
    # The spike is gone by the end, yet the peak remembers it.
    assert process_tree_memory().total_pss - base < 50 * MB
    assert mem.peak_pss - base >= 150 * MB
    assert mem.peak_uss_per_worker >= 190 * MB
    assert mem.peak_rss >= mem.peak_pss
    assert mem.max_workers >= 1
    ts = [s[0] for s in mem.samples]
    assert ts == sorted(ts) and len(ts) >= 10
    assert all(rss >= pss >= uss > 0 for _, pss, uss, rss in mem.samples)
    labels = [m[0] for m in mem.marks]
    assert labels == ["before", "after"]
    (_, t0, s0), (_, t1, s1) = mem.marks
    assert 0 < t0 < t1
    assert s1.total_pss - s0.total_pss < 50 * MB
    summary = mem.summary()
    assert summary["peak_pss"] == mem.peak_pss
    assert [m["label"] for m in summary["marks"]] == ["before", "after"]


def test_sampler_peak_misses_nothing_only_if_sampling():
    """Control: without the thread (interval far longer than the spike) the peak is missed."""
    with MemorySampler(interval=30) as mem:
        base = mem.samples[0][1]
        proc = _spawn_allocator(200, hold=0.2)
        proc.wait(timeout=10)
    assert mem.peak_pss - base < 150 * MB


def test_sampler_stops_when_root_exits():
    proc = _spawn_allocator(1, hold=0.3)
    mem = MemorySampler(interval=0.02, pid=proc.pid).start()
    proc.wait(timeout=10)
    time.sleep(0.1)
    mem.stop()
    assert mem.root_exited and mem.error is None
    assert len(mem.samples) >= 2
    assert mem.mark("late") is None


def test_sampler_rejects_bad_interval():
    with pytest.raises(ValueError):
        MemorySampler(interval=0)


def test_sampler_splits_anonymous_memory_from_mapped_files(tmp_path):
    """A child's 200 MB heap is anonymous PSS; 200 MB of a file it maps and reads is file PSS
    (page cache the kernel can drop), and only the heap shows in ``peak_pss_anon``."""
    path = tmp_path / "mapped.bin"
    path.write_bytes(os.urandom(1 << 20) * 200)
    with MemorySampler(interval=0.02) as mem:
        base_anon = mem.peak_pss_anon
        base_file = mem.peak_pss_file
        mapper = subprocess.Popen(
            [sys.executable, "-c",
             "import mmap, sys, time\n"
             "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
             "sum(m[i] for i in range(0, len(m), 4096)); print('ready', flush=True); time.sleep(0.3)\n",
             str(path)], stdout=subprocess.PIPE, text=True)
        assert mapper.stdout.readline().strip() == "ready"
        mapper.wait(timeout=10)
        file_peak, anon_after_map = mem.peak_pss_file, mem.peak_pss_anon
        proc = _spawn_allocator(200, hold=0.3)
        proc.wait(timeout=10)
    assert file_peak - base_file >= 150 * MB
    assert anon_after_map - base_anon < 100 * MB  # the mapped file is not anonymous memory
    assert mem.peak_pss_anon - base_anon >= 150 * MB
    assert mem.summary()["peak_pss_anon"] == mem.peak_pss_anon


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")
def test_shared_memory_is_held_memory_apart_from_the_heap():
    """A child's 120 MB of written shared memory (a memfd, as process workers' batches travel)
    is ``pss_shmem``, not ``pss_anon``, and counts in ``peak_pss_held`` (anonymous plus shared:
    what the kernel cannot drop). A comparison of anonymous memory alone would miss it: the control
    is the anonymous peak, which stays far below."""
    with MemorySampler(interval=0.02) as mem:
        base_anon, base_shmem, base_held = mem.peak_pss_anon, mem.peak_pss_shmem, mem.peak_pss_held
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import mmap, os, time\n"
             "fd = os.memfd_create('held'); os.ftruncate(fd, 120 << 20); m = mmap.mmap(fd, 120 << 20)\n"
             "chunk = b'x' * (1 << 20)\n"
             "for i in range(120): m[i << 20:(i + 1) << 20] = chunk\n"
             "print('ready', flush=True); time.sleep(0.3)\n"],
            stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "ready"
        holder.wait(timeout=10)
    assert mem.peak_pss_shmem - base_shmem >= 100 * MB
    assert mem.peak_pss_held - base_held >= 100 * MB
    assert mem.peak_pss_anon - base_anon < 60 * MB  # control: not anonymous memory
    assert mem.summary()["peak_pss_held"] == mem.peak_pss_held


def test_one_smaps_rollup_read_gives_what_psutil_reads_and_the_split(monkeypatch):
    """A snapshot reads each process's ``smaps_rollup`` once: its PSS and USS are psutil's figures for
    the same moment (read from the same file), and its split adds up to its PSS. Counting the reads
    of the file shows one per process per snapshot and per sample (it was two: psutil's and the
    split's)."""
    import builtins

    import psutil

    from fastdata.bench import memory

    ballast = np.ones(64 * MB, dtype=np.uint8)  # private pages, so the figures are far from 0
    me = psutil.Process()
    before = me.memory_full_info()
    snap = memory.process_tree_memory()
    after = me.memory_full_info()
    main = snap.main
    assert main is not None and snap.pss_exact
    assert min(before.pss, after.pss) - MB <= main.pss <= max(before.pss, after.pss) + MB
    assert min(before.uss, after.uss) - MB <= main.uss <= max(before.uss, after.uss) + MB
    assert main.pss_anon >= ballast.nbytes and main.pss_file > 0
    assert abs(main.pss_anon + main.pss_file + main.pss_shmem - main.pss) <= MB

    reads = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith("/smaps_rollup"):
            reads.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    snap = memory.process_tree_memory()  # (this test process may have children: pytest's, a tracker)
    assert sorted(reads) == sorted(f"/proc/{p.pid}/smaps_rollup" for p in snap.processes)
    reads.clear()
    with memory.MemorySampler(interval=60) as mem:  # start() and stop() sample; the thread waits 60 s
        pass
    assert len(mem.samples) >= 1 and reads.count(f"/proc/{os.getpid()}/smaps_rollup") == len(mem.samples)
    assert mem.peak_pss_anon >= ballast.nbytes
