"""PNG plots of benchmark rows (matplotlib, Agg backend: no display needed).

* ``throughput_vs_workers.png``: images/s against ``num_workers``, one line per target
  (and per other setting that varies: thread and process workers are lines of their own).
* ``pss_vs_workers.png``: peak PSS of main + workers against ``num_workers``.
* ``throughput_vs_memory.png``: every configuration as a point (peak PSS, images/s)
  with the trade-off frontier: the configurations no other one beats on both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fastdata.common.extras import require

_BASE_AXES = ("batch_size", "pin_memory", "output", "transform", "cold", "step_ms")
_WORKER_AXES = ("worker_type", "prefetch_factor", "persistent_workers", "start_method")
_SHORT = {"batch_size": "bs", "pin_memory": "pin", "output": "", "transform": "", "cold": "cold",
          "step_ms": "step", "prefetch_factor": "pf", "persistent_workers": "persist", "start_method": "",
          "worker_type": ""}


def _name(row: dict) -> str:
    return f"{os.path.basename(str(row['target']).rstrip('/'))} ({row['kind']})"


def _varying(rows: Sequence[dict], axes) -> list:
    return [a for a in axes if len({str(r.get(a)) for r in rows if not (a in _WORKER_AXES and not r["workers"])}) > 1]


def _axis_text(axis: str, value) -> str:
    short = _SHORT[axis]
    if value is None:  # e.g. no start method for thread workers
        return ""
    if axis == "worker_type":
        return "threads" if value == "thread" else "processes"
    if isinstance(value, bool):
        return short if value else f"no-{short}"
    return f"{short}={value}" if short else str(value)


def series(rows: Sequence[dict]) -> dict:
    """Group ok rows into lines over ``workers``: ``{label: [rows sorted by workers]}``.

    A ``workers=0`` row has no prefetch/persistence/start method, so it starts every
    line that shares its other settings.
    """
    ok = [r for r in rows if r.get("status") == "ok"]
    base_vary, worker_vary = _varying(ok, _BASE_AXES), _varying(ok, _WORKER_AXES)
    groups: dict = {}
    for r in ok:
        base = (r["target"], r["kind"]) + tuple(r.get(a) for a in _BASE_AXES)
        groups.setdefault(base, []).append(r)
    lines = {}
    for members in groups.values():
        zero = [r for r in members if not r["workers"]]
        by_worker_key: dict = {}
        for r in members:
            if r["workers"]:
                by_worker_key.setdefault(tuple(r.get(a) for a in _WORKER_AXES), []).append(r)
        if not by_worker_key:
            by_worker_key = {None: []}
        for wkey, wrows in by_worker_key.items():
            first = (zero + wrows)[0]
            parts = [_name(first)] + [_axis_text(a, first.get(a)) for a in base_vary]
            if wkey is not None:
                parts += [_axis_text(a, v) for a, v in zip(_WORKER_AXES, wkey, strict=False) if a in worker_vary]
            lines[" ".join(p for p in parts if p)] = sorted(zero + wrows, key=lambda r: r["workers"])
    return lines


def frontier(points: Sequence[tuple]) -> list:
    """The points ``(memory, throughput, ...)`` that no other point beats on both
    (less or equal memory and more throughput), sorted by memory."""
    best = []
    top = float("-inf")
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if p[1] > top:
            best.append(p)
            top = p[1]
    return best


_PURPOSE = "benchmark plots (skip them with plots=False)"


def check_plotting() -> None:
    """Fail early, before a long run, when matplotlib is missing.

    Raises:
        fastdata.common.extras.MissingExtraError: one line naming the extra to install.
    """
    require("matplotlib", _PURPOSE)


def write_plots(rows: Sequence[dict], out: str) -> dict:
    """Write the three PNGs into ``out``. Returns ``{name: path}`` (empty when no row succeeded)."""
    matplotlib = require("matplotlib", _PURPOSE)
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    lines = series(rows)
    if not lines:
        return {}
    mib = 1024 * 1024
    paths = {}
    for key, field, ylabel, title, scale in (
        ("plot_throughput", "images_per_s", "images / s", "Throughput vs num_workers", 1),
        ("plot_pss", "peak_pss_bytes", "peak PSS, main + workers (MiB)", "Peak memory vs num_workers", mib),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, members in lines.items():
            ax.plot([r["workers"] for r in members], [r[field] / scale for r in members], marker="o", label=label)
        ax.set_xlabel("num_workers")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = "throughput_vs_workers.png" if field == "images_per_s" else "pss_vs_workers.png"
        paths[key] = os.path.join(out, name)
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = []
    for label, members in lines.items():
        xs = [r["peak_pss_bytes"] / mib for r in members]
        ys = [r["images_per_s"] for r in members]
        ax.scatter(xs, ys, label=label)
        for r, x, y in zip(members, xs, ys, strict=False):
            mark = "t" if r.get("worker_type") == "thread" else "w"  # t4: four threads, w4: four processes
            ax.annotate(f"{mark}{r['workers']}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        points += list(zip(xs, ys, strict=False))
    edge = frontier(sorted(set(points)))
    ax.step([p[0] for p in edge], [p[1] for p in edge], where="post", color="black", linewidth=1, alpha=0.6,
            label="frontier")
    ax.set_xlabel("peak PSS, main + workers (MiB)")
    ax.set_ylabel("images / s")
    ax.set_title("Throughput vs memory")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["plot_frontier"] = os.path.join(out, "throughput_vs_memory.png")
    fig.savefig(paths["plot_frontier"], dpi=110)
    plt.close(fig)
    return paths
