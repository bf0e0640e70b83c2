"""Appending to a published store (``fastdata convert SRC STORE --append``, ``write(..., append=True)``).

The contract (fastdata/writer/append.py): new shards after the store's, class names mapped onto
the store's labels, one atomic manifest swap; a SIGKILL leaves the old store readable and
complete and ``--append --resume`` finishes; a dataset opened before reads on in its version;
anything incompatible is refused with nothing changed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.backends import first_in_ci
from helpers.procs import cli_in_process, sigkill_once_a_shard_is_staged
from helpers.stores import files_of, make_folder, store_records

import fastdata
from fastdata.errors import FastdataError, StoreChangedError, StoreLockedError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.writer.lock import StoreLock


def snapshot(store: Path) -> dict[str, bytes]:
    """Every file of a store (not its staging folder) by name: what "nothing changed" compares."""
    return {p.name: p.read_bytes() for p in store.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def weeks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weeks")
    return {
        "w1": make_folder(root / "w1", {"a": 4, "b": 4, "c": 3}, seed=1),
        "w2": make_folder(root / "w2", {"b": 3, "c": 2}, seed=2),  # a subset of the classes
        "w3": make_folder(root / "w3", {"a": 1, "d": 2}, seed=3),  # a class the store lacks
    }


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_append_adds_shards_maps_classes_by_name_and_keeps_old_readers(weeks, tmp_path, suffix):
    store = tmp_path / f"s{suffix}"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    before = fastdata.open_dataset(store, output="numpy")
    old_shards = read_manifest(str(store))["shards"]
    old_inodes = {s["name"]: os.stat(store / s["name"]).st_ino for s in old_shards}

    report = fastdata.convert(weeks["w2"], store, workers=0, progress=False, append=True)
    assert report.images == 5 and report.shards == 1 and report.store_total == (16, 2)
    assert "appended 5 images" in report.summary() and "now holds 16 images in 2 shard(s)" in report.summary()

    m = read_manifest(str(store))
    assert m["shards"][:1] == old_shards  # the old shard entries exactly as they were
    assert {s["name"]: os.stat(store / s["name"]).st_ino for s in old_shards} == old_inodes  # never rewritten
    assert m["classes"] == ["a", "b", "c"] and m["class_counts"] == [4, 7, 5]
    assert [a["samples"] for a in m["options"]["appends"]] == [5]
    _, records = store_records(store)
    expected = files_of(weeks["w1"]) + files_of(weeks["w2"])
    assert [(m["classes"][r["label"]], r["image"]) for r in records] == expected  # bit-exact, labels by name
    assert fastdata.verify(str(store)).ok

    after = fastdata.open_dataset(store, output="numpy")
    assert len(after) == 16 and after.targets.tolist()[11:] == [1, 1, 1, 2, 2]
    # samples name each record's own file: the appended ones under the append's source (they were
    # joined with the first conversion's folder: other files, or none)
    expected_paths = [str(weeks[w] / c / f) for w in ("w1", "w2") for c in sorted(os.listdir(weeks[w]))
                      for f in sorted(os.listdir(weeks[w] / c))]
    assert [path for path, _ in after.samples] == expected_paths
    assert all(os.path.isfile(path) for path, _ in after.samples)
    # the dataset opened before reads on in its own version: its length, and its shards, also
    # after reopening them (a worker's copy; a closed handle) past the newer manifest
    assert len(before) == 11
    copy = pickle.loads(pickle.dumps(before))
    before.close()
    for ds in (before, copy):
        np.testing.assert_array_equal(ds[10][0], after[10][0])
        assert ds[10][1] == after[10][1]


def test_a_rewrite_is_still_refused_under_an_open_dataset(weeks, tmp_path):
    """Control for the reader side of append: a store replaced (--overwrite), not extended, still
    raises StoreChangedError in a dataset opened before."""
    store = tmp_path / "s.lmdb"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    before = fastdata.open_dataset(store)
    fastdata.convert(weeks["w2"], store, workers=0, progress=False, overwrite=True)
    before.close()
    with pytest.raises(StoreChangedError):
        before[0]


def test_new_classes_are_refused_unless_added_at_the_end(weeks, tmp_path):
    store = tmp_path / "s.lmdb"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    kept = snapshot(store)
    with pytest.raises(FastdataError, match=r"class\(es\) 'd' are not among the store's 3 classes.*add_classes=True"):
        fastdata.convert(weeks["w3"], store, workers=0, progress=False, append=True)
    assert snapshot(store) == kept and not (store / STAGING_DIR).exists()
    fastdata.convert(weeks["w3"], store, workers=0, progress=False, append=True, add_classes=True)
    ds = fastdata.open_dataset(store)
    assert ds.classes == ["a", "b", "c", "d"] and ds.targets.tolist()[11:] == [0, 3, 3]
    assert read_manifest(str(store))["class_counts"] == [5, 4, 3, 2]
    # two appends: the index file of the version before the previous one is gone, the previous one stays
    fastdata.convert(weeks["w2"], store, workers=0, progress=False, append=True)
    names = sorted(p.name for p in store.iterdir() if p.name.endswith(".fdi"))
    assert names == ["index-00001.fdi", "index-00002.fdi"] and fastdata.verify(str(store)).ok
    assert len(fastdata.open_dataset(store)) == 19


def test_incompatible_appends_are_refused_with_nothing_changed(weeks, tmp_path):
    store = tmp_path / "s.lmdb"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    kept = snapshot(store)
    cases = [
        (dict(max_side=8), r"storage: the store keeps original, the append asks for re-encode"),
        (dict(format="hdf5"), r"backend: the store is lmdb, the append asks for hdf5"),
        (dict(overwrite=True), r"append=True and overwrite=True are exclusive"),
    ]
    for options, message in cases:
        with pytest.raises((FastdataError, ValueError), match=message):
            fastdata.convert(weeks["w2"], store, workers=0, progress=False, append=True, **options)
        assert snapshot(store) == kept
    with pytest.raises(ValueError, match=r"add_classes=True applies to an append \(append=True\)"):
        fastdata.convert(weeks["w2"], tmp_path / "other.lmdb", workers=0, progress=False, add_classes=True)
    with StoreLock(str(store)), pytest.raises(StoreLockedError):
        fastdata.convert(weeks["w2"], store, workers=0, progress=False, append=True)
    with pytest.raises(FastdataError, match="no fastdata store to append to"):
        fastdata.convert(weeks["w2"], tmp_path / "none.lmdb", workers=0, progress=False, append=True)
    general = tmp_path / "g.lmdb"
    fastdata.write([{"x": 1}, {"x": 2}], general, workers=0, progress=False)
    with pytest.raises(FastdataError, match="cannot append an image folder or list .* to .*: it is a general store"):
        fastdata.convert(weeks["w2"], general, workers=0, progress=False, append=True)
    with pytest.raises(FastdataError, match=r"the schema differs: field 'y' is not in the store"):
        fastdata.write([{"x": 3, "y": 1.0}], general, workers=0, progress=False, append=True)
    assert len(fastdata.open_dataset(general)) == 2
    # an unfinished first conversion is finished with --resume, not appended to
    unfinished = tmp_path / "u.lmdb"
    (unfinished / STAGING_DIR).mkdir(parents=True)
    with pytest.raises(FastdataError, match="unfinished conversion, not a published store: finish it with resume=True"):
        fastdata.convert(weeks["w2"], unfinished, workers=0, progress=False, append=True)


def test_general_store_append_round_trips(tmp_path):
    store = tmp_path / "g.h5"
    first = [{"x": i, "name": f"n{i}", "vec": np.full(3, i, np.float32)} for i in range(5)]
    more = [{"x": 10 + i, "name": f"m{i}", "vec": np.full(3, -i, np.float32)} for i in range(4)]
    fastdata.write(first, store, workers=0, progress=False)
    report = fastdata.write(more, store, workers=0, progress=False, append=True)
    assert report.images == 4 and report.store_total == (9, 2)
    ds = fastdata.open_dataset(store)
    assert [ds[i]["x"] for i in range(9)] == [0, 1, 2, 3, 4, 10, 11, 12, 13]
    assert ds[7]["name"] == "m2" and ds[7]["vec"].tolist() == [-2.0, -2.0, -2.0]
    assert fastdata.verify(str(store)).ok


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastdata", "convert", *args]


@pytest.fixture(scope="module")
def big_week(tmp_path_factory) -> Path:
    """About 3 MiB of noise JPEGs in classes the store has: several 1 MiB shards to kill between."""
    return make_folder(tmp_path_factory.mktemp("big") / "wk", {"b": 20, "c": 20}, seed=7, size=(256, 256))


@pytest.mark.parametrize("suffix", first_in_ci([".lmdb", ".h5"]))
def test_sigkill_during_an_append_leaves_the_old_store_and_resume_finishes_it(weeks, big_week, tmp_path, suffix):
    store, clean = tmp_path / f"s{suffix}", tmp_path / f"clean{suffix}"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    shutil.copytree(store, clean)
    kept = snapshot(store)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    args = [str(big_week), str(store), "--append", "--shard-size", "1MiB", "--workers", "1"]
    proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, store, "append")

    # killed mid-append: the old version, as it was, readable and complete
    now = snapshot(store)
    assert all(now.get(name) == data for name, data in kept.items())  # every file of the old version as it was
    assert all(name.startswith(("shard-", ".fastdata")) for name in set(now) - set(kept))  # + new shards, the lock
    assert len(fastdata.open_dataset(store)) == 11 and fastdata.verify(str(store)).ok
    again = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "kept from the interrupted run" in again.stdout and "appended" in again.stdout, again.stdout
    done = subprocess.run(_cli(str(big_week), str(clean), "--append", "--shard-size", "1MiB", "--workers", "1",
                               "--quiet"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    def shards(s: Path) -> list:
        return [(e["name"], e["count"], e["xxh"]) for e in read_manifest(str(s))["shards"]]

    assert len(shards(store)) > 3 and shards(store) == shards(clean)
    assert fastdata.verify(str(store)).ok and not (store / STAGING_DIR).exists()
    _, records = store_records(store)
    assert [r["image"] for r in records] == [b for _, b in files_of(weeks["w1"]) + files_of(big_week)]
    # a resume of an append that is already published: nothing to do
    twice = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert twice.returncode == 0 and "already a complete store" in twice.stdout, twice.stdout + twice.stderr


def test_a_new_append_discards_an_interrupted_one(weeks, big_week, tmp_path, capsys):
    store = tmp_path / "s.lmdb"
    fastdata.convert(weeks["w1"], store, workers=0, progress=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(_cli(str(big_week), str(store), "--append", "--shard-size", "1MiB", "--workers", "1",
                                 "--quiet"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, store, "append")
    assert len(list(store.glob("shard-*"))) > 1  # what the killed append left
    result = cli_in_process(capsys, "convert", str(weeks["w2"]), str(store), "--append", "--workers", "0", "--quiet")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in store.glob("shard-*")) == ["shard-00000.lmdb", "shard-00001.lmdb"]
    assert len(fastdata.open_dataset(store)) == 16 and fastdata.verify(str(store)).ok
    info = cli_in_process(capsys, "info", str(store))
    assert "appends:  1, adding 5 samples" in info.stdout, info.stdout
