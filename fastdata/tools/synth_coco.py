"""A synthetic COCO-format detection dataset for the tests, the benchmarks and the examples.

:func:`make_coco` writes ``root/images/*.jpg`` and ``root/annotations.json`` shaped like
COCO's ``instances_*.json``: photo-like JPEGs (the generator of :mod:`fastdata.tools.synth`)
with the annotated objects painted into them, so that a detector can learn something; each
object has a polygon segmentation and the box around it (inside the image); some images
carry an ``iscrowd`` annotation whose segmentation is uncompressed RLE (``counts`` a list
of ints, column-major, as pycocotools writes it); some images have no annotation at all.
The file exercises what a reader must get right: category ids with gaps (COCO's run 1..90
with 80 used), image ids that are neither contiguous nor in file order (so sorting by id
matters), annotations in an order unrelated to their images, crowd areas as JSON integers
next to float areas, and COCO's key order in every dict.

Everything is a pure function of the arguments: the same call writes the same bytes,
whatever the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastdata.tools.synth import cv2, encode_jpeg, jpeg_quality_for, render_photo

__all__ = ["CocoSynthSummary", "make_coco", "DEFAULT_CATEGORY_IDS", "rle_encode"]

#: a spread of COCO's own category ids: gaps where COCO has them (12, 26, 29, 30, 45, 66, 68...)
DEFAULT_CATEGORY_IDS = (1, 2, 3, 4, 6, 8, 11, 13, 18, 25, 27, 31, 44, 46, 62, 67, 70, 90)


@dataclass(frozen=True)
class CocoSynthSummary:
    """What :func:`make_coco` wrote.

    Attributes:
        root: the dataset folder.
        image_dir: ``root/images``, the folder ``file_name`` is relative to.
        ann_file: ``root/annotations.json``.
        num_images: images written (every one listed in the file).
        num_annotations: annotations in the file (crowd ones included).
        num_crowd: annotations with ``iscrowd`` 1 (RLE segmentation).
        num_empty: images without any annotation.
        total_bytes: sum of the JPEG file sizes.
        elapsed_s: wall-clock seconds spent.
    """

    root: str
    image_dir: str
    ann_file: str
    num_images: int
    num_annotations: int
    num_crowd: int
    num_empty: int
    total_bytes: int
    elapsed_s: float


def rle_encode(mask: np.ndarray) -> dict:
    """Uncompressed COCO RLE of a binary ``(h, w)`` mask: ``{"counts": [...], "size": [h, w]}``.

    Runs alternate zeros and ones over the column-major pixels and start with zeros
    (a leading 0 when the first pixel is set), as ``pycocotools.mask`` expects.
    """
    flat = np.asarray(mask, dtype=bool).flatten(order="F")
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], changes, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat.size and flat[0]:
        counts = [0] + counts
    return {"counts": [int(c) for c in counts], "size": [int(mask.shape[0]), int(mask.shape[1])]}


def _polygon(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A star-shaped polygon (k, 2) of float pixel coordinates inside the image."""
    side = min(h, w)
    radius = float(rng.uniform(0.04, 0.3)) * side
    cx = float(rng.uniform(radius * 0.5, w - radius * 0.5))
    cy = float(rng.uniform(radius * 0.5, h - radius * 0.5))
    k = int(rng.integers(5, 13))
    angles = np.sort(rng.uniform(0, 2 * np.pi, k))
    radii = radius * rng.uniform(0.45, 1.0, k)
    pts = np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], axis=1)
    # inside the image, with room for the painted edge: COCO boxes never leave the canvas
    pts[:, 0] = np.clip(pts[:, 0], 0.0, w - 1.0)
    pts[:, 1] = np.clip(pts[:, 1], 0.0, h - 1.0)
    return np.round(pts, 2)


def _polygon_area(pts: np.ndarray) -> float:
    x, y = pts[:, 0], pts[:, 1]
    return float(abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))) / 2.0)


def _object(rng: np.random.Generator, h: int, w: int, category_id: int) -> dict:
    """One annotated object: one polygon, sometimes two (an occluded object in two parts)."""
    polygons = [_polygon(rng, h, w) for _ in range(1 if rng.random() < 0.85 else 2)]
    allpts = np.concatenate(polygons)
    x0, y0 = allpts.min(axis=0)
    x1, y1 = allpts.max(axis=0)
    return {
        "segmentation": [[float(v) for v in p.reshape(-1)] for p in polygons],
        "area": round(sum(_polygon_area(p) for p in polygons), 4),
        "iscrowd": 0,
        "bbox": [float(x0), float(y0), round(float(x1 - x0), 2), round(float(y1 - y0), 2)],
        "category_id": category_id,
    }


def _crowd_circles(rng: np.random.Generator, h: int, w: int) -> list[tuple[int, int, int]]:
    """A crowd region: a cluster of discs ``(cx, cy, r)``."""
    cx, cy = int(rng.integers(w // 4, 3 * w // 4)), int(rng.integers(h // 4, 3 * h // 4))
    spread = max(4, min(h, w) // 5)
    out = []
    for _ in range(int(rng.integers(3, 9))):
        out.append((int(np.clip(cx + rng.integers(-spread, spread + 1), 0, w - 1)),
                    int(np.clip(cy + rng.integers(-spread, spread + 1), 0, h - 1)),
                    int(rng.integers(3, max(4, spread // 2)))))
    return out


def _crowd_mask(h: int, w: int, circles: list[tuple[int, int, int]]) -> np.ndarray:
    mask = np.zeros((h, w), np.uint8)
    for cx, cy, r in circles:
        cv2.circle(mask, (cx, cy), r, 1, -1)
    return mask


def _crowd_object(h: int, w: int, circles: list[tuple[int, int, int]], category_id: int) -> dict:
    mask = _crowd_mask(h, w, circles)
    ys, xs = np.nonzero(mask)
    return {
        "segmentation": rle_encode(mask),
        "area": int(mask.sum()),  # COCO's crowd areas are JSON integers (pixel counts)
        "iscrowd": 1,
        "bbox": [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)],
        "category_id": category_id,
    }


def _category_colour(category_id: int) -> tuple[float, float, float]:
    rgb = np.random.default_rng([category_id, 0xC0C0]).uniform(20, 235, 3)
    return (float(rgb[0]), float(rgb[1]), float(rgb[2]))


def _paint_task(task: tuple) -> int:
    """Render one image with its objects painted in, write it, return its size in bytes."""
    path, seed, index, h, w, polygons, crowds, quality = task
    rng = np.random.default_rng([seed, index, 0x1AA6E])
    img = render_photo(rng, h, w, rng.uniform(-40.0, 40.0, 3))
    for category_id, parts in polygons:
        pts = [np.round(np.asarray(p, np.float64).reshape(-1, 2)).astype(np.int32) for p in parts]
        cv2.fillPoly(img, pts, _category_colour(category_id), cv2.LINE_AA)
    for category_id, circles in crowds:
        colour = _category_colour(category_id)
        for cx, cy, r in circles:
            cv2.circle(img, (cx, cy), r, colour, -1)
    q = jpeg_quality_for(rng, h, w) if quality is None else int(quality)
    data = encode_jpeg(np.clip(img, 0, 255).astype(np.uint8), q)
    with open(path, "wb") as fh:
        fh.write(data)
    return len(data)


def _categories(categories: int | list[dict] | None) -> list[dict]:
    if categories is None:
        categories = len(DEFAULT_CATEGORY_IDS)
    if isinstance(categories, int):
        if not 1 <= categories <= len(DEFAULT_CATEGORY_IDS):
            raise ValueError(f"categories must be 1..{len(DEFAULT_CATEGORY_IDS)} or a list of dicts")
        return [{"supercategory": f"group_{cid // 20}", "id": cid, "name": f"thing_{cid}"}
                for cid in DEFAULT_CATEGORY_IDS[:categories]]
    if not categories or not all(isinstance(c, dict) and isinstance(c.get("id"), int) for c in categories):
        raise ValueError("categories must be a non-empty list of dicts with an integer 'id'")
    return list(categories)


def _geometry(rng: np.random.Generator, size: tuple[int, int]) -> tuple[int, int]:
    """(height, width) within +-12% of ``size``, like COCO's photos of one typical size."""
    h = int(round(size[0] * rng.uniform(0.88, 1.12)))
    w = int(round(size[1] * rng.uniform(0.88, 1.12)))
    return max(16, h), max(16, w)


def make_coco(
    root: str | os.PathLike,
    n_images: int,
    *,
    seed: int = 0,
    min_boxes: int = 1,
    max_boxes: int = 20,
    size: tuple[int, int] = (350, 400),
    with_crowd_rle: bool = True,
    with_empty_images: bool = True,
    categories: int | list[dict] | None = None,
    quality: int | None = None,
    workers: int = 1,
) -> CocoSynthSummary:
    """Write a COCO-format detection dataset: ``root/images/*.jpg`` and ``root/annotations.json``.

    Args:
        root (str | os.PathLike): output folder (created; files of the same names are overwritten).
        n_images (int): images to write (>= 1).
        seed (int): the output is a pure function of the arguments.
        min_boxes, max_boxes (int): objects per annotated image, drawn uniformly (0 <= min <= max).
        size (tuple[int, int]): typical ``(height, width)``; each image varies by up to 12%.
        with_crowd_rle (bool): about one image in 8 also gets an ``iscrowd`` 1 annotation with
            uncompressed RLE (at least one image when ``n_images >= 2``).
        with_empty_images (bool): about one image in 10 has no annotation (at least one when
            ``n_images >= 2``).
        categories (int | list[dict] | None): how many of :data:`DEFAULT_CATEGORY_IDS` to use
            (all by default), or COCO category dicts (``id``, ``name``, ``supercategory``).
        quality (int | None): JPEG quality, or ``None`` for 85-95 by pixel count.
        workers (int): processes rendering images (1 = this process); the bytes do not depend on it.

    Returns:
        CocoSynthSummary: the paths written and counts.
    """
    if n_images < 1:
        raise ValueError(f"n_images must be >= 1, got {n_images!r}")
    if not 0 <= min_boxes <= max_boxes:
        raise ValueError(f"need 0 <= min_boxes <= max_boxes, got {min_boxes}, {max_boxes}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    t0 = time.perf_counter()
    cats = _categories(categories)
    cat_ids = [c["id"] for c in cats]
    rng = np.random.default_rng([seed, 0xC0C0])
    image_dir = Path(root) / "images"
    image_dir.mkdir(parents=True, exist_ok=True)

    # sparse ids, listed in a shuffled order: a reader must sort them as CocoDetection does
    ids = rng.choice(np.arange(1, 20 * n_images + 2), size=n_images, replace=False)
    empty = set(_pick(rng, n_images, 10, with_empty_images).tolist())
    crowd = set(_pick(rng, n_images, 8, with_crowd_rle).tolist()) - empty
    images, objects, tasks = [], [], []
    for index in range(n_images):
        image_id = int(ids[index])
        h, w = _geometry(rng, size)
        name = f"{image_id:012d}.jpg"
        images.append({"license": int(rng.integers(1, 4)), "file_name": name,
                       "coco_url": f"http://images.example/val/{name}", "height": h, "width": w,
                       "date_captured": f"2013-11-{1 + index % 28:02d} 12:{index % 60:02d}:00",
                       "flickr_url": f"http://farm.example/{image_id}.jpg", "id": image_id})
        n_obj = 0 if index in empty else int(rng.integers(min_boxes, max_boxes + 1))
        mine = [(image_id, _object(rng, h, w, int(rng.choice(cat_ids)))) for _ in range(n_obj)]
        crowds = []
        if index in crowd:
            circles = _crowd_circles(rng, h, w)
            cid = int(rng.choice(cat_ids))
            mine.append((image_id, _crowd_object(h, w, circles, cid)))
            crowds.append((cid, circles))
        objects.extend(mine)
        polys = [(o["category_id"], o["segmentation"]) for _, o in mine if not o["iscrowd"]]
        tasks.append((str(image_dir / name), seed, index, h, w, polys, crowds, quality))

    annotations = _annotation_list(rng, objects)
    document = {
        "info": {"description": "fastdata synthetic COCO-format set", "version": "1.0", "year": 2026,
                 "contributor": "fastdata.tools.synth_coco", "date_created": "2026/01/01"},
        "licenses": [{"url": f"http://licenses.example/{i}", "id": i, "name": f"License {i}"} for i in (1, 2, 3)],
        "images": images,
        "annotations": annotations,
        "categories": cats,
    }
    ann_file = Path(root) / "annotations.json"
    ann_file.write_text(json.dumps(document))
    sizes = _render_all(tasks, workers)
    return CocoSynthSummary(
        root=str(root), image_dir=str(image_dir), ann_file=str(ann_file), num_images=n_images,
        num_annotations=len(annotations), num_crowd=sum(a["iscrowd"] for a in annotations),
        num_empty=len(empty), total_bytes=int(sum(sizes)), elapsed_s=time.perf_counter() - t0)


def _pick(rng: np.random.Generator, n: int, one_in: int, enabled: bool) -> np.ndarray:
    """About ``n / one_in`` distinct image indices (at least one when ``n >= 2``), none when disabled."""
    if not enabled or n < 2:
        return np.zeros(0, dtype=np.int64)
    return rng.choice(n, size=max(1, n // one_in), replace=False)


def _annotation_list(rng: np.random.Generator, objects: list[tuple[int, dict]]) -> list[dict]:
    """Annotation dicts in COCO's key order, listed in a shuffled order, ids unique but not sequential."""
    order = rng.permutation(len(objects))
    ann_ids = np.sort(rng.choice(np.arange(1, 3 * len(objects) + 2), size=len(objects), replace=False))
    out = []
    for ann_id, k in zip(ann_ids.tolist(), order.tolist(), strict=True):
        image_id, obj = objects[k]
        out.append({"segmentation": obj["segmentation"], "area": obj["area"], "iscrowd": obj["iscrowd"],
                    "image_id": image_id, "bbox": obj["bbox"], "category_id": obj["category_id"], "id": ann_id})
    return out


def _render_all(tasks: list[tuple], workers: int) -> list[int]:
    if workers == 1 or len(tasks) < 2:
        return [_paint_task(t) for t in tasks]
    chunk = max(1, len(tasks) // (workers * 8))
    with multiprocessing.get_context().Pool(min(workers, len(tasks))) as pool:
        return list(pool.imap_unordered(_paint_task, tasks, chunksize=chunk))
