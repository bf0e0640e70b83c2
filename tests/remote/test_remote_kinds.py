"""COCO, Parquet and WebDataset sources at a URL, on a real S3-compatible server (SeaweedFS,
tests/helpers/s3server.py): each converts to the store its local copy converts to (same shards,
same records), an input changed after planning stops the run naming it (nothing published), a
killed conversion resumes, and a missing annotation file is one clear line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fastdata
from fastdata.errors import ResumeMismatchError, SourceError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.remote.location import RemoteLocation, SourceChangedError
from fastdata.tools.synth_coco import make_coco

pq = pytest.importorskip("pyarrow.parquet")
from helpers.parquet import hf_rows, hf_table, write_hf_parquet  # noqa: E402


def upload_tree(local: str | Path, url: str) -> None:
    """Every file under ``local`` to ``url``/<its relative path>."""
    loc = RemoteLocation(url)
    paths = [os.path.join(root, name) for root, _, files in os.walk(local) for name in files]
    targets = [loc.child(os.path.relpath(p, local).replace(os.sep, "/")).split("://", 1)[1] for p in paths]
    loc.filesystem().put(paths, targets)


def same_records(a: str | Path, b: str | Path, same_bytes: bool = True) -> None:
    """``a`` and ``b`` hold the same shards (names, counts; checksums too with ``same_bytes``:
    a COCO store records each image's source path, a local path in one and a URL in the other),
    rejected input names and records (every field of every sample, decoded)."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert [(s["name"], s["count"]) for s in ma["shards"]] == [(s["name"], s["count"]) for s in mb["shards"]]
    if same_bytes:
        assert [s["xxh"] for s in ma["shards"]] == [s["xxh"] for s in mb["shards"]]
    assert ma["num_samples"] == mb["num_samples"] and ma["classes"] == mb["classes"]

    def rejected_names(store):
        path = Path(store, "rejected.tsv")
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        return sorted(line.split("\t", 1)[0].rsplit("/", 1)[-1] for line in lines)
    assert rejected_names(a) == rejected_names(b)
    da, db = fastdata.open_dataset(a, output="bytes"), fastdata.open_dataset(b, output="bytes")
    assert len(da) == len(db) == ma["num_samples"]
    for i in range(len(da)):
        assert repr(da[i]) == repr(db[i]), i  # (images as their stored bytes)
    assert fastdata.verify(a).ok and fastdata.verify(b).ok


@pytest.fixture(scope="module")
def inputs(s3_server, tmp_path_factory):
    """A small COCO set (with a missing image and a file_name leaving the folder) locally and in a
    bucket, with its local conversion. Yields a namespace."""
    mp = pytest.MonkeyPatch()
    for key, value in s3_server.env().items():
        mp.setenv(key, value)
    mp.setenv("FASTDATA_REMOTE_RETRIES", "2")
    root = tmp_path_factory.mktemp("remote-kinds")
    coco = make_coco(root / "data" / "coco", 10, seed=5, max_boxes=4, size=(60, 80))
    doc = json.loads(Path(coco.ann_file).read_text())
    doc["images"].append({"id": 9001, "file_name": "gone.jpg", "height": 60, "width": 80})
    doc["images"].append({"id": 9002, "file_name": "../outside.jpg", "height": 60, "width": 80})
    Path(coco.ann_file).write_text(json.dumps(doc))
    Path(root, "data", "coco", "outside.jpg").write_bytes(Path(coco.image_dir, os.listdir(coco.image_dir)[0])
                                                             .read_bytes())
    # Hub-named Parquet shards (row groups of 4) under hf/data/, their ClassLabel in hf/dataset_info.json
    rows = hf_rows(14, seed=2)
    half = {k: v[:8] for k, v in rows.items()}, {k: v[8:] for k, v in rows.items()}
    pq_dir = root / "data" / "hf" / "data"
    for k, part in enumerate(half):
        write_hf_parquet(pq_dir / f"train-0000{k}-of-00002.parquet", part)
        table = pq.read_table(pq_dir / f"train-0000{k}-of-00002.parquet")
        pq.write_table(table.replace_schema_metadata(None), pq_dir / f"train-0000{k}-of-00002.parquet",
                       row_group_size=4)
    features = json.loads(hf_table(half[0]).schema.metadata[b"huggingface"])["info"]["features"]
    Path(root, "data", "hf", "dataset_info.json").write_text(json.dumps({"features": features}))
    bucket = f"s3://{s3_server.take_bucket(f'rkind{os.getpid()}')}"
    upload_tree(root / "data", bucket)
    local_coco = root / "local-coco.lmdb"
    fastdata.convert_coco(coco.ann_file, coco.image_dir, local_coco, shard_size="20kB", progress=False, workers=0)
    local_parquet = root / "local-parquet.lmdb"
    fastdata.convert(fastdata.sources.Parquet(str(pq_dir)), local_parquet, shard_size="4kB", progress=False,
                     workers=0)

    class NS:
        pass
    t = NS()
    t.server, t.bucket, t.root, t.local_coco = s3_server, bucket, root, local_coco
    t.local_parquet, t.parquet = local_parquet, f"{bucket}/hf/data"
    rel = os.path.relpath(coco.ann_file, root / "data").replace(os.sep, "/")
    t.coco_ann = f"{bucket}/{rel}"
    t.coco_images = f"{bucket}/{os.path.relpath(coco.image_dir, root / 'data').replace(os.sep, '/')}"
    yield t
    mp.undo()


def test_remote_coco_converts_to_the_local_store(inputs, tmp_path):
    dst = tmp_path / "remote-coco.lmdb"
    report = fastdata.convert_coco(inputs.coco_ann, inputs.coco_images, dst, shard_size="20kB", progress=False,
                                   workers=2)
    assert report.rejected == 2  # the missing image and the one outside the folder, as locally
    same_records(inputs.local_coco, dst, same_bytes=False)
    ds = fastdata.open_dataset(dst)
    local_name = fastdata.open_dataset(inputs.local_coco).relpath(0).rsplit("/", 1)[1]
    assert ds.relpath(0) == f"{inputs.coco_images}/{local_name}"  # the image's URL, as a local path is kept
    coco = read_manifest(dst)["metadata"]["coco"]
    assert coco["annotation_file"] == inputs.coco_ann and coco["image_dir"] == inputs.coco_images
    assert coco["categories"] == read_manifest(inputs.local_coco)["metadata"]["coco"]["categories"]


def test_a_local_coco_file_with_images_at_a_url_converts_to_the_local_store(inputs, tmp_path, capsys):
    """``convert --coco local/instances.json s3://b/images DST``: the annotation file read where it
    is, the images from the bucket: the records of the local conversion, rejections included (the
    reverse, an annotation URL with a local image folder, is refused: the test below)."""
    from helpers.procs import cli_in_process

    ann = str(inputs.root / "data" / inputs.coco_ann.split("/", 3)[3])
    dst = tmp_path / "local-ann.lmdb"
    cli = cli_in_process(capsys, "convert", "--coco", ann, inputs.coco_images, str(dst), "--shard-size", "20kB",
                         "--workers", "0", "--quiet")
    assert cli.returncode == 0, cli.stderr
    same_records(inputs.local_coco, dst, same_bytes=False)
    coco = read_manifest(dst)["metadata"]["coco"]
    assert coco["annotation_file"] == ann and coco["image_dir"] == inputs.coco_images


def test_a_coco_image_changed_after_planning_stops_the_run_naming_it(inputs, tmp_path):
    from fastdata.writer.sources.remote_coco import RemoteCocoInput
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession

    loc = RemoteLocation(inputs.coco_images)
    name = sorted(n.rsplit("/", 1)[-1] for n in loc.filesystem().ls(inputs.coco_images.split("://", 1)[1]))[0]
    original = loc.read_bytes(name)

    class Changing(RemoteCocoInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            loc.write_bytes(name, original[:-2] + bytes([original[-2] ^ 0xFF, original[-1]]))  # same size
            return plans
    dst = tmp_path / "changed.lmdb"
    try:
        with pytest.raises(SourceChangedError, match=f"{inputs.coco_images}/{name}: the object changed") as caught:
            WriteSession(Changing(inputs.coco_ann, inputs.coco_images), str(dst),
                         WriteOptions(progress=False, workers=0)).run()
        assert "\n" not in str(caught.value)
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists()


def test_a_missing_coco_annotation_file_or_mixed_paths_are_one_line_errors(inputs, tmp_path):
    with pytest.raises(SourceError, match="not found: .*nothing.json"):
        fastdata.convert_coco(f"{inputs.bucket}/nothing.json", inputs.coco_images, tmp_path / "x.lmdb",
                              progress=False, workers=0)
    with pytest.raises(ValueError, match="give the image folder's URL, or a local copy of the annotation file"):
        fastdata.convert_coco(inputs.coco_ann, str(tmp_path), tmp_path / "y.lmdb", progress=False, workers=0)


@pytest.mark.slow
def test_remote_coco_resumes_after_an_interrupted_run_and_refuses_a_changed_input(inputs, tmp_path):
    """A run interrupted after a shard leaves its staging; ``resume`` refuses it once the
    annotation file changed (one byte appended), and finishes it to the local store's records once
    the file is back."""
    from fastdata.writer.sources.remote_coco import RemoteCocoSamples

    dst = tmp_path / "resumed.lmdb"
    calls = {"n": 0}
    real = RemoteCocoSamples.__getitem__

    def failing(self, i):
        calls["n"] += 1
        if calls["n"] > 12:
            raise KeyboardInterrupt
        return real(self, i)
    RemoteCocoSamples.__getitem__ = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            fastdata.convert_coco(inputs.coco_ann, inputs.coco_images, dst, shard_size="20kB", progress=False,
                                  workers=0)
    finally:
        RemoteCocoSamples.__getitem__ = real  # type: ignore[method-assign]
    assert not (dst / "manifest.json").exists()
    assert list((dst / STAGING_DIR).glob("shard-*"))  # a shard was finished before the stop
    # the annotation file changed (one byte more) since: resume refuses it
    ann = RemoteLocation(inputs.coco_ann.rsplit("/", 1)[0])
    ann_name = inputs.coco_ann.rsplit("/", 1)[1]
    text = ann.read_bytes(ann_name)
    ann.write_bytes(ann_name, text + b" ")
    try:
        with pytest.raises(ResumeMismatchError, match="cannot resume: the source files or options differ"):
            fastdata.convert_coco(inputs.coco_ann, inputs.coco_images, dst, shard_size="20kB", progress=False,
                                  workers=0, resume=True)
    finally:
        ann.write_bytes(ann_name, text)
    from fastdata.cli.main import main  # (the CLI's --coco takes URLs too)

    assert main(["convert", "--coco", inputs.coco_ann, inputs.coco_images, str(dst), "--shard-size", "20kB",
                 "--workers", "0", "--resume", "--quiet"]) == 0
    same_records(inputs.local_coco, dst, same_bytes=False)


def test_remote_parquet_folder_and_glob_convert_to_the_local_store(inputs, tmp_path):
    folder = tmp_path / "folder.lmdb"
    fastdata.convert(fastdata.sources.Parquet(inputs.parquet), folder, shard_size="4kB", progress=False, workers=1)
    same_records(inputs.local_parquet, folder)
    assert len(read_manifest(folder)["shards"]) > 1
    assert read_manifest(folder)["classes"] == ["airplane", "bird", "cat"]  # from dataset_info.json, one folder up
    globbed = tmp_path / "glob.lmdb"
    fastdata.convert(f"{inputs.parquet}/train-*.parquet", globbed, shard_size="4kB", progress=False, workers=0)
    same_records(inputs.local_parquet, globbed)


def test_a_parquet_file_changed_after_planning_stops_the_run_naming_it(inputs, tmp_path):
    from fastdata.writer.options import WriteOptions
    from fastdata.writer.session import WriteSession
    from fastdata.writer.sources.remote_parquet import RemoteParquetInput

    loc = RemoteLocation(inputs.parquet)
    name = "train-00001-of-00002.parquet"
    original = loc.read_bytes(name)

    class Changing(RemoteParquetInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            loc.write_bytes(name, original[:-9] + bytes([original[-9] ^ 0xFF]) + original[-8:])  # same size
            return plans
    dst = tmp_path / "changed.lmdb"
    try:
        with pytest.raises(SourceChangedError, match=f"{inputs.parquet}/{name}: the object changed") as caught:
            WriteSession(Changing(inputs.parquet), str(dst), WriteOptions(progress=False, workers=0)).run()
        assert "\n" not in str(caught.value)
    finally:
        loc.write_bytes(name, original)
    assert not (dst / "manifest.json").exists()


def test_remote_parquet_errors_are_one_line(inputs, tmp_path):
    with pytest.raises(SourceError, match="no file matches .*/val-"):
        fastdata.convert(f"{inputs.parquet}/val-*.parquet", tmp_path / "a.lmdb", progress=False, workers=0)
    with pytest.raises(SourceError, match="Parquet file not found: .*/nothing.parquet"):
        fastdata.convert(f"{inputs.parquet}/nothing.parquet", tmp_path / "b.lmdb", progress=False, workers=0)
    with pytest.raises(SourceError, match="no .parquet objects directly under this prefix"):
        fastdata.convert(fastdata.sources.Parquet(f"{inputs.bucket}/hf"), tmp_path / "c.lmdb", progress=False,
                         workers=0)


@pytest.mark.slow
def test_remote_parquet_resumes_after_an_interrupted_run(inputs, tmp_path):
    """A run interrupted after its first shards resumes to the local store (records and checksums)."""
    from fastdata.writer.sources.remote_parquet import RemoteParquetRows

    dst = tmp_path / "resumed.lmdb"
    real, calls = RemoteParquetRows.open_file, {"n": 0}

    def failing(self, file_index):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(self, file_index)
    RemoteParquetRows.open_file = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            fastdata.convert(fastdata.sources.Parquet(inputs.parquet), dst, shard_size="4kB", progress=False,
                             workers=0)
    finally:
        RemoteParquetRows.open_file = real  # type: ignore[method-assign]
    assert list((dst / STAGING_DIR).glob("shard-*")) and not (dst / "manifest.json").exists()
    fastdata.convert(fastdata.sources.Parquet(inputs.parquet), dst, shard_size="4kB", progress=False, workers=0,
                     resume=True)
    same_records(inputs.local_parquet, dst)


_LATE_CREDENTIALS = r"""
import os, sys
import fastdata
from fastdata.synth import make_image_folder
# a local conversion with workers first: its pool's forkserver starts without the S3 settings
make_image_folder(sys.argv[3], num_classes=2, per_class=3, size=(16, 12))
fastdata.convert(sys.argv[3], sys.argv[4], workers=2, progress=False)
os.environ.update(dict(arg.split("=", 1) for arg in sys.argv[5:]))  # the settings come only now
report = fastdata.convert(fastdata.sources.Parquet(sys.argv[1]), sys.argv[2], shard_size="4kB", workers=2,
                          progress=False)
print(report.images)
"""


def test_parquet_workers_get_the_credentials_set_after_the_pool_started(inputs, tmp_path, monkeypatch):
    """A process that ran a conversion before its S3 settings were in its environment (a notebook)
    converts remote Parquet with workers: the workers of a pool started before then get the
    credentials and endpoint the converter resolved, not their own (empty) environment's."""
    import subprocess
    import sys

    settings = inputs.server.env()
    for name in settings:
        monkeypatch.delenv(name, raising=False)
    proc = subprocess.run([sys.executable, "-c", _LATE_CREDENTIALS, inputs.parquet, str(tmp_path / "late.lmdb"),
                           str(tmp_path / "imgs"), str(tmp_path / "local.lmdb"),
                           *(f"{k}={v}" for k, v in settings.items())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_records(inputs.local_parquet, tmp_path / "late.lmdb")
