"""Stored bytes -> PIL image / numpy array / tensor, in an image read mode.

Read modes (:mod:`fastdata.common.imagemodes`): ``"RGB"`` (the default for a field named
``image``) is pixel-identical to ImageFolder's loader, ``Image.open(f).convert("RGB")``.
JPEGs go through libjpeg-turbo via simplejpeg straight into numpy (no PIL object, ~1.6x
faster); the tests check this is bit-identical to Pillow. CMYK/YCCK JPEGs (Pillow
applies its own CMYK->RGB formula), JPEGs over Pillow's decompression-bomb limit and
every non-JPEG format go through Pillow. ``"L"``/``"RGBA"`` are Pillow's conversions;
``"unchanged"`` gives the pixels as stored (own dtype and channels; numpy ``HxW`` for one
channel, else ``HxWxC``), through :func:`fastdata.common.imageio.decode_image`.

Every decode follows :mod:`fastdata.common.imageio`'s policy: the bytes' content picks
the decoder among a fixed allow-list (a record's format field cannot choose
another decoder, and a record whose field says JPEG but holds PNG bytes decodes
as the PNG it is, on every read path), and decompression bombs are refused.
"""

from __future__ import annotations

import numpy as np
import simplejpeg
import torch
from PIL import Image

from fastdata.common.imageio import (
    decode_image,
    decode_pil_image,
    decode_rgb_array,
    decode_unchanged_into,
    fast_jpeg_size,
    ppm_pixels,
)
from fastdata.errors import ImageModeError


def _raw_pixels(data: bytes, raw_shape: tuple[int, int] | None) -> np.ndarray:
    if raw_shape is None:
        raise ValueError("a RAW record needs raw_shape=(H, W): the store's storage.raw_shape")
    h, w = raw_shape
    return np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3).copy()


def decode_pil(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None, mode: str = "RGB") -> Image.Image:
    """A PIL image in read mode ``mode``: for ``"RGB"`` exactly what ImageFolder's loader returns;
    for ``"unchanged"`` the PIL mode that holds the stored pixels losslessly. ImageModeError (not
    damage) where the mode has no form of the image: a 5-band TIFF in ``"RGB"``, 16-bit RGB unchanged."""
    if fmt == "RAW":
        image = Image.fromarray(_raw_pixels(data, raw_shape))
        return image if mode in ("RGB", "unchanged") else image.convert(mode)
    return decode_pil_image(data, mode)


def decode_numpy(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None, mode: str = "RGB") -> np.ndarray:
    """A writable array in read mode ``mode``: HWC uint8 RGB for ``"RGB"`` (pixel-identical to
    :func:`decode_pil`); ``HxW`` for one channel (``"L"``, a grayscale image unchanged), else
    ``HxWxC`` in the stored dtype."""
    if fmt == "RAW":
        pixels = _raw_pixels(data, raw_shape)
        return pixels if mode in ("RGB", "unchanged") else np.array(Image.fromarray(pixels).convert(mode))
    if mode != "RGB":
        return decode_image(data, mode)
    if fast_jpeg_size(data) is not None:
        try:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # let Pillow decide and produce its own error
    return decode_rgb_array(data)


def decode_numpy_into(data: bytes, fmt: str, out: np.ndarray, raw_shape: tuple[int, int] | None = None,
                      mode: str = "RGB") -> None:
    """Decode like :func:`decode_numpy` straight into ``out`` (a C-contiguous HxWxC view of the
    batch's dtype, e.g. one slot of a batch array; C = 1 for a one-channel image). Raises
    ValueError when the image's size, channels or dtype differ from ``out``'s."""
    if mode == "RGB" and fmt != "RAW" and out.flags.c_contiguous and out.dtype == np.uint8 and \
            fast_jpeg_size(data) == out.shape[:2] and out.shape[2:] == (3,):
        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
            return
        except ValueError:
            pass
    if mode == "unchanged" and fmt != "RAW" and out.flags.c_contiguous and decode_unchanged_into(data, out):
        return
    if mode in ("RGB", "unchanged") and fmt == "PPM":
        pixels = ppm_pixels(data)  # a raw-native record: its pixels straight into ``out``, one copy
        if pixels is not None and pixels.shape == out.shape and out.dtype == np.uint8:
            out[...] = pixels
            return
    array = decode_numpy(data, fmt, raw_shape, mode)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.shape != out.shape or array.dtype != out.dtype:
        raise ValueError(f"image is {array.shape[1]}x{array.shape[0]} with {array.shape[2]} channel(s) of "
                         f"{array.dtype}, the index says {out.shape[1]}x{out.shape[0]} with {out.shape[2]} of "
                         f"{out.dtype}")
    out[...] = array


def pil_of(array: np.ndarray) -> Image.Image:
    """An HxW/HxWxC array (a decode transform's output) as a PIL image in the mode that holds it
    losslessly (L, LA, RGB, RGBA for uint8; I;16, I, F for one channel of uint16, int32, float32).

    Raises:
        ImageModeError: no PIL mode holds it (e.g. 16-bit RGB, 5 channels): use output="numpy" or "tensor".
    """
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    channels = 1 if array.ndim == 2 else array.shape[2]
    if (array.dtype == np.uint8 and channels <= 4) or (
            channels == 1 and array.dtype in (np.uint16, np.int32, np.float32)):
        return Image.fromarray(np.ascontiguousarray(array))
    raise ImageModeError(f"PIL has no mode for a {array.dtype} image of {channels} channel(s); use output='numpy' "
                         "or output='tensor'")


#: the name earlier versions gave :func:`pil_of`
to_pil = pil_of


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """An HxW or HxWxC array as a CxHxW tensor of its dtype (a view: no copy)."""
    if image.ndim == 2:
        return torch.from_numpy(image).unsqueeze(0)
    return torch.from_numpy(image).permute(2, 0, 1)


def squeezed(image: np.ndarray, mode: str) -> np.ndarray:
    """A decode transform's HxWxC output as the dataset gives it for ``output="numpy"``: HxW for one
    channel outside RGB mode (as a full decode gives it), else unchanged."""
    if mode != "RGB" and image.ndim == 3 and image.shape[2] == 1:
        return image[:, :, 0]
    return image
