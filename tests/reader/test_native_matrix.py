"""Every supported format, depth and channel count, end to end: converted from a folder (both
backends) and written by ``fastdata.write``, then read with ``image_mode="unchanged"`` in the main
process and in 2 DataLoader workers; each image equals its reference reader's array bit for bit,
dtype and shape included (references: ``cv2.imread(IMREAD_UNCHANGED)`` in RGB order for PNG,
``tifffile.imread`` for TIFF, ``pydicom.dcmread(...).pixel_array`` for DICOM; see
``tests/helpers/native_images.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import fastdata
from helpers.native_images import native_cases

_SUFFIX = {"png": ".png", "tiff": ".tif", "dicom": ".dcm"}


def _suffix(name: str) -> str:
    for key, suffix in _SUFFIX.items():
        if name.lower().startswith(key):
            return suffix
    raise AssertionError(f"case {name!r}: unknown family")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """The cases as a class-folder tree (one class per file family), and relpath -> reference."""
    root = tmp_path_factory.mktemp("native")
    references = {}
    for name, data, reference in native_cases():
        suffix = _suffix(name)
        folder = root / "src" / suffix.lstrip(".")
        folder.mkdir(parents=True, exist_ok=True)
        rel = f"{suffix.lstrip('.')}/{name.replace(' ', '_').replace('/', '_')}{suffix}"
        (root / "src" / rel).write_bytes(data)
        references[rel] = reference
    assert {rel.split("/")[0] for rel in references} == {"png", "tif", "dcm"}
    return str(root), references


def _check(ds, references: dict[str, np.ndarray], images) -> int:
    checked = 0
    for i, image in images:
        rel = ds.relpath(i)
        expected = references[rel]
        got = image.numpy() if isinstance(image, torch.Tensor) else image
        assert got.dtype == expected.dtype and got.shape == expected.shape, (rel, got.dtype, got.shape)
        np.testing.assert_array_equal(got, expected, err_msg=rel)
        checked += 1
    return checked


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_converted_folder_reads_back_as_the_reference_arrays(cases, backend, tmp_path):
    root, references = cases
    dst = str(tmp_path / f"native.{backend}")
    report = fastdata.convert(os.path.join(root, "src"), dst, workers=2)
    assert report.rejected == 0, report.rejected_items
    # a store holding DICOM images records "unchanged" as its default read mode (DICOM has no RGB form)
    assert fastdata.open_dataset(dst).image_mode == "unchanged"
    ds = fastdata.open_dataset(dst, image_mode="unchanged", output="numpy")
    assert len(ds) == len(references)
    assert _check(ds, references, ((i, ds[i][0]) for i in range(len(ds)))) == len(references)
    # the same through 2 forked DataLoader workers, one sample at a time (the shapes differ)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert _check(ds, references, ((i, sample[0]) for i, sample in enumerate(loader))) == len(references)


def test_written_samples_read_back_as_the_reference_arrays(cases, tmp_path):
    root, references = cases
    rels = sorted(references)
    dst = str(tmp_path / "written.lmdb")
    fastdata.write([{"scan": os.path.join(root, "src", rel), "n": k} for k, rel in enumerate(rels)], dst, workers=2)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.image_modes == {"scan": "unchanged"}  # not called image: read as stored by default
    images = ((k, ds[k]["scan"]) for k in range(len(ds)))
    by_index = {k: rels[k] for k in range(len(rels))}
    for k, image in images:
        expected = references[by_index[k]]
        assert image.dtype == expected.dtype and image.shape == expected.shape, by_index[k]
        np.testing.assert_array_equal(image, expected, err_msg=by_index[k])
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    for k, sample in enumerate(loader):
        np.testing.assert_array_equal(np.asarray(sample["scan"]), references[by_index[k]], err_msg=by_index[k])
