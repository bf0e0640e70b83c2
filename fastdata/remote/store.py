"""Where a dataset's store lives: a local directory, or a URL read through the shard cache.

Datasets ask a :class:`StoreLocation` for three things: the manifest, every shard's index,
and a local path to open a shard at (plus a pin that keeps that file in place while it is
open). A local store answers from its directory; a remote store from its URL, its store
index file and the :class:`~fastdata.remote.cache.ShardCache`.

**The version a dataset opened.** A location is tied to the store version it read: a
local one records, when it is made, the identity of ``manifest.json`` and of every shard
file (:func:`file_identity`: device, inode, size, mtime), after checking that the manifest
did not change while the shards were looked at (a rewrite in progress is retried, then
refused). Every later open of a shard (in a DataLoader worker after fork or spawn, or
again after the LRU closed it) checks the file against its recorded identity, by a
``stat`` just before the reader opens it and one just after (:meth:`StoreLocation.check_shard`),
and the manifest by a ``stat`` (its checksum is read only when the ``stat`` changed:
:meth:`StoreLocation.check_current`). A store rewritten under an open dataset (``convert
overwrite=True`` deletes the manifest first and publishes the new one last) raises
:class:`~fastdata.errors.StoreChangedError` ("<store> was rewritten since it was opened;
open it again"), never a mix of the new shards with the old index. A remote store's cache
is keyed by its manifest checksum, so cached shards are always the opened version; a
shard downloaded after the store was rewritten fails its size or checksum and, when the
remote manifest's checksum is no longer the opened one, is the same StoreChangedError.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from fastdata.common.callers import user_stacklevel
from fastdata.common.fileio import atomic_write, read_regular
from fastdata.common.paths import remote_scheme
from fastdata.errors import (
    CorruptRecordError,
    FastdataError,
    FormatError,
    IncompleteStoreError,
    RemoteStoreError,
    StoreChangedError,
    UnsafeStoreError,
)
from fastdata.format.backends.base import ShardReader, StorageSpec
from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest, read_manifest
from fastdata.format.names import MANIFEST_NAME, STORE_INDEX_NAME
from fastdata.format.record import ShardIndex
from fastdata.format.store_index import MANIFEST_KEY, index_file_name, parse_store_index
from fastdata.remote.cache import Pin, ShardCache, store_key
from fastdata.remote.location import RemoteLocation


class RecordsFallbackWarning(UserWarning):
    """A remote store opened with ``cache="records"`` has shards whose records cannot be read one by
    one (its index file records no byte ranges: written by an older fastdata; or chunked fields):
    those shards are downloaded whole into the shard cache. Points at the caller's line."""


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL (``s3://``, ``gs://``, ``https://``, ...)."""
    return remote_scheme(path) is not None


class _NoPin:
    path = ""

    def release(self) -> None:
        pass


#: a file's identity: (device, inode, size, mtime in ns); None when the file is missing
Identity = tuple[int, int, int, int] | None
#: how many times opening a store retries when the manifest changes while it is read
OPEN_ATTEMPTS = 3


def file_identity(path: str) -> Identity:
    """``(st_dev, st_ino, st_size, st_mtime_ns)`` of ``path`` (following a symlink), None when missing."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


#: what a shard entry of an appended store's later manifest keeps exactly as it was
_KEPT_SHARD_KEYS = ("name", "first_index", "count", "bytes", "xxh")


def extends(later: Mapping[str, Any], earlier: Mapping[str, Any]) -> bool:
    """Whether manifest ``later`` is ``earlier`` with shards appended (``fastdata convert
    append=True``): the same backend, and ``earlier``'s shards first, each unchanged. A dataset
    opened on ``earlier`` reads on in that version (its shards are never rewritten by an append)."""
    old, new = earlier["shards"], later["shards"]
    return (later["backend"] == earlier["backend"] and len(new) >= len(old)
            and all(all(a.get(k) == b.get(k) for k in _KEPT_SHARD_KEYS) for a, b in zip(old, new, strict=False)))


def changed_error(root: str, detail: str) -> StoreChangedError:
    return StoreChangedError(f"{root} was rewritten since it was opened; open it again ({detail}; reading on "
                             "would mix the new store's files with the old one's index)")


class StoreLocation:
    """A local store directory (the base class) or a remote one (:class:`RemoteStore`)."""

    remote = False

    def __init__(self, root: str):
        self.root = root
        manifest_path = os.path.join(root, MANIFEST_NAME)
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            before = file_identity(manifest_path)
            self.manifest = read_manifest(root)
            #: identity of each shard file of the version opened (see the module docstring)
            self.shard_identity: list[Identity] = [file_identity(os.path.join(root, s["name"]))
                                                   for s in self.manifest["shards"]]
            #: identity of manifest.json as opened
            self.manifest_identity = file_identity(manifest_path)
            if before == self.manifest_identity and before is not None:
                break
            if attempt == OPEN_ATTEMPTS:
                raise StoreChangedError(f"{root}: manifest.json changed {OPEN_ATTEMPTS} times while the store was "
                                        "opened (a conversion is rewriting it?); open it again once it is finished")

    def shard_indexes(self, reader_cls, storage, schema) -> list:
        """Every shard's index, in manifest order, each checked against the manifest's count
        (and each shard file against the identity recorded when the store was opened)."""
        out = []
        for shard, entry in enumerate(self.manifest["shards"]):
            path = os.path.join(self.root, entry["name"])
            self.check_shard(shard, path)
            with reader_cls(path, storage, schema=schema, expected_count=entry["count"]) as reader:
                out.append(reader.read_index())
            self.check_shard(shard, path)
        return out

    def field_file(self, name: str, nbytes: int, xxh: str) -> str:
        """The local path of field file ``name`` (an added field's values: ``fastdata.add_fields``)
        of ``nbytes`` bytes and xxh3-64 ``xxh`` (a local store's own file: its reader checks the
        size, and each array's checksum)."""
        return os.path.join(self.root, name)

    def open_shard(self, shard: int, release_idle: Callable[[], None] | None = None) -> tuple[str, Any]:
        """(local path of shard ``shard``, a pin to release when the reader closes)."""
        return os.path.join(self.root, self.manifest["shards"][shard]["name"]), _NoPin()

    def check_shard(self, shard: int, path: str, manifest: bool = True) -> None:
        """Raise :class:`StoreChangedError` unless the file at ``path`` (shard ``shard``) is the
        one the store was opened with, and the manifest too (:meth:`check_current`). Costs
        one ``stat`` of the shard plus (``manifest``) one of the manifest (~1 us each on a local disk).

        A reader opening a shard calls this just before and just after opening it: the file
        it opened is then the recorded one (a rewrite replaces shard files and never puts an
        old one back)."""
        recorded = self.shard_identity[shard] if shard < len(self.shard_identity) else None
        found = file_identity(path)
        if found != recorded:
            self.check_current(force=True)  # the manifest too: it says which of the two changed
            if recorded is None:  # (missing when opened: the reader's own error says so)
                return
            raise changed_error(self.root, f"shard {self.manifest['shards'][shard]['name']} is not the file it was: "
                                f"{'gone' if found is None else 'replaced'}")
        if manifest:
            self.check_current()

    def check_current(self, force: bool = False) -> None:
        """Raise :class:`StoreChangedError` when ``manifest.json`` is no longer the one opened:
        one ``stat``; its checksum is read only when the ``stat`` differs (a manifest copied
        or touched in place, with the same checksum, is the same version)."""
        path = os.path.join(self.root, MANIFEST_NAME)
        found = file_identity(path)
        if found == self.manifest_identity and not force:
            return
        if found is None:
            raise changed_error(self.root, f"its {MANIFEST_NAME} is gone (a conversion is rewriting it?)")
        if found == self.manifest_identity:
            return
        try:
            current = read_manifest(self.root)
        except FastdataError as err:
            raise changed_error(self.root, f"its {MANIFEST_NAME} changed and does not read as a store: {err}") \
                from None
        if current["checksum"] != self.manifest["checksum"] and not extends(current, self.manifest):
            raise changed_error(self.root, f"its {MANIFEST_NAME} has checksum {current['checksum']}, not "
                                           f"{self.manifest['checksum']}")
        # the same version (e.g. copied back in place), or a later one made by appending to it,
        # which keeps every shard of this one as it was: this dataset reads on in its own version
        self.manifest_identity = found

    def record_reader(self, shard: int) -> ShardReader | None:
        """A reader of shard ``shard`` that reads single records without the shard file (a remote
        store opened with ``cache="records"``), or None: open the shard file (:meth:`open_shard`)."""
        return None

    def prefetch(self, shards: Sequence[int], keep: Collection[int] = ()) -> None:
        """Start fetching ``shards`` in the background (nothing to do for a local store)."""

    def open_shards_per_process(self, processes: int = 1) -> int | None:
        """How many shards one reading process keeps open by default (None: all of them), when
        ``processes`` processes of this job read the store at once."""
        return None

    def slim(self) -> StoreLocation:
        """This location without the manifest's bulky parts (what datasets keep and pickle)."""
        self.manifest = {k: self.manifest[k] for k in ("shards", "backend", "checksum")}
        return self


#: what ``cache=`` may say: whole shards through the shard cache (the default), or single records
CACHE_MODES = ("shards", "records")


def check_cache_mode(cache: str) -> str:
    """``cache`` when it is one of :data:`CACHE_MODES`; ValueError naming them otherwise."""
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {', '.join(map(repr, CACHE_MODES))}, got {cache!r:.60}")
    return cache


class RemoteStore(StoreLocation):
    """A store at a URL, read through a shared, bounded, checksummed local cache.

    Args:
        url: the store's URL.
        storage_options: fsspec filesystem options (endpoint, credentials, ...).
        cache_dir: the cache directory (default :func:`~fastdata.remote.cache.default_cache_dir`).
        cache_limit: most bytes the cache holds (an int or "50GiB"); None = unbounded.
        cache: ``"shards"`` (shards downloaded whole into the cache and read there) or
            ``"records"`` (each record read with a ranged request, :mod:`fastdata.remote.records`;
            the shards of a store whose index file records no byte ranges are still read whole,
            with a warning).
    """

    remote = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, cache: str = "shards"):
        self.cache_mode = check_cache_mode(cache)
        #: shard -> what its ranged reader needs (``cache="records"``, shards whose index has ranges)
        self._ranged: dict[int, dict[str, Any]] = {}
        self.location = RemoteLocation(url, storage_options or {})
        self.root = self.location.url
        self.cache = ShardCache(cache_dir, cache_limit)
        self.manifest = self._read_manifest()
        self.key = store_key(self.root, self.manifest["checksum"])
        self._dir = self.cache.prepare_store(self.key, self.root, self.manifest["checksum"])
        local_manifest = os.path.join(self._dir, MANIFEST_NAME)
        if not os.path.exists(local_manifest):
            atomic_write(local_manifest, self._raw_manifest)
        del self._raw_manifest
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None
        self._queued: set[int] = set()
        self._lock = threading.Lock()
        #: shard -> message, for shards whose downloads never matched the manifest (this process)
        self._damaged: dict[int, str] = {}

    def _read_manifest(self) -> dict:
        try:
            raw = self.location.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            staging = False
            if not self.location.read_only:
                staging = bool(self.location.listing(".fastdata-staging"))
            if staging:
                raise IncompleteStoreError(f"{self.root}: no {MANIFEST_NAME}: an unfinished conversion (finish it "
                                           "by converting its source again with resume=True)") from None
            raise FormatError(f"{self.root}: not a fastdata store: no {MANIFEST_NAME} there") from None
        self._raw_manifest = raw
        return parse_manifest(raw, where=self.location.child(MANIFEST_NAME))

    def shard_indexes(self, reader_cls, storage, schema) -> list:
        if MANIFEST_KEY not in self.manifest:
            raise FormatError(f"{self.root}: the store has no {STORE_INDEX_NAME} (it was made by an older fastdata), "
                              "so it cannot be read remotely without downloading every shard: convert it again "
                              "with this version, or copy it to local disk")
        entry = self.manifest[MANIFEST_KEY]
        name = index_file_name(self.manifest)
        local = os.path.join(self._dir, name)
        data = None
        if os.path.exists(local):
            try:
                data = read_regular(local, entry["bytes"], "cached store index")
            except UnsafeStoreError:
                data = None  # not what was cached there: fetched again, and replaced
        if data is None or len(data) != entry["bytes"]:
            # at most the declared size (+1 byte to tell a longer object), whatever the server sends
            data = self.location.read_bytes(name, limit=entry["bytes"])
            parsed = parse_store_index(data, self.manifest, schema, self.location.child(name))
            atomic_write(local, data)
        else:
            parsed = parse_store_index(data, self.manifest, schema, local)
        if self.cache_mode == "records" and reader_cls is not None:
            self._keep_ranges(parsed, reader_cls, storage, schema)
        return parsed

    def _keep_ranges(self, indexes: list, reader_cls, storage: StorageSpec, schema) -> None:
        """Keep what each shard's ranged reader needs (``cache="records"``); warn once, naming why,
        when some shards can only be read whole (a store written before ``record_ranges`` existed,
        or chunked fields, whose chunks have no ranges)."""
        self._ranged = {}
        chunked = schema is not None and bool(schema.chunked_fields())
        whole = []
        for shard, index in enumerate(indexes):
            if index.record_ranges is None or chunked:
                whole.append(shard)
                continue
            offsets = index.relpath_offsets if isinstance(index, ShardIndex) else index.arrays["relpath_offsets"]
            self._ranged[shard] = {"ranges": index.record_ranges, "checksums": index.checksums,
                                   "nbytes": index.nbytes, "path_bytes": np.diff(offsets),
                                   "reader_cls": reader_cls, "storage": storage, "schema": schema}
        if whole:
            names = [self.manifest["shards"][k]["name"] for k in whole]
            why = ("its chunked fields are read from whole shards" if chunked else
                   f"its {index_file_name(self.manifest)} records no byte ranges of records (written by a fastdata "
                   "before they existed; convert or write it again to read single records)")
            warnings.warn(f"fastdata: {self.root}: cache='records' reads {len(names)} of its "
                          f"{len(indexes)} shards ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) whole "
                          f"through the shard cache: {why}", RecordsFallbackWarning, stacklevel=user_stacklevel())

    def field_file(self, name: str, nbytes: int, xxh: str) -> str:
        """Field file ``name`` downloaded whole into this store version's cache folder (once:
        checked against ``nbytes`` and the xxh3-64 ``xxh`` the manifest gives, then kept there
        beside the cached manifest and index file)."""
        local = os.path.join(self._dir, name)
        if os.path.exists(local):
            try:
                if xxhash.xxh3_64_hexdigest(read_regular(local, nbytes, "cached field file")) == xxh:
                    return local
            except UnsafeStoreError:
                pass  # not what was cached there: fetched again, and replaced
        data = self.location.read_bytes(name, limit=nbytes)
        if len(data) != nbytes or xxhash.xxh3_64_hexdigest(data) != xxh:
            self._raise_if_rewritten()
            raise CorruptRecordError(f"{self.location.child(name)}: {len(data)} bytes that do not match the "
                                     f"manifest's size ({nbytes}) and checksum; the store is damaged",
                                     store=self.root)
        atomic_write(local, data)
        return local

    def record_reader(self, shard: int) -> ShardReader | None:
        """A :class:`~fastdata.remote.records.RangedShardReader` of ``shard`` with ``cache="records"``
        (None for a shard read whole: see :meth:`_keep_ranges`)."""
        kept = self._ranged.get(shard)
        if kept is None:
            return None
        from fastdata.remote.records import RangedShardReader

        entry = self.manifest["shards"][shard]
        return RangedShardReader(location=self.location, name=entry["name"], shard_bytes=entry["bytes"],
                                 check_rewritten=self._raise_if_rewritten, **kept)

    def open_shard(self, shard: int, release_idle: Callable[[], None] | None = None) -> tuple[str, Pin]:
        """(local path, pin) of ``shard``, downloaded first when not cached; ``release_idle`` is
        called before waiting for room (to close this process's readers of other shards).

        A download that does not match the manifest opened (its size or checksum) is a
        :class:`StoreChangedError` when the store's manifest at the URL is no longer that one
        (the store was rewritten), else damage (:class:`CorruptRecordError`)."""
        damaged = self._damaged.get(shard)
        if damaged is not None:  # once per process: on_error="skip" moves on without downloading it again
            raise CorruptRecordError(damaged, shard=self.manifest["shards"][shard]["name"])
        try:
            pin = self._acquire(shard, wait=True, on_wait=release_idle)
        except CorruptRecordError as err:
            self._raise_if_rewritten()
            self._damaged[shard] = str(err)
            raise
        except (RemoteStoreError, OSError):  # (a missing object: FileNotFoundError)
            self._raise_if_rewritten()
            raise
        assert pin is not None
        return pin.path, pin

    def _raise_if_rewritten(self) -> None:
        """Raise :class:`StoreChangedError` when the manifest at the URL is not the one opened
        (one small read, only after a download failed its check)."""
        try:
            raw = self.location.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
            checksum = parse_manifest(raw, where=self.location.child(MANIFEST_NAME))["checksum"]
        except FileNotFoundError:
            raise changed_error(self.root, f"its {MANIFEST_NAME} is gone (a conversion is rewriting it?)") from None
        except FastdataError:
            return  # unreadable now: the caller's own error stands
        if checksum != self.manifest["checksum"]:
            raise changed_error(self.root, f"its {MANIFEST_NAME} has checksum {checksum}, not "
                                           f"{self.manifest['checksum']}")

    def check_shard(self, shard: int, path: str, manifest: bool = True) -> None:
        """Nothing to check: the cache is keyed by the manifest checksum (shards of the opened
        version only) and a download is checked against it (see :meth:`open_shard`)."""

    def check_current(self, force: bool = False) -> None:
        """Nothing to check per read (see :meth:`check_shard`)."""

    def open_shards_per_process(self, processes: int = 1) -> int:
        """Shards one reading process keeps open (so pinned) by default: 4, or fewer when the cache
        limit could not hold 4 of the largest shards for every process reading it (``processes``,
        e.g. a DataLoader's workers, times ``$LOCAL_WORLD_SIZE`` ranks); at least 1. Under that
        bound a process that needs room finds it once it releases its own pins, however long the
        others keep theirs while idle."""
        if self.cache.limit is None:
            return 4
        processes = max(1, processes) * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        biggest = max((s["bytes"] for s in self.manifest["shards"]), default=1) or 1
        return max(1, min(4, self.cache.limit // (biggest * processes)))

    def _acquire(self, shard: int, wait: bool, keep: Collection[int] = (),
                 on_wait: Callable[[], None] | None = None) -> Pin | None:
        entry = self.manifest["shards"][shard]
        name = entry["name"]
        return self.cache.acquire(self.key, name, size=entry["bytes"], xxh=entry["xxh"], wait=wait,
                                  keep=[self.manifest["shards"][k]["name"] for k in keep], on_wait=on_wait,
                                  download=lambda part: self.location.download(name, part, entry["bytes"]))

    def prefetch(self, shards: Sequence[int], keep: Collection[int] = ()) -> None:
        """Download ``shards`` in background threads of this process (two at a time), within
        the cache limit, never evicting ``shards`` or ``keep`` (the windows about to be read)
        to make room: a shard that finds no room, or that another process is already
        downloading, is left for the reader to fetch on demand."""
        shards = [k for k in shards if k not in self._ranged]  # (read record by record: nothing to download)
        if not shards:
            return
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fastdata-prefetch")
                self._pool_pid = os.getpid()
                self._queued = set()
            for shard in shards:
                if shard not in self._queued:
                    self._queued.add(shard)
                    self._pool.submit(self._prefetch_one, shard, frozenset(keep) | frozenset(shards))

    def _prefetch_one(self, shard: int, keep: frozenset[int]) -> None:
        try:
            pin = self._acquire(shard, wait=False, keep=keep)
            if pin is not None:
                pin.release()
        except Exception:  # noqa: BLE001 - the reader fetches it on demand and reports the error there
            pass
        finally:
            with self._lock:
                self._queued.discard(shard)

    def slim(self) -> RemoteStore:
        super().slim()
        return self

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_pool_pid"] = None
        state["_queued"] = set()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def locate_store(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | None = None, cache_limit: int | str | None = None,
                 cache: str = "shards") -> StoreLocation:
    """The :class:`StoreLocation` of a store path or URL (reads and checks its manifest).

    ``cache``: how a remote store is read (:class:`RemoteStore`); a local store reads single
    records from its files whatever it says.

    Raises :class:`~fastdata.errors.PathNotFoundError` (a missing local path),
    :class:`~fastdata.errors.FormatError` (not a store),
    :class:`~fastdata.errors.RemoteStoreError` (an unreachable URL) and ValueError (an unknown
    ``cache``)."""
    text = os.fspath(path)
    check_cache_mode(cache)
    if is_remote(text):
        return RemoteStore(text, storage_options, cache_dir, cache_limit, cache)
    if storage_options:
        raise RemoteStoreError(f"{text}: storage_options apply to remote URLs only, not to a local path")
    return StoreLocation(os.path.abspath(text))
