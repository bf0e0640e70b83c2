"""Remote stores: URLs (``s3://``, ``gs://``, ``az://``, ``https://``) read through a bounded,
shared, checksummed local cache of whole shards, and written through local staging.

* :mod:`fastdata.remote.location`: a URL plus fsspec ``storage_options``, with retries.
* :mod:`fastdata.remote.cache`: the shard cache (locks, pins, LRU eviction under a limit).
* :mod:`fastdata.remote.store`: what a dataset asks of a store, local or remote.
* :mod:`fastdata.remote.inventory`: what the cache holds per store, and clearing it.
"""

from .cache import ShardCache, default_cache_dir
from .inventory import CacheReport, CachedStore, cache_report, clear_cache
from .location import RemoteLocation, parse_storage_options
from .store import RemoteStore, StoreLocation, is_remote, locate_store

__all__ = ["CacheReport", "CachedStore", "RemoteLocation", "RemoteStore", "ShardCache", "StoreLocation",
           "cache_report", "clear_cache", "default_cache_dir", "is_remote", "locate_store", "parse_storage_options"]
