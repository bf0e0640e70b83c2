"""Read one HDF5 shard (layout in ``spec.py``)."""

from __future__ import annotations

from typing import Sequence

import h5py
import numpy as np

from ...errors import CorruptRecordError, FormatError
from ...record import ShardIndex, checksum
from ..base import ShardReader, StorageSpec
from . import spec


class HDF5ShardReader(ShardReader):
    """Opens with mode "r", ``locking=False`` (published shards are immutable and
    HDF5 file locking fails on NFS/Lustre) and a small bounded chunk cache."""

    def __init__(self, path: str, storage: StorageSpec, **options):
        super().__init__(path, storage)
        try:
            self.file = h5py.File(path, "r", locking=False, rdcc_nbytes=spec.READER_CHUNK_CACHE)
        except (OSError, ValueError) as err:
            raise FormatError(f"{path}: cannot open HDF5 shard ({err}); the file is missing or damaged; "
                              "run 'fastdata verify' on the store") from None
        self._offsets: np.ndarray | None = None
        self._checksums: np.ndarray | None = None
        self.data = None

    def read_index(self) -> ShardIndex:
        f = self.file
        try:
            if f.attrs.get("layout") != spec.LAYOUT:
                raise CorruptRecordError(f"{self.path}: missing or damaged shard header", shard=self.path)
            if int(f.attrs.get("version", -1)) != spec.VERSION:
                raise FormatError(f"{self.path}: HDF5 shard layout version {f.attrs.get('version')!r} "
                                  f"is not supported (expects {spec.VERSION})")
            arrays = {name: np.asarray(f[name][()], dtype=np.dtype(dtype).newbyteorder("="))
                      for name, dtype in spec.INDEX_ARRAYS.items()}
            count = int(f.attrs["count"])
            if self.storage.mode == "raw":
                self.data = f[spec.PIXELS]
                total = self.data.shape[0]
                self._offsets = None
            else:
                self.data = f[spec.IMAGES]
                self._offsets = np.asarray(f[spec.OFFSETS][()], dtype=np.int64)
                total = len(self._offsets) - 1
        except (KeyError, OSError, ValueError, TypeError) as err:
            raise CorruptRecordError(f"{self.path}: shard index unreadable ({err})", shard=self.path) from None
        index = ShardIndex(**arrays)
        if len(index) != count or total != count:
            raise CorruptRecordError(f"{self.path}: index has {len(index)} entries, header says {count}",
                                     shard=self.path)
        index.validate(self.path)
        if self._offsets is not None and (
            self._offsets[0] != 0 or np.any(np.diff(self._offsets) != index.nbytes) or self._offsets[-1] > self.data.shape[0]
        ):
            raise CorruptRecordError(f"{self.path}: image offsets are inconsistent", shard=self.path)
        self._checksums = index.checksums
        return index

    def _ensure_index(self) -> None:
        if self._checksums is None:
            self.read_index()

    def _check(self, data: bytes, local_index: int) -> bytes:
        if checksum(data) != int(self._checksums[local_index]):
            raise CorruptRecordError(f"{self.path} record {local_index}: image checksum mismatch (the record is damaged)",
                                     shard=self.path, index=local_index)
        return data

    def _read(self, local_index: int) -> bytes:
        try:
            if self._offsets is None:
                return self.data[local_index].tobytes()
            a, b = self._offsets[local_index], self._offsets[local_index + 1]
            return self.data[a:b].tobytes()
        except (OSError, ValueError) as err:
            raise CorruptRecordError(f"{self.path} record {local_index}: unreadable ({err})",
                                     shard=self.path, index=local_index) from None

    def get(self, local_index: int) -> bytes:
        self._ensure_index()
        if not 0 <= local_index < len(self._checksums):
            raise IndexError(local_index)
        return self._check(self._read(local_index), local_index)

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """Reads in offset order; a run of consecutive indices is one contiguous read."""
        self._ensure_index()
        idx = np.asarray(local_indices, dtype=np.int64)
        out: list = [None] * len(idx)
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        # split the sorted indices into runs of consecutive values
        breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
        for run_pos in np.split(np.arange(len(sorted_idx)), breaks):
            if not len(run_pos):
                continue
            first, last = int(sorted_idx[run_pos[0]]), int(sorted_idx[run_pos[-1]])
            if self._offsets is None:
                try:
                    block = self.data[first:last + 1]
                except (OSError, ValueError) as err:
                    raise CorruptRecordError(f"{self.path} records {first}-{last}: unreadable ({err})",
                                             shard=self.path, index=first) from None
                for k, pos in enumerate(run_pos):
                    i = int(sorted_idx[pos])
                    out[order[pos]] = self._check(block[k].tobytes(), i)
            else:
                base = int(self._offsets[first])
                try:
                    block = self.data[base:int(self._offsets[last + 1])].tobytes()
                except (OSError, ValueError) as err:
                    raise CorruptRecordError(f"{self.path} records {first}-{last}: unreadable ({err})",
                                             shard=self.path, index=first) from None
                for pos in run_pos:
                    i = int(sorted_idx[pos])
                    a, b = int(self._offsets[i]) - base, int(self._offsets[i + 1]) - base
                    out[order[pos]] = self._check(block[a:b], i)
        return out

    def get_raw_batch(self, local_indices: np.ndarray, out: np.ndarray) -> None:
        """Raw mode: fancy-index read in sorted order, one call per batch."""
        self._ensure_index()
        idx = np.asarray(local_indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        if len(sorted_idx) and np.all(np.diff(sorted_idx) == 1):
            block = self.data[int(sorted_idx[0]):int(sorted_idx[-1]) + 1]
        else:
            uniq, inverse = np.unique(sorted_idx, return_inverse=True)
            block = self.data[uniq][inverse]
        for k, i in enumerate(sorted_idx):
            self._check(block[k].tobytes(), int(i))
        out[order] = block

    def close(self) -> None:
        f, self.file = getattr(self, "file", None), None
        self.data = None
        if f is not None:
            try:
                f.close()
            except Exception:  # closing a damaged file can raise; nothing left to release
                pass
