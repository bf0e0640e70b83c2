"""Regenerate the README's performance section on this machine, end to end, on generated data.

Runs, each in its own process:

1. ``benchmarks/bench_formats.py``: folder vs LMDB vs HDF5, warm and cold cache,
   ImageNet-like and CIFAR-like images -> the table and the plot;
2. ``benchmarks/bench_memory.py``: memory over epochs, fastdata vs a naive dataset;
3. ``benchmarks/bench_convert.py``: conversion speed next to the machine's ceiling.

and writes ``benchmarks/results/README_perf.md`` (the section to paste into
README.md: the format table, the plot, the memory and conversion reports and the
machine they were measured on) plus ``benchmarks/results/formats.png``.

Usage::

    python scripts/regen_readme_perf.py                 # full size (about 30 min on 2 cores)
    python scripts/regen_readme_perf.py --size small    # smoke test of the whole chain
    python scripts/regen_readme_perf.py --only formats  # just the format comparison
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: per size: extra arguments of the memory and conversion benchmarks
SMALL_ARGS = {"memory": ["--n", "5000", "--epochs", "4"], "convert": ["--quick"]}


def run(cmd: list, log) -> str:
    """Run a benchmark script, echo its output as it comes, return it (raises on failure)."""
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write(line)
        sys.stdout.flush()
    if proc.wait() != 0:
        raise SystemExit(f"{cmd[1]} failed with exit code {proc.returncode}")
    return "".join(lines)


def _tail_report(output: str, keep: int = 25) -> str:
    """The report at the end of a benchmark's output (its last ``keep`` lines)."""
    lines = [line.rstrip() for line in output.strip().splitlines()]
    return "\n".join(lines[-keep:])


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["full", "small"], default="full")
    p.add_argument("--results", default=str(RESULTS),
                   help="folder for the outputs (default benchmarks/results; the README links its formats.png)")
    p.add_argument("--only", default="formats,memory,convert",
                   help="comma list of parts to run: formats, memory, convert (default: all)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = set(parts) - {"formats", "memory", "convert"}
    if unknown:
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    results = Path(args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    section = ["## Performance", ""]
    py = sys.executable

    if "formats" in parts:
        out = results / "formats"
        run([py, "benchmarks/bench_formats.py", "--size", args.size, "--out", str(out)], print)
        table = (out / "formats.md").read_text().strip()
        (results / "formats.png").write_bytes((out / "formats.png").read_bytes())
        section += ["### Loading throughput: image folder vs LMDB vs HDF5", "",
                    "`python benchmarks/bench_formats.py`: each configuration in a fresh process "
                    "(`fastdata bench`), persistent workers, ImageNet-like JPEGs with RandomResizedCrop(224) "
                    "and 32x32 JPEGs (plus a `--raw 32x32` store), warm page cache and cold (every file "
                    "evicted before each epoch).", "", table, "",
                    "![throughput relative to the image folder](benchmarks/results/formats.png)", ""]
    if "memory" in parts:
        extra = SMALL_ARGS["memory"] if args.size == "small" else []
        report = run([py, "benchmarks/bench_memory.py", "--json", str(results / "memory.json"), *extra], print)
        section += ["### Memory over epochs: fastdata vs a naive dataset", "",
                    "`" + " ".join(["python benchmarks/bench_memory.py", *extra]) + "`", "",
                    "```", _tail_report(report), "```", ""]
    if "convert" in parts:
        extra = SMALL_ARGS["convert"] if args.size == "small" else []
        report = run([py, "benchmarks/bench_convert.py", "--json", str(results / "convert.json"), *extra], print)
        section += ["### Conversion speed", "",
                    "`" + " ".join(["python benchmarks/bench_convert.py", *extra]) + "`", "",
                    "```", _tail_report(report), "```", ""]

    sys.path.insert(0, str(ROOT))
    from fastdata.bench.report import fingerprint

    machine = fingerprint()
    section += [f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_bytes'] / 2**30:.0f} GiB "
                f"RAM, {machine['os']}, Python {machine['python']}, torch {machine['torch']}. Regenerate with "
                "`python scripts/regen_readme_perf.py`.", ""]
    path = results / "README_perf.md"
    path.write_text("\n".join(section))
    (results / "machine.json").write_text(json.dumps(machine, indent=2))
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s): paste it into README.md's performance section")
    return 0


if __name__ == "__main__":
    sys.exit(main())
