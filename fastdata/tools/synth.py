"""Synthetic image datasets for the demo, the tests and the benchmarks.

:func:`make_image_folder` writes an ImageFolder tree (``root/class_XXX/img_XXXXX.jpg``)
whose files look like photographs to a JPEG codec: smooth multi-octave noise, hard-edged
shapes, fine texture and grain, with a per-class colour tint so that the classes differ.
Flat colours would compress to a few KB and make every decode benchmark a lie; these
files land mostly between 40 and 120 KB, like ImageNet's.

:func:`make_bad_inputs` writes the hostile inputs a converter must reject without dying,
and :func:`make_odd_images` the valid-but-awkward images it must accept and normalise.

Every output is a pure function of the seed: the same call writes the same bytes,
whatever the number of workers.
"""

from __future__ import annotations

import functools
import io
import multiprocessing
import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fastdata.common.extras import require

cv2 = require("cv2", "synthetic images (fastdata.tools.synth, the demo, the benchmarks)")

__all__ = ["SynthSummary", "make_image_folder", "make_bad_inputs", "make_odd_images", "synth_jpeg"]

SizeSpec = str | tuple[int, int]

# ImageNet-like geometry: widths 300-500 px, aspect (w/h) 0.75-1.33.
_IMAGENET_WIDTH = (300, 500)
_IMAGENET_ASPECT = (0.75, 1.33)
# Quality falls as pixel count grows so that file sizes stay in a narrow band
# (a fixed quality would spread sizes over the ~5x range of pixel counts).
_QUALITY_RANGE = (85, 95)
_QUALITY_PIXELS = (90_000, 340_000)

_TILE = 1024  # side of the cached grain/texture tiles, cropped at random offsets


@dataclass(frozen=True)
class SynthSummary:
    """What :func:`make_image_folder` wrote.

    Attributes:
        root: the tree's root directory.
        num_classes: number of class folders.
        per_class: images per class.
        num_images: total images written (``num_classes * per_class``).
        total_bytes: sum of the JPEG file sizes.
        elapsed_s: wall-clock seconds spent generating and writing.
    """

    root: str
    num_classes: int
    per_class: int
    num_images: int
    total_bytes: int
    elapsed_s: float


@functools.lru_cache(maxsize=1)
def _tiles() -> tuple[np.ndarray, np.ndarray]:
    """Grain and mid-frequency texture tiles, built once per process from a fixed seed.

    Drawing fresh per-pixel normals for each image would dominate generation time;
    cropping a cached tile at a seeded offset is free and still deterministic.
    """
    rng = np.random.default_rng(0x5EED)
    shape1, shape3 = (_TILE, _TILE, 1), (_TILE, _TILE, 3)
    # Mostly luminance with a little chroma, as in camera noise and natural texture.
    grain = rng.standard_normal(shape1, dtype=np.float32) + 0.5 * rng.standard_normal(
        shape3, dtype=np.float32
    )
    detail = rng.standard_normal(shape1, dtype=np.float32) + 0.3 * rng.standard_normal(
        shape3, dtype=np.float32
    )
    detail = cv2.GaussianBlur(detail, (0, 0), 2.0)
    detail /= detail.std()
    return grain, detail


def _crop(tile: np.ndarray, rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    if h <= _TILE and w <= _TILE:
        y = int(rng.integers(0, _TILE - h + 1))
        x = int(rng.integers(0, _TILE - w + 1))
        return tile[y : y + h, x : x + w]
    # Larger than the tile: wrap around.
    y, x = int(rng.integers(0, _TILE)), int(rng.integers(0, _TILE))
    ys = (y + np.arange(h)) % _TILE
    xs = (x + np.arange(w)) % _TILE
    return tile[ys][:, xs]


def _class_tint(seed: int, class_index: int) -> np.ndarray:
    return np.random.default_rng([seed, class_index, 0xC1A55]).uniform(-55.0, 55.0, 3)


def render_photo(rng: np.random.Generator, h: int, w: int, tint: np.ndarray) -> np.ndarray:
    """One photo-like image: smooth noise octaves, a few hard-edged shapes, texture and grain,
    so that JPEG compresses it as it does a photograph.

    Args:
        rng: the only source of randomness (the image is a pure function of its state).
        h, w: the image's height and width in pixels.
        tint: an RGB offset (three floats, about -55..55) added to the base colour.

    Returns:
        np.ndarray: RGB uint8, shape (h, w, 3).
    """
    grain_tile, detail_tile = _tiles()
    # Low octaves are summed at quarter resolution, then upscaled once: cheap and smooth.
    lh, lw = max(4, h // 4), max(4, w // 4)
    low = np.zeros((lh, lw, 3), np.float32)
    amp = 1.0
    for cells in (2, 3, 6, 12, 24):
        shape = (cells, max(2, round(cells * w / h)))
        small = rng.standard_normal(shape + (3,), dtype=np.float32) * 0.45
        small += rng.standard_normal(shape + (1,), dtype=np.float32)
        low += amp * cv2.resize(small, (lw, lh), interpolation=cv2.INTER_CUBIC)
        amp *= 0.6
    base = 128.0 + tint + rng.uniform(-8.0, 8.0, 3)
    low = low * 30.0 + base.astype(np.float32)
    img = cv2.resize(low, (w, h), interpolation=cv2.INTER_LINEAR)

    # Objects with hard edges: what makes JPEG work on real photographs.
    for _ in range(int(rng.integers(2, 7))):
        colour = tuple(float(c) for c in rng.uniform(0, 255, 3) * 0.6 + base * 0.4)
        kind = int(rng.integers(0, 4))
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        if kind == 0:
            radius = int(rng.integers(4, max(5, min(h, w) // 4)))
            cv2.circle(img, (cx, cy), radius, colour, -1, cv2.LINE_AA)
        elif kind == 1:
            dx = int(rng.integers(4, max(5, w // 3)))
            dy = int(rng.integers(4, max(5, h // 3)))
            cv2.rectangle(img, (cx, cy), (cx + dx, cy + dy), colour, -1, cv2.LINE_AA)
        elif kind == 2:
            pts = rng.integers(0, [w, h], (int(rng.integers(3, 6)), 2)).astype(np.int32)
            cv2.fillPoly(img, [pts], colour, cv2.LINE_AA)
        else:
            end = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            cv2.line(img, (cx, cy), end, colour, int(rng.integers(1, 5)), cv2.LINE_AA)

    # cv2.scaleAdd avoids numpy's temporaries: about half of the render time otherwise.
    img = cv2.scaleAdd(_crop(detail_tile, rng, h, w), float(rng.uniform(6.0, 14.0)), img)
    img = cv2.GaussianBlur(img, (0, 0), 0.7)
    img = cv2.scaleAdd(_crop(grain_tile, rng, h, w), float(rng.uniform(4.0, 8.0)), img)
    return cv2.convertScaleAbs(img)


def _geometry(rng: np.random.Generator, size: SizeSpec) -> tuple[int, int]:
    if size == "imagenet":
        w = int(rng.integers(_IMAGENET_WIDTH[0], _IMAGENET_WIDTH[1] + 1))
        aspect = float(rng.uniform(*_IMAGENET_ASPECT))
        return max(1, round(w / aspect)), w
    if size == "cifar":
        return 32, 32
    return int(size[0]), int(size[1])


def jpeg_quality_for(rng: np.random.Generator, h: int, w: int) -> int:
    """The JPEG quality (85-95) for an (h, w) image: lower for more pixels, so that file sizes
    stay in a narrow band, with a random step of -1, 0 or +1 drawn from ``rng``."""
    lo_q, hi_q = _QUALITY_RANGE
    lo_px, hi_px = _QUALITY_PIXELS
    frac = (h * w - lo_px) / (hi_px - lo_px)
    q = round(hi_q - (hi_q - lo_q) * frac) + int(rng.integers(-1, 2))
    return int(min(hi_q, max(lo_q, q)))


def encode_jpeg(img_rgb: np.ndarray, quality: int) -> bytes:
    """Baseline JPEG bytes (OpenCV's encoder) of an RGB uint8 (h, w, 3) image at ``quality`` (1-100)."""
    ok, buf = cv2.imencode(".jpg", img_rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:  # cv2 reports failure by return value, not exception
        raise RuntimeError("cv2.imencode failed to encode a synthetic image")
    return buf.tobytes()


def synth_jpeg(
    seed: int,
    class_index: int,
    image_index: int,
    size: SizeSpec = "imagenet",
    quality: int | None = None,
) -> bytes:
    """The JPEG bytes of one synthetic image, a pure function of its arguments.

    Args:
        seed: dataset seed.
        class_index: class number (selects the colour tint).
        image_index: index within the class.
        size: ``"imagenet"``, ``"cifar"`` or ``(height, width)``.
        quality: JPEG quality 1-100, or ``None`` to pick 85-95 from the pixel count.

    Returns:
        bytes: a baseline JPEG.
    """
    rng = np.random.default_rng([seed, class_index, image_index])
    h, w = _geometry(rng, size)
    img = render_photo(rng, h, w, _class_tint(seed, class_index))
    q = jpeg_quality_for(rng, h, w) if quality is None else int(quality)
    return encode_jpeg(img, q)


def class_paths(root: Path, num_classes: int, per_class: int, ext: str) -> list[tuple[str, int, int]]:
    """``(path, class index, image index)`` of every image of an ImageFolder tree under ``root``
    (``class_000/img_00000.jpg``...), its class folders created."""
    out = []
    for ci in range(num_classes):
        class_dir = root / f"class_{ci:03d}"
        class_dir.mkdir(parents=True, exist_ok=True)
        out += [(str(class_dir / f"img_{ii:05d}{ext}"), ci, ii) for ii in range(per_class)]
    return out


def write_all(write_one: Callable[[Any], int], tasks: list, workers: int) -> list[int]:
    """Run ``write_one(task)`` (a module-level function returning the bytes it wrote) for every task,
    in ``workers`` processes (1: in this one), and return the sizes in no particular order.

    Every synthetic image is a pure function of its task, so the order the pool takes them in is
    irrelevant; chunks of about an eighth of a worker's share keep the pool's overhead small."""
    if workers == 1 or len(tasks) < 2:
        return [write_one(t) for t in tasks]
    chunk = max(1, len(tasks) // (workers * 8))
    with multiprocessing.get_context().Pool(min(workers, len(tasks))) as pool:
        return list(pool.imap_unordered(write_one, tasks, chunksize=chunk))


def _write_one(task) -> int:
    path, seed, ci, ii, size, quality = task
    data = synth_jpeg(seed, ci, ii, size, quality)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _check_size(size: SizeSpec) -> SizeSpec:
    if isinstance(size, str):
        if size not in ("imagenet", "cifar"):
            raise ValueError(f"size must be 'imagenet', 'cifar' or (h, w), got {size!r}")
        return size
    if not (isinstance(size, Sequence) and len(size) == 2):
        raise ValueError(f"size must be 'imagenet', 'cifar' or (h, w), got {size!r}")
    h, w = int(size[0]), int(size[1])
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return (h, w)


def make_image_folder(
    root: str | os.PathLike,
    num_classes: int = 10,
    per_class: int = 20,
    size: SizeSpec = "imagenet",
    seed: int = 0,
    quality: int | None = None,
    workers: int = 1,
) -> SynthSummary:
    """Write a synthetic ImageFolder tree ``root/class_XXX/img_XXXXX.jpg``.

    Args:
        root: output directory (created; existing files of the same names are overwritten).
        num_classes: number of class folders (>= 1).
        per_class: images per class (>= 1).
        size: ``"imagenet"`` (about 400x350, widths 300-500, aspect 0.75-1.33, photo-like,
            mostly 40-120 KB), ``"cifar"`` (32x32) or an explicit ``(height, width)``.
        seed: the output is a pure function of the seed (and the other arguments).
        quality: JPEG quality 1-100 for every image, or ``None`` to choose 85-95 per image
            (lower for larger images, which keeps file sizes in a narrow band).
        workers: processes used to generate (1 = in this process). The bytes written do
            not depend on it.

    Returns:
        SynthSummary: counts, total bytes and elapsed seconds.
    """
    if num_classes < 1 or per_class < 1:
        raise ValueError("num_classes and per_class must be >= 1")
    if quality is not None and not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    size = _check_size(size)
    t0 = time.perf_counter()
    root_path = Path(root)
    tasks = [(path, seed, ci, ii, size, quality) for path, ci, ii in class_paths(root_path, num_classes, per_class,
                                                                                  ".jpg")]

    sizes = write_all(_write_one, tasks, workers)

    return SynthSummary(
        root=str(root_path),
        num_classes=num_classes,
        per_class=per_class,
        num_images=len(tasks),
        total_bytes=int(sum(sizes)),
        elapsed_s=time.perf_counter() - t0,
    )


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))
        + kind
        + payload
        + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
    )


def _bomb_png() -> bytes:
    """A valid 1-bit grayscale PNG declaring more than twice Pillow's pixel limit.

    All-zero rows compress about 1000:1, so the file is tens of KB while a decoder
    that trusts the header would allocate hundreds of MB.
    """
    limit = Image.MAX_IMAGE_PIXELS or 89_478_485  # Pillow's default when disabled
    width = 20_000
    height = -(-(2 * limit + 1) // width) + 1000
    row = b"\x00" * (1 + -(-width // 8))  # filter byte + packed 1-bit pixels
    comp = zlib.compressobj(9)
    body = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", body)
        + _png_chunk(b"IEND", b"")
    )


def make_bad_inputs(directory: str | os.PathLike) -> dict:
    """Write a catalogue of hostile inputs that a converter must reject without dying.

    Args:
        directory: where to write (created if missing).

    Returns:
        dict[str, str]: file name -> short description. Names:
        ``zero_bytes.jpg``, ``truncated.jpg``, ``garbage.jpg``, ``png_named.jpg``
        (a valid PNG with a .jpg name), ``bomb.png.jpg`` (decompression bomb: declares
        more than ``2 * Image.MAX_IMAGE_PIXELS`` pixels, small on disk),
        ``broken_symlink.jpg`` (points nowhere), ``loop_a.jpg``/``loop_b.jpg``
        (symlinks pointing at each other).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    catalogue = {}

    def put(name: str, data: bytes, what: str) -> None:
        (d / name).write_bytes(data)
        catalogue[name] = what

    good = synth_jpeg(0, 0, 0, size=(96, 128), quality=90)
    put("zero_bytes.jpg", b"", "empty file")
    put("truncated.jpg", good[: len(good) * 3 // 5], "JPEG cut off in the middle of its scan data")
    garbage = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    put("garbage.jpg", b"NOTANIMAGE" + garbage, "random bytes with a .jpg name")
    png = io.BytesIO()
    Image.fromarray(np.full((24, 24, 3), 200, np.uint8)).save(png, format="PNG")
    put("png_named.jpg", png.getvalue(), "a valid PNG file named .jpg")
    put(
        "bomb.png.jpg",
        _bomb_png(),
        "decompression bomb: PNG declaring > 2x Image.MAX_IMAGE_PIXELS, small on disk",
    )

    links = {
        "broken_symlink.jpg": ("does_not_exist.jpg", "symlink to a missing file"),
        "loop_a.jpg": ("loop_b.jpg", "symlink loop a -> b -> a"),
        "loop_b.jpg": ("loop_a.jpg", "symlink loop b -> a -> b"),
    }
    for name, (target, what) in links.items():
        link = d / name
        if os.path.lexists(link):
            link.unlink()
        os.symlink(target, link)
        catalogue[name] = what
    return catalogue


def make_odd_images(directory: str | os.PathLike) -> dict:
    """Write valid but awkward images a converter must accept (and normalise on decode).

    Args:
        directory: where to write (created if missing).

    Returns:
        dict[str, str]: file name -> short description. The non-UTF-8 name is returned
        as ``os.fsdecode`` gives it (with surrogate escapes).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rgb = cv2.imdecode(
        np.frombuffer(synth_jpeg(1, 0, 0, size=(60, 80), quality=92), np.uint8), cv2.IMREAD_COLOR
    )[:, :, ::-1]
    pil = Image.fromarray(np.ascontiguousarray(rgb))
    catalogue = {}

    def save(name: str, image: Image.Image, what: str, **kw) -> None:
        image.save(d / name, **kw)
        catalogue[name] = what

    save("cmyk.jpg", pil.convert("CMYK"), "CMYK JPEG", format="JPEG", quality=90)
    save("gray.jpg", pil.convert("L"), "grayscale JPEG", format="JPEG", quality=90)
    save("palette.png", pil.convert("P"), "palette (mode P) PNG", format="PNG")
    save("rgba.png", pil.convert("RGBA"), "RGBA PNG with an alpha channel", format="PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    save(
        "exif_rotated.jpg",
        pil,
        "JPEG with EXIF Orientation=6 (stored 80x60, displayed 60x80)",
        format="JPEG",
        quality=90,
        exif=exif,
    )
    raw_name = b"non_utf8_\xff\xfe.jpg"
    with open(os.path.join(os.fsencode(d), raw_name), "wb") as f:
        f.write(synth_jpeg(1, 0, 1, size=(40, 40), quality=90))
    catalogue[os.fsdecode(raw_name)] = "valid JPEG whose file name is not valid UTF-8"
    return catalogue
