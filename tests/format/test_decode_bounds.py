"""Bounded decoding (fastdata.common.bounded) and the manifest/record/index checks built on it:
each bound has a value just inside (accepted) and just outside (refused, the message naming the
file, shard, record or field)."""

from __future__ import annotations

import json
import os
import struct

import msgpack
import numpy as np
import pytest

from fastdata.common.bounded import (
    BYTES_PER_OBJECT,
    OBJECTS_FLOOR,
    ExpansionError,
    json_container_budget,
    json_loads_bounded,
    object_budget,
    unpackb_bounded,
)
from fastdata.errors import CorruptRecordError, FormatError, UnsafeStoreError
from fastdata.format.fields import MAX_ARRAY_BYTES, JSON, Image, Int, NDArray, Ragged, Schema, SchemaError
from fastdata.format.manifest import MAX_MANIFEST_BYTES, canonical_json, parse_manifest, read_manifest
from fastdata.format.names import MAX_FILE_NAME_BYTES, check_file_name
from fastdata.format.record import encode_sample, unpack_record_v2


def empty_lists(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + b"\x90" * n


def nested_lists(outer: int, inner: int, item: bytes = b"\x90") -> bytes:
    """``outer`` lists of ``inner`` empty lists (or other 1-byte ``item``) each."""
    return b"\xdd" + struct.pack(">I", outer) + (b"\xdd" + struct.pack(">I", inner) + item * inner) * outer


# -- msgpack ------------------------------------------------------------------------------------

def test_budget_formula():
    assert object_budget(0) == OBJECTS_FLOOR
    assert object_budget(8 << 20) == OBJECTS_FLOOR + (8 << 20) // BYTES_PER_OBJECT


def test_msgpack_just_inside_the_budget_decodes():
    # 8 lists of n small ints: each list counts itself and its elements: 1 + 8 + 8 * (1 + n) objects
    n = 40_000
    data = nested_lists(8, n, b"\x01")
    budget = 1 + 8 + 8 * (1 + n)
    assert len(data) > budget  # more bytes than objects allowed: the count runs
    out = unpackb_bounded(data, max_objects=budget)
    assert len(out) == 8 and all(len(x) == n for x in out)
    with pytest.raises(ExpansionError, match="objects allowed"):
        unpackb_bounded(data, max_objects=budget - 1)


def test_msgpack_default_budget_refuses_a_flat_list_of_empty_lists_at_its_header():
    data = empty_lists(8_000_000)
    with pytest.raises(ValueError, match="max_array_len"):
        unpackb_bounded(data)


def test_msgpack_default_budget_refuses_nested_lists_of_empty_lists():
    data = nested_lists(8, 1_000_000)
    with pytest.raises(ExpansionError):
        unpackb_bounded(data)


def test_msgpack_small_input_skips_the_count_and_decodes():
    data = msgpack.packb({"a": [[]] * 1000, "b": "x" * 100})
    assert len(data) < OBJECTS_FLOOR
    assert unpackb_bounded(data, raw=False)["b"] == "x" * 100


def test_msgpack_lengths_are_bounded_by_the_input():
    with pytest.raises(ValueError):
        unpackb_bounded(b"\xc6" + struct.pack(">I", 2**31) + b"x" * 10)  # bin32 claiming 2 GiB of 10 bytes
    with pytest.raises(ValueError):
        unpackb_bounded(b"\xdb" + struct.pack(">I", 2**31) + b"x" * 10)
    with pytest.raises(ValueError):
        unpackb_bounded(b"\xd4\x01\x00")  # ext types: none allowed


# -- JSON ---------------------------------------------------------------------------------------

def test_json_containers_just_inside_and_outside():
    def doc(k: int) -> bytes:  # k empty lists in one list: k + 1 containers in 3k bytes
        return b"[" + b",".join([b"[]"] * k) + b"]"
    k = 1
    while k + 2 <= json_container_budget(len(doc(k + 1))):
        k += 1
    assert len(json_loads_bounded(doc(k))) == k
    with pytest.raises(ExpansionError, match="lists/objects"):
        json_loads_bounded(doc(k + 1))


def test_json_brackets_inside_strings_do_not_count():
    doc = json.dumps({"names": ["[{" * 50_000]}).encode()
    assert json_loads_bounded(doc)["names"][0].startswith("[{")


# -- the manifest -------------------------------------------------------------------------------

def _manifest_body(**changes) -> dict:
    body = {"format": "fastdata-store", "version": 1, "backend": "lmdb",
            "storage": {"mode": "original", "max_side": None, "quality": None, "raw_shape": None},
            "classes": ["a"], "num_samples": 1, "class_counts": [1],
            "shards": [{"name": "shard-00000.lmdb", "first_index": 0, "count": 1, "bytes": 1000, "xxh": "0",
                        "image_bytes": 10}],
            "rejected": [], "options": {}}
    body.update(changes)
    return body


def _signed(body: dict) -> bytes:
    import xxhash

    full = dict(body, checksum=xxhash.xxh3_64_hexdigest(canonical_json(body)))
    return json.dumps(full).encode()


def test_a_sound_manifest_parses():
    assert parse_manifest(_signed(_manifest_body()))["num_samples"] == 1


def test_manifest_of_nested_empty_lists_is_refused_before_parsing():
    body = _manifest_body(options={"note": "@@"})
    raw = _signed(body).replace(b'"@@"', b"[" + b"[]," * (1 << 20) + b"[]]")
    with pytest.raises(FormatError, match="manifest refused.*lists/objects"):
        parse_manifest(raw, where="somewhere/manifest.json")


@pytest.mark.parametrize("name, ok", [
    ("shard-00000.lmdb", True), ("shard-00000.lmdb\x00.evil", False), ("../x.lmdb", False), ("a/b.lmdb", False),
    ("a\\b.lmdb", False), ("..", False), (".hidden", False), ("\x1b[31mred", False), ("x\x85y", False),
    ("é" * (MAX_FILE_NAME_BYTES // 2), True), ("é" * (MAX_FILE_NAME_BYTES // 2 + 1), False),
    ("index.fdi", False), ("manifest.json", False)])
def test_shard_names_must_be_plain_file_names(name, ok):
    body = _manifest_body()
    body["shards"][0]["name"] = name
    if ok:
        parse_manifest(_signed(body))
        return
    with pytest.raises(FormatError, match="shard entry 0: name") as err:
        parse_manifest(_signed(body), where="st/manifest.json")
    assert "st/manifest.json" in str(err.value)


def test_check_file_name_reasons():
    assert check_file_name("ok.h5") is None
    assert "NUL" in check_file_name("a\x00b")
    assert "separator" in check_file_name("a/b")
    assert "longer" in check_file_name("x" * (MAX_FILE_NAME_BYTES + 1))
    assert check_file_name("x" * MAX_FILE_NAME_BYTES) is None


@pytest.mark.parametrize("entry, ok", [
    ({"name": "index.fdi", "bytes": 10, "xxh": "ab"}, True),
    ({"name": "index.fdi", "bytes": 4 << 30, "xxh": "ab"}, True),
    ({"name": "index.fdi", "bytes": (4 << 30) + 1, "xxh": "ab"}, False),
    ({"name": "index.fdi", "bytes": -1, "xxh": "ab"}, False),
    ({"name": "../index.fdi", "bytes": 10, "xxh": "ab"}, False),
    (None, False), ([], False)])
def test_store_index_entry(entry, ok):
    body = _manifest_body(store_index=entry)
    if ok:
        parse_manifest(_signed(body))
        return
    with pytest.raises(FormatError, match="store_index"):
        parse_manifest(_signed(body))


def test_raw_shape_checked_against_the_shard_size_and_the_record_limit():
    raw = {"mode": "raw", "max_side": None, "quality": None, "raw_shape": [10, 10]}
    body = _manifest_body(storage=raw)
    body["shards"][0]["bytes"] = 300  # exactly one 10x10x3 image
    parse_manifest(_signed(body))
    body["shards"][0]["bytes"] = 299
    with pytest.raises(FormatError, match="shard shard-00000.lmdb: 1 raw images of 10x10 are 300 bytes"):
        parse_manifest(_signed(body))
    body = _manifest_body(storage=dict(raw, raw_shape=[10**5, 10**5]))
    body["shards"][0]["bytes"] = 10**12
    with pytest.raises(FormatError, match="raw_shape"):
        parse_manifest(_signed(body))


def test_fifo_manifest_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(UnsafeStoreError, match="FIFO"):
        read_manifest(str(tmp_path))


def test_manifest_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    import fastdata.format.manifest as m

    raw = _signed(_manifest_body())
    (tmp_path / "manifest.json").write_bytes(raw)
    monkeypatch.setattr(m, "MAX_MANIFEST_BYTES", len(raw))
    assert read_manifest(str(tmp_path))["num_samples"] == 1
    monkeypatch.setattr(m, "MAX_MANIFEST_BYTES", len(raw) - 1)
    with pytest.raises(UnsafeStoreError, match="more than"):
        read_manifest(str(tmp_path))
    assert MAX_MANIFEST_BYTES == 256 << 20


# -- schema shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [[2**70], [2**32, 2**32], [2**31, 2**31, 4], [-1], [True], [1.5], "ab",
                                   [1] * 33])
def test_hostile_ndarray_shapes_are_format_errors_naming_the_field(shape):
    schema = [{"name": "vec", "kind": "ndarray", "dtype": "float32", "shape": shape}]
    with pytest.raises(FormatError, match="schema field 'vec'"):
        Schema.from_json(schema, "st/manifest.json: schema")
    ragged = [{"name": "box", "kind": "ragged", "dtype": "float32", "inner_shape": shape}]
    with pytest.raises(FormatError, match="schema field 'box'"):
        Schema.from_json(ragged, "st/manifest.json: schema")


def test_array_size_limit_just_inside_and_outside():
    assert NDArray("uint8", (MAX_ARRAY_BYTES,)).nbytes == MAX_ARRAY_BYTES
    assert NDArray("float32", (MAX_ARRAY_BYTES // 4,)).nbytes == MAX_ARRAY_BYTES
    with pytest.raises(SchemaError, match="more than"):
        NDArray("float32", (MAX_ARRAY_BYTES // 4 + 1,))
    assert Ragged("uint8", (1 << 15, 1 << 15)).row_bytes == MAX_ARRAY_BYTES
    with pytest.raises(SchemaError, match="more than"):
        Ragged("uint16", (1 << 15, 1 << 15))


# -- version-2 records --------------------------------------------------------------------------

SCHEMA = Schema.of({"image": Image(), "label": Int(), "meta": JSON()})


def _record(meta_raw: bytes) -> bytes:
    p = msgpack.Packer(use_bin_type=True)
    return (p.pack_map_header(4) + p.pack("v") + p.pack(2) + p.pack("path") + p.pack(b"x") + p.pack("image")
            + p.pack(b"\xff" * 100) + p.pack("meta") + meta_raw)


def test_record_of_8_million_empty_lists_is_a_corrupt_record_naming_the_field():
    where = "st: shard shard-00000.lmdb record 0 (sample 0)"
    for raw in (empty_lists(8_000_000), nested_lists(8, 1_000_000)):
        with pytest.raises(CorruptRecordError, match="expansion bomb") as err:
            unpack_record_v2(_record(raw), where=where)
        assert str(err.value).startswith(where + " field 'meta'")


def test_record_just_inside_its_budget_decodes():
    meta = [0] * 50_000 + [[]] * 10_000  # small ints and empty lists: 1 byte each
    data = msgpack.packb(meta, use_bin_type=True)
    rec = _record(data)
    assert 1 + 60_000 + 10_000 + 9 <= object_budget(len(rec))
    assert len(unpack_record_v2(rec, where="w")["meta"]) == 60_000


def test_the_writer_refuses_what_readers_would_refuse():
    jpeg = b"\xff\xd8" + b"\x00" * 10
    n = 200_000
    checked = SCHEMA.check({"image": jpeg, "label": 1, "meta": [[]] * n}, "sample 3")
    with pytest.raises(SchemaError, match="field 'meta'"):
        encode_sample(SCHEMA, checked, {"image": ("JPEG", 1, 1)}, b"r")
    # just inside: a list of ints as long as the budget allows for its own size
    meta = [1] * 70_000
    checked = SCHEMA.check({"image": jpeg, "label": 1, "meta": meta}, "sample 3")
    sample = encode_sample(SCHEMA, checked, {"image": ("JPEG", 1, 1)}, b"r")
    assert unpack_record_v2(sample.record, where="w")["meta"] == meta


def test_store_index_of_empty_lists_is_refused():
    from fastdata.format.store_index import parse_store_index

    data = empty_lists(8_000_000)
    import xxhash

    manifest = {"shards": [{"name": "s", "count": 0}],
                "store_index": {"name": "index.fdi", "bytes": len(data), "xxh": xxhash.xxh3_64_hexdigest(data)}}
    with pytest.raises(CorruptRecordError, match="index.fdi is not readable"):
        parse_store_index(data, manifest, None, "st/index.fdi")
    assert np.int64  # numpy imported for the fixtures above
