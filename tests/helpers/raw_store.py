"""Store surgery and reads with lmdb/h5py/numcodecs alone, run by the chunked-field tests in a
fresh interpreter that imports no fastdata code (see tests/reader/test_chunked_read.py)."""

from __future__ import annotations

import math

import h5py
import lmdb
import msgpack
import numpy as np


def set_first(shard: str, first: int) -> None:
    """Point sample 0's ``ct`` chunks of an HDF5 shard at ``first``."""
    with h5py.File(shard, "r+") as f:
        f["fields/ct.first"][0] = first


def set_shape(shard: str, shape: list[int]) -> None:
    """Give sample 0's ``ct`` of an HDF5 shard another stored shape."""
    with h5py.File(shard, "r+") as f:
        f["fields/ct.shape"][0] = shape


def read_without_fastdata(path, suffix: str) -> np.ndarray:
    """Sample 1's ``ct`` of the store ``path``, read as FORMAT.md describes, with no fastdata code."""
    import json

    import numcodecs  # imported here: only this function needs it

    manifest = json.loads((path / "manifest.json").read_text())
    field = next(f for f in manifest["schema"] if f["name"] == "ct")
    assert field["codec"] in ("blosc-lz4", "blosc-zstd")  # Blosc frames: one decoder for both
    chunks = tuple(field["chunks"])
    shard = path / manifest["shards"][0]["name"]
    if suffix == ".lmdb":
        env = lmdb.open(str(shard), subdir=False, readonly=True, lock=False, max_dbs=3)
        with env.begin() as txn:
            index_db, records_db, chunks_db = (env.open_db(n, txn=txn, create=False)
                                               for n in (b"index", b"records", b"chunks"))
            shapes = np.frombuffer(txn.get(b"fields/ct.shape", db=index_db), "<i8").reshape(-1, 3)
            firsts = np.frombuffer(txn.get(b"fields/ct.first", db=index_db), "<u8")
            record = msgpack.unpackb(txn.get((1).to_bytes(8, "big"), db=records_db))
            entries = np.frombuffer(record["ct"], dtype=[("nbytes", "<u4"), ("xxh", "<u8")])
            stored = [txn.get(int(firsts[1] + j).to_bytes(8, "big"), db=chunks_db) for j in range(len(entries))]
        env.close()
    else:
        with h5py.File(shard, "r") as f:
            shapes, firsts = f["fields/ct.shape"][()], f["fields/ct.first"][()]
            offsets = f["offsets"][()]
            record = msgpack.unpackb(f["records"][offsets[1]:offsets[2]].tobytes())
            entries = np.frombuffer(record["ct"], dtype=[("nbytes", "<u4"), ("xxh", "<u8")])
            starts = int(firsts[1]) + np.concatenate([[0], np.cumsum(entries["nbytes"].astype(np.int64))])
            stored = [f["chunks"][starts[j]:starts[j + 1]].tobytes() for j in range(len(entries))]
    shape = tuple(int(s) for s in shapes[1])
    grid = [math.ceil(s / c) for s, c in zip(shape, chunks, strict=True)]
    out = np.zeros(shape, dtype="<u2")
    for j, data in enumerate(stored):
        pos = np.unravel_index(j, grid)
        region = tuple(slice(p * c, min((p + 1) * c, s)) for p, c, s in zip(pos, chunks, shape, strict=True))
        block = np.frombuffer(numcodecs.Blosc().decode(data), dtype="<u2")
        out[region] = block.reshape([r.stop - r.start for r in region])
    return out
