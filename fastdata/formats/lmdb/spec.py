"""LMDB shard layout, version 1.

Each shard is one LMDB environment stored as a single file (``subdir=False``),
e.g. ``shard-00000.lmdb``. It holds two named databases:

``records``
    key   = the sample's index *within the shard* as an 8-byte big-endian
            unsigned integer (``struct.pack(">Q", i)``), so key order is sample
            order and keys are 0 .. count-1 without gaps;
    value = one msgpack record (schema in ``fastdata/record.py`` and
            ``docs/FORMAT.md``).

``index``
    ``b"header"``  msgpack map ``{"layout": "fastdata-lmdb-shard", "version": 1, "count": n}``
    ``b"labels"`` int64, ``b"checksums"`` uint64, ``b"widths"`` int32,
    ``b"heights"`` int32, ``b"formats"`` uint8, ``b"nbytes"`` int64 (all
    little-endian, ``n`` entries), ``b"relpaths"`` (concatenated path bytes)
    and ``b"relpath_offsets"`` int64 (``n + 1`` entries).

The global index of a record is the shard's ``first_index`` (manifest) plus
its key. Readers open with ``readonly=True, lock=False, readahead=False,
max_spare_txns=0`` (published stores are immutable; no reader-lock table).
"""

from __future__ import annotations

import struct

from ...record import INDEX_DTYPES

LAYOUT = "fastdata-lmdb-shard"
VERSION = 1
RECORDS_DB = b"records"
INDEX_DB = b"index"
HEADER_KEY = b"header"
KEY = struct.Struct(">Q")
#: index key -> numpy dtype string (explicit little-endian)
INDEX_ARRAYS = INDEX_DTYPES
#: first map size; it doubles on MapFullError, so users never see MDB_MAP_FULL
DEFAULT_INITIAL_MAP_SIZE = 64 << 20


def encode_key(local_index: int) -> bytes:
    """Key of the record at ``local_index`` in its shard."""
    return KEY.pack(local_index)
