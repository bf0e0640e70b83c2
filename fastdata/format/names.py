"""File names inside a store directory (shared by the writer pipeline and readers).

::

    DST/
      manifest.json           published last; its presence means "finished store"
      rejected.tsv            inputs that were skipped, with the reason
      shard-00000.lmdb        LMDB backend (one file per shard, subdir=False)
      shard-00000.h5          HDF5 backend
      .fastdata-staging/      only while converting: plan, the run's options and source
                              listing (for --resume), one sidecar per finished shard
      .fastdata.lock          only while converting: flock'ed by the live converter
      shard-00000.lmdb.tmp    only while converting: a shard being written
"""

from __future__ import annotations

import os
import re

STAGING_DIR = ".fastdata-staging"
LOCK_NAME = ".fastdata.lock"
TMP_SUFFIX = ".tmp"
#: atomic_write() names its temporary file "<target>.tmp-<pid>"
ATOMIC_TMP_MARK = ".tmp-"


def shard_name(backend: str, shard_id: int) -> str:
    """File name of shard ``shard_id`` for ``backend`` (its suffix comes from the backend registry)."""
    from fastdata.format.backends.registry import get_backend  # local import: layout is imported by light modules

    return f"shard-{shard_id:05d}{get_backend(backend).shard_suffix}"


def backend_for_path(path: str) -> str | None:
    """Backend implied by a destination suffix (see :mod:`fastdata.format.backends.registry`), or None."""
    from fastdata.format.backends.registry import backend_for_path as lookup

    return lookup(path)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def remote_scheme(path: str | os.PathLike) -> str | None:
    """``"s3"`` for ``s3://bucket/x`` (any ``scheme://`` URL), None for a local path."""
    m = _URL.match(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    return m.group(1).lower() if m else None


def check_local_path(path: str | os.PathLike, what: str, must_exist: bool = True) -> None:
    """Refuse a remote URL, and (with ``must_exist``) a path that does not exist.

    Args:
        path: what the user gave.
        what: how messages name it ("source", "store", ...).
        must_exist: also require the path to exist.

    Raises:
        RemotePathError: ``path`` is a URL (``s3://``, ``gs://``, ``https://``, ``az://``...).
        PathNotFoundError: ``must_exist`` and nothing is at ``path``.
    """
    from fastdata.errors import PathNotFoundError, RemotePathError

    scheme = remote_scheme(path)
    if scheme is not None:
        raise RemotePathError(
            f"{what} {os.fspath(path)}: remote stores ({scheme}://) are not supported yet: "
            "copy the data to a local or mounted filesystem and give that path")
    if must_exist and not os.path.exists(path):
        raise PathNotFoundError(f"{what} {os.fspath(path)} does not exist")
