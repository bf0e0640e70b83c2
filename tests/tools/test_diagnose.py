"""Tests for fastdata.tools.diagnose: each hazard is flagged where present and silent where absent."""

from __future__ import annotations

import functools
import random
import socket
import sqlite3
import sys
import threading

import h5py
import lmdb
import numpy as np
import pytest

from fastdata.tools.diagnose import (
    ITEM_ERROR,
    OPEN_HANDLE,
    PYTHON_CONTAINER,
    SHARED_RNG,
    UNPICKLABLE,
    diagnose,
)

# Dataset classes live at module level: a class defined inside a test function is itself
# unpicklable (spawn cannot import it), which diagnose rightly reports.


class Plain:
    """An empty dataset: attributes are attached by each test."""

    def __init__(self, n: int = 10, **attrs):
        self.n = n
        self.__dict__.update(attrs)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Holder:
    """A nested plain object (a reader, a transform, a config)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class CleanNumpyDataset:
    """What fastdata's own datasets look like: numpy arrays and lazily opened handles."""

    def __init__(self, n: int = 5000):
        names = [f"class_{i % 10:03d}/img_{i:05d}.jpg" for i in range(n)]
        self.paths = np.array(names, dtype=np.bytes_)
        self.labels = np.arange(n, dtype=np.int64) % 10
        self.offsets = np.arange(n + 1, dtype=np.int64) * 100
        self.classes = [f"class_{i:03d}" for i in range(10)]
        self.root = "/data/store"
        self._env = None
        self._h5 = None
        self._pid = None
        self.reader = Holder(env=None, txn=None, path="/data/store/shard-00000.lmdb")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.paths[i], int(self.labels[i])


class LazyLMDBDataset:
    """Opens its environment on first __getitem__, as a lazy dataset should."""

    def __init__(self, path: str, n: int = 4):
        self.path = path
        self.n = n
        self.env = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False)
        return i


class ForkSafeLMDBDataset(LazyLMDBDataset):
    __fastdata_fork_safe__ = True

    def __getstate__(self):
        return {**self.__dict__, "env": None}


class FailingItems(Plain):
    def __getitem__(self, i):
        if i == 0:
            raise KeyError("missing record")
        return i


class DropsHandleOnPickle(Plain):
    def __getstate__(self):
        return {**self.__dict__, "fh": None}


def module_level_transform(x):
    return x


def kinds(report):
    return sorted(h.kind for h in report.hazards)


def at(report, kind):
    return {h.attribute: h for h in report.of_kind(kind)}


# ---------------------------------------------------------------- clean cases


def test_clean_numpy_dataset_is_silent():
    report = diagnose(CleanNumpyDataset(), sample_items=3)
    assert report.ok, str(report)
    assert report.hazards == []
    assert "no hazards found" in str(report)
    assert report.pickled_bytes is not None and report.pickled_bytes > 5000 * 8


def test_lazy_none_handle_is_clean_but_open_one_is_flagged(tmp_path):
    lazy = LazyLMDBDataset(str(tmp_path / "db"))
    lmdb.open(str(tmp_path / "db")).close()  # create the store
    assert diagnose(lazy).ok
    # Control: the very same object with the handle opened is flagged (fork and spawn).
    lazy[0]
    try:
        report = diagnose(lazy)
        assert set(at(report, OPEN_HANDLE)) == {"env"}
        assert set(at(report, UNPICKLABLE)) == {"env"}
    finally:
        lazy.env.close()
    # Closed: nothing left to inherit over fork, but a closed Environment still cannot be
    # pickled, so spawn would still fail until the attribute is reset to None.
    report = diagnose(lazy)
    assert at(report, OPEN_HANDLE) == {}
    assert set(at(report, UNPICKLABLE)) == {"env"}
    assert "drop the handle in __getstate__" in at(report, UNPICKLABLE)["env"].fix
    lazy.env = None
    assert diagnose(lazy).ok


# ---------------------------------------------------------------- (a) Python containers


def test_large_list_of_tuples_flagged_with_estimate():
    n = 5000
    samples = [(f"/data/train/class_{i % 10}/img_{i:06d}.jpg", i % 10) for i in range(n)]
    report = diagnose(Plain(samples=samples))
    hz = at(report, PYTHON_CONTAINER)
    assert set(hz) == {"samples"}
    h = hz["samples"]
    assert "pytorch/pytorch#13246" in h.detail and "5,000" in h.detail
    low = n * sys.getsizeof(samples[0])
    high = n * (sys.getsizeof(samples[0]) + sys.getsizeof(samples[0][0]) + 64) * 1.2
    assert low <= h.bytes_at_risk <= high, (low, h.bytes_at_risk, high)
    assert "numpy" in h.fix


def test_containers_nested_dict_set_and_object_array_flagged():
    ds = Plain(
        meta={"paths": [f"p{i}" for i in range(2000)], "version": 1},
        index={i: f"p{i}" for i in range(1500)},
        seen=set(range(1200)),
        objs=np.array([f"p{i}" for i in range(3000)], dtype=object),
        inner=Holder(records=tuple(range(1000, 2100))),
    )
    report = diagnose(ds)
    assert set(at(report, PYTHON_CONTAINER)) == {
        "meta['paths']", "index", "seen", "objs", "inner.records",
    }
    assert all(h.bytes_at_risk > 0 for h in report.hazards)
    text = str(report)
    assert "dataset.meta['paths']" in text and "dataset.inner.records" in text


def test_small_containers_and_numeric_arrays_are_not_flagged():
    ds = Plain(
        classes=[f"c{i}" for i in range(999)],  # just under the threshold
        labels=np.arange(1_000_000, dtype=np.int64),
        paths=np.array([b"x" * 20] * 5000),
    )
    assert diagnose(ds).ok
    # Control: the same list one element longer is flagged; the threshold is a parameter.
    ds.classes.append("c999")
    assert set(at(diagnose(ds), PYTHON_CONTAINER)) == {"classes"}
    assert diagnose(ds, container_threshold=1001).ok


# ---------------------------------------------------------------- (b) open handles


def test_each_kind_of_open_handle_flagged(tmp_path):
    env = lmdb.open(str(tmp_path / "db"), max_dbs=0)
    txn = env.begin()
    h5 = h5py.File(tmp_path / "x.h5", "w")
    dset = h5.create_dataset("d", data=np.arange(4))
    fh = open(tmp_path / "f.bin", "wb")
    conn = sqlite3.connect(str(tmp_path / "s.db"))
    sock = socket.socket()
    ds = Plain(env=env, reader=Holder(txn=txn), h5=h5, dset=dset, files=[fh], conn=conn, sock=sock)
    try:
        report = diagnose(ds)
        handles = at(report, OPEN_HANDLE)
        assert set(handles) == {"env", "reader.txn", "h5", "dset", "files[0]", "conn", "sock"}
        assert "lmdb.Environment" in handles["env"].detail
        assert "lazily" in handles["env"].fix
        assert "offset" in handles["files[0]"].detail
        assert "MDB_BAD_RSLOT" in handles["reader.txn"].detail
    finally:
        txn.abort()
        env.close()
        h5.close()
        fh.close()
        conn.close()
        sock.close()
    # Control: the same attributes, now closed, are harmless.
    assert at(diagnose(ds), OPEN_HANDLE) == {}


def test_in_memory_streams_are_not_handles():
    import io

    assert diagnose(Plain(buf=io.BytesIO(b"abc"), text=io.StringIO("x"))).ok


def test_handle_opened_by_getitem_is_attributed(tmp_path):
    lmdb.open(str(tmp_path / "db")).close()
    ds = LazyLMDBDataset(str(tmp_path / "db"))
    try:
        report = diagnose(ds, sample_items=2)
        h = at(report, OPEN_HANDLE)["env"]
        assert "opened by __getitem__" in h.detail
        assert any("fetched 2 of 2" in note for note in report.notes)
    finally:
        ds.env.close()


def test_fork_safe_declaration_downgrades_handle_to_note(tmp_path):
    lmdb.open(str(tmp_path / "db")).close()
    ds = ForkSafeLMDBDataset(str(tmp_path / "db"))
    try:
        report = diagnose(ds, sample_items=1)
        assert report.ok, str(report)  # handle declared fork-safe, dropped when pickled
        assert any("reopens handles after fork" in note for note in report.notes)
    finally:
        ds.env.close()


# ---------------------------------------------------------------- (c) picklability


def test_unpicklable_attributes_pinpointed():
    ds = Plain(
        transform=lambda x: x,
        cfg=Holder(lock=threading.Lock(), fine=1),
        ok_fn=module_level_transform,
        ok_partial=functools.partial(module_level_transform),
    )
    report = diagnose(ds)
    hz = at(report, UNPICKLABLE)
    assert set(hz) == {"transform", "cfg.lock"}
    assert "lambda" in hz["transform"].fix
    assert "spawn" in hz["cfg.lock"].detail
    assert report.pickled_bytes is None
    # Control: without them, the dataset pickles.
    del ds.transform, ds.cfg.lock
    report = diagnose(ds)
    assert report.ok and report.pickled_bytes > 0


def test_getstate_that_drops_the_handle_makes_it_picklable(tmp_path):
    with open(tmp_path / "f", "wb") as fh:
        report = diagnose(DropsHandleOnPickle(fh=fh))
        assert set(at(report, OPEN_HANDLE)) == {"fh"}  # still a fork hazard
        assert at(report, UNPICKLABLE) == {}  # but spawn is fine
        report = diagnose(Plain(fh=fh))
        assert set(at(report, UNPICKLABLE)) == {"fh"}


def test_local_class_reported_at_dataset_level():
    class Local(Plain):
        pass

    report = diagnose(Local())
    hz = at(report, UNPICKLABLE)
    assert set(hz) == {""}
    assert "module level" in hz[""].fix


# ---------------------------------------------------------------- (d) RNGs


def test_private_rngs_flagged_globals_not():
    ds = Plain(
        rng=np.random.default_rng(0),
        legacy=np.random.RandomState(0),
        pyrng=random.Random(0),
        transforms=[Holder(p=0.5, gen=np.random.default_rng(1))],
        np_global=np.random.mtrand._rand,
        py_global=random._inst,
        sysrng=random.SystemRandom(),
        np_module=np.random,
    )
    report = diagnose(ds)
    hz = at(report, SHARED_RNG)
    assert set(hz) == {"rng", "legacy", "pyrng", "transforms[0].gen"}
    assert "seed_worker" in hz["rng"].fix
    # Not shared-RNG hazards, though neither survives spawn: modules and SystemRandom
    # cannot be pickled, and diagnose says so.
    assert set(at(report, UNPICKLABLE)) == {"sysrng", "np_module"}
    assert kinds(report) == [SHARED_RNG] * 4 + [UNPICKLABLE] * 2


def test_torch_generator_flagged():
    torch = pytest.importorskip("torch")
    report = diagnose(Plain(gen=torch.Generator().manual_seed(0), default=torch.default_generator))
    assert set(at(report, SHARED_RNG)) == {"gen"}


# ---------------------------------------------------------------- walk mechanics and report


def test_cycles_and_depth_limit():
    ds = Plain()
    ds.me = ds
    loop = []
    loop.append(loop)
    ds.loop = loop
    ds.deep = Holder(a=Holder(b=Holder(c=Holder(rng=np.random.default_rng(0)))))
    assert diagnose(ds, max_depth=4).ok  # the rng sits at depth 5
    assert set(at(diagnose(ds, max_depth=5), SHARED_RNG)) == {"deep.a.b.c.rng"}


def test_item_errors_reported():
    report = diagnose(FailingItems(n=4), sample_items=4)
    hz = at(report, ITEM_ERROR)
    assert set(hz) == {"[0]"}
    assert "KeyError" in hz["[0]"].detail
    assert any("fetched 3 of 4" in note for note in report.notes)


def test_torch_subset_with_list_indices():
    torch = pytest.importorskip("torch")
    from torch.utils.data import Subset

    subset = Subset(CleanNumpyDataset(n=3000), list(range(0, 3000, 2)))
    assert set(at(diagnose(subset), PYTHON_CONTAINER)) == {"indices"}
    assert diagnose(Subset(CleanNumpyDataset(n=3000), torch.arange(0, 3000, 2))).ok


def test_report_rendering_lists_every_hazard_with_fix():
    ds = Plain(samples=list(range(5000)), rng=np.random.default_rng(0), fn=lambda x: x)
    report = diagnose(ds)
    assert not report.ok
    text = str(report)
    assert "3 hazards" in text
    for h in report.hazards:
        assert f"[{h.kind}] dataset.{h.attribute}" in text
        assert h.fix in text
    assert "per worker" in text
    # Ordered by kind: containers, handles, pickling, rngs.
    assert [h.kind for h in report.hazards] == [PYTHON_CONTAINER, UNPICKLABLE, SHARED_RNG]
