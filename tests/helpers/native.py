"""Native-image fixtures for the writer, CLI and tools tests: deep PNGs, DICOM files (built
with pydicom), and a store's records read back with their index dtype and channels."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from helpers.native_images import dicom, pixels


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
    """A classification store's records in store order: stored bytes, format, dtype and channels
    (``None``: not recorded), relpath."""
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest
    from fastdata.format.record import FORMAT_NAMES, IMAGE_DTYPE_NAMES

    manifest = read_manifest(str(dst))
    storage = StorageSpec.from_json(manifest["storage"])
    out = []
    for shard in manifest["shards"]:
        with reader_class(manifest["backend"])(os.path.join(str(dst), shard["name"]), storage) as reader:
            index = reader.read_index()
            for i in range(len(index)):
                out.append({"image": reader.get(i), "fmt": FORMAT_NAMES[int(index.formats[i])],
                            "dtype": IMAGE_DTYPE_NAMES.get(int(index.dtypes[i])),
                            "channels": int(index.channels[i]) or None, "label": int(index.labels[i]),
                            "relpath": os.fsdecode(index.relpath(i))})
    return out


def v2_records(dst) -> list[dict]:
    """A general store's records in store order: decoded record fields plus, per image field
    ``name``, its stored bytes and ``name.format|.dtype|.channels`` from the index."""
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest, schema_of
    from fastdata.format.record import FIELD_PREFIX, FORMAT_NAMES, IMAGE_DTYPE_NAMES, decode_record_v2

    manifest = read_manifest(str(dst))
    schema = schema_of(manifest)
    out = []
    for shard in manifest["shards"]:
        with reader_class(manifest["backend"])(os.path.join(str(dst), shard["name"]), StorageSpec(),
                                               schema=schema) as reader:
            index = reader.read_index()
            for i in range(shard["count"]):
                rec = decode_record_v2(reader.get(i), schema, where="test")
                for key, arr in index.arrays.items():
                    if key.startswith(FIELD_PREFIX):
                        rec[key[len(FIELD_PREFIX):]] = arr[i].tolist() if arr.ndim > 1 else arr[i].item()
                for name in schema.image_fields():
                    rec[f"{name}.format"] = FORMAT_NAMES[rec[f"{name}.format"]]
                    rec[f"{name}.dtype"] = IMAGE_DTYPE_NAMES.get(rec[f"{name}.dtype"])
                out.append(rec)
    return out
