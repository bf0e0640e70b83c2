"""Loading through ``ds.subset(...)`` vs reading the store directly, with the same pipeline.

One store of photo-like JPEGs (``fastdata.synth``, ImageNet-like ~400x350, 10 classes), read
three ways through the same pipeline: ``decode=fastdata.transforms.RandomResizedCrop(224)``,
``output="tensor"``, ``fastdata.loader`` with ``--workers`` persistent workers (2), batch
``--batch-size`` (64), shuffled:

* ``direct``  the dataset itself;
* ``all``     ``ds.subset(all indices, sorted)``: the view's own cost (index mapping, epoch tag);
* ``half``    a 50% random subset (``fastdata.random_split(ds, [0.5, 0.5], seed=0)[0]``, sorted):
              per-sample throughput when every other record is skipped.

The store is read from the page cache (warmed first). After a warm-up epoch of each, epochs
alternate ``direct, all, half`` for ``--rounds`` rounds (3); rates are samples/s, medians over
rounds, and each ratio is the median of the rounds' own ratios to ``direct`` (a round's epochs
are adjacent in time, so a slow minute of a shared machine hits all three).

Target: ``all`` >= 0.95x ``direct``.

Usage::

    python benchmarks/bench_subset.py                       # 3000 images
    python benchmarks/bench_subset.py --n 300 --rounds 2    # a quick check that it works
    python benchmarks/bench_subset.py --data /tmp/bench-subset   # keep and reuse the images and the store
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

TARGET_RATIO = 0.95
CLASSES = 10


def prepare(base: Path, n: int, workers: int) -> Path:
    """The synthetic ImageFolder tree and its LMDB store (reused when ``base`` already holds them)."""
    import fastdata
    from fastdata.synth import make_image_folder

    marker = base / ".bench-complete"
    store = base / "photos.lmdb"
    if not marker.exists() or marker.read_text() != str(n):
        shutil.rmtree(base / "src", ignore_errors=True)
        make_image_folder(base / "src", num_classes=CLASSES, per_class=max(1, n // CLASSES), seed=0,
                          workers=workers)
        fastdata.convert(str(base / "src"), str(store), workers=workers, overwrite=True, progress=False)
        marker.write_text(str(n))
    return store


def warm(root: Path) -> int:
    """Read every file under ``root`` once (page cache); returns the bytes read."""
    total = 0
    for f in root.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    total += len(chunk)
    return total


def epoch(loader: Any) -> tuple[int, float]:
    """Samples read and seconds taken by one pass over ``loader``."""
    t0 = time.perf_counter()
    count = 0
    for _images, labels in loader:
        count += len(labels)
    return count, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="images in the store (default 3000)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three epochs (default 3)")
    p.add_argument("--data", default=None, help="folder for the images and the store (kept and reused); "
                   "default a temporary folder, removed at the end")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)

    import numpy as np

    import fastdata
    from fastdata import transforms

    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fastdata-bench-subset-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        store = prepare(base, args.n, max(1, args.workers))
        store_bytes = warm(store)

        def open_ds():
            return fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(224), seed=0)

        direct = open_ds()
        n = len(direct)
        print(f"store ready: {n} images, {store_bytes / 1e6:.0f} MB ({time.perf_counter() - t0:.0f} s); "
              f"fastdata from {os.path.dirname(fastdata.__file__)}", flush=True)
        sets = {"direct": direct, "all": open_ds().subset(np.arange(n)),
                "half": fastdata.random_split(open_ds(), [0.5, 0.5], seed=0)[0]}
        loaders = {name: fastdata.loader(ds, batch_size=args.batch_size, num_workers=args.workers, shuffle=True,
                                         pin_memory=False) for name, ds in sets.items()}
        for loader in loaders.values():
            epoch(loader)  # warm-up: worker start, handles opened
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for r in range(args.rounds):
            line = []
            for name, loader in loaders.items():
                count, secs = epoch(loader)
                assert count == len(sets[name]), f"{name} read {count} samples, expected {len(sets[name])}"
                rates[name].append(count / secs)
                line.append(f"{name} {count / secs:.0f}/s")
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(line), flush=True)
        ratios = {name: statistics.median(s / d for s, d in zip(rates[name], rates["direct"], strict=True))
                  for name in ("all", "half")}
        print()
        print(f"machine: {os.cpu_count()} logical cores; {n} images (~400x350), RandomResizedCrop(224) -> tensor, "
              f"{args.workers} workers, batch {args.batch_size}, warm page cache; medians of {args.rounds} rounds")
        for name in loaders:
            print(f"{name:>7}: {statistics.median(rates[name]):.0f} samples/s ({len(sets[name])} samples an epoch)")
        mark = "ok" if ratios["all"] >= TARGET_RATIO else "BELOW TARGET"
        print(f"subset(all, sorted) / direct: {ratios['all']:.3f}x (target >= {TARGET_RATIO}x: {mark})")
        print(f"50% random subset / direct:   {ratios['half']:.3f}x (per sample)")
        if args.json:
            raw = {"rates": rates, "ratios": ratios, "images": n, "workers": args.workers,
                   "batch_size": args.batch_size}
            Path(args.json).write_text(json.dumps(raw, indent=2))
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
