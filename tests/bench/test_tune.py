"""The memory-aware tuner: never recommends more than the budget, uses it when it can.

A synthetic target stands in for real measurements in the search's tests: its peak
PSS follows the estimator's law (times a noise factor; for thread workers the law of one
process) and its throughput grows with workers up to the cores, with zero workers on a
line of their own, and thread workers on theirs (a GIL-holding transform keeps them at one
thread's speed, however many). Real stores of
mixed image sizes check what a synthetic target cannot: every printed snippet runs,
the pick keeps up with what ``fastdata bench`` measures, the memory prediction is
within 20% of the measured peak.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastdata.bench.tune import (
    Measurement,
    Probe,
    Settings,
    TuneResult,
    accumulation_snippet,
    dataloader_snippet,
    estimate_memory,
    tune,
    worker_ladder,
)
from fastdata.errors import FastdataError

MiB = 1 << 20


class Synthetic:
    """A target whose memory and speed follow known laws; records what was measured."""

    def __init__(self, sample_bytes, main=200 * MiB, worker=60 * MiB, cores=8, per_worker=300.0, noise=1.0,
                 step_ms=0.0, zero_workers_ips=None, per_thread=None, gil=False):
        self.sample = sample_bytes
        self.main, self.worker, self.cores = main, worker, cores
        self.per_worker = per_worker
        self.noise = noise  # real usage is higher than the estimator's law by this factor
        self.step_ms = step_ms
        # loading in the main process (its own torch threads): not on the workers' line
        self.zero_workers_ips = per_worker * 0.5 if zero_workers_ips is None else zero_workers_ips
        # thread workers: per_thread images/s each (default: as a worker process) up to the cores;
        # gil=True: loading holds the GIL, so any number of threads runs at one thread's speed
        self.per_thread = per_worker if per_thread is None else per_thread
        self.gil = gil
        self.measured: list[Settings] = []

    def peak(self, s: Settings) -> int:
        return int(estimate_memory(s, self.probe()) * self.noise)

    def __call__(self, s: Settings) -> Measurement:
        self.measured.append(s)
        if not s.workers:
            ips = self.zero_workers_ips
        elif s.worker_type == "thread":
            ips = self.per_thread * (1 if self.gil else min(s.workers, self.cores))
        else:
            ips = self.per_worker * min(s.workers, self.cores)
        ips *= 1 + 0.02 * (s.prefetch_factor - 2)
        wait = None
        if self.step_ms:
            step_ips = s.batch_size / (self.step_ms / 1e3)
            wait = max(0.0, 1 - ips / step_ips)
            ips = min(ips, step_ips)
        return Measurement(ok=True, images_per_s=ips, peak_pss=self.peak(s), data_wait_fraction=wait)

    def probe(self) -> Probe:
        return Probe(main_bytes=self.main, worker_bytes=self.worker, sample_bytes=self.sample)


def quiet(_line):
    pass


@settings(max_examples=150, deadline=None)
@given(
    sample=st.integers(1_000, 2_000_000),
    budget_mib=st.integers(100, 8000),
    batch=st.sampled_from([1, 8, 32, 64, 256]),
    cores=st.integers(0, 16),
    noise=st.floats(0.7, 1.6),
    allow_zero=st.booleans(),
)
# found by hypothesis: the estimate (noise 1) put the only fitting configuration
# over the skip margin, and the tuner said "nothing fits" without measuring it
@example(sample=1000, budget_mib=151, batch=1, cores=0, noise=0.75, allow_zero=True)
def test_recommendation_never_exceeds_budget(sample, budget_mib, batch, cores, noise, allow_zero):
    target = Synthetic(sample, cores=max(cores, 1), noise=noise)
    budget = budget_mib * MiB
    try:
        result = tune(target, target.probe, budget, batch_size=batch, max_workers=cores, log=quiet,
                      allow_no_workers=allow_zero)
    except FastdataError:
        # only allowed when even the cheapest allowed configuration at this batch is over
        cheapest = Settings(0 if allow_zero or not cores else 1, batch)
        assert target.peak(cheapest) > budget
        return
    assert result.measured.peak_pss <= budget
    assert target.peak(result.settings) <= budget
    assert result.settings.workers <= cores
    assert result.settings in target.measured  # recommended only what was measured
    if cores and not allow_zero:
        assert result.settings.workers >= 1


@settings(max_examples=100, deadline=None)
@given(sample=st.integers(10_000, 1_000_000), budget_mib=st.integers(150, 4000),
       effective=st.sampled_from([64, 256, 1000, 4096]))
def test_effective_batch_gives_largest_fitting_batch_and_accumulation(sample, budget_mib, effective):
    target = Synthetic(sample, main=100 * MiB, worker=40 * MiB, cores=4)
    budget = budget_mib * MiB
    try:
        result = tune(target, target.probe, budget, effective_batch_size=effective, max_workers=4, log=quiet)
    except FastdataError:
        assert target.peak(Settings(0, 1)) > budget
        return
    b = result.settings.batch_size
    assert result.measured.peak_pss <= budget
    assert result.accumulation_steps == math.ceil(effective / b)
    assert b * result.accumulation_steps >= effective
    candidates = [effective]
    while candidates[-1] > 1:
        candidates.append(candidates[-1] // 2)
    if b < effective:  # the next larger candidate does not fit with one worker
        larger = candidates[candidates.index(b) - 1]
        assert target.peak(Settings(1, larger)) > budget


def test_budget_binds_more_workers_with_more_memory():
    """Control: the same target gets more workers when the budget allows them."""
    target = Synthetic(150_528, cores=8)
    tight = tune(target, target.probe, 700 * MiB, batch_size=64, max_workers=8, log=quiet)
    roomy = tune(Synthetic(150_528, cores=8), Synthetic(150_528).probe(), 8000 * MiB, batch_size=64,
                 max_workers=8, log=quiet)
    assert tight.settings.workers < roomy.settings.workers == 8
    # the tight budget was binding: one more worker would not have fit
    over = Settings(tight.settings.workers + 1, 64, 2)
    assert target.peak(over) > 700 * MiB
    assert any("exceed the budget" in n for n in tight.notes)


def test_stops_when_loader_outruns_the_step():
    # 64 images per 100 ms step = 640 img/s needed; one worker gives 300, three give 900
    target = Synthetic(150_528, cores=8, step_ms=100.0)
    result = tune(target, target.probe, 16000 * MiB, batch_size=64, max_workers=8, step_ms=100.0, log=quiet)
    assert result.settings.workers < 8
    assert any("keeps up" in n or "levelled off" in n for n in result.notes)
    assert max(s.workers for s in target.measured) <= 4


def test_over_budget_candidates_are_not_measured():
    target = Synthetic(1_000_000, cores=16)  # 64 MB per batch: workers get expensive fast
    result = tune(target, target.probe, 1000 * MiB, batch_size=64, max_workers=16, log=quiet)
    skipped = [t for t in result.trials if t.verdict.startswith("skipped")]
    assert skipped and all(t.measured is None for t in skipped)
    assert all(estimate_memory(t.settings, target.probe()) > 1000 * MiB for t in skipped)
    assert result.measured.peak_pss <= 1000 * MiB


def test_failed_measurement_is_never_recommended():
    target = Synthetic(150_528, cores=4)

    def flaky(s):
        if s.workers >= 2:
            return Measurement(ok=False, error="worker killed by SIGKILL")
        return target(s)

    result = tune(flaky, target.probe, 16000 * MiB, batch_size=32, max_workers=4, log=quiet)
    assert result.settings.workers == 1
    assert any(t.verdict.startswith("failed") for t in result.trials)


def test_nothing_fits_is_an_error():
    target = Synthetic(150_528)
    with pytest.raises(FastdataError, match="nothing fits"):
        tune(target, target.probe, 50 * MiB, batch_size=64, max_workers=2, log=quiet)


def test_estimate_printed_before_measuring():
    lines = []
    target = Synthetic(150_528, cores=2)
    tune(target, target.probe, 4000 * MiB, batch_size=16, max_workers=2, log=lines.append)
    text = "\n".join(lines)
    assert text.index("predicted peak PSS") < text.index("measuring:")
    assert "measured" in text.split("measuring:")[1]


def test_worker_ladder():
    assert worker_ladder(0) == []
    assert worker_ladder(1) == [1]
    assert worker_ladder(6) == [1, 2, 4, 6]
    assert worker_ladder(8) == [1, 2, 4, 8]


def test_snippets_are_valid_python():
    target = Synthetic(150_528, cores=4)
    result = tune(target, target.probe, 500 * MiB, effective_batch_size=1024, max_workers=4, log=quiet)
    assert result.accumulation_steps > 1
    for kind in ("lmdb", "folder"):
        code = dataloader_snippet(result, "/data/train.lmdb", kind, transform="rrc224")
        compile(code, "<snippet>", "exec")
        assert f"batch_size={result.settings.batch_size}" in code
        assert f"num_workers={result.settings.workers}" in code
    loop = accumulation_snippet(result)
    compile(loop, "<loop>", "exec")
    assert f"accumulation_steps = {result.accumulation_steps}" in loop


def test_non_monotone_throughput_does_not_stop_at_one_worker():
    """0 workers (the main process' own threads) beat 1 worker, 2 workers beat both: pick 2.

    The shape measured on a 2-core machine (rrc224, LMDB): about 1000 img/s with no
    worker, fewer with one, 1500-1800 with two. Stopping when 1 worker is not faster
    than 0 recommended 0.
    """
    target = Synthetic(150_528, cores=2, per_worker=800.0, zero_workers_ips=1000.0)
    result = tune(target, target.probe, 8000 * MiB, batch_size=64, max_workers=2, log=quiet)
    assert result.settings.workers == 2
    fastest = max(t.measured.images_per_s for t in result.trials if t.measured)
    assert result.measured.images_per_s >= fastest * 0.95  # within the default min_gain
    # the same shape with room to grow: 1 loses to 0, 2 and 4 gain, 8 levels off
    wide = Synthetic(150_528, cores=4, per_worker=300.0, zero_workers_ips=500.0)
    assert tune(wide, wide.probe, 8000 * MiB, batch_size=64, max_workers=8, log=quiet).settings.workers == 4


def test_zero_workers_only_when_asked_and_measurably_faster():
    # no worker count reaches the main process' own speed
    fast_main = Synthetic(150_528, cores=2, per_worker=300.0, zero_workers_ips=2000.0)
    lines: list[str] = []
    default = tune(fast_main, fast_main.probe, 8000 * MiB, batch_size=64, max_workers=2, log=lines.append)
    assert default.settings.workers >= 1
    assert Settings(0, 64) not in fast_main.measured  # not even measured: it cannot be recommended
    assert any("allow_no_workers=True" in n for n in default.notes)
    asked = tune(fast_main, fast_main.probe, 8000 * MiB, batch_size=64, max_workers=2, allow_no_workers=True,
                 log=quiet)
    assert asked.settings.workers == 0
    # asked for, but not faster than workers: workers keep loading off the training step
    slow_main = Synthetic(150_528, cores=2, per_worker=300.0, zero_workers_ips=610.0)
    assert tune(slow_main, slow_main.probe, 8000 * MiB, batch_size=64, max_workers=2, allow_no_workers=True,
                log=quiet).settings.workers == 2


def test_effective_batch_size_says_it_replaces_batch_size():
    target = Synthetic(150_528, cores=2)
    lines: list[str] = []
    result = tune(target, target.probe, 8000 * MiB, batch_size=64, effective_batch_size=256, max_workers=2,
                  log=lines.append)
    said = [n for n in result.notes if "effective_batch_size=256" in n]
    assert said and "batch_size=64 is not used" in said[0]
    assert said[0] in lines  # on screen as it happens, not only in the result
    assert result.settings.batch_size == 256
    # without --batch-size there is nothing to replace, but the batch choice is still explained
    quiet_notes = tune(target, target.probe, 8000 * MiB, effective_batch_size=256, max_workers=2, log=quiet).notes
    assert any("effective_batch_size=256" in n and "not used" not in n for n in quiet_notes)


# ------------------------------------------------------------ thread or process workers

BOTH = ("process", "thread")


def test_thread_memory_law_is_one_process():
    probe = Probe(main_bytes=200 * MiB, worker_bytes=60 * MiB, sample_bytes=1000.0)
    batch = 64 * 1000.0
    for w, full in ((1, False), (4, False), (4, True)):
        in_flight = w * (2 if full else 1)
        threads = estimate_memory(Settings(4 if w == 4 else 1, 64, 2, "thread"), probe, full)
        assert threads == int(200 * MiB + (w + in_flight + 1) * batch)  # no per-worker baseline
        assert threads < estimate_memory(Settings(w, 64, 2, "process"), probe, full)
    assert Settings(0, 64, worker_type="thread") == Settings(0, 64)  # no workers: nothing to choose
    with pytest.raises(ValueError, match="worker_type"):
        Settings(2, 64, worker_type="fiber")


def test_threads_faster_recommends_threads():
    target = Synthetic(150_528, cores=4, per_worker=300.0, per_thread=450.0)
    lines: list[str] = []
    result = tune(target, target.probe, 16000 * MiB, batch_size=64, max_workers=4, log=lines.append,
                  worker_types=BOTH)
    assert result.settings.worker_type == "thread" and result.settings.workers == 4
    assert result.recommendation()["worker_type"] == "thread"
    assert result.to_json()["recommendation"]["worker_type"] == "thread"
    assert set(result.by_worker_type) == {"process", "thread"}
    assert result.by_worker_type["process"].settings.worker_type == "process"
    assert result.reason.startswith("thread workers: 1.50x") and result.reason in result.notes
    # both measured lines are printed next to each other, then the reason
    text = "\n".join(lines)
    i, j = text.index("best worker processes:"), text.index("best thread workers:")
    assert j > i and text.index(result.reason) > j
    # the thread ladder was measured: 1, 2, 4 threads
    assert {s.workers for s in target.measured if s.worker_type == "thread"} >= {1, 2, 4}
    assert result.settings in target.measured


def test_gil_holding_transform_recommends_processes():
    target = Synthetic(150_528, cores=4, per_worker=300.0, gil=True)  # threads stay at 300 img/s
    result = tune(target, target.probe, 16000 * MiB, batch_size=64, max_workers=4, log=quiet, worker_types=BOTH)
    assert result.settings.worker_type == "process" and result.settings.workers == 4
    assert result.reason.startswith("worker processes: thread workers reached only 0.25x")
    assert "GIL" in result.reason
    assert result.recommendation()["worker_type"] == "process"
    # the thread search stopped once more threads gained nothing
    assert max(s.workers for s in target.measured if s.worker_type == "thread") <= 4
    assert any("threads are not" in n for n in result.notes)


def test_threads_win_a_tie_within_min_gain():
    target = Synthetic(150_528, cores=4, per_worker=300.0, per_thread=290.0)  # 3% slower: within 5%
    result = tune(target, target.probe, 16000 * MiB, batch_size=64, max_workers=4, log=quiet, worker_types=BOTH)
    assert result.settings.worker_type == "thread"
    assert "a tie" in result.reason
    slower = Synthetic(150_528, cores=4, per_worker=300.0, per_thread=250.0)  # 17% slower: processes
    assert tune(slower, slower.probe, 16000 * MiB, batch_size=64, max_workers=4, log=quiet,
                worker_types=BOTH).settings.worker_type == "process"


def test_budget_only_threads_fit_recommends_threads():
    """1 MB samples in batches of 64: one worker process costs a baseline and a batch more than one thread."""
    target = Synthetic(1_000_000, cores=4, per_worker=300.0, per_thread=200.0)  # threads slower, but they fit
    probe = target.probe()
    proc1 = target.peak(Settings(1, 64))
    thread1 = target.peak(Settings(1, 64, worker_type="thread"))
    budget = (proc1 + thread1) // 2
    assert thread1 <= budget < proc1
    with pytest.raises(FastdataError, match="nothing fits"):  # control: processes alone do not fit
        tune(Synthetic(1_000_000, cores=4), probe, budget, batch_size=64, max_workers=4, log=quiet)
    result = tune(target, probe, budget, batch_size=64, max_workers=4, log=quiet, worker_types=BOTH)
    assert result.settings.worker_type == "thread" and result.settings.workers >= 1
    assert result.measured.peak_pss <= budget
    assert set(result.by_worker_type) == {"thread"} and result.reason == ""
    only_threads = tune(Synthetic(1_000_000, cores=4), probe, budget, batch_size=64, max_workers=4, log=quiet,
                        worker_types=("thread",))
    assert only_threads.settings.worker_type == "thread"


@settings(max_examples=60, deadline=None)
@given(
    sample=st.integers(1_000, 2_000_000),
    budget_mib=st.integers(100, 8000),
    batch=st.sampled_from([1, 8, 64, 256]),
    cores=st.integers(0, 8),
    noise=st.floats(0.7, 1.6),
    per_thread=st.sampled_from([100.0, 300.0, 600.0]),
    gil=st.booleans(),
)
def test_recommendation_with_both_worker_types_never_exceeds_budget(sample, budget_mib, batch, cores, noise,
                                                                     per_thread, gil):
    target = Synthetic(sample, cores=max(cores, 1), noise=noise, per_thread=per_thread, gil=gil)
    budget = budget_mib * MiB
    try:
        result = tune(target, target.probe, budget, batch_size=batch, max_workers=cores, log=quiet,
                      worker_types=BOTH)
    except FastdataError:
        cheapest = Settings(1 if cores else 0, batch, worker_type="thread")
        assert target.peak(cheapest) > budget
        return
    assert result.measured.peak_pss <= budget and target.peak(result.settings) <= budget
    assert result.settings in target.measured
    assert result.settings.workers <= cores
    # the faster kind wins, or threads within min_gain
    if len(result.by_worker_type) == 2:
        speeds = {k: t.measured.images_per_s for k, t in result.by_worker_type.items()}
        if result.settings.worker_type == "thread":
            assert speeds["thread"] >= speeds["process"] * 0.95
        else:
            assert speeds["thread"] < speeds["process"] * 0.95


def test_thread_config_and_snippet():
    from fastdata.bench.grid import BenchConfig
    from fastdata.bench.tune import config_for

    base = BenchConfig(target="/data/s.lmdb", kind="lmdb", start_method="fork")
    cfg = config_for(base, Settings(4, 32, 2, "thread"))
    assert cfg.worker_type == "thread" and cfg.start_method is None and cfg.persistent_workers
    assert config_for(base, Settings(4, 32)).worker_type == "process"
    result = _result(2, 8, "thread")
    for kind in ("lmdb", "folder"):
        code = dataloader_snippet(result, "/data/train.lmdb", kind, transform="rrc224", start_method="spawn")
        compile(code, "<snippet>", "exec")
        assert "fastdata.loader(" in code and "worker_type='thread'" in code
        assert "worker_init_fn=" not in code and "multiprocessing_context" not in code


@pytest.mark.parametrize("kind,transform", [("lmdb", "rrc224"), ("lmdb", "none"), ("folder", "rrc224")])
def test_printed_thread_snippet_runs(mixed_store, monkeypatch, kind, transform):
    store, folder_root = mixed_store
    if kind == "folder":
        _FakeTorchvision.install(monkeypatch)
    code = dataloader_snippet(_result(2, 8, "thread"), folder_root if kind == "folder" else store, kind,
                              transform, "tensor", uniform_size=False)
    for images, labels in _first_batches(code):
        assert len(images) == len(labels) == 8


# ----------------------------------------------------------------- real stores


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    """An LMDB store of 96 photo-like images of ImageNet-like, mixed sizes (and their folder)."""
    import fastdata
    from fastdata.synth import make_image_folder

    root = tmp_path_factory.mktemp("mixed")
    make_image_folder(root / "src", num_classes=3, per_class=32, size="imagenet", seed=3)
    fastdata.convert(str(root / "src"), str(root / "s.lmdb"), workers=1, progress=False)
    return str(root / "s.lmdb"), str(root / "src")


@pytest.fixture(scope="module")
def deep_mixed_store(tmp_path_factory):
    """Like ``mixed_store`` with 192 images: 6 batches of 32 per epoch, more than 2 workers x
    prefetch 2 keep in flight, so a run's peak is not cut short by the end of its epoch."""
    import fastdata
    from fastdata.synth import make_image_folder

    root = tmp_path_factory.mktemp("deep_mixed")
    make_image_folder(root / "src", num_classes=3, per_class=64, size="imagenet", seed=3)
    fastdata.convert(str(root / "src"), str(root / "s.lmdb"), workers=1, progress=False)
    return str(root / "s.lmdb"), str(root / "src")


def _result(workers: int, batch: int, worker_type: str = "process") -> TuneResult:
    m = Measurement(ok=True, images_per_s=1.0, peak_pss=1)
    return TuneResult(settings=Settings(workers, batch, worker_type=worker_type), measured=m, predicted_pss=1, budget=1,
                      probe=Probe(1, 1, 1.0))


def _first_batches(code: str, n: int = 2) -> list:
    """Execute a printed snippet as a user would and take ``n`` batches from its ``loader``."""
    namespace: dict = {}
    exec(compile(code, "<tune snippet>", "exec"), namespace)
    it = iter(namespace["loader"])
    try:
        return [next(it) for _ in range(n)]
    except Exception as err:
        # Drop the traceback (as test_on_error_matrix.read_all does): its frames hold the iterator,
        # whose workers the garbage collector would otherwise shut down later, mid-way through
        # another test, after torch's 5 s join timeout; this way they stop here.
        error = err.with_traceback(None)
    finally:
        del it, namespace
    raise error


class _FakeTorchvision:
    """``torchvision.datasets.ImageFolder`` and the transforms the folder snippet names, built on
    fastdata's ImageFolder-equivalent baseline (torchvision is not installable next to this torch)."""

    @staticmethod
    def install(monkeypatch):
        import types

        from fastdata.bench import folder

        class ImageFolder(torch.utils.data.Dataset):
            def __init__(self, root, transform=None):
                self.inner, self.transform = folder.FolderDataset(root, "none", "pil"), transform

            def __len__(self):
                return len(self.inner)

            def __getitem__(self, i):
                img, target = self.inner[i]
                return self.transform(img), target

        def compose(steps):
            def run(img):
                for step in steps:
                    img = step(img)
                return img
            return run

        tv, datasets, transforms = (types.ModuleType(n) for n in
                                    ("torchvision", "torchvision.datasets", "torchvision.transforms"))
        datasets.ImageFolder = ImageFolder
        transforms.Compose = compose
        transforms.Resize = lambda size: (lambda img: img)  # CenterCrop below does resize + crop
        transforms.CenterCrop = lambda size: (lambda img: folder.resize_center_crop(img, size))
        transforms.RandomResizedCrop = lambda size: (lambda img: folder.random_resized_crop(img, size))
        transforms.PILToTensor = lambda: folder.pil_to_tensor
        tv.datasets, tv.transforms = datasets, transforms
        for name, module in (("torchvision", tv), ("torchvision.datasets", datasets),
                             ("torchvision.transforms", transforms)):
            monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("kind,transform,output", [
    ("lmdb", "none", "tensor"), ("lmdb", "resize224", "tensor"), ("lmdb", "rrc224", "tensor"),
    ("lmdb", "rrc224", "pil"), ("folder", "none", "tensor"), ("folder", "rrc224", "tensor"),
])
def test_printed_snippet_runs_on_mixed_sizes(mixed_store, monkeypatch, kind, transform, output):
    store, folder_root = mixed_store
    target = folder_root if kind == "folder" else store
    if kind == "folder":
        _FakeTorchvision.install(monkeypatch)
    code = dataloader_snippet(_result(1, 8), target, kind, transform, output, uniform_size=False)
    batches = _first_batches(code)
    for images, labels in batches:
        assert len(images) == len(labels) == 8
    if transform != "none" and output == "tensor":
        assert tuple(batches[0][0].shape) == (8, 3, 224, 224)  # one stacked tensor where sizes agree
    if transform == "none" and kind == "lmdb":
        assert len({tuple(im.shape) for im in batches[0][0]}) > 1  # the store's sizes really differ
        # control: the collate printed before cannot stack them (in a worker, default_collate
        # fails while sizing its shared-memory output instead)
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size|resize storage"):
            _first_batches(code.replace("collate_fn=fastdata.collate_lists", "collate_fn=fastdata.collate"))


# nightly (16 s): .ci/run runs the tune command over a remote store (tests/remote/test_remote_cli.py)
# and the tuner's own tests above
@pytest.mark.slow
def test_tune_cli_snippet_runs_as_printed(tmp_path, mixed_store, capsys):
    """The tuning guide's command shape (docs/guides/tuning.md; default --transform none) on a store of mixed sizes."""
    from fastdata.cli.main import main

    store, _ = mixed_store
    out = tmp_path / "tune"
    rc = main(["tune", store, "--memory-budget", "4GiB", "--batch-size", "16", "--max-workers", "1",
               "--max-batches", "2", "--epochs", "1", "--out", str(out)])
    assert rc == 0
    shown = capsys.readouterr().out
    assert "data wait:" in shown.split("recommended:")[1]  # on screen, not only in tune.json
    assert "differ in size" in shown and "--transform rrc224" in shown
    doc = json.loads((out / "tune.json").read_text())
    assert doc["snippet"] in shown
    assert doc["recommendation"]["batch_size"] == 16 and doc["measured"]["peak_pss"] <= 4 << 30
    assert doc["probe"]["sample_bytes"] > 0
    # both worker types measured (the command's default), side by side, and the pick explained
    assert doc["recommendation"]["worker_type"] in ("process", "thread")
    assert set(doc["by_worker_type"]) == {"process", "thread"} and doc["reason"]
    assert "processes:" in shown and "threads:" in shown and f"picked {doc['reason']}" in shown
    for images, _labels in _first_batches(doc["snippet"]):
        assert len(images) == 16
    assert main(["tune", store, "--memory-budget", "lots"]) == 2


def _in_process(cfg) -> dict:
    """One bench measurement in this process (the runner's code, without the fresh interpreter)."""
    from fastdata.bench.runner import measure

    return measure(cfg)


# A timed comparison: on a shared 2-core CI machine its interleaved medians still miss by more
# than the noise allowance now and then (a fresh-clone run measured the pick at 0.83 of the best
# row), so it runs nightly; benchmarks/bench_tune.py measures the same property on demand.
@pytest.mark.slow
def test_pick_is_within_ten_percent_of_the_bench_best(mixed_store):
    """On a real store, the tuner's pick loads at >= 90% of the best that ``fastdata bench`` measures
    over the worker counts within the same budget (same store, transform, batch, run length).

    With ``allow_no_workers`` every bench row counts; by default ``num_workers=0`` may
    not be recommended (it never overlaps the training step), so the rows with workers.
    Noise on a shared 2-core machine is large, so the picks and every bench row are
    re-measured in interleaved rounds and medians compared (a slow spell hits all
    alike), with 10% tolerance, or the best row's own spread where that is larger.
    """
    from fastdata.bench.grid import available_cores, expand_grid
    from fastdata.bench.tune import config_for, harness_measure

    store, _ = mixed_store
    rows = expand_grid([store], workers=list(range(available_cores() + 1)), batch_size="16",
                       transform="rrc224", epochs=3, warmup_epochs=1, max_batches=6)
    base = rows[-1]
    measure = harness_measure(base, run=_in_process)
    probe = Probe(0, 0, 150_528.0)
    default = config_for(base, tune(measure, probe, 64 << 30, batch_size=16, prefetch_factors=(4,),
                                    log=quiet).settings)
    anything = config_for(base, tune(measure, probe, 64 << 30, batch_size=16, prefetch_factors=(4,),
                                     allow_no_workers=True, log=quiet).settings)
    assert default.workers >= 1
    speeds: dict = {cfg: [] for cfg in [default, anything, *rows]}

    def misses() -> list:
        median = {cfg: statistics.median(v) for cfg, v in speeds.items()}
        found = []
        for pick, allowed in ((anything, rows), (default, [cfg for cfg in rows if cfg.workers])):
            best = max(allowed, key=median.get)
            # 10%, or more where the best row's own runs spread more (other load on the machine):
            # a difference inside the noise is no evidence of a worse pick
            noise = 1 - min(speeds[best]) / median[best]
            if median[pick] < (1 - max(0.1, noise)) * median[best]:
                found.append((pick.label(), best.label()))
        return found

    # 3 interleaved rounds; where a pick misses, 3 more, up to 9 (the medians of all so far): a burst
    # of other load (the nightly runs the crash-loop tests beside this one) is outvoted, while a
    # worse pick stays worse in every round
    for _round in range(9):
        for cfg in speeds:
            speeds[cfg].append(_in_process(cfg)["images_per_s"])
        if _round % 3 == 2 and not misses():
            break
    shown = {c.label(): [round(x) for x in v] for c, v in speeds.items()}
    assert not misses(), (misses(), shown)


def test_memory_prediction_never_under_the_measured_peak(deep_mixed_store):
    """The CI form of the test below (nightly: 8 fresh-process runs): the prediction the budget
    rests on is at most 20% under the peak measured at the heaviest setting. A PSS sampler can
    only miss a peak, never invent one, so a loaded machine cannot fail this side of the bound."""
    from fastdata.bench.grid import expand_grid
    from fastdata.bench.tune import harness_measure, harness_probe

    store, _src = deep_mixed_store
    base = replace(expand_grid([store], workers=[0], batch_size="32", transform="none", epochs=2, warmup_epochs=1,
                               max_batches=6)[0], start_method="fork")
    probe = harness_probe(base)()
    s = Settings(2, 32)
    peak = harness_measure(base)(s).peak_pss
    assert peak > 0
    assert estimate_memory(s, probe) >= 0.8 * peak, (estimate_memory(s, probe), peak)


# Two-sided, over four settings, twice each (the sampler's misses on a loaded machine make the
# upper side fail now and then): nightly; the side the budget rests on runs in CI above.
@pytest.mark.slow
def test_memory_prediction_within_20_percent_of_measured_peak(deep_mixed_store):
    """Predicted peak PSS vs the peak measured in a fresh process, on a real store of mixed sizes.

    The probe's decoded size per sample is the mean over its samples (one sample of a
    mixed-size store can be far from the mean), and the law counts what each process
    holds (see ``estimate_memory``).
    """
    from pathlib import Path

    import numpy as np
    from PIL import Image

    from fastdata.bench.grid import expand_grid
    from fastdata.bench.tune import harness_measure, harness_probe

    store, src = deep_mixed_store
    # 3 measured epochs of 6 batches: the 50 ms PSS sampler needs a few samples at the peak
    # (in one epoch of 3 batches a loaded machine's run was often over before the sampler saw
    # it, and 3 batches cannot fill 2 workers x prefetch 2)
    base = expand_grid([store], workers=[0], batch_size="32", transform="none", epochs=3, warmup_epochs=1,
                       max_batches=6)[0]
    base = replace(base, start_method="fork")
    probe = harness_probe(base)()
    sizes = [Image.open(p).size for p in sorted(Path(src).rglob("*.jpg"))]
    mean_decoded = float(np.mean([w * h * 3 for w, h in sizes]))
    assert max(w * h * 3 for w, h in sizes) > 1.5 * min(w * h * 3 for w, h in sizes)  # sizes really differ
    assert probe.sample_bytes == pytest.approx(mean_decoded, rel=0.25)
    measure = harness_measure(base)
    errors = {}
    for s in (Settings(0, 32), Settings(1, 32), Settings(2, 16), Settings(2, 32)):
        # A sampler can only miss a peak, never invent one: the higher of two runs is the
        # closer reading (on a loaded CI machine one run of 2 workers read 22% under the prediction)
        peak = max(measure(s).peak_pss for _run in range(2))
        errors[s] = round(estimate_memory(s, probe) / peak - 1, 3)
    assert all(abs(e) <= 0.2 for e in errors.values()), errors
