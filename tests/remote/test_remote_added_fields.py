"""Added fields of a store read from S3 (SeaweedFS): each field file downloaded whole into the
cache and checked against the manifest; verify checks the server's copies."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_remote_read import upload_store

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.format.added import FIELD_FILES_KEY
from fastdata.format.manifest import read_manifest
from fastdata.remote.location import RemoteLocation
from helpers.backends import SUFFIXES
from helpers.procs import cli_in_process


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_added_fields_read_from_s3(s3, tmp_path, suffix):
    _server, bucket = s3
    local = str(tmp_path / f"s{suffix}")
    n = 24
    fastdata.write([{"x": float(i)} for i in range(n)], local, shard_size=300, progress=False)
    emb = np.random.default_rng(0).random((n, 8)).astype(np.float16)
    fastdata.add_fields(local, {"emb": emb, "tag": [f"t{i}" for i in range(n)]})
    url = f"{bucket}/s{suffix}"
    upload_store(local, url)
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.column("emb"), emb)
    assert [ds[i]["tag"] for i in (0, n - 1)] == ["t0", f"t{n - 1}"]
    assert fastdata.verify(url).ok
    assert [f["name"] for f in fastdata.info(url)["added_fields"]] == ["emb", "tag"]
    # a field file changed on the server: refused when downloaded (cache of another version: fresh)
    name = read_manifest(local)["shards"][-1][FIELD_FILES_KEY][0]["name"]
    path = os.path.join(local, name)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    RemoteLocation(url).upload(path, name)
    report = fastdata.verify(url)
    assert not report.ok and any(name in p for p in report.problems)
    with pytest.raises(CorruptRecordError, match="do not match the manifest's size"):
        fastdata.open_dataset(url, cache_dir=str(tmp_path / "fresh-cache"))


def test_add_fields_to_a_store_on_s3(s3, tmp_path, monkeypatch, capsys):
    server, bucket = s3
    local = str(tmp_path / "s.lmdb")
    n = 24
    fastdata.write([{"x": float(i)} for i in range(n)], local, shard_size=300, progress=False)
    url = f"{bucket}/s.lmdb"
    upload_store(local, url)
    loc = RemoteLocation(url)
    shards = {s["name"]: loc.read_bytes(s["name"]) for s in read_manifest(local)["shards"]}
    before = fastdata.open_dataset(url)
    before[3]
    score = np.arange(n, dtype=np.float32) / 2
    fastdata.add_fields(url, {"score": score, "tag": [f"t{i}" for i in range(n)]})
    assert all(loc.read_bytes(name) == data for name, data in shards.items())  # no shard object rewritten
    assert before.columns() == ("x",) and before[n - 1] == {"x": float(n - 1)}  # its version
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.column("score"), score)
    assert ds[5]["tag"] == "t5"
    assert fastdata.verify(url).ok
    assert not loc.size(".fastdata.lock")  # the lock object is gone
    with pytest.raises(fastdata.errors.FastdataError, match="field 'score' was added already"):
        fastdata.add_fields(url, {"score": score})
    # the command line's rename and drop, the endpoint given as a storage option (not in the environment)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    option = ("--storage-option", f"endpoint_url={server.endpoint}")
    assert cli_in_process(capsys, "rename-field", url, "score", "half", *option).returncode == 0
    done = cli_in_process(capsys, "drop-fields", url, "tag", *option)
    assert done.returncode == 0 and "dropped tag" in done.stdout, done.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    ds = fastdata.open_dataset(url)
    assert ds.columns() == ("x", "half") and set(ds[2]) == {"x", "half"}
    np.testing.assert_array_equal(ds.column("half"), score)
    assert fastdata.verify(url).ok
    fastdata.write([{"x": 1.0}], url, overwrite=True, progress=False)  # field objects are the store's
    assert not [n for n in loc.listing() if n.startswith("fields-")]


def test_append_to_a_store_on_s3_with_added_fields(s3, tmp_path):
    """The appended shards' field files are uploaded (checked) before the manifest; a new append
    first deletes field objects an interrupted one left beside shards no manifest lists."""
    _server, bucket = s3
    n, m = 10, 5
    url = f"{bucket}/grow.lmdb"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=300, progress=False, workers=0)
    fastdata.add_fields(url, {"score": np.arange(n, dtype=np.float32), "tag": [f"t{i}" for i in range(n)]},
                        defaults={"tag": "new"})
    loc = RemoteLocation(url)
    stale = "fields-00001.shard-00099.lmdb.fdf"
    loc.write_bytes(stale, b"left by a killed append")
    before = fastdata.open_dataset(url)
    with pytest.raises(fastdata.errors.FastdataError, match=r"added field\(s\) score without a default"):
        fastdata.write([{"x": float(i)} for i in range(n, n + m)], url, append=True, progress=False, workers=0)
    fastdata.write([{"x": float(i)} for i in range(n, n + m)], url, append=True, progress=False, workers=0,
                   added_values={"score": np.arange(n, n + m, dtype=np.float32)})
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.column("score"), np.arange(n + m, dtype=np.float32))
    assert [ds[i]["tag"] for i in (n - 1, n, n + m - 1)] == [f"t{n - 1}", "new", "new"]
    assert fastdata.verify(url).ok
    assert len(before) == n and before[n - 1]["tag"] == f"t{n - 1}"  # its version
    objects = loc.listing()
    manifest = json.loads(loc.read_bytes("manifest.json"))
    listed = {e["name"] for s in manifest["shards"] for e in s["field_files"]}
    assert {k for k in objects if k.startswith("fields-")} == listed  # the stale one deleted, the new uploaded


def test_merge_of_stores_on_s3_with_added_fields(s3, tmp_path):
    """Inputs with the same added fields in other generations: each merged shard gets one field
    file of generation 1 (the inputs' files downloaded and checked, the new one uploaded and
    checked before the manifest); defaults are carried."""
    _server, bucket = s3
    n = 6
    a, b, out = f"{bucket}/a.h5", f"{bucket}/b.h5", f"{bucket}/ab.h5"
    for url, first in ((a, 0), (b, n)):
        fastdata.write([{"x": float(i)} for i in range(first, first + n)], url, shard_size=300, progress=False,
                       workers=0)
    fastdata.add_fields(a, {"score": np.arange(n, dtype=np.float32)})
    fastdata.add_fields(a, {"tag": [f"t{i}" for i in range(n)]}, defaults={"tag": ""})  # two generations
    fastdata.add_fields(b, {"score": np.arange(n, 2 * n, dtype=np.float32),
                            "tag": [f"t{i}" for i in range(n, 2 * n)]})
    report = fastdata.merge([a, b], out)
    assert report.samples == 2 * n
    ds = fastdata.open_dataset(out)
    np.testing.assert_array_equal(ds.column("score"), np.arange(2 * n, dtype=np.float32))
    assert [ds[i]["tag"] for i in (0, n - 1, n, 2 * n - 1)] == ["t0", f"t{n - 1}", f"t{n}", f"t{2 * n - 1}"]
    assert fastdata.verify(out).ok
    manifest = json.loads(RemoteLocation(out).read_bytes("manifest.json"))
    assert {e["generation"] for s in manifest["shards"] for e in s["field_files"]} == {1}
    assert [f.get("default") for f in manifest["added_fields"]] == [None, ""]  # the first input's fields
    fastdata.add_fields(b, {"other": np.zeros(n)})
    with pytest.raises(fastdata.errors.FastdataError, match="a merge needs the same added fields"):
        fastdata.merge([a, b], f"{bucket}/ab2.h5")


def test_compute_fields_over_a_store_on_s3(s3, tmp_path):
    """The function runs over the version opened (read through the cache); its values are added
    under the store's lock object, the samples it raises on skipped and listed (on_error="skip")."""
    _server, bucket = s3
    n = 12
    url = f"{bucket}/c.lmdb"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=300, progress=False, workers=0)

    def fn(batch):
        if (batch["x"] == 7).any():
            raise RuntimeError("no")
        return {"double": batch["x"] * 2}

    with pytest.raises(fastdata.errors.FastdataError, match="cannot resume: nothing to resume"):
        fastdata.compute_fields(url, fn, resume=True, staging_dir=str(tmp_path / "staging"))
    with pytest.warns(fastdata.tools.compute.ComputeFieldsWarning, match="skipped 1 sample"):
        m = fastdata.compute_fields(url, fn, batch_size=4, num_workers=0, on_error="skip",
                                    defaults={"double": -1.0}, cache_dir=str(tmp_path / "cache"))
    assert m["options"]["field_history"][-1]["skipped"] == [[7, "RuntimeError: no"]]
    ds = fastdata.open_dataset(url)
    want = np.arange(n) * 2.0
    want[7] = -1.0
    np.testing.assert_array_equal(ds.column("double"), want)
    assert fastdata.verify(url).ok


_KILLED_URL_APPEND = """
import os, signal, sys
import numpy as np
import fastdata
import fastdata.writer.remote_sink as sink

upload = sink.upload_checked

def killed_at_the_manifest(location, path, name):  # the new field files are uploaded; the manifest is not
    if name == "manifest.json":
        os.kill(os.getpid(), signal.SIGKILL)
    upload(location, path, name)

sink.upload_checked = killed_at_the_manifest
fastdata.write([{"x": float(i)} for i in range(10, 15)], sys.argv[1], append=True, progress=False, workers=0,
               staging_dir=sys.argv[2], added_values={"score": np.arange(10, 15, dtype=np.float32)})
"""


@pytest.mark.slow
def test_sigkill_during_an_s3_append_with_added_fields_then_resume(s3, tmp_path):
    import subprocess
    import sys

    _server, bucket = s3
    n = 10
    url = f"{bucket}/killed.lmdb"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=300, progress=False, workers=0)
    fastdata.add_fields(url, {"score": np.arange(n, dtype=np.float32)})
    loc = RemoteLocation(url)
    published = loc.read_bytes("manifest.json")
    staging = str(tmp_path / "staging")
    proc = subprocess.run([sys.executable, "-c", _KILLED_URL_APPEND, url, staging], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    listed = {e["name"] for s in json.loads(published)["shards"] for e in s["field_files"]}
    assert {k for k in loc.listing() if k.startswith("fields-")} - listed  # uploaded, listed by no manifest
    assert loc.read_bytes("manifest.json") == published
    assert len(fastdata.open_dataset(url)) == n and fastdata.verify(url).ok
    fastdata.write([{"x": float(i)} for i in range(n, n + 5)], url, append=True, resume=True, progress=False,
                   workers=0, staging_dir=staging, added_values={"score": np.arange(n, n + 5, dtype=np.float32)})
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.column("score"), np.arange(n + 5, dtype=np.float32))
    assert fastdata.verify(url).ok
    manifest = json.loads(loc.read_bytes("manifest.json"))
    assert {k for k in loc.listing() if k.startswith("fields-")} == {
        e["name"] for s in manifest["shards"] for e in s["field_files"]}


def test_gc_of_a_store_on_s3_removes_only_unlisted_field_files(s3, tmp_path, capsys):
    _server, bucket = s3
    n = 12
    url = f"{bucket}/gc.lmdb"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=200, progress=False, workers=0)
    fastdata.add_fields(url, {"a": np.arange(n, dtype=np.int32)})  # generation 1
    fastdata.add_fields(url, {"b": [f"b{i}" for i in range(n)]})  # generation 2
    fastdata.drop_fields(url, ["a"])
    loc = RemoteLocation(url)
    live = {e["name"] for s in json.loads(loc.read_bytes("manifest.json"))["shards"] for e in s["field_files"]}
    gen1 = {k for k in loc.listing() if k.startswith("fields-00001.")}
    assert gen1 and not gen1 & live  # the dropped generation's files are still on the server (control)
    leftover = "fields-00009." + sorted(live)[0].split(".", 1)[1]  # what a killed add would leave
    loc.write_bytes(leftover, b"left by a killed add")
    done = cli_in_process(capsys, "gc", url)
    assert done.returncode == 0 and f"removed {len(gen1) + 1} field file(s)" in done.stdout, done.stderr
    assert {k for k in loc.listing() if k.startswith("fields-")} == live  # every listed file kept
    assert fastdata.gc(url) == []
    ds = fastdata.open_dataset(url)
    assert ds.columns() == ("x",) and ds[n - 1]["b"] == f"b{n - 1}"
    assert fastdata.verify(url).ok


def test_chunked_field_added_to_a_store_on_s3_read_by_region(s3):
    _server, bucket = s3
    n = 6
    url = f"{bucket}/chunked.h5"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=60, progress=False, workers=0)
    rng = np.random.default_rng(0)
    masks = [rng.integers(0, 3, size=(6, 5 + i, 7)).astype(np.uint16) for i in range(n)]
    fastdata.add_fields(url, {"mask": masks}, fields={"mask": fastdata.fields.Chunked("uint16", (4, 4, 4))})
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.array_shapes("mask"), [m.shape for m in masks])
    value = ds[n - 1]["mask"]
    np.testing.assert_array_equal(value[4:, 1:3], masks[n - 1][4:, 1:3])
    assert value.chunks_read == 2
    assert fastdata.verify(url).ok


_KILLED_URL_ADD = """
import os, signal, sys
import numpy as np
import fastdata
import fastdata.writer.remote_sink as sink

upload = sink.upload_checked
fields = []

def killed_at_the_second_field_file(location, path, name):  # one field file uploaded, then killed
    if name.startswith("fields-"):
        fields.append(name)
        if len(fields) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    upload(location, path, name)

sink.upload_checked = killed_at_the_second_field_file
fastdata.add_fields(sys.argv[1], {"emb": np.load(sys.argv[2]), "tag": [f"t{i}" for i in range(12)]})
"""


@pytest.mark.slow
def test_sigkill_during_an_s3_add_then_resume_equals_an_uninterrupted_add(s3, tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    import fastdata.writer.remote_sink as sink

    _server, bucket = s3
    n = 12
    local = str(tmp_path / "s.lmdb")
    fastdata.write([{"x": float(i)} for i in range(n)], local, shard_size=60, progress=False, workers=0)
    assert len(read_manifest(local)["shards"]) >= 3
    url, clean = f"{bucket}/killed.lmdb", f"{bucket}/clean.lmdb"
    upload_store(local, url)
    upload_store(local, clean)
    emb = np.random.default_rng(0).random((n, 4)).astype(np.float16)
    np.save(tmp_path / "emb.npy", emb)
    values = {"emb": emb, "tag": [f"t{i}" for i in range(n)]}
    loc = RemoteLocation(url)
    before = loc.read_bytes("manifest.json")
    proc = subprocess.run([sys.executable, "-c", _KILLED_URL_ADD, url, str(tmp_path / "emb.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert loc.read_bytes("manifest.json") == before and fastdata.verify(url).ok  # the previous version
    left = [k for k in loc.listing() if k.startswith("fields-")]
    assert len(left) == 1
    uploaded: list[str] = []
    upload = sink.upload_checked

    def counted(location, path, name):
        uploaded.append(name)
        upload(location, path, name)

    monkeypatch.setattr(sink, "upload_checked", counted)
    fastdata.add_fields(url, values, resume=True)
    assert left[0] not in uploaded and "manifest.json" in uploaded  # the object it had uploaded: kept
    fastdata.add_fields(clean, values)  # uninterrupted
    a, b = (json.loads(RemoteLocation(u).read_bytes("manifest.json")) for u in (url, clean))
    assert a["shards"] == b["shards"]
    assert [{**f, "added": ""} for f in a["added_fields"]] == [{**f, "added": ""} for f in b["added_fields"]]
    for s in a["shards"]:
        for e in s["field_files"]:
            assert loc.read_bytes(e["name"]) == RemoteLocation(clean).read_bytes(e["name"])
    ds = fastdata.open_dataset(url)
    np.testing.assert_array_equal(ds.column("emb"), emb)
    assert fastdata.verify(url).ok
    uploaded.clear()
    assert fastdata.add_fields(url, values, resume=True)["checksum"] == a["checksum"]  # published: nothing done
    assert uploaded == []


def test_compute_fields_over_a_store_on_s3_interrupted_then_resumed(s3, tmp_path):
    """An interrupted run over a store at a URL leaves its version; resume=True computes only the
    shards not staged (locally), then uploads every field file and the manifest."""
    _server, bucket = s3
    n = 12
    url = f"{bucket}/r.lmdb"
    fastdata.write([{"x": float(i)} for i in range(n)], url, shard_size=60, progress=False, workers=0)
    shards = json.loads(RemoteLocation(url).read_bytes("manifest.json"))["shards"]
    assert len(shards) >= 3
    staging = str(tmp_path / "staging")
    seen: list[float] = []

    def stops(batch):
        seen.extend(batch["x"].tolist())
        if len(seen) > shards[0]["count"]:
            raise KeyboardInterrupt  # Ctrl-C once the first shard is staged
        return {"double": batch["x"] * 2}

    with pytest.raises(KeyboardInterrupt):
        fastdata.compute_fields(url, stops, batch_size=shards[0]["count"], num_workers=0, staging_dir=staging)
    assert fastdata.open_dataset(url).columns() == ("x",)  # the previous version, nothing uploaded
    assert not [k for k in RemoteLocation(url).listing() if k.startswith("fields-")]
    again: list[float] = []

    def counts(batch):
        again.extend(batch["x"].tolist())
        return {"double": batch["x"] * 2}

    fastdata.compute_fields(url, counts, batch_size=4, num_workers=0, resume=True, staging_dir=staging)
    assert len(again) == n - shards[0]["count"]  # the staged shard was not computed again
    np.testing.assert_array_equal(fastdata.open_dataset(url).column("double"), np.arange(n) * 2.0)
    assert fastdata.verify(url).ok
    assert not os.path.exists(os.path.join(staging, "run"))  # the run's staging: removed once published


_KILLED_URL_COMPUTE = """
import os, signal, sys
import fastdata

def fn(batch):
    if float(batch["x"].max()) >= 8:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"double": batch["x"] * 2}

fastdata.compute_fields(sys.argv[1], fn, batch_size=4, num_workers=0, staging_dir=sys.argv[2])
"""


@pytest.mark.slow
def test_sigkill_during_compute_fields_on_s3_then_resume_equals_an_uninterrupted_run(s3, tmp_path):
    import signal
    import subprocess
    import sys

    _server, bucket = s3
    n = 12
    local = str(tmp_path / "s.lmdb")
    fastdata.write([{"x": float(i)} for i in range(n)], local, shard_size=60, progress=False, workers=0)
    url, clean = f"{bucket}/killed.lmdb", f"{bucket}/clean.lmdb"
    upload_store(local, url)
    upload_store(local, clean)
    staging = str(tmp_path / "staging")
    proc = subprocess.run([sys.executable, "-c", _KILLED_URL_COMPUTE, url, staging], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert fastdata.open_dataset(url).columns() == ("x",) and fastdata.verify(url).ok
    fastdata.compute_fields(url, lambda b: {"double": b["x"] * 2}, batch_size=4, num_workers=0, resume=True,
                            staging_dir=staging)
    fastdata.compute_fields(clean, lambda b: {"double": b["x"] * 2}, batch_size=4, num_workers=0)
    a, b = (json.loads(RemoteLocation(u).read_bytes("manifest.json")) for u in (url, clean))
    assert a["shards"] == b["shards"]
    for s in a["shards"]:
        for e in s["field_files"]:
            assert RemoteLocation(url).read_bytes(e["name"]) == RemoteLocation(clean).read_bytes(e["name"])
    np.testing.assert_array_equal(fastdata.open_dataset(url).column("double"), np.arange(n) * 2.0)
