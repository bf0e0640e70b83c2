"""Read one HDF5 shard (layout in ``spec.py``)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import h5py
import numpy as np

from fastdata.common.fileio import check_regular, open_regular
from fastdata.errors import CorruptRecordError, FormatError, UnsafeStoreError
from fastdata.format.backends.base import MappedPages, ShardReader, StorageSpec
from fastdata.format.backends.hdf5 import spec, structure
from fastdata.format.record import (
    OPTIONAL_INDEX_ARRAYS,
    SampleIndex,
    ShardIndex,
    checksum,
    index_layout,
    read_index_arrays,
    v1_index_arrays,
)


def _map_address(m: mmap.mmap) -> int:
    """Address of the first byte of a mapping (to turn array offsets into map offsets)."""
    return np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data


class HDF5ShardReader(ShardReader):
    """Opens with mode "r", ``locking=False`` (published shards are immutable and
    HDF5 file locking fails on NFS/Lustre) and a small bounded chunk cache.

    The payload dataset (``images`` or ``pixels``) is contiguous, so after
    reading the index through h5py the reader maps the payload's byte range
    read-only (``MADV_RANDOM``: no readahead for random access) and slices
    samples out of the mapping directly. Each process makes its own mapping
    (readers are created lazily per process by the datasets). (Classification shards of the
    first writer, fastdata 0.1.0, hold a chunked payload: read through h5py instead.)

    Nothing is read before it is checked (``structure.py``): the path must be a regular
    file (never a FIFO or device) before h5py opens it; every link in the file must be a
    hard link and no dataset may use external storage or a virtual layout (checked on
    open, over the whole file); each dataset's dtype, shape (from the shard's count, which
    must be the manifest's when ``expected_count`` is given) and stored bytes are checked
    before it is read; the payload lies within the file (contiguous, or chunked unfiltered and
    fully stored in a first-writer classification shard)."""

    #: diagnose(): the handles held here are reopened per process (see the datasets)
    __fastdata_fork_safe__ = True

    def __init__(self, path: str, storage: StorageSpec, **options):
        super().__init__(path, storage, **options)
        self._map: mmap.mmap | None = None
        self._payload: np.ndarray | None = None
        self._chunk_map: mmap.mmap | None = None
        self._chunks: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._checksums: np.ndarray | None = None
        self.file = None
        self.file, self._datasets, self._stat = self._open_checked(path)

    @classmethod
    def _open_checked(cls, path: str) -> tuple[h5py.File, dict[str, structure.DatasetInfo], os.stat_result]:
        """Open ``path`` once it is known to be a regular file, and check its links and
        datasets (:func:`structure.walk`) before anything is read."""
        try:
            st = check_regular(path, "shard")  # never a FIFO (h5py would wait on it forever) or a device
            f = h5py.File(path, "r", locking=False, rdcc_nbytes=spec.READER_CHUNK_CACHE)
        except (OSError, ValueError) as err:
            raise FormatError(f"{path}: cannot open HDF5 shard ({err}); the file is missing or damaged; "
                              "run 'fastdata verify' on the store") from None
        try:
            opened = os.fstat(f.id.get_vfd_handle())
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise UnsafeStoreError(f"{path}: the shard file was replaced while it was opened")
            return f, structure.walk(f, path), opened
        except BaseException:
            f.close()
            raise

    @classmethod
    def check_structure(cls, path: str, *, full: bool = False) -> None:
        """A regular file whose links and datasets pass :func:`structure.walk` (the per-dataset
        checks run when the index is read, before each dataset is)."""
        f, _datasets, _stat = cls._open_checked(path)
        f.close()

    def _array(self, name: str, dtype, shape, *, contiguous: bool = False) -> np.ndarray:
        """Dataset ``name`` read in native byte order, once :func:`structure.check_dataset` passed."""
        assert self.file is not None
        structure.check_dataset(self._datasets, name, dtype, shape, self._stat.st_size, self.path,
                                contiguous=contiguous)
        return np.asarray(self.file[name][()], dtype=np.dtype(dtype).newbyteorder("="))

    def _header_count(self, f) -> int:
        """The shard's record count from its root attributes (layout, version and count checked,
        and the count against the manifest's when the reader was given it)."""
        expected = spec.VERSION if self.schema is None else spec.VERSION_2
        if structure.scalar_attr(f, "layout", self.path) != spec.LAYOUT:
            raise CorruptRecordError(f"{self.path}: missing or damaged shard header", shard=self.path)
        version = structure.scalar_attr(f, "version", self.path)
        if not isinstance(version, np.integer | int) or int(version) != expected:
            raise FormatError(f"{self.path}: HDF5 shard layout version {version!r} is not supported "
                              f"(expects {expected})")
        count = structure.scalar_attr(f, "count", self.path)
        if not isinstance(count, np.integer | int) or int(count) < 0:
            raise CorruptRecordError(f"{self.path}: damaged shard header (count)", shard=self.path)
        self.check_count(int(count))
        return int(count)

    def read_index(self) -> ShardIndex | SampleIndex:
        f = self.file
        if f is None:
            raise ValueError(f"{self.path}: the shard reader is closed")
        count = self._header_count(f)
        try:
            if self.schema is not None:
                return self._read_index_v2(f, count)
            arrays = {name: self._array(name, dtype, structure.flat if name == "relpaths" else
                                        (count + 1,) if name == "relpath_offsets" else (count,))
                      for name, dtype in spec.INDEX_ARRAYS.items()
                      if name not in OPTIONAL_INDEX_ARRAYS or name in self._datasets}
            arrays = v1_index_arrays(arrays.get, count, self.path)
            offsets: np.ndarray | None
            # (contiguous=False: the first writer, fastdata 0.1.0, stored the payload chunked; read
            # through h5py below, the checks of a chunked dataset applied: unfiltered, fully stored)
            if self.storage.mode.holds_fixed_size_pixels:
                h, w = self.storage.fixed_pixel_shape()
                payload_name = spec.PIXELS
                data = structure.check_dataset(self._datasets, spec.PIXELS, "u1", (count, h, w, 3),
                                               self._stat.st_size, self.path)
                offsets = None
            else:
                payload_name = spec.IMAGES
                data = structure.check_dataset(self._datasets, spec.IMAGES, "u1", structure.flat,
                                               self._stat.st_size, self.path)
                offsets = self._array(spec.OFFSETS, "<i8", (count + 1,))
        except (KeyError, OSError, ValueError, TypeError) as err:
            raise CorruptRecordError(f"{self.path}: shard index unreadable ({err})", shard=self.path) from None
        index = ShardIndex(**arrays)
        index.validate(self.path)
        if offsets is not None and (offsets[0] != 0 or np.any(np.diff(offsets) != index.nbytes)
                                    or offsets[-1] != data.nbytes):
            raise CorruptRecordError(f"{self.path}: image offsets are inconsistent", shard=self.path)
        if data.nbytes and data.offset is None:  # a version-1 store of the first writer: chunked payload
            self._payload = _ChunkedPayload(f[payload_name], self.path)  # type: ignore[assignment]
            self._offsets, self._checksums = offsets, index.checksums
            return index
        self._adopt_payload(index, offsets, data.offset, data.nbytes)
        return index

    def _read_index_v2(self, f, count: int) -> SampleIndex:
        """Version 2: the index arrays by key, then map ``records`` like version 1's ``images``."""
        assert self.schema is not None
        layout = index_layout(self.schema)

        def get(key: str):
            if key not in self._datasets:
                return None
            if key == "relpaths":
                return self._array(key, "u1", structure.flat)
            if key == "relpath_offsets":
                return self._array(key, "<i8", (count + 1,))
            dtype, per = layout[key]
            return self._array(key, dtype, structure.rows(count, per))

        index = read_index_arrays(self.schema, get, count, self.path)
        data = structure.check_dataset(self._datasets, spec.RECORDS, "u1", structure.flat, self._stat.st_size,
                                       self.path, contiguous=True)
        offsets = self._array(spec.OFFSETS, "<i8", (count + 1,))
        if count and (offsets[0] != 0 or np.any(np.diff(offsets) != index.nbytes) or offsets[-1] != data.nbytes):
            raise CorruptRecordError(f"{self.path}: record offsets are inconsistent", shard=self.path)
        if self.schema.chunked_fields() and self._chunks is None:
            chunks = structure.check_dataset(self._datasets, spec.CHUNKS, "u1", structure.flat, self._stat.st_size,
                                             self.path, contiguous=True)
            if chunks.nbytes and chunks.offset is None:
                raise CorruptRecordError(f"{self.path}: chunks dataset is not contiguous", shard=self.path)
            self._chunk_map, self._chunks = self._map_range(chunks.offset or 0, chunks.nbytes)
            self.mapped_pages = MappedPages()  # chunk_bytes() gives views of this mapping
        self._adopt_payload(index, offsets, data.offset, data.nbytes)
        return index

    def _adopt_payload(self, index: ShardIndex | SampleIndex, offsets: np.ndarray | None, file_offset: int | None,
                       nbytes: int) -> None:
        """Map the checked index's payload dataset (``nbytes`` at ``file_offset``, None when HDF5 did not
        store it in one piece) and keep the record ``offsets`` (None: fixed-size raw pixels) and the
        checksums :meth:`get` reads by."""
        if nbytes and file_offset is None:
            raise CorruptRecordError(f"{self.path}: payload dataset is not contiguous", shard=self.path)
        self._map_payload(file_offset or 0, nbytes)
        self._offsets = offsets
        self._checksums = index.checksums

    def _map_payload(self, file_offset: int, nbytes: int) -> None:
        self._map, self._payload = self._map_range(file_offset, nbytes)

    def _map_range(self, file_offset: int, nbytes: int) -> tuple[mmap.mmap | None, np.ndarray]:
        """A read-only ``MADV_RANDOM`` mapping of ``nbytes`` of the shard at ``file_offset``, checked
        to lie within the file that was opened, and the bytes as a uint8 array over it."""
        if nbytes == 0:
            return None, np.zeros(0, dtype=np.uint8)
        fd = open_regular(self.path, "shard")
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self._stat.st_dev, self._stat.st_ino):
                raise UnsafeStoreError(f"{self.path}: the shard file was replaced while it was open")
            if file_offset + nbytes > st.st_size:
                raise CorruptRecordError(f"{self.path}: payload runs past the end of the file (truncated shard)",
                                         shard=self.path)
            start = file_offset - file_offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, nbytes + file_offset - start, access=mmap.ACCESS_READ, offset=start)
        finally:
            os.close(fd)
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_RANDOM)
        return mapping, np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=file_offset - start)

    def chunk_bytes(self, first: int, table, chunk: int) -> np.ndarray | None:
        """Chunk ``chunk`` of a value whose chunks start ``first`` bytes into the ``chunks``
        dataset: a view of the mapping (None when the table puts it outside the dataset)."""
        if self._chunks is None:
            self._loaded()
        chunks = self._chunks
        if chunks is None:
            return None
        start = first + int(table.starts_of(chunk))
        end = start + int(table.nbytes[chunk])
        if not 0 <= start <= end <= len(chunks):
            return None
        return chunks[start:end]

    def get_chunks(self, first: int, table, chunks: Sequence[int], where: str) -> list:
        """As :meth:`ShardReader.get_chunks`, the whole span asked for advised at once
        (``MADV_WILLNEED``): a cold chunk is then not read one page fault at a time."""
        if self._chunks is None:
            self._loaded()
        if self._chunk_map is not None and chunks and hasattr(mmap, "MADV_WILLNEED"):
            base = self._chunks.ctypes.data - _map_address(self._chunk_map)  # type: ignore[union-attr]
            page = mmap.PAGESIZE
            for j in chunks:
                a = first + int(table.starts_of(j))
                b = a + int(table.nbytes[j])
                if 0 <= a <= b <= len(self._chunks):  # type: ignore[arg-type]
                    lo = (base + a) // page * page
                    try:
                        self._chunk_map.madvise(mmap.MADV_WILLNEED, lo, base + b - lo)
                    except (OSError, ValueError):  # advice only
                        break
        return super().get_chunks(first, table, chunks, where)

    def _loaded(self) -> tuple[np.ndarray, np.ndarray]:
        """``(payload, checksums)``, reading the index on first use.

        Raises ValueError once the reader is closed (close() drops the mapping)."""
        if self.file is None:
            raise ValueError(f"{self.path}: the shard reader is closed")
        if self._checksums is None:
            with self.lazy_lock:
                if self._checksums is None:
                    self.read_index()
        # read_index() either maps the payload and keeps the checksums, or raises
        assert self._payload is not None and self._checksums is not None
        return self._payload, self._checksums

    def _check(self, data: bytes, checksums: np.ndarray, local_index: int) -> bytes:
        if checksum(data) != int(checksums[local_index]):
            what = "image" if self.schema is None else "record"
            raise CorruptRecordError(f"{self.path} record {local_index}: {what} checksum mismatch "
                                     "(the record is damaged)",
                                     shard=self.path, index=local_index)
        return data

    def _span(self, local_index: int) -> tuple[int, int]:
        if self._offsets is None:
            h, w = self.storage.fixed_pixel_shape()
            row = h * w * 3
            return local_index * row, (local_index + 1) * row
        return int(self._offsets[local_index]), int(self._offsets[local_index + 1])

    def _read(self, payload: np.ndarray, local_index: int) -> bytes:
        a, b = self._span(local_index)
        try:
            return payload[a:b].tobytes()
        except (OSError, ValueError) as err:  # e.g. SIGBUS-free I/O errors surface as OSError
            raise CorruptRecordError(f"{self.path} record {local_index}: unreadable ({err})",
                                     shard=self.path, index=local_index) from None

    def get(self, local_index: int) -> bytes:
        payload, checksums = self._loaded()
        if not 0 <= local_index < len(checksums):
            raise IndexError(local_index)
        return self._check(self._read(payload, local_index), checksums, local_index)

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """Samples are sliced in offset order so a cold store is read as sequentially as the batch allows."""
        payload, checksums = self._loaded()
        idx = np.asarray(local_indices, dtype=np.int64)
        out: list = [None] * len(idx)
        order = np.argsort(idx, kind="stable").tolist()
        self._prefetch(payload, (int(idx[j]) for j in order))
        for j in order:
            i = int(idx[j])
            out[j] = self._check(self._read(payload, i), checksums, i)
        return out

    def _prefetch(self, payload: np.ndarray, local_indices) -> None:
        """Ask the kernel for every sample of the batch at once (``MADV_WILLNEED``, in
        offset order) before touching any: the map is ``MADV_RANDOM``, so otherwise a
        cold sample larger than a page would be read one page fault at a time."""
        if self._map is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        base = payload.ctypes.data - _map_address(self._map)
        page = mmap.PAGESIZE
        for i in local_indices:
            a, b = self._span(i)
            start = (base + a) // page * page
            try:
                self._map.madvise(mmap.MADV_WILLNEED, start, base + b - start)
            except (OSError, ValueError):  # advice only: never fail a read over it
                return

    def get_raw_batch(self, local_indices: np.ndarray, out: np.ndarray) -> None:
        """Raw mode: one numpy gather from the mapped pixel array (sorted order), then checksums."""
        payload, checksums = self._loaded()
        idx = np.asarray(local_indices, dtype=np.int64)
        h, w = self.storage.fixed_pixel_shape()
        order = np.argsort(idx, kind="stable")
        if isinstance(payload, _ChunkedPayload):
            for j in order.tolist():
                out[j] = payload.row(int(idx[j])).reshape(h, w, 3)
        else:
            out[order] = payload.reshape(-1, h, w, 3)[idx[order]]
        for j, i in enumerate(idx.tolist()):
            if checksum(out[j]) != int(checksums[i]):
                raise CorruptRecordError(f"{self.path} record {i}: image checksum mismatch (the record is damaged)",
                                         shard=self.path, index=i)

    def close(self) -> None:
        f, self.file = getattr(self, "file", None), None
        self.mapped_pages = None
        self._payload = None
        self._chunks = None
        for attr in ("_map", "_chunk_map"):
            m = getattr(self, attr, None)
            setattr(self, attr, None)
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a caller still holds a view; the GC unmaps it later
                    pass
        if f is not None:
            try:
                f.close()
            except Exception:  # closing a damaged file can raise; nothing left to release
                pass


class _ChunkedPayload:
    """The payload dataset of a version-1 shard written by fastdata 0.1.0, which stored it chunked
    (every later writer stores it contiguous, and readers map it). Records are read through h5py,
    a byte range (or a pixel row) at a time, through the file's bounded chunk cache: sliced as the
    mapped payload is, ``payload[a:b]`` giving the bytes ``a`` to ``b`` as a uint8 array."""

    def __init__(self, dataset, path: str):
        self._dataset, self._path = dataset, path
        self._row = int(np.prod(dataset.shape[1:], dtype=np.int64)) if dataset.ndim > 1 else 1

    def row(self, i: int) -> np.ndarray:
        """Row ``i`` of a pixel dataset ``[n, H, W, 3]``, flat."""
        return np.asarray(self._dataset[i], dtype=np.uint8).reshape(-1)

    def __getitem__(self, span: slice) -> np.ndarray:
        a, b = int(span.start), int(span.stop)
        if self._dataset.ndim == 1:
            return np.asarray(self._dataset[a:b], dtype=np.uint8)
        if a % self._row or b - a != self._row:
            raise ValueError(f"{self._path}: bytes {a}..{b} are not one pixel row of {self._row}")
        return self.row(a // self._row)
