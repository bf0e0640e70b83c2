"""What the shard cache holds, per store version, and clearing it (``fastdata cache``).

Each store version has its own folder in the cache (see :mod:`fastdata.remote.cache`);
its ``store.json`` names the URL and manifest checksum, its ``manifest.json`` the shards
the store has, and ``shards/`` the ones downloaded so far.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fastdata.common.units import format_size
from fastdata.format.names import MANIFEST_NAME
from fastdata.remote.cache import STORE_INFO, ShardCache, resolve_limit


@dataclass
class CachedStore:
    """One cached store version.

    Attributes:
        key: its folder name in the cache.
        url: the store's URL ("?" when its ``store.json`` is unreadable).
        manifest_checksum: the checksum of the manifest this version was read from.
        shards_cached: finished shard files in the cache.
        shards_total: shards the store has (None when its cached manifest is unreadable).
        bytes: bytes of those shard files.
        last_use: when a shard was last opened (epoch seconds; the folder's time if none is cached).
        current: whether the server's manifest still has this checksum (None: not checked,
            or the server could not say: then ``check_error`` says why).
    """

    key: str
    url: str
    manifest_checksum: str
    shards_cached: int
    shards_total: int | None
    bytes: int
    last_use: float
    current: bool | None = None
    check_error: str | None = None


@dataclass
class CacheReport:
    """The cache at ``root``: its store versions (most recently used first), totals and limit."""

    root: str
    stores: list[CachedStore] = field(default_factory=list)
    limit: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.stores)

    @property
    def total_shards(self) -> int:
        return sum(s.shards_cached for s in self.stores)

    def to_json(self) -> dict:
        """Plain dict (JSON-ready)."""
        return {"root": self.root, "limit": self.limit, "total_bytes": self.total_bytes,
                "total_shards": self.total_shards, "stores": [asdict(s) for s in self.stores]}

    def table(self) -> str:
        """The human-readable listing ``fastdata cache list`` prints."""
        lines = [f"cache: {self.root}"]
        if not self.stores:
            lines.append("  (empty)")
        for s in self.stores:
            total = "?" if s.shards_total is None else str(s.shards_total)
            current = {True: "current", False: "outdated (the store was rewritten)", None: "current: ?"}[s.current]
            if s.check_error:
                current += f" ({s.check_error})"
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_use))
            lines.append(f"  {s.url}  [{s.manifest_checksum[:16]}]")
            lines.append(f"    {s.shards_cached}/{total} shards, {format_size(s.bytes)}, last use {used}, {current}")
        limit = f" of a {format_size(self.limit)} limit (FASTDATA_CACHE_LIMIT)" if self.limit else ""
        lines.append(f"total: {self.total_shards} shard(s), {format_size(self.total_bytes)}{limit} in "
                     f"{len(self.stores)} store version(s)")
        return "\n".join(lines)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as fh:
            body = json.loads(fh.read())
        return body if isinstance(body, dict) else None
    except (OSError, ValueError):
        return None


def _describe(cache: ShardCache, key: str) -> CachedStore:
    folder = cache.store_dir(key)
    info = _read_json(os.path.join(folder, STORE_INFO)) or {}
    manifest = _read_json(os.path.join(folder, MANIFEST_NAME))
    shards = cache.shards(key)
    total = None
    if manifest is not None and isinstance(manifest.get("shards"), list):
        total = len(manifest["shards"])
    try:
        folder_time = os.stat(folder).st_mtime
    except OSError:
        folder_time = 0.0
    return CachedStore(key=key, url=str(info.get("url", "?")), manifest_checksum=str(info.get("manifest_checksum",
                                                                                                  "?")),
                       shards_cached=len(shards), shards_total=total, bytes=sum(s.size for s in shards),
                       last_use=max([s.last_use for s in shards], default=folder_time))


def _check_current(stores: list[CachedStore], storage_options: Mapping[str, Any] | None) -> None:
    """Ask each store's server for its manifest: is the cached version the current one?"""
    from fastdata.errors import FastdataError
    from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
    from fastdata.remote.location import RemoteLocation

    checksums: dict[str, str | Exception] = {}
    for s in stores:
        if s.url not in checksums:
            loc = RemoteLocation(s.url, storage_options or {})
            try:
                raw = loc.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
                checksums[s.url] = str(parse_manifest(raw, where=loc.child(MANIFEST_NAME))["checksum"])
            except FileNotFoundError:
                checksums[s.url] = FileNotFoundError("the store is gone from the server")
            except (FastdataError, OSError) as err:
                checksums[s.url] = err
        found = checksums[s.url]
        if isinstance(found, Exception):
            s.check_error = str(found) if not isinstance(found, FileNotFoundError) else found.args[0]
            s.current = False if isinstance(found, FileNotFoundError) else None
        else:
            s.current = found == s.manifest_checksum


def cache_report(cache_dir: str | None = None, *, check: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> CacheReport:
    """What the shard cache at ``cache_dir`` holds.

    Args:
        cache_dir (str | None): the cache (default :func:`~fastdata.remote.cache.default_cache_dir`).
        check (bool): ask each store's server whether the cached version is still the current one.
        storage_options (Mapping | None): fsspec options for those requests.

    Returns:
        CacheReport: one :class:`CachedStore` per store version, most recently used first;
        ``limit`` is ``FASTDATA_CACHE_LIMIT`` in bytes (None when unset).
    """
    cache = ShardCache(cache_dir)
    stores = sorted((_describe(cache, k) for k in cache.store_keys()), key=lambda s: -s.last_use)
    if check:
        _check_current(stores, storage_options)
    return CacheReport(root=cache.root, stores=stores, limit=resolve_limit(None))


def clear_cache(url: str | None = None, cache_dir: str | None = None) -> tuple[int, int]:
    """Remove cached shards of the store at ``url`` (all its versions), or of every store.

    A shard that a live process has open is kept (it is removed by a later clear, or
    evicted, once that process is done with it).

    Returns:
        tuple[int, int]: (shards removed, shards kept because in use).
    """
    cache = ShardCache(cache_dir)
    if not os.path.isdir(cache.root):  # nothing cached; a mistyped cache_dir is not created
        return 0, 0
    if url is None:
        return cache.clear()
    wanted = url.rstrip("/")
    removed = kept = 0
    for key in cache.store_keys():
        info = _read_json(os.path.join(cache.store_dir(key), STORE_INFO)) or {}
        if str(info.get("url", "")).rstrip("/") == wanted:
            r, k = cache.clear(key)
            removed, kept = removed + r, kept + k
    return removed, kept
