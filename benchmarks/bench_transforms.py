"""Decode-time transforms vs the PIL pipeline torchvision users start from.

Photo-like synthetic JPEGs (fastdata.synth, ImageNet-like ~400x350 by default) are held
in RAM; each pipeline turns every one into a CROPxCROPx3 uint8 array (224 by default) in
one process with one torch thread (as in a DataLoader worker; PIL is single-threaded):

* ``pil rrc``       PIL decode + convert("RGB"), crop the box, resize BILINEAR to CROP
                    (what torchvision's RandomResizedCrop does to a PIL image)
* ``fastdata rrc``  fastdata.transforms.RandomResizedCrop(CROP), the same crop boxes
* ``pil center``    PIL decode, Resize(RESIZE) BILINEAR on the shorter side, CenterCrop(CROP)
* ``fastdata center``  fastdata.transforms.CenterCrop(CROP, resize=RESIZE)
* ``pil decode`` / ``fastdata decode``  full-size decode only, for scale

Prints the median images/s over ``--repeats`` interleaved passes (after one warm-up
pass) and the ratio to the matching PIL pipeline.

    python benchmarks/bench_transforms.py
    python benchmarks/bench_transforms.py --size 1200x1600   # where DCT scaling pays
    python benchmarks/bench_transforms.py --crop 64 --resize 72
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from fastdata import transforms
from fastdata.synth import synth_jpeg


def _images(n: int, size: str, seed: int) -> list[bytes]:
    spec = "imagenet" if size == "imagenet" else tuple(int(v) for v in size.split("x"))
    return [synth_jpeg(seed, i % 10, i, spec) for i in range(n)]


def _pil_rrc(data: bytes, box: tuple[int, int, int, int], crop: int) -> np.ndarray:
    top, left, h, w = box
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return np.asarray(img.crop((left, top, left + w, top + h)).resize((crop, crop), Image.BILINEAR))


def _pil_center(data: bytes, crop: int, resize: int) -> np.ndarray:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    rw, rh = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    img = img.resize((rw, rh), Image.BILINEAR)
    top, left = int(round((rh - crop) / 2.0)), int(round((rw - crop) / 2.0))
    return np.asarray(img.crop((left, top, left + crop, top + crop)))


def _rates(pipelines: dict[str, Callable[[int], object]], n: int, repeats: int) -> dict[str, float]:
    """Median images/s of each pipeline over ``repeats`` timed passes of ``n`` images.

    Passes are interleaved (A B C, A B C, ...) so that load from other processes on a
    shared machine hits every pipeline alike instead of skewing one of them.
    """
    for fn in pipelines.values():  # warm-up: allocator, lazy imports, CPU caches
        for i in range(n):
            fn(i)
    samples: dict[str, list[float]] = {name: [] for name in pipelines}
    for _ in range(repeats):
        for name, fn in pipelines.items():
            start = time.perf_counter()
            for i in range(n):
                fn(i)
            samples[name].append(n / (time.perf_counter() - start))
    return {name: statistics.median(rates) for name, rates in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print a table; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="images held in RAM (default 200)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes (default 7)")
    parser.add_argument("--size", default="imagenet", help="'imagenet' (300-500 px wide) or HxW")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crop", type=int, default=224, help="output side (default 224)")
    parser.add_argument("--resize", type=int, default=256, help="CenterCrop's shorter-side resize (default 256)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    images = _images(args.n, args.size, args.seed)
    shapes = np.array([transforms.full_decode(d).shape[:2] for d in images])
    rrc = transforms.RandomResizedCrop(args.crop)
    # Both RandomResizedCrop pipelines crop the same boxes: fastdata's draw with a
    # generator reset each pass, and PIL gets the boxes that generator yields.
    box_rng = np.random.default_rng(args.seed)
    boxes = [rrc.get_params(h, w, box_rng) for h, w in shapes]
    state = {"rng": np.random.default_rng(args.seed)}

    def fast_rrc(i: int) -> np.ndarray:
        if i == 0:
            state["rng"] = np.random.default_rng(args.seed)
        return rrc(images[i], state["rng"])

    center = transforms.CenterCrop(args.crop, resize=args.resize)
    pipelines = {
        "pil rrc": lambda i: _pil_rrc(images[i], boxes[i], args.crop),
        "fastdata rrc": fast_rrc,
        "pil center": lambda i: _pil_center(images[i], args.crop, args.resize),
        "fastdata center": lambda i: center(images[i]),
        "pil decode": lambda i: np.asarray(Image.open(io.BytesIO(images[i])).convert("RGB")),
        "fastdata decode": lambda i: transforms.full_decode(images[i]),
    }
    kb = sum(len(d) for d in images) / len(images) / 1024
    print(f"{args.n} JPEGs, mean {shapes[:, 0].mean():.0f}x{shapes[:, 1].mean():.0f} px, {kb:.0f} KB; "
          f"crop {args.crop}, resize {args.resize}; median of {args.repeats} interleaved passes, 1 torch thread")
    rates = _rates(pipelines, args.n, args.repeats)
    print(f"{'pipeline':<18}{'images/s':>10}{'vs PIL':>9}")
    for name, rate in rates.items():
        baseline = "pil " + name.split(" ", 1)[1]
        print(f"{name:<18}{rate:>10.0f}{rate / rates[baseline]:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
