"""fastdata.add_fields: fields added to a published store without rewriting it (issue 41).

One small general store per backend is written once per module; each test works on a copy.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import fastdata
from fastdata.common.fileio import file_checksum
from fastdata.errors import CorruptRecordError, FormatError, StoreChangedError, StoreLockedError
from fastdata.fields import Float, NDArray
from fastdata.format.added import ADDED_FIELDS_KEY, FIELD_FILES_KEY
from fastdata.format.manifest import read_manifest, write_manifest
from fastdata.reader.loader import loader
from fastdata.writer.add_fields import AddFieldsError
from fastdata.writer.lock import StoreLock
from helpers.backends import NAME_SUFFIXES
from helpers.hostile import copy_store

N = 40


def _samples():
    rng = np.random.default_rng(0)
    return [{"x": float(i), "boxes": rng.random((i % 3, 4)).astype(np.float32)} for i in range(N)]


@pytest.fixture(scope="module", params=NAME_SUFFIXES, ids=[n for n, _ in NAME_SUFFIXES])
def base_store(request, tmp_path_factory):
    name, suffix = request.param
    dst = str(tmp_path_factory.mktemp(f"base-{name}") / f"s{suffix}")
    fastdata.write(_samples(), dst, shard_size=600)  # several shards
    assert len(read_manifest(dst)["shards"]) >= 3
    return dst


@pytest.fixture
def store(base_store, tmp_path):
    """A copy of the module's store, for a test that changes it."""
    return copy_store(base_store, tmp_path / os.path.basename(base_store))


def _values():
    rng = np.random.default_rng(1)
    return {
        "emb": rng.random((N, 16)).astype(np.float16),
        "score": rng.random(N),
        "caption": [f"sample {i}" for i in range(N)],
        "mask": [rng.integers(0, 2, size=(i % 4, 3)).astype(np.uint8) for i in range(N)],
        "meta": [{"i": i, "tags": ["a"] * (i % 2)} for i in range(N)],
    }


def _checksums(store: str) -> dict[str, str]:
    return {n: file_checksum(os.path.join(store, n)) for n in os.listdir(store) if n != "manifest.json"}


def test_added_fields_read_back_and_shards_untouched(store):
    before = _checksums(store)
    values = _values()
    fastdata.add_fields(store, values)
    after = _checksums(store)
    assert {n: after[n] for n in before} == before  # every original file byte-identical
    new = sorted(set(after) - set(before))
    m = read_manifest(store)
    assert new == sorted(e["name"] for s in m["shards"] for e in s[FIELD_FILES_KEY])
    ds = fastdata.open_dataset(store)
    assert ds.columns() == ("x", "emb", "score")
    np.testing.assert_array_equal(ds.column("emb"), values["emb"])
    np.testing.assert_array_equal(ds.column("score"), values["score"])
    for i in (0, 7, N - 1):
        sample = ds[i]
        assert sample["x"] == float(i) and sample["caption"] == values["caption"][i]
        np.testing.assert_array_equal(sample["emb"], values["emb"][i])
        np.testing.assert_array_equal(sample["mask"], values["mask"][i])
        assert sample["mask"].dtype == np.uint8 and sample["meta"] == values["meta"][i]
    batch = ds.__getitems__([3, 30, 5])  # the batched path
    assert [s["caption"] for s in batch] == ["sample 3", "sample 30", "sample 5"]
    seen = []
    for b in loader(ds, batch_size=8, shuffle=False, num_workers=0):
        seen += b["caption"]
        np.testing.assert_array_equal(np.asarray(b["emb"]), values["emb"][len(seen) - len(b["caption"]):len(seen)])
    assert seen == values["caption"]
    report = fastdata.verify(store)
    assert report.ok, report.problems
    info = fastdata.info(store)
    assert [(f["name"], f["kind"], f["generation"]) for f in info["added_fields"]] == [
        ("emb", "ndarray", 1), ("score", "float", 1), ("caption", "string", 1), ("mask", "ragged", 1),
        ("meta", "json", 1)]
    assert all(f["added"].endswith("Z") for f in info["added_fields"])


def test_dataset_opened_before_keeps_its_version(store):
    ds0 = fastdata.open_dataset(store)
    first = ds0[4]
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float32)})
    assert ds0.columns() == ("x",)
    again = ds0[4]
    assert set(again) == {"x", "boxes"} and again["x"] == first["x"]
    assert len(ds0.__getitems__(list(range(N)))) == N  # every shard, after the new manifest
    ds1 = fastdata.open_dataset(store)
    assert ds1[4]["score"] == 4.0


def test_column_of_added_field_reads_no_record(store):
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64)})
    ds = fastdata.open_dataset(store)
    reads = []
    shards = ds._shards
    real_get = shards.get

    def counting_get(shard):
        reads.append(shard)
        return real_get(shard)

    shards.get = counting_get
    assert ds.column("score").sum() == sum(range(N))
    sub = ds.subset(np.flatnonzero(ds.column("score") > 30))
    assert len(sub) == N - 31
    assert reads == []
    ds[0]  # control: a sample does read its record
    assert reads != []


def test_column_reads_with_every_shard_unreadable(store):
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64)})
    ds = fastdata.open_dataset(store)
    for s in read_manifest(store)["shards"]:  # the records are gone; the index was read at open
        os.chmod(os.path.join(store, s["name"]), 0)
    try:
        np.testing.assert_array_equal(ds.column("score"), np.arange(N))
    finally:
        for s in read_manifest(store)["shards"]:
            os.chmod(os.path.join(store, s["name"]), 0o644)


def _unchanged(store, before_manifest, before_files):
    assert read_manifest(store)["checksum"] == before_manifest["checksum"]
    assert sorted(os.listdir(store)) == before_files


@pytest.mark.parametrize("values, fields, message", [
    ({"score": np.zeros(N - 1)}, None, "field 'score': 39 values for a store of 40 samples"),
    ({"emb": [np.zeros(4)] * 5 + [np.zeros(3)] + [np.zeros(4)] * (N - 6)}, {"emb": NDArray("float32", (4,))},
     "field 'emb' sample 5: shape (3,) is not the schema's (4,)"),
    ({"emb": np.full((N, 4), 1e6)}, {"emb": NDArray("float16", (4,))},
     "field 'emb' sample 0: values of dtype float64 do not fit float16 exactly"),
    ({"score": [1.0] * 9 + ["high"] + [1.0] * (N - 10)}, None, "field 'score' sample 9: expected a number"),
    ({"score": np.r_[np.zeros(N - 1), np.nan]}, {"score": Float("float32")}, "field 'score' sample 39: NaN"),
    ({"x": np.zeros(N)}, None, "field 'x' is one the store was written with"),
    ({"img": [b"\xff\xd8"] * N}, None, "field 'img' sample 0: not a usable image"),
], ids=["length", "shape", "dtype", "kind", "nan", "original", "image"])
def test_bad_values_refused_nothing_published(store, values, fields, message):
    m, files = read_manifest(store), sorted(os.listdir(store))
    with pytest.raises(AddFieldsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fastdata.add_fields(store, values, fields=fields)
    _unchanged(store, m, files)


def test_existing_name_needs_replace(store):
    fastdata.add_fields(store, {"score": np.zeros(N)})
    m, files = read_manifest(store), sorted(os.listdir(store))
    with pytest.raises(AddFieldsError, match="field 'score' was added already; pass replace=True"):
        fastdata.add_fields(store, {"score": np.ones(N)})
    _unchanged(store, m, files)
    fastdata.add_fields(store, {"score": np.ones(N)}, replace=True)
    assert fastdata.open_dataset(store).column("score").tolist() == [1.0] * N


def test_store_being_written_is_refused(store):
    m, files = read_manifest(store), sorted(os.listdir(store))
    lock = StoreLock(store).acquire()  # what a conversion or an append holds
    try:
        with pytest.raises(StoreLockedError, match="is being written"):
            fastdata.add_fields(store, {"score": np.zeros(N)})
    finally:
        lock.release()
    _unchanged(store, m, files)


def test_drop_rename_gc_versions(store):
    fastdata.add_fields(store, {"a": np.arange(N), "b": [str(i) for i in range(N)]})
    fastdata.add_fields(store, {"c": np.arange(N) * 2.0})
    ds_v2 = fastdata.open_dataset(store)
    fastdata.drop_fields(store, ["a", "b"])  # generation 1 entirely: its files stay for ds_v2
    gen1 = [n for n in os.listdir(store) if n.startswith("fields-00001.")]
    assert gen1
    assert ds_v2[3]["b"] == "3"
    ds = fastdata.open_dataset(store)
    assert ds.columns() == ("x", "c")
    assert sorted(fastdata.gc(store)) == sorted(gen1)  # explicit: at once
    with pytest.raises(StoreChangedError, match="open it again"):
        ds_v2[N - 1]  # (another shard: a file not opened yet) its field files are gone: said, not an OSError
    fastdata.rename_field(store, "c", "double")
    ds = fastdata.open_dataset(store)
    assert ds.column("double").tolist() == [2.0 * i for i in range(N)] and "c" not in ds.columns()
    assert fastdata.open_dataset(store)[5]["double"] == 10.0
    assert fastdata.verify(store).ok
    fastdata.add_fields(store, {"c": np.zeros(N)})  # the name is free again
    fastdata.drop_fields(store, ["c"])
    fastdata.drop_fields(store, ["double"])  # (the call after: the dropped "c" files removed without gc)
    assert not [n for n in os.listdir(store) if n.startswith("fields-00004.")]
    assert fastdata.open_dataset(store).columns() == ("x",)
    history = read_manifest(store)["options"]["field_history"]
    assert [h["action"] for h in history] == ["add", "add", "drop", "rename", "add", "drop", "drop"]
    with pytest.raises(AddFieldsError, match="not added field"):
        fastdata.drop_fields(store, ["x"])


def test_damaged_field_file_is_found(store):
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64), "caption": [f"c{i}" for i in range(N)]})
    entry = read_manifest(store)["shards"][1][FIELD_FILES_KEY][0]
    path = os.path.join(store, entry["name"])
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # the last value of the caption data
    open(path, "wb").write(bytes(data))
    report = fastdata.verify(store)
    assert not report.ok and any(entry["name"] in p for p in report.problems)
    ds = fastdata.open_dataset(store)  # the fixed-size arrays are sound: it opens
    shard1 = read_manifest(store)["shards"][1]
    last = shard1["first_index"] + shard1["count"] - 1
    with pytest.raises(CorruptRecordError, match=f"sample {last} added field 'caption'"):
        ds[last]
    assert ds[0]["caption"] == "c0"


def test_hostile_field_file_header_refused(store):
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64)})
    m = read_manifest(store)
    entry = m["shards"][0][FIELD_FILES_KEY][0]
    path = os.path.join(store, entry["name"])
    raw = open(path, "rb").read()
    import msgpack

    length = int.from_bytes(raw[8:16], "little")
    header = msgpack.unpackb(raw[16:16 + length])
    header["arrays"]["score"][2] = 1 << 40  # an offset far past the end of the file
    packed = msgpack.packb(header)  # (longer: it still ends before the first array)
    raw = raw[:8] + len(packed).to_bytes(8, "little") + packed + raw[16 + len(packed):]
    open(path, "wb").write(raw)
    body = {k: v for k, v in m.items() if k != "checksum"}  # re-signed: only the file's own checks can tell
    body["shards"][0][FIELD_FILES_KEY][0]["xxh"] = file_checksum(path)
    write_manifest(store, body)
    with pytest.raises(CorruptRecordError, match="field file array 'score' is damaged"):
        fastdata.open_dataset(store)
    assert not fastdata.verify(store).ok


def test_manifest_with_field_files_of_no_field_refused(store):
    fastdata.add_fields(store, {"score": np.zeros(N)})
    body = {k: v for k, v in read_manifest(store).items() if k != "checksum"}
    del body[ADDED_FIELDS_KEY]
    with pytest.raises(FormatError, match="declares no added fields"):
        write_manifest(store, body)


def test_merge_carries_added_fields(store, tmp_path):
    suffix = os.path.splitext(store)[1]
    other = str(tmp_path / ("other" + suffix))
    shutil.copytree(store, other)
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64)})
    fastdata.add_fields(store, {"tag": [f"a{i}" for i in range(N)]})  # two generations here ...
    fastdata.add_fields(other, {"tag": [f"b{i}" for i in range(N)], "score": -np.arange(N, dtype=np.float64)})
    merged = str(tmp_path / ("m" + suffix))
    before = _checksums(store)
    fastdata.merge([store, other], merged)  # ... one there: the merged store has one
    assert _checksums(store) == before
    ds = fastdata.open_dataset(merged)
    np.testing.assert_array_equal(ds.column("score"), np.r_[np.arange(N), -np.arange(N)])
    assert [ds[i]["tag"] for i in (0, N - 1, N, 2 * N - 1)] == ["a0", f"a{N - 1}", "b0", f"b{N - 1}"]
    assert fastdata.verify(merged).ok
    fastdata.drop_fields(other, ["tag"])
    with pytest.raises(fastdata.errors.FastdataError, match="a merge needs the same added fields"):
        fastdata.merge([store, other], str(tmp_path / ("m2" + suffix)))


def test_classification_store(small_tree, tmp_path):
    dst = str(tmp_path / "c.lmdb")
    fastdata.convert(small_tree, dst)
    ds = fastdata.open_dataset(dst)
    n = len(ds)
    fastdata.add_fields(dst, {"loss": np.linspace(0, 1, n), "note": [f"n{i}" for i in range(n)]})
    ds = fastdata.open_dataset(dst)
    assert "loss" in ds.columns() and ds.column("loss")[-1] == 1.0
    image, target = ds[0]  # ImageFolder's pair, unchanged
    sample = fastdata.reader.dataset.StoreDataset(dst)[n - 1]
    assert sample["note"] == f"n{n - 1}" and sample["label"] == ds.targets[n - 1]
    assert fastdata.verify(dst).ok
    assert json.loads(json.dumps(fastdata.info(dst)["added_fields"]))[0]["name"] == "loss"


_KILLED_ADD = """
import os, signal, sys
import numpy as np
import fastdata

def progress(done, total):
    if done == 2:
        os.kill(os.getpid(), signal.SIGKILL)

fastdata.add_fields(sys.argv[1], {"emb": np.load(sys.argv[2]), "caption": [f"c{i}" for i in range(N_SAMPLES)]},
                    progress=progress)
""".replace("N_SAMPLES", str(N))


def test_sigkill_during_add_then_again_equals_an_uninterrupted_add(store, tmp_path):
    import subprocess
    import sys

    emb = np.random.default_rng(3).random((N, 8)).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb)
    clean = str(tmp_path / ("clean" + os.path.splitext(store)[1]))
    shutil.copytree(store, clean)
    before = read_manifest(store)
    proc = subprocess.run([sys.executable, "-c", _KILLED_ADD, store, str(tmp_path / "emb.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [n for n in os.listdir(store) if n.startswith("fields-")]  # it had written some field files
    assert read_manifest(store)["checksum"] == before["checksum"]  # the previous version, published
    ds = fastdata.open_dataset(store)
    assert ds.columns() == ("x",) and fastdata.verify(store).ok
    values = {"emb": emb, "caption": [f"c{i}" for i in range(N)]}
    fastdata.add_fields(store, values)  # again: what the killed call left is removed, then written anew
    fastdata.add_fields(clean, values)
    a, b = read_manifest(store), read_manifest(clean)
    assert [s.get(FIELD_FILES_KEY) for s in a["shards"]] == [s.get(FIELD_FILES_KEY) for s in b["shards"]]
    assert sorted(os.listdir(store)) == sorted(os.listdir(clean))
    assert _checksums(store) == _checksums(clean)
    np.testing.assert_array_equal(fastdata.open_dataset(store).column("emb"), emb)


def test_subsets_and_mixes_carry_added_fields(store, tmp_path):
    other = str(tmp_path / ("other" + os.path.splitext(store)[1]))
    shutil.copytree(store, other)
    fastdata.add_fields(store, {"score": np.arange(N, dtype=np.float64), "tag": [f"a{i}" for i in range(N)]})
    fastdata.add_fields(other, {"score": -np.arange(N, dtype=np.float64), "tag": [f"b{i}" for i in range(N)]})
    part = fastdata.random_split(fastdata.open_dataset(store), [0.5, 0.5], seed=0)[0]
    picked = np.asarray(part.indices)
    np.testing.assert_array_equal(part.column("score"), picked.astype(float))
    assert part[1]["tag"] == f"a{picked[1]}"
    mixed = fastdata.mix([fastdata.MixPart(store, weight=1), fastdata.MixPart(other, weight=1)], epoch_size=20,
                         seed=0)
    letters = set()
    for batch in loader(mixed, batch_size=10, num_workers=0, sampler=mixed.sampler()):
        for score, tag in zip(batch["score"].tolist(), batch["tag"], strict=True):
            sign = 1 if tag[0] == "a" else -1  # each sample's fields from its own store's field files
            assert score == sign * int(tag[1:])
            letters.add(tag[0])
    assert letters == {"a", "b"}


def test_overwrite_removes_added_fields(store):
    fastdata.add_fields(store, {"score": np.zeros(N)})
    os.makedirs(os.path.join(store, ".fastdata-fields-staging"))  # (as an interrupted compute_fields leaves)
    fastdata.write(_samples()[:5], store, overwrite=True, progress=False)
    assert not [n for n in os.listdir(store) if n.startswith(("fields-", ".fastdata-fields"))]
    assert fastdata.open_dataset(store).columns() == ("x",)
