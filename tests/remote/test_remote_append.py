"""Appending to a store on the test S3 server (SeaweedFS): the same append as on local disk (new
shard objects, the new index file and manifest uploaded last), a SIGKILL mid-append leaves the
published version as it was, and ``append + resume`` finishes without uploading kept shards again."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers.backends import first_in_ci
from helpers.procs import reaped
from test_remote_read import same_samples

import fastdata
from fastdata.errors import StoreExistsError
from fastdata.format.names import STAGING_DIR
from fastdata.remote.location import RemoteLocation


def remote_manifest(url: str) -> dict:
    loc = RemoteLocation(url)
    loc.filesystem().invalidate_cache()
    return json.loads(loc.read_bytes("manifest.json"))


def test_append_to_s3_reads_like_the_local_append_and_old_readers_read_on(s3, jpeg_tree, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    w1 = jpeg_tree(tmp_path / "w1", classes={"a": 4, "b": 4}, size=(40, 30), seed=1)
    w2 = jpeg_tree(tmp_path / "w2", classes={"b": 5}, size=(40, 30), seed=2)
    url, local = f"{bucket}/grow.lmdb", str(tmp_path / "grow.lmdb")
    for dst in (url, local):
        fastdata.convert(w1, dst, shard_size="8kB", workers=1, progress=False)
    before = fastdata.open_dataset(url, output="numpy")
    first_version = remote_manifest(url)
    with pytest.raises(StoreExistsError, match="no published fastdata store to append to"):
        fastdata.convert(w2, f"{bucket}/none.lmdb", workers=1, progress=False, append=True)
    for dst in (url, local):
        report = fastdata.convert(w2, dst, workers=1, progress=False, append=True)
    assert report.store_total == (13, len(remote_manifest(url)["shards"]))
    m = remote_manifest(url)
    assert m["shards"][:len(first_version["shards"])] == first_version["shards"]
    assert m["store_index"]["name"] == "index-00001.fdi"
    assert not [n for n in RemoteLocation(url).listing() if n.startswith(STAGING_DIR)]
    same_samples(url, local)
    assert fastdata.verify(url).ok
    # the dataset opened before reads on in the version it opened (its cache is keyed by that version)
    copy = pickle.loads(pickle.dumps(before))
    assert len(copy) == 8
    np.testing.assert_array_equal(copy[7][0], fastdata.open_dataset(local, output="numpy")[7][0])


@pytest.mark.parametrize("suffix", first_in_ci([".lmdb", ".h5"]))
def test_sigkill_during_an_s3_append_then_resume(s3, jpeg_tree, tmp_path, monkeypatch, suffix):
    _, bucket = s3
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    w1 = jpeg_tree(tmp_path / "w1", classes={"a": 2, "b": 1}, size=(40, 30), seed=1)
    big = jpeg_tree(tmp_path / "big", classes={"a": 20, "b": 20}, size=(64, 48), seed=3)
    url, clean = f"{bucket}/killed{suffix}", str(tmp_path / f"clean{suffix}")
    for dst in (url, clean):
        fastdata.convert(w1, dst, shard_size="8kB", workers=1, progress=False)
    published = remote_manifest(url)
    staging = tmp_path / "staging"
    cmd = [sys.executable, "-m", "fastdata", "convert", big, url, "--append", "--workers", "1",
           "--staging-dir", str(staging)]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    loc = RemoteLocation(url)
    with reaped(proc):
        while not any(n.endswith(".json") and n.startswith(f"{STAGING_DIR}/shard-") for n in loc.listing()):
            if proc.poll() is not None:
                pytest.fail(f"the append finished before it could be killed: {proc.communicate()}")
        proc.kill()
        proc.wait(10)
    # the published version, as it was: readable, verifying
    assert remote_manifest(url) == published
    assert len(fastdata.open_dataset(url)) == 3 and fastdata.verify(url).ok
    report = fastdata.convert(big, url, workers=1, progress=False, append=True, resume=True, staging_dir=staging)
    assert report.resumed_shards > 0 and report.images == 40
    fastdata.convert(big, clean, workers=1, progress=False, append=True)
    same_samples(url, clean)
    clean_manifest = json.loads((tmp_path / f"clean{suffix}" / "manifest.json").read_text())
    assert [(s["name"], s["xxh"]) for s in remote_manifest(url)["shards"]] == \
        [(s["name"], s["xxh"]) for s in clean_manifest["shards"]]
    assert fastdata.verify(url).ok


def test_merge_of_s3_stores_copies_server_side_and_reads_like_the_local_merge(s3, jpeg_tree, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    a = jpeg_tree(tmp_path / "a", classes={"a": 4, "b": 3}, size=(40, 30), seed=1)
    b = jpeg_tree(tmp_path / "b", classes={"b": 2, "c": 3}, size=(40, 30), seed=2)
    for name, src in (("A", a), ("B", b)):
        fastdata.convert(src, f"{bucket}/{name}.lmdb", shard_size="8kB", workers=1, progress=False)
        fastdata.convert(src, str(tmp_path / f"{name}.lmdb"), shard_size="8kB", workers=1, progress=False)
    url = f"{bucket}/C.lmdb"
    report = fastdata.merge([f"{bucket}/A.lmdb", f"{bucket}/B.lmdb"], url)
    local = fastdata.merge([tmp_path / "A.lmdb", tmp_path / "B.lmdb"], tmp_path / "C.lmdb")
    assert report.shards == local.shards > 2 and report.server_side == report.copied == report.shards
    assert "copied by the server" in report.summary()
    same_samples(url, str(tmp_path / "C.lmdb"))
    assert fastdata.open_dataset(url).classes == ["a", "b", "c"] and fastdata.verify(url).ok
    with pytest.raises(fastdata.errors.FastdataError, match="merge local stores into a local store"):
        fastdata.merge([f"{bucket}/A.lmdb", tmp_path / "B.lmdb"], tmp_path / "D.lmdb")
    # the destination is compared by what the URL names, not its spelling (a destination with '//', '.' or
    # '..' segments is refused as such): none of these touches A
    inputs = [f"{bucket}/A.lmdb", f"{bucket}/B.lmdb"]
    before = remote_manifest(inputs[0])
    host = bucket.split("://", 1)[1]
    for dst, says in [(f"S3://{host}/A.lmdb", "is the input"), (f"s3a://{host}/A.lmdb", "is the input"),
                      (f"{bucket}//A.lmdb/", "empty segment"), (f"{bucket}/x/../A.lmdb", "'..'"),
                      (f"{bucket}/A.lmdb/inner", "lies inside the input"),
                      (f"{bucket}/", "lies inside the destination")]:
        with pytest.raises(fastdata.errors.FastdataError, match=says):
            fastdata.merge(inputs, dst, overwrite=True)
    assert remote_manifest(inputs[0]) == before and fastdata.verify(inputs[0]).ok


@pytest.mark.parametrize("a, b, same", [
    ("s3://bkt/a/b", "S3://BKT/a/b/", True), ("s3a://bkt/a//b", "s3://bkt/a/./b", True),
    ("gcs://bkt/x/../a", "gs://bkt/a", True), ("s3://bkt/A", "s3://bkt/a", False),  # keys keep their case
    ("s3://bkt/a%2Fb", "s3://bkt/a/b", False), ("s3://bkt/a", "gs://bkt/a", False)])
def test_url_identity_meets_every_spelling_of_one_prefix(a, b, same):
    from fastdata.remote.location import url_identity

    assert (url_identity(a) == url_identity(b)) is same
