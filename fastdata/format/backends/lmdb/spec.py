"""LMDB shard layout, versions 1 (classification), 2 (general samples) and 3 (either, with tails).

A shard is one LMDB environment in a single file (``subdir=False``): named databases ``records``
(a msgpack record per sample under its 8-byte big-endian local index), ``index`` (the header and
the per-sample arrays readers load at open), ``chunks`` for chunked fields, and from version 3
``tails``: LMDB keeps a value larger than about half a page in whole overflow pages, so a record
whose last page would waste at least :data:`SPLIT_MIN_WASTE` bytes is stored as a head that fills
its pages exactly plus tail parts inline in leaf pages (:func:`cut_tail`). Optional
``record_spans``/``chunk_spans``/``tail_spans`` in ``index`` are read-ahead advice only.

The byte-level specification (keys, values, dtypes, versions, how a reader opens a shard), precise
enough to read a shard with ``lmdb`` alone: ``docs/FORMAT.md``, section 5.
"""

from __future__ import annotations

import struct

from fastdata.format.record import INDEX_DTYPES

LAYOUT = "fastdata-lmdb-shard"
VERSION = 1
#: layout version of general (schema) stores
VERSION_2 = 2
#: layout version of shards with a ``tails`` database (records of either version)
VERSION_TAILS = 3
TAILS_DB = b"tails"
#: a record is split only where its last overflow page would leave at least this many bytes empty
SPLIT_MIN_WASTE = 256
#: LMDB's page header (``PAGEHDRSZ`` of a 64-bit build): an overflow value of ``k`` pages holds
#: ``k * psize - PAGE_HEADER`` bytes
PAGE_HEADER = 16
#: a reader follows at most this many tail parts (4 KiB pages need at most 3)
MAX_TAIL_PARTS = 64
RECORDS_DB = b"records"
INDEX_DB = b"index"
CHUNKS_DB = b"chunks"
#: a write transaction of chunks is committed after about this many bytes (LMDB keeps a
#: transaction's dirty pages in memory until it commits)
CHUNK_COMMIT_BYTES = 64 << 20
HEADER_KEY = b"header"
#: index keys of the advisory (offset, length) spans of records and chunks (see the module docstring)
RECORD_SPANS_KEY = b"record_spans"
TAIL_SPANS_KEY = b"tail_spans"
CHUNK_SPANS_KEY = b"chunk_spans"
KEY = struct.Struct(">Q")
#: chunk keys a reader looks up are below this (the index's ``first`` + chunk, as Python ints: an
#: int64 position, never a wrapped one)
MAX_CHUNK_KEY = 1 << 63
#: index key -> numpy dtype string (explicit little-endian)
INDEX_ARRAYS = INDEX_DTYPES
#: first map size; it doubles on MapFullError, so users never see MDB_MAP_FULL
DEFAULT_INITIAL_MAP_SIZE = 64 << 20


def encode_key(local_index: int) -> bytes:
    """Key of the record at ``local_index`` in its shard."""
    return KEY.pack(local_index)


def tail_key(local_index: int, part: int) -> bytes:
    """Key of part ``part`` of the tail of the record at ``local_index``."""
    return KEY.pack(local_index) + bytes((part,))


def inline_max(psize: int, key_bytes: int) -> int:
    """The largest value LMDB 0.9 keeps inside a leaf page (not in overflow pages) under a key of
    ``key_bytes``: ``me_nodemax = ((psize - 16) / 2 & -2) - 2`` less the node header (8) and the key."""
    return (((psize - PAGE_HEADER) // 2) & ~1) - 2 - 8 - key_bytes


def fills_pages(length: int, psize: int) -> bool:
    """Whether a head of ``length`` bytes fills its overflow pages exactly (or is empty): only
    such a head can have tail parts."""
    return length == 0 or (length + PAGE_HEADER) % psize == 0


def split_point(length: int, psize: int) -> int:
    """Where a record of ``length`` bytes is cut into its head and its tail: ``length`` (kept
    whole) when it is inline in ``records`` or its last page would waste fewer than
    :data:`SPLIT_MIN_WASTE` bytes, else the largest ``k * psize - PAGE_HEADER`` below it (0 when
    the record fits one page)."""
    if length <= inline_max(psize, KEY.size):
        return length
    pages = -(-(length + PAGE_HEADER) // psize)
    if pages * psize - PAGE_HEADER - length < SPLIT_MIN_WASTE:
        return length
    head = (pages - 1) * psize - PAGE_HEADER
    return max(head, 0)


#: a tail part is not cut smaller than this to fill a leaf page's last bytes (a new page is begun)
MIN_PART = 64


def cut_tail(length: int, free: int, psize: int) -> tuple[list[int], int]:
    """The sizes of the parts of a tail of ``length`` bytes appended to the ``tails`` database
    whose last leaf page has ``free`` bytes left, and the bytes left after them.

    LMDB (0.9, ``mdb_node_add``) takes ``EVEN(8 + key + data) + 2`` bytes of a leaf page for a
    node and, appending (``MDB_APPEND``), begins a new page with a node that does not fit; so each
    part is cut to what the page has left, and the pages fill completely. Were LMDB to lay pages
    out otherwise, only the space saved would change, never what is read."""
    node = 8 + KEY.size + 1  # node header and the 9-byte key
    largest = inline_max(psize, KEY.size + 1)
    fresh = psize - PAGE_HEADER
    parts: list[int] = []
    while length > 0:
        room = min(largest, free - node - 2)
        if room < min(MIN_PART, length):
            free = fresh
            continue
        part = min(length, room)
        parts.append(part)
        free -= (node + part + 1) // 2 * 2 + 2
        length -= part
    return parts, free
