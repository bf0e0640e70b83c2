"""``fastdata tune``: the DataLoader settings that load fastest within a memory budget, by measurement.

The search (:func:`tune`):

1. **Probe** once: the memory of the main process and of one worker doing almost
   nothing (interpreter, torch, the dataset's index), and the decoded bytes per
   sample of this target and transform.
2. **Estimate** before measuring, and print it: ``main + batch x sample +
   workers x (worker + prefetch_factor x batch x sample)``. Candidates predicted
   more than ``skip_margin`` over the budget are not run (no point courting the
   OOM killer); every measured one is printed next to its prediction.
3. **Batch size** (only with ``effective_batch_size`` E): the largest of E, E/2,
   E/4, ... whose measured run with one worker fits (with no worker only if none
   does: zero workers stall training whatever the batch); the recipe is then
   gradient accumulation over ``ceil(E / b)`` steps.
4. **Workers**: 0, 1, 2, 4, ... up to ``max_workers`` (prefetch 2) while throughput
   improves by at least ``min_gain`` and the measured peak PSS fits; where a step
   overshoots, bisect between the last good count and it. With ``step_ms`` the run
   simulates the training step; once the loop hardly waits for data, more workers
   would only cost memory, and the search says so and stops.
5. **Prefetch factor**: 4, then 8, kept only if it fits and gains.

Only configurations whose *measured* peak PSS is within the budget are ever
recommended. The measuring function is a parameter, so the search can be tested
against a synthetic target with a known memory law.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from ..errors import FastdataError
from ..units import format_size

DEFAULT_PREFETCH = 2


@dataclass(frozen=True)
class Settings:
    """The DataLoader knobs the tuner turns."""

    workers: int
    batch_size: int
    prefetch_factor: int = DEFAULT_PREFETCH

    def describe(self) -> str:
        pf = f" prefetch_factor={self.prefetch_factor}" if self.workers else ""
        return f"num_workers={self.workers} batch_size={self.batch_size}{pf}"


@dataclass
class Measurement:
    """What measuring one :class:`Settings` gave.

    Attributes:
        ok: False when the run failed (``error`` says why).
        images_per_s: median images/s.
        peak_pss: peak PSS of main + workers, bytes.
        data_wait_fraction: fraction of time the loop waited for data (with a simulated step).
    """

    ok: bool
    images_per_s: float = 0.0
    peak_pss: int = 0
    data_wait_fraction: Optional[float] = None
    error: Optional[str] = None


@dataclass
class Probe:
    """Baseline figures measured once (bytes)."""

    main_bytes: int
    worker_bytes: int
    sample_bytes: float


def estimate_memory(s: Settings, probe: Probe) -> int:
    """Predicted peak PSS of main + workers for ``s``.

    ``main + batch x sample`` (the batch being consumed) plus, per worker, its
    baseline and the ``prefetch_factor`` batches it keeps in flight.
    """
    batch = s.batch_size * probe.sample_bytes
    total = probe.main_bytes + batch
    if s.workers:
        total += s.workers * (probe.worker_bytes + s.prefetch_factor * batch)
    return int(total)


@dataclass
class Trial:
    """One candidate the search considered."""

    settings: Settings
    predicted_pss: int
    measured: Optional[Measurement] = None
    verdict: str = ""


@dataclass
class TuneResult:
    """The recommendation and how it was found.

    Attributes:
        settings: recommended :class:`Settings`.
        measured: its :class:`Measurement` (peak PSS within ``budget``).
        predicted_pss: the estimator's figure for it.
        budget: the memory budget, bytes.
        probe: the baseline figures.
        trials: every candidate in order, with prediction, measurement and verdict.
        notes: why the search stopped where it did.
        effective_batch_size, accumulation_steps: the gradient-accumulation recipe
            (``accumulation_steps`` is 1 without one).
    """

    settings: Settings
    measured: Measurement
    predicted_pss: int
    budget: int
    probe: Probe
    trials: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    effective_batch_size: Optional[int] = None
    accumulation_steps: int = 1

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return {
            "recommendation": {
                "num_workers": self.settings.workers,
                "batch_size": self.settings.batch_size,
                "prefetch_factor": self.settings.prefetch_factor if self.settings.workers else None,
                "persistent_workers": self.settings.workers > 0,
                "accumulation_steps": self.accumulation_steps,
                "effective_batch_size": self.effective_batch_size,
            },
            "measured": asdict(self.measured),
            "predicted_pss_bytes": self.predicted_pss,
            "memory_budget_bytes": self.budget,
            "probe": asdict(self.probe),
            "trials": [{"settings": asdict(t.settings), "predicted_pss_bytes": t.predicted_pss,
                        "measured": asdict(t.measured) if t.measured else None, "verdict": t.verdict}
                       for t in self.trials],
            "notes": list(self.notes),
        }


def worker_ladder(max_workers: int) -> list[int]:
    """1, 2, 4, ... below ``max_workers``, then ``max_workers`` itself."""
    out, w = [], 1
    while w < max_workers:
        out.append(w)
        w *= 2
    if max_workers >= 1:
        out.append(max_workers)
    return out


class _Search:
    def __init__(self, measure, probe, budget, min_gain, skip_margin, log):
        self.measure_fn = measure
        self.probe = probe
        self.budget = budget
        self.min_gain = min_gain
        self.skip_margin = skip_margin
        self.log = log
        self.trials: list[Trial] = []
        self.cache: dict[Settings, Trial] = {}

    def fits(self, t: Trial) -> bool:
        return t.measured is not None and t.measured.ok and t.measured.peak_pss <= self.budget

    def run(self, s: Settings, force: bool = False) -> Trial:
        """Measure ``s`` (once), unless the estimate says it cannot fit (and not ``force``)."""
        if s in self.cache and not (force and self.cache[s].measured is None):
            return self.cache[s]
        t = Trial(s, estimate_memory(s, self.probe))
        if s in self.cache:
            self.trials.remove(self.cache[s])
        self.cache[s] = t
        self.trials.append(t)
        if not force and t.predicted_pss > self.budget * (1 + self.skip_margin):
            t.verdict = "skipped: predicted over budget"
            self.log(f"  {s.describe():<52} predicted {format_size(t.predicted_pss):>10}  skipped (over budget)")
            return t
        t.measured = m = self.measure_fn(s)
        if not m.ok:
            t.verdict = f"failed: {m.error}"
        elif m.peak_pss > self.budget:
            t.verdict = "over budget"
        else:
            t.verdict = "fits"
        figure = (f"{m.images_per_s:8.0f} img/s  peak PSS {format_size(m.peak_pss):>10}" if m.ok
                  else f"FAILED ({m.error})")
        self.log(f"  {s.describe():<52} predicted {format_size(t.predicted_pss):>10}  measured {figure}  "
                 f"-> {t.verdict}")
        return t

    def better(self, t: Trial, than: Trial) -> bool:
        return self.fits(t) and t.measured.images_per_s >= than.measured.images_per_s * (1 + self.min_gain)


def tune(
    measure: Callable[[Settings], Measurement],
    probe: Callable[[], Probe] | Probe,
    memory_budget: int,
    *,
    batch_size: int = 64,
    effective_batch_size: Optional[int] = None,
    max_workers: Optional[int] = None,
    prefetch_factors: tuple = (4, 8),
    min_gain: float = 0.05,
    step_ms: float = 0.0,
    wait_threshold: float = 0.05,
    skip_margin: float = 0.25,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Find the fastest DataLoader settings whose measured peak PSS is within ``memory_budget``.

    Args:
        measure: runs one :class:`Settings` and returns a :class:`Measurement`.
        probe: the baseline figures, or a function measuring them.
        memory_budget: bytes for the loading process tree (main + workers).
        batch_size: batch size to tune for (ignored when ``effective_batch_size`` is given).
        effective_batch_size: the batch the training recipe wants; a smaller batch plus
            gradient accumulation is recommended when it does not fit.
        max_workers: most workers to try (default: available cores).
        prefetch_factors: prefetch factors tried after the worker count (2 is the start).
        min_gain: relative throughput gain a step must bring to be taken.
        step_ms: the simulated training step ``measure`` uses (only for the messages).
        wait_threshold: data-wait fraction under which the loader keeps up with the step.
        skip_margin: candidates predicted more than this fraction over budget are not measured.
        log: where progress lines go.

    Returns:
        TuneResult

    Raises:
        FastdataError: nothing fits the budget (not even ``num_workers=0`` at batch 1).
        ValueError: a bad argument.
    """
    if memory_budget <= 0:
        raise ValueError("memory budget must be positive")
    if batch_size < 1 or (effective_batch_size is not None and effective_batch_size < 1):
        raise ValueError("batch sizes must be >= 1")
    if max_workers is None:
        from .grid import available_cores

        max_workers = available_cores()
    probe = probe() if callable(probe) else probe
    log(f"baseline: main process {format_size(probe.main_bytes)}, each worker {format_size(probe.worker_bytes)}, "
        f"{format_size(probe.sample_bytes)} per decoded sample")
    search = _Search(measure, probe, memory_budget, min_gain, skip_margin, log)
    notes: list[str] = []

    # -- batch size
    target_batch = effective_batch_size or batch_size
    if effective_batch_size:
        candidates = []
        b = effective_batch_size
        while b >= 1:
            candidates.append(b)
            b //= 2
        if candidates[-1] != 1:
            candidates.append(1)
    else:
        candidates = [batch_size]
    _print_estimates(candidates[0], max_workers, probe, memory_budget, log)
    log("measuring:")
    # Prefer the largest batch that fits with one worker: with none, loading stalls the
    # training loop whatever the batch. Only if no batch fits that way, try with none.
    chosen_batch = None
    start_workers = min(1, max_workers)
    for workers in dict.fromkeys((start_workers, 0)):
        for b in candidates:
            if search.fits(search.run(Settings(workers, b))):
                chosen_batch = b
                break
        if chosen_batch is not None:
            break
    if chosen_batch is None:
        # the estimate may over-state real use: "nothing fits" is only said after measuring
        smallest = search.run(Settings(0, candidates[-1]), force=True)
        if search.fits(smallest):
            chosen_batch = candidates[-1]
    if chosen_batch is None:
        figure = (format_size(smallest.measured.peak_pss) if smallest and smallest.measured and smallest.measured.ok
                  else f"about {format_size(estimate_memory(Settings(0, candidates[-1]), probe))}")
        hint = "" if effective_batch_size else " or lower --batch-size (or give --effective-batch-size)"
        raise FastdataError(f"nothing fits a memory budget of {format_size(memory_budget)}: num_workers=0 with "
                            f"batch_size={candidates[-1]} already needs {figure}; raise the budget{hint}")
    if chosen_batch < target_batch:
        notes.append(f"batch {target_batch} does not fit the budget; batch {chosen_batch} does: accumulate "
                     f"gradients over {math.ceil(target_batch / chosen_batch)} steps")

    # -- workers
    best = search.run(Settings(0, chosen_batch))
    if not search.fits(best):
        best = search.run(Settings(start_workers, chosen_batch))  # fits: chosen above
    good_w, over_w, stop = best.settings.workers, None, None
    for w in worker_ladder(max_workers):
        if w <= good_w:
            continue
        t = search.run(Settings(w, chosen_batch))
        if t.measured is None or not search.fits(t):
            over_w = w
            break
        if not search.better(t, best):
            stop = f"{w} workers are not {min_gain:.0%} faster than {best.settings.workers}: throughput has levelled off"
            break
        best, good_w = t, w
        if step_ms and t.measured.data_wait_fraction is not None and t.measured.data_wait_fraction < wait_threshold:
            stop = (f"with {w} workers the loader already keeps up with the {step_ms:g} ms step (waiting "
                    f"{t.measured.data_wait_fraction:.0%} of the time): more workers would only cost memory")
            break
    if over_w is not None:
        lo, hi = good_w, over_w
        while hi - lo > 1:
            mid = (lo + hi) // 2
            t = search.run(Settings(mid, chosen_batch))
            if search.better(t, best):
                best, lo = t, mid
            else:
                hi = mid
        notes.append(f"{over_w} workers exceed the budget; bisected to {best.settings.workers}")
    if stop:
        notes.append(stop)
    elif over_w is None and best.settings.workers == max_workers and max_workers:
        notes.append(f"throughput still rose at the most workers tried ({max_workers}); a larger "
                     "--max-workers may help on a machine with more cores")

    # -- prefetch factor
    if best.settings.workers:
        for pf in prefetch_factors:
            t = search.run(Settings(best.settings.workers, chosen_batch, pf))
            if not search.better(t, best):
                break
            best = t

    result = TuneResult(settings=best.settings, measured=best.measured, predicted_pss=best.predicted_pss,
                        budget=memory_budget, probe=probe, trials=search.trials, notes=notes,
                        effective_batch_size=effective_batch_size,
                        accumulation_steps=math.ceil(target_batch / best.settings.batch_size))
    return result


def _print_estimates(batch: int, max_workers: int, probe: Probe, budget: int, log) -> None:
    log(f"predicted peak PSS (main + workers) at batch_size={batch}, prefetch_factor={DEFAULT_PREFETCH}; "
        f"budget {format_size(budget)}:")
    for w in [0] + worker_ladder(max_workers):
        est = estimate_memory(Settings(w, batch), probe)
        log(f"  num_workers={w:<3} {format_size(est):>10}  {'fits' if est <= budget else 'over budget'}")


# --------------------------------------------------------------------------- output


def dataloader_snippet(result: TuneResult, target: str, kind: str, transform: str = "none", output: str = "tensor",
                       pin_memory: bool = False, start_method: Optional[str] = None) -> str:
    """The recommendation as ready-to-paste Python."""
    s = result.settings
    if kind == "folder":
        tf = {"none": "", "resize224": "transforms.Resize(224), transforms.CenterCrop(224), ",
              "rrc224": "transforms.RandomResizedCrop(224), "}[transform]
        lines = ["from torch.utils.data import DataLoader",
                 "from torchvision import datasets, transforms",
                 "",
                 f"dataset = datasets.ImageFolder({target!r}, transform=transforms.Compose([{tf}"
                 "transforms.PILToTensor()]))"]
    else:
        decode = {"none": "", "resize224": ", decode=fastdata.transforms.CenterCrop(224, resize=224)",
                  "rrc224": ", decode=fastdata.transforms.RandomResizedCrop(224)"}[transform]
        lines = ["import fastdata",
                 "from torch.utils.data import DataLoader",
                 "",
                 f"dataset = fastdata.open_dataset({target!r}, output={output!r}{decode})"]
    args = [f"batch_size={s.batch_size}", "shuffle=True", f"num_workers={s.workers}"]
    if s.workers:
        args += [f"prefetch_factor={s.prefetch_factor}", "persistent_workers=True"]
        if start_method:
            args.append(f"multiprocessing_context={start_method!r}")
    args.append(f"pin_memory={pin_memory}")
    if kind != "folder":
        args += ["worker_init_fn=fastdata.seed_worker", "collate_fn=fastdata.collate"]
    lines.append("loader = DataLoader(")
    lines.append("    dataset,")
    lines += [f"    {a}," for a in args]
    lines.append(")")
    return "\n".join(lines)


def accumulation_snippet(result: TuneResult) -> str:
    """The training-loop lines that apply gradient accumulation (empty when not needed)."""
    if result.accumulation_steps <= 1:
        return ""
    k, b = result.accumulation_steps, result.settings.batch_size
    return "\n".join([
        f"accumulation_steps = {k}  # effective batch {k} x {b} = {k * b} "
        f"(asked: {result.effective_batch_size})",
        "optimizer.zero_grad()",
        "for step, (images, labels) in enumerate(loader):",
        "    loss = criterion(model(images), labels) / accumulation_steps",
        "    loss.backward()",
        "    if (step + 1) % accumulation_steps == 0:",
        "        optimizer.step()",
        "        optimizer.zero_grad()",
    ])


def write_json(result: TuneResult, path: str, extra: Optional[dict] = None) -> str:
    """Save the result (plus ``extra``, e.g. the snippet and fingerprint) as JSON. Returns ``path``."""
    import json

    doc = result.to_json()
    if extra:
        doc.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ measuring for real


def harness_measure(base, timeout: float = 900.0) -> Callable[[Settings], Measurement]:
    """A ``measure`` function that runs :class:`Settings` through the harness (fresh process each).

    Args:
        base: a :class:`~fastdata.bench.grid.BenchConfig` giving target, transform,
            output, epochs, max_batches, step_ms...; workers/batch/prefetch are replaced.
    """
    from dataclasses import replace

    from .harness import run_isolated

    def measure(s: Settings) -> Measurement:
        cfg = replace(base, workers=s.workers, batch_size=s.batch_size,
                      prefetch_factor=s.prefetch_factor if s.workers else None,
                      persistent_workers=bool(s.workers), start_method=base.start_method if s.workers else None)
        row = run_isolated(cfg, timeout)
        if row["status"] != "ok":
            return Measurement(ok=False, error=row.get("error"))
        return Measurement(ok=True, images_per_s=row["images_per_s"], peak_pss=row["peak_pss_bytes"],
                           data_wait_fraction=row.get("data_wait_fraction"))

    return measure


def harness_probe(base, timeout: float = 900.0) -> Callable[[], Probe]:
    """A ``probe`` function: one worker, batch 1, prefetch 1, a few batches, no step."""
    from dataclasses import replace

    from .harness import run_isolated

    def probe() -> Probe:
        cfg = replace(base, workers=1, batch_size=1, prefetch_factor=1, persistent_workers=True,
                      start_method=base.start_method or None, epochs=1, warmup_epochs=0, max_batches=4,
                      step_ms=0.0, cold=False)
        row = run_isolated(cfg, timeout)
        if row["status"] != "ok":
            raise FastdataError(f"cannot measure {base.target}: {row.get('error')}")
        sample = row.get("decoded_bytes_per_sample") or 0.0
        # A forked worker shares the interpreter's pages with the main process; what each
        # extra worker adds is its private memory (USS). The rest of the tree is the main's.
        worker = row.get("peak_uss_per_worker_bytes") or 0
        return Probe(main_bytes=int(max(0, row["peak_pss_bytes"] - worker)),
                     worker_bytes=int(max(0, worker - sample)), sample_bytes=float(sample))

    return probe
