"""``fastdata tune``: the DataLoader settings that load fastest within a memory budget, by measurement.

The search (:func:`tune`):

1. **Probe** once: the memory of the main process and of one worker doing almost
   nothing (interpreter, torch, the dataset's index), and the decoded bytes per
   sample of this target and transform.
2. **Estimate** before measuring, and print it (:func:`estimate_memory`: per
   worker its baseline plus the batch it decodes, the batches in flight in shared
   memory, the batch the main process consumes; without workers the decoder's
   cost lands in the main process). Candidates predicted
   more than ``skip_margin`` over the budget are not run (no point courting the
   OOM killer); every measured one is printed next to its prediction.
3. **Batch size** (only with ``effective_batch_size`` E): the largest of E, E/2,
   E/4, ... whose measured run with one worker fits (with no worker only where
   ``num_workers=0`` is allowed); the recipe is then gradient accumulation over
   ``ceil(E / b)`` steps.
4. **Workers**: 1, 2, 4, ... up to ``max_workers`` (prefetch 2). Throughput over
   worker counts is not monotone, so the search goes on past a step that gains
   nothing and stops after two in a row, at a count over the budget (then bisects
   below it), or, with ``step_ms``, once the loop hardly waits for data. The pick
   is the fewest workers within ``min_gain`` of the fastest fitting trial.
   ``num_workers=0`` (loading in the training process, never overlapping the
   step) competes only with ``step_ms`` (the measurement then shows the missing
   overlap) or when ``allow_no_workers`` asks for it.
   With ``worker_types`` holding ``"thread"`` (the command's default), thread workers are
   searched the same way after the processes (threads of the training process: one
   process's memory, estimated as ``main + (threads + in flight + 1) x batch``); the faster
   of the two kinds' picks that fits the budget is recommended, threads when they are within
   ``min_gain`` of processes (they use less memory). A transform that holds the GIL
   serialises threads: the measurement shows it.
5. **Prefetch factor** (of the recommended worker type): 4, then 8, kept only if it fits and
   gains.

Only configurations whose *measured* peak PSS is within the budget are ever
recommended. The measuring function is a parameter, so the search can be tested
against a synthetic target with a known memory law.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from fastdata.common.units import format_size
from fastdata.errors import FastdataError
from fastdata.reader.worker_types import WORKER_TYPES

DEFAULT_PREFETCH = 2
DEFAULT_BATCH = 64


@dataclass(frozen=True)
class Settings:
    """The DataLoader knobs the tuner turns.

    ``worker_type``: ``"process"`` (DataLoader worker processes) or ``"thread"`` (threads of the
    training process, ``fastdata.loader(..., worker_type="thread")``); it means nothing without
    workers, where it stays ``"process"``.
    """

    workers: int
    batch_size: int
    prefetch_factor: int = DEFAULT_PREFETCH
    worker_type: str = "process"

    def __post_init__(self) -> None:
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type must be one of {', '.join(WORKER_TYPES)}, got {self.worker_type!r}")
        if not self.workers and self.worker_type != "process":  # no workers: nothing to choose
            object.__setattr__(self, "worker_type", "process")

    @property
    def threads(self) -> bool:
        """Thread workers (and at least one)."""
        return self.workers > 0 and self.worker_type == "thread"

    def describe(self) -> str:
        kind = " worker_type=thread" if self.threads else ""
        pf = f" prefetch_factor={self.prefetch_factor}" if self.workers else ""
        return f"num_workers={self.workers}{kind} batch_size={self.batch_size}{pf}"


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
    data_wait_fraction: float | None = None
    error: str | None = None


@dataclass
class Probe:
    """Baseline figures measured once (bytes)."""

    main_bytes: int
    worker_bytes: int
    sample_bytes: float


def estimate_memory(s: Settings, probe: Probe, full_queue: bool = False) -> int:
    """Predicted peak PSS of main + workers for ``s``.

    With workers: ``main + workers x (worker + batch) + (in flight + 1) x batch``.
    Each worker holds the batch it is decoding (the per-sample arrays before they are
    collated) besides its baseline; collated batches travel in shared memory (counted
    once, however many processes map them); the main process holds the one being
    consumed. How many are in flight depends on who waits: a loop that only loads
    (no training step) takes each batch as soon as it is ready, so about one per
    worker; a loop slower than loading (``full_queue``, as with a simulated step)
    lets every worker fill its ``prefetch_factor`` slots.

    Without workers the main process does the decoding: while it builds the next
    batch, a training loop still holds the previous one: ``main + 2 x batch``. (A
    worker's baseline is not added: most of it is pages it shares with the main
    process, already counted there; measured peaks agree within a few percent.)

    Thread workers (``s.worker_type == "thread"``) are one process: ``main + (threads + in
    flight + 1) x batch``: each thread holds the batch it decodes, no per-worker baseline.

    Args:
        s: the settings.
        probe: the baseline figures.
        full_queue: the training loop is slower than loading (a ``step_ms`` was given).

    Returns:
        int: bytes.
    """
    batch = s.batch_size * probe.sample_bytes
    if not s.workers:
        return int(probe.main_bytes + 2 * batch)
    in_flight = s.workers * (s.prefetch_factor if full_queue else 1)
    if s.threads:
        return int(probe.main_bytes + (s.workers + in_flight + 1) * batch)
    return int(probe.main_bytes + s.workers * (probe.worker_bytes + batch) + (in_flight + 1) * batch)


@dataclass
class Trial:
    """One candidate the search considered."""

    settings: Settings
    predicted_pss: int
    measured: Measurement | None = None
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
        by_worker_type: the best trial of each worker type measured (``{"process": Trial,
            "thread": Trial}``, only those that fit), the recommendation among them.
        reason: why that worker type was recommended ("" when only one was measured).
    """

    settings: Settings
    measured: Measurement
    predicted_pss: int
    budget: int
    probe: Probe
    trials: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    effective_batch_size: int | None = None
    accumulation_steps: int = 1
    by_worker_type: dict = field(default_factory=dict)
    reason: str = ""

    def recommendation(self) -> dict:
        """The recipe: the keyword arguments of the loader, plus the accumulation."""
        s = self.settings
        return {
            "num_workers": s.workers,
            "worker_type": s.worker_type,
            "batch_size": s.batch_size,
            "prefetch_factor": s.prefetch_factor if s.workers else None,
            "persistent_workers": s.workers > 0,
            "accumulation_steps": self.accumulation_steps,
            "effective_batch_size": self.effective_batch_size,
        }

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return {
            "recommendation": self.recommendation(),
            "reason": self.reason,
            "by_worker_type": {kind: {"settings": asdict(t.settings), "predicted_pss_bytes": t.predicted_pss,
                                      "measured": asdict(t.measured) if t.measured else None}
                               for kind, t in self.by_worker_type.items()},
            "measured": asdict(self.measured),
            "predicted_pss_bytes": self.predicted_pss,
            "memory_budget_bytes": self.budget,
            "probe": asdict(self.probe),
            "trials": [{"settings": asdict(t.settings), "predicted_pss_bytes": t.predicted_pss,
                        "measured": asdict(t.measured) if t.measured else None, "verdict": t.verdict}
                       for t in self.trials],
            "notes": list(self.notes),
        }


def wait_text(m: Measurement) -> str:
    """``"  data wait 12%"``: the share of the loop's time spent waiting for the next batch ("" if unknown)."""
    if m.data_wait_fraction is None:
        return ""
    return f"  data wait {m.data_wait_fraction:.0%}"


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
    def __init__(self, measure, probe, budget, min_gain, skip_margin, log, full_queue=False):
        self.full_queue = full_queue
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
        t = Trial(s, estimate_memory(s, self.probe, self.full_queue))
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
        figure = (f"{m.images_per_s:8.0f} img/s  peak PSS {format_size(m.peak_pss):>10}{wait_text(m)}" if m.ok
                  else f"FAILED ({m.error})")
        self.log(f"  {s.describe():<52} predicted {format_size(t.predicted_pss):>10}  measured {figure}  "
                 f"-> {t.verdict}")
        return t

    def better(self, t: Trial, than: Trial) -> bool:
        return self.fits(t) and _speed(t) >= _speed(than) * (1 + self.min_gain)


def tune(
    measure: Callable[[Settings], Measurement],
    probe: Callable[[], Probe] | Probe,
    memory_budget: int,
    *,
    batch_size: int | None = None,
    effective_batch_size: int | None = None,
    max_workers: int | None = None,
    prefetch_factors: tuple = (4, 8),
    min_gain: float = 0.05,
    step_ms: float = 0.0,
    allow_no_workers: bool = False,
    wait_threshold: float = 0.05,
    skip_margin: float = 0.25,
    log: Callable[[str], None] = print,
    worker_types: Sequence[str] = ("process",),
) -> TuneResult:
    """Find the fastest DataLoader settings whose measured peak PSS is within ``memory_budget``.

    Args:
        measure: runs one :class:`Settings` and returns a :class:`Measurement`.
        probe: the baseline figures, or a function measuring them.
        memory_budget: bytes for the loading process tree (main + workers).
        batch_size: batch size to tune for (default 64); when ``effective_batch_size`` is given too,
            it is not used, and a note and the log say so.
        effective_batch_size: the batch the training recipe wants; a smaller batch plus
            gradient accumulation is recommended when it does not fit.
        max_workers: most workers to try (default: available cores).
        prefetch_factors: prefetch factors tried after the worker count (2 is the start).
        min_gain: relative throughput gain a step must bring to be taken.
        step_ms: the simulated training step ``measure`` uses; with one, ``num_workers=0`` competes
            on measured throughput (the step is in the measurement, so is the missing overlap).
        allow_no_workers: also consider ``num_workers=0`` without ``step_ms``; it is recommended
            only when it is measurably (``min_gain``) faster than every worker count.
        wait_threshold: data-wait fraction under which the loader keeps up with the step.
        skip_margin: candidates predicted more than this fraction over budget are not measured.
        log: where progress lines go.
        worker_types: ``("process",)`` (the default here), ``("thread",)`` or both: each is searched
            (the same ladder, pick and prefetch steps) and the faster that fits is recommended,
            threads within ``min_gain`` of processes (``fastdata tune`` measures both by default).

    Returns:
        TuneResult

    Raises:
        FastdataError: nothing fits the budget (not even ``num_workers=0`` at batch 1).
        ValueError: a bad argument.
    """
    if memory_budget <= 0:
        raise ValueError("memory budget must be positive")
    if (batch_size is not None and batch_size < 1) or (effective_batch_size is not None and effective_batch_size < 1):
        raise ValueError("batch sizes must be >= 1")
    if max_workers is None:
        from fastdata.bench.grid import available_cores

        max_workers = available_cores()
    types = _worker_types(worker_types)
    probe = probe() if callable(probe) else probe
    log(f"baseline: main process {format_size(probe.main_bytes)}, each worker {format_size(probe.worker_bytes)}, "
        f"{format_size(probe.sample_bytes)} per decoded sample")
    search = _Search(measure, probe, memory_budget, min_gain, skip_margin, log, full_queue=step_ms > 0)
    notes: list[str] = []

    allow_zero = allow_no_workers or step_ms > 0 or max_workers == 0
    if effective_batch_size:
        note = (f"batch size: effective_batch_size={effective_batch_size} sets it: the largest of "
                f"{effective_batch_size}, {effective_batch_size // 2}, ... that fits, with gradient accumulation "
                f"making up the rest")
        if batch_size is not None and batch_size != effective_batch_size:
            note += f" (batch_size={batch_size} is not used)"
        log(note)
        notes.append(note)
    batch_size = DEFAULT_BATCH if batch_size is None else batch_size
    candidates = _batch_candidates(batch_size, effective_batch_size)
    target_batch = candidates[0]
    _print_estimates(target_batch, max_workers, probe, memory_budget, log, search.full_queue, types)
    log("measuring:")
    chosen_batch = _choose_batch(search, candidates, max_workers, allow_zero, types)
    if chosen_batch is None:
        raise FastdataError(_nothing_fits(search, candidates[-1], probe, memory_budget, effective_batch_size,
                                          allow_zero, types))
    if chosen_batch < target_batch:
        notes.append(f"batch {target_batch} does not fit the budget; batch {chosen_batch} does: accumulate "
                     f"gradients over {math.ceil(target_batch / chosen_batch)} steps")

    best_of: dict[str, Trial] = {}
    for kind in types:
        if len(types) > 1 and max_workers:
            log(f"{_KIND_WORDS[kind]}:")
        fitting = _search_workers(search, chosen_batch, max_workers, step_ms, wait_threshold, notes, kind)
        if kind == types[0]:  # num_workers=0 competes once, in the first kind's pool
            if allow_zero:
                zero = search.run(Settings(0, chosen_batch), force=not fitting)
                if search.fits(zero):
                    fitting.append(zero)
            elif max_workers:
                notes.append("num_workers=0 was not tried: with no worker, loading never overlaps the training "
                             "step; pass allow_no_workers=True to include it, or step_ms=MS to measure the overlap")
        if not fitting:
            continue
        best = _pick(search, fitting, min_gain)
        if not search.fits(best):  # a second run went over the budget
            still = [t for t in fitting if search.fits(t)]
            if not still:
                continue
            best = _pick(search, still, min_gain, confirm_within=None)
        best_of[kind] = best
    if not best_of:
        raise FastdataError("no configuration could be measured within the budget")
    # the two kinds compared at the same prefetch factor; then the winner's prefetch factor
    best, reason = _choose_worker_type(best_of, min_gain)
    if reason:
        for kind, t in best_of.items():
            m = _measured(t)
            log(f"  best {_KIND_WORDS[kind] + ':':<17} {t.settings.describe():<52} {m.images_per_s:8.0f} img/s  "
                f"peak PSS {format_size(m.peak_pss):>10}")
        log(f"  -> {reason}")
        notes.append(reason)

    # -- prefetch factor
    if best.settings.workers:
        for pf in prefetch_factors:
            t = search.run(Settings(best.settings.workers, chosen_batch, pf, best.settings.worker_type))
            if not search.better(t, best):
                break
            best = t

    return TuneResult(settings=best.settings, measured=_measured(best), predicted_pss=best.predicted_pss,
                      budget=memory_budget, probe=probe, trials=search.trials, notes=notes,
                      effective_batch_size=effective_batch_size,
                      accumulation_steps=math.ceil(target_batch / best.settings.batch_size),
                      by_worker_type=best_of, reason=reason)


_KIND_WORDS = {"process": "worker processes", "thread": "thread workers"}


def _kind_of(t: Trial) -> str:
    """How a trial's workers are named: "no workers", "worker processes", "thread workers"."""
    if not t.settings.workers:
        return "no workers"
    return _KIND_WORDS[t.settings.worker_type]


def _choose_worker_type(best_of: dict, min_gain: float) -> tuple[Trial, str]:
    """The recommendation among the best trial of each worker type, and the sentence saying why.

    Thread workers win when they are at least as fast as worker processes, or within
    ``min_gain`` of them: one process's memory, and no worker start-up. Both trials fit the budget.
    """
    if len(best_of) == 1:
        (only,) = best_of.values()
        return only, ""
    proc, thr = best_of["process"], best_of["thread"]
    ps, ts = _speed(proc), _speed(thr)
    pm, tm = _measured(proc).peak_pss, _measured(thr).peak_pss
    ratio = ts / ps if ps else math.inf
    memory = f"peak PSS {format_size(tm)} against {format_size(pm)}"
    if ts >= ps * (1 - min_gain):
        if ts >= ps * (1 + min_gain):
            why = f"thread workers: {ratio:.2f}x the images/s of {_kind_of(proc)} ({memory})"
        else:
            why = (f"thread workers: {ratio:.2f}x the images/s of {_kind_of(proc)}, within {min_gain:.0%} (a tie), "
                   f"and threads share one process's memory ({memory})")
        return thr, why
    return proc, (f"{_kind_of(proc)}: thread workers reached only {ratio:.2f}x their images/s (threads serialise "
                  "where loading holds the GIL, e.g. a Python transform: fastdata doctor checks a Dataset); "
                  f"{memory}")


def _batch_candidates(batch_size: int, effective_batch_size: int | None) -> list[int]:
    """``[batch_size]``, or E, E/2, E/4, ... 1 for an effective batch size E."""
    if not effective_batch_size:
        return [batch_size]
    out, b = [], effective_batch_size
    while b >= 1:
        out.append(b)
        b //= 2
    return out


def _worker_types(worker_types) -> tuple[str, ...]:
    """The worker types to search, in the order processes, threads; a bad value is a ValueError."""
    asked = [worker_types] if isinstance(worker_types, str) else list(worker_types)
    unknown = [k for k in asked if k not in WORKER_TYPES]
    if unknown or not asked:
        raise ValueError(f"worker types must be among {', '.join(WORKER_TYPES)}, got {asked!r}")
    return tuple(k for k in WORKER_TYPES if k in asked)


def _choose_batch(search: _Search, candidates: list[int], max_workers: int, allow_zero: bool,
                  types: Sequence[str] = ("process",)) -> int | None:
    """The largest candidate batch whose measured run fits, with one worker of some kind in ``types``
    (with none only if allowed)."""
    worker_counts = [min(1, max_workers)] + ([0] if allow_zero and max_workers else [])
    for workers in worker_counts:
        for b in candidates:
            for kind in (types if workers else types[:1]):
                if search.fits(search.run(Settings(workers, b, worker_type=kind))):
                    return b
    # the estimate may over-state real use: "nothing fits" is only said after measuring
    cheapest = Settings(worker_counts[-1], candidates[-1], worker_type=types[-1])
    if search.fits(search.run(cheapest, force=True)):
        return candidates[-1]
    return None


def _nothing_fits(search: _Search, batch: int, probe: Probe, budget: int, effective: int | None,
                  allow_zero: bool, types: Sequence[str] = ("process",)) -> str:
    workers = 0 if allow_zero else 1
    cheapest = Settings(workers, batch, worker_type=types[-1])
    trial = search.cache.get(cheapest)
    figure = (format_size(trial.measured.peak_pss) if trial and trial.measured and trial.measured.ok
              else f"about {format_size(estimate_memory(cheapest, probe, search.full_queue))}")
    hint = "" if effective else " or lower batch_size (or give effective_batch_size)"
    if not allow_zero:
        hint += ("; num_workers=0 may fit but never overlaps loading with training: pass allow_no_workers=True "
                 "to consider it")
    return (f"nothing fits a memory budget of {format_size(budget)}: {cheapest.describe()} already needs "
            f"{figure}; raise the budget{hint}")


def _search_workers(search: _Search, batch: int, max_workers: int, step_ms: float, wait_threshold: float,
                    notes: list, kind: str = "process") -> list:
    """Measure 1, 2, 4, ... workers (and bisect below a count that overshoots the budget).

    Throughput over worker counts is not monotone, so one step that does not gain
    does not end the search: it ends after two steps in a row gain nothing, at a
    count over the budget, or (with ``step_ms``) once the loop hardly waits for data.

    ``kind``: the worker type (``"process"`` or ``"thread"``) of every trial.

    Returns:
        list[Trial]: every measured trial that fits the budget.
    """
    noun = "threads" if kind == "thread" else "workers"
    fitting: list[Trial] = []
    top = 0.0
    misses = 0
    over_w = None
    for w in worker_ladder(max_workers):
        t = search.run(Settings(w, batch, worker_type=kind))
        if not search.fits(t):
            over_w = w
            break
        fitting.append(t)
        if _speed(t) >= top * (1 + search.min_gain):
            misses = 0
        else:
            misses += 1
        top = max(top, _speed(t))
        wait = _measured(t).data_wait_fraction
        if step_ms and wait is not None and wait < wait_threshold:
            notes.append(f"with {w} {noun} the loader already keeps up with the {step_ms:g} ms step (waiting "
                         f"{wait:.0%} of the time): more workers would only cost memory")
            return fitting
        if misses >= 2:
            notes.append(f"{w} {noun} are not {search.min_gain:.0%} faster than fewer: throughput has levelled off")
            return fitting
    if over_w is None:
        if fitting and max(fitting, key=_speed).settings.workers == max_workers:
            notes.append(f"throughput still rose at the most {noun} tried ({max_workers}); a larger "
                         "max_workers may help on a machine with more cores")
        return fitting
    # the largest count under the one that overshoots which still fits
    lo = fitting[-1].settings.workers if fitting else 0
    hi = over_w
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = search.run(Settings(mid, batch, worker_type=kind))
        if search.fits(t):
            fitting.append(t)
            lo = mid
        else:
            hi = mid
    notes.append(f"{over_w} {noun} exceed the budget; the most that fit: {lo}")
    return fitting


def _measured(t: Trial) -> Measurement:
    """The measurement of a trial that was measured (skipped trials never reach the callers)."""
    if t.measured is None:
        raise RuntimeError(f"{t.settings.describe()} was not measured")
    return t.measured


def _speed(t: Trial) -> float:
    return _measured(t).images_per_s


def _pick(search: _Search, fitting: list, min_gain: float, confirm_within: float | None = 0.25) -> Trial:
    """The fewest workers within ``min_gain`` of the fastest fitting trial (fewer workers: less memory).

    One run per candidate is noisy on a busy machine, so when the runner-up is within
    ``confirm_within`` of the fastest, both are measured once more, alternately, and
    compared on the mean of their runs.
    """
    if not fitting:
        raise FastdataError("no configuration could be measured within the budget")
    ranked = sorted(fitting, key=_speed, reverse=True)
    if confirm_within is not None and len(ranked) > 1 and _speed(ranked[1]) >= _speed(ranked[0]) * (1 - confirm_within):
        for t in ranked[:2]:
            _measure_again(search, t)
    fastest = max(_speed(t) for t in fitting)
    close = [t for t in fitting if _speed(t) >= fastest * (1 - min_gain)]
    return min(close, key=lambda t: (t.settings.workers == 0, t.settings.workers, -_speed(t)))


def _measure_again(search: _Search, t: Trial) -> None:
    """Fold one more run of ``t`` into its measurement: mean throughput, highest peak."""
    again = search.measure_fn(t.settings)
    if not again.ok:
        return
    m = _measured(t)
    waits = [w for w in (m.data_wait_fraction, again.data_wait_fraction) if w is not None]
    t.measured = Measurement(ok=True, images_per_s=(m.images_per_s + again.images_per_s) / 2,
                             peak_pss=max(m.peak_pss, again.peak_pss),
                             data_wait_fraction=sum(waits) / len(waits) if waits else None)
    if t.measured.peak_pss > search.budget:
        t.verdict = "over budget"
    search.log(f"  {t.settings.describe():<52} measured again: {again.images_per_s:8.0f} img/s  "
               f"(mean {t.measured.images_per_s:.0f})")


def _print_estimates(batch: int, max_workers: int, probe: Probe, budget: int, log, full_queue: bool,
                     types: Sequence[str] = ("process",)) -> None:
    log(f"predicted peak PSS (main + workers) at batch_size={batch}, prefetch_factor={DEFAULT_PREFETCH}; "
        f"budget {format_size(budget)}:")
    for w in [0] + worker_ladder(max_workers):
        cells = []
        for kind in (types if w else types[:1]):
            est = estimate_memory(Settings(w, batch, worker_type=kind), probe, full_queue)
            label = f"{'threads' if kind == 'thread' else 'processes'} " if w and len(types) > 1 else ""
            cells.append(f"{label}{format_size(est):>10}  {'fits' if est <= budget else 'over budget':<11}")
        log(f"  num_workers={w:<3} " + "   ".join(cells).rstrip())


# --------------------------------------------------------------------------- output


def needs_list_collate(kind: str, transform: str, output: str, uniform_size: bool | None) -> bool:
    """Whether the recommended loader's batches must be lists rather than one stacked tensor.

    Images of different sizes cannot be stacked: that is the case without a resizing
    transform unless every image is known to be one size (``uniform_size``; None for
    unknown, e.g. an image folder), and PIL images from a store never stack.
    """
    if kind != "folder" and output == "pil":
        return True
    return transform == "none" and not uniform_size


def dataloader_snippet(result: TuneResult, target: str, kind: str, transform: str = "none", output: str = "tensor",
                       pin_memory: bool = False, start_method: str | None = None,
                       uniform_size: bool | None = None, store_options: dict | None = None) -> str:
    """The recommendation as ready-to-paste Python that runs as printed.

    Args:
        result: the tuner's result.
        target: the image folder or store path.
        kind: ``"folder"``, ``"lmdb"`` or ``"hdf5"``.
        transform: ``"none"``, ``"resize224"`` or ``"rrc224"``.
        output: ``"pil"`` or ``"tensor"`` (stores only; a folder always gives tensors).
        pin_memory, start_method: DataLoader settings to write out.
        store_options: a URL store's ``cache_dir``/``cache_limit`` (written out) and
            ``storage_options`` (only named: they may hold credentials).
        uniform_size: True when every image has one size (a store's index knows), None when unknown.
            Otherwise, without a resizing transform, the loader collates each batch into
            ``(list of images, labels)``: ``default_collate`` cannot stack different sizes.

    Returns:
        str: Python source.
    """
    s = result.settings
    lists = needs_list_collate(kind, transform, output, uniform_size)
    if kind == "folder":
        tf = {"none": "", "resize224": "transforms.Resize(224), transforms.CenterCrop(224), ",
              "rrc224": "transforms.RandomResizedCrop(224), "}[transform]
        lines = ["from torch.utils.data import DataLoader",
                 "from torchvision import datasets, transforms"]
        if lists:
            lines.insert(0, "import fastdata")
        lines += ["",
                  f"dataset = datasets.ImageFolder({target!r}, transform=transforms.Compose([{tf}"
                  "transforms.PILToTensor()]))"]
    else:
        decode = {"none": "", "resize224": ", decode=fastdata.transforms.CenterCrop(224, resize=224)",
                  "rrc224": ", decode=fastdata.transforms.RandomResizedCrop(224)"}[transform]
        lines = ["import fastdata",
                 "from torch.utils.data import DataLoader"]
        remote = "".join(f", {k}={v!r}" for k, v in (store_options or {}).items() if k != "storage_options")
        if (store_options or {}).get("storage_options"):
            lines.append("storage_options = {...}  # the storage_options you passed")
            remote += ", storage_options=storage_options"
        lines += ["",
                  f"dataset = fastdata.open_dataset({target!r}, output={output!r}{decode}{remote})"]
    args = [f"batch_size={s.batch_size}", "shuffle=True", f"num_workers={s.workers}"]
    if s.threads:
        args.append("worker_type='thread'")
    if s.workers:
        args += [f"prefetch_factor={s.prefetch_factor}", "persistent_workers=True"]
        if start_method and not s.threads:
            args.append(f"multiprocessing_context={start_method!r}")
    args.append(f"pin_memory={pin_memory}")
    if kind != "folder" and not s.threads:  # (threads: seed_worker would reseed this process's generators)
        args.append("worker_init_fn=fastdata.seed_worker")
    if lists:
        why = "PIL images" if kind != "folder" and output == "pil" else "images of different sizes"
        lines.append(f"# {why} cannot be stacked: each batch is (list of images, labels tensor)")
        args.append("collate_fn=fastdata.collate_lists")
    elif kind != "folder":
        args.append("collate_fn=fastdata.collate")
    elif s.threads:  # fastdata.loader's default is fastdata.collate; an ImageFolder wants DataLoader's
        args.append("collate_fn=default_collate")
    if s.threads:
        # thread workers: fastdata.loader (a DataLoader whose workers are threads of this process)
        lines = [line for line in lines if line != "from torch.utils.data import DataLoader"]
        if "import fastdata" not in lines:
            lines.insert(0, "import fastdata")
        if "collate_fn=default_collate" in args:
            lines.insert(1, "from torch.utils.data import default_collate")
        lines.append("# worker_type='thread': the workers are threads of this process (no worker_init_fn needed)")
        lines.append("loader = fastdata.loader(")
    else:
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


def write_json(result: TuneResult, path: str, extra: dict | None = None) -> str:
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


def config_for(base, s: Settings):
    """The :class:`~fastdata.bench.grid.BenchConfig` that measures ``s``: ``base`` with its DataLoader knobs.

    The same configuration ``fastdata bench`` runs for those knobs, so the two measure alike.
    """
    from dataclasses import replace

    from fastdata.bench.grid import default_start_method

    method = (base.start_method or default_start_method()) if s.workers and not s.threads else None
    return replace(base, workers=s.workers, batch_size=s.batch_size,
                   prefetch_factor=s.prefetch_factor if s.workers else None,
                   persistent_workers=bool(s.workers), start_method=method,
                   worker_type="thread" if s.threads else "process")


def measurement_from_row(row: dict) -> Measurement:
    """A :class:`Measurement` from one result row of the bench runner."""
    if row["status"] != "ok":
        return Measurement(ok=False, error=row.get("error"))
    return Measurement(ok=True, images_per_s=row["images_per_s"], peak_pss=row["peak_pss_bytes"],
                       data_wait_fraction=row.get("data_wait_fraction"))


def harness_measure(base, timeout: float = 900.0, run: Callable | None = None,
                    store_options: dict | None = None) -> Callable[[Settings], Measurement]:
    """A ``measure`` function that runs :class:`Settings` through the harness (fresh process each).

    Args:
        base: a :class:`~fastdata.bench.grid.BenchConfig` giving target, transform,
            output, epochs, max_batches, step_ms...; workers/batch/prefetch are replaced.
        timeout: seconds per run.
        run: ``run(cfg) -> row`` replacing the fresh process (tests measure in process).
        store_options: for a URL target, ``storage_options``/``cache_dir``/``cache_limit``.
    """
    from fastdata.bench.harness import run_isolated

    def measure(s: Settings) -> Measurement:
        cfg = config_for(base, s)
        return measurement_from_row(run(cfg) if run else run_isolated(cfg, timeout, store_options))

    return measure


def harness_probe(base, timeout: float = 900.0, store_options: dict | None = None) -> Callable[[], Probe]:
    """A ``probe`` function: one worker, batch 1, prefetch 1, 16 batches (the decoded size is their mean), no step.
    ``store_options``: as for :func:`harness_measure`."""
    from dataclasses import replace

    from fastdata.bench.harness import run_isolated

    def probe() -> Probe:
        cfg = replace(base, workers=1, batch_size=1, prefetch_factor=1, persistent_workers=True,
                      start_method=base.start_method or None, epochs=1, warmup_epochs=0, max_batches=16,
                      step_ms=0.0, cold=False)
        row = run_isolated(cfg, timeout, store_options)
        if row["status"] != "ok":
            raise FastdataError(f"cannot measure {base.target}: {row.get('error')}")
        sample = row.get("decoded_bytes_per_sample") or 0.0
        # A forked worker shares the interpreter's pages with the main process; what each
        # extra worker adds is its private memory (USS). The rest of the tree is the main's.
        worker = row.get("peak_uss_per_worker_bytes") or 0
        return Probe(main_bytes=int(max(0, row["peak_pss_bytes"] - worker)),
                     worker_bytes=int(max(0, worker - sample)), sample_bytes=float(sample))

    return probe
