"""The field table: every kind checks, encodes and decodes its values; schemas
round-trip through the manifest's JSON; errors name the sample and the field."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from fastdata.errors import FormatError
from fastdata.fields import (
    CLASSIFICATION,
    JSON,
    KINDS,
    Field,
    Float,
    Image,
    Int,
    NDArray,
    Ragged,
    Schema,
    SchemaError,
    String,
    infer_field,
    kinds_markdown,
    register_kind,
)

VALUES = [
    (Image(), b"\xff\xd8 not really a jpeg"),
    (Int(), -3),
    (Int("uint8"), 255),
    (Int("bool"), True),
    (Float(), 0.25),
    (Float("float32"), 1.5),
    (String(), "a caption, with ünïcode"),
    (NDArray("float32", (4,)), np.arange(4, dtype=np.float32)),
    (NDArray("uint8", (64, 64)), np.ones((64, 64), np.uint8)),  # 4 KiB: in the record
    (Ragged("float32", (4,)), np.arange(12, dtype=np.float32).reshape(3, 4)),
    (Ragged("int64"), np.array([], dtype=np.int64)),
    (JSON(), {"segmentation": [[1.0, 2.0, 3.5]], "iscrowd": 0, "attrs": {"occluded": False}, "none": None}),
]


def _roundtrip(field: Field, value):
    checked = field.check(value, "sample 0 field 'x'")
    if field.index_shape is not None:
        dtype, shape = field.index_shape
        stored = np.asarray(checked, dtype=dtype).reshape(shape)
        out = field.decode(stored if shape else stored.item(), "x")
    else:
        packed = msgpack.packb(field.encode(checked), use_bin_type=True)
        out = field.decode(msgpack.unpackb(packed, raw=False, use_list=False), "x")
    return checked, out


@pytest.mark.parametrize("field,value", VALUES, ids=[f"{f.kind}-{i}" for i, (f, _) in enumerate(VALUES)])
def test_every_kind_round_trips_exactly(field, value):
    checked, out = _roundtrip(field, value)
    if isinstance(checked, np.ndarray):
        assert out.dtype == checked.dtype and out.shape == checked.shape and np.array_equal(out, checked)
    else:
        assert out == checked and type(out) is type(checked)


def test_fixed_numbers_live_in_the_index_and_the_rest_in_the_record():
    schema = Schema.of({"image": Image(), "label": Int(), "score": Float("float32"),
                        "emb": NDArray("float16", (8,)), "mask": NDArray("uint8", (64, 64)),
                        "boxes": Ragged("float32", (4,)), "caption": String(), "meta": JSON()})
    assert set(schema.index_fields()) == {"label", "score", "emb"}
    assert schema.record_fields() == ("image", "mask", "boxes", "caption", "meta")
    assert schema.image_fields() == ("image",)


def test_schema_round_trips_through_json_and_rejects_unknown_kinds():
    schema = Schema.of({"img": Image(), "mask": Image(), "boxes": Ragged("float64", (4,)), "n": Int("int32")})
    assert Schema.from_json(schema.to_json()) == schema
    with pytest.raises(FormatError, match="field kind 'video' is unknown.*upgrade fastdata"):
        Schema.from_json([{"name": "v0", "kind": "video"}])
    with pytest.raises(FormatError, match="bad parameters for a ragged field"):
        Schema.from_json([{"name": "b", "kind": "ragged", "dtype": "object"}])


@pytest.mark.parametrize("sample,message", [
    ({"image": b"x"}, r"sample 7: missing 'label'"),
    ({"image": b"x", "label": 1, "extra": 2}, r"sample 7: not in the schema: 'extra'"),
    ({"image": "a.jpg", "label": 1}, r"sample 7 field 'image': an image field needs encoded bytes"),
    ({"image": b"x", "label": 1.5}, r"sample 7 field 'label': expected an integer"),
    ({"image": b"x", "label": 2**70}, r"sample 7 field 'label': .* does not fit int64"),
])
def test_schema_errors_name_the_sample_and_the_field(sample, message):
    with pytest.raises(SchemaError, match=message):
        CLASSIFICATION.check(sample, "sample 7")


def test_array_fields_refuse_wrong_shapes_dtypes_and_nan():
    with pytest.raises(SchemaError, match="shape .* is not the schema's .*declare Ragged"):
        NDArray("float32", (4,)).check(np.zeros(5), "s field 'e'")
    with pytest.raises(SchemaError, match=r"is not \(N, \*\(4,\)\)"):
        Ragged("float32", (4,)).check(np.zeros((2, 3)), "s field 'boxes'")
    with pytest.raises(SchemaError, match="do not fit uint8 exactly"):
        Ragged("uint8").check(np.array([1, 300]), "s field 'x'")
    with pytest.raises(SchemaError, match="NaN"):
        Float().check(math.nan, "s field 'score'")
    assert math.isnan(Float(allow_nan=True).check(math.nan, "s"))
    # float64 values that float32 holds exactly are accepted (COCO boxes are often such)
    assert Ragged("float32", (4,)).check([[1.5, 2.0, 3.25, 4.0]], "s").dtype == np.float32


def test_decoders_refuse_hostile_stored_values():
    with pytest.raises(FormatError, match="ragged field holds"):
        Ragged("float32", (4,)).decode([2, b"\x00" * 31], "record 3 field 'boxes'")
    with pytest.raises(FormatError, match="must be"):
        Ragged("float32", (4,)).decode(b"junk", "r")
    with pytest.raises(FormatError, match="must be 16 bytes"):
        NDArray("float32", (4,)).decode(b"\x00" * 15, "r")
    with pytest.raises(FormatError, match="binary"):
        Image().decode("not bytes", "r")
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(FormatError, match="nested deeper"):
        JSON().decode(msgpack.unpackb(msgpack.packb(deep), use_list=False), "r")


def test_inference_picks_the_kind_a_value_needs():
    assert infer_field(b"\x89PNG", "s") == Image()
    assert infer_field(3, "s") == Int() and infer_field(np.int32(3), "s") == Int()
    assert infer_field(2.5, "s") == Float()
    assert infer_field("cat", "s") == String()
    assert infer_field("missing.jpg", "s") == String()  # a path to nothing is text
    assert infer_field(np.zeros((3, 4), np.float32), "s") == Ragged("float32", (4,))
    assert infer_field([1, 2, 3], "s") == Ragged("int64")
    assert infer_field([[1.0, 2.0], [3.0, 4.0]], "s") == Ragged("float64", (2,))
    assert infer_field(["cat", "dog"], "s") == JSON()
    assert infer_field({"a": 1}, "s") == JSON()
    with pytest.raises(SchemaError, match="not msgpack-native"):
        infer_field(object(), "sample 0 field 'x'")


def test_a_new_kind_is_one_class_in_one_place():
    """Adding a kind touches only the module that declares it: schemas (and so
    manifests, records and readers) pick it up from the registry."""

    @register_kind
    class Point(Field):
        kind = "test_point2d"

        def check(self, value, where):
            x, y = value
            return [float(x), float(y)]

        def decode(self, obj, where):
            return tuple(obj)

        def describe(self):
            return "record: [x, y] floats"

    try:
        schema = Schema.from_json([{"name": "p", "kind": "test_point2d"}])
        assert isinstance(schema["p"], Point) and schema.record_fields() == ("p",)
        assert "`test_point2d`" in kinds_markdown()
    finally:
        del KINDS["test_point2d"]


def test_field_names_are_checked():
    with pytest.raises(SchemaError, match="identifier"):
        Schema.of({"has space": Int()})
    with pytest.raises(SchemaError, match="identifier"):
        Schema.of({"path": Int()})


def test_a_str_path_to_an_image_file_is_inferred_as_an_image(tmp_path):
    path = tmp_path / "a.JPG"
    path.write_bytes(b"\xff\xd8")
    assert infer_field(str(path), "s") == Image()
    assert infer_field(str(tmp_path / "notes.txt"), "s") == String()
