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
    return np.asarray(open_pil(data, fmt).convert("RGB"))


def hwc_to_chw_tensor(array: np.ndarray):
    """uint8 HWC numpy -> uint8 CHW torch tensor (a view, no copy)."""
    import torch

    return torch.from_numpy(array).permute(2, 0, 1)
