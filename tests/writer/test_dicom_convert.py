"""DICOM folders convert like image folders: a classification store whose default read mode is
"unchanged", or with --dicom-tags a general store keeping those tags as fields. The fixtures are
real DICOM files built with pydicom (tests/helpers/native.py)."""

from __future__ import annotations

import pydicom
import pytest
from helpers.native import dicom_tree, v1_records, v2_records, write_dicom

import fastdata
from fastdata.cli.main import main
from fastdata.format.fields import Image
from fastdata.format.manifest import read_manifest, schema_of

TAGS = ["RescaleSlope", "RescaleIntercept", "PhotometricInterpretation", "PixelSpacing"]


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "ct"
    return root, dicom_tree(root, {"lung": 2, "liver": 3})


def test_dicom_folder_is_a_classification_store_read_unchanged_by_default(tmp_path, tree):
    root, pixels = tree
    report = fastdata.convert(root, tmp_path / "ct.lmdb", workers=1, progress=False)
    assert report.images == 5 and report.rejected == 0
    manifest = read_manifest(str(tmp_path / "ct.lmdb"))
    assert manifest["version"] == 1 and manifest["classes"] == ["liver", "lung"]
    assert manifest["image_modes"] == {"image": "unchanged"}
    for rec in v1_records(tmp_path / "ct.lmdb"):
        assert rec["fmt"] == "DICOM" and (rec["dtype"], rec["channels"]) == ("int16", 1)
        assert rec["image"] == (root / rec["relpath"]).read_bytes()  # stored bit-exact
    assert "default read mode of 'image': 'unchanged'" in report.summary()


def test_image_mode_overrides_the_recorded_default(tmp_path, tree):
    root, _ = tree
    fastdata.convert(root, tmp_path / "rgb.lmdb", image_mode="RGB", workers=0, progress=False)
    assert read_manifest(str(tmp_path / "rgb.lmdb"))["image_modes"] == {"image": "RGB"}


def test_dicom_tags_become_fields_of_a_general_store(tmp_path, tree):
    root, pixels = tree
    (root / "lung" / "broken.dcm").write_bytes(b"DICM" * 10)  # rejected, with the decoder's reason
    report = fastdata.convert(root, tmp_path / "tags.h5", dicom_tags=",".join(TAGS), workers=1, progress=False)
    assert report.images == 5 and [p for p, _ in report.rejected_items] == ["lung/broken.dcm"]
    assert report.rejected_items[0][1]
    manifest = read_manifest(str(tmp_path / "tags.h5"))
    schema = schema_of(manifest)
    assert schema.names == ("image", "label", *TAGS)
    assert isinstance(schema["image"], Image) and schema["image"].mode == "unchanged"
    assert manifest["classes"] == ["liver", "lung"] and manifest["class_counts"] == [3, 2]
    for rec in v2_records(tmp_path / "tags.h5"):
        path = rec["path"].decode()
        ds = pydicom.dcmread(path)
        assert rec["RescaleSlope"] == float(ds.RescaleSlope)
        assert rec["RescaleIntercept"] == float(ds.RescaleIntercept)
        assert rec["PhotometricInterpretation"] == "MONOCHROME2"
        assert rec["PixelSpacing"] == [0.5, 0.5]
        assert rec["label"] == manifest["classes"].index(path.split("/")[-2])
        assert (rec["image.format"], rec["image.dtype"], rec["image.channels"]) == ("DICOM", "int16", 1)
        with open(path, "rb") as fh:
            assert rec["image"] == fh.read()
    assert "kept DICOM tag(s) as fields" in report.summary()


def test_dicom_extensions_are_in_the_one_table():
    from fastdata.common.extensions import EXTENSION_FORMATS, has_image_extension

    assert EXTENSION_FORMATS[".dcm"] == EXTENSION_FORMATS[".dicom"] == "DICOM"
    assert has_image_extension("scan/IM0001.DCM") and has_image_extension(b"x.dicom")


@pytest.mark.parametrize("extra, expect", [
    (["--dicom-tags", "RescaleSlope", "--lossless", "tiff"], "--dicom-tags keeps each DICOM file's bytes"),
    (["--dicom-tags", "RescaleSlope", "--max-side", "64"], "--dicom-tags keeps each DICOM file's bytes"),
    (["--dicom-tags", "image"], "not a DICOM keyword"),
    (["--dicom-tags", "Rescale Slope"], "not a DICOM keyword"),
    (["--dicom-tags", "PixelSpacing,PixelSpacing"], "named twice"),
    (["--dicom-tags", ","], "comma-separated list"),
])
def test_cli_dicom_tag_errors_are_one_line(tmp_path, capsys, extra, expect):
    write_dicom(tmp_path / "src" / "a" / "x.dcm")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "o.lmdb"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fastdata: error: ") and expect in err, err
    assert not (tmp_path / "o.lmdb").exists()
