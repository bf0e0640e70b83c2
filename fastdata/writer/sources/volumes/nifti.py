"""NIfTI files read through nibabel: the header (:func:`nifti_header`), the raw values of a
``.nii`` region by region (:class:`NiftiRegions`) or of a ``.nii.gz`` decompressed once, whole
(:class:`WholeVolume`, :func:`read_gzip_values`), and a NIfTI source's store layout, schema and
samples (:class:`VolumeLayout`, :func:`volume_schema`, :class:`VolumeSamples`)."""

from __future__ import annotations

import gzip
import math
import os
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.fields import Field, Float, Int, NDArray, Schema
from fastdata.writer.sources.volumes.common import (
    OpenedSample,
    chunk_shape,
    chunked_field,
    named,
    native_dtype,
    require_extra,
)
from fastdata.writer.sources.volumes.scan import FileScan, ScannedSamples

__all__ = ["DEFAULT_MAX_GZIP_BYTES", "GZIP_LIMIT_ENV", "GZIP_PIECE_BYTES", "GZIP_TRAILING_BYTES",
           "MAX_EXTENSION_BYTES", "NiftiRegions", "PLANE_CHUNK", "VOLUME_CHUNK", "VolumeLayout", "VolumeSamples",
           "WholeVolume", "max_gzip_bytes", "nifti_header", "read_gzip_values", "require_nibabel", "volume_layout",
           "volume_schema"]

#: chunk side of the spatial axes of a 3-D (or more) volume, and of a 2-D one. 48: a 96^3 patch (the
#: common training patch) at a random place touches about 26 chunks holding 3.3x its voxels, against
#: 15 chunks and 4.4x with 64^3 chunks; measured on 512^3 uint16 CT-like volumes in one process
#: (blosc-lz4), 658 against 532 patches/s (1.24x), for a store 1.3% larger
VOLUME_CHUNK, PLANE_CHUNK = 48, 256


#: most bytes a ``.nii.gz``'s stream may decompress to, as its header declares it (header, extensions and
#: voxels: a converter worker holds the voxels whole in memory), unless ``FASTDATA_MAX_NIFTI_GZ_BYTES`` says
#: otherwise; the stream is read no further than that (see docs/SECURITY.md)
DEFAULT_MAX_GZIP_BYTES = 2 << 30
#: the environment variable that sets the ``.nii.gz`` limit (bytes, a decimal integer)
GZIP_LIMIT_ENV = "FASTDATA_MAX_NIFTI_GZ_BYTES"
#: most bytes of header extensions a NIfTI file may declare between its header and its voxels
MAX_EXTENSION_BYTES = 64 << 20
#: most bytes a ``.nii.gz``'s stream may hold after its voxels (read, at most this many, to tell)
GZIP_TRAILING_BYTES = 1 << 20


def max_gzip_bytes() -> int:
    """The most bytes a ``.nii.gz``'s stream may decompress to (``FASTDATA_MAX_NIFTI_GZ_BYTES``, default
    2 GiB): only the user (the converting process's environment), never a file, raises it."""
    try:
        value = int(os.environ.get(GZIP_LIMIT_ENV, DEFAULT_MAX_GZIP_BYTES))
    except ValueError:
        return DEFAULT_MAX_GZIP_BYTES
    return value if value > 0 else DEFAULT_MAX_GZIP_BYTES


def _skip(fh: Any, count: int) -> bool:
    """Read ``count`` bytes of ``fh`` in pieces, keeping none; False when the stream ends first."""
    while count > 0:
        piece = fh.read(min(count, 1 << 20))
        if not piece:
            return False
        count -= len(piece)
    return True


def _check_nifti_stream(path: str, name: str) -> None:
    """The NIfTI header's own sizes, read with Python integers before nibabel reads anything: the offset of
    the voxels (``vox_offset``) within :data:`MAX_EXTENSION_BYTES` of the header, and every header extension
    within it (nibabel reads an extension's declared size whole, and a size under 8 reads the whole
    stream: a 2 MB ``.nii.gz`` of zeros is 2 GB).

    Raises:
        RejectedInputError: naming the file and the size.
    """
    opener: Any = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(348)
            if len(head) < 348:
                return  # nibabel words the refusal
            for order in "<>":
                if struct.unpack(order + "i", head[:4])[0] in (348, 540):
                    break
            else:
                return  # not a NIfTI header: nibabel's verdict
            two = struct.unpack(order + "i", head[:4])[0] == 540
            size = 544 if two else 352  # the header and its 4 extension-flag bytes
            head += fh.read(size - 348)  # the stream is now where nibabel reads the extensions from
            if len(head) < size:
                return
            if two:
                offset = struct.unpack(order + "q", head[168:176])[0]
                single = head[4:7] == b"n+2"
            else:
                raw = struct.unpack(order + "f", head[108:112])[0]
                if not math.isfinite(raw):
                    raise RejectedInputError(f"{named(name)}NIfTI header's vox_offset is {raw}")
                offset = int(raw)
                single = head[344:347] == b"n+1"
            if single and offset - size > MAX_EXTENSION_BYTES:
                raise RejectedInputError(f"{named(name)}NIfTI header puts the voxels at byte {offset:,}, more than "
                                         f"{MAX_EXTENSION_BYTES >> 20} MiB of header extensions after the header")
            if head[size - 4] == 0:
                return  # no extensions
            # nibabel's loop (Nifti1Extensions.from_fileobj): up to the voxels, or (a pair's header) to the end
            left: int | None = offset - size if single else None
            budget = MAX_EXTENSION_BYTES
            while left is None or left >= 16:
                ext = fh.read(8)
                if len(ext) < 8:
                    return  # the end (a pair's header), or a short extension nibabel refuses itself
                esize = struct.unpack(order + "i", ext[:4])[0]
                if esize < 8 or esize > budget or (left is not None and esize > left):
                    where = f"{left:,} bytes left before the voxels at byte {offset:,}" if left is not None else \
                        f"at most {MAX_EXTENSION_BYTES >> 20} MiB of extensions"
                    raise RejectedInputError(f"{named(name)}NIfTI header extension of {esize:,} bytes does not fit "
                                             f"between the header and the voxels ({where})")
                if not _skip(fh, esize - 8):
                    return
                budget -= esize
                if left is not None:
                    left -= esize
    except RejectedInputError:
        raise
    except (OSError, EOFError, ValueError, struct.error, gzip.BadGzipFile) as err:
        raise RejectedInputError(f"{named(name)}not a readable NIfTI file ({type(err).__name__}: {err})") from None


def require_nibabel() -> ModuleType:
    """nibabel, or a :class:`~fastdata.errors.MissingExtraError` naming the ``volumes`` extra."""
    return require_extra("nibabel", "reading NIfTI volumes")


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
            raise RejectedInputError(f"{named(self.name)}truncated or corrupt NIfTI data ({type(err).__name__}: "
                                     f"{err})") from None
        return block if block.dtype.isnative else block.astype(block.dtype.newbyteorder("="))


class WholeVolume:
    """A ``.nii.gz``'s raw values, decompressed whole on the first read (see
    :mod:`~fastdata.writer.sources.volumes`: a gzip stream read slab by slab is decompressed
    again for every slab)."""

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
                raise RejectedInputError(f"{named(self.name)}truncated or corrupt NIfTI data ({type(err).__name__}: "
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
    size in memory, and no more. The stream is decompressed no further than the voxels and
    :data:`GZIP_TRAILING_BYTES` after them (the caller checked ``offset`` + the voxels' bytes
    against :func:`max_gzip_bytes`).

    Raises:
        EOFError: the stream ends before the voxels do; gzip/zlib errors for a damaged stream.
        ValueError: the stream holds more than :data:`GZIP_TRAILING_BYTES` after the voxels.
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
        if len(fh.read(GZIP_TRAILING_BYTES + 1)) > GZIP_TRAILING_BYTES:  # read no further than that
            raise ValueError(f"the gzip stream holds more than the {offset + len(out):,} bytes its header declares "
                             f"(over {GZIP_TRAILING_BYTES:,} bytes after the voxels): refused, not decompressed")
    values = out.view(stored)
    if not stored.isnative:
        values = values.byteswap(inplace=True).view(stored.newbyteorder("="))
    return values.reshape(shape, order="F")


def nifti_header(path: bytes, name: str, held: int | None = None) -> tuple[Any, tuple[int, ...], np.dtype]:
    """``(image, shape, stored dtype)`` of the NIfTI file at ``path`` (its header only). ``held``:
    the size of the whole file when ``path`` holds only its start (a remote volume's first bytes,
    :mod:`fastdata.writer.sources.volumes.remote`); None: the file's own size.

    Raises:
        RejectedInputError: not a NIfTI-1/2 file nibabel reads, or of a non-numeric dtype (``name`` first).
    """
    nib = require_nibabel()
    _check_nifti_stream(os.fsdecode(path), name)
    try:
        image = nib.load(os.fsdecode(path))
    except FileNotFoundError:
        raise RejectedInputError(f"{named(name)}file not found") from None
    except Exception as err:  # noqa: BLE001 - ImageFileError, OSError, EOFError, struct errors, ...
        raise RejectedInputError(f"{named(name)}not a readable NIfTI file ({type(err).__name__}: {err})") from None
    if not isinstance(image, nib.Nifti1Image | nib.Nifti2Image) or not nib.is_proxy(image.dataobj):
        raise RejectedInputError(f"{named(name)}not a NIfTI-1/2 image (nibabel read it as {type(image).__name__})")
    try:
        dtype = np.dtype(image.get_data_dtype())
        shape = tuple(int(s) for s in image.shape)
    except Exception as err:  # noqa: BLE001
        raise RejectedInputError(f"{named(name)}unusable NIfTI header ({type(err).__name__}: {err})") from None
    if dtype.kind not in "biuf":
        raise RejectedInputError(f"{named(name)}NIfTI data type {dtype} is not a numeric type fastdata stores "
                                 "(RGB and complex volumes are not supported)")
    if not shape or 0 in shape:
        raise RejectedInputError(f"{named(name)}NIfTI volume of shape {shape} holds no voxel")
    _check_declared_bytes(os.fsdecode(path), name, image, shape, dtype, held)
    return image, shape, dtype


def _check_declared_bytes(path: str, name: str, image: Any, shape: tuple[int, ...], dtype: np.dtype,
                          held: int | None = None) -> None:
    """The bytes the header declares (voxel offset + voxels, Python integers) against what will be read:
    a ``.nii.gz`` within :func:`max_gzip_bytes` (its voxels are decompressed whole), a ``.nii`` no longer
    than the file (it is read region by region, so a header cannot claim what the file does not hold)."""
    try:
        offset = int(image.dataobj.offset)
    except Exception as err:  # noqa: BLE001
        raise RejectedInputError(f"{named(name)}unusable NIfTI header ({type(err).__name__}: {err})") from None
    voxels = math.prod(shape) * dtype.itemsize
    need = offset + voxels
    if path.lower().endswith(".gz"):
        if need > max_gzip_bytes():
            raise RejectedInputError(
                f"{named(name)}NIfTI header declares {shape} of {dtype} ({voxels:,} bytes of voxels): more than the "
                f"{max_gzip_bytes():,} bytes a .nii.gz may decompress to ({GZIP_LIMIT_ENV} raises the limit; or store "
                "it uncompressed, .nii, which is read region by region)")
        return
    if held is None:
        try:
            held = os.path.getsize(path)
        except OSError:
            return  # nibabel's reads word it
    if need > held and not path.lower().endswith((".hdr", ".img")):
        raise RejectedInputError(f"{named(name)}truncated NIfTI file: its header declares {shape} of {dtype} "
                                 f"({need:,} bytes with the header), the file holds {held:,} bytes")


def _nifti_values(path: bytes, name: str, dtype: np.dtype, opened: OpenedSample) -> tuple[Any, Any, tuple[int, ...]]:
    """``(image, array-like of its raw values, shape)`` of a NIfTI file, whose stored dtype must cast
    to ``dtype`` exactly."""
    image, shape, stored = nifti_header(path, name)
    if stored != dtype and not np.can_cast(native_dtype(stored), dtype, "safe"):
        raise RejectedInputError(f"{named(name)}stored dtype {stored} does not fit the store's {dtype} exactly "
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
    dtype = np.result_type(*(native_dtype(d) for s, d in shapes_dtypes if len(s) == ndim))
    return ndim, native_dtype(dtype)


class VolumeSamples(ScannedSamples):
    """The samples of a NIfTI source: ``open(i)`` reads volume ``i``'s header (and its label's),
    checks them against the store's :class:`VolumeLayout` and returns array-likes the chunk writer
    reads slab by slab (in whichever process calls it: the converter's workers)."""

    def __init__(self, scan: FileScan, layout: VolumeLayout):
        super().__init__(scan)
        self.layout = layout

    def files_of(self, i: int) -> list[bytes]:
        return [self.scan.paths[i]] + ([self.scan.label_paths[i]] if self.scan.label_paths else [])

    def open(self, i: int) -> OpenedSample:
        """Sample ``i``'s values (fields: :mod:`~fastdata.writer.sources.volumes`).

        Raises:
            RejectedInputError: a file is unreadable, or does not fit the layout (the file named).
        """
        scan = self.scan
        return self.open_files(i, scan.paths[i], scan.label_paths[i] if scan.label_paths is not None else None)

    def open_files(self, i: int, path: bytes, label_path: bytes | None, opened: OpenedSample | None = None
                   ) -> OpenedSample:
        """:meth:`open` of sample ``i`` with its volume (and label volume) read from ``path`` (and
        ``label_path``): a local copy of a remote file. ``opened``: add to it (its closers run on failure)."""
        layout, scan = self.layout, self.scan
        opened = opened if opened is not None else OpenedSample()
        try:
            image, values, shape = _nifti_values(path, "", layout.dtype, opened)
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
                assert label_path is not None
                _, label_values, label_shape = _nifti_values(label_path, f"label {label_name}",
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


def volume_layout(scan: FileScan, chunks: tuple[int, ...] | None,
                  header: Callable[[bytes, str], tuple[Any, tuple[int, ...], np.dtype]] = nifti_header
                  ) -> VolumeLayout:
    """The store's layout from every volume's header (read here, in the converting process, by
    ``header``: :func:`nifti_header`, or a remote volume's).

    Raises:
        SourceError: no volume (or no label volume) can be read at all, naming the first failure.
    """
    headers, failures = [], []
    for path, rel in zip(scan.paths, scan.relpaths, strict=True):
        try:
            headers.append(header(path, os.fsdecode(rel))[1:])
        except RejectedInputError as err:
            failures.append(str(err))
    if not headers:
        raise SourceError(f"{scan.root}: none of the {len(scan)} volume(s) can be read; the first: {failures[0]}")
    ndim, dtype = _common(headers)
    if ndim < 2:
        raise SourceError(f"{scan.root}: the volumes are 1-D: fastdata stores volumes of at least 2 axes")
    default = (PLANE_CHUNK, PLANE_CHUNK) if ndim == 2 else (VOLUME_CHUNK,) * 3
    image_chunks = chunk_shape(ndim, chunks, default, "volumes")
    layout = VolumeLayout(ndim, dtype, image_chunks)
    if scan.label_paths is not None:
        assert scan.label_relpaths is not None
        labels = []
        for path, rel in zip(scan.label_paths, scan.label_relpaths, strict=True):
            try:
                labels.append(header(path, os.fsdecode(rel))[1:])
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
    """The schema of a NIfTI source (fields: :mod:`~fastdata.writer.sources.volumes`)."""
    fields: list[tuple[str, Field]] = [("image", chunked_field(layout.dtype, layout.chunks, codec))]
    if layout.label_dtype is not None and layout.label_chunks is not None:
        fields.append(("label", chunked_field(layout.label_dtype, layout.label_chunks, codec)))
    elif scan.labels is not None:
        fields.append(("label", Int()))
    fields += [("affine", NDArray("float64", (4, 4))), ("spacing", NDArray("float64", (layout.spatial,))),
               ("scl_slope", Float()), ("scl_inter", Float())]
    fields += [(name, f) for name, (f, _) in scan.extras.items()]
    return Schema(tuple(fields))
