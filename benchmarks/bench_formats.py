"""Format comparison: image folder vs LMDB vs HDF5, warm and cold page cache, large and small images.

Everything runs through the benchmark harness (``fastdata.bench``): each
configuration in a fresh process, median images/s over the measured epochs after
one warm-up epoch, peak PSS of main + workers. The folder is read the way users
start (ImageFolder-equivalent: PIL decode, PIL transforms); the stores through
fastdata.

Datasets (generated with ``fastdata.synth``, photo-like content):

* ``imagenet``: ImageNet-like JPEGs (widths 300-500 px, mostly 40-120 KB),
  RandomResizedCrop(224) to uint8 tensors, batch 64;
* ``cifar``: 32x32 JPEGs, full decode to uint8 tensors, batch 256; also a
  ``--raw 32x32`` LMDB store (decoded pixels, no JPEG decode at read time).

Each dataset is measured warm (cache filled by the warm-up epoch) and cold (every
file of the target evicted from the page cache before each epoch, with
``posix_fadvise``), with 0 workers and with one worker per core. The summary
prints every format's images/s as a ratio to the folder baseline of the same
dataset, cache state and worker count.

Usage::

    python benchmarks/bench_formats.py                 # full size (2000 + 20000 images; ~15 min on 2 cores)
    python benchmarks/bench_formats.py --size small    # smoke size (~3 min on 2 cores)
    python benchmarks/bench_formats.py --data /tmp/fmt # keep/reuse the generated data
    python benchmarks/bench_formats.py --out benchmarks/results/formats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdata  # noqa: E402
from fastdata.bench.grid import available_cores, expand_grid  # noqa: E402
from fastdata.bench.harness import run_bench  # noqa: E402
from fastdata.bench.report import fingerprint  # noqa: E402
from fastdata.synth import make_image_folder  # noqa: E402

#: per size: dataset -> (classes, per_class, batch_size, max_batches (0 = whole epoch))
SIZES = {
    "full": {"imagenet": (10, 200, 64, 0), "cifar": (10, 2000, 256, 0)},
    "small": {"imagenet": (4, 40, 32, 0), "cifar": (10, 100, 256, 0)},
}
PIPELINE = {"imagenet": "rrc224", "cifar": "none"}


def make_data(base: Path, size: str, workers: int, log=print) -> dict:
    """Generate (or reuse) the datasets and their stores. Returns ``{dataset: {format: path}}``."""
    out = {}
    for name, (classes, per_class, _, _) in SIZES[size].items():
        root = base / f"{name}-{size}"
        src = root / "images"
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            t0 = time.perf_counter()
            synth = make_image_folder(src, classes, per_class, size=name, seed=0, workers=workers)
            log(f"{name}: {synth.num_images} images, {synth.total_bytes / synth.num_images / 1024:.1f} KiB mean "
                f"({time.perf_counter() - t0:.0f} s)")
            fastdata.convert(str(src), str(root / "store.lmdb"), workers=workers, progress=False)
            fastdata.convert(str(src), str(root / "store.h5"), workers=workers, progress=False)
            if name == "cifar":
                fastdata.convert(str(src), str(root / "raw.lmdb"), workers=workers, raw="32x32", progress=False)
            (root / ".complete").write_text("ok\n")
        out[name] = {"folder": str(src), "lmdb": str(root / "store.lmdb"), "hdf5": str(root / "store.h5")}
        if name == "cifar":
            out[name]["lmdb-raw"] = str(root / "raw.lmdb")
    return out


def format_of(row: dict, paths: dict) -> str:
    """The format label of a row (``folder``, ``lmdb``, ``hdf5``, ``lmdb-raw``)."""
    for label, path in paths.items():
        if os.path.abspath(path) == row["target"]:
            return label
    return row["kind"]


def measure(data: dict, size: str, workers: list, epochs: int, out: Path, log=print) -> list:
    """Run the grid for every dataset, warm and cold. Returns rows tagged ``dataset``, ``format``, ``cache``."""
    rows = []
    for name, paths in data.items():
        _, _, batch, max_batches = SIZES[size][name]
        for cold in (False, True):
            cache = "cold" if cold else "warm"
            log(f"\n== {name}, {cache} cache: {', '.join(paths)} x num_workers {', '.join(map(str, workers))}")
            configs = expand_grid(list(paths.values()), workers=workers, batch_size=[batch],
                                  transform=PIPELINE[name], output="tensor", epochs=epochs, warmup_epochs=1,
                                  max_batches=max_batches, cold=cold, persistent_workers="on")
            result = run_bench(configs, str(out / f"{name}-{cache}"), timeout=1800)
            log(result.table)
            for row in result.rows:
                rows.append({**row, "dataset": name, "format": format_of(row, paths), "cache": cache})
    return rows


def ratios(rows: list) -> list:
    """One entry per (dataset, cache, workers, format): images/s, peak PSS and the ratio to the folder."""
    out = []
    keys = sorted({(r["dataset"], r["cache"], r["workers"]) for r in rows},
                  key=lambda k: (k[0] != "imagenet", k[0], k[1] != "warm", k[2]))
    for dataset, cache, workers in keys:
        group = [r for r in rows if (r["dataset"], r["cache"], r["workers"]) == (dataset, cache, workers)]
        folder = next((r for r in group if r["format"] == "folder" and r["status"] == "ok"), None)
        for r in group:
            ok = r["status"] == "ok"
            out.append({
                "dataset": dataset, "cache": cache, "workers": workers, "format": r["format"],
                "images_per_s": r["images_per_s"] if ok else None,
                "mb_per_s": r["mb_per_s"] if ok else None,
                "peak_pss_bytes": r["peak_pss_bytes"] if ok else None,
                "vs_folder": (r["images_per_s"] / folder["images_per_s"]) if ok and folder else None,
                "error": None if ok else r["error"],
            })
    return out


def markdown(entries: list, machine: dict) -> str:
    """The README table: rows = dataset/cache/workers, columns = formats (images/s and ratio)."""
    formats = [f for f in ("folder", "lmdb", "hdf5", "lmdb-raw") if any(e["format"] == f for e in entries)]
    head = "| dataset | cache | workers | " + " | ".join(formats) + " |"
    lines = [head, "|" + "---|" * (3 + len(formats))]
    seen = []
    for e in entries:
        key = (e["dataset"], e["cache"], e["workers"])
        if key not in seen:
            seen.append(key)
    for key in seen:
        cells = []
        for f in formats:
            e = next((x for x in entries if (x["dataset"], x["cache"], x["workers"]) == key and x["format"] == f), None)
            if e is None:
                cells.append("")
            elif e["images_per_s"] is None:
                cells.append("failed")
            elif f == "folder":
                cells.append(f"{e['images_per_s']:.0f}/s")
            elif e["vs_folder"] is None:
                cells.append(f"{e['images_per_s']:.0f}/s")
            else:
                cells.append(f"{e['images_per_s']:.0f}/s ({e['vs_folder']:.2f}x)")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    gib = machine["memory_bytes"] / 2**30
    lines.append("")
    lines.append(f"Measured on {machine['cores']} cores ({machine['cpu']}), {gib:.0f} GiB RAM, {machine['os']}; "
                 f"Python {machine['python']}, torch {machine['torch']}, Pillow {machine['Pillow']}, "
                 f"lmdb {machine['lmdb']}, h5py {machine['h5py']}. images/s: median of the measured epochs; "
                 "(x) = ratio to the image folder read like torchvision's ImageFolder.")
    return "\n".join(lines)


def plot(entries: list, path: str) -> str:
    """Grouped bars: images/s ratio to the folder per scenario (workers = the most measured)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    most = max(e["workers"] for e in entries)
    chosen = [e for e in entries if e["workers"] == most and e["vs_folder"] is not None]
    scenarios = list(dict.fromkeys((e["dataset"], e["cache"]) for e in chosen))
    formats = list(dict.fromkeys(e["format"] for e in chosen))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / max(1, len(formats))
    for i, f in enumerate(formats):
        ys = [next((e["vs_folder"] for e in chosen if (e["dataset"], e["cache"]) == s and e["format"] == f), 0)
              for s in scenarios]
        ax.bar([x + i * width for x in range(len(scenarios))], ys, width, label=f)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(formats) - 1) / 2 for x in range(len(scenarios))])
    ax.set_xticklabels([f"{d}\n{c} cache" for d, c in scenarios])
    ax.set_ylabel("images/s relative to the image folder")
    ax.set_title(f"Loading throughput, num_workers={most}")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="dataset sizes (default full)")
    p.add_argument("--workers", default=None, help="comma list of num_workers (default: 0 and the core count)")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs after one warm-up (default 2)")
    p.add_argument("--data", default=None, help="folder to keep/reuse the generated data (default: temporary)")
    p.add_argument("--out", default="benchmarks/results/formats", help="folder for results (JSON, tables, plots)")
    args = p.parse_args(argv)
    cores = available_cores()
    workers = [int(w) for w in args.workers.split(",")] if args.workers else sorted({0, cores})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fastdata-formats-"))
    base.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        data = make_data(base, args.size, cores)
        rows = measure(data, args.size, workers, args.epochs, out)
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    machine = fingerprint()
    entries = ratios(rows)
    table = markdown(entries, machine)
    (out / "formats.json").write_text(json.dumps({"machine": machine, "size": args.size, "summary": entries,
                                                  "rows": rows}, indent=2))
    (out / "formats.md").write_text(table + "\n")
    plot(entries, str(out / "formats.png"))
    print("\n" + table)
    print(f"\nwrote {out}/formats.json, formats.md, formats.png ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
