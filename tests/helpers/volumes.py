"""Volumes for the chunked-field tests, importable by worker processes (spawned workers
unpickle the datasets below by module name)."""

from __future__ import annotations

import os
import time

import numpy as np

from fastdata.fields import Chunked, Int, Schema

#: small chunks so that small volumes still have many chunks, edges included
CHUNKS = (16, 16, 16)
SCHEMA = Schema.of({"ct": Chunked("uint16", CHUNKS), "label": Int()})
#: shapes that are not multiples of the chunks, one with an empty axis, one smaller than a chunk
SHAPES = [(40, 33, 21), (16, 16, 16), (5, 70, 9), (0, 4, 4), (1, 1, 1), (37, 20, 48)]


def volume(i: int, shape=None) -> np.ndarray:
    """Volume ``i``: smooth structure plus noise (compresses as scans do), distinct per ``i``."""
    shape = SHAPES[i % len(SHAPES)] if shape is None else shape
    rng = np.random.default_rng(i)
    grid = np.indices(shape, dtype=np.float32).sum(axis=0) if all(shape) else np.zeros(shape, np.float32)
    return (grid * (3 + i) + rng.integers(0, 50, shape)).astype(np.uint16) % 4096


def write_memmaps(folder: str | os.PathLike, count: int) -> list[str]:
    """``count`` volumes as raw ``.u16`` files in ``folder`` (shapes from :data:`SHAPES`); their paths."""
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"vol{i:03d}.u16")
        volume(i).tofile(path)
        paths.append(path)
    return paths


def open_memmap(path: str, i: int) -> np.ndarray:
    """Volume ``i`` mapped from its file (an empty volume, which cannot be mapped, as an array)."""
    shape = SHAPES[i % len(SHAPES)]
    if not all(shape):
        return np.zeros(shape, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", shape=shape)


class MemmapVolumes:
    """A map-style dataset of memmapped volumes (what a user with raw volume files writes),
    optionally slowed down so that a test can SIGKILL its writer mid-way."""

    def __init__(self, paths: list[str], delay: float = 0.0):
        self.paths, self.delay = paths, delay

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        return {"ct": open_memmap(self.paths[i], i), "label": i}
