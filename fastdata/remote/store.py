"""Where a dataset's store lives: a local directory, or a URL read through the shard cache.

Datasets ask a :class:`StoreLocation` for three things: the manifest, every shard's index,
and a local path to open a shard at (plus a pin that keeps that file in place while it is
open). A local store answers from its directory; a remote store from its URL, its store
index file and the :class:`~fastdata.remote.cache.ShardCache`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from fastdata.common.fileio import atomic_write, read_regular
from fastdata.common.paths import remote_scheme
from fastdata.errors import CorruptRecordError, FormatError, IncompleteStoreError, RemoteStoreError, UnsafeStoreError
from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest, read_manifest
from fastdata.format.names import MANIFEST_NAME, STORE_INDEX_NAME
from fastdata.format.store_index import MANIFEST_KEY, parse_store_index
from fastdata.remote.cache import Pin, ShardCache, store_key
from fastdata.remote.location import RemoteLocation


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL (``s3://``, ``gs://``, ``https://``, ...)."""
    return remote_scheme(path) is not None


class _NoPin:
    path = ""

    def release(self) -> None:
        pass


class StoreLocation:
    """A local store directory (the base class) or a remote one (:class:`RemoteStore`)."""

    remote = False

    def __init__(self, root: str):
        self.root = root
        self.manifest = read_manifest(root)

    def shard_indexes(self, reader_cls, storage, schema) -> list:
        """Every shard's index, in manifest order, each checked against the manifest's count."""
        out = []
        for shard in self.manifest["shards"]:
            with reader_cls(os.path.join(self.root, shard["name"]), storage, schema=schema,
                            expected_count=shard["count"]) as reader:
                out.append(reader.read_index())
        return out

    def open_shard(self, shard: int, release_idle: Callable[[], None] | None = None) -> tuple[str, Any]:
        """(local path of shard ``shard``, a pin to release when the reader closes)."""
        return os.path.join(self.root, self.manifest["shards"][shard]["name"]), _NoPin()

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


class RemoteStore(StoreLocation):
    """A store at a URL, read through a shared, bounded, checksummed local cache.

    Args:
        url: the store's URL.
        storage_options: fsspec filesystem options (endpoint, credentials, ...).
        cache_dir: the cache directory (default :func:`~fastdata.remote.cache.default_cache_dir`).
        cache_limit: most bytes the cache holds (an int or "50GiB"); None = unbounded.
    """

    remote = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None):
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
                                           "with fastdata convert SRC DST --resume)") from None
            raise FormatError(f"{self.root}: not a fastdata store: no {MANIFEST_NAME} there") from None
        self._raw_manifest = raw
        return parse_manifest(raw, where=self.location.child(MANIFEST_NAME))

    def shard_indexes(self, reader_cls, storage, schema) -> list:
        if MANIFEST_KEY not in self.manifest:
            raise FormatError(f"{self.root}: the store has no {STORE_INDEX_NAME} (it was made by an older fastdata), "
                              "so it cannot be read remotely without downloading every shard: convert it again "
                              "with this version, or copy it to local disk")
        entry = self.manifest[MANIFEST_KEY]
        local = os.path.join(self._dir, STORE_INDEX_NAME)
        data = None
        if os.path.exists(local):
            try:
                data = read_regular(local, entry["bytes"], "cached store index")
            except UnsafeStoreError:
                data = None  # not what was cached there: fetched again, and replaced
        if data is None or len(data) != entry["bytes"]:
            # at most the declared size (+1 byte to tell a longer object), whatever the server sends
            data = self.location.read_bytes(STORE_INDEX_NAME, limit=entry["bytes"])
            parsed = parse_store_index(data, self.manifest, schema, self.location.child(STORE_INDEX_NAME))
            atomic_write(local, data)
            return parsed
        return parse_store_index(data, self.manifest, schema, local)

    def open_shard(self, shard: int, release_idle: Callable[[], None] | None = None) -> tuple[str, Pin]:
        """(local path, pin) of ``shard``, downloaded first when not cached; ``release_idle`` is
        called before waiting for room (to close this process's readers of other shards)."""
        damaged = self._damaged.get(shard)
        if damaged is not None:  # once per process: on_error="skip" moves on without downloading it again
            raise CorruptRecordError(damaged, shard=self.manifest["shards"][shard]["name"])
        try:
            pin = self._acquire(shard, wait=True, on_wait=release_idle)
        except CorruptRecordError as err:
            self._damaged[shard] = str(err)
            raise
        assert pin is not None
        return pin.path, pin

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
                 cache_dir: str | None = None, cache_limit: int | str | None = None) -> StoreLocation:
    """The :class:`StoreLocation` of a store path or URL (reads and checks its manifest).

    Raises :class:`~fastdata.errors.PathNotFoundError` (a missing local path),
    :class:`~fastdata.errors.FormatError` (not a store) and
    :class:`~fastdata.errors.RemoteStoreError` (an unreachable URL)."""
    text = os.fspath(path)
    if is_remote(text):
        return RemoteStore(text, storage_options, cache_dir, cache_limit)
    if storage_options:
        raise RemoteStoreError(f"{text}: storage_options apply to remote URLs only, not to a local path")
    return StoreLocation(os.path.abspath(text))
