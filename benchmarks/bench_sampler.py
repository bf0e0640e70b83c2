"""Shuffle quality vs read locality of DistributedShardSampler (pure numpy, no storage).

The dataset is label-sorted like an ImageFolder store (``classes x per_class`` samples, labels
``0,0,..,1,1,..``), the worst case for block shuffling. For each sampler the script takes one
rank's index stream over several epochs, cuts it into batches and reports:

* ``labels``: mean distinct labels per batch (i.i.d. expectation printed as a reference line);
* ``tv``: mean total-variation distance between a batch's label histogram and the uniform class
  distribution (the same statistic for the DistributedSampler control is the i.i.d. level);
* ``same_nb``: fraction of consecutive indices with the same label (i.i.d. ~ 1/classes);
* ``runs``: mean number of maximal runs of consecutive indices in a batch's sorted indices
  (i.i.d. ~ batch size);
* ``regions``: the same, merging holes of up to ``gap`` (16) records, i.e. separate storage
  regions a DataLoader worker reads per batch (holes are read by a neighbouring batch anyway);
* ``adjacent``: fraction of consecutive reads that are storage neighbours (index + 1);
* ``shards``: mean distinct shards per batch, the dataset cut into shards of ``--shard-size``
  records (what a rank needs on local disk to read one batch; in shard-window mode the rank
  needs only its current window, ``shard_window`` shards, however many batches it reads).

Shard-window rows (``shard_window=W``) shuffle the shard order and then per index within
windows of W shards (the mode for stores larger than a local cache of remote shards).

Usage: ``python benchmarks/bench_sampler.py [--classes 1000 --per-class 50 --batch 256
--replicas 1 --epochs 4 --shard-size 1000]``. A read-speed part (real stores) can be added on top.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastdata.reader.sampler import DistributedShardSampler  # noqa: E402


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def stream_metrics(stream: np.ndarray, labels: np.ndarray, classes: int, batch: int,
                   gap: int = 16, shard_size: int = 1000) -> dict:
    """Quality/locality figures of one rank's index stream (see module docstring)."""
    n_batches = len(stream) // batch
    batches = stream[: n_batches * batch].reshape(n_batches, batch)
    lab = labels[batches]
    hist = np.zeros((n_batches, classes))
    np.add.at(hist, (np.arange(n_batches)[:, None], lab), 1.0)
    tv = 0.5 * np.abs(hist / batch - 1.0 / classes).sum(axis=1)
    srt = np.sort(batches, axis=1)
    gaps = np.diff(srt, axis=1)
    runs = 1 + (gaps != 1).sum(axis=1)
    regions = 1 + (gaps > gap + 1).sum(axis=1)
    return {
        "labels": float((hist > 0).sum(axis=1).mean()),
        "tv": float(tv.mean()),
        "same_nb": float((labels[stream[1:]] == labels[stream[:-1]]).mean()),
        "runs": float(runs.mean()),
        "regions": float(regions.mean()),
        "adjacent": float((np.diff(stream) == 1).mean()),
        "shards": float(np.mean([len(np.unique(b // shard_size)) for b in batches])),
    }


def run_sampler(sampler, epochs: int, labels, classes: int, batch: int, shard_size: int) -> dict:
    rows = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        rows.append(stream_metrics(np.fromiter(iter(sampler), dtype=np.int64), labels, classes,
                                   batch, shard_size=shard_size))
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=1000,
                        help="records per shard (shard-window rows and the shards column)")
    parser.add_argument("--store", help="also measure cold-cache read speed of this store by sampler")
    args = parser.parse_args(argv)

    n = args.classes * args.per_class
    labels = np.repeat(np.arange(args.classes), args.per_class)
    data = _Sized(n)
    world = dict(num_replicas=args.replicas, rank=0)
    configs = [("DistributedSampler (control)", DistributedSampler(data, **world, seed=0)),
               ("block_size=1", DistributedShardSampler(data, **world, block_size=1))]
    for block in (16, 64, 256):
        for window in (1, block, 4 * block):
            configs.append((f"block_size={block}, window={window}",
                            DistributedShardSampler(data, **world, block_size=block,
                                                    window=window)))
    sizes = [args.shard_size] * (n // args.shard_size) + ([n % args.shard_size] if n % args.shard_size else [])
    for shard_window in (1, 2, 4, 8):
        configs.append((f"shard_window={shard_window}",
                        DistributedShardSampler(data, **world, shard_window=shard_window,
                                                shard_sizes=sizes)))
    iid_labels = args.classes * (1 - (1 - 1 / args.classes) ** args.batch)
    print(f"n={n} ({args.classes} classes x {args.per_class}, label-sorted), batch={args.batch}, "
          f"replicas={args.replicas} (rank 0 shown), epochs 0-{args.epochs - 1}, "
          f"shards of {args.shard_size}; "
          f"i.i.d. distinct labels/batch ~ {iid_labels:.1f}")
    header = (f"{'sampler':34s} {'labels':>7s} {'tv':>6s} {'same_nb':>8s} {'runs':>7s} "
              f"{'regions':>7s} {'adjacent':>8s} {'shards':>6s}")
    print(header)
    print("-" * len(header))
    t0 = time.perf_counter()
    for name, sampler in configs:
        m = run_sampler(sampler, args.epochs, labels, args.classes, args.batch, args.shard_size)
        print(f"{name:34s} {m['labels']:7.1f} {m['tv']:6.3f} {m['same_nb']:8.3f} "
              f"{m['runs']:7.1f} {m['regions']:7.1f} {m['adjacent']:8.3f} {m['shards']:6.1f}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.store:
        read_speed(args.store, args.batch, args.epochs)
    return 0


def read_speed(store: str, batch: int, epochs: int) -> None:
    """Cold-cache storage reads (no decoding) of one rank's epoch, by sampler.

    The page cache of every shard is evicted before each epoch, so this is the
    read pattern a cold local disk or a network filesystem sees.
    """
    import os

    import fastdata
    from fastdata.bench.cache import evict_page_cache
    from fastdata.format.manifest import read_manifest

    files = [os.path.join(store, s["name"]) for s in read_manifest(store)["shards"]]
    datasets = {None: fastdata.open_dataset(store)}
    rows = [("block_size=1 (random)", 1, None), ("block_size=16", 16, None), ("block_size=64", 64, None)]
    if datasets[None].backend == "lmdb":  # control: the OS readahead off (LMDB's MADV_RANDOM)
        datasets[False] = fastdata.open_dataset(store, readahead=False)
        rows.insert(1, ("block_size=1, readahead=False", 1, False))
    print(f"\ncold-cache reads of {store} ({len(datasets[None])} records, batch {batch}; storage only, "
          f"no decode; readahead={datasets[None].readahead} unless shown)")
    print(f"{'sampler':34s} {'records/s':>10s} {'x random':>9s}")
    base = None
    for name, block, readahead in rows:
        ds = datasets[readahead]
        rates = []
        for epoch in range(epochs):
            sampler = DistributedShardSampler(ds, num_replicas=1, rank=0, block_size=block)
            sampler.set_epoch(epoch)
            order = np.fromiter(iter(sampler), dtype=np.int64)
            for each in datasets.values():  # one process maps a shard once: close every user
                each.close()
            evict_page_cache(files)
            t = time.perf_counter()
            for k in range(0, len(order), batch):
                ds._read_batch(order[k:k + batch])
            rates.append(len(order) / (time.perf_counter() - t))
        rate = float(np.median(rates))
        base = base or rate
        print(f"{name:34s} {rate:10.0f} {rate / base:9.2f}")
    for ds in datasets.values():
        ds.close()


if __name__ == "__main__":
    raise SystemExit(main())
