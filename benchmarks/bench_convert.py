"""Conversion speed and memory of ``fastdata convert``, next to the machine's ceiling.

What it measures, all in one run on the same generated data:

* **ceiling**: read every file and fully decode it with Pillow (``Image.open`` +
  ``load``, the work the converter's validation must do anyway), spread over the
  same number of processes (a warmed-up pool; only the work is timed). No
  conversion can beat this on this machine.
* **convert**: ``fastdata.convert`` with 1 and with all workers, run in a child
  process; images/s and MB/s of input from the converter's own elapsed time
  (scan, pool start, read, validate, write, fsync, publish). Reported as a ratio to
  the ceiling of the same process count, and as the speed-up of all workers over 1.
* **memory**: peak PSS of the whole conversion (the child process and every
  descendant: pool workers, forkserver, resource tracker), sampled in a thread,
  for N and 10N images. PSS, not RSS: shared pages are divided among sharers.

Ceiling and conversion runs are interleaved for ``--rounds`` rounds (default 5);
rates are medians over rounds and each ratio is the median of the rounds' own
ratios (a round's runs are adjacent in time): this shared VM's speed drifts by
+-20% from minute to minute, and one run each is not a ratio worth quoting.

Targets: convert >= 0.8x ceiling; >= 1.7x faster with 2 workers
than with 1 on a 2-core machine; peak PSS flat from N to 10N.

The dataset is photo-like JPEGs with an ImageNet-like size distribution
(``fastdata.synth.make_image_folder``, mostly 40-120 KB). The page cache is warmed
before timing so every run reads from memory; disk speed is not what is measured.

Usage::

    python benchmarks/bench_convert.py                # N=500 (memory: 500 and 5000 images)
    python benchmarks/bench_convert.py --quick        # smoke test, seconds
    python benchmarks/bench_convert.py --n 2000 --backend hdf5 --json out.json
    python benchmarks/bench_convert.py --data /tmp/bench-data   # keep/reuse the dataset
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_CEILING_RATIO = 0.8
TARGET_SPEEDUP_2 = 1.7
TARGET_PSS_GROWTH = 1.25  # peak PSS at 10N / at N: "does not grow" with some noise allowance

# Runs inside the child: one conversion, its report as JSON on the last stdout line.
_RUNNER = """
import json, sys, fastdata
src, dst, workers, fmt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
r = fastdata.convert(src, dst, workers=workers, format=fmt, progress=False)
print(json.dumps({"images": r.images, "rejected": r.rejected, "input_bytes": r.input_bytes,
                  "output_bytes": r.output_bytes, "elapsed": r.elapsed}))
"""


# --- dataset ---

def make_dataset(root: Path, num_images: int, classes: int, workers: int) -> list[str]:
    """Generate (or reuse) ``num_images`` photo-like JPEGs under ``root``; returns the file list."""
    per_class = max(1, -(-num_images // classes))
    marker = root / ".bench-complete"
    if not marker.exists() or marker.read_text() != f"{classes}x{per_class}":
        if root.exists():
            shutil.rmtree(root)
        try:
            from fastdata.synth import make_image_folder
        except ImportError:  # older checkout: a plain generator with the same shape
            _fallback_image_folder(root, classes, per_class)
        else:
            make_image_folder(root, num_classes=classes, per_class=per_class, size="imagenet", seed=0,
                              workers=workers)
        marker.write_text(f"{classes}x{per_class}")
    return sorted(str(p) for p in root.rglob("*.jpg"))


def _fallback_image_folder(root: Path, classes: int, per_class: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True)
        for i in range(per_class):
            w, h = int(rng.integers(300, 500)), int(rng.integers(260, 420))
            coarse = rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
            img = np.clip(img + rng.integers(-20, 21, (h, w, 1)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / f"class_{c:03d}" / f"img_{i:05d}.jpg", quality=90)


def warm_page_cache(files: list[str]) -> int:
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            total += len(fh.read())
    return total


# --- ceiling ---

def _read_and_decode(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as fh:
            data = fh.read()
        with Image.open(io.BytesIO(data)) as im:
            im.load()
        n += len(data)
    return n


def _noop(_):
    return os.getpid()


def ceiling(files: list[str], processes: int, chunk: int = 16) -> dict:
    """Images/s and MB/s of read + full Pillow decode over ``processes`` processes."""
    chunks = [files[i:i + chunk] for i in range(0, len(files), chunk)]
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                      else "spawn")
    with ctx.Pool(processes) as pool:
        pool.map(_noop, range(processes * 4))  # start every worker before timing
        t0 = time.perf_counter()
        nbytes = sum(pool.imap_unordered(_read_and_decode, chunks))
        elapsed = time.perf_counter() - t0
    return {"images": len(files), "input_bytes": nbytes, "elapsed": elapsed}


# --- conversion with PSS sampling ---

class PssSampler(threading.Thread):
    """Samples the summed PSS of a process and all its descendants until stopped."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.peak_procs = 0
        self.samples = 0
        self._stop_event = threading.Event()

    def measure(self, proc: psutil.Process) -> int:
        """One process's figure (PSS here; subclasses measure something else)."""
        return proc.memory_full_info().pss

    def sampled(self, procs: list, total: int) -> None:
        """Called after each sample of the whole tree (``total`` is the sum of :meth:`measure`)."""

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                break
            total = 0
            for p in procs:
                try:
                    total += self.measure(p)
                except (psutil.Error, OSError):  # exited between listing and sampling
                    pass
            if total > self.peak:
                self.peak, self.peak_procs = total, len(procs)
            self.sampled(procs, total)
            self.samples += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def convert_in_child(src: str, dst: str, workers: int, backend: str, sample_memory: bool = True) -> dict:
    """Run one conversion in a child Python; returns its report plus peak PSS.

    Reading every process's smaps for PSS costs CPU the conversion then lacks, so
    throughput runs pass ``sample_memory=False`` and memory is measured in runs of its own.
    """
    if os.path.exists(dst):
        shutil.rmtree(dst)
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, src, dst, str(workers), backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    sampler = PssSampler(proc.pid)
    if sample_memory:
        sampler.start()
    out, err = proc.communicate()
    if sample_memory:
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"conversion failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(peak_pss=sampler.peak, peak_procs=sampler.peak_procs, pss_samples=sampler.samples)
    shutil.rmtree(dst, ignore_errors=True)
    return result


# --- report ---

def median_run(runs: list[dict]) -> dict:
    """The run with the median images/s (an actual run, so its fields agree)."""
    ordered = sorted(runs, key=lambda r: r["images"] / r["elapsed"])
    return ordered[len(ordered) // 2]


def per_round_median(rounds: dict, kind_a: str, procs_a: str, kind_b: str, procs_b: str) -> float:
    """Median over rounds of (images/s of a) / (images/s of b) within the same round."""
    pairs = zip(rounds[kind_a][procs_a], rounds[kind_b][procs_b], strict=False)
    return statistics.median(rate(a)[0] / rate(b)[0] for a, b in pairs)


def rate(r: dict) -> tuple[float, float]:
    return r["images"] / r["elapsed"], r["input_bytes"] / r["elapsed"] / 1e6


def mark(ok: bool) -> str:
    return "ok" if ok else "BELOW TARGET"


def print_report(res: dict) -> None:
    w = res["workers"]
    print()
    print(f"machine: {os.cpu_count()} logical cores; dataset {res['images']} images, "
          f"{res['dataset_bytes'] / 1e6:.1f} MB ({res['dataset_bytes'] / res['images'] / 1e3:.0f} KB/image); "
          f"backend {res['backend']}")
    print()
    print(f"{'processes':>9} | {'ceiling img/s':>13} {'MB/s':>7} | {'convert img/s':>13} {'MB/s':>7} | "
          f"{'convert/ceiling':>15}")
    print("-" * 78)
    rounds = res.get("rounds")
    for n in sorted({1, w}):
        c_img, c_mb = rate(res["ceiling"][str(n)])
        v_img, v_mb = rate(res["convert"][str(n)])
        # the ratio is the median of the rounds' ratios: each round's two runs are
        # adjacent in time, so a slow spell of the machine cancels out
        ratio = per_round_median(rounds, "convert", str(n), "ceiling", str(n)) if rounds else v_img / c_img
        print(f"{n:>9} | {c_img:>13.0f} {c_mb:>7.1f} | {v_img:>13.0f} {v_mb:>7.1f} | {ratio:>8.2f}x "
              f"({mark(ratio >= TARGET_CEILING_RATIO)})")
    if w > 1:
        if rounds:
            conv_speedup = per_round_median(rounds, "convert", str(w), "convert", "1")
            ceil_speedup = per_round_median(rounds, "ceiling", str(w), "ceiling", "1")
        else:
            conv_speedup = rate(res["convert"][str(w)])[0] / rate(res["convert"]["1"])[0]
            ceil_speedup = rate(res["ceiling"][str(w)])[0] / rate(res["ceiling"]["1"])[0]
        line = f"speed-up {w} vs 1 process(es): convert {conv_speedup:.2f}x, ceiling {ceil_speedup:.2f}x"
        if w == 2:
            line += f" (target >= {TARGET_SPEEDUP_2}x: {mark(conv_speedup >= TARGET_SPEEDUP_2)})"
        print(line)
    print()
    print(f"{'images':>9} | {'peak PSS (MiB)':>14} | {'processes':>9} | {'samples':>7}")
    print("-" * 50)
    for key in ("N", "10N"):
        m = res["memory"][key]
        print(f"{m['images']:>9} | {m['peak_pss'] / 2**20:>14.1f} | {m['peak_procs']:>9} | {m['pss_samples']:>7}")
    growth = res["memory"]["10N"]["peak_pss"] / res["memory"]["N"]["peak_pss"]
    print(f"peak PSS 10N / N: {growth:.2f}x (flat means <= {TARGET_PSS_GROWTH}x: {mark(growth <= TARGET_PSS_GROWTH)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500, help="N: the memory figure is taken at N and 10N images; "
                                                      "throughput is measured on the 10N dataset (default 500)")
    p.add_argument("--quick", action="store_true", help="smoke-test size (N=30)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="'all workers' (default: all cores)")
    p.add_argument("--backend", choices=["lmdb", "hdf5"], default="lmdb")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--data", default=None, help="folder for the generated datasets (kept and reused); "
                                                "default: a temporary folder, deleted at the end")
    p.add_argument("--rounds", type=int, default=5, help="interleaved ceiling/convert rounds; figures are "
                                                         "medians over rounds (default 5)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    n = 30 if args.quick else args.n
    workers = max(1, args.workers)

    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fastdata-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        small = make_dataset(base / f"n{n}", n, args.classes, workers)
        big = make_dataset(base / f"n{10 * n}", 10 * n, args.classes, workers)
        print(f"datasets ready: {len(small)} and {len(big)} images ({time.perf_counter() - t0:.0f} s)", flush=True)
        dataset_bytes = warm_page_cache(big)
        warm_page_cache(small)
        out = str(base / f"store.{ 'lmdb' if args.backend == 'lmdb' else 'h5'}")

        res = {"workers": workers, "backend": args.backend, "images": len(big), "dataset_bytes": dataset_bytes,
               "ceiling": {}, "convert": {}, "memory": {}}
        # Rounds interleave ceiling and conversion so a slow minute of a shared
        # machine hits both; each figure is the median over rounds.
        rounds: dict[str, dict[str, list]] = {"ceiling": {}, "convert": {}}
        for r in range(args.rounds):
            for procs in sorted({1, workers}):
                c = ceiling(big, procs)
                v = convert_in_child(str(base / f"n{10 * n}"), out, procs, args.backend, sample_memory=False)
                rounds["ceiling"].setdefault(str(procs), []).append(c)
                rounds["convert"].setdefault(str(procs), []).append(v)
                print(f"round {r + 1}/{args.rounds}, {procs} process(es): ceiling {rate(c)[0]:.0f} img/s, "
                      f"convert {rate(v)[0]:.0f} img/s ({rate(v)[0] / rate(c)[0]:.2f}x)", flush=True)
        for kind in ("ceiling", "convert"):
            for procs, runs in rounds[kind].items():
                res[kind][procs] = median_run(runs)
        res["rounds"] = rounds
        big_run = convert_in_child(str(base / f"n{10 * n}"), out, workers, args.backend)
        res["memory"]["10N"] = {k: big_run[k] for k in ("images", "peak_pss", "peak_procs", "pss_samples")}
        small_run = convert_in_child(str(base / f"n{n}"), out, workers, args.backend)
        res["memory"]["N"] = {k: small_run[k] for k in ("images", "peak_pss", "peak_procs", "pss_samples")}
        for r in list(res["convert"].values()) + [small_run]:
            if r["rejected"]:
                print(f"warning: {r['rejected']} input(s) rejected", file=sys.stderr)
        print_report(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
