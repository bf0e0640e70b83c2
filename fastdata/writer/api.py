"""The public entry points of the writer: ``fastdata.convert(source, dst, options)``, the one
entry, and ``write``, ``convert_table``, ``convert_coco``, which build its source object and
call it (the CLI's ``convert`` is a thin layer over them).

A source is an object of :mod:`fastdata.sources` (its own options, checked when it is made)
or a path, sniffed into one by :func:`source_for_path` as ``convert`` always has: the keywords
of the older 29-keyword ``convert`` keep working and build the same objects, so a keyword
call and an object call write the same store. The options every write has are one
:class:`~fastdata.writer.options.WriteOptions` (``fastdata.WriteOptions``); keywords named
as its fields override it. The write itself is the one write session
(:class:`~fastdata.writer.session.WriteSession`): destination checks, the lock,
resume/overwrite, staging, progress, torchrun ranks, URL destinations, publishing, the report.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastdata.format.fields import Schema
from fastdata.writer.options import WriteOptions
from fastdata.remote.store import is_remote
from fastdata.writer.remote_sink import refuse_remote_source, remote_image_source
from fastdata.writer.report import ConvertReport
from fastdata.writer.sources.parquet.detect import hf_kind, parquet_files
from fastdata.writer.sources.public import (
    Coco,
    Dicom,
    ImageFolder,
    Parquet,
    Samples,
    Source,
    Table,
    Volumes,
    WebDataset,
    storage_from_keywords,
)
from fastdata.writer.sources.python import MapStyle
from fastdata.writer.sources.table.input import is_general_list
from fastdata.writer.sources.volumes.input import chunked_input
from fastdata.writer.sources.webdataset.names import tar_files

__all__ = ["SOURCE_KEYWORDS", "convert", "convert_coco", "convert_table", "source_for_path", "write"]

#: the fields of :class:`WriteOptions`, each also a keyword of every entry point
WRITE_KEYWORDS = tuple(f.name for f in dataclasses.fields(WriteOptions))
#: the keywords of ``convert`` that are options of a path's source (older calls; a source object
#: takes its own): the image storage ones, then those of the other kinds
STORAGE_KEYWORDS = ("max_side", "quality", "raw", "lossless", "storage", "raw_fraction", "raw_budget")
SOURCE_KEYWORDS = (*STORAGE_KEYWORDS, "image_mode", "dicom_tags", "schema", "chunks", "codec", "max_pixels",
                   "image_column")


def convert(
    source: Source | str | os.PathLike,
    dst: str | os.PathLike,
    options: WriteOptions | None = None,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    resume: bool | None = None,
    overwrite: bool | None = None,
    append: bool | None = None,
    progress: bool | None = None,
    **keywords: Any,
) -> ConvertReport:
    """Write a source into a store: the one entry of the writer.

    ::

        fastdata.convert(fastdata.sources.ImageFolder("train/", storage=fastdata.sources.Reencode(512)),
                         "train.lmdb", fastdata.WriteOptions(workers=8, shard_size="512MiB"))
        fastdata.convert("train/", "train.lmdb", max_side=512, workers=8)   # the same store

    Under ``torchrun`` (an initialised process group of several ranks) an :class:`ImageFolder
    <fastdata.writer.sources.public.ImageFolder>` is converted by all ranks together, shard ``k``
    by rank ``k % world_size`` (see :mod:`fastdata.writer.distributed`); the store is identical to
    a single-process one.

    Args:
        source: a source object of :mod:`fastdata.sources` (``ImageFolder``, ``Table``, ``Coco``,
            ``Parquet``, ``WebDataset``, ``Volumes``, ``Dicom``, ``Samples``), or a path, whose
            kind is sniffed (:func:`source_for_path`): a folder of class folders or a
            ``path,label`` CSV/TSV (an image folder), a JSONL list or a CSV/TSV with more columns
            (a table), NIfTI volumes (a folder, a list naming them, a Decathlon ``dataset.json``),
            Parquet files (a file, a folder or a glob), WebDataset shards (a ``.tar``, a brace
            pattern, a glob or a folder). An image folder or ``path,label`` list may be a URL
            (``s3://bucket/imgs/``, ``gs://``, ``az://``; an ``https://`` list), read where it lies
            with ``storage_options`` (see "Remote sources" in the remote guide).
        dst: destination directory, or a URL (``s3://bucket/train.lmdb``, ``gs://``, ``az://``:
            shards are staged locally and uploaded as each finishes, manifest last; see
            :mod:`fastdata.writer.remote_sink`); its suffix picks the backend unless ``format`` is given.
        options: the write's options (:class:`~fastdata.writer.options.WriteOptions`); None: the defaults.
        format, workers, shard_size, resume, overwrite, append, progress: the fields of
            ``options`` of these names, for short (None: as ``options`` has them).
        **keywords: any other field of :class:`~fastdata.writer.options.WriteOptions` (``strict``,
            ``add_classes``, ``lmdb_map_size``, ``task_size``, ``storage_options``, ``staging_dir``;
            ``chunk_size``, deprecated, is ``task_size``). With a path ``source``, also the older
            keywords of its kind's options, which build the source object: ``max_side``, ``quality``,
            ``raw`` (``"HxW"``), ``lossless``, ``storage`` (``"raw"``, ``"mixed"``), ``raw_fraction``,
            ``raw_budget`` (the :class:`ImageStorage <fastdata.writer.sources.public.ImageStorage>`
            objects), ``image_mode``, ``dicom_tags`` (a ``Dicom`` source), ``schema`` (a ``Table``),
            ``chunks``, ``codec``, ``max_pixels`` (``Volumes``), ``image_column`` (``Parquet``'s
            ``image_columns``). A keyword that does not apply to the source's kind is an error.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        TypeError: an unknown keyword, or a value of the wrong type (naming it).
        ValueError: conflicting or invalid options (e.g. ``resume`` with ``overwrite``, a negative
            ``workers``), or a keyword that does not apply to the source (naming it and the kind).
        MissingExtraError: NIfTI volumes without nibabel (``pip install 'fastdata[volumes]'``), Parquet
            files without pyarrow (``pip install 'fastdata[parquet]'``).
        FastdataError subclasses, each naming the file or store at fault.
    """
    unknown = [name for name in keywords if name not in WRITE_KEYWORDS + SOURCE_KEYWORDS + ("chunk_size",)]
    if unknown:
        raise TypeError(f"convert() got an unexpected keyword argument {unknown[0]!r} (its keywords are the fields "
                        "of fastdata.WriteOptions and, for a path source, the options of its kind)")
    source_keywords = {name: keywords.pop(name) for name in SOURCE_KEYWORDS if name in keywords}
    shorthands = {"format": format, "workers": workers, "shard_size": shard_size, "resume": resume,
                  "overwrite": overwrite, "append": append, "progress": progress}
    given = {name: value for name, value in {**shorthands, **keywords}.items() if value is not None}
    write_options = _write_options(options, given)
    if isinstance(source, Source):
        misplaced = [name for name, value in source_keywords.items() if value is not None]
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)} do(es) not apply to a source object ({type(source).__name__}, "
                             f"{source.kind}): a source takes its own options, e.g. fastdata.sources."
                             f"{type(source).__name__}(...)")
        return source.write(dst, write_options)
    kind = hf_kind(source)
    if kind is not None:
        raise ValueError(f"convert takes a path; a datasets.{kind} is written with fastdata.write(ds, dst) or "
                         "convert(fastdata.sources.Samples(ds), dst) (split= for a DatasetDict)")
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"source must be a path or a fastdata.sources object, got {type(source).__name__} (Python "
                        "samples: fastdata.sources.Samples(samples))")
    return source_for_path(source, storage_options=write_options.storage_options,
                           **source_keywords).write(dst, write_options)


def _write_options(options: WriteOptions | None, given: Mapping[str, Any], caller: str = "convert",
                   stacklevel: int = 3) -> WriteOptions:
    """``options`` (None: the defaults) with the fields ``given`` by keyword replaced; ``chunk_size``
    is ``task_size`` with a DeprecationWarning (``stacklevel``: the caller's frame)."""
    if options is not None and not isinstance(options, WriteOptions):
        raise TypeError(f"options must be a fastdata.WriteOptions, got {type(options).__name__} (keywords such as "
                        "workers=8 are given to the call itself)")
    given = dict(given)
    if given.get("chunk_size") is not None:
        chunk_size = given.pop("chunk_size")
        warnings.warn(f"{caller}(chunk_size=) is deprecated: it is the number of inputs per worker task, now named "
                      "task_size (chunks is an array's chunk shape)", DeprecationWarning, stacklevel=stacklevel)
        if given.get("task_size", chunk_size) != chunk_size:
            raise ValueError(f"chunk_size (deprecated) and task_size name one option: give task_size only, got "
                             f"chunk_size={chunk_size!r}, task_size={given['task_size']!r}")
        given["task_size"] = chunk_size
    given.pop("chunk_size", None)
    return WriteOptions(**given) if options is None else dataclasses.replace(options, **given)


def _given(given: Mapping[str, Any]) -> list[str]:
    """``name=value`` for each keyword of ``given`` that is set (not None), a string quoted."""
    return [f'{name}="{value}"' if isinstance(value, str) else f"{name}={value!r}"
            for name, value in given.items() if value is not None]


def _refuse(given: Mapping[str, Any], kind: str, why: str) -> None:
    """Raise a ValueError naming the keywords of ``given`` that are set (not None), which do not
    apply to ``kind`` (the source kind), and ``why``."""
    named = _given(given)
    if named:
        raise ValueError(f"{', '.join(named)} do(es) not apply to {kind}: {why}")


def source_for_path(
    src: str | os.PathLike,
    *,
    max_side: int | None = None,
    quality: int | None = None,
    raw=None,
    lossless: str | None = None,
    storage: str | None = None,
    raw_fraction: float | None = None,
    raw_budget: int | str | None = None,
    image_mode: str | None = None,
    dicom_tags: str | list[str] | None = None,
    schema=None,
    chunks: str | Sequence[int] | None = None,
    codec: str | None = None,
    max_pixels: int | str | None = None,
    image_column: str | Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Source:
    """The source object a path is, with ``convert``'s older keywords as its options.

    A URL (``s3://``, ``gs://``, ``az://``, ``https://``) is read remotely: a ``.jsonl`` list (or
    any list given ``schema``) as a table, a ``.csv``/``.tsv`` as a ``path,label`` list, a
    ``.parquet`` file or glob as Parquet files (a folder of them: :class:`~fastdata.sources.Parquet`),
    a ``.tar`` URL, brace pattern or glob, or a prefix holding ``.tar`` objects and no "subfolder"
    (one listing page is read to tell, with ``storage_options``), as WebDataset shards, anything
    else as an image folder prefix; other kinds of input are refused from a URL
    (:class:`~fastdata.errors.RemotePathError`). For a path, the kind is sniffed in this order:
    Parquet files, WebDataset shards, NIfTI volumes (or a folder given ``chunks``/``max_pixels``:
    TIFF images as chunked arrays), a list with more fields than ``path,label`` (or ``schema``
    given), a folder with ``dicom_tags``, else an image folder or ``path,label`` list.

    Returns:
        Source: a :mod:`fastdata.sources` object.

    Raises:
        ValueError: a keyword that does not apply to the kind found (naming it and the kind), or
            an invalid value.
    """
    src = os.fspath(src)
    if is_remote(src):
        _refuse({"max_pixels": max_pixels, "image_column": image_column}, "a URL source",
                "TIFF images are read from local files; Parquet columns are named with fastdata.sources.Parquet")
        images = {"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless, "storage": storage,
                  "raw_fraction": raw_fraction, "raw_budget": raw_budget, "image_mode": image_mode}
        if dicom_tags is not None:
            _refuse({**{k: v for k, v in images.items() if k != "image_mode"}, "schema": schema, "chunks": chunks,
                     "codec": codec}, "a DICOM folder with tags", "each DICOM file's bytes are kept as they are")
            return Dicom(src, dicom_tags, image_mode=image_mode)
        if chunks is not None or codec is not None:  # (a folder of NIfTI volumes)
            _refuse({**images, "schema": schema}, "NIfTI volumes", "every value is stored exactly as read")
            return Volumes(src, chunks=chunks, codec=codec)
        from fastdata.writer.sources.volumes.remote import holds_volumes, is_remote_volume_list

        lower = src.rstrip("/").lower()
        if lower.endswith(".json") or (schema is None and is_remote_volume_list(src, storage_options or {})):
            _refuse({**images, "schema": schema}, "NIfTI volumes", "every value is stored exactly as read")
            return Volumes(src, chunks=chunks, codec=codec)  # (a volume list, a Decathlon dataset.json)
        if lower.endswith((".jsonl", ".ndjson")) or schema is not None:
            _refuse({"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless, "storage": storage,
                     "raw_fraction": raw_fraction, "raw_budget": raw_budget, "image_mode": image_mode},
                    "a list with more fields than path,label", "each image's bytes are kept as they are")
            return Table(src, schema=schema)
        if lower.endswith(".parquet"):  # a file or a glob of them (a folder: sources.Parquet)
            _refuse({"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless, "storage": storage,
                     "raw_fraction": raw_fraction, "raw_budget": raw_budget, "image_mode": image_mode,
                     "schema": schema}, "Parquet files",
                    "every column becomes a field and image bytes are stored as they are")
            return Parquet(src)
        from fastdata.remote.location import RemoteLocation
        from fastdata.remote.sources import first_listing_page
        from fastdata.writer.sources.webdataset.remote import holds_tars, is_tar_url

        page = None
        if not is_tar_url(src) and remote_image_source(src) and not lower.endswith((".csv", ".tsv")):
            # one listing page tells a prefix of tars, of volumes or of images apart
            page = first_listing_page(RemoteLocation(src, dict(storage_options or {})))
        if is_tar_url(src) or holds_tars(page):
            _refuse({"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless, "storage": storage,
                     "raw_fraction": raw_fraction, "raw_budget": raw_budget, "image_mode": image_mode,
                     "schema": schema}, "WebDataset shards",
                    "every member extension becomes a field and image bytes are stored as they are")
            return WebDataset(src)
        if holds_volumes(page):
            _refuse({**images, "schema": schema}, "NIfTI volumes", "every value is stored exactly as read")
            return Volumes(src, chunks=chunks, codec=codec)
        if not remote_image_source(src):
            refuse_remote_source(src)
        return ImageFolder(src, storage=storage_from_keywords(
            max_side=max_side, quality=quality, raw=raw, lossless=lossless, storage=storage,
            raw_fraction=raw_fraction, raw_budget=raw_budget), image_mode=image_mode)
    images = {"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless, "storage": storage,
              "raw_fraction": raw_fraction, "raw_budget": raw_budget, "image_mode": image_mode,
              "dicom_tags": dicom_tags}
    kept = "every value is stored exactly as read"
    if parquet_files(src) is not None:
        _refuse({**images, "schema": schema, "chunks": chunks, "codec": codec, "max_pixels": max_pixels},
                "Parquet files", "every column becomes a field and image bytes are stored as they are")
        return Parquet(src, image_columns=image_column)
    if image_column is not None:
        raise ValueError(f"{src}: image_column applies to Parquet files (a .parquet file, a folder or a glob of them)")
    if tar_files(src) is not None:
        _refuse({**images, "schema": schema, "chunks": chunks, "codec": codec, "max_pixels": max_pixels},
                "WebDataset shards", "every member extension becomes a field and image bytes are stored as they are")
        return WebDataset(src)
    if chunked_input(src, chunks=chunks, codec=codec, max_pixels=max_pixels) is not None:
        _refuse({**images, "schema": schema}, "chunked arrays (NIfTI volumes, TIFF images with chunks/max_pixels)",
                kept)
        return Volumes(src, chunks=chunks, codec=codec, max_pixels=max_pixels)
    if chunks is not None or codec is not None or max_pixels is not None:
        raise ValueError(f"{src}: chunks/codec/max_pixels apply to NIfTI volumes (a folder, a list naming "
                         ".nii/.nii.gz files, a dataset.json) and to folders of TIFF images")
    if is_general_list(src, schema):
        _refuse(images, "a list with more fields than path,label", "each image's bytes are kept as they are (leave "
                "them out; declare Image(mode=...) in schema for a default read mode)")
        return Table(src, schema=schema)
    if dicom_tags is not None:
        storage_given = _given({name: images[name] for name in STORAGE_KEYWORDS})
        if storage_given:
            raise ValueError(f"dicom_tags keeps each DICOM file's bytes as they are: leave out "
                             f"{', '.join(storage_given)}")
        return Dicom(src, dicom_tags, image_mode=image_mode)
    return ImageFolder(src, storage=storage_from_keywords(
        max_side=max_side, quality=quality, raw=raw, lossless=lossless, storage=storage, raw_fraction=raw_fraction,
        raw_budget=raw_budget), image_mode=image_mode)


def convert_table(src: str | os.PathLike, dst: str | os.PathLike, *, schema=None,
                  options: WriteOptions | None = None, **keywords: Any) -> ConvertReport:
    """Convert a JSONL or CSV/TSV list with any fields into a general (layout version 2) store:
    ``convert(fastdata.sources.Table(src, schema=schema), dst, options, **keywords)``.

    The list is parsed by :func:`fastdata.writer.sources.table.reader.scan_table` (fields typed by
    inference or by ``schema``); workers read and fully decode each row's image and encode the row
    (:mod:`fastdata.writer.sources.table.input`). Records keep the image path as written in the
    list. Unreadable images are rejected and reported (``strict`` stops at the first). The
    manifest holds every class field's table under ``class_tables`` and the single-label one's
    under ``classes``, with ``class_counts``. It converts in one process (and its workers): not
    under ``torchrun``.

    Args:
        src (str | os.PathLike): the list file.
        dst (str | os.PathLike): the destination, as for :func:`convert`.
        schema: as :func:`fastdata.writer.sources.table.spec.parse_schema`.
        options (WriteOptions | None): the write's options.
        **keywords: fields of :class:`~fastdata.writer.options.WriteOptions`, overriding ``options``.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        SourceError: the list is missing or has bad rows (all named with line numbers).
        SchemaError: the schema spec is malformed.
        ValueError: ``src`` is a folder, or the call runs under ``torchrun``, or an option is invalid.
        FastdataError subclasses for the destination, resume and I/O, as :func:`convert`.
    """
    return Table(src, schema=schema).write(dst, _entry_options("convert_table", options, keywords))


def write(samples: Iterable[Mapping[str, Any]] | MapStyle, dst: str | os.PathLike,
          schema: Schema | Mapping[str, Any] | None = None, *, options: WriteOptions | None = None,
          metadata: Mapping[str, Any] | None = None, split: str | None = None, **keywords: Any) -> ConvertReport:
    """Write ``samples`` (dicts of field name -> value) into a general fastdata store:
    ``convert(fastdata.sources.Samples(samples, schema, metadata=..., split=...), dst, options, **keywords)``.

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
        options (WriteOptions | None): the write's options. ``resume`` finishes an interrupted
            write of the same map-style dataset (same length, schema and sampled contents, see
            :class:`~fastdata.writer.sources.python.MapInput`); an iterable cannot be resumed.
            ``strict`` is True unless given: an unusable image value stops the write; False: that
            sample is skipped and reported (``report.rejected_items``, the manifest's ``rejected``
            list and ``rejected.tsv``, named ``sample <index>``; map-style inputs only, an
            iterable is always strict).
        metadata: a JSON object stored in the manifest under ``"metadata"`` (e.g. class
            names, a COCO file's categories); part of what ``resume`` compares.
        split: the split of a ``datasets.DatasetDict`` to write (``"train"``); only for one.
        **keywords: fields of :class:`~fastdata.writer.options.WriteOptions` (``format``,
            ``workers``, ``shard_size``, ``resume``, ...), overriding ``options``.

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
    source = Samples(samples, schema, metadata=metadata, split=split)
    return source.write(dst, _entry_options("write", options, keywords))


def convert_coco(ann_file: str | os.PathLike, image_dir: str | os.PathLike, dst: str | os.PathLike, *,
                 options: WriteOptions | None = None, **keywords: Any) -> ConvertReport:
    """Convert a COCO instances annotation file and its image folder into a store:
    ``convert(fastdata.sources.Coco(ann_file, image_dir), dst, options, **keywords)``.

    One sample per image, in ``torchvision.datasets.CocoDetection``'s order, with the fields
    of :data:`~fastdata.writer.sources.coco.COCO_SCHEMA` (see :mod:`fastdata.writer.sources.coco`).

    Args:
        ann_file (str | os.PathLike): the COCO annotation JSON (``instances_*.json``).
        image_dir (str | os.PathLike): the folder the images' ``file_name`` is relative to.
        dst (str | os.PathLike): destination directory, or a URL (``s3://bucket/coco.lmdb``, uploaded as
            :func:`fastdata.write` does); its suffix picks the backend unless ``format`` is given.
        options (WriteOptions | None): the write's options. ``strict`` stops, before writing
            anything, at any problem of the annotation file or a missing image (and at an unusable
            image while writing); default False: skip and report them.
        **keywords: fields of :class:`~fastdata.writer.options.WriteOptions`, overriding ``options``.

    Returns:
        ConvertReport: counts, rejected images (``rejected_items``) and the annotation file's
        problems (``warnings``).

    Raises:
        SourceError: the annotation file is unusable (names the file and entry).
        RejectedInputError: ``strict`` and a problem was found (names the first ones).
        ValueError: an invalid option (e.g. a negative ``workers``).
        FastdataError subclasses for the destination (exists, locked, I/O).
    """
    return Coco(ann_file, image_dir).write(dst, _entry_options("convert_coco", options, keywords))


def _entry_options(caller: str, options: WriteOptions | None, keywords: Mapping[str, Any]) -> WriteOptions:
    """The options of ``write``/``convert_table``/``convert_coco``: ``options`` with the keywords
    (fields of :class:`WriteOptions`, given as not None) replacing its fields."""
    unknown = [name for name in keywords if name not in WRITE_KEYWORDS + ("chunk_size",)]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} (its keywords are the "
                        "fields of fastdata.WriteOptions)")
    return _write_options(options, {name: value for name, value in keywords.items() if value is not None}, caller,
                          stacklevel=4)
