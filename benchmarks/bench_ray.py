"""A Ray Data write on one machine (2 CPUs) against ``fastdata convert`` and ``fastdata.write`` of
the same rows, beside ``litdata.optimize`` of the same input, side by side in one run.

Data: ``--n`` photo-like ImageNet-like JPEGs in class folders (``fastdata.synth.make_image_folder``,
~63 KB each), read from the page cache (warmed first). The rows are ``{"image": path, "label":
class index}`` for every file, in the folder scan's order.

Rows (each in a fresh child process, ``--rounds`` interleaved rounds, medians; the ratio is the
median of the rounds' own ratios, so a slow minute of a shared machine hits both sides):

* ``convert``: ``fastdata.convert(folder, dst, workers=2)``: the converter's own elapsed time
  (scan, pool start, read, validate, write, fsync, publish), as ``bench_convert.py`` reports it;
* ``write(rows)``: ``fastdata.write(rows, dst, schema, workers=2)``, elapsed as above;
* ``ray``: ``fastdata.integrations.ray.write(ray.data.from_items(rows), dst, schema)`` on a local
  cluster of 2 CPUs (2 write tasks at a time, each writing its part in its own process, then the
  publish): the call's wall time, on a cluster already started and warmed by a write of 20 rows
  (a cluster is long-lived; ``ray.init`` and that first job are reported apart, not counted);
* ``litdata.optimize``: ``optimize(fn=read the file's bytes, inputs=rows, num_workers=2,
  chunk_bytes="64MB")``: the call's wall time (where litdata is installed: the bench venv).
  LitData stores the bytes without decoding them; every fastdata row decodes each image once
  to validate it (the ceiling of ``bench_convert.py``), which is most of its time.

Target: ray >= 0.8x convert.

Usage::

    python benchmarks/bench_ray.py --workdir /tmp/bench-ray                 # 5000 images, 3 rounds
    python benchmarks/bench_ray.py --workdir /tmp/bench-ray --n 400 --rounds 1   # smoke
    python benchmarks/bench_ray.py --workdir /tmp/bench-ray --repeat 4       # 20,000 inputs: a longer job
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import warm_page_cache  # noqa: E402

REPO = str(Path(__file__).resolve().parents[1])
TARGET = 0.8

_CHILD = """
import json, os, sys, time
src, dst, kind, blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if __name__ == "__main__":
    import fastdata
    from bench_ray import SCHEMA, rows_of
    rows = rows_of(src)
    extra = {}
    if kind == "convert":
        t0 = time.perf_counter()
        report = fastdata.convert(src, dst, workers=2, progress=False)
        elapsed = report.elapsed
    elif kind == "write":
        t0 = time.perf_counter()
        report = fastdata.write(rows, dst, SCHEMA, workers=2, progress=False)
        elapsed = report.elapsed
    elif kind == "ray":
        t0 = time.perf_counter()
        import ray
        from fastdata.integrations import ray as fray
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        extra["init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fray.write(ray.data.from_items(rows[:20], override_num_blocks=2), dst + "-warm.lmdb", SCHEMA)
        extra["first_job_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fray.write(ray.data.from_items(rows, override_num_blocks=blocks), dst, SCHEMA)
        elapsed = time.perf_counter() - t0
    else:
        import litdata
        from bench_ray import litdata_item
        t0 = time.perf_counter()
        litdata.optimize(fn=litdata_item, inputs=[(r["image"], r["label"]) for r in rows], output_dir=dst,
                         chunk_bytes="64MB", num_workers=2)
        elapsed = time.perf_counter() - t0
    print(json.dumps({"elapsed": elapsed, "images": len(rows), **extra}))
"""


def _schema():
    from fastdata.fields import Image, Int, Schema

    return Schema.of({"image": Image(), "label": Int()})


SCHEMA = _schema()


def rows_of(folder: str) -> list[dict]:
    """``{"image": path, "label": class index}`` of every image of ``folder``, in the scan's order."""
    from fastdata.writer.sources.folder import scan_folder

    scan = scan_folder(folder)
    return [{"image": os.fsdecode(p), "label": int(label)} for p, label in zip(scan.paths, scan.labels, strict=True)]


def litdata_item(item: tuple[str, int]) -> dict:
    """What LitData stores of a row: the file's bytes, not decoded, and the label."""
    path, label = item
    with open(path, "rb") as fh:
        return {"image": fh.read(), "label": label}


def repeated(src: str, dst: str, times: int) -> str:
    """``dst``: ``times`` copies of ``src``'s class folders (``NAME-k``), hard-linked (no extra disk)."""
    if not os.path.isdir(dst):
        os.makedirs(dst + ".tmp", exist_ok=True)
        for name in sorted(os.listdir(src)):
            for k in range(times):
                os.makedirs(os.path.join(dst + ".tmp", f"{name}-{k}"), exist_ok=True)
                for f in os.listdir(os.path.join(src, name)):
                    os.link(os.path.join(src, name, f), os.path.join(dst + ".tmp", f"{name}-{k}", f))
        os.rename(dst + ".tmp", dst)
    return dst


def child(src: str, dst: str, kind: str, blocks: int) -> dict:
    for path in (dst, dst + "-warm.lmdb"):
        shutil.rmtree(path, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((REPO, os.path.join(REPO, "benchmarks"))),
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-c", _CHILD, src, dst, kind, str(blocks)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    for path in (dst, dst + "-warm.lmdb"):
        shutil.rmtree(path, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=8, help="blocks of the Ray dataset (write tasks, parts)")
    p.add_argument("--repeat", type=int, default=1,
                   help="the input is this many hard-linked copies of the --n images (as more class folders): a "
                        "longer job from the same files, without generating more")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from fastdata.synth import make_image_folder

    src = os.path.join(args.workdir, "jpeg")
    if not os.path.isdir(src):
        make_image_folder(src, num_classes=10, per_class=args.n // 10, size="imagenet", workers=2)
    if args.repeat > 1:
        src = repeated(src, os.path.join(args.workdir, f"jpeg-x{args.repeat}"), args.repeat)
    rows = rows_of(src)
    warm_page_cache([r["image"] for r in rows])
    try:
        import litdata  # noqa: F401

        kinds = ["convert", "write", "ray", "litdata"]
    except ImportError:
        kinds = ["convert", "write", "ray"]
        print("litdata is not installed here: its row is left out (the bench venv has it)", file=sys.stderr)
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds:
            res = child(src, os.path.join(args.workdir, "out.lmdb" if kind != "litdata" else "out-litdata"), kind,
                        args.blocks)
            runs[kind].append(res)
            print(f"round {r + 1}/{args.rounds} {kind}: {res['images'] / res['elapsed']:.0f} images/s "
                  f"({res['elapsed']:.2f} s)", file=sys.stderr, flush=True)
    n = len(rows)
    ratios = [c["elapsed"] / ray_run["elapsed"] for c, ray_run in zip(runs["convert"], runs["ray"], strict=True)]
    names = {"convert": "fastdata convert (workers=2)", "write": "fastdata.write(rows) (workers=2)",
             "ray": "fastdata.integrations.ray.write (2 CPUs)", "litdata": "litdata.optimize (num_workers=2)"}
    lines = [f"{n} JPEGs (~{sum(os.path.getsize(r['image']) for r in rows) / n / 1e3:.0f} KB), {args.rounds} rounds, "
             f"{args.blocks} Ray blocks, {os.cpu_count()} cores", "", "| run | median s | images/s |", "|---|---|---|"]
    for kind in kinds:
        med = statistics.median(x["elapsed"] for x in runs[kind])
        lines.append(f"| {names[kind]} | {med:.2f} | {n / med:.0f} |")
    ratio = statistics.median(ratios)
    lines += ["", f"ray / convert: {ratio:.2f}x (target >= {TARGET}x: {'met' if ratio >= TARGET else 'NOT met'}; "
              f"rounds: {', '.join(f'{r:.2f}x' for r in ratios)})",
              f"ray.init {statistics.median(x['init_s'] for x in runs['ray']):.1f} s and the first (warm-up) job "
              f"{statistics.median(x['first_job_s'] for x in runs['ray']):.1f} s, not counted"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"n": n, "runs": runs, "ratio": ratio}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
