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
