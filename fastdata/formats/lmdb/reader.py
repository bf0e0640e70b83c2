"""Read one LMDB shard (layout in ``spec.py``)."""

from __future__ import annotations

from typing import Sequence

import lmdb
import msgpack
import numpy as np

from ...errors import CorruptRecordError, FormatError
from ...record import ShardIndex, decode_record
from ..base import ShardReader, StorageSpec
from . import spec


class LMDBShardReader(ShardReader):
    """Opens the environment read-only without a lock table and without spare
    transactions (nothing survives a fork: see GUIDE section 3)."""

    def __init__(self, path: str, storage: StorageSpec, *, readahead: bool = False, **options):
        super().__init__(path, storage)
        try:
            self.env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=readahead,
                                 max_spare_txns=0, max_dbs=2)
            self.records = self.env.open_db(spec.RECORDS_DB, create=False)
            self.index_db = self.env.open_db(spec.INDEX_DB, create=False)
        except lmdb.Error as err:
            raise FormatError(f"{path}: cannot open LMDB shard ({err}); the file is missing or damaged; "
                              "run 'fastdata verify' on the store") from None

    def read_index(self) -> ShardIndex:
        try:
            with self.env.begin(db=self.index_db) as txn:
                header_raw = txn.get(spec.HEADER_KEY)
                raw = {name: txn.get(name.encode()) for name in spec.INDEX_ARRAYS}
        except lmdb.Error as err:
            raise CorruptRecordError(f"{self.path}: cannot read the shard index ({err})", shard=self.path) from None
        try:
            header = msgpack.unpackb(header_raw, raw=False, max_str_len=256, max_map_len=8)
        except Exception:
            header = None
        if not isinstance(header, dict) or header.get("layout") != spec.LAYOUT:
            raise CorruptRecordError(f"{self.path}: missing or damaged shard header", shard=self.path)
        if header.get("version") != spec.VERSION:
            raise FormatError(f"{self.path}: LMDB shard layout version {header.get('version')!r} "
                              f"is not supported (expects {spec.VERSION})")
        arrays = {}
        for name, dtype in spec.INDEX_ARRAYS.items():
            buf = raw[name]
            if buf is None or len(buf) % np.dtype(dtype).itemsize:
                raise CorruptRecordError(f"{self.path}: index array {name!r} missing or damaged", shard=self.path)
            arrays[name] = np.frombuffer(buf, dtype=dtype).astype(np.dtype(dtype).newbyteorder("="))
        index = ShardIndex(**arrays)
        if len(index) != header.get("count"):
            raise CorruptRecordError(f"{self.path}: index has {len(index)} entries, header says {header.get('count')}",
                                     shard=self.path)
        index.validate(self.path)
        return index

    def _decode(self, buf, local_index: int) -> bytes:
        where = f"{self.path} record {local_index}"
        if buf is None:
            raise CorruptRecordError(f"{where}: record is missing", shard=self.path, index=local_index)
        return decode_record(buf, where=where).image

    def get(self, local_index: int) -> bytes:
        with self.env.begin(db=self.records, buffers=True) as txn:
            return self._decode(txn.get(spec.encode_key(local_index)), local_index)

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """One read transaction for the whole batch; keys visited in sorted order."""
        order = np.argsort(np.asarray(local_indices), kind="stable")
        out: list = [None] * len(local_indices)
        with self.env.begin(db=self.records, buffers=True) as txn:
            for j in order:
                i = int(local_indices[j])
                out[j] = self._decode(txn.get(spec.encode_key(i)), i)
        return out

    def close(self) -> None:
        env, self.env = getattr(self, "env", None), None
        if env is not None:
            env.close()
