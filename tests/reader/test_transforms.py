"""Decode-time transforms: shapes, torchvision sampling statistics, DCT fast path, decoding fidelity."""

from __future__ import annotations

import io
import math
import pickle
import random

import cv2
import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, get_worker_info

from fastdata import transforms as T
from fastdata.common.imageio import ImageDecodeError
from fastdata.reader.seeding import seed_rng

# ------------------------------------------------------------------ generated images


def _photo(height: int, width: int, *, seed: int, cell: int = 16, mode: str = "RGB") -> Image.Image:
    """Smooth random content: coarse noise upscaled bicubically (JPEG-friendly, no flat areas)."""
    rng = np.random.default_rng(seed)
    coarse = (rng.random((height // cell + 2, width // cell + 2, 3)) * 255).astype(np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC).convert(mode)


def _encode(img: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    return {
        "jpeg420": _encode(_photo(301, 457, seed=1), quality=90),
        "jpeg444": _encode(_photo(260, 190, seed=2), quality=90, subsampling=0),
        "jpeg420_progressive": _encode(_photo(333, 250, seed=3), progressive=True),
        "jpeg444_progressive": _encode(_photo(170, 201, seed=13), subsampling=0, progressive=True),
        "jpeg422": _encode(_photo(123, 345, seed=14), subsampling=1),
        "jpeg_gray": _encode(_photo(200, 300, seed=4, mode="L")),
        "jpeg_cmyk": _encode(_photo(180, 240, seed=5, mode="CMYK")),
        "jpeg_rgb_colorspace": _encode(_photo(150, 170, seed=6), keep_rgb=True),
        "png": _encode(_photo(210, 230, seed=7), "PNG"),
        "png_palette": _encode(_photo(120, 140, seed=8).convert("P"), "PNG"),
    }


@pytest.fixture(scope="module")
def large_jpeg() -> bytes:
    # 1600x1200 with 24 px features: fine enough that a misplaced crop shows.
    return _encode(_photo(1200, 1600, seed=9, cell=24), quality=92)


def _pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def _expected_shape(transform, data: bytes) -> tuple[int, int, int]:
    if transform.output_size is not None:
        return (*transform.output_size, 3)
    h, w = _pil_rgb(data).shape[:2]
    s = transform.size  # torchvision Resize(int): shorter side to s, longer truncated
    return (s, int(s * w / h), 3) if h <= w else (int(s * h / w), s, 3)


TRANSFORMS = [
    T.RandomResizedCrop(224),
    T.RandomResizedCrop((160, 200), scale=(0.5, 1.0)),
    T.CenterCrop(224, resize=256),
    T.CenterCrop((90, 120)),
    T.Resize(100),
    T.Resize((90, 120)),
]
KINDS = ["jpeg420", "jpeg444", "jpeg420_progressive", "jpeg444_progressive", "jpeg422", "jpeg_gray", "jpeg_cmyk",
         "jpeg_rgb_colorspace", "png", "png_palette"]


# ----------------------------------------------------------------------- interface


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_output_shape_dtype_and_entry_points_agree(transform, kind, images):
    data = images[kind]
    out = transform(data, np.random.default_rng(5))
    assert out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable
    assert out.shape == _expected_shape(transform, data)
    assert out.std() > 5, "output is flat: content was lost"
    # memoryview input and decode_into into a batch slot give the same pixels.
    np.testing.assert_array_equal(transform(memoryview(data), np.random.default_rng(5)), out)
    batch = np.full((3, *out.shape), 7, np.uint8)
    transform.decode_into(memoryview(data), batch[1], np.random.default_rng(5))
    np.testing.assert_array_equal(batch[1], out)
    assert (batch[0] == 7).all() and (batch[2] == 7).all()


def test_transforms_survive_pickling_for_spawn_workers(images):
    for transform in TRANSFORMS:
        clone = pickle.loads(pickle.dumps(transform))
        np.testing.assert_array_equal(clone(images["jpeg420"], np.random.default_rng(3)),
                                      transform(images["jpeg420"], np.random.default_rng(3)))


def test_decode_into_rejects_a_wrong_slot(images):
    with pytest.raises(ValueError):
        T.RandomResizedCrop(64).decode_into(images["jpeg420"], np.zeros((64, 65, 3), np.uint8))
    with pytest.raises(ValueError):
        T.CenterCrop(64).decode_into(images["png"], np.zeros((64, 64, 3), np.float32))
    with pytest.raises(ValueError):
        T.Resize(50).decode_into(images["jpeg420"], np.zeros((50, 50, 3), np.uint8))


def test_default_decode_into_copies_call_result(images):
    class Flip(T.DecodeTransform):
        output_size = None

        def __call__(self, data, rng=None):
            return np.ascontiguousarray(T.full_decode(data)[:, ::-1])

    data = images["jpeg444"]
    out = np.empty((260, 190, 3), np.uint8)
    Flip().decode_into(data, out)
    np.testing.assert_array_equal(out, _pil_rgb(data)[:, ::-1])


@pytest.mark.parametrize(
    "bad", [lambda: T.RandomResizedCrop(0), lambda: T.RandomResizedCrop(8, scale=(0.9, 0.1)),
            lambda: T.RandomResizedCrop(8, ratio=(0, 1)), lambda: T.CenterCrop(8, resize=-1),
            lambda: T.Resize((1, 2, 3)), lambda: T.Resize(True)],
)
def test_bad_arguments_are_rejected(bad):
    with pytest.raises(ValueError):
        bad()


# -------------------------------------------------------------------- full decode


@pytest.mark.parametrize("kind", KINDS)
def test_full_decode_is_pixel_identical_to_pillow(kind, images):
    data = images[kind]
    out = T.full_decode(data)
    np.testing.assert_array_equal(out, _pil_rgb(data))
    assert out.flags.writeable


@pytest.mark.parametrize("kind", ["jpeg420", "jpeg444", "jpeg420_progressive", "jpeg444_progressive", "jpeg422",
                                  "jpeg_gray", "jpeg_rgb_colorspace"])
def test_plain_jpegs_take_the_simplejpeg_path(kind, images, monkeypatch):
    def no_pillow(data):
        raise AssertionError("Pillow fallback used")

    monkeypatch.setattr(T, "decode_rgb_array", no_pillow)  # what every Pillow decode of "RGB" goes through
    assert T.full_decode(images[kind]).ndim == 3
    assert T.RandomResizedCrop(32)(images[kind]).shape == (32, 32, 3)


def test_control_cmyk_needs_the_pillow_fallback(images):
    # Why CMYK is routed to Pillow: simplejpeg's own CMYK->RGB differs from Pillow's.
    data = images["jpeg_cmyk"]
    assert not np.array_equal(simplejpeg.decode_jpeg(data, colorspace="RGB"), _pil_rgb(data))


@pytest.mark.parametrize("transform", [T.full_decode, T.RandomResizedCrop(32), T.CenterCrop(32, 40), T.Resize(32)],
                         ids=lambda t: getattr(t, "__name__", None) or repr(t))
def test_undecodable_input_raises_the_image_policys_error(transform, images):
    # ImageDecodeError is an OSError, as Pillow's UnidentifiedImageError is
    with pytest.raises(ImageDecodeError, match="not a recognised image"):
        transform(b"not an image at all")
    with pytest.raises(ImageDecodeError, match="empty"):
        transform(b"")
    truncated = images["jpeg420"][: len(images["jpeg420"]) // 2]
    with pytest.raises(OSError):
        transform(truncated)


def test_decompression_bomb_limit_applies_to_the_jpeg_path(images, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)  # jpeg420 has 137_557 px > 2x limit
    for transform in (T.full_decode, T.RandomResizedCrop(16), T.CenterCrop(16, 20), T.Resize(16)):
        with pytest.raises(ImageDecodeError, match="decompression bomb"):
            transform(images["jpeg420"])


# --------------------------------------------------- RandomResizedCrop statistics


def _reference_get_params(height, width, scale, ratio, rnd: random.Random):
    """torchvision.transforms.RandomResizedCrop.get_params, transcribed with Python's RNG."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rnd.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rnd.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = rnd.randint(0, height - h)
            j = rnd.randint(0, width - w)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def _box_stats(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = boxes.T.astype(np.float64)
    return {
        "area fraction": h * w / (height * width),
        "log aspect ratio": np.log(w / h),
        "centre y": (top + h / 2) / height,
        "centre x": (left + w / 2) / width,
    }


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference between the two empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / a.size - np.searchsorted(b, grid, "right") / b.size).max())


N_SAMPLES = 20_000


@pytest.mark.parametrize("height,width", [(350, 400), (120, 900), (900, 120)])
def test_crop_sampling_matches_torchvision_algorithm(height, width):
    t = T.RandomResizedCrop(224)
    rng = np.random.default_rng(1)
    ours = np.array([t.get_params(height, width, rng) for _ in range(N_SAMPLES)])
    rnd = random.Random(2)
    ref = np.array([_reference_get_params(height, width, t.scale, t.ratio, rnd) for _ in range(N_SAMPLES)])
    top, left, h, w = ours.T
    assert (h > 0).all() and (w > 0).all() and (top + h <= height).all() and (left + w <= width).all()
    ours_stats, ref_stats = _box_stats(ours, height, width), _box_stats(ref, height, width)
    for name in ours_stats:
        assert _ks(ours_stats[name], ref_stats[name]) < 0.02, name


def test_control_ks_check_detects_a_plausible_bug():
    # A sampler that draws the aspect ratio uniformly instead of log-uniformly.
    def buggy(height, width, rnd):
        area = height * width
        for _ in range(10):
            target_area = area * rnd.uniform(0.08, 1.0)
            aspect_ratio = rnd.uniform(3 / 4, 4 / 3)
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                return rnd.randint(0, height - h), rnd.randint(0, width - w), h, w
        return 0, 0, height, width

    rnd = random.Random(3)
    bug = np.array([buggy(350, 400, rnd) for _ in range(N_SAMPLES)])
    ref = np.array([_reference_get_params(350, 400, (0.08, 1.0), (3 / 4, 4 / 3), rnd) for _ in range(N_SAMPLES)])
    assert _ks(_box_stats(bug, 350, 400)["log aspect ratio"], _box_stats(ref, 350, 400)["log aspect ratio"]) > 0.02


@pytest.mark.parametrize(
    "height,width,expected",
    [(120, 900, (0, 370, 120, 160)), (900, 120, (370, 0, 160, 120)), (100, 110, (0, 0, 100, 110))],
)
def test_crop_fallback_is_torchvision_centre_crop(height, width, expected):
    # scale > 1 makes every attempt too large, so the fallback always runs.
    t = T.RandomResizedCrop(8, scale=(2.0, 3.0))
    assert t.get_params(height, width, np.random.default_rng(0)) == expected


# ---------------------------------------------------------------- DCT fast path


@pytest.fixture
def factors(monkeypatch):
    """Record every (factor, decoded shape) the transforms decode a JPEG at (through simplejpeg,
    their JPEG decoder: ``min_factor`` is the DCT scale 1/factor; None: the decode failed)."""
    seen: list[tuple[int, tuple[int, ...] | None]] = []
    real = simplejpeg.decode_jpeg

    def spy(data, *args, **kwargs):
        factor = kwargs.get("min_factor", 1)
        try:
            img = real(data, *args, **kwargs)
        except Exception:
            seen.append((factor, None))
            raise
        seen.append((factor, img.shape))
        return img

    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    return seen


def _sharpness(img: np.ndarray) -> float:
    a = img.astype(np.float64)
    return float(np.abs(np.diff(a, axis=0)).mean() + np.abs(np.diff(a, axis=1)).mean())


def test_dct_scaling_is_used_for_large_image_and_small_output(large_jpeg, factors):
    t = T.RandomResizedCrop(56)
    for seed in range(30):
        t(large_jpeg, np.random.default_rng(seed))
    used = [f for f, _ in factors]
    assert max(used) == 8 and sum(f > 1 for f in used) >= 20
    assert (8, (150, 200, 3)) in factors

    factors.clear()
    T.CenterCrop(224, resize=256)(large_jpeg)
    T.Resize(72)(large_jpeg)
    # 1200/2 = 600 >= 2*256 but 1200/4 = 300 < 2*256; 1200/8 = 150 >= 2*72.
    assert [f for f, _ in factors] == [2, 8]


def test_whole_image_dct_scaling_needs_exact_division(factors):
    # 603x805 at 1/4 would be 150.75 x 201.25 px: the last block row is partial and the
    # image would be stretched, so only the even-sized twin is scaled.
    for h, w, expected in [(600, 800, 4), (603, 805, 1)]:
        factors.clear()
        out = T.Resize(64)(_encode(_photo(h, w, seed=11)))
        assert out.shape == (64, int(64 * w / h), 3)
        assert [f for f, _ in factors] == [expected]


def test_dct_scaling_keeps_twice_the_output_resolution(large_jpeg, factors):
    size = (112, 112)
    t = T.RandomResizedCrop(size)
    for seed in range(40):
        t(large_jpeg, np.random.default_rng(seed))
        _, _, h, w = t.get_params(1200, 1600, np.random.default_rng(seed))
        factor = factors[-1][0]
        assert h >= 2 * size[0] * factor and w >= 2 * size[1] * factor, "scaled crop under 2x the output"
        if factor < 8:  # the next factor would have left less than 2x
            assert h < 2 * size[0] * 2 * factor or w < 2 * size[1] * 2 * factor
    assert {f for f, _ in factors} >= {1, 2, 4}


# ------------------------------------------------------ torchvision's PIL pipeline


def _tv_short_side(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision Resize(int) output (h, w): shorter side = size, longer truncated."""
    return (size, int(size * width / height)) if height <= width else (int(size * height / width), size)


def _tv_center_crop(img: Image.Image, size: int) -> Image.Image:
    """torchvision CenterCrop on a PIL image: offsets int(round((side - crop) / 2))."""
    w, h = img.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


def _tv_reference(kind: str, data: bytes, crop: int, resize: int, box) -> np.ndarray:
    """torchvision's transform on ``pil_loader``'s image, BILINEAR (antialiased)."""
    pil = Image.open(io.BytesIO(data)).convert("RGB")
    if kind == "rrc":
        top, left, h, w = box
        return np.asarray(pil.crop((left, top, left + w, top + h)).resize((crop, crop), Image.BILINEAR))
    rh, rw = _tv_short_side(pil.height, pil.width, resize)
    resized = pil.resize((rw, rh), Image.BILINEAR)
    return np.asarray(resized if kind == "resize" else _tv_center_crop(resized, crop))


@pytest.fixture(scope="module")
def synth_photos() -> list[bytes]:
    """Photo-like JPEGs (grain, edges) of varied sizes; half with sides divisible by 8,
    where whole-image DCT scaling applies, half arbitrary."""
    from fastdata.synth import synth_jpeg

    rng = np.random.default_rng(18)
    sizes = [(int(rng.integers(19, 100)) * 8, int(rng.integers(19, 100)) * 8) for _ in range(12)]
    sizes += [(int(rng.integers(150, 800)), int(rng.integers(150, 800))) for _ in range(6)]
    sizes += [(1200, 1600), (1600, 1200), (800, 600)]
    return [synth_jpeg(18, i % 5, i, size=s) for i, s in enumerate(sizes)]


def _fused(kind: str, crop: int, resize: int):
    if kind == "center":
        return T.CenterCrop(crop, resize=resize)
    return T.Resize(resize) if kind == "resize" else T.RandomResizedCrop(crop)


def _mads_against_torchvision(photos, kind: str, crop: int, resize: int) -> list[float]:
    fused, mads = _fused(kind, crop, resize), []
    for i, data in enumerate(photos):
        h, w = T.full_decode(data).shape[:2]
        box = fused.get_params(h, w, np.random.default_rng(i)) if kind == "rrc" else None
        mads.append(_mad(fused(data, np.random.default_rng(i)), _tv_reference(kind, data, crop, resize, box)))
    return mads


@pytest.mark.parametrize("kind", ["center", "resize", "rrc"])
@pytest.mark.parametrize("crop, resize", [(64, 72), (32, 36), (224, 256)])
def test_fused_transforms_match_torchvision_within_one_level(synth_photos, kind, crop, resize):
    mads = _mads_against_torchvision(synth_photos, kind, crop, resize)
    assert max(mads) <= 1.0, [round(m, 2) for m in mads]


@pytest.mark.parametrize("kind", ["center", "rrc"])
def test_control_dct_scaling_without_headroom_misses_the_bound(synth_photos, kind, monkeypatch):
    # Decoding at 1/f whenever the scaled image merely covers the output (no headroom)
    # lets the DCT's block averaging set the filter: the comparison above catches it.
    monkeypatch.setattr(T, "DCT_HEADROOM", 1)
    assert max(_mads_against_torchvision(synth_photos, kind, 64, 72)) > 1.0


def _snapped_crop(data: bytes, crop: int, seed: int) -> tuple[np.ndarray, int]:
    """``RandomResizedCrop(crop)(data, default_rng(seed))`` as it would be if the JPEG decoded
    at 1/f were cropped at whole scaled pixels (the box divided by f, rounded) instead of
    resampled over the exact window; and f (1: no scaled decode, the transform's own output).
    The same box, factor (``DCT_HEADROOM``), decoder and resize as the transform's."""
    t = T.RandomResizedCrop(crop)
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    top, left, h, w = t.get_params(height, width, np.random.default_rng(seed))
    factor = next((f for f in (8, 4, 2) if min(h, w) >= T.DCT_HEADROOM * f * crop), 1)
    if factor == 1:
        return t(data, np.random.default_rng(seed)), 1
    scaled = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // factor),
                                    min_width=-(-width // factor), min_factor=factor)
    top, left, h, w = (int(round(v / factor)) for v in (top, left, h, w))
    # the snapped crop, resized by the transforms' own resize (a PNG of it: decoded losslessly)
    return T.Resize((crop, crop))(_encode(Image.fromarray(scaled[top : top + h, left : left + w]), "PNG")), factor


def test_control_snapping_the_crop_to_scaled_pixels_misses_the_bound(synth_photos):
    # Cropping the scaled image at whole pixels instead of the exact window moves the
    # crop edges by up to f/2 source pixels: measurably off torchvision's crop.
    mads, factors = [], []
    for i, data in enumerate(synth_photos):
        h, w = T.full_decode(data).shape[:2]
        box = T.RandomResizedCrop(32).get_params(h, w, np.random.default_rng(i))
        snapped, factor = _snapped_crop(data, 32, i)
        mads.append(_mad(snapped, _tv_reference("rrc", data, 32, 36, box)))
        factors.append(factor)
    assert max(factors) > 1, "no crop took a DCT-scaled decode: nothing was snapped"
    assert max(mads) > 1.0


def test_dct_scaled_crop_keeps_full_decode_sharpness(large_jpeg):
    # large_jpeg is independent random colour per 24 px cell, 4:2:0: far more chroma
    # detail than a photo. A DCT-scaled decode reads chroma from its blocks where a full
    # decode interpolates it ("fancy" upsampling), so this worst case gets a looser bound.
    t = T.RandomResizedCrop(64)
    full = T.full_decode(large_jpeg)
    for seed in range(12):
        top, left, h, w = t.get_params(*full.shape[:2], np.random.default_rng(seed))
        reference = T._resize(full[top : top + h, left : left + w], t.output_size)
        fast = t(large_jpeg, np.random.default_rng(seed))
        assert _mad(fast, reference) <= 1.5, seed
        assert _sharpness(fast) > 0.95 * _sharpness(reference), seed


def test_random_resized_crop_matches_pil_pipeline(images, large_jpeg):
    # torchvision with PIL: decode, crop the sampled box, resize BILINEAR (antialiased).
    t = T.RandomResizedCrop((160, 150))
    for data in (images["jpeg420"], images["png"], large_jpeg):
        pil = Image.open(io.BytesIO(data)).convert("RGB")
        full = np.asarray(pil)
        for seed in range(6):
            top, left, h, w = t.get_params(*full.shape[:2], np.random.default_rng(seed))
            reference = np.asarray(pil.crop((left, top, left + w, top + h)).resize((150, 160), Image.BILINEAR))
            out = t(data, np.random.default_rng(seed))
            assert _mad(out, reference) <= 1.0, seed
            if T._box_factor((top, left, h, w), t.output_size) == 1 or data[:2] != b"\xff\xd8":
                # same decoder, same geometry: only resampler rounding differs
                assert np.abs(out.astype(int) - reference).max() <= 2


def test_resize_fallback_without_the_aten_out_op_gives_the_same_pixels(images, large_jpeg, monkeypatch):
    cases = [(images["jpeg420"], T.RandomResizedCrop(224)), (large_jpeg, T.RandomResizedCrop(96)),
             (images["png"], T.CenterCrop(224, resize=256)), (images["jpeg444"], T.Resize((300, 100)))]
    fast = [t(d, np.random.default_rng(1)) for d, t in cases]
    monkeypatch.setattr(T, "AA_BILINEAR_OUT", None)  # the fallback: F.interpolate, then a copy
    for (data, t), expected in zip(cases, fast, strict=False):
        np.testing.assert_array_equal(t(data, np.random.default_rng(1)), expected)


def test_control_pil_comparison_sees_a_one_pixel_shift(images):
    pil = Image.open(io.BytesIO(images["jpeg420"])).convert("RGB")
    exact = np.asarray(pil.crop((50, 40, 250, 240)).resize((150, 150), Image.BILINEAR)).astype(int)
    shifted = np.asarray(pil.crop((51, 40, 251, 240)).resize((150, 150), Image.BILINEAR)).astype(int)
    assert np.abs(exact - shifted).max() > 2


def test_centre_crop_and_resize_match_pil_pipeline(large_jpeg, images):
    for data, limit in ((images["jpeg420"], 0.5), (images["png"], 0.5), (large_jpeg, 1.0)):
        pil = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = pil.size
        rw, rh = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
        resized = pil.resize((rw, rh), Image.BILINEAR)
        top, left = int(round((rh - 224) / 2.0)), int(round((rw - 224) / 2.0))
        reference = np.asarray(resized.crop((left, top, left + 224, top + 224)))
        assert _mad(T.CenterCrop(224, resize=256)(data), reference) < limit
        assert _mad(T.Resize(256)(data), np.asarray(resized)) < limit
        assert _mad(T.Resize((200, 180))(data), np.asarray(pil.resize((180, 200), Image.BILINEAR))) < limit


def test_centre_crop_without_resize_pads_small_images_like_torchvision():
    img = _photo(100, 80, seed=10)
    data = _encode(img, "PNG")
    out = T.CenterCrop(128)(data)
    expected = np.zeros((128, 128, 3), np.uint8)
    expected[14:114, 24:104] = np.asarray(img)  # pad (128-100)//2 top, (128-80)//2 left
    np.testing.assert_array_equal(out, expected)
    crop = T.CenterCrop((50, 60))(data)
    np.testing.assert_array_equal(crop, np.asarray(img)[25:75, 10:70])


# ------------------------------------------------------------- reproducibility


def test_fixed_seed_reproduces_random_crops(images, large_jpeg):
    t = T.RandomResizedCrop(96)
    for data in (large_jpeg, images["jpeg420"], images["png"]):
        a = [t(data, np.random.default_rng(42)) for _ in range(2)]
        np.testing.assert_array_equal(a[0], a[1])
        seed_rng(3)
        first = [t(data) for _ in range(4)]
        seed_rng(3)
        second = [t(data) for _ in range(4)]
        for x, y in zip(first, second, strict=False):
            np.testing.assert_array_equal(x, y)
        assert len({x.tobytes() for x in first}) == 4, "crops do not vary"


class _CropDataset(Dataset):
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.transform = T.RandomResizedCrop(48)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index):
        return get_worker_info().id, torch.from_numpy(self.transform(self.data))


@pytest.mark.timeout(60)
def test_forked_workers_after_parent_used_thread_pools(images):
    # The parent's intra-op pools (torch; OpenCV if user code used it) are live when
    # the workers fork: the transforms must neither hang nor repeat crops there.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        T.RandomResizedCrop(300)(_encode(_photo(1200, 1600, seed=12)), np.random.default_rng(0))
    finally:
        torch.set_num_threads(threads)
    cv2.resize(np.zeros((2000, 2000, 3), np.uint8), (500, 500), interpolation=cv2.INTER_AREA)
    loader = DataLoader(_CropDataset(images["jpeg420"]), batch_size=None, num_workers=2,
                        multiprocessing_context="fork")
    items = list(loader)
    assert len(items) == 8
    crops: dict[int, list[bytes]] = {}
    for wid, crop in items:
        crops.setdefault(int(wid), []).append(crop.numpy().tobytes())
    assert sorted(crops) == [0, 1]
    assert not set(crops[0]) & set(crops[1]), "workers drew identical crops"


# ----------------------------------------------------------------- normalization


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 3, 9, 7), (3, 5, 6)])
def test_normalize_on_device_matches_float_reference(device, shape):
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ref = (batch.double() / 255 - torch.tensor(mean).double().view(3, 1, 1)) / torch.tensor(std).double().view(3, 1, 1)
    out = T.normalize_on_device(batch.to(device), mean, std)
    assert out.dtype == torch.float32 and out.device.type == device and out.shape == batch.shape
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-6, atol=1e-6)
    # A channels-last view straight from an NHWC batch gives the same values.
    if len(shape) == 4:
        nhwc = batch.permute(0, 2, 3, 1).contiguous().to(device)
        assert torch.equal(T.normalize_on_device(nhwc.permute(0, 3, 1, 2), mean, std), out)


def test_normalize_on_device_rejects_bad_input():
    batch = torch.zeros((2, 3, 4, 4), dtype=torch.uint8)
    with pytest.raises(TypeError):
        T.normalize_on_device(batch.bool(), (0.5,) * 3, (0.5,) * 3)  # float and integer dtypes are accepted
    with pytest.raises(ValueError):
        T.normalize_on_device(batch, (0.5,) * 2, (0.5,) * 3)
    with pytest.raises(ValueError):
        T.normalize_on_device(batch, (0.5,) * 3, (0.5, 0.0, 0.5))
    with pytest.raises(ValueError):
        T.normalize_on_device(batch[0, 0], (0.5,), (0.5,))


def test_fast_decode_opt_in_is_close_to_exact_and_takes_the_same_crops(images, large_jpeg):
    """``fast=True`` (libjpeg-turbo's fast IDCT and upsampling, the figure quoted in
    the fast=True row of docs/performance.md) changes pixels only slightly, never the sampling."""
    exact, fast = T.RandomResizedCrop(224), T.RandomResizedCrop(224, fast=True)
    differs = False
    for data in (images["jpeg420"], large_jpeg):
        for seed in range(6):
            a = exact(data, np.random.default_rng(seed))
            b = fast(data, np.random.default_rng(seed))
            assert a.shape == b.shape == (224, 224, 3)
            assert _mad(a, b) < 2.5, seed  # the bound the DCT-scaled path meets (measured 1.3-2.2 here)
            differs |= not np.array_equal(a, b)
    assert differs, "fast=True decoded exactly like the default: the option does nothing"
