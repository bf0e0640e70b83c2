"""``az://`` and ``gs://`` against real emulators (tests/helpers/emulators.py: Azurite through
adlfs, gcp-storage-emulator through gcsfs), each test once per scheme: a store written to the
URL verifies and reads like its local conversion, through the shard cache and record by record;
an image folder at the URL converts (in the CLI, with its storage options) to the store its
local copy converts to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.counting_proxy import CountingProxy
from helpers.images import make_jpeg
from helpers.procs import cli_in_process, reaped
from test_remote_read import same_samples
from test_remote_sources import same_store, upload_tree

import fastdata
import fastdata.writer.remote_sink as remote_sink
from fastdata.errors import IncompleteStoreError, RemoteStoreError
from fastdata.format.names import STAGING_DIR
from fastdata.remote.location import RemoteLocation, SourceChangedError
from fastdata.writer.options import WriteOptions
from fastdata.writer.session import WriteSession
from fastdata.writer.sources.remote import RemoteFolderInput


def test_a_store_written_to_the_url_verifies_and_reads_like_the_local_one(cloud, small_tree, tmp_path):
    """Converted to the URL: the local conversion's shards, no staging left; it verifies; it reads
    like the local store through the shard cache, and with ``cache="records"`` each record is one
    ranged request the emulator answered with 206 (counted by a proxy in front of it), no shard
    downloaded."""
    server, bucket = cloud
    options = server.storage_options
    local = str(tmp_path / "train.h5")
    url = f"{bucket}/train.h5"
    fastdata.convert(small_tree, local, shard_size="20kB", progress=False, workers=0)
    report = fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1, storage_options=options)
    assert report.dst == url
    loc = RemoteLocation(url, options)
    man = json.loads(loc.read_bytes("manifest.json"))
    ref = json.loads(Path(local, "manifest.json").read_text())
    assert len(man["shards"]) > 1
    assert [(s["name"], s["bytes"], s["xxh"]) for s in man["shards"]] == \
        [(s["name"], s["bytes"], s["xxh"]) for s in ref["shards"]]
    assert not [n for n in loc.listing() if n.startswith(STAGING_DIR)]
    assert fastdata.verify(url, storage_options=options).ok
    same_samples(url, local, storage_options=options)

    proxy = CountingProxy(server.endpoint).start()
    try:
        cache_dir = str(tmp_path / "records-cache")
        ds = fastdata.open_dataset(url, storage_options=server.options_via(proxy.endpoint), cache="records",
                                   cache_dir=cache_dir, output="numpy")
        want = fastdata.open_dataset(local, output="numpy")
        assert len(ds) == len(want)
        for i in range(len(ds)):
            proxy.clear()
            img, label = ds[i]
            gets = proxy.gets("shard-")
            assert len(gets) == 1 and gets[0].range and gets[0].status == 206, (i, gets)
            np.testing.assert_array_equal(img, want[i][0])
            assert label == want[i][1]
        assert not [f for _d, _s, files in os.walk(cache_dir) for f in files if f.endswith(".h5")]
    finally:
        proxy.stop()


def test_an_image_folder_at_the_url_converts_like_its_local_copy(cloud, tmp_path, capsys):
    server, bucket = cloud
    tree = tmp_path / "imgs"
    for k in range(12):
        make_jpeg(tree / ("ant" if k % 2 else "bee") / f"img_{k}.jpg", size=(24 + k, 20), seed=k)
    (tree / "bee" / "broken.jpg").write_bytes(b"\xff\xd8not a jpeg")
    upload_tree(tree, f"{bucket}/imgs", server.storage_options)
    local = str(tmp_path / "local.lmdb")
    fastdata.convert(str(tree), local, shard_size="4kB", progress=False, workers=0)
    dst = str(tmp_path / "remote.lmdb")
    options = [f"--storage-option={k}={v}" for k, v in server.storage_options.items()]
    done = cli_in_process(capsys, "convert", f"{bucket}/imgs", dst, "--shard-size", "4kB", "--workers", "1",
                          "--quiet", *options)
    assert done.returncode == 0, done.stderr
    same_store(dst, local)


@pytest.mark.parametrize("how", ["rewritten-same-size", "deleted"])
def test_an_object_changed_after_listing_stops_the_run_naming_it(cloud, tmp_path, how):
    """Between the listing and the reads, one input is rewritten with as many bytes (only its ETag
    tells) or deleted: the run stops naming it and publishes nothing; unchanged, it converts."""
    server, bucket = cloud
    options = server.storage_options
    tree = tmp_path / "imgs"
    for k in range(4):
        make_jpeg(tree / "ant" / f"img_{k}.jpg", size=(24, 20), seed=k)
    url = f"{bucket}/changing"
    upload_tree(tree, url, options)
    loc = RemoteLocation(url, options)
    victim = "ant/img_2.jpg"
    data = loc.read_bytes(victim)

    def change() -> None:
        if how == "deleted":
            loc.remove([victim])
        else:
            loc.write_bytes(victim, data[:-2] + bytes([data[-2] ^ 0xFF, data[-1]]))

    class Changing(RemoteFolderInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            change()
            return plans

    dst = tmp_path / "changed.lmdb"
    with pytest.raises(SourceChangedError, match=f"{url}/{victim}: the object (changed|was deleted)") as caught:
        WriteSession(Changing(url, storage_options=options), str(dst), WriteOptions(workers=0, progress=False)).run()
    assert "\n" not in str(caught.value)
    assert not (dst / "manifest.json").exists()
    # control: the same run with nothing changed after the listing converts
    fastdata.convert(url, str(tmp_path / "control.lmdb"), progress=False, workers=0, storage_options=options)


@pytest.mark.slow
def test_a_killed_upload_resumes_without_reuploading(cloud, jpeg_tree, tmp_path, monkeypatch):
    """The CLI converting to the URL is SIGKILLed once a shard is uploaded and recorded in the
    remote staging; the URL then reads as an unfinished conversion, and ``--resume`` keeps the
    recorded shards (not uploaded again) and publishes the store of an uninterrupted run."""
    server, bucket = cloud
    options = server.storage_options
    src = jpeg_tree(tmp_path / "src", classes={"a": 20, "b": 20}, size=(64, 48))
    url = f"{bucket}/killed.lmdb"
    flags = [f"--storage-option={k}={v}" for k, v in options.items()]
    cmd = [sys.executable, "-m", "fastdata", "convert", src, url, "--shard-size", "8kB", "--workers", "1",
           "--staging-dir", str(tmp_path / "staging"), "--quiet", *flags]
    proc = subprocess.Popen(cmd, env=dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    loc = RemoteLocation(url, options)
    with reaped(proc):
        while not any(n.endswith(".json") and n.startswith(f"{STAGING_DIR}/shard-") for n in loc.listing()):
            if proc.poll() is not None:
                pytest.fail(f"the converter finished before it could be killed: {proc.communicate()}")
            time.sleep(0.01)
        proc.kill()
        proc.wait(10)
    listing = loc.listing()
    assert "manifest.json" not in listing
    with pytest.raises(IncompleteStoreError, match="unfinished conversion"):
        fastdata.open_dataset(url, storage_options=options)
    kept = {n[len(STAGING_DIR) + 1:-5] for n in listing
            if n.startswith(f"{STAGING_DIR}/shard-") and n.endswith(".json")}
    uploaded: list[str] = []
    real = remote_sink.upload_checked
    monkeypatch.setattr(remote_sink, "upload_checked",
                        lambda location, path, name: (uploaded.append(name), real(location, path, name))[1])
    report = fastdata.convert(src, url, workers=1, progress=False, resume=True, storage_options=options,
                              staging_dir=str(tmp_path / "staging"))
    assert report.resumed_shards == len(kept) > 0
    clean = str(tmp_path / "clean.lmdb")
    fastdata.convert(src, clean, shard_size="8kB", progress=False, workers=1)
    same_samples(url, clean, storage_options=options)
    assert fastdata.verify(url, storage_options=options).ok
    assert uploaded[-1] == "manifest.json" and not kept & set(uploaded)  # the kept shards: not uploaded again


def test_an_upload_damaged_on_the_way_is_caught_by_its_md5_and_nothing_is_published(cloud, small_tree, monkeypatch,
                                                                                       tmp_path):
    """A shard whose upload carries other bytes of the same size: the MD5 the emulator reports
    for the object is not the file's, so the run stops naming it; the manifest is never written,
    and a resume uploads it again and publishes. Control: checking sizes alone publishes it."""
    server, bucket = cloud
    options = server.storage_options
    url = f"{bucket}/damaged.lmdb"
    fs = RemoteLocation(url, options).filesystem()  # the converter's (one per process and options)
    real = fs.put_file

    def damaging(local_path, path, **kwargs):
        if not os.path.basename(path).startswith("shard-00001"):
            return real(local_path, path, **kwargs)
        data = Path(local_path).read_bytes()
        bad = tmp_path / "bad"
        bad.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        return real(str(bad), path, **kwargs)

    monkeypatch.setattr(fs, "put_file", damaging)
    with pytest.raises(RemoteStoreError, match=r"shard-00001\.lmdb: the uploaded object does not match.*its MD5"):
        fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1, storage_options=options)
    listing = RemoteLocation(url, options).listing()
    assert "manifest.json" not in listing and f"{STAGING_DIR}/shard-00001.lmdb.json" not in listing
    # control: with sizes alone checked the damaged shard is published (verify finds it later)
    monkeypatch.setenv("FASTDATA_UPLOAD_ETAG_CHECK", "0")
    control = f"{bucket}/control.lmdb"
    fastdata.convert(small_tree, control, shard_size="20kB", progress=False, workers=1, storage_options=options)
    assert not fastdata.verify(control, storage_options=options).ok
    monkeypatch.delenv("FASTDATA_UPLOAD_ETAG_CHECK")
    monkeypatch.setattr(fs, "put_file", real)
    fastdata.convert(small_tree, url, progress=False, workers=1, resume=True, storage_options=options)
    assert len(fastdata.open_dataset(url, storage_options=options)) == 24


@pytest.mark.slow
def test_append_merge_and_added_fields_on_the_url_read_like_local(cloud, jpeg_tree, tmp_path):
    """A store on the URL grown by an append, two stores merged there (shards copied by the
    server), and a field added to a store there: each reads like the same operations done locally,
    and verifies."""
    server, bucket = cloud
    options = server.storage_options
    w1 = jpeg_tree(tmp_path / "w1", classes={"a": 4, "b": 4}, size=(40, 30), seed=1)
    w2 = jpeg_tree(tmp_path / "w2", classes={"b": 5}, size=(40, 30), seed=2)
    for name in ("A", "B"):
        for dst in (f"{bucket}/{name}.lmdb", str(tmp_path / f"{name}.lmdb")):
            fastdata.convert(w1 if name == "A" else w2, dst, shard_size="8kB", workers=1, progress=False,
                             storage_options=options if "://" in dst else None)
    report = fastdata.merge([f"{bucket}/A.lmdb", f"{bucket}/B.lmdb"], f"{bucket}/C.lmdb", storage_options=options)
    fastdata.merge([tmp_path / "A.lmdb", tmp_path / "B.lmdb"], tmp_path / "C.lmdb")
    assert report.server_side == report.shards > 2
    same_samples(f"{bucket}/C.lmdb", str(tmp_path / "C.lmdb"), storage_options=options)
    for dst in (f"{bucket}/A.lmdb", str(tmp_path / "A.lmdb")):
        fastdata.convert(w2, dst, workers=1, progress=False, append=True,
                         storage_options=options if "://" in dst else None)
    same_samples(f"{bucket}/A.lmdb", str(tmp_path / "A.lmdb"), storage_options=options)
    assert fastdata.verify(f"{bucket}/A.lmdb", storage_options=options).ok
    score = np.arange(13, dtype=np.float32) / 2
    fastdata.add_fields(f"{bucket}/A.lmdb", {"score": score}, storage_options=options)
    ds = fastdata.open_dataset(f"{bucket}/A.lmdb", storage_options=options)
    np.testing.assert_array_equal(ds.column("score"), score)
    assert fastdata.verify(f"{bucket}/A.lmdb", storage_options=options).ok


@pytest.mark.parametrize("scheme", ["az", "gs"])
def test_an_emulator_dies_with_its_sigkilled_starter(scheme, tmp_path):
    """The emulators are started as the S3 server is (tests/helpers/s3server.py): a starter
    SIGKILLed (a CI timeout) leaves no emulator running."""
    import psutil
    from helpers.emulators import missing
    from helpers.images import TESTS_DIR

    if missing(scheme):
        pytest.skip(missing(scheme))
    starter = ("import sys, time; sys.path.insert(0, sys.argv[1]); from helpers.emulators import EMULATORS; "
               "server = EMULATORS[sys.argv[2]](sys.argv[3]).start(); print(server.proc.pid, flush=True); "
               "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", starter, str(TESTS_DIR), scheme, str(tmp_path / "emulator")],
                             stdout=subprocess.PIPE, text=True)
    with reaped(child):
        pid = int(child.stdout.readline())
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        child.kill()
        child.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        psutil.Process(pid).kill()
        pytest.fail(f"the {scheme} emulator (pid {pid}) outlived its SIGKILLed starter")


@pytest.mark.slow
def test_a_listing_of_more_than_a_page_of_blobs_is_read_whole(az_server, tmp_path):
    """Azurite answers 5,000 blobs a page: a folder of 5,001 objects is listed across two pages
    (counted through a proxy), every object once. (gcp-storage-emulator answers any listing in
    one page, so gcsfs's paging has no test here.)"""
    from fastdata.remote.sources import list_objects

    bucket = f"page{os.getpid()}"
    az_server.make_bucket(bucket)
    az_server.filesystem().pipe({f"{bucket}/imgs/c/{i:05d}.jpg": b"x" * (i % 7 + 1) for i in range(5001)})
    proxy = CountingProxy(az_server.endpoint).start()
    try:
        found = list_objects(RemoteLocation(f"az://{bucket}/imgs", az_server.options_via(proxy.endpoint)))
        pages = proxy.gets("comp=list")
    finally:
        proxy.stop()
    size_of = {name.decode(): int(size) for name, size in zip(found.names, found.sizes, strict=True)}
    assert len(found) == 5001 and size_of == {f"c/{i:05d}.jpg": i % 7 + 1 for i in range(5001)}
    assert all(found.etags)
    assert len(pages) == 2, pages
