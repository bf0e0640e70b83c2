"""Hostile source files (issue 36): crafted WebDataset tars, COCO annotation files and Decathlon
``dataset.json`` files are refused or rejected with a typed, named reason, within bounded memory,
and never pull a file from outside the source into the store. Each attack has a control: the
benign version of the same file converts.

The attacks run in a fresh fork of one zygote process (:class:`helpers.hostile.Harness`, given
this module's ``case_*`` functions; :func:`zygote_setup`: fastdata imported and one small
conversion done once), under ``RLIMIT_AS`` = the zygote's address space + :data:`GROWTH` and a
timeout: without the fixes the memory attacks end in a MemoryError there instead of costing GiBs.
The tars declare GiBs in sparse files (a few KiB on disk).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers.hostile import Harness

#: the memory a case may use beyond the zygote's
GROWTH = 1 << 30
TIMEOUT = 30.0


# -- the zygote ---------------------------------------------------------------------------------

def zygote_setup(workdir: str) -> None:
    """In the harness's zygote, once: the imports the cases need and one small conversion, inherited
    by every child (so a child's growth is the case's own)."""
    import nibabel  # noqa: F401 - imported once, inherited by every child
    import pycocotools.mask  # noqa: F401

    import fastdata
    import fastdata.reader.targets  # noqa: F401
    import fastdata.writer.sources.volumes.nifti  # noqa: F401

    write_tar(Path(workdir) / "warm.tar", [("a.jpg", jpeg(0)), ("a.cls", b"0"), ("a.json", b"{}")])
    fastdata.convert(os.path.join(workdir, "warm.tar"), os.path.join(workdir, "warm.lmdb"), workers=0,
                     progress=False)


#: what the harness adds to a case's own result
_HARNESS_KEYS = ("elapsed", "vm_peak", "growth", "log_tail")


class _Cases:
    """The cases below, each run by :class:`helpers.hostile.Harness` in a fresh fork of its zygote
    under ``RLIMIT_AS`` = the zygote's size + :data:`GROWTH` and :data:`TIMEOUT`."""

    def __init__(self, harness: Harness):
        self.harness = harness

    def run(self, case: str, **args) -> dict:
        result = self.harness.run(case, timeout=TIMEOUT, growth=GROWTH, **args)
        return {k: v for k, v in result.items() if k not in _HARNESS_KEYS}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    harness = Harness(tmp_path_factory.mktemp("zygote"), cases=__file__)
    yield _Cases(harness)
    harness.close()


# -- the cases (run in the zygote's children) ----------------------------------------------------

def case_convert(src: str, dst: str, coco_images: str | None = None, strict: bool = False) -> dict:
    import fastdata

    if coco_images is not None:
        report = fastdata.convert_coco(src, coco_images, dst, workers=0, progress=False, strict=strict)
    else:
        report = fastdata.convert(src, dst, workers=0, progress=False, strict=strict)
    return {"outcome": "ok", "images": report.images, "rejected": report.rejected_items}


def case_masks(annotations: str, height: int, width: int) -> dict:
    from fastdata.reader.targets import coco_target

    try:
        target = coco_target(json.loads(annotations), 1, (height, width), ["masks"])
    except ValueError as err:
        return {"outcome": "refused", "message": str(err)}
    return {"outcome": "ok", "shape": list(target["masks"].shape), "sum": int(target["masks"].sum())}


# -- crafting -------------------------------------------------------------------------------------

def jpeg(seed: int, size: tuple[int, int] = (12, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(
        buf, "JPEG")
    return buf.getvalue()


def write_tar(path, members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def write_sparse_tar(path, members: list[tuple[str, bytes, int]]) -> None:
    """A tar of ``(name, type, declared size)`` members, their data holes (a sparse file), then a
    benign sample ``b`` (``b.jpg``, ``b.cls``, ``b.txt``)."""
    with open(path, "wb") as fh:
        for name, kind, size in members:
            fh.write(_header(name, size, kind))
            fh.seek(fh.tell() + (size + 511) // 512 * 512)
        for name, data in (("b.jpg", jpeg(2)), ("b.cls", b"1"), ("b.txt", b"b")):
            fh.write(_header(name, len(data)) + data + b"\0" * (-len(data) % 512))
        fh.write(b"\0" * 1024)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _outcome(result: dict) -> str:
    return json.dumps(result)[:1500]


# -- WebDataset tars --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME], ids=["pax", "gnu-long-name"])
def test_an_extended_header_of_gibs_is_refused_before_it_is_read(zygote, tmp_path, kind):
    src = tmp_path / "evil.tar"
    write_sparse_tar(src, [("././@PaxHeader" if kind == tarfile.XHDTYPE else "././@LongLink", kind, 3 << 29)])
    assert os.stat(src).st_size > 1 << 30
    result = zygote.run("case_convert", src=src, dst=tmp_path / "out.lmdb")
    assert result["outcome"] == "typed_error" and result["type"] == "SourceError", _outcome(result)
    assert str(src) in result["message"] and "byte 0" in result["message"]
    assert "1,048,576 byte limit for a tar extended header" in result["message"]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_control_extended_headers_of_long_names_convert(zygote, tmp_path, fmt):
    key = "d" * 150 + "/é-sample"
    write_tar(tmp_path / "ok.tar", [(key + ".jpg", jpeg(1)), (key + ".cls", b"3")], fmt=fmt)
    result = zygote.run("case_convert", src=tmp_path / "ok.tar", dst=tmp_path / "out.lmdb")
    assert result == {"outcome": "ok", "images": 1, "rejected": []}, _outcome(result)


def test_a_sample_whose_members_hold_gibs_is_rejected_and_the_conversion_goes_on(zygote, tmp_path):
    src = tmp_path / "big.tar"
    size = 700 << 20
    write_sparse_tar(src, [("a.jpg", tarfile.REGTYPE, size), ("a.cls", tarfile.REGTYPE, size),
                           ("a.txt", tarfile.REGTYPE, size)])
    result = zygote.run("case_convert", src=src, dst=tmp_path / "out.lmdb")
    assert result["outcome"] == "ok" and result["images"] == 1, _outcome(result)
    [(name, reason)] = result["rejected"]
    assert name == "big.tar a" and "byte limit for one sample" in reason
    strict = zygote.run("case_convert", src=src, dst=tmp_path / "strict.lmdb", strict=True)
    assert strict["outcome"] == "typed_error" and "limit for one sample" in strict["message"], _outcome(strict)


def _json_tar(path, bad_json: bytes) -> None:
    write_tar(path, [("a.jpg", jpeg(1)), ("a.json", b'{"ok": [1, 2]}'),
                     ("b.jpg", jpeg(2)), ("b.json", bad_json),
                     ("c.jpg", jpeg(3)), ("c.json", b'{"ok": []}')])


@pytest.mark.parametrize("attack, reason", [
    ("size", "byte limit"),  # 24 MB of JSON: ~1.25 GB parsed
    ("containers", "JSON lists/objects"),  # 3 MB of nested empty lists
    ("values", "values in one record"),  # 200,000 ints in one list: a record readers would refuse
], ids=["24MB", "containers", "record-budget"])
def test_a_json_member_bomb_rejects_its_sample_not_the_conversion(zygote, tmp_path, attack, reason):
    if attack == "size":
        bad = b"[" + b'{"k": [1]},' * ((24 << 20) // 11) + b"1]"
    elif attack == "containers":
        bad = b"[" + b"[]," * (1 << 20) + b"1]"
    else:
        bad = b"[" + b"1," * 200_000 + b"1]"
    _json_tar(tmp_path / "j.tar", bad)
    result = zygote.run("case_convert", src=tmp_path / "j.tar", dst=tmp_path / "out.lmdb")
    assert result["outcome"] == "ok" and result["images"] == 2, _outcome(result)
    [(name, why)] = result["rejected"]
    assert name == "j.tar b" and reason in why, why


def test_control_json_members_convert(zygote, tmp_path):
    _json_tar(tmp_path / "j.tar", json.dumps({"tags": list(range(1000)), "nested": [[1], {"a": []}]}).encode())
    result = zygote.run("case_convert", src=tmp_path / "j.tar", dst=tmp_path / "out.lmdb")
    assert result == {"outcome": "ok", "images": 3, "rejected": []}, _outcome(result)


def _npy_header_declaring(shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 64


@pytest.mark.parametrize("attack", [True, False], ids=["64GiB-header", "control"])
def test_a_npy_header_declaring_more_than_its_member_holds_is_rejected(zygote, tmp_path, attack):
    good = _npy_bytes(np.arange(6, dtype=np.float64).reshape(3, 2))
    second = _npy_header_declaring((1 << 32, 2)) if attack else _npy_bytes(np.ones((5, 2)))
    write_tar(tmp_path / "n.tar", [("a.jpg", jpeg(1)), ("a.npy", good), ("b.jpg", jpeg(2)), ("b.npy", second)])
    result = zygote.run("case_convert", src=tmp_path / "n.tar", dst=tmp_path / "out.lmdb")
    if not attack:
        assert result == {"outcome": "ok", "images": 2, "rejected": []}, _outcome(result)
        return
    assert result["outcome"] == "ok" and result["images"] == 1, _outcome(result)
    [(name, why)] = result["rejected"]
    assert name == "n.tar b" and "header declares 68,719,476,736 bytes" in why, why


# -- COCO ----------------------------------------------------------------------------------------------

def _coco(tmp_path: Path, anns_of_1: list[dict], file_names: dict[int, str] | None = None,
          images: dict[int, tuple[int, int]] | None = None) -> tuple[Path, Path]:
    """Images 1 and 2 (``images/1.jpg``, ``images/2.jpg``, 10x12) and an annotation file: image 1's
    annotations ``anns_of_1``, image 2 one box."""
    image_dir = tmp_path / "images"
    image_dir.mkdir(exist_ok=True)
    entries = []
    for i in (1, 2):
        (image_dir / f"{i}.jpg").write_bytes(jpeg(i, size=(12, 10)))
        h, w = (images or {}).get(i, (10, 12))
        entries.append({"id": i, "file_name": (file_names or {}).get(i, f"{i}.jpg"), "height": h, "width": w})
    anns = [dict({"id": 100 + k, "image_id": 1, "category_id": 1, "bbox": [0, 0, 2, 2]}, **a)
            for k, a in enumerate(anns_of_1)]
    anns.append({"id": 1, "image_id": 2, "category_id": 1, "bbox": [1, 1, 3, 3]})
    ann_file = tmp_path / "instances.json"
    ann_file.write_text(json.dumps({"images": entries, "annotations": anns,
                                    "categories": [{"id": 1, "name": "thing"}]}))
    return ann_file, image_dir


def _rle(h: int, w: int) -> dict:
    return {"size": [h, w], "counts": [h * w // 2, h * w - h * w // 2]}


@pytest.mark.parametrize("segmentation, reason", [
    ({"size": [30000, 40000], "counts": [1_200_000_000]}, "RLE segmentation size [30000, 40000] is not the image's"),
    ({"size": [10, 12], "counts": [5, 7]}, "add up to 12, not the 120 pixels"),
    ({"size": [10, 12], "counts": "~"}, "not a compressed RLE"),
    ({"size": [30000, 40000], "counts": [1_200_000_000], "unlisted": True}, "is more than the 89,478,485 pixels"),
    ({"size": [10, 12], "counts": [120], "listed": True}, "listed size 30000 x 40000 is more than"),
    (None, "annotations, more than the 5,000 allowed"),
], ids=["declared-size", "short-counts", "bad-string", "unlisted-image-size", "listed-size", "too-many-annotations"])
def test_a_coco_image_with_an_unusable_rle_or_too_many_annotations_is_rejected(zygote, tmp_path, segmentation,
                                                                               reason):
    segmentation = dict(segmentation or {})
    sizes = {1: (-1, -1)} if segmentation.pop("unlisted", False) else {1: (30000, 40000)} \
        if segmentation.pop("listed", False) else None
    anns = [{}] * 5001 if not segmentation else [{"segmentation": segmentation, "iscrowd": 1}]
    ann_file, image_dir = _coco(tmp_path, anns, images=sizes)
    result = zygote.run("case_convert", src=ann_file, dst=tmp_path / "out.lmdb", coco_images=image_dir)
    assert result["outcome"] == "ok" and result["images"] == 1, _outcome(result)
    [(name, why)] = result["rejected"]
    assert name == "1.jpg" and reason in why, why
    strict = zygote.run("case_convert", src=ann_file, dst=tmp_path / "strict.lmdb", coco_images=image_dir,
                        strict=True)
    assert strict["outcome"] == "typed_error" and reason in strict["message"], _outcome(strict)


def test_control_coco_rles_convert(zygote, tmp_path):
    from pycocotools import mask

    m = np.zeros((10, 12), np.uint8, order="F")
    m[2:5, 3:9] = 1
    compressed = mask.encode(m)
    anns = [{"segmentation": _rle(10, 12), "iscrowd": 1},
            {"segmentation": {"size": [10, 12], "counts": compressed["counts"].decode()}, "iscrowd": 1},
            {"segmentation": [[0, 0, 5, 0, 5, 5]], "iscrowd": 0}] + [{}] * 100
    ann_file, image_dir = _coco(tmp_path, anns)
    result = zygote.run("case_convert", src=ann_file, dst=tmp_path / "out.lmdb", coco_images=image_dir)
    assert result == {"outcome": "ok", "images": 2, "rejected": []}, _outcome(result)
    masks = zygote.run("case_masks", annotations=json.dumps(anns[:2]), height=10, width=12)
    assert masks == {"outcome": "ok", "shape": [2, 10, 12], "sum": 60 + 18}, masks


@pytest.mark.parametrize("segmentation", [
    {"size": [30000, 40000], "counts": [1_200_000_000]},
    {"size": [30000, 40000], "counts": "0"},
    {"size": [10, 12], "counts": [1_200_000_000]},
], ids=["declared-size", "declared-size-compressed", "counts"])
def test_v2_masks_refuse_an_rle_that_does_not_fit_the_image_before_allocating(zygote, segmentation):
    anns = [{"bbox": [0, 0, 1, 1], "category_id": 1, "segmentation": segmentation}]
    result = zygote.run("case_masks", annotations=json.dumps(anns), height=10, width=12)
    assert result["outcome"] == "refused" and "COCO segmentation" in result["message"], _outcome(result)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_coco_file_name_outside_the_image_folder_is_rejected_never_read(zygote, tmp_path, how):
    outside = tmp_path / "secret" / "outside.jpg"
    outside.parent.mkdir()
    outside.write_bytes(jpeg(9, size=(12, 10)))
    name = {"absolute": str(outside), "dotdot": "../secret/outside.jpg", "symlink": "link.jpg"}[how]
    ann_file, image_dir = _coco(tmp_path, [{}], file_names={1: name})
    if how == "symlink":
        (image_dir / "link.jpg").symlink_to(outside)
    result = zygote.run("case_convert", src=ann_file, dst=tmp_path / "out.lmdb", coco_images=image_dir)
    assert result["outcome"] == "ok" and result["images"] == 1, _outcome(result)
    [(rejected, why)] = result["rejected"]
    assert rejected == name and "resolves outside the image folder" in why, why
    store = b"".join(p.read_bytes() for p in (tmp_path / "out.lmdb").rglob("*") if p.is_file())
    assert outside.read_bytes()[-200:] not in store


def test_control_a_coco_symlink_inside_the_image_folder_converts(zygote, tmp_path):
    ann_file, image_dir = _coco(tmp_path, [{}], file_names={1: "sub/../link.jpg"})
    (image_dir / "sub").mkdir()
    (image_dir / "link.jpg").symlink_to(image_dir / "1.jpg")
    result = zygote.run("case_convert", src=ann_file, dst=tmp_path / "out.lmdb", coco_images=image_dir)
    assert result == {"outcome": "ok", "images": 2, "rejected": []}, _outcome(result)


# -- Decathlon dataset.json ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "control"])
def test_a_decathlon_path_outside_its_folder_is_refused_naming_the_entry(zygote, tmp_path, how):
    from helpers.nifti import label_of, volume, write_nifti

    root = tmp_path / "Task01"
    img = volume(0, (8, 6, 4), "int16")
    for folder in (root / "imagesTr", root / "labelsTr", tmp_path / "secret"):
        folder.mkdir(parents=True)
    write_nifti(root / "imagesTr" / "a.nii.gz", img)
    write_nifti(root / "labelsTr" / "a.nii.gz", label_of(img))
    write_nifti(tmp_path / "secret" / "b.nii.gz", img)
    image = {"absolute": str(tmp_path / "secret" / "b.nii.gz"), "dotdot": "./imagesTr/../../secret/b.nii.gz",
             "symlink": "./imagesTr/b.nii.gz", "control": "./imagesTr/c.nii.gz"}[how]
    if how == "symlink":
        (root / "imagesTr" / "b.nii.gz").symlink_to(tmp_path / "secret" / "b.nii.gz")
    if how == "control":  # a link inside the folder is fine
        (root / "imagesTr" / "c.nii.gz").symlink_to(root / "imagesTr" / "a.nii.gz")
    training = [{"image": "./imagesTr/a.nii.gz", "label": "./labelsTr/a.nii.gz"},
                {"image": image, "label": "./labelsTr/a.nii.gz"}]
    (root / "dataset.json").write_text(json.dumps({"name": "t", "training": training}))
    result = zygote.run("case_convert", src=root / "dataset.json", dst=tmp_path / "out.lmdb")
    if how == "control":
        assert result == {"outcome": "ok", "images": 2, "rejected": []}, _outcome(result)
        return
    assert result["outcome"] == "typed_error" and result["type"] == "SourceError", _outcome(result)
    assert f"training entry 1: image path {image!r} resolves outside" in result["message"], result["message"]
