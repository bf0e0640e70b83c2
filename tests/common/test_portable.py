"""fastdata.common.portable in this process: each facility's Linux path and the portable path
beside it give the same results (the portable paths taken by hiding the facility, as on macOS
or Windows; the whole library on such a proxy runs in ``tests/platform``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import psutil
import pytest

from fastdata.common import portable


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


@pytest.fixture(params=["os", "seek"])
def reads(request, monkeypatch):
    """The OS's positioned calls, or lseek + read/write (no pread/preadv/pwrite: Windows)."""
    if request.param == "seek":
        monkeypatch.setattr(portable, "HAS_PREAD", False)
        monkeypatch.delattr(os, "preadv", raising=False)
    return request.param


def test_positioned_reads_and_writes(data_file, reads):
    assert portable.pread(data_file, 10, 250) == bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3])
    assert portable.pread(data_file, 100, 256 * 64 - 4) == bytes([252, 253, 254, 255])  # short at the end
    buf = bytearray(6)
    assert portable.preadinto(data_file, memoryview(buf)[1:5], 3) == 4 and buf == bytes([0, 3, 4, 5, 6, 0])
    assert portable.preadinto(data_file, memoryview(buf), 1 << 20) == 0  # past the end
    assert portable.pwrite(data_file, b"xyz", 5) == 3
    assert portable.pread(data_file, 5, 4) == b"\x04xyz\x08"


def test_reads_from_threads_sharing_a_descriptor_never_mix_offsets(data_file, reads):
    wrong = []

    def read(start):
        for k in range(200):
            offset = (start * 37 + k * 11) % 16000
            if portable.pread(data_file, 4, offset) != bytes((offset + i) % 256 for i in range(4)):
                wrong.append(offset)

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("how", ["kernel", "refused", "missing"])
def test_copy_range(tmp_path, data_file, monkeypatch, how):
    if how == "refused":  # another file system: the kernel refuses, the copy goes on here
        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif how == "missing":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    with open(tmp_path / "dst.bin", "w+b") as dst:
        dst.write(b"\0" * 20)
        dst.flush()
        assert portable.copy_range(data_file, dst.fileno(), 8, 100, 4) == 8
        assert portable.copy_range(data_file, dst.fileno(), 8, 256 * 64, 12) == 0  # at the end of the source
        dst.seek(0)
        assert dst.read() == b"\0" * 4 + bytes(range(100, 108)) + b"\0" * 8


def test_cores_and_threads_without_sched_getaffinity_or_proc(monkeypatch):
    cores, threads = portable.available_cores(), portable.native_thread_count()
    assert cores == len(os.sched_getaffinity(0)) and threads == len(os.listdir("/proc/self/task"))
    monkeypatch.delattr(os, "sched_getaffinity")
    assert portable.available_cores() == cores  # psutil's affinity (Windows)
    monkeypatch.delattr(psutil.Process, "cpu_affinity")
    assert portable.available_cores() == os.cpu_count()  # macOS: psutil has no affinity either

    real_listdir = os.listdir

    def listdir(path="."):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(errno.ENOENT, "no /proc", path)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert portable.native_thread_count() == threads  # psutil's count


def test_file_mappings_name_this_processes_maps_of_a_file(tmp_path):
    import mmap

    path = tmp_path / "m.bin"
    path.write_bytes(b"x" * mmap.PAGESIZE * 2)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[0] == ord("x")
        (start, end, offset), *_ = portable.file_mappings(str(path))
        assert end - start == mmap.PAGESIZE * 2 and offset == 0


class _Msvcrt:
    """msvcrt.locking as Windows behaves for one handle per lock (over flock here)."""

    LK_UNLCK, LK_NBLCK = 0, 2

    def __init__(self, flock):
        self.flock, self.calls = flock, []

    def locking(self, fd, mode, nbytes):
        import fcntl

        self.calls.append((os.lseek(fd, 0, os.SEEK_CUR), mode, nbytes))
        if mode == self.LK_UNLCK:
            self.flock(fd, fcntl.LOCK_UN)
            return
        try:
            self.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PermissionError(errno.EACCES, "Permission denied") from None


@pytest.mark.parametrize("locking", ["flock", "msvcrt"])
def test_locks_exclude_other_descriptors_and_go_with_them(tmp_path, monkeypatch, locking):
    import fcntl

    if locking == "msvcrt":
        stand_in = _Msvcrt(fcntl.flock)
        monkeypatch.setattr(portable, "LOCKING", "msvcrt")
        monkeypatch.setattr(portable, "msvcrt", stand_in)
    path = tmp_path / "lock"
    path.write_bytes(b"1234\n")
    a, b = os.open(path, os.O_RDWR), os.open(path, os.O_RDONLY)
    try:
        assert portable.lock(a) and not portable.lock(b) and portable.locked_elsewhere(b)
        assert portable.pread(b, 8, 0) == b"1234\n"  # the content stays readable: the locked byte lies far past it
        portable.unlock(a)
        assert not portable.locked_elsewhere(b) and portable.lock(b, shared=True)
        assert portable.lock(a, shared=True) is (locking == "flock")  # msvcrt: no shared locks, so exclusive
        os.close(b)
        b = os.open(path, os.O_RDONLY)
        assert portable.lock(a, wait=True) and not portable.lock(b)  # closing b released its lock
    finally:
        os.close(a)
        os.close(b)
    if locking == "msvcrt":
        assert {(at, n) for at, _mode, n in stand_in.calls} == {(1 << 30, 1)}


@pytest.fixture(params=["O_NOFOLLOW", "look"])
def nofollow(request, monkeypatch):
    """The OS's O_NOFOLLOW, or the look-then-check path (no O_NOFOLLOW: Windows)."""
    if request.param == "look":
        monkeypatch.setattr(portable, "O_NOFOLLOW", 0)
    return request.param


def test_open_nofollow_refuses_a_link_and_opens_a_file(tmp_path, nofollow):
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as err:
        portable.open_nofollow(str(tmp_path / "link"), os.O_RDONLY)
    assert err.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        portable.open_nofollow(str(tmp_path / "link"), os.O_RDWR | os.O_CREAT, 0o644)
    assert target.read_bytes() == b"secret"
    fd = portable.open_nofollow(str(target), os.O_RDONLY)
    try:
        assert os.read(fd, 6) == b"secret"
    finally:
        os.close(fd)
    fd = portable.open_nofollow(str(tmp_path / "new"), os.O_RDWR | os.O_CREAT, 0o644)  # created
    os.close(fd)
    assert (tmp_path / "new").is_file()
    with pytest.raises(FileNotFoundError):
        portable.open_nofollow(str(tmp_path / "missing"), os.O_RDONLY)


def test_open_nofollow_refuses_a_file_swapped_after_the_look(tmp_path, monkeypatch):
    monkeypatch.setattr(portable, "O_NOFOLLOW", 0)
    path, other = tmp_path / "file", tmp_path / "other"
    path.write_bytes(b"mine")
    other.write_bytes(b"theirs")
    real_open = os.open

    def swap_then_open(p, flags, mode=0o777):
        os.replace(other, path)  # between the look and the open
        return real_open(p, flags, mode)

    monkeypatch.setattr(os, "open", swap_then_open)
    with pytest.raises(OSError) as err:
        portable.open_nofollow(str(path), os.O_RDONLY)
    assert err.value.errno == errno.ELOOP


def test_store_lock_refuses_a_link_without_o_nofollow(tmp_path, monkeypatch):
    from fastdata.errors import UnsafeStoreError
    from fastdata.format.names import LOCK_NAME
    from fastdata.writer.lock import StoreLock

    monkeypatch.setattr(portable, "O_NOFOLLOW", 0)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / LOCK_NAME).symlink_to(victim)
    with pytest.raises(UnsafeStoreError, match="symbolic link"):
        StoreLock(str(tmp_path)).acquire()
    assert victim.read_text() == "keep me"


def test_datasync_without_fdatasync(tmp_path, monkeypatch):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x")
        portable.datasync(fd)
        synced = []
        monkeypatch.delattr(os, "fdatasync")
        monkeypatch.setattr(os, "fsync", lambda f: synced.append(f))
        portable.datasync(fd)  # macOS, Windows: fsync
        assert synced == [fd]
    finally:
        os.close(fd)


def test_fsync_by_name_and_of_a_directory_where_the_os_refuses_them(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    portable.fsync_path(str(path))
    portable.fsync_dir(str(tmp_path))
    real_fsync, modes = os.fsync, []

    def windows_fsync(fd):  # FlushFileBuffers needs write access
        import fcntl

        modes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        if modes[-1] == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", windows_fsync)
    portable.fsync_path(str(path))
    assert modes == [os.O_RDONLY, os.O_RDWR] and path.read_bytes() == b"x"
    monkeypatch.delattr(os, "O_DIRECTORY")
    portable.fsync_dir(str(tmp_path))  # no directory descriptors: nothing to do
    assert len(modes) == 2


@pytest.mark.parametrize("groups", [True, False], ids=["killpg", "no-process-groups"])
def test_kill_process_group_takes_the_leader_and_its_children(monkeypatch, groups):
    """A runner started in its own session and the worker it started both die; without
    ``os.killpg`` (Windows) through psutil's view of the tree. A group already gone is no error."""
    if not groups:
        monkeypatch.delattr(os, "killpg")
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True); time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = psutil.Process(int(leader.stdout.readline()))
    portable.kill_process_group(leader.pid)
    assert leader.wait(timeout=10) != 0
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    portable.kill_process_group(leader.pid)  # gone already: no error
