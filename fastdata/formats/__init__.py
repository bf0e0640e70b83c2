"""Storage backends. Each backend only encodes/decodes its shard files; the
writer pipeline (``fastdata.pipeline``) and the datasets are shared."""

from __future__ import annotations

from .base import ShardReader, ShardWriter


def writer_class(backend: str) -> type[ShardWriter]:
    """The shard writer class for ``backend`` ('lmdb' or 'hdf5')."""
    if backend == "lmdb":
        from .lmdb.writer import LMDBShardWriter

        return LMDBShardWriter
    if backend == "hdf5":
        from .hdf5.writer import HDF5ShardWriter

        return HDF5ShardWriter
    raise ValueError(f"unknown backend {backend!r}")


def reader_class(backend: str) -> type[ShardReader]:
    """The shard reader class for ``backend`` ('lmdb' or 'hdf5')."""
    if backend == "lmdb":
        from .lmdb.reader import LMDBShardReader

        return LMDBShardReader
    if backend == "hdf5":
        from .hdf5.reader import HDF5ShardReader

        return HDF5ShardReader
    raise ValueError(f"unknown backend {backend!r}")
