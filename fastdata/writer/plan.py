"""Deterministic shard planning.

Shard boundaries are decided from the scan alone (sorted order and the file
sizes stat'ed at scan time), never from which worker finished first, so the
same input and options give the same shards and records with 1 or N workers,
and every rank of a distributed conversion computes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from fastdata.format.backends.base import StorageSpec


class Listing(Protocol):
    """What planning and ``resume=True`` read of a folder or ``path,label`` list scan
    (a :class:`fastdata.writer.sources.folder.SourceScan`)."""

    classes: list[str]
    relpaths: list[bytes]
    labels: np.ndarray
    sizes: np.ndarray
    #: with a raw budget: whether each input is stored as pixels, and the bytes it will take
    raw: np.ndarray | None
    stored_sizes: np.ndarray | None

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class ShardPlan:
    """Shard ``shard_id`` holds the (accepted) inputs ``start .. stop-1`` of the scan."""

    shard_id: int
    start: int
    stop: int


def estimated_sizes(scan: Listing, storage: StorageSpec) -> np.ndarray:
    """Bytes each input is expected to take in the store (for rotation)."""
    if scan.stored_sizes is not None:  # a raw budget's plan read every header: the sizes are known
        return scan.stored_sizes
    if storage.mode.holds_fixed_size_pixels:
        h, w = storage.fixed_pixel_shape()
        return np.full(len(scan), h * w * 3, dtype=np.int64)
    sizes = np.maximum(scan.sizes, 0)
    if storage.mode.may_hold_native_size_pixels:
        # A raw image's size is not known before decoding: its upper bound, a square at the
        # longest side allowed (plus the PPM header), so that shards end up at most the target
        side = storage.reencode_max_side()
        pixels = np.int64(3 * side * side + 32)
        raw = np.fromiter((storage.stores_native_pixels(rel) for rel in scan.relpaths), dtype=bool, count=len(scan))
        sizes = np.where(raw, pixels, sizes)
    return sizes


def plan_shards(sizes: np.ndarray, shard_size: int) -> list[ShardPlan]:
    """Greedy rotation: start a new shard before an input that would push the
    current one past ``shard_size`` (a shard always holds at least one input)."""
    plans: list[ShardPlan] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if i > start and acc + size > shard_size:
            plans.append(ShardPlan(len(plans), start, i))
            start, acc = i, 0
        acc += size
    if len(sizes) > start or not plans:
        plans.append(ShardPlan(len(plans), start, len(sizes)))
    return plans


def plan_fingerprint(scan: Listing, backend: str, storage: StorageSpec, shard_size: int) -> str:
    """A hash of everything that determines the store's content, used to refuse
    a ``resume=True`` whose source or options differ from the interrupted run."""
    h = xxhash.xxh3_128()
    h.update(repr((backend, storage.to_json(), shard_size, scan.classes)).encode())
    for rel in scan.relpaths:
        h.update(len(rel).to_bytes(4, "little"))
        h.update(rel)
    h.update(scan.labels.astype("<i8").tobytes())
    h.update(scan.sizes.astype("<i8").tobytes())
    etags = getattr(scan, "etags", None)
    if etags is not None:  # a remote source: an object rewritten at the same size is another input
        h.update(b"etags")
        h.update(np.asarray(etags, dtype="<u8").tobytes())
    if scan.raw is not None:  # (a raw budget's choice follows from the files; hashed all the same)
        h.update(scan.raw.astype(np.uint8).tobytes())
    return h.hexdigest()
