"""The public source classes, one per input kind, and the image storage objects
(``fastdata.sources`` re-exports them; see that module for why they look as they do).

Each class takes only its own options, checks them when it is made (a ValueError or
TypeError naming the parameter) and builds the internal
:class:`~fastdata.writer.sources.base.WriteSource` of its input when
:func:`fastdata.convert` runs it: the logic stays in the write sources, these are the typed
front of them. ``fastdata.convert(path, dst, **keywords)`` sniffs a path into one of these
(:func:`fastdata.writer.api.source_for_path`), so a keyword call and an object call run the
same code.
"""

from __future__ import annotations

import abc
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from fastdata.common.extras import require
from fastdata.common.imagemodes import check_mode
from fastdata.common.paths import check_local_path
from fastdata.errors import RejectedInputError, RemotePathError
from fastdata.format.backends.base import MIN_RAW_MAX_SIDE
from fastdata.format.chunk_codecs import CHUNK_CODECS
from fastdata.format.fields import Schema
from fastdata.writer.options import LOSSLESS_CODECS, WriteOptions, parse_raw_budget, parse_raw_shape, storage_spec
from fastdata.writer.pipeline import ExecutorFactory
from fastdata.remote.store import is_remote
from fastdata.writer.report import ConvertReport
from fastdata.writer.session import WriteSession
from fastdata.writer.sources.base import WriteSource
from fastdata.writer.sources.coco import CocoInput
from fastdata.writer.sources.dicom import DicomFolderInput, parse_dicom_tags
from fastdata.writer.sources.folder import FolderInput
from fastdata.writer.sources.parquet.detect import hf_kind, parquet_files
from fastdata.writer.sources.remote import list_names_urls, RemoteFolderInput, RemoteTableInput
from fastdata.writer.sources.python import IterInput, MapInput, MapStyle, is_map_style
from fastdata.writer.sources.table.input import TableInput
from fastdata.writer.sources.volumes.input import (
    BOMB_HINT,
    TiffImageInput,
    chunked_input,
    parse_chunks,
    parse_max_pixels,
)
from fastdata.writer.sources.volumes.scan import names_urls
from fastdata.writer.sources.webdataset.input import TarInput
from fastdata.writer.sources.webdataset.names import tar_files

__all__ = [
    "Coco", "Dicom", "FixedSizePixels", "ImageFolder", "ImageStorage", "Lossless", "MixedPixels", "NativeSizePixels",
    "Parquet", "Reencode", "Samples", "Source", "Table", "Volumes", "WebDataset",
]


# --------------------------------------------------------------------------- checks


def _path(value: object, name: str) -> str:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty path, got {value!r}")
    return path


def _whole(value: object, name: str, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int ({what}), got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum} ({what}), got {value!r}")
    return int(value)


def _budget(value: object, name: str) -> int | str | None:
    if value is None:
        return None
    try:
        parse_raw_budget(value)
    except ValueError:
        raise ValueError(f"{name} must be a positive size such as \"200GB\" or a byte count (the most bytes the "
                         f"images may take), got {value!r}") from None
    return value  # type: ignore[return-value]  # a size parse_raw_budget accepts: an int or a str


def _names(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    """Names given as ``"a,b"``, ``["a", "b"]`` or None, as a tuple without repeats."""
    if value is None:
        return ()
    if not isinstance(value, str | Sequence) or any(not isinstance(v, str) for v in ([value] if isinstance(
            value, str) else value)):
        raise TypeError(f"{name} must be a name, a comma-separated string of names or a list of names, got {value!r}")
    items = [value] if isinstance(value, str) else list(value)
    names = (part.strip() for item in items for part in item.split(","))
    return tuple(dict.fromkeys(n for n in names if n))


# --------------------------------------------------------------------------- image storage


class ImageStorage(abc.ABC):
    """How an :class:`ImageFolder`'s images are stored. Without one (``storage=None``) each file's
    bytes are kept as they are (validated), or, resuming or appending, as the store already does."""

    @abc.abstractmethod
    def keywords(self) -> dict[str, Any]:
        """The storage keywords of :func:`fastdata.convert` meaning the same (``max_side``,
        ``quality``, ``raw``, ``lossless``, ``storage``, ``raw_fraction``, ``raw_budget``)."""


@dataclass(frozen=True)
class Reencode(ImageStorage):
    """Images whose longer side exceeds ``max_side`` scaled down and re-encoded as JPEG; the
    others kept as they are.

    Args:
        max_side (int): the longest side kept, in pixels (positive).
        quality (int): the JPEG quality, 1 to 100 (default 90).

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    max_side: int
    quality: int = 90

    def __post_init__(self) -> None:
        _whole(self.max_side, "max_side", 1, "the longest side kept, in pixels")
        if _whole(self.quality, "quality", 1, "the JPEG quality, 1 to 100") > 100:
            raise ValueError(f"quality must be within 1..100, got {self.quality!r}")

    def keywords(self) -> dict[str, Any]:
        return {"max_side": int(self.max_side), "quality": int(self.quality)}


@dataclass(frozen=True)
class Lossless(ImageStorage):
    """Every image but JPEG, WebP and DICOM files re-encoded as a zstd TIFF of its unchanged pixels,
    checked bit-exact while converting (16-bit PNGs then decode several times faster).

    Args:
        codec (str): ``"tiff"``, the one there is.

    Raises:
        ValueError: another codec.
    """

    codec: str = "tiff"

    def __post_init__(self) -> None:
        if self.codec not in LOSSLESS_CODECS:
            raise ValueError(f"codec must be one of {', '.join(map(repr, LOSSLESS_CODECS))}, got {self.codec!r}")

    def keywords(self) -> dict[str, Any]:
        return {"lossless": self.codec}


@dataclass(frozen=True, init=False)
class FixedSizePixels(ImageStorage):
    """Every image decoded to RGB and resized to one ``size`` (squashed: the aspect ratio is not
    kept), stored as pixels: a fixed-shape store whose reads need no decode (for small images
    such as CIFAR's). ``convert(raw="HxW")`` in keywords.

    Args:
        size (int | tuple[int, int]): ``(height, width)``, or one side for a square.

    Raises:
        TypeError, ValueError: not one or two positive ints.
    """

    size: tuple[int, int]

    def __init__(self, size: int | tuple[int, int]):
        sides = (size, size) if isinstance(size, numbers.Integral) and not isinstance(size, bool) else size
        if (not isinstance(sides, tuple | list) or len(sides) != 2
                or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in sides)):
            raise TypeError(f"size must be an int or a (height, width) pair of ints, got {size!r}")
        if min(sides) < 1:
            raise ValueError(f"size must be positive, got {size!r}")
        object.__setattr__(self, "size", parse_raw_shape(tuple(int(s) for s in sides)))

    def keywords(self) -> dict[str, Any]:
        return {"raw": self.size}


@dataclass(frozen=True)
class NativeSizePixels(ImageStorage):
    """Every image's decoded RGB pixels at its own size, the longer side scaled down to at most
    ``max_side``: records readers use without decoding. ``convert(storage="raw")`` in keywords.

    Args:
        max_side (int): the longest side stored (at least 32: a random crop needs pixels to
            choose from); it bounds the disk the pixels take.
        budget (int | str | None): the most bytes the images may take (``"200GB"`` or a byte
            count): a source whose pixels do not fit is refused before anything is written.

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    max_side: int
    budget: int | str | None = None

    def __post_init__(self) -> None:
        _whole(self.max_side, "max_side", MIN_RAW_MAX_SIDE, "the longest side of the stored pixels")
        _budget(self.budget, "budget")

    def keywords(self) -> dict[str, Any]:
        return {"storage": "raw", "max_side": int(self.max_side), "raw_budget": self.budget}


@dataclass(frozen=True)
class MixedPixels(ImageStorage):
    """Some images stored as :class:`NativeSizePixels` does, the others as their original bytes:
    a share ``fraction`` of them (picked by a hash of the relative path), or as many as
    ``budget`` bytes hold (those whose decode saves the most time per extra byte: high-quality
    JPEGs first). Give one of ``fraction`` and ``budget``. ``convert(storage="mixed")`` in keywords.

    Args:
        max_side (int): the longest side of the images stored as pixels (at least 32).
        fraction (float | None): the share of images stored as pixels, 0 to 1.
        budget (int | str | None): the most bytes the images may take (``"200GB"`` or a byte count).

    Raises:
        TypeError, ValueError: naming the parameter; both or neither of ``fraction`` and ``budget``.
    """

    max_side: int
    fraction: float | None = None
    budget: int | str | None = None

    def __post_init__(self) -> None:
        _whole(self.max_side, "max_side", MIN_RAW_MAX_SIDE, "the longest side of the stored pixels")
        if (self.fraction is None) == (self.budget is None):
            raise ValueError("give one of fraction (the share of images stored as pixels, 0 to 1) and budget (as "
                             "many as fit in it, e.g. \"200GB\")")
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, numbers.Real):
                raise TypeError(f"fraction must be a number from 0 to 1, got {self.fraction!r}")
            if not 0.0 <= float(self.fraction) <= 1.0:  # (NaN fails this too)
                raise ValueError(f"fraction must be from 0 to 1 (the share of images stored as pixels), got "
                                 f"{self.fraction!r}")
        _budget(self.budget, "budget")

    def keywords(self) -> dict[str, Any]:
        return {"storage": "mixed", "max_side": int(self.max_side),
                "raw_fraction": None if self.fraction is None else float(self.fraction), "raw_budget": self.budget}


def storage_from_keywords(*, max_side: int | None = None, quality: int | None = None, raw=None,
                          lossless: str | None = None, storage: str | None = None, raw_fraction: float | None = None,
                          raw_budget: int | str | None = None) -> ImageStorage | None:
    """The :class:`ImageStorage` that ``convert``'s storage keywords mean (None: none given).

    The keywords are checked by :func:`fastdata.writer.options.storage_spec` first, so that a
    message names them (``max_side``, ``raw_budget``), not the object's parameters.

    Raises:
        ValueError: options of two storage modes, or an invalid value.
    """
    given = (max_side, quality, raw, lossless, storage, raw_fraction, raw_budget)
    if all(v is None for v in given):
        return None
    spec = storage_spec(*given)
    if storage is not None:
        assert max_side is not None  # (storage_spec requires it)
        pixels = {"raw": lambda: NativeSizePixels(int(max_side), budget=raw_budget),
                  "mixed": lambda: MixedPixels(int(max_side), fraction=spec.raw_fraction, budget=raw_budget)}
        return pixels[storage]()
    if lossless is not None:
        return Lossless(lossless)
    if raw is not None:
        assert spec.raw_shape is not None
        return FixedSizePixels(spec.raw_shape)
    assert spec.max_side is not None and spec.quality is not None
    return Reencode(spec.max_side, spec.quality)


# --------------------------------------------------------------------------- sources


class Source(abc.ABC):
    """One input of :func:`fastdata.convert`: a subclass per input kind."""

    #: the input kind, as messages name it ("an image folder")
    kind: ClassVar[str] = "a source"
    #: ``strict`` when :class:`~fastdata.writer.options.WriteOptions` leaves it None; None: the
    #: interrupted write's recorded value on resume, else False
    default_strict: ClassVar[bool | None] = None

    @abc.abstractmethod
    def write_source(self) -> WriteSource:
        """A new internal write source of this input (what the write session runs; one per write).

        Raises:
            FastdataError, ValueError: the input is not of this kind or cannot be read.
        """

    def write(self, dst: str | os.PathLike, options: WriteOptions, *,
              executor_factory: ExecutorFactory | None = None) -> ConvertReport:
        """Write this input into ``dst`` with ``options`` (what :func:`fastdata.convert` does).

        Args:
            dst (str | os.PathLike): the destination, as for :func:`fastdata.convert`.
            options (WriteOptions): the write's options.
            executor_factory (ExecutorFactory | None): makes the worker pool when ``options.workers``
                asks for worker processes (:data:`fastdata.writer.pipeline.ExecutorFactory`, given to
                :class:`~fastdata.writer.session.WriteSession`); None: a
                :class:`concurrent.futures.ProcessPoolExecutor`.

        Returns:
            ConvertReport: what was written.
        """
        if options.strict is None and self.default_strict is not None:
            options = replace(options, strict=self.default_strict)
        return WriteSession(self.write_source(), dst, options, executor_factory=executor_factory).run()


class ImageFolder(Source):
    """A classification set: an ImageFolder tree (``root/<class>/<image>``, classes sorted as
    torchvision's ``ImageFolder`` sorts them) or a CSV/TSV list of ``path,label`` rows. Under
    ``torchrun`` all ranks convert it together.

    Args:
        path (str | os.PathLike): the folder or the list file (a local list's rows may all name
            URLs: see "Remote sources" in the remote guide).
        storage (ImageStorage | None): how the images are stored: :class:`Reencode`,
            :class:`Lossless`, :class:`FixedSizePixels`, :class:`NativeSizePixels`,
            :class:`MixedPixels`; None: each file's bytes as they are (resuming or appending:
            as the interrupted write or the store does).
        image_mode (str | None): the default read mode recorded for the images (``"RGB"``,
            ``"L"``, ``"RGBA"`` or ``"unchanged"``; a reader's ``image_mode=`` overrides it).
            None: ``"unchanged"`` for DICOM images, else the reader's default (RGB).
        storage_options (Mapping | None): fsspec options for a URL ``path`` (``s3://bucket/train/``,
            ``gs://``, ``az://``, or an ``https://`` list file) and for the URLs a list's rows name;
            None: the write's ``storage_options``. See "Remote sources" in the remote guide.

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    kind = "an image folder or path,label list"

    def __init__(self, path: str | os.PathLike, *, storage: ImageStorage | None = None,
                 image_mode: str | None = None, storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options
        if storage is not None and not isinstance(storage, ImageStorage):
            raise TypeError(f"storage must be an ImageStorage (Reencode, Lossless, FixedSizePixels, NativeSizePixels, "
                            f"MixedPixels) or None, got {storage!r}")
        self.storage = storage
        self.image_mode = None if image_mode is None else check_mode(image_mode, "image_mode")

    def write_source(self) -> FolderInput:
        keywords = self.storage.keywords() if self.storage is not None else {}
        if is_remote(self.path) or list_names_urls(self.path):  # (a list at a URL, or a local one naming URLs)
            return RemoteFolderInput(self.path, storage_options=self.storage_options, image_mode=self.image_mode,
                                     **keywords)
        if self.storage_options is not None:
            raise ValueError(f"{self.path}: storage_options apply to a URL source (s3://, gs://, az://, https://), "
                             "not to a local path")
        check_local_path(self.path, "source")
        return FolderInput(self.path, image_mode=self.image_mode,
                           **(self.storage.keywords() if self.storage is not None else {}))

    def write(self, dst: str | os.PathLike, options: WriteOptions, *,
              executor_factory: ExecutorFactory | None = None) -> ConvertReport:
        """As :meth:`Source.write`; an image refused by the decompression-bomb limit says how
        to store large TIFF images instead (:class:`Volumes`)."""
        try:
            report = super().write(dst, options, executor_factory=executor_factory)
        except RejectedInputError as err:
            if "decompression bomb" in str(err):
                raise RejectedInputError(f"{err}; {BOMB_HINT}") from None
            raise
        bombs = sum(1 for _, reason in report.rejected_items if "decompression bomb" in reason)
        if bombs:
            report.notes.append(f"{bombs} image(s) refused by the decompression-bomb limit: {BOMB_HINT}")
        return report


class Dicom(Source):
    """A folder of class folders of DICOM files kept with some of their tags: a general store of
    fields ``image``, ``label`` and one JSON field per tag (each file's bytes kept as they are).
    Without tags, a DICOM folder is an :class:`ImageFolder`.

    Args:
        path (str | os.PathLike): the folder.
        tags (str | Sequence[str]): DICOM keywords (``["RescaleSlope", "PixelSpacing"]`` or
            ``"RescaleSlope,PixelSpacing"``).
        image_mode (str | None): the images' default read mode (``Image(mode=...)``); None:
            ``"unchanged"``.
        storage_options (Mapping | None): fsspec options for a URL ``path`` (``s3://``, ``gs://``,
            ``az://``: each file fetched whole by the worker that encodes it); None: the write's
            ``storage_options``.

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    kind = "a DICOM folder with tags"

    def __init__(self, path: str | os.PathLike, tags: str | Sequence[str], *, image_mode: str | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options
        self.image_mode = None if image_mode is None else check_mode(image_mode, "image_mode")
        if not isinstance(tags, str | Sequence) or not all(isinstance(t, str) for t in
                                                            ([tags] if isinstance(tags, str) else tags)):
            raise TypeError(f"tags must be DICOM keywords: a comma-separated string or a list of strings, got {tags!r}")
        self.tags = tuple(parse_dicom_tags(tags))

    def write_source(self) -> DicomFolderInput:
        if is_remote(self.path):
            from fastdata.writer.sources.remote_dicom import RemoteDicomFolderInput

            return RemoteDicomFolderInput(self.path, list(self.tags), self.image_mode,
                                          storage_options=self.storage_options)
        if self.storage_options is not None:
            raise ValueError(f"{self.path}: storage_options apply to a URL source (s3://, gs://, az://), not to a "
                             "local path")
        check_local_path(self.path, "source")
        return DicomFolderInput(self.path, list(self.tags), self.image_mode)


class Table(Source):
    """A JSONL list, or a CSV/TSV list with more fields than ``path,label``: a general store with a
    field per column, each image's bytes kept as they are (read and fully decoded once to check
    them). Converts in one process (and its workers), not under ``torchrun``.

    Args:
        path (str | os.PathLike): the list file, or its URL (``s3://``, ``gs://``, ``az://``,
            ``https://``; rows then name URLs or keys relative to the list's folder; one image
            field: see "Remote sources" in the remote guide). A local list's rows may all name URLs.
        schema: the declared fields (an inline spec, a JSON file's path, or a loaded JSON value;
            :func:`fastdata.writer.sources.table.spec.parse_schema`); None: inferred from the rows.
        storage_options (Mapping | None): fsspec options for a URL ``path`` and the URLs its rows
            name; None: the write's.

    Raises:
        TypeError: ``path`` is not a path.
    """

    kind = "a list file (JSONL/CSV/TSV)"

    def __init__(self, path: str | os.PathLike, *, schema: Any = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        self.schema = schema
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options

    def write_source(self) -> TableInput:
        if is_remote(self.path) or list_names_urls(self.path):  # (a list at a URL, or a local one naming URLs)
            return RemoteTableInput(self.path, self.schema, storage_options=self.storage_options)
        check_local_path(self.path, "source")
        if os.path.isdir(self.path):
            raise ValueError(f"{self.path} is a folder: a Table (schema) is a JSONL/CSV/TSV list file (path plus "
                             "fields)")
        return TableInput(self.path, self.schema)


class Coco(Source):
    """A COCO instances annotation file and its image folder: one sample per image, in
    ``torchvision.datasets.CocoDetection``'s order, with the fields of
    :data:`~fastdata.writer.sources.coco.COCO_SCHEMA`. Problems of the file and missing images are
    reported and skipped unless ``strict`` (which then stops before writing anything).

    Args:
        annotations (str | os.PathLike): the annotation JSON (``instances_*.json``), or its URL.
        images (str | os.PathLike): the folder the images' ``file_name`` is relative to, or its
            URL (with a URL or a local ``annotations``; a local folder needs a local ``annotations``).
        storage_options (Mapping | None): fsspec options for URLs (``s3://``, ``gs://``, ``az://``,
            ``https://``); None: the write's ``storage_options``. See "Remote sources" in the
            remote guide.

    Raises:
        TypeError, ValueError: not paths, or an annotation URL beside a local image folder.
    """

    kind = "a COCO annotation file"
    default_strict = False

    def __init__(self, annotations: str | os.PathLike, images: str | os.PathLike, *,
                 storage_options: Mapping[str, Any] | None = None):
        self.annotations = _path(annotations, "annotations")
        self.images = _path(images, "images")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options

    def write_source(self) -> CocoInput:
        if is_remote(self.annotations) or is_remote(self.images):
            if not is_remote(self.images):
                raise ValueError(f"annotation file {self.annotations} and image folder {self.images}: an annotation "
                                 "file at a URL is read with its images at a URL; give the image folder's URL, or a "
                                 "local copy of the annotation file")
            from fastdata.writer.sources.remote_coco import RemoteCocoInput

            return RemoteCocoInput(self.annotations, self.images, storage_options=self.storage_options)
        if self.storage_options is not None:
            raise ValueError(f"{self.annotations}: storage_options apply to URL sources (s3://, gs://, az://, "
                             "https://), not to local paths")
        return CocoInput(self.annotations, self.images)


class Parquet(Source):
    """Parquet files (a ``.parquet`` file, a folder of them, a glob such as
    ``data/train-*.parquet``, or a Hugging Face dataset folder): a general store with a field per
    column, image bytes kept as they are and ``ClassLabel`` names kept. Needs pyarrow.

    Args:
        path (str | os.PathLike): the file, folder or glob.
        image_columns (str | Sequence[str] | None): columns to store as images besides those
            recognised (a Hugging Face image struct, a binary column whose first value is an
            image): a name, a comma-separated list or a list of names; each a binary,
            ``struct<bytes, path>`` or file path column.
        storage_options (Mapping | None): fsspec options for a URL ``path`` (``s3://``, ``gs://``,
            ``az://``); None: the write's ``storage_options``. From a URL, images must be stored in
            the files (not named by path). See "Remote sources" in the remote guide.

    Raises:
        TypeError: naming the parameter.
    """

    kind = "Parquet files"

    def __init__(self, path: str | os.PathLike, *, image_columns: str | Sequence[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        self.image_columns = _names(image_columns, "image_columns")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options

    def write_source(self) -> WriteSource:
        if is_remote(self.path):
            require("pyarrow", "converting Parquet files")
            from fastdata.writer.sources.remote_parquet import RemoteParquetInput

            return RemoteParquetInput(self.path, self.image_columns, storage_options=self.storage_options)
        if self.storage_options is not None:
            raise ValueError(f"{self.path}: storage_options apply to a URL source (s3://, gs://, az://), not to a "
                             "local path")
        files = parquet_files(self.path)
        if files is None:
            raise ValueError(f"{self.path}: not Parquet files (a .parquet file, a folder or a glob of them)")
        require("pyarrow", "converting Parquet files")
        from fastdata.writer.sources.parquet.input import ParquetInput

        return ParquetInput(self.path, files, self.image_columns)


class WebDataset(Source):
    """WebDataset tar shards (a ``.tar`` file, a brace pattern such as
    ``shards/train-{000000..000099}.tar``, a glob or a folder of them): a general store with a
    field per member extension plus ``__key__``, bytes kept as they are.

    Args:
        path (str | os.PathLike): the shard, pattern, glob or folder; or a URL of one
            (``s3://bucket/shards/`` holding ``.tar`` objects, ``s3://bucket/train-{000000..000099}.tar``,
            ``gs://``, ``az://``; ``https://`` for named tars), read in ranged GETs (see "Remote
            sources" in the remote guide).
        storage_options (Mapping | None): fsspec options for a URL ``path``; None: the write's
            ``storage_options``.

    Raises:
        TypeError: not a path.
    """

    kind = "WebDataset shards"

    def __init__(self, path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options

    def write_source(self) -> TarInput:
        if is_remote(self.path):
            from fastdata.writer.sources.webdataset.remote import RemoteTarInput

            return RemoteTarInput(self.path, storage_options=self.storage_options)
        if self.storage_options is not None:
            raise ValueError(f"{self.path}: storage_options apply to a URL source (s3://, gs://, az://, https://), "
                             "not to a local path")
        tars = tar_files(self.path)
        if tars is None:
            raise ValueError(f"{self.path}: not WebDataset shards (a .tar file, a brace pattern, a glob or a folder "
                             "of them)")
        return TarInput(self.path, tars)


class Volumes(Source):
    """Arrays stored in chunks read tile by tile: NIfTI volumes (a folder of ``.nii``/``.nii.gz``
    files, a CSV/TSV/JSONL list whose ``image`` column names them, a Decathlon ``dataset.json``;
    needs nibabel) or a folder of TIFF images (class subfolders give labels; needs tifffile).
    Values are stored exactly as read.

    Args:
        path (str | os.PathLike): the folder, list or ``dataset.json``.
        chunks (str | Sequence[int] | None): the chunk shape (``"64,64,64"`` or ``(64, 64, 64)``);
            default 48 per spatial axis of a volume (sized for 96^3 patches), 512x512 for images.
            Not :attr:`WriteOptions.task_size <fastdata.writer.options.WriteOptions>` (inputs per
            worker task).
        codec (str | None): the chunks' codec (``"blosc-lz4"`` by default, ``"blosc-zstd"`` for
            smaller stores; :data:`fastdata.format.chunk_codecs.CHUNK_CODECS`).
        max_pixels (int | str | None): TIFF images only: the most pixels (H x W) of one image
            (``"2G"`` or an int; default: the decompression-bomb limit).
        storage_options (Mapping | None): fsspec options for NIfTI volumes at URLs (a folder, a
            volume list or ``dataset.json`` at ``s3://``, ``gs://``, ``az://``, or a list at
            ``https://``; a local volume list whose rows name URLs); each volume is copied by the
            worker that converts it into a temporary file of its own: see "Remote sources" in the
            remote guide. None: the write's ``storage_options``.

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    kind = "NIfTI volumes or a TIFF folder"

    def __init__(self, path: str | os.PathLike, *, chunks: str | Sequence[int] | None = None,
                 codec: str | None = None, max_pixels: int | str | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.path = _path(path, "path")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
        self.storage_options = storage_options
        if chunks is not None and not isinstance(chunks, str | Sequence):
            raise TypeError(f"chunks must be a chunk shape such as \"64,64,64\" or (64, 64, 64), got {chunks!r}")
        self.chunks = None if chunks is None else parse_chunks(chunks)
        if codec is not None and codec not in CHUNK_CODECS:
            raise ValueError(f"codec must be one of {', '.join(map(repr, CHUNK_CODECS))}, got {codec!r}")
        self.codec = codec
        self.max_pixels = None if max_pixels is None else parse_max_pixels(max_pixels)

    def write_source(self) -> WriteSource:
        if is_remote(self.path) or names_urls(self.path):
            if self.max_pixels is not None:
                raise RemotePathError(f"{self.path}: TIFF images (max_pixels) are read from a local or mounted "
                                      "filesystem; from URLs fastdata reads NIfTI volumes")
            from fastdata.writer.sources.volumes.remote import RemoteVolumeInput

            return RemoteVolumeInput(self.path, self.chunks, self.codec, storage_options=self.storage_options)
        if self.storage_options is not None:
            raise ValueError(f"{self.path}: storage_options apply to a URL source (s3://, gs://, az://), not to a "
                             "local path")
        found = chunked_input(self.path, chunks=self.chunks, codec=self.codec, max_pixels=self.max_pixels)
        if found is not None:
            return found
        if os.path.isdir(self.path):  # a TIFF folder with the default chunks and pixel limit
            return TiffImageInput(self.path, self.chunks, self.codec, self.max_pixels)
        raise ValueError(f"{self.path}: not NIfTI volumes (a folder of .nii/.nii.gz files, a list naming them, a "
                         "Decathlon dataset.json) nor a folder of TIFF images")


class Samples(Source):
    """Python data: dicts of field name -> value, written into a general store (what
    :func:`fastdata.write` takes; see it for the values an image field may hold).

    Args:
        samples: a map-style dataset (``__len__`` + ``__getitem__``: a list, a torch
            ``Dataset``; resumable), any iterable of dicts (not resumable), or a Hugging Face
            ``datasets.Dataset``/``IterableDataset`` (a ``DatasetDict`` with ``split``).
        schema (Schema | Mapping | None): the fields; None: inferred from the first sample.
        metadata (Mapping | None): a JSON object stored in the manifest under ``"metadata"``.
        split (str | None): the split of a ``datasets.DatasetDict`` to write.

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    kind = "Python samples"
    default_strict = True

    def __init__(self, samples: Iterable[Mapping[str, Any]] | MapStyle,
                 schema: Schema | Mapping[str, Any] | None = None, *,
                 metadata: Mapping[str, Any] | None = None, split: str | None = None):
        if hf_kind(samples) is None and isinstance(samples, str | bytes | os.PathLike | Mapping):
            raise TypeError(f"samples must be a dataset or an iterable of dicts (a path is converted with "
                            f"fastdata.convert), got {type(samples).__name__}")
        if hf_kind(samples) is None and not (is_map_style(samples) or isinstance(samples, Iterable)):
            raise TypeError(f"samples must be a map-style dataset or an iterable of dicts, got "
                            f"{type(samples).__name__}")
        if schema is not None and not isinstance(schema, Schema | Mapping):
            raise TypeError(f"schema must be a fastdata.fields.Schema or a dict of name -> Field, got {schema!r}")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict (a JSON object), got {metadata!r}")
        if split is not None and not isinstance(split, str):
            raise TypeError(f"split must be a split's name, got {split!r}")
        if split is not None and hf_kind(samples) is None:
            raise ValueError("split= picks a split of a datasets.DatasetDict; these samples are not one")
        self.samples, self.schema, self.metadata, self.split = samples, schema, metadata, split

    def write_source(self) -> WriteSource:
        if hf_kind(self.samples) is not None:
            require("pyarrow", "writing a datasets object")
            from fastdata.writer.sources.hf import hf_source

            return hf_source(self.samples, split=self.split, schema=self.schema, metadata=self.metadata)
        return (MapInput(self.samples, self.schema, self.metadata) if is_map_style(self.samples)
                else IterInput(self.samples, self.schema, self.metadata))
