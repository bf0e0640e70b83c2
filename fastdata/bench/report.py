"""Benchmark results: the documented fields, machine fingerprint, terminal table, JSON and CSV.

Every result row has every key of :data:`FIELDS` (``None`` where a figure does
not apply: a failed row, no CUDA, no workers). The JSON file holds the
fingerprint, the notes, the warnings and the rows; the CSV file holds one line
per row with the fingerprint repeated in ``machine_*`` columns, lists joined by
``;``.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import fields as dc_fields
from importlib import metadata

from fastdata._version import __version__
from fastdata.bench.grid import BenchConfig, available_cores
from fastdata.common.units import format_size

#: every field of a result row, with its meaning (the README and the bench command's help point here)
FIELDS: dict[str, str] = {
    # configuration
    **{f.name: "configuration (see BenchConfig)" for f in dc_fields(BenchConfig)},
    "pipeline": "how samples were read, decoded and transformed",
    "storage": "how the target holds its images: 'files' (a folder), or the store's mode (original, "
               "raw-native <=SIDE, mixed F% raw <=SIDE, raw HxW, reencode, lossless)",
    "disk_bytes": "bytes the target takes on disk (a folder's image files, a store's shards)",
    # outcome
    "status": "'ok' or 'failed'",
    "error": "why a failed row failed (worker error, killed by a signal, timeout), else null",
    "run_s": "wall seconds of the whole measuring process",
    # throughput
    "num_samples": "samples in the dataset",
    "samples_per_epoch": "samples read per epoch (max_batches x batch_size, at most the dataset)",
    "batches_per_epoch": "batches per epoch",
    "images_per_s": "median images/s over the measured epochs (after warm-up)",
    "mb_per_s": "median MB/s (10^6 bytes of stored, encoded data) over the measured epochs",
    "images_per_s_epochs": "images/s of each measured epoch",
    "epoch_s": "seconds of each measured epoch (worker start-up included when not persistent)",
    "time_to_first_batch_s": "seconds from iter(loader) to the first batch, first epoch",
    "setup_s": "seconds to construct the Dataset",
    # memory
    "peak_pss_bytes": "peak PSS summed over the main process and all worker processes (sampled every 50 ms; "
                      "with thread workers the main process alone)",
    "peak_uss_per_worker_bytes": "peak USS (private memory) of any single worker process (null with thread "
                                 "workers: they have no process of their own)",
    "peak_rss_bytes": "peak RSS summed over the tree; counts shared pages once per process, so it "
                      "overstates real use",
    "pss_per_epoch_bytes": "total PSS at the end of each epoch (warm-up included)",
    "mem_growth_bytes": "total PSS at the end of the last epoch minus at the end of the first",
    "main_pss_bytes": "PSS of the main process at the end of the last epoch",
    "worker_pss_bytes": "mean PSS of one worker process at the end of the last epoch (null with thread "
                        "workers)",
    "pss_exact": "false where the OS reports no PSS (PSS figures are then USS)",
    # CPU and the training step
    "cpu_cores_busy": "CPU seconds of main + workers per wall second, measured epochs",
    "cpu_util": "cpu_cores_busy / available cores",
    "data_wait_fraction": "fraction of the epoch the training loop waited for data (with step_ms: "
                          "time not covered by the simulated step)",
    "decoded_bytes_per_sample": "bytes of decoded pixels per sample, as delivered",
    # cold cache
    "cold_evicted_files": "files evicted from the page cache before each epoch (cold)",
    "cold_residency_after_evict": "fraction of those files' pages still cached right after eviction "
                                  "(mincore; 0 = truly cold)",
    # CUDA (null without CUDA)
    "h2d_ms_per_batch": "median host-to-device copy time per batch (pinned when pin_memory)",
    "gpu_mem_allocated_bytes": "peak GPU memory allocated",
    "gpu_mem_reserved_bytes": "peak GPU memory reserved by the caching allocator",
}

NOTES = [
    "images/s and MB/s: median over measured epochs after warm-up; MB = 10^6 bytes of stored data",
    "peak PSS: main process + all DataLoader workers, shared pages divided among sharers: what the tree "
    "really uses",
    "peak RSS counts shared pages (LMDB's mmap, copy-on-write memory inherited from the parent) once in "
    "every process, so it overstates memory use; compare configurations by PSS",
    "worker_type=thread: the workers are threads of the measuring process, so its memory is all of theirs "
    "(per-worker figures do not apply); start_method does not apply either",
]

FINGERPRINT_PACKAGES = ("torch", "Pillow", "lmdb", "h5py", "numpy", "simplejpeg", "opencv-python-headless")


def fingerprint() -> dict:
    """Machine and software the figures were measured on."""
    import psutil

    versions: dict[str, str | None] = {}
    for pkg in FINGERPRINT_PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        import torch

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop the report
        cuda = None
    return {
        "cores": available_cores(),
        "logical_cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "memory_bytes": psutil.virtual_memory().total,
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "fastdata": __version__,
        "gpu": cuda,
        **versions,
    }


def complete_row(cfg: BenchConfig, result: dict) -> dict:
    """The configuration plus the measured figures, with every :data:`FIELDS` key present."""
    row = {key: None for key in FIELDS}
    row.update(cfg.to_json())
    row.update(result)
    return row


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return format_size(value)
    if kind == "pct":
        return f"{100 * value:.0f}%"
    if kind == "s":
        return f"{value:.2f}s"
    if kind == "f0":
        return f"{value:.0f}"
    if kind == "f1":
        return f"{value:.1f}"
    if kind == "bool":
        return "on" if value else "off"
    return str(value)


_AXES = [("workers", "workers", "str"), ("worker_type", "type", "str"), ("batch_size", "batch", "str"),
         ("prefetch_factor", "prefetch", "str"),
         ("persistent_workers", "persist", "bool"), ("pin_memory", "pin", "bool"),
         ("start_method", "start", "str"), ("output", "output", "str"), ("transform", "transform", "str"),
         ("cold", "cold", "bool"), ("step_ms", "step ms", "f0")]
_FIGURES = [("images_per_s", "img/s", "f0"), ("mb_per_s", "MB/s", "f1"), ("time_to_first_batch_s", "1st batch", "s"),
            ("peak_pss_bytes", "peak PSS", "bytes"), ("peak_uss_per_worker_bytes", "USS/worker", "bytes"),
            ("peak_rss_bytes", "peak RSS", "bytes"), ("mem_growth_bytes", "growth", "bytes"),
            ("cpu_util", "CPU", "pct")]


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table: one line per row; axes shown only when they vary, then the figures.

    The worker type (``type``) is shown whenever a row has thread workers.

    Each target's best throughput is also given as a ratio to the folder baseline's
    best when a folder target was measured.
    """
    if not rows:
        return "(no results)"
    threads = any(r.get("worker_type") == "thread" for r in rows)
    axes = [a for a in _AXES if a[0] == "workers" or (a[0] == "worker_type" and threads)
            or len({str(r.get(a[0])) for r in rows}) > 1]
    figures = list(_FIGURES)
    if any(r.get("step_ms") for r in rows):
        figures.append(("data_wait_fraction", "data wait", "pct"))
    if any(r.get("cold") for r in rows):
        figures.append(("cold_residency_after_evict", "cached", "pct"))
    if any(r.get("h2d_ms_per_batch") is not None for r in rows):
        figures.append(("h2d_ms_per_batch", "H2D ms", "f1"))
    targets = {str(r.get("target")) for r in rows}
    # several targets: say what each holds and its size, so speed and disk are read side by side
    per_target = [("storage", "storage", "str"), ("disk_bytes", "disk", "bytes")] if len(targets) > 1 else []
    axes = per_target + axes
    header = ["target"] + [a[1] for a in axes] + [f[1] for f in figures] + ["status"]
    body = []
    for r in rows:
        name = _target_name(r["target"], r["kind"])
        line = [name] + [_fmt(r.get(k), kind) for k, _, kind in axes]
        if r.get("status") == "ok":
            line += [_fmt(r.get(k), kind) for k, _, kind in figures] + ["ok"]
        else:
            line += ["-"] * len(figures) + [f"FAILED: {r.get('error') or 'unknown'}"]
        body.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=False)]

    def render(cells):
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1:
                out.append(str(c))
            elif i == 0:
                out.append(str(c).ljust(widths[i]))
            else:
                out.append(str(c).rjust(widths[i]))
        return "  ".join(out)

    lines = [render(header), render(["-" * w for w in widths])]
    lines += [render(b) for b in body]
    constant = [f"{label}={_fmt(rows[0].get(k), kind)}" for k, label, kind in _AXES
                if (k, label, kind) not in axes]
    if constant:
        lines.append("all rows: " + ", ".join(constant))
    ratios = speedups(rows)
    if ratios:
        disk = disk_ratios(rows)
        lines.append("best images/s vs the folder baseline: " +
                     ", ".join(f"{name} {ratio:.2f}x" + (f" (disk {disk[name]:.2f}x)" if name in disk else "")
                               for name, ratio in ratios.items()))
    return "\n".join(lines)


def disk_ratios(rows: Sequence[dict]) -> dict:
    """Disk bytes of each non-folder target divided by the folder's (the first folder measured),
    keyed like :func:`speedups`; empty without a folder or sizes."""
    folder = next((r.get("disk_bytes") for r in rows if r.get("kind") == "folder" and r.get("disk_bytes")), None)
    if not folder:
        return {}
    return {_target_name(r["target"], r["kind"]): r["disk_bytes"] / folder
            for r in rows if r.get("kind") != "folder" and r.get("disk_bytes")}


def speedups(rows: Sequence[dict]) -> dict:
    """Best images/s of each non-folder target divided by the best folder images/s."""
    best: dict[tuple, float] = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("images_per_s"):
            continue
        key = (r["target"], r["kind"])
        best[key] = max(best.get(key, 0.0), r["images_per_s"])
    folder = max((v for (t, k), v in best.items() if k == "folder"), default=None)
    if not folder:
        return {}
    return {_target_name(t, k): v / folder for (t, k), v in best.items() if k != "folder"}


def _target_name(target, kind: str) -> str:
    """How the table and its ratio line name a target: ``train.lmdb (lmdb)``."""
    return f"{os.path.basename(str(target).rstrip('/'))} ({kind})"


def write_json(path: str, rows: Sequence[dict], machine: dict, warnings: Sequence[str] = (),
               extra: dict | None = None) -> str:
    """Write the full report as JSON. Returns ``path``."""
    doc = {"fastdata_bench": 1, "machine": machine, "fields": FIELDS, "notes": NOTES,
           "warnings": list(warnings), "results": list(rows)}
    if extra:
        doc.update(extra)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
    return path


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ";".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in value)
    return value


def write_csv(path: str, rows: Sequence[dict], machine: dict) -> str:
    """Write one line per row, every :data:`FIELDS` column plus ``machine_*`` columns. Returns ``path``."""
    machine_cols = {f"machine_{k}": v for k, v in machine.items()}
    columns = list(FIELDS) + list(machine_cols)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in {**row, **machine_cols}.items()})
    os.replace(tmp, path)
    return path
