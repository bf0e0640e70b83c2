"""``CocoStoreDataset.coco``: the ground truth as a ``pycocotools.coco.COCO``, rebuilt from the store.

On a synthetic COCO file with polygon, uncompressed-RLE crowd and compressed-RLE annotations, the
store's ``.coco.dataset`` equals the file's (images, annotations, categories, info, licenses), and
``COCOeval`` of the same detections (boxes and masks) gives the same stats with the store's
``.coco`` as with ``COCO(annotation_file)``. A store converted before image entries were stored
(no ``image_info`` field) still gives the same stats. ``.coco`` is built once, never pickled, and
without pycocotools says what to install.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pycocotools", reason="the COCO API needs pycocotools (the test extra installs it)")
from pycocotools import mask as mask_utils  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

import fastdata  # noqa: E402
from fastdata.errors import MissingExtraError  # noqa: E402
from fastdata.fields import JSON, Image, Int, Schema  # noqa: E402
from fastdata.reader.coco import CocoStoreDataset  # noqa: E402
from fastdata.synth_coco import make_coco  # noqa: E402


def quiet(fn, *args):
    """``fn(*args)`` without pycocotools' progress lines."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    """16 images, two with a crowd annotation; one crowd RLE rewritten compressed (``counts`` a
    string), as COCO's own files hold some."""
    summary = make_coco(tmp_path_factory.mktemp("cocoapi"), 16, seed=2, max_boxes=4, size=(120, 160), workers=1)
    path = Path(summary.ann_file)
    doc = json.loads(path.read_text())
    crowd = [a for a in doc["annotations"] if a["iscrowd"]]
    assert len(crowd) >= 2 and summary.num_empty >= 1
    seg = crowd[0]["segmentation"]
    compressed = mask_utils.frPyObjects(seg, *seg["size"])
    crowd[0]["segmentation"] = {"size": seg["size"], "counts": compressed["counts"].decode("ascii")}
    path.write_text(json.dumps(doc))
    return summary


@pytest.fixture(scope="module")
def store(coco_set, tmp_path_factory):
    dst = tmp_path_factory.mktemp("cocoapi-store") / "coco.lmdb"
    fastdata.convert_coco(coco_set.ann_file, coco_set.image_dir, dst, workers=1, progress=False)
    return dst


def by_id(entries: list[dict]) -> list[dict]:
    return sorted(entries, key=lambda e: e["id"])


def detections(gt: COCO, seed: int = 0) -> list[dict]:
    """Jittered ground-truth boxes and masks with random scores, plus false positives: what a
    detector gives, crowd regions included (COCOeval ignores matches to them)."""
    rng = np.random.default_rng(seed)
    out = []
    for ann in gt.dataset["annotations"]:
        if rng.random() < 0.2:
            continue  # missed
        x, y, w, h = ann["bbox"]
        box = [x + rng.normal(0, 2), y + rng.normal(0, 2), w * rng.uniform(0.85, 1.15), h * rng.uniform(0.85, 1.15)]
        rle = gt.annToRLE(ann)
        rle["counts"] = rle["counts"].decode("ascii") if isinstance(rle["counts"], bytes) else rle["counts"]
        out.append({"image_id": ann["image_id"], "category_id": ann["category_id"], "bbox": box,
                    "segmentation": rle, "score": float(rng.uniform(0.3, 1))})
    cats = [c["id"] for c in gt.dataset["categories"]]
    for image in gt.dataset["images"]:
        h, w = image["height"], image["width"]
        mask = np.zeros((h, w), dtype=np.uint8, order="F")
        mask[10:40, 10:50] = 1
        rle = mask_utils.encode(mask)
        rle["counts"] = rle["counts"].decode("ascii")
        out.append({"image_id": image["id"], "category_id": int(rng.choice(cats)), "bbox": [10.0, 10.0, 40.0, 30.0],
                    "segmentation": rle, "score": float(rng.uniform(0, 0.5))})
    return out


def stats(gt: COCO, dets: list[dict], iou_type: str) -> np.ndarray:
    results = quiet(gt.loadRes, [dict(d) for d in dets])  # loadRes writes into the dicts it is given
    evaluator = COCOeval(gt, results, iou_type)
    quiet(evaluator.evaluate)
    quiet(evaluator.accumulate)
    quiet(evaluator.summarize)
    return evaluator.stats


def test_the_stores_coco_dataset_is_the_annotation_files(coco_set, store):
    doc = json.loads(Path(coco_set.ann_file).read_text())
    ds = fastdata.open_dataset(store)
    api = ds.coco
    assert isinstance(api, COCO) and ds.coco is api  # built once
    got = api.dataset
    assert set(got) == set(doc) == {"info", "licenses", "images", "annotations", "categories"}
    assert got["info"] == doc["info"] and got["licenses"] == doc["licenses"]
    assert by_id(got["images"]) == by_id(doc["images"])  # every key: file_name, height, width, coco_url...
    assert by_id(got["annotations"]) == by_id(doc["annotations"])
    assert by_id(got["categories"]) == by_id(doc["categories"])
    # rebuilt image by image (not the file, copied): the order differs from the file's
    assert [a["id"] for a in got["annotations"]] != [a["id"] for a in doc["annotations"]]
    kinds = {(a["iscrowd"], type(a["segmentation"]).__name__,
              type(a["segmentation"].get("counts")).__name__ if isinstance(a["segmentation"], dict) else "")
             for a in got["annotations"]}
    assert kinds >= {(0, "list", ""), (1, "dict", "list"), (1, "dict", "str")}  # polygon, RLE, compressed RLE
    ref = quiet(COCO, coco_set.ann_file)
    assert api.getImgIds() == sorted(ref.getImgIds()) == list(ds.ids)
    assert api.imgs == ref.imgs and api.anns == ref.anns and api.cats == ref.cats


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_cocoeval_of_the_store_equals_cocoeval_of_the_file(coco_set, store, iou_type):
    ref = quiet(COCO, coco_set.ann_file)
    dets = detections(ref)
    want = stats(ref, dets, iou_type)
    got = stats(fastdata.open_dataset(store).coco, dets, iou_type)
    assert 0.2 < want[0] < 1  # a score that crowd regions and misses move
    assert np.array_equal(got, want)


def test_a_store_without_image_entries_gives_the_same_stats(coco_set, tmp_path):
    """A store converted before ``image_info`` existed: the entries come from the index."""
    doc = json.loads(Path(coco_set.ann_file).read_text())
    ref = quiet(COCO, coco_set.ann_file)
    schema = Schema.of({"image": Image(), "image_id": Int("int64"), "width": Int("int32"), "height": Int("int32"),
                        "annotations": JSON()})
    samples = [{"image": str(Path(coco_set.image_dir) / image["file_name"]), "image_id": image["id"],
                "width": image["width"], "height": image["height"], "annotations": ref.imgToAnns[image["id"]]}
               for image in by_id(doc["images"])]
    meta = {"coco": {"annotation_file": coco_set.ann_file, "image_dir": coco_set.image_dir,
                     "categories": doc["categories"], "info": doc["info"], "licenses": None, "problems": []}}
    dst = tmp_path / "old.lmdb"
    fastdata.write(samples, dst, schema=schema, metadata=meta, workers=1, progress=False)
    ds = fastdata.open_dataset(dst)
    assert isinstance(ds, CocoStoreDataset) and "image_info" not in ds.schema
    images = ds.coco.dataset["images"]
    assert set(ds.coco.dataset) == {"info", "images", "annotations", "categories"}  # licenses: none recorded
    assert images == [{"id": e["id"], "file_name": e["file_name"], "height": e["height"], "width": e["width"]}
                      for e in by_id(doc["images"])]
    dets = detections(ref, seed=1)
    assert np.array_equal(stats(ds.coco, dets, "bbox"), stats(ref, dets, "bbox"))


def test_coco_is_not_pickled_and_names_what_to_install(store, monkeypatch):
    ds = fastdata.open_dataset(store)
    light = len(pickle.dumps(ds))
    assert ds.coco is not None
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) == light and copy._coco is None
    assert copy.coco.dataset == ds.coco.dataset  # rebuilt where it is asked for
    monkeypatch.setitem(sys.modules, "pycocotools.coco", None)  # what an uninstalled module looks like
    fresh = fastdata.open_dataset(store)
    with pytest.raises(ImportError, match="needs pycocotools.*pip install pycocotools") as err:
        fresh.coco  # noqa: B018
    assert isinstance(err.value, MissingExtraError)
    assert fresh.coco_dataset()["images"] == ds.coco.dataset["images"]  # the dict needs nothing
