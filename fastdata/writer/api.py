"""The public entry points of the writer (``fastdata.convert``, ``convert_table``, ``write``,
``convert_coco``; the CLI's ``convert`` is a thin layer over them).

Each one checks its own arguments, builds the write source of its input
(:mod:`fastdata.writer.sources`) and runs the one write session
(:class:`~fastdata.writer.session.WriteSession`), which owns everything else: the
destination checks, the lock, resume/overwrite, staging, progress, torchrun ranks, URL
destinations, publishing and the report.

``workers`` means the same everywhere (:mod:`fastdata.writer.options`): None (the default)
is all cores; 0 is no worker process, everything runs in this process (as PyTorch's
``DataLoader(num_workers=0)``; useful for debugging); N > 0 is N worker processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastdata.common.extras import require
from fastdata.common.paths import check_local_path
from fastdata.errors import RejectedInputError
from fastdata.format.fields import Schema
from fastdata.writer.remote_sink import refuse_remote_source
from fastdata.writer.report import ConvertReport
from fastdata.writer.session import WriteOptions, WriteSession
from fastdata.writer.sources.base import WriteSource
from fastdata.writer.sources.coco import CocoInput
from fastdata.writer.sources.dicom import DicomFolderInput
from fastdata.writer.sources.folder import FolderInput
from fastdata.writer.sources.parquet.detect import hf_kind, parquet_files
from fastdata.writer.sources.python import IterInput, MapInput, MapStyle, is_map_style
from fastdata.writer.sources.table.input import TableInput, is_general_list
from fastdata.writer.sources.volumes.input import BOMB_HINT, chunked_input
from fastdata.writer.sources.webdataset.input import TarInput
from fastdata.writer.sources.webdataset.names import tar_files

__all__ = ["convert", "convert_coco", "convert_table", "write"]


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    max_side: int | None = None,
    quality: int | None = None,
    raw=None,
    lossless: str | None = None,
    image_mode: str | None = None,
    dicom_tags: str | list[str] | None = None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    append: bool = False,
    add_classes: bool = False,
    progress: bool | None = None,
    lmdb_map_size: int | str | None = None,
    chunk_size: int = 32,
    schema=None,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
    chunks: str | Sequence[int] | None = None,
    codec: str | None = None,
    max_pixels: int | str | None = None,
    image_column: str | Sequence[str] | None = None,
    storage: str | None = None,
    raw_fraction: float | None = None,
    raw_budget: int | str | None = None,
) -> ConvertReport:
    """Convert an ImageFolder tree, a list file, NIfTI volumes, Parquet files or WebDataset shards into a store.

    Under ``torchrun`` (an initialised process group of several ranks) an image folder or
    ``path,label`` list is converted by all ranks together, shard ``k`` by rank ``k % world_size``
    (see :mod:`fastdata.writer.distributed`); the store is identical to a single-process one.

    Args:
        src: image folder (class subfolders) or a ``.csv``/``.tsv`` list of ``path,label``
            (a classification store, layout version 1); or a JSONL list, or a CSV/TSV list
            whose header names more columns than ``path,label`` (a general store, layout
            version 2, written by :func:`convert_table`). Or NIfTI volumes: a folder of
            ``.nii``/``.nii.gz`` files, a CSV/TSV/JSONL list whose ``image`` column names them (and
            ``label`` a label volume each), or a Decathlon ``dataset.json``: a general store of
            ``Chunked`` volumes (:mod:`fastdata.writer.sources.volumes`). Or Parquet files: a
            ``.parquet`` file, a folder of them or a glob (``data/train-*.parquet``): a general store
            with a field per column, image bytes kept as they are and Hugging Face ``ClassLabel``
            names kept (:mod:`fastdata.writer.sources.parquet`; needs pyarrow). Or WebDataset tar
            shards: a ``.tar`` file, a brace pattern (``shards/train-{000000..000099}.tar``), a glob or
            a folder of them: a field per member extension plus ``__key__``
            (:mod:`fastdata.writer.sources.webdataset`).
        dst: destination directory, or a URL (``s3://bucket/train.lmdb``, ``gs://``, ``az://``: shards
            are staged locally and uploaded as each finishes, manifest last; see
            :mod:`fastdata.writer.remote_sink`); its suffix picks the backend unless ``format`` is given.
        format: ``"lmdb"`` or ``"hdf5"``.
        workers: worker processes that read, validate and encode the images (default None: all cores;
            0: none, everything runs in this process, e.g. for debugging; negative is an error; more
            than 4x the cores is allowed with a warning).
        shard_size: target bytes per shard file (``int`` or e.g. ``"512MiB"``, ``"2GB"``; default 1GiB).
            At least 1 MiB, and at most 10,000 shards per store.
        max_side, quality: re-encode images whose longer side exceeds ``max_side`` as JPEG.
        raw: ``"HxW"``: store decoded RGB pixels resized to that shape.
        lossless: ``"tiff"`` (storage mode ``"lossless"``): re-encode every image but JPEG, WebP and
            DICOM files (and palette/CMYK images, whose pixels need their palette or colour space) as
            a zstd TIFF of its unchanged pixels, checked bit-exact while converting (a mismatch
            rejects the image with the reason); 16-bit PNGs then decode several times faster.
            Exclusive with ``max_side``/``quality``/``raw``.
        storage: ``"raw"`` (``--storage raw``, storage mode ``"raw-native"``): every image's decoded
            RGB pixels at its own size, the longer side capped at ``max_side`` (required, at least 32;
            :func:`fastdata.writer.ingest.raw_native_rgb`), each record a binary PPM that readers use
            without decoding; ``"mixed"`` (``--storage mixed``): the share ``raw_fraction`` of the
            images that :meth:`~fastdata.format.backends.base.StorageSpec.keeps_raw` picks (by a hash
            of the relative path) stored so, the others kept as their original bytes. Exclusive with
            ``quality``/``raw``/``lossless``.
        raw_fraction: with ``storage="mixed"``: 0 to 1.
        raw_budget: with ``storage`` (``--raw-budget``; bytes or a size such as ``"200GB"``): the most
            bytes the images may take. ``"mixed"`` keeps as pixels the images that save the most decode
            time per extra byte (high-quality JPEGs first), as many as fit, instead of a fraction;
            ``"raw"`` refuses a source whose pixels do not fit. The plan reads every image's header
            first (:mod:`fastdata.writer.raw_budget`); a source that cannot fit is refused before
            anything is written.
        image_mode: the default read mode recorded for the store's images (``"RGB"``, ``"L"``,
            ``"RGBA"`` or ``"unchanged"``; a reader's ``image_mode=`` overrides it): the manifest's
            ``image_modes`` for a classification store, ``Image(mode=...)`` with ``dicom_tags``.
            None: ``"unchanged"`` when the store holds DICOM images, else the reader's default (RGB).
        dicom_tags: DICOM keywords (``["RescaleSlope", "PixelSpacing"]`` or ``"RescaleSlope,PixelSpacing"``)
            kept as json fields of a general (version-2) store of a folder of DICOM files: fields
            ``image``, ``label`` and one per tag (see :mod:`fastdata.writer.sources.dicom`). Without it
            a DICOM folder becomes an ordinary classification store.
        strict: stop at the first unusable input instead of skipping and reporting it (default False).
        resume: finish an interrupted conversion, keeping its completed shards. The content options
            (``format``, ``shard_size``, ``max_side``/``quality``/``raw``, ``strict``) left as None take
            the values the interrupted run recorded; one given that differs refuses the resume, naming it.
        overwrite: replace an existing store at ``dst``.
        append: add the samples to the published store at ``dst`` as new shards, publishing the new
            manifest atomically (:mod:`fastdata.writer.append`): the backend and storage options not
            given are the store's, the schema must be the store's, and each class name maps to the
            store's index of it. A SIGKILL leaves the store as it was; ``append`` with ``resume``
            finishes an interrupted append. A dataset opened before reads on in its own version.
        add_classes: with ``append``: class names the store lacks are appended at the end of its class
            table (otherwise they are an error); the table is then no longer sorted as ImageFolder's.
        progress: show a progress bar (default: when stderr is a terminal).
        lmdb_map_size: initial LMDB map size (it grows automatically).
        chunk_size: inputs per worker task.
        schema: declared fields of a list file (``--schema``: an inline spec, a JSON file, or a
            loaded JSON value; see :func:`fastdata.writer.sources.table.spec.parse_schema`); makes ``src``
            a general list (:func:`convert_table`).
        storage_options: fsspec options for a URL ``dst`` (endpoint, credentials, ...).
        staging_dir: local directory shards of a URL ``dst`` are written in before upload
            (default: under the cache directory).
        chunks: the chunk shape of chunked arrays (``"64,64,64"`` or ``(64, 64, 64)``): for NIfTI
            volumes (default 48 per spatial axis, sized for 96^3 patches, 1 on the others) and, given for
            an image folder, its TIFF images become ``Chunked`` (H, W[, C]) arrays read tile by tile (default 512x512).
        codec: the chunks' codec (:data:`fastdata.format.chunk_codecs.CHUNK_CODECS`; default ``"blosc-lz4"``;
            ``"blosc-zstd"`` for smaller stores).
        max_pixels: the pixel limit (H x W) of one image of a TIFF folder stored as chunked arrays
            (``int`` or ``"2G"``; default :func:`fastdata.common.imageio.pixel_limit`, the
            decompression-bomb limit); implies chunked storage.
        image_column: Parquet columns to store as images besides those recognised (a Hugging Face
            image struct, a binary column whose first value is an image): a name, a comma-separated
            list or a list of names; each a binary, ``struct<bytes, path>`` or file path column.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        ValueError: conflicting or invalid options (e.g. ``resume`` with ``overwrite``, a negative ``workers``).
        MissingExtraError: NIfTI volumes without nibabel (``pip install 'fastdata[volumes]'``), Parquet
            files without pyarrow (``pip install 'fastdata[parquet]'``).
        FastdataError subclasses, each naming the file or store at fault.
    """
    if hf_kind(src) is not None:
        raise ValueError(f"convert takes a path; a datasets.{hf_kind(src)} is written with fastdata.write(ds, dst) "
                         "(split= for a DatasetDict)")
    src = os.fspath(src)
    refuse_remote_source(src)
    options = WriteOptions(
        format=format, shard_size=shard_size, strict=strict, workers=workers, resume=resume, overwrite=overwrite,
        append=append, add_classes=add_classes,
        progress=progress, lmdb_map_size=lmdb_map_size, chunk_size=chunk_size, storage_options=storage_options,
        staging_dir=staging_dir)
    # the options of image folders and volumes, which the sources that keep every value as read refuse
    image_options = (("--max-side", max_side), ("--quality", quality), ("--raw", raw), ("--lossless", lossless),
                     ("--storage", storage), ("--raw-fraction", raw_fraction), ("--raw-budget", raw_budget),
                     ("--image-mode", image_mode), ("--dicom-tags", dicom_tags), ("--schema", schema),
                     ("--chunks", chunks), ("--codec", codec), ("--max-pixels", max_pixels))
    files = parquet_files(src)
    if files is not None:
        refuse_given(image_options, "Parquet files: every column becomes a field and image bytes are stored as "
                     "they are")
        require("pyarrow", "converting Parquet files")
        from fastdata.writer.sources.parquet.input import ParquetInput

        return WriteSession(ParquetInput(src, files, _names(image_column)), dst, options).run()
    if image_column is not None:
        raise ValueError(f"{src}: --image-column applies to Parquet files (a .parquet file, a folder or a glob of "
                         "them)")
    tars = tar_files(src)
    if tars is not None:
        refuse_given(image_options, "WebDataset shards: every member extension becomes a field and image bytes "
                     "are stored as they are")
        return WriteSession(TarInput(src, tars), dst, options).run()
    chunked = chunked_input(src, chunks=chunks, codec=codec, max_pixels=max_pixels)
    if chunked is not None:
        given = [flag for flag, value in (("--max-side", max_side), ("--quality", quality), ("--raw", raw),
                                          ("--lossless", lossless), ("--storage", storage),
                                          ("--raw-fraction", raw_fraction), ("--raw-budget", raw_budget),
                                          ("--image-mode", image_mode),
                                          ("--dicom-tags", dicom_tags), ("--schema", schema)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} do(es) not apply to chunked arrays (NIfTI volumes, TIFF images "
                             "with --chunks/--max-pixels): their values are stored exactly as read")
        return WriteSession(chunked, dst, options).run()
    if chunks is not None or codec is not None or max_pixels is not None:
        raise ValueError(f"{src}: --chunks/--codec/--max-pixels apply to NIfTI volumes (a folder, a list naming "
                         ".nii/.nii.gz files, a dataset.json) and to folders of TIFF images")
    if is_general_list(src, schema):
        if any(v is not None for v in (max_side, quality, raw, lossless, storage, raw_fraction, raw_budget,
                                       image_mode, dicom_tags)):
            raise ValueError(f"{src}: --max-side/--quality/--raw/--lossless/--storage/--raw-fraction/--raw-budget/"
                             "--image-mode/"
                             "--dicom-tags apply to image "
                             "folders and path,label lists; a list with more fields keeps each image's bytes as they "
                             "are (leave them out; declare Image(mode=...) in --schema for a default read mode)")
        return convert_table(src, dst, schema=schema, format=format, workers=workers, shard_size=shard_size,
                             strict=strict, resume=resume, overwrite=overwrite, progress=progress,
                             lmdb_map_size=lmdb_map_size, chunk_size=chunk_size, storage_options=storage_options,
                             staging_dir=staging_dir)
    check_local_path(src, "source")
    source: WriteSource
    if dicom_tags is not None:
        if any(v is not None for v in (max_side, quality, raw, lossless, storage, raw_fraction, raw_budget)):
            raise ValueError("--dicom-tags keeps each DICOM file's bytes as they are: leave out "
                             "--max-side/--quality/--raw/--lossless/--storage/--raw-fraction/--raw-budget")
        source = DicomFolderInput(src, dicom_tags, image_mode)
    else:
        source = FolderInput(src, max_side=max_side, quality=quality, raw=raw, lossless=lossless,
                             image_mode=image_mode, storage=storage, raw_fraction=raw_fraction,
                             raw_budget=raw_budget)
    try:
        report = WriteSession(source, dst, options).run()
    except RejectedInputError as err:
        if "decompression bomb" in str(err):
            raise RejectedInputError(f"{err}; {BOMB_HINT}") from None
        raise
    bombs = sum(1 for _, reason in report.rejected_items if "decompression bomb" in reason)
    if bombs:
        report.notes.append(f"{bombs} image(s) refused by the decompression-bomb limit: {BOMB_HINT}")
    return report


def _names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Column names given as ``"a,b"``, ``["a", "b"]`` or None."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    names = (name.strip() for item in items for name in str(item).split(","))
    return tuple(dict.fromkeys(name for name in names if name))


def convert_table(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    schema=None,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    append: bool = False,
    add_classes: bool = False,
    progress: bool | None = None,
    lmdb_map_size: int | str | None = None,
    chunk_size: int = 32,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> ConvertReport:
    """Convert a JSONL or CSV/TSV list with any fields into a general (layout version 2) store.

    The list is parsed by :func:`fastdata.writer.sources.table.reader.scan_table` (fields typed by
    inference or by ``schema``); workers read and fully decode each row's image and
    encode the row (:mod:`fastdata.writer.sources.table.input`), through the same write
    session, lock, resume and atomic publish as :func:`convert`. Records keep the
    image path as written in the list. Unreadable images are rejected and reported
    (``strict`` stops at the first). The manifest holds every class field's table under
    ``class_tables`` and the single-label one's under ``classes``, with ``class_counts``.
    It converts in one process (and its workers): not under ``torchrun``.

    Args: as :func:`convert` (``workers``: None, the default, all cores; 0: everything in this
        process; N: N worker processes); ``schema`` as :func:`fastdata.writer.sources.table.spec.parse_schema`.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        SourceError: the list is missing or has bad rows (all named with line numbers).
        SchemaError: the schema spec is malformed.
        ValueError: ``src`` is a folder, or the call runs under ``torchrun``, or an option is invalid.
        FastdataError subclasses for the destination, resume and I/O, as :func:`convert`.
    """
    src = os.fspath(src)
    refuse_remote_source(src)
    check_local_path(src, "source")
    if os.path.isdir(src):
        raise ValueError(f"{src} is a folder: --schema applies to a JSONL/CSV/TSV list file (path plus fields)")
    return WriteSession(TableInput(src, schema), dst, WriteOptions(
        format=format, shard_size=shard_size, strict=strict, workers=workers, resume=resume, overwrite=overwrite,
        append=append, add_classes=add_classes,
        progress=progress, lmdb_map_size=lmdb_map_size, chunk_size=chunk_size, storage_options=storage_options,
        staging_dir=staging_dir)).run()


def write(
    samples: Iterable[Mapping[str, Any]] | MapStyle,
    dst: str | os.PathLike,
    schema: Schema | Mapping[str, Any] | None = None,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    append: bool = False,
    add_classes: bool = False,
    progress: bool | None = None,
    chunk_size: int = 32,
    strict: bool = True,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
    split: str | None = None,
) -> ConvertReport:
    """Write ``samples`` (dicts of field name -> value) into a general fastdata store.

    Args:
        samples: a map-style dataset (``__len__`` + ``__getitem__``: a list, a torch
            ``Dataset``) or any iterable of dicts. Or a Hugging Face ``datasets.Dataset`` (a
            ``DatasetDict`` with ``split=``), read through Arrow: encoded image bytes kept as they
            are (never decoded to PIL and re-encoded), ``ClassLabel`` columns as class fields with
            their names, arrays as ragged/fixed-shape fields, resumable; or a
            ``datasets.IterableDataset``, written as an iterable (see
            :mod:`fastdata.writer.sources.hf`). Image values may be encoded bytes (stored as
            they are), a path (read in a worker), a PIL image (stored as PNG; modes ``I;16``, ``I``
            and ``F`` losslessly as TIFF), or a numpy array or torch tensor, HxW or HxWxC (channels
            last) of any dtype of :data:`~fastdata.common.imageio.ARRAY_IMAGE_DTYPES` and any channel
            count, stored bit-exact by :func:`~fastdata.common.imageio.encode_lossless` (8-bit with up
            to 4 channels as PNG, anything else as a zstd TIFF). Each image's dtype and channel count
            are recorded in the index. An image field of an inferred schema is ``Image()``: declare
            ``schema=`` for array images (an array alone is inferred as a ``ragged`` field).
        dst: destination directory, or a URL (``s3://bucket/x.lmdb``: shards are staged locally
            and uploaded as each finishes, manifest last; see :mod:`fastdata.writer.remote_sink`);
            its suffix picks the backend unless ``format`` is given.
        schema: a :class:`~fastdata.format.fields.Schema` or ``{name: Field}``; inferred from the
            first sample when None (:meth:`Schema.infer`).
        format: a backend name (``"lmdb"``, ``"hdf5"``).
        workers: worker processes (None, the default: all cores; 0: none, everything runs in this
            process, e.g. for debugging or a dataset that cannot be pickled; negative is an error;
            more than 4x the cores is allowed with a warning).
        shard_size: target bytes per shard (``int`` or e.g. ``"512MiB"``; default 1GiB);
            samples per shard are estimated from a few encoded samples.
        resume: finish an interrupted write of the same map-style dataset (same length,
            schema and sampled contents, see :class:`~fastdata.writer.sources.python.MapInput`),
            keeping its finished shards. An iterable cannot be resumed: it is refused (rerun with
            ``overwrite``).
        overwrite: replace an existing store at ``dst``.
        append: add the samples to the published store at ``dst`` as new shards, publishing the new
            manifest atomically (:mod:`fastdata.writer.append`): the backend and storage options not
            given are the store's, the schema must be the store's, and each class name maps to the
            store's index of it. A SIGKILL leaves the store as it was; ``append`` with ``resume``
            finishes an interrupted append. A dataset opened before reads on in its own version.
        add_classes: with ``append``: class names the store lacks are appended at the end of its class
            table (otherwise they are an error); the table is then no longer sorted as ImageFolder's.
        progress: show a progress bar (default: when stderr is a terminal).
        chunk_size: samples per worker task.
        strict: True (default): an unusable image value (unreadable file, not an image) stops
            the write; False: that sample is skipped and reported (``report.rejected_items``,
            the manifest's ``rejected`` list and ``rejected.tsv``, named ``sample <index>``).
            Map-style inputs only; an iterable is always strict.
        metadata: a JSON object stored in the manifest under ``"metadata"`` (e.g. class
            names, a COCO file's categories); part of what ``resume`` compares.
        storage_options: fsspec options for a URL ``dst`` (endpoint, credentials, ...).
        staging_dir: local directory shards of a URL ``dst`` are written in before upload
            (default: under the cache directory).
        split: the split of a ``datasets.DatasetDict`` to write (``"train"``); only for one.

    Returns:
        A :class:`~fastdata.writer.report.ConvertReport` (``images`` counts samples).

    Raises:
        SchemaError: a sample does not match the schema, or an image array's dtype (complex, bool,
            object, datetime, ...) or shape cannot be an image (names the sample and field); nothing is published.
        RejectedInputError: an image value is unreadable or not a usable image.
        ValueError: ``resume`` with an iterable, or an invalid option; a ``DatasetDict`` without
            ``split`` (the message lists its splits).
        FastdataError subclasses for the destination (exists, locked, I/O).
    """
    source: WriteSource
    if hf_kind(samples) is not None:
        require("pyarrow", "writing a datasets object")
        from fastdata.writer.sources.hf import hf_source

        source = hf_source(samples, split=split, schema=schema, metadata=metadata)
    elif split is not None:
        raise ValueError("split= picks a split of a datasets.DatasetDict; these samples are not one")
    else:
        source = (MapInput(samples, schema, metadata) if is_map_style(samples)
                  else IterInput(samples, schema, metadata))
    return WriteSession(source, dst, WriteOptions(
        format=format, shard_size=shard_size, strict=strict, workers=workers, resume=resume, overwrite=overwrite,
        append=append, add_classes=add_classes,
        progress=progress, chunk_size=chunk_size, storage_options=storage_options, staging_dir=staging_dir)).run()


def convert_coco(
    ann_file: str | os.PathLike,
    image_dir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    append: bool = False,
    add_classes: bool = False,
    progress: bool | None = None,
    chunk_size: int = 32,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> ConvertReport:
    """Convert a COCO instances annotation file and its image folder into a store.

    One sample per image, in ``torchvision.datasets.CocoDetection``'s order, with the fields
    of :data:`~fastdata.writer.sources.coco.COCO_SCHEMA` (see :mod:`fastdata.writer.sources.coco`).

    Args:
        ann_file (str | os.PathLike): the COCO annotation JSON (``instances_*.json``).
        image_dir (str | os.PathLike): the folder the images' ``file_name`` is relative to.
        dst (str | os.PathLike): destination directory, or a URL (``s3://bucket/coco.lmdb``, uploaded as
            :func:`fastdata.write` does); its suffix picks the backend unless ``format`` is given.
        format (str | None): ``"lmdb"`` or ``"hdf5"``.
        workers (int | None): worker processes that read and validate the images (None, the default:
            all cores; 0: none, everything runs in this process; negative is an error; more than 4x
            the cores is allowed with a warning), as for ``convert``.
        shard_size (int | str | None): target bytes per shard (e.g. ``"512MiB"``; default 1GiB).
        strict (bool | None): stop, before writing anything, at any problem of the annotation
            file or a missing image (and at an unusable image while writing); default False:
            skip and report them.
        resume (bool): finish an interrupted conversion of the same file, keeping its finished shards.
        overwrite (bool): replace an existing store at ``dst``.
        append: add the samples to the published store at ``dst`` as new shards, publishing the new
            manifest atomically (:mod:`fastdata.writer.append`): the backend and storage options not
            given are the store's, the schema must be the store's, and each class name maps to the
            store's index of it. A SIGKILL leaves the store as it was; ``append`` with ``resume``
            finishes an interrupted append. A dataset opened before reads on in its own version.
        add_classes: with ``append``: class names the store lacks are appended at the end of its class
            table (otherwise they are an error); the table is then no longer sorted as ImageFolder's.
        progress (bool | None): show a progress bar (default: when stderr is a terminal).
        chunk_size (int): images per worker task.
        storage_options (dict | None): fsspec options for a URL ``dst``.
        staging_dir (str | os.PathLike | None): local directory shards of a URL ``dst`` are written in first.

    Returns:
        ConvertReport: counts, rejected images (``rejected_items``) and the annotation file's
        problems (``warnings``).

    Raises:
        SourceError: the annotation file is unusable (names the file and entry).
        RejectedInputError: ``strict`` and a problem was found (names the first ones).
        ValueError: an invalid option (e.g. a negative ``workers``).
        FastdataError subclasses for the destination (exists, locked, I/O).
    """
    refuse_remote_source(ann_file, "annotation file")
    refuse_remote_source(image_dir, "image folder")
    return WriteSession(CocoInput(ann_file, image_dir), dst, WriteOptions(
        format=format, shard_size=shard_size, strict=bool(strict), workers=workers, resume=resume,
        overwrite=overwrite, append=append, add_classes=add_classes, progress=progress, chunk_size=chunk_size,
        storage_options=storage_options, staging_dir=staging_dir)).run()


def refuse_given(options: Sequence[tuple[str, Any]], what: str) -> None:
    """Raise a ValueError naming the flags of ``options`` (``(flag, value)`` pairs) that were given
    (not None), which do not apply to ``what`` (the input kind and why, for the message)."""
    given = [flag for flag, value in options if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} do(es) not apply to {what}")
