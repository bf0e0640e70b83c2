"""The store lock: two converters on one output are refused; a lock left by a
killed converter is detected as stale and taken over, naming the dead pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.procs import cli_in_process
from helpers.images import make_tree

import fastdata
from fastdata.common import portable
from fastdata.errors import StoreLockedError
from fastdata.format.names import LOCK_NAME
from fastdata.writer.lock import StoreLock

pytestmark = pytest.mark.timeout(120)

HOLDER = """
import sys, time
from fastdata.writer.lock import StoreLock
lock = StoreLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.read()  # hold until stdin closes (or we are killed)
lock.release()
"""


@pytest.fixture
def holder():
    """Start a process that holds the store lock of a directory; yields a starter."""
    procs = []

    def start(store: str) -> subprocess.Popen:
        os.makedirs(store, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, store], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture
def src(tmp_path):
    return make_tree(tmp_path / "src", classes={"cat": 4, "dog": 3}, size=(24, 16))


_cli = cli_in_process  # the lock holders and killed converters keep their own processes


def test_second_converter_is_refused_and_touches_nothing(src, tmp_path, holder, capsys):
    dst = str(tmp_path / "out.lmdb")
    live = holder(dst)
    before = sorted(os.listdir(dst))
    with pytest.raises(StoreLockedError, match=rf"another converter \(pid {live.pid}\)"):
        fastdata.convert(src, dst, workers=1, progress=False)
    done = _cli(capsys, "convert", src, dst, "--workers", "1")
    assert done.returncode == 2 and f"pid {live.pid}" in done.stderr, done.stderr
    assert sorted(os.listdir(dst)) == before
    # the holder finishes: now the same command works
    live.stdin.close()
    live.wait(timeout=30)
    report = fastdata.convert(src, dst, workers=1, progress=False)
    assert report.images == 7 and not report.warnings


def test_overwrite_is_refused_while_another_converter_holds_the_lock(src, tmp_path, holder):
    dst = str(tmp_path / "out.h5")
    fastdata.convert(src, dst, workers=1, progress=False)
    holder(dst)
    with pytest.raises(StoreLockedError):
        fastdata.convert(src, dst, workers=1, progress=False, overwrite=True)
    assert fastdata.verify(dst).ok, "a refused --overwrite must not have cleared the store"


@pytest.mark.parametrize("state", ["complete", "unfinished"])
def test_a_live_writer_is_named_first_whatever_the_flags(src, tmp_path, holder, state, capsys):
    """Another converter writing DST is the first thing said, before "already holds a store",
    "holds an unfinished conversion" or a resume mismatch (which would send the user to
    --overwrite while a converter is still writing there)."""
    dst = str(tmp_path / "out.lmdb")
    if state == "complete":
        fastdata.convert(src, dst, workers=1, progress=False)
    else:
        os.makedirs(os.path.join(dst, ".fastdata-staging"))
        with open(os.path.join(dst, ".fastdata-staging", "plan.json"), "w") as fh:
            fh.write('{"fingerprint": "from another run"}')
    live = holder(dst)
    before = sorted(os.listdir(dst))
    for flags in ([], ["--resume"], ["--resume", "--shard-size", "2MiB"], ["--overwrite"]):
        done = _cli(capsys, "convert", src, dst, "--workers", "1", *flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert f"being written by another converter (pid {live.pid})" in done.stderr, (flags, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(dst)) == before


def test_stale_lock_of_a_killed_holder_is_taken_over_with_its_pid(src, tmp_path, holder):
    dst = str(tmp_path / "out.lmdb")
    dead = holder(dst)
    dead.kill()
    dead.wait()
    with open(os.path.join(dst, LOCK_NAME)) as fh:
        assert fh.read().strip() == str(dead.pid), "control: the stale lock file names the dead holder"
    report = fastdata.convert(src, dst, workers=1, progress=False)
    assert any(f"pid {dead.pid}" in w and "no longer running" in w for w in report.warnings), report.warnings
    assert not os.path.exists(os.path.join(dst, LOCK_NAME)), "the lock file is removed on release"
    assert fastdata.verify(dst).ok


def test_lock_of_a_converter_killed_mid_run_is_stale_at_once(tmp_path, capsys):
    """A real converter SIGKILLed mid-run: its workers may still be alive for a
    moment, but none of them holds the lock, so --resume proceeds immediately
    and reports the dead converter's pid."""
    src = make_tree(tmp_path / "src", classes={"a": 120, "b": 120}, size=(32, 24))
    dst = str(tmp_path / "out.h5")
    lock_path = os.path.join(dst, LOCK_NAME)
    for _attempt in range(3):
        again = ["--overwrite"] if os.path.exists(dst) else []
        proc = subprocess.Popen([sys.executable, "-m", "fastdata", "convert", src, dst, "--workers", "2",
                                 "--shard-size", "20k", "--quiet", *again],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with open(lock_path) as fh:
                    if fh.read().strip() == str(proc.pid):
                        break
            except FileNotFoundError:
                pass
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode == -signal.SIGKILL and os.path.exists(lock_path):
            break
    else:
        pytest.fail("could not kill the converter while it held the lock")
    done = _cli(capsys, "convert", src, dst, "--workers", "2", "--shard-size", "20k", "--resume")
    assert done.returncode == 0, done.stderr
    assert f"took over the lock of converter pid {proc.pid}" in done.stderr
    assert fastdata.verify(dst).ok


def test_two_locks_in_one_process_conflict_and_release_hands_over(tmp_path):
    first = StoreLock(str(tmp_path)).acquire()
    with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
        StoreLock(str(tmp_path)).acquire()
    first.release()
    second = StoreLock(str(tmp_path)).acquire()
    assert second.stale_pid is None
    second.release()


def test_release_between_open_and_flock_does_not_hand_out_two_locks(tmp_path, monkeypatch):
    """The race the inode check exists for: the holder releases (unlinks the
    lock file) after a contender opened it but before it flocks. The contender
    must not keep a lock on the unlinked file, or a third converter could lock
    the new file at the path too."""
    store = str(tmp_path)
    first = StoreLock(store).acquire()
    real_lock = portable.lock
    calls = []

    def lock(fd, **kwargs):
        calls.append(fd)
        if len(calls) == 1:
            first.release()  # unlink + close: the contender's fd now names a dead inode
        return real_lock(fd, **kwargs)

    monkeypatch.setattr(portable, "lock", lock)
    second = StoreLock(store).acquire()
    monkeypatch.setattr(portable, "lock", real_lock)
    assert len(calls) == 2, "the contender must retry on the file now at the path"
    assert os.fstat(second._fd).st_ino == os.stat(second.path).st_ino
    with pytest.raises(StoreLockedError):
        StoreLock(store).acquire()
    second.release()


def test_forked_child_does_not_hold_the_store_lock(tmp_path):
    """The converter may fork its workers: a child must not keep the lock's
    descriptor (it would hold the store locked after the converter dies)."""
    import multiprocessing

    with StoreLock(str(tmp_path)) as lock:
        fd = lock._fd
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()

        lock_inode = os.fstat(fd).st_ino

        def report(conn, fd=fd):
            # the number may have been reused for another file (multiprocessing opens /dev/null)
            try:
                conn.send("open" if os.fstat(fd).st_ino == lock_inode else "closed")
            except OSError:
                conn.send("closed")

        child = ctx.Process(target=report, args=(child_end,))
        child.start()
        answer = parent_end.recv()
        child.join(10)
        assert answer == "closed"
        os.fstat(fd)  # still held here
