"""``convert(storage="raw"|"mixed", raw_budget=SIZE)``: keeping images as decoded pixels within a
disk budget.

Decoded pixels skip the JPEG decode at load time but take several times the disk. A mixed store
with a budget keeps as pixels the images whose decode costs the most per extra byte they take,
as many as the budget holds; the others keep their original bytes. The choice is made in the
conversion's plan, before anything is written, from each image's header (its size) and its file
size, so it is a function of the source alone: a ``resume=True``, another rank or a rerun picks the
same images, and a budget the images cannot fit in is refused before any writing.

**Decode cost.** libjpeg-turbo's decode time grows with the pixels and, much more per unit, with
the compressed bytes (the entropy decoding): timed with simplejpeg on synthetic photos of 0.04-2
megapixels at qualities 50-97, a least-squares fit of ``a * pixels + b * bytes`` gave b = 37 a
(within a third of each image's time in the median; pixels alone were off by half), so one byte
counts as :data:`DECODE_PIXELS_PER_BYTE` pixels. So a high-quality JPEG is the one to keep
raw first: slow to decode, and its pixels cost few bytes more than its file.

**What the budget counts.** Each image's stored bytes (the PPM of its capped pixels, exactly, or
its file) plus :data:`RECORD_ALLOWANCE` per image for the store's own overhead (LMDB stores each
value in whole 4 KiB pages; the index) and :data:`WRITE_ALLOWANCE` once (a shard's fixed pages, the
store index, the manifest), so a store planned within the budget is within it on disk; an append
counts the store's shards as already spent.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from fastdata.common.imageio import encode_ppm_header
from fastdata.common.units import exact_size, format_size
from fastdata.format.backends.base import StorageSpec
from fastdata.writer.ingest import capped_size

#: pixels that cost as much decode time as one compressed byte (see the module docstring)
DECODE_PIXELS_PER_BYTE = 32
#: bytes counted per image for the store's own overhead: LMDB's page rounding and the index
RECORD_ALLOWANCE = 4096
#: bytes counted once per write: a new shard's fixed pages (LMDB's meta pages and index databases),
#: the store index and the manifest (measured: a 4-record LMDB shard is about 40 KiB over its images)
WRITE_ALLOWANCE = 256 << 10
#: threads reading image headers (their time is mostly waiting on the disk)
HEADER_THREADS = 8
_HEADER_BATCH = 256


def _header_size(path: bytes) -> tuple[int, int]:
    """``(width, height)`` from the image header of the file at ``path``, or ``(0, 0)`` when it is
    not an image Pillow reads (the conversion itself then rejects and reports it)."""
    try:
        with open(path, "rb") as fh, Image.open(fh) as im:
            return im.size
    except Exception:  # any failure to parse a header: that input is rejected by ingest, with its reason
        return 0, 0


def header_sizes(paths: list[bytes], threads: int = HEADER_THREADS) -> tuple[np.ndarray, np.ndarray]:
    """The images' ``(widths, heights)`` (int64 arrays), read from their headers (no decode) by
    ``threads`` threads; 0 for a file that is not a readable image."""
    batches = [paths[i:i + _HEADER_BATCH] for i in range(0, len(paths), _HEADER_BATCH)]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        sizes = [size for batch in pool.map(lambda b: [_header_size(p) for p in b], batches) for size in batch]
    arr = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def raw_record_bytes(widths: np.ndarray, heights: np.ndarray, max_side: int) -> np.ndarray:
    """The bytes of each image's raw record (a PPM of its pixels capped at ``max_side``:
    :func:`fastdata.writer.ingest.raw_native_sample`), exactly; 0 where the size is unknown."""
    out = np.zeros(len(widths), dtype=np.int64)
    for i, (w, h) in enumerate(zip(widths.tolist(), heights.tolist(), strict=True)):
        if w > 0 and h > 0:
            cw, ch = capped_size(w, h, max_side)
            out[i] = len(encode_ppm_header(cw, ch)) + 3 * cw * ch
    return out


def decode_priority(widths: np.ndarray, heights: np.ndarray, file_sizes: np.ndarray,
                    raw_bytes: np.ndarray) -> np.ndarray:
    """Decode cost saved per extra byte stored, per image: ``(W*H + 32 * file bytes) /
    (raw bytes - file bytes)``; infinite where the pixels take no more than the file."""
    cost = widths.astype(np.float64) * heights + DECODE_PIXELS_PER_BYTE * file_sizes.astype(np.float64)
    extra = (raw_bytes - file_sizes).astype(np.float64)
    with np.errstate(divide="ignore"):
        return np.where(extra > 0, cost / np.maximum(extra, 1.0), np.inf)


def choose_raw(storage: StorageSpec, file_sizes: np.ndarray, widths: np.ndarray, heights: np.ndarray,
               source: str, used: int = 0, raw_bytes: np.ndarray | None = None) -> np.ndarray:
    """Which images a store with ``storage.raw_budget`` keeps as pixels (a bool per input), with
    ``used`` bytes of the budget already taken (an append: the store's shards); ``raw_bytes``:
    :func:`raw_record_bytes` of the images when the caller has them.

    Mode ``NATIVE_SIZE_PIXELS``: all, when they fit the budget. Mode ``MIXED``: in order of
    :func:`decode_priority` (ties in input order), as many as fit the budget on top of the others'
    original bytes; an image whose header is unreadable is kept as it is.

    Raises:
        ValueError: the images do not fit the budget (every one as pixels in mode ``NATIVE_SIZE_PIXELS``;
            even all as their original bytes in mode ``'mixed'``), naming the sizes and what to do.
    """
    budget = storage.raw_budget
    assert budget is not None and storage.max_side is not None, "choose_raw needs a raw budget and max_side"
    files = np.maximum(file_sizes, 0).astype(np.int64)
    readable = (widths > 0) & (heights > 0)
    raw = raw_record_bytes(widths, heights, storage.max_side) if raw_bytes is None else raw_bytes
    allowance = RECORD_ALLOWANCE * len(files) + WRITE_ALLOWANCE + used
    # an append cannot raise the store's budget: the way out is a new store of both sources
    held = f" beside the store's {format_size(used)}" if used else ""
    way_out = ("convert the store's sources and these together into a new store with a larger raw_budget" if used
               else "raise the budget")
    if storage.mode.holds_only_native_size_pixels:
        total = int(np.where(readable, raw, files).sum()) + allowance
        if total > budget:
            raise ValueError(f"{source}: storage='raw' max_side={storage.max_side} stores these {len(files):,} "
                             f"images as about {format_size(total - used)} of pixels{held}, over "
                             f"raw_budget={exact_size(budget)!r}: {way_out}, lower max_side, or use storage='mixed' "
                             "with raw_budget to keep as many as fit as pixels and the rest as their original bytes")
        return np.ones(len(files), dtype=bool)
    base = int(files.sum()) + allowance
    if base > budget:
        raise ValueError(f"{source}: its {len(files):,} images take {format_size(base - used)} as they are{held}, "
                         f"over raw_budget={exact_size(budget)!r} before any is stored as pixels: {way_out} (a "
                         "mixed store is at least as large as one of the original files)")
    priority = np.where(readable, decode_priority(widths, heights, files, raw), -np.inf)
    order = np.lexsort((np.arange(len(files)), -priority))  # highest priority first, then input order
    order = order[readable[order]]
    spent = base + np.cumsum(np.maximum(raw - files, 0)[order])
    chosen = np.zeros(len(files), dtype=bool)
    chosen[order[spent <= budget]] = True  # (spent only grows: the images taken are a prefix of the order)
    return chosen


def plan_raw(storage: StorageSpec, paths: list[bytes], file_sizes: np.ndarray,
             source: str, used: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """The plan of a store with a raw budget: ``(raw, stored, note)``, whether each input is kept
    as pixels, the bytes it will take in the store (exact, for shard rotation) and a summary line;
    ``used``: bytes of the budget already taken (see :func:`choose_raw`).

    Raises:
        ValueError: as :func:`choose_raw`.
    """
    assert storage.max_side is not None
    t0 = time.perf_counter()
    widths, heights = header_sizes(paths)
    raw_bytes = raw_record_bytes(widths, heights, storage.max_side)
    raw = choose_raw(storage, file_sizes, widths, heights, source, used, raw_bytes)
    stored = np.where(raw & (raw_bytes > 0), raw_bytes, np.maximum(file_sizes, 0)).astype(np.int64)
    assert storage.raw_budget is not None
    note = (f"raw budget {exact_size(storage.raw_budget)}: {int(raw.sum()):,} of {len(raw):,} image(s) planned as "
            f"pixels (up to {storage.max_side} px), the images about {format_size(int(stored.sum()))}"
            + (f" beside the store's {format_size(used)}" if used else "") + " "
            f"(headers of {len(paths):,} file(s) read in {time.perf_counter() - t0:.1f} s)")
    return raw, stored, note

