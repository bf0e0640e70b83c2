"""Stored bytes -> PIL image / numpy array / tensor.

The default decode is pixel-identical to ImageFolder's loader,
``Image.open(f).convert("RGB")``. JPEGs go through libjpeg-turbo via simplejpeg
straight into numpy (no PIL object, ~1.6x faster); the tests check this is
bit-identical to Pillow. CMYK/YCCK JPEGs (Pillow applies its own CMYK->RGB
formula), JPEGs over Pillow's decompression-bomb limit and every non-JPEG format
go through Pillow.

Every decode follows :mod:`fastdata.common.imageio`'s policy: the bytes' content picks
the decoder among a fixed allow-list (a record's format field cannot choose
another decoder, and a record whose field says JPEG but holds PNG bytes decodes
as the PNG it is, on every read path), and decompression bombs are refused.
"""

from __future__ import annotations

import numpy as np
import simplejpeg
from PIL import Image

from fastdata.common.imageio import decode_rgb_array, fast_jpeg_size, open_image


def decode_pil(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None) -> Image.Image:
    """An RGB PIL image, exactly what ImageFolder's loader returns."""
    if fmt == "RAW":
        return Image.fromarray(decode_numpy(data, fmt, raw_shape))
    return open_image(data).convert("RGB")


def decode_numpy(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None) -> np.ndarray:
    """HWC uint8 RGB array (writable), pixel-identical to :func:`decode_pil`."""
    if fmt == "RAW":
        if raw_shape is None:
            raise ValueError("a RAW record needs raw_shape=(H, W): the store's storage.raw_shape")
        h, w = raw_shape
        return np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3).copy()
    if fast_jpeg_size(data) is not None:
        try:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # let Pillow decide and produce its own error
    return decode_rgb_array(data)


def decode_numpy_into(data: bytes, fmt: str, out: np.ndarray, raw_shape: tuple[int, int] | None = None) -> None:
    """Decode like :func:`decode_numpy` straight into ``out`` (a C-contiguous HxWx3
    uint8 view, e.g. one slot of a batch array). Raises ValueError on a size mismatch."""
    if fmt != "RAW" and out.flags.c_contiguous and fast_jpeg_size(data) == out.shape[:2] and out.shape[2:] == (3,):
        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
            return
        except ValueError:
            pass
    array = decode_numpy(data, fmt, raw_shape)
    if array.shape != out.shape:
        raise ValueError(f"image is {array.shape[1]}x{array.shape[0]}, expected {out.shape[1]}x{out.shape[0]}")
    out[...] = array


def to_pil(array):
    """An HWC/HW uint8 array as a PIL image (Pillow imported on first use)."""
    from PIL import Image

    return Image.fromarray(array)
