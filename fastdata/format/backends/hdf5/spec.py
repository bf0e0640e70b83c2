"""HDF5 shard layout, versions 1 (classification) and 2 (general samples).

Each shard is one HDF5 file, e.g. ``shard-00000.h5``. Root attributes:
``layout = "fastdata-hdf5-shard"``, ``version = 1``, ``count = n``.

Datasets (all 1-D unless noted; ``n`` = samples in the shard):

``images``   uint8 [total bytes]   the stored image bytes of every sample,
                                   concatenated (original / re-encoded modes);
                                   contiguous layout, uncompressed
``offsets``  int64 [n + 1]         sample i is ``images[offsets[i]:offsets[i+1]]``
``pixels``   uint8 [n, H, W, 3]    raw mode only (instead of ``images``):
                                   decoded RGB pixels, contiguous
``labels`` int64, ``checksums`` uint64 (xxh3_64 of the sample's bytes),
``widths`` int32, ``heights`` int32, ``formats`` uint8 (codes in
``fastdata/format/record.py``), ``nbytes`` int64, ``relpaths`` uint8 (concatenated
source paths) with ``relpath_offsets`` int64 [n + 1].

Version 2 (a store whose manifest has a ``schema`` other than the classification
one): root attribute ``version = 2``; instead of ``images``:

``records``  uint8 [total bytes]   every sample's version-2 msgpack record
                                   (``{"v": 2, "path": bin, <record field>: value}``),
                                   concatenated, contiguous, uncompressed
``offsets``  int64 [n + 1]         record i is ``records[offsets[i]:offsets[i+1]]``

plus ``checksums`` uint64 (xxh3_64 of each record's bytes), ``nbytes`` int64,
``relpaths``/``relpath_offsets`` as in version 1, and per field
(``fastdata.format.record.index_layout``) the group ``fields/``: ``fields/<name>``
[n, *shape] in the field's little-endian dtype for index-resident fields (ints,
floats, small fixed arrays), and ``fields/<image>.format`` uint8,
``fields/<image>.width`` / ``.height`` int32 for each image field.

A store whose schema has ``chunked`` fields adds:

``chunks``   uint8 [total bytes]   every stored chunk of the shard, back to back, contiguous
                                   and uncompressed (the codec compressed each chunk): chunk
                                   ``j`` of a sample's field starts ``first + sum(nbytes[:j])``
                                   bytes in, ``first`` being its ``fields/<name>.first`` entry
                                   (``uint64``) and ``nbytes`` its record's chunk table

Why not variable-length datasets: h5py reads them element by element through a
slow path (h5py/h5py#59); one flat byte array plus offsets reads a contiguous
range of samples in one call. Why contiguous: the payload then has one file
offset (``dataset.id.get_offset()``), so fastdata's reader maps it and slices
samples without a per-read call into libhdf5 (~40 us each through h5py).
fastdata's writer happens to put the payload at 64 KiB (it streams the bytes there
before creating the HDF5 structure around them); readers must not rely on that.
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
