"""The one image-opening policy: every place fastdata hands bytes to Pillow goes
through :func:`open_image`.

The policy, the same at conversion time (validating inputs), at read time
(``ds[i]``, batches, the fused ``decode=`` transforms) and in ``fastdata verify``:

* **Content decides the decoder**, as ``PIL.Image.open`` does for ImageFolder: a
  PNG named ``.jpg`` is a PNG. A record's format field is metadata, never a
  decoder choice, so every read path gives the same answer for the same bytes.
* **A fixed allow-list** of decoders, :data:`ALLOWED_FORMATS` (the formats of
  torchvision's ``IMG_EXTENSIONS``), never "whatever plugins Pillow has": a hostile
  file or record cannot reach an exotic decoder.
* **Decompression bombs are errors**: Pillow only *warns* between
  ``Image.MAX_IMAGE_PIXELS`` and twice that; here both refuse the image. The
  simplejpeg fast paths (which never call Pillow) check the same limit through
  :func:`fast_jpeg_size`.
* **One error type**, :class:`ImageDecodeError`, whatever Pillow raised.
"""

from __future__ import annotations

import io
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image

Buffer = bytes | bytearray | memoryview

#: the only decoders Pillow may try (the Pillow format names of torchvision's
#: IMG_EXTENSIONS: .pgm files are Pillow's "PPM"; camera "MPO" files are JPEGs
#: that Pillow's JPEG decoder opens, see :func:`stored_format`)
ALLOWED_FORMATS = ("BMP", "JPEG", "PNG", "PPM", "TIFF", "WEBP")
#: simplejpeg colour spaces whose RGB output equals Pillow's convert("RGB")
#: (CMYK/YCCK differ by rounding and go through Pillow)
SIMPLEJPEG_SAFE_COLORSPACES = frozenset({"RGB", "YCbCr", "Gray"})
_JPEG_SOI = b"\xff\xd8"


class ImageDecodeError(OSError):
    """The bytes are not an image fastdata may decode: not one of
    :data:`ALLOWED_FORMATS`, truncated or corrupt, or a decompression bomb.

    A subclass of ``OSError``, as Pillow's own decode errors are, so code written
    for ``PIL.Image.open`` keeps catching it. ``str(err)`` is a one-line reason.
    """


def open_image(data: Buffer, allowed: tuple[str, ...] = ALLOWED_FORMATS) -> Image.Image:
    """Open and fully decode ``data`` under the policy of this module.

    Args:
        data (bytes | bytearray | memoryview): an encoded image file.
        allowed (tuple[str, ...]): Pillow format names that may be tried.

    Returns:
        PIL.Image.Image: the loaded image (any mode; call ``convert("RGB")``).

    Raises:
        ImageDecodeError: empty, unrecognised or disallowed format, a decompression
            bomb, or truncated/corrupt data.
    """
    if len(data) == 0:
        raise ImageDecodeError("empty file (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=allowed)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ImageDecodeError(f"decompression bomb: {err}") from None
        except Image.UnidentifiedImageError:
            raise ImageDecodeError(
                f"not a recognised image (garbage, or not one of {', '.join(allowed)})") from None
        except Exception as err:  # noqa: BLE001 - Pillow raises many unrelated types on garbage
            raise ImageDecodeError(f"not a recognised image ({type(err).__name__}: {err})") from None
        try:
            im.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ImageDecodeError(f"decompression bomb: {err}") from None
        except Exception as err:  # noqa: BLE001 - likewise for decoder errors
            raise ImageDecodeError(
                f"truncated or corrupt {im.format} image data ({type(err).__name__}: {err})") from None
    return im


def stored_format(im: Image.Image) -> str:
    """The format name a store records for an image opened by :func:`open_image`.

    Pillow calls a JPEG with a multi-picture extension (most phone and camera
    photos with a depth map or preview) "MPO"; it is a JPEG file whose first
    picture is what ``Image.open(...).convert("RGB")`` returns, so it is stored as JPEG.
    """
    return "JPEG" if im.format == "MPO" else str(im.format)


def fast_jpeg_size(data: Buffer) -> tuple[int, int] | None:
    """``(height, width)`` when simplejpeg may decode ``data`` instead of Pillow
    with the same pixels and the same refusals, else None (use :func:`open_image`).

    Not for: non-JPEG bytes (whatever the record's format field says), colour
    spaces simplejpeg converts differently, and images over Pillow's
    decompression-bomb limit (Pillow must refuse those, so the fast path must not
    decode them either).
    """
    if bytes(data[:2]) != _JPEG_SOI:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - any header failure defers to Pillow's verdict
        return None
    if colorspace not in SIMPLEJPEG_SAFE_COLORSPACES:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        return None
    return height, width


#: the pixel limit when Pillow's ``Image.MAX_IMAGE_PIXELS`` is None (bomb checks turned off):
#: a store's declared sizes are still checked against it before memory is allocated
PIXEL_LIMIT_WITHOUT_PILLOW_LIMIT = 1 << 31


def pixel_limit() -> int:
    """The most pixels (width x height) one image may have: Pillow's ``Image.MAX_IMAGE_PIXELS``
    (default 89,478,485), the limit the decoders refuse images beyond; when that is None,
    :data:`PIXEL_LIMIT_WITHOUT_PILLOW_LIMIT`. Readers check a store's declared image sizes
    (index widths and heights, raw shapes) against it before allocating batch memory."""
    limit = Image.MAX_IMAGE_PIXELS
    return PIXEL_LIMIT_WITHOUT_PILLOW_LIMIT if limit is None else int(limit)


def decoded_bytes_limit() -> int:
    """The most bytes one decoded image may hold: :func:`pixel_limit` pixels of 4 bytes (one
    8-bit RGBA pixel, or one float32 value). The decompression-bomb rule of every decoder, and
    what readers check a store's declared sizes, channels and dtypes against before allocating."""
    return pixel_limit() * 4


_scratch = threading.local()


def validate_image(data: Buffer) -> tuple[str, int, int]:
    """Fully decode ``data`` under the policy, keeping no pixels: what a writer checks.

    A JPEG that :func:`fast_jpeg_size` vouches for (same pixels, same refusals as
    Pillow) is decoded by libjpeg-turbo through simplejpeg into a scratch buffer this
    thread reuses: about a fifth faster than Pillow's decoder, and no fresh memory per
    image. Anything else, and any JPEG simplejpeg refuses, gets Pillow's verdict
    through :func:`open_image`.

    Args:
        data (bytes | bytearray | memoryview): an encoded image file.

    Returns:
        tuple[str, int, int]: the format a store records (:func:`stored_format`), width, height.

    Raises:
        ImageDecodeError: as :func:`open_image`.
    """
    size = fast_jpeg_size(data)
    if size is not None:
        height, width = size
        need = height * width * 3
        scratch = getattr(_scratch, "buffer", None)
        if scratch is None or len(scratch) < need:
            scratch = _scratch.buffer = np.empty(need, dtype=np.uint8)
        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=scratch)
            return "JPEG", width, height
        except ValueError:
            pass  # Pillow decides, and words the refusal
    im = open_image(data)
    try:
        return stored_format(im), im.width, im.height
    finally:
        im.close()


def decode_rgb_array(data: Buffer) -> np.ndarray:
    """Writable HxWx3 uint8 RGB array of ``data`` through Pillow under the policy
    (pixel-identical to ``numpy.array(Image.open(f).convert("RGB"))``).

    Raises:
        ImageDecodeError: as :func:`open_image`.
    """
    im = open_image(data)
    try:
        # np.array, not np.asarray: Pillow's array interface hands out read-only bytes,
        # and torch.from_numpy on a read-only array warns (writes would be undefined)
        return np.array(im.convert("RGB"))
    finally:
        im.close()



# -- images as stored: every read mode (fastdata.common.imagemodes) ----------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    """What a writer records of an image (its index entry): the stored format
    (:func:`stored_format`), its size, and its pixels as stored (``image_mode="unchanged"``):
    a numpy dtype name and a channel count."""

    format: str
    width: int
    height: int
    dtype: str = "uint8"
    channels: int = 3


#: Pillow mode -> (numpy dtype name, channels) of its pixels as stored (modes not listed: see _native_of)
_PILLOW_NATIVE = {
    "1": ("uint8", 1), "L": ("uint8", 1), "P": ("uint8", 1), "LA": ("uint8", 2), "PA": ("uint8", 2),
    "La": ("uint8", 2), "RGB": ("uint8", 3), "YCbCr": ("uint8", 3), "LAB": ("uint8", 3), "HSV": ("uint8", 3),
    "RGBA": ("uint8", 4), "RGBa": ("uint8", 4), "RGBX": ("uint8", 4), "CMYK": ("uint8", 4),
    "I;16": ("uint16", 1), "I;16L": ("uint16", 1), "I;16B": ("uint16", 1), "I;16N": ("uint16", 1),
    "I": ("int32", 1), "F": ("float32", 1),
}


def _native_of(im: Image.Image) -> tuple[str, int]:
    """(dtype, channels) of a Pillow image's pixels as stored."""
    try:
        return _PILLOW_NATIVE[im.mode]
    except KeyError:
        raise ImageDecodeError(f"{im.format} image of Pillow mode {im.mode!r} is not supported") from None


def _pillow_array(im: Image.Image) -> np.ndarray:
    """A writable array of a loaded Pillow image's pixels as stored: HxW or HxWxC, own dtype."""
    if im.mode == "1":
        return np.array(im, dtype=np.uint8) * np.uint8(255)  # as libpng, cv2 and torchvision expand 1-bit
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        return np.array(im).astype(np.uint16)
    if im.mode in ("YCbCr", "LAB", "HSV", "RGBa", "La"):
        return np.array(im)
    return np.array(im)


def inspect_image(data: Buffer) -> ImageInfo:
    """Fully decode ``data`` under the policy, keeping no pixels: what a writer checks and records.

    Args:
        data (bytes | bytearray | memoryview): an encoded image file.

    Returns:
        ImageInfo: stored format, width, height, and the dtype and channel count of its
        pixels as stored.

    Raises:
        ImageDecodeError: as :func:`open_image`.
    """
    size = fast_jpeg_size(data)
    if size is not None:
        fmt, width, height = validate_image(data)
        channels = 1 if simplejpeg.decode_jpeg_header(data)[2] == "Gray" else 3
        return ImageInfo(fmt, width, height, "uint8", channels)
    im = open_image(data)
    try:
        dtype, channels = _native_of(im)
        return ImageInfo(stored_format(im), im.width, im.height, dtype, channels)
    finally:
        im.close()


def decode_image(data: Buffer, mode: str = "RGB") -> np.ndarray:
    """Decode ``data`` in read mode ``mode`` (see :mod:`fastdata.common.imagemodes`).

    Args:
        data (bytes | bytearray | memoryview): an encoded image file.
        mode (str): ``"RGB"`` (HxWx3 uint8, pixel-identical to ``Image.open(f).convert("RGB")``),
            ``"L"`` (HxW uint8), ``"RGBA"`` (HxWx4 uint8), or ``"unchanged"``: HxW for one
            channel, else HxWxC, in the stored dtype.

    Returns:
        numpy.ndarray: writable and C-contiguous.

    Raises:
        ImageDecodeError: as :func:`open_image`.
        ImageModeError: a Pillow mode asked of an image Pillow cannot open (a DICOM, a 5-band TIFF).
    """
    if mode == "RGB":
        size = fast_jpeg_size(data)
        if size is not None:
            try:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            except ValueError:
                pass
        return decode_rgb_array(data)
    if mode == "unchanged":
        size = fast_jpeg_size(data)
        if size is not None:
            try:
                if simplejpeg.decode_jpeg_header(data)[2] == "Gray":
                    return simplejpeg.decode_jpeg(data, colorspace="GRAY")[:, :, 0].copy()
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            except ValueError:
                pass
        im = open_image(data)
        try:
            _native_of(im)
            return _pillow_array(im)
        finally:
            im.close()
    if mode in ("L", "RGBA"):
        im = open_image(data)
        try:
            return np.array(im.convert(mode))
        finally:
            im.close()
    raise ValueError(f"unknown image mode {mode!r}")


def decode_pil_image(data: Buffer, mode: str = "RGB") -> Image.Image:
    """Decode ``data`` in read mode ``mode`` as a PIL image.

    ``"RGB"``/``"L"``/``"RGBA"``: Pillow's ``convert(mode)``. ``"unchanged"``: the PIL mode
    that holds the stored pixels losslessly (a palette PNG stays ``"P"`` with its palette,
    16-bit grayscale is ``"I;16"``, float32 ``"F"``).

    Raises:
        ImageDecodeError: as :func:`open_image`.
        ImageModeError: no PIL mode holds the image (16-bit RGB, more than 4 channels, ...):
            the message names ``output="numpy"``/``"tensor"``.
    """
    if mode == "unchanged":
        im = open_image(data)
        _native_of(im)
        return im
    return open_image(data).convert(mode)


#: dtypes an image array given to a writer may have (stored losslessly by :func:`encode_lossless`)
ARRAY_IMAGE_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "float32", "float64", "int8", "float16")


def encode_lossless(array: np.ndarray) -> tuple[bytes, str]:
    """Encode an image array losslessly as an image file: what writers store for pixels given
    as an array.

    ``uint8`` with 1, 2, 3 or 4 channels becomes a PNG (what every image tool reads,
    ImageFolder included); any other dtype or channel count a TIFF with zstd compression
    (tifffile with imagecodecs; measured on 512x512 16-bit CT-like images: the same size as
    PNG and 3-5x faster to decode).

    Args:
        array (numpy.ndarray): HxW or HxWxC (channels last), a dtype of :data:`ARRAY_IMAGE_DTYPES`.

    Returns:
        tuple[bytes, str]: the file's bytes and its format name (``"PNG"`` or ``"TIFF"``).

    Raises:
        ValueError: another dtype or number of dimensions.
        ImportError: a TIFF is needed and tifffile/imagecodecs are not installed
            (``pip install 'fastdata[images]'``).
    """
    array = np.asarray(array)
    if array.dtype.name not in ARRAY_IMAGE_DTYPES or array.ndim not in (2, 3) or 0 in array.shape:
        raise ValueError(f"an image array must be HxW or HxWxC of dtype {', '.join(ARRAY_IMAGE_DTYPES)}; "
                         f"got {array.dtype} of shape {array.shape}")
    channels = 1 if array.ndim == 2 else array.shape[2]
    if array.dtype == np.uint8 and channels <= 4:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array[..., 0] if array.ndim == 3 and channels == 1 else array)).save(
            buf, format="PNG")
        return buf.getvalue(), "PNG"
    try:
        import imagecodecs  # noqa: F401 - tifffile's zstd codec
        import tifffile
    except ImportError as err:
        raise ImportError(f"storing a {array.dtype} image of {channels} channel(s) needs tifffile and imagecodecs: "
                          "pip install 'fastdata[images]'") from err
    buf = io.BytesIO()
    tifffile.imwrite(buf, np.ascontiguousarray(array), photometric="rgb" if channels == 3 and array.ndim == 3
                     else "minisblack", planarconfig="contig" if array.ndim == 3 else None, compression="zstd",
                     metadata=None)
    return buf.getvalue(), "TIFF"
