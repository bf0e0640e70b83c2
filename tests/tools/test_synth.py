"""Tests for fastdata.synth: layout, realism, determinism and the hostile-input catalogue."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError

from fastdata.synth import make_bad_inputs, make_image_folder, make_odd_images, synth_jpeg


def _files(root: Path) -> list:
    return sorted(root.glob("class_*/img_*.jpg"))


def _gray(path_or_bytes) -> np.ndarray:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_GRAYSCALE).astype(np.float32)


def _texture(gray: np.ndarray) -> tuple:
    """(fine detail, large-scale variation): both near zero for a flat image."""
    fine = float(np.abs(cv2.Laplacian(gray, cv2.CV_32F)).mean())
    coarse = float(cv2.GaussianBlur(gray, (0, 0), 8).std())
    return fine, coarse


def test_cifar_layout_summary_and_decodability(tmp_path):
    s = make_image_folder(tmp_path, num_classes=3, per_class=4, size="cifar", seed=1)
    files = _files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["class_000", "class_001", "class_002"]
    assert [p.name for p in sorted((tmp_path / "class_001").iterdir())] == [
        f"img_{i:05d}.jpg" for i in range(4)
    ]
    assert (s.num_classes, s.per_class, s.num_images) == (3, 4, 12)
    assert len(files) == 12
    assert s.total_bytes == sum(p.stat().st_size for p in files)
    assert s.elapsed_s > 0
    for p in files:
        with Image.open(p) as im:
            assert im.format == "JPEG"
            assert im.size == (32, 32)
            im.load()


def test_explicit_size_and_quality(tmp_path):
    make_image_folder(tmp_path / "q95", num_classes=1, per_class=2, size=(48, 64), quality=95)
    make_image_folder(tmp_path / "q30", num_classes=1, per_class=2, size=(48, 64), quality=30)
    for p in _files(tmp_path / "q95"):
        with Image.open(p) as im:
            assert im.size == (64, 48)  # PIL reports (w, h)
    hi = sum(p.stat().st_size for p in _files(tmp_path / "q95"))
    lo = sum(p.stat().st_size for p in _files(tmp_path / "q30"))
    assert hi > 1.5 * lo  # quality is honoured, not ignored


def test_imagenet_like_geometry_sizes_and_texture(tmp_path):
    make_image_folder(tmp_path, num_classes=3, per_class=8, size="imagenet", seed=0)
    files = _files(tmp_path)
    sizes_kb = np.array([p.stat().st_size for p in files]) / 1024
    assert 40 <= float(np.median(sizes_kb)) <= 120, sizes_kb
    assert np.mean((sizes_kb >= 30) & (sizes_kb <= 150)) >= 0.9, sizes_kb
    widths, heights = [], []
    for p in files:
        with Image.open(p) as im:
            w, h = im.size
        widths.append(w)
        heights.append(h)
        assert 300 <= w <= 500
        assert 0.74 <= w / h <= 1.34
        fine, coarse = _texture(_gray(p))
        assert fine > 5 and coarse > 5, (p, fine, coarse)
    assert len(set(zip(widths, heights, strict=False))) > len(files) // 2  # sizes vary

    # Control: the texture check does fail on the flat colours it is meant to exclude.
    flat = np.full((350, 400, 3), (90, 140, 200), np.uint8)
    ok, buf = cv2.imencode(".jpg", flat, [cv2.IMWRITE_JPEG_QUALITY, 90])
    fine, coarse = _texture(_gray(buf.tobytes()))
    assert fine < 1 and coarse < 1


def _class_mean_colours(root: Path):
    feats, labels = [], []
    for p in _files(root):
        img = cv2.imread(str(p), cv2.IMREAD_COLOR)
        feats.append(img.reshape(-1, 3).mean(0))
        labels.append(int(p.parent.name.split("_")[1]))
    return np.array(feats), np.array(labels)


def _loo_nearest_centroid_accuracy(x: np.ndarray, y: np.ndarray) -> float:
    classes = np.unique(y)
    hits = 0
    for i in range(len(x)):
        keep = np.arange(len(x)) != i
        cents = np.array([x[keep & (y == c)].mean(0) for c in classes])
        hits += classes[np.argmin(((cents - x[i]) ** 2).sum(1))] == y[i]
    return hits / len(x)


def test_classes_differ_by_colour(tmp_path):
    make_image_folder(tmp_path, num_classes=4, per_class=6, size="cifar", seed=0)
    x, y = _class_mean_colours(tmp_path)
    acc = _loo_nearest_centroid_accuracy(x, y)
    assert acc >= 0.6, acc  # chance is 0.25
    # Control: shuffled labels carry no class signal, so the same classifier is near chance.
    rng = np.random.default_rng(0)
    shuffled = np.mean([_loo_nearest_centroid_accuracy(x, rng.permutation(y)) for _ in range(5)])
    assert shuffled < acc - 0.25


def test_deterministic_per_seed_and_independent_of_workers(tmp_path):
    kw = dict(num_classes=2, per_class=5, size=(40, 56))
    make_image_folder(tmp_path / "a", seed=3, **kw)
    make_image_folder(tmp_path / "b", seed=3, workers=2, **kw)
    make_image_folder(tmp_path / "c", seed=4, **kw)
    a = [p.read_bytes() for p in _files(tmp_path / "a")]
    b = [p.read_bytes() for p in _files(tmp_path / "b")]
    c = [p.read_bytes() for p in _files(tmp_path / "c")]
    assert a == b
    assert all(x != z for x, z in zip(a, c, strict=False))
    assert len(set(a)) == len(a)  # no duplicate images within a dataset
    assert synth_jpeg(3, 1, 2, size=(40, 56)) == a[5 + 2]


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_classes=0), dict(per_class=0), dict(size="huge"), dict(size=(0, 5)),
     dict(quality=0), dict(workers=0)],
)
def test_bad_arguments_raise(tmp_path, kwargs):
    with pytest.raises(ValueError):
        make_image_folder(tmp_path, **kwargs)


def test_bad_inputs_catalogue(tmp_path):
    cat = make_bad_inputs(tmp_path)
    expected = {
        "zero_bytes.jpg", "truncated.jpg", "garbage.jpg", "png_named.jpg", "bomb.png.jpg",
        "broken_symlink.jpg", "loop_a.jpg", "loop_b.jpg",
    }
    assert set(cat) == expected
    assert all(isinstance(v, str) and v for v in cat.values())
    for name in expected:
        assert os.path.lexists(tmp_path / name)

    assert (tmp_path / "zero_bytes.jpg").stat().st_size == 0
    for name in ("zero_bytes.jpg", "garbage.jpg"):
        with pytest.raises(UnidentifiedImageError):
            Image.open(tmp_path / name)

    truncated = (tmp_path / "truncated.jpg").read_bytes()
    assert truncated[:2] == b"\xff\xd8"  # looks like a JPEG ...
    with Image.open(io.BytesIO(truncated)) as im, pytest.raises(OSError):
        im.load()  # ... but does not decode

    with Image.open(tmp_path / "png_named.jpg") as im:
        assert im.format == "PNG"
        im.load()

    bomb = tmp_path / "bomb.png.jpg"
    assert bomb.stat().st_size < 200_000
    with pytest.raises(Image.DecompressionBombError):
        Image.open(bomb)
    # Control: it is a well-formed PNG whose header really declares that many pixels.
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = None
        with Image.open(bomb) as im:
            w, h = im.size
            assert im.format == "PNG"
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    assert w * h > 2 * limit

    assert os.path.islink(tmp_path / "broken_symlink.jpg")
    assert not os.path.exists(tmp_path / "broken_symlink.jpg")
    for name in ("loop_a.jpg", "loop_b.jpg"):
        with pytest.raises(OSError) as ei:
            os.stat(tmp_path / name)
        assert ei.value.errno == errno.ELOOP

    # Idempotent: a second call over the same directory works (symlinks replaced).
    assert make_bad_inputs(tmp_path) == cat


def test_odd_images_are_valid_and_awkward(tmp_path):
    cat = make_odd_images(tmp_path)
    modes = {}
    for name in cat:
        with Image.open(os.path.join(os.fsencode(tmp_path), os.fsencode(name))) as im:
            im.load()
            modes[name] = im.mode
            if name == "exif_rotated.jpg":
                assert im.getexif().get(0x0112) == 6
                assert im.size == (80, 60)
    assert modes["cmyk.jpg"] == "CMYK"
    assert modes["gray.jpg"] == "L"
    assert modes["palette.png"] == "P"
    assert modes["rgba.png"] == "RGBA"
    odd = [n for n in cat if n.startswith("non_utf8")]
    assert len(odd) == 1
    with pytest.raises(UnicodeEncodeError):
        odd[0].encode("utf-8")
