"""Write one HDF5 shard (layout in ``spec.py``)."""

from __future__ import annotations

import os
from typing import Sequence

import h5py
import numpy as np

from ...record import IndexBuilder, ShardIndex
from ..base import Sample, ShardWriter, StorageSpec
from . import spec


class HDF5ShardWriter(ShardWriter):
    """Appends image bytes to a resizable flat dataset (or a 4-D pixel dataset
    in raw mode); offsets and the index are written at close."""

    def __init__(self, path: str, storage: StorageSpec, **options):
        super().__init__(path, storage)
        self.file = h5py.File(path, "w", locking=False)
        self.index = IndexBuilder()
        self.offsets = [0]
        if storage.mode == "raw":
            h, w = storage.raw_shape
            self.data = self.file.create_dataset(spec.PIXELS, shape=(0, h, w, 3), maxshape=(None, h, w, 3),
                                                 dtype=np.uint8, chunks=(max(1, (256 << 10) // (h * w * 3)), h, w, 3))
        else:
            self.data = self.file.create_dataset(spec.IMAGES, shape=(0,), maxshape=(None,), dtype=np.uint8,
                                                 chunks=(spec.IMAGES_CHUNK,))

    def put(self, samples: Sequence[Sample]) -> None:
        if not samples:
            return
        if self.storage.mode == "raw":
            h, w = self.storage.raw_shape
            block = np.stack([np.frombuffer(s.image, dtype=np.uint8).reshape(h, w, 3) for s in samples])
            start = self.data.shape[0]
            self.data.resize(start + len(samples), axis=0)
            self.data[start:] = block
        else:
            block = np.frombuffer(b"".join(s.image for s in samples), dtype=np.uint8)
            start = self.data.shape[0]
            self.data.resize(start + len(block), axis=0)
            self.data[start:] = block
        for s in samples:
            self.offsets.append(self.offsets[-1] + len(s.image))
            self.index.add(label=s.label, xxh=s.xxh, width=s.width, height=s.height, fmt=s.fmt,
                           nbytes=len(s.image), relpath=s.relpath)

    def close(self) -> ShardIndex:
        index = self.index.build()
        f = self.file
        if self.storage.mode != "raw":
            f.create_dataset(spec.OFFSETS, data=np.asarray(self.offsets, dtype="<i8"))
        for name, dtype in spec.INDEX_ARRAYS.items():
            f.create_dataset(name, data=np.asarray(getattr(index, name), dtype=dtype))
        f.attrs["layout"] = spec.LAYOUT
        f.attrs["version"] = spec.VERSION
        f.attrs["count"] = len(index)
        f.flush()
        f.close()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return index

    def abort(self) -> None:
        try:
            self.file.close()
        except Exception:  # h5py raises assorted types on a half-written file
            pass
