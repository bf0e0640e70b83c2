"""WebDataset tar shards, NIfTI volumes and DICOM folders at a URL, on a real S3-compatible server
(SeaweedFS, tests/helpers/s3server.py): each converts to the store its local copy converts to
(same shards, checksums and records), an input changed or deleted after planning stops the run
naming it (nothing published), an interrupted run resumes, errors are one line; a tar several
times larger than the remote reader's block converts with the bytes buffered held to that block."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers.native import dicom_tree
from helpers.nifti import affine_of, label_of, volume, write_nifti
from helpers.procs import cli_in_process
from helpers.samples import jpeg

import fastdata
from fastdata.errors import SourceError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.remote.location import RemoteLocation, SourceChangedError


def upload_tree(local: str | Path, url: str) -> None:
    """Every file under ``local`` to ``url``/<its relative path>."""
    loc = RemoteLocation(url)
    paths = [os.path.join(root, name) for root, _, files in os.walk(local) for name in files]
    targets = [loc.child(os.path.relpath(p, local).replace(os.sep, "/")).split("://", 1)[1] for p in paths]
    loc.filesystem().put(paths, targets)


def same_records(a: str | Path, b: str | Path) -> None:
    """``a`` and ``b`` hold the same shards (names, counts, checksums of the files), rejected input
    names and records (every field of every sample, decoded); each verifies."""
    ma, mb = read_manifest(str(a)), read_manifest(str(b))
    assert [(s["name"], s["count"], s["xxh"]) for s in ma["shards"]] == \
        [(s["name"], s["count"], s["xxh"]) for s in mb["shards"]]
    assert ma["num_samples"] == mb["num_samples"] and ma.get("metadata") == mb.get("metadata")

    def rejected(store):
        path = Path(store, "rejected.tsv")
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        return sorted(line.split("\t", 1)[0].rsplit("/", 1)[-1] + "\t" + line.rsplit("\t", 1)[-1] for line in lines)
    assert rejected(a) == rejected(b)
    da, db = fastdata.open_dataset(a, output="bytes"), fastdata.open_dataset(b, output="bytes")
    assert len(da) == len(db) == ma["num_samples"]
    for i in range(len(da)):
        assert repr(da[i]) == repr(db[i]), i
    assert fastdata.verify(str(a)).ok and fastdata.verify(str(b)).ok


DICOM_TAGS = ["RescaleSlope", "RescaleIntercept", "PixelSpacing"]


def same_values(a: str | Path, b: str | Path) -> None:
    """``a`` and ``b`` hold the same samples (every field decoded; chunked arrays read whole),
    classes, counts per shard and rejected inputs, each store verified: for sources whose records
    keep a local path in one and a URL in the other (DICOM), or whose chunk codec's bytes may
    differ from run to run (Blosc)."""
    ma, mb = read_manifest(str(a)), read_manifest(str(b))
    assert [s["count"] for s in ma["shards"]] == [s["count"] for s in mb["shards"]]
    assert ma["num_samples"] == mb["num_samples"] and ma.get("classes") == mb.get("classes")
    assert ma.get("class_tables") == mb.get("class_tables") and ma.get("metadata") == mb.get("metadata")

    def rejected(store):
        path = Path(store, "rejected.tsv")
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        return sorted(line.split("\t", 1)[0].rsplit("/", 2)[-1] for line in lines)
    assert rejected(a) == rejected(b)
    da, db = fastdata.open_dataset(a, output="numpy"), fastdata.open_dataset(b, output="numpy")
    assert len(da) == len(db) == ma["num_samples"]
    for i in range(len(da)):
        sa, sb = da[i], db[i]
        assert sorted(sa) == sorted(sb), i
        for key in sa:
            va, vb = sa[key], sb[key]
            if not isinstance(va, np.ndarray) and hasattr(va, "shape"):
                va, vb = va[...], vb[...]
            assert np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, np.ndarray) else va == vb, (i, key)
        assert da.relpath(i).rsplit("/", 2)[-2:] == db.relpath(i).rsplit("/", 2)[-2:]
    assert fastdata.verify(str(a)).ok and fastdata.verify(str(b)).ok


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def shard_members(first: int, count: int) -> list[tuple[str, bytes]]:
    """Samples ``first ..`` with an image, a class, a caption, JSON and an array; sample 5 has a
    corrupt image (rejected and reported, as locally)."""
    out = []
    for i in range(first, first + count):
        rng = np.random.default_rng(i)
        out += [(f"s/{i:05d}.jpg", jpeg(i) if i != 5 else b"\xff\xd8not a jpeg"),
                (f"s/{i:05d}.cls", str(i % 3).encode()),
                (f"s/{i:05d}.txt", f"caption {i}".encode()),
                (f"s/{i:05d}.json", json.dumps({"id": i}).encode()),
                (f"s/{i:05d}.npy", npy(rng.random((i % 3, 2)).astype(np.float32)))]
    return out


@pytest.fixture(scope="module")
def inputs(s3_server, tmp_path_factory):
    """Three small tar shards, NIfTI volumes and DICOM files locally and in a bucket, with their
    local conversions. Yields a namespace."""
    mp = pytest.MonkeyPatch()
    for key, value in s3_server.env().items():
        mp.setenv(key, value)
    mp.setenv("FASTDATA_REMOTE_RETRIES", "2")
    root = tmp_path_factory.mktemp("remote-tars")
    for t in range(3):
        write_tar(root / "data" / "shards" / f"train-{t:06d}.tar", shard_members(4 * t, 4))
    # NIfTI volumes in class folders (one nested, one compressed, one corrupt) and a DICOM class-folder tree
    write_nifti(root / "data" / "scans" / "a" / "v0.nii.gz", volume(0, (20, 18, 10)), affine_of(0))
    write_nifti(root / "data" / "scans" / "a" / "deep" / "v1.nii", volume(1, (20, 18, 10)), affine_of(1), slope=2.0)
    write_nifti(root / "data" / "scans" / "b" / "v2.nii", volume(2, (20, 18, 10)), affine_of(2))
    Path(root, "data", "scans", "b", "bad.nii").write_bytes(b"not a volume" * 40)
    dicom_tree(root / "data" / "dicom", {"lung": 2, "liver": 2})
    bucket = f"s3://{s3_server.take_bucket(f'rtars{os.getpid()}')}"
    upload_tree(root / "data", bucket)
    local = root / "local.lmdb"
    fastdata.convert(str(root / "data" / "shards"), local, shard_size="6kB", progress=False, workers=0)
    local_scans = root / "local-scans.lmdb"
    fastdata.convert(str(root / "data" / "scans"), local_scans, chunks=(8, 8, 8), progress=False, workers=0)
    local_dicom = root / "local-dicom.lmdb"
    fastdata.convert(str(root / "data" / "dicom"), local_dicom, dicom_tags=DICOM_TAGS, progress=False, workers=0)

    class NS:
        pass
    t = NS()
    t.server, t.bucket, t.root, t.local, t.shards = s3_server, bucket, root, local, f"{bucket}/shards"
    t.local_scans, t.scans, t.local_dicom, t.dicom = local_scans, f"{bucket}/scans", local_dicom, f"{bucket}/dicom"
    yield t
    mp.undo()


def test_remote_tars_convert_to_the_local_store(inputs, tmp_path, capsys):
    # a prefix holding .tar objects, told from an image folder by one listing page
    dst = tmp_path / "prefix.lmdb"
    report = fastdata.convert(f"{inputs.shards}/", dst, shard_size="6kB", progress=False, workers=2)
    assert report.rejected == 1 and len(read_manifest(str(dst))["shards"]) > 1
    same_records(inputs.local, dst)
    assert read_manifest(str(dst))["options"]["source"] == f"{inputs.shards}/"
    # a brace pattern through the CLI; a resume of the published store is complete
    braced = f"{inputs.shards}/train-{{000000..000002}}.tar"
    cli = cli_in_process(capsys, "convert", braced, str(tmp_path / "brace.lmdb"), "--shard-size", "6kB",
                         "--workers", "0")
    assert cli.returncode == 0, cli.stderr
    same_records(inputs.local, tmp_path / "brace.lmdb")
    again = fastdata.convert(fastdata.sources.WebDataset(braced), tmp_path / "brace.lmdb", shard_size="6kB",
                             progress=False, resume=True, workers=0)
    assert again.already_complete
    # a glob, and one tar against the local conversion of that tar
    fastdata.convert(f"{inputs.shards}/train-*.tar", tmp_path / "glob.lmdb", shard_size="6kB", progress=False,
                     workers=0)
    same_records(inputs.local, tmp_path / "glob.lmdb")
    one_local = tmp_path / "one-local.lmdb"
    fastdata.convert(str(inputs.root / "data" / "shards" / "train-000001.tar"), one_local, progress=False, workers=0)
    fastdata.convert(f"{inputs.shards}/train-000001.tar", tmp_path / "one.lmdb", progress=False, workers=0)
    same_records(one_local, tmp_path / "one.lmdb")
    # the same tar over plain HTTP (the test server answers anonymous GETs; ranges, ETags)
    http = f"{inputs.server.endpoint}/{inputs.shards.split('://')[1]}/train-000001.tar"
    fastdata.convert(http, tmp_path / "http.lmdb", progress=False, workers=0)
    same_records(one_local, tmp_path / "http.lmdb")


@pytest.mark.parametrize("how", ["rewritten", "deleted"])
def test_a_tar_changed_after_planning_stops_the_run_naming_it(inputs, tmp_path, how):
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession
    from fastdata.writer.sources.webdataset.remote import RemoteTarInput

    loc = RemoteLocation(inputs.shards)
    name = "train-000002.tar"
    original = loc.read_bytes(name)

    class Changing(RemoteTarInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            if how == "deleted":
                loc.remove([name])
            else:  # the same size, another ETag
                loc.write_bytes(name, original[:600] + bytes([original[600] ^ 0xFF]) + original[601:])
            return plans
    dst = tmp_path / "changed.lmdb"
    try:
        want = "the object changed" if how == "rewritten" else "the object was deleted"
        with pytest.raises(SourceChangedError, match=f"{inputs.shards}/{name}: {want}") as caught:
            WriteSession(Changing(inputs.shards), str(dst), WriteOptions(progress=False, workers=0,
                                                                         shard_size="6kB")).run()
        assert "\n" not in str(caught.value)
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists()


def test_remote_tar_errors_are_one_line(inputs, tmp_path, capsys):
    with pytest.raises(SourceError, match=r"train-000009\.tar does not exist \(2 of the 3"):
        fastdata.convert(f"{inputs.shards}/train-{{000001,000009,000008}}.tar", tmp_path / "a.lmdb",
                         progress=False, workers=0)
    with pytest.raises(SourceError, match="no file matches .*/val-"):
        fastdata.convert(f"{inputs.shards}/val-*.tar", tmp_path / "b.lmdb", progress=False, workers=0)
    with pytest.raises(SourceError, match=r"compressed tar.*gunzip"):
        fastdata.convert(f"{inputs.shards}/train-0.tar.gz", tmp_path / "c.lmdb", progress=False, workers=0)
    cli = cli_in_process(capsys, "convert", f"{inputs.shards}/gone.tar", str(tmp_path / "d.lmdb"))
    assert cli.returncode != 0 and "gone.tar does not exist" in cli.stderr and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


@pytest.mark.slow
def test_a_tar_larger_than_the_read_block_converts_with_one_block_buffered(inputs, tmp_path, monkeypatch):
    """The 24 MiB tar converts to its local store while the remote reads hold at most one 4 MiB
    block beside the member being read (measured: the largest reply and tracemalloc's peak of
    the whole in-process conversion, against the same conversion from the local file); a control
    with a block as large as the tar holds the whole tar."""
    from fastdata.remote import sources

    # 24 samples of one 1 MiB array each: several times the remote reader's 4 MiB block
    big = tmp_path / "big" / "big-0.tar"
    write_tar(big, [(f"b/{i:04d}.npy", npy(np.random.default_rng(i).integers(0, 255, (1 << 20) - 128,
                                                                               dtype=np.uint8))) for i in range(24)])
    RemoteLocation(f"{inputs.bucket}/big").filesystem().put(str(big), f"{inputs.bucket}/big/big-0.tar".split("://")[1])
    local = tmp_path / "big-local.lmdb"
    fastdata.convert(str(big), local, shard_size="2MB", task_size=2, progress=False, workers=0)
    replies: list[int] = []
    real_range = RemoteLocation.read_range

    def counted(self, name, start, end, **kwargs):
        data = real_range(self, name, start, end, **kwargs)
        replies.append(len(data))
        return data
    monkeypatch.setattr(RemoteLocation, "read_range", counted)

    def peak(src: str, dst: Path) -> int:
        tracemalloc.start()
        try:
            fastdata.convert(src, dst, shard_size="2MB", task_size=2, progress=False, workers=0)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    local_peak = peak(str(big), tmp_path / "again-local.lmdb")
    peak(f"{inputs.bucket}/big/big-0.tar", tmp_path / "warm.lmdb")  # (clients made, models loaded: once)
    replies.clear()
    remote_peak = peak(f"{inputs.bucket}/big/big-0.tar", tmp_path / "big.lmdb")
    same_records(local, tmp_path / "big.lmdb")
    size = big.stat().st_size
    assert size > 5 * (4 << 20) and max(replies) <= 4 << 20
    # the walk over the headers reads the tar once (its members are not larger than the walk's block),
    # the workers once more: 2x the tar in about 2 GETs a MiB
    assert sum(replies) < 2.1 * size and len(replies) < 2.2 * size / (1 << 20)
    # measured: 8.6 MB against 8.5 MB from the local file (the task's records and the shard's)
    assert remote_peak < local_peak + (4 << 20), (remote_peak, local_peak)
    assert remote_peak < size / 2
    # control: workers reading the whole tar in one GET (a block as large as it, read-ahead past their task) hold it
    from fastdata.writer.sources.webdataset import remote

    class WholeTar(sources.ObjectReader):
        def __init__(self, url, size, etag, options, block=0, stop=None):
            super().__init__(url, size, etag, options, 64 << 20)
    monkeypatch.setattr(remote, "ObjectReader", WholeTar)
    whole = peak(f"{inputs.bucket}/big/big-0.tar", tmp_path / "whole.lmdb")
    assert whole > size, (whole, size)


def test_an_interrupted_remote_tar_conversion_resumes_to_the_local_store(inputs, tmp_path, monkeypatch):
    from fastdata.writer.sources.webdataset import remote

    dst = tmp_path / "resumed.lmdb"
    real, calls = remote.encode_samples, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:  # (one task a tar: after 8 samples, a shard is staged)
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(remote, "encode_samples", failing)
    with pytest.raises(KeyboardInterrupt):
        fastdata.convert(inputs.shards, dst, shard_size="6kB", progress=False, workers=0)
    monkeypatch.setattr(remote, "encode_samples", real)
    assert list((dst / STAGING_DIR).glob("shard-*")) and not (dst / "manifest.json").exists()
    fastdata.convert(inputs.shards, dst, shard_size="6kB", progress=False, workers=0, resume=True)
    same_records(inputs.local, dst)


# --------------------------------------------------------------------------- NIfTI and DICOM folders


def test_remote_nifti_and_dicom_folders_convert_to_the_local_stores(inputs, tmp_path):
    # a NIfTI folder, told from an image folder by one listing page; volumes spooled by the workers
    dst = tmp_path / "scans.lmdb"
    report = fastdata.convert(inputs.scans, dst, chunks=(8, 8, 8), progress=False, workers=2)
    assert report.rejected == 1  # bad.nii, as locally
    same_values(inputs.local_scans, dst)
    assert fastdata.open_dataset(dst).relpath(0) == "a/v0.nii.gz"  # the key in the folder, as locally
    # a DICOM class-folder tree with tags; each file's URL kept as its source path
    dst = tmp_path / "dicom.lmdb"
    fastdata.convert(fastdata.sources.Dicom(inputs.dicom, DICOM_TAGS), dst, progress=False, workers=0)
    same_values(inputs.local_dicom, dst)
    assert fastdata.open_dataset(dst).relpath(0).startswith(f"{inputs.dicom}/")


def test_a_volume_changed_after_planning_stops_the_run_naming_it_and_spools_nothing_more(inputs, tmp_path,
                                                                                        monkeypatch):
    """Spool files live one sample at a time in a worker (counted in process), are removed after
    each sample and when the run stops; a volume rewritten after planning stops the run naming it."""
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession
    from fastdata.writer.sources.volumes import remote
    from fastdata.writer.sources.volumes.remote import RemoteVolumeInput

    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool_dir))
    real, most = remote.spool, {"n": 0}

    def counted(*args, **kwargs):
        path = real(*args, **kwargs)
        most["n"] = max(most["n"], len(list(spool_dir.glob("fastdata-spool-*"))))
        return path
    monkeypatch.setattr(remote, "spool", counted)
    fastdata.convert(inputs.scans, tmp_path / "counted.lmdb", chunks=(8, 8, 8), progress=False, workers=0)
    assert most["n"] == 1 and not list(spool_dir.glob("fastdata-spool-*"))
    same_values(inputs.local_scans, tmp_path / "counted.lmdb")

    loc = RemoteLocation(inputs.scans)
    name = "b/v2.nii"
    original = loc.read_bytes(name)

    class Changing(RemoteVolumeInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            loc.write_bytes(name, original[:-1] + bytes([original[-1] ^ 0xFF]))  # same size, another ETag
            return plans
    dst = tmp_path / "changed.lmdb"
    try:
        with pytest.raises(SourceChangedError, match=f"{inputs.scans}/{name}: the object changed") as caught:
            WriteSession(Changing(inputs.scans, (8, 8, 8), None), str(dst), WriteOptions(progress=False,
                                                                                          workers=0)).run()
        assert "\n" not in str(caught.value)
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists() and not list(spool_dir.glob("fastdata-spool-*"))


def test_a_dicom_file_deleted_after_planning_stops_the_run_and_errors_are_one_line(inputs, tmp_path, capsys):
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession
    from fastdata.writer.sources.remote_dicom import RemoteDicomFolderInput

    loc = RemoteLocation(inputs.dicom)
    name = "lung/slice001.dcm"
    original = loc.read_bytes(name)

    class Deleting(RemoteDicomFolderInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            loc.remove([name])
            return plans
    dst = tmp_path / "deleted.lmdb"
    try:
        with pytest.raises(SourceChangedError, match=f"{inputs.dicom}/{name}: the object was deleted"):
            WriteSession(Deleting(inputs.dicom, DICOM_TAGS), str(dst), WriteOptions(progress=False, workers=0)).run()
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists()
    cli = cli_in_process(capsys, "convert", f"{inputs.bucket}/nothing-here/", str(tmp_path / "x.lmdb"), "--chunks",
                         "8,8,8")
    assert cli.returncode != 0 and "no objects under this prefix" in cli.stderr and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    with pytest.raises(SourceError, match="no NIfTI files found"):
        fastdata.convert(fastdata.sources.Volumes(inputs.shards), tmp_path / "y.lmdb", progress=False, workers=0)


# --------------------------------------------------------------------------- volume lists and dataset.json


@pytest.fixture(scope="module")
def vol_lists(s3_server, tmp_path_factory):
    """A Decathlon task (image and label volumes, a dataset.json) and a CSV volume list beside it
    naming its pairs relatively, with an extra column and a missing volume; locally and in a
    bucket, with their local conversions; and a local list naming the bucket's volumes by URL."""
    mp = pytest.MonkeyPatch()
    for key, value in s3_server.env().items():
        mp.setenv(key, value)
    mp.setenv("FASTDATA_REMOTE_RETRIES", "2")
    root = tmp_path_factory.mktemp("remote-vol-lists")
    task = root / "data" / "task"
    for i in range(3):
        image = volume(10 + i, (16, 12, 9))
        write_nifti(task / "imagesTr" / f"c{i}.nii.gz", image, affine_of(i))
        write_nifti(task / "labelsTr" / f"c{i}.nii.gz", label_of(image), affine_of(i))
    training = [{"image": f"./imagesTr/c{i}.nii.gz", "label": f"./labelsTr/c{i}.nii.gz"} for i in range(3)]
    (task / "dataset.json").write_text(json.dumps({"name": "Tiny", "modality": {"0": "CT"}, "training": training}))
    rows = ["image,label,age"] + [f"../task/imagesTr/c{i}.nii.gz,../task/labelsTr/c{i}.nii.gz,{40 + i}"
                                  for i in (2, 0)]
    rows.insert(2, "../task/imagesTr/missing.nii.gz,../task/labelsTr/c1.nii.gz,50")  # rejected, as locally
    (root / "data" / "lists").mkdir()
    (root / "data" / "lists" / "vols.csv").write_text("\n".join(rows) + "\n")
    bucket = f"s3://{s3_server.take_bucket(f'rvlists{os.getpid()}')}"
    upload_tree(root / "data", bucket)
    # a local list naming the bucket's objects by URL
    url_rows = [rows[0]] + [row.replace("../task/", f"{bucket}/task/") for row in rows[1:]]
    (root / "urls.csv").write_text("\n".join(url_rows) + "\n")

    class NS:
        pass
    t = NS()
    t.server, t.bucket, t.root = s3_server, bucket, root
    t.local_list = root / "local-list.lmdb"
    t.local_report = fastdata.convert(str(root / "data" / "lists" / "vols.csv"), t.local_list, chunks=(8, 8, 8),
                                      progress=False, workers=0)
    t.local_task = root / "local-task.lmdb"
    fastdata.convert(str(task / "dataset.json"), t.local_task, chunks=(8, 8, 8), progress=False, workers=0)
    yield t
    mp.undo()


def test_remote_volume_lists_and_dataset_json_convert_to_the_local_stores(vol_lists, tmp_path):
    """A list at a URL (relative paths resolved against its URL), a dataset.json at a URL, and a
    local list naming URLs: told apart from image lists, converted to the local store's values,
    labels, extra columns, paths and rejects; a resume of the published store has nothing to do."""
    t = vol_lists
    dst = tmp_path / "list.lmdb"
    report = fastdata.convert(f"{t.bucket}/lists/vols.csv", dst, progress=False, workers=2, chunks=(8, 8, 8))
    same_values(t.local_list, dst)
    # the same row rejected (locally nibabel's FileNotFoundError; here the object's URL)
    assert [r[0] for r in report.rejected_items] == [r[0] for r in t.local_report.rejected_items] == \
        ["../task/imagesTr/missing.nii.gz"]
    assert report.rejected_items[0][1] == f"file not found (no object at {t.bucket}/task/imagesTr/missing.nii.gz)"
    ds = fastdata.open_dataset(dst)
    assert ds.relpath(0) == "../task/imagesTr/c2.nii.gz" and ds[0]["age"] == 42  # recorded as the row says
    assert read_manifest(str(dst))["options"]["source"] == f"{t.bucket}/lists/vols.csv"
    again = fastdata.convert(f"{t.bucket}/lists/vols.csv", dst, progress=False, chunks=(8, 8, 8), resume=True)
    assert again.already_complete

    # the same list over plain HTTP (the test server answers anonymous GETs)
    http_list = f"{t.server.endpoint}/{t.bucket.split('://')[1]}/lists/vols.csv"
    dst = tmp_path / "http-list.lmdb"
    fastdata.convert(http_list, dst, progress=False, workers=0, chunks=(8, 8, 8))
    same_values(t.local_list, dst)

    dst = tmp_path / "task.lmdb"
    fastdata.convert(f"{t.bucket}/task/dataset.json", dst, progress=False, workers=0)  # default chunks: told apart
    assert read_manifest(str(dst))["metadata"]["decathlon"] == {"name": "Tiny", "modality": {"0": "CT"}}
    dst = tmp_path / "task8.lmdb"
    fastdata.convert(fastdata.sources.Volumes(f"{t.bucket}/task/dataset.json", chunks=(8, 8, 8)), dst,
                     progress=False, workers=0)
    same_values(t.local_task, dst)

    dst = tmp_path / "urls.lmdb"
    report = fastdata.convert(str(t.root / "urls.csv"), dst, chunks=(8, 8, 8), progress=False, workers=0)
    same_values(t.local_list, dst)
    assert fastdata.open_dataset(dst).relpath(0) == f"{t.bucket}/task/imagesTr/c2.nii.gz"
    assert report.rejected_items == [(f"{t.bucket}/task/imagesTr/missing.nii.gz",
                                      f"file not found (no object at {t.bucket}/task/imagesTr/missing.nii.gz)")]


def test_a_remote_volume_list_holds_one_samples_files_and_stops_naming_a_changed_label(vol_lists, tmp_path,
                                                                                      monkeypatch):
    """Spool files of a list with label volumes: at most one sample's two files at a time (counted
    at every copy, probes included), none left; a label volume rewritten after planning stops the
    run naming it, nothing published; strict stops at the missing volume as locally."""
    from fastdata.errors import RejectedInputError
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession
    from fastdata.writer.sources.volumes import remote
    from fastdata.writer.sources.volumes.remote import RemoteVolumeInput

    t = vol_lists
    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool_dir))
    real, most = remote.spool, {"n": 0, "calls": 0}

    def counted(*args, **kwargs):
        path = real(*args, **kwargs)
        most["n"] = max(most["n"], len(list(spool_dir.glob("fastdata-spool-*"))))
        most["calls"] += 1
        return path
    monkeypatch.setattr(remote, "spool", counted)
    src = f"{t.bucket}/lists/vols.csv"
    fastdata.convert(src, tmp_path / "counted.lmdb", chunks=(8, 8, 8), progress=False, workers=0)
    assert most["n"] == 2 and most["calls"] > 4 and not list(spool_dir.glob("fastdata-spool-*"))
    same_values(t.local_list, tmp_path / "counted.lmdb")

    with pytest.raises(RejectedInputError, match="missing.nii.gz") as local:
        fastdata.convert(str(t.root / "data" / "lists" / "vols.csv"), tmp_path / "s1.lmdb", chunks=(8, 8, 8),
                         progress=False, workers=0, strict=True)
    with pytest.raises(RejectedInputError, match="missing.nii.gz") as remote_err:
        fastdata.convert(src, tmp_path / "s2.lmdb", chunks=(8, 8, 8), progress=False, workers=0, strict=True)
    # the same stop, naming the input (locally its path, here its URL)
    missing = f"{t.bucket}/task/imagesTr/missing.nii.gz"
    hint = str(local.value)[str(local.value).index(" (strict=True"):]
    assert str(remote_err.value) == f"{missing}: file not found (no object at {missing}){hint}"

    loc = RemoteLocation(f"{t.bucket}/task/labelsTr")
    name = "c0.nii.gz"
    original = loc.read_bytes(name)

    class Changing(RemoteVolumeInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            loc.write_bytes(name, original + b"\0")  # another size and ETag
            return plans
    dst = tmp_path / "changed.lmdb"
    try:
        with pytest.raises(SourceChangedError, match=f"{t.bucket}/task/labelsTr/{name}: the object changed") as err:
            WriteSession(Changing(src, (8, 8, 8), None), str(dst), WriteOptions(progress=False, workers=0)).run()
        assert "\n" not in str(err.value)
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists() and not list(spool_dir.glob("fastdata-spool-*"))


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_temporary_folder_that_cannot_take_a_volume_is_one_line_naming_it(inputs, tmp_path, workers):
    """A real EFBIG: the CLI runs under a file size limit (RLIMIT_FSIZE, as `ulimit -f` sets) that
    the converter's copy of a header (the first MiB) fits in and the copy of the whole volume (in
    the converter, or in a worker: slow) does not. One line naming the object, the folder and
    TMPDIR; no copy left behind. (A full disk, ENOSPC, takes the same path: a failed write of the
    copy.)"""
    import resource
    import subprocess
    import sys

    big = f"{inputs.bucket}/big"
    loc = RemoteLocation(big)
    for i in range(8):  # v1 is not among the planning probes (samples 0, 2, 4, 6, 7): a worker copies it
        shape = (96, 96, 96) if i == 1 else (4, 4, 4)  # 1.8 MB of voxels, a few kB stored
        loc.write_bytes(f"v{i}.nii", write_nifti(tmp_path / f"v{i}.nii", np.zeros(shape, np.int16)).read_bytes())
    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    limit = 3 << 19

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    env = {**os.environ, "TMPDIR": str(spool_dir)}
    cli = subprocess.run([sys.executable, "-m", "fastdata", "convert", big, str(tmp_path / "big.lmdb"), "--chunks",
                          "8,8,8", "--workers", str(workers)], capture_output=True, text=True, timeout=120, env=env,
                         preexec_fn=limited)
    assert cli.returncode != 0 and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    size = len(loc.read_bytes("v1.nii"))
    assert f"{big}/v1.nii: cannot copy {size:,} bytes of the volume into the temporary folder {spool_dir}: File " \
        "too large (EFBIG)" in cli.stderr and "set TMPDIR" in cli.stderr
    assert not list(spool_dir.glob("fastdata-spool-*"))


def test_a_remote_image_folder_is_told_apart_by_one_listing_page(inputs, tmp_path):
    """Telling a prefix's kind (tar shards? NIfTI volumes? images?) costs one listing request; the
    folder's own listing follows (one page for these objects): two listing requests in all,
    counted at the HTTP level by a proxy in front of the server."""
    from helpers.counting_proxy import CountingProxy

    for i in range(4):
        path = tmp_path / "imgs" / ("ab"[i % 2]) / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg(i))
    upload_tree(tmp_path / "imgs", f"{inputs.bucket}/imgs")
    proxy = CountingProxy(inputs.server.endpoint).start()
    try:
        report = fastdata.convert(f"{inputs.bucket}/imgs/", tmp_path / "counted.lmdb", progress=False, workers=0,
                                  storage_options={"endpoint_url": proxy.endpoint})
        listings = [r.path for r in proxy.requests if r.method == "GET" and "list-type=2" in r.path]
    finally:
        proxy.stop()
    assert report.images == 4 and fastdata.open_dataset(tmp_path / "counted.lmdb").classes == ["a", "b"]
    assert len(listings) == 2, listings


def test_an_interrupted_remote_volume_list_conversion_resumes_and_refuses_a_changed_volume(vol_lists, tmp_path,
                                                                                          monkeypatch):
    """Interrupted once a shard is staged: a resume with a volume rewritten since is refused (its
    ETag is in the fingerprint); with the volume as it was, the resume gives the local store."""
    from fastdata.errors import ResumeMismatchError
    from fastdata.writer.sources.volumes import remote

    t = vol_lists
    local = tmp_path / "local.lmdb"
    fastdata.convert(str(t.root / "data" / "lists" / "vols.csv"), local, chunks=(8, 8, 8), shard_size="1kB",
                     progress=False, workers=0)
    src, dst = f"{t.bucket}/lists/vols.csv", tmp_path / "resumed.lmdb"
    real, calls = remote.spool, {"n": 0}

    def failing(url, size, etag, options, limit=None):
        calls["n"] += limit is None
        if calls["n"] > 6:  # (the planning probes copy 4 files, the first sample 2)
            raise KeyboardInterrupt
        return real(url, size, etag, options, limit)
    monkeypatch.setattr(remote, "spool", failing)
    with pytest.raises(KeyboardInterrupt):
        fastdata.convert(src, dst, chunks=(8, 8, 8), shard_size="1kB", progress=False, workers=0)
    monkeypatch.setattr(remote, "spool", real)
    assert list((dst / STAGING_DIR).glob("shard-*")) and not (dst / "manifest.json").exists()
    loc = RemoteLocation(f"{t.bucket}/task/imagesTr")
    original = loc.read_bytes("c2.nii.gz")
    loc.write_bytes("c2.nii.gz", original[:-1] + bytes([original[-1] ^ 0xFF]))  # same size, another ETag
    try:
        with pytest.raises(ResumeMismatchError):
            fastdata.convert(src, dst, chunks=(8, 8, 8), shard_size="1kB", progress=False, workers=0, resume=True)
    finally:
        loc.write_bytes("c2.nii.gz", original)
    fastdata.convert(src, dst, chunks=(8, 8, 8), shard_size="1kB", progress=False, workers=0, resume=True)
    same_values(local, dst)
    assert len(read_manifest(str(dst))["shards"]) > 1
