"""Write one HDF5 shard (layout in ``spec.py``)."""

from __future__ import annotations

import errno
import io
import os
import shutil
import tempfile
from collections.abc import Sequence

import h5py
import numpy as np

from fastdata.common import portable
from fastdata.common.fileio import fsync_file
from fastdata.common.writeback import Writeback
from fastdata.format.backends.base import ShardWriter, StorageSpec
from fastdata.format.backends.hdf5 import spec
from fastdata.format.chunks import PendingChunks
from fastdata.format.record import IndexBuilder, SampleIndex, SampleIndexBuilder, ShardIndex


def file_write(fh: io.FileIO, view: memoryview) -> int | None:
    """One write of libhdf5's through its file object: ``io.FileIO.write``.

    A module-level hook, looked up at each write: a fault-injection test replaces it to make
    the writes of one shard fail (ENOSPC, EIO) without replacing the file class itself.
    """
    return io.FileIO.write(fh, view)


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
                written = file_write(self, view)
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


class _AroundPayloadFile(_SwallowingFile):
    """The shard file as libhdf5 must see it when creating the file around the
    payload already written into it: empty, so its end is what libhdf5 itself
    wrote (it refuses to create a file over one that looks non-empty)."""

    written_end = 0

    def seek(self, pos, whence=0):
        if whence == os.SEEK_END:
            return super().seek(self.written_end + pos)
        return super().seek(pos, whence)

    def write(self, data) -> int:
        size = super().write(data)
        self.written_end = max(self.written_end, self.tell())
        return size

    def truncate(self, size=None):
        if size is not None:
            self.written_end = size
        return super().truncate(size)


#: where the payload (image bytes, or raw pixels) starts in a shard file. The writer
#: streams it there while the shard is written and builds the HDF5 structure around
#: it at close: with 64 KiB alignment for allocations of 64 KiB or more, libhdf5
#: places the contiguous payload dataset at the first aligned address, which is this
#: one (the metadata allocated before it is about 1 KB). Smaller payloads are
#: simply rewritten through h5py. Readers never assume this offset: they ask
#: the dataset (``id.get_offset()``).
PAYLOAD_OFFSET = 64 << 10


class HDF5ShardWriter(ShardWriter):
    """Streams image bytes (or raw pixels) into the shard file at
    :data:`PAYLOAD_OFFSET` while the shard is written, then at close creates the
    HDF5 structure around them: a *contiguous* payload dataset of the exact size,
    allocated at that offset and never filled, plus offsets and index arrays.
    Contiguous storage has a fixed file offset, so readers can map it and slice
    samples without a per-read trip through the HDF5 library, and no image byte
    is copied at close (a 190 MB shard took 0.7 s to copy in through h5py)."""

    def __init__(self, path: str, storage: StorageSpec, **options):
        super().__init__(path, storage, **options)
        self.payload = open(path, "wb")
        self.payload.seek(PAYLOAD_OFFSET)
        self.writeback = Writeback(path)
        self.index: IndexBuilder | SampleIndexBuilder = (
            IndexBuilder() if self.schema is None else SampleIndexBuilder(self.schema))
        self.offsets = [0]
        # the chunks of chunked fields wait in an unnamed file beside the shard (nothing to
        # clean up after a crash) and are copied into the ``chunks`` dataset at close
        self.chunk_file: io.BufferedRandom | None = None
        self.chunk_bytes = 0
        self.has_chunks = bool(self.schema is not None and self.schema.chunked_fields())

    def put_chunks(self, pending: PendingChunks) -> int:
        """Chunks are appended to the shard's chunk bytes; ``first`` is the byte offset of the first."""
        if self.chunk_file is None:
            self.chunk_file = tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(self.path)))
        first = self.chunk_bytes
        with open(pending.path, "rb") as src:
            shutil.copyfileobj(src, self.chunk_file, 1 << 20)
        size = pending.table.stored_bytes
        if self.chunk_file.tell() != first + size:
            raise OSError(f"{pending.path}: holds {self.chunk_file.tell() - first} bytes of chunks, its table says "
                          f"{size}")
        self.chunk_bytes += size
        return first

    def put(self, samples: Sequence) -> None:
        if isinstance(self.index, SampleIndexBuilder):  # version 2: the payload is the records
            data = b"".join(s.record for s in samples)
            self.payload.write(data)
            self.writeback.wrote(len(data))
            for s in samples:
                self.offsets.append(self.offsets[-1] + len(s.record))
                self.index.add(s, self.place_chunks(s))
            return
        if self.storage.mode.holds_fixed_size_pixels:
            h, w = self.storage.fixed_pixel_shape()
            for s in samples:
                if len(s.image) != h * w * 3:
                    raise ValueError(f"raw sample {s.relpath!r} has {len(s.image)} bytes, expected {h * w * 3}")
        data = b"".join(s.image for s in samples)
        self.payload.write(data)
        self.writeback.wrote(len(data))
        for s in samples:
            self.offsets.append(self.offsets[-1] + len(s.image))
            self.index.add(label=s.label, xxh=s.xxh, width=s.width, height=s.height, fmt=s.fmt,
                           nbytes=len(s.image), relpath=s.relpath, dtype=s.dtype, channels=s.channels)

    def close(self) -> ShardIndex | SampleIndex:
        index = self.index.build()
        self.payload.close()
        self.writeback.close()
        total = self.offsets[-1]
        in_place = total >= PAYLOAD_OFFSET
        small = b""
        if not in_place and total:
            with open(self.path, "rb") as fh:
                fh.seek(PAYLOAD_OFFSET)
                small = fh.read(total)
        raw = _AroundPayloadFile(self.path, "r+b")  # not "w": the payload is already in place
        try:
            align = {"alignment_threshold": PAYLOAD_OFFSET, "alignment_interval": PAYLOAD_OFFSET} if in_place else {}
            with h5py.File(raw, "w", locking=False, **align) as f:
                shape: tuple[int, ...]
                if isinstance(index, SampleIndex):
                    name, shape = spec.RECORDS, (total,)
                elif self.storage.mode.holds_fixed_size_pixels:
                    h, w = self.storage.fixed_pixel_shape()
                    name, shape = spec.PIXELS, (len(index), h, w, 3)
                else:
                    name, shape = spec.IMAGES, (total,)
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_layout(h5py.h5d.CONTIGUOUS)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                data = f.create_dataset(name, shape=shape, dtype=np.uint8, dcpl=dcpl)
                payload_at = data.id.get_offset()
                if in_place and data.id.get_offset() != PAYLOAD_OFFSET:
                    raise RuntimeError(f"{self.path}: libhdf5 placed the payload at {data.id.get_offset()}, "
                                       f"not {PAYLOAD_OFFSET}; this HDF5 version is not supported by fastdata's "
                                       "writer (please report it)")
                if small:
                    data[...] = np.frombuffer(small, dtype=np.uint8).reshape(shape)
                chunks_at = None
                if self.has_chunks:
                    chunks = f.create_dataset(spec.CHUNKS, shape=(self.chunk_bytes,), dtype=np.uint8, dcpl=dcpl)
                    chunks_at = chunks.id.get_offset()
                if not self.storage.mode.holds_fixed_size_pixels:
                    f.create_dataset(spec.OFFSETS, data=np.asarray(self.offsets, dtype="<i8"))
                if isinstance(index, SampleIndex):
                    for key, arr in index.arrays.items():
                        f.create_dataset(key, data=np.asarray(arr, dtype=arr.dtype.newbyteorder("<")))
                else:
                    for key, dtype in spec.INDEX_ARRAYS.items():
                        f.create_dataset(key, data=np.asarray(getattr(index, key), dtype=dtype))
                f.attrs["layout"] = spec.LAYOUT
                f.attrs["version"] = spec.VERSION if isinstance(index, ShardIndex) else spec.VERSION_2
                f.attrs["count"] = len(index)
        finally:
            raw.close()
        if raw.error is not None:
            raise OSError(raw.error.errno, raw.error.strerror or str(raw.error), self.path) from raw.error
        if self.chunk_bytes:
            self._copy_chunks(chunks_at)
        fsync_file(self.path)
        index.record_ranges = self._record_ranges(payload_at, len(index))
        return index

    def _record_ranges(self, payload_at: int | None, count: int) -> np.ndarray | None:
        """``[count, 1, 2]`` uint64: each record's (file offset, length) in the contiguous payload at
        ``payload_at`` (None where libhdf5 allocated none: an empty payload). Raw pixels (``[n, H,
        W, 3]``, C order) are their records back to back too, so the offsets say where each is."""
        offsets = np.asarray(self.offsets, dtype=np.int64)
        starts, lengths = offsets[:-1], np.diff(offsets)
        if payload_at is None:
            if lengths.any():
                return None
            payload_at = 0
        ranges = np.stack([starts + int(payload_at), lengths], axis=1).astype("<u8")
        return np.ascontiguousarray(ranges.reshape(count, 1, 2))

    def _copy_chunks(self, offset: int | None) -> None:
        """Copy the waiting chunk bytes into the ``chunks`` dataset's place in the file (libhdf5
        allocated it, contiguous and never filled), in the kernel where it can."""
        assert self.chunk_file is not None
        if offset is None:
            raise RuntimeError(f"{self.path}: libhdf5 did not allocate the chunks dataset in one piece")
        self.chunk_file.flush()
        src = self.chunk_file.fileno()
        with open(self.path, "r+b") as dst:
            done = 0
            while done < self.chunk_bytes:
                step = min(self.chunk_bytes - done, 64 << 20)
                copied = portable.copy_range(src, dst.fileno(), step, done, offset + done)
                if copied <= 0:
                    raise OSError(errno.EIO, f"copying the chunks into {self.path} stopped at byte {done}")
                done += copied
        self.chunk_file.close()
        self.chunk_file = None

    def abort(self) -> None:
        """Close without finishing (the pipeline deletes the file)."""
        try:
            self.payload.close()
        except OSError:
            pass
        if self.chunk_file is not None:
            self.chunk_file.close()
            self.chunk_file = None
        try:
            self.writeback.close()
        except OSError:
            pass
