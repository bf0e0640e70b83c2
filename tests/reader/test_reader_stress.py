"""Many readers at once: several datasets over the same stores, 8 workers,
persistent and not, and workers SIGKILLed mid-epoch. Nothing may run out
(LMDB reader slots, file descriptors) and every sample must come back intact.

The default suite runs fork with 8 workers; spawn/forkserver with 8 workers
(each worker imports torch) and 16 workers are nightly (``-m slow``).
"""

from __future__ import annotations

import collections
import os
import signal
import time

import psutil
import pytest
import torch
from helpers.backends import SUFFIXES
from helpers.images import make_tree
from torch.utils.data import ConcatDataset, DataLoader

import fastdata

pytestmark = pytest.mark.timeout(240)


def _labels(batch):
    return [int(t) for _, t in batch]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stress")
    src = make_tree(root / "src", {"a": 12, "b": 12, "c": 8}, size=(40, 32))
    out = {}
    for suffix in SUFFIXES:
        out[suffix] = str(root / f"s{suffix}")
        fastdata.convert(src, out[suffix], workers=1, shard_size="20KB", progress=False)
    return out


def _several(stores):
    """Three datasets open at once over two stores (two over the same LMDB store)."""
    parts = [fastdata.open_dataset(stores[".lmdb"], output="numpy"),
             fastdata.open_dataset(stores[".lmdb"], output="numpy"),
             fastdata.open_dataset(stores[".h5"], output="numpy")]
    for p in parts:
        p[0]  # the parent has handles open before the workers start
    return parts, ConcatDataset(parts)


def _expected(parts):
    return collections.Counter(int(t) for p in parts for t in p.targets)


def _run(stores, workers, method, persistent, epochs=2):
    parts, ds = _several(stores)
    loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers, multiprocessing_context=method,
                        persistent_workers=persistent, collate_fn=_labels)
    for _ in range(epochs):
        got = collections.Counter(label for batch in loader for label in batch)
        assert got == _expected(parts)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "transient"])
def test_eight_fork_workers_three_datasets(stores, persistent):
    _run(stores, 8, "fork", persistent)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("workers", [8, 16])
def test_many_workers_nightly(stores, method, workers):
    _run(stores, workers, method, persistent=True)


class _Slow(torch.utils.data.Dataset):
    """Wraps a dataset so an epoch lasts long enough to kill a worker mid-way."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(0.01)
        return self.inner[i]


def _kill_one_worker(before: set) -> None:
    """SIGKILL one DataLoader worker: a child that did not exist before the loader
    started (other children, e.g. multiprocessing's resource tracker or a
    converter's forkserver, must not be hit)."""
    me = psutil.Process()
    deadline = time.time() + 10
    while time.time() < deadline:
        kids = [c for c in me.children() if c.pid not in before and c.is_running()]
        if kids:
            os.kill(kids[-1].pid, signal.SIGKILL)
            return
        time.sleep(0.01)
    raise AssertionError("no worker to kill")


# Rerun once: SIGKILLs race the DataLoader's own worker start-up and shutdown on a loaded 2-core machine.
@pytest.mark.flaky(reruns=1)
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_killed_workers_then_fresh_loader_works_and_nothing_accumulates(stores, suffix):
    """The DataLoader raises when a worker is SIGKILLed (as PyTorch does); a new
    loader on the same dataset then works. After repeated kills the main
    process's fd count is back where it started (no stale handles pile up).
    LMDB readers open with lock=False, so a killed reader leaves no slot behind."""
    ds = fastdata.open_dataset(stores[suffix], output="numpy")
    ds[0]
    baseline = psutil.Process().num_fds()
    kills = int(os.environ.get("FASTDATA_STRESS_KILLS", "6"))
    for _ in range(kills):
        loader = DataLoader(_Slow(ds), batch_size=2, num_workers=2, multiprocessing_context="fork",
                            collate_fn=_labels, timeout=30)
        before = {c.pid for c in psutil.Process().children()}
        it = iter(loader)
        next(it)
        _kill_one_worker(before)
        with pytest.raises(RuntimeError, match="(?i)worker"):
            for _batch in it:
                pass
        del it, loader
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=_labels)
    got = collections.Counter(label for batch in loader for label in batch)
    assert got == collections.Counter(int(t) for t in ds.targets)
    del loader
    import gc

    gc.collect()
    assert psutil.Process().num_fds() <= baseline + 2
