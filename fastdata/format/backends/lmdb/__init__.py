"""The LMDB backend: layout constants (``spec``), shard writer and shard reader."""
