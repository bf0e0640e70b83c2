"""Large TIFF images read tile by tile (or strip by strip) with tifffile's own segment reader:
the header checked (:func:`open_tiff`: one 2-D image, the pixel limit, bounded tiles), a region
that decodes only the tiles it touches (:class:`TiffRegions`), and a TIFF folder's store layout
and samples (:class:`ImageLayout`, :func:`image_layout`, :class:`TiffSamples`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from fastdata.common.imageio import ImageDecodeError, check_tiff_segment, pixel_limit
from fastdata.errors import RejectedInputError, SourceError
from fastdata.writer.sources.volumes.common import OpenedSample, chunk_shape, named, native_dtype, require_extra
from fastdata.writer.sources.volumes.scan import FileScan, ScannedSamples

__all__ = ["IMAGE_CHUNKS", "ImageLayout", "MAX_SEGMENT_BYTES", "READ_BUFFER_BYTES", "TIFF_SUFFIXES", "TiffRegions",
           "TiffSamples", "image_layout", "open_tiff", "require_tifffile"]

#: TIFF-based file names a ``chunks`` image folder takes (other images there are rejected)
TIFF_SUFFIXES = (".tif", ".tiff", ".svs", ".btf", ".tf2", ".tf8", ".ndpi", ".scn")
#: chunk sides (rows, columns) of a TIFF image
IMAGE_CHUNKS = (512, 512)
#: most bytes one decoded TIFF tile or strip may take (one is in memory at a time)
MAX_SEGMENT_BYTES = 256 << 20
#: bytes tifffile reads from the file at once while gathering a slab's tiles
READ_BUFFER_BYTES = 16 << 20


def require_tifffile() -> ModuleType:
    """tifffile, or a :class:`~fastdata.errors.MissingExtraError` naming the ``images`` extra."""
    return require_extra("tifffile", "reading TIFF images tile by tile")


_JPEG_COMPRESSIONS = frozenset({6, 7, 34892, 33007})


class TiffRegions:
    """The first page of a TIFF as an array-like of shape (H, W[, C]) that reads a region by
    decoding only the tiles (or strips) it touches, one at a time (see
    :mod:`~fastdata.writer.sources.volumes`).

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
            raise RejectedInputError(f"{named(name)}corrupt TIFF: {len(page.dataoffsets)} tiles/strips, the page's "
                                     f"geometry needs {planes * self.rows * self.cols}")
        self.decode_args: dict[str, Any] = {}
        self.compression = int(page.compression)
        if self.compression in _JPEG_COMPRESSIONS:
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
                if data:  # an image codec sizes its output from its own header: checked before it decodes
                    self._check_segment(data)
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
                require_extra("imagecodecs", f"decoding a TIFF of compression {getattr(page.compression, 'name', '?')}")
            raise RejectedInputError(f"{named(self.name)}truncated or corrupt TIFF data ({type(err).__name__}: "
                                     f"{err})") from None


    def _check_segment(self, data: bytes) -> None:
        """Refuse a tile whose codec header (a JPEG frame header, ...) declares more than the tile holds
        or more than :data:`MAX_SEGMENT_BYTES` decoded (see :func:`fastdata.common.imageio.check_tiff_segment`)."""
        try:
            check_tiff_segment(self.compression, data, self.seg_h, self.seg_w, MAX_SEGMENT_BYTES,
                               max_pixels=self.seg_h * self.seg_w, tables=self.decode_args.get("jpegtables"),
                               header=self.decode_args.get("jpegheader"))
        except ImageDecodeError as err:
            raise RejectedInputError(f"{named(self.name)}{err}") from None


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
        RejectedInputError: naming the problem (and ``max_pixels`` for too many pixels).
        MissingExtraError: tifffile, or imagecodecs for a compressed TIFF, is not installed.
    """
    tifffile = require_tifffile()
    try:
        tif = tifffile.TiffFile(os.fsdecode(path))
    except FileNotFoundError:
        raise RejectedInputError(f"{named(name)}file not found") from None
    except Exception as err:  # noqa: BLE001 - TiffFileError, ValueError, struct.error, ...
        raise RejectedInputError(f"{named(name)}not a readable TIFF file ({type(err).__name__}: {err}); chunks "
                                 "stores TIFF images, read tile by tile") from None
    try:
        try:
            pages = tif.pages
            page = pages.first
            axes, dtype, shape = page.axes, page.dtype, tuple(page.shape)
            count = len(pages)
            stack = any(tuple(pages[k].shape) == shape for k in range(1, count))
        except Exception as err:  # noqa: BLE001
            raise RejectedInputError(f"{named(name)}corrupt TIFF ({type(err).__name__}: {err})") from None
        if stack:
            raise RejectedInputError(f"{named(name)}a multi-page TIFF stack ({count} pages, several of shape {shape}): "
                                     "one image per sample is stored; split the stack into one file per page")
        if axes not in ("YX", "YXS", "SYX") or int(getattr(page, "imagedepth", 1)) != 1:
            raise RejectedInputError(f"{named(name)}TIFF page of axes {axes!r} (shape {shape}) is not a 2-D image")
        if dtype is None or np.dtype(dtype).kind not in "biuf":
            raise RejectedInputError(f"{named(name)}TIFF of {page.bitspersample} bits per sample, sample format "
                                     f"{page.sampleformat} is not supported")
        height, width, channels = _tiff_geometry(page)
        limit = pixel_limit() if max_pixels is None else max_pixels
        if height * width > limit:
            given = ("max_pixels" if max_pixels is not None
                     else "the decompression-bomb limit, PIL.Image.MAX_IMAGE_PIXELS")
            raise RejectedInputError(
                f"{named(name)}{width}x{height} image ({height * width:,} pixels) is over the limit of {limit:,} "
                f"pixels ({given}): pass max_pixels=N to allow larger images, e.g. "
                f"max_pixels={_suggest_pixels(height * width)!r}")
        segment = math.prod(int(c) for c in page.chunks) * np.dtype(dtype).itemsize
        if segment > MAX_SEGMENT_BYTES:
            raise RejectedInputError(f"{named(name)}its tiles/strips of {list(page.chunks)} decode to {segment:,} "
                                     f"bytes each, more than the {MAX_SEGMENT_BYTES >> 20} MiB read at once: rewrite "
                                     "it tiled (e.g. tifffile.imwrite(..., tile=(512, 512)))")
    except BaseException:
        tif.close()
        raise
    return tif, page, (height, width, channels), native_dtype(dtype)


def _suggest_pixels(pixels: int) -> str:
    """A round ``max_pixels`` value above ``pixels`` (``2G``, ``500M``)."""
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


class TiffSamples(ScannedSamples):
    """The samples of a TIFF folder: ``open(i)`` opens image ``i`` as a :class:`TiffRegions`."""

    def __init__(self, scan: FileScan, layout: ImageLayout, max_pixels: int | None):
        super().__init__(scan)
        self.layout, self.max_pixels = layout, max_pixels

    def open(self, i: int) -> OpenedSample:
        """Image ``i``'s values (``image``, and ``label`` with class folders).

        Raises:
            RejectedInputError: the file is unreadable or refused (see :func:`open_tiff`).
        """
        opened = OpenedSample()
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
    dtype = native_dtype(np.result_type(*(d for _, d in headers)))
    sides = chunk_shape(ndim, chunks, IMAGE_CHUNKS, "images")
    if ndim == 3 and (chunks is None or len(chunks) < 3):
        sides = sides[:2] + (bands,)
    return ImageLayout(ndim, dtype, sides)
