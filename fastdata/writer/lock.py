"""A per-destination lock so two converters never write the same store.

A file lock on ``DST/.fastdata.lock`` (``flock``; ``msvcrt.locking`` where there is no
``fcntl``: :mod:`fastdata.common.portable`). The OS drops the lock when its holder
dies (SIGKILL, OOM kill), so a lock left by a killed converter is *stale* by
construction: the next converter takes it over and reports the dead holder's
pid. The file is unlinked on release; acquiring checks that the locked inode is
still the one at the path, so a concurrent release cannot hand out two locks.

The lock file is never followed or written through: it is opened with ``O_NOFOLLOW``
(a symlink there is refused with :class:`~fastdata.errors.UnsafeStoreError`), must be a
regular file with one link (a hard link to a file elsewhere is refused too), and an
existing one is rewritten only when it holds what a lock file holds (a pid, or nothing):
a file of someone else's that happens to bear the name is refused, never truncated.
"""

from __future__ import annotations

import os
import re
import stat

from fastdata.common import portable
from fastdata.errors import StoreLockedError, UnsafeStoreError
from fastdata.format.names import LOCK_NAME
from fastdata.writer.owned import describe_kind

#: what a lock file holds: a pid, then (since this version) the token of the run's staging marker
_LOCK_TEXT = re.compile(rb"\A\s*(\d{1,10})?\s*(?:\n[0-9a-f]{0,64}\s*)?\Z")
_LOCK_LIMIT = 128

_held_fds: set[int] = set()


def _close_in_child() -> None:
    # A forked converter worker must not keep the store locked after the converter
    # dies: closing its copy of the descriptor leaves the parent's lock in place.
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


portable.at_fork_in_child(_close_in_child)


class StoreLock:
    """Exclusive lock on a store directory. Use as a context manager."""

    def __init__(self, store_dir: str):
        self.path = os.path.join(store_dir, LOCK_NAME)
        self._fd: int | None = None
        #: pid written by a previous holder that died without releasing, if any
        self.stale_pid: int | None = None

    def acquire(self) -> StoreLock:
        while True:
            fd = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
            try:
                taken = portable.lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                holder = _read_pid(fd)
                os.close(fd)
                raise StoreLockedError(_locked_message(os.path.dirname(self.path), holder))
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and unlinked between our open and flock: retry
                os.close(fd)
                continue
            try:
                _check_ours(self.path, fd)
            except BaseException:
                os.close(fd)
                raise
            previous = _read_pid(fd)
            if previous and previous != os.getpid():
                self.stale_pid = previous
            os.ftruncate(fd, 0)
            portable.pwrite(fd, str(os.getpid()).encode(), 0)
            self._fd = fd
            _held_fds.add(fd)
            return self

    def record_token(self, token: str) -> None:
        """Write the run's staging marker token after the pid (what a later look at the lock
        can match against the staging folder's marker)."""
        if self._fd is not None:
            portable.pwrite(self._fd, f"{os.getpid()}\n{token}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.lstat(self.path).st_ino == os.fstat(self._fd).st_ino:  # only the file we locked
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except PermissionError:
            if portable.LOCKING != "msvcrt":
                raise
            # Windows removes no open file: the file stays, emptied, so that the next converter
            # finds no pid in it (a pid there would read as a dead holder's stale lock)
            os.ftruncate(self._fd, 0)
        _held_fds.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _open_lock(path: str, flags: int) -> int:
    """Open the lock file without following a symlink or blocking on a FIFO; refuse anything
    but a regular file with a single link."""
    try:
        fd = portable.open_nofollow(path, flags | portable.O_NONBLOCK | portable.OPEN_FLAGS, 0o644)
    except OSError as err:
        if os.path.islink(path):
            raise UnsafeStoreError(f"{path} is a symbolic link, not a lock file made by fastdata; refusing to "
                                   "write through it: remove it (and check who put it there)") from None
        raise err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStoreError(f"{path} is {describe_kind(st.st_mode)}, not a lock file made by fastdata; "
                                   "refusing to use it: remove it")
        if st.st_nlink != 1:
            raise UnsafeStoreError(f"{path} has {st.st_nlink} hard links (a lock file fastdata made has one): it "
                                   "may be a link to a file elsewhere; refusing to write it: remove it")
        portable.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_ours(path: str, fd: int) -> None:
    """Refuse to rewrite a lock file that holds something other than a pid (and token)."""
    st = os.fstat(fd)
    head = portable.pread(fd, _LOCK_LIMIT + 1, 0)
    if st.st_size > _LOCK_LIMIT or not _LOCK_TEXT.match(head):
        raise UnsafeStoreError(f"{path} holds {st.st_size} bytes that are not a fastdata lock (a pid); refusing "
                               "to overwrite a file fastdata did not write: remove it if it is not yours")


def _read_pid(fd: int) -> int | None:
    try:
        text = portable.pread(fd, 32, 0).decode("ascii", "replace").strip().split("\n", 1)[0].strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def raise_if_locked(store_dir: str) -> None:
    """Raise :class:`StoreLockedError` when a live converter holds ``store_dir``'s lock.

    A check without taking the lock, so a converter can name the live writer before
    any other complaint about the destination (existing store, unfinished run, options).
    A stale lock (its holder died) passes: the converter takes it over later.
    """
    try:
        fd = _open_lock(os.path.join(store_dir, LOCK_NAME), os.O_RDONLY)
    except UnsafeStoreError:
        raise
    except OSError:  # no lock file (or no directory): nobody is writing
        return
    try:
        if portable.locked_elsewhere(fd):
            raise StoreLockedError(_locked_message(store_dir, _read_pid(fd)))
    finally:
        os.close(fd)


def _locked_message(store_dir: str, holder: int | None) -> str:
    return (f"{store_dir} is being written by another converter{f' (pid {holder})' if holder else ''}; "
            "wait for it to finish or stop it")
