"""fastdata.compute_fields: a function of the samples run over a store, its values added as fields;
an interrupted run resumes where it stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import fastdata
from fastdata.format.added import FIELDS_STAGING_DIR
from fastdata.format.manifest import read_manifest
from fastdata.tools.compute import ComputeFieldsError
from fastdata.writer.add_fields import AddFieldsError

N = 30


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("compute") / "s.lmdb")
    fastdata.write([{"x": float(i)} for i in range(N)], dst, shard_size=300, progress=False)
    assert len(read_manifest(dst)["shards"]) >= 3
    return dst


@pytest.fixture
def store(base_store, tmp_path):
    dst = str(tmp_path / "s.lmdb")
    shutil.copytree(base_store, dst)
    return dst


def double(batch):
    x = batch["x"]
    return {"double": x * 2, "text": [f"x={float(v):g}" for v in x]}


def test_values_of_the_function_are_added(store):
    fastdata.compute_fields(store, double, batch_size=4, num_workers=0)
    ds = fastdata.open_dataset(store)
    np.testing.assert_array_equal(ds.column("double"), np.arange(N) * 2.0)
    assert ds[7]["text"] == "x=7"
    assert fastdata.verify(store).ok
    assert not os.path.exists(os.path.join(store, FIELDS_STAGING_DIR))
    with pytest.raises(AddFieldsError, match="cannot resume: nothing to resume"):
        fastdata.compute_fields(store, double, resume=True, num_workers=0, replace=True)


def test_a_raising_function_is_named_and_nothing_published(store):
    before = read_manifest(store)["checksum"]

    def fails(batch):
        if (batch["x"] == 21).any():
            raise RuntimeError("model exploded")
        return {"y": batch["x"]}

    with pytest.raises(ComputeFieldsError, match=r"sample 21 \(shard shard-0000[0-9]\.lmdb\): the function raised "
                                                 r"RuntimeError: model exploded"):
        fastdata.compute_fields(store, fails, batch_size=5, num_workers=0)

    def fails_in_batches(batch):  # only a batch of several fails: its samples are named
        if len(batch["x"]) > 1 and float(batch["x"].max()) >= 20:
            raise RuntimeError("model exploded")
        return {"y": batch["x"]}

    with pytest.raises(ComputeFieldsError, match=r"samples [0-9]+\.\.2[0-9] \(shard shard-0000[0-9]\.lmdb\)"):
        fastdata.compute_fields(store, fails_in_batches, batch_size=5, num_workers=0)
    assert read_manifest(store)["checksum"] == before

    with pytest.raises(ComputeFieldsError, match="returned 2 values for a batch of 5 samples"):
        fastdata.compute_fields(store, lambda b: {"y": [1, 2]}, batch_size=5, num_workers=0)


def test_on_error_skip_gives_the_failing_samples_their_defaults_and_reports_them(store):
    def picky(batch):
        x = batch["x"]
        if ((x == 5) | (x == 21)).any():
            raise ValueError(f"cannot score {x.tolist()}")
        return {"score": x * 10, "note": [f"n{int(v)}" for v in x]}

    before = read_manifest(store)["checksum"]
    with pytest.raises(ComputeFieldsError, match=r"skipped sample 5 \(ValueError: cannot score \[5.0\]\) but "
                                                 r"field\(s\) note have no default"):
        fastdata.compute_fields(store, picky, batch_size=4, num_workers=0, on_error="skip", defaults={"score": -1.0})
    assert read_manifest(store)["checksum"] == before  # nothing published
    with pytest.warns(fastdata.tools.compute.ComputeFieldsWarning, match=r"skipped 2 sample\(s\).*sample 5: "
                                                                            r"ValueError: cannot score \[5.0\]"):
        m = fastdata.compute_fields(store, picky, batch_size=4, num_workers=0, on_error="skip",
                                    defaults={"score": -1.0, "note": "none"})
    ds = fastdata.open_dataset(store)
    want = np.arange(N) * 10.0
    want[[5, 21]] = -1.0
    np.testing.assert_array_equal(ds.column("score"), want)  # the batches' other samples computed one by one
    assert [ds[i]["note"] for i in (4, 5, 6, 21)] == ["n4", "none", "n6", "none"]
    entry = m["options"]["field_history"][-1]
    assert entry["skipped_count"] == 2 and entry["skipped"] == [[5, "ValueError: cannot score [5.0]"],
                                                                [21, "ValueError: cannot score [21.0]"]]
    assert fastdata.verify(store).ok
    with pytest.raises(ValueError, match="on_error must be one of"):
        fastdata.compute_fields(store, picky, on_error="ignore")


def test_interrupted_run_resumes_computing_only_the_rest(store, tmp_path):
    seen = []

    def stops(batch):
        seen.extend(batch["x"].tolist())
        if len(seen) > N // 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a shard
        return double(batch)

    with pytest.raises(KeyboardInterrupt):
        fastdata.compute_fields(store, stops, batch_size=4, num_workers=0)
    assert fastdata.open_dataset(store).columns() == ("x",)  # the previous version
    shards = read_manifest(store)["shards"]
    staged = [int(n[:5]) for n in os.listdir(os.path.join(store, FIELDS_STAGING_DIR)) if n.endswith(".json")
              and n != "plan.json"]
    done = sum(shards[k]["count"] for k in staged)
    assert 0 < done < N
    again = []

    def counts(batch):
        again.extend(batch["x"].tolist())
        return double(batch)

    fastdata.compute_fields(store, counts, batch_size=4, num_workers=0, resume=True)
    assert len(again) == N - done  # the shards finished before are not computed again
    ds = fastdata.open_dataset(store)
    np.testing.assert_array_equal(ds.column("double"), np.arange(N) * 2.0)
    assert [ds[i]["text"] for i in range(N)] == [f"x={i}" for i in range(N)]


_KILLED = """
import os, signal, sys
import fastdata

def fn(batch):
    if float(batch["x"].max()) >= 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"double": batch["x"] * 2}

fastdata.compute_fields(sys.argv[1], fn, batch_size=4, num_workers=2)
"""


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(store, base_store, tmp_path):
    clean = str(tmp_path / "clean.lmdb")
    shutil.copytree(base_store, clean)
    proc = subprocess.run([sys.executable, "-c", _KILLED, store], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert fastdata.verify(store).ok and fastdata.open_dataset(store).columns() == ("x",)
    fastdata.compute_fields(store, lambda b: {"double": b["x"] * 2}, batch_size=4, num_workers=2, resume=True)
    fastdata.compute_fields(clean, lambda b: {"double": b["x"] * 2}, batch_size=4, num_workers=2)
    names = sorted(n for n in os.listdir(store) if n.startswith("fields-"))
    assert names == sorted(n for n in os.listdir(clean) if n.startswith("fields-"))
    for n in names:
        assert open(os.path.join(store, n), "rb").read() == open(os.path.join(clean, n), "rb").read()
