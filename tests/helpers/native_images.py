"""Small generated images in their native bit depths and channel counts, each with the array a
reference library reads from it: for the codec tests and any test that stores or reads such images.

``native_cases()`` gives ``(name, file bytes, reference array)``: the reference is what
``decode_image(data, "unchanged")`` must give bit for bit (dtype and shape included):

* PNG 8/16-bit gray, RGB, RGBA written by ``cv2.imencode``; reference ``cv2.imdecode(IMREAD_UNCHANGED)``
  with BGR(A) reordered to RGB(A). Gray+alpha (cv2 cannot write 2 channels) is written by imagecodecs;
  reference the array written (a lossless round trip), checked against Pillow for 8 bits.
* TIFF uint8/uint16/int16/float32 x 1/3/4/5 bands x deflate/LZW (planar for 3 and 5 bands); reference
  ``tifffile.imread`` with planar made channels last.
* DICOM 16-bit MONOCHROME2, uncompressed and RLE Lossless, built with pydicom; reference
  ``pydicom.dcmread(...).pixel_array``.
"""

from __future__ import annotations

import io

import numpy as np

#: the size of every generated image: small, so the tests stay fast, and not square (catches H/W swaps)
HEIGHT, WIDTH = 24, 32


def pixels(dtype, channels: int, seed: int = 0, shape: tuple[int, int] = (HEIGHT, WIDTH)) -> np.ndarray:
    """Random pixels over the dtype's whole range (floats: negative and fractional values too):
    HxW for one channel, else HxWxC."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    full = shape if channels == 1 else (*shape, channels)
    if dtype.kind == "f":
        return (rng.standard_normal(full) * 1000).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, full, dtype=dtype, endpoint=True)


def png_cv2(array: np.ndarray) -> tuple[bytes, np.ndarray]:
    """A PNG of ``array`` (RGB order) written by OpenCV, and OpenCV's IMREAD_UNCHANGED reading of it in RGB order."""
    import cv2

    bgr = array if array.ndim == 2 else cv2.cvtColor(array, cv2.COLOR_RGB2BGR if array.shape[2] == 3
                                                     else cv2.COLOR_RGBA2BGRA)
    ok, encoded = cv2.imencode(".png", bgr)
    assert ok
    data = encoded.tobytes()
    ref = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if ref.ndim == 3:
        ref = cv2.cvtColor(ref, cv2.COLOR_BGR2RGB if ref.shape[2] == 3 else cv2.COLOR_BGRA2RGBA)
    return data, ref


def tiff(array: np.ndarray, compression: str | None = "deflate", planar: bool = False, **kwargs) -> bytes:
    """A one-page TIFF of ``array`` (HxW or HxWxC) written by tifffile; ``planar`` stores it band by band."""
    import tifffile

    channels = 1 if array.ndim == 2 else array.shape[2]
    photometric = "rgb" if channels in (3, 4) and array.dtype == np.uint8 else "minisblack"
    buf = io.BytesIO()
    if planar and channels > 1:
        tifffile.imwrite(buf, np.ascontiguousarray(np.moveaxis(array, -1, 0)), photometric=photometric,
                         planarconfig="separate", compression=compression, metadata=None, **kwargs)
    else:
        tifffile.imwrite(buf, array, photometric=photometric, planarconfig="contig" if channels > 1 else None,
                         compression=compression, metadata=None,
                         extrasamples=["unassalpha"] if photometric == "rgb" and channels == 4 else None, **kwargs)
    return buf.getvalue()


def tiff_reference(data: bytes) -> np.ndarray:
    """``tifffile.imread`` of a one-page TIFF, a planar one made channels last."""
    import tifffile

    with tifffile.TiffFile(io.BytesIO(data)) as tif:
        page = tif.pages.first
        array = tif.asarray()
        return np.ascontiguousarray(np.moveaxis(array, 0, -1) if page.axes == "SYX" else array)


def dicom(array: np.ndarray | None, rle: bool = False, frames: int = 1, **tags) -> bytes:
    """A 16-bit MONOCHROME2 CT-like DICOM file of ``array`` (HxW uint16 or int16) built with pydicom,
    uncompressed or RLE Lossless; ``array=None`` gives a file without pixel data. ``tags`` set more
    elements (keyword=value), last: ``Rows=40000`` makes a header that lies about the pixel data."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, RLELossless, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(None, {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = CTImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "CT"
    ds.PatientName = "Test^Synthetic"
    ds.RescaleSlope = "1.5"
    ds.RescaleIntercept = "-1024"
    ds.PixelSpacing = [0.5, 0.625]
    if array is not None:
        stack = np.stack([array] * frames) if frames > 1 else array
        ds.set_pixel_data(stack, photometric_interpretation="MONOCHROME2", bits_stored=16,
                          generate_instance_uid=False)
        if rle:
            ds.compress(RLELossless, encoding_plugin="pydicom", generate_instance_uid=False)
        if frames > 1:
            ds.NumberOfFrames = frames
    for key, value in tags.items():  # after the pixel data, which sets Rows, Columns, ... from the array
        setattr(ds, key, value)
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def dicom_reference(data: bytes) -> np.ndarray:
    """``pydicom.dcmread(...).pixel_array``."""
    import pydicom

    return pydicom.dcmread(io.BytesIO(data)).pixel_array


def native_cases() -> list[tuple[str, bytes, np.ndarray]]:
    """Every generated case as ``(name, file bytes, reference array)`` (see the module docstring)."""
    import imagecodecs
    from PIL import Image

    cases: list[tuple[str, bytes, np.ndarray]] = []
    for dtype in ("uint8", "uint16"):
        for channels, name in ((1, "gray"), (3, "rgb"), (4, "rgba")):
            data, ref = png_cv2(pixels(dtype, channels, seed=channels))
            cases.append((f"png-{dtype}-{name}", data, ref))
        ga = pixels(dtype, 2, seed=2)
        data = imagecodecs.png_encode(ga)
        if dtype == "uint8":
            assert np.array_equal(np.array(Image.open(io.BytesIO(data))), ga)
        cases.append((f"png-{dtype}-gray-alpha", data, ga))
    for dtype in ("uint8", "uint16", "int16", "float32"):
        for channels in (1, 3, 4, 5):
            for compression in ("deflate", "lzw"):
                data = tiff(pixels(dtype, channels, seed=channels), compression, planar=channels in (3, 5))
                cases.append((f"tiff-{dtype}-{channels}band-{compression}", data, tiff_reference(data)))
    ct = pixels("uint16", 1, seed=7) >> 4  # 12 bits of a 16-bit sample, as CT scanners store them
    for rle in (False, True):
        data = dicom(ct, rle=rle)
        cases.append((f"dicom-uint16-{'rle' if rle else 'raw'}", data, dicom_reference(data)))
    return cases
