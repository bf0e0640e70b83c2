"""Decoding is pixel-identical to ImageFolder's loader, ``Image.open(f).convert("RGB")``.

Checked twice: on the decode functions directly (``decode_numpy``/``decode_pil``)
and end to end through converted LMDB and HDF5 stores in all three output modes
(``pil``, ``numpy`` HWC, ``tensor`` CHW). The sources cover what a decoder can get
wrong: chroma subsampling 4:2:0/4:2:2/4:4:4 at sizes that are not a multiple of the
MCU, progressive scans, grayscale, CMYK (Adobe-inverted), an EXIF orientation tag
(ImageFolder does not rotate, so neither may we), and PNG in RGB, RGBA, L, LA and
palette modes.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from helpers.backends import NAMES
from helpers.images import photo_array
from PIL import Image

import fastdata
from fastdata.reader.decode import decode_numpy, decode_pil

SIZE = (37, 23)  # (w, h): neither is a multiple of 8 or 16, so partial MCUs at both edges


def _image(seed: int) -> Image.Image:
    return Image.fromarray(photo_array(SIZE, seed))


def _jpeg(mode: str = "RGB", **kwargs):
    def write(path: Path, seed: int) -> None:
        im = _image(seed)
        if mode != "RGB":
            im = im.convert(mode)
        im.save(path, format="JPEG", quality=90, **kwargs)
    return write


def _jpeg_exif_rotated(path: Path, seed: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    _image(seed).save(path, format="JPEG", quality=90, exif=exif.tobytes())


def _png(mode: str):
    def write(path: Path, seed: int) -> None:
        im = _image(seed)
        if mode == "P":
            im = im.quantize(colors=37)
        elif mode in ("RGBA", "LA"):
            alpha = Image.fromarray(photo_array(SIZE, seed + 1)[..., 0])
            im = im.convert(mode[:-1])
            im.putalpha(alpha)
        elif mode != "RGB":
            im = im.convert(mode)
        assert im.mode == mode
        im.save(path, format="PNG")
    return write


#: name -> (file extension, writer)
CASES = {
    "jpeg_420": (".jpg", _jpeg(subsampling=2)),
    "jpeg_422": (".jpg", _jpeg(subsampling=1)),
    "jpeg_444": (".jpg", _jpeg(subsampling=0)),
    "jpeg_progressive_420": (".jpg", _jpeg(subsampling=2, progressive=True)),
    "jpeg_progressive_444": (".jpg", _jpeg(subsampling=0, progressive=True)),
    "jpeg_gray": (".jpg", _jpeg("L")),
    "jpeg_cmyk": (".jpg", _jpeg("CMYK")),
    "jpeg_exif_rotated": (".jpg", _jpeg_exif_rotated),
    "png_rgb": (".png", _png("RGB")),
    "png_rgba": (".png", _png("RGBA")),
    "png_gray": (".png", _png("L")),
    "png_gray_alpha": (".png", _png("LA")),
    "png_palette": (".png", _png("P")),
}


def _reference(path) -> np.ndarray:
    """ImageFolder's loader, as an HWC uint8 array."""
    with open(path, "rb") as f:
        return np.asarray(Image.open(f).convert("RGB"))


@pytest.fixture(scope="module")
def odd_tree(tmp_path_factory) -> str:
    """One class folder per case, two images each (different content)."""
    root = tmp_path_factory.mktemp("odd") / "src"
    for name, (ext, write) in CASES.items():
        (root / name).mkdir(parents=True)
        for k in range(2):
            write(root / name / f"{name}_{k}{ext}", seed=100 * len(name) + k)
    return str(root)


@pytest.fixture(scope="module")
def odd_stores(odd_tree, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("odd_stores")
    stores = {}
    for backend, suffix in (("lmdb", ".lmdb"), ("hdf5", ".h5")):
        dst = str(base / f"store{suffix}")
        report = fastdata.convert(odd_tree, dst, workers=1, progress=False)
        assert report.rejected == 0, report.rejected_items
        stores[backend] = dst
    return stores


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_functions_match_pillow(odd_tree, case):
    ext = CASES[case][0]
    fmt = "JPEG" if ext == ".jpg" else "PNG"
    for k in range(2):
        path = os.path.join(odd_tree, case, f"{case}_{k}{ext}")
        data = Path(path).read_bytes()
        ref = _reference(path)
        assert ref.shape == (SIZE[1], SIZE[0], 3)

        arr = decode_numpy(data, fmt)
        assert isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.shape == ref.shape
        assert arr.flags.writeable  # torch.from_numpy on a read-only array warns and is unsafe
        np.testing.assert_array_equal(arr, ref)

        im = decode_pil(data, fmt)
        assert im.mode == "RGB" and im.size == SIZE
        np.testing.assert_array_equal(np.asarray(im), ref)


@pytest.mark.parametrize("case", ["jpeg_420", "jpeg_422", "jpeg_444", "jpeg_progressive_420",
                                  "jpeg_progressive_444", "jpeg_gray", "jpeg_exif_rotated"])
def test_fast_jpeg_path_is_pixel_identical(odd_tree, case):
    """The premise of the libjpeg-turbo fast path: for these colourspaces simplejpeg's
    default output equals Pillow's. If a library update broke it, this fails (instead
    of decode silently diverging from ImageFolder)."""
    path = os.path.join(odd_tree, case, f"{case}_0.jpg")
    data = Path(path).read_bytes()
    assert simplejpeg.decode_jpeg_header(data)[2] in ("YCbCr", "Gray", "RGB")
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(data, colorspace="RGB"), _reference(path))


def test_cmyk_needs_the_pillow_fallback(odd_tree):
    """Control for the CMYK case: the fast decoder alone cannot give Pillow's pixels,
    so decode_numpy matching them (test above) shows the fallback is taken."""
    path = os.path.join(odd_tree, "jpeg_cmyk", "jpeg_cmyk_0.jpg")
    data = Path(path).read_bytes()
    assert simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK")
    try:
        fast = simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ValueError:
        return  # cannot even convert: the fallback is the only way
    assert fast.shape != _reference(path).shape or not np.array_equal(fast, _reference(path))


def test_damaged_jpeg_raises_instead_of_returning_garbage():
    buf = io.BytesIO()
    _image(3).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    truncated = data[: len(data) // 2]
    with pytest.raises((OSError, ValueError)):
        decode_numpy(truncated, "JPEG")
    with pytest.raises((OSError, ValueError)):
        decode_pil(truncated, "JPEG")


@pytest.mark.parametrize("output", ["pil", "numpy", "tensor"])
@pytest.mark.parametrize("backend", NAMES)
def test_store_outputs_match_pillow(odd_tree, odd_stores, backend, output):
    ds = fastdata.open_dataset(odd_stores[backend], output=output)
    assert len(ds) == 2 * len(CASES)
    seen = set()
    for i in range(len(ds)):
        image, label = ds[i]
        rel = ds.relpath(i)
        seen.add(rel)
        case = rel.split("/")[0]
        assert ds.classes[label] == case
        ref = _reference(os.path.join(odd_tree, rel))
        if output == "pil":
            assert isinstance(image, Image.Image) and image.mode == "RGB"
            got = np.asarray(image)
        elif output == "numpy":
            assert isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
            got = image
        else:
            assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
            assert tuple(image.shape) == (3, ref.shape[0], ref.shape[1])  # CHW
            got = image.permute(1, 2, 0).numpy()
        assert got.shape == ref.shape, rel
        np.testing.assert_array_equal(got, ref, err_msg=rel)
    assert len(seen) == len(ds)
    ds.close()
