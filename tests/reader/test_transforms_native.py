"""Decode-time transforms in read modes other than "RGB": native dtype and channels.

The acceptance property: on an image read ``"unchanged"`` (uint16, int16, float32, 4 or 5
channels), every transform gives what the same crop-then-resize gives on the encoded array
itself with torch's antialiased bilinear in float64, within 1 for integers (1e-3 relative
for floats), in the stored dtype and channel count, with the crop box of the "RGB" path.

Decoding is :func:`fastdata.common.imageio.decode_image`'s job, whose codec coverage grows
separately (today it reads 16-bit colour and 4-5 channel TIFFs wrongly or not at all, and
int16 as int32). Where it does not yet give a case's encoded array back exactly, that test
decodes the TIFF with tifffile instead (:func:`_case`), so the crop/resize property is
checked for every dtype and channel count either way; once decode_image reads the case, the
test runs on the real path with no change.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import tifffile
import torch
import torch.nn.functional as F
from PIL import Image

from fastdata import transforms as T
from fastdata.common.imageio import decode_image, encode_lossless
from fastdata.reader import transforms as transforms_module

# ------------------------------------------------------------------ generated images


def _smooth(height: int, width: int, channels: int, *, seed: int, cell: int = 6) -> np.ndarray:
    """HxWxC float64 in 0-1: coarse noise upscaled bilinearly, features a few pixels wide,
    so that a crop misplaced by one pixel changes values by far more than one unit."""
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.random((1, channels, height // cell + 2, width // cell + 2)))
    fine = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return fine[0].permute(1, 2, 0).numpy()


def _array(dtype: str, channels: int, height: int, width: int, seed: int) -> np.ndarray:
    x = _smooth(height, width, channels, seed=seed)
    if dtype == "float32":
        arr = ((x - 0.4) * 300.0).astype(np.float32)  # negative and positive, well beyond 0-1
    else:
        info = np.iinfo(dtype)
        arr = np.rint(info.min + x * (float(info.max) - info.min)).astype(dtype)  # the full range
    return arr[:, :, 0] if channels == 1 else arr


# (dtype, channels, height, width): odd sizes, portrait and landscape
CASES = {
    "uint16_gray": ("uint16", 1, 97, 131),
    "uint16_rgb": ("uint16", 3, 120, 90),
    "uint16_4ch": ("uint16", 4, 88, 101),
    "int16_gray": ("int16", 1, 103, 77),
    "float32_gray": ("float32", 1, 91, 117),
    "float32_5ch": ("float32", 5, 79, 95),
    "uint8_5ch": ("uint8", 5, 85, 99),
}


@pytest.fixture(scope="module")
def native() -> dict[str, tuple[np.ndarray, bytes]]:
    """Each case's reference array (HxWxC) and its encoded bytes (TIFF, PNG-free dtypes)."""
    out = {}
    for seed, (name, (dtype, channels, h, w)) in enumerate(CASES.items()):
        arr = _array(dtype, channels, h, w, seed)
        data, _ = encode_lossless(arr)
        out[name] = (arr if arr.ndim == 3 else arr[:, :, None], data)
    return out


def _roundtrips(arr: np.ndarray, data: bytes) -> bool:
    try:
        got = decode_image(data, "unchanged")
    except Exception:  # noqa: BLE001 - any failure means: not readable yet
        return False
    got = got[:, :, None] if got.ndim == 2 else got
    return got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)


def _tiff_decode(data, mode: str = "RGB") -> np.ndarray:
    """Stand-in for decode_image("unchanged") on a TIFF it cannot read yet: tifffile's pixels."""
    if bytes(data[:2]) not in (b"II", b"MM"):
        return decode_image(data, mode)
    assert mode == "unchanged", mode
    return tifffile.imread(io.BytesIO(bytes(data)))


def _case(native, name: str, monkeypatch) -> tuple[np.ndarray, bytes]:
    """A case's (array, bytes), decoded by decode_image where it reads them exactly, else by tifffile."""
    arr, data = native[name]
    if not _roundtrips(arr, data):
        monkeypatch.setattr(transforms_module, "decode_image", _tiff_decode)
    return arr, data


# ------------------------------------------------------------------ the reference


def _ref_resize(arr: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """torch's antialiased bilinear in float64 of an HxWxC array (no rounding)."""
    x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64)).permute(2, 0, 1)[None]
    if tuple(x.shape[-2:]) == tuple(out_hw):
        return x[0].permute(1, 2, 0).numpy()
    y = F.interpolate(x, size=out_hw, mode="bilinear", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0).numpy()


def _shorter_side(hw: tuple[int, int], s: int) -> tuple[int, int]:
    h, w = hw
    return (int(s * h / w), s) if w <= h else (s, int(s * w / h))


def _ref_center(arr: np.ndarray, crop: tuple[int, int], resize) -> np.ndarray:
    """torchvision Resize then CenterCrop (offsets round((size - crop) / 2), zero padding)."""
    if resize is not None:
        target = resize if isinstance(resize, tuple) else _shorter_side(arr.shape[:2], resize)
        arr = _ref_resize(arr, target)
    arr = arr.astype(np.float64)
    h, w = arr.shape[:2]
    ch, cw = crop
    pt, pl = max(ch - h, 0) // 2, max(cw - w, 0) // 2
    arr = np.pad(arr, ((pt, max(ch - h, 0) - pt), (pl, max(cw - w, 0) - pl), (0, 0)))
    h, w = arr.shape[:2]
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return arr[top : top + ch, left : left + cw]


def _assert_close(out: np.ndarray, ref: np.ndarray, dtype) -> None:
    assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-5 * np.abs(ref).max())
    elif np.dtype(dtype) == np.uint8:
        # torch's uint8 kernel (fixed-point weights, rounded between its two passes): within
        # 1, measured up to 1.003 over 750 random resizes of C = 1-5, as in the "RGB" path.
        assert np.abs(out.astype(np.float64) - ref).max() <= 1.01
    else:
        # float kernel then round to nearest: half a unit, plus float32's error on 16 bits.
        assert np.abs(out.astype(np.float64) - ref).max() <= 0.6


# ------------------------------------------------------------------ the property


@pytest.mark.parametrize("name", list(CASES))
def test_random_resized_crop_matches_float64_reference_with_the_rgb_box(name, native, monkeypatch):
    arr, data = _case(native, name, monkeypatch)
    rrc = T.RandomResizedCrop((40, 56), scale=(0.1, 1.0))
    for seed in range(4):
        out = rrc(data, np.random.default_rng(seed), mode="unchanged")
        top, left, h, w = rrc.get_params(arr.shape[0], arr.shape[1], np.random.default_rng(seed))
        assert out.flags.c_contiguous and out.flags.writeable
        _assert_close(out, _ref_resize(arr[top : top + h, left : left + w], (40, 56)), arr.dtype)
    # Upscaling a tiny crop goes through the same kernel.
    out = T.RandomResizedCrop(64, scale=(0.01, 0.02))(data, np.random.default_rng(9), mode="unchanged")
    top, left, h, w = T.RandomResizedCrop(64, scale=(0.01, 0.02)).get_params(
        arr.shape[0], arr.shape[1], np.random.default_rng(9))
    assert h < 64 and w < 64
    _assert_close(out, _ref_resize(arr[top : top + h, left : left + w], (64, 64)), arr.dtype)


@pytest.mark.parametrize("name", ["uint16_gray", "int16_gray", "float32_5ch", "uint16_4ch"])
def test_control_a_crop_box_shifted_by_one_pixel_fails_the_bound(name, native, monkeypatch):
    arr, data = _case(native, name, monkeypatch)
    rrc = T.RandomResizedCrop((40, 56), scale=(0.1, 0.5))
    out = rrc(data, np.random.default_rng(1), mode="unchanged")
    top, left, h, w = rrc.get_params(arr.shape[0], arr.shape[1], np.random.default_rng(1))
    for dy, dx in ((1, 0), (0, 1)):
        t = top + dy if top + h < arr.shape[0] else top - dy  # stay inside the image
        le = left + dx if left + w < arr.shape[1] else left - dx
        shifted = _ref_resize(arr[t : t + h, le : le + w], (40, 56))
        with pytest.raises(AssertionError):
            _assert_close(out, shifted, arr.dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("crop, resize", [((48, 48), 56), ((30, 44), (60, 50)), ((40, 40), None),
                                          ((128, 90), None), ((150, 140), 100)])
def test_center_crop_matches_float64_reference(name, crop, resize, native, monkeypatch):
    arr, data = _case(native, name, monkeypatch)
    out = T.CenterCrop(crop, resize=resize)(data, mode="unchanged")
    _assert_close(out, _ref_center(arr, crop, resize), arr.dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", [33, (50, 61), 200])
def test_resize_matches_float64_reference(name, size, native, monkeypatch):
    arr, data = _case(native, name, monkeypatch)
    out = T.Resize(size)(data, mode="unchanged")
    target = size if isinstance(size, tuple) else _shorter_side(arr.shape[:2], size)
    _assert_close(out, _ref_resize(arr, target), arr.dtype)


def test_centre_crop_pads_with_zero_in_the_stored_dtype(native, monkeypatch):
    arr, data = _case(native, "int16_gray", monkeypatch)  # values reach -32768: a padding of "min" would show
    out = T.CenterCrop((120, 90))(data, mode="unchanged")
    pad_top, pad_left = (120 - 103) // 2, (90 - 77) // 2
    assert out.dtype == np.int16 and out.shape == (120, 90, 1)
    assert (out[:pad_top] == 0).all() and (out[:, :pad_left] == 0).all()
    np.testing.assert_array_equal(out[pad_top : pad_top + 103, pad_left : pad_left + 77], arr)


def test_native_box_equals_rgb_box_and_uses_the_same_draws(monkeypatch):
    """A uint8 RGB PNG read "unchanged" is exactly the "RGB" result; the same image as uint16
    (x * 257) gives it at 16 bits; both leave the generator in the same state."""
    rgb = np.rint(_smooth(110, 93, 3, seed=40) * 255).astype(np.uint8)
    png, fmt = encode_lossless(rgb)
    tif, _ = encode_lossless(rgb.astype(np.uint16) * 257)
    assert fmt == "PNG"
    if not _roundtrips(rgb.astype(np.uint16) * 257, tif):
        monkeypatch.setattr(transforms_module, "decode_image", _tiff_decode)
    rrc = T.RandomResizedCrop(32)
    for seed in range(5):
        rngs = [np.random.default_rng(seed) for _ in range(3)]
        a = rrc(png, rngs[0])
        b = rrc(png, rngs[1], mode="unchanged")
        c = rrc(tif, rngs[2], mode="unchanged")
        np.testing.assert_array_equal(a, b)
        assert c.dtype == np.uint16 and c.shape == (32, 32, 3)
        assert np.abs(c / 257.0 - a).max() <= 1.0
        assert len({r.random() for r in rngs}) == 1, "the modes consumed different draws"


# ------------------------------------------------------------------ modes L and RGBA


def _photo_jpeg(seed: int, mode: str = "RGB") -> bytes:
    img = Image.fromarray(np.rint(_smooth(90, 120, 3, seed=seed) * 255).astype(np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92)
    return buf.getvalue()


@pytest.mark.parametrize("mode, channels", [("L", 1), ("RGBA", 4), ("unchanged", 3)])
@pytest.mark.parametrize("transform", [T.RandomResizedCrop(40), T.CenterCrop(48, resize=56), T.Resize(45)], ids=repr)
def test_pillow_modes_are_3d_uint8_with_the_modes_channels(mode, channels, transform):
    data = _photo_jpeg(7)
    ref_img = decode_image(data, mode)
    ref_img = ref_img[:, :, None] if ref_img.ndim == 2 else ref_img
    out = transform(data, np.random.default_rng(2), mode=mode)
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == channels
    if isinstance(transform, T.RandomResizedCrop):
        top, left, h, w = transform.get_params(90, 120, np.random.default_rng(2))
        ref = _ref_resize(ref_img[top : top + h, left : left + w], transform.output_size)
    elif isinstance(transform, T.CenterCrop):
        ref = _ref_center(ref_img, transform.output_size, transform.resize)
    else:
        ref = _ref_resize(ref_img, _shorter_side((90, 120), 45))
    _assert_close(out, ref, np.uint8)
    if mode == "RGBA":
        assert (out[..., 3] == 255).all()


def test_gray_jpeg_unchanged_and_l_have_one_channel():
    data = _photo_jpeg(8, "L")
    for mode in ("L", "unchanged"):
        out = T.CenterCrop(40)(data, mode=mode)
        assert out.shape == (40, 40, 1) and out.dtype == np.uint8
        np.testing.assert_array_equal(out[:, :, 0], decode_image(data, "L")[25:65, 40:80])
    assert T.full_decode(data, mode="L").shape == (90, 120, 1)
    assert T.full_decode(data).shape == (90, 120, 3)


def test_full_decode_modes(native, monkeypatch):
    arr, data = _case(native, "float32_5ch", monkeypatch)
    out = T.full_decode(data, mode="unchanged")
    assert out.dtype == np.float32 and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    arr, data = _case(native, "uint16_gray", monkeypatch)
    np.testing.assert_array_equal(T.full_decode(data, mode="unchanged"), arr)
    with pytest.raises(ValueError, match="mode"):
        T.full_decode(data, mode="rgb")


def test_rgb_mode_keyword_is_the_default_path():
    data = _photo_jpeg(9)
    for transform in (T.RandomResizedCrop(40), T.CenterCrop(48, resize=56), T.Resize(45)):
        np.testing.assert_array_equal(transform(data, np.random.default_rng(1), mode="RGB"),
                                      transform(data, np.random.default_rng(1)))
        with pytest.raises(ValueError, match="mode"):
            transform(data, mode="BGR")


# ------------------------------------------------------------------ decode_into


@pytest.mark.parametrize("name", ["uint16_gray", "float32_5ch", "uint8_5ch"])
@pytest.mark.parametrize("transform", [T.RandomResizedCrop((24, 20)), T.CenterCrop(24, resize=30)], ids=repr)
def test_decode_into_writes_a_native_batch_slot(name, transform, native, monkeypatch):
    arr, data = _case(native, name, monkeypatch)
    expected = transform(data, np.random.default_rng(4), mode="unchanged")
    batch = np.full((3, 24, *expected.shape[1:]), 7, arr.dtype)
    transform.decode_into(memoryview(data), batch[1], np.random.default_rng(4), mode="unchanged")
    np.testing.assert_array_equal(batch[1], expected)
    assert (batch[0] == 7).all() and (batch[2] == 7).all()


def test_decode_into_rejects_a_wrong_native_slot_without_writing(native, monkeypatch):
    arr, data = _case(native, "uint16_4ch", monkeypatch)
    crop = T.CenterCrop(16)
    for bad in (np.full((16, 16, 4), 7, np.uint8), np.full((16, 16, 3), 7, np.uint16),
                np.full((16, 17, 4), 7, np.uint16), np.full((16, 16), 7, np.uint16)):
        with pytest.raises(ValueError, match="out"):
            crop.decode_into(data, bad, mode="unchanged")
        assert (bad == 7).all()
    frozen = np.zeros((16, 16, 4), np.uint16)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        crop.decode_into(data, frozen, mode="unchanged")
    with pytest.raises(ValueError, match="out"):  # Resize(int): the size is known only after decoding
        T.Resize(20).decode_into(data, np.zeros((20, 20, 4), np.uint16), mode="unchanged")
    out = np.zeros((16, 16, 4), np.uint16)
    crop.decode_into(data, out, mode="unchanged")
    np.testing.assert_array_equal(out, crop(data, mode="unchanged"))


def test_default_decode_into_passes_the_mode(native, monkeypatch):
    class Whole(T.DecodeTransform):
        def __call__(self, data, rng=None, mode="RGB"):
            return T.full_decode(data, mode=mode)

    arr, data = _case(native, "int16_gray", monkeypatch)
    out = np.empty(arr.shape, np.int16)
    Whole().decode_into(data, out, mode="unchanged")
    np.testing.assert_array_equal(out, arr)


def test_resize_without_the_aten_out_op_gives_the_same_values(native, monkeypatch):
    arr, data = _case(native, "uint16_4ch", monkeypatch)
    _, fdata = _case(native, "float32_gray", monkeypatch)
    rrc = T.RandomResizedCrop(30)
    expected = [rrc(d, np.random.default_rng(3), mode="unchanged") for d in (data, fdata)]
    monkeypatch.setattr(transforms_module, "AA_BILINEAR_OUT", None)  # the fallback: F.interpolate
    for d, e in zip((data, fdata), expected, strict=True):
        np.testing.assert_array_equal(rrc(d, np.random.default_rng(3), mode="unchanged"), e)


def test_integer_results_are_rounded_and_clipped_to_the_dtype():
    """A full-range uint16 step, upscaled: values stay in 0..65535 and are the rounded exact ones."""
    arr = np.zeros((8, 8), np.uint16)
    arr[:, 4:] = 65535
    data, _ = encode_lossless(arr)
    out = T.Resize((8, 13))(data, mode="unchanged")
    ref = _ref_resize(arr[:, :, None], (8, 13))
    assert out.min() == 0 and out.max() == 65535
    np.testing.assert_array_equal(out, np.rint(ref).astype(np.uint16))


# ------------------------------------------------------------------ normalization


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _ref_normalize(batch: np.ndarray, lo: float, hi: float) -> np.ndarray:
    mean = np.array(MEAN).reshape(3, 1, 1)
    std = np.array(STD).reshape(3, 1, 1)
    return ((batch.astype(np.float64) - lo) / (hi - lo) - mean) / std


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, value_range, lo, hi", [
    ("uint8", None, 0, 255), ("uint16", None, 0, 65535), ("int16", None, -32768, 32767),
    ("float32", None, 0, 1), ("float64", None, 0, 1), ("uint16", (0, 4095), 0, 4095),
    ("int16", (-1024, 3071), -1024, 3071), ("float32", (-1000.0, 1000.0), -1000, 1000),
    ("uint8", (16, 235), 16, 235),
])
def test_normalize_on_device_matches_float64_reference(device, dtype, value_range, lo, hi):
    rng = np.random.default_rng(0)
    if dtype.startswith("float"):
        span = (0.0, 1.0) if value_range is None else value_range
        nhwc = rng.uniform(*span, (2, 5, 6, 3)).astype(dtype)
    else:
        info = np.iinfo(dtype)
        nhwc = rng.integers(info.min, int(info.max) + 1, (2, 5, 6, 3)).astype(dtype)
    ref = _ref_normalize(nhwc.transpose(0, 3, 1, 2), lo, hi)
    before = nhwc.copy()
    batch = torch.from_numpy(nhwc).to(device).permute(0, 3, 1, 2)  # channels-last, as the reader gives it
    out = T.normalize_on_device(batch, MEAN, STD, value_range=value_range)
    assert out.dtype == torch.float32 and out.device.type == device and tuple(out.shape) == (2, 3, 5, 6)
    assert out.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(batch.cpu().permute(0, 2, 3, 1).numpy(), before)  # input untouched
    one = T.normalize_on_device(batch[0], MEAN, STD, value_range=value_range)  # (C, H, W)
    assert torch.equal(one, out[0])


def test_normalize_uint8_is_bit_identical_to_the_divide_by_255_formula():
    batch = torch.randint(0, 256, (3, 3, 7, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(MEAN).reshape(-1, 1, 1)
    std = torch.tensor(STD).reshape(-1, 1, 1)
    assert torch.equal(T.normalize_on_device(batch, MEAN, STD), batch.float().div_(255.0).sub_(mean).div_(std))


def test_normalize_rejects_bad_value_ranges_and_dtypes():
    batch = torch.zeros((2, 3, 4, 4), dtype=torch.int16)
    for bad in ((1, 1), (5, 2), (0, float("inf")), (0,), "ab", (0, 1, 2)):
        with pytest.raises(ValueError, match="value_range"):
            T.normalize_on_device(batch, MEAN, STD, value_range=bad)
    with pytest.raises(TypeError):
        T.normalize_on_device(batch.bool(), MEAN, STD)
    with pytest.raises(TypeError):
        T.normalize_on_device(batch.numpy(), MEAN, STD)


def test_colour_jpegs_read_unchanged_take_the_rgb_fast_path():
    """A colour JPEG's stored pixels are 8-bit RGB: "unchanged" gives the RGB path's crop (with its
    DCT-scaled decode), not a slower full decode."""
    import io

    from PIL import Image

    from fastdata.reader.transforms import CenterCrop, RandomResizedCrop

    rng = np.random.default_rng(0)
    photo = (rng.random((480, 640, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(photo).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    for transform in (RandomResizedCrop(56), CenterCrop(56, resize=64)):
        rgb = transform(data, np.random.default_rng(5))
        unchanged = transform(data, np.random.default_rng(5), mode="unchanged")
        np.testing.assert_array_equal(unchanged, rgb)
        out = np.empty((56, 56, 3), np.uint8)
        transform.decode_into(data, out, np.random.default_rng(5), mode="unchanged")
        np.testing.assert_array_equal(out, rgb)
