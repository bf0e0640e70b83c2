"""File I/O every layer shares: atomic replacement, fsync by path, whole-file checksums."""

from __future__ import annotations

import os

import xxhash

#: atomic_write() names its temporary file "<target>.tmp-<pid>"
ATOMIC_TMP_MARK = ".tmp-"


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix.

    Sequence: write ``<path>.tmp-<pid>``, fsync it, ``os.replace`` it onto
    ``path``, fsync the directory. On any ``OSError`` the temporary is removed,
    and if the rename already happened ``path`` is removed too (a file whose
    directory sync failed is not durable, so it must not be trusted); the
    ``OSError`` raised names ``path`` and keeps the errno.
    """
    tmp = f"{path}{ATOMIC_TMP_MARK}{os.getpid()}"
    replaced = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        replaced = True
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as err:
        for leftover in (tmp, path) if replaced else (tmp,):
            try:
                os.unlink(leftover)
            except OSError:
                pass
        raise OSError(err.errno, err.strerror or str(err), path) from err


def fsync_file(path: str) -> None:
    """fsync a file by path (after a library that owns the handle closed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_checksum(path: str) -> str:
    """xxh3-64 hex digest of a whole file."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(4 << 20)
            if not block:
                return h.hexdigest()
            h.update(block)
