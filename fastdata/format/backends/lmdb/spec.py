"""LMDB shard layout, versions 1 (classification) and 2 (general samples).

Each shard is one LMDB environment stored as a single file (``subdir=False``),
e.g. ``shard-00000.lmdb``. It holds two named databases:

``records``
    key   = the sample's index *within the shard* as an 8-byte big-endian
            unsigned integer (``struct.pack(">Q", i)``), so key order is sample
            order and keys are 0 .. count-1 without gaps;
    value = one msgpack record (schema in ``fastdata/format/record.py`` and
            ``docs/FORMAT.md``).

``index``
    ``b"header"``  msgpack map ``{"layout": "fastdata-lmdb-shard", "version": 1, "count": n}``
    ``b"labels"`` int64, ``b"checksums"`` uint64, ``b"widths"`` int32,
    ``b"heights"`` int32, ``b"formats"`` uint8, ``b"nbytes"`` int64 (all
    little-endian, ``n`` entries), ``b"relpaths"`` (concatenated path bytes)
    and ``b"relpath_offsets"`` int64 (``n + 1`` entries).

Version 2 (a store whose manifest has a ``schema`` other than the
classification one) keeps the same two databases and keys; only the values differ:

``records``
    value = one version-2 msgpack record ``{"v": 2, "path": bin, <record field>: value, ...}``
    (fields in schema order; see ``fastdata/format/record.py`` and ``docs/FORMAT.md``).

``index``
    ``b"header"`` with ``"version": 2``; ``b"checksums"`` uint64 (xxh3_64 of each
    record's bytes), ``b"nbytes"`` int64 (record lengths), ``b"relpaths"`` /
    ``b"relpath_offsets"`` as in version 1, and per field (``fastdata.format.record.index_layout``):
    ``b"fields/<name>"`` for index-resident fields (the field's dtype, little-endian,
    ``n * prod(shape)`` values, C order) and ``b"fields/<image>.format"`` uint8,
    ``.width`` int32, ``.height`` int32 for each image field.

A store whose schema has ``chunked`` fields adds a third named database:

``chunks``
    key   = a chunk number within the shard, 8-byte big-endian (``struct.pack(">Q", k)``);
    value = one stored chunk (``fastdata/format/chunk_codecs.py``). A value's chunks have
            consecutive numbers in grid order: chunk ``j`` of a sample's field is key
            ``first + j``, ``first`` being the index's ``b"fields/<name>.first"`` entry
            (``uint64``); the record's chunk table gives each one's length and xxh3-64.

Both versions may add ``b"record_spans"`` (and, with a ``chunks`` database,
``b"chunk_spans"``) to ``index``: uint64 little-endian ``[n, 2]``, each record's (each chunk's)
byte offset in the shard file and length, learned from the finished file by the writer
(Linux). Readers use them only as advice, to ask the kernel for a batch's pages before
reading it (``posix_fadvise(WILLNEED)``, deepest first in offset order); what they read
still comes from LMDB's own lookups, so a wrong span costs a useless read-ahead, never
wrong data. Shards without them read the same way, without the prefetch.

The global index of a record is the shard's ``first_index`` (manifest) plus
its key. Readers open with ``readonly=True, lock=False, max_spare_txns=0``
(published stores are immutable; no reader-lock table) and ``readahead`` as
:func:`fastdata.reader.dataset.wants_readahead` decides for the store.
"""

from __future__ import annotations

import struct

from fastdata.format.record import INDEX_DTYPES

LAYOUT = "fastdata-lmdb-shard"
VERSION = 1
#: layout version of general (schema) stores
VERSION_2 = 2
RECORDS_DB = b"records"
INDEX_DB = b"index"
CHUNKS_DB = b"chunks"
#: a write transaction of chunks is committed after about this many bytes (LMDB keeps a
#: transaction's dirty pages in memory until it commits)
CHUNK_COMMIT_BYTES = 64 << 20
HEADER_KEY = b"header"
#: index keys of the advisory (offset, length) spans of records and chunks (see the module docstring)
RECORD_SPANS_KEY = b"record_spans"
CHUNK_SPANS_KEY = b"chunk_spans"
KEY = struct.Struct(">Q")
#: index key -> numpy dtype string (explicit little-endian)
INDEX_ARRAYS = INDEX_DTYPES
#: first map size; it doubles on MapFullError, so users never see MDB_MAP_FULL
DEFAULT_INITIAL_MAP_SIZE = 64 << 20


def encode_key(local_index: int) -> bytes:
    """Key of the record at ``local_index`` in its shard."""
    return KEY.pack(local_index)
