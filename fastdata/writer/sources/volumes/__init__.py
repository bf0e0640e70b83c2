"""NIfTI volumes and large TIFF images as chunked samples (``fastdata convert`` of a NIfTI
folder, a volume list or a Decathlon ``dataset.json``; ``chunks``/``max_pixels`` for a
folder of TIFF images): general (layout version 2) stores whose arrays are
:class:`~fastdata.format.fields.Chunked` fields, read region by region afterwards
(``fastdata.open_dataset(dst)[i]["image"][10:74, ...]``, :class:`fastdata.PatchDataset`).

Usage::

    fastdata.convert("scans/", "ct.lmdb")                    # a folder of .nii/.nii.gz files
    fastdata.convert("train.csv", "seg.h5", chunks=(96, 96, 96))  # rows image,label (label volumes), more kept
    fastdata.convert("Task02_Heart/dataset.json", "heart.lmdb")   # Medical Segmentation Decathlon: "training"
    fastdata.convert("slides/", "wsi.lmdb", chunks=(512, 512), max_pixels="2G")  # TIFFs read tile by tile

    fastdata.convert("scans/", "ct.lmdb", chunks=(64, 64, 64), codec="blosc-zstd")  # smaller, slower to read
    ds = fastdata.open_dataset("ct.lmdb"); ds[0]["image"][0:64, 0:64, 0:64]   # reads only 1 chunk

**NIfTI sources** (nibabel, the ``volumes`` extra: ``pip install 'fastdata[volumes]'``):

* a folder of ``.nii``/``.nii.gz`` files (any case; NIfTI-1 or -2, not ``.hdr``/``.img``
  pairs). Its subfolders that hold volumes (searched recursively, in sorted order, as
  ImageFolder walks) are classes: each sample gets ``label``, the class index (classes sorted
  by name; the manifest's ``classes``). Without such subfolders the folder's own files are
  the samples (not recursive), without a label. Volumes directly in a folder that also has
  class folders are skipped with a warning. A folder is taken as NIfTI when, of its first
  100 NIfTI or image files (walked top-down, sorted), NIfTI files are at least half.
* a list file: CSV/TSV with a header row, or JSONL (one object per line). Its ``image``
  column (or ``path``) names a volume, relative to the list's folder or absolute. A
  ``label`` column either names a label (segmentation) volume per row, when its values are
  NIfTI paths, or holds class names/integers, as in ``path,label`` lists (integers are the
  class index itself, names are numbered in sorted order). Every other column is kept as a
  field of its name: CSV cells as ``int`` when every cell is an integer, ``float`` when every
  cell is a number, else ``string``; JSONL values as bool/int/float/string when every row has
  that kind, else ``json`` (a missing key is then ``None``). Rows the list cannot describe
  (no image, an empty label cell) are all reported at once, with line numbers.
* a Medical Segmentation Decathlon ``dataset.json``: its ``"training"`` entries
  (``{"image": ..., "label": ...}``, relative to the file's folder); the other top-level
  entries (name, modality, labels, ...) are kept in the manifest's ``metadata["decathlon"]``.
  The ``"test"`` images (no labels) are not converted: list them in a CSV to convert them.

Each sample holds

* ``image``: ``Chunked`` of the volume as nibabel orders it (``img.shape``: x, y, z[, t, ...]),
  in its **stored** dtype, unscaled: the raw values of the file, bit-exact, never the
  ``get_fdata()`` floats. The physical values are ``raw * scl_slope + scl_inter``; both are
  fields (``float``, nibabel's effective values: 1 and 0 when the header sets none), so
  ``ds[i]["image"][...] * ds[i]["scl_slope"] + ds[i]["scl_inter"]`` is ``img.get_fdata()``.
  The store's dtype is the one every volume's stored dtype casts to exactly
  (``numpy.result_type``; int16 and uint8 volumes make an int16 store).
* ``label`` when the source has one: the label volume (``Chunked``, its own stored dtype,
  unscaled), or the class index (``int``);
* ``affine``: ``img.affine`` (``ndarray`` float64 (4, 4): voxel indices to world mm);
* ``spacing``: the voxel sizes of the spatial axes (``header.get_zooms()[:3]``, float64);
* ``scl_slope``, ``scl_inter``; the list's other columns;
* the record's ``path``: the volume's path relative to the source folder (as in the list):
  ``ds.relpath(i)``, which ``PatchDataset(output="monai")`` puts in each MetaTensor's
  ``filename_or_obj``. It is the record's, not a field: stores of every version have it.

Chunks: ``chunks=(48, 48, 48)`` (the default for 3-D volumes, chosen for 96^3 patches:
:data:`~fastdata.writer.sources.volumes.nifti.VOLUME_CHUNK`; 256,256 for 2-D ones); axes beyond
the ones given are chunked by 1 (a 4-D volume's 4th axis: one time point per chunk). A label
volume is chunked like its image on the spatial axes, so a patch of both reads the same chunks.
All volumes of a store have the number of axes most of them have (the others are rejected).

Reading, in the worker processes (the samples are map-style: each worker opens its volumes):

* ``.nii``: slab by slab (64 x-planes at a time, see :mod:`fastdata.writer.chunking`) through a
  nibabel ``ArrayProxy`` with scaling 1/0 (the raw values), which reads each slab with seeks
  and reads (nibabel's ``fileslice``; NIfTI voxels are in Fortran order, so each slab's bytes are
  spread over the whole file, read from the page cache); a worker holds one slab, whatever the
  volume's size.
* ``.nii.gz``: a gzip stream cannot seek, so each slab read through ``dataobj`` decompresses the
  file again from its start (measured on a 256x256x160 int16 volume: 1.25 s for its 4 slabs
  against 0.22 s for one whole read; a 512-wide CT has 8 slabs). A ``.nii.gz`` is therefore
  decompressed **once, whole, into the worker's memory** (its raw values, as
  ``dataobj.get_unscaled()`` gives them;
  :func:`~fastdata.writer.sources.volumes.nifti.read_gzip_values`): a worker holds one decoded
  volume (512x512x300 int16: 150 MB), decompressed 16 MiB at a time straight into its array
  (nibabel's whole read goes through a bytes object of the volume's size first: twice the
  memory; measured on a 512x512x200 int16 volume, 100 MB: worker peak RSS 253 MB through
  nibabel, 171 MB this way, against 93 MB for the same volume as ``.nii``). For volumes too
  large for that times the workers, ``gunzip`` them first (``.nii`` is read slab by slab) or
  pass fewer ``workers``.

Bad inputs: a file nibabel cannot read (not NIfTI, truncated, corrupt gzip), a label volume
whose shape differs from its image's on the spatial axes (both files are named), a volume of
another number of axes or of a dtype the store's does not hold exactly, are rejected
(``rejected.tsv``, the summary) or, with ``strict=True``, stop the run naming the file.

**TIFF images** (tifffile, the ``images`` extra; zarr is not needed): a folder of TIFF files
(``.tif``, ``.tiff``, ``.svs``, ...; class subfolders give ``label`` as for NIfTI) converted with
``chunks=H,W`` and/or ``max_pixels=N``: each image becomes ``image``, ``Chunked`` of shape
(H, W, C), or (H, W) when every image has one band (a one-band image in a store of colour ones
is (H, W, 1)). Chunks default to 512x512 (all bands in each chunk). An image is read tile by
tile (or strip by strip) with tifffile's own segment reader and decoder
(``FileHandle.read_segments`` over the page's ``dataoffsets``, ``TiffPage.decode``): for each
slab of chunk rows, only the tiles that slab touches are read and decoded, one at a time, into
the slab; a worker holds one slab (512 rows x width x bands) plus one tile, never the image
(measured: 8000x8000x3 uint8, 256x256 tiles, zlib: the worker's peak RSS grew by about 30 MB
over its baseline while the image decodes to 192 MB). The first page is stored (a pyramid's
full-resolution level; its reduced levels, thumbnails and label images are not); a multi-page
stack of same-sized pages is rejected.

Such images are what the decompression-bomb limit (:func:`fastdata.common.imageio.pixel_limit`)
refuses when converted as ordinary images; it still holds here, per image, on the pixel
count (H x W), unless ``max_pixels`` gives another limit explicitly (``2G`` = 2,000,000,000
pixels). An image over the limit is rejected with a reason naming ``max_pixels``. Tiles or
strips that decode to more than 256 MiB each (a one-strip image) are rejected: they cannot be
read piece by piece.

The modules, from the files to the write source:

- :mod:`~fastdata.writer.sources.volumes.common`: what the NIfTI and TIFF readers share (optional
  imports, chunk shapes, an opened sample).
- :mod:`~fastdata.writer.sources.volumes.scan`: folders, volume lists and Decathlon ``dataset.json``
  as a :class:`~fastdata.writer.sources.volumes.scan.FileScan`; the detection of a NIfTI source.
- :mod:`~fastdata.writer.sources.volumes.nifti`: NIfTI files read through nibabel; a NIfTI store's
  layout, schema and samples.
- :mod:`~fastdata.writer.sources.volumes.tiff`: TIFF images read tile by tile; a TIFF store's layout
  and samples.
- :mod:`~fastdata.writer.sources.volumes.input`: the write sources
  (:func:`~fastdata.writer.sources.volumes.input.chunked_input`) and the worker entry points.
"""
