"""The store index file's ``record_ranges`` (docs/FORMAT.md, section 3a): read with nothing but the
shard file's bytes at those ranges, every record is what the shard's own reader gives."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import xxhash

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.format.manifest import read_manifest
from fastdata.format.store_index import parse_store_index


def _stores(root) -> dict[str, str]:
    from fastdata.synth import make_image_folder

    make_image_folder(root / "imgs", num_classes=2, per_class=4, size=(90, 120))
    rng = np.random.default_rng(0)
    samples = [{"image": rng.integers(0, 255, (30 + i, 40, 3), dtype=np.uint8), "idx": i} for i in range(8)]
    out = {}
    for suffix in (".lmdb", ".h5"):
        out[f"v1{suffix}"] = str(root / f"v1{suffix}")
        fastdata.convert(str(root / "imgs"), out[f"v1{suffix}"], shard_size="30kB", workers=1, progress=False)
        out[f"raw{suffix}"] = str(root / f"raw{suffix}")
        fastdata.convert(str(root / "imgs"), out[f"raw{suffix}"], raw="24x32", shard_size="8kB", workers=1,
                         progress=False)
        out[f"v2{suffix}"] = str(root / f"v2{suffix}")
        fastdata.write(samples, out[f"v2{suffix}"], shard_size="12kB", workers=1, progress=False)
    return out


def _indexes(store: str) -> list:
    m = read_manifest(store)
    schema = None if m["version"] == 1 else fastdata.fields.Schema.from_json(m["schema"])
    with open(os.path.join(store, "index.fdi"), "rb") as fh:
        return parse_store_index(fh.read(), m, schema, store)


def test_record_ranges_give_every_record_from_the_shard_bytes_alone(tmp_path):
    for name, store in _stores(tmp_path).items():
        m = read_manifest(store)
        ds = fastdata.open_dataset(store)
        indexes = _indexes(store)
        assert len(indexes) > 1, name
        for shard, index in zip(m["shards"], indexes, strict=True):
            ranges = index.record_ranges
            assert ranges is not None and ranges.shape[0] == shard["count"] and ranges.shape[2] == 2, name
            with open(os.path.join(store, shard["name"]), "rb") as fh:
                data = fh.read()
            reader = ds._reader(m["shards"].index(shard))
            for j in range(shard["count"]):
                value = b"".join(data[a:a + n] for a, n in ranges[j].tolist() if n)
                if name.startswith(("v1.lmdb", "raw.lmdb")):  # a classification LMDB value: the msgpack record
                    image = msgpack.unpackb(value, raw=False)["img"]
                else:  # an HDF5 record, a general LMDB record: the bytes the checksum is of
                    image = value
                assert xxhash.xxh3_64_intdigest(image) == int(index.checksums[j]), (name, j)
                assert bytes(reader.get(j)) == (image if name.startswith(("v1", "raw")) else value), (name, j)
                assert type(reader).from_stored_value(value, j, int(index.checksums[j]), schema=reader.schema,
                                                      where=name) == reader.get(j)
        if name.endswith(".h5"):
            assert all(idx.record_ranges.shape[1] == 1 for idx in indexes)  # one piece a record


def test_a_damaged_record_ranges_array_is_refused(tmp_path):
    from helpers.hostile import index_entries, resign

    from fastdata.errors import FormatError

    from fastdata.synth import make_image_folder

    make_image_folder(tmp_path / "imgs", num_classes=2, per_class=2, size=(40, 40))
    store = str(tmp_path / "s.h5")
    fastdata.convert(str(tmp_path / "imgs"), store, progress=False)
    body = index_entries(store)
    dtype, shape, raw = body["shards"][0]["arrays"]["record_ranges"]
    body["shards"][0]["arrays"]["record_ranges"] = [dtype, [shape[0], 1, 3], raw]
    with open(os.path.join(store, "index.fdi"), "wb") as fh:
        fh.write(msgpack.packb(body, use_bin_type=True))
    resign(store)
    with pytest.raises((CorruptRecordError, FormatError), match="record_ranges.*damaged"):
        _indexes(store)


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_verify_checks_record_ranges_against_the_shards(tmp_path, suffix):
    """``fastdata verify`` reads each record at its ranges as ``cache="records"`` would: a store whose
    (re-signed) index file places a record elsewhere is reported, naming the shard and record."""
    import shutil

    from helpers.hostile import index_entries, resign

    from fastdata.synth import make_image_folder

    make_image_folder(tmp_path / "imgs", num_classes=2, per_class=3, size=(60, 80))
    store = str(tmp_path / f"s{suffix}")
    fastdata.convert(str(tmp_path / "imgs"), store, shard_size="20kB", workers=1, progress=False)
    assert fastdata.verify(store).ok
    crafted = str(tmp_path / f"crafted{suffix}")
    shutil.copytree(store, crafted)
    body = index_entries(crafted)
    entry = body["shards"][0]
    dtype, shape, raw = entry["arrays"]["record_ranges"]
    ranges = np.frombuffer(raw, "<u8").reshape(shape).copy()
    piece = int(np.argmax(ranges[1, :, 1]))  # (an LMDB record's head may be empty: its largest piece)
    ranges[1, piece, 0] -= 1  # one byte early: the right length, the wrong bytes
    entry["arrays"]["record_ranges"] = [dtype, shape, ranges.tobytes()]
    with open(os.path.join(crafted, "index.fdi"), "wb") as fh:
        fh.write(msgpack.packb(body, use_bin_type=True))
    resign(crafted)
    report = fastdata.verify(crafted)
    assert not report.ok
    assert any(f"{entry['name']}: record 1: the record_ranges of index.fdi do not give the record" in p
               for p in report.problems), report.problems
