"""fastdata.write with native image arrays (numpy, torch, deep PIL modes): stored losslessly,
bit-exact, with their dtype and channel count in the index; unsupported arrays refused by name."""

from __future__ import annotations

import io

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image as PILImage

import fastdata
from fastdata.fields import Image, Int, SchemaError
from helpers.images import make_jpeg
from helpers.native import ramp, v2_records, write_png16

SCHEMA = {"image": Image(), "label": Int()}
#: (dtype, channels) pairs written in one store: every dtype family, 1/3/4/5 channels
CASES = [("uint8", 1), ("uint8", 3), ("uint8", 4), ("uint8", 5), ("uint16", 1), ("uint16", 3), ("int16", 1),
         ("int16", 4), ("float32", 1), ("float32", 5), ("int32", 1), ("float64", 3)]


def unchanged(data: bytes, fmt: str) -> np.ndarray:
    """The stored pixels through an independent decoder: tifffile for a TIFF, Pillow for a PNG
    (fastdata's own ``decode_image(data, "unchanged")`` is checked by the codec tests)."""
    if fmt == "TIFF":
        return tifffile.imread(io.BytesIO(data))
    with PILImage.open(io.BytesIO(data)) as im:
        return np.array(im)


def _array(dtype: str, channels: int, seed: int) -> np.ndarray:
    shape = (7, 9) if channels == 1 else (7, 9, channels)
    return ramp(shape, dtype, seed)


def test_arrays_of_every_dtype_and_channel_count_are_stored_bit_exact(tmp_path):
    arrays = [_array(d, c, i) for i, (d, c) in enumerate(CASES)]
    arrays[8][0, 0] = np.nan  # a NaN and a negative zero survive too (compared bit for bit)
    arrays[8][0, 1] = -0.0
    samples = [{"image": a, "label": i} for i, a in enumerate(arrays)]
    fastdata.write(samples, tmp_path / "s.lmdb", SCHEMA, workers=0, progress=False)
    records = v2_records(tmp_path / "s.lmdb")
    assert len(records) == len(CASES)
    for rec, a, (dtype, channels) in zip(records, arrays, CASES, strict=True):
        back = unchanged(rec["image"], rec["image.format"])
        assert back.dtype == a.dtype and back.shape == a.shape, (dtype, channels)
        assert back.tobytes() == a.tobytes(), (dtype, channels)
        assert (rec["image.dtype"], rec["image.channels"]) == (dtype, channels)
        assert (rec["image.width"], rec["image.height"]) == (9, 7)
        assert rec["image.format"] == ("PNG" if dtype == "uint8" and channels <= 4 else "TIFF")


def test_torch_tensors_and_deep_pil_images_are_stored_losslessly(tmp_path):
    u16 = ramp((6, 5), np.uint16, 1)
    f32 = ramp((6, 5), np.float32, 2)
    i32 = ramp((6, 5), np.int32, 3)
    samples = [
        {"image": torch.from_numpy(ramp((6, 5, 3), np.int16, 4)), "label": 0},
        {"image": PILImage.fromarray(u16), "label": 1},  # mode I;16
        {"image": PILImage.fromarray(f32), "label": 2},  # mode F
        {"image": PILImage.fromarray(i32), "label": 3},  # mode I
    ]
    assert [s["image"].mode for s in samples[1:]] == ["I;16", "F", "I"]
    fastdata.write(samples, tmp_path / "t.h5", SCHEMA, workers=1, progress=False)
    records = v2_records(tmp_path / "t.h5")
    expected = [samples[0]["image"].numpy(), u16, f32, i32]
    for rec, want in zip(records, expected, strict=True):
        back = unchanged(rec["image"], rec["image.format"])
        assert back.dtype == want.dtype and back.tobytes() == want.tobytes()
        assert rec["image.dtype"] == want.dtype.name
        assert rec["image.channels"] == (1 if want.ndim == 2 else want.shape[2])


def test_encoded_images_record_what_they_hold(tmp_path):
    png16 = tmp_path / "deep.png"
    write_png16(png16, (8, 6))
    gray = make_jpeg(tmp_path / "g.jpg", mode="L")
    rgba = tmp_path / "a.png"
    PILImage.fromarray(ramp((5, 4, 4), np.uint8)).save(rgba)
    samples = [{"image": str(png16), "label": 0}, {"image": gray, "label": 1}, {"image": str(rgba), "label": 2},
               {"image": make_jpeg(tmp_path / "c.jpg"), "label": 3}]
    fastdata.write(samples, tmp_path / "e.lmdb", SCHEMA, workers=0, progress=False)
    kinds = [(r["image.format"], r["image.dtype"], r["image.channels"]) for r in v2_records(tmp_path / "e.lmdb")]
    assert kinds == [("PNG", "uint16", 1), ("JPEG", "uint8", 1), ("PNG", "uint8", 4), ("JPEG", "uint8", 3)]


@pytest.mark.parametrize("bad, what", [
    (np.zeros((4, 4), dtype=np.complex64), "complex64"),
    (np.zeros((4, 4), dtype=bool), "bool"),
    (np.zeros((4, 4), dtype=object), "object"),
    (np.zeros((4, 4), dtype="datetime64[s]"), "datetime64"),
    (np.zeros((2, 4, 4, 3), dtype=np.uint8), "shape (2, 4, 4, 3)"),
    (np.zeros(4, dtype=np.uint8), "shape (4,)"),
    (np.zeros((0, 4), dtype=np.uint8), "shape (0, 4)"),
])
def test_unsupported_arrays_are_refused_naming_sample_and_field(tmp_path, bad, what):
    samples = [{"image": np.zeros((3, 3), np.uint8), "label": 0}, {"image": bad, "label": 1}]
    with pytest.raises(SchemaError, match=r"sample 1 field 'image'") as err:
        fastdata.write(samples, tmp_path / "x.lmdb", SCHEMA, workers=0, progress=False)
    assert what in str(err.value)
    assert not (tmp_path / "x.lmdb" / "manifest.json").exists()
