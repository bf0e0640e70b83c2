"""Remote stores: URLs (``s3://``, ``gs://``, ``az://``, ``https://``) read through a bounded,
shared, checksummed local cache of whole shards.

* :mod:`fastdata.remote.location`: a URL plus fsspec ``storage_options``, with retries.
* :mod:`fastdata.remote.cache`: the shard cache (locks, pins, LRU eviction under a limit).
* :mod:`fastdata.remote.store`: what a dataset asks of a store, local or remote.
* :mod:`fastdata.remote.inventory`: what the cache holds per store, and clearing it.

Writing to a URL is the writer's business (:mod:`fastdata.writer.remote_sink`)."""
