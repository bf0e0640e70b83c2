"""Decode-time transforms: encoded image bytes -> final-size HWC arrays.

Decoding and cropping/resizing happen in one step, so a large JPEG never exists as a full-size
image when a small crop is wanted: JPEGs decode through libjpeg-turbo at a DCT scale when the crop
allows it, anything else through Pillow under :mod:`fastdata.common.imageio`'s policy; crops are
numpy views, resizing is torch's antialiased bilinear with torchvision's sampling geometry, in every
read mode of :mod:`fastdata.common.imagemodes` (``mode=``). Random transforms draw from an explicit
``numpy.random.Generator`` (default :func:`fastdata.reader.seeding.get_rng`, never cloned across
forked workers); :func:`normalize_on_device` turns a batch of any dtype into normalized float32.

How each path decodes, how close it stays to torchvision's PIL pipeline, and what the resizes cost:
``docs/guides/classification.md``, "Decode-time transforms".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import simplejpeg
import torch
from PIL import Image  # resampling of fractional windows only; decoding goes through .imageio

from fastdata.common.imageio import decode_image, decode_rgb_array, fast_jpeg_size, ppm_header, ppm_pixels
from fastdata.common.imagemodes import check_mode
from fastdata.reader.seeding import get_rng

__all__ = [
    "DecodeTransform",
    "RandomResizedCrop",
    "CenterCrop",
    "Resize",
    "full_decode",
    "normalize_on_device",
]

Buffer = bytes | bytearray | memoryview
Box = tuple[int, int, int, int]  # top, left, height, width in source pixels

_DCT_FACTORS = (8, 4, 2)  # libjpeg-turbo scales 1/8, 1/4, 1/2; largest first
#: How many pixels per output pixel (each side) a DCT-scaled JPEG decode must keep: the
#: transforms decode at 1/f only where the scaled image (or crop box) keeps this many, so that
#: the antialiased resize after it, not the DCT's block averaging, shapes the result (with 1,
#: crops differ from torchvision's by more than one level on average). Read at each call: public
#: so that its effect can be measured (a test lowers it) without replacing the transforms' code.
DCT_HEADROOM = 2


# --------------------------------------------------------------------------- decoding


def _jpeg_size(data: Buffer) -> tuple[int, int] | None:
    """(height, width) if simplejpeg should decode ``data``, else None (use Pillow).
    The image policy decides (JPEG content, safe colour space, under the bomb limit)."""
    return fast_jpeg_size(data)


def _decode_jpeg(data: Buffer, size: tuple[int, int], factor: int, fast: bool = False) -> np.ndarray | None:
    """Decode at DCT scale 1/factor (output ceil(h/f) x ceil(w/f)); None on any failure.
    ``fast``: libjpeg-turbo's fast integer IDCT and fast (non-interpolating) chroma upsampling."""
    height, width = size
    try:
        if factor == 1:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast)
        else:
            img = simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                min_height=-(-height // factor),
                min_width=-(-width // factor),
                min_factor=factor,
                fastdct=fast,
                fastupsample=fast,
            )
    except Exception:  # noqa: BLE001 - any fast-path failure defers to Pillow's verdict
        return None
    expected = (-(-height // factor), -(-width // factor))
    if img.shape != (*expected, 3):
        return None
    return img


def _pil_decode(data: Buffer) -> np.ndarray:
    """Every non-JPEG-fast-path decode of the "RGB" pipeline: HxWx3 uint8 RGB, as torchvision's
    pil_loader gives it. A raw-native record (a binary 8-bit PPM, ``convert(storage="raw"|"mixed")``)
    is not decoded at all: its pixels are a read-only view of ``data``
    (:func:`fastdata.common.imageio.ppm_pixels`; its header checked against the bytes), which the
    crops and resizes below take as any decoded image, so the same crop box and the same resize
    kernel apply as to a JPEG of those pixels. Anything else goes through Pillow under the image
    policy (allowed formats only, by content; decompression bombs refused) into a writable array."""
    pixels = ppm_pixels(data)
    return decode_rgb_array(data) if pixels is None else pixels


def _native_decode(data: Buffer, mode: str) -> np.ndarray:
    """:func:`decode_image` in a mode other than "RGB", as HxWxC (a one-channel image gets C = 1)."""
    img = decode_image(data, mode)
    return img[:, :, None] if img.ndim == 2 else img


def full_decode(data: Buffer, mode: str = "RGB") -> np.ndarray:
    """Decode an image at full size in read mode ``mode``.

    Args:
        data (bytes | bytearray | memoryview): an encoded image in one of
            :data:`fastdata.common.imageio.ALLOWED_FORMATS` (the content decides, not a name).
        mode (str): a read mode of :mod:`fastdata.common.imagemodes`.

    Returns:
        numpy.ndarray: ``"RGB"``: HxWx3 uint8, pixel-identical to
        ``numpy.asarray(PIL.Image.open(BytesIO(data)).convert("RGB"))``. Other modes:
        :func:`fastdata.common.imageio.decode_image`'s pixels as HxWxC (C = 1 for ``"L"``
        or a one-channel image), uint8 for ``"L"``/``"RGBA"``, the stored dtype for
        ``"unchanged"``.

    Raises:
        fastdata.common.imageio.ImageDecodeError (an OSError): another format, corrupt data,
            or a decompression bomb (over ``PIL.Image.MAX_IMAGE_PIXELS``).
        fastdata.common.imageio.ImageModeError: a Pillow mode asked of an image Pillow
            cannot open.
        ValueError: an unknown ``mode``.
    """
    if check_mode(mode, "mode") != "RGB":
        return _native_decode(data, mode)
    size = _jpeg_size(data)
    if size is not None:
        img = _decode_jpeg(data, size, 1)
        if img is not None:
            return img
    img = _pil_decode(data)
    return img if img.flags.writeable else img.copy()  # a PPM record's view of the stored bytes


# ------------------------------------------------------------------- resize and crop


_UINT8 = np.dtype(np.uint8)


def _check_shape(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype = _UINT8) -> None:
    """Before anything is written: ``out`` must be exactly what this image gives."""
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out is {out.dtype} of shape {out.shape} but this image gives {dtype} of shape {shape}")


def _emit(img: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Copy ``img`` into ``out`` (or a fresh array that does not pin a larger buffer)."""
    if out is None:
        return img.copy()
    _check_shape(out, img.shape, img.dtype)
    np.copyto(out, img)
    return out


def _aa_bilinear_out_op():
    """aten's out= variant of antialiased bilinear, or None where this torch lacks it.

    Writing straight into a channels-last view of the HWC output saves the CHW->HWC
    copy that ``F.interpolate`` needs for a batch of one: 0.16 ms instead of 0.38 ms for
    300x330 -> 224x224 (same pixels; tests check both paths).

    The generated binding (``torch._C._nn``) is preferred over ``torch.ops.aten``: both release
    the GIL while they resize, but the boxed ``torch.ops`` call takes it back inside the op to
    adjust the Python references of its tensors, so with thread workers each resize waited for
    the GIL twice (py-spy: ``gil_scoped_acquire`` under ``OpOverload.__call__``), and one
    thread's CPU per sample was about 10% higher (433 against 397 us, raw 512 px store).
    """
    direct = getattr(getattr(torch._C, "_nn", None), "_upsample_bilinear2d_aa", None)
    if direct is not None:
        return direct
    try:
        return torch.ops.aten._upsample_bilinear2d_aa.out
    except (AttributeError, RuntimeError):
        return None


#: aten's out= variant of antialiased bilinear that the resizes write through
#: (:func:`_aa_bilinear_out_op`), or None where this torch lacks it: then they call
#: ``torch.nn.functional.interpolate`` and copy, the same pixels. Read at each call: public so
#: that the fallback can be exercised (set it to None) on a torch that has the op.
AA_BILINEAR_OUT = _aa_bilinear_out_op()


def _resize(src: np.ndarray, out_hw: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
    """Resize HxWxC to ``out_hw`` with torch's antialiased bilinear, keeping the dtype.

    uint8 (any C) uses torch's uint8 kernel; other dtypes go through :func:`_resize_float`.

    For HxWx3 uint8 this is torchvision's PIL ``BILINEAR`` (antialiased). Measured on 1/f-noise "photos" against PIL
    (torchvision's reference), 224 px output, one thread: shrinking 1.2x / 1.9x / 4x,
    torch differs by at most 1 (mean 0.01) in 0.25 / 0.33 / 0.6 ms where PIL takes
    0.7 / 1.4 / 3.9 ms; cv2 INTER_LINEAR (0.1 ms) aliases (mean abs. difference 1.9 at
    1.3x, 4.1 at 1.9x, 9 at 3x) and cv2 INTER_AREA, closer (0.9 / 1.6 / 2.4), is as slow
    as PIL off integer factors. Enlarging, torch equals PIL exactly (0.3 ms; cv2 0.1 ms,
    within 1). OpenCV is also avoided because its pthreads pool is not fork-safe:
    ``cv2.setNumThreads`` in a DataLoader worker forked from a parent that had used
    OpenCV threads hung in our tests (its pool joins threads that the fork did not copy).
    """
    oh, ow = out_hw
    if src.shape[:2] == (oh, ow):
        return _emit(src, out)
    if src.dtype != np.uint8:
        return _resize_float(src, out_hw, out)
    # uint8 with C != 3 keeps the uint8 kernel: it is within 1 of a float64 resize for C = 1-5
    # (measured up to 1.003 over 750 random resizes, as for C = 3: fixed-point weights) and
    # faster than the float path, 400x380 -> 224 on one thread: C = 1: 0.41 vs 0.49 ms,
    # 2: 0.41 vs 1.1, 4: 0.19 vs 2.1 ms, 5: 2.6 vs 2.9 ms (3 and 4 have vectorised kernels).
    shape = (oh, ow, src.shape[2])
    if out is None:
        out = np.empty(shape, np.uint8)
    else:
        _check_shape(out, shape)
    # A crop of an HWC image is a strided channels-last NCHW view, resized in place: on torch
    # 2.13 that is faster than copying it contiguous first (237 against 374 us for 370x360 ->
    # 224, same pixels), and each copy released and retook the GIL, which thread workers pay
    # for in waits. A PPM record read through LMDB or HDF5 is a read-only view of the store,
    # which torch.from_numpy warns about: copied (an LMDB batch reads records through a
    # copy-on-write map of the shard instead, writable, so not copied).
    if not src.flags.writeable:
        src = src.copy()
    src_t = torch.from_numpy(src.transpose(2, 0, 1)[None])
    dst_t = torch.from_numpy(out.transpose(2, 0, 1)[None])
    if AA_BILINEAR_OUT is not None:
        AA_BILINEAR_OUT(src_t, [oh, ow], False, None, None, out=dst_t)
    else:
        dst_t.copy_(torch.nn.functional.interpolate(src_t, size=(oh, ow), mode="bilinear", antialias=True))
    return out


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float64 for float64 and 32/64-bit integers (float32's 24-bit mantissa would round
    their values), float32 for everything else."""
    if dtype == np.float64 or (dtype.kind in "iu" and dtype.itemsize >= 4):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _resize_float(src: np.ndarray, out_hw: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
    """Antialiased bilinear of a non-uint8 HxWxC array, computed in float, cast back.

    Integers are rounded to nearest (ties to even) and clipped to their dtype's range, so
    a result is within 1 of the exact resize. The weights are non-negative, so clipping
    only guards the rounding; float16 comes back as float16 without rounding.
    """
    oh, ow = out_hw
    shape = (oh, ow, src.shape[2])
    if out is None:
        out = np.empty(shape, src.dtype)
    else:
        _check_shape(out, shape, src.dtype)
    compute = _compute_dtype(src.dtype)
    # astype copies the crop into a contiguous HWC buffer, i.e. a channels-last NCHW
    # tensor: torch's float kernel was 10-30% faster on that than on planar CHW (C = 2-5).
    src_t = torch.from_numpy(src.astype(compute)).permute(2, 0, 1).unsqueeze(0)
    dst = out if out.dtype == compute else np.empty(shape, compute)
    dst_t = torch.from_numpy(dst).permute(2, 0, 1).unsqueeze(0)
    if AA_BILINEAR_OUT is not None:
        AA_BILINEAR_OUT(src_t, [oh, ow], False, None, None, out=dst_t)
    else:
        dst_t.copy_(torch.nn.functional.interpolate(src_t, size=(oh, ow), mode="bilinear", antialias=True))
    if dst is not out:
        if out.dtype.kind in "iu":
            info = np.iinfo(out.dtype)
            np.rint(dst, out=dst)
            np.clip(dst, info.min, info.max, out=dst)
        np.copyto(out, dst, casting="unsafe")
    return out


def _resize_window(img: np.ndarray, window: tuple[float, float, float, float], out_hw: tuple[int, int],
                   out: np.ndarray | None = None) -> np.ndarray:
    """Resize a fractional window (top, left, height, width in ``img`` pixels) to ``out_hw``.

    Used on a JPEG decoded at 1/f, where a crop box in source pixels falls between scaled
    pixels: snapping it to whole scaled pixels would shift each edge by up to f/2 source
    pixels, a visible misplacement (a mean 1-2 levels of 255 at 64 px output). PIL's
    ``resize(box=...)`` samples the exact window with the same BILINEAR filter as
    torchvision; its cost is small here because the scaled image is small.

    Only the whole pixels that the window touches are handed to PIL: torchvision crops
    before it resizes, so its filter never reaches pixels outside the box either.
    """
    top, left, h, w = window
    oh, ow = out_hw
    t, le = int(top), int(left)  # floor: windows start at >= 0
    b, r = min(math.ceil(top + h), img.shape[0]), min(math.ceil(left + w), img.shape[1])
    region = Image.fromarray(np.ascontiguousarray(img[t:b, le:r]))
    box = (left - le, top - t, min(left + w, r) - le, min(top + h, b) - t)
    return _emit(np.asarray(region.resize((ow, oh), Image.Resampling.BILINEAR, box=box)), out)


def _box_factor(box: Box, out_hw: tuple[int, int]) -> int:
    """Largest DCT factor at which the crop box keeps ``DCT_HEADROOM`` pixels per output pixel."""
    _, _, h, w = box
    for f in _DCT_FACTORS:
        if h >= DCT_HEADROOM * f * out_hw[0] and w >= DCT_HEADROOM * f * out_hw[1]:
            return f
    return 1


def _whole_factor(size: tuple[int, int], target_hw: tuple[int, int]) -> int:
    """Largest DCT factor whose scaled image keeps ``DCT_HEADROOM`` pixels per target pixel.

    Only factors dividing both sides: otherwise the last scaled row/column stands for a
    partial block and the whole image would come out stretched by up to one scaled pixel.
    """
    h, w = size
    for f in _DCT_FACTORS:
        exact = h % f == 0 and w % f == 0
        if exact and h // f >= DCT_HEADROOM * target_hw[0] and w // f >= DCT_HEADROOM * target_hw[1]:
            return f
    return 1


def _center_crop_into(img: np.ndarray, crop_hw: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
    """torchvision CenterCrop: offset int(round((size - crop) / 2)); zero-pad if smaller.
    Any dtype and channel count; the padding is 0 in every dtype, as torchvision's."""
    ch, cw = crop_hw
    h, w = img.shape[:2]
    shape = (ch, cw, img.shape[2])
    if out is None:
        out = np.zeros(shape, img.dtype) if (h < ch or w < cw) else np.empty(shape, img.dtype)
    else:
        _check_shape(out, shape, img.dtype)
        if h < ch or w < cw:
            out[...] = 0

    def span(size: int, crop: int) -> tuple[slice, slice]:
        if size >= crop:
            off = int(round((size - crop) / 2.0))
            return slice(off, off + crop), slice(0, crop)
        pad = (crop - size) // 2  # torchvision pads (crop - size) // 2 on the top/left
        return slice(0, size), slice(pad, pad + size)

    src_y, dst_y = span(h, ch)
    src_x, dst_x = span(w, cw)
    out[dst_y, dst_x] = img[src_y, src_x]
    return out


# -------------------------------------------------------------------------- helpers


def _pair(size, name: str) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        pair = (int(size), int(size))
    elif isinstance(size, Sequence) and len(size) == 2 and all(isinstance(s, (int, np.integer)) for s in size):
        pair = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{name} must be an int or a (height, width) pair of ints, got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return pair


def _shorter_side_hw(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """torchvision Resize(int): shorter side -> ``shorter``, longer side truncated."""
    h, w = size
    if w <= h:
        return int(shorter * h / w), shorter
    return shorter, int(shorter * w / h)


def _check_out(out: np.ndarray, mode: str = "RGB") -> None:
    """What can be checked of ``out`` before decoding; the channel count and dtype of a
    mode other than "RGB" are known only once the image is decoded (see :func:`_check_shape`)."""
    if mode == "RGB":
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 3 or out.shape[2] != 3:
            raise ValueError("out must be a HxWx3 uint8 numpy array")
    elif not isinstance(out, np.ndarray) or out.ndim != 3:
        raise ValueError(f"out must be a HxWxC numpy array in mode {mode!r} (C = 1 for one channel), "
                         f"got {getattr(out, 'shape', type(out))}")
    if not out.flags.writeable:
        raise ValueError("out must be writable")


# ----------------------------------------------------------------------- transforms


class DecodeTransform:
    """Interface of a decode-time transform: encoded bytes -> HxWxC array.

    In mode ``"RGB"`` the result is HxWx3 uint8; in ``"L"``, ``"RGBA"`` and
    ``"unchanged"`` HxWxC in the mode's dtype (see the module docstring).

    Attributes:
        output_size (tuple[int, int] | None): (H, W) when every output has that shape,
            else None.
    """

    output_size: tuple[int, int] | None = None

    def __call__(self, data: Buffer, rng: np.random.Generator | None = None, mode: str = "RGB") -> np.ndarray:
        """Decode ``data`` in read mode ``mode`` and return a new array.

        Args:
            data (bytes | bytearray | memoryview): an encoded image.
            rng (numpy.random.Generator | None): random stream; defaults to
                :func:`fastdata.reader.seeding.get_rng`.
            mode (str): a read mode of :mod:`fastdata.common.imagemodes`.

        Returns:
            numpy.ndarray: HxWx3 uint8 for ``"RGB"``, else HxWxC (C = 1 for one channel)
            in the mode's dtype; C-contiguous and writable.

        Raises:
            ValueError: an unknown ``mode``.
            fastdata.common.imageio.ImageDecodeError: undecodable data.
        """
        raise NotImplementedError

    def decode_into(self, data: Buffer, out: np.ndarray, rng: np.random.Generator | None = None,
                    mode: str = "RGB") -> None:
        """Write the result into ``out``, a preallocated view (a batch slot).

        This default copies :meth:`__call__`'s result; subclasses may write directly.

        Args:
            data (bytes | bytearray | memoryview): an encoded image.
            out (numpy.ndarray): writable, exactly the result's shape and dtype: HxWx3
                uint8 for ``"RGB"``, else HxWxC of the mode's dtype (C = 1 for one channel).
            rng (numpy.random.Generator | None): as for :meth:`__call__`.
            mode (str): a read mode of :mod:`fastdata.common.imagemodes`.

        Raises:
            ValueError: ``out`` is not writable or not of the result's shape and dtype
                (nothing is written then), or an unknown ``mode``.
        """
        _check_out(out, check_mode(mode, "mode"))
        # A subclass written before modes existed may take no ``mode``: "RGB" calls it as before.
        _emit(self(data, rng) if mode == "RGB" else self(data, rng, mode=mode), out)


def _rgb_is_unchanged(data: Buffer, mode: str) -> bool:
    """Whether ``data`` read "unchanged" is its RGB form: a colour JPEG the fast path decodes (its
    stored pixels are 8-bit RGB), which then keeps the DCT-scaled decode of the RGB path, or a
    raw-native PPM record, which then keeps its zero-copy view."""
    if mode != "unchanged":
        return False
    if _jpeg_size(data) is None:
        return ppm_header(data) is not None  # a raw-native record: 8-bit RGB as stored
    try:
        return simplejpeg.decode_jpeg_header(data)[2] != "Gray"
    except ValueError:
        return False


class _DirectTransform(DecodeTransform):
    """Shared plumbing: both entry points run ``_produce`` ("RGB") or ``_produce_native``
    (other modes), which may write into ``out``."""

    def __call__(self, data: Buffer, rng: np.random.Generator | None = None, mode: str = "RGB") -> np.ndarray:
        if check_mode(mode, "mode") == "RGB" or _rgb_is_unchanged(data, mode):
            return self._produce(data, rng, None)
        return self._produce_native(data, rng, None, mode)

    def decode_into(self, data: Buffer, out: np.ndarray, rng: np.random.Generator | None = None,
                    mode: str = "RGB") -> None:
        _check_out(out, check_mode(mode, "mode"))
        if self.output_size is not None and out.shape[:2] != self.output_size:
            raise ValueError(f"out has shape {out.shape} but this transform gives {self.output_size} x channels")
        if mode == "RGB" or (_rgb_is_unchanged(data, mode) and out.shape[2:] == (3,) and out.dtype == np.uint8):
            self._produce(data, rng, out)
        else:
            self._produce_native(data, rng, out, mode)

    def _produce(self, data: Buffer, rng: np.random.Generator | None, out: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def _produce_native(self, data: Buffer, rng: np.random.Generator | None, out: np.ndarray | None,
                        mode: str) -> np.ndarray:
        raise NotImplementedError


class RandomResizedCrop(_DirectTransform):
    """torchvision's ``RandomResizedCrop`` fused with decoding.

    Args:
        size (int | tuple[int, int]): output (H, W); an int gives a square.
        scale (tuple[float, float]): range of the crop area as a fraction of the image.
        ratio (tuple[float, float]): range of the crop aspect ratio (width / height),
            sampled log-uniformly.
        fast (bool): opt-in: decode JPEGs with libjpeg-turbo's fast IDCT and fast
            (non-interpolating) chroma upsampling. Measured on ~400x350 photo-like
            JPEGs: 7% less time per crop, crops differ from the accurate decode by a
            mean absolute 1.1 (0-255). Off by default: decoding is then identical to
            Pillow's before the crop.

    The crop box is sampled from the original image size exactly as torchvision does
    (see :meth:`get_params`). When a JPEG is decoded at a DCT scale 1/f, the exact
    (fractional) box is resampled from the scaled image, so the crop lands where
    torchvision's does.
    """

    output_size: tuple[int, int]  # always fixed: every crop is resized to it

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), fast: bool = False):
        self.output_size = _pair(size, "size")
        self.fast = bool(fast)
        scale = tuple(float(s) for s in scale)
        ratio = tuple(float(r) for r in ratio)
        if len(scale) != 2 or not 0.0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (min, max) with 0 < min <= max, got {scale!r}")
        if len(ratio) != 2 or not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {ratio!r}")
        self.scale = scale
        self.ratio = ratio
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def __repr__(self) -> str:
        return (f"RandomResizedCrop(size={self.output_size}, scale={self.scale}, ratio={self.ratio}, "
                f"fast={self.fast})")

    def get_params(self, height: int, width: int, rng: np.random.Generator) -> Box:
        """Sample a crop box for a ``height`` x ``width`` image.

        torchvision's algorithm: up to 10 attempts of area ~ U(scale) * image area and
        log aspect ratio ~ U(log ratio); the first box that fits is placed uniformly.
        Otherwise a centre crop of the whole image clamped to the ratio range.

        Returns:
            tuple[int, int, int, int]: (top, left, h, w) in pixels of the full image.
        """
        area = height * width
        (scale_lo, scale_hi), (ratio_lo, ratio_hi) = self.scale, self._log_ratio
        for _ in range(10):
            # rng.uniform(lo, hi) is lo + (hi - lo) * rng.random(), to the bit: the two draws taken in
            # one call, as Python floats (two uniform() calls cost three times as much, under the GIL)
            u_area, u_ratio = rng.random(2).tolist()
            target_area = area * (scale_lo + (scale_hi - scale_lo) * u_area)
            aspect_ratio = math.exp(ratio_lo + (ratio_hi - ratio_lo) * u_ratio)
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                return top, left, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _produce(self, data, rng, out):
        rng = get_rng() if rng is None else rng
        size = _jpeg_size(data)
        if size is not None:
            box = self.get_params(size[0], size[1], rng)
            factor = _box_factor(box, self.output_size)
            img = _decode_jpeg(data, size, factor, self.fast)
            if img is None and factor != 1:
                factor, img = 1, _decode_jpeg(data, size, 1, self.fast)
            if img is not None:
                top, left, h, w = box
                if factor != 1:
                    window = (top / factor, left / factor, h / factor, w / factor)
                    return _resize_window(img, window, self.output_size, out)
                return _resize(img[top : top + h, left : left + w], self.output_size, out)
        img = _pil_decode(data)
        if size is None or img.shape[:2] != size:
            box = self.get_params(img.shape[0], img.shape[1], rng)
        top, left, h, w = box
        return _resize(img[top : top + h, left : left + w], self.output_size, out)

    def _produce_native(self, data, rng, out, mode):
        rng = get_rng() if rng is None else rng
        img = _native_decode(data, mode)
        # Same draws as the "RGB" path for the same image size: the same box in every mode.
        top, left, h, w = self.get_params(img.shape[0], img.shape[1], rng)
        return _resize(img[top : top + h, left : left + w], self.output_size, out)


class CenterCrop(_DirectTransform):
    """torchvision's eval recipe ``Resize(resize)`` + ``CenterCrop(size)`` as one step.

    Args:
        size (int | tuple[int, int]): crop (H, W); an int gives a square. Images smaller
            than the crop are zero-padded, as torchvision does.
        resize (int | tuple[int, int] | None): an int resizes the shorter side to it
            (torchvision ``Resize(int)``), a pair to exactly (H, W); None crops the
            full-size image without resizing.
    """

    output_size: tuple[int, int]  # always fixed: the crop size

    def __init__(self, size, resize=None):
        self.output_size = _pair(size, "size")
        self.resize: int | tuple[int, int] | None
        if resize is None or isinstance(resize, (int, np.integer)):
            if resize is not None and (isinstance(resize, bool) or resize <= 0):
                raise ValueError(f"resize must be a positive int, a pair or None, got {resize!r}")
            self.resize = None if resize is None else int(resize)
        else:
            self.resize = _pair(resize, "resize")

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.output_size}, resize={self.resize})"

    def _target(self, size: tuple[int, int]) -> tuple[int, int] | None:
        if self.resize is None:
            return None
        if isinstance(self.resize, tuple):
            return self.resize
        return _shorter_side_hw(size, self.resize)

    def _produce(self, data, rng, out):
        size = _jpeg_size(data)
        img = None
        if size is not None:
            target = self._target(size)
            factor = 1 if target is None else _whole_factor(size, target)
            img = _decode_jpeg(data, size, factor)
            if img is None and factor != 1:
                img = _decode_jpeg(data, size, 1)
        if img is None:
            img = _pil_decode(data)
            target = self._target(img.shape[:2])
        if target is not None and img.shape[:2] != target:
            img = _resize(img, target)
        return _center_crop_into(img, self.output_size, out)

    def _produce_native(self, data, rng, out, mode):
        img = _native_decode(data, mode)
        target = self._target(img.shape[:2])
        if target is not None and img.shape[:2] != target:
            img = _resize(img, target)
        return _center_crop_into(img, self.output_size, out)


class Resize(_DirectTransform):
    """torchvision's ``Resize`` fused with decoding.

    Args:
        size (int | tuple[int, int]): an int resizes the shorter side to ``size`` (the
            longer side keeps the aspect ratio, truncated, as torchvision does); a pair
            gives exactly (H, W). ``output_size`` is None for an int.
    """

    def __init__(self, size):
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            if size <= 0:
                raise ValueError(f"size must be positive, got {size!r}")
            self.size: int | tuple[int, int] = int(size)
            self.output_size = None
        else:
            self.size = _pair(size, "size")
            self.output_size = self.size

    def __repr__(self) -> str:
        return f"Resize(size={self.size})"

    def _target(self, size: tuple[int, int]) -> tuple[int, int]:
        return self.size if isinstance(self.size, tuple) else _shorter_side_hw(size, self.size)

    def _produce(self, data, rng, out):
        size = _jpeg_size(data)
        img = None
        if size is not None:
            target = self._target(size)
            img = _decode_jpeg(data, size, _whole_factor(size, target))
            if img is None:
                img = _decode_jpeg(data, size, 1)
        if img is None:
            img = _pil_decode(data)
            target = self._target(img.shape[:2])
        if img.shape[:2] == target:
            # (a PPM record's pixels are a read-only view of the stored bytes: copied)
            return _emit(img, out) if out is not None or not img.flags.writeable else img
        return _resize(img, target, out)

    def _produce_native(self, data, rng, out, mode):
        img = _native_decode(data, mode)
        target = self._target(img.shape[:2])
        if img.shape[:2] == target:
            # decode_image's array is fresh, writable and C-contiguous (a 2-D one with an
            # axis appended still is): no copy needed.
            return _emit(img, out) if out is not None else img
        return _resize(img, target, out)


# ----------------------------------------------------------------------- on device


def _value_range(dtype: torch.dtype, value_range: Sequence[float] | None) -> tuple[float, float] | None:
    """(lo, hi) that maps to 0-1, or None for no scaling (float data taken as 0-1)."""
    if value_range is not None:
        try:
            lo, hi = (float(v) for v in value_range)
        except (TypeError, ValueError):
            raise ValueError(f"value_range must be a (lo, hi) pair of numbers, got {value_range!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise ValueError(f"value_range must be finite with lo < hi, got {value_range!r}")
        return lo, hi
    if dtype.is_floating_point:
        return None
    info = torch.iinfo(dtype)  # uint8: 0..255 as before; uint16: 0..65535; int16: -32768..32767
    return float(info.min), float(info.max)


def normalize_on_device(batch: torch.Tensor, mean: Sequence[float], std: Sequence[float], *,
                        value_range: Sequence[float] | None = None) -> torch.Tensor:
    """Convert an image batch to normalized float32 on the batch's own device.

    Args:
        batch (torch.Tensor): shape (N, C, H, W) or (C, H, W), on any device, of an
            integer dtype (uint8, uint16, int16, ...) or a float dtype. A channels-last
            view (e.g. an NHWC batch ``.permute(0, 3, 1, 2)``) is fine; the result keeps
            its memory format.
        mean (Sequence[float]): per-channel mean in 0-1 units (e.g. ImageNet's
            (0.485, 0.456, 0.406)).
        std (Sequence[float]): per-channel standard deviation in 0-1 units.
        value_range (Sequence[float] | None): keyword only: the (lo, hi) values that map
            to 0 and 1, ``(x - lo) / (hi - lo)``. Default: an integer dtype's full range
            (uint8 0..255, uint16 0..65535, int16 -32768..32767); float values are taken
            as already in 0-1 (not scaled). A 12-bit image in uint16 wants (0, 4095).

    Returns:
        torch.Tensor: float32 ``((batch - lo) / (hi - lo) - mean) / std``, same shape,
        device and memory format; a new tensor (a float32 batch is not modified).

    Raises:
        TypeError: ``batch`` is not a tensor, or is bool or complex.
        ValueError: wrong rank, mean/std without one positive entry per channel, or a bad
            ``value_range``.
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype == torch.bool or batch.dtype.is_complex:
        raise TypeError(f"batch must be an integer or float torch.Tensor, got {getattr(batch, 'dtype', type(batch))}")
    if batch.dim() not in (3, 4):
        raise ValueError(f"batch must be (N, C, H, W) or (C, H, W), got shape {tuple(batch.shape)}")
    channels = batch.shape[-3]
    # Checked on the host: a check on the device tensors would stall on a GPU sync.
    mean_l, std_l = [float(m) for m in mean], [float(s) for s in std]
    if len(mean_l) != channels or len(std_l) != channels:
        raise ValueError(f"mean and std need {channels} entries, got {len(mean_l)} and {len(std_l)}")
    if min(std_l) <= 0:
        raise ValueError(f"std entries must be positive, got {std_l}")
    scale = _value_range(batch.dtype, value_range)
    mean_t = torch.tensor(mean_l, dtype=torch.float32, device=batch.device).reshape(-1, 1, 1)
    std_t = torch.tensor(std_l, dtype=torch.float32, device=batch.device).reshape(-1, 1, 1)
    # One new float32 buffer (preserving the memory format), then in place. ``.float()`` of a
    # float32 tensor is the tensor itself, hence the copy. ``.float()`` is also what torch
    # supports for uint16/uint32 (most arithmetic on them is not implemented).
    x = batch.to(torch.float32, copy=True) if batch.dtype == torch.float32 else batch.float()
    if scale is not None:
        lo, hi = scale
        if lo != 0.0:
            x.sub_(lo)
        # uint8 by default: div_(255.0) then mean and std, the same operations as before modes.
        x.div_(hi - lo)
    return x.sub_(mean_t).div_(std_t)
