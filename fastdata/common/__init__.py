"""Shared helpers every layer may use: sizes and units, optional extras, the image-opening
policy, and file I/O (atomic writes, fsync, checksums, write-back pacing).

Imports nothing else of fastdata but :mod:`fastdata.errors`."""
