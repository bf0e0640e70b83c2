"""``fastdata merge A B ... -o C`` / ``fastdata.merge``: shards hard-linked (or copied), never read or
re-encoded; ``C[i]`` the concatenation of the inputs; class tables unified by name with per-shard
label maps; incompatible inputs refused with the differences named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers.procs import cli_in_process
from helpers.stores import files_of, make_folder, store_records

import fastdata
from fastdata.errors import FastdataError, FormatError, StoreExistsError, StoreLockedError
from fastdata.format.manifest import read_manifest, validate_manifest
from fastdata.format.names import PLAN_FILE, STAGING_DIR
from fastdata.writer.lock import StoreLock


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Three lmdb stores: A (a, b, c), B (b, c: a subset), D (d) and an HDF5 one, from small folders."""
    root = tmp_path_factory.mktemp("merge")
    folders = {"A": make_folder(root / "fa", {"a": 3, "b": 2, "c": 2}, seed=11),
               "B": make_folder(root / "fb", {"b": 2, "c": 3}, seed=12),
               "D": make_folder(root / "fd", {"d": 2}, seed=13)}
    out = {}
    for name, folder in folders.items():
        out[name] = root / f"{name}.lmdb"
        fastdata.convert(folder, out[name], workers=0, progress=False, shard_size="1MiB")
    out["H"] = root / "H.h5"
    fastdata.convert(folders["A"], out["H"], workers=0, progress=False)
    return out, folders


def test_merge_concatenates_in_order_hard_linked_and_verifies(stores, tmp_path):
    (paths, folders) = stores
    dst = tmp_path / "C.lmdb"
    report = fastdata.merge([paths["A"], paths["B"]], dst)
    assert report.samples == 12 and report.linked == report.shards == 2 and report.copied == 0
    assert "merged 2 stores" in report.summary()
    assert fastdata.verify(str(dst)).ok
    m = read_manifest(str(dst))
    assert m["version"] == 3 and m["classes"] == ["a", "b", "c"] and m["class_counts"] == [3, 4, 5]
    assert [s.get("label_map") for s in m["shards"]] == [None, [1, 2]]  # B's b, c are the store's 1, 2
    # no extra disk: each shard is the input's file (same inode)
    sources = [paths["A"] / s["name"] for s in read_manifest(str(paths["A"]))["shards"]] + [
        paths["B"] / s["name"] for s in read_manifest(str(paths["B"]))["shards"]]
    assert [os.stat(dst / s["name"]).st_ino for s in m["shards"]] == [os.stat(p).st_ino for p in sources]
    # C[i] is A then B, bit-exact, each label by its class name
    merged = fastdata.open_dataset(dst, output="numpy")
    expected = files_of(folders["A"]) + files_of(folders["B"])
    _, records = store_records(dst)
    assert [r["image"] for r in records] == [b for _, b in expected]
    assert [merged.classes[t] for t in merged.targets.tolist()] == [c for c, _ in expected]
    a, b = fastdata.open_dataset(paths["A"], output="numpy"), fastdata.open_dataset(paths["B"], output="numpy")
    for i, (ds, j) in enumerate([(a, k) for k in range(len(a))] + [(b, k) for k in range(len(b))]):
        np.testing.assert_array_equal(merged[i][0], ds[j][0])
    # control: the stored labels of B's shard are B's own; only the label map makes them the store's
    assert [r["label"] for r in records[7:]] == [0, 0, 1, 1, 1]
    assert merged.targets.tolist()[7:] == [1, 1, 2, 2, 2]


def test_unified_classes_sorted_union_or_first_appearance_and_copy_mode(stores, tmp_path):
    (paths, folders) = stores
    dst = tmp_path / "C.lmdb"
    report = fastdata.merge([paths["D"], paths["A"]], dst, link=False)
    assert report.copied == 2 and report.linked == 0 and report.remapped_shards == 1  # A keeps its labels
    m = read_manifest(str(dst))
    assert m["version"] == 3 and m["classes"] == ["a", "b", "c", "d"]  # sorted union: ImageFolder's order
    assert os.stat(dst / m["shards"][0]["name"]).st_ino != os.stat(paths["D"] / "shard-00000.lmdb").st_ino
    ds = fastdata.open_dataset(dst)
    assert ds.targets.tolist() == [3, 3, 0, 0, 0, 1, 1, 2, 2] and fastdata.verify(str(dst)).ok
    # a table that is not sorted (an append that added a class at the end): first appearance
    unsorted = tmp_path / "U.lmdb"
    fastdata.convert(folders["D"], unsorted, workers=0, progress=False)
    fastdata.convert(folders["B"], unsorted, workers=0, progress=False, append=True, add_classes=True)
    assert fastdata.open_dataset(unsorted).classes == ["d", "b", "c"]
    fastdata.merge([unsorted, paths["A"]], tmp_path / "C2.lmdb")
    both = fastdata.open_dataset(tmp_path / "C2.lmdb")
    assert both.classes == ["d", "b", "c", "a"]
    assert [both.classes[t] for t in both.targets.tolist()] == ["d"] * 2 + ["b"] * 2 + ["c"] * 3 + [
        "a"] * 3 + ["b"] * 2 + ["c"] * 2
    # appending to a merged (version 3) store keeps its version and label maps
    fastdata.convert(folders["B"], dst, workers=0, progress=False, append=True)
    after = read_manifest(str(dst))
    assert after["version"] == 3 and [s.get("label_map") for s in after["shards"]] == [[3], None, None]
    assert fastdata.open_dataset(dst).targets.tolist()[9:] == [1, 1, 2, 2, 2] and fastdata.verify(str(dst)).ok


def test_label_maps_need_their_own_version(stores, tmp_path):
    """A reader that ignored a label map would misread labels: version 1 may not carry one."""
    (paths, _) = stores
    dst = tmp_path / "C.lmdb"
    fastdata.merge([paths["A"], paths["B"]], dst)
    body = json.loads((dst / "manifest.json").read_text())
    assert body["version"] == 3
    validate_manifest(body, where="m", check_sum=True)
    body["version"] = 1  # what an older fastdata writes and reads: it would ignore the map
    with pytest.raises(FormatError, match="a label_map belongs to a store of version 3 only"):
        validate_manifest(body, where="m", check_sum=False)
    body["version"] = 3
    body["shards"][1]["label_map"] = [1, 7]
    with pytest.raises(FormatError, match=r"label_map is not a list of class indices \(0..2\)"):
        validate_manifest(body, where="m", check_sum=False)


def test_incompatible_inputs_and_destinations_are_refused(stores, tmp_path):
    (paths, _) = stores
    general = tmp_path / "g.lmdb"
    fastdata.write([{"x": 1}], general, workers=0, progress=False)
    other = tmp_path / "o.lmdb"
    fastdata.write([{"y": 1.5}], other, workers=0, progress=False)
    small = tmp_path / "small.lmdb"
    fastdata.convert(stores[1]["A"], small, workers=0, progress=False, max_side=8)
    cases = [([paths["A"], paths["H"]], r"H.h5 is hdf5, .*A.lmdb is lmdb"),
             ([paths["A"], small], r"small.lmdb keeps re-encode .*A.lmdb keeps original"),
             ([paths["A"], general], r"not both classification stores"),
             ([general, other], r"field 'x' is missing from the new samples.*field 'y' is not in the store"),
             ([paths["A"]], r"merge takes two or more stores, got 1")]
    for inputs, message in cases:
        with pytest.raises(FastdataError, match=message):
            fastdata.merge(inputs, tmp_path / "never.lmdb")
        assert not (tmp_path / "never.lmdb").exists()
    with pytest.raises(FastdataError, match="is one of the inputs"):
        fastdata.merge([paths["A"], paths["B"]], paths["B"])
    with StoreLock(str(paths["B"])), pytest.raises(StoreLockedError):
        fastdata.merge([paths["A"], paths["B"]], tmp_path / "never.lmdb")
    fastdata.merge([paths["A"], paths["B"]], tmp_path / "C.lmdb")
    with pytest.raises(StoreExistsError, match="already holds a fastdata store; pass overwrite=True"):
        fastdata.merge([paths["A"], paths["B"]], tmp_path / "C.lmdb")
    fastdata.merge([paths["B"], paths["A"]], tmp_path / "C.lmdb", overwrite=True)
    assert fastdata.open_dataset(tmp_path / "C.lmdb").targets.tolist()[:5] == [1, 1, 2, 2, 2]


def test_an_unfinished_merge_is_redone_and_the_cli_reports(stores, tmp_path, capsys):
    (paths, _) = stores
    dst = tmp_path / "C.lmdb"
    (dst / STAGING_DIR).mkdir(parents=True)  # what a merge killed before its manifest leaves
    (dst / STAGING_DIR / PLAN_FILE).write_text(json.dumps({"source": "fastdata.merge"}))
    (dst / "shard-00000.lmdb").write_bytes(b"half")
    result = cli_in_process(capsys, "merge", str(paths["A"]), str(paths["B"]), "-o", str(dst))
    assert result.returncode == 0 and "merged 2 stores" in result.stdout, result.stderr
    assert fastdata.verify(str(dst)).ok and not (dst / STAGING_DIR).exists()
    info = cli_in_process(capsys, "info", str(dst))
    assert "made by:  fastdata merge of 2 stores" in info.stdout and "1 shard(s) carry a label map" in info.stdout
    again = cli_in_process(capsys, "merge", str(paths["A"]), str(paths["B"]), "-o", str(dst))
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "already holds" in again.stderr
