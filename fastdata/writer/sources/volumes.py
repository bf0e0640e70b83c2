"""NIfTI volumes and large TIFF images as chunked samples (``fastdata convert`` of a NIfTI
folder, a volume list or a Decathlon ``dataset.json``; ``--chunks``/``--max-pixels`` for a
folder of TIFF images): general (layout version 2) stores whose arrays are
:class:`~fastdata.format.fields.Chunked` fields, read region by region afterwards
(``fastdata.open_dataset(dst)[i]["image"][10:74, ...]``, :class:`fastdata.PatchDataset`).

Usage::

    fastdata convert scans/ ct.lmdb                       # a folder of .nii/.nii.gz files
    fastdata convert train.csv seg.h5 --chunks 96,96,96   # rows image,label (label volumes), other columns kept
    fastdata convert Task02_Heart/dataset.json heart.lmdb # Medical Segmentation Decathlon: its "training" list
    fastdata convert slides/ wsi.lmdb --chunks 512,512 --max-pixels 2G   # TIFFs read tile by tile

    fastdata.convert("scans/", "ct.lmdb", chunks=(64, 64, 64), codec="blosc-zstd")
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
* the record's ``path``: the volume's path relative to the source folder (as in the list).

Chunks: ``--chunks 64,64,64`` (the default for 3-D volumes; 256,256 for 2-D ones); axes beyond
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
  ``dataobj.get_unscaled()`` gives them; :func:`read_gzip_values`): a worker
  holds one decoded volume (512x512x300 int16: 150 MB), decompressed 16 MiB at a time straight
  into its array (nibabel's whole read goes through a bytes object of the volume's size first:
  twice the memory; measured on a 512x512x200 int16 volume, 100 MB: worker peak RSS 253 MB
  through nibabel, 171 MB this way, against 93 MB for the same volume as ``.nii``). For
  volumes too large for that times the workers, ``gunzip`` them first (``.nii`` is read slab by
  slab) or pass fewer ``--workers``.

Bad inputs: a file nibabel cannot read (not NIfTI, truncated, corrupt gzip), a label volume
whose shape differs from its image's on the spatial axes (both files are named), a volume of
another number of axes or of a dtype the store's does not hold exactly, are rejected
(``rejected.tsv``, the summary) or, with ``--strict``, stop the run naming the file.

**TIFF images** (tifffile, the ``images`` extra; zarr is not needed): a folder of TIFF files
(``.tif``, ``.tiff``, ``.svs``, ...; class subfolders give ``label`` as for NIfTI) converted with
``--chunks H,W`` and/or ``--max-pixels N``: each image becomes ``image``, ``Chunked`` of shape
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
count (H x W), unless ``--max-pixels`` gives another limit explicitly (``2G`` = 2,000,000,000
pixels). An image over the limit is rejected with a reason naming ``--max-pixels``. Tiles or
strips that decode to more than 256 MiB each (a one-strip image) are rejected: they cannot be
read piece by piece.
"""

from __future__ import annotations

import csv
import gzip
import importlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

from fastdata.common.extensions import IMG_EXTENSIONS
from fastdata.common.imageio import pixel_limit
from fastdata.common.units import parse_size
from fastdata.errors import MissingExtraError, RejectedInputError, SourceError
from fastdata.format.chunk_codecs import DEFAULT_CODEC
from fastdata.format.fields import (
    JSON,
    RESERVED_NAMES,
    Chunked,
    Field,
    Float,
    Int,
    NDArray,
    Schema,
    SchemaError,
    String,
)
from fastdata.format.manifest import CLASS_TABLES_KEY, canonical_json
from fastdata.format.record import FIELD_PREFIX, EncodedSample, SampleIndex, encode_sample
from fastdata.format.store_index import decode_shard_index
from fastdata.writer.chunking import write_chunks
from fastdata.writer.ingest import spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import ShardResult, shard_index_bytes, staging_path
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.folder import MAX_INTEGER_LABEL, MAX_ROW_ERRORS, find_classes
from fastdata.writer.sources.python import MapInput, MapSource

__all__ = ["BOMB_HINT", "NIFTI_SUFFIXES", "TIFF_SUFFIXES", "TiffImageInput", "VolumeInput", "chunked_input",
           "is_volume_source", "parse_chunks", "parse_max_pixels"]

NIFTI_SUFFIXES = (".nii", ".nii.gz")
#: TIFF-based file names a ``--chunks`` image folder takes (other images there are rejected)
TIFF_SUFFIXES = (".tif", ".tiff", ".svs", ".btf", ".tf2", ".tf8", ".ndpi", ".scn")
LIST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")
#: chunk side of the spatial axes of a 3-D (or more) volume, and of a 2-D one
VOLUME_CHUNK, PLANE_CHUNK = 64, 256
#: chunk sides (rows, columns) of a TIFF image
IMAGE_CHUNKS = (512, 512)
#: the fields a volume source makes itself (a list's other columns must be named otherwise)
OWN_FIELDS = ("image", "label", "affine", "spacing", "scl_slope", "scl_inter")
#: most bytes one decoded TIFF tile or strip may take (one is in memory at a time)
MAX_SEGMENT_BYTES = 256 << 20
#: bytes tifffile reads from the file at once while gathering a slab's tiles
READ_BUFFER_BYTES = 16 << 20
#: what a refusal by the decompression-bomb limit of an ordinary image conversion adds
BOMB_HINT = ("to store large TIFF images (whole slides, satellite scenes) as chunked arrays read tile by tile, "
             "convert their folder with --chunks 512,512 and --max-pixels N (e.g. 2G; chunks=, max_pixels= in "
             "Python)")
#: list columns (compared lower-case) that name the image volume, in order of preference
IMAGE_COLUMNS = ("image", "path")
LABEL_COLUMN = "label"
_INTEGER = re.compile(r"-?[0-9]+")
_INSTALL = {"nibabel": "pip install 'fastdata[volumes]'", "tifffile": "pip install 'fastdata[images]'",
            "imagecodecs": "pip install 'fastdata[images]'"}


def _require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs {module}, which is not installed: {_INSTALL[module]}") from None


def _at(name: str) -> str:
    """``"name: "``, or nothing for an empty name (the input itself: rejected.tsv names it)."""
    return f"{name}: " if name else ""


def is_nifti(name: str | bytes) -> bool:
    """True when ``name`` ends with ``.nii`` or ``.nii.gz`` (any case)."""
    return os.fsdecode(name).lower().endswith(NIFTI_SUFFIXES)


# --------------------------------------------------------------------------- options


def parse_chunks(spec: str | Sequence[int]) -> tuple[int, ...]:
    """``"64,64,64"`` or ``(64, 64, 64)`` -> the chunk sides, checked (positive integers).

    Raises:
        ValueError: naming ``--chunks`` and the bad entry.
    """
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    sides = []
    for p in parts:
        if isinstance(p, str) and p.isascii() and p.isdigit():
            sides.append(int(p))
        elif isinstance(p, int | np.integer) and not isinstance(p, bool):
            sides.append(int(p))
        else:
            sides.append(0)
    if not sides or any(s <= 0 for s in sides):
        raise ValueError(f"--chunks takes positive integers separated by commas (e.g. 64,64,64 or 512,512), "
                         f"got {spec!r}")
    return tuple(sides)


def parse_max_pixels(spec: int | str) -> int:
    """``"2G"``, ``"500M"``, ``400000000`` -> a pixel count (k/M/G decimal, as sizes are).

    Raises:
        ValueError: naming ``--max-pixels``.
    """
    try:
        return parse_size(spec)
    except ValueError:
        raise ValueError(f"--max-pixels takes a pixel count such as 2G (2,000,000,000), 500M or 400000000, "
                         f"got {spec!r}") from None


def _chunks_for(ndim: int, given: tuple[int, ...] | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    """The chunk shape of ``ndim``-axis values: ``given`` (or ``default``), extended by 1 on the
    axes after those given."""
    sides = given if given is not None else default[:ndim]
    if len(sides) > ndim:
        raise ValueError(f"--chunks {','.join(map(str, sides))} names {len(sides)} sides, but the {what} have "
                         f"{ndim} axes")
    return tuple(sides) + (1,) * (ndim - len(sides))


def _chunked(dtype: np.dtype, chunks: tuple[int, ...], codec: str | None) -> Chunked:
    try:
        return Chunked(dtype, chunks, codec=codec)
    except SchemaError as err:
        raise ValueError(f"--chunks/--codec: {err}") from None


# --------------------------------------------------------------------------- scanning


@dataclass
class FileScan:
    """What a volume or image source lists: per sample the file (``paths`` absolute, ``relpaths``
    as recorded), an optional label volume (``label_paths``/``label_relpaths``, None without), an
    optional class index (``labels``, with ``classes``), other fields (``extras``: name ->
    (field, one value per sample)); ``problems`` are ``(path, warning)`` pairs to report."""

    root: str
    paths: list[bytes]
    relpaths: list[bytes]
    classes: list[str] = field(default_factory=list)
    labels: list[int] | None = None
    label_paths: list[bytes] | None = None
    label_relpaths: list[bytes] | None = None
    extras: dict[str, tuple[Field, list]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: True when the source is a folder (a destination inside it is refused)
    is_folder: bool = False

    def __len__(self) -> int:
        return len(self.paths)


def _walk(folder: str, suffixes: tuple[str, ...], problems: list[tuple[str, str]]) -> list[str]:
    """Files under ``folder`` whose names end with ``suffixes`` (any case), in ImageFolder's
    order (sorted walk, directory symlinks followed, each real directory walked once)."""
    seen: set[tuple[int, int]] = set()
    entries = []

    def onerror(err: OSError) -> None:
        problems.append((str(err.filename), f"cannot list directory: {err.strerror}"))

    for root, dirs, files in os.walk(folder, followlinks=True, onerror=onerror):
        try:
            st = os.stat(root)
        except OSError as err:
            problems.append((root, f"cannot stat directory: {err.strerror}"))
            dirs[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            problems.append((root, "directory symlink loop: already walked, skipped"))
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        entries.append((root, files))
    return [os.path.join(root, name) for root, files in sorted(entries) for name in sorted(files)
            if name.lower().endswith(suffixes)]


def scan_file_folder(root: str, suffixes: tuple[str, ...], what: str) -> FileScan:
    """The files of folder ``root`` whose names end with ``suffixes``: class subfolders (those
    holding such files, searched recursively) give class labels; without any, the folder's own
    files are the samples, unlabeled (rules: the module docstring).

    Raises:
        SourceError: ``root`` is missing or holds no such file.
    """
    root = os.path.abspath(root)
    problems: list[tuple[str, str]] = []
    found = {c: _walk(os.path.join(root, c), suffixes, problems) for c in find_classes(root)}
    classes = [c for c, files in found.items() if files]
    try:
        top = sorted(n for n in os.listdir(root) if n.lower().endswith(suffixes)
                     and os.path.isfile(os.path.join(root, n)))
    except OSError as err:
        raise SourceError(f"cannot list source folder {root}: {err.strerror}") from None
    prefix = os.path.join(root, "")
    if classes:
        files = [(path, label) for label, c in enumerate(classes) for path in found[c]]
        if top:
            problems.append((root, f"{len(top)} {what} file(s) directly in the folder are not in a class folder "
                                   f"({', '.join(top[:5])}{' ...' if len(top) > 5 else ''}): skipped, as "
                                   "ImageFolder does"))
        empty = [c for c in found if not found[c]]
        if empty:
            problems.append((root, f"subfolder(s) holding no {what} file: {', '.join(empty[:20])}: not classes"))
    else:
        files = [(os.path.join(root, n), -1) for n in top]
    if not files:
        raise SourceError(f"{root}: no {what} files found ({', '.join(suffixes)}, any case) in the folder or its "
                          "class subfolders")
    if os.path.isfile(os.path.join(root, "dataset.json")) and suffixes == NIFTI_SUFFIXES:
        problems.append((root, "the folder holds a dataset.json: convert SRC/dataset.json to pair each image with "
                               "its label volume (a Decathlon task)"))
    return FileScan(root=root, paths=[os.fsencode(p) for p, _ in files],
                    relpaths=[os.fsencode(p[len(prefix):]) for p, _ in files], classes=classes if classes else [],
                    labels=[label for _, label in files] if classes else None, problems=problems, is_folder=True)


def _list_rows(list_file: str) -> tuple[list[str], list[tuple[int, dict[str, Any] | str]], bool]:
    """``(keys in order, [(line, {key: value} or what is wrong with the row)], from_text)`` of a
    CSV/TSV (header row) or JSONL list.

    Raises:
        SourceError: the file is missing, a JSONL line is not an object, or the header repeats a name.
    """
    rows: list[tuple[int, dict[str, Any] | str]] = []
    keys: list[str] = []
    try:
        fh = open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape")
    except FileNotFoundError:
        raise SourceError(f"list file not found: {list_file}") from None
    except OSError as err:
        raise SourceError(f"cannot read list file {list_file}: {err.strerror}") from None
    with fh:
        if list_file.lower().endswith((".jsonl", ".ndjson")):
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise SourceError(f"{list_file}:{lineno}: not a JSON object ({err.msg})") from None
                if not isinstance(obj, dict):
                    raise SourceError(f"{list_file}:{lineno}: expected a JSON object per line, got "
                                      f"{type(obj).__name__}")
                keys.extend(k for k in obj if k not in keys)
                rows.append((lineno, obj))
            return keys, rows, False
        reader = csv.reader(fh, delimiter="\t" if list_file.lower().endswith(".tsv") else ",")
        try:
            for row in reader:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if not keys:
                    keys = [c.strip() for c in row]
                    if len(set(keys)) != len(keys):
                        raise SourceError(f"{list_file}:{reader.line_num}: the header names a column twice")
                    if is_nifti(keys[0]):
                        raise SourceError(f"{list_file}: a volume list needs a header row naming its columns "
                                          "(e.g. image,label); its first line names a file")
                    continue
                if len(row) != len(keys):
                    rows.append((reader.line_num, f"expected {len(keys)} columns, got {len(row)}"))
                    continue
                rows.append((reader.line_num, {k: v.strip() for k, v in zip(keys, row, strict=True)}))
        except csv.Error as err:
            raise SourceError(f"{list_file}:{reader.line_num}: {err}; fix that line") from None
    return keys, rows, True


def _column(keys: list[str], names: Sequence[str]) -> str | None:
    lower = {k.lower(): k for k in keys}
    return next((lower[n] for n in names if n in lower), None)


def _extra_field(name: str, values: list, from_text: bool) -> tuple[Field, list]:
    """The field of a list's other column and its values (rules: the module docstring)."""
    if from_text:
        if values and all(_INTEGER.fullmatch(v) for v in values):
            return Int(), [int(v) for v in values]
        try:
            numbers = [float(v) for v in values]
            return Float(allow_nan=any(math.isnan(v) for v in numbers)), numbers
        except ValueError:
            return String(), values
    if all(isinstance(v, bool) for v in values):
        return Int("bool"), values
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return Int(), values
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return Float(allow_nan=any(math.isnan(v) for v in values)), [float(v) for v in values]
    if all(isinstance(v, str) for v in values):
        return String(), values
    return JSON(), values


def _class_labels(texts: list[str]) -> tuple[list[str], list[int]]:
    """Classes and indices of a class column (the rule of ``path,label`` lists)."""
    if all(t.isascii() and t.isdigit() for t in texts):
        targets = [int(t) for t in texts]
        if max(targets) >= MAX_INTEGER_LABEL:
            raise ValueError(f"integer label {max(targets)} is taken as a class index and would make too many "
                             "classes; renumber the labels from 0, or use class names")
        return [str(i) for i in range(max(targets) + 1)], targets
    classes = sorted(set(texts))
    index = {c: i for i, c in enumerate(classes)}
    return classes, [index[t] for t in texts]


def _entries_scan(where: str, root: str, entries: Sequence[tuple[int, dict[str, Any] | str]], keys: list[str],
                  from_text: bool, line_word: str = "line") -> FileScan:
    """A :class:`FileScan` of list entries (``(line or entry number, {key: value})``), every bad
    entry reported at once in one :class:`SourceError`."""
    image_key = _column(keys, IMAGE_COLUMNS)
    if image_key is None:
        raise SourceError(f"{where}: no image column (expected one named {' or '.join(IMAGE_COLUMNS)}; "
                          f"found {', '.join(keys) or 'none'})")
    label_key = _column(keys, (LABEL_COLUMN,))
    bad: list[str] = []
    kept: list[tuple[int, dict[str, Any]]] = []
    for lineno, row in entries:
        problem = row if isinstance(row, str) else None
        if isinstance(row, dict):
            image = row.get(image_key)
            if not isinstance(image, str) or not image.strip():
                problem = f"no {image_key!r} path"
            elif label_key is not None and not (isinstance(row.get(label_key), str | int)
                                                and str(row.get(label_key)).strip()):
                problem = f"empty {label_key!r}: every row of a list with a {label_key!r} column needs one"
        if problem is not None or not isinstance(row, dict):
            bad.append(f"{line_word} {lineno}: {problem}")
        else:
            kept.append((lineno, row))
    if not bad and not kept:
        raise SourceError(f"{where}: the list names no volumes")
    segmentation = False
    if label_key is not None and kept:
        kinds = {is_nifti(str(row[label_key])) for _, row in kept}
        if len(kinds) > 1:
            first = next(n for n, row in kept if is_nifti(str(row[label_key])) != is_nifti(str(kept[0][1][label_key])))
            bad.append(f"{line_word} {first}: {label_key!r} mixes NIfTI paths (label volumes) and class labels")
        segmentation = kinds == {True}
    if bad:
        shown = "; ".join(bad[:MAX_ROW_ERRORS]) + (f"; ... and {len(bad) - MAX_ROW_ERRORS} more"
                                                   if len(bad) > MAX_ROW_ERRORS else "")
        raise SourceError(f"{where}: {len(bad)} bad row(s) (fix them all, then convert again): {shown}")

    def located(text: str) -> tuple[bytes, bytes]:
        text = text.strip()
        return os.fsencode(text if os.path.isabs(text) else os.path.join(root, text)), \
            os.fsencode(os.path.normpath(text))

    images = [located(str(row[image_key])) for _, row in kept]
    scan = FileScan(root=root, paths=[p for p, _ in images], relpaths=[r for _, r in images])
    if label_key is not None and segmentation:
        labels = [located(str(row[label_key])) for _, row in kept]
        scan.label_paths, scan.label_relpaths = [p for p, _ in labels], [r for _, r in labels]
    elif label_key is not None:
        try:
            scan.classes, scan.labels = _class_labels([str(row[label_key]).strip() for _, row in kept])
        except ValueError as err:
            raise SourceError(f"{where}: {err}") from None
    for key in keys:
        if key in (image_key, label_key):
            continue
        if key in OWN_FIELDS or key in RESERVED_NAMES or not key.isidentifier():
            raise SourceError(f"{where}: column {key!r} cannot be a field: rename it (fields are identifiers, not "
                              f"one of {', '.join(OWN_FIELDS + tuple(sorted(RESERVED_NAMES)))}, which a volume "
                              "store uses itself)")
        scan.extras[key] = _extra_field(key, [row.get(key) for _, row in kept], from_text)
    if scan.extras:
        try:
            Schema(tuple((name, f) for name, (f, _) in scan.extras.items()))
        except SchemaError as err:
            raise SourceError(f"{where}: {err}") from None
    return scan


def scan_volume_list(list_file: str) -> FileScan:
    """A CSV/TSV (header row) or JSONL list of volumes (rules: the module docstring).

    Raises:
        SourceError: the file is missing, names no image column, or has bad rows (all listed).
    """
    list_file = os.path.abspath(list_file)
    keys, rows, from_text = _list_rows(list_file)
    return _entries_scan(list_file, os.path.dirname(list_file), rows, keys, from_text)


def scan_decathlon(json_file: str) -> FileScan:
    """A Medical Segmentation Decathlon ``dataset.json``: its ``"training"`` image/label pairs.

    Raises:
        SourceError: the file is not such a JSON object, or an entry lacks its image or label.
    """
    json_file = os.path.abspath(json_file)
    body = _decathlon_body(json_file)
    if body is None:
        raise SourceError(f"{json_file}: not a Decathlon dataset.json (a JSON object with a \"training\" list of "
                          "{\"image\": ..., \"label\": ...} entries)")
    entries = body["training"]
    if not entries:
        raise SourceError(f"{json_file}: its \"training\" list is empty")
    if not all(isinstance(e, dict) for e in entries):
        raise SourceError(f"{json_file}: every \"training\" entry must be an object with image and label paths")
    keys: list[str] = []
    for e in entries:
        keys.extend(k for k in e if k not in keys)
    scan = _entries_scan(json_file, os.path.dirname(json_file), list(enumerate(entries)), keys, False,
                         line_word="training entry")
    scan.metadata = {"decathlon": {k: v for k, v in body.items() if k not in ("training", "test")}}
    return scan


def _decathlon_body(json_file: str) -> dict | None:
    """The JSON object of ``json_file`` when it has a ``"training"`` list, else None."""
    try:
        with open(json_file, encoding="utf-8") as fh:
            body = json.load(fh)
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("training"), list) else None


def _first_kind(root: str, look: int = 100) -> str | None:
    """``"nifti"`` when, among the first ``look`` NIfTI or image files under ``root`` (walked
    top-down, sorted), NIfTI files are at least as many as images; ``"image"`` when images are
    more; None when there are neither (a preview PNG beside the volumes does not make an image folder)."""
    counts: Counter[str] = Counter()
    for _dirpath, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            kind = "nifti" if is_nifti(name) else "image" if name.lower().endswith(IMG_EXTENSIONS) else None
            if kind is not None:
                counts[kind] += 1
        if sum(counts.values()) >= look:
            break
    if not counts:
        return None
    return "nifti" if counts["nifti"] >= counts["image"] else "image"


def _is_volume_list(src: str) -> bool:
    """A CSV/TSV/JSONL list whose first row's image column names a NIfTI file."""
    try:
        if src.lower().endswith((".jsonl", ".ndjson")):
            with open(src, encoding="utf-8-sig", errors="replace") as fh:
                line = next((ln for ln in fh if ln.strip()), "")
            obj = json.loads(line) if line else None
            if not isinstance(obj, dict):
                return False
            key = _column(list(obj), IMAGE_COLUMNS)
            return key is not None and isinstance(obj[key], str) and is_nifti(obj[key])
        with open(src, newline="", encoding="utf-8-sig", errors="replace") as fh:
            reader = csv.reader(fh, delimiter="\t" if src.lower().endswith(".tsv") else ",")
            rows = [r for r in (next(reader, None), next(reader, None)) if r]
    except (OSError, ValueError, csv.Error):
        return False
    if not rows:
        return False
    if is_nifti(rows[0][0].strip()):
        return True  # (no header: the scan says that it needs one)
    key = _column([c.strip() for c in rows[0]], IMAGE_COLUMNS)
    if key is None or len(rows) < 2:
        return False
    header = [c.strip() for c in rows[0]]
    cells = dict(zip(header, (c.strip() for c in rows[1]), strict=False))
    return is_nifti(cells.get(key, ""))


def is_volume_source(src: str) -> bool:
    """Whether ``src`` is a NIfTI source: a folder whose first folder with files holds NIfTI
    files, a CSV/TSV/JSONL list whose first row names a ``.nii``/``.nii.gz`` image, or a
    Decathlon ``dataset.json``."""
    if os.path.isdir(src):
        return _first_kind(src) == "nifti"
    if not os.path.isfile(src):
        return False
    lower = src.lower()
    if lower.endswith(".json"):
        return _decathlon_body(src) is not None
    return lower.endswith(LIST_SUFFIXES) and _is_volume_list(src)


# --------------------------------------------------------------------------- NIfTI files


def _nibabel() -> ModuleType:
    return _require("nibabel", "reading NIfTI volumes")


class _Opened:
    """A sample's values with the files they read from, closed by :meth:`close`."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.closers: list[Any] = []

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - closing a file that failed to read
                pass


class NiftiRegions:
    """The raw (unscaled) values of an uncompressed ``.nii``, read region by region through a
    nibabel ``ArrayProxy`` of scaling 1/0; a read error is a :class:`RejectedInputError`."""

    def __init__(self, proxy: Any, dtype: np.dtype, name: str):
        self.proxy, self.name = proxy, name
        self.shape = tuple(int(s) for s in proxy.shape)
        self.dtype = dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        try:
            block = np.asarray(self.proxy[key])
        except Exception as err:  # noqa: BLE001 - nibabel raises OSError, ValueError, EOFError, ...
            raise RejectedInputError(f"{_at(self.name)}truncated or corrupt NIfTI data ({type(err).__name__}: "
                                     f"{err})") from None
        return block if block.dtype.isnative else block.astype(block.dtype.newbyteorder("="))


class WholeVolume:
    """A ``.nii.gz``'s raw values, decompressed whole on the first read (see the module
    docstring: a gzip stream read slab by slab is decompressed again for every slab)."""

    def __init__(self, path: str, image: Any, dtype: np.dtype, name: str):
        self.path, self.image, self.name = path, image, name
        self.shape = tuple(int(s) for s in image.shape)
        self.dtype = dtype
        self.data: np.ndarray | None = None

    def __getitem__(self, key: Any) -> np.ndarray:
        if self.data is None:
            try:
                self.data = read_gzip_values(self.path, int(self.image.dataobj.offset), self.shape,
                                             np.dtype(self.image.get_data_dtype()))
            except Exception as err:  # noqa: BLE001 - gzip, zlib and nibabel errors of a damaged file
                raise RejectedInputError(f"{_at(self.name)}truncated or corrupt NIfTI data ({type(err).__name__}: "
                                         f"{err})") from None
        return self.data[key]

    def close(self) -> None:
        self.data = None


#: bytes decompressed at once into a ``.nii.gz``'s array (gzip's own ``read`` of the whole file
#: would first make a bytes object as large as the volume, then copy it: twice the memory)
GZIP_PIECE_BYTES = 16 << 20


def read_gzip_values(path: str, offset: int, shape: tuple[int, ...], stored: np.dtype) -> np.ndarray:
    """The voxels of a ``.nii.gz`` (Fortran order, from byte ``offset`` of the decompressed stream),
    decompressed piece by piece straight into one array of the native byte order: the volume's
    size in memory, and no more.

    Raises:
        EOFError: the stream ends before the voxels do; gzip/zlib errors for a damaged stream.
    """
    out = np.empty(math.prod(shape) * stored.itemsize, dtype=np.uint8)
    view = memoryview(out.data)
    with gzip.open(path, "rb") as fh:
        skip = offset
        while skip > 0:
            header = fh.read(min(skip, GZIP_PIECE_BYTES))
            if not header:
                raise EOFError("the file ends inside its header")
            skip -= len(header)
        done = 0
        while done < len(out):
            got = fh.readinto(view[done:done + GZIP_PIECE_BYTES])
            if not got:
                raise EOFError(f"the file ends after {done:,} of its {len(out):,} bytes of voxels")
            done += got
    values = out.view(stored)
    if not stored.isnative:
        values = values.byteswap(inplace=True).view(stored.newbyteorder("="))
    return values.reshape(shape, order="F")


def _native(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def nifti_header(path: bytes, name: str) -> tuple[Any, tuple[int, ...], np.dtype]:
    """``(image, shape, stored dtype)`` of the NIfTI file at ``path`` (its header only).

    Raises:
        RejectedInputError: not a NIfTI-1/2 file nibabel reads, or of a non-numeric dtype (``name`` first).
    """
    nib = _nibabel()
    try:
        image = nib.load(os.fsdecode(path))
    except FileNotFoundError:
        raise RejectedInputError(f"{_at(name)}file not found") from None
    except Exception as err:  # noqa: BLE001 - ImageFileError, OSError, EOFError, struct errors, ...
        raise RejectedInputError(f"{_at(name)}not a readable NIfTI file ({type(err).__name__}: {err})") from None
    if not isinstance(image, nib.Nifti1Image | nib.Nifti2Image) or not nib.is_proxy(image.dataobj):
        raise RejectedInputError(f"{_at(name)}not a NIfTI-1/2 image (nibabel read it as {type(image).__name__})")
    try:
        dtype = np.dtype(image.get_data_dtype())
        shape = tuple(int(s) for s in image.shape)
    except Exception as err:  # noqa: BLE001
        raise RejectedInputError(f"{_at(name)}unusable NIfTI header ({type(err).__name__}: {err})") from None
    if dtype.kind not in "biuf":
        raise RejectedInputError(f"{_at(name)}NIfTI data type {dtype} is not a numeric type fastdata stores "
                                 "(RGB and complex volumes are not supported)")
    if not shape or 0 in shape:
        raise RejectedInputError(f"{_at(name)}NIfTI volume of shape {shape} holds no voxel")
    return image, shape, dtype


def _nifti_values(path: bytes, name: str, dtype: np.dtype, opened: _Opened) -> tuple[Any, Any, tuple[int, ...]]:
    """``(image, array-like of its raw values, shape)`` of a NIfTI file, whose stored dtype must cast
    to ``dtype`` exactly."""
    image, shape, stored = nifti_header(path, name)
    if stored != dtype and not np.can_cast(_native(stored), dtype, "safe"):
        raise RejectedInputError(f"{_at(name)}stored dtype {stored} does not fit the store's {dtype} exactly "
                                 "(it was chosen from the other volumes: convert this one separately)")
    if os.fsdecode(path).lower().endswith(".gz"):
        whole = WholeVolume(os.fsdecode(path), image, dtype, name)
        opened.closers.append(whole.close)
        return image, whole, shape
    from nibabel.arrayproxy import ArrayProxy

    proxy = ArrayProxy(os.fsdecode(path), (shape, stored, int(image.dataobj.offset), 1.0, 0.0))
    return image, NiftiRegions(proxy, dtype, name), shape


@dataclass(frozen=True)
class VolumeLayout:
    """What every volume of a store shares: axes, dtype and chunks of ``image`` and ``label``."""

    ndim: int
    dtype: np.dtype
    chunks: tuple[int, ...]
    label_ndim: int | None = None
    label_dtype: np.dtype | None = None
    label_chunks: tuple[int, ...] | None = None

    @property
    def spatial(self) -> int:
        return min(3, self.ndim)


def _common(shapes_dtypes: list[tuple[tuple[int, ...], np.dtype]]) -> tuple[int, np.dtype]:
    """The most common number of axes (ties: the fewest) and the dtype all of those cast to exactly."""
    counts = Counter(len(s) for s, _ in shapes_dtypes)
    ndim = min(counts, key=lambda n: (-counts[n], n))
    dtype = np.result_type(*(_native(d) for s, d in shapes_dtypes if len(s) == ndim))
    return ndim, _native(dtype)


class VolumeSamples:
    """The samples of a NIfTI source: ``open(i)`` reads volume ``i``'s header (and its label's),
    checks them against the store's :class:`VolumeLayout` and returns array-likes the chunk writer
    reads slab by slab (in whichever process calls it: the converter's workers)."""

    def __init__(self, scan: FileScan, layout: VolumeLayout):
        self.scan, self.layout = scan, layout

    def __len__(self) -> int:
        return len(self.scan)

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.scan.relpaths[i])

    def input_path(self, i: int) -> str:
        return os.fsdecode(self.scan.paths[i])

    def relpath(self, i: int) -> bytes:
        return self.scan.relpaths[i]

    def input_bytes(self, i: int) -> int:
        paths = [self.scan.paths[i]] + ([self.scan.label_paths[i]] if self.scan.label_paths else [])
        return sum(os.stat(p).st_size for p in paths if os.path.isfile(p))

    def open(self, i: int) -> _Opened:
        """Sample ``i``'s values (see the module docstring for the fields).

        Raises:
            RejectedInputError: a file is unreadable, or does not fit the layout (the file named).
        """
        layout, scan = self.layout, self.scan
        opened = _Opened()
        try:
            image, values, shape = _nifti_values(scan.paths[i], "", layout.dtype, opened)
            if len(shape) != layout.ndim:
                raise RejectedInputError(f"{len(shape)}-D volume of shape {shape} in a store of {layout.ndim}-D "
                                         "volumes (most of them): convert volumes of other dimensions separately")
            proxy = image.dataobj
            zooms = image.header.get_zooms()
            out = opened.values
            out["image"] = values
            if scan.label_paths is not None:
                assert layout.label_dtype is not None and scan.label_relpaths is not None
                label_name = os.fsdecode(scan.label_relpaths[i])
                _, label_values, label_shape = _nifti_values(scan.label_paths[i], f"label {label_name}",
                                                             layout.label_dtype, opened)
                if label_shape[:layout.spatial] != shape[:layout.spatial]:
                    raise RejectedInputError(
                        f"label volume {label_name} has shape {label_shape}, image {self.input_name(i)} has shape "
                        f"{shape}: they differ on the {layout.spatial} spatial axes")
                if len(label_shape) != layout.label_ndim:
                    raise RejectedInputError(f"label volume {label_name} is {len(label_shape)}-D, the store's label "
                                             f"volumes are {layout.label_ndim}-D")
                out["label"] = label_values
            elif scan.labels is not None:
                out["label"] = scan.labels[i]
            out["affine"] = np.asarray(image.affine, dtype=np.float64)
            out["spacing"] = np.asarray(zooms[:layout.spatial], dtype=np.float64)
            out["scl_slope"], out["scl_inter"] = float(proxy.slope), float(proxy.inter)
            for name, (_, column) in scan.extras.items():
                out[name] = column[i]
        except BaseException:
            opened.close()
            raise
        return opened


def volume_layout(scan: FileScan, chunks: tuple[int, ...] | None) -> VolumeLayout:
    """The store's layout from every volume's header (read here, in the converting process).

    Raises:
        SourceError: no volume (or no label volume) can be read at all, naming the first failure.
    """
    headers, failures = [], []
    for path, rel in zip(scan.paths, scan.relpaths, strict=True):
        try:
            headers.append(nifti_header(path, os.fsdecode(rel))[1:])
        except RejectedInputError as err:
            failures.append(str(err))
    if not headers:
        raise SourceError(f"{scan.root}: none of the {len(scan)} volume(s) can be read; the first: {failures[0]}")
    ndim, dtype = _common(headers)
    if ndim < 2:
        raise SourceError(f"{scan.root}: the volumes are 1-D: fastdata stores volumes of at least 2 axes")
    default = (PLANE_CHUNK, PLANE_CHUNK) if ndim == 2 else (VOLUME_CHUNK,) * 3
    image_chunks = _chunks_for(ndim, chunks, default, "volumes")
    layout = VolumeLayout(ndim, dtype, image_chunks)
    if scan.label_paths is not None:
        assert scan.label_relpaths is not None
        labels = []
        for path, rel in zip(scan.label_paths, scan.label_relpaths, strict=True):
            try:
                labels.append(nifti_header(path, os.fsdecode(rel))[1:])
            except RejectedInputError:
                pass
        if not labels:
            raise SourceError(f"{scan.root}: none of the {len(scan)} label volume(s) can be read")
        label_ndim, label_dtype = _common(labels)
        spatial = min(3, ndim)
        label_chunks = image_chunks[:min(spatial, label_ndim)] + (1,) * (label_ndim - min(spatial, label_ndim))
        layout = VolumeLayout(ndim, dtype, image_chunks, label_ndim, label_dtype, label_chunks)
    return layout


def volume_schema(scan: FileScan, layout: VolumeLayout, codec: str | None) -> Schema:
    """The schema of a NIfTI source (fields: the module docstring)."""
    fields: list[tuple[str, Field]] = [("image", _chunked(layout.dtype, layout.chunks, codec))]
    if layout.label_dtype is not None and layout.label_chunks is not None:
        fields.append(("label", _chunked(layout.label_dtype, layout.label_chunks, codec)))
    elif scan.labels is not None:
        fields.append(("label", Int()))
    fields += [("affine", NDArray("float64", (4, 4))), ("spacing", NDArray("float64", (layout.spatial,))),
               ("scl_slope", Float()), ("scl_inter", Float())]
    fields += [(name, f) for name, (f, _) in scan.extras.items()]
    return Schema(tuple(fields))


# --------------------------------------------------------------------------- TIFF files


def _tifffile() -> ModuleType:
    return _require("tifffile", "reading TIFF images tile by tile")


_JPEG_COMPRESSIONS = frozenset({6, 7, 34892, 33007})


class TiffRegions:
    """The first page of a TIFF as an array-like of shape (H, W[, C]) that reads a region by
    decoding only the tiles (or strips) it touches, one at a time (see the module docstring).

    Args:
        tif: an open ``tifffile.TiffFile`` (closed by the caller).
        page: its first page (axes ``YX``, ``YXS`` or ``SYX``).
        dtype: the store's dtype (values are cast to it; exactness is the chunk writer's check).
        ndim: 2 or 3: the store's number of axes (a one-band image in a 3-D store is (H, W, 1)).
        name: the file, for messages.
    """

    def __init__(self, tif: Any, page: Any, dtype: np.dtype, ndim: int, name: str):
        self.tif, self.page, self.name, self.dtype = tif, page, name, dtype
        self.separate = page.axes == "SYX"
        height, width, channels = _tiff_geometry(page)
        self.height, self.width, self.channels = height, width, channels
        self.shape = (height, width) if ndim == 2 else (height, width, channels)
        self.seg_h, self.seg_w = int(page.chunks[0]), int(page.chunks[1])
        self.rows, self.cols = -(-height // self.seg_h), -(-width // self.seg_w)
        planes = channels if self.separate else 1
        if len(page.dataoffsets) != planes * self.rows * self.cols:
            raise RejectedInputError(f"{_at(name)}corrupt TIFF: {len(page.dataoffsets)} tiles/strips, the page's "
                                     f"geometry needs {planes * self.rows * self.cols}")
        self.decode_args: dict[str, Any] = {}
        if int(page.compression) in _JPEG_COMPRESSIONS:
            self.decode_args = {"jpegtables": page.jpegtables, "jpegheader": page.jpegheader}
        #: segments decoded so far (a measure for tests: a region reads only what it touches)
        self.decoded = 0

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self.shape) or not all(isinstance(k, slice) and k.step in (None, 1) for k in key):
            raise TypeError("TiffRegions takes a tuple of slices (steps of 1)")
        bounds = [k.indices(s)[:2] for k, s in zip(key + (slice(None),) * (len(self.shape) - len(key)), self.shape,
                                                   strict=True)]
        (y0, y1), (x0, x1) = bounds[0], bounds[1]
        c0, c1 = bounds[2] if len(bounds) == 3 else (0, 1)
        y1, x1, c1 = max(y0, y1), max(x0, x1), max(c0, c1)
        out = np.zeros((y1 - y0, x1 - x0, c1 - c0), dtype=self.dtype)
        if out.size:
            self._fill(out, y0, y1, x0, x1, c0, c1)
        return out if len(self.shape) == 3 else out[..., 0]

    def _segments(self, y0: int, y1: int, x0: int, x1: int, c0: int, c1: int) -> list[int]:
        planes = range(c0, c1) if self.separate else range(1)
        return [(s * self.rows + ty) * self.cols + tx for s in planes
                for ty in range(y0 // self.seg_h, (y1 - 1) // self.seg_h + 1)
                for tx in range(x0 // self.seg_w, (x1 - 1) // self.seg_w + 1)]

    def _fill(self, out: np.ndarray, y0: int, y1: int, x0: int, x1: int, c0: int, c1: int) -> None:
        page = self.page
        wanted = self._segments(y0, y1, x0, x1, c0, c1)
        fh = self.tif.filehandle
        try:
            offsets = [page.dataoffsets[j] for j in wanted]
            counts = [page.databytecounts[j] for j in wanted]
            for data, j in fh.read_segments(offsets, counts, indices=wanted, sort=True, lock=fh.lock,
                                            buffersize=READ_BUFFER_BYTES, flat=True):
                segment, (s, _d, y, x, _c), _shape = page.decode(data, j, **self.decode_args)
                self.decoded += 1
                if segment is None:
                    continue  # an empty tile: its pixels stay 0
                tile = segment[0]  # (length, width, contig samples)
                ya, yb = max(y0, y), min(y1, y + tile.shape[0], self.height)
                xa, xb = max(x0, x), min(x1, x + tile.shape[1], self.width)
                if ya >= yb or xa >= xb:
                    continue
                rows = tile[ya - y:yb - y, xa - x:xb - x]
                if self.separate:
                    out[ya - y0:yb - y0, xa - x0:xb - x0, s - c0] = rows[..., 0]
                elif self.channels == 1:
                    out[ya - y0:yb - y0, xa - x0:xb - x0, 0] = rows[..., 0]
                else:
                    out[ya - y0:yb - y0, xa - x0:xb - x0, :] = rows[..., c0:c1]
        except RejectedInputError:
            raise
        except Exception as err:  # noqa: BLE001 - tifffile and the codecs raise many kinds on damaged data
            if "imagecodecs" in str(err):
                _require("imagecodecs", f"decoding a TIFF of compression {getattr(page.compression, 'name', '?')}")
            raise RejectedInputError(f"{_at(self.name)}truncated or corrupt TIFF data ({type(err).__name__}: "
                                     f"{err})") from None


def _tiff_geometry(page: Any) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in page.shape)
    if page.axes == "SYX":
        return shape[1], shape[2], shape[0]
    if page.axes == "YXS":
        return shape[0], shape[1], shape[2]
    return shape[0], shape[1], 1


def open_tiff(path: bytes, name: str, max_pixels: int | None) -> tuple[Any, Any, tuple[int, int, int], np.dtype]:
    """``(TiffFile, first page, (H, W, C), dtype)`` of a TIFF, its header checked: a 2-D image (axes
    YX, YXS or SYX), not a stack, at most ``max_pixels`` pixels (None: :func:`pixel_limit`),
    tiles or strips of at most :data:`MAX_SEGMENT_BYTES` each. The caller closes the file.

    Raises:
        RejectedInputError: naming the problem (and ``--max-pixels`` for too many pixels).
        MissingExtraError: tifffile, or imagecodecs for a compressed TIFF, is not installed.
    """
    tifffile = _tifffile()
    try:
        tif = tifffile.TiffFile(os.fsdecode(path))
    except FileNotFoundError:
        raise RejectedInputError(f"{_at(name)}file not found") from None
    except Exception as err:  # noqa: BLE001 - TiffFileError, ValueError, struct.error, ...
        raise RejectedInputError(f"{_at(name)}not a readable TIFF file ({type(err).__name__}: {err}); --chunks "
                                 "stores TIFF images, read tile by tile") from None
    try:
        try:
            pages = tif.pages
            page = pages.first
            axes, dtype, shape = page.axes, page.dtype, tuple(page.shape)
            count = len(pages)
            stack = any(tuple(pages[k].shape) == shape for k in range(1, count))
        except Exception as err:  # noqa: BLE001
            raise RejectedInputError(f"{_at(name)}corrupt TIFF ({type(err).__name__}: {err})") from None
        if stack:
            raise RejectedInputError(f"{_at(name)}a multi-page TIFF stack ({count} pages, several of shape {shape}): "
                                     "one image per sample is stored; split the stack into one file per page")
        if axes not in ("YX", "YXS", "SYX") or int(getattr(page, "imagedepth", 1)) != 1:
            raise RejectedInputError(f"{_at(name)}TIFF page of axes {axes!r} (shape {shape}) is not a 2-D image")
        if dtype is None or np.dtype(dtype).kind not in "biuf":
            raise RejectedInputError(f"{_at(name)}TIFF of {page.bitspersample} bits per sample, sample format "
                                     f"{page.sampleformat} is not supported")
        height, width, channels = _tiff_geometry(page)
        limit = pixel_limit() if max_pixels is None else max_pixels
        if height * width > limit:
            given = ("--max-pixels" if max_pixels is not None
                     else "the decompression-bomb limit, PIL.Image.MAX_IMAGE_PIXELS")
            raise RejectedInputError(
                f"{_at(name)}{width}x{height} image ({height * width:,} pixels) is over the limit of {limit:,} pixels "
                f"({given}): pass --max-pixels N (max_pixels=N) to allow larger images, e.g. --max-pixels "
                f"{_suggest_pixels(height * width)}")
        segment = math.prod(int(c) for c in page.chunks) * np.dtype(dtype).itemsize
        if segment > MAX_SEGMENT_BYTES:
            raise RejectedInputError(f"{_at(name)}its tiles/strips of {list(page.chunks)} decode to {segment:,} "
                                     f"bytes each, more than the {MAX_SEGMENT_BYTES >> 20} MiB read at once: rewrite "
                                     "it tiled (e.g. tifffile.imwrite(..., tile=(512, 512)))")
    except BaseException:
        tif.close()
        raise
    return tif, page, (height, width, channels), _native(dtype)


def _suggest_pixels(pixels: int) -> str:
    """A round ``--max-pixels`` value above ``pixels`` (``2G``, ``500M``)."""
    for unit, factor in (("M", 10**6), ("G", 10**9)):
        for mantissa in (1, 2, 5, 10, 20, 50, 100, 200, 500):
            if mantissa * factor >= pixels:
                return f"{mantissa}{unit}"
    return str(pixels)


@dataclass(frozen=True)
class ImageLayout:
    """What every image of a TIFF store shares: axes (2 or 3), dtype and chunks."""

    ndim: int
    dtype: np.dtype
    chunks: tuple[int, ...]


class TiffSamples:
    """The samples of a TIFF folder: ``open(i)`` opens image ``i`` as a :class:`TiffRegions`."""

    def __init__(self, scan: FileScan, layout: ImageLayout, max_pixels: int | None):
        self.scan, self.layout, self.max_pixels = scan, layout, max_pixels

    def __len__(self) -> int:
        return len(self.scan)

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.scan.relpaths[i])

    def input_path(self, i: int) -> str:
        return os.fsdecode(self.scan.paths[i])

    def relpath(self, i: int) -> bytes:
        return self.scan.relpaths[i]

    def input_bytes(self, i: int) -> int:
        path = self.scan.paths[i]
        return os.stat(path).st_size if os.path.isfile(path) else 0

    def open(self, i: int) -> _Opened:
        """Image ``i``'s values (``image``, and ``label`` with class folders).

        Raises:
            RejectedInputError: the file is unreadable or refused (see :func:`open_tiff`).
        """
        opened = _Opened()
        tif, page, (_h, _w, channels), dtype = open_tiff(self.scan.paths[i], "", self.max_pixels)
        opened.closers.append(tif.close)
        try:
            if channels > 1 and self.layout.ndim == 2:
                raise RejectedInputError(f"image of {channels} bands in a store of one-band images")
            if dtype != self.layout.dtype and not np.can_cast(dtype, self.layout.dtype, "safe"):
                raise RejectedInputError(f"dtype {dtype} does not fit the store's {self.layout.dtype} exactly")
            opened.values["image"] = TiffRegions(tif, page, self.layout.dtype, self.layout.ndim, "")
            if self.scan.labels is not None:
                opened.values["label"] = self.scan.labels[i]
        except BaseException:
            opened.close()
            raise
        return opened


def image_layout(scan: FileScan, chunks: tuple[int, ...] | None, max_pixels: int | None) -> ImageLayout:
    """The TIFF store's layout from every image's header (read here, in the converting process).

    Raises:
        SourceError: no image can be read at all, naming the first failure.
    """
    headers, failures = [], []
    for path, rel in zip(scan.paths, scan.relpaths, strict=True):
        try:
            tif, _page, geometry, dtype = open_tiff(path, os.fsdecode(rel), max_pixels)
            tif.close()
            headers.append((geometry, dtype))
        except RejectedInputError as err:
            failures.append(str(err))
    if not headers:
        raise SourceError(f"{scan.root}: none of the {len(scan)} image(s) can be read as a TIFF; the first: "
                          f"{failures[0]}")
    bands = max(g[2] for g, _ in headers)
    ndim = 2 if bands == 1 else 3
    dtype = _native(np.result_type(*(d for _, d in headers)))
    sides = _chunks_for(ndim, chunks, IMAGE_CHUNKS, "images")
    if ndim == 3 and (chunks is None or len(chunks) < 3):
        sides = sides[:2] + (bands,)
    return ImageLayout(ndim, dtype, sides)


# --------------------------------------------------------------------------- the worker side


#: the samples of this worker process (set by the pool initializer)
_SAMPLES: VolumeSamples | TiffSamples | None = None


def set_samples(samples: VolumeSamples | TiffSamples | None) -> None:
    """Worker initializer: keep the samples for :func:`encode_files` (None: let them go)."""
    global _SAMPLES
    _SAMPLES = samples


def encode_file(samples: VolumeSamples | TiffSamples, schema: Schema, i: int,
                chunk_dir: str | None) -> EncodedSample | str:
    """Sample ``i`` opened, checked and written chunk by chunk into ``chunk_dir`` (None: a probe,
    measured and not kept), or the reason (``str``) why its file is rejected."""
    where = f"{samples.input_name(i)}"
    try:
        opened = samples.open(i)
    except RejectedInputError as err:
        return str(err)
    pending = []
    try:
        checked = schema.check(opened.values, where)
        for name in schema.chunked_fields():
            chunked = schema[name]
            assert isinstance(chunked, Chunked)
            checked[name], waiting = write_chunks(chunked, name, checked[name], f"{where} field {name!r}", chunk_dir)
            if waiting is not None:
                pending.append(waiting)
        return encode_sample(schema, checked, {}, samples.relpath(i), tuple(pending))
    except (RejectedInputError, SchemaError) as err:
        for waiting in pending:
            os.unlink(waiting.path)
        return str(err)
    except BaseException:
        for waiting in pending:
            os.unlink(waiting.path)
        raise
    finally:
        opened.close()


def encode_files(schema: Schema, start: int, stop: int, items: list | None, strict: bool, chunk_dir: str | None,
                 spill_dir: str | None):
    """Worker entry point: samples ``start .. stop-1`` of this worker's samples as
    :class:`EncodedSample` objects or rejection reasons (the pipeline stops at the first under
    ``--strict``); see :class:`~fastdata.writer.pipeline.ChunkSource` for the return value."""
    samples = _SAMPLES
    assert samples is not None, "set_samples runs in each worker first"
    results = [encode_file(samples, schema, i, chunk_dir) for i in range(start, stop)]
    nbytes = sum(samples.input_bytes(i) for i in range(start, stop))
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class FileChunks(MapSource):
    """The pipeline's feed: one file per task, read by :func:`encode_files` in the workers."""

    worker = staticmethod(encode_files)

    def __init__(self, samples: VolumeSamples | TiffSamples, schema: Schema, strict: bool, chunk_dir: str | None):
        super().__init__(samples, schema, 1, strict, chunk_dir)
        self.samples = samples
        self.worker_init = (set_samples, (samples,))

    def describe(self, start: int, stop: int) -> str:
        return self.samples.input_path(start) + (f" .. {self.samples.input_path(stop - 1)}" if stop - start > 1 else "")

    def input_path(self, i: int) -> str:
        return self.samples.input_path(i)


# --------------------------------------------------------------------------- the write sources


class _FilesInput(MapInput):
    """What both sources share: a scan, the layout from the files' headers, a probe of a few files
    for the shard size, one file per worker task."""

    resume_flag, overwrite_flag = "--resume", "--overwrite"
    made_from = "made from different inputs or options"

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None):
        super().__init__([], None)
        self.src = src
        self.recorded_source = os.path.abspath(src)
        self.chunks_given, self.codec = chunks, DEFAULT_CODEC if codec is None else codec
        self.scan: FileScan | None = None
        self.files: VolumeSamples | TiffSamples | None = None
        self.notes: list[str] = []

    def _scan_source(self) -> FileScan:
        raise NotImplementedError

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples | TiffSamples, Schema]:
        raise NotImplementedError

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.chunk_dir = staging_path(dst)
        scan = self.scan = self._scan_source()
        if scan.is_folder:
            root, target = os.path.realpath(scan.root), os.path.realpath(dst)
            if target == root or target.startswith(os.path.join(root, "")):
                raise SourceError(f"the destination {dst} is inside the source folder {scan.root}: choose a "
                                  "destination outside it")
        self.warnings.extend(f"{path}: {problem}" for path, problem in scan.problems)
        files, schema = self._layout(scan)
        self.files, self.samples, self.schema = files, files, schema
        count = self.count = len(files)
        picks = sorted({0, count // 4, count // 2, 3 * count // 4, count - 1})
        probe = [encode_file(files, schema, i, None) for i in picks]
        self.probe = [p for p in probe if not isinstance(p, str)]
        sizes = [p.stored_bytes + len(p.relpath) + 16 + 8 * len(p.index) for p in self.probe] or [1]
        per_shard = max(1, run.shard_size.bytes // max(1, int(np.mean(sizes))))
        plans = [ShardPlan(k, a, min(a + per_shard, count)) for k, a in enumerate(range(0, count, per_shard))]
        check_shard_count(plans, int(np.mean(sizes)) * count, run.shard_size)
        self.metadata = {**scan.metadata, **self._metadata()}
        return plans

    def _metadata(self) -> dict[str, Any]:
        return {}

    def _scanned(self) -> FileScan:
        assert self.scan is not None, "plan scans the source first"
        return self.scan

    def fingerprint(self, run: RunOptions) -> str:
        """What identifies the conversion for ``--resume``: backend, shard size, schema, metadata and
        every file's path, size and modification time. (Not the probe's encoded records, as
        :meth:`MapInput.fingerprint` hashes: Blosc's output bytes are not always the same from one
        run to the next for the same chunk, and the files' listing says more about a change.)"""
        h = xxhash.xxh3_128()
        h.update(repr((run.backend, run.shard_size.bytes, self.count, self._checked_schema().to_json())).encode())
        h.update(canonical_json(dict(self.metadata or {})))
        scan = self._scanned()
        for paths in (scan.paths, scan.label_paths or []):
            for p in paths:
                try:
                    st = os.stat(p)
                    h.update(repr((p, st.st_size, st.st_mtime_ns)).encode())
                except OSError:
                    h.update(repr((p, None)).encode())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> FileChunks:
        assert self.files is not None, "plan opens the source first"
        return FileChunks(self.files, self._checked_schema(), run.strict, self.chunk_dir)

    def options_text(self, run: RunOptions) -> str:
        schema = self._checked_schema()
        image = schema["image"]
        assert isinstance(image, Chunked)
        return (f"{run.backend}, shard size {run.shard_size}, chunks {','.join(map(str, image.chunks))}, "
                f"codec {image.codec}")

    def classes(self) -> list[str]:
        return list(self._scanned().classes)

    def remarks(self) -> list[tuple[str, str]]:
        return list(self._scanned().problems)

    def manifest_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"metadata": dict(self.metadata or {})}
        if self.classes():
            extra[CLASS_TABLES_KEY] = {"label": self.classes()}
        return extra

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Each shard's ``class_counts`` from the labels its index sidecar holds, with class labels."""
        if not self.classes():
            return
        schema = self._checked_schema()
        for r in results:
            index = decode_shard_index(shard_index_bytes(dst, backend, r.name, schema), schema, r.name)
            assert isinstance(index, SampleIndex), "a general store's shards hold a SampleIndex"
            labels = np.asarray(index.arrays[FIELD_PREFIX + "label"], dtype=np.int64)
            r.class_counts = np.bincount(labels, minlength=len(self.classes())).tolist()

    def report_notes(self) -> list[str]:
        return list(self.notes)


class VolumeInput(_FilesInput):
    """A NIfTI folder, volume list or Decathlon ``dataset.json`` (see the module docstring)."""

    unit = "volumes"

    def _scan_source(self) -> FileScan:
        _nibabel()  # before anything: one clear line when nibabel is missing
        src = self.src
        if os.path.isdir(src):
            return scan_file_folder(src, NIFTI_SUFFIXES, "NIfTI")
        if src.lower().endswith(".json"):
            return scan_decathlon(src)
        return scan_volume_list(src)

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples, Schema]:
        layout = volume_layout(scan, self.chunks_given)
        schema = volume_schema(scan, layout, self.codec)
        self.notes = [f"image: {layout.dtype.name} {layout.ndim}-D volumes, raw stored values (physical value = "
                      "image * scl_slope + scl_inter)"]
        if layout.label_dtype is not None:
            self.notes.append(f"label: {layout.label_dtype.name} {layout.label_ndim}-D label volumes")
        return VolumeSamples(scan, layout), schema

    def _metadata(self) -> dict[str, Any]:
        return {"volumes": {"format": "nifti", "values": "raw stored values: image * scl_slope + scl_inter"}}


class TiffImageInput(_FilesInput):
    """A folder of TIFF images stored as chunked arrays read tile by tile (see the module docstring)."""

    unit = "images"

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None, max_pixels: int | None):
        super().__init__(src, chunks, codec)
        self.max_pixels = max_pixels

    def _scan_source(self) -> FileScan:
        _tifffile()
        if not os.path.isdir(self.src):
            raise SourceError(f"{self.src}: --chunks/--max-pixels store the TIFF images of a folder (class "
                              "subfolders give labels) or NIfTI volumes; this is not a folder")
        return scan_file_folder(self.src, tuple(dict.fromkeys(TIFF_SUFFIXES + IMG_EXTENSIONS)), "TIFF/image")

    def _layout(self, scan: FileScan) -> tuple[TiffSamples, Schema]:
        layout = image_layout(scan, self.chunks_given, self.max_pixels)
        fields: list[tuple[str, Field]] = [("image", _chunked(layout.dtype, layout.chunks, self.codec))]
        if scan.labels is not None:
            fields.append(("label", Int()))
        limit = self.max_pixels if self.max_pixels is not None else pixel_limit()
        self.notes = [f"image: {layout.dtype.name} {'HxWxC' if layout.ndim == 3 else 'HxW'} arrays read tile by tile; "
                      f"pixel limit {limit:,} per image" + (" (--max-pixels)" if self.max_pixels is not None else "")]
        return TiffSamples(scan, layout, self.max_pixels), Schema(tuple(fields))


def chunked_input(src: str, *, chunks: str | Sequence[int] | None = None, codec: str | None = None,
                  max_pixels: int | str | None = None) -> VolumeInput | TiffImageInput | None:
    """The write source of ``src`` when it is stored as chunked arrays, else None.

    A NIfTI source (:func:`is_volume_source`) is a :class:`VolumeInput`; a folder converted with
    ``chunks`` or ``max_pixels`` is a :class:`TiffImageInput`; anything else is None (an ordinary
    image source, which takes none of these options; ``codec`` alone does not make a folder chunked).

    Raises:
        ValueError: a malformed option, or ``max_pixels`` for NIfTI volumes.
    """
    sides = None if chunks is None else parse_chunks(chunks)
    pixels = None if max_pixels is None else parse_max_pixels(max_pixels)
    if is_volume_source(src):
        if pixels is not None:
            raise ValueError("--max-pixels applies to TIFF images; NIfTI volumes are read slab by slab without it")
        return VolumeInput(src, sides, codec)
    if os.path.isdir(src) and (sides is not None or pixels is not None):
        if sides is not None and len(sides) not in (2, 3):
            raise ValueError(f"--chunks for images takes 2 sides (rows,columns; every band in each chunk) or 3 "
                             f"(rows,columns,bands), got {len(sides)}")
        return TiffImageInput(src, sides, codec, pixels)
    return None
