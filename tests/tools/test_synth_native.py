"""Tests for fastdata.tools.synth_native: the files decode to the advertised dtype and shape,
look like what they claim (CT value ranges, noise), and are a pure function of the seed."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

tifffile = pytest.importorskip("tifffile")
pytest.importorskip("imagecodecs")

from fastdata.tools.synth_native import (  # noqa: E402 - after the skips
    CT_MAX,
    make_ct_folder,
    make_multiband_folder,
    synth_ct_png,
    synth_multiband_tiff,
)


def _tree(root: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern))}


def test_ct_folder_layout_dtype_and_values(tmp_path):
    s = make_ct_folder(tmp_path, num_classes=2, per_class=3, size=(128, 160), seed=3)
    files = sorted(tmp_path.glob("class_*/img_*.png"))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        f"class_{c:03d}/img_{i:05d}.png" for c in range(2) for i in range(3)]
    assert (s.num_images, s.total_bytes) == (6, sum(p.stat().st_size for p in files))
    for p in files:
        arr = cv2.imread(str(p), cv2.IMREAD_UNCHANGED)
        assert arr.dtype == np.uint16 and arr.shape == (128, 160)
        assert 0 <= arr.min() and arr.max() <= CT_MAX
        # air outside the body (~24), soft tissue (~1024-1100) and bone (>= 1400) all present
        assert np.median(arr[:4, :4]) < 100
        assert np.median(arr[64 - 4:64 + 4, 80 - 4:80 + 4]) > 150  # inside the body (chest lungs ~170)
        assert arr.max() > 1400
        assert arr[:8].std() > 3  # noise: not a flat phantom that compresses to nothing
        with Image.open(p) as im:  # Pillow (the path fastdata decodes through) sees 16-bit grayscale
            assert im.mode == "I;16" and im.size == (160, 128)


def test_ct_png_deterministic_and_seed_dependent():
    a = synth_ct_png(0, 1, 2, (64, 64))
    assert a == synth_ct_png(0, 1, 2, (64, 64))
    assert a != synth_ct_png(1, 1, 2, (64, 64))
    assert a != synth_ct_png(0, 1, 3, (64, 64))


def test_ct_folder_bytes_do_not_depend_on_workers(tmp_path):
    make_ct_folder(tmp_path / "a", num_classes=2, per_class=3, size=(64, 64), workers=1)
    make_ct_folder(tmp_path / "b", num_classes=2, per_class=3, size=(64, 64), workers=2)
    assert _tree(tmp_path / "a", "*/*.png") == _tree(tmp_path / "b", "*/*.png")


def test_multiband_folder_layout_dtype_and_shape(tmp_path):
    s = make_multiband_folder(tmp_path, num_classes=2, per_class=2, size=(48, 40), bands=4, seed=1)
    files = sorted(tmp_path.glob("class_*/img_*.tif"))
    assert len(files) == s.num_images == 4
    for p in files:
        arr = tifffile.imread(p)
        assert arr.dtype == np.uint16 and arr.shape == (48, 40, 4)
        assert arr.max() <= 10000 and arr.std() > 10


def test_multiband_deterministic_and_band_count():
    a = synth_multiband_tiff(0, 0, 0, (32, 32), bands=5)
    assert a == synth_multiband_tiff(0, 0, 0, (32, 32), bands=5)
    assert tifffile.imread(io.BytesIO(a)).shape == (32, 32, 5)
    assert tifffile.imread(io.BytesIO(synth_multiband_tiff(0, 0, 0, (32, 32), bands=1))).shape == (32, 32)


@pytest.mark.parametrize("bad", [dict(num_classes=0), dict(per_class=0), dict(size=(8, 8)), dict(workers=0)])
def test_bad_arguments(tmp_path, bad):
    with pytest.raises(ValueError):
        make_ct_folder(tmp_path, **{"num_classes": 1, "per_class": 1, "size": (32, 32), **bad})
