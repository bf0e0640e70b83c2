"""HDF5 shard layout, versions 1 (classification) and 2 (general samples).

A shard is one HDF5 file: root attributes ``layout``/``version``/``count``, every sample's bytes in
one flat contiguous uint8 dataset (``images``, or ``records`` for version 2, or ``pixels`` for raw
classification stores) with ``offsets``, the per-sample index arrays beside it, and ``chunks`` for
chunked fields. Why not variable-length datasets: h5py reads them element by element through a slow
path (h5py/h5py#59), where one flat array plus offsets reads a run of samples in one call. Why
contiguous: the payload then has one file offset (``dataset.id.get_offset()``), so fastdata's reader
maps it and slices samples without a call into libhdf5 per read (~40 us each through h5py).

The dataset-level specification, precise enough to read a shard with ``h5py`` alone:
``docs/FORMAT.md``, section 6.
"""

from __future__ import annotations

from fastdata.format.record import INDEX_DTYPES

LAYOUT = "fastdata-hdf5-shard"
VERSION = 1
#: layout version of general (schema) stores
VERSION_2 = 2
IMAGES = "images"
RECORDS = "records"
OFFSETS = "offsets"
PIXELS = "pixels"
CHUNKS = "chunks"
INDEX_ARRAYS = INDEX_DTYPES
#: readers' chunk cache: small and bounded (random access gains nothing from more)
READER_CHUNK_CACHE = 1 << 20
