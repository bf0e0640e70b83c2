"""One image-opening policy on every path that hands bytes to Pillow.

The stores here are written with fastdata's own shard writers and ``publish``
(so every checksum — record, index, shard file, manifest — is right) but hold
records the converter would never write: a GIF (a format outside the allow-list)
recorded as PNG, a PNG recorded as JPEG. Every read path must give the same
verdict: ``ds[i]`` as pil/numpy/tensor, the ``__getitems__`` batch path, the fused
``decode=`` transforms, and ``verify(decode=True)``.

Decompression bombs are tested by lowering ``PIL.Image.MAX_IMAGE_PIXELS`` below
the size of the stored images (16x12 = 192 pixels; limit 100 puts them in the
band where Pillow only warns), which also covers the simplejpeg fast paths that
never call Pillow.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from helpers.backends import NAME_SUFFIXES
from PIL import Image

import fastdata
from fastdata.common.fileio import file_checksum
from fastdata.common.imageio import ALLOWED_FORMATS, ImageDecodeError, open_image
from fastdata.errors import CorruptRecordError
from fastdata.format.backends.base import Sample, StorageSpec
from fastdata.format.backends.registry import writer_class
from fastdata.format.names import shard_name
from fastdata.format.record import checksum
from fastdata.reader.open import open_dataset
from fastdata.transforms import CenterCrop, RandomResizedCrop, Resize, full_decode
from fastdata.writer.pipeline import ShardResult, publish

pytestmark = pytest.mark.timeout(120)

SIZE = (16, 12)  # (width, height)


def _encoded(fmt: str, seed: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def _write_store(dst: str, backend: str, records: list[tuple[bytes, str]]) -> str:
    """A one-shard store holding ``records`` ((image bytes, recorded format)) as given."""
    os.makedirs(dst)
    storage = StorageSpec()
    name = shard_name(backend, 0)
    path = os.path.join(dst, name)
    writer = writer_class(backend)(path, storage)
    samples = [Sample(image=data, label=0, width=SIZE[0], height=SIZE[1], fmt=fmt, xxh=checksum(data),
                      relpath=f"a/{i}.img".encode()) for i, (data, fmt) in enumerate(records)]
    writer.put(samples)
    writer.close()
    result = ShardResult(shard_id=0, name=name, count=len(samples), bytes=os.path.getsize(path),
                         xxh=file_checksum(path), image_bytes=sum(len(s.image) for s in samples), input_bytes=0,
                         class_counts=[len(samples)], rejected=[])
    publish(dst=dst, backend=backend, classes=["a"], remarks=[], storage=storage, results=[result],
            options={"source": dst, "shard_size": 1 << 20, "strict": False, "fingerprint": "test"})
    return dst


GOOD_JPEG, GOOD_PNG = _encoded("JPEG", 1), _encoded("PNG", 2)
GIF = _encoded("GIF", 3, mode="P")
TRANSFORMS = {"RandomResizedCrop": RandomResizedCrop(8), "CenterCrop": CenterCrop(8), "Resize": Resize((8, 8))}


def _read_paths(store: str, index: int):
    """Every way fastdata reads sample ``index``: name -> zero-arg callable."""
    paths = {}
    for output in ("pil", "numpy", "tensor"):
        ds = open_dataset(store, output=output)
        paths[f"ds[i] {output}"] = (lambda ds=ds: ds[index])
    for output in ("numpy", "tensor"):  # the fixed-shape batch path (pil batches are lists of ds[i])
        ds = open_dataset(store, output=output)
        paths[f"__getitems__ {output}"] = (lambda ds=ds: ds.__getitems__([0, index]))
    for name, transform in TRANSFORMS.items():
        ds = open_dataset(store, output="tensor", decode=transform)
        paths[f"decode={name} ds[i]"] = (lambda ds=ds: ds[index])
        paths[f"decode={name} __getitems__"] = (lambda ds=ds: ds.__getitems__([0, index]))
    return paths


@pytest.mark.parametrize("backend,suffix", NAME_SUFFIXES)
def test_a_record_in_a_format_outside_the_allow_list_is_refused_on_every_read_path(tmp_path, backend, suffix):
    assert "GIF" not in ALLOWED_FORMATS
    store = _write_store(str(tmp_path / ("s" + suffix)), backend,
                         [(GOOD_JPEG, "JPEG"), (GIF, "PNG"), (GOOD_PNG, "PNG")])
    verdicts = {name: _error_of(read) for name, read in _read_paths(store, 1).items()}
    accepted = [name for name, err in verdicts.items() if err is None]
    assert not accepted, f"read paths that decoded a GIF record: {accepted}"
    for name, err in verdicts.items():
        assert isinstance(err, CorruptRecordError) and "sample 1" in str(err), (name, err)
        assert "not a recognised image" in str(err), (name, err)
    # control: the neighbours read fine on every path (the refusal is about that record)
    for read in _read_paths(store, 2).values():
        read()
    report = fastdata.verify(store, decode=True)
    assert not report.ok and any("record 1" in p and "not a recognised image" in p for p in report.problems), \
        report.problems
    # full_decode, the public decode helper, applies the same policy
    with pytest.raises(ImageDecodeError):
        full_decode(GIF)


@pytest.mark.parametrize("backend,suffix", NAME_SUFFIXES)
def test_decompression_bombs_are_refused_on_every_read_path(tmp_path, backend, suffix, monkeypatch):
    store = _write_store(str(tmp_path / ("s" + suffix)), backend, [(GOOD_JPEG, "JPEG"), (GOOD_PNG, "PNG")])
    # control: under the default limit everything reads
    for index in (0, 1):
        for read in _read_paths(store, index).values():
            read()
    assert fastdata.verify(store, decode=True).ok
    # 192 pixels with a limit of 100: the band where Pillow itself only warns
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for index in (0, 1):  # the JPEG (simplejpeg fast paths) and the PNG (Pillow)
        verdicts = {name: _error_of(read) for name, read in _read_paths(store, index).items()}
        accepted = [name for name, err in verdicts.items() if err is None]
        assert not accepted, f"read paths that decoded sample {index} over the pixel limit: {accepted}"
        for name, err in verdicts.items():
            assert isinstance(err, CorruptRecordError) and "decompression bomb" in str(err), (name, err)
    report = fastdata.verify(store, decode=True)
    assert not report.ok and sum("decompression bomb" in p for p in report.problems) == 2, report.problems


def _error_of(read) -> Exception | None:
    """The exception ``read()`` raises, or None when it returns."""
    try:
        read()
    except Exception as err:  # noqa: BLE001 - the test inspects the type
        return err
    return None


def _reference(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("backend,suffix", NAME_SUFFIXES)
def test_a_record_labelled_jpeg_holding_png_bytes_decodes_by_content_on_every_path(tmp_path, backend, suffix):
    """The format field never picks the decoder: the same bytes give the same pixels
    whatever the record says, on every path (before, ds[i] refused what decode= read)."""
    mislabelled = _write_store(str(tmp_path / ("m" + suffix)), backend, [(GOOD_JPEG, "JPEG"), (GOOD_PNG, "JPEG")])
    honest = _write_store(str(tmp_path / ("h" + suffix)), backend, [(GOOD_JPEG, "JPEG"), (GOOD_PNG, "PNG")])
    expected = _reference(GOOD_PNG)
    ours, theirs = _read_paths(mislabelled, 1), _read_paths(honest, 1)
    for name in ours:
        got, want = _image_of(ours[name]()), _image_of(theirs[name]())
        if "decode=" not in name:
            assert np.array_equal(got, expected), name
        if "RandomResizedCrop" in name:  # a random crop differs from draw to draw: same shape
            assert got.shape == want.shape, name
        else:
            assert np.array_equal(got, want), name
    assert fastdata.verify(mislabelled, decode=True).ok


def _image_of(result) -> np.ndarray:
    """HWC numpy pixels of a sample ``(image, label)`` or of a batch's last sample."""
    image = result[0] if isinstance(result, tuple) else result[-1][0]
    if isinstance(image, torch.Tensor):
        return image.permute(1, 2, 0).numpy()
    return np.asarray(image)


def test_open_image_maps_every_failure_to_one_error_type():
    assert open_image(GOOD_PNG).format == "PNG"
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    big_jpeg = buf.getvalue()
    for bad, reason in ((b"", "empty"), (b"\x00garbage" * 10, "not a recognised image"),
                        (GIF, "not a recognised image"), (big_jpeg[:len(big_jpeg) * 3 // 4], "truncated or corrupt")):
        with pytest.raises(ImageDecodeError, match=reason):
            open_image(bad)
    # an OSError, like Pillow's own decode errors, so callers written for Pillow keep working
    assert issubclass(ImageDecodeError, OSError)
