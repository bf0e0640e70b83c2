"""Does ``fastdata tune`` pick what ``fastdata bench`` measures as fastest? And is its memory prediction right?

On one generated store (photo-like JPEGs of ImageNet-like, mixed sizes), the script:

1. runs the tuner exactly as ``fastdata tune STORE --memory-budget B --batch-size N
   --transform T`` does (every trial in a fresh process), once by default and once
   with ``--allow-no-workers``;
2. measures the ``fastdata bench`` grid over ``--workers 0..cores`` for the same
   store, transform, batch size and run length, together with the two picks, in
   ``--rounds`` interleaved rounds (a slow spell of the machine hits every row alike);
3. prints, per pick, the median images/s of the pick, of the best bench row it was
   allowed to pick (with workers for the default; any row with ``--allow-no-workers``)
   and their ratio, which should be >= 0.9; and the tuner's predicted peak PSS next
   to the peaks measured for the pick (should be within 20%).

Usage::

    python benchmarks/bench_tune.py                          # 800 images, rrc224, batch 64
    python benchmarks/bench_tune.py --transform none --batch 32
    python benchmarks/bench_tune.py --data /tmp/tune-data    # keep/reuse the generated store
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def make_store(data: str, images: int) -> str:
    """Generate (once) an ImageFolder of ImageNet-like images and its LMDB store; returns the store."""
    import fastdata
    from fastdata.synth import make_image_folder

    store = os.path.join(data, f"tune-{images}.lmdb")
    if not os.path.exists(os.path.join(store, "manifest.json")):
        src = os.path.join(data, f"tune-{images}-src")
        make_image_folder(src, num_classes=8, per_class=max(1, images // 8), size="imagenet", seed=11, workers=2)
        fastdata.convert(src, store, workers=2, progress=False)
    return store


def main(argv=None) -> int:
    """Run the comparison and print (and save) the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--transform", default="rrc224", choices=["none", "resize224", "rrc224"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-batches", type=int, default=10, help="batches per epoch (tune's and bench's)")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per run (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", default="8GiB")
    p.add_argument("--data", default=None, help="folder for the generated store (default: a temporary one)")
    p.add_argument("--out", default="benchmarks/results/tune.json")
    args = p.parse_args(argv)

    from fastdata.bench.grid import available_cores, expand_grid
    from fastdata.bench.harness import run_isolated
    from fastdata.bench.report import fingerprint
    from fastdata.bench.tune import config_for, harness_measure, harness_probe, tune
    from fastdata.common.units import parse_size

    data = args.data or tempfile.mkdtemp(prefix="fastdata-bench-tune-")
    store = make_store(data, args.images)
    rows = expand_grid([store], workers=list(range(available_cores() + 1)), batch_size=str(args.batch),
                       transform=args.transform, epochs=args.epochs, warmup_epochs=1, max_batches=args.max_batches)
    base = rows[-1]  # a row with workers: carries the start method
    budget = parse_size(args.budget)
    probe = harness_probe(base)()
    picks = {}
    for name, allow in (("default", False), ("--allow-no-workers", True)):
        result = tune(harness_measure(base), probe, budget, batch_size=args.batch, allow_no_workers=allow,
                      log=lambda line, name=name: print(f"[tune {name}] {line}", flush=True))
        picks[name] = (config_for(base, result.settings), result.predicted_pss)

    configs = list(dict.fromkeys([cfg for cfg, _ in picks.values()] + rows))
    runs: dict = {cfg: [] for cfg in configs}
    for r in range(args.rounds):
        for cfg in configs:
            row = run_isolated(cfg)
            if row["status"] != "ok":
                raise SystemExit(f"{cfg.label()}: {row.get('error')}")
            runs[cfg].append(row)
            print(f"round {r + 1}: {cfg.label():<60} {row['images_per_s']:7.0f} img/s  "
                  f"peak PSS {row['peak_pss_bytes'] / MiB:6.0f} MiB", flush=True)
    median = {cfg: statistics.median(x["images_per_s"] for x in v) for cfg, v in runs.items()}

    report = {"store": store, "images": args.images, "transform": args.transform, "batch": args.batch,
              "max_batches": args.max_batches, "epochs": args.epochs, "rounds": args.rounds,
              "rows": {cfg.label(): median[cfg] for cfg in rows}, "picks": {}, "machine": fingerprint()}
    print(f"\n{args.images} images, transform {args.transform}, batch {args.batch}, medians of {args.rounds} rounds")
    for cfg in rows:
        print(f"  bench  {cfg.label():<60} {median[cfg]:7.0f} img/s")
    for name, (cfg, predicted) in picks.items():
        allowed = rows if name != "default" else [c for c in rows if c.workers]
        best = max(allowed, key=median.get)
        peaks = [x["peak_pss_bytes"] for x in runs[cfg]]
        ratio = median[cfg] / median[best]
        mem_err = predicted / statistics.median(peaks) - 1
        report["picks"][name] = {"pick": cfg.label(), "images_per_s": median[cfg], "best": best.label(),
                                 "best_images_per_s": median[best], "ratio": ratio,
                                 "predicted_pss_bytes": predicted, "measured_peak_pss_bytes": peaks,
                                 "memory_error": mem_err}
        print(f"  tune {name:<19} picks {cfg.label()}: {median[cfg]:.0f} img/s = {ratio:.2f} x the best "
              f"allowed bench row ({best.label()}, {median[best]:.0f}); predicted peak PSS "
              f"{predicted / MiB:.0f} MiB vs measured {statistics.median(peaks) / MiB:.0f} MiB ({mem_err:+.0%})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
