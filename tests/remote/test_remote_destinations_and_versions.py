"""Remote halves of destinations that cannot be turned against the user and of a dataset tied
to the store version it opened (on the test S3 server).

* a URL destination's local staging folder (``staging_dir`` + the store's name) that the
  converter did not make is never emptied (control: an empty ``staging_dir`` is used, and
  kept, while the converter's own folder in it is removed at the end);
* a remote store rewritten under an open dataset: a shard downloaded afterwards raises
  :class:`~fastdata.errors.StoreChangedError` naming the URL (control: not rewritten, every
  shard reads).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.images import make_tree

import fastdata
from fastdata.errors import StoreChangedError, UnsafeStoreError
from fastdata.remote.location import RemoteLocation


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("remote-version-trees")
    return {"old": make_tree(base / "old", {"ant": 6, "bee": 6}, size=(24, 20), seed=3),
            "new": make_tree(base / "new", {"cat": 4, "dog": 8}, size=(16, 12), seed=4)}


def _convert(src, dst, **kw):
    return fastdata.convert(src, dst, workers=0, progress=False, shard_size=3000, format="lmdb", **kw)


def test_a_folder_named_like_the_store_in_staging_dir_is_never_emptied(s3, trees, tmp_path):
    _, bucket = s3
    user = tmp_path / "work"
    (user / "victim.lmdb").mkdir(parents=True)
    (user / "victim.lmdb" / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeStoreError, match="victim.lmdb"):
        _convert(trees["old"], f"{bucket}/victim.lmdb", staging_dir=str(user))
    assert os.listdir(user / "victim.lmdb") == ["notes.txt"]
    assert not RemoteLocation(bucket).listing(), "objects were written after the refusal"


def test_control_an_empty_staging_dir_is_used_and_kept(s3, trees, tmp_path):
    _, bucket = s3
    user = tmp_path / "staging"
    user.mkdir()
    report = _convert(trees["old"], f"{bucket}/ok.lmdb", staging_dir=str(user))
    assert report.images == 12 and user.is_dir() and os.listdir(user) == []
    assert fastdata.verify(f"{bucket}/ok.lmdb").ok


def _read_all(ds) -> list:
    return [(np.asarray(img).shape, int(label)) for img, label in (ds[i] for i in range(len(ds)))]


@pytest.mark.parametrize("mode", ["control", "rewritten"])
def test_remote_store_rewritten_under_an_open_dataset(s3, trees, tmp_path, mode):
    _, bucket = s3
    url = f"{bucket}/store.lmdb"
    _convert(trees["old"], url)
    ds = fastdata.open_dataset(url, output="numpy", cache_dir=str(tmp_path / "cache"))
    assert len(ds.shard_starts) >= 3
    ds[0]  # shard 0 cached (the opened version), the others not yet
    if mode == "control":
        assert len(_read_all(ds)) == 12
        return
    _convert(trees["new"], url, overwrite=True)
    with pytest.raises(StoreChangedError) as exc:
        _read_all(ds)
    assert url in str(exc.value) and "rewritten since it was opened" in str(exc.value), str(exc.value)
