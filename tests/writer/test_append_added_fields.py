"""Appending to a store with added fields (issue 41): the new samples get values for every added
field (``added_values=``, ``added_defaults=``, or a default declared with ``add_fields(...,
defaults=)``), written into field files of every live generation beside each new shard; an
append without them is refused with nothing written; a SIGKILL before the manifest leaves the
old version and ``resume=True`` finishes it.

One small store with two generations of added fields (one renamed) per backend, made once per
module; each test appends to a copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers.backends import NAME_SUFFIXES
from helpers.procs import cli_in_process
from helpers.hostile import copy_store

import fastdata
from fastdata.fields import Float
from fastdata.common.fileio import file_checksum
from fastdata.format.added import FIELD_FILES_KEY, field_file_name
from fastdata.format.manifest import read_manifest
from fastdata.writer.append import AppendError

N, M = 12, 7  # samples in the store, samples appended


def _samples(first: int, count: int) -> list[dict]:
    return [{"x": float(i)} for i in range(first, first + count)]


def _write(store: str, first: int, count: int, **options):
    """Samples ``first .. first + count`` written (appended, with ``append=True``) into ``store``."""
    return fastdata.write(_samples(first, count), store, {"x": Float("float64", allow_nan=True)},  # (as Parquet
                          **{"progress": False, "workers": 0, **options})                     # infers it)


@pytest.fixture(scope="module", params=NAME_SUFFIXES, ids=[n for n, _ in NAME_SUFFIXES])
def base_store(request, tmp_path_factory):
    name, suffix = request.param
    dst = str(tmp_path_factory.mktemp(f"base-{name}") / f"s{suffix}")
    _write(dst, 0, N, shard_size=300)  # several shards
    fastdata.add_fields(dst, {"score": np.arange(N, dtype=np.float32), "caption": [f"c{i}" for i in range(N)]},
                        defaults={"caption": "none"})
    fastdata.add_fields(dst, {"emb": np.ones((N, 4), dtype=np.float16),
                              "boxes": [np.full((i % 3, 2), i, dtype=np.int16) for i in range(N)]})
    fastdata.rename_field(dst, "emb", "vec")  # (its values stay stored under the key "emb")
    return dst


@pytest.fixture
def store(base_store, tmp_path):
    """A copy of the module's store, for a test that changes it."""
    return copy_store(base_store, tmp_path / os.path.basename(base_store))


def _checksums(store: str) -> dict[str, str]:
    return {n: file_checksum(os.path.join(store, n)) for n in os.listdir(store) if not n.startswith(".")}


def _new_values() -> dict:
    return {"score": np.arange(N, N + M, dtype=np.float32),
            "vec": np.full((M, 4), 2, dtype=np.float16),
            "boxes": [np.full((1, 2), -i, dtype=np.int16) for i in range(M)]}


def test_append_with_values_and_a_declared_default(store):
    before = _checksums(store)
    old = fastdata.open_dataset(store)
    report = _write(store, N, M, append=True, added_values=_new_values())
    assert report.images == M
    after = _checksums(store)
    assert {n: after[n] for n in before if n != "manifest.json"} == {n: v for n, v in before.items()
                                                                     if n != "manifest.json"}  # nothing rewritten
    m = read_manifest(store)
    gens = sorted({f["generation"] for f in m["added_fields"]})
    for shard in m["shards"]:  # every generation has exactly one file in every shard
        assert sorted(e["generation"] for e in shard[FIELD_FILES_KEY]) == gens
    ds = fastdata.open_dataset(store)
    assert len(ds) == N + M
    np.testing.assert_array_equal(ds.column("score"), np.arange(N + M, dtype=np.float32))
    np.testing.assert_array_equal(ds.column("vec")[N:], np.full((M, 4), 2, dtype=np.float16))
    np.testing.assert_array_equal(ds.column("vec")[:N], np.ones((N, 4), dtype=np.float16))
    assert [ds[i]["caption"] for i in (0, N - 1, N, N + M - 1)] == ["c0", f"c{N - 1}", "none", "none"]
    assert ds[N + 3]["boxes"].tolist() == [[-3, -3]] and ds[N + 3]["x"] == float(N + 3)
    assert ds[2]["boxes"].tolist() == [[2, 2], [2, 2]]
    assert fastdata.verify(store).ok
    assert len(old) == N and old[N - 1]["caption"] == f"c{N - 1}"  # a dataset opened before: its version
    assert [f.get("default") for f in fastdata.info(store)["added_fields"]] == [None, "none", None, None]
    # the append's own defaults; then a second append keeps the invariant on its shards too
    _write(store, N + M, 3, append=True,
                   added_values={"boxes": [np.zeros((0, 2), np.int16)] * 3},
                   added_defaults={"score": -1.0, "vec": [0, 1, 2, 3], "caption": "late"})
    ds = fastdata.open_dataset(store)
    assert ds.column("score")[-3:].tolist() == [-1.0] * 3 and ds.column("vec")[-1].tolist() == [0, 1, 2, 3]
    assert ds[N + M]["caption"] == "late" and ds[N + M + 2]["boxes"].shape == (0, 2)
    assert fastdata.verify(store).ok


def test_append_without_values_is_refused_with_what_to_do(store):
    before = _checksums(store)
    with pytest.raises(AppendError, match=r"added field\(s\) score, vec, boxes without a default.*"
                                          r"\(added_values=VALUES\).*\(added_defaults=DEFAULTS\)"):
        _write(store, N, M, append=True)
    bad = dict(_new_values(), vec=np.full((M, 5), 2, dtype=np.float16))
    with pytest.raises(AppendError, match=r"added_values: field 'vec': each sample's value has shape \(5,\)"):
        _write(store, N, M, append=True, added_values=bad)
    with pytest.raises(AppendError, match=r"added_values\['score'\] has 8 values, the append has 7 samples"):
        _write(store, N, M, append=True,
                       added_values=dict(_new_values(), score=np.zeros(M + 1, np.float32)))
    with pytest.raises(AppendError, match="nope: not added field"):
        _write(store, N, M, append=True,
                       added_values=dict(_new_values(), nope=[1] * M))
    with pytest.raises(AppendError, match="added_defaults: field 'caption': its default: expected a str"):
        _write(store, N, M, append=True, added_values=_new_values(),
                       added_defaults={"caption": 3})
    with pytest.raises(ValueError, match="apply to an append"):
        _write(store + "-new", 0, 2, added_values={"score": [1.0, 2.0]})
    assert _checksums(store) == before  # nothing written, anywhere
    assert not os.path.exists(store + "-new")


def test_append_fewer_stored_samples_than_values_is_refused_then_resumed(store):
    """Values are counted again once the shards are written (inputs the writer rejects make fewer
    samples); a mismatch publishes nothing, and resume=True with the right values finishes."""
    values = _new_values()
    # (Samples are all stored: simulate a mismatch that is only visible after writing by giving
    # fewer values than samples, which the count before writing lets through)
    short = dict(values, score=values["score"][:M - 1])
    before = read_manifest(store)["checksum"]
    with pytest.raises(AppendError, match=r"has 6 values, the append stores 7 samples.*resume=True"):
        _write(store, N, M, append=True, added_values=short)
    assert read_manifest(store)["checksum"] == before and fastdata.verify(store).ok
    _write(store, N, M, append=True, resume=True, added_values=values)
    ds = fastdata.open_dataset(store)
    assert len(ds) == N + M and ds.column("score")[-1] == N + M - 1 and fastdata.verify(store).ok


_KILLED_APPEND = """
import os, signal, sys
import numpy as np
import fastdata
import fastdata.writer.pipeline as pipeline
from fastdata.fields import Float

def killed(*args, **kwargs):  # the field files are written; the manifest is not
    os.kill(os.getpid(), signal.SIGKILL)

pipeline.write_manifest = killed
values = {"score": np.arange(12, 19, dtype=np.float32), "vec": np.full((7, 4), 2, dtype=np.float16),
          "boxes": [np.full((1, 2), -i, dtype=np.int16) for i in range(7)]}
fastdata.write([{"x": float(i)} for i in range(12, 19)], sys.argv[1], {"x": Float("float64", allow_nan=True)},
               append=True, added_values=values, progress=False, workers=0)
"""


def test_sigkill_before_the_manifest_then_resume_equals_an_uninterrupted_append(store, tmp_path):
    clean = str(tmp_path / ("clean" + os.path.splitext(store)[1]))
    shutil.copytree(store, clean)
    before = read_manifest(store)
    proc = subprocess.run([sys.executable, "-c", _KILLED_APPEND, store], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    listed = {s["name"] for s in before["shards"]}
    left = [n for n in os.listdir(store) if n.startswith("fields-") and n.split(".", 1)[1][:-4] not in listed]
    assert left  # the new shards' field files were written, and no manifest lists them
    assert read_manifest(store)["checksum"] == before["checksum"]
    old = fastdata.open_dataset(store)
    assert len(old) == N and old[N - 1]["caption"] == f"c{N - 1}" and fastdata.verify(store).ok
    _write(store, N, M, append=True, resume=True, added_values=_new_values())
    _write(clean, N, M, append=True, added_values=_new_values())
    a, b = read_manifest(store), read_manifest(clean)
    assert [s.get(FIELD_FILES_KEY) for s in a["shards"]] == [s.get(FIELD_FILES_KEY) for s in b["shards"]]
    assert sorted(os.listdir(store)) == sorted(os.listdir(clean))
    assert {k: v for k, v in _checksums(store).items() if k != "manifest.json"} == \
        {k: v for k, v in _checksums(clean).items() if k != "manifest.json"}
    assert fastdata.verify(store).ok


def test_a_new_append_discards_the_field_files_an_interrupted_one_left(store):
    stale = field_file_name(1, "shard-00099" + os.path.splitext(store)[1])
    with open(os.path.join(store, stale), "wb") as fh:
        fh.write(b"left by a killed append")
    _write(store, N, M, append=True, added_values=_new_values())
    assert not os.path.exists(os.path.join(store, stale)) and fastdata.verify(store).ok


def test_cli_append_names_what_to_give_then_takes_values_and_defaults(store, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "new.parquet"
    pq.write_table(pa.table({"x": [float(N), float(N + 1)]}), src)
    proc = cli_in_process(capsys, "convert", str(src), store, "--append", "--workers", "0")
    assert proc.returncode != 0
    assert "added field(s) score, vec, boxes without a default" in proc.stderr
    # the CLI names its flags where the library names parameters
    assert "(--added-values VALUES)" in proc.stderr and "(--added-default DEFAULTS)" in proc.stderr
    assert "added_values" not in proc.stderr and "Traceback" not in proc.stderr
    np.save(tmp_path / "vec.npy", np.full((2, 4), 5, dtype=np.float16))
    (tmp_path / "more.csv").write_text("score\n100.5\n101.5\n")
    proc = cli_in_process(capsys, "convert", str(src), store, "--append", "--workers", "0",
                          "--added-values", str(tmp_path / "more.csv"), "--added-values", f"vec={tmp_path / 'vec.npy'}",
                          "--added-default", "boxes=[[7, 8]]", "--added-default", 'caption="cli"')
    assert proc.returncode == 0, proc.stderr
    ds = fastdata.open_dataset(store)
    assert ds.column("score")[-2:].tolist() == [100.5, 101.5] and ds.column("vec")[-1].tolist() == [5] * 4
    assert ds[N + 1]["boxes"].tolist() == [[7, 8]] and ds[N]["caption"] == "cli"
    proc = cli_in_process(capsys, "convert", str(src), store, "--append", "--workers", "0", "--added-default", "score")
    assert proc.returncode != 0 and "--added-default takes NAME=JSON" in proc.stderr


def test_inputs_the_writer_rejects_are_named_when_the_values_counted_them(tmp_path):
    """An image folder append whose bad image is rejected stores fewer samples than the values
    given for its inputs: refused once the shards are written (nothing published), naming the
    rejected count; resume=True with values for the stored samples publishes without writing a
    shard again."""
    from helpers.stores import make_folder

    store = str(tmp_path / "c.lmdb")
    fastdata.convert(str(make_folder(tmp_path / "w1", {"a": 3, "b": 3}, seed=1)), store, workers=0, progress=False)
    fastdata.add_fields(store, {"loss": np.arange(6, dtype=np.float32)})
    new = make_folder(tmp_path / "w2", {"b": 3}, seed=2)
    (new / "b" / "s2_001.jpg").write_bytes(b"not a jpeg")  # rejected (strict=False: skipped and reported)
    before = read_manifest(store)["checksum"]
    with pytest.raises(AppendError, match=r"has 3 values, the append stores 2 samples \(1 input\(s\) were "
                                          r"rejected: see the report\).*resume=True"):
        fastdata.convert(str(new), store, append=True, workers=0, progress=False,
                         added_values={"loss": [10.0, 11.0, 12.0]})
    assert read_manifest(store)["checksum"] == before
    report = fastdata.convert(str(new), store, append=True, resume=True, workers=0, progress=False,
                              added_values={"loss": [10.0, 12.0]})
    assert report.resumed_shards == report.shards and report.rejected == 1
    ds = fastdata.open_dataset(store)
    assert ds.column("loss").tolist() == [0, 1, 2, 3, 4, 5, 10, 12] and fastdata.verify(store).ok
