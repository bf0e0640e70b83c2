"""Paths the user gives: telling a URL from a local path, and refusing one where only the other works."""

from __future__ import annotations

import os
import re

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
