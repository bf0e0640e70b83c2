"""What a store holds, counted from its shards' indexes: images per stored format, per dtype
and channel count, and the image bytes stored. The conversion summary and ``fastdata info``
both say it (:func:`image_census`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fastdata.common.units import exact_size, format_size
from fastdata.format.backends.base import StorageSpec
from fastdata.format.record import FIELD_PREFIX, FORMAT_NAMES, IMAGE_DTYPE_NAMES, NOT_RECORDED, SampleIndex, ShardIndex

#: the key of :func:`image_census`'s ``kinds`` for entries written before fastdata recorded them
NOT_RECORDED_KIND = "not recorded"


def _image_arrays(index: ShardIndex | SampleIndex, field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(format codes, dtype codes, channels, stored bytes or empty) of image field ``field``."""
    if isinstance(index, ShardIndex):
        return index.formats, index.dtypes, index.channels, index.nbytes
    prefix = f"{FIELD_PREFIX}{field}."
    a = index.arrays
    return a[prefix + "format"], a[prefix + "dtype"], a[prefix + "channels"], np.zeros(0, np.int64)


def image_census(indexes: Iterable[ShardIndex | SampleIndex], field: str = "image") -> dict[str, dict[str, int]]:
    """What the shards with ``indexes`` hold in image field ``field`` (a classification store's is
    ``image``): ``{"formats": {"PNG": 10}, "kinds": {"uint16 x1": 10}, "bytes": {"stored": n}}``.

    ``kinds`` counts images per dtype and channel count; entries written before fastdata recorded
    them count as :data:`NOT_RECORDED_KIND`. ``bytes`` is a classification store's image bytes
    (a general store's images are parts of its records: 0)."""
    formats: dict[str, int] = {}
    kinds: dict[str, int] = {}
    stored = 0
    for index in indexes:
        fmt, dtype, channels, nbytes = _image_arrays(index, field)
        stored += int(nbytes.sum())
        for code, count in zip(*np.unique(fmt, return_counts=True), strict=True):
            name = FORMAT_NAMES.get(int(code), f"code {int(code)}")
            formats[name] = formats.get(name, 0) + int(count)
        if not len(dtype):
            continue
        pairs = np.stack([np.asarray(dtype, np.int64), np.asarray(channels, np.int64)], axis=1)
        for (d, c), count in zip(*np.unique(pairs, axis=0, return_counts=True), strict=True):
            key = NOT_RECORDED_KIND if d == NOT_RECORDED else f"{IMAGE_DTYPE_NAMES.get(int(d), 'unknown')} x{int(c)}"
            kinds[key] = kinds.get(key, 0) + int(count)
    return {"formats": formats, "kinds": kinds, "bytes": {"stored": stored}}


def listing(counts: dict[str, int]) -> str:
    """``"uint16 x1 2000, uint8 x3 12"``: most first."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def census_notes(census: dict[str, dict[str, int]], image_modes: dict[str, str], storage: StorageSpec) -> list[str]:
    """The summary lines of a conversion's :func:`image_census` (report notes)."""
    notes = []
    if census["formats"]:
        notes.append(f"stored formats: {listing(census['formats'])}")
    if census["kinds"]:
        notes.append(f"images (dtype x channels): {listing(census['kinds'])}")
    if storage.raw_budget is not None:
        stored = census["bytes"]["stored"]
        notes.append(f"image bytes stored: {format_size(stored)}, {stored / storage.raw_budget:.0%} of the raw budget "
                     f"{exact_size(storage.raw_budget)}")
    if storage.mode.transcodes_losslessly:
        kept = {k: v for k, v in census["formats"].items() if k != "TIFF"}
        notes.append("lossless: every image but JPEG/WebP/DICOM (and palette/CMYK images) re-encoded as a zstd "
                     "TIFF, checked bit-exact" + (f"; kept as they were: {listing(kept)}" if kept else "")
                     + f"; stored image bytes {format_size(census['bytes']['stored'])} (the input files: 'input' "
                     "above)")
    deep = [kind for kind in census["kinds"] if kind != NOT_RECORDED_KIND and not kind.startswith("uint8 ")]
    if deep and storage.mode.keeps_files_as_given and "PNG" in census["formats"]:
        notes.append("images deeper than 8 bits stored as PNG decode at zlib's pace: lossless='tiff' keeps the "
                     "same pixels in a zstd TIFF that decodes about 2.5x faster")
    if deep and not image_modes:
        notes.append(f"{listing({k: census['kinds'][k] for k in deep})} images are read as 8-bit RGB by default "
                     "(ImageFolder's convert('RGB'), with a warning): open the store with image_mode='unchanged' "
                     "(or convert with image_mode='unchanged') to read them as stored")
    for name, mode in image_modes.items():
        notes.append(f"default read mode of {name!r}: {mode!r} (recorded in the manifest's image_modes; "
                     "image_mode= of a reader overrides it)")
    return notes
