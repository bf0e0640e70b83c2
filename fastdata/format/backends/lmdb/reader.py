"""Read one LMDB shard (layout in ``spec.py``)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import lmdb
import msgpack
import numpy as np

from fastdata.common import portable
from fastdata.common.fileio import open_regular
from fastdata.errors import CorruptRecordError, FormatError, UnsafeStoreError
from fastdata.format.backends.base import MappedPages, ShardReader, StorageSpec
from fastdata.format.backends.lmdb import spec
from fastdata.format.backends.lmdb.structure import check_structure
from fastdata.format.record import (
    FORMAT_CODES,
    Record,
    SampleIndex,
    ShardIndex,
    checksum,
    decode_record,
    index_layout,
    read_index_arrays,
    record_image,
    record_image_view,
    v1_index_arrays,
)


#: most bytes a classification record holds besides its image and path: eight keys, a version,
#: label, width, height (ints of up to 9 bytes), a format name, a checksum and two bin headers
CLASSIFICATION_RECORD_OVERHEAD = 128


#: held while a read transaction is made and while it is freed: py-lmdb's extension links each
#: Transaction into its Environment's list of dependents when it is made and unlinks it when it is
#: freed, and nothing but the GIL guards that list. Its module declares no free-threading support,
#: so a free-threaded build turns the GIL on when it loads (the default); run without it
#: (``PYTHON_GIL=0``), loader threads reading one shard would edit the list at once.
_TXN_LIFECYCLE = threading.Lock()


class _ReadTxn:
    """A read transaction of ``env`` (``with _ReadTxn(env, db=...) as txn: txn.get(key)``) made,
    ended and freed under :data:`_TXN_LIFECYCLE`; ``get`` runs outside it, at the same time as other
    threads' reads (LMDB's read transactions are independent)."""

    __slots__ = ("_txn",)

    def __init__(self, env, **kw) -> None:
        with _TXN_LIFECYCLE:
            self._txn = env.begin(**kw)

    def get(self, key, default=None, db=None):
        return self._txn.get(key, default, db=db)

    def __enter__(self) -> _ReadTxn:
        return self

    def __exit__(self, *exc) -> None:
        txn, self._txn = self._txn, None
        with _TXN_LIFECYCLE:
            txn.abort()
            del txn  # (the last reference: freed, and unlinked from its environment, under the lock)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: identities (device, inode, size, mtime, ctime) of the shard files whose structure this
#: process (or the parent it was forked from) has checked: each is checked once
_CHECKED: set[tuple[int, ...]] = set()


def checked_open(path: str, *, full: bool = False) -> tuple[int, ...]:
    """Refuse ``path`` unless it is a regular file whose LMDB structure passes
    :func:`~fastdata.format.backends.lmdb.structure.check_structure` (once per file identity
    and process; ``full`` checks again, overflow page headers included). Returns the
    file's identity, which the caller compares after LMDB opened the file by name."""
    fd = open_regular(path, "shard")
    try:
        identity = _identity(os.fstat(fd))
        if full or identity not in _CHECKED:
            try:
                check_structure(path, fd, full=full)
            except OSError as err:
                raise CorruptRecordError(f"{path}: cannot read the shard ({err.strerror or err})",
                                         shard=path) from None
            _CHECKED.add(identity)
        return identity
    finally:
        os.close(fd)


class _EnvCache:
    """LMDB allows one Environment per file per process (py-lmdb raises on a
    second open), so readers of the same shard in one process share it,
    reference-counted.

    After a fork the child inherits the parent's environments *and* py-lmdb's
    registry of open files, so it could not open the shard itself. The child
    never reads through an inherited environment; it closes its copy first.
    For our ``readonly=True, lock=False`` environments that only unmaps the
    child's mapping and closes the child's duplicate descriptor: there is no
    reader-table slot or lock to release, and the parent is unaffected (the
    fork tests check the parent keeps reading).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.envs: dict[tuple[int, int], list] = {}
        # thread workers open and close shards from several threads; a new lock after a fork
        # (one held by another thread at the fork would never be released in the child). Reentrant:
        # opening an environment can run the garbage collector, whose finalizer of another dataset
        # releases its environments here, in the same thread (a plain Lock deadlocked there)
        self.lock = threading.RLock()
        # Such a finalizer can run between two steps of an acquire or release in this thread: after
        # acquire found a shard's entry and before it counted itself, one releasing that shard's last
        # reference would close the environment acquire then hands out. So a release made inside
        # another (depth > 0) waits in `pending` until the outer one ends. A free-threaded build
        # makes this common: an object whose last reference another thread dropped is freed by the
        # thread that made it, at its next check between bytecodes (a loader thread ends an epoch
        # holding a dataset the training thread made).
        self.depth = 0
        self.pending: list[tuple[int, int]] = []
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self.lock = threading.RLock()
        self.depth, self.pending = 0, []

    def acquire(self, path: str, readahead: bool):
        with self.lock:
            self.depth += 1
            try:
                return self._acquire(path, readahead)
            finally:
                self.depth -= 1
                self._release_pending()

    def _release_pending(self) -> None:
        while self.depth == 0 and self.pending:
            key = self.pending.pop()
            self.depth += 1
            try:
                self._release(key)
            finally:
                self.depth -= 1

    def _acquire(self, path: str, readahead: bool):
        if self.pid != os.getpid():
            inherited, self.envs, self.pid = self.envs, {}, os.getpid()
            for env, _dbs, _refs in inherited.values():
                env.close()
        # keyed by the file (device, inode), not its path: py-lmdb refuses a second environment of
        # one file even under another name, e.g. a shard hard-linked into a merged store
        try:
            st = os.stat(path)
            key: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            key = None  # (checked_open names the problem)
        entry = self.envs.get(key) if key is not None else None
        if entry is None:
            identity = checked_open(path)  # before LMDB maps anything: nothing it reads can fault
            key = (identity[0], identity[1])
            entry = self.envs.get(key)
        assert key is not None
        if entry is None:
            env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=readahead,
                            max_spare_txns=0, max_dbs=4)
            try:
                # the same file (device and inode): its times may move (the shard cache touches a
                # shard it pins, for LRU), but another file at this path was not checked
                if _identity(os.stat(path))[:2] != identity[:2]:
                    raise UnsafeStoreError(f"{path}: the shard file was replaced while it was opened")
                dbs = (env.open_db(spec.RECORDS_DB, create=False), env.open_db(spec.INDEX_DB, create=False),
                       _optional_db(env, spec.CHUNKS_DB), _optional_db(env, spec.TAILS_DB), int(env.stat()["psize"]))
            except BaseException:
                env.close()
                raise
            entry = self.envs[key] = [env, dbs, 0]
        entry[2] += 1
        return key, entry[0], entry[1]

    def release(self, key: tuple[int, int]) -> None:
        if self.pid != os.getpid():
            return
        with self.lock:
            if self.depth:  # a finalizer inside an acquire or release of this thread: when it ends
                self.pending.append(key)
                return
            self.depth += 1
            try:
                self._release(key)
            finally:
                self.depth -= 1
                self._release_pending()

    def _release(self, key: tuple[int, int]) -> None:
        entry = self.envs.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self.envs[key]
            entry[0].close()


_ENVS = _EnvCache()


def _optional_db(env, name: bytes):
    """The shard's database ``name`` (``chunks``, ``tails``), or None in a shard without it."""
    try:
        return env.open_db(name, create=False)
    except lmdb.NotFoundError:
        return None


#: ask the kernel for a batch's records (and a region's chunks) before reading them, where the
#: shard knows their spans; ``FASTDATA_PREFETCH=0`` turns it off (the tests' control)
PREFETCH = os.environ.get("FASTDATA_PREFETCH", "1") != "0"
#: spans closer than this are advised as one range (fewer system calls; the gap is read too)
_MERGE_GAP = 64 << 10


def advise_spans(fd: int, spans: np.ndarray, file_size: int, file_map: mmap.mmap | None = None) -> int:
    """``posix_fadvise(WILLNEED)`` for each ``(offset, length)`` of ``spans`` (clamped to the
    file: spans are advice from the shard, not trusted), in offset order, neighbours merged; the
    kernel reads them asynchronously, all at once, so the synchronous page faults of the reads
    that follow find the pages in the page cache or already on their way. Returns the number of
    advice calls made.

    ``file_map``: a map of the whole file, advised with ``madvise(MADV_WILLNEED)`` instead (the
    same read-ahead of a file's pages): ``os.posix_fadvise`` releases the GIL for its system call,
    ``mmap.madvise`` does not, and with thread workers each release is a wait for the GIL."""
    use_map = file_map is not None and hasattr(mmap, "MADV_WILLNEED")
    if not len(spans) or not (use_map or hasattr(os, "posix_fadvise")):
        return 0

    def advise(lo: int, hi: int) -> None:
        if use_map:
            assert file_map is not None
            start = lo - lo % mmap.PAGESIZE  # madvise takes a page-aligned start
            file_map.madvise(mmap.MADV_WILLNEED, start, hi - start)
        else:
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)

    starts = np.minimum(spans[:, 0], file_size).astype(np.int64)
    ends = np.minimum(starts + np.minimum(spans[:, 1], file_size).astype(np.int64), file_size)
    order = np.argsort(starts, kind="stable")
    calls = 0
    lo = hi = -1
    for a, b in zip(starts[order].tolist(), ends[order].tolist(), strict=True):
        if b <= a:
            continue
        if lo >= 0 and a <= hi + _MERGE_GAP:
            hi = max(hi, b)
            continue
        if lo >= 0:
            advise(lo, hi)
            calls += 1
        lo, hi = a, b
    if lo >= 0:
        advise(lo, hi)
        calls += 1
    return calls


class LMDBShardReader(ShardReader):
    """Opens the environment read-only without a lock table and without spare
    transactions: a parent holding a read transaction when workers fork makes them fail
    later with MDB_BAD_RSLOT (py-lmdb#346), so nothing survives a fork.

    Before LMDB opens (and maps) a shard file, the file must be a regular file whose
    structure passes :func:`~fastdata.format.backends.lmdb.structure.check_structure`
    (read with ``pread``: meta pages, every B-tree page and node within its page and the
    file, overflow values within the last page), so that no read through the map can
    fault; checked once per file identity (device, inode, size, mtime, ctime) per process,
    forked children included. The header's count must be the manifest's when
    ``expected_count`` is given."""

    #: diagnose(): the handles held here are reopened per process (see the datasets)
    __fastdata_fork_safe__ = True

    def __init__(self, path: str, storage: StorageSpec, *, readahead: bool = False, **options):
        super().__init__(path, storage, **options)
        self._pid = os.getpid()
        self._checksums: np.ndarray | None = None  # raw mode: loaded at the first batch
        #: (is a PPM, stored bytes) per record: loaded at the first :meth:`read_images`
        self._pixel_index: tuple[np.ndarray, np.ndarray] | None = None
        #: the index's record / chunk spans (None: not read yet; False: the shard has none)
        self._spans: dict[bytes, np.ndarray | bool] = {}
        self._advice_fd: int | None = None  # for posix_fadvise, opened at the first prefetch
        self._advice_pid = -1  # the process that opened it
        #: this process's read-only map of the shard file, for reading records at their spans
        #: (:meth:`_mapped_record`); opened at the first batch, per process
        self._file_map: mmap.mmap | None = None
        #: the whole map as a uint8 array, sliced per record: see :meth:`_mapped_record`
        self._file_bytes: np.ndarray | None = None
        self._map_pid = -1
        #: advice calls made (for tests and diagnosis)
        self.prefetches = 0
        #: records of batches read at their spans through the file map, and through LMDB (for
        #: tests and diagnosis: a healthy shard with spans reads none through LMDB)
        self.mapped_reads = 0
        self.lmdb_reads = 0
        try:
            self._key, self.env, (self.records, self.index_db, self.chunks_db, self.tails_db, self.psize) = \
                _ENVS.acquire(path, readahead)
        except (lmdb.Error, OSError) as err:
            self.env = None
            raise FormatError(f"{path}: cannot open LMDB shard ({err}); the file is missing or damaged; "
                              "run 'fastdata verify' on the store") from None
        except BaseException:
            self.env = None
            raise

    @classmethod
    def check_structure(cls, path: str, *, full: bool = False) -> None:
        """A regular file whose LMDB structure passes
        :func:`~fastdata.format.backends.lmdb.structure.check_structure` (``full``: overflow
        page headers and overlaps too), read with ``pread`` only: this check cannot fault."""
        try:
            checked_open(path, full=full)
        except OSError as err:
            raise FormatError(f"{path}: cannot open the shard ({err.strerror or err})") from None

    def read_index(self) -> ShardIndex | SampleIndex:
        try:
            with _ReadTxn(self._open_env(), db=self.index_db) as txn:
                count = self._header_count(txn.get(spec.HEADER_KEY))  # before any array is read
                if self.schema is not None:
                    stored = {key: txn.get(key.encode()) for key in (*index_layout(self.schema), "relpaths",
                                                                      "relpath_offsets")}
                else:
                    raw = {name: txn.get(name.encode()) for name in spec.INDEX_ARRAYS}
        except lmdb.Error as err:
            raise CorruptRecordError(f"{self.path}: cannot read the shard index ({err})", shard=self.path) from None
        if self.schema is not None:
            try:
                index_v2 = read_index_arrays(self.schema, stored.get, count, self.path)
            except CorruptRecordError as err:
                raise CorruptRecordError(str(err), shard=self.path) from None
            self._checksums = index_v2.checksums
            return index_v2
        try:
            arrays = v1_index_arrays(raw.get, count, self.path)
        except CorruptRecordError as err:
            raise CorruptRecordError(str(err), shard=self.path) from None
        index = ShardIndex(**arrays)
        if len(index) != count:
            raise CorruptRecordError(f"{self.path}: index has {len(index)} entries, header says {count}",
                                     shard=self.path)
        index.validate(self.path)
        return index

    def _header_count(self, header_raw) -> int:
        """The record count of the shard header ``header_raw`` (checked: layout, version, and the
        manifest's count when the reader was given one)."""
        expected = spec.VERSION if self.schema is None else spec.VERSION_2
        try:
            header = msgpack.unpackb(header_raw, raw=False, max_str_len=256, max_map_len=8)
        except Exception:
            header = None
        if not isinstance(header, dict) or header.get("layout") != spec.LAYOUT:
            raise CorruptRecordError(f"{self.path}: missing or damaged shard header", shard=self.path)
        version = header.get("version")
        if type(version) is not int or version not in (expected, spec.VERSION_TAILS):
            raise FormatError(f"{self.path}: LMDB shard layout version {version!r} "
                              f"is not supported (expects {expected} or {spec.VERSION_TAILS})")
        count = header.get("count")
        if type(count) is not int or count < 0:
            raise CorruptRecordError(f"{self.path}: damaged shard header (count)", shard=self.path)
        self.check_count(count)
        return count

    def _decode(self, buf, local_index: int) -> bytes:
        where = f"{self.path} record {local_index}"
        if buf is None:
            raise CorruptRecordError(f"{where}: record is missing", shard=self.path, index=local_index)
        if self.schema is not None:  # version 2: the whole record against the index's checksum
            assert self._checksums is not None, "get()/get_many() load the checksums first"
            if not 0 <= local_index < len(self._checksums) or checksum(buf) != int(self._checksums[local_index]):
                raise CorruptRecordError(f"{where}: record checksum mismatch (the record is damaged)",
                                         shard=self.path, index=local_index)
            return bytes(buf)
        try:
            return record_image(buf, where=where)
        except CorruptRecordError as err:  # decode_record knows no shard/index: attach them
            raise CorruptRecordError(str(err), shard=self.path, index=local_index) from None

    @classmethod
    def from_stored_value(cls, value: bytes, local_index: int, expected: int, *, schema, where: str) -> bytes:
        """A general record: checked as :meth:`ShardReader.from_stored_value` does. A classification
        record: unpacked and checked as :meth:`get` checks it (its image against the record's own
        checksum), and that checksum against the index's ``expected`` (the record is the one indexed)."""
        if schema is not None:
            return super().from_stored_value(value, local_index, expected, schema=schema, where=where)
        try:
            record = decode_record(value, where=where)
        except CorruptRecordError as err:
            raise CorruptRecordError(str(err), index=local_index) from None
        if record.xxh != expected:
            raise CorruptRecordError(f"{where}: checksum mismatch (the record is not the one the index lists)",
                                     index=local_index)
        return record.image

    @classmethod
    def stored_value_bounds(cls, nbytes: int, path_bytes: int, *, schema) -> tuple[int, int]:
        """A classification record is a msgpack map holding the image (``nbytes``), its path and
        six small fields: at most :data:`CLASSIFICATION_RECORD_OVERHEAD` bytes besides the two."""
        if schema is not None:
            return nbytes, nbytes
        return nbytes + path_bytes, nbytes + path_bytes + CLASSIFICATION_RECORD_OVERHEAD

    def _load_checksums(self) -> None:
        """Version 2: the index's record checksums, read before a records transaction opens
        (never a second transaction nested inside one)."""
        if self.schema is not None and self._checksums is None:
            with self.lazy_lock:
                if self._checksums is None:
                    self.read_index()

    def get(self, local_index: int) -> bytes:
        self._load_checksums()
        try:
            with _ReadTxn(self._open_env(), db=self.records, buffers=True) as txn:
                return self._decode(self._value(txn, local_index), local_index)
        except lmdb.Error as err:  # a damaged page (LMDB keeps no page checksums)
            raise self._damaged(err, local_index) from None

    def _value(self, txn, local_index: int):
        """Record ``local_index``'s bytes (inside ``txn``, a read transaction of ``records``), or None
        where the shard has no such record: its value as a buffer into the map, joined with its
        tail parts where it has them (a copy; layout version 3, see ``spec.py``)."""
        if not 0 <= local_index < 1 << 64:
            return None
        head = txn.get(spec.encode_key(local_index))
        if head is None or self.tails_db is None:
            return head
        n = len(head)
        if n and (n + spec.PAGE_HEADER) % self.psize:  # spec.fills_pages, inline: this runs per record
            return head
        parts = []
        for part in range(spec.MAX_TAIL_PARTS):
            data = txn.get(spec.tail_key(local_index, part), db=self.tails_db)
            if data is None:
                break
            parts.append(data)
        return b"".join((head, *parts)) if parts else head

    def _record_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """This process's map of the shard file and the index's record spans, or None: no spans
        (an older shard, prefetching off), or the file cannot be mapped here.

        Why read records there rather than through ``txn.get``: py-lmdb releases the GIL twice a
        record (around ``mdb_get``, then to touch the value's pages), and with thread workers each
        release is a wait for another thread to release it in turn; read at its span, a record
        costs no release, no transaction lookup, and the same bytes (the checks that follow are
        the same, and the record's checksum is compared with the index's, so a span that points
        anywhere else is a damaged record, never another record's data)."""
        spans = self._spans_of(spec.RECORD_SPANS_KEY)
        if spans is None:
            return None
        tails = self._spans_of(spec.TAIL_SPANS_KEY, drop_empty=True) if self.tails_db is not None else None
        if tails is not None and len(tails) % len(spans) == 0 and len(tails) // len(spans) <= spec.MAX_TAIL_PARTS:
            tails = tails.reshape(len(spans), -1, 2)
        else:
            tails = None
        if self._map_pid != os.getpid():
            with self.lazy_lock:
                if self._map_pid != os.getpid():
                    self._file_map = self._file_bytes = None
                    try:
                        with open(self.path, "rb") as handle:  # the map outlives the descriptor
                            # copy-on-write: its views are writable (torch.from_numpy takes a
                            # read-only array with a warning), and nothing written reaches the file
                            self._file_map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
                        self._file_bytes = np.frombuffer(self._file_map, np.uint8)
                    except (OSError, ValueError):  # an empty file, or no mapping here: read through LMDB
                        self._file_map = self._file_bytes = None
                    self._map_pid = os.getpid()
        file_bytes = self._file_bytes
        return None if file_bytes is None else (file_bytes, spans, tails)

    def _mapped_record(self, mapped: tuple[np.ndarray, np.ndarray, np.ndarray | None],
                       local_index: int) -> bytes | memoryview | None:
        """Record ``local_index``'s bytes read at its spans: a view of the file map, or its head
        joined with its tail parts (a copy, as :meth:`_value` makes); None where a span lies
        outside the file or the record's spans are not known.

        Each record's view is a memoryview of its own, made from a slice of the map's array, never
        a slice of one memoryview the threads share: a slice of a memoryview counts itself in the
        shared view's export count, which free-threaded CPython 3.13 updates without atomics, so
        loader threads slicing one view at once lost counts and the map was released under them
        ("operation forbidden on released memoryview object", CPython gh-155606). An array slice
        only holds a reference to the array (references are atomic there)."""
        view, spans, tails = mapped
        if not 0 <= local_index < len(spans):
            return None
        start, length = int(spans[local_index, 0]), int(spans[local_index, 1])
        if length <= 0 or start + length > len(view):
            return None
        head = view[start:start + length].data
        if self.tails_db is None or (length + spec.PAGE_HEADER) % self.psize:
            return head  # no tail parts: only a head that fills its pages has them (spec.fills_pages)
        if tails is None:
            return None
        parts = [head]
        for part_start, part_length in tails[local_index].tolist():
            if part_length == 0:
                break
            if part_start + part_length > len(view):
                return None
            parts.append(view[part_start:part_start + part_length].data)
        return b"".join(parts) if len(parts) > 1 else head

    def _checked(self, buf, local_index: int, ppm, nbytes, expected) -> bytes | memoryview:
        """Record ``local_index`` (``buf``, its stored bytes) checked: a raw-native PPM record of a
        classification shard as a view of its pixels, anything else as :meth:`_decode` gives it;
        ``expected``: the index's checksum of a classification record, which its own must equal.

        Raises:
            CorruptRecordError: the record is missing or damaged, or not the one ``expected`` lists.
        """
        where = f"{self.path} record {local_index}"
        try:
            if ppm is not None and buf is not None and 0 <= local_index < len(ppm) and ppm[local_index]:
                return record_image_view(buf, int(nbytes[local_index]), where=where,
                                         expected=None if expected is None else int(expected))
            if expected is not None:
                return self.from_stored_value(buf, local_index, int(expected), schema=None, where=where)
        except CorruptRecordError as err:
            raise CorruptRecordError(str(err), shard=self.path, index=local_index) from None
        return self._decode(buf, local_index)

    def _damaged(self, err: Exception, local_index: int) -> CorruptRecordError:
        return CorruptRecordError(f"{self.path} record {local_index}: unreadable, the shard's internal "
                                  f"structure is damaged ({err})", shard=self.path, index=local_index)

    def get_record(self, local_index: int) -> Record:
        """The whole validated record (image and its own metadata), for ``verify``."""
        where = f"{self.path} record {local_index}"
        try:
            with _ReadTxn(self._open_env(), db=self.records, buffers=True) as txn:
                buf = self._value(txn, local_index)
                if buf is None:
                    raise CorruptRecordError(f"{where}: record is missing", shard=self.path, index=local_index)
                return decode_record(buf, where=where)
        except lmdb.Error as err:
            raise self._damaged(err, local_index) from None

    def _spans_of(self, key: bytes, *, drop_empty: bool = False) -> np.ndarray | None:
        """The index's ``key`` spans (``[rows, 2]`` uint64), or None: absent, damaged, prefetching
        off, or (``drop_empty``) all empty. Only advice: a value not covered (or covered wrongly) is
        read all the same."""
        if not PREFETCH:
            return None
        spans = self._spans.get(key)
        if spans is None:
            try:
                with _ReadTxn(self._open_env(), db=self.index_db) as txn:
                    raw = txn.get(key)
                    data = bytes(raw) if raw is not None else b""
            except lmdb.Error:
                data = b""
            ok = bool(data) and len(data) % 16 == 0
            table = np.frombuffer(data, dtype="<u8").reshape(-1, 2) if ok else None
            if drop_empty and table is not None and not table[:, 1].any():
                table = None  # nothing to advise (e.g. tail spans of a shard whose records have no tails)
            spans = self._spans[key] = table if table is not None else False
        return spans if spans is not False else None  # type: ignore[return-value]

    def _prefetch(self, keys: tuple[bytes, ...], ids) -> None:
        """Ask the kernel for the values ``ids`` (records or chunks) before they are read, as the
        index's span tables ``keys`` place them, in one advice pass: ``keys[0]`` one span a value
        (records' heads, chunks), any further table (``tail_spans``) ``k`` spans a record, its
        ``k * n`` rows read as ``[n, k]`` by the first table's ``n`` (ignored where they do not divide
        or ``k`` is above :data:`~spec.MAX_TAIL_PARTS`)."""
        first = self._spans_of(keys[0])
        if first is None:
            return
        tables = [first]
        for key in keys[1:]:
            more = self._spans_of(key, drop_empty=True)
            # (a table of more than MAX_TAIL_PARTS spans a record is not one fastdata writes: ignored,
            # so that a crafted one cannot make a batch's selection of it a large allocation)
            if more is not None and len(more) % len(first) == 0 and len(more) // len(first) <= spec.MAX_TAIL_PARTS:
                tables.append(more.reshape(len(first), -1, 2))
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < len(first))]
        wanted = [table[ids].reshape(-1, 2) for table in tables]  # (0, 0) rows: nothing to advise
        file_map = self._file_map if self._map_pid == os.getpid() else None
        if file_map is not None and hasattr(mmap, "MADV_WILLNEED"):  # the map's advice keeps the GIL
            try:
                self.prefetches += advise_spans(-1, np.concatenate(wanted), len(file_map), file_map)
            except (OSError, ValueError):  # advice only (ValueError: the map was closed meanwhile)
                pass
            return
        if self._advice_fd is None or self._advice_pid != os.getpid():
            with self.lazy_lock:
                if self._advice_fd is None or self._advice_pid != os.getpid():
                    try:
                        self._advice_fd, self._advice_pid = (os.open(self.path, os.O_RDONLY | portable.OPEN_FLAGS),
                                                             os.getpid())
                    except OSError:
                        for key in keys:
                            self._spans[key] = False
                        return
        fd = self._advice_fd
        if fd is None:  # closed meanwhile
            return
        try:
            self.prefetches += advise_spans(fd, np.concatenate(wanted), os.fstat(fd).st_size)
        except OSError:  # advice only
            pass

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """One read transaction for the whole batch; keys visited in sorted order. py-lmdb faults
        in every page of a value inside ``get``, one synchronous read at a time when the store is
        cold; so where the shard knows its records' spans, the whole batch is asked for first
        (:func:`advise_spans`), and the reads find it in the page cache or on its way."""
        out: list = [None] * len(local_indices)
        self._read_records(local_indices, out.__setitem__, views=False)
        return out

    def read_images(self, local_indices: Sequence[int], consume) -> None:
        """As :meth:`get_many`, but a raw-native PPM record of a classification shard reaches
        ``consume`` as a view of its pixels in the map (:func:`~fastdata.format.record.record_image_view`:
        the same checks, no copy of the ~3 bytes a pixel), every other record as :meth:`get` gives
        it (see :meth:`ShardReader.read_images`)."""
        self._read_records(local_indices, consume, views=self.schema is None)

    def _read_records(self, local_indices: Sequence[int], consume, views: bool) -> None:
        """``consume(k, data)`` for the ``k``-th of ``local_indices``, in one read transaction,
        keys in sorted order, the batch prefetched; ``views``: PPM records as views of the map."""
        self._load_checksums()
        if views and self._pixel_index is None:  # (read before the records transaction: never nested in it)
            index = self.read_index()
            assert isinstance(index, ShardIndex)
            self._pixel_index = (index.formats == FORMAT_CODES["PPM"], index.nbytes)
        ppm, nbytes = self._pixel_index if views and self._pixel_index is not None else (None, None)
        mapped = self._record_spans()  # (opens this process's map first: the advice below goes through it)
        if len(local_indices) > 1:
            self._prefetch((spec.RECORD_SPANS_KEY, spec.TAIL_SPANS_KEY) if self.tails_db is not None
                           else (spec.RECORD_SPANS_KEY,), local_indices)
        order = np.argsort(np.asarray(local_indices), kind="stable")
        expected = None
        if mapped is not None and self.schema is None:
            # a classification record read at its span: its own checksum must be the index's
            # (a general record's whole bytes are checked against the index by _decode)
            if self._checksums is None:  # (read before the records transaction: never nested in it)
                self._checksums = self.read_index().checksums
            expected = self._checksums
        i = -1
        try:
            with _ReadTxn(self._open_env(), db=self.records, buffers=True) as txn:
                for k in order.tolist():
                    i = int(local_indices[k])
                    known = expected is None or 0 <= i < len(expected)  # (a crafted index may be short)
                    buf = self._mapped_record(mapped, i) if mapped is not None and known else None
                    data = None
                    if buf is not None:
                        try:
                            data = self._checked(buf, i, ppm, nbytes, None if expected is None else expected[i])
                        except CorruptRecordError:
                            # the span is wrong, not (yet) the record: spans are advice, so this shard
                            # is read through LMDB from here on, and the record's verdict is LMDB's
                            self._spans[spec.RECORD_SPANS_KEY] = False
                            mapped = None
                    if data is None:
                        data = self._checked(self._value(txn, i), i, ppm, nbytes, None)
                        self.lmdb_reads += 1
                    else:
                        self.mapped_reads += 1
                    consume(k, data)
        except lmdb.Error as err:
            raise self._damaged(err, i) from None

    def get_chunks(self, first: int, table, chunks: Sequence[int], where: str) -> list:
        """Chunks ``first + j`` of the ``chunks`` database in one read transaction, each checked
        against its table entry (see :meth:`ShardReader.get_chunks`), copied out of the map."""
        out: list = []
        self.read_chunks(first, table, chunks, where, lambda k, view: out.append(bytes(view)))
        return out

    def read_chunks(self, first: int, table, chunks: Sequence[int], where: str, consume) -> None:
        """One read transaction; ``consume`` gets each chunk as a buffer into the map, valid while
        it runs (see :meth:`ShardReader.read_chunks`): a chunk is decoded from the map, not copied."""
        if self.chunks_db is None:
            raise CorruptRecordError(f"{where}: the shard {self.path} has no chunks database", shard=self.path)
        # a chunk key is a u64 of the index; the shard's chunks are keyed 0, 1, ... (Python ints: no wrap)
        last = int(first) + max((int(c) for c in chunks), default=0)
        if not 0 <= int(first) <= last < spec.MAX_CHUNK_KEY:
            raise CorruptRecordError(f"{where}: the index places its chunks at keys {int(first):,} .. {last:,} of "
                                     f"{self.path}, outside 0 .. {spec.MAX_CHUNK_KEY - 1:,} (the index is damaged); "
                                     "run 'fastdata verify'", shard=self.path)
        j = -1
        pages = self.mapped_pages
        if pages is None:
            pages = self.mapped_pages = MappedPages()  # the environment's map (one per path and process)
        if len(chunks) > 1:
            self._prefetch((spec.CHUNK_SPANS_KEY,), [first + j for j in chunks])
        try:
            with _ReadTxn(self._open_env(), db=self.chunks_db, buffers=True) as txn:
                for k, j in enumerate(chunks):
                    view = txn.get(spec.encode_key(first + j)) if 0 <= first + j < 1 << 64 else None
                    if view is None or len(view) != int(table.nbytes[j]):
                        raise CorruptRecordError(f"{where} chunk {j}: missing or of the wrong length in "
                                                 f"{self.path}; run 'fastdata verify'", shard=self.path)
                    if checksum(view) != int(table.xxh[j]):
                        raise CorruptRecordError(f"{where} chunk {j}: checksum mismatch (the chunk is damaged); "
                                                 "run 'fastdata verify'", shard=self.path)
                    consume(k, view)
                    pages.used(view)  # decoded: this process need not keep its pages mapped
        except lmdb.Error as err:
            raise CorruptRecordError(f"{where} chunk {j}: unreadable, the shard's internal structure is damaged "
                                     f"({err})", shard=self.path) from None

    def get_raw_batch(self, local_indices: np.ndarray, out: np.ndarray) -> None:
        """Raw mode: one read transaction in key order, one copy into ``out``.

        A raw record's pixels are its last H*W*3 bytes (``img`` is the record's
        last field, of fixed size), so they are sliced without unpacking the
        record (2.7 us a sample) and checked against the shard index's checksum
        instead of the record's own copy of it.
        """
        if self._checksums is None:
            self._checksums = self.read_index().checksums
        idx = np.asarray(local_indices, dtype=np.int64)
        nbytes = int(np.prod(out.shape[1:]))
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order].tolist()
        expected = self._checksums[idx[order]].tolist() if len(idx) else []
        pieces = []
        i = -1
        try:
            with _ReadTxn(self._open_env(), db=self.records, buffers=True) as txn:
                for i, want in zip(sorted_idx, expected, strict=False):
                    view = self._value(txn, i)
                    if view is None or len(view) <= nbytes:
                        raise CorruptRecordError(f"{self.path} record {i}: missing or too short for a raw image",
                                                 shard=self.path, index=i)
                    pixels = view[len(view) - nbytes:]
                    if checksum(pixels) != want:
                        raise CorruptRecordError(f"{self.path} record {i}: image checksum mismatch "
                                                 "(the record is damaged)", shard=self.path, index=i)
                    pieces.append(pixels)
                block = b"".join(pieces)  # inside the transaction: the views die with it
        except lmdb.Error as err:
            raise self._damaged(err, i) from None
        out[order] = np.frombuffer(block, dtype=np.uint8).reshape(out.shape)

    def _open_env(self):
        """The environment, or ValueError once the reader is closed."""
        if self.env is None:
            raise ValueError(f"{self.path}: the shard reader is closed")
        return self.env

    def close(self) -> None:
        # each handle is taken by one caller (an explicit close, a finalizer in another thread): two
        # that both took the environment would release it twice, closing it under another reader of
        # the file; without a GIL the read and the clearing of an attribute can interleave
        with _ENVS.lock:
            fd, self._advice_fd = getattr(self, "_advice_fd", None), None
            file_map, self._file_map = getattr(self, "_file_map", None), None
            file_bytes, self._file_bytes = getattr(self, "_file_bytes", None), None
            env, self.env = getattr(self, "env", None), None
        if fd is not None and self._advice_pid == os.getpid():
            os.close(fd)
        del file_bytes  # (the array's hold on the map goes with it, unless a record's view still holds it)
        if file_map is not None:
            try:
                file_map.close()
            except BufferError:  # a record view is still held somewhere: the map goes with the last one
                pass
        self.mapped_pages = None
        if env is not None and self._pid == os.getpid():
            _ENVS.release(self._key)
