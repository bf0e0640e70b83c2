"""``fastdata add-fields`` / ``drop-fields`` / ``rename-field`` / ``gc``: the CLI over fastdata.add_fields."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import fastdata
from fastdata.cli.main import main
from fastdata.format.manifest import read_manifest


@pytest.fixture(scope="module")
def folder_store(tmp_path_factory):
    from helpers.images import make_small_tree

    root = tmp_path_factory.mktemp("cli-add")
    dst = str(root / "s.lmdb")
    fastdata.convert(make_small_tree(str(root / "src")), dst)
    return dst


@pytest.fixture
def store(folder_store, tmp_path):
    import shutil

    dst = str(tmp_path / "s.lmdb")
    shutil.copytree(folder_store, dst)
    return dst


def test_npy_csv_by_path_and_parquet_by_index(store, tmp_path, capsys):
    ds = fastdata.open_dataset(store)
    n = len(ds)
    emb = np.random.default_rng(0).random((n, 8)).astype(np.float16)
    np.save(tmp_path / "emb.npy", emb)
    assert main(["add-fields", store, "--from", str(tmp_path / "emb.npy"), "--name", "emb"]) == 0
    assert "added emb (ndarray) to" in capsys.readouterr().out
    paths = [ds.relpath(i) for i in range(n)]
    order = list(reversed(range(n)))  # rows in another order than the store's
    with open(tmp_path / "scores.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "score", "note"])
        for i in order:
            w.writerow([paths[i], i / 10, f"note {i}"])
    assert main(["add-fields", store, "--from", str(tmp_path / "scores.csv"), "--key", "path", "--quiet"]) == 0
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"index": order, "loss": [float(i) for i in order]}), tmp_path / "loss.parquet")
    assert main(["add-fields", store, "--from", str(tmp_path / "loss.parquet"), "--quiet"]) == 0
    ds = fastdata.open_dataset(store)
    np.testing.assert_array_equal(ds.column("emb"), emb)
    np.testing.assert_allclose(ds.column("score"), np.arange(n) / 10)
    np.testing.assert_array_equal(ds.column("loss"), np.arange(n, dtype=float))
    assert fastdata.reader.dataset.StoreDataset(store)[2]["note"] == "note 2"
    capsys.readouterr()
    assert main(["info", store]) == 0
    out = capsys.readouterr().out
    assert "added fields:" in out and "emb: ndarray (dtype=float16, shape=[8]), added " in out
    assert main(["verify", store]) == 0


def test_errors_are_one_line_and_publish_nothing(store, tmp_path, capsys):
    before = read_manifest(store)["checksum"]
    np.save(tmp_path / "short.npy", np.zeros(3))
    assert main(["add-fields", store, "--from", str(tmp_path / "short.npy")]) == 2
    assert "give its name (--name NAME)" in capsys.readouterr().err
    assert main(["add-fields", store, "--from", str(tmp_path / "short.npy"), "--name", "s"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("fastdata: error: field 's': 3 values for a store of") and len(err) == 2
    with open(tmp_path / "bad.csv", "w") as fh:
        fh.write("path,score\nnot/a/sample.jpg,1\n")
    assert main(["add-fields", store, "--from", str(tmp_path / "bad.csv"), "--key", "path"]) == 2
    assert "row 0: path 'not/a/sample.jpg' names no sample" in capsys.readouterr().err
    assert read_manifest(store)["checksum"] == before


def test_drop_rename_gc(store, tmp_path, capsys):
    n = len(fastdata.open_dataset(store))
    np.save(tmp_path / "a.npy", np.arange(n))
    assert main(["add-fields", store, "--from", str(tmp_path / "a.npy"), "--name", "a", "--quiet"]) == 0
    assert main(["rename-field", store, "a", "b"]) == 0
    assert fastdata.open_dataset(store).column("b").tolist() == list(range(n))
    assert main(["drop-fields", store, "b"]) == 0
    assert main(["gc", store]) == 0
    assert "removed 1 field file(s)" in capsys.readouterr().out
    assert main(["drop-fields", store, "b"]) == 2
    assert "not added field" in capsys.readouterr().err


_KILLED_CLI_ADD = """
import os, signal, sys
import fastdata.writer.add_fields as af
from fastdata.cli.main import main

write = af.write_field_file
calls = []

def killed_at_the_second(path, pieces):  # the first shard's field file is written, the second is not
    calls.append(path)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(path, pieces)

af.write_field_file = killed_at_the_second
sys.exit(main(["add-fields", sys.argv[1], "--from", sys.argv[2], "--name", "emb", "--quiet"]))
"""


def test_sigkill_during_add_fields_then_resume_equals_an_uninterrupted_add(tmp_path, capsys):
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from fastdata.common.fileio import file_checksum

    n = 12
    store = str(tmp_path / "s.lmdb")
    fastdata.write([{"x": float(i)} for i in range(n)], store, shard_size=60, progress=False, workers=0)
    assert len(read_manifest(store)["shards"]) >= 3
    clean = str(tmp_path / "clean.lmdb")
    shutil.copytree(store, clean)
    np.save(tmp_path / "emb.npy", np.random.default_rng(0).random((n, 4)).astype(np.float16))
    values = str(tmp_path / "emb.npy")
    before = read_manifest(store)["checksum"]
    proc = subprocess.run([sys.executable, "-c", _KILLED_CLI_ADD, store, values], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert read_manifest(store)["checksum"] == before  # the previous version, still published
    written = [f for f in os.listdir(store) if f.startswith("fields-")]
    assert len(written) == 1
    kept = os.stat(os.path.join(store, written[0]))
    assert main(["add-fields", store, "--from", values, "--name", "emb", "--resume", "--quiet"]) == 0
    again = os.stat(os.path.join(store, written[0]))
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # kept, not written again
    assert main(["add-fields", clean, "--from", values, "--name", "emb", "--quiet"]) == 0  # uninterrupted
    a, b = read_manifest(store), read_manifest(clean)
    assert a["shards"] == b["shards"]  # the same field files (names, sizes, checksums)
    assert [{**f, "added": ""} for f in a["added_fields"]] == [{**f, "added": ""} for f in b["added_fields"]]
    assert sorted(os.listdir(store)) == sorted(os.listdir(clean))  # nothing left behind
    assert {f: file_checksum(os.path.join(store, f)) for f in os.listdir(store) if f != "manifest.json"} == {
        f: file_checksum(os.path.join(clean, f)) for f in os.listdir(clean) if f != "manifest.json"}
    # killed after its manifest: --resume finds it published and does nothing; without it, refused
    assert main(["add-fields", store, "--from", values, "--name", "emb", "--resume", "--quiet"]) == 0
    assert read_manifest(store)["checksum"] == a["checksum"]
    capsys.readouterr()
    assert main(["add-fields", store, "--from", values, "--name", "emb", "--quiet"]) == 2
    assert "was added already" in capsys.readouterr().err
