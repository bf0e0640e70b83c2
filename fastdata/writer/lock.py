"""A per-destination lock so two converters never write the same store.

``flock`` on ``DST/.fastdata.lock``. The kernel drops the lock when its holder
dies (SIGKILL, OOM kill), so a lock left by a killed converter is *stale* by
construction: the next converter takes it over and reports the dead holder's
pid. The file is unlinked on release; acquiring checks that the locked inode is
still the one at the path, so a concurrent release cannot hand out two locks.
"""

from __future__ import annotations

import fcntl
import os

from fastdata.errors import StoreLockedError
from fastdata.format.names import LOCK_NAME

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


os.register_at_fork(after_in_child=_close_in_child)


class StoreLock:
    """Exclusive lock on a store directory. Use as a context manager."""

    def __init__(self, store_dir: str):
        self.path = os.path.join(store_dir, LOCK_NAME)
        self._fd: int | None = None
        #: pid written by a previous holder that died without releasing, if any
        self.stale_pid: int | None = None

    def acquire(self) -> StoreLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise StoreLockedError(_locked_message(os.path.dirname(self.path), holder)) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and unlinked between our open and flock: retry
                os.close(fd)
                continue
            previous = _read_pid(fd)
            if previous and previous != os.getpid():
                self.stale_pid = previous
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._fd = fd
            _held_fds.add(fd)
            return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        _held_fds.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
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
        fd = os.open(os.path.join(store_dir, LOCK_NAME), os.O_RDONLY)
    except OSError:  # no lock file (or no directory): nobody is writing
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(_locked_message(store_dir, _read_pid(fd))) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _locked_message(store_dir: str, holder: int | None) -> str:
    return (f"{store_dir} is being written by another converter{f' (pid {holder})' if holder else ''}; "
            "wait for it to finish or stop it")
