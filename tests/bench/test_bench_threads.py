"""``fastdata bench --worker-type``: thread and process workers as a grid axis, side by side.

Thread rows load with ``fastdata.loader(..., worker_type="thread")``: their memory is the main
process's alone, so per-worker figures are null (not applicable), never a measured zero.
"""

from __future__ import annotations

import json

import pytest

import fastdata
from fastdata.bench import runner
from fastdata.bench.grid import BenchConfig, expand_grid, parse_worker_types
from fastdata.bench.plots import series
from fastdata.bench.report import FIELDS, format_table
from fastdata.bench.runner import measure
from fastdata.cli.main import main


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An LMDB store of 16 small images."""
    root = tmp_path_factory.mktemp("bench_threads")
    from helpers.images import make_tree

    src = make_tree(root / "images", {"a": 8, "b": 8}, size=(120, 96))
    fastdata.convert(src, str(root / "s.lmdb"), workers=1, progress=False)
    return str(root / "s.lmdb")


def test_worker_type_axis(store):
    default = expand_grid([store], workers="0,2")
    assert [(c.workers, c.worker_type) for c in default] == [(0, "process"), (2, "process")]  # unchanged
    both = expand_grid([store], workers="0,2", worker_type="both", start_method="fork")
    assert [(c.workers, c.worker_type) for c in both] == [(0, "process"), (2, "process"), (2, "thread")]
    thread = both[-1]
    assert thread.start_method is None and thread.persistent_workers and thread.prefetch_factor == 2
    assert "threads" in thread.label() and "fork" in both[1].label()
    assert BenchConfig.from_json(thread.to_json()) == thread
    listed = expand_grid([store], workers="1", worker_type="process,thread")
    assert [(c.workers, c.worker_type) for c in listed] == [(1, "process"), (1, "thread")]
    assert parse_worker_types("thread") == ["thread"] and parse_worker_types("both") == ["process", "thread"]
    with pytest.raises(ValueError, match="worker-type"):
        expand_grid([store], workers="1", worker_type="fiber")
    # an older results.json row (before the axis) still reads back, as a process row
    old = {k: v for k, v in thread.to_json().items() if k != "worker_type"}
    assert BenchConfig.from_json(old).worker_type == "process"


def test_make_loader_builds_thread_workers(store):
    cfg = expand_grid([store], workers="2", worker_type="thread", batch_size="4")[0]
    loader = runner.make_loader(cfg, fastdata.open_dataset(store), runner.SubsetShuffle(list(range(8)), 0))
    assert loader.worker_type == "thread" and loader.num_workers == 2
    assert loader.worker_init_fn is None and loader.multiprocessing_context is None
    assert loader.persistent_workers and loader.prefetch_factor == 2
    assert sum(len(labels) for _, labels in loader) == 8


def test_thread_row_measures_with_worker_figures_not_applicable(store):
    cfg = expand_grid([store], workers="2", worker_type="thread", batch_size="4", max_batches=2, epochs=1,
                      cold=False)[0]
    row = measure(cfg)
    assert row["images_per_s"] > 0 and row["samples_per_epoch"] == 8
    assert row["peak_pss_bytes"] > 10 << 20 and row["main_pss_bytes"] > 0
    # one process: no worker of its own to measure
    assert row["peak_uss_per_worker_bytes"] is None and row["worker_pss_bytes"] is None


def _row(workers, worker_type, ips, **extra):
    base = {k: None for k in FIELDS}
    return {**base, "target": "/d/s.lmdb", "kind": "lmdb", "workers": workers, "worker_type": worker_type,
            "batch_size": 8, "prefetch_factor": 2 if workers else None, "persistent_workers": bool(workers),
            "start_method": "fork" if workers and worker_type == "process" else None, "status": "ok",
            "images_per_s": ips, "peak_pss_bytes": 1 << 28, **extra}


def test_table_and_plots_show_the_worker_type():
    rows = [_row(0, "process", 100.0), _row(2, "process", 300.0, peak_uss_per_worker_bytes=1 << 24),
            _row(2, "thread", 400.0)]
    table = format_table(rows)
    header = table.splitlines()[0].split()
    assert "type" in header
    lines = table.splitlines()
    assert any(" thread " in f" {line} " for line in lines[2:]) and any("process" in line for line in lines[2:])
    # a table of thread rows alone still names the type
    assert "type" in format_table([_row(2, "thread", 400.0)]).splitlines()[0].split()
    assert "type" not in format_table(rows[:2]).splitlines()[0].split()  # process only: as before
    lines_by_label = series(rows)
    assert len(lines_by_label) == 2
    labels = sorted(lines_by_label)
    assert any("threads" in label for label in labels) and any("processes" in label for label in labels)
    assert all("None" not in label for label in labels)
    for members in lines_by_label.values():  # the no-worker row starts both lines
        assert members[0]["workers"] == 0


# nightly (8 s): .ci/run tests the worker-type axis, loader, row and table above without the command
@pytest.mark.slow
def test_bench_cli_worker_type_both(store, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", store, "--workers", "2", "--worker-type", "both", "--batch-size", "4", "--max-batches", "2",
               "--epochs", "1", "--warmup-epochs", "0", "--out", str(out), "--quiet"])
    shown = capsys.readouterr().out
    assert rc == 0, shown
    doc = json.loads((out / "results.json").read_text())
    rows = doc["results"]
    assert [(r["workers"], r["worker_type"]) for r in rows] == [(2, "process"), (2, "thread")]
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    proc, thread = rows
    assert proc["peak_uss_per_worker_bytes"] > 0 and thread["peak_uss_per_worker_bytes"] is None
    assert "worker_type" in doc["fields"] and any("worker_type=thread" in n for n in doc["notes"])
    assert "type" in shown.splitlines()[0].split() and "thread" in shown
    assert "worker_type" in (out / "results.csv").read_text().splitlines()[0].split(",")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--worker-type" in capsys.readouterr().out
    assert main(["bench", store, "--workers", "1", "--worker-type", "fiber"]) == 2
