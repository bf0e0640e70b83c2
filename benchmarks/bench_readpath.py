"""In-process read-path speed of one store: ``__getitems__`` batches in the main
process (no DataLoader, no workers), median images/s over several rounds.

It isolates the per-sample cost of fastdata's read path (record read, checksum,
decode policy, fused transform) from process start-up and queue transport, so two
checkouts can be compared on the same store by running it alternately with
``PYTHONPATH`` pointing at each (rounds interleaved, medians compared)::

    for i in 1 2 3; do
      PYTHONPATH=/path/to/old python benchmarks/bench_readpath.py STORE --decode rrc224
      python benchmarks/bench_readpath.py STORE --decode rrc224
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import fastdata
from fastdata import transforms

DECODES = {
    "none": lambda: None,
    "rrc224": lambda: transforms.RandomResizedCrop(224),
    "center224": lambda: transforms.CenterCrop(224, resize=256),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--decode", choices=sorted(DECODES), default="none")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=20, help="batches per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    ds = fastdata.open_dataset(args.store, output="tensor", decode=DECODES[args.decode]())
    if hasattr(ds, "set_epoch"):
        ds.set_epoch(0)
    rng = np.random.default_rng(0)
    rates = []
    ds.__getitems__(list(range(min(len(ds), args.batch_size))))  # open handles, warm the page cache
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.batches):
            ds.__getitems__(rng.integers(0, len(ds), args.batch_size).tolist())
        rates.append(args.batches * args.batch_size / (time.perf_counter() - t0))
    print(json.dumps({"store": args.store, "decode": args.decode, "images_per_s": statistics.median(rates),
                      "rounds": [round(r, 1) for r in rates], "fastdata": fastdata.__file__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
