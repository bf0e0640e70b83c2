"""The readers: per-process shard handles, the datasets, ``open_dataset`` (the one module
that knows every dataset class), batching, decode, transforms, samplers, seeding and the
loader.

Never imports :mod:`fastdata.writer`."""
