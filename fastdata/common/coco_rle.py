"""COCO run-length encoded (RLE) masks checked before they are decoded.

pycocotools allocates an RLE's mask at the size the RLE declares (``size: [height, width]``),
whatever its run lengths hold: a crafted annotation declaring 30,000 x 40,000 costs 1.2 GB.
:func:`rle_size` checks an RLE (uncompressed ``counts`` list or compressed string) without
decoding it: ``size`` is two non-negative ints, and the run lengths are non-negative and add
up to height x width. The COCO source (rejecting the image) and the v2 targets (refusing the
mask) also require the size to be the image's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["rle_counts", "rle_size"]


def _is_int(v: object) -> bool:
    return type(v) is int


def rle_counts(counts: str | bytes) -> list[int]:
    """The run lengths of a compressed COCO RLE string (pycocotools' ``rleFrString``)."""
    if isinstance(counts, bytes):
        counts = counts.decode("latin-1")
    out: list[int] = []
    p, n = 0, len(counts)
    while p < n:
        x, k, more = 0, 0, True
        while more:
            if p >= n:
                raise ValueError("the compressed counts end mid-number")
            c = ord(counts[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"character {counts[p]!r} is not in the compressed counts alphabet")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(out) > 2:
            x += out[-2]
        out.append(x)
    return out


def rle_size(rle: Mapping[str, Any]) -> tuple[tuple[int, int], str | None]:
    """An RLE segmentation's declared ``(height, width)``, or why it is unusable: ``size`` must be two
    non-negative ints and the run lengths (non-negative) must add up to height x width."""
    size, counts = rle.get("size"), rle.get("counts")
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(_is_int(v) and 0 <= v < 2**31 for v in size)):
        return (-1, -1), f"RLE segmentation size {str(size)[:60]} is not [height, width]"
    h, w = size
    if isinstance(counts, str | bytes):
        try:
            runs = rle_counts(counts)
        except ValueError as err:
            return (-1, -1), f"RLE segmentation counts are not a compressed RLE ({err})"
    elif isinstance(counts, list | tuple) and all(_is_int(v) for v in counts):
        runs = list(counts)
    else:
        return (-1, -1), "RLE segmentation counts are neither a string nor a list of integers"
    if any(r < 0 for r in runs) or sum(runs) != h * w:
        return (-1, -1), (f"RLE segmentation run lengths add up to {sum(runs):,}, not the {h * w:,} pixels of its "
                          f"size [{h}, {w}]")
    return (h, w), None
