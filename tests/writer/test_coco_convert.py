"""``fastdata convert --coco`` and the COCO store's dataset, without torchvision.

The reference is the annotation file itself: ``CocoDetection``'s order is the sorted image
ids, its target the image's annotation dicts in file order as ``json.load`` made them, and
its image ``Image.open(path).convert("RGB")``. Parity with torchvision's own classes is in
tests/test_coco_parity.py (run where torchvision imports). Strict equality of annotations
is ``repr(a) == repr(b)``: unlike ``==`` it tells 1 from 1.0 and True from 1, and follows
key order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.procs import sigkill_once_a_shard_is_staged
from PIL import Image

import fastdata
from fastdata.cli.main import main
from fastdata.common.extras import MissingExtraError
from fastdata.errors import RejectedInputError
from fastdata.format.manifest import read_manifest
from fastdata.reader.coco import CocoStoreDataset
from fastdata.synth_coco import make_coco


def _reference(ann_file: str | Path) -> tuple[list[int], dict[int, dict], dict[int, list[dict]]]:
    """CocoDetection by hand: sorted ids, the last images entry per id, annotations per id in file order."""
    doc = json.loads(Path(ann_file).read_text())
    images = {img["id"]: img for img in doc["images"]}
    per_image: dict[int, list[dict]] = {}
    for ann in doc.get("annotations", []):
        per_image.setdefault(ann["image_id"], []).append(ann)
    return sorted(images), images, per_image


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    return make_coco(tmp_path_factory.mktemp("coco"), 24, seed=3, max_boxes=6)


@pytest.fixture(scope="module")
def store(coco_set, tmp_path_factory):
    dst = tmp_path_factory.mktemp("stores") / "coco.lmdb"
    report = fastdata.convert_coco(coco_set.ann_file, coco_set.image_dir, dst, workers=2, progress=False)
    assert report.images == coco_set.num_images and report.rejected == 0 and report.warnings == []
    return dst


def test_every_sample_is_the_image_and_annotations_of_cocodetections_order(coco_set, store):
    ids, images, per_image = _reference(coco_set.ann_file)
    ds = fastdata.open_dataset(store)
    assert isinstance(ds, CocoStoreDataset) and len(ds) == len(ids)
    assert ds.ids == ids and list(ds.ids) == ids and ds.ids[3] == ids[3] and type(ds.ids[3]) is int
    assert list(images) != ids  # the file lists images in another order: sorting by id matters
    empty = 0
    for i, image_id in enumerate(ids):
        image, target = ds[i]
        expected = Image.open(os.path.join(coco_set.image_dir, images[image_id]["file_name"])).convert("RGB")
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(expected))
        assert repr(target) == repr(per_image.get(image_id, []))
        empty += not target
    assert empty == coco_set.num_empty >= 1
    doc = json.loads(Path(coco_set.ann_file).read_text())
    assert ds.categories == doc["categories"] and ds.coco_metadata["info"] == doc.get("info")
    assert any(ann["iscrowd"] and isinstance(ann["segmentation"], dict) for i in range(len(ds)) for ann in ds[i][1])


def test_batches_and_a_two_worker_loader_give_lists_of_images_and_targets(coco_set, store):
    ds = fastdata.open_dataset(store)
    batch = ds.__getitems__([5, 0, 2])
    assert [repr(t) for _, t in batch] == [repr(ds[i][1]) for i in (5, 0, 2)]
    images, targets = fastdata.collate(batch)
    assert isinstance(images, list) and isinstance(targets, list) and len(images) == 3
    # samples collated by hand (no batch marker) are recognised too, empty annotation lists included
    empty = next(i for i in range(len(ds)) if not ds[i][1])
    images, targets = fastdata.collate([ds[empty], ds[0]])
    assert targets == [[], ds[0][1]]
    loader = fastdata.loader(ds, batch_size=5, num_workers=2, shuffle=False, persistent_workers=False)
    got = [(np.asarray(im), t) for images, targets in loader for im, t in zip(images, targets, strict=True)]
    assert len(got) == len(ds)
    for i, (pixels, target) in enumerate(got):
        assert np.array_equal(pixels, np.asarray(ds[i][0])) and repr(target) == repr(ds[i][1])


def test_transform_keywords_follow_visiondataset(store):
    plain = fastdata.open_dataset(store)
    ds = fastdata.open_dataset(store, transform=lambda im: im.size, target_transform=len)
    assert ds[1] == (plain[1][0].size, len(plain[1][1]))
    joint = fastdata.open_dataset(store, transforms=lambda im, t: (t, im.size))
    assert joint[1] == (plain[1][1], plain[1][0].size)
    with pytest.raises(ValueError, match="Only transforms or transform/target_transform"):
        fastdata.open_dataset(store, transforms=lambda im, t: (im, t), transform=len)
    tensors = fastdata.open_dataset(store, output="tensor")
    assert torch.equal(tensors[1][0], torch.from_numpy(np.array(plain[1][0])).permute(2, 0, 1))


def test_v2_targets_without_torchvision_are_a_clear_error(store, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed (here it does not import anyway)
    with pytest.raises(MissingExtraError, match="need torchvision"):
        fastdata.open_dataset(store, target_format="v2")
    with pytest.raises(ValueError, match="target_format must be one of"):
        fastdata.open_dataset(store, target_format="yolo")


def test_problems_are_reported_and_a_missing_image_moves_no_id(tmp_path):
    summary = make_coco(tmp_path / "c", 12, seed=4, max_boxes=3)
    doc = json.loads(Path(summary.ann_file).read_text())
    ids = sorted(img["id"] for img in doc["images"])
    by_id = {img["id"]: img for img in doc["images"]}
    gone, broken = ids[2], ids[5]
    os.remove(os.path.join(summary.image_dir, by_id[gone]["file_name"]))
    Path(summary.image_dir, by_id[broken]["file_name"]).write_bytes(b"not an image at all")
    doc["annotations"].append(dict(doc["annotations"][0], id=10**6, image_id=999_999))  # dangling
    doc["images"].append(dict(by_id[ids[7]]))  # the same id listed twice
    ann = tmp_path / "bad.json"
    ann.write_text(json.dumps(doc))

    dst = tmp_path / "s.h5"
    report = fastdata.convert_coco(ann, summary.image_dir, dst, workers=2, progress=False)
    assert report.images == len(ids) - 2 and report.rejected == 2
    assert sorted(name for name, _ in report.rejected_items) == sorted(by_id[i]["file_name"] for i in (gone, broken))
    reasons = " ".join(why for _, why in report.rejected_items)
    assert "not a usable image" in reasons and os.path.join(summary.image_dir, by_id[broken]["file_name"]) in reasons
    warnings = " ".join(report.warnings)
    assert "image_id 999999 is not in 'images'" in warnings and f"image id {ids[7]} is listed 2 times" in warnings
    assert by_id[gone]["file_name"] not in warnings  # reported once, as rejected
    summary_text = report.summary()
    assert "rejected 2 input(s)" in summary_text
    manifest = read_manifest(str(dst))
    assert len(manifest["rejected"]) == 2 and len(manifest["metadata"]["coco"]["problems"]) == 2
    ds = fastdata.open_dataset(dst)
    assert list(ds.ids) == [i for i in ids if i not in (gone, broken)]
    _, _, per_image = _reference(ann)
    assert all(repr(ds[k][1]) == repr(per_image.get(image_id, [])) for k, image_id in enumerate(ds.ids))
    assert fastdata.verify(str(dst), decode=True).ok

    # --strict stops before writing anything, naming the problems
    assert main(["convert", "--coco", str(ann), summary.image_dir, str(tmp_path / "strict.lmdb"), "--strict",
                 "--quiet"]) == 2
    with pytest.raises(RejectedInputError, match="999999"):
        fastdata.convert_coco(ann, summary.image_dir, tmp_path / "strict.lmdb", strict=True, progress=False)
    assert not (tmp_path / "strict.lmdb").exists()


def test_cli_converts_verifies_and_refuses_options_that_do_not_apply(coco_set, tmp_path, capsys):
    dst = tmp_path / "cli.h5"
    assert main(["convert", "--coco", coco_set.ann_file, coco_set.image_dir, str(dst), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {coco_set.num_images} images" in out and "rejected 0 input(s)" in out
    assert main(["verify", str(dst), "--decode"]) == 0
    assert main(["convert", "--coco", coco_set.ann_file, coco_set.image_dir, str(tmp_path / "x.h5"),
                 "--max-side", "100"]) == 2
    assert "--max-side do(es) not apply to --coco" in capsys.readouterr().err
    assert main(["convert", "--coco", str(tmp_path / "none.json"), coco_set.image_dir, str(tmp_path / "y.h5")]) == 2
    assert "COCO annotation file not found" in capsys.readouterr().err


# Rerun once: the kill must land while shards are being written (load-dependent timing)
@pytest.mark.flaky(reruns=1)
def test_sigkill_then_resume_equals_a_clean_conversion(tmp_path, monkeypatch):
    summary = make_coco(tmp_path / "c", 40, seed=6, max_boxes=4)
    dst = tmp_path / "out.lmdb"
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1")
    argv = [sys.executable, "-m", "fastdata", "convert", "--coco", summary.ann_file, summary.image_dir, str(dst),
            "--workers", "1", "--shard-size", "60000", "--quiet"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "conversion")
    assert not (dst / "manifest.json").exists()
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    report = fastdata.convert_coco(summary.ann_file, summary.image_dir, dst, workers=2, shard_size=60000,
                                   resume=True, progress=False)
    clean = tmp_path / "clean.lmdb"
    fastdata.convert_coco(summary.ann_file, summary.image_dir, clean, workers=2, shard_size=60000, progress=False)
    assert report.resumed_shards >= 1
    assert f"took over the lock of converter pid {proc.pid}" in " ".join(report.warnings)
    shards = lambda m: [(s["name"], s["count"], s["xxh"]) for s in m["shards"]]  # noqa: E731
    assert shards(read_manifest(str(dst))) == shards(read_manifest(str(clean)))
    assert fastdata.verify(str(dst)).ok


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_fork_and_spawn(store, context):
    ds = fastdata.open_dataset(store, output="numpy")
    ds[0]  # handles opened in the parent must not be used by the children
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=fastdata.collate,
                                         multiprocessing_context=context)
    got = [(im, t) for images, targets in loader for im, t in zip(images, targets, strict=True)]
    assert len(got) == len(ds)
    assert all(np.array_equal(im, ds[i][0]) and repr(t) == repr(ds[i][1]) for i, (im, t) in enumerate(got))


def test_write_skips_unusable_images_when_not_strict_and_keeps_metadata(tmp_path, coco_set):
    """The two writer options the COCO conversion relies on, through fastdata.write itself."""
    jpeg = Path(coco_set.image_dir).glob("*.jpg").__next__().read_bytes()
    samples = [{"image": jpeg, "n": 0}, {"image": b"garbage", "n": 1}, {"image": str(tmp_path / "none.jpg"), "n": 2},
               {"image": jpeg, "n": 3}]
    with pytest.raises(RejectedInputError, match="sample 1 field 'image': not a usable image"):
        fastdata.write(samples, tmp_path / "strict.h5", workers=0, progress=False)
    meta = {"classes": ["a", "b"], "nested": {"x": 1.5}}
    report = fastdata.write(samples, tmp_path / "s.h5", workers=0, progress=False, strict=False, metadata=meta)
    assert report.images == 2 and [name for name, _ in report.rejected_items] == ["sample 1", "sample 2"]
    assert "none.jpg" in report.rejected_items[1][1]
    assert [s["n"] for s in fastdata.open_dataset(tmp_path / "s.h5")] == [0, 3]
    assert read_manifest(str(tmp_path / "s.h5"))["metadata"] == meta
    # resume compares the metadata too: other metadata is another write
    with pytest.raises(fastdata.errors.ResumeMismatchError):
        fastdata.write(samples, tmp_path / "s.h5", workers=0, progress=False, strict=False, metadata={"x": 1},
                       resume=True)


def test_a_lone_surrogate_in_the_annotations_is_one_clear_error_and_nothing_is_published(tmp_path, capsys):
    """JSON escapes allow "\\udc80", which no UTF-8 record can hold: the CLI names the sample,
    the field path and the text instead of a UnicodeEncodeError traceback."""
    info = make_coco(tmp_path / "coco", n_images=4, seed=1)
    ann = json.loads(Path(info.ann_file).read_text())
    ann["annotations"][0]["note"] = "bad \udc80 text"
    Path(info.ann_file).write_text(json.dumps(ann))  # ensure_ascii: stored as the \udc80 escape
    dst = tmp_path / "o.lmdb"
    assert main(["convert", "--coco", info.ann_file, info.image_dir, str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'annotations'.note" in err[0] and "not valid Unicode" in err[0], err
    assert not (dst / "manifest.json").exists()
