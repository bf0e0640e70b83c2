"""File names inside a store directory (shared by the writer pipeline and readers).

::

    DST/
      manifest.json           published last; its presence means "finished store"
      rejected.tsv            inputs that were skipped, with the reason
      shard-00000.lmdb        LMDB backend (one file per shard, subdir=False)
      shard-00000.h5          HDF5 backend
      .fastdata-staging/      only while converting: plan, the run's options and source
                              listing (for resume=True), one sidecar per finished shard
      .fastdata.lock          only while converting: flock'ed by the live converter
      shard-00000.lmdb.tmp    only while converting: a shard being written
"""

from __future__ import annotations

import re

from fastdata.common.fileio import ATOMIC_TMP_MARK

#: the store's manifest: published last, its presence means "finished store"
MANIFEST_NAME = "manifest.json"
#: inputs that were skipped, one per line with the reason
REJECTED_NAME = "rejected.tsv"
#: every shard's index arrays in one file (see docs/FORMAT.md); an appended store's later
#: versions name theirs ``index-00001.fdi``, ... (:func:`store_index_name`), so the file of the
#: version a reader opened is never replaced under it
STORE_INDEX_NAME = "index.fdi"
_STORE_INDEX_RE = re.compile(r"index(-[0-9]{5})?\.fdi")
#: only while writing: the staging folder, and in it ...
STAGING_DIR = ".fastdata-staging"
#: ... the run's plan fingerprint and options (what resume=True reuses and compares)
PLAN_FILE = "plan.json"
#: ... the source listing of a folder conversion (what resume=True compares the source with)
LISTING_FILE = "listing.npz"
#: ... the number of the run's first shard, when not 0 (an overwrite numbered its shards past
#: those an open file kept: see ``fastdata.writer.pipeline.clear_store``)
NUMBERING_FILE = "numbering.json"
#: ... and one index sidecar per finished shard (``<shard>.index``)
SIDECAR_SUFFIX = ".index"
#: only while writing: flock'ed by the live converter
LOCK_NAME = ".fastdata.lock"
#: only while writing: a shard being written is ``<shard>.tmp``
TMP_SUFFIX = ".tmp"

__all__ = ["ATOMIC_TMP_MARK", "LISTING_FILE", "LOCK_NAME", "MANIFEST_NAME", "NUMBERING_FILE", "PLAN_FILE",
           "REJECTED_NAME", "SIDECAR_SUFFIX", "STAGING_DIR", "STORE_INDEX_NAME", "TMP_SUFFIX", "check_file_name",
           "is_store_index_name", "shard_name", "shard_number", "store_index_name"]

#: the longest file name a store may list (NAME_MAX of common file systems)
MAX_FILE_NAME_BYTES = 255
_UNSAFE_NAME_CHARS = re.compile("[\x00-\x1f\x7f-\x9f/\\\\\ud800-\udfff]")


def _utf8_size(name: str) -> int:
    try:
        return len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: no file can have this name
        return MAX_FILE_NAME_BYTES + 1


def check_file_name(name: object) -> str | None:
    """Why ``name`` (from a manifest: untrusted) is not a plain file name inside the store
    directory, or None when it is one: a non-empty str of at most :data:`MAX_FILE_NAME_BYTES`
    UTF-8 bytes, not ``.`` or ``..``, without ``/``, ``\\``, NUL or any other control character
    (C0, DEL, C1) or lone surrogate."""
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if name in (".", ".."):
        return "a directory reference"
    bad = _UNSAFE_NAME_CHARS.search(name)
    if bad is not None:
        return ("holds a path separator" if bad.group() in "/\\"
                else "holds a NUL, a control character or a lone surrogate")
    if len(name) * 4 > MAX_FILE_NAME_BYTES and _utf8_size(name) > MAX_FILE_NAME_BYTES:
        return f"longer than {MAX_FILE_NAME_BYTES} bytes"
    return None


def shard_name(backend: str, shard_id: int) -> str:
    """File name of shard ``shard_id`` for ``backend`` (its suffix comes from the backend registry)."""
    from fastdata.format.backends.registry import get_backend  # local import: layout is imported by light modules

    return f"shard-{shard_id:05d}{get_backend(backend).shard_suffix}"


_SHARD_NUMBER = re.compile(r"shard-([0-9]+)\.")


def shard_number(name: str) -> int | None:
    """The number in a shard's file name (``shard-00007.lmdb`` -> 7), None for another name."""
    match = _SHARD_NUMBER.match(name)
    return int(match.group(1)) if match else None


def store_index_name(generation: int) -> str:
    """The store index file of a store's ``generation``-th version: ``index.fdi`` as first
    published, ``index-00001.fdi`` after its first append, and so on."""
    return STORE_INDEX_NAME if generation == 0 else f"index-{generation:05d}.fdi"


def is_store_index_name(name: str) -> bool:
    """Whether ``name`` is a store index file's name (:func:`store_index_name` of some generation)."""
    return _STORE_INDEX_RE.fullmatch(name) is not None
