"""Samples and datasets for tests/test_write.py, importable by worker processes
(forkserver/spawn workers unpickle these by module name)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image as PILImage

from fastdata.fields import JSON, Float, Image, Int, NDArray, Ragged, Schema, String

SCHEMA = Schema.of({
    "image": Image(), "mask": Image(), "label": Int("int32"), "score": Float("float32"), "caption": String(),
    "embedding": NDArray("float16", (2, 3)), "big": NDArray("uint8", (40, 40)), "boxes": Ragged("float32", (4,)),
    "labels": Ragged("int64"), "meta": JSON(),
})


def jpeg(seed: int, size=(12, 10)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def sample(i: int) -> dict:
    """Sample ``i``: every field kind, with values that differ from sample to sample."""
    rng = np.random.default_rng(i)
    n = i % 4
    return {
        "image": jpeg(i),
        "mask": rng.integers(0, 3, (7, 5, 3), dtype=np.uint8),  # an array: stored as PNG
        "label": i * 3 - 7,
        "score": float(np.float32(i / 7)),
        "caption": f"sample {i} \N{SNOWMAN}",
        "embedding": rng.standard_normal((2, 3)).astype(np.float16),
        "big": rng.integers(0, 255, (40, 40), dtype=np.uint8),
        "boxes": rng.random((n, 4)).astype(np.float32),
        "labels": np.arange(n, dtype=np.int64) + i,
        "meta": {"id": i, "tags": ["a", "b"][: i % 3], "nested": {"x": None, "y": 1.5, "b": b"\x00\x01"}},
    }


class SampleList(torch.utils.data.Dataset):
    """A torch map-style Dataset of :func:`sample`; ``delay`` seconds per item (to slow a run down)."""

    def __init__(self, n: int, delay: float = 0.0):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            import time

            time.sleep(self.delay)
        return sample(i)


def keep(batch):
    """A collate_fn that keeps the list of sample dicts."""
    return batch
