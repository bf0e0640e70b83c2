"""Small, fast, photo-like JPEG files and ImageFolder trees.

Images are upscaled random noise (smooth, every pixel different), never flat
colour: a flat image compresses to a few hundred bytes and would hide bugs that
only show with real entropy-coded data (offsets, chunk boundaries, map growth).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

#: the repository's tests/ folder and its committed data
TESTS_DIR = Path(__file__).resolve().parents[1]
DATA_DIR = TESTS_DIR / "data"
#: the repository root
REPO_ROOT = TESTS_DIR.parent


def photo_array(size: Sequence[int], seed: int) -> np.ndarray:
    """``uint8 [h, w, 3]`` smooth random content for ``size=(w, h)``."""
    w, h = int(size[0]), int(size[1])
    rng = np.random.default_rng(seed)
    # Coarse noise upscaled bicubically gives smooth gradients; a little fine
    # grain on top keeps the JPEG from being trivially compressible.
    coarse = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, (h, w, 1), dtype=np.int16)
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def make_jpeg(
    path,
    size: Sequence[int] = (64, 48),
    seed: int = 0,
    quality: int = 90,
    mode: str = "RGB",
    subsampling: int | None = None,
    progressive: bool = False,
) -> str:
    """Write a photo-like JPEG of ``size=(width, height)`` in Pillow ``mode``
    (``"RGB"``, ``"L"``, ``"CMYK"``) to ``path`` (parents created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.fromarray(photo_array(size, seed))
    if mode != "RGB":
        im = im.convert(mode)
    kwargs = {"quality": quality, "progressive": progressive}
    if subsampling is not None:
        kwargs["subsampling"] = subsampling
    im.save(path, format="JPEG", **kwargs)
    return str(path)


def make_tree(
    root,
    classes: Mapping[str, int] | None = None,
    size: Sequence[int] = (64, 48),
    ext: str = ".jpg",
    seed: int = 0,
) -> str:
    """Write an ImageFolder tree ``root/<class>/<class>_<i><ext>``; every file has
    distinct content. Returns ``str(root)``."""
    classes = {"cat": 5, "dog": 3} if classes is None else classes
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for ci, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            make_jpeg(root / name / f"{name}_{i:03d}{ext}", size=size, seed=seed * 100_003 + ci * 1009 + i)
    return str(root)


def make_small_tree(root: str | Path) -> str:
    """3 classes x 8 JPEGs; some in nested subfolders (two levels), one with an uppercase ``.JPG``
    extension, varied sizes (the ``small_tree`` fixture). Returns the root path."""
    root = Path(root)
    seed = 7
    for ci, cls in enumerate(("ant", "bee", "wasp")):
        for i in range(8):
            if i < 4:
                rel = Path(cls) / f"img_{i}.jpg"
            elif i < 6:
                rel = Path(cls) / "sub" / f"img_{i}.jpg"
            else:
                rel = Path(cls) / "sub" / "deeper" / f"img_{i}.jpg"
            if ci == 1 and i == 2:
                rel = rel.with_suffix(".JPG")
            make_jpeg(root / rel, size=(40 + 8 * i, 32 + 4 * ci), seed=seed + ci * 100 + i)
    return str(root)
