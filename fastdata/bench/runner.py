"""Measure one configuration in this process (run by the harness in a fresh process).

``python -m fastdata.bench.runner`` reads one :class:`~fastdata.bench.grid.BenchConfig`
as JSON on stdin, measures it with :func:`measure` and prints the result as one
line ``FASTDATA_RESULT {json}`` on stdout (anything else printed is ignored).

What one run does: open the dataset, pick a fixed random subset of
``max_batches * batch_size`` samples (the same subset every epoch, so warm-up
really warms the cache for the measured epochs), build the DataLoader, then run
``warmup_epochs + epochs`` epochs, each over the subset in a fresh order, while a
:class:`~fastdata.bench.memory.MemorySampler` thread samples the process tree's
memory. With ``cold`` every file of the target is evicted from the page cache
before each epoch; with ``step_ms`` each batch is followed by a sleep of that
length (a stand-in for the training step running on an accelerator).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import psutil

from fastdata.bench.grid import RESULT_MARK


class SubsetShuffle:
    """Sampler over a fixed subset of indices, in a new seeded order every epoch."""

    def __init__(self, indices: np.ndarray, seed: int):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.rng = np.random.default_rng(seed + 1)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return iter(self.rng.permutation(self.indices).tolist())


class CloseAfterFetch:
    """Dataset wrapper for ``cold`` with persistent workers on a store.

    A page some process has mapped cannot be evicted, and persistent workers would
    keep their store maps (LMDB's, the HDF5 reader's mmap of the image bytes) from
    one epoch to the next, so the main process's eviction would leave exactly the
    pages read before cached. Closing the handles after every fetch (they reopen
    lazily, well under a millisecond) leaves nothing mapped between epochs. Under
    real memory pressure the kernel reclaims mapped pages too; this is the closest
    ``posix_fadvise`` gets to that.
    """

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        try:
            return self.inner[index]
        finally:
            self.inner.close()

    def __getitems__(self, indices):
        try:
            return self.inner.__getitems__(indices)
        finally:
            self.inner.close()


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process, its reaped children and its live descendants."""
    proc = psutil.Process()
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        try:
            ct = child.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        total += ct.user + ct.system
    return total


def _snapshot_figures(snap) -> dict:
    workers = snap.workers
    return {
        "total_pss": snap.total_pss,
        "main_pss": snap.main.pss if snap.main else None,
        "worker_pss": [w.pss for w in workers],
        "worker_uss": [w.uss for w in workers],
    }


def make_loader(cfg, dataset, sampler):
    """The DataLoader a run of ``cfg`` iterates: ``cfg``'s batch size, workers, pinning, prefetch,
    persistent workers and start method over ``dataset`` in ``sampler``'s order (the default
    ``loader_factory`` of :func:`measure`).

    Thread workers (``cfg.worker_type == "thread"``): a :class:`fastdata.reader.loader.Loader` with
    ``worker_type="thread"``, ``num_workers`` threads of this process; no ``worker_init_fn``
    (``seed_worker`` seeds process-wide generators), no start method; ``persistent_workers`` keeps
    the thread pool from one epoch to the next.
    """
    import torch
    from torch.utils.data import DataLoader

    from fastdata.reader.batching import collate_lists
    from fastdata.reader.seeding import seed_worker

    kwargs = dict(batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                  collate_fn=collate_lists, pin_memory=cfg.pin_memory,
                  generator=torch.Generator().manual_seed(cfg.seed))
    if cfg.workers > 0 and cfg.worker_type == "thread":
        from fastdata.reader.loader import Loader

        return Loader(dataset, worker_type="thread", prefetch_factor=cfg.prefetch_factor,
                      persistent_workers=cfg.persistent_workers, **kwargs)
    kwargs["worker_init_fn"] = seed_worker
    if cfg.workers > 0:
        import multiprocessing

        kwargs.update(prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers,
                      multiprocessing_context=multiprocessing.get_context(cfg.start_method))
    return DataLoader(dataset, **kwargs)


class _Cuda:
    """Host-to-device copy timing and GPU memory, only when CUDA is available."""

    def __init__(self, pin: bool):
        import torch

        self.torch = torch
        self.on = torch.cuda.is_available()
        self.pin = pin
        self.copy_ms: list[float] = []

    def copy(self, images) -> None:
        if not self.on or not isinstance(images, self.torch.Tensor):
            return
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        on_device = images.to("cuda", non_blocking=self.pin)
        torch.cuda.synchronize()
        self.copy_ms.append((time.perf_counter() - t0) * 1e3)
        del on_device

    def figures(self) -> dict:
        if not self.on:
            return {"h2d_ms_per_batch": None, "gpu_mem_allocated_bytes": None, "gpu_mem_reserved_bytes": None}
        torch = self.torch
        return {
            "h2d_ms_per_batch": statistics.median(self.copy_ms) if self.copy_ms else None,
            "gpu_mem_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "gpu_mem_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }


def measure(cfg, *, loader_factory: Callable[[Any, Any, SubsetShuffle], Iterable] | None = None) -> dict:
    """Run one configuration here and return its figures (see ``report.FIELDS``).

    Args:
        cfg (BenchConfig): the configuration.
        loader_factory (Callable | None): makes what each epoch iterates from ``(cfg, dataset,
            sampler)``, batches of ``(images, labels)``; None: :func:`make_loader`'s DataLoader. An
            argument so that a caller can wrap the loader (a test times its batches on a clock of
            its own) without replacing the runner's function.

    Raises whatever the dataset or DataLoader raises; :func:`main` turns that
    into a failed result.
    """
    import torch

    from fastdata.bench.cache import evict_page_cache, resident_fraction
    from fastdata.bench.grid import available_cores
    from fastdata.bench.memory import MemorySampler
    from fastdata.bench.pipelines import build_target, decoded_nbytes

    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # pin without CUDA: a no-op, said once in the report
    torch.manual_seed(cfg.seed)
    t_setup = time.perf_counter()
    target = build_target(cfg)
    setup_s = time.perf_counter() - t_setup
    n = len(target.dataset)
    if n == 0:
        raise ValueError(f"{cfg.target}: the dataset is empty")
    per_epoch = n if cfg.max_batches == 0 else min(n, cfg.max_batches * cfg.batch_size)
    subset = np.random.default_rng(cfg.seed).permutation(n)[:per_epoch]
    epoch_bytes = int(target.sample_bytes[subset].sum())
    n_batches = math.ceil(per_epoch / cfg.batch_size)
    dataset = target.dataset
    # (thread workers use this process's dataset, which is closed before each eviction below)
    threads = cfg.worker_type == "thread" and cfg.workers > 0
    if cfg.cold and cfg.workers and not threads and cfg.persistent_workers and cfg.kind != "folder":
        dataset = CloseAfterFetch(target.dataset)
    loader = (loader_factory or make_loader)(cfg, dataset, SubsetShuffle(subset, cfg.seed))
    cuda = _Cuda(cfg.pin_memory)
    files = target.files() if cfg.cold else []
    cores = available_cores()

    epoch_s, wait_s, cpu_s, evicted, residency, marks = [], [], [], [], [], []
    ttfb = None
    decoded_total, decoded_samples = 0, 0
    sampler = MemorySampler(interval=0.05).start()
    try:
        for epoch in range(cfg.warmup_epochs + cfg.epochs):
            if cfg.cold:
                # a mapped page cannot be evicted: drop this process's LMDB maps (they reopen lazily)
                getattr(target.dataset, "close", lambda: None)()
                evicted.append(len(evict_page_cache(files)))
                residency.append(resident_fraction(files))
            cpu0 = tree_cpu_seconds()
            t0 = time.perf_counter()
            it = iter(loader)
            wait = time.perf_counter() - t0
            seen = 0
            bookkeeping = 0.0
            while True:
                tw = time.perf_counter()
                try:
                    images, _labels = next(it)
                except StopIteration:
                    break
                wait += time.perf_counter() - tw
                seen += 1
                if ttfb is None:
                    ttfb = time.perf_counter() - t0
                # the mean over every batch: one sample of a store of mixed sizes says little
                decoded_total += decoded_nbytes(images)
                decoded_samples += len(_labels)
                cuda.copy(images)
                if seen == n_batches:  # last batch: mark while the workers are still alive
                    tm = time.perf_counter()
                    snap = sampler.mark(f"epoch{epoch}")
                    if snap is not None:
                        marks.append(_snapshot_figures(snap))
                    bookkeeping += time.perf_counter() - tm  # reading /proc is not loading time
                if cfg.step_ms:
                    time.sleep(cfg.step_ms / 1e3)
                del images, _labels
            del it
            elapsed = time.perf_counter() - t0 - bookkeeping
            if seen != n_batches:
                raise RuntimeError(f"epoch {epoch} gave {seen} batches, expected {n_batches}")
            epoch_s.append(elapsed)
            wait_s.append(wait)
            cpu_s.append(tree_cpu_seconds() - cpu0)
        del loader  # shuts persistent workers (processes or threads) down before the final memory sample
    finally:
        sampler.stop()

    measured = slice(cfg.warmup_epochs, None)
    m_epoch, m_wait, m_cpu = epoch_s[measured], wait_s[measured], cpu_s[measured]
    ips = [per_epoch / t for t in m_epoch]
    mbs = [epoch_bytes / t / 1e6 for t in m_epoch]
    growth = marks[-1]["total_pss"] - marks[0]["total_pss"] if len(marks) >= 2 else 0
    last = marks[-1] if marks else {"main_pss": None, "worker_pss": [], "worker_uss": []}
    result = {
        "status": "ok",
        "error": None,
        "num_samples": n,
        "storage": target.storage,
        "disk_bytes": target.disk_bytes,
        "samples_per_epoch": per_epoch,
        "batches_per_epoch": n_batches,
        "images_per_s": statistics.median(ips),
        "mb_per_s": statistics.median(mbs),
        "images_per_s_epochs": ips,
        "epoch_s": m_epoch,
        "time_to_first_batch_s": ttfb,
        "setup_s": setup_s,
        "peak_pss_bytes": sampler.peak_pss,
        # 0 means no process was classified as a worker (not a worker using nothing): unknown;
        # thread workers have no process of their own: their memory is the main process's
        "peak_uss_per_worker_bytes": (sampler.peak_uss_per_worker or None) if cfg.workers and not threads
        else None,
        "peak_rss_bytes": sampler.peak_rss,
        "pss_per_epoch_bytes": [m["total_pss"] for m in marks],
        "mem_growth_bytes": growth,
        "main_pss_bytes": last["main_pss"],
        "worker_pss_bytes": statistics.mean(last["worker_pss"]) if last["worker_pss"] and not threads else None,
        "pss_exact": bool(sampler.samples) and process_tree_pss_exact(),
        "cpu_cores_busy": sum(m_cpu) / sum(m_epoch),
        "cpu_util": sum(m_cpu) / sum(m_epoch) / cores,
        "data_wait_fraction": sum(m_wait) / sum(m_epoch),
        "decoded_bytes_per_sample": decoded_total / decoded_samples if decoded_samples else None,
        "cold_evicted_files": evicted[-1] if evicted else None,
        "cold_residency_after_evict": _mean_or_none(residency),
        "pipeline": target.pipeline,
    }
    result.update(cuda.figures())
    return result


def process_tree_pss_exact() -> bool:
    """False where the OS has no PSS (then PSS figures are USS and undercount sharing)."""
    from fastdata.bench.memory import process_tree_memory

    return process_tree_memory().pss_exact


def _mean_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def failure_reason(err: BaseException) -> str:
    """One line naming what failed.

    A DataLoader re-raises a worker's exception as ``Caught OSError in DataLoader
    worker process 0.`` followed by the worker's traceback; the reason keeps that
    first line and the traceback's last one (the worker's own error message).
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].startswith("Caught ") and len(lines) > 1:
        return f"{lines[0].rstrip('.')}: {lines[-1]}"[:400]
    return f"{type(err).__name__}: {lines[0]}"[:400]


def main() -> int:
    """Entry point of ``python -m fastdata.bench.runner``."""
    from fastdata.bench.grid import BenchConfig

    started = time.perf_counter()
    try:
        cfg = BenchConfig.from_json(json.loads(sys.stdin.read()))
        result = measure(cfg)
    except BaseException as err:  # noqa: BLE001 - every failure becomes a failed row
        if isinstance(err, KeyboardInterrupt):
            raise
        traceback.print_exc(file=sys.stderr)
        result = {"status": "failed", "error": failure_reason(err)}
    result["run_s"] = time.perf_counter() - started
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
