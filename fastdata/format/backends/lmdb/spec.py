"""LMDB shard layout, versions 1 (classification), 2 (general samples) and 3 (either, with tails).

Each shard is one LMDB environment stored as a single file (``subdir=False``),
e.g. ``shard-00000.lmdb``. It holds two named databases (three from version 3, below):

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

A store whose schema has ``chunked`` fields adds one more named database:

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

Version 3 (what fastdata writes) holds the records of version 1 or 2 (as the manifest's
version says) and adds a ``tails`` database, because LMDB keeps every value larger than
about half a page in whole overflow pages: a 56 KB record left most of its last 4 KiB page
empty, about 2 KiB a record (3.6% of a store of such JPEGs). A record whose last page would
waste at least :data:`SPLIT_MIN_WASTE` bytes is stored as a *head* that fills its overflow
pages exactly (``k * psize - 16`` bytes, or empty) under its key in ``records`` and the rest
as one to a few *tail parts*, each small enough to sit inline in a leaf page of ``tails``
(:func:`cut_tail` sizes them to fill each leaf page as LMDB appends to it):

``tails``
    key   = the record's local index, 8-byte big-endian, then the part number, one byte;
    value = the part's bytes (at most :func:`inline_max` of a 9-byte key).

Record ``j`` is ``records[j]`` followed by ``tails[j, 0]``, ``tails[j, 1]``, ... while they
exist. A reader looks for tails only behind a head that fills its pages exactly (its length
is ``k * psize - 16`` or 0): another record has none. Records kept whole: raw pixels of a
classification store (PPM: read as views of the map, which a split record cannot be) and
records inline in ``records`` already. ``index`` may add ``b"tail_spans"`` (uint64
little-endian ``[n, k, 2]``, ``k`` the most parts a record of the shard has, at least 1: the file
offset and length of each part of each record's tail, ``(0, 0)`` past its last), advice as
``record_spans`` is (which then covers the heads). One span a part, not one a record: a record's
parts often lie on two leaf pages far apart (LMDB takes a new leaf page from its free list, where
an earlier commit left one).

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
