"""Copy-on-write growth in forked workers (pytorch/pytorch#13246), with its control.

A forked DataLoader worker shares its parent's pages until it writes to them. Merely
*reading* a Python object writes to it (its reference count), so a worker that walks
a per-sample Python list (ImageFolder's ``samples``: a list of (path, label) tuples)
copies every page the list's objects live on: its private memory (USS) grows by
about the size of the list. Reading elements of numpy arrays writes nothing to the
arrays, so a worker walking fastdata-style metadata stays flat.

The naive control must show growth (else the measurement could not catch it), and
the numpy layout must not. ``test_dataset_keeps_per_sample_data_in_numpy`` ties this
to the real dataset classes: no per-sample Python containers in their state.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import numpy as np
import psutil
import pytest
from helpers.backends import SUFFIXES
from helpers.images import make_tree

import fastdata

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork + USS are Linux measures")

N = 200_000
MB = 1 << 20


def _naive(n: int):
    """ImageFolder-style per-sample Python objects."""
    return [(f"class_{i % 1000:04d}/img_{i:08d}.JPEG", i % 1000) for i in range(n)]


def _arrays(n: int):
    """The same metadata the way fastdata keeps it: a few numpy arrays."""
    labels = (np.arange(n) % 1000).astype(np.int64)
    paths = b"".join(f"class_{i % 1000:04d}/img_{i:08d}.JPEG".encode() for i in range(n))
    path_bytes = np.frombuffer(paths, dtype=np.uint8)
    offsets = np.arange(n + 1, dtype=np.int64) * (len(paths) // n)
    return labels, path_bytes, offsets


def _walk(data) -> int:
    """What a worker does per sample: fetch its path and label."""
    acc = 0
    if isinstance(data, list):
        for i in range(len(data)):
            path, label = data[i]
            acc += len(path) + label
    else:
        labels, path_bytes, offsets = data
        for i in range(len(labels)):
            acc += len(path_bytes[offsets[i]:offsets[i + 1]].tobytes()) + int(labels[i])
    return acc


def _child(data, conn) -> None:
    me = psutil.Process()
    before = me.memory_full_info().uss
    _walk(data)
    conn.send(me.memory_full_info().uss - before)
    conn.close()


def _worker_growth(data, workers: int = 2) -> list:
    """USS growth (bytes) of each of ``workers`` forked processes walking ``data``."""
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for _ in range(workers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(data, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    growth = [recv.recv() for recv in pipes]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return growth


def test_python_list_grows_in_workers_numpy_does_not():
    naive = _naive(N)
    naive_growth = _worker_growth(naive)
    del naive
    arrays = _arrays(N)
    array_growth = _worker_growth(arrays)
    # 200k tuples + strings are ~25 MB of objects: each worker copies most of it
    assert min(naive_growth) > 12 * MB, [g / MB for g in naive_growth]
    assert max(array_growth) < 3 * MB, [g / MB for g in array_growth]


def test_dataset_keeps_per_sample_data_in_numpy(tmp_path):
    """No attribute of a real dataset is a Python container that grows with the
    number of samples: every per-sample attribute is a numpy array."""
    src = make_tree(tmp_path / "src", {"a": 30, "b": 30}, size=(16, 16))
    for sfx in SUFFIXES:
        store = str(tmp_path / f"s{sfx}")
        fastdata.convert(src, store, workers=1, progress=False)
        ds = fastdata.open_dataset(store)
        ds[0]
        assert len(ds) == 60
        for name, value in vars(ds).items():
            if isinstance(value, (list, tuple, dict, set)):
                assert len(value) < len(ds) // 2, f"{name} holds {len(value)} Python objects"
        assert isinstance(ds.targets, np.ndarray)
        ds.close()
