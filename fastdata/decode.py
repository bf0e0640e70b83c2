"""Stored bytes -> PIL image / numpy array / tensor.

The default decode is pixel-identical to ImageFolder's loader,
``Image.open(f).convert("RGB")``. JPEGs go through libjpeg-turbo via simplejpeg
straight into numpy (no PIL object, ~1.6x faster); the tests check this is
bit-identical to Pillow. CMYK/YCCK JPEGs (Pillow applies its own CMYK->RGB
formula) and every non-JPEG format fall back to Pillow.

Pillow is only ever allowed the one format the store recorded for the sample
(``formats=[fmt]``), so a record cannot smuggle in another decoder.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import simplejpeg
from PIL import Image

#: simplejpeg colourspaces whose RGB output equals Pillow's convert("RGB")
_SIMPLEJPEG_SAFE = {"RGB", "YCbCr", "Gray"}


def open_pil(data: bytes, fmt: str) -> Image.Image:
    """Open and fully load ``data`` as format ``fmt`` (decompression bombs raise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        im = Image.open(io.BytesIO(data), formats=[fmt])
        im.load()
    return im


def decode_pil(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None) -> Image.Image:
    """An RGB PIL image, exactly what ImageFolder's loader returns."""
    if fmt == "RAW":
        return Image.fromarray(decode_numpy(data, fmt, raw_shape))
    return open_pil(data, fmt).convert("RGB")


def decode_numpy(data: bytes, fmt: str, raw_shape: tuple[int, int] | None = None) -> np.ndarray:
    """HWC uint8 RGB array (writable), pixel-identical to :func:`decode_pil`."""
    if fmt == "RAW":
        h, w = raw_shape
        return np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3).copy()
    if fmt == "JPEG":
        try:
            _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in _SIMPLEJPEG_SAFE:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # let Pillow decide and produce its own error
    # np.array, not np.asarray: Pillow's array interface hands out read-only bytes,
    # and torch.from_numpy on a read-only array warns (writes would be undefined)
    return np.array(open_pil(data, fmt).convert("RGB"))


def decode_numpy_into(data: bytes, fmt: str, out: np.ndarray, raw_shape: tuple[int, int] | None = None) -> None:
    """Decode like :func:`decode_numpy` straight into ``out`` (a C-contiguous HxWx3
    uint8 view, e.g. one slot of a batch array). Raises ValueError on a size mismatch."""
    if fmt == "JPEG" and out.flags.c_contiguous:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in _SIMPLEJPEG_SAFE and out.shape == (h, w, 3):
                simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
                return
        except ValueError:
            pass
    array = decode_numpy(data, fmt, raw_shape)
    if array.shape != out.shape:
        raise ValueError(f"image is {array.shape[1]}x{array.shape[0]}, expected {out.shape[1]}x{out.shape[0]}")
    out[...] = array
