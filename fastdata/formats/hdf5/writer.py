"""Write one HDF5 shard (layout in ``spec.py``)."""

from __future__ import annotations

import errno
import io
import os
from typing import Sequence

import h5py
import numpy as np

from ...manifest import fsync_file
from ...record import IndexBuilder, ShardIndex
from ..base import Sample, ShardWriter, StorageSpec
from . import spec

_COPY_BLOCK = 64 << 20


class _SwallowingFile(io.FileIO):
    """The file libhdf5 writes through (h5py's file-object driver).

    The first write error is recorded and every later write is dropped, so the
    library never sees it: HDF5 cannot close a file whose flush failed (e.g. on
    ENOSPC), keeps it open and then crashes the interpreter at exit (SIGSEGV).
    The writer raises the recorded error itself once the file is closed; the
    half-written shard is then deleted by the pipeline and never trusted.
    """

    error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view and self.error is None:
            try:
                written = super().write(view)
            except OSError as err:
                self.error = err
                break
            if not written:
                self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
            view = view[written:]
        return size

    def truncate(self, size=None):
        if self.error is None:
            try:
                return super().truncate(size)
            except OSError as err:  # e.g. EFBIG past RLIMIT_FSIZE, or ENOSPC
                self.error = err
        return size

    def flush(self) -> None:
        if self.error is None:
            try:
                super().flush()
            except OSError as err:
                self.error = err


class HDF5ShardWriter(ShardWriter):
    """Streams image bytes (or raw pixels) to a side file while the shard is
    written, then at close creates the *contiguous* payload dataset of the exact
    size and copies the bytes in. Contiguous storage has a fixed file offset, so
    readers can map it and slice samples without a per-read trip through the
    HDF5 library; the one extra sequential copy is cheap next to validation."""

    def __init__(self, path: str, storage: StorageSpec, **options):
        super().__init__(path, storage)
        self.payload_path = path + ".payload"
        self.payload = open(self.payload_path, "wb")
        self.index = IndexBuilder()
        self.offsets = [0]

    def put(self, samples: Sequence[Sample]) -> None:
        if self.storage.mode == "raw":
            h, w = self.storage.raw_shape
            for s in samples:
                if len(s.image) != h * w * 3:
                    raise ValueError(f"raw sample {s.relpath!r} has {len(s.image)} bytes, expected {h * w * 3}")
        self.payload.write(b"".join(s.image for s in samples))
        for s in samples:
            self.offsets.append(self.offsets[-1] + len(s.image))
            self.index.add(label=s.label, xxh=s.xxh, width=s.width, height=s.height, fmt=s.fmt,
                           nbytes=len(s.image), relpath=s.relpath)

    def close(self) -> ShardIndex:
        index = self.index.build()
        self.payload.close()
        total = self.offsets[-1]
        raw = _SwallowingFile(self.path, "w+b")
        try:
            with h5py.File(raw, "w", locking=False) as f:
                if self.storage.mode == "raw":
                    h, w = self.storage.raw_shape
                    data = f.create_dataset(spec.PIXELS, shape=(len(index), h, w, 3), dtype=np.uint8)
                else:
                    data = f.create_dataset(spec.IMAGES, shape=(total,), dtype=np.uint8)
                    f.create_dataset(spec.OFFSETS, data=np.asarray(self.offsets, dtype="<i8"))
                with open(self.payload_path, "rb") as src:
                    pos = 0
                    row = data.shape[1] * data.shape[2] * 3 if self.storage.mode == "raw" else 1
                    block_rows = max(1, _COPY_BLOCK // row)
                    while True:
                        chunk = src.read(block_rows * row)
                        if not chunk:
                            break
                        arr = np.frombuffer(chunk, dtype=np.uint8)
                        rows = len(arr) // row
                        data[pos:pos + rows] = arr.reshape((rows,) + data.shape[1:])
                        pos += rows
                for name, dtype in spec.INDEX_ARRAYS.items():
                    f.create_dataset(name, data=np.asarray(getattr(index, name), dtype=dtype))
                f.attrs["layout"] = spec.LAYOUT
                f.attrs["version"] = spec.VERSION
                f.attrs["count"] = len(index)
        finally:
            raw.close()
        if raw.error is not None:
            raise OSError(raw.error.errno, raw.error.strerror or str(raw.error), self.path) from raw.error
        os.unlink(self.payload_path)
        fsync_file(self.path)
        return index

    def abort(self) -> None:
        try:
            self.payload.close()
        finally:
            for path in (self.payload_path,):
                if os.path.exists(path):
                    os.unlink(path)
