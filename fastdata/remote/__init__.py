"""Remote stores: URLs (``s3://``, ``gs://``, ``az://``, ``https://``) read through a bounded,
shared, checksummed local cache of whole shards, and written through local staging.

* :mod:`fastdata.remote.location`: a URL plus fsspec ``storage_options``, with retries.
* :mod:`fastdata.remote.cache`: the shard cache (locks, pins, LRU eviction under a limit).
* :mod:`fastdata.remote.store`: what a dataset asks of a store, local or remote.
"""

from .cache import ShardCache, default_cache_dir
from .location import RemoteLocation, parse_storage_options
from .store import RemoteStore, StoreLocation, is_remote, locate_store

__all__ = ["RemoteLocation", "RemoteStore", "ShardCache", "StoreLocation", "default_cache_dir", "is_remote",
           "locate_store", "parse_storage_options"]
