"""Real NIfTI files (nibabel) and tiled TIFF files (tifffile) for the volume/large-image convert tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def volume(i: int, shape, dtype="int16") -> np.ndarray:
    """Volume ``i``: smooth structure plus noise (compresses as scans do), distinct per ``i``, using
    the dtype's range (negative values for signed types)."""
    rng = np.random.default_rng(1000 + i)
    grid = np.indices(shape, dtype=np.float64).sum(axis=0) * (3 + i)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (grid / 7.0 + rng.standard_normal(shape)).astype(dtype)
    top = min(np.iinfo(dtype).max, 4000)
    low = -1000 if dtype.kind == "i" else 0
    return ((grid + rng.integers(0, 50, shape)) % (top - low) + low).astype(dtype)


def label_of(image: np.ndarray, classes: int = 3) -> np.ndarray:
    """A uint8 label volume of ``image``'s shape (thresholds of its values: 0 .. classes-1)."""
    edges = np.quantile(image, np.linspace(0, 1, classes + 1)[1:-1])
    return np.digitize(image, edges).astype(np.uint8)


def affine_of(i: int) -> np.ndarray:
    """A distinct, non-diagonal affine (voxel sizes 0.5+i/10, 0.8, 2.5, rotated, shifted)."""
    zooms = np.diag([0.5 + i / 10, 0.8, 2.5])
    c, s = np.cos(0.3), np.sin(0.3)
    rot = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])
    out = np.eye(4)
    out[:3, :3] = rot @ zooms
    out[:3, 3] = [-100.0 + i, 20.5, 7.25]
    return out


def write_nifti(path: str | os.PathLike, array: np.ndarray, affine: np.ndarray | None = None,
                slope: float | None = None, inter: float | None = None) -> Path:
    """``array`` written by nibabel as NIfTI-1 at ``path`` (``.nii`` or ``.nii.gz``), with scaling
    ``slope``/``inter`` in the header when given."""
    import nibabel as nib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img = nib.Nifti1Image(array, np.eye(4) if affine is None else affine, dtype=array.dtype)
    if slope is not None or inter is not None:
        img.header.set_slope_inter(1.0 if slope is None else slope, 0.0 if inter is None else inter)
    img.to_filename(str(path))
    return path


def raw_values(path: str | os.PathLike) -> np.ndarray:
    """The stored (unscaled) values of a NIfTI file, as nibabel reads them."""
    import nibabel as nib

    return np.asanyarray(nib.load(str(path)).dataobj.get_unscaled())


def truncate(path: str | os.PathLike, keep: float = 0.6) -> Path:
    """Cut ``path`` to ``keep`` of its bytes (a download that stopped)."""
    path = Path(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def image(i: int, shape, dtype="uint8") -> np.ndarray:
    """An image ``i`` of ``shape`` (H, W) or (H, W, C): gradients plus noise, distinct per ``i``."""
    rng = np.random.default_rng(2000 + i)
    dtype = np.dtype(dtype)
    top = np.iinfo(dtype).max
    h, w = shape[:2]
    base = (np.add.outer(np.arange(h) * (i + 1), np.arange(w) * 2) % (top + 1)).astype(np.int64)
    if len(shape) == 3:
        base = base[..., None] + np.arange(shape[2]) * 40
    return ((base + rng.integers(0, 9, shape)) % (top + 1)).astype(dtype)


def write_tiff(path: str | os.PathLike, array: np.ndarray, **options) -> Path:
    """``array`` written by tifffile at ``path`` (``tile=(256, 256)``, ``compression="zlib"``, ...)."""
    import tifffile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(str(path), array, **options)
    return path
