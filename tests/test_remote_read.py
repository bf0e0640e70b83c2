"""Reading stores from an S3-compatible server (a real SeaweedFS, see tests/s3server.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import fastdata
from fastdata.remote.location import RemoteLocation


def upload_store(local: str, url: str) -> None:
    """Copy a published local store to ``url`` object by object (as `aws s3 sync` would)."""
    loc = RemoteLocation(url)
    for name in sorted(os.listdir(local)):
        path = os.path.join(local, name)
        if os.path.isfile(path):
            loc.upload(path, name)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_remote_store_reads_like_the_local_one(s3, small_tree, tmp_path, fmt):
    server, bucket = s3
    local = str(tmp_path / f"train.{fmt}")
    fastdata.convert(small_tree, local, shard_size="20kB", progress=False)
    url = f"{bucket}/train.{fmt}"
    upload_store(local, url)
    ref = fastdata.open_dataset(local, output="numpy")
    ds = fastdata.open_dataset(url, output="numpy")
    assert len(ds) == len(ref) and ds.classes == ref.classes
    assert len(ref.shard_starts) > 1
    np.testing.assert_array_equal(ds.targets, ref.targets)
    for i in range(len(ref)):
        img, label = ds[i]
        ref_img, ref_label = ref[i]
        assert label == ref_label
        np.testing.assert_array_equal(img, ref_img)
