"""Read, validate and (optionally) transcode one input file. Runs in the
converter's worker processes.

Validation fully decodes every image, so anything a training run would choke on
is rejected at conversion time with a reason, never stored. The outcome for
each file is either a :class:`~fastdata.format.backends.base.Sample` or a rejection
reason string.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import stat
import tempfile

import numpy as np
from PIL import Image

from fastdata.common import portable
from fastdata.common.extensions import EXTENSION_FORMATS
from fastdata.common.imageio import (
    ImageDecodeError,
    ImageInfo,
    decode_image,
    encode_ppm,
    encode_lossless,
    inspect_image,
    open_image,
    stored_format,
)
from fastdata.errors import ImageModeError
from fastdata.format.backends.base import Sample, StorageSpec
from fastdata.format.record import MAX_RECORD_BYTES, EncodedSample, checksum

DEFAULT_REENCODE_QUALITY = 90
#: names of the per-chunk files workers hand image bytes back through (in staging)
SPILL_PREFIX, SPILL_SUFFIX = "chunk-", ".spill"
#: largest input file read: a bigger one could not be stored as one record (and
#: reading it would only exhaust memory)
MAX_INPUT_BYTES = MAX_RECORD_BYTES - (1 << 20)


class Rejected(Exception):
    """Internal: the file is not usable; ``str(self)`` is the reason."""


def starts_like_jpeg(path: bytes) -> bool:
    """True when ``path`` is a regular file whose first bytes are a JPEG start-of-image
    marker (so only the JPEG decoder can open it under the image policy). Never
    blocks (FIFOs are opened non-blocking and refused); any error gives False."""
    try:
        fd = os.open(path, os.O_RDONLY | portable.O_NONBLOCK | portable.OPEN_FLAGS)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 2) == b"\xff\xd8"
    except OSError:
        return False
    finally:
        os.close(fd)


def read_bytes(path: bytes) -> bytes:
    """The bytes of the file at ``path`` under the input rules (regular file, size limit,
    never blocking on a FIFO); raises :class:`Rejected` with the reason."""
    return _read_bytes(path)


def _read_bytes(path: bytes) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO named *.jpg must not block the worker forever
        fd = os.open(path, os.O_RDONLY | portable.O_NONBLOCK | portable.OPEN_FLAGS)
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Rejected("not a regular file (a FIFO, socket or device); not read")
            if st.st_size > MAX_INPUT_BYTES:
                raise Rejected(f"file of {st.st_size} bytes exceeds the {MAX_INPUT_BYTES} byte limit for one image")
            # read(size + 1), not read(limit): Python allocates the requested size up
            # front, and a limit-sized buffer per file cost ~0.1 ms/image (8% of a decode)
            data = fh.read(st.st_size + 1)
            if len(data) > st.st_size:  # grew after the fstat: read on, up to the limit
                data += fh.read(MAX_INPUT_BYTES + 1 - len(data))
            if len(data) > MAX_INPUT_BYTES:
                raise Rejected(f"file exceeds the {MAX_INPUT_BYTES} byte limit for one image")
            return data
    except FileNotFoundError:
        if os.path.islink(path):
            raise Rejected("broken symlink (its target does not exist)") from None
        raise Rejected("file not found (a wrong path in the list, or deleted or moved after the scan)") from None
    except PermissionError:
        raise Rejected("permission denied (cannot read the file)") from None
    except IsADirectoryError:
        raise Rejected("is a directory, not a file") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Rejected("symlink loop (too many levels of symbolic links)") from None
        raise Rejected(f"cannot read: {err.strerror or err}") from None


@dataclasses.dataclass(frozen=True)
class IngestedSample(Sample):
    """A :class:`Sample` plus a note for the conversion's warnings (e.g. a PNG named
    ``.jpg``: stored as the PNG it is, as ImageFolder would load it)."""

    warning: str = ""


def inspect(data: bytes) -> ImageInfo:
    """Fully decode ``data`` under the image policy and return what the index records of it
    (format, size, dtype and channels as stored: :func:`fastdata.common.imageio.inspect_image`).
    Raises :class:`Rejected` with the decoder's reason."""
    try:
        return inspect_image(data)
    except ImageDecodeError as err:
        raise Rejected(str(err)) from None


def open_validated(data: bytes) -> Image.Image:
    """Open and fully decode ``data`` under the image policy
    (:func:`fastdata.common.imageio.open_image`). Raises :class:`Rejected`."""
    try:
        return open_image(data)
    except ImageDecodeError as err:
        raise Rejected(str(err)) from None


def extension_mismatch(path: bytes, fmt: str) -> str:
    """A warning when the file name's extension says another format than ``fmt``
    (the content's), else ""."""
    ext = os.path.splitext(os.fsdecode(path))[1].lower()
    expected = EXTENSION_FORMATS.get(ext)
    if expected is None or expected == fmt:
        return ""
    return (f"content is {fmt} but the extension {ext!r} says {expected}; "
            f"kept and stored as {fmt}, as ImageFolder loads it")


def ingest(path: bytes, relpath: bytes, label: int, storage: StorageSpec, data: bytes | None = None,
           keep_raw: bool | None = None) -> Sample:
    """Turn one input file (``data``: its bytes, read here when None) into a
    storable sample or raise :class:`Rejected`. ``keep_raw`` is the plan's choice of whether a
    raw-native or mixed store keeps it as pixels (a raw budget's); None leaves it to
    :meth:`~fastdata.format.backends.base.StorageSpec.stores_native_pixels`."""
    if data is None:
        data = _read_bytes(path)
    if storage.mode.transcodes_losslessly:
        return lossless_sample(path, relpath, label, data)
    if storage.mode.may_hold_native_size_pixels and (
            storage.stores_native_pixels(relpath) if keep_raw is None else keep_raw):
        return raw_native_sample(path, relpath, label, data, storage.reencode_max_side())
    if not (storage.mode.holds_fixed_size_pixels or storage.mode.reencodes_large_images):  # as given: checked
        info = inspect(data)
        return IngestedSample(image=data, label=label, width=info.width, height=info.height, fmt=info.format,
                              xxh=checksum(data), relpath=relpath, warning=extension_mismatch(path, info.format),
                              dtype=info.dtype, channels=info.channels)
    if storage.mode.reencodes_large_images:
        info = inspect(data)  # one decode for the images kept as they are (most of them)
        if max(info.width, info.height) <= storage.reencode_max_side():
            return IngestedSample(image=data, label=label, width=info.width, height=info.height, fmt=info.format,
                                  xxh=checksum(data), relpath=relpath,
                                  warning=extension_mismatch(path, info.format), dtype=info.dtype,
                                  channels=info.channels)
    im = open_validated(data)
    fmt, width, height = stored_format(im), im.width, im.height
    warning = extension_mismatch(path, fmt)
    if storage.mode.holds_fixed_size_pixels:
        h, w = storage.fixed_pixel_shape()
        rgb = im.convert("RGB")
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), Image.Resampling.BILINEAR)
        data, fmt, width, height = rgb.tobytes(), "RAW", w, h
    else:  # reencode, larger than max_side: an RGB JPEG
        size = capped_size(width, height, storage.reencode_max_side())
        rgb = im.convert("RGB").resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        buf = io.BytesIO()
        rgb.save(buf, format="JPEG", quality=storage.quality or DEFAULT_REENCODE_QUALITY)
        data, fmt, (width, height) = buf.getvalue(), "JPEG", size
    # both are 8-bit RGB: raw pixels are HxWx3 uint8, and the JPEG is saved from an RGB image
    return IngestedSample(image=data, label=label, width=width, height=height, fmt=fmt, xxh=checksum(data),
                          relpath=relpath, warning=warning, dtype="uint8", channels=3)


def capped_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """``(width, height)`` scaled so that the longer side is ``max_side`` (each side
    ``max(1, round(side * max_side / longer))``), or unchanged when it is already at most that:
    the size ``max_side`` re-encoding and ``storage="raw"|"mixed"`` store an image at."""
    longer = max(width, height)
    if longer <= max_side:
        return width, height
    scale = max_side / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def raw_native_rgb(rgb: np.ndarray, max_side: int) -> np.ndarray:
    """The pixels ``storage="raw"|"mixed"`` stores of an image decoded to 8-bit RGB (``rgb``,
    HxWx3 uint8): as they are when the longer side is at most ``max_side``, else
    ``Image.fromarray(rgb).resize(capped_size(...), LANCZOS, reducing_gap=3.0)``, the resize of
    ``max_side`` re-encoding."""
    size = capped_size(rgb.shape[1], rgb.shape[0], max_side)
    if size == (rgb.shape[1], rgb.shape[0]):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0))


def raw_native_sample(path: bytes, relpath: bytes, label: int, data: bytes, max_side: int) -> IngestedSample:
    """One image as ``storage="raw"|"mixed"`` stores its raw share: a binary PPM
    (:func:`fastdata.common.imageio.encode_ppm`) of its pixels in read mode ``"RGB"``
    (:func:`fastdata.common.imageio.decode_image`: pixel-identical to ``Image.open(f).convert("RGB")``,
    what ImageFolder's loader gives: gray, palette, CMYK, 16-bit and alpha images become 8-bit RGB),
    capped by :func:`raw_native_rgb`. The original format is not kept, so neither is a warning
    about its file name's extension.

    Raises:
        Rejected: the input is not a usable image, or has no 8-bit RGB form (a DICOM, a TIFF of
            more than 4 bands: stored as they are without ``storage``).
    """
    try:
        rgb = decode_image(data, "RGB")
    except ImageModeError:
        raise Rejected("the image has no 8-bit RGB form (a DICOM, or a TIFF of more than 4 bands or of several "
                       "bands over 8 bits); storage='raw'|'mixed' stores RGB pixels: convert it without storage= "
                       "to keep it as it is") from None
    except ImageDecodeError as err:
        raise Rejected(str(err)) from None
    pixels = raw_native_rgb(rgb, max_side)
    ppm = encode_ppm(pixels)
    return IngestedSample(image=ppm, label=label, width=int(pixels.shape[1]), height=int(pixels.shape[0]),
                          fmt="PPM", xxh=checksum(ppm), relpath=relpath, dtype="uint8", channels=3)


#: formats the lossless storage mode keeps as they are: JPEG and WebP are smaller than any lossless
#: re-encoding of their pixels, and a DICOM's photometric interpretation and rescale tags are part
#: of what its pixels mean
LOSSLESS_KEEPS = frozenset({"JPEG", "WEBP", "DICOM"})
#: Pillow modes whose "unchanged" pixels are the whole image (a TIFF of them reads back the same in
#: every read mode); a palette, CMYK or YCbCr image is kept as it is instead (its RGB read needs the
#: palette or the colour space, which a TIFF of the raw channels would lose)
LOSSLESS_PILLOW_MODES = frozenset({"1", "L", "RGB", "RGBA", "I;16", "I;16L", "I;16B", "I;16N", "I", "F"})


def encode_tiff(pixels: np.ndarray) -> bytes:
    """``pixels`` (HxW or HxWxC, any dtype of :data:`~fastdata.common.imageio.ARRAY_IMAGE_DTYPES`) as a
    zstd-compressed TIFF: what the lossless storage mode stores. Arrays that
    :func:`~fastdata.common.imageio.encode_lossless` makes TIFFs of are encoded by it; 8-bit images of
    up to 4 channels (a PNG there) are written with the same options here, so every re-encoded
    image is the same kind of file."""
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    if pixels.dtype != np.uint8 or channels > 4:
        data, fmt = encode_lossless(pixels)
        assert fmt == "TIFF", "encode_lossless makes a TIFF of anything but 8-bit images of up to 4 channels"
        return data
    import tifffile  # (an optional dependency: encode_lossless names the extra when it is missing)

    colour = pixels.ndim == 3 and channels in (3, 4)
    buf = io.BytesIO()
    tifffile.imwrite(buf, np.ascontiguousarray(pixels), photometric="rgb" if colour else "minisblack",
                     planarconfig="contig" if pixels.ndim == 3 else None, compression="zstd", metadata=None,
                     extrasamples=("unassalpha",) if colour and channels == 4 else None)
    return buf.getvalue()


def _pillow_mode(data: bytes) -> str | None:
    """The Pillow mode of ``data``, or None when Pillow cannot open it (a multi-band or tiled
    TIFF read by tifffile)."""
    try:
        im = open_image(data)
    except ImageDecodeError:
        return None
    mode = im.mode
    im.close()
    return mode


def lossless_sample(path: bytes, relpath: bytes, label: int, data: bytes) -> IngestedSample:
    """The lossless storage mode (``convert(lossless="tiff")``): a validated image re-encoded as a
    zstd TIFF of its unchanged pixels, checked bit-exact (both decoded ``"unchanged"``) before it
    is stored; JPEG, WebP and DICOM files (:data:`LOSSLESS_KEEPS`) and images whose pixels need a
    palette or colour space (:data:`LOSSLESS_PILLOW_MODES`) are stored as they are.

    Raises:
        Rejected: the input is not a usable image, or its TIFF does not decode to the same pixels.
    """
    info = inspect(data)
    warning = extension_mismatch(path, info.format)
    mode = None if info.format in LOSSLESS_KEEPS else _pillow_mode(data)
    if info.format in LOSSLESS_KEEPS or (mode is not None and mode not in LOSSLESS_PILLOW_MODES):
        return IngestedSample(image=data, label=label, width=info.width, height=info.height, fmt=info.format,
                              xxh=checksum(data), relpath=relpath, warning=warning, dtype=info.dtype,
                              channels=info.channels)
    try:
        pixels = decode_image(data, "unchanged")
        tiff = encode_tiff(pixels)
        back = decode_image(tiff, "unchanged")
    except (ImageDecodeError, ValueError) as err:
        raise Rejected(f"lossless re-encoding failed ({err}); not stored") from None
    # bit for bit, NaNs and negative zeros included: compare the bytes, after dtype and shape
    if back.dtype != pixels.dtype or back.shape != pixels.shape or back.tobytes() != pixels.tobytes():
        raise Rejected(f"lossless re-encoding as TIFF does not give the same pixels back ({pixels.dtype} "
                       f"{pixels.shape} in, {back.dtype} {back.shape} out); not stored")
    return IngestedSample(image=tiff, label=label, width=info.width, height=info.height, fmt="TIFF",
                          xxh=checksum(tiff), relpath=relpath, warning=warning, dtype=info.dtype,
                          channels=info.channels)


def ingest_chunk(paths: list[bytes], relpaths: list[bytes], labels: list[int], storage: StorageSpec,
                 keep_raw: list[bool] | None = None, spill_dir: str | None = None):
    """Worker entry point: ingest a chunk (``keep_raw``: the plan's raw choice per input, see
    :func:`ingest`). Returns a list with a Sample or a rejection reason (str) per input, plus the
    input bytes read; with ``spill_dir``, the list comes back spilled (see :func:`spill`)."""
    results, read_bytes = _ingest_all(paths, relpaths, labels, storage, keep_raw)
    if spill_dir is not None:
        return spill(results, spill_dir), read_bytes
    return results, read_bytes


def _payload(item) -> bytes | None:
    """The bytes of a stored item that travel through the spill file (None for a rejection)."""
    if isinstance(item, Sample):
        return item.image
    if isinstance(item, EncodedSample):
        return item.record
    return None


def _with_payload(item, data: bytes):
    return dataclasses.replace(item, image=data) if isinstance(item, Sample) else dataclasses.replace(item, record=data)


def spill(results: list, spill_dir: str) -> tuple:
    """Move a chunk's image bytes (or general records) into one file in ``spill_dir``
    and return ``(path, results without those bytes, their lengths)``.

    Why: sending megabytes of image bytes back through the process pool's
    64 KiB pipe stalls the worker until the converter's receiving thread wins the
    GIL for every piece; one page-cache file per chunk does not (measured: the
    worker's time per image fell by about a fifth).
    """
    payloads = [p for p in map(_payload, results) if p is not None]
    fd, path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=SPILL_SUFFIX, dir=spill_dir)
    with os.fdopen(fd, "wb") as fh:
        fh.write(b"".join(payloads))
    light = [item if _payload(item) is None else _with_payload(item, b"") for item in results]
    return path, light, [len(b) for b in payloads]


def unspill(spilled: tuple) -> list:
    """Inverse of :func:`spill` (in the converter): read the file back, delete it."""
    path, light, lengths = spilled
    with open(path, "rb") as fh:
        blob = fh.read()
    os.unlink(path)
    out, pos, k = [], 0, 0
    for item in light:
        if _payload(item) is not None:
            out.append(_with_payload(item, blob[pos:pos + lengths[k]]))
            pos += lengths[k]
            k += 1
        else:
            out.append(item)
    return out


def _ingest_all(paths: list[bytes], relpaths: list[bytes], labels: list[int], storage: StorageSpec,
                keep_raw: list[bool] | None = None):
    out: list = []
    read_bytes = 0
    choices = keep_raw if keep_raw is not None else [None] * len(paths)
    for path, rel, label, raw in zip(paths, relpaths, labels, choices, strict=False):
        try:
            data = _read_bytes(path)
            read_bytes += len(data)
            sample = ingest(path, rel, label, storage, data, raw)
        except Rejected as reason:
            out.append(str(reason))
            continue
        except MemoryError:
            out.append("out of memory while decoding (image too large for this machine)")
            continue
        out.append(sample)
    return out, read_bytes
