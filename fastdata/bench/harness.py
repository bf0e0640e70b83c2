"""Run a benchmark grid: each configuration in a fresh process, results collected and written.

:func:`run_isolated` measures one :class:`~fastdata.bench.grid.BenchConfig` in a
new ``python -m fastdata.bench.runner`` process (its own session, so a timeout
kills the runner *and* its DataLoader workers). Whatever goes wrong there (the
dataset raises in a worker, a worker or the runner is killed, e.g. by the
out-of-memory killer, the time limit passes) becomes a row with
``status="failed"`` and the reason; the grid goes on.

:func:`run_bench` runs a whole grid with a progress bar, prints the table and
writes ``results.json``, ``results.csv`` and the plots to the output folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from fastdata.bench.envcheck import check_environment
from fastdata.common import portable
from fastdata.bench.grid import RESULT_MARK, STORE_OPTIONS_ENV, BenchConfig
from fastdata.bench.report import complete_row, fingerprint, format_table, write_csv, write_json

DEFAULT_TIMEOUT_S = 900.0
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def _child_env(store_options: dict | None = None) -> dict:
    env = dict(os.environ)
    if store_options:
        env[STORE_OPTIONS_ENV] = json.dumps(store_options)
    # the runner must import this fastdata, whatever the caller's working directory
    env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _kill_group(pid: int) -> None:
    # (os.killpg is missing on Windows: the portable module kills the tree there)
    portable.kill_process_group(pid)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _stderr_tail(stderr: str, lines: int = 3) -> str:
    tail = [line.strip() for line in stderr.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(tail)[-300:]


def run_isolated(cfg: BenchConfig, timeout: float = DEFAULT_TIMEOUT_S, store_options: dict | None = None) -> dict:
    """Measure ``cfg`` in a fresh process.

    Args:
        cfg: the configuration.
        timeout: seconds before the process tree is killed and the row marked failed.
        store_options: for a URL target, :func:`fastdata.open_dataset`'s ``storage_options``,
            ``cache_dir`` and ``cache_limit`` (only those given).

    Returns:
        dict: the row (every ``report.FIELDS`` key): ``status`` is ``"ok"`` or
        ``"failed"`` with ``error`` saying why.
    """
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fastdata.bench.runner"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(store_options),
                            start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(cfg.to_json()), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        return complete_row(cfg, {"status": "failed", "error": f"timed out after {timeout:g} s (killed)",
                                  "run_s": time.perf_counter() - started})
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    _kill_group(proc.pid)  # stragglers (a worker that outlived its parent) must not skew the next row
    result = None
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
            break
    if result is None:
        if proc.returncode < 0:
            why = f"runner killed by {_signal_name(-proc.returncode)}"
            if proc.returncode == -getattr(signal, "SIGKILL", 9):  # (Windows has no SIGKILL)
                why += " (out of memory?)"
        else:
            why = f"runner exited with code {proc.returncode}"
        tail = _stderr_tail(err)
        result = {"status": "failed", "error": why + (f": {tail}" if tail else ""),
                  "run_s": time.perf_counter() - started}
    return complete_row(cfg, result)


def estimate_sample_bytes(cfg: BenchConfig) -> int:
    """Decoded bytes per sample, guessed before measuring (224x224 crops, else ImageNet-sized)."""
    return 224 * 224 * 3 if cfg.transform != "none" else 500 * 375 * 3


def environment_warnings(configs: Sequence[BenchConfig]) -> list[str]:
    """Environment traps for the most demanding configuration of the grid."""
    if not configs:
        return []
    # thread workers hand batches over in this process: no shared memory, no descriptors passed
    processes = [c for c in configs if c.worker_type != "thread"] or [replace(configs[0], workers=0)]
    worst = max(processes,
                key=lambda c: c.workers * (c.prefetch_factor or 1) * c.batch_size * estimate_sample_bytes(c))
    out = check_environment(worst.workers, worst.prefetch_factor or 1, worst.batch_size, estimate_sample_bytes(worst))
    if any(c.cold for c in configs):
        from fastdata.bench.cache import can_evict

        if not can_evict():
            out.append("cold=True needs os.posix_fadvise (Linux): cold rows will fail")
    return out


@dataclass
class BenchResult:
    """What :func:`run_bench` produced.

    Attributes:
        rows: one dict per configuration (every ``report.FIELDS`` key).
        machine: the fingerprint.
        warnings: environment warnings.
        files: paths written (JSON, CSV, plots), empty when no output folder.
        table: the rendered table.
    """

    rows: list
    machine: dict
    warnings: list = field(default_factory=list)
    files: dict = field(default_factory=dict)
    table: str = ""

    @property
    def failed(self) -> list:
        """The rows whose status is ``"failed"``."""
        return [r for r in self.rows if r.get("status") != "ok"]


class _Progress:
    """A tqdm bar over the grid on a terminal, one line per finished row otherwise."""

    def __init__(self, total: int, enabled: bool, stream):
        self.total = total
        self.enabled = enabled
        self.stream = stream
        self.done = 0
        self.bar = None
        if enabled and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="config", file=stream, dynamic_ncols=True)

    def start(self, cfg: BenchConfig) -> None:
        if self.bar is not None:
            self.bar.set_description_str(cfg.label()[:60])

    def finish(self, cfg: BenchConfig, row: dict) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            what = (f"{row['images_per_s']:.0f} img/s" if row.get("status") == "ok"
                    else f"FAILED: {row.get('error')}")
            print(f"[{self.done}/{self.total}] {cfg.label()}: {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_bench(
    configs: Sequence[BenchConfig],
    out: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
    plots: bool = True,
    stream=None,
    run: Callable[..., dict] = run_isolated,
    store_options: dict | None = None,
) -> BenchResult:
    """Measure every configuration (each in a fresh process) and write the report.

    Args:
        configs: from :func:`~fastdata.bench.grid.expand_grid`.
        out: folder for ``results.json``, ``results.csv``, ``table.txt`` and the PNG plots
            (created); None writes nothing.
        timeout: seconds per configuration.
        progress: show a progress bar (a line per row when not a terminal).
        plots: write the PNG plots (needs matplotlib).
        stream: where progress and warnings go (default stderr).
        run: the per-configuration runner (tests may inject one).
        store_options: for URL targets, ``storage_options``/``cache_dir``/``cache_limit``
            (passed to :func:`run_isolated`).

    Returns:
        BenchResult
    """
    stream = sys.stderr if stream is None else stream
    machine = fingerprint()
    warnings = environment_warnings(configs)
    for w in warnings:
        print(f"warning: {w}", file=stream)
    bar = _Progress(len(configs), progress, stream)
    rows = []
    try:
        for cfg in configs:
            bar.start(cfg)
            row = run(cfg, timeout, store_options) if store_options else run(cfg, timeout)
            rows.append(row)
            bar.finish(cfg, row)
    finally:
        bar.close()
    result = BenchResult(rows=rows, machine=machine, warnings=warnings, table=format_table(rows))
    if out is not None:
        os.makedirs(out, exist_ok=True)
        result.files["json"] = write_json(os.path.join(out, "results.json"), rows, machine, warnings)
        result.files["csv"] = write_csv(os.path.join(out, "results.csv"), rows, machine)
        table_path = os.path.join(out, "table.txt")
        with open(table_path, "w") as f:
            f.write(result.table + "\n")
        result.files["table"] = table_path
        if plots:
            from fastdata.bench.plots import write_plots

            result.files.update(write_plots(rows, out))
    return result
