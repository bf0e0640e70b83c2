"""The HDF5 backend: layout constants (``spec``), shard writer and shard reader."""
