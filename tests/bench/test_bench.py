"""The benchmark harness: grid, isolated runs, failures, cold cache, report files.

Real measurements run on tiny stores with tiny grids (batch 4, 2 batches per epoch);
each configuration is a fresh ``python -m fastdata.bench.runner`` process, as in use.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

import fastdata
from fastdata.bench import cache, envcheck, runner
from fastdata.bench.grid import BenchConfig, expand_grid, target_kind
from fastdata.bench.harness import run_isolated
from fastdata.bench.plots import frontier
from fastdata.bench.report import FIELDS, format_table
from fastdata.bench.runner import failure_reason, measure
from fastdata.cli.main import main
from fastdata.errors import FastdataError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An image folder (16 images), its LMDB and HDF5 stores, and a folder of garbage 'JPEGs'."""
    root = tmp_path_factory.mktemp("bench")
    from helpers.images import make_tree

    src = make_tree(root / "images", {"a": 8, "b": 8}, size=(120, 96))
    fastdata.convert(src, str(root / "s.lmdb"), workers=1, progress=False)
    fastdata.convert(src, str(root / "s.h5"), workers=1, progress=False)
    bad = root / "broken"
    for cls in ("x", "y"):
        (bad / cls).mkdir(parents=True)
        for i in range(4):
            (bad / cls / f"{i}.jpg").write_bytes(b"this is not a jpeg" * 10)
    return {"folder": src, "lmdb": str(root / "s.lmdb"), "hdf5": str(root / "s.h5"), "broken": str(bad)}


# ----------------------------------------------------------------------------- grid


def test_grid_expands_and_collapses_worker_only_axes(data):
    cfgs = expand_grid([data["lmdb"]], workers="0,2", prefetch_factor="2,4", persistent_workers="on,off",
                       start_method="fork,spawn")
    zero = [c for c in cfgs if c.workers == 0]
    assert len(zero) == 1 and zero[0].prefetch_factor is None and zero[0].start_method is None
    assert len([c for c in cfgs if c.workers == 2]) == 2 * 2 * 2
    assert all(c.kind == "lmdb" for c in cfgs)
    assert BenchConfig.from_json(cfgs[-1].to_json()) == cfgs[-1]


def test_grid_defaults_and_errors(data):
    cfgs = expand_grid([data["folder"], data["hdf5"]])
    from fastdata.bench.grid import available_cores

    assert [c.workers for c in cfgs if c.kind == "folder"] == list(range(available_cores() + 1))
    assert {target_kind(data["folder"]), target_kind(data["lmdb"]), target_kind(data["hdf5"])} == \
        {"folder", "lmdb", "hdf5"}
    with pytest.raises(ValueError, match="transform"):
        expand_grid([data["lmdb"]], transform="blur")
    with pytest.raises(ValueError, match="workers"):
        expand_grid([data["lmdb"]], workers="two")
    with pytest.raises(ValueError, match="on/off"):
        expand_grid([data["lmdb"]], persistent_workers="maybe")
    with pytest.raises(FastdataError, match="does not exist"):
        expand_grid([data["lmdb"] + "-missing"])


# ------------------------------------------------------------------ the whole harness


# nightly (16 s): .ci/run runs the bench command over a remote store (tests/remote/test_remote_cli.py)
# and the harness's lighter tests here
@pytest.mark.slow
def test_bench_cli_tiny_grid_writes_every_field_and_survives_failures(data, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", data["broken"], data["lmdb"], "--workers", "0,1", "--batch-size", "4", "--max-batches", "2",
               "--epochs", "1", "--transform", "rrc224", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1  # some configuration failed; the others were still measured and reported

    doc = json.loads((out / "results.json").read_text())
    for key in ("cores", "memory_bytes", "python", "torch", "Pillow", "lmdb", "h5py"):
        assert doc["machine"][key], key
    rows = doc["results"]
    assert len(rows) == 4
    for row in rows:
        assert set(FIELDS) <= set(row)
    broken, good = rows[:2], rows[2:]
    assert [r["status"] for r in broken] == ["failed", "failed"]
    assert "UnidentifiedImageError" in broken[0]["error"]
    assert "worker process" in broken[1]["error"] and "cannot identify image file" in broken[1]["error"]
    for row in good:
        assert row["status"] == "ok", row["error"]
        assert row["images_per_s"] > 0 and row["mb_per_s"] > 0
        assert len(row["images_per_s_epochs"]) == 1 and len(row["pss_per_epoch_bytes"]) == 2
        assert row["samples_per_epoch"] == 8 and row["batches_per_epoch"] == 2
        assert row["time_to_first_batch_s"] > 0
        assert row["peak_pss_bytes"] > 10 << 20 and row["peak_rss_bytes"] >= row["peak_pss_bytes"] * 0.9
        # epochs this short are near the 10 ms CPU-accounting tick: only sanity here, see test_tree_cpu_*
        assert row["cpu_util"] >= 0 and 0 <= row["data_wait_fraction"] <= 1
        assert row["decoded_bytes_per_sample"] == 224 * 224 * 3
        assert "RandomResizedCrop" in row["pipeline"]
        assert row["h2d_ms_per_batch"] is None or row["h2d_ms_per_batch"] > 0
    w0, w1 = good
    assert w0["peak_uss_per_worker_bytes"] is None and w1["peak_uss_per_worker_bytes"] > 1 << 20
    assert w1["worker_pss_bytes"] > 0

    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[: len(FIELDS)] == list(FIELDS)
        assert "machine_torch" in reader.fieldnames and "machine_h5py" in reader.fieldnames
        csv_rows = list(reader)
    assert len(csv_rows) == 4 and float(csv_rows[3]["images_per_s"]) == pytest.approx(w1["images_per_s"])

    for name in ("throughput_vs_workers.png", "pss_vs_workers.png", "throughput_vs_memory.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    table = (out / "table.txt").read_text()
    assert "FAILED" in table and "img/s" in table and "peak PSS" in table
    assert "img/s" in captured.out and "[4/4]" in captured.err


# A runner that never finishes, with a worker process of its own (its pid written to argv[1]).
_HUNG_RUNNER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(str(worker.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


def test_timeout_kills_the_run_and_its_workers(data, tmp_path, monkeypatch):
    """A run that does not finish in time is killed with its workers. The run here never
    finishes (whatever the machine's speed, the timeout fires), and the timeout starts once
    its worker exists."""
    import psutil

    cfg = expand_grid([data["folder"]], workers="1", batch_size="4", max_batches=2)[0]
    pidfile = tmp_path / "worker.pid"
    real = subprocess.Popen
    runners = []

    def popen(_args, **kwargs):
        proc = real([sys.executable, "-c", _HUNG_RUNNER, str(pidfile)], **kwargs)
        runners.append(proc)
        deadline = time.monotonic() + 60  # a watchdog for the runner's start-up
        while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc
    monkeypatch.setattr(subprocess, "Popen", popen)
    row = run_isolated(cfg, timeout=0.5)
    assert row["status"] == "failed" and "timed out" in row["error"]
    assert set(FIELDS) <= set(row)
    assert runners[0].poll() is not None
    worker = int(pidfile.read_text())  # the worker was started before the timeout began
    deadline = time.monotonic() + 10  # a watchdog: SIGKILL takes effect at once
    while time.monotonic() < deadline:
        try:
            if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                break  # dead, not yet reaped by whoever adopted it
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the run's worker outlived the timeout")


def test_killed_runner_is_reported_as_failed(data, monkeypatch):
    cfg = expand_grid([data["folder"]], workers="0")[0]
    suicide = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    monkeypatch.setattr(subprocess, "Popen", _popen_with(suicide))
    row = run_isolated(cfg, timeout=30)
    assert row["status"] == "failed"
    assert "SIGKILL" in row["error"] and "out of memory" in row["error"]


def _popen_with(command):
    real = subprocess.Popen

    def popen(_args, **kwargs):
        return real(command, **kwargs)

    return popen


def test_tree_cpu_seconds_counts_live_and_finished_children():
    from fastdata.bench.runner import tree_cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    before = tree_cpu_seconds()
    live = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"])
    try:
        deadline = time.time() + 20
        while tree_cpu_seconds() - before < 0.25 and time.time() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds() - before >= 0.25  # a live child (a persistent worker) is counted
    finally:
        live.kill()
        live.wait()
    mid = tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert tree_cpu_seconds() - mid >= 0.25  # and so is one that has exited and been reaped


class _FakeClock:
    """The runner's ``time`` module on a clock of its own: time passes only when a batch is
    loaded (``load_s`` each) or a training step sleeps, so every figure has an exact value."""

    def __init__(self, load_s: float):
        self.now, self.load_s = 0.0, load_s

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def loader(self, real):
        """Wrap the loader factory ``real`` (``runner.make_loader``): each batch its DataLoader
        yields costs ``load_s``; the result is :func:`measure`'s ``loader_factory``."""
        clock = self

        class Timed:
            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                for batch in self.inner:
                    clock.now += clock.load_s
                    yield batch
        return lambda *args, **kwargs: Timed(real(*args, **kwargs))


def test_step_ms_measures_the_data_wait_fraction(data, monkeypatch):
    """The figures follow from the times measured: on a fake clock (10 ms per batch loaded,
    ``step_ms`` per batch stepped) each has one exact value. Only bounds that hold under any
    load are checked on the real clock (a busy machine once read 0.877 for an expected > 0.9)."""
    import types

    cfg = expand_grid([data["hdf5"]], workers="0", batch_size="4", max_batches=3, epochs=2)[0]
    stepped_cfg = BenchConfig.from_json({**cfg.to_json(), "step_ms": 60.0})

    # the real clock: a 60 ms step per batch is time not spent waiting for data, however slow the machine
    real = measure(stepped_cfg)
    assert 0 <= real["data_wait_fraction"] <= 1
    for epoch_s in real["epoch_s"]:
        assert epoch_s >= 3 * 0.060
    assert sum(real["epoch_s"]) * (1 - real["data_wait_fraction"]) >= 2 * 3 * 0.060 - 1e-9

    # a fake clock: the formulas
    clock = _FakeClock(load_s=0.010)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep))
    timed = clock.loader(runner.make_loader)
    busy, stepped = measure(cfg, loader_factory=timed), measure(stepped_cfg, loader_factory=timed)
    # no step: the loop does nothing but wait for data
    assert busy["data_wait_fraction"] == pytest.approx(1.0)
    assert busy["epoch_s"] == pytest.approx([3 * 0.010] * 2)
    assert busy["images_per_s"] == pytest.approx(12 / 0.030)
    assert busy["time_to_first_batch_s"] == pytest.approx(0.010)
    # a 60 ms step per 10 ms batch: the loader waits 1/7 of the time
    assert stepped["data_wait_fraction"] == pytest.approx(0.010 / 0.070)
    assert stepped["epoch_s"] == pytest.approx([3 * 0.070] * 2)
    assert stepped["images_per_s"] == pytest.approx(12 / 0.210)


def test_failure_reason_names_the_worker_error():
    err = RuntimeError("Caught OSError in DataLoader worker process 3.\nOriginal Traceback (most recent call "
                       "last):\n  File 'x.py', line 1\nOSError: image file is truncated")
    assert failure_reason(err) == "Caught OSError in DataLoader worker process 3: OSError: image file is truncated"
    assert failure_reason(ValueError("bad\nmore")) == "ValueError: bad"


# ------------------------------------------------------------------------ cold cache


def test_cold_evicts_every_file_before_every_epoch(data, monkeypatch):
    calls = []
    real = cache.evict_page_cache

    def spy(paths):
        paths = list(paths)
        calls.append(paths)
        return real(paths)

    monkeypatch.setattr(cache, "evict_page_cache", spy)
    cfg = expand_grid([data["folder"]], workers="0", batch_size="4", max_batches=1, epochs=2, cold=True)[0]
    row = measure(cfg)
    images = sorted(glob.glob(os.path.join(data["folder"], "*", "*.jpg")))
    assert len(calls) == 3  # warm-up + 2 measured epochs
    assert all(sorted(c) == images for c in calls)  # every image file, not only the 4 read
    assert row["cold_evicted_files"] == len(images)

    calls.clear()
    cfg = expand_grid([data["hdf5"]], workers="0", batch_size="4", max_batches=1, epochs=1, cold=True)[0]
    measure(cfg)
    shards = sorted(glob.glob(os.path.join(data["hdf5"], "shard-*.h5")))
    assert len(calls) == 2 and all(sorted(c) == shards for c in calls)

    calls.clear()
    cfg = expand_grid([data["folder"]], workers="0", batch_size="4", max_batches=1, epochs=1)[0]
    measure(cfg)
    assert calls == []  # control: warm runs evict nothing


def _evictable(tmp_path) -> bool:
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 16))
    probe.read_bytes()
    cache.evict_page_cache([str(probe)])
    return cache.resident_fraction([str(probe)]) == 0.0


def test_eviction_really_drops_pages(tmp_path):
    if cache.resident_fraction([__file__]) is None:
        pytest.skip("mincore is not available on this platform")
    files = []
    for i in range(5):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(256 << 10))
        files.append(str(p))
    for p in files:
        with open(p, "rb") as f:
            f.read()
    assert cache.resident_fraction(files) > 0.9  # control: read files are cached
    if not _evictable(tmp_path):
        pytest.skip(f"{tmp_path} is on a filesystem whose page cache is its storage (tmpfs)")
    assert cache.evict_page_cache(files) == files
    assert cache.resident_fraction(files) < 0.05
    assert cache.evict_page_cache([str(tmp_path / "missing")]) == []


@pytest.mark.parametrize("kind", ["lmdb", "hdf5"])
def test_cold_run_is_really_cold_even_with_persistent_workers(data, tmp_path, monkeypatch, kind):
    """Persistent workers' store maps would keep pages cached; the runner makes them let go."""
    if not _evictable(tmp_path):
        pytest.skip("page cache cannot be evicted here (tmpfs or no mincore)")
    cfg = expand_grid([data[kind]], workers="2", batch_size="2", max_batches=4, epochs=2, cold=True,
                      persistent_workers="on", start_method="fork")[0]
    row = measure(cfg)
    assert row["cold_residency_after_evict"] is not None and row["cold_residency_after_evict"] < 0.05
    assert row["cold_evicted_files"] == 1

    class KeepOpen(runner.CloseAfterFetch):  # control: workers keep their maps between epochs
        def __getitems__(self, indices):
            return self.inner.__getitems__(indices)

    monkeypatch.setattr(runner, "CloseAfterFetch", KeepOpen)
    assert measure(cfg)["cold_residency_after_evict"] > 0.2


# --------------------------------------------------------------------- small pieces


def test_environment_warnings(tmp_path):
    assert envcheck.check_shm(4, 2, 64, 150_528, shm_path=str(tmp_path)) == []
    warn = envcheck.check_shm(4, 2, 64, 1e15, shm_path=str(tmp_path))
    assert len(warn) == 1 and "--shm-size" in warn[0]
    assert envcheck.check_shm(0, 2, 64, 1e15, shm_path=str(tmp_path)) == []  # no workers, no shared memory
    assert "ulimit -n" in envcheck.check_nofile(8, 2, limit=1024)[0]
    assert envcheck.check_nofile(8, 2, limit=65536) == []


def test_table_shows_failures_and_ratios():
    base = {k: None for k in FIELDS}
    rows = [
        {**base, "target": "/d/imgs", "kind": "folder", "workers": 0, "batch_size": 8, "status": "ok",
         "images_per_s": 100.0, "peak_pss_bytes": 1 << 28},
        {**base, "target": "/d/s.lmdb", "kind": "lmdb", "workers": 0, "batch_size": 8, "status": "ok",
         "images_per_s": 250.0, "peak_pss_bytes": 1 << 28},
        {**base, "target": "/d/s.lmdb", "kind": "lmdb", "workers": 2, "batch_size": 8, "status": "failed",
         "error": "runner killed by SIGKILL"},
    ]
    table = format_table(rows)
    assert "FAILED: runner killed by SIGKILL" in table
    assert "s.lmdb (lmdb) 2.50x" in table
    assert "batch=8" in table  # constant axes summarised once


def test_frontier():
    pts = [(100, 50), (200, 40), (150, 80), (300, 90), (120, 80)]
    assert frontier(pts) == [(100, 50), (120, 80), (300, 90)]


def test_cli_help_and_errors(capsys, data):
    for cmd, words in (("bench", ["--workers", "--prefetch-factor", "--persistent-workers", "--pin-memory",
                                  "--start-method", "--output", "--transform", "--epochs", "--max-batches",
                                  "--cold", "--step-ms", "--out"]),
                       ("tune", ["--memory-budget", "--batch-size", "--step-ms", "--effective-batch-size"]),
                       ("doctor", ["MODULE:ATTRIBUTE"])):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        for w in words:
            assert w in text, (cmd, w)
    assert main(["bench", data["lmdb"] + "-missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastdata: error:") and len(err.splitlines()) == 1
    assert main(["bench", data["lmdb"], "--transform", "sharpen"]) == 2


def test_cold_is_an_axis_warm_and_cold_rows_side_by_side(data):
    both = expand_grid([data["lmdb"]], workers="0,1", cold="off,on")
    assert [(c.workers, c.cold) for c in both] == [(0, False), (0, True), (1, False), (1, True)]
    assert [c.cold for c in expand_grid([data["lmdb"]], workers="0", cold=True)] == [True]  # the bool form
    assert [c.cold for c in expand_grid([data["lmdb"]], workers="0")] == [False]
    with pytest.raises(ValueError, match="on/off"):
        expand_grid([data["lmdb"]], workers="0", cold="tepid")


def test_rows_say_each_targets_storage_and_disk_size(data, tmp_path, capsys):
    """A raw-pixel store of a folder's images and the folder: each row names its storage and size, and
    the ratio line gives speed and disk against the folder (every storage mode's words:
    test_describe_storage_names_every_storage_mode)."""
    raw = str(tmp_path / "raw.lmdb")
    fastdata.convert(data["folder"], raw, storage="raw", max_side=64, workers=1, progress=False)
    out = tmp_path / "out"
    rc = main(["bench", data["folder"], raw, "--workers", "0", "--batch-size", "4",
               "--max-batches", "1", "--epochs", "1", "--warmup-epochs", "0",
               "--out", str(out), "--no-plots", "--quiet"])  # (cold rows: test_cold_evicts_every_file_*)
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [(r["kind"], r["cold"]) for r in rows] == [("folder", False), ("lmdb", False)]
    folder, raw_row = rows
    files = [p for p in pathlib.Path(data["folder"]).rglob("*") if p.is_file()]
    assert folder["storage"] == "files" and folder["disk_bytes"] == sum(p.stat().st_size for p in files)
    manifest = json.loads((pathlib.Path(raw) / "manifest.json").read_text())
    assert raw_row["storage"] == "raw-native <=64"
    assert raw_row["disk_bytes"] == sum(s["bytes"] for s in manifest["shards"])
    assert raw_row["disk_bytes"] != folder["disk_bytes"]
    assert "storage" in table and "raw-native <=64" in table and "(disk " in table


@pytest.mark.parametrize("storage, words", [
    ({"mode": "original"}, "original"),
    ({"mode": "lossless"}, "lossless"),
    ({"mode": "raw-native", "max_side": 512}, "raw-native <=512"),
    ({"mode": "mixed", "max_side": 256, "raw_fraction": 0.5}, "mixed 50% raw <=256"),
    ({"mode": "raw", "raw_shape": [32, 48]}, "raw 32x48"),
    ({"mode": "reencode", "max_side": 512, "quality": 90}, "reencode <=512 q90"),
])
def test_describe_storage_names_every_storage_mode(storage, words):
    from fastdata.bench.pipelines import describe_storage

    assert describe_storage(storage) == words
