"""torchvision's detection references evaluate a COCO store as they evaluate ``CocoDetection``.

``references/detection/coco_utils.py`` ``get_coco_api_from_dataset(dataset)`` unwraps
``Subset`` s and returns ``dataset.coco`` when ``isinstance(dataset, torchvision.datasets.CocoDetection)``;
for any other dataset it rebuilds the ground truth from the *transformed* targets, which the
references' ``ConvertCocoPolysToMask`` has stripped of crowd annotations, so detections on crowd
regions count as false positives and the mAP drops. Nothing is vendored here: the two paths
are written out below in a few lines, as the references have them. With the one-line edit
``isinstance(dataset, (CocoDetection, fastdata.CocoStoreDataset))`` (docs/frameworks-coco.md),
the store's ``.coco`` is taken and ``COCOeval`` (what ``CocoEvaluator`` runs) gives the very
stats of torchvision's ``CocoDetection`` on the same detections, crowd annotations present; a
subclass overriding ``__getitem__`` the references' way is an instance too, and sees every sample.

Runs in CI's torchvision venv; elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

try:  # torchvision raises RuntimeError (not ImportError) when built for another torch
    from torchvision.datasets import CocoDetection
    from torchvision.transforms.functional import pil_to_tensor
except (ImportError, RuntimeError) as err:
    pytest.skip(f"needs torchvision, which does not import here ({type(err).__name__}: {err}); "
                "CI runs this module in its torchvision venv", allow_module_level=True)
pytest.importorskip("pycocotools", reason="COCOeval needs pycocotools (the test-tv extra installs it)")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

import fastdata  # noqa: E402
from fastdata.synth_coco import make_coco  # noqa: E402

pytestmark = pytest.mark.torchvision


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        return fn(*args)


def convert_polys(image, anno):
    """The references' ``ConvertCocoPolysToMask`` in short: crowd objects dropped, XYXY boxes."""
    anno = [obj for obj in anno if obj.get("iscrowd", 0) == 0]
    boxes = torch.as_tensor([obj["bbox"] for obj in anno], dtype=torch.float32).reshape(-1, 4)
    boxes[:, 2:] += boxes[:, :2]
    image_id = anno[0]["image_id"] if anno else -1
    target = {"boxes": boxes, "labels": torch.tensor([obj["category_id"] for obj in anno], dtype=torch.int64),
              "area": torch.tensor([obj["area"] for obj in anno], dtype=torch.float32),
              "iscrowd": torch.tensor([obj["iscrowd"] for obj in anno], dtype=torch.int64), "image_id": image_id}
    return pil_to_tensor(image), target


def convert_to_coco_api(ds) -> COCO:
    """The references' ``convert_to_coco_api``: ground truth rebuilt from the transformed targets."""
    dataset: dict = {"images": [], "categories": [], "annotations": []}
    categories, ann_id = set(), 1
    for i in range(len(ds)):
        image, target = ds[i]
        if target["image_id"] == -1:
            continue  # (our short converter cannot name an image without objects; it holds none anyway)
        dataset["images"].append({"id": target["image_id"], "height": image.shape[-2], "width": image.shape[-1]})
        boxes = target["boxes"].clone()
        boxes[:, 2:] -= boxes[:, :2]
        for box, label, area, crowd in zip(boxes.tolist(), target["labels"].tolist(), target["area"].tolist(),
                                           target["iscrowd"].tolist(), strict=True):
            dataset["annotations"].append({"image_id": target["image_id"], "bbox": box, "category_id": label,
                                           "area": area, "iscrowd": crowd, "id": ann_id})
            categories.add(label)
            ann_id += 1
    dataset["categories"] = [{"id": c} for c in sorted(categories)]
    api = COCO()
    api.dataset = dataset
    quiet(api.createIndex)
    return api


def get_coco_api_from_dataset(dataset, coco_types=(CocoDetection,)) -> COCO:
    """The references' function; ``coco_types`` is the one line a fastdata user edits."""
    for _ in range(10):
        if isinstance(dataset, coco_types):
            break
        if isinstance(dataset, torch.utils.data.Subset):
            dataset = dataset.dataset
    if isinstance(dataset, coco_types):
        return dataset.coco
    return convert_to_coco_api(dataset)


def mean_ap(gt: COCO, detections: list[dict]) -> np.ndarray:
    """``CocoEvaluator``'s bbox evaluation: ``loadRes`` + ``COCOeval``, its 12 stats."""
    evaluator = COCOeval(gt, quiet(gt.loadRes, [dict(d) for d in detections]), "bbox")
    for step in (evaluator.evaluate, evaluator.accumulate, evaluator.summarize):
        quiet(step)
    return evaluator.stats


def references_collate(batch):
    """The references' ``utils.collate_fn``."""
    return tuple(zip(*batch, strict=True))


class ReferencesStyleCoco(fastdata.CocoStoreDataset):
    """How the references subclass ``CocoDetection``: ``super().__getitem__`` then their transforms."""

    def __init__(self, path, transforms):
        super().__init__(path)
        self._transforms = transforms

    def __getitem__(self, idx):
        img, target = super().__getitem__(idx)
        return self._transforms(img, target)


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    summary = make_coco(tmp_path_factory.mktemp("refs"), 16, seed=0, max_boxes=4, size=(120, 160), workers=1)
    assert summary.num_crowd >= 2
    return summary


def test_the_references_path_gives_the_stores_map_equal_to_cocodetections(coco_set, tmp_path):
    store = tmp_path / "coco.lmdb"
    fastdata.convert_coco(coco_set.ann_file, coco_set.image_dir, store, workers=1, progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = CocoDetection(coco_set.image_dir, coco_set.ann_file, transforms=convert_polys)
    ours = ReferencesStyleCoco(store, transforms=convert_polys)
    subset = list(range(len(ours)))  # the references wrap their datasets in Subsets
    theirs_s, ours_s = torch.utils.data.Subset(theirs, subset), torch.utils.data.Subset(ours, subset)

    # a detector that also fires on crowd regions (COCOeval ignores those matches, if it knows them)
    rng = np.random.default_rng(1)
    # with confidence: there the rebuilt ground truth sees confident false positives
    detections = [{"image_id": a["image_id"], "category_id": a["category_id"],
                   "score": float(rng.uniform(0.9, 1) if a["iscrowd"] else rng.uniform(0.2, 0.9)),
                   "bbox": [v + float(rng.normal(0, 1.5)) for v in a["bbox"]]}
                  for a in theirs.coco.dataset["annotations"]]
    assert any(a["iscrowd"] for a in theirs.coco.dataset["annotations"])

    want = mean_ap(get_coco_api_from_dataset(theirs_s), detections)
    rebuilt = mean_ap(get_coco_api_from_dataset(ours_s), detections)  # the references as they are
    edited = get_coco_api_from_dataset(ours_s, coco_types=(CocoDetection, fastdata.CocoStoreDataset))
    assert edited is ours.coco
    got = mean_ap(edited, detections)
    assert np.array_equal(got, want), (got, want)
    assert rebuilt[0] < want[0] - 0.01  # crowd dropped from the rebuilt ground truth: a lower mAP

    # the subclass's __getitem__ is what a DataLoader batch goes through (its targets are dicts)
    loader = torch.utils.data.DataLoader(ours_s, batch_size=5, num_workers=0, collate_fn=references_collate)
    targets = [t for _, batch_targets in loader for t in batch_targets]
    assert len(targets) == len(ours) and all(isinstance(t, dict) and "boxes" in t for t in targets)
