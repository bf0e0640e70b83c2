"""File I/O every layer shares: atomic replacement, fsync by path, whole-file checksums."""

from __future__ import annotations

import os
import secrets
import stat

import xxhash

from fastdata.common import portable
from fastdata.errors import UnsafeStoreError

#: atomic_write() names its temporary file "<target>.tmp-<pid>-<random>"
ATOMIC_TMP_MARK = ".tmp-"


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix.

    Sequence: write ``<path>.tmp-<pid>-<random>`` (created with ``O_EXCL | O_NOFOLLOW``:
    never an existing file, never through a symlink), fsync it, ``os.replace`` it onto
    ``path``, fsync the directory. On any ``OSError`` the temporary is removed,
    and if the rename already happened ``path`` is removed too (a file whose
    directory sync failed is not durable, so it must not be trusted); the
    ``OSError`` raised names ``path`` and keeps the errno.
    """
    tmp = f"{path}{ATOMIC_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    created = replaced = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | portable.O_NOFOLLOW | portable.OPEN_FLAGS,
                     0o644)
        created = True
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
        for leftover in (path,) if replaced else (tmp,) if created else ():
            try:
                os.unlink(leftover)
            except OSError:
                pass
        raise OSError(err.errno, err.strerror or str(err), path) from err


def fsync_file(path: str) -> None:
    """fsync a file by path (after a library that owns the handle closed it)."""
    portable.fsync_path(path)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives power loss (where the OS has directory
    descriptors: :func:`~fastdata.common.portable.fsync_dir`)."""
    portable.fsync_dir(path)


def file_checksum(path: str) -> str:
    """xxh3-64 hex digest of a whole file."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(4 << 20)
            if not block:
                return h.hexdigest()
            h.update(block)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, what: str = "file") -> int:
    """Open ``path`` read-only and return the descriptor, refusing anything but a regular file.

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer (and
    has no effect on a regular file); ``fstat`` on the open descriptor then checks what was
    really opened, so a file swapped after a check cannot slip through. A symbolic link is
    followed, to a regular file only.

    Args:
        path: the file.
        what: how the error names it (``"manifest"``, ``"shard"``, ...).

    Raises:
        UnsafeStoreError: ``path`` is a FIFO, socket, device or directory.
        OSError: it cannot be opened (missing, permission denied, ...).
    """
    fd = os.open(path, os.O_RDONLY | portable.O_NONBLOCK | portable.OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeStoreError(f"{path}: the {what} is {_kind(mode)}, not a regular file; refusing to read it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str, what: str = "file") -> os.stat_result:
    """Refuse ``path`` unless it is a regular file (see :func:`open_regular`), for files a library
    opens by name (h5py, lmdb). Returns its ``stat`` (size, inode, mtime: the file's identity)."""
    fd = open_regular(path, what)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_regular(path: str, limit: int, what: str = "file") -> bytes:
    """The whole of the regular file ``path``, refusing one larger than ``limit`` bytes before
    reading it (and one that grows past it while read).

    Raises:
        UnsafeStoreError: not a regular file, or larger than ``limit``.
        OSError: it cannot be opened or read.
    """
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeStoreError(f"{path}: the {what} is {size:,} bytes, more than the {limit:,} allowed")
        chunks: list[bytes] = []
        total = 0
        while True:
            # the whole file in one read when it is as large as fstat said (no second copy to join);
            # a file growing while it is read is taken in blocks, up to one byte past the limit
            want = size + 1 - total if total <= size else 1 << 20
            block = os.read(fd, min(want, limit + 1 - total))
            if not block:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.append(block)
            total += len(block)
            if total > limit:
                raise UnsafeStoreError(f"{path}: the {what} grew past the {limit:,} bytes allowed while it was read")
    finally:
        os.close(fd)
