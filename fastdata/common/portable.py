"""One home for each operating-system facility fastdata uses that Linux has and other systems
lack, with a portable path beside it.

Each path is chosen once, by whether the facility exists (never by the system's name): Linux
takes exactly the path it took before this module existed; a system without the facility takes
the portable one. Facility (where it exists) -> elsewhere:

* positioned reads and writes (``os.pread``/``preadv``/``pwrite``) -> ``lseek`` then
  ``read``/``write``, one call at a time per process (Windows);
* ``os.fdatasync`` -> ``os.fsync`` (macOS, Windows); ``fsync`` of a read-only descriptor ->
  reopened for writing where refused (Windows: ``EBADF``); ``fsync`` of a directory
  (``O_DIRECTORY``) -> nothing (Windows opens no directory; NTFS journals renames);
* ``os.copy_file_range`` -> ``pread``/``pwrite`` in steps; ``os.posix_fadvise`` -> no advice;
* ``os.sched_getaffinity`` -> psutil's CPU affinity (Windows), else ``os.cpu_count()`` (macOS);
* ``/proc/self/task`` -> psutil's thread count; ``/proc/self/maps`` -> :class:`OSError`
  (callers do without what it would tell);
* ``fcntl.flock`` -> ``msvcrt.locking`` on one byte far past the file's content (Windows);
* ``O_NOFOLLOW`` -> look (``lstat``) before opening, then check the file opened is the one
  looked at; ``O_CLOEXEC``/``O_NONBLOCK`` -> not needed (descriptors are not inherited, PEP
  446; no file system path is a FIFO); ``O_BINARY`` added where it exists (Windows);
* ``os.register_at_fork`` -> nothing to do (no fork: Windows).

Both kinds of lock are dropped by the OS when their holder dies (killed or crashed), which is
what makes a lock left by a dead converter stale. ``msvcrt`` has no shared locks:
:data:`SHARED_LOCKS` says whether this system has them. The DataLoader's memfd batch ring is
its own module's business (:mod:`fastdata.reader.batch_ring`; without memfd, batches travel
pickled).
"""

from __future__ import annotations

import errno
import importlib
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
# Any: typeshed declares msvcrt's names for Windows only, so a check on Linux would see none
msvcrt: Any
try:
    msvcrt = importlib.import_module("msvcrt")
except ImportError:  # every system but Windows
    msvcrt = None

__all__ = [
    "HAS_PREAD", "LOCKING", "OPEN_FLAGS", "O_BINARY", "O_NOFOLLOW", "O_NONBLOCK", "SHARED_LOCKS", "advise_willneed",
    "at_fork_in_child", "available_cores", "copy_range", "datasync", "file_mappings", "fsync_dir", "fsync_path",
    "held_open_elsewhere", "lock", "locked_elsewhere", "native_thread_count", "open_nofollow", "pread", "preadinto",
    "pwrite", "remove_unless_held", "set_blocking", "unlock",
]

#: whether the OS reads and writes at an offset in one call (``os.pread``: every Unix)
HAS_PREAD = hasattr(os, "pread")
#: how files are locked here: ``"flock"``, ``"msvcrt"`` or ``"none"`` (no lock can be taken)
LOCKING = "flock" if fcntl is not None else "msvcrt" if msvcrt is not None else "none"
#: whether shared (reader) locks exist beside exclusive ones (flock has them, msvcrt does not)
SHARED_LOCKS = LOCKING == "flock"

#: what every ``os.open`` of fastdata adds: close-on-exec where the OS has it (elsewhere Python
#: makes descriptors non-inheritable anyway, PEP 446) and binary mode where the OS has a text
#: mode (Windows: without ``O_BINARY``, ``os.open`` translates line ends)
OPEN_FLAGS = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
#: binary mode alone, where the OS has a text mode (Windows), for an ``os.open`` that must not
#: change on Linux (0 there)
O_BINARY = getattr(os, "O_BINARY", 0)
#: open a FIFO without blocking (0 on Windows, where no file system path is a pipe)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
#: refuse a symbolic link as the last part of a path (0 where missing: :func:`open_nofollow` checks
#: instead; ``O_CREAT | O_EXCL`` never follows one anyway, it fails on any existing name)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

# lseek + read is two calls: one at a time, so that threads sharing a descriptor never
# read at each other's offset
_SEEK_LOCK = threading.Lock()
#: the byte msvcrt locks: far past what a lock file holds, because Windows locks are mandatory
#: (no other handle may read a locked byte) and the holder's pid in the file must stay readable
_MSVCRT_BYTE = 1 << 30
#: how long a waiting msvcrt lock sleeps between tries (msvcrt cannot wait without a time limit)
_MSVCRT_POLL_S = 0.05


# -- positioned reads and writes ------------------------------------------------------------------
#: Windows' errors for a file that a handle holds open (ERROR_SHARING_VIOLATION, ERROR_LOCK_VIOLATION)
_IN_USE_WINERRORS = (32, 33)


def held_open_elsewhere(err: OSError) -> bool:
    """Whether ``err`` (from removing, renaming or replacing a file) says a handle holds the file
    open, so it cannot be removed or replaced now: Windows refuses that with a sharing violation,
    where Linux and macOS unlink an open file and its readers keep reading it. Decided by the
    error itself: never true where open files can be removed.

    Args:
        err (OSError): the error of the remove, rename or replace.

    Returns:
        bool: True when the file is in use (leave it and retry later), False for any other failure.
    """
    return getattr(err, "winerror", None) in _IN_USE_WINERRORS


def remove_unless_held(remove: Callable[[str], None], path: str) -> bool:
    """``remove(path)``, unless a handle holds the file open where that forbids it
    (:func:`held_open_elsewhere`): then it stays, for a later try.

    Returns:
        bool: True when it was removed, False when it stays (in use). Other failures raise.
    """
    try:
        remove(path)
    except OSError as err:
        if held_open_elsewhere(err):
            return False
        raise
    return True


def pread(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` from ``offset`` (fewer at the end of the file), leaving the
    file position alone where the OS can (``os.pread``).

    Args:
        fd (int): an open file descriptor.
        size (int): bytes wanted.
        offset (int): where to start, from the start of the file.

    Returns:
        bytes: what was read; shorter than ``size`` only at the end of the file.
    """
    if HAS_PREAD:
        return os.pread(fd, size, offset)
    with _SEEK_LOCK:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, size)


def preadinto(fd: int, view: memoryview, offset: int) -> int:
    """Read into the writable buffer ``view`` from ``offset`` of ``fd`` (``os.preadv``: no copy).

    Args:
        fd (int): an open file descriptor.
        view (memoryview): a writable, contiguous byte buffer to fill.
        offset (int): where to start reading.

    Returns:
        int: bytes read (fewer than ``len(view)`` only at the end of the file, 0 past it).
    """
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


def pwrite(fd: int, data: bytes, offset: int) -> int:
    """Write ``data`` at ``offset`` of ``fd`` (``os.pwrite``).

    Args:
        fd (int): a descriptor open for writing.
        data (bytes): what to write.
        offset (int): where, from the start of the file.

    Returns:
        int: bytes written.
    """
    if HAS_PREAD:
        return os.pwrite(fd, data, offset)
    with _SEEK_LOCK:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


def copy_range(src: int, dst: int, count: int, src_offset: int, dst_offset: int) -> int:
    """Copy up to ``count`` bytes from ``src_offset`` of ``src`` to ``dst_offset`` of ``dst``: in the
    kernel where it can (``os.copy_file_range``; not across file systems or where the file system
    refuses), else read and written back here.

    Args:
        src (int): descriptor to copy from.
        dst (int): descriptor to copy to (open for writing).
        count (int): bytes wanted (one step: the caller loops until done).
        src_offset (int): where in ``src``.
        dst_offset (int): where in ``dst``.

    Returns:
        int: bytes copied; 0 at the end of ``src``.
    """
    if hasattr(os, "copy_file_range"):
        try:
            return os.copy_file_range(src, dst, count, src_offset, dst_offset)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
    data = pread(src, count, src_offset)
    return pwrite(dst, data, dst_offset) if data else 0


def datasync(fd: int) -> None:
    """Flush the data written to ``fd`` to the disk: ``os.fdatasync`` where the OS has it (not the
    metadata a later read does not need), else ``os.fsync``.

    Args:
        fd (int): an open descriptor of the file.
    """
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:
        os.fsync(fd)


def fsync_path(path: str) -> None:
    """fsync the file at ``path`` (one a library that owned its handle has closed): through a
    read-only descriptor, or, where the OS flushes only a descriptor open for writing (Windows
    refuses the read-only one with ``EBADF``), through a read-write one.

    Args:
        path (str): a regular file.
    """
    fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    try:
        os.fsync(fd)
        return
    except OSError as err:
        if err.errno != errno.EBADF:
            raise
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDWR | OPEN_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` so that a rename inside it survives power loss, where the OS
    opens directories (``O_DIRECTORY``: every Unix); nothing elsewhere (Windows opens no directory
    descriptor, and NTFS journals the rename itself).

    Args:
        path (str): a directory.
    """
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def advise_willneed(fd: int, offset: int, length: int) -> bool:
    """Ask the OS to start reading ``length`` bytes at ``offset`` of ``fd`` into its page cache
    (``posix_fadvise(WILLNEED)``).

    Args:
        fd (int): an open file descriptor.
        offset (int): where the bytes start.
        length (int): how many.

    Returns:
        bool: whether the advice was given (False where the OS has no such call or refused it:
        advice only, reads work either way).
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        return False
    return True


# -- opening files --------------------------------------------------------------------------------
def open_nofollow(path: str, flags: int, mode: int = 0o777) -> int:
    """``os.open(path, flags, mode)`` that refuses a symbolic link at ``path`` as ``O_NOFOLLOW``
    does (:class:`OSError` ``ELOOP``). Where the OS has no ``O_NOFOLLOW`` (Windows) it looks at
    ``path`` first and refuses a link, then checks that the file it opened is the one it looked
    at (or, where there was none, that no link appeared there), so a link swapped in between is
    refused too.

    Args:
        path (str): the file.
        flags (int): ``os.open`` flags (``O_NOFOLLOW`` is added here).
        mode (int): permission bits of a file created (``O_CREAT``).

    Returns:
        int: the open descriptor.

    Raises:
        OSError: ``ELOOP`` for a symbolic link; what ``os.open`` raises otherwise.
    """
    if O_NOFOLLOW:
        return os.open(path, flags | O_NOFOLLOW, mode)
    try:
        seen: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        seen = None  # created by this open (O_CREAT), or missing: os.open says which
    if seen is not None and stat.S_ISLNK(seen.st_mode):
        raise OSError(errno.ELOOP, "Too many levels of symbolic links (a link, not followed)", path)
    fd = os.open(path, flags, mode)
    try:
        if seen is not None:
            st = os.fstat(fd)
            swapped = (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino)
        else:
            swapped = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        swapped = True  # gone or replaced under us: not the file looked at
    if swapped:
        os.close(fd)
        raise OSError(errno.ELOOP, "the file changed while it was opened (a link put in its place?)", path)
    return fd


def set_blocking(fd: int, blocking: bool) -> None:
    """``os.set_blocking`` where the OS has it for files (nothing elsewhere: no descriptor was
    opened non-blocking there, :data:`O_NONBLOCK` being 0).

    Args:
        fd (int): an open descriptor.
        blocking (bool): whether reads and writes wait.
    """
    if O_NONBLOCK and hasattr(os, "set_blocking"):
        os.set_blocking(fd, blocking)


# -- this process ---------------------------------------------------------------------------------
def available_cores() -> int:
    """Cores this process may run on: its CPU affinity where the OS keeps one, else every core.

    Returns:
        int: at least 1.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    try:
        import psutil

        return max(1, len(psutil.Process().cpu_affinity()))
    except (AttributeError, OSError, ImportError):  # macOS: no affinity in psutil either
        return os.cpu_count() or 1


def native_thread_count() -> int | None:
    """OS threads of this process, native ones included (a torch or OpenMP pool, which
    ``threading`` cannot see).

    Returns:
        int | None: the count, or None where it cannot be learned.
    """
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process().num_threads())
    except Exception:  # noqa: BLE001  # psutil's own errors (AccessDenied...): the count is unknown
        return None


def file_mappings(path: str) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of each of this process's memory mappings of ``path``.

    Args:
        path (str): a file; compared by its real path.

    Returns:
        list[tuple[int, int, int]]: the mappings, in the order the OS lists them.

    Raises:
        OSError: where the OS does not list mappings with their file offsets (``/proc/self/maps``
            is Linux's; psutil's listing elsewhere has no offsets).
    """
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
    return out


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group that process ``pid`` leads (started with ``start_new_session=True``),
    so that its children go too; where the OS has no process groups (Windows), ``pid`` and the
    descendants psutil finds. A group or process already gone is not an error.

    Args:
        pid (int): the group leader's process id.
    """
    import signal

    if hasattr(os, "killpg"):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    import psutil

    try:
        leader = psutil.Process(pid)
        doomed = [*leader.children(recursive=True), leader]
    except psutil.Error:
        return
    for proc in doomed:
        try:
            proc.kill()
        except psutil.Error:
            pass


def at_fork_in_child(func: Callable[[], Any]) -> None:
    """Run ``func`` in each child this process forks from now on (nothing where the OS cannot fork).

    Args:
        func (Callable[[], Any]): called with no arguments in the child, right after the fork.
    """
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=func)


# -- file locks -----------------------------------------------------------------------------------
def lock(fd: int, *, shared: bool = False, wait: bool = False) -> bool:
    """Lock the file open as ``fd``: the lock belongs to this descriptor (closing it, or the
    process dying, releases it).

    Args:
        fd (int): a descriptor of the file.
        shared (bool): a shared (reader) lock, which other shared locks do not exclude. Where
            :data:`SHARED_LOCKS` is False it is exclusive: safe, never concurrent.
        wait (bool): wait until the lock is free; else return False at once when it is held.

    Returns:
        bool: True once locked; False when ``wait`` is False and another descriptor holds it.

    Raises:
        OSError: the lock failed for another reason, or this system has no file locks
            (:data:`LOCKING` is ``"none"``).
    """
    if LOCKING == "flock":
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            return False
        return True
    if LOCKING == "msvcrt":
        while True:
            os.lseek(fd, _MSVCRT_BYTE, os.SEEK_SET)
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                return True
            except OSError as err:  # EACCES (or EDEADLOCK): another handle holds the byte
                if err.errno not in (errno.EACCES, errno.EDEADLK):
                    raise
            if not wait:
                return False
            time.sleep(_MSVCRT_POLL_S)
    raise OSError(errno.ENOSYS, "this system has no file locks (neither fcntl nor msvcrt)")


def unlock(fd: int) -> None:
    """Release the lock this descriptor holds (closing the descriptor releases it too).

    Args:
        fd (int): the descriptor :func:`lock` locked.
    """
    if LOCKING == "flock":
        fcntl.flock(fd, fcntl.LOCK_UN)
    elif LOCKING == "msvcrt":
        os.lseek(fd, _MSVCRT_BYTE, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def locked_elsewhere(fd: int) -> bool:
    """Whether another descriptor holds an exclusive lock on the file open as ``fd``, without
    keeping any lock (a shared lock taken and dropped; where there are no shared locks, an
    exclusive one taken and dropped at once).

    Args:
        fd (int): a descriptor of the file.

    Returns:
        bool: True when an exclusive lock is held through another descriptor.
    """
    if not lock(fd, shared=True):
        return True
    unlock(fd)
    return False
