"""What the converter may create, write through and delete in a destination.

A destination directory may already hold something a converter did not make: a symlink
planted where the lock, the staging folder, a shard or the manifest goes, a FIFO, a
folder of the user's. The rules every write-side module follows (see docs/SECURITY.md):

* **Nothing is written through a symlink.** Every entry of a destination that a
  conversion makes (:func:`check_entries`) is ``lstat``-checked before anything is
  written: a symlink, a FIFO, a device, or a folder where a file belongs is refused with
  an :class:`~fastdata.errors.UnsafeStoreError` naming it. Files are created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_file`), folders with ``os.mkdir``
  (which never follows a link) and then ``lstat``-checked (:func:`make_dir`).
* **Only what the converter made is deleted.** A folder the converter makes and later
  removes (the staging folder ``.fastdata-staging``, a URL destination's local staging
  folder) carries the marker file :data:`MARKER_NAME`, written at its creation with a
  random token (:func:`make_dir`); :func:`remove_dir` deletes a folder only when it is a
  real folder (never a symlink) holding a valid marker, and then with ``shutil.rmtree``'s
  descriptor-based walk, which never follows a symlink inside. A staging folder left by
  an older fastdata (no marker) is emptied file by file, of the names a conversion
  writes only, and removed only if nothing else is left. Files are unlinked only when
  ``lstat`` says they are regular files (:func:`remove_file`).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Mapping

from fastdata.common import portable
from fastdata.errors import UnsafeStoreError

#: the marker file in a folder the converter made (and so may delete)
MARKER_NAME = ".fastdata-owner"
#: what the marker says it is
_MARKER_KIND = "fastdata-owned-directory"
_MARKER_LIMIT = 4096


def describe_kind(mode: int) -> str:
    """``"a symlink"``, ``"a FIFO"``, ... for messages about an entry that is not what belongs there."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def unsafe_entry(path: str, mode: int, want: str = "a regular file") -> UnsafeStoreError:
    return UnsafeStoreError(
        f"{path} is {describe_kind(mode)}, not {want} made by fastdata; refusing to write through or delete it "
        "(a destination's lock, staging folder, shards and manifest are never followed): remove it yourself "
        "if it is yours, or choose another destination")


def check_file(path: str) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file (None when it does not exist).

    Raises:
        UnsafeStoreError: it is a symlink, FIFO, device, socket or directory.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise unsafe_entry(path, st.st_mode)
    return st


def check_dir(path: str) -> bool:
    """Whether the real directory ``path`` exists (False: nothing there).

    Raises:
        UnsafeStoreError: it is a symlink (even to a directory) or not a directory.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe_entry(path, st.st_mode, "a directory")
    return True


def check_entries(dst: str, names: list[str], dirs: tuple[str, ...] = ()) -> None:
    """Refuse any of ``names`` in ``dst`` that is not a regular file (``dirs``: not a real
    directory; the entries of those directories are checked as files)."""
    for name in names:
        path = os.path.join(dst, name)
        if name in dirs:
            if check_dir(path):
                for inner in os.listdir(path):
                    check_file(os.path.join(path, inner))
        else:
            check_file(path)


def create_file(path: str, mode: int = 0o644) -> int:
    """Create ``path`` (it must not exist) and return a write descriptor: ``O_EXCL |
    O_NOFOLLOW``, so neither an existing file nor a symlink is ever opened.

    Raises:
        UnsafeStoreError: something is already at ``path`` that is not a regular file.
        FileExistsError: a regular file is already there.
    """
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | portable.O_NOFOLLOW | portable.OPEN_FLAGS, mode)
    except FileExistsError:
        check_file(path)  # a symlink / FIFO: say so
        raise


def remove_file(path: str) -> None:
    """Unlink ``path`` if it is a regular file (nothing when it does not exist).

    Raises:
        UnsafeStoreError: it is a symlink, FIFO, device or directory (left alone).
    """
    if check_file(path) is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def make_dir(path: str) -> str:
    """Create the directory ``path`` with its marker; returns the marker's token.

    Raises:
        UnsafeStoreError: ``path`` exists as a symlink or non-directory.
        FileExistsError: a directory is already there (use :func:`adopt_dir`).
    """
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        check_dir(path)
        raise
    check_dir(path)  # (mkdir made it: a real directory, unless swapped since)
    return _write_marker(path)


def ensure_dir(path: str) -> str:
    """The token of the directory ``path`` the converter made (creating it, with its marker,
    when missing); an existing directory without a marker (an older fastdata's staging
    folder) is given one.

    Raises:
        UnsafeStoreError: ``path`` is a symlink or not a directory.
    """
    try:
        return make_dir(path)
    except FileExistsError:
        pass
    token = read_marker(path)
    if token is not None:
        return token
    remove_file(os.path.join(path, MARKER_NAME))  # one cut short by a failed write (a symlink is refused)
    return _write_marker(path)


def _write_marker(path: str) -> str:
    token = secrets.token_hex(16)
    marker = os.path.join(path, MARKER_NAME)
    fd = create_file(marker)
    try:
        try:
            data = json.dumps({"kind": _MARKER_KIND, "token": token}).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.EIO, "short write", marker)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        os.unlink(marker)  # (we created it just now)
        raise
    return token


def read_marker(path: str) -> str | None:
    """The token of the marker in directory ``path``; None when there is no valid marker
    (missing, a symlink, not a regular file, not one fastdata wrote)."""
    try:
        fd = portable.open_nofollow(os.path.join(path, MARKER_NAME),
                                    os.O_RDONLY | portable.O_NONBLOCK | portable.OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MARKER_LIMIT:
            return None
        body = json.loads(os.read(fd, _MARKER_LIMIT))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(body, dict) or body.get("kind") != _MARKER_KIND:
        return None
    token = body.get("token")
    return token if isinstance(token, str) and token else None


def remove_dir(path: str, *, token: str | None = None, legacy: Callable[[str], bool] | None = None,
               legacy_dirs: Mapping[str, Callable[[str], bool]] | None = None, ignore_errors: bool = False) -> None:
    """Delete the directory ``path`` the converter made: a real directory (never a symlink)
    holding a valid marker (whose token is ``token``, when given). Without a marker,
    ``legacy(name)`` (when given) says which entries an older fastdata wrote there: those,
    if regular files, are unlinked (``legacy_dirs``: the subfolders it made, each removed the
    same way with its own predicate) and the directory removed if that empties it.

    ``ignore_errors``: OS errors while deleting are ignored (a refusal is not).

    Raises:
        UnsafeStoreError: ``path`` is a symlink or not a directory, its marker is missing or
            foreign, or (legacy) it holds something fastdata did not write.
    """
    if not check_dir(path):
        return
    found = read_marker(path)
    if found is not None and (token is None or found == token):
        # rmtree's fd-based walk (rmtree.avoids_symlink_attacks) never follows a symlink
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    why = "its marker was written by another run" if found is not None else f"it has no {MARKER_NAME} marker"
    if found is None and legacy is not None:
        names = os.listdir(path)
        subdirs = legacy_dirs or {}
        foreign = [n for n in names if not (legacy(n) or n in subdirs)]
        if not foreign:
            for name in names:
                if name in subdirs:
                    remove_dir(os.path.join(path, name), legacy=subdirs[name], ignore_errors=ignore_errors)
                else:
                    remove_file(os.path.join(path, name))
            try:
                os.rmdir(path)
                return
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    if ignore_errors:
                        return
                    raise
                foreign = os.listdir(path)
        why += f" and holds files fastdata does not write there (e.g. {sorted(foreign)[0]!r})"
    raise UnsafeStoreError(f"{path}: refusing to delete this directory: {why}, so fastdata did not make it; "
                           "remove it yourself if it is yours, or choose another destination")
