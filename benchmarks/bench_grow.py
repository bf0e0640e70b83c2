"""Growing and combining stores: ``--append`` and ``fastdata merge`` against converting again.

Photo-like JPEGs (``fastdata.synth``, ImageNet-like ~400x350, 10 classes):

* **append**: a store of ``--n`` images (3000) gets 1% more (a new folder of the same classes)
  with ``fastdata.convert(extra, store, append=True)``; the baseline converts the whole grown set
  (the old images and the new, one folder) again. Target: append <= 5% of the reconversion.
* **merge**: two stores (``--n`` and ``--n // 3`` images) merged with ``fastdata.merge`` (hard
  links); the baseline converts both folders again. Target: <= 2% of the reconversions, and no
  extra disk: the merged store's bytes in files that are not hard links of the inputs' (its
  manifest, index file and rejected list only).

Each is timed ``--rounds`` times (3), alternating with its baseline, page cache warm; medians,
and the ratio of the medians. Same machine, same run, ``--workers`` (2) conversion workers.

Usage::

    python benchmarks/bench_grow.py                  # 3000 images
    python benchmarks/bench_grow.py --n 300 --rounds 1   # a quick check that it works
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APPEND_TARGET = 0.05
MERGE_TARGET = 0.02
CLASSES = 10


def make_folder(root: Path, n: int, seed: int, workers: int) -> Path:
    from fastdata.synth import make_image_folder

    make_image_folder(root, num_classes=CLASSES, per_class=max(1, n // CLASSES), seed=seed, workers=workers)
    return root


def combined(root: Path, *folders: Path) -> Path:
    """One ImageFolder tree holding every image of ``folders`` (hard links: no copy)."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                rel = path.relative_to(folder)
                target = root / rel.parent / f"{folder.name}-{rel.name}"  # (the folders reuse file names)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)
    return root


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def extra_disk(merged: Path, *inputs: Path) -> tuple[int, int]:
    """``(shard bytes, metadata bytes)`` of files in ``merged`` that are not hard links of a file of
    ``inputs`` (the metadata: its manifest, store index file and rejected list)."""
    theirs = {os.stat(p).st_ino for root in inputs for p in root.iterdir() if p.is_file()}
    new = [p for p in merged.iterdir() if p.is_file() and p.stat().st_ino not in theirs]
    shards = sum(p.stat().st_size for p in new if p.name.startswith("shard-"))
    return shards, sum(p.stat().st_size for p in new) - shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="images of the store appended to (default 3000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    import fastdata

    base = Path(tempfile.mkdtemp(prefix="bench-grow-"))
    try:
        src = make_folder(base / "src", args.n, 0, args.workers)
        extra = make_folder(base / "extra", max(CLASSES, args.n // 100), 1, args.workers)
        other = make_folder(base / "other", max(CLASSES, args.n // 3), 2, args.workers)
        grown = combined(base / "grown", src, extra)
        convert = lambda s, d: fastdata.convert(str(s), str(d), workers=args.workers, progress=False,  # noqa: E731
                                                overwrite=True)
        store_a, store_b = base / "a.lmdb", base / "b.lmdb"
        convert(src, store_a)
        convert(other, store_b)
        append_s, reconvert_s, merge_s, both_s = [], [], [], []
        for _ in range(args.rounds):
            work = base / "work.lmdb"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(store_a, work)
            append_s.append(timed(lambda: fastdata.convert(str(extra), str(work), workers=args.workers,  # noqa: B023
                                                           progress=False, append=True)))
            reconvert_s.append(timed(lambda: convert(grown, base / "again.lmdb")))
            shutil.rmtree(base / "merged.lmdb", ignore_errors=True)
            merge_s.append(timed(lambda: fastdata.merge([store_a, store_b], base / "merged.lmdb")))
            both_s.append(timed(lambda: (convert(src, base / "a2.lmdb"), convert(other, base / "b2.lmdb"))))
        assert len(fastdata.open_dataset(base / "work.lmdb")) == len(fastdata.open_dataset(base / "again.lmdb"))
        assert fastdata.verify(str(base / "merged.lmdb")).ok
        med = statistics.median
        result = {
            "n": args.n, "appended": len(fastdata.open_dataset(base / "work.lmdb")) - args.n,
            "merged": len(fastdata.open_dataset(base / "merged.lmdb")), "rounds": args.rounds,
            "workers": args.workers, "append_s": med(append_s), "reconvert_s": med(reconvert_s),
            "append_ratio": med(append_s) / med(reconvert_s), "merge_s": med(merge_s),
            "convert_both_s": med(both_s), "merge_ratio": med(merge_s) / med(both_s),
            "merge_extra_shard_bytes": extra_disk(base / "merged.lmdb", store_a, store_b)[0],
            "merge_metadata_bytes": extra_disk(base / "merged.lmdb", store_a, store_b)[1],
            "merged_shard_bytes": sum(s["bytes"] for s in json.loads(
                (base / "merged.lmdb" / "manifest.json").read_text())["shards"]),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"append {result['appended']} images to a store of {args.n}: {result['append_s']:.3f} s; converting "
          f"all {args.n + result['appended']} again: {result['reconvert_s']:.2f} s; ratio {result['append_ratio']:.3f} "
          f"(target <= {APPEND_TARGET})")
    print(f"merge two stores ({result['merged']} images): {result['merge_s']:.3f} s; converting both again: "
          f"{result['convert_both_s']:.2f} s; ratio {result['merge_ratio']:.4f} (target <= {MERGE_TARGET}); extra "
          f"disk: {result['merge_extra_shard_bytes']:,} bytes of shards (of {result['merged_shard_bytes']:,}) and "
          f"{result['merge_metadata_bytes']:,} bytes of manifest, index and rejected list")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
