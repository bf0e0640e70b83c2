"""A COCO store against torchvision itself: ``CocoDetection`` and its transforms-v2 wrapper.

Run where torchvision imports (CI's second venv: torch 2.14.1 + torchvision 0.29.1 +
pycocotools); elsewhere the module is skipped with that reason. On a synthetic COCO-format
set (crowd RLE, images without annotations, sparse shuffled ids), for every index:
``open_dataset(store)[i]`` equals ``CocoDetection(IMAGE_DIR, ANNOTATIONS)[i]`` (pixels and
annotation dicts, ``repr``-equal so 1 vs 1.0 and key order count), with the same transform
keywords, and ``open_dataset(store, target_format="v2")[i]`` equals
``wrap_dataset_for_transforms_v2(CocoDetection(...))[i]``, through a random v2 pipeline too.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

try:  # torchvision raises RuntimeError (not ImportError) when built for another torch
    import torchvision  # noqa: F401
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import v2
except (ImportError, RuntimeError) as err:
    pytest.skip(f"needs torchvision, which does not import here ({type(err).__name__}: {err}); "
                "CI runs this module in its torchvision venv", allow_module_level=True)

import fastdata
from fastdata.synth_coco import make_coco

pytestmark = pytest.mark.torchvision


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    summary = make_coco(tmp_path_factory.mktemp("coco"), 30, seed=11, max_boxes=7)
    assert summary.num_crowd >= 1 and summary.num_empty >= 1
    return summary


@pytest.fixture(scope="module")
def store(coco_set, tmp_path_factory):
    dst = tmp_path_factory.mktemp("stores") / "coco.lmdb"
    report = fastdata.convert_coco(coco_set.ann_file, coco_set.image_dir, dst, workers=2, progress=False)
    assert report.images == coco_set.num_images and report.rejected == 0
    return dst


def _coco_detection(coco_set, **kwargs) -> CocoDetection:
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        return CocoDetection(coco_set.image_dir, coco_set.ann_file, **kwargs)


def _same_image(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a.mode == b.mode and a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def _same_target(a: dict, b: dict) -> bool:
    """v2 targets equal key by key: tensors by type, dtype and values, BoundingBoxes also by
    format and canvas, lists of JSON values by repr. The keys are compared as a set: torchvision
    adds the annotations' own keys (area, iscrowd, ...) iterating a set of strings, whose order
    changes with each process's string hash seed."""
    if set(a) != set(b) or list(a)[:2] != list(b)[:2]:  # image_id, boxes (when any) come first in both
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if type(x) is not type(y) or x.dtype != y.dtype or not torch.equal(x, y):
                return False
            if isinstance(x, torchvision.tv_tensors.BoundingBoxes) and (
                    x.format != y.format or tuple(x.canvas_size) != tuple(y.canvas_size)):
                return False
        elif repr(x) != repr(y):
            return False
    return True


def test_every_index_equals_cocodetection(coco_set, store):
    ref = _coco_detection(coco_set)
    ds = fastdata.open_dataset(store)
    assert len(ds) == len(ref) and ds.ids == ref.ids and list(ds.ids) == ref.ids
    assert ds.categories == list(ref.coco.cats.values())
    for i in range(len(ref)):
        (image, target), (ref_image, ref_target) = ds[i], ref[i]
        assert _same_image(image, ref_image), i
        assert repr(target) == repr(ref_target), i
    assert any(not ref[i][1] for i in range(len(ref)))  # images without annotations are there, as []


def test_transform_keywords_behave_like_cocodetection(coco_set, store):
    to_tensor = torchvision.transforms.PILToTensor()
    count = len
    cases = [dict(transform=to_tensor), dict(target_transform=count), dict(transform=to_tensor, target_transform=count),
             dict(transforms=lambda im, t: (to_tensor(im).float().mean(), [a["id"] for a in t]))]
    for kwargs in cases:
        ref, ds = _coco_detection(coco_set, **kwargs), fastdata.open_dataset(store, **kwargs)
        for i in (0, 3, len(ref) - 1):
            got, want = ds[i], ref[i]
            assert type(got) is type(want) and len(got) == len(want) == 2
            for g, w in zip(got, want, strict=True):
                assert (torch.equal(g, w) if isinstance(w, torch.Tensor) else
                        _same_image(g, w) if hasattr(w, "getbands") else repr(g) == repr(w)), (kwargs, i)
    for bad in (dict(transform=to_tensor), dict(target_transform=count)):
        with pytest.raises(ValueError, match="Only transforms or transform/target_transform") as ours:
            fastdata.open_dataset(store, transforms=lambda im, t: (im, t), **bad)
        with pytest.raises(ValueError) as theirs:
            _coco_detection(coco_set, transforms=lambda im, t: (im, t), **bad)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("target_keys", [None, "all", {"image_id", "boxes", "labels", "masks", "iscrowd"}])
def test_v2_targets_equal_the_v2_wrapper(coco_set, store, target_keys):
    ref = wrap_dataset_for_transforms_v2(_coco_detection(coco_set), target_keys=target_keys)
    ds = fastdata.open_dataset(store, target_format="v2", target_keys=target_keys)
    seen_empty = False
    for i in range(len(ref)):
        (image, target), (ref_image, ref_target) = ds[i], ref[i]
        assert _same_image(image, ref_image), i
        assert _same_target(target, ref_target), (i, target, ref_target)
        seen_empty |= list(ref_target) == ["image_id"]
        if "boxes" in ref_target:
            assert ref_target["boxes"].format == torchvision.tv_tensors.BoundingBoxFormat.XYXY
            assert tuple(target["boxes"].canvas_size) == (image.height, image.width)
    assert seen_empty  # an image without annotations: only its id, as torchvision gives it


def test_a_random_v2_pipeline_moves_image_and_boxes_like_the_wrapper(coco_set, store):
    pipeline = v2.Compose([v2.ToImage(), v2.RandomResizedCrop((160, 192), antialias=True),
                           v2.RandomHorizontalFlip(0.5), v2.ToDtype(torch.float32, scale=True),
                           v2.SanitizeBoundingBoxes()])
    ref = wrap_dataset_for_transforms_v2(_coco_detection(coco_set, transforms=pipeline))
    ds = fastdata.open_dataset(store, target_format="v2", transforms=pipeline)
    moved = 0
    for i in range(len(ref)):
        if not len(ref._dataset._load_target(ref.ids[i])):
            continue  # SanitizeBoundingBoxes needs boxes; images without annotations are covered above
        torch.manual_seed(1000 + i)
        image, target = ds[i]
        torch.manual_seed(1000 + i)
        ref_image, ref_target = ref[i]
        assert _same_image(image, ref_image) and _same_target(target, ref_target), i
        moved += image.shape[-2:] == (160, 192)
    assert moved >= 10


def test_dataloader_with_two_workers_over_the_store(coco_set, store):
    pipeline = v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(0.5)])
    ds = fastdata.open_dataset(store, target_format="v2", transforms=pipeline)
    ref = wrap_dataset_for_transforms_v2(_coco_detection(coco_set))
    loader = fastdata.loader(ds, batch_size=4, num_workers=2, shuffle=False, persistent_workers=False)
    count = 0
    for images, targets in loader:
        assert isinstance(images, list) and isinstance(targets, list)
        for image, target in zip(images, targets, strict=True):
            ref_image, ref_target = ref[count]
            assert target["image_id"] == ref_target["image_id"] == ds.ids[count]
            flipped = not torch.equal(image, v2.functional.to_image(ref_image))
            want_boxes = ref_target.get("boxes")
            if want_boxes is not None:
                want = v2.functional.horizontal_flip(want_boxes) if flipped else want_boxes
                assert torch.equal(target["boxes"], want) and torch.equal(target["labels"], ref_target["labels"])
            count += 1
    assert count == len(ref)
