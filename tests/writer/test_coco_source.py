"""The COCO annotation reader (fastdata.writer.sources.coco) against json.load and pycocotools,
on the synthetic COCO-format set of fastdata.synth_coco.

Strict equality throughout is ``repr(a) == repr(b)``: unlike ``==`` it tells 1 from 1.0 and
True from 1, and a dict's repr follows its key order, so "the same dicts json.load gives"
means same keys, same order, same values and same Python types.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools import coco as pycocotools_coco  # the test extra's reference implementation
from pycocotools import mask as mask_utils

from fastdata.errors import SourceError
from fastdata.synth_coco import DEFAULT_CATEGORY_IDS, make_coco
from fastdata.writer.sources.coco import load_coco


def _reference(doc: dict) -> tuple[list[int], dict[int, list[dict]]]:
    """CocoDetection's order by hand: sorted image ids; per id, its annotations in file order."""
    per_image: dict[int, list[dict]] = {}
    for ann in doc.get("annotations", []):
        per_image.setdefault(ann["image_id"], []).append(ann)
    return sorted({img["id"] for img in doc["images"]}), per_image


def _pycoco(ann_file: str | Path):
    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines
        return pycocotools_coco.COCO(str(ann_file))


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    summary = make_coco(root, 40, seed=5, max_boxes=9)
    doc = json.loads(Path(summary.ann_file).read_text())
    return summary, doc


def test_synthetic_set_covers_what_a_reader_must_get_right(coco_set):
    """Not vacuous: the set has empty images, crowd RLE with list counts, polygons, integer
    crowd areas next to float ones, sparse shuffled image ids and category ids with gaps."""
    summary, doc = coco_set
    anns, images = doc["annotations"], doc["images"]
    ids_in_file = [img["id"] for img in images]
    assert ids_in_file != sorted(ids_in_file) and max(ids_in_file) > len(ids_in_file)
    assert summary.num_empty >= 1 and summary.num_crowd >= 1
    assert len({a["image_id"] for a in anns}) == len(images) - summary.num_empty
    crowd = [a for a in anns if a["iscrowd"] == 1]
    assert all(isinstance(a["segmentation"]["counts"], list) and type(a["area"]) is int for a in crowd)
    assert all(isinstance(a["segmentation"], list) and type(a["area"]) is float for a in anns if not a["iscrowd"])
    cat_ids = sorted(c["id"] for c in doc["categories"])
    assert cat_ids == list(DEFAULT_CATEGORY_IDS) and cat_ids != list(range(1, len(cat_ids) + 1))
    # annotations are not grouped by image in the file
    firsts = [a["image_id"] for a in anns]
    assert firsts != sorted(firsts, key=firsts.index)


def test_boxes_inside_images_and_rle_is_pycocotools_rle(coco_set):
    summary, doc = coco_set
    sizes = {img["id"]: (img["height"], img["width"]) for img in doc["images"]}
    for ann in doc["annotations"]:
        h, w = sizes[ann["image_id"]]
        x, y, bw, bh = ann["bbox"]
        assert 0 <= x and 0 <= y and bw > 0 and bh > 0 and x + bw <= w and y + bh <= h, ann["id"]
        if ann["iscrowd"]:
            assert ann["segmentation"]["size"] == [h, w] and sum(ann["segmentation"]["counts"]) == h * w
            rle = mask_utils.frPyObjects(ann["segmentation"], h, w)
            assert int(mask_utils.area(rle)) == ann["area"]
            assert mask_utils.toBbox(rle).tolist() == ann["bbox"]
    for img in doc["images"]:
        path = Path(summary.image_dir) / img["file_name"]
        with Image.open(path) as im:
            assert im.size == (img["width"], img["height"]) and im.format == "JPEG"


def test_generator_is_a_pure_function_of_its_arguments(tmp_path):
    a = make_coco(tmp_path / "a", 6, seed=9, max_boxes=4)
    b = make_coco(tmp_path / "b", 6, seed=9, max_boxes=4, workers=2)
    c = make_coco(tmp_path / "c", 6, seed=10, max_boxes=4)
    assert Path(a.ann_file).read_bytes() == Path(b.ann_file).read_bytes() != Path(c.ann_file).read_bytes()
    for name in sorted(os.listdir(a.image_dir)):
        assert (Path(a.image_dir) / name).read_bytes() == (Path(b.image_dir) / name).read_bytes()


def test_order_and_annotations_equal_json_load(coco_set):
    summary, doc = coco_set
    index = load_coco(summary.ann_file, summary.image_dir)
    ids, per_image = _reference(doc)
    assert index.ids.dtype == np.int64 and index.ids.tolist() == ids
    assert index.problems == []
    for i, image_id in enumerate(ids):
        assert repr(index.annotations(i)) == repr(per_image.get(image_id, [])), image_id
    images = {img["id"]: img for img in doc["images"]}
    for i, image_id in enumerate(ids):
        assert repr(index.image(i)) == repr(images[image_id])
    assert index.categories == doc["categories"] and index.info == doc["info"] and index.licenses == doc["licenses"]


def test_matches_pycocotools_loadanns(coco_set):
    summary, _ = coco_set
    index = load_coco(summary.ann_file, summary.image_dir)
    coco = _pycoco(summary.ann_file)
    assert index.ids.tolist() == sorted(coco.imgs.keys())
    for i, image_id in enumerate(index.ids.tolist()):
        assert repr(index.annotations(i)) == repr(coco.loadAnns(coco.getAnnIds(image_id)))


def test_typed_columns_hold_the_converter_fields(coco_set):
    summary, doc = coco_set
    index = load_coco(summary.ann_file, summary.image_dir)
    _, per_image = _reference(doc)
    assert index.num_annotations == len(doc["annotations"])
    for i, image_id in enumerate(index.ids.tolist()):
        rows = index.ann_slice(i)
        expected = per_image.get(image_id, [])
        assert index.ann_bbox[rows].tolist() == [a["bbox"] for a in expected]
        assert index.ann_category_id[rows].tolist() == [a["category_id"] for a in expected]
        assert index.ann_id[rows].tolist() == [a["id"] for a in expected]
        assert index.ann_iscrowd[rows].tolist() == [a["iscrowd"] for a in expected]
        assert index.ann_area[rows].tolist() == [float(a["area"]) for a in expected]
        image = index.image(i)
        assert (index.width[i], index.height[i]) == (image["width"], image["height"])
        assert index.file_name(i) == image["file_name"] and index.relpath(i) == os.fsencode(image["file_name"])
        assert index.path(i) == os.path.join(os.path.abspath(summary.image_dir), image["file_name"])
        assert index.sizes[i] == os.path.getsize(index.path(i))
    assert index.ann_bbox.dtype == np.float64 and index.ann_bbox.shape == (index.num_annotations, 4)


def test_extra_keys_and_odd_value_types_survive_exactly(coco_set, tmp_path):
    """COCO variants carry keys the reader does not know, and values of other types than
    COCO's (integer boxes, a boolean iscrowd, null, nested objects, a lone surrogate):
    every dict still comes back as json.load made it, and as pycocotools returns it."""
    _, doc = coco_set
    doc = json.loads(json.dumps(doc))
    anns = doc["annotations"]
    anns[0]["keypoints"] = [10, 20, 2, 0, 0, 0]
    anns[0]["num_keypoints"] = 1
    anns[1]["attributes"] = {"occluded": True, "note": None, "score": 0.5, "tags": ["a", "é", "\ud800"]}
    anns[2]["bbox"] = [1, 2, 30, 40]  # integers: the float column cannot say so
    anns[3]["iscrowd"] = False
    anns[4]["area"] = 7
    anns[5] = {"id": anns[5]["id"], "category_id": anns[5]["category_id"], "bbox": anns[5]["bbox"],
               "image_id": anns[5]["image_id"]}  # other key order, no area, iscrowd or segmentation
    anns[6]["big"] = 2**64 - 1
    anns[7]["bbox"] = [0.1, -0.0, 1e-300, 1.7976931348623157e308]
    doc["images"][0]["extra"] = {"exif": [1, 2.5, "x"]}
    doc["images"][1].pop("width")
    doc["something_else"] = [1, 2]
    ann_file = _write(tmp_path / "variant.json", doc)
    index = load_coco(ann_file)
    ids, per_image = _reference(doc)
    coco = _pycoco(ann_file)
    for i, image_id in enumerate(ids):
        assert repr(index.annotations(i)) == repr(per_image.get(image_id, []))
        assert repr(index.annotations(i)) == repr(coco.loadAnns(coco.getAnnIds(image_id)))
        assert repr(index.image(i)) == repr(coco.imgs[image_id])
    assert index.other == {"something_else": [1, 2]}
    row = {int(a): k for k, a in enumerate(index.ann_id)}
    assert index.ann_bbox[row[anns[2]["id"]]].tolist() == [1.0, 2.0, 30.0, 40.0]
    assert np.isnan(index.ann_area[row[anns[5]["id"]]]) and index.ann_iscrowd[row[anns[5]["id"]]] == 0
    assert index.width[index.ids.tolist().index(doc["images"][1]["id"])] == -1


def test_file_without_annotations_gives_empty_targets(coco_set, tmp_path):
    _, doc = coco_set
    doc = {k: v for k, v in doc.items() if k != "annotations"}
    ann_file = _write(tmp_path / "image_info.json", doc)
    index = load_coco(ann_file)
    coco = _pycoco(ann_file)
    assert index.ids.tolist() == sorted(coco.imgs) and index.num_annotations == 0
    assert all(index.annotations(i) == [] == coco.loadAnns(coco.getAnnIds(int(index.ids[i])))
               for i in range(len(index)))


def test_missing_image_files_are_one_problem_each(coco_set, tmp_path):
    summary, doc = coco_set
    image_dir = tmp_path / "images"
    shutil.copytree(summary.image_dir, image_dir)
    gone = [doc["images"][3]["file_name"], doc["images"][7]["file_name"]]
    for name in gone:
        (image_dir / name).unlink()
    index = load_coco(summary.ann_file, image_dir)
    assert sorted(index.problems) == sorted((str(image_dir / name), "image file cannot be read (No such file or "
                                             "directory)") for name in gone)
    missing = [i for i in range(len(index)) if index.sizes[i] == -1]
    assert sorted(index.file_name(i) for i in missing) == sorted(gone)
    assert len(index) == len(doc["images"])  # still listed: the converter decides (strict stops, lenient skips)


def test_dangling_annotations_are_reported_and_left_out(coco_set, tmp_path):
    _, doc = coco_set
    doc = json.loads(json.dumps(doc))
    doc["annotations"][4]["image_id"] = 10**9
    doc["annotations"][9]["image_id"] = "not an id"
    ann_file = _write(tmp_path / "dangling.json", doc)
    index = load_coco(ann_file)
    coco = _pycoco(ann_file)
    assert [(where.split(": ", 1)[1], reason.split(";")[0]) for where, reason in index.problems] == [
        (f"annotations[4] (id {doc['annotations'][4]['id']})", "image_id 1000000000 is not in 'images'"),
        (f"annotations[9] (id {doc['annotations'][9]['id']})", "image_id \"not an id\" is not in 'images'"),
    ]
    assert all(where.startswith(str(ann_file)) for where, _ in index.problems)
    assert index.num_annotations == len(doc["annotations"]) - 2
    for i, image_id in enumerate(index.ids.tolist()):
        assert repr(index.annotations(i)) == repr(coco.loadAnns(coco.getAnnIds(image_id)))


def test_repeated_ids_follow_pycocotools_and_are_reported(coco_set, tmp_path):
    """A repeated image id keeps its last entry; a repeated annotation id shows the last
    annotation's dict at every occurrence; an unlisted category is kept: all reported."""
    _, doc = coco_set
    doc = json.loads(json.dumps(doc))
    images, anns = doc["images"], doc["annotations"]
    dup_image = dict(images[2], file_name="other.jpg", width=11)
    images.append(dup_image)
    anns[12]["id"] = anns[3]["id"]
    anns[15]["category_id"] = 12  # a gap in COCO's ids, not among the categories
    ann_file = _write(tmp_path / "dups.json", doc)
    index = load_coco(ann_file)
    coco = _pycoco(ann_file)
    reasons = [reason for _, reason in index.problems]
    assert len(reasons) == 3
    assert reasons[0].startswith(f"image id {images[2]['id']} is listed 2 times; the last entry is kept")
    assert reasons[1].startswith(f"annotation id {anns[3]['id']} is listed 2 times")
    assert reasons[2].startswith("category_id 12 is not in 'categories'")
    assert index.ids.tolist() == sorted(coco.imgs)
    i = index.ids.tolist().index(images[2]["id"])
    assert repr(index.image(i)) == repr(dup_image) and index.file_name(i) == "other.jpg"
    for i, image_id in enumerate(index.ids.tolist()):
        assert repr(index.annotations(i)) == repr(coco.loadAnns(coco.getAnnIds(image_id)))


@pytest.mark.parametrize("mutate, expected", [
    (lambda text: text[: len(text) // 2], r"dups?\.json:1:\d+: not valid JSON"),
    (lambda text: "[1, 2]", "is a JSON object with an 'images' list; this one holds a list"),
    (lambda text: '{"annotations": []}', r"no 'images' list \(top-level keys: 'annotations'\)"),
    (lambda text: '{"images": {}}', "'images' must be a list, not a dict"),
    (lambda text: '{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [3]}',
     r"annotations\[0\] must be an object, not a int"),
    (lambda text: '{"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2}]}', r"images\[1\] has no 'file_name' key"),
    (lambda text: '{"images": [{"id": "x", "file_name": "a.jpg"}]}',
     r"images\[0\] has id=\"x\", which is not an integer"),
    (lambda text: '{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 5, "image_id": 1, '
                  '"category_id": 1}]}', r"annotations\[0\] has no 'bbox' key"),
    (lambda text: '{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 5, "image_id": 1, '
                  '"category_id": 1, "bbox": [1, 2, 3]}]}',
     r"annotations\[0\] has bbox=\[1, 2, 3\], which is not a list of 4 numbers"),
    (lambda text: '{"images": [{"id": 1, "file_name": "a.jpg", "x": 100000000000000000000000}]}',
     r"images\[0\] holds a value that cannot be stored"),
])
def test_unusable_file_is_one_clear_source_error(coco_set, tmp_path, mutate, expected):
    summary, _ = coco_set
    ann_file = tmp_path / "dups.json"
    ann_file.write_text(mutate(Path(summary.ann_file).read_text()))
    with pytest.raises(SourceError, match=expected) as err:
        load_coco(ann_file)
    assert str(ann_file) in str(err.value) and "\n" not in str(err.value)


def test_missing_or_folder_annotation_file(tmp_path):
    with pytest.raises(SourceError, match="COCO annotation file not found: .*nope.json"):
        load_coco(tmp_path / "nope.json")
    with pytest.raises(SourceError, match="is a folder; give the COCO annotation .json file"):
        load_coco(tmp_path)
