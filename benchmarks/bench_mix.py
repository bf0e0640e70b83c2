"""Loading through ``fastdata.mix`` of two stores vs reading one store directly.

The same pipeline on both sides: ``decode=RandomResizedCrop(224)``, ``output="tensor"``,
``fastdata.loader`` with 2 workers (persistent) and batches of 64. *direct*: store A through a
shuffling ``DistributedShardSampler``; *mix*: ``fastdata.mix({"a": A, "b": B}, weights 0.5/0.5,
epoch_size=len(A))`` through ``mix.sampler()`` (the batches combine both stores' parts). Each
loader first runs one untimed epoch (worker start, page cache), then the two alternate epoch by
epoch; the figures are medians of ``--epochs`` timed epochs (images/s) and their ratio, target
>= 0.95. It also times building one epoch's order for ``epoch_size=1,281,167`` (two sources of
1,000,000 and 281,167 samples) in this process.

    python benchmarks/bench_mix.py [--images 2000] [--epochs 3] [--workers 2] [--batch 64] [--dir DIR]

The two stores (ImageNet-like photos from ``fastdata.synth``, ~400x350; B is another store of
the same photos, so that decoding costs the same on both sides) are written under ``--dir`` (a
temporary folder by default) and reused when it already holds them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import fastdata
from fastdata import transforms
from fastdata.synth import make_image_folder


def prepare(base: Path, images: int, seed: int, name: str) -> str:
    """An LMDB store of ``images`` synthetic photos (10 classes), made once under ``base``."""
    store = base / f"{name}.lmdb"
    if not (store / "manifest.json").exists():
        src = base / f"{name}_src"
        make_image_folder(src, num_classes=10, per_class=max(1, images // 10), size="imagenet", seed=seed,
                          workers=2)
        fastdata.convert(str(src), str(store), workers=2, progress=False)
    return str(store)


def opened(path: str):
    return fastdata.open_dataset(path, output="tensor", decode=transforms.RandomResizedCrop(224), seed=0)


def timed_epoch(loader, sampler, epoch: int) -> float:
    """Images/s of one epoch."""
    sampler.set_epoch(epoch)
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch[1])
    return count / (time.perf_counter() - start)


def table_build_seconds() -> float:
    """Seconds to build one epoch's order of 1,281,167 positions over two sources (best of 3)."""

    class Sized:
        def __init__(self, n: int):
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            return i

    m = fastdata.mix({"a": Sized(1_000_000), "b": Sized(281_167)}, weights={"a": 0.5, "b": 0.5},
                     epoch_size=1_281_167)
    best = float("inf")
    for epoch in range(3):
        start = time.perf_counter()
        m.order(epoch)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000, help="images per store (default 2000)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per side (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--dir", default=None, help="where the stores live (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_mix_") as tmp:
        base = Path(args.dir or tmp)
        base.mkdir(parents=True, exist_ok=True)
        # B holds the same photos as A (another store): decoding costs the same on both sides, so
        # the ratio measures the mix, not which store's photos happen to be larger
        path_a, path_b = prepare(base, args.images, 0, "a"), prepare(base, args.images, 0, "b")
        direct_ds = opened(path_a)
        direct_sampler = fastdata.DistributedShardSampler(direct_ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        direct = fastdata.loader(direct_ds, batch_size=args.batch, sampler=direct_sampler, num_workers=args.workers)
        a = opened(path_a)
        mixed = fastdata.mix({"a": a, "b": opened(path_b)}, weights={"a": 0.5, "b": 0.5}, epoch_size=len(a),
                             seed=0, batch_size=args.batch)
        mix_sampler = mixed.sampler(rank=0)
        mix_loader = fastdata.loader(mixed, batch_size=args.batch, sampler=mix_sampler, num_workers=args.workers)
        print(mixed)
        timed_epoch(direct, direct_sampler, 0)  # untimed: workers start, pages come into the cache
        timed_epoch(mix_loader, mix_sampler, 0)
        rates: dict[str, list[float]] = {"direct": [], "mix": []}
        for epoch in range(1, args.epochs + 1):
            rates["direct"].append(timed_epoch(direct, direct_sampler, epoch))
            rates["mix"].append(timed_epoch(mix_loader, mix_sampler, epoch))
        med = {k: statistics.median(v) for k, v in rates.items()}
        for name, values in rates.items():
            print(f"{name:7s} {med[name]:8.1f} img/s  (epochs: {', '.join(f'{v:.1f}' for v in values)})")
        print(f"mix / direct: {med['mix'] / med['direct']:.3f}  (target >= 0.95)")
        print(f"one epoch's order, epoch_size 1,281,167: {table_build_seconds():.3f} s")


if __name__ == "__main__":
    main()
