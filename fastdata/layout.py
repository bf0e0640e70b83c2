"""File names inside a store directory (shared by the writer pipeline and readers).

::

    DST/
      manifest.json           published last; its presence means "finished store"
      rejected.tsv            inputs that were skipped, with the reason
      shard-00000.lmdb        LMDB backend (one file per shard, subdir=False)
      shard-00000.h5          HDF5 backend
      .fastdata-staging/      only while converting: plan + one sidecar per finished shard
      .fastdata.lock          only while converting: flock'ed by the live converter
      shard-00000.lmdb.tmp    only while converting: a shard being written
"""

from __future__ import annotations

STAGING_DIR = ".fastdata-staging"
LOCK_NAME = ".fastdata.lock"
TMP_SUFFIX = ".tmp"
#: atomic_write() names its temporary file "<target>.tmp-<pid>"
ATOMIC_TMP_MARK = ".tmp-"
SHARD_SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


def shard_name(backend: str, shard_id: int) -> str:
    """File name of shard ``shard_id`` for ``backend``."""
    return f"shard-{shard_id:05d}{SHARD_SUFFIX[backend]}"


def backend_for_path(path: str) -> str | None:
    """Backend implied by a destination suffix, or None."""
    low = path.rstrip("/").lower()
    if low.endswith(".lmdb"):
        return "lmdb"
    if low.endswith((".h5", ".hdf5")):
        return "hdf5"
    return None
