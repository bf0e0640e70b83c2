"""Field files and the manifest keys of added fields are untrusted input (fastdata/format/added.py):
names, generations and every array of a file are checked before anything is read."""

from __future__ import annotations

import copy

import msgpack
import numpy as np
import pytest

from fastdata.errors import CorruptRecordError, FormatError
from fastdata.fields import Float, Ragged
from fastdata.format.added import (
    AddedField,
    build_field_file,
    check_offsets,
    field_file_name,
    parse_header,
    validate_added,
)

COUNT = 5


def _manifest() -> dict:
    return {"shards": [{"name": "shard-00000.lmdb", "field_files": [
        {"name": field_file_name(1, "shard-00000.lmdb"), "generation": 1, "bytes": 100, "xxh": "0"}]}],
        "added_fields": [{"name": "score", "field": {"kind": "float", "dtype": "float64", "allow_nan": False},
                          "generation": 1, "added": "2026-12-07T00:00:00Z", "key": "score"}]}


def test_a_sound_manifest_passes():
    validate_added(_manifest(), ("x",), "m")


@pytest.mark.parametrize("damage, message", [
    (lambda m: m["shards"][0]["field_files"][0].update(name="../../etc/passwd"), "is not this shard's field file"),
    (lambda m: m["shards"][0]["field_files"][0].update(name="shard-00000.lmdb"), "is not this shard's field file"),
    (lambda m: m["shards"][0]["field_files"][0].update(generation=2, name=field_file_name(2, "shard-00000.lmdb")),
     "of generations \\[2\\]"),
    (lambda m: m["shards"][0].pop("field_files"), "of generations \\[\\]"),
    (lambda m: m["added_fields"][0].update(name="x"), "have the name of a field the store was written with"),
    (lambda m: m["added_fields"][0].update(name="not an identifier"), "must be an identifier"),
    (lambda m: m["added_fields"][0].update(field={"kind": "teleport", "dtype": "uint8"}),
     "field kind 'teleport' is unknown to this fastdata version"),
    (lambda m: m["added_fields"][0].update(generation=0), "'generation': 1..99999"),
    (lambda m: m["added_fields"].append(dict(m["added_fields"][0], name="other")), "read the same values"),
    (lambda m: m.pop("added_fields"), "declares no added fields"),
    (lambda m: m["added_fields"][0].update(default="high"), "added field 'score': its default: expected a number"),
    (lambda m: m["added_fields"][0].update(extra=1), "'added': str, 'key': str\\[, 'default': value\\]"),
], ids=["traversal", "a shard's name", "generation", "missing file", "written name", "bad name", "unknown kind",
        "generation 0", "same key", "no fields", "bad default", "unknown key"])
def test_damaged_manifest_entries_refused(damage, message):
    m = copy.deepcopy(_manifest())
    damage(m)
    with pytest.raises(FormatError, match=message):
        validate_added(m, ("x",), "m")


def _file(arrays: dict) -> bytes:
    return b"".join(bytes(p) for p in build_field_file(COUNT, arrays))


SCORE = [AddedField("score", Float(), 1, "t", "score")]
TAGS = [AddedField("boxes", Ragged("float32", (4,)), 1, "t", "boxes")]


def _rewrite(raw: bytes, edit) -> bytes:
    length = int.from_bytes(raw[8:16], "little")
    header = msgpack.unpackb(raw[16:16 + length])
    edit(header)
    packed = msgpack.packb(header)
    return raw[:8] + len(packed).to_bytes(8, "little") + packed + raw[16 + len(packed):]


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["arrays"]["score"].__setitem__(0, "<f4"), "does not match the field"),
    (lambda h: h["arrays"]["score"].__setitem__(1, [COUNT + 1]), "does not match the field"),
    (lambda h: h["arrays"]["score"].__setitem__(3, 10 ** 9), "does not match the field"),
    (lambda h: h["arrays"]["score"].__setitem__(2, 3), "does not match the field"),  # inside the header
    (lambda h: h["arrays"]["score"].__setitem__(0, "|O"), "does not match the field"),  # objects: never
    (lambda h: h.__setitem__("count", COUNT + 1), f"not a version-1 field file of {COUNT} records"),
    (lambda h: h["arrays"].pop("score"), "lacks arrays \\['score'\\]"),
], ids=["dtype", "shape", "nbytes", "offset", "object dtype", "count", "missing"])
def test_damaged_field_file_headers_refused(edit, message):
    raw = _rewrite(_file({"score": np.arange(COUNT, dtype="<f8")}), edit)
    with pytest.raises(CorruptRecordError, match=message):
        parse_header(raw[:4096], len(raw), SCORE, COUNT, "f")


def test_header_length_and_magic_checked():
    raw = _file({"score": np.arange(COUNT, dtype="<f8")})
    with pytest.raises(CorruptRecordError, match="does not fit the file"):
        parse_header(raw[:8] + (1 << 40).to_bytes(8, "little") + raw[16:], len(raw), SCORE, COUNT, "f")
    with pytest.raises(CorruptRecordError, match="not a fastdata field file"):
        parse_header(b"PK\x03\x04" + raw[4:], len(raw), SCORE, COUNT, "f")
    assert set(parse_header(raw, len(raw), SCORE, COUNT, "f")) == {"score"}


def test_value_offsets_checked():
    check_offsets(np.array([0, 3, 3, 8]), 8, "f", "boxes")
    for bad in ([1, 3, 8], [0, 5, 3, 8], [0, 3, 7], []):
        with pytest.raises(CorruptRecordError, match="value offsets are damaged"):
            check_offsets(np.array(bad, dtype=np.int64), 8, "f", "boxes")


def test_image_field_files_need_their_per_sample_arrays_and_known_codes():
    from fastdata.fields import Image
    from fastdata.format.added import IMAGE_META_ARRAYS, check_image_meta

    mask = [AddedField("mask", Image(), 1, "t", "mask")]
    values = {"mask.offsets": np.zeros(COUNT + 1, "<i8"), "mask.checksums": np.zeros(COUNT, "<u8"),
              "mask.data": np.zeros(0, "|u1")}
    with pytest.raises(CorruptRecordError, match="lacks arrays.*mask.channels"):  # a file without them
        raw = _file(values)
        parse_header(raw, len(raw), mask, COUNT, "f")
    meta = {f"mask.{k}": np.ones(COUNT, dtype=v) for k, v in IMAGE_META_ARRAYS.items()}
    raw = _file({**values, **meta})
    assert set(parse_header(raw, len(raw), mask, COUNT, "f")) == set(values) | set(meta)
    good = {k: np.ones(COUNT, dtype=v) for k, v in IMAGE_META_ARRAYS.items()}
    check_image_meta(good, "f", "mask")
    for part, bad, message in (("format", 99, "record 2: unknown format code 99"),
                               ("dtype", 250, "record 2: unknown dtype code 250"),
                               ("width", -1, "a negative width")):
        damaged = {k: v.copy() for k, v in good.items()}
        damaged[part][2] = bad
        with pytest.raises(CorruptRecordError, match=message):
            check_image_meta(damaged, "f", "mask")
