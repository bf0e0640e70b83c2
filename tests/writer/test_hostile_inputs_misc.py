"""Hostile conversion inputs (issue 36): a Parquet dataset's sidecars (``dataset_info.json``,
``README.md``) that are FIFOs, links to devices or oversized; destinations that are an input under
another name (a symlink, a folder inside it); footers and index values that overflow a C integer.
Each attack ends in a typed error naming the file; each has a control that converts or reads."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.hostile import lmdb_put, run_cli
from helpers.procs import cli_in_process
from helpers.volumes import SCHEMA, volume

import fastdata
from fastdata.errors import CorruptRecordError, FastdataError, SourceError, StoreExistsError
from fastdata.format.manifest import read_manifest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

NAMES = ["n0", "n1", "n2"]


def _parquet_dataset(root: Path) -> Path:
    """A Hub-like folder: ``root/data/train-00000-of-00001.parquet`` with an int ``label`` column
    (no huggingface metadata: its class names come from a sidecar in ``root``)."""
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.table({"label": [2, 0, 1, 1, 0], "x": [1.0, 2.0, 3.0, 4.0, 5.0]}),
                   root / "data" / "train-00000-of-00001.parquet")
    return root / "data"


def _info_json(names) -> str:
    return json.dumps({"features": {"label": {"names": names, "_type": "ClassLabel"}}})


# ---------------------------------------------------------------------------- sidecars


@pytest.mark.parametrize("name", ["dataset_info.json", "README.md"])
def test_a_fifo_sidecar_is_refused_at_once_never_waited_on(tmp_path, name):
    data = _parquet_dataset(tmp_path)
    fifo = tmp_path / name
    os.mkfifo(fifo)
    done, hung = threading.Event(), []

    def watchdog():  # a reader blocked in open() is released (EOF) so that the test can fail, not hang
        if not done.wait(5):
            hung.append(True)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        with pytest.raises(SourceError) as caught:
            fastdata.convert(data, tmp_path / "out.lmdb", workers=0, progress=False)
    finally:
        done.set()
        guard.join()
    assert not hung, "the conversion waited on the FIFO for a writer"
    assert str(fifo) in str(caught.value) and "FIFO" in str(caught.value)
    assert not (tmp_path / "out.lmdb" / "manifest.json").exists()


def test_a_sidecar_linked_to_dev_zero_is_refused_without_reading_it(tmp_path):
    """Run in a child under RLIMIT_AS and a timeout: reading /dev/zero to its end never ends."""
    data = _parquet_dataset(tmp_path)
    os.symlink("/dev/zero", tmp_path / "dataset_info.json")
    result = run_cli(["convert", str(data), str(tmp_path / "out.lmdb"), "--workers", "0"], limit=8 << 30,
                     timeout=60)
    assert result["outcome"] == "exit" and result["rc"] != 0, result
    err = result["stderr"]
    assert "dataset_info.json" in err and "character device" in err and "Traceback" not in err, err


def test_oversized_sidecars_and_class_lists_are_refused_naming_the_file(tmp_path):
    data = _parquet_dataset(tmp_path)
    info = tmp_path / "dataset_info.json"
    # a 30 MB ClassLabel list: over the sidecar's size limit, refused before it is read
    info.write_text(_info_json([f"class-{i:08d}-" + "x" * 16 for i in range(1_000_000)]))
    assert info.stat().st_size > 30_000_000
    with pytest.raises(SourceError, match=r"dataset_info\.json.*more than the 16,777,216 allowed"):
        fastdata.convert(data, tmp_path / "a.lmdb", workers=0, progress=False)
    # within the size limit, but names holding more than the class names' limit
    info.write_text(_info_json(["y" * 1000 for _ in range(9000)]))
    with pytest.raises(SourceError, match=r"dataset_info\.json: a ClassLabel whose 9,000 names hold more than"):
        fastdata.convert(data, tmp_path / "b.lmdb", workers=0, progress=False)
    # more names than allowed, in the Parquet file's own huggingface metadata
    info.unlink()
    crowded = tmp_path / "crowded.parquet"
    meta = {b"huggingface": json.dumps({"info": {"features": {"label": {
        "names": [str(i) for i in range(1_000_001)], "_type": "ClassLabel"}}}})}
    pq.write_table(pa.table({"label": [0, 1]}).replace_schema_metadata(meta), crowded)
    with pytest.raises(SourceError, match=r"crowded\.parquet: a ClassLabel of 1,000,001 names, more than the "):
        fastdata.convert(crowded, tmp_path / "c.lmdb", workers=0, progress=False)


def test_a_card_with_aliased_class_names_is_not_expanded(tmp_path):
    """A YAML alias bomb in a card's class names: a name must be a string, not a list of lists."""
    pytest.importorskip("yaml")
    data = _parquet_dataset(tmp_path)
    card = ["---", "a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for k in "bcdefgh":
        prev = chr(ord(k) - 1)
        card.append(f"{k}: &{k} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    card += ["dataset_info:", "  features:", "  - name: label", "    dtype:", "      class_label:",
             "        names: [*h, *h, *h]", "---", "# card"]
    (tmp_path / "README.md").write_text("\n".join(card) + "\n")
    with pytest.raises(SourceError, match=r"README\.md: a ClassLabel name is a list, not a string"):
        fastdata.convert(data, tmp_path / "out.lmdb", workers=0, progress=False)


def test_control_sound_sidecars_give_their_class_names_and_a_malformed_one_a_warning(tmp_path):
    data = _parquet_dataset(tmp_path)
    (tmp_path / "dataset_info.json").write_text(_info_json(NAMES))
    fastdata.convert(data, tmp_path / "ok.lmdb", workers=0, progress=False)
    assert read_manifest(str(tmp_path / "ok.lmdb"))["class_tables"] == {"label": NAMES}
    (tmp_path / "dataset_info.json").write_text('{"features": {"label": ')  # truncated: skipped, reported
    report = fastdata.convert(data, tmp_path / "plain.lmdb", workers=0, progress=False)
    assert any("dataset_info.json: not valid JSON" in w for w in report.warnings), report.warnings
    assert read_manifest(str(tmp_path / "plain.lmdb"))["class_tables"] == {}


# ---------------------------------------------------------------------------- destinations


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def two_stores(tmp_path):
    a, b = tmp_path / "A.lmdb", tmp_path / "B.lmdb"
    fastdata.write([{"x": i} for i in range(3)], a, workers=0, progress=False)
    fastdata.write([{"x": i} for i in range(3, 5)], b, workers=0, progress=False)
    return a, b


def test_merge_into_a_symlink_to_an_input_leaves_the_input_intact(two_stores, tmp_path, capsys):
    a, b = two_stores
    before = _tree_digest(a)
    link = tmp_path / "LINK"
    os.symlink(a, link)
    result = cli_in_process(capsys, "merge", str(a), str(b), "-o", str(link), "--overwrite")
    assert result.returncode != 0
    assert f"the destination {link} is the input {a}" in result.stderr, result.stderr
    with pytest.raises(FastdataError, match="is the input"):
        fastdata.merge([b, a], link, overwrite=True)
    with pytest.raises(FastdataError, match=f"lies inside the input {a}"):  # not made yet, inside an input
        fastdata.merge([a, b], link / "sub" / "C.lmdb")
    assert _tree_digest(a) == before and not (a / "sub").exists()
    assert fastdata.verify(str(a)).ok and read_manifest(str(a))["num_samples"] == 3


def test_control_merge_overwrites_a_real_other_store(two_stores, tmp_path):
    a, b = two_stores
    c = tmp_path / "C.lmdb"
    fastdata.write([{"x": 9}], c, workers=0, progress=False)
    fastdata.merge([a, b], c, overwrite=True)
    assert fastdata.verify(str(c)).ok and read_manifest(str(c))["num_samples"] == 5
    assert [s["name"] for s in read_manifest(str(c))["shards"]] == ["shard-00000.lmdb", "shard-00001.lmdb"]


def test_convert_and_append_into_a_destination_resolving_to_the_source(tmp_path):
    data = _parquet_dataset(tmp_path)
    before = _tree_digest(data)
    link = tmp_path / "LINK"
    os.symlink(data, link)
    for kwargs in ({}, {"overwrite": True}, {"append": True}):
        with pytest.raises(StoreExistsError, match=f"the destination {link} is the input {data}"):
            fastdata.convert(data, link, workers=0, progress=False, **kwargs)
    with pytest.raises(StoreExistsError, match=f"the input {data} lies inside the destination {tmp_path}"):
        fastdata.convert(data, tmp_path, workers=0, progress=False, overwrite=True)
    assert _tree_digest(data) == before
    # control: a destination beside the source
    fastdata.convert(data, tmp_path / "out.lmdb", workers=0, progress=False)
    assert read_manifest(str(tmp_path / "out.lmdb"))["num_samples"] == 5


# ---------------------------------------------------------------------------- overflowing values


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _craft_row_count(path: Path, rows: int, claimed: int) -> None:
    """A Parquet file of ``rows`` rows (one row group) whose footer's row group says ``claimed`` rows:
    the Thrift compact ``RowGroup.num_rows`` (field 3, i64, zigzag varint) rewritten, the footer's
    length updated."""
    pq.write_table(pa.table({"x": list(range(rows))}), path)
    data = path.read_bytes()
    n = struct.unpack("<I", data[-8:-4])[0]
    footer = data[-8 - n:-8]
    field = b"\x16" + _varint(rows << 1)
    at = footer.rfind(field)  # RowGroup.num_rows follows the column chunks (whose num_values is the same)
    assert at > 0
    new = footer[:at] + b"\x16" + _varint(((claimed << 1) ^ (claimed >> 63)) & (2**64 - 1)) + footer[at + len(field):]
    path.write_bytes(data[:-8 - n] + new + struct.pack("<I", len(new)) + b"PAR1")
    assert pq.read_metadata(path).row_group(0).num_rows == claimed


@pytest.mark.parametrize("claimed", [2**62, 2**63 - 1, -1, 777])
def test_a_parquet_footer_row_count_out_of_range_is_a_typed_error(tmp_path, claimed, capsys):
    src = tmp_path / "x.parquet"
    _craft_row_count(src, 777, claimed)
    dst = tmp_path / "out.lmdb"
    if claimed == 777:  # control: the same motions, the true count
        fastdata.convert(src, dst, workers=0, progress=False)
        assert read_manifest(str(dst))["num_samples"] == 777
        return
    with pytest.raises(SourceError, match=rf"x\.parquet: its footer says row group 0 holds {claimed:,} rows"):
        fastdata.convert(src, dst, workers=0, progress=False)
    result = cli_in_process(capsys, "convert", str(src), str(tmp_path / "cli.lmdb"), "--workers", "0")
    assert result.returncode != 0 and "x.parquet" in result.stderr and "--resume" not in result.stderr, result.stderr


@pytest.mark.parametrize("first", [2**63, 2**64 - 1, 0])
def test_an_lmdb_chunk_key_past_int64_is_a_corrupt_record_error(tmp_path, first):
    dst = tmp_path / "v.lmdb"
    vol = volume(0, (20, 20, 20))
    fastdata.write([{"ct": vol, "label": 0}], dst, SCHEMA, workers=0, progress=False)
    shard = str(dst / "shard-00000.lmdb")
    lmdb_put(shard, {(b"index", b"fields/ct.first"): np.array([first], "<u8").tobytes()})
    arr = fastdata.open_dataset(dst)[0]["ct"]
    if first == 0:  # control: the same rewrite, the true key
        assert np.array_equal(arr[:, :, :], vol)
        return
    with pytest.raises(CorruptRecordError, match=r"shard-00000\.lmdb.*outside 0 \.\. 9,223,372,036,854,775,807"):
        arr[:, :, :]  # several chunks: their keys are prefetched together
    with pytest.raises(CorruptRecordError, match="outside 0"):
        arr[:2, :2, :2]  # one chunk
    assert not fastdata.verify(str(dst)).ok


@pytest.mark.parametrize("first", [2**63, 2**64 - 1, 2**63 - 1, 0])
def test_an_hdf5_chunk_offset_past_int64_is_a_corrupt_record_error(tmp_path, first):
    """HDF5 keeps a value's chunks at a byte offset (``first``) into the shard's ``chunks`` dataset:
    an offset at or past 2**63 (a u64 that would wrap in int64 arithmetic) is a damaged record."""
    h5py = pytest.importorskip("h5py")
    dst = tmp_path / "v.h5"
    vol = volume(0, (20, 20, 20))
    fastdata.write([{"ct": vol, "label": 0}], dst, SCHEMA, workers=0, progress=False, format="hdf5")
    with h5py.File(dst / "shard-00000.h5", "r+") as f:
        f["fields/ct.first"][0] = first
    ds = fastdata.open_dataset(dst)
    arr = ds[0]["ct"]
    if first == 0:  # control: the same rewrite, the true offset
        assert np.array_equal(arr[:, :, :], vol)
        assert fastdata.verify(str(dst)).ok
        return
    with pytest.raises(CorruptRecordError, match=r"shard-00000\.h5.*field 'ct' chunk 0: missing"):
        arr[:, :, :]
    with pytest.raises(CorruptRecordError, match="chunk 0: missing"):
        arr[:2, :2, :2]
    del arr, ds
    assert not fastdata.verify(str(dst)).ok
