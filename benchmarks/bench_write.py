"""Speed of ``fastdata.write`` from a map-style dataset, next to the machine's ceiling.

What it measures, in one run on the same generated data:

* **ceiling**: read every file and fully decode it with Pillow over ``--workers``
  processes (a warmed-up pool, only the work timed): :func:`bench_convert.ceiling`,
  the same ceiling ``bench_convert.py`` holds ``convert`` to. No writer that validates
  its images can beat it on this machine.
* **write**: ``fastdata.write(JpegDicts(...), dst, workers=--workers)`` in a child
  process, where ``JpegDicts`` is a map-style dataset of dicts like a detection or
  multi-label set would give: ``image`` (the JPEG's path, or its bytes with
  ``--image bytes``; either way read in the writer's workers), ``label`` (an int, kept
  in the shard index) and ``boxes`` (a ragged ``float32 (k, 4)`` array, 0-8 rows).
  Images/s from the writer's own elapsed time (pool start, read, validate, encode,
  write, fsync, publish).

Ceiling and write runs alternate for ``--rounds`` rounds; each rate is the median over
rounds and the ratio is the median of the rounds' own ratios (a round's two runs are
adjacent in time, so a slow minute of this shared VM hits both).

Target: write >= 0.8x ceiling with 2 workers (what ``convert`` reaches).

The images are ``fastdata.synth.make_image_folder``'s photo-like JPEGs with an
ImageNet-like size distribution (mostly 40-120 KB), read from the page cache (warmed first).

Usage::

    python benchmarks/bench_write.py                       # N=5000, 2 workers, 5 rounds
    python benchmarks/bench_write.py --quick               # smoke test, seconds
    python benchmarks/bench_write.py --n 1000 --rounds 3 --data /tmp/bench-write   # keep/reuse the images
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from bench_convert import ceiling, make_dataset, rate, warm_page_cache  # noqa: E402

from fastdata.fields import Image, Int, Ragged, Schema  # noqa: E402

TARGET_CEILING_RATIO = 0.8
#: declared, not inferred: an inferred schema would store a path given as the image as a string
SCHEMA = Schema.of({"image": Image(), "label": Int(), "boxes": Ragged("float32", (4,))})

# Runs inside the child: one write, its report as JSON on the last stdout line. The dataset
# class comes from this module (importable by name, so the writer's workers can unpickle it).
_RUNNER = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import fastdata
from bench_write import SCHEMA, JpegDicts
files, dst, workers, image_mode = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
samples = JpegDicts(open(files).read().splitlines(), image_mode)
r = fastdata.write(samples, dst, SCHEMA, workers=workers, progress=False)
print(json.dumps({"images": r.images, "rejected": r.rejected, "input_bytes": r.input_bytes,
                  "output_bytes": r.output_bytes, "elapsed": r.elapsed}))
"""

#: the same images through ``fastdata.convert`` of their folder (``--with-convert``)
_CONVERT_RUNNER = """
import json, sys
import fastdata
src, dst, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = fastdata.convert(src, dst, workers=workers, progress=False)
print(json.dumps({"images": r.images, "rejected": r.rejected, "input_bytes": r.input_bytes,
                  "output_bytes": r.output_bytes, "elapsed": r.elapsed}))
"""


class JpegDicts:
    """A map-style dataset of ``{"image", "label", "boxes"}`` dicts over JPEG files.

    ``image`` is the path (``image_mode="path"``: the writer reads it) or the file's bytes
    (``"bytes"``: read here, i.e. in the writer's worker that asks for the sample);
    ``label`` and ``boxes`` are pure functions of the index (the boxes made once, up front).
    """

    def __init__(self, files: list[str], image_mode: str = "path"):
        if image_mode not in ("path", "bytes"):
            raise ValueError(f"image_mode must be 'path' or 'bytes', got {image_mode!r}")
        self.files, self.image_mode = files, image_mode
        # made once (a numpy generator costs ~40 us to create: per item it would be the
        # dataset's cost, not the writer's, and the ceiling pays nothing like it)
        rng = np.random.default_rng(0)
        counts = rng.integers(0, 9, len(files))
        xy = rng.uniform(0, 200, (int(counts.sum()), 2)).astype(np.float32)
        all_boxes = np.concatenate([xy, xy + rng.uniform(4, 100, xy.shape).astype(np.float32)], axis=1)
        self._box_offsets = np.concatenate([[0], np.cumsum(counts)])
        self._boxes = all_boxes

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.files[i]
        if self.image_mode == "bytes":
            with open(path, "rb") as fh:
                image: Any = fh.read()
        else:
            image = path
        boxes = self._boxes[self._box_offsets[i]:self._box_offsets[i + 1]]
        return {"image": image, "label": i % 1000, "boxes": boxes}


def write_in_child(files_list: str, dst: str, workers: int, image_mode: str) -> dict:
    """One ``fastdata.write`` in a fresh Python; returns its report."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(BENCH_DIR), str(BENCH_DIR.parent), files_list, dst,
                           str(workers), image_mode], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"write failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def convert_in_child(src: str, dst: str, workers: int) -> dict:
    """One ``fastdata.convert`` of the image folder in a fresh Python; returns its report."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    proc = subprocess.run([sys.executable, "-c", _CONVERT_RUNNER, src, dst, str(workers)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(BENCH_DIR.parent)))
    if proc.returncode != 0:
        raise RuntimeError(f"convert failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000, help="images (default 5000)")
    p.add_argument("--quick", action="store_true", help="smoke-test size (N=60, 2 rounds)")
    p.add_argument("--workers", type=int, default=2, help="writer and ceiling processes (default 2)")
    p.add_argument("--image", choices=["path", "bytes"], default="path",
                   help="what the dataset gives as the image: its path or its bytes (default path)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved ceiling/write rounds (default 5)")
    p.add_argument("--data", default=None, help="folder for the generated images (kept and reused); "
                                                "default: a temporary folder, deleted at the end")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--with-convert", action="store_true",
                   help="also time fastdata.convert of the same images' folder in each round")
    args = p.parse_args(argv)
    n, rounds = (60, 2) if args.quick else (args.n, args.rounds)

    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fastdata-bench-write-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = make_dataset(base / f"n{n}", n, 10, max(1, args.workers))
        files_list = base / f"n{n}.files"
        files_list.write_text("\n".join(files))
        dataset_bytes = warm_page_cache(files)
        print(f"dataset ready: {len(files)} images, {dataset_bytes / 1e6:.0f} MB "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        dst = str(base / "store.lmdb")
        runs: dict[str, list[dict]] = {"ceiling": [], "write": []}
        for r in range(rounds):
            c = ceiling(files, args.workers)
            w = write_in_child(str(files_list), dst, args.workers, args.image)
            if w["images"] + w["rejected"] != len(files):
                raise RuntimeError(f"the write stored {w['images']} samples and rejected {w['rejected']}, "
                                   f"of {len(files)}")
            runs["ceiling"].append(c)
            runs["write"].append(w)
            extra = ""
            if args.with_convert:
                cv = convert_in_child(str(base / f"n{n}"), str(base / "convert.lmdb"), args.workers)
                runs.setdefault("convert", []).append(cv)
                extra = f", convert {rate(cv)[0]:.0f} img/s ({rate(cv)[0] / rate(c)[0]:.2f}x)"
            print(f"round {r + 1}/{rounds}: ceiling {rate(c)[0]:.0f} img/s, write {rate(w)[0]:.0f} img/s "
                  f"({rate(w)[0] / rate(c)[0]:.2f}x){extra}", flush=True)
        ratio = statistics.median(rate(w)[0] / rate(c)[0] for c, w in zip(runs["ceiling"], runs["write"],
                                                                             strict=True))
        c_img = statistics.median(rate(c)[0] for c in runs["ceiling"])
        w_img = statistics.median(rate(w)[0] for w in runs["write"])
        mb = w_img * dataset_bytes / len(files) / 1e6  # the writer's report counts samples, not input bytes
        print()
        print(f"machine: {os.cpu_count()} logical cores; {len(files)} images, {dataset_bytes / 1e6:.1f} MB "
              f"({dataset_bytes / len(files) / 1e3:.0f} KB/image); image given as {args.image}; "
              f"{args.workers} processes; medians of {rounds} rounds")
        print(f"ceiling (read + full decode): {c_img:.0f} img/s")
        print(f"fastdata.write:               {w_img:.0f} img/s ({mb:.1f} MB/s of input)")
        if args.with_convert:
            cv_ratio = statistics.median(rate(v)[0] / rate(c)[0] for c, v in zip(runs["ceiling"], runs["convert"],
                                                                                 strict=True))
            print(f"convert / ceiling: {cv_ratio:.2f}x (same rounds)")
        mark = "ok" if ratio >= TARGET_CEILING_RATIO else "BELOW TARGET"
        print(f"write / ceiling: {ratio:.2f}x (median of per-round ratios; target >= {TARGET_CEILING_RATIO}x: {mark})")
        rejected = sum(w["rejected"] for w in runs["write"])
        if rejected:
            print(f"warning: {rejected} sample(s) rejected", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "ratio": ratio, "images": len(files),
                                                   "workers": args.workers, "image": args.image}, indent=2))
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
