"""Stores written by fastdata 0.1.0 (layout version 1, committed under tests/data/)
stay readable bit for bit: same stored bytes, pixels and labels, and verify passes.

The stores were converted from a 5-image ImageFolder tree (3 JPEG/PNG "cat", 2
"dog") with ``shard_size=1500``; ``v1-expected.json`` holds hashes of the source
files and of their decoded pixels, taken from the source tree at that time.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import xxhash

import fastdata
from fastdata.reader.dataset import StoreDataset

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")
EXPECTED = json.load(open(os.path.join(DATA, "v1-expected.json")))["samples"]


@pytest.fixture(params=["v1-lmdb", "v1-h5"])
def v1_store(request, tmp_path):
    # a copy: verify and the readers must not depend on the store being writable, but never touch the committed one
    dst = tmp_path / request.param
    shutil.copytree(os.path.join(DATA, request.param), dst)
    return str(dst)


def test_v1_store_reads_bit_exact(v1_store):
    ds = fastdata.open_dataset(v1_store, output="numpy")
    assert isinstance(ds, StoreDataset)
    assert ds.classes == ["cat", "dog"] and len(ds) == len(EXPECTED) == 5
    for i, want in enumerate(EXPECTED):
        shard, local = ds.locate(i)
        stored = ds._shards.get(shard).get(local)
        assert xxhash.xxh3_64_hexdigest(stored) == want["bytes_xxh3"] and len(stored) == want["nbytes"]
        image, label = ds[i]
        assert label == want["label"] and ds.relpath(i) == want["relpath"]
        assert list(image.shape) == want["shape"]
        assert xxhash.xxh3_64_hexdigest(np.ascontiguousarray(image).tobytes()) == want["pixels_xxh3"]
    batch = ds.__getitems__([4, 0, 2])
    assert [t for _, t in batch] == [EXPECTED[k]["label"] for k in (4, 0, 2)]


def test_v1_store_verifies(v1_store):
    report = fastdata.verify(v1_store, decode=True)
    assert report.ok, report.problems
    assert report.records_checked == report.decoded == 5
    assert fastdata.info(v1_store)["version"] == 1
