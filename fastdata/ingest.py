"""Read, validate and (optionally) transcode one input file. Runs in the
converter's worker processes.

Validation fully decodes every image, so anything a training run would choke on
is rejected at conversion time with a reason, never stored. The outcome for
each file is either a :class:`~fastdata.formats.base.Sample` or a rejection
reason string.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import stat
import tempfile
import warnings

from PIL import Image

from .formats.base import Sample, StorageSpec
from .record import MAX_RECORD_BYTES, checksum

#: extension -> the Pillow format the content must have
EXTENSION_FORMATS = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".ppm": "PPM", ".pgm": "PPM",
    ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF", ".webp": "WEBP",
}
#: Pillow may only try these decoders on input (no exotic plugins on hostile files)
ALLOWED_FORMATS = tuple(sorted(set(EXTENSION_FORMATS.values())))
DEFAULT_REENCODE_QUALITY = 90
#: names of the per-chunk files workers hand image bytes back through (in staging)
SPILL_PREFIX, SPILL_SUFFIX = "chunk-", ".spill"
#: largest input file read: a bigger one could not be stored as one record (and
#: reading it would only exhaust memory)
MAX_INPUT_BYTES = MAX_RECORD_BYTES - (1 << 20)


class Rejected(Exception):
    """Internal: the file is not usable; ``str(self)`` is the reason."""


def _read_bytes(path: bytes) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO named *.jpg must not block the worker forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
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


def open_validated(data: bytes, expected_format: str | None) -> Image.Image:
    """Open ``data`` with Pillow restricted to :data:`ALLOWED_FORMATS`, fully decode it
    and check its format against the extension. Raises :class:`Rejected`."""
    if not data:
        raise Rejected("empty file (0 bytes)")
    with warnings.catch_warnings():
        # Pillow only *warns* between MAX_IMAGE_PIXELS and twice that; treat both as bombs.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise Rejected(f"decompression bomb: {err}") from None
        except Image.UnidentifiedImageError:
            raise Rejected(f"not a recognised image (garbage, or not one of {', '.join(ALLOWED_FORMATS)})") from None
        except Exception as err:  # Pillow raises many unrelated types on garbage
            raise Rejected(f"not a recognised image ({type(err).__name__}: {err})") from None
        if expected_format and im.format != expected_format:
            raise Rejected(f"content is {im.format} but the extension says {expected_format}: rename the file")
        try:
            im.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise Rejected(f"decompression bomb: {err}") from None
        except Exception as err:
            raise Rejected(f"truncated or corrupt image data ({type(err).__name__}: {err})") from None
    return im


def ingest(path: bytes, relpath: bytes, label: int, storage: StorageSpec, data: bytes | None = None) -> Sample:
    """Turn one input file (``data``: its bytes, read here when None) into a
    storable sample or raise :class:`Rejected`."""
    if data is None:
        data = _read_bytes(path)
    ext = os.path.splitext(os.fsdecode(path))[1].lower()
    im = open_validated(data, EXTENSION_FORMATS.get(ext))
    fmt, width, height = im.format, im.width, im.height
    if storage.mode == "raw":
        h, w = storage.raw_shape
        rgb = im.convert("RGB")
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), Image.BILINEAR)
        data, fmt, width, height = rgb.tobytes(), "RAW", w, h
    elif storage.mode == "reencode" and max(width, height) > storage.max_side:
        scale = storage.max_side / max(width, height)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        rgb = im.convert("RGB").resize(size, Image.LANCZOS, reducing_gap=3.0)
        buf = io.BytesIO()
        rgb.save(buf, format="JPEG", quality=storage.quality or DEFAULT_REENCODE_QUALITY)
        data, fmt, (width, height) = buf.getvalue(), "JPEG", size
    return Sample(image=data, label=label, width=width, height=height, fmt=fmt, xxh=checksum(data), relpath=relpath)


def ingest_chunk(paths: list[bytes], relpaths: list[bytes], labels: list[int], storage: StorageSpec,
                 spill_dir: str | None = None):
    """Worker entry point: ingest a chunk. Returns a list with a Sample or a
    rejection reason (str) per input, plus the input bytes read; with
    ``spill_dir``, the list comes back spilled (see :func:`spill`)."""
    results, read_bytes = _ingest_all(paths, relpaths, labels, storage)
    if spill_dir is not None:
        return spill(results, spill_dir), read_bytes
    return results, read_bytes


def spill(results: list, spill_dir: str) -> tuple:
    """Move a chunk's image bytes into one file in ``spill_dir`` and return
    ``(path, results without image bytes, image lengths)``.

    Why: sending megabytes of image bytes back through the process pool's
    64 KiB pipe stalls the worker until the converter's receiving thread wins the
    GIL for every piece; one page-cache file per chunk does not (measured: the
    worker's time per image fell by about a fifth).
    """
    images = [s.image for s in results if isinstance(s, Sample)]
    fd, path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=SPILL_SUFFIX, dir=spill_dir)
    with os.fdopen(fd, "wb") as fh:
        fh.write(b"".join(images))
    light = [dataclasses.replace(s, image=b"") if isinstance(s, Sample) else s for s in results]
    return path, light, [len(b) for b in images]


def unspill(spilled: tuple) -> list:
    """Inverse of :func:`spill` (in the converter): read the file back, delete it."""
    path, light, lengths = spilled
    with open(path, "rb") as fh:
        blob = fh.read()
    os.unlink(path)
    out, pos, k = [], 0, 0
    for item in light:
        if isinstance(item, Sample):
            out.append(dataclasses.replace(item, image=blob[pos:pos + lengths[k]]))
            pos += lengths[k]
            k += 1
        else:
            out.append(item)
    return out


def _ingest_all(paths: list[bytes], relpaths: list[bytes], labels: list[int], storage: StorageSpec):
    out: list = []
    read_bytes = 0
    for path, rel, label in zip(paths, relpaths, labels):
        try:
            data = _read_bytes(path)
            read_bytes += len(data)
            sample = ingest(path, rel, label, storage, data)
        except Rejected as reason:
            out.append(str(reason))
            continue
        except MemoryError:
            out.append("out of memory while decoding (image too large for this machine)")
            continue
        out.append(sample)
    return out, read_bytes
