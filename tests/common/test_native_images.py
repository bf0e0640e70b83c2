"""Images as they are stored (``decode_image(data, "unchanged")``) against the real reference readers
(cv2 for PNG, tifffile for TIFF, pydicom for DICOM), bit for bit; the Pillow modes against Pillow's
``convert``; and the refusals: decompression bombs before allocation, damage, stacks, missing libraries."""

from __future__ import annotations

import io
import struct
import sys
import tracemalloc

import numpy as np
import pytest
import tifffile
from PIL import Image

from fastdata.common import imageio
from fastdata.common.imageio import (
    ARRAY_IMAGE_DTYPES,
    IMAGE_DTYPES,
    ImageDecodeError,
    decode_image,
    decode_pil_image,
    decoded_bytes_limit,
    dicom_tags,
    encode_lossless,
    has_pillow_form,
    inspect_image,
    pixel_limit,
)
from fastdata.errors import ImageModeError, MissingExtraError
from fastdata.format.record import IMAGE_DTYPE_CODES
from helpers.native_images import HEIGHT, WIDTH, dicom, native_cases, pixels, png_cv2, tiff

CASES = native_cases()
IDS = [name for name, _, _ in CASES]


def _pillow_opens_as_one_image(name: str) -> bool:
    """The cases that have a Pillow form: every PNG, TIFFs of up to 4 bands and one band or 8 bits."""
    if name.startswith("dicom"):
        return False
    if name.startswith("tiff"):
        return "5band" not in name and ("1band" in name or "uint8" in name)
    return True


@pytest.mark.parametrize(("name", "data", "ref"), CASES, ids=IDS)
def test_unchanged_is_the_reference_bit_for_bit(name, data, ref):
    out = decode_image(data, "unchanged")
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert np.array_equal(out, ref)
    assert out.flags.writeable and out.flags.c_contiguous
    assert np.array_equal(decode_image(memoryview(data), "unchanged"), ref)  # any buffer


@pytest.mark.parametrize(("name", "data", "ref"), CASES, ids=IDS)
def test_inspect_image_records_the_unchanged_form(name, data, ref):
    info = inspect_image(data)
    assert info.format == name.split("-")[0].upper()
    assert (info.height, info.width) == (HEIGHT, WIDTH)
    assert info.dtype == ref.dtype.name and info.channels == (1 if ref.ndim == 2 else ref.shape[2])


@pytest.mark.parametrize(("name", "data", "ref"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_pillow_modes_are_pillows_convert_or_a_mode_error(name, data, ref, mode):
    assert has_pillow_form(data) == _pillow_opens_as_one_image(name)
    if _pillow_opens_as_one_image(name):
        expected = np.array(Image.open(io.BytesIO(data)).convert(mode))  # ImageFolder's loader, as it is
        assert np.array_equal(decode_image(data, mode), expected)
        assert np.array_equal(np.array(decode_pil_image(data, mode)), expected)
    else:
        with pytest.raises(ImageModeError, match='image_mode="unchanged"'):
            decode_image(data, mode)
        with pytest.raises(ImageModeError, match='image_mode="unchanged"'):
            decode_pil_image(data, mode)


@pytest.mark.parametrize(("name", "data", "ref"), CASES, ids=IDS)
def test_unchanged_pil_image_holds_the_pixels_or_names_numpy(name, data, ref):
    channels = 1 if ref.ndim == 2 else ref.shape[2]
    if (ref.dtype == np.uint8 and channels <= 4) or (channels == 1 and ref.dtype in (np.uint16, np.int16, np.float32)):
        im = decode_pil_image(data, "unchanged")
        expected_mode = {np.uint16: "I;16", np.int16: "I", np.float32: "F"}.get(ref.dtype.type)
        assert im.mode == (expected_mode or {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}[channels])
        got = np.array(im)
        assert np.array_equal(got, ref) and got.shape == ref.shape
    else:
        with pytest.raises(ImageModeError, match='output="numpy"'):
            decode_pil_image(data, "unchanged")


def test_palette_png_gives_indices_and_keeps_its_palette():
    indices = (np.arange(HEIGHT * WIDTH) % 7).astype(np.uint8).reshape(HEIGHT, WIDTH)
    im = Image.fromarray(indices, mode="P")
    im.putpalette([v for i in range(7) for v in (i * 30, 255 - i * 30, i)])
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    data = buf.getvalue()
    assert np.array_equal(decode_image(data, "unchanged"), indices)
    pil = decode_pil_image(data, "unchanged")
    assert pil.mode == "P" and pil.getpalette()[:6] == [0, 255, 0, 30, 225, 1]
    assert inspect_image(data) == imageio.ImageInfo("PNG", WIDTH, HEIGHT, "uint8", 1)


@pytest.mark.parametrize("channels", [1, 3])
def test_a_png_transparency_key_is_not_a_channel(channels):
    array = pixels("uint8", channels, seed=3)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", transparency=5 if channels == 1 else (1, 2, 3))
    out = decode_image(buf.getvalue(), "unchanged")
    assert out.shape == array.shape and np.array_equal(out, array)  # as Pillow's L / RGB


def test_big_endian_and_one_bit_tiffs():
    array = pixels("uint16", 1, seed=4)
    data = tiff(array, None, byteorder=">")
    out = decode_image(data, "unchanged")
    assert out.dtype == np.dtype("uint16") and out.dtype.isnative and np.array_equal(out, array)
    bits = pixels("uint8", 1, seed=5) > 127
    out = decode_image(tiff(bits, None), "unchanged")
    assert out.dtype == np.uint8 and np.array_equal(out, bits.astype(np.uint8) * 255)  # as Pillow's mode "1"


def test_gray_jpeg_is_hxw():
    buf = io.BytesIO()
    Image.fromarray(pixels("uint8", 1)).save(buf, format="JPEG")
    out = decode_image(buf.getvalue(), "unchanged")
    assert out.shape == (HEIGHT, WIDTH) and out.dtype == np.uint8
    assert np.array_equal(out, np.array(Image.open(io.BytesIO(buf.getvalue()))))


# -- refusals


def _bomb_png(width: int, height: int, color_type: int = 2, depth: int = 16) -> bytes:
    data = bytearray(png_cv2(pixels("uint16", 3))[0])
    ihdr = struct.pack(">IIBB", width, height, depth, color_type)
    data[16:26] = ihdr
    import zlib

    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _patched_tiff(width: int, height: int, samples: int = 5) -> bytes:
    data = bytearray(tiff(pixels("uint16", samples), None))
    with tifffile.TiffFile(io.BytesIO(bytes(data))) as tif:
        tags = tif.pages.first.tags
        for name, value in (("ImageWidth", width), ("ImageLength", height), ("RowsPerStrip", height)):
            tag = tags[name]
            fmt = "<H" if tag.dtype == 3 else "<I"
            data[tag.valueoffset:tag.valueoffset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(data)


def _refused_small(data: bytes, match: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ImageDecodeError, match=match):
            decode_image(data, "unchanged")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # refused from the header: nothing near the declared size was allocated


@pytest.mark.parametrize("kind", ["png", "tiff", "dicom"])
def test_bombs_are_refused_from_the_header_before_allocation(kind):
    side = 40_000  # 1.6e9 pixels: over Pillow's limit
    if kind == "png":
        data = _bomb_png(side, side)
    elif kind == "tiff":
        data = _patched_tiff(side, side)
    else:
        data = dicom(pixels("uint16", 1), Rows=side, Columns=side)
    _refused_small(data, "decompression bomb")
    with pytest.raises(ImageDecodeError, match="decompression bomb"):
        inspect_image(data)


@pytest.mark.parametrize("kind", ["png", "tiff", "dicom"])
def test_decoded_bytes_count_not_only_pixels(kind, monkeypatch):
    # pixels within the limit, decoded bytes not: 9,000 x 9,000 16-bit RGB is 486 MB (> 4 x 81M pixels = 324 MB)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 81_000_000)
    assert decoded_bytes_limit() == 4 * pixel_limit() == 324_000_000
    if kind == "png":
        data = _bomb_png(9_000, 9_000)
    elif kind == "tiff":
        data = _patched_tiff(9_000, 9_000, samples=3)
    else:
        data = dicom(pixels("uint16", 1), Rows=9_000, Columns=9_000, SamplesPerPixel=3)
    _refused_small(data, "would decode to .* bytes, over the limit")


def test_pillow_images_are_held_to_the_same_limits(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", HEIGHT * WIDTH // 2)
    buf = io.BytesIO()
    Image.fromarray(pixels("uint8", 3)).save(buf, format="BMP")
    with pytest.raises(ImageDecodeError, match="decompression bomb"):
        decode_image(buf.getvalue(), "unchanged")
    for _, data, _ in CASES[::7]:
        with pytest.raises(ImageDecodeError, match="decompression bomb"):
            decode_image(data, "unchanged")


@pytest.mark.parametrize(("name", "data", "ref"), [c for c in CASES if c[0].endswith(("rgb", "lzw", "rle"))],
                         ids=[c[0] for c in CASES if c[0].endswith(("rgb", "lzw", "rle"))])
def test_truncated_files_are_decode_errors(name, data, ref):
    for cut in (len(data) // 2, 40):
        with pytest.raises(ImageDecodeError):
            decode_image(data[:cut], "unchanged")
        with pytest.raises(ImageDecodeError):
            inspect_image(data[:cut])


@pytest.mark.parametrize("data", [b"", b"\0" * 300, b"\x89PNG\r\n\x1a\n" + b"\xff" * 40, b"II*\x00" + b"\xff" * 40,
                                  b"\0" * 128 + b"DICM" + b"\xff" * 40], ids=["empty", "zeros", "png", "tiff", "dicom"])
def test_garbage_is_a_decode_error(data):
    with pytest.raises(ImageDecodeError):
        decode_image(data, "unchanged")
    assert not has_pillow_form(data)


def test_multi_page_tiff_is_refused_with_the_reason():
    buf = io.BytesIO()
    tifffile.imwrite(buf, np.stack([pixels("uint16", 1, seed=i) for i in range(3)]), photometric="minisblack",
                     metadata=None)
    with pytest.raises(ImageDecodeError, match=r"multi-page TIFF \(3 images\)"):
        decode_image(buf.getvalue(), "unchanged")


def test_a_tiff_with_a_reduced_resolution_page_is_one_image():
    array = pixels("uint8", 1)
    buf = io.BytesIO()
    with tifffile.TiffWriter(buf) as tw:
        tw.write(array, metadata=None)
        tw.write(array[::2, ::2], subfiletype=1, metadata=None)  # a thumbnail
    assert np.array_equal(decode_image(buf.getvalue(), "unchanged"), array)


def test_unsupported_tiff_compression_names_it():
    data = bytearray(tiff(pixels("uint16", 1), "zstd"))
    with tifffile.TiffFile(io.BytesIO(bytes(data))) as tif:
        offset = tif.pages.first.tags["Compression"].valueoffset
    data[offset:offset + 2] = struct.pack("<H", 99)
    with pytest.raises(ImageDecodeError, match="compression .*not supported"):
        decode_image(bytes(data), "unchanged")


def test_dicom_without_pixel_data_and_multi_frame_are_refused():
    with pytest.raises(ImageDecodeError, match="no pixel data"):
        decode_image(dicom(None), "unchanged")
    with pytest.raises(ImageDecodeError, match=r"multi-frame DICOM \(3 frames\)"):
        inspect_image(dicom(pixels("uint16", 1), frames=3))


def test_dicom_tags_are_json_safe():
    data = dicom(pixels("uint16", 1))
    tags = dicom_tags(data, ["RescaleSlope", "RescaleIntercept", "PhotometricInterpretation", "PixelSpacing",
                             "Modality", "PatientName", "Rows", "WindowCenter"])
    assert tags == {"RescaleSlope": 1.5, "RescaleIntercept": -1024.0, "PhotometricInterpretation": "MONOCHROME2",
                    "PixelSpacing": [0.5, 0.625], "Modality": "CT", "PatientName": "Test^Synthetic",
                    "Rows": HEIGHT, "WindowCenter": None}
    assert type(tags["RescaleSlope"]) is float and all(type(v) is float for v in tags["PixelSpacing"])
    import json

    json.dumps(tags)
    with pytest.raises(ValueError, match="NotAKeyword"):
        dicom_tags(data, ["NotAKeyword"])
    with pytest.raises(ImageDecodeError, match="not a DICOM"):
        dicom_tags(png_cv2(pixels("uint8", 1))[0], ["Rows"])


# -- optional libraries missing (sys.modules[name] = None makes the import fail)


@pytest.mark.parametrize(("module", "case", "extra"), [
    ("pydicom", "dicom-uint16-raw", "dicom"),
    ("tifffile", "tiff-uint16-1band-lzw", "images"),
    ("imagecodecs", "png-uint16-rgb", "images"),
    ("imagecodecs", "png-uint16-gray-alpha", "images"),
])
def test_a_missing_library_names_the_extra(monkeypatch, module, case, extra):
    data = dict((n, d) for n, d, _ in CASES)[case]
    monkeypatch.setitem(sys.modules, module, None)
    for call in (lambda: decode_image(data, "unchanged"), lambda: inspect_image(data)):
        with pytest.raises(MissingExtraError, match=rf"pip install 'fastdata\[{extra}\]'") as err:
            call()
        assert not isinstance(err.value, ImageDecodeError) and isinstance(err.value, ImportError)


@pytest.mark.parametrize("case", ["png-uint8-gray", "png-uint8-rgb", "png-uint8-rgba", "png-uint8-gray-alpha",
                                  "png-uint16-gray"])
def test_without_imagecodecs_pillow_gives_the_same_pngs(monkeypatch, case):
    name, data, ref = next(c for c in CASES if c[0] == case)
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    out = decode_image(data, "unchanged")
    assert out.dtype == ref.dtype and np.array_equal(out, ref)


def test_without_tifffile_pillow_modes_of_tiff_still_work(monkeypatch):
    data = dict((n, d) for n, d, _ in CASES)["tiff-uint8-3band-deflate"]
    expected = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    monkeypatch.setitem(sys.modules, "tifffile", None)
    assert np.array_equal(decode_image(data, "RGB"), expected)


# -- encode_lossless


@pytest.mark.parametrize("dtype", ARRAY_IMAGE_DTYPES)
@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5])
def test_encode_lossless_round_trips_bit_for_bit(dtype, channels):
    array = pixels(dtype, channels, seed=channels)
    data, fmt = encode_lossless(array)
    assert fmt == ("PNG" if dtype == "uint8" and channels <= 4 else "TIFF")
    out = decode_image(data, "unchanged")
    assert out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out.view(np.uint8), array.view(np.uint8))  # bits, NaN payloads and -0.0 included
    info = inspect_image(data)
    assert (info.format, info.dtype, info.channels) == (fmt, dtype, channels)


def test_encode_lossless_hxwx1_comes_back_hxw():
    array = pixels("float32", 1)
    assert np.array_equal(decode_image(encode_lossless(array[..., None])[0], "unchanged"), array)


def test_image_dtypes_are_the_index_codes():
    assert set(IMAGE_DTYPES) == set(IMAGE_DTYPE_CODES) and set(ARRAY_IMAGE_DTYPES) <= set(IMAGE_DTYPES)


@pytest.mark.parametrize("case", [c for c in CASES if c[0].split("-")[0] in ("png", "tiff")], ids=lambda c: c[0])
def test_decode_unchanged_into_writes_the_reference_pixels_in_place(case):
    """Batch slots are decoded into where the decoder can; what lands there is the reference, and
    a slot of another shape or dtype is left alone (False: the caller decodes another way)."""
    from fastdata.common.imageio import decode_unchanged_into

    _, data, reference = case
    out = np.zeros(reference.shape if reference.ndim == 3 else (*reference.shape, 1), reference.dtype)
    assert decode_unchanged_into(data, out) is True  # every generated PNG and TIFF decodes in place
    np.testing.assert_array_equal(out.reshape(reference.shape), reference)
    wrong = np.zeros((out.shape[0] + 1, *out.shape[1:]), out.dtype)
    assert decode_unchanged_into(data, wrong) is False and not wrong.any()


def test_a_tiff_strip_that_decodes_short_is_a_decode_error():
    """A strip whose LZW data ends early: tifffile (from 2026.11) pads it and only logs an error, which
    would read a damaged image as a good one; fastdata raises instead (on every tifffile)."""
    image = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
    buf = io.BytesIO()
    tifffile.imwrite(buf, image, compression="lzw", rowsperstrip=16)
    data = bytearray(buf.getvalue())
    page = tifffile.TiffFile(io.BytesIO(bytes(data))).pages[0]
    offset, count = int(page.dataoffsets[1]), int(page.databytecounts[1])
    data[offset:offset + count] = bytes([0x80, 0x00, 0x20, 0x10]) + bytes(count - 4)  # clear code, then an end
    with pytest.raises(ImageDecodeError, match="corrupt TIFF image data"):
        imageio.decode_image(bytes(data), "unchanged")
