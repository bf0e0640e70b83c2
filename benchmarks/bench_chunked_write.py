"""The writer's memory and speed on values larger than RAM should have to hold: one huge array
per sample, written from an ``np.memmap`` into a ``Chunked`` field.

Cases (``--cases``, default both):

* ``image``: one ``H x W x 3`` uint8 image (default 20000 x 20000 x 3, 1.2 GB: ``--image-side``),
  ``Chunked("uint8", (512, 512, 3))``, like a whole-slide image or an aerial mosaic. The file is
  made chunk of rows by chunk of rows with a cheap structured pattern (gradients, a checkerboard,
  a product term and a few units of hashed noise: compressible, but not trivially), never in RAM;
* ``volume``: one ``S^3`` uint16 CT-like volume (default 512^3, 256 MiB: ``--volume-side``) from
  :func:`fastdata.tools.synth_volumes.ct_volume`, ``Chunked("uint16", (64, 64, 64))``.

Each write is ``fastdata.write(samples, dst, {"x": Chunked(...)}, workers=W)`` in a fresh Python
process, for every ``--workers`` value (default 2 and 0), every ``--inputs`` form of ``samples``
(``list``: ``[{"x": np.memmap(...)}]``, a map-style dataset; ``iter``: ``iter([{"x": np.memmap(...)}])``,
an iterable, which the writer feeds to its workers sample by sample) and every ``--backends`` store
(default LMDB); the default codec (blosc-zstd level 1, 256 KiB Blosc blocks). A thread samples the writer's process
tree (the process, its worker processes, multiprocessing's forkserver and resource tracker) every
50 ms with :func:`fastdata.bench.memory.process_tree_memory`: peak total PSS, peak total RSS (which
counts shared pages once per process), the largest RSS of any one process, the peaks of the tree's
anonymous and file-backed PSS (``/proc/PID/smaps_rollup``: file-backed pages are the mapped files,
the source memmap's included), and the tree's figures just before the write (the interpreter and
its imports). Target: peak RSS under 400 MB.

With one sample, a single worker reads and compresses all its chunks (the workers share samples,
not the chunks of one sample), so ``workers=2`` is not expected to be faster than ``workers=0``.

The source file's pages are in the page cache when a write starts (``--cold-source`` evicts them
first, with ``posix_fadvise(DONTNEED)``: then the write also waits for the disk). MB/s is the raw
bytes of the value over the elapsed time of ``fastdata.write``. After each write a few regions of
the store (the four corners, the centre and random ones) are checked against the memmap.

    python benchmarks/bench_chunked_write.py                          # 20000^2 x 3 image + 512^3 volume
    python benchmarks/bench_chunked_write.py --image-side 8000 --volume-side 256   # quicker
    python benchmarks/bench_chunked_write.py --cases image --workers 2 --backends lmdb,hdf5
    python benchmarks/bench_chunked_write.py --workdir /tmp/cw --json cw.json --md cw.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 1 << 20


# --------------------------------------------------------------------------- sources
def make_image(path: str, side: int, rows: int = 256) -> None:
    """``side x side x 3`` uint8, written ``rows`` rows at a time (never the whole image in RAM)."""
    x = np.arange(side, dtype=np.uint32)[None, :, None]
    c = np.arange(3, dtype=np.uint32)[None, None, :]
    with open(path, "wb") as f:
        for r0 in range(0, side, rows):
            y = np.arange(r0, min(r0 + rows, side), dtype=np.uint32)[:, None, None]
            v = (x >> 3) + (y >> 2) * 3 + c * 85 + (((x >> 6) ^ (y >> 6)) & 1) * 60 + ((x * y) >> 13)
            v += ((x * np.uint32(2654435761)) ^ (y * np.uint32(40503))) >> np.uint32(29)  # 0..7 of noise
            f.write((v & 255).astype(np.uint8).tobytes())


def make_volume(path: str, side: int) -> None:
    from fastdata.tools.synth_volumes import ct_volume

    ct_volume((side,) * 3, seed=0).tofile(path)


CASES = {
    # name: (dtype, chunks, shape from the side)
    "image": ("uint8", (512, 512, 3), lambda s: (s, s, 3)),
    "volume": ("uint16", (64, 64, 64), lambda s: (s, s, s)),
}


# --------------------------------------------------------------------------- the measured child
class TreeSampler:
    """Peaks of the process tree's memory, sampled in a thread."""

    def __init__(self, interval: float = 0.05):
        from fastdata.bench.memory import process_tree_memory, pss_split

        self._snap, self._split = process_tree_memory, pss_split
        self.interval = interval
        self.peak = {"pss": 0, "rss": 0, "rss_one": 0, "uss": 0, "anon_pss": 0, "file_pss": 0, "processes": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        snap = self._snap()
        now = {"pss": snap.total_pss, "rss": snap.total_rss, "uss": snap.total_uss,
               "rss_one": max(p.rss for p in snap.processes), "processes": len(snap.processes),
               **{f"{k}_pss": v for k, v in self._split([p.pid for p in snap.processes]).items()}}
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)
        self.samples += 1
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def child(args) -> dict:
    import fastdata
    from fastdata.fields import Chunked

    dtype, chunks, shape_of = CASES[args.case]
    shape = shape_of(args.side)
    arr = np.memmap(args.source, dtype=dtype, mode="r", shape=shape)
    sampler = TreeSampler()
    before = sampler.sample()
    with sampler:
        t0 = time.perf_counter()
        samples = [{"x": arr}] if args.child_input == "list" else iter([{"x": arr}])
        fastdata.write(samples, args.dst, {"x": Chunked(dtype, chunks)}, workers=args.child_workers,
                       overwrite=True, progress=False)
        elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "before": before, "peak": sampler.peak, "samples": sampler.samples}


# --------------------------------------------------------------------------- checks, driver
def read_back(dst: str, source: str, dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    """Corners, centre and random regions of the store equal the memmap's; the regions checked."""
    import fastdata

    want = np.memmap(source, dtype=dtype, mode="r", shape=shape)
    ds = fastdata.open_dataset(dst)
    got = ds[0]["x"]
    if got.shape != shape or got.dtype != np.dtype(dtype):
        raise SystemExit(f"{dst}: stored {got.dtype}{got.shape}, expected {dtype}{shape}")
    size = [min(s, 2 * c + 37) for s, c in zip(shape, chunks, strict=True)]
    rng = np.random.default_rng(5)
    starts = [[0] * len(shape), [s - n for s, n in zip(shape, size, strict=True)],
              [0] + [s - n for s, n in zip(shape[1:], size[1:], strict=True)],
              [shape[0] - size[0]] + [0] * (len(shape) - 1),
              [(s - n) // 2 for s, n in zip(shape, size, strict=True)]]
    starts += [[int(rng.integers(0, s - n + 1)) for s, n in zip(shape, size, strict=True)] for _ in range(5)]
    for start in starts:
        region = tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))
        if not np.array_equal(got[region], want[region]):
            raise SystemExit(f"{dst}: region {[(r.start, r.stop) for r in region]} differs from the memmap")
    ds.close()
    return len(starts)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_case(case: str, side: int, work: str, args) -> dict:
    dtype, chunks, shape_of = CASES[case]
    shape = shape_of(side)
    raw = int(np.prod(shape)) * np.dtype(dtype).itemsize
    source = os.path.join(work, f"{case}-{side}.{dtype}")
    if not (os.path.isfile(source) and os.path.getsize(source) == raw):
        t0 = time.perf_counter()
        (make_image if case == "image" else make_volume)(source, side)
        print(f"{case}: made {source} ({raw / MB:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    combos = [(backend, workers, kind) for backend in args.backends.split(",")
              for workers in [int(w) for w in args.workers.split(",")] for kind in args.inputs.split(",")]
    for _ in range(args.repeats):
        for backend, workers, kind in combos:
            dst = os.path.join(work, f"{case}-{side}-w{workers}.{'lmdb' if backend == 'lmdb' else 'h5'}")
            shutil.rmtree(dst, ignore_errors=True)
            if args.cold_source:
                from fastdata.bench.cache import evict_page_cache

                evict_page_cache([source])
            else:
                with open(source, "rb") as f:
                    while f.read(64 << 20):
                        pass
            cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--side", str(side),
                   "--source", source, "--dst", dst, "--child-workers", str(workers), "--child-input", kind]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"writer child failed ({case}, {backend}, workers={workers}, {kind}):\n"
                                 f"{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r |= {"case": case, "backend": backend, "workers": workers, "input": kind, "shape": shape, "dtype": dtype,
                  "chunks": chunks, "raw_bytes": raw, "stored_bytes": dir_bytes(dst),
                  "mb_s": raw / MB / r["elapsed_s"],
                  "regions_checked": read_back(dst, source, dtype, shape, chunks)}
            print(f"    {case} {backend} workers={workers} {kind}: {r['elapsed_s']:.1f} s, {r['mb_s']:.0f} MiB/s, "
                  f"peak RSS {r['peak']['rss'] / MB:.0f} MiB (one process {r['peak']['rss_one'] / MB:.0f}), "
                  f"peak PSS {r['peak']['pss'] / MB:.0f} MiB, store {r['stored_bytes'] / MB:.0f} MiB", flush=True)
            rows.append(r)
            shutil.rmtree(dst, ignore_errors=True)
    return {"rows": rows}


def summarize(rows: list[dict]) -> list[dict]:
    """Medians over repeats, per (case, backend, workers)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["backend"], r["workers"], r["input"]), []).append(r)
    out = []
    for (case, backend, workers, kind), rs in groups.items():
        med = {k: statistics.median(r["peak"][k] for r in rs)
               for k in ("rss", "rss_one", "pss", "anon_pss", "file_pss", "processes")}
        out.append({"case": case, "backend": backend, "workers": workers, "input": kind, "n": len(rs),
                    "shape": rs[0]["shape"], "dtype": rs[0]["dtype"], "chunks": rs[0]["chunks"],
                    "raw_bytes": rs[0]["raw_bytes"],
                    "stored_bytes": rs[0]["stored_bytes"], "elapsed_s": statistics.median(r["elapsed_s"] for r in rs),
                    "mb_s": statistics.median(r["mb_s"] for r in rs), "peak": med,
                    "before_rss": statistics.median(r["before"]["rss"] for r in rs),
                    "before_pss": statistics.median(r["before"]["pss"] for r in rs),
                    "regions_checked": rs[0]["regions_checked"]})
    return out


def markdown(res: dict, command: str) -> str:
    lines = ["| value | chunks | store | workers | samples given as | raw MiB | stored MiB | s | MiB/s | "
             "peak RSS MiB (tree) | largest one process | peak PSS MiB | anon / file PSS peaks | "
             "before write RSS / PSS | read-back |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["summary"]:
        shape = "x".join(map(str, r["shape"]))
        ok = "meets" if r["peak"]["rss"] < 400 * MB else "above"
        lines.append(f"| {shape} {r['dtype']} | {'x'.join(map(str, r['chunks']))} | {r['backend']} | {r['workers']} | "
                     f"{'a list' if r['input'] == 'list' else 'an iterator'} | "
                     f"{r['raw_bytes'] / MB:.0f} | {r['stored_bytes'] / MB:.0f} | {r['elapsed_s']:.1f} | "
                     f"{r['mb_s']:.0f} | {r['peak']['rss'] / MB:.0f} (< 400: {ok}) | {r['peak']['rss_one'] / MB:.0f} | "
                     f"{r['peak']['pss'] / MB:.0f} | "
                     f"{r['peak']['anon_pss'] / MB:.0f} / {r['peak']['file_pss'] / MB:.0f} | "
                     f"{r['before_rss'] / MB:.0f} / {r['before_pss'] / MB:.0f} | "
                     f"{r['regions_checked']} regions equal |")
    m = res["machine"]
    n = res["summary"][0]["n"] if res["summary"] else 0
    lines += ["", f"Medians of {n} run(s) each, every write in a fresh process; source pages "
              f"{'evicted' if m['cold_source'] else 'cached'} at the start. Machine: {m['cores']} cores, "
              f"{m['mem_gb']:.0f} GB, Python {m['python']}, {m['platform']}; fastdata {m['fastdata_commit']}, "
              f"numpy {m['numpy']}, numcodecs {m['numcodecs']}; 1-min load average {m['loadavg_start']:.1f} at start, "
              f"{m['loadavg_end']:.1f} at end (above {m['cores']} = busy). Command: `{command}`"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="image,volume", help="comma-separated: image, volume (default both)")
    p.add_argument("--image-side", type=int, default=20000, help="the image is SIDE x SIDE x 3 uint8 (default 20000)")
    p.add_argument("--volume-side", type=int, default=512, help="the volume is SIDE^3 uint16 (default 512)")
    p.add_argument("--workers", default="2,0", help="comma-separated writer worker counts (default 2,0)")
    p.add_argument("--backends", default="lmdb", help="comma-separated: lmdb, hdf5 (default lmdb)")
    p.add_argument("--inputs", default="list,iter",
                   help="comma-separated: how the one sample is given: list ([{...}], a map-style dataset), iter "
                        "(iter([{...}])) (default both)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every write (medians)")
    p.add_argument("--cold-source", action="store_true", help="evict the source file from the page cache first")
    p.add_argument("--workdir", help="keep the source files here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--md", help="write the markdown table here")
    for flag in ("--child", "--side", "--source", "--dst", "--child-workers", "--child-input"):
        p.add_argument(flag, help=argparse.SUPPRESS, type=int if flag in ("--side", "--child-workers") else str)
    args = p.parse_args(argv)
    if args.child:
        args.case = args.child
        print(json.dumps(child(args)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := set(cases) - set(CASES):
        p.error(f"unknown cases {sorted(unknown)}")
    import numcodecs
    import psutil

    temp = None if args.workdir else tempfile.mkdtemp(prefix="fastdata-chunked-write-")
    work = args.workdir or temp
    os.makedirs(work, exist_ok=True)
    command = shlex.join(["python", "benchmarks/bench_chunked_write.py", *(argv or sys.argv[1:])])
    res: dict = {"machine": {"cores": os.cpu_count(), "mem_gb": psutil.virtual_memory().total / 2 ** 30,
                             "python": platform.python_version(), "platform": platform.platform(),
                             "fastdata_commit": git_commit(), "numpy": np.__version__,
                             "numcodecs": numcodecs.__version__, "cold_source": args.cold_source,
                             "loadavg_start": os.getloadavg()[0]}, "cases": {}}
    try:
        for case in cases:
            side = args.image_side if case == "image" else args.volume_side
            res["cases"][case] = run_case(case, side, work, args)
        res["summary"] = summarize([r for c in res["cases"].values() for r in c["rows"]])
        res["machine"]["loadavg_end"] = os.getloadavg()[0]
        md = markdown(res, command)
        print("\n" + md)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        if args.md:
            Path(args.md).write_text(md)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
