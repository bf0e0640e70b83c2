"""A chunked field added to a store (``fastdata.add_fields`` with ``fastdata.fields.Chunked``) against
the same field written with the store from the start: the cost of adding it, and region reads.

Data: ``--n`` (16) label volumes, ``--side``\\ :sup:`3` (128) uint8 (segmentation-mask-like: mostly
0, labels 1..3), stored as ``Chunked("uint8", (32, 32, 32))`` with the default codec.

Row 1, **add vs rewrite** (wall time, the volumes in memory for both): ``add``:
``fastdata.add_fields(store, {"mask": volumes})`` on a store written without the field;
``rewrite``: ``fastdata.write`` of every sample with the field into a new store (a lower bound of a
real rewrite, which also reads the store). Medians of ``--rounds`` alternated runs.

Row 2, **region reads**: ``--reads`` (200) random 48\\ :sup:`3` regions (``ds[i]["mask"][a:a+48, ...]``:
only the chunks a region touches are read and decoded) from each store, one process, from the page
cache; rounds alternate between the stores; the ratio is the median of the rounds' own
``added / written`` ratios of regions/s. Target (the issue's for loading a store with added
fields): >= 0.95x.

Usage::

    python benchmarks/bench_added_chunked.py                      # LMDB, 16 volumes of 128^3
    python benchmarks/bench_added_chunked.py --backend hdf5 --rounds 9
    python benchmarks/bench_added_chunked.py --n 4 --side 64 --rounds 2   # a quick check that it works
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOAD_TARGET = 0.95
REGION = 48


def volumes(n: int, side: int, seed: int = 0) -> list:
    """``n`` mask-like uint8 volumes of ``side``^3 (70% zeros, labels 1..3 elsewhere)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (side, side, side)
    return [((rng.random(shape) < 0.3) * rng.integers(1, 4, shape)).astype(np.uint8) for _ in range(n)]


def region_reads(path: str, n: int, side: int, reads: int, seed: int) -> float:
    """Regions per second of ``reads`` random ``REGION``^3 reads of field ``mask``."""
    import numpy as np

    from fastdata.reader.dataset import StoreDataset

    ds = StoreDataset(path)
    rng = np.random.default_rng(seed)
    region = min(REGION, side)
    start = time.perf_counter()
    for _ in range(reads):
        i = int(rng.integers(n))
        a = rng.integers(0, side - region + 1, 3)
        ds[i]["mask"][a[0]:a[0] + region, a[1]:a[1] + region, a[2]:a[2] + region]
    seconds = time.perf_counter() - start
    ds.close()
    return reads / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16, help="volumes (samples)")
    parser.add_argument("--side", type=int, default=128, help="each volume's side (voxels)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of each row")
    parser.add_argument("--reads", type=int, default=200, help="region reads a round")
    parser.add_argument("--backend", choices=("lmdb", "hdf5"), default="lmdb")
    args = parser.parse_args(argv)

    import fastdata
    from fastdata.fields import Chunked, Float

    suffix = ".lmdb" if args.backend == "lmdb" else ".h5"
    field = Chunked("uint8", (32, 32, 32))
    vols = volumes(args.n, args.side)
    plain = [{"x": float(i)} for i in range(args.n)]
    full = [{"x": float(i), "mask": v} for i, v in enumerate(vols)]
    schema = {"x": Float(), "mask": field}
    root = tempfile.mkdtemp(prefix="bench-added-chunked-")
    try:
        base = os.path.join(root, "base" + suffix)
        fastdata.write(plain, base, progress=False)
        adds, rewrites = [], []
        for r in range(args.rounds):
            store = os.path.join(root, f"a{r}{suffix}")
            shutil.copytree(base, store)
            start = time.perf_counter()
            fastdata.add_fields(store, {"mask": vols}, fields={"mask": field})
            adds.append(time.perf_counter() - start)
            start = time.perf_counter()
            fastdata.write(full, os.path.join(root, f"w{r}{suffix}"), schema=schema, progress=False)
            rewrites.append(time.perf_counter() - start)
        added, written = os.path.join(root, f"a0{suffix}"), os.path.join(root, f"w0{suffix}")
        region_reads(added, args.n, args.side, args.reads, 99)  # warm-up: page cache, imports
        region_reads(written, args.n, args.side, args.reads, 99)
        ratios, speeds_a, speeds_w = [], [], []
        for r in range(args.rounds):
            a = region_reads(added, args.n, args.side, args.reads, r)
            w = region_reads(written, args.n, args.side, args.reads, r)
            speeds_a.append(a)
            speeds_w.append(w)
            ratios.append(a / w)
        add, rewrite = statistics.median(adds), statistics.median(rewrites)
        ratio = statistics.median(ratios)
        print(f"{args.backend}, {args.n} volumes of {args.side}^3 uint8, chunks 32^3, {args.rounds} rounds (medians)")
        print(f"add the chunked field: {add:.3f} s; rewrite with it: {rewrite:.3f} s ({add / rewrite:.0%} of it)")
        print(f"{REGION}^3 region reads: added {statistics.median(speeds_a):.0f}/s, written "
              f"{statistics.median(speeds_w):.0f}/s; ratio {ratio:.3f}x (rounds {min(ratios):.2f}x to "
              f"{max(ratios):.2f}x; target >= {LOAD_TARGET}x)")
        return 0 if ratio >= LOAD_TARGET else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
