"""Native-image fixtures for the writer, CLI and tools tests: deep PNGs, DICOM files (built
with pydicom), and a store's records read back with their index dtype and channels."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from helpers.native_images import dicom, pixels
from helpers.stores import general_records, store_records


def ramp(shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` spanning the dtype's range (so that a reduction to 8
    bits, a sign or a byte-order slip shows), deterministic for ``seed``: HxW or HxWxC."""
    channels = 1 if len(shape) == 2 else shape[2]
    return pixels(dtype, channels, seed, shape=tuple(shape[:2]))


def write_png16(path, shape=(12, 10), seed: int = 0) -> np.ndarray:
    """A 16-bit grayscale PNG at ``path`` (with cv2); returns its pixels."""
    import cv2

    pixels = ramp(shape, np.uint16, seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), pixels)
    return pixels


def write_dicom(path, pixels: np.ndarray | None = None, *, seed: int = 0, slope: float = 1.0,
                intercept: float = -1024.0, photometric: str = "MONOCHROME2", spacing=(0.5, 0.5)) -> np.ndarray:
    """A small CT-like DICOM file (uncompressed, explicit VR little endian, built with pydicom by
    :func:`tests.helpers.native_images.dicom`): 16-bit signed (int16) or unsigned (uint16)
    monochrome pixels. Returns the pixels stored."""
    if pixels is None:
        pixels = ramp((16, 12), np.int16, seed) // 16
    data = dicom(pixels, RescaleSlope=slope, RescaleIntercept=intercept, PhotometricInterpretation=photometric,
                 PixelSpacing=list(spacing))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    return pixels


def dicom_tree(root, classes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """A class-folder tree of DICOM files (``{class: count}``); returns ``{relpath: pixels}``."""
    out = {}
    for ci, (cls, n) in enumerate(sorted(classes.items())):
        for i in range(n):
            rel = os.path.join(cls, f"slice{i:03d}.dcm")
            out[rel] = write_dicom(Path(root) / rel, seed=seed + 100 * ci + i, slope=1.0 + i, intercept=-1024.0)
    return out


def v1_records(dst) -> list[dict]:
    """A classification store's records in store order (:func:`helpers.stores.store_records`): stored
    bytes, format, dtype and channels (``None``: not recorded), label, relpath."""
    return store_records(dst)[1]


def v2_records(dst) -> list[dict]:
    """A general store's records in store order: decoded record fields plus, per image field
    ``name``, its stored bytes and ``name.format|.dtype|.channels`` from the index (names, not codes)."""
    from fastdata.format.manifest import read_manifest, schema_of
    from fastdata.format.record import FORMAT_NAMES, IMAGE_DTYPE_NAMES

    schema = schema_of(read_manifest(str(dst)))
    out = general_records(dst, index=True)
    for rec in out:
        for name in schema.image_fields():
            rec[f"{name}.format"] = FORMAT_NAMES[rec[f"{name}.format"]]
            rec[f"{name}.dtype"] = IMAGE_DTYPE_NAMES.get(rec[f"{name}.dtype"])
    return out
