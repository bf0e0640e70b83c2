"""Object detection with fastdata: a COCO-format set, converted, trained through ``fastdata.loader``.

What it does, end to end on CPU (well under a minute with the defaults):

1. writes a small synthetic COCO-format dataset (:func:`fastdata.synth_coco.make_coco`:
   JPEGs with painted objects, ``annotations.json`` with boxes, polygons, crowd RLE and
   images without any annotation);
2. converts it with ``fastdata.convert_coco`` (``fastdata convert --coco`` from Python):
   one sample per image, in ``CocoDetection``'s order, every annotation kept;
3. opens the store so that each sample is what torchvision's
   ``wrap_dataset_for_transforms_v2(CocoDetection(...))`` gives: an image and a target
   dict with ``image_id``, ``boxes`` (``tv_tensors.BoundingBoxes``, XYXY) and ``labels``;
4. runs a ``torchvision.transforms.v2`` pipeline that moves the boxes with the image
   (flip, random resized crop), then drops the boxes the crop cut away;
5. trains a few steps of ``fasterrcnn_mobilenet_v3_large_320_fpn`` (built from scratch: no
   weights are downloaded) from a ``fastdata.loader`` with 2 worker processes, printing
   the losses and the images per second.

Usage::

    pip install torch==2.14.1 torchvision==0.29.1 -e ".[bench]"
    python examples/detection.py
    python examples/detection.py --images 16 --steps 3 --batch-size 2 --json summary.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fastdata
from fastdata.synth_coco import make_coco
from fastdata.targets import AddEmptyBoxes

#: COCO's category ids run 1..90 (the synthetic set uses a spread of them); 0 is the background
NUM_CLASSES = 91


def convert(ann_file: str, image_dir: str, store: Path, workers: int) -> None:
    """``fastdata convert --coco ANN_FILE IMAGE_DIR STORE`` from Python (``workers`` writer processes)."""
    report = fastdata.convert_coco(ann_file, image_dir, store, workers=workers, overwrite=True, progress=False)
    print(f"converted {report.images} images into {store} in {report.elapsed:.1f} s")


def train_transforms(size: int) -> Any:
    """Augmentations that transform the image and its boxes together."""
    from torchvision.transforms import v2

    return v2.Compose([
        AddEmptyBoxes(),
        v2.ToImage(),
        v2.RandomHorizontalFlip(p=0.5),
        v2.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True),
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=2),  # drops boxes the crop cut away, and their labels
        v2.ToDtype(torch.float32, scale=True),
    ])


def train(store: Path, *, steps: int, batch_size: int, size: int, workers: int, seed: int) -> dict:
    """Train ``steps`` steps; returns the losses and the images/s of the training loop."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    # each sample is what wrap_dataset_for_transforms_v2(CocoDetection(...)) gives, then transformed
    dataset = fastdata.open_dataset(store, target_format="v2", transforms=train_transforms(size))
    # fastdata.collate gives (list of images, list of targets), what torchvision's detection models take
    loader = fastdata.loader(dataset, batch_size=batch_size, num_workers=workers, seed=seed,
                             collate_fn=fastdata.collate, drop_last=True)
    torch.manual_seed(seed)
    # Built from scratch (nothing downloaded). Sized for a CPU demo: the model works at the crop's size
    # instead of upscaling to 320, and samples fewer proposals and RoIs per image than its defaults
    # (2000 proposals, 512 RoIs), whose box head dominates a CPU step.
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=NUM_CLASSES, min_size=size, max_size=size,
        rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=300, rpn_batch_size_per_image=64,
        box_batch_size_per_image=64)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    losses: list[float] = []
    images_seen, t0 = 0, time.perf_counter()
    while len(losses) < steps:
        for images, targets in loader:
            loss_parts = model(images, targets)
            loss = sum(loss_parts.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            images_seen += len(targets)
            parts = ", ".join(f"{k.removeprefix('loss_')} {v.item():.3f}" for k, v in loss_parts.items())
            rate = images_seen / (time.perf_counter() - t0)
            print(f"step {len(losses):>3}: loss {losses[-1]:.3f} ({parts}); {rate:.1f} images/s", flush=True)
            if len(losses) == steps:
                break
    elapsed = time.perf_counter() - t0
    return {"steps": len(losses), "losses": losses, "images": images_seen, "images_per_s": images_seen / elapsed,
            "final_loss_finite": math.isfinite(losses[-1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=64, help="images in the synthetic COCO set (default 64)")
    p.add_argument("--image-size", type=int, nargs=2, default=(180, 240), metavar=("H", "W"),
                   help="typical image height and width (default 180 240)")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--size", type=int, default=192, help="side of the RandomResizedCrop output (default 192)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader and writer processes (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the dataset and the store here (default: a temporary "
                                                   "folder, deleted at the end)")
    p.add_argument("--json", default=None, help="also write the losses and images/s here")
    args = p.parse_args(argv)

    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fastdata-detection-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        coco = make_coco(base / "coco", args.images, seed=args.seed, max_boxes=8, size=tuple(args.image_size),
                         workers=max(1, args.workers))
        print(f"synthetic COCO set: {coco.num_images} images, {coco.num_annotations} annotations "
              f"({coco.num_empty} images without any) in {coco.elapsed_s:.1f} s")
        store = base / "coco.lmdb"
        convert(coco.ann_file, coco.image_dir, store, args.workers)
        summary = train(store, steps=args.steps, batch_size=args.batch_size, size=args.size, workers=args.workers,
                        seed=args.seed)
        print(f"trained {summary['steps']} steps, {summary['images']} images: {summary['images_per_s']:.1f} images/s, "
              f"loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if summary["final_loss_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
