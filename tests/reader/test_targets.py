"""COCO annotations as torchvision transforms-v2 targets (fastdata.targets).

The parity tests compare :func:`fastdata.targets.coco_to_v2` with the real
``wrap_dataset_for_transforms_v2(CocoDetection(...))`` on a small hand-made COCO set; they
run wherever torchvision imports. The rest checks the torch-only parts everywhere.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.common.extras import MissingExtraError
from fastdata.targets import COCO_TARGET_KEYS, canvas_size, coco_target, coco_target_keys, coco_to_v2, xywh_to_xyxy

SQUARE = [[2.0, 1.0, 6.0, 1.0, 6.0, 4.0, 2.0, 4.0]]  # polygon: x 2..6, y 1..4


def _annotations() -> list[dict]:
    """Three annotations of one 8x10 (HxW) image: float, int and a crowd RLE box."""
    return [
        {"id": 1, "image_id": 7, "category_id": 3, "bbox": [1.5, 2.0, 4.0, 3.25], "area": 13.0, "iscrowd": 0,
         "segmentation": SQUARE},
        {"id": 2, "image_id": 7, "category_id": 1, "bbox": [0, 0, 2, 2], "area": 4, "iscrowd": 0,
         "segmentation": [[0, 0, 2, 0, 2, 2, 0, 2], [5, 5, 7, 5, 7, 7]]},
        {"id": 3, "image_id": 7, "category_id": 3, "bbox": [3.0, 3.0, 2.0, 2.0], "area": 4.0, "iscrowd": 1,
         "segmentation": {"size": [8, 10], "counts": [34, 3, 5, 3, 35]}},
    ]


# ------------------------------------------------------------------ torch-only parts, everywhere
def test_boxes_go_from_xywh_to_xyxy():
    xywh = torch.tensor([[1.5, 2.0, 4.0, 3.25], [0.0, 0.0, 2.0, 2.0]])
    xyxy = xywh_to_xyxy(xywh)
    assert xyxy.tolist() == [[1.5, 2.0, 5.5, 5.25], [0.0, 0.0, 2.0, 2.0]]
    assert xywh.tolist()[0] == [1.5, 2.0, 4.0, 3.25]  # the input is left as it was
    ints = xywh_to_xyxy(torch.tensor([[1, 2, 3, 4]]))
    assert ints.dtype == torch.int64 and ints.tolist() == [[1, 2, 4, 6]]


def test_canvas_size_is_height_width_for_every_image_type():
    assert canvas_size(Image.new("RGB", (10, 8))) == (8, 10)
    assert canvas_size(torch.zeros(3, 8, 10)) == (8, 10)
    assert canvas_size(np.zeros((8, 10, 3), np.uint8)) == (8, 10)
    with pytest.raises(TypeError, match="cannot tell the size"):
        canvas_size([1, 2])


def test_default_target_keys_dtypes_and_shapes():
    target = coco_target(_annotations(), 7, (8, 10))
    assert set(target) == {"image_id", "boxes", "labels"} and target["image_id"] == 7
    assert target["boxes"].dtype == torch.float32 and target["boxes"].shape == (3, 4)
    assert target["boxes"].tolist() == [[1.5, 2.0, 5.5, 5.25], [0.0, 0.0, 2.0, 2.0], [3.0, 3.0, 5.0, 5.0]]
    assert target["labels"].dtype == torch.int64 and target["labels"].tolist() == [3, 1, 3]
    # boxes all given as JSON ints stay ints, as torch.as_tensor (and so torchvision) makes them
    ints = coco_target([{"bbox": [1, 2, 3, 4], "category_id": 5}], 1, (8, 10))
    assert ints["boxes"].dtype == torch.int64 and ints["boxes"].tolist() == [[1, 2, 4, 6]]


def test_an_image_without_annotations_has_only_its_id():
    for keys in (None, "all", {"boxes"}, {"labels", "area"}):
        assert coco_target([], 42, (8, 10), keys) == {"image_id": 42}
        image = Image.new("RGB", (10, 8))
        out_image, target = coco_to_v2(image, [], 42, target_keys=keys)  # no torchvision needed for this
        assert out_image is image and target == {"image_id": 42}


def test_all_keys_copy_the_native_values_as_lists():
    anns = _annotations()
    target = coco_target(anns, 7, (8, 10), "all")
    assert set(target) == COCO_TARGET_KEYS
    for key in ("segmentation", "area", "iscrowd", "bbox", "category_id"):
        assert target[key] == [a[key] for a in anns]
    assert target["area"][1] == 4 and isinstance(target["area"][1], int)  # values untouched


def test_masks_are_rasterised_segmentations():
    target = coco_target(_annotations(), 7, (8, 10), {"masks"})
    masks = target["masks"]
    assert masks.dtype == torch.uint8 and masks.shape == (3, 8, 10)
    assert masks[0].nonzero().tolist()  # the square polygon covers its box and nothing far from it
    ys, xs = masks[0].nonzero().unbind(1)
    assert 1 <= ys.min() and ys.max() <= 4 and 2 <= xs.min() and xs.max() <= 6
    assert masks[1][:3, :3].any() and masks[1][5:, 5:].any()  # two polygons merged into one mask
    rle = np.zeros(80, np.uint8)
    rle[34:37] = 1
    rle[42:45] = 1
    assert torch.equal(masks[2], torch.from_numpy(rle.reshape(10, 8).T.copy()))  # column-major RLE


def test_missing_pycocotools_is_a_clear_error(monkeypatch):
    for name in ("pycocotools", "pycocotools.mask"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(MissingExtraError, match="'masks' needs pycocotools.*pip install pycocotools"):
        coco_target_keys({"boxes", "masks"})
    assert coco_target_keys(None) == {"image_id", "boxes", "labels"}  # the default needs no pycocotools


def test_bad_target_keys_are_named():
    with pytest.raises(ValueError, match=r"Target keys \['keypoints'\] are not available"):
        coco_target_keys({"boxes", "keypoints"})
    with pytest.raises(ValueError, match="target_keys can be None, 'all', or a collection of strings"):
        coco_target_keys(3)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="'segmentation'"):
        coco_target([{"bbox": [0, 0, 1, 1], "category_id": 1}], 1, (8, 10), {"segmentation"})


def test_missing_torchvision_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(MissingExtraError, match="need torchvision"):
        coco_to_v2(Image.new("RGB", (10, 8)), _annotations(), 7)


# ------------------------------------------------------------------ parity with torchvision itself
@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    """A COCO-format set: 4 images (one with no annotation, one RGBA-free grey), polygons,
    uncompressed and compressed RLE, int and float boxes, ids not in file order."""
    from pycocotools import mask as mask_utils

    root = tmp_path_factory.mktemp("coco")
    rng = np.random.default_rng(0)
    images = [(30, "a.jpg", (48, 64)), (10, "b.png", (40, 40)), (20, "c.jpg", (33, 57)), (40, "d.png", (20, 30))]
    for _, name, (h, w) in images:
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
    blob = np.zeros((33, 57), np.uint8, order="F")
    blob[5:20, 10:30] = 1
    compressed = mask_utils.encode(blob)
    compressed["counts"] = compressed["counts"].decode("ascii")
    anns = [
        {"id": 1, "image_id": 30, "category_id": 2, "bbox": [3.5, 4.0, 20.25, 10.0], "area": 202.5, "iscrowd": 0,
         "segmentation": [[3.5, 4.0, 23.75, 4.0, 23.75, 14.0, 3.5, 14.0]]},
        {"id": 2, "image_id": 30, "category_id": 5, "bbox": [0, 0, 10, 12], "area": 120, "iscrowd": 0,
         "segmentation": [[0, 0, 10, 0, 10, 12], [20, 20, 30, 20, 30, 30, 20, 30]]},
        {"id": 3, "image_id": 20, "category_id": 2, "bbox": [10.0, 5.0, 20.0, 15.0], "area": 300.0, "iscrowd": 1,
         "segmentation": compressed},
        {"id": 4, "image_id": 10, "category_id": 7, "bbox": [1, 2, 3, 4], "area": 12, "iscrowd": 1,
         "segmentation": {"size": [40, 40], "counts": [41, 4, 36, 4, 1515]}},
        {"id": 5, "image_id": 20, "category_id": 9, "bbox": [0.0, 0.0, 57.0, 33.0], "area": 1881.0, "iscrowd": 0,
         "segmentation": [[0, 0, 57, 0, 57, 33, 0, 33]]},
    ]
    ann_file = root / "instances.json"
    ann_file.write_text(json.dumps({
        "images": [{"id": i, "file_name": n, "height": h, "width": w} for i, n, (h, w) in images],
        "annotations": anns,
        "categories": [{"id": c, "name": f"c{c}"} for c in (2, 5, 7, 9)],
    }))
    return str(root), str(ann_file)


def _assert_same(ours, theirs, where: str) -> None:
    assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert torch.equal(ours.as_subclass(torch.Tensor), theirs.as_subclass(torch.Tensor)), where
        for attr in ("format", "canvas_size", "clamping_mode"):
            assert getattr(ours, attr, None) == getattr(theirs, attr, None), f"{where}: {attr}"
    else:
        assert ours == theirs, where


@pytest.mark.torchvision
@pytest.mark.parametrize("target_keys", [None, "all", ("boxes", "masks"), ("labels", "area", "iscrowd")],
                         ids=["default", "all", "boxes-masks", "labels-area-iscrowd"])
def test_matches_torchvisions_v2_wrapper(coco_set, target_keys):
    pytest.importorskip("torchvision", reason="the parity check needs torchvision (not importable here)")
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2

    root, ann_file = coco_set
    plain = CocoDetection(root, ann_file)
    wrapped = wrap_dataset_for_transforms_v2(CocoDetection(root, ann_file), target_keys=target_keys)
    assert plain.ids == [10, 20, 30, 40]
    for i in range(len(plain)):
        image, annotations = plain[i]
        ref_image, ref_target = wrapped[i]
        out_image, target = coco_to_v2(image, annotations, plain.ids[i], target_keys=target_keys)
        assert np.array_equal(np.asarray(out_image), np.asarray(ref_image))
        assert set(target) == set(ref_target), f"sample {i}"
        for key in ref_target:
            _assert_same(target[key], ref_target[key], f"sample {i} key {key!r}")
    assert wrapped[3][1] == {"image_id": 40}  # the image without annotations


@pytest.mark.torchvision
def test_v2_transforms_move_boxes_with_the_image(coco_set):
    pytest.importorskip("torchvision", reason="the parity check needs torchvision (not importable here)")
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import v2

    root, ann_file = coco_set
    transforms = v2.Compose([v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0), v2.Resize((24, 32))])
    plain = CocoDetection(root, ann_file)
    wrapped = wrap_dataset_for_transforms_v2(CocoDetection(root, ann_file, transforms=transforms))
    image, annotations = plain[2]
    ours = transforms(*coco_to_v2(image, annotations, plain.ids[2]))
    theirs = wrapped[2]
    assert torch.equal(ours[0], theirs[0])
    _assert_same(ours[1]["boxes"], theirs[1]["boxes"], "transformed boxes")
    assert ours[1]["boxes"].canvas_size == (24, 32)
    assert ours[1]["boxes"][0].tolist() != coco_to_v2(image, annotations, 30)[1]["boxes"][0].tolist()


@pytest.mark.torchvision
def test_add_empty_boxes_lets_sanitize_and_models_take_unannotated_images(coco_set):
    """torchvision's wrapper gives an unannotated image only its id, on which
    SanitizeBoundingBoxes raises; AddEmptyBoxes supplies empty boxes and labels
    (control: the same pipeline without it raises)."""
    pytest.importorskip("torchvision", reason="the parity check needs torchvision (not importable here)")
    from torchvision.datasets import CocoDetection
    from torchvision.transforms import v2

    from fastdata.targets import AddEmptyBoxes

    root, ann_file = coco_set
    plain = CocoDetection(root, ann_file)
    image, annotations = plain[3]
    sample = coco_to_v2(image, annotations, plain.ids[3])
    with pytest.raises(ValueError):
        v2.Compose([v2.ToImage(), v2.SanitizeBoundingBoxes()])(*sample)
    out_image, target = v2.Compose([AddEmptyBoxes(), v2.ToImage(), v2.SanitizeBoundingBoxes()])(*sample)
    assert target["boxes"].shape == (0, 4) and target["boxes"].canvas_size == (image.height, image.width)
    assert target["labels"].dtype == torch.int64 and target["image_id"] == 40
    annotated = coco_to_v2(*plain[0], plain.ids[0])
    assert AddEmptyBoxes()(*annotated)[1] is annotated[1]  # an annotated target is left as it is
