"""Writing stores to an S3-compatible server (a real SeaweedFS, see tests/helpers/s3server.py): shards
staged locally and uploaded as each finishes, checked, manifest last, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.backends import NAMES
from helpers.procs import reaped
from test_remote_read import same_samples

import fastdata
import fastdata.writer.remote_sink as publish_mod
from fastdata.errors import (
    IncompleteStoreError,
    RemotePathError,
    RemoteStoreError,
    ResumeMismatchError,
    StoreExistsError,
)
from fastdata.format.names import STAGING_DIR
from fastdata.remote.location import RemoteLocation
from fastdata.writer.remote_sink import MAX_WAITING, expected_etag, local_staging_dir


def remote_manifest(url: str) -> dict:
    loc = RemoteLocation(url)
    loc.filesystem().invalidate_cache()  # a listing taken while the store was written is cached by s3fs
    return json.loads(loc.read_bytes("manifest.json"))


def objects(url: str) -> dict[str, int]:
    return RemoteLocation(url).listing()


@pytest.fixture
def count_uploads(monkeypatch):
    """Record every checked upload: (object name, local shard files in its folder at that moment)."""
    seen: list[tuple[str, int]] = []
    real = publish_mod.upload_checked

    def counting(location, local_path, name):
        folder = os.path.dirname(local_path)
        shards = [n for n in os.listdir(folder) if n.startswith("shard-")]
        seen.append((name, len(shards)))
        return real(location, local_path, name)

    monkeypatch.setattr(publish_mod, "upload_checked", counting)
    return seen


@pytest.mark.parametrize("fmt", NAMES)
def test_convert_to_s3_reads_like_the_local_conversion(s3, small_tree, tmp_path, fmt, count_uploads):
    _, bucket = s3
    local = str(tmp_path / f"train.{fmt}")
    url = f"{bucket}/train.{fmt}"
    fastdata.convert(small_tree, local, shard_size="20kB", progress=False, workers=1)
    report = fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    assert report.dst == url and url in report.summary()
    same_samples(url, local)
    man, ref = remote_manifest(url), json.loads(Path(local, "manifest.json").read_text())
    assert [(s["name"], s["bytes"], s["xxh"]) for s in man["shards"]] == \
        [(s["name"], s["bytes"], s["xxh"]) for s in ref["shards"]]
    assert len(man["shards"]) > 1
    # every shard uploaded once, manifest last; nothing left in the remote staging or locally
    names = [n for n, _ in count_uploads]
    assert sorted(n for n in names if n.startswith("shard-")) == [s["name"] for s in man["shards"]]
    assert names[-1] == "manifest.json"
    assert not [n for n in objects(url) if n.startswith(STAGING_DIR)]
    assert not os.path.exists(os.path.dirname(local_staging_dir(url, None, None)))  # uploads/<key>/ removed too


def test_local_staging_holds_at_most_the_bound_of_shards(s3, small_tree, tmp_path, count_uploads, monkeypatch):
    _, bucket = s3
    url = f"{bucket}/bounded.lmdb"
    # uploads are slow here: the converter runs ahead until it blocks on the bound
    real = publish_mod.upload_checked  # (count_uploads' count, then the upload)

    def slow_upload(*args, **kwargs):
        import time
        real(*args, **kwargs)
        time.sleep(0.05)  # a slow network, not synchronisation: the bound must hold whatever the speed

    monkeypatch.setattr(publish_mod, "upload_checked", slow_upload)
    fastdata.convert(small_tree, url, shard_size="8kB", progress=False, workers=0)
    shard_uploads = [(n, k) for n, k in count_uploads if n.startswith("shard-")]
    assert len(shard_uploads) >= 6
    assert max(k for _, k in shard_uploads) <= MAX_WAITING + 1
    assert max(k for _, k in shard_uploads) >= 2  # the converter did run ahead of the uploads


def test_write_dicts_to_s3_round_trips(s3, tmp_path):
    _, bucket = s3
    url = f"{bucket}/dicts.hdf5"
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal(5).astype(np.float32), "label": i % 3, "name": f"s{i}"} for i in range(40)]
    report = fastdata.write(samples, url, shard_size="2kB", workers=0, progress=False)
    assert report.dst == url
    ds = fastdata.open_dataset(url)
    assert len(ds) == 40
    for i in (0, 17, 39):
        got = ds[i]
        np.testing.assert_array_equal(np.asarray(got["x"]), samples[i]["x"])
        assert got["label"] == samples[i]["label"] and got["name"] == samples[i]["name"]
    assert len(remote_manifest(url)["shards"]) > 1
    # an iterable (written as it comes, not resumable) uploads the same way
    fastdata.write(iter(samples), f"{bucket}/iter.lmdb", shard_size="2kB", workers=0, progress=False)
    it = fastdata.open_dataset(f"{bucket}/iter.lmdb")
    assert len(it) == 40 and it[39]["name"] == "s39"


def test_no_manifest_is_visible_before_the_last_upload(s3, small_tree, monkeypatch):
    _, bucket = s3
    url = f"{bucket}/late.lmdb"
    seen: list[tuple[str, bool, bool]] = []
    real = publish_mod.upload_checked

    def watching(location, local_path, name):
        listing = objects(url)
        seen.append((name, "manifest.json" in listing, any(n.startswith(STAGING_DIR) for n in listing)))
        return real(location, local_path, name)

    monkeypatch.setattr(publish_mod, "upload_checked", watching)
    fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    assert [n for n, _, _ in seen][-1] == "manifest.json"
    assert not any(has_manifest for _, has_manifest, _ in seen)
    # while shards were uploading, the URL read as an unfinished conversion
    assert all(staging for name, _, staging in seen if name.startswith("shard-"))


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_a_damaged_upload_is_caught_and_nothing_is_published(s3, small_tree, monkeypatch, tmp_path, damage):
    _, bucket = s3
    url = f"{bucket}/damaged.lmdb"
    # the damage happens on the way: in the PUT itself, below fastdata's upload and its check
    # (the filesystem the converter uploads with is this one: RemoteLocation.filesystem is one a process)
    fs = RemoteLocation(url).filesystem()
    real = fs.put_file

    def damaging(local_path, path, **kwargs):
        if not os.path.basename(path).startswith("shard-00001"):
            return real(local_path, path, **kwargs)
        data = Path(local_path).read_bytes()
        bad = tmp_path / "bad"
        bad.write_bytes(data[:-100] if damage == "truncated" else data[:-1] + bytes([data[-1] ^ 1]))
        return real(str(bad), path, **kwargs)

    monkeypatch.setattr(fs, "put_file", damaging)
    with pytest.raises(RemoteStoreError, match=r"shard-00001\.lmdb: the uploaded object does not match") as err:
        fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    assert ("bytes" if damage == "truncated" else "ETag") in str(err.value)
    assert "manifest.json" not in objects(url)
    assert f"{STAGING_DIR}/shard-00001.lmdb.json" not in objects(url)  # never recorded as uploaded
    with pytest.raises(IncompleteStoreError, match="unfinished conversion"):
        fastdata.open_dataset(url)
    # the next run re-uploads it and publishes
    monkeypatch.setattr(fs, "put_file", real)
    fastdata.convert(small_tree, url, progress=False, workers=1, resume=True)
    assert len(fastdata.open_dataset(url)) == 24


def test_multipart_etag_is_checked(s3, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv("FASTDATA_UPLOAD_PART_SIZE", str(5 << 20))
    path = tmp_path / "blob"
    path.write_bytes(np.random.default_rng(1).bytes((12 << 20) + 123))
    want = expected_etag(str(path), 5 << 20)
    assert want.endswith("-3")
    loc = RemoteLocation(f"{bucket}/x")
    publish_mod.upload_checked(loc, str(path), "blob")  # the server's composite ETag matches ours
    monkeypatch.setattr(publish_mod, "expected_etag", lambda p, part: "0" * 32 + "-3")
    with pytest.raises(RemoteStoreError, match="ETag"):
        publish_mod.upload_checked(loc, str(path), "blob")


def test_existing_store_and_overwrite(s3, small_tree, jpeg_tree, tmp_path, monkeypatch):
    _, bucket = s3
    url = f"{bucket}/ow.lmdb"
    fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    with pytest.raises(StoreExistsError, match=f"{url} already holds a fastdata store; pass overwrite=True"):
        fastdata.convert(small_tree, url, progress=False, workers=1)
    other = jpeg_tree(tmp_path / "other", classes={"a": 2, "b": 1})
    removed: list[list[str]] = []
    real = RemoteLocation.remove

    def recording(self, names):
        removed.append(list(names))
        return real(self, names)

    monkeypatch.setattr(RemoteLocation, "remove", recording)
    fastdata.convert(other, url, progress=False, workers=1, overwrite=True)
    assert removed[0] == ["manifest.json"]  # unpublished first
    ds = fastdata.open_dataset(url)
    assert len(ds) == 3 and ds.classes == ["a", "b"]
    assert fastdata.convert(other, url, progress=False, workers=1, resume=True).already_complete
    assert sorted(n for n in objects(url) if n.startswith("shard-")) == ["shard-00000.lmdb"]  # old shards gone


def test_foreign_objects_https_and_remote_source_are_refused(s3, small_tree, tmp_path):
    _, bucket = s3
    RemoteLocation(f"{bucket}/mixed.lmdb").write_bytes("notes.txt", b"hi")
    with pytest.raises(StoreExistsError, match="not part of a fastdata store.*notes.txt"):
        fastdata.convert(small_tree, f"{bucket}/mixed.lmdb", progress=False)
    with pytest.raises(RemoteStoreError, match="read-only"):
        fastdata.convert(small_tree, "https://example.invalid/x.lmdb", progress=False)
    with pytest.raises(RemotePathError, match="read from a local or mounted filesystem"):
        fastdata.convert(f"{bucket}/vols/a.nii.gz", str(tmp_path / "x.lmdb"), progress=False)
    with pytest.raises(ValueError, match="URL destination or source only"):
        fastdata.convert(small_tree, str(tmp_path / "y.lmdb"), storage_options={"anon": True}, progress=False)
    cli = subprocess.run([sys.executable, "-m", "fastdata", "convert", f"{bucket}/vols/a.nii.gz",
                          str(tmp_path / "z.lmdb")], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and "read from a local or mounted filesystem" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_killed_upload_resumes_without_reuploading(s3, jpeg_tree, tmp_path, count_uploads, monkeypatch):
    server, bucket = s3
    src = jpeg_tree(tmp_path / "src", classes={"a": 20, "b": 20}, size=(64, 48))
    url = f"{bucket}/killed.lmdb"
    staging = tmp_path / "staging"
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1")
    cmd = [sys.executable, "-m", "fastdata", "convert", src, url, "--shard-size", "8kB", "--workers", "1",
           "--staging-dir", str(staging)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    loc = RemoteLocation(url)
    with reaped(proc):
        # killed once a shard's upload is checked and recorded in the remote staging
        while not any(n.endswith(".json") and n.startswith(f"{STAGING_DIR}/shard-") for n in loc.listing()):
            if proc.poll() is not None:
                pytest.fail(f"the converter finished before it could be killed: {proc.communicate()}")
        proc.kill()
        proc.wait(10)
    listing = loc.listing()
    assert "manifest.json" not in listing
    with pytest.raises(IncompleteStoreError, match="unfinished conversion"):
        fastdata.open_dataset(url)
    with pytest.raises(StoreExistsError, match="unfinished conversion; pass resume=True"):
        fastdata.convert(src, url, progress=False)
    kept = sorted(n[len(STAGING_DIR) + 1:-5] for n in listing if n.startswith(f"{STAGING_DIR}/shard-")
                  and n.endswith(".json"))
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    report = fastdata.convert(src, url, workers=1, progress=False, resume=True, staging_dir=staging)
    assert report.resumed_shards == len(kept) > 0 and "kept from the interrupted run" in report.summary()
    uploaded = [n for n, _ in count_uploads]
    assert uploaded and not set(kept) & set(uploaded)  # the uploaded shards were not uploaded again
    assert uploaded[-1] == "manifest.json"
    clean = str(tmp_path / "clean.lmdb")
    fastdata.convert(src, clean, shard_size="8kB", progress=False, workers=1)
    same_samples(url, clean)
    assert [(s["name"], s["xxh"]) for s in remote_manifest(url)["shards"]] == \
        [(s["name"], s["xxh"]) for s in json.loads(Path(clean, "manifest.json").read_text())["shards"]]


def test_resume_with_other_options_is_refused(s3, small_tree, monkeypatch):
    _, bucket = s3
    url = f"{bucket}/opts.lmdb"
    real = publish_mod.upload_checked

    def failing(location, local_path, name):
        if name.startswith("shard-00001"):
            raise RemoteStoreError("simulated network failure")
        return real(location, local_path, name)

    monkeypatch.setattr(publish_mod, "upload_checked", failing)
    with pytest.raises(RemoteStoreError, match="simulated"):
        fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    monkeypatch.setattr(publish_mod, "upload_checked", real)
    with pytest.raises(ResumeMismatchError, match=f"cannot resume {url}: shard size"):
        fastdata.convert(small_tree, url, shard_size="40kB", progress=False, workers=1, resume=True)
    report = fastdata.convert(small_tree, url, progress=False, workers=1, resume=True)
    assert report.resumed_shards == 1 and len(fastdata.open_dataset(url)) == 24


@pytest.mark.timeout(300)
def test_two_ranks_upload_their_shards_and_rank0_publishes(s3, jpeg_tree, tmp_path, monkeypatch):
    from helpers.procs import torchrun

    _, bucket = s3
    src = jpeg_tree(tmp_path / "src", classes={"a": 14, "b": 12, "c": 10}, size=(96, 72))
    url = f"{bucket}/ranks.lmdb"
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    torchrun("convert", str(src), url, "--shard-size", "40KB", "--workers", "1", "--quiet",
             "--staging-dir", str(tmp_path / "staging"))
    clean = str(tmp_path / "one.lmdb")
    fastdata.convert(src, clean, shard_size="40KB", progress=False, workers=1)
    ref = json.loads(Path(clean, "manifest.json").read_text())
    assert len(ref["shards"]) >= 4, "the test needs several shards so both ranks write some"
    assert [(s["name"], s["xxh"]) for s in remote_manifest(url)["shards"]] == \
        [(s["name"], s["xxh"]) for s in ref["shards"]]
    same_samples(url, clean)
    assert not [n for n in objects(url) if n.startswith(STAGING_DIR)]
    # each rank staged its own shards locally (and removed them once uploaded)
    assert sorted(os.listdir(tmp_path / "staging")) == []


def test_jsonl_list_and_coco_convert_to_s3_like_locally(s3, tmp_path, monkeypatch):
    from helpers.lists import jsonl_rows, write_list

    from fastdata.cli.main import main
    from fastdata.synth_coco import make_coco

    _, bucket = s3
    lst = write_list(tmp_path, jsonl_rows(12))
    local, url = str(tmp_path / "rows.lmdb"), f"{bucket}/rows.lmdb"
    fastdata.convert(lst, local, shard_size="2kB", progress=False, workers=1)
    fastdata.convert(lst, url, shard_size="2kB", progress=False, workers=1)
    man, ref = remote_manifest(url), json.loads(Path(local, "manifest.json").read_text())
    assert len(man["shards"]) > 1
    for key in ("shards", "class_counts", "classes", "class_tables"):
        assert man[key] == ref[key], key
    coco = make_coco(tmp_path / "coco", 10, seed=3, max_boxes=3)
    coco_local, coco_url = str(tmp_path / "coco.h5"), f"{bucket}/coco.h5"
    fastdata.convert_coco(coco.ann_file, coco.image_dir, coco_local, workers=1, progress=False)
    assert main(["convert", "--coco", coco.ann_file, coco.image_dir, coco_url, "--workers", "1", "--quiet"]) == 0
    assert [(s["name"], s["xxh"]) for s in remote_manifest(coco_url)["shards"]] == \
        [(s["name"], s["xxh"]) for s in json.loads(Path(coco_local, "manifest.json").read_text())["shards"]]
    ds, ref_ds = fastdata.open_dataset(coco_url), fastdata.open_dataset(coco_local)
    assert len(ds) == len(ref_ds) == 10


# Nightly: the ranks' kill-and-resume is tested locally in CI (tests/writer/test_distributed.py) and a
# killed upload's resume on one rank here (test_killed_upload_resumes_without_reuploading); ranks and a
# single process go through the same write session.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_killed_then_resumed_keep_the_uploaded_shards(s3, jpeg_tree, tmp_path, monkeypatch):
    import signal

    import psutil
    from helpers.procs import torchrun

    _, bucket = s3
    src = jpeg_tree(tmp_path / "src", classes={"a": 20, "b": 20, "c": 16}, size=(96, 72))
    url = f"{bucket}/ranks-resume.lmdb"
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    args = ("convert", str(src), url, "--shard-size", "30KB", "--workers", "1", "--quiet")
    proc = torchrun(*args, wait=False)
    loc = RemoteLocation(url)

    def recorded() -> set[str]:
        return {n for n in loc.listing() if n.startswith(f"{STAGING_DIR}/shard-") and n.endswith(".json")}

    with reaped(proc):
        while proc.poll() is None and len(recorded()) < 2:
            pass  # polling the server for the second uploaded shard, not waiting for an outcome
        if proc.poll() is not None:
            pytest.fail(f"the conversion finished before it could be killed: {proc.communicate()}")
        victims = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        for victim in victims:  # torchrun starts its workers in their own sessions: kill the whole tree
            try:
                victim.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
        proc.communicate(timeout=30)
    kept = recorded()
    assert "manifest.json" not in loc.listing() and len(kept) >= 2
    resumed = torchrun(*[a for a in args if a != "--quiet"], "--resume")
    assert f"{len(kept)} kept from the interrupted run" in resumed.stdout  # those were not converted again
    clean = str(tmp_path / "one.lmdb")
    fastdata.convert(src, clean, shard_size="30KB", progress=False, workers=1)
    assert [(s["name"], s["xxh"]) for s in remote_manifest(url)["shards"]] == \
        [(s["name"], s["xxh"]) for s in json.loads(Path(clean, "manifest.json").read_text())["shards"]]
    same_samples(url, clean)


def test_the_lock_object_refuses_a_live_writer_and_is_taken_over_from_a_dead_one(s3, small_tree, monkeypatch):
    import socket
    import time

    from fastdata.errors import StoreLockedError

    _, bucket = s3
    url = f"{bucket}/locked.lmdb"
    loc = RemoteLocation(url)

    def lock(pid: int, host: str, age: float) -> None:
        body = {"host": host, "pid": pid, "job": f"other:{pid}", "time": time.time() - age}
        loc.write_bytes(".fastdata.lock", json.dumps(body).encode())

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with reaped(live):
        lock(live.pid, socket.gethostname(), 5)
        with pytest.raises(StoreLockedError, match=rf"{url} is being written by pid {live.pid} on "):
            fastdata.convert(small_tree, url, progress=False, workers=1)
        lock(live.pid, "other-host", 5)  # a run on another machine: its pid cannot be checked from here
        with pytest.raises(StoreLockedError, match="delete .*/locked.lmdb/.fastdata.lock"):
            fastdata.convert(small_tree, url, progress=False, workers=1, overwrite=True)
    lock(live.pid, "other-host", 2 * 3600)  # not renewed for two hours: gone
    seen: list[bool] = []
    real = publish_mod.upload_checked

    def watching(location, local_path, name):
        seen.append(".fastdata.lock" in objects(url))
        return real(location, local_path, name)

    monkeypatch.setattr(publish_mod, "upload_checked", watching)
    report = fastdata.convert(small_tree, url, shard_size="20kB", progress=False, workers=1)
    assert any(f"took over the lock object {url}/.fastdata.lock of pid {live.pid} on other-host" in w
               for w in report.warnings)
    assert seen and all(seen)  # held while uploading
    assert ".fastdata.lock" not in objects(url)  # released at the end
    live.wait()
    lock(live.pid, socket.gethostname(), 5)  # a killed run on this machine: taken over at once
    assert fastdata.convert(small_tree, url, progress=False, workers=1, overwrite=True).images == 24
