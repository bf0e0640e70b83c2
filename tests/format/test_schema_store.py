"""Field kinds and backends are each declared in one place."""

from __future__ import annotations

import os

import numpy as np
from helpers.backends import dummy_backend

import fastdata
from fastdata.fields import kinds_markdown
from fastdata.format.backends.lmdb.reader import LMDBShardReader
from fastdata.format.backends.registry import backend_for_path, reader_class, writer_class
from fastdata.writer.options import choose_backend

FORMAT_MD = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "FORMAT.md")


def test_format_md_holds_the_generated_table_of_field_kinds():
    assert kinds_markdown() in open(FORMAT_MD, encoding="utf-8").read()


def test_a_backend_registered_in_one_call_is_selectable_and_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    with dummy_backend("dummy", (".dmy",), like="lmdb"):
        assert choose_backend(str(tmp_path / "x.dmy"), None) == "dummy"
        assert choose_backend("x.lmdb", "DUMMY") == "dummy"
        assert reader_class("dummy") is LMDBShardReader and writer_class("dummy") is writer_class("lmdb")
        dst = tmp_path / "s.dmy"
        fastdata.write([{"x": np.arange(i, dtype=np.int64)} for i in range(5)], dst, workers=0, progress=False)
        assert sorted(p.name for p in dst.glob("shard-*")) == ["shard-00000.dmy"]
        assert fastdata.open_dataset(dst)[4]["x"].tolist() == [0, 1, 2, 3]
        assert fastdata.verify(str(dst)).ok
    assert backend_for_path(str(tmp_path / "x.dmy")) is None  # unregistered after the block


# -- hostile version-2 records: only ever CorruptRecordError ---------------------------------------------------------

import sys  # noqa: E402

import msgpack  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastdata.errors import CorruptRecordError  # noqa: E402
from fastdata.fields import KINDS, Field, Image, Schema, SchemaError, register_kind  # noqa: E402
from fastdata.format.record import decode_record_v2, encode_sample  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.samples import SCHEMA, sample  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _valid_record(i: int) -> bytes:
    from fastdata.writer.sources.python import prepare_sample

    return prepare_sample(SCHEMA, sample(i), i).record


def _decode(buf: bytes):
    try:
        return decode_record_v2(buf, SCHEMA, where="fuzz")
    except CorruptRecordError:
        return None


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_corrupt_record_error(buf):
    _decode(buf)


@FUZZ
@given(st.dictionaries(st.sampled_from(["v", "path", *SCHEMA.record_fields(), "other"]), _VALUES, max_size=10),
       st.booleans())
def test_hostile_record_maps_raise_only_corrupt_record_error(body, ordered):
    if ordered:  # the right keys in the right order, hostile values: reaches every field decoder
        body = {"v": 2, "path": b"p", **{name: body.get(name) for name in SCHEMA.record_fields()}}
    _decode(msgpack.packb(body, use_bin_type=True))


@FUZZ
@given(st.integers(0, 5), st.data())
def test_mutated_records_raise_only_corrupt_record_error(i, data):
    buf = bytearray(_valid_record(i))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    _decode(bytes(buf))


def test_valid_record_control_decodes():
    record = decode_record_v2(_valid_record(3), SCHEMA, where="control")
    assert record["caption"] == sample(3)["caption"] and record["meta"] == sample(3)["meta"]


# -- a field kind declared in one module (here, this test) works end to end ------------------------------------------

class Complex(Field):
    """A complex number, stored in the record as [real, imag]."""

    kind = "test-complex"

    def check(self, value, where):
        if not isinstance(value, complex):
            raise SchemaError(f"{where}: expected a complex number")
        return value

    def encode(self, value):
        return [value.real, value.imag]

    def decode(self, obj, where):
        from fastdata.errors import FormatError

        if not isinstance(obj, list | tuple) or len(obj) != 2 or not all(type(v) is float for v in obj):
            raise FormatError(f"{where}: a complex field must be [real, imag]")
        return complex(*obj)

    def describe(self):
        return "record: `[real, imag]` as two msgpack floats"


def test_a_new_field_kind_is_one_registered_class(tmp_path, monkeypatch):
    from fastdata.fields import Int

    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    register_kind(Complex)
    try:
        schema = Schema.of({"z": Complex(), "n": Int()})
        dst = tmp_path / "c.h5"
        fastdata.write([{"z": complex(i, -i), "n": i} for i in range(4)], dst, schema, workers=0, progress=False)
        ds = fastdata.open_dataset(dst)
        assert [ds[i]["z"] for i in range(4)] == [complex(i, -i) for i in range(4)]
        assert fastdata.verify(str(dst)).ok
        assert "`test-complex`" in kinds_markdown()
        with pytest.raises(SchemaError, match="sample 2 field 'z'"):
            fastdata.write([{"z": 1j, "n": 0}] * 2 + [{"z": 1.0, "n": 0}], tmp_path / "bad.h5", schema, workers=0)
    finally:
        KINDS.pop(Complex.kind, None)


def test_encode_sample_puts_index_fields_in_the_index_only():
    from fastdata.fields import Int

    schema = Schema.of({"image": Image(), "label": Int()})
    encoded = encode_sample(schema, {"image": b"abc", "label": 5}, {"image": ("PNG", 2, 3)}, b"x")
    assert set(msgpack.unpackb(encoded.record)) == {"v", "path", "image"}
    assert encoded.index == {"fields/label": 5, "fields/image.format": 1, "fields/image.width": 2,
                             "fields/image.height": 3, "fields/image.dtype": 1, "fields/image.channels": 3}
