"""fastdata.common.imageio.validate_image: Pillow's verdict on every input, faster for plain JPEGs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastdata.common import imageio
from fastdata.common.imageio import ImageDecodeError, open_image, stored_format, validate_image


def _jpeg(seed: int = 0, size=(64, 48), **save) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG", **save)
    return buf.getvalue()


def _verdict(fn, data):
    try:
        return fn(data)
    except ImageDecodeError:
        return "refused"


def _pillow(data):
    im = open_image(data)
    return stored_format(im), im.width, im.height


def test_a_plain_jpeg_never_reaches_pillow_and_other_formats_do(monkeypatch):
    def no_pillow(data):
        raise AssertionError("Pillow was asked")

    monkeypatch.setattr(imageio, "open_image", no_pillow)
    assert validate_image(_jpeg()) == ("JPEG", 64, 48)
    assert validate_image(_jpeg(progressive=True)) == ("JPEG", 64, 48)
    png = io.BytesIO()
    Image.new("RGB", (5, 4)).save(png, "PNG")
    with pytest.raises(AssertionError, match="Pillow was asked"):  # control: a PNG goes to Pillow
        validate_image(png.getvalue())


@pytest.mark.parametrize("seed", range(40))
def test_damaged_jpegs_get_pillows_verdict(seed):
    rng = np.random.default_rng(seed)
    data = bytearray(_jpeg(seed, progressive=bool(seed % 2)))
    kind = seed % 4
    if kind == 0:  # truncated
        data = data[: int(rng.integers(200, len(data) - 2))]
    elif kind == 1:  # bytes flipped inside the scan
        for pos in rng.integers(len(data) // 2, len(data) - 2, 4):
            data[pos] ^= 0xFF
    elif kind == 2:  # garbage inserted before a marker (Pillow only warns: kept)
        at = data.rfind(b"\xff\xd9")
        data[at:at] = bytes(rng.integers(0, 255, 8, dtype=np.uint8)).replace(b"\xff", b"\x00")
    else:  # a header lying about the size
        sof = data.find(b"\xff\xc0") if data.find(b"\xff\xc0") >= 0 else data.find(b"\xff\xc2")
        data[sof + 5] ^= 0x01
    assert _verdict(validate_image, bytes(data)) == _verdict(_pillow, bytes(data))


def test_cmyk_and_bombs_are_judged_by_pillow(monkeypatch):
    buf = io.BytesIO()
    Image.new("CMYK", (6, 5), (1, 2, 3, 4)).save(buf, "JPEG")
    assert validate_image(buf.getvalue()) == ("JPEG", 6, 5)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageDecodeError, match="decompression bomb"):
        validate_image(_jpeg(size=(64, 48)))
