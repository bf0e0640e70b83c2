"""Synthetic images with their native bit depth and bands: CT-like 16-bit grayscale PNGs and
satellite-like multi-band uint16 TIFFs, for the example, the tests and the benchmarks.

:func:`make_ct_folder` writes an ImageFolder tree of 16-bit grayscale PNGs that look like
axial CT slices to a PNG codec: values are Hounsfield units offset by 1024 (air about 24,
fat about 924, soft tissue 1040-1090, bone 1400-2600), within the 12-bit range 0-4095 that
CT scanners store in uint16; a body ellipse with a fat layer, organs, lungs in some classes,
a bone ring and a spine, edges softened as a reconstruction kernel does, and correlated
noise of 8-14 HU. Noise matters: a flat phantom compresses to a few KB and makes every
decode benchmark a lie; these files are 200-240 KB at 512x512, like exported CT PNGs.

:func:`make_multiband_folder` writes ImageFolder trees of ``bands``-band uint16 TIFFs
(channels last, deflate-compressed, as GeoTIFF tiles usually are) that look like
surface-reflectance tiles (Sentinel-2-like scale, 0-10000): land-cover patches, water with
a low near-infrared band, roads.

Every output is a pure function of the seed: the same call writes the same bytes, whatever
the number of workers.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fastdata.common.extras import require
from fastdata.tools.synth import SynthSummary, class_paths, write_all

cv2 = require("cv2", "synthetic images (fastdata.tools.synth_native)")

__all__ = [
    "CT_MAX", "make_ct_folder", "make_multiband_folder", "render_ct", "render_multiband",
    "synth_ct_png", "synth_multiband_tiff",
]

#: the largest stored CT value (12-bit data in uint16, as scanners store it)
CT_MAX = 4095
_HU_OFFSET = 1024  # stored value = HU + 1024: air (-1000 HU) is 24, water (0 HU) 1024
#: zlib level of the PNGs: 6 is libpng's and Pillow's default, what most exported CT PNGs use
_PNG_LEVEL = 6


def _hu(value: float) -> float:
    return float(value + _HU_OFFSET)


def _ellipse(img: np.ndarray, centre: tuple[float, float], axes: tuple[float, float], angle: float,
             value: float, thickness: int = -1) -> None:
    # cv2 draws at integer coordinates; a fill of -1 is a solid ellipse, else a ring
    cv2.ellipse(img, (round(centre[0]), round(centre[1])), (max(1, round(axes[0])), max(1, round(axes[1]))),
                angle, 0, 360, value, thickness, cv2.LINE_AA)


def render_ct(rng: np.random.Generator, h: int, w: int, class_index: int = 0) -> np.ndarray:
    """One CT-like axial slice.

    Args:
        rng (numpy.random.Generator): the only source of randomness (the image is a pure
            function of its state).
        h (int): height in pixels.
        w (int): width in pixels.
        class_index (int): even classes are chest-like (lungs), odd ones abdomen-like
            (more organs, no lungs), so that classes differ.

    Returns:
        numpy.ndarray: uint16 of shape (h, w), values within 0-:data:`CT_MAX`.
    """
    s = min(h, w) / 512.0  # every size below is given for 512x512 and scaled
    img = np.full((h, w), _hu(-1000), np.float32)
    cx, cy = w / 2 + rng.uniform(-12, 12) * s, h / 2 + rng.uniform(-10, 10) * s
    ax, ay = rng.uniform(175, 215) * s, rng.uniform(130, 165) * s
    tilt = float(rng.uniform(-4, 4))
    # subcutaneous fat, then muscle and soft tissue inside it
    _ellipse(img, (cx, cy), (ax, ay), tilt, _hu(rng.uniform(-110, -80)))
    fat = rng.uniform(10, 22) * s
    _ellipse(img, (cx, cy), (ax - fat, ay - fat), tilt, _hu(rng.uniform(35, 50)))
    chest = class_index % 2 == 0
    if chest:
        for side in (-1, 1):
            lx = cx + side * ax * rng.uniform(0.38, 0.48)
            _ellipse(img, (lx, cy - ay * 0.05), (ax * rng.uniform(0.28, 0.34), ay * rng.uniform(0.55, 0.68)),
                     float(rng.uniform(-10, 10)), _hu(rng.uniform(-870, -820)))
        _ellipse(img, (cx + ax * 0.08, cy + ay * 0.05), (ax * 0.22, ay * 0.32), float(rng.uniform(-20, 20)),
                 _hu(rng.uniform(35, 45)))  # heart
    organs = int(rng.integers(2, 4)) if chest else int(rng.integers(4, 7))
    for _ in range(organs):
        ox, oy = cx + rng.uniform(-0.5, 0.5) * ax, cy + rng.uniform(-0.45, 0.35) * ay
        _ellipse(img, (ox, oy), (rng.uniform(18, 60) * s, rng.uniform(14, 45) * s), float(rng.uniform(0, 180)),
                 _hu(rng.uniform(20, 75)))
    # a few small lesions or vessels: bright (contrast) or dark
    for _ in range(int(rng.integers(1, 5))):
        ox, oy = cx + rng.uniform(-0.6, 0.6) * ax, cy + rng.uniform(-0.5, 0.4) * ay
        _ellipse(img, (ox, oy), (rng.uniform(3, 9) * s,) * 2, 0.0, _hu(rng.uniform(-20, 180)))
    # bone: a broken ring of ribs near the body wall, then the spine behind
    ring = (ax - fat - rng.uniform(8, 14) * s, ay - fat - rng.uniform(8, 14) * s)
    thick = max(1, round(rng.uniform(4, 7) * s))
    start = float(rng.uniform(0, 30))
    for arc in range(10):
        a0 = start + arc * 36
        cv2.ellipse(img, (round(cx), round(cy)), (round(ring[0]), round(ring[1])), tilt, a0, a0 + 22,
                    _hu(rng.uniform(700, 1100)), thick, cv2.LINE_AA)
    sy = cy + ay * rng.uniform(0.55, 0.65)
    _ellipse(img, (cx, sy), (22 * s, 19 * s), 0.0, _hu(rng.uniform(900, 1500)))  # cortical shell
    _ellipse(img, (cx, sy), (15 * s, 12 * s), 0.0, _hu(rng.uniform(250, 400)))  # cancellous core
    _ellipse(img, (cx, sy - 30 * s), (9 * s, 8 * s), 0.0, _hu(rng.uniform(5, 15)))  # spinal canal
    # a little texture inside the body (parenchyma), then the reconstruction kernel's blur
    texture = cv2.resize(rng.standard_normal((h // 16, w // 16), dtype=np.float32), (w, h),
                         interpolation=cv2.INTER_CUBIC)
    img = cv2.scaleAdd(texture, float(rng.uniform(4, 8)), img)
    img = cv2.GaussianBlur(img, (0, 0), 1.1 * s)
    # quantum noise, correlated over a pixel or two as reconstructed CT noise is
    noise = cv2.GaussianBlur(rng.standard_normal((h, w), dtype=np.float32), (0, 0), 0.7)
    img = cv2.scaleAdd(noise, float(rng.uniform(8, 14)) * 2.0, img)  # x2: the blur above halves the std
    return np.clip(np.rint(img), 0, CT_MAX).astype(np.uint16)


def encode_png16(img: np.ndarray) -> bytes:
    """PNG bytes (16-bit grayscale, zlib level 6) of a uint16 (h, w) array."""
    if img.dtype != np.uint16 or img.ndim != 2:
        raise ValueError(f"need a uint16 (h, w) array, got {img.dtype} {img.shape}")
    ok, buf = cv2.imencode(".png", img, [cv2.IMWRITE_PNG_COMPRESSION, _PNG_LEVEL])
    if not ok:  # cv2 reports failure by return value, not exception
        raise RuntimeError("cv2.imencode failed to encode a synthetic 16-bit PNG")
    return buf.tobytes()


def synth_ct_png(seed: int, class_index: int, image_index: int, size: tuple[int, int] = (512, 512)) -> bytes:
    """The PNG bytes of one CT-like slice (:func:`render_ct`), a pure function of its arguments.

    Args:
        seed (int): dataset seed.
        class_index (int): class number (chest-like when even, abdomen-like when odd).
        image_index (int): index within the class.
        size (tuple[int, int]): (height, width).

    Returns:
        bytes: a 16-bit grayscale PNG.
    """
    rng = np.random.default_rng([seed, class_index, image_index, 0xC7])
    return encode_png16(render_ct(rng, int(size[0]), int(size[1]), class_index))


def render_multiband(rng: np.random.Generator, h: int, w: int, bands: int = 4, class_index: int = 0) -> np.ndarray:
    """One satellite-like tile of surface reflectance (scale 0-10000).

    Args:
        rng (numpy.random.Generator): the only source of randomness.
        h (int): height in pixels.
        w (int): width in pixels.
        bands (int): number of bands (>= 1); the first four are blue, green, red and near
            infrared, any further ones short-wave-infrared-like.
        class_index (int): shifts the mix of land covers (more water, vegetation or bare
            soil), so that classes differ.

    Returns:
        numpy.ndarray: uint16 of shape (h, w, bands).
    """
    # reflectance of each land cover in B, G, R, NIR, SWIR (x 10000)
    covers = np.array([[400, 600, 450, 3200, 1800],     # vegetation
                       [900, 1100, 1300, 2200, 2800],   # bare soil
                       [700, 600, 300, 150, 80],        # water
                       [1200, 1250, 1300, 1700, 2000]], np.float32)  # built-up
    weights = np.array([3.0, 2.0, 1.0, 1.0], np.float32)
    weights[class_index % 4] += 3.0
    cells = (max(2, h // 24), max(2, w // 24))
    labels = rng.choice(4, size=cells, p=weights / weights.sum()).astype(np.uint8)
    # nearest-neighbour upscaling gives the field boundaries; a slight blur the sensor's PSF
    cover = cv2.resize(labels, (w, h), interpolation=cv2.INTER_NEAREST)
    table = np.stack([covers[:, min(b, covers.shape[1] - 1)] for b in range(bands)], axis=1)
    img = table[cover]  # (h, w, bands)
    for _ in range(int(rng.integers(1, 4))):  # roads
        p0 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        mask = np.zeros((h, w), np.uint8)
        cv2.line(mask, p0, p1, 1, int(rng.integers(1, 4)))
        img[mask.astype(bool)] = table[3] * 1.1
    shade = cv2.resize(rng.standard_normal((max(2, h // 32), max(2, w // 32)), dtype=np.float32), (w, h),
                       interpolation=cv2.INTER_CUBIC)
    img *= (1.0 + 0.08 * shade)[:, :, None]  # within-field variation and terrain shading
    img = cv2.GaussianBlur(img, (0, 0), 0.6).reshape(h, w, bands)
    img += rng.standard_normal((h, w, bands), dtype=np.float32) * 40.0  # sensor noise
    return np.clip(np.rint(img), 0, 10000).astype(np.uint16)


def encode_tiff(img: np.ndarray, compression: str | None = "zlib") -> bytes:
    """TIFF bytes of an (h, w) or (h, w, bands) array, channels interleaved (``planarconfig=contig``).

    Args:
        img (numpy.ndarray): the pixels, any dtype tifffile writes; (h, w, 1) is stored as (h, w).
        compression (str | None): tifffile's compression name (``"zlib"`` = deflate, as most
            GeoTIFFs; ``"zstd"``; None).

    Returns:
        bytes: the file.
    """
    tifffile = _tifffile()
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[:, :, 0]  # one band is a plain grayscale page: what every TIFF reader expects
    buf = io.BytesIO()
    tifffile.imwrite(buf, np.ascontiguousarray(img), photometric="minisblack",
                     planarconfig="contig" if img.ndim == 3 else None, compression=compression, metadata=None)
    return buf.getvalue()


def synth_multiband_tiff(seed: int, class_index: int, image_index: int, size: tuple[int, int] = (256, 256),
                         bands: int = 4) -> bytes:
    """The TIFF bytes of one satellite-like tile (:func:`render_multiband`), a pure function of its arguments.

    Args:
        seed (int): dataset seed.
        class_index (int): class number.
        image_index (int): index within the class.
        size (tuple[int, int]): (height, width).
        bands (int): number of bands.

    Returns:
        bytes: a deflate-compressed uint16 TIFF of shape (h, w, bands) ((h, w) for one band).
    """
    rng = np.random.default_rng([seed, class_index, image_index, 0x5A7])
    return encode_tiff(render_multiband(rng, int(size[0]), int(size[1]), bands, class_index))


def _tifffile():
    try:
        import imagecodecs  # noqa: F401 - tifffile's deflate/zstd codecs
        import tifffile
    except ImportError as err:
        raise ImportError("synthetic TIFFs need tifffile and imagecodecs: pip install 'fastdata[images]'") from err
    return tifffile


# --------------------------------------------------------------------------- folders


def _write_one(task: tuple) -> int:
    path, make, args = task
    data = make(*args)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _write_tree(root: str | os.PathLike, num_classes: int, per_class: int, ext: str,
                make: Callable[..., bytes], extra: tuple, seed: int, workers: int) -> SynthSummary:
    if num_classes < 1 or per_class < 1:
        raise ValueError("num_classes and per_class must be >= 1")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    t0 = time.perf_counter()
    root_path = Path(root)
    tasks = [(path, make, (seed, ci, ii) + extra) for path, ci, ii in class_paths(root_path, num_classes, per_class,
                                                                                   ext)]
    # each image is a pure function of (seed, class, index): the order workers take them in is irrelevant
    sizes = write_all(_write_one, tasks, workers)
    return SynthSummary(root=str(root_path), num_classes=num_classes, per_class=per_class, num_images=len(tasks),
                        total_bytes=int(sum(sizes)), elapsed_s=time.perf_counter() - t0)


def _check_size(size: Sequence[int]) -> tuple[int, int]:
    if not (isinstance(size, Sequence) and len(size) == 2) or int(size[0]) < 16 or int(size[1]) < 16:
        raise ValueError(f"size must be (height, width), both >= 16, got {size!r}")
    return int(size[0]), int(size[1])


def make_ct_folder(root: str | os.PathLike, num_classes: int = 2, per_class: int = 20,
                   size: tuple[int, int] = (512, 512), seed: int = 0, workers: int = 1) -> SynthSummary:
    """Write an ImageFolder tree ``root/class_XXX/img_XXXXX.png`` of CT-like 16-bit grayscale PNGs.

    Args:
        root (str | os.PathLike): output directory (created; files of the same names are overwritten).
        num_classes (int): number of class folders (>= 1); even classes are chest-like, odd ones
            abdomen-like.
        per_class (int): images per class (>= 1).
        size (tuple[int, int]): (height, width), both >= 16; 512x512 files are 200-240 KB.
        seed (int): the output is a pure function of the seed (and the other arguments).
        workers (int): processes used to generate (1 = in this process); the bytes do not depend on it.

    Returns:
        SynthSummary: counts, total bytes and elapsed seconds.
    """
    return _write_tree(root, num_classes, per_class, ".png", synth_ct_png, (_check_size(size),), seed, workers)


def make_multiband_folder(root: str | os.PathLike, num_classes: int = 4, per_class: int = 20,
                          size: tuple[int, int] = (256, 256), bands: int = 4, seed: int = 0,
                          workers: int = 1) -> SynthSummary:
    """Write an ImageFolder tree ``root/class_XXX/img_XXXXX.tif`` of satellite-like uint16 TIFFs.

    Args:
        root (str | os.PathLike): output directory (created; files of the same names are overwritten).
        num_classes (int): number of class folders (>= 1); the class shifts the mix of land covers.
        per_class (int): images per class (>= 1).
        size (tuple[int, int]): (height, width), both >= 16.
        bands (int): bands per image (>= 1), stored channels last.
        seed (int): the output is a pure function of the seed (and the other arguments).
        workers (int): processes used to generate (1 = in this process); the bytes do not depend on it.

    Returns:
        SynthSummary: counts, total bytes and elapsed seconds.
    """
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands!r}")
    _tifffile()  # fail before creating any folder
    return _write_tree(root, num_classes, per_class, ".tif", synth_multiband_tiff, (_check_size(size), int(bands)),
                       seed, workers)
