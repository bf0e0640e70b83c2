"""Check an LMDB shard's on-disk structure with ``os.pread`` before LMDB maps it.

Why: LMDB reads through a memory map of the file and keeps no checksums, so a page
number or a value size that points past the end of the file makes the first access to
it fault (SIGBUS) inside the map, which kills the process; py-lmdb's ``get`` touches
every page of a value. LMDB itself refuses page numbers ``>= last_pg + 1`` (the
meta page's ``mm_last_pg``), but not a ``last_pg`` past the end of the file, nor a
node whose key or data runs past its page, nor an overflow value whose size runs past
the last page. This module reads the file with ``os.pread`` (a short read is an
ordinary result, an I/O error an ``OSError``: nothing here can fault) and refuses, with
:class:`~fastdata.errors.UnsafeStoreError` naming the file and what is wrong:

* meta pages: both pages flagged ``P_META`` with LMDB's magic and data version and the
  same page size (a power of two, 512 .. 65536); the one with the larger ``txnid`` is
  used, as LMDB does; ``(last_pg + 1) * psize <= file size``; the free and main
  databases' roots are "none" or within ``2 .. last_pg``.
* every B-tree page of the main database and of every named database it lists
  (fastdata's layout has ``records``, ``index``, ``tails`` and ``chunks``), level by level from the root: the
  page number within ``2 .. last_pg``, never reached twice, at most 32 levels (LMDB's
  cursor stack); the header's page number the page's own, flags a branch or a leaf,
  ``16 <= lower <= upper <= psize``; every node pointer within the node area and every
  node's key (and inline data) within its page; a branch node's child page within the
  file; no duplicate-key (``F_DUPDATA``, ``MDB_DUPSORT``) data, which fastdata never
  writes; a named database's record exactly one ``MDB_db``.
* every overflow (``F_BIGDATA``) value: its pages ``pgno .. pgno + ceil((16 + size) /
  psize) - 1`` within ``2 .. last_pg``. With ``full=True`` (``verify``) also each
  overflow page's own header (flagged ``P_OVERFLOW``, its ``mp_pages`` covering the
  value, its page number its own) and that no two pages or values overlap.

Layouts follow ``lmdb.h``/``mdb.c`` of LMDB 0.9 on a 64-bit build: page header
``MDB_page`` {pgno u64, pad u16, flags u16, lower u16, upper u16 (or pages u32)},
``MDB_meta`` after it {magic u32, version u32, address u64, mapsize u64, dbs[2]
(free, main) of ``MDB_db`` {pad u32 (the free DB's is the page size), flags u16,
depth u16, branch_pages, leaf_pages, overflow_pages, entries, root: u64}, last_pg u64,
txnid u64}, node ``MDB_node`` {lo u16, hi u16, flags u16, ksize u16, key, data}.

The walk reads every branch and leaf page once, in page order, coalesced into reads of
up to 4 MiB, and checks each batch of pages with numpy (no Python loop per node).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from fastdata.common import portable
from fastdata.errors import UnsafeStoreError

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16
NODE_HEADER = 8
#: ``MDB_db``: pad u32, flags u16, depth u16, branch/leaf/overflow pages, entries, root (u64 each)
DB_STRUCT = struct.Struct("<IHHQQQQQ")
#: ``MDB_meta`` from its start (after the page header) to ``mm_txnid`` included
META_STRUCT = struct.Struct("<IIQQ48s48sQQ")
META_END = PAGE_HEADER + META_STRUCT.size
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40
P_LOOSE, P_KEEP = 0x4000, 0x8000
#: page flags that only ever matter in memory (ignored if a file has them)
TRANSIENT_FLAGS = P_DIRTY | P_LOOSE | P_KEEP
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
#: database flags for duplicate keys (sub-pages and sub-databases): fastdata never sets them
DUP_FLAGS = 0x04 | 0x10 | 0x20 | 0x40
P_INVALID = (1 << 64) - 1
#: pages 0 and 1 are the meta pages
FIRST_PAGE = 2
#: LMDB's cursor stack depth (CURSOR_STACK): no B-tree it can read is deeper
MAX_DEPTH = 32
MIN_PSIZE, MAX_PSIZE = 512, 1 << 16
#: bytes read by one pread while walking
READ_BYTES = 4 << 20


@dataclass(frozen=True)
class Database:
    """One ``MDB_db`` record: a B-tree's root page (``P_INVALID``: empty), depth, flags, entries."""

    name: str
    flags: int
    depth: int
    entries: int
    root: int

    @classmethod
    def unpack(cls, name: str, raw: bytes) -> Database:
        _pad, flags, depth, _branch, _leaf, _overflow, entries, root = DB_STRUCT.unpack(raw)
        return cls(name, flags, depth, entries, root)


@dataclass(frozen=True)
class Meta:
    """One meta page's fields."""

    page: int
    magic: int
    version: int
    mapsize: int
    psize: int
    free: Database
    main: Database
    last_pg: int
    txnid: int


@dataclass
class Summary:
    """What :func:`check_structure` read: the meta page used, the databases walked and counts."""

    path: str
    meta: Meta
    file_size: int
    databases: dict[str, Database] = field(default_factory=dict)
    tree_pages: int = 0
    overflow_values: int = 0
    overflow_pages: int = 0


class _Refused(Exception):
    """A structural problem (the message, without the file name)."""


def check_structure(path: str, fd: int | None = None, *, full: bool = False) -> Summary:
    """Check the LMDB file ``path`` (through ``fd`` when given, else opened here) as the module
    docstring says; returns what it found.

    Args:
        full: also read every overflow page's header and check nothing overlaps (``verify``).

    Raises:
        UnsafeStoreError: the structure could make a reader fault, or is not LMDB's; the
            message names the file and what is wrong.
        OSError: the file cannot be read.
    """
    own = fd is None
    if fd is None:
        from fastdata.common.fileio import open_regular

        fd = open_regular(path, "shard")
    try:
        return _Checker(path, fd, full).run()
    except _Refused as err:
        raise UnsafeStoreError(f"{path}: damaged LMDB shard: {err}") from None
    finally:
        if own:
            os.close(fd)


class _Checker:
    def __init__(self, path: str, fd: int, full: bool):
        self.path, self.fd, self.full = path, fd, full
        self.size = os.fstat(fd).st_size

    # -- meta pages -------------------------------------------------------------------------------
    def _meta(self, page: int, offset: int) -> Meta:
        raw = portable.pread(self.fd, META_END, offset)
        if len(raw) < META_END:
            raise _Refused(f"the file is {self.size} bytes, too short for LMDB's meta page {page}")
        flags = struct.unpack_from("<H", raw, 10)[0]
        magic, version, _address, mapsize, free, main, last_pg, txnid = META_STRUCT.unpack_from(raw, PAGE_HEADER)
        if not flags & P_META or magic != MAGIC:
            raise _Refused(f"meta page {page} is not an LMDB meta page (flags 0x{flags:x}, magic 0x{magic:08x})")
        if version != DATA_VERSION:
            raise _Refused(f"meta page {page} has LMDB data version {version}, not {DATA_VERSION}")
        psize = DB_STRUCT.unpack(free)[0]  # mm_psize is the free DB's md_pad
        return Meta(page, magic, version, mapsize, psize, Database.unpack("free", free), Database.unpack("main", main),
                    last_pg, txnid)

    def _pick_meta(self) -> Meta:
        first = self._meta(0, 0)
        psize = first.psize
        if psize & (psize - 1) or not MIN_PSIZE <= psize <= MAX_PSIZE:
            raise _Refused(f"meta page 0 gives a page size of {psize} bytes (a power of two from "
                           f"{MIN_PSIZE} to {MAX_PSIZE} expected)")
        second = self._meta(1, psize)
        if second.psize != psize:
            raise _Refused(f"the meta pages disagree on the page size ({psize} and {second.psize} bytes)")
        meta = second if second.txnid > first.txnid else first  # as LMDB picks (ties: page 0)
        self.psize, self.last_pg = psize, meta.last_pg
        self.file_pages = self.size // psize
        if meta.last_pg < 1 or meta.last_pg >= self.file_pages:
            raise _Refused(f"meta page {meta.page} says the last page is {meta.last_pg}, past the end of the file "
                           f"({self.file_pages} pages of {psize} bytes)")
        for db in (meta.free, meta.main):
            if db.root != P_INVALID and not FIRST_PAGE <= db.root <= meta.last_pg:
                raise _Refused(f"the {db.name} database's root is {self._page_problem(db.root)}")
        return meta

    def _page_problem(self, pgno: int) -> str:
        """How page number ``pgno`` (outside ``2 .. last_pg``) is wrong, for a message."""
        if pgno < FIRST_PAGE:
            return f"page {pgno}, a meta page"
        if pgno >= self.file_pages:
            return f"page {pgno}, past the end of the file ({self.file_pages} pages)"
        return f"page {pgno}, past the last page ({self.last_pg}) the meta page records"

    # -- reading pages ----------------------------------------------------------------------------
    def _read_pages(self, pgnos: np.ndarray) -> np.ndarray:
        """Pages ``pgnos`` (sorted, unique, checked <= last_pg) as a (k, psize) uint8 array."""
        psize = self.psize
        out = np.empty((len(pgnos), psize), dtype=np.uint8)
        view = out.data.cast("B")
        breaks = np.flatnonzero(np.diff(pgnos) != 1) + 1
        runs = np.split(np.arange(len(pgnos)), breaks)
        if len(runs) > 1:
            # pages scattered over the file (the leaf pages of a tails database lie between the
            # records' overflow pages): ask for all of them first, so that a cold shard is read with
            # a deep queue instead of one synchronous read a page (0.68 -> 0.08 s per GiB of ~63 KB records)
            for run in runs:
                if not portable.advise_willneed(self.fd, int(pgnos[run[0]]) * psize, len(run) * psize):
                    break  # advice only: refused, or no posix_fadvise here (macOS, Windows)
        for run in runs:
            a, b = int(run[0]), int(run[-1]) + 1
            got = portable.preadinto(self.fd, view[a * psize:b * psize], int(pgnos[a]) * psize)
            if got != (b - a) * psize:
                raise _Refused(f"page {int(pgnos[a]) + got // psize} could not be read (the file is "
                               f"{self.size} bytes: truncated while it was checked?)")
        return out

    # -- the B-trees ------------------------------------------------------------------------------
    def run(self) -> Summary:
        meta = self._pick_meta()
        summary = Summary(self.path, meta, self.size)
        self.seen = np.zeros(self.last_pg + 1, dtype=bool)
        self.overflows: list[np.ndarray] = []  # (first page, pages) pairs, for full mode
        main = meta.main
        if main.flags & DUP_FLAGS:
            raise _Refused(f"the main database has flags 0x{main.flags:x} (duplicate keys), which fastdata never sets")
        subs: list[Database] = []
        summary.databases["main"] = main
        if main.root != P_INVALID:
            summary.tree_pages += self._walk(main, subs)
        for db in subs:
            summary.databases[db.name] = db
            if db.flags & DUP_FLAGS:
                raise _Refused(f"database {db.name!r} has flags 0x{db.flags:x} (duplicate keys), "
                               "which fastdata never sets")
            if db.root == P_INVALID:
                continue
            if not FIRST_PAGE <= db.root <= self.last_pg:
                raise _Refused(f"database {db.name!r}: its root is {self._page_problem(db.root)}")
            summary.tree_pages += self._walk(db, None)
        if self.overflows:
            ov = np.concatenate(self.overflows, axis=0)
            summary.overflow_values = len(ov)
            summary.overflow_pages = int(ov[:, 1].sum())
            if self.full:
                self._check_overflow_pages(ov)
        return summary

    def _walk(self, db: Database, subs: list[Database] | None) -> int:
        """Check every page of B-tree ``db``; named databases found (main DB only) go to ``subs``."""
        level = np.array([db.root], dtype=np.int64)
        parents = np.array([-1], dtype=np.int64)
        walked = 0
        for _depth in range(MAX_DEPTH):
            if not len(level):
                return walked
            bad = np.flatnonzero((level < FIRST_PAGE) | (level > self.last_pg))
            if len(bad):
                j = int(bad[0])
                raise _Refused(f"database {db.name!r}: branch page {int(parents[j])} points to "
                               f"{self._page_problem(int(level[j]))}")
            order = np.argsort(level, kind="stable")
            level, parents = level[order], parents[order]
            twice = np.flatnonzero(np.diff(level) == 0)
            if len(twice) or self.seen[level].any():
                pg = int(level[twice[0] + 1]) if len(twice) else int(level[self.seen[level]][0])
                raise _Refused(f"database {db.name!r}: page {pg} is reached twice in the B-trees (a loop or a "
                               "shared page)")
            self.seen[level] = True
            walked += len(level)
            batch = max(1, READ_BYTES // self.psize)
            children, child_parents = [], []
            for start in range(0, len(level), batch):
                pgnos = level[start:start + batch]
                kids, kid_parents = self._check_pages(db, pgnos, self._read_pages(pgnos), subs)
                children.append(kids)
                child_parents.append(kid_parents)
            level, parents = np.concatenate(children), np.concatenate(child_parents)
        if len(level):
            raise _Refused(f"database {db.name!r}: the B-tree is deeper than {MAX_DEPTH} levels")
        return walked

    def _check_pages(self, db: Database, pgnos: np.ndarray, pages: np.ndarray,
                     subs: list[Database] | None) -> tuple[np.ndarray, np.ndarray]:
        """Check the branch/leaf ``pages`` (numbers ``pgnos``) of ``db``; returns the child page
        numbers of its branch nodes and, for each, the page that points to it."""
        psize = self.psize
        where = f"database {db.name!r}: page"
        header_pgno = pages[:, 0:8].copy().view("<u8").ravel()
        flags = pages[:, 10:12].copy().view("<u2").ravel().astype(np.int64) & ~TRANSIENT_FLAGS
        lower = pages[:, 12:14].copy().view("<u2").ravel().astype(np.int64)
        upper = pages[:, 14:16].copy().view("<u2").ravel().astype(np.int64)
        first = _first(header_pgno != pgnos.astype(np.uint64))
        if first is not None:
            raise _Refused(f"{where} {int(pgnos[first])}: its header says it is page {int(header_pgno[first])}")
        first = _first((flags != P_BRANCH) & (flags != P_LEAF))
        if first is not None:
            raise _Refused(f"{where} {int(pgnos[first])}: flags 0x{int(flags[first]):x} are not those of a branch "
                           "or leaf page")
        branch = flags == P_BRANCH
        nkeys = (lower - PAGE_HEADER) // 2
        first = _first((lower < PAGE_HEADER) | (lower > upper) | (upper > psize) | (lower % 2 == 1)
                       | (branch & (nkeys < 1)))
        if first is not None:
            raise _Refused(f"{where} {int(pgnos[first])}: header (lower {int(lower[first])}, upper "
                           f"{int(upper[first])}) is impossible for a {'branch' if branch[first] else 'leaf'} page "
                           f"of {psize} bytes")
        most = int(nkeys.max()) if len(nkeys) else 0
        if most == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ptrs = pages[:, PAGE_HEADER:PAGE_HEADER + 2 * most].copy().view("<u2")
        rows, cols = np.nonzero(np.arange(most)[None, :] < nkeys[:, None])
        ptr = ptrs[rows, cols].astype(np.int64)
        first = _first((ptr < upper[rows]) | (ptr + NODE_HEADER > psize))
        if first is not None:
            raise _Refused(f"{where} {int(pgnos[rows[first]])}: node {int(cols[first])} is at offset "
                           f"{int(ptr[first])}, outside the page's node area ({int(upper[rows[first]])}..{psize})")
        flat = pages.reshape(-1)
        base = rows.astype(np.int64) * psize + ptr

        def u16(offset) -> np.ndarray:
            return flat[base + offset].astype(np.int64) | flat[base + offset + 1].astype(np.int64) << 8

        lo, hi, nflags, ksize = u16(0), u16(2), u16(4), u16(6)
        is_branch = branch[rows]
        node_flags = np.where(is_branch, 0, nflags)
        big = (node_flags & F_BIGDATA) != 0
        dsize = lo | hi << 16
        inline = np.where(is_branch, 0, np.where(big, 8, dsize))
        end = ptr + NODE_HEADER + ksize + inline
        first = _first(end > psize)
        if first is not None:
            what = "key" if is_branch[first] or big[first] else f"data ({int(dsize[first])} bytes)"
            raise _Refused(f"{where} {int(pgnos[rows[first]])}: node {int(cols[first])}'s {what} runs past the end "
                           f"of its page ({int(end[first])} > {psize} bytes)")
        first = _first((node_flags & ~(F_BIGDATA | F_SUBDATA)) != 0)
        if first is not None:
            raise _Refused(f"{where} {int(pgnos[rows[first]])}: node {int(cols[first])} has flags "
                           f"0x{int(node_flags[first]):x} (duplicate keys or unknown), which fastdata never writes")
        if big.any():
            self._overflow_nodes(where, pgnos[rows[big]], cols[big], flat, base[big] + NODE_HEADER + ksize[big],
                                 dsize[big])
        sub = (node_flags & F_SUBDATA) != 0
        if sub.any():
            self._named_databases(where, db, subs, pgnos, rows, cols, sub & ~big, big & sub, flat, base, ksize, dsize)
        child = lo | hi << 16 | nflags << 32
        return child[is_branch], pgnos[rows[is_branch]]

    def _overflow_nodes(self, where: str, pgnos: np.ndarray, cols: np.ndarray, flat: np.ndarray, at: np.ndarray,
                        dsize: np.ndarray) -> None:
        ov = np.zeros(len(at), dtype=np.uint64)
        for i in range(8):
            ov |= flat[at + i].astype(np.uint64) << np.uint64(8 * i)
        first_page = ov.astype(np.int64)  # wraps to negative for pgno >= 2**63: refused below
        npages = (PAGE_HEADER - 1 + dsize) // self.psize + 1
        last = first_page + npages - 1
        first = _first((ov > np.uint64(self.last_pg)) | (first_page < FIRST_PAGE) | (last > self.last_pg))
        if first is not None:
            start, count = int(ov[first]), int(npages[first])
            if not FIRST_PAGE <= start <= self.last_pg:
                problem = f"starts at {self._page_problem(start)}"
            else:
                problem = f"spans pages {start}..{start + count - 1}, ending at {self._page_problem(start + count - 1)}"
            raise _Refused(f"{where} {int(pgnos[first])}: node {int(cols[first])}'s overflow value "
                           f"({int(dsize[first])} bytes) {problem}")
        self.overflows.append(np.stack([first_page, npages], axis=1))

    def _named_databases(self, where: str, db: Database, subs: list[Database] | None, pgnos, rows, cols,
                         sub: np.ndarray, big_sub: np.ndarray, flat: np.ndarray, base, ksize, dsize) -> None:
        first = _first(big_sub)
        if first is None and subs is None:
            first = _first(sub)
        if first is None:
            first = _first(sub & (dsize != DB_STRUCT.size))
        if first is not None:
            inside = f" (a named database inside {db.name!r})" if subs is None else ""
            raise _Refused(f"{where} {int(pgnos[rows[first]])}: node {int(cols[first])} is not a valid named "
                           f"database record{inside}")
        assert subs is not None
        for j in np.flatnonzero(sub).tolist():
            key_at = int(base[j]) + NODE_HEADER
            name = bytes(flat[key_at:key_at + int(ksize[j])]).decode("utf-8", "backslashreplace")
            raw = bytes(flat[key_at + int(ksize[j]):key_at + int(ksize[j]) + DB_STRUCT.size])
            subs.append(Database.unpack(name, raw))

    def _check_overflow_pages(self, ov: np.ndarray) -> None:
        """``full``: each overflow value's first page is an overflow page covering it, and no
        two values (or a value and a tree page) share a page."""
        psize = self.psize
        for start, npages in ov.tolist():
            raw = portable.pread(self.fd, PAGE_HEADER, start * psize)
            if len(raw) < PAGE_HEADER:
                raise _Refused(f"overflow page {start} could not be read (truncated while it was checked?)")
            pgno, _pad, flags, pages = struct.unpack("<QHHI", raw)
            if pgno != start or not flags & P_OVERFLOW or pages < npages:
                raise _Refused(f"overflow page {start}: header (page {pgno}, flags 0x{flags:x}, {pages} pages) "
                               f"does not hold a value of {npages} pages")
        order = np.argsort(ov[:, 0], kind="stable")
        starts, ends = ov[order, 0], ov[order, 0] + ov[order, 1]
        first = _first(starts[1:] < ends[:-1])
        if first is not None:
            raise _Refused(f"overflow values at pages {int(starts[first])} and {int(starts[first + 1])} overlap")
        tree = np.flatnonzero(self.seen)
        inside = np.searchsorted(starts, tree, side="right") - 1
        hit = (inside >= 0) & (tree < ends[np.maximum(inside, 0)])
        first = _first(hit)
        if first is not None:
            raise _Refused(f"B-tree page {int(tree[first])} lies inside the overflow value at page "
                           f"{int(starts[inside[first]])}")


def _first(mask: np.ndarray) -> int | None:
    """Index of the first True in ``mask``, or None."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None
