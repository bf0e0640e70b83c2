"""Reading a COCO-style store vs ``torchvision.datasets.CocoDetection`` from the folder.

Both sides read the same synthetic COCO-format set (:func:`fastdata.synth_coco.make_coco`:
photo-like JPEGs of about 400x350 with 1-20 annotated objects each, polygons, crowd RLE,
a few images without annotations) and return the same samples:

* **torchvision**: ``CocoDetection(IMAGE_DIR, ANNOTATIONS)``: per sample, open and decode
  the JPEG with Pillow (``convert("RGB")``) and look the annotation dicts up with pycocotools;
* **fastdata**: the store ``fastdata.convert_coco`` writes from the same files, opened with
  ``fastdata.open_dataset`` (``ds[i]`` equals ``CocoDetection[i]``: the same PIL pixels and
  annotation dicts).

With ``--output tensor`` both give the image as a ``uint8 (3, H, W)`` tensor instead of a PIL
image (``CocoDetection(..., transform=PILToTensor())`` vs ``open_dataset(store, output="tensor")``):
the same pixels, sent from the workers through shared memory instead of pickled.

With ``--cold`` every file of both sides is evicted from the page cache before each epoch
(``posix_fadvise(DONTNEED)``, :mod:`fastdata.bench.cache`; workers then are not persistent,
so that no process keeps the store mapped), and the fraction still cached right after
eviction is printed: storage, not only decoding, is then part of what is measured.

With ``--target-format v2`` both give torchvision's transforms-v2 samples instead
(``wrap_dataset_for_transforms_v2(CocoDetection(...))`` vs ``target_format="v2"``).

Each is read through a ``torch.utils.data.DataLoader`` with the same settings (``--workers``
persistent worker processes, ``--batch-size``, shuffled), batches collated into the same
``(list of images, list of targets)``: torchvision's detection references' ``collate_fn``
for ``CocoDetection``, ``fastdata.collate`` (what ``fastdata.loader`` uses) for the store,
which sends a batch's tensors through one shared-memory segment. After a warm-up epoch of
each, epochs alternate between the two for ``--rounds`` rounds; rates are medians over
rounds and the speed-up is the median of the rounds' own ratios (a round's two epochs are
adjacent in time, so a slow minute of this shared VM hits both). Files and store are read
from the page cache (warmed first) unless ``--cold``.

Target: fastdata >= 1.8x CocoDetection with 2 workers.

Needs torchvision and pycocotools (e.g. ``pip install torch==2.14.1 torchvision==0.29.1 -e ".[test]"``).

Usage::

    python benchmarks/bench_coco.py                        # 2000 images, 2 workers, 5 rounds
    python benchmarks/bench_coco.py --quick                # smoke test
    python benchmarks/bench_coco.py --cold                 # page cache dropped before every epoch
    python benchmarks/bench_coco.py --output tensor        # uint8 CHW tensors instead of PIL images
    python benchmarks/bench_coco.py --n 1000 --data /tmp/bench-coco   # keep/reuse the set and the store
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_SPEEDUP = 1.8


def as_lists(batch: list) -> tuple[list, list]:
    """``(images, targets)`` of a batch of ``(image, target)`` samples (torchvision's detection
    references' ``collate_fn``; module level so that workers can receive it under any start method)."""
    images, targets = zip(*batch, strict=True)
    return list(images), list(targets)


def prepare(base: Path, n: int, workers: int) -> tuple[Any, Path]:
    """The synthetic COCO set and its fastdata store (both reused when ``base`` already holds them)."""
    import fastdata
    from fastdata.synth_coco import make_coco

    marker = base / ".bench-complete"
    store = base / "coco.lmdb"
    coco_root = base / "coco"
    if not marker.exists() or marker.read_text() != str(n):
        shutil.rmtree(coco_root, ignore_errors=True)
        make_coco(coco_root, n, seed=0, workers=workers)
        fastdata.convert_coco(coco_root / "annotations.json", coco_root / "images", store, workers=workers,
                              overwrite=True, progress=False)
        marker.write_text(str(n))
    return coco_root, store


def warm(paths: list[Path]) -> int:
    """Read every file under ``paths`` once (page cache); returns the bytes read."""
    total = 0
    for root in paths:
        for f in (root.rglob("*") if root.is_dir() else [root]):
            if f.is_file():
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        total += len(chunk)
    return total


def datasets(coco_root: Path, store: Path, target_format: str, output: str) -> dict[str, Any]:
    """The two datasets, giving equal samples."""
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import PILToTensor

    import fastdata

    tv = CocoDetection(str(coco_root / "images"), str(coco_root / "annotations.json"),
                       transform=PILToTensor() if output == "tensor" else None)
    if target_format == "v2":
        tv = wrap_dataset_for_transforms_v2(tv)
    fd = fastdata.open_dataset(store, target_format=target_format, output=output)
    return {"torchvision": tv, "fastdata": fd}


def files_of(coco_root: Path, store: Path) -> dict[str, list[str]]:
    """The files each side reads during an epoch."""
    return {"torchvision": sorted(str(f) for f in (coco_root / "images").iterdir()),
            "fastdata": sorted(str(f) for f in store.rglob("*") if f.is_file())}


def epoch(loader: Any) -> tuple[int, float]:
    """Samples read and seconds taken by one pass over ``loader``."""
    t0 = time.perf_counter()
    count = 0
    for images, _targets in loader:
        count += len(images)
    return count, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="images in the COCO set (default 2000)")
    p.add_argument("--quick", action="store_true", help="smoke-test size (100 images, 2 rounds)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of each side (default 2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target-format", choices=["coco", "v2"], default="coco",
                   help="coco: (PIL image, annotation dicts); v2: torchvision's transforms-v2 samples")
    p.add_argument("--output", choices=["pil", "tensor"], default="pil",
                   help="the image as a PIL image (CocoDetection's) or a uint8 CHW tensor (default pil)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved epoch pairs (default 5)")
    p.add_argument("--cold", action="store_true", help="evict both sides' files from the page cache before "
                                                       "every epoch (workers not persistent)")
    p.add_argument("--data", default=None, help="folder for the COCO set and the store (kept and reused); "
                                                "default: a temporary folder, deleted at the end")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    n, rounds = (100, 2) if args.quick else (args.n, args.rounds)

    import torch

    import fastdata
    from fastdata.bench.cache import evict_page_cache, resident_fraction

    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fastdata-bench-coco-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        coco_root, store = prepare(base, n, max(1, args.workers))
        folder_bytes, store_bytes = warm([coco_root]), warm([store])
        print(f"COCO set ready: {n} images, folder {folder_bytes / 1e6:.0f} MB, store {store_bytes / 1e6:.0f} MB "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        sets = datasets(coco_root, store, args.target_format, args.output)
        collates = {"torchvision": as_lists, "fastdata": fastdata.collate}
        loaders = {name: torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                                     num_workers=args.workers, collate_fn=collates[name],
                                                     persistent_workers=args.workers > 0 and not args.cold,
                                                     worker_init_fn=fastdata.seed_worker)
                   for name, ds in sets.items()}
        for loader in loaders.values():
            epoch(loader)  # warm-up: worker start, handles opened, annotation index loaded
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        cached: dict[str, list[float]] = {name: [] for name in loaders}
        files = files_of(coco_root, store)
        for r in range(rounds):
            line = []
            for name, loader in loaders.items():
                if args.cold:
                    evict_page_cache(files[name])
                    cached[name].append(resident_fraction(files[name]) or 0.0)
                count, secs = epoch(loader)
                assert count == n, f"{name} read {count} samples, expected {n}"
                rates[name].append(count / secs)
                line.append(f"{name} {count / secs:.0f} img/s")
            print(f"round {r + 1}/{rounds}: " + ", ".join(line) +
                  f" ({rates['fastdata'][-1] / rates['torchvision'][-1]:.2f}x)", flush=True)
        speedup = statistics.median(f / t for f, t in zip(rates["fastdata"], rates["torchvision"], strict=True))
        print()
        cache = "warm page cache" if not args.cold else (
            "cold page cache (still cached after eviction: " +
            ", ".join(f"{k} {100 * max(v):.0f}%" for k, v in cached.items()) + ")")
        print(f"machine: {os.cpu_count()} logical cores; {n} images (~400x350, 1-20 objects), "
              f"{args.workers} DataLoader workers, batch {args.batch_size}, target format {args.target_format}, "
              f"images as {args.output}, "
              f"{cache}; medians of {rounds} rounds")
        for name in loaders:
            print(f"{name:>12}: {statistics.median(rates[name]):.0f} img/s")
        mark = "ok" if speedup >= TARGET_SPEEDUP else "BELOW TARGET"
        print(f"fastdata / CocoDetection: {speedup:.2f}x (median of per-round ratios; "
              f"target >= {TARGET_SPEEDUP}x: {mark})")
        if args.json:
            raw = {"rates": rates, "speedup": speedup, "images": n, "workers": args.workers, "cold": args.cold,
                   "target_format": args.target_format, "output": args.output}
            Path(args.json).write_text(json.dumps(raw, indent=2))
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
