"""Cold-cache measurement without root: evict files from the page cache, check residency.

:func:`evict_page_cache` calls ``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` on
each file, which drops its clean cached pages, so the next read goes to storage.
Each file is ``fdatasync``'ed first, because dirty pages (a dataset written
moments ago) are not dropped. Limits (the kernel's, not ours): pages some process
has mapped stay (a store that a live persistent worker holds open: the runner
closes the main process's handles before evicting, and has persistent workers
close theirs after every batch, see ``runner.CloseAfterFetch``); on tmpfs/ramfs the
page cache *is* the storage, so nothing is evicted.

:func:`resident_fraction` asks the kernel which pages are cached (``mincore(2)``
on a fresh read-only mapping, through ctypes), so a run can report how cold
"cold" really was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable, Sequence

_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def can_evict() -> bool:
    """True where ``os.posix_fadvise`` exists (Linux, most Unixes; not macOS)."""
    return hasattr(os, "posix_fadvise")


def evict_page_cache(paths: Iterable[str]) -> list[str]:
    """Drop the cached pages of every file in ``paths``.

    Args:
        paths: files to evict (a missing or unreadable file is skipped).

    Returns:
        list[str]: the files the eviction call was made for, in order.

    Raises:
        OSError: ``posix_fadvise`` is not available on this platform.
    """
    if not can_evict():
        raise OSError("page-cache eviction needs os.posix_fadvise (Linux); cold=True is not available here")
    evicted = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            # dirty pages (a file written moments ago) survive DONTNEED: write them back first
            os.fdatasync(fd)
        except OSError:
            pass
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return evicted


def _file_residency(path: str) -> tuple[int, int] | None:
    """(resident pages, total pages) of one file, or None when it cannot be checked."""
    libc = _load_libc()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return (0, 0)
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def resident_fraction(paths: Sequence[str], max_files: int = 256) -> float | None:
    """Fraction of the pages of ``paths`` that are in the page cache now.

    Only a reproducible spread of at most ``max_files`` files is checked (a folder
    target has one file per image).

    Returns:
        float | None: 0.0 (nothing cached) to 1.0, or None where ``mincore`` is not
        available or no file could be checked.
    """
    if not paths or not hasattr(mmap, "PAGESIZE"):
        return None
    try:
        _load_libc()
    except (OSError, AttributeError):
        return None
    step = max(1, len(paths) // max_files)
    resident = total = 0
    for path in list(paths)[::step][:max_files]:
        res = _file_residency(path)
        if res is not None:
            resident += res[0]
            total += res[1]
    return resident / total if total else None
