"""Sources a new user points the converter at, and ImageFolder parity on real-photo trees.

* Files ImageFolder loads are kept, whatever their name says: a PNG named .jpg
  (ImageNet's n02105855_2933.JPEG), a camera MPO named .jpg, CMYK, grayscale and
  palette images. Same count and pixels as ``Image.open(path).convert("RGB")``.
* A tree with no image at all is an error naming the folder and the extensions;
  empty class folders are kept and warned about; class folders named like splits
  are warned about.
* A destination inside the source folder is refused.
* CSV/TSV lists: integer labels are the targets; every bad row in one error.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from helpers.procs import cli_in_process
from helpers.backends import SUFFIXES
from helpers.images import make_jpeg, photo_array
from helpers.reference import ref_image_folder
from PIL import Image

import fastdata
from fastdata.common.extensions import IMG_EXTENSIONS
from fastdata.errors import SourceError
from fastdata.reader.open import open_dataset
from fastdata.writer.sources.folder import scan

pytestmark = pytest.mark.timeout(120)


def _save(path, fmt: str, mode: str = "RGB", seed: int = 0, size=(24, 16), **kwargs) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    im = Image.fromarray(photo_array(size, seed))
    if mode == "P":
        im = im.quantize(colors=16)
    elif mode != "RGB":
        im = im.convert(mode)
    im.save(path, format=fmt, **kwargs)


def _mpo_bytes() -> bytes:
    """A two-picture MPO (what many phones and cameras write as .jpg)."""
    first, second = Image.fromarray(photo_array((24, 16), 7)), Image.fromarray(photo_array((24, 16), 8))
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    return buf.getvalue()


@pytest.fixture
def real_photo_tree(tmp_path) -> str:
    """What real ImageNet-like trees hold besides plain RGB JPEGs."""
    root = tmp_path / "src"
    make_jpeg(root / "dog" / "plain.jpg", size=(24, 16), seed=1)
    _save(str(root / "dog" / "n02105855_2933.JPEG"), "PNG", seed=2)          # a PNG named .JPEG
    make_jpeg(root / "dog" / "cmyk.jpg", size=(24, 16), seed=3, mode="CMYK")
    make_jpeg(root / "cat" / "gray.jpg", size=(24, 16), seed=4, mode="L")
    _save(str(root / "cat" / "palette.png"), "PNG", mode="P", seed=5)
    (root / "cat" / "phone.jpg").write_bytes(_mpo_bytes())                   # MPO named .jpg
    _save(str(root / "cat" / "rgba.png"), "PNG", mode="RGBA", seed=6)
    return str(root)


def _manifest(dst: str) -> dict:
    with open(os.path.join(dst, "manifest.json")) as fh:
        return json.load(fh)


def _reference_samples(root: str):
    """ImageFolder(root) with its default loader: (classes, [(rgb array, target)])."""
    classes, samples = ref_image_folder(root)
    return classes, [(np.asarray(Image.open(path).convert("RGB")), target) for path, target in samples]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_file_image_folder_loads_is_kept_with_the_same_pixels(real_photo_tree, tmp_path, suffix):
    dst = str(tmp_path / ("s" + suffix))
    report = fastdata.convert(real_photo_tree, dst, workers=2, progress=False, strict=True)
    classes, expected = _reference_samples(real_photo_tree)
    assert report.rejected == 0, report.rejected_items
    assert report.images == len(expected) == 7
    for output in ("pil", "numpy", "tensor"):
        ds = open_dataset(dst, output=output)
        assert ds.classes == classes and len(ds) == len(expected)
        for i, (pixels, target) in enumerate(expected):
            image, label = ds[i]
            got = np.asarray(image) if output != "tensor" else image.permute(1, 2, 0).numpy()
            assert label == target and np.array_equal(got, pixels), (output, i)
    # the PNG is stored as the PNG it is; the mismatch is a warning, in the report and the manifest
    manifest = _manifest(dst)
    warned = {w["path"]: w["warning"] for w in manifest["warnings"]}
    assert list(warned) == ["dog/n02105855_2933.JPEG"], warned
    assert "content is PNG" in warned["dog/n02105855_2933.JPEG"]
    assert any("n02105855_2933.JPEG" in w and "content is PNG" in w for w in report.warnings), report.warnings
    with open(os.path.join(dst, "rejected.tsv")) as fh:
        assert fh.read() == "path\treason\n"
    assert fastdata.verify(dst, decode=True).ok


def test_strict_still_stops_on_a_file_image_folder_cannot_load(real_photo_tree, tmp_path):
    with open(os.path.join(real_photo_tree, "cat", "broken.jpg"), "wb") as fh:
        fh.write(b"\x00garbage" * 20)
    with pytest.raises(fastdata.errors.RejectedInputError, match="broken.jpg"):
        fastdata.convert(real_photo_tree, str(tmp_path / "s.lmdb"), workers=1, progress=False, strict=True)


# ----------------------------------------------------------------------------- empty sources

_cli = cli_in_process


def test_a_tree_without_images_is_an_error_naming_folder_and_extensions(tmp_path, capsys):
    src = tmp_path / "notes"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        (src / cls / "readme.txt").write_text("not an image")
    with pytest.raises(SourceError) as err:
        fastdata.convert(str(src), str(tmp_path / "s.lmdb"), workers=1, progress=False)
    message = str(err.value)
    assert str(src) in message and all(ext in message for ext in IMG_EXTENSIONS), message
    done = _cli(capsys, "convert", str(src), str(tmp_path / "cli.lmdb"), "--workers", "1")
    assert done.returncode != 0 and "no image files" in done.stderr and "Traceback" not in done.stderr, done
    assert "wrote 0 images" not in done.stdout
    assert not os.path.exists(tmp_path / "cli.lmdb")


def test_an_empty_list_file_is_an_error(tmp_path):
    lst = tmp_path / "l.csv"
    lst.write_text("path,label\n")
    with pytest.raises(SourceError, match="names no image files"):
        scan(str(lst))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_empty_class_folders_are_kept_and_warned_about(tmp_path, suffix):
    src = tmp_path / "src"
    make_jpeg(src / "ant" / "a.jpg", size=(16, 12))
    (src / "bee").mkdir()
    (src / "wasp").mkdir()
    (src / "wasp" / "notes.txt").write_text("x")
    dst = str(tmp_path / ("s" + suffix))
    report = fastdata.convert(str(src), dst, workers=1, progress=False)
    ds = open_dataset(dst)
    assert ds.classes == ["ant", "bee", "wasp"] and len(ds) == 1   # ImageFolder(allow_empty=True) parity
    warning = [w for w in report.warnings if "hold no image file" in w]
    assert len(warning) == 1 and "bee, wasp" in warning[0], report.warnings
    manifest = _manifest(dst)
    assert any("bee, wasp" in w["warning"] for w in manifest["warnings"]), manifest["warnings"]
    # control: a tree without empty classes gets no such warning
    make_jpeg(src / "bee" / "b.jpg", size=(16, 12))
    make_jpeg(src / "wasp" / "w.jpg", size=(16, 12))
    again = fastdata.convert(str(src), dst, workers=1, progress=False, overwrite=True)
    assert not [w for w in again.warnings if "hold no image file" in w], again.warnings


def test_class_folders_named_like_splits_are_warned_about(tmp_path):
    root = tmp_path / "imagenet"
    for split in ("train", "val"):
        make_jpeg(root / split / "n01440764" / "x.JPEG", size=(16, 12))
    report = fastdata.convert(str(root), str(tmp_path / "s.lmdb"), workers=1, progress=False)
    hint = [w for w in report.warnings if "named like dataset splits" in w]
    assert len(hint) == 1 and os.path.join(str(root), "train") in hint[0], report.warnings
    # control: real class names, or one class that merely happens to be called "test"
    other = tmp_path / "pets"
    for cls in ("cat", "dog", "test"):
        make_jpeg(other / cls / "x.jpg", size=(16, 12))
    report = fastdata.convert(str(other), str(tmp_path / "p.lmdb"), workers=1, progress=False)
    assert not [w for w in report.warnings if "splits" in w], report.warnings


# ----------------------------------------------------------------------------- destination

def test_a_destination_inside_the_source_folder_is_refused(tmp_path, capsys):
    src = tmp_path / "imgs"
    make_jpeg(src / "a" / "x.jpg", size=(16, 12))
    for dst in (src / "out.lmdb", src / "a" / "deeper" / "out.h5"):
        with pytest.raises(SourceError, match="inside the source folder"):
            fastdata.convert(str(src), str(dst), workers=1, progress=False)
        assert not os.path.exists(dst)
    # the same through a symlink that points into the source
    os.symlink(src, tmp_path / "alias")
    with pytest.raises(SourceError, match="inside the source folder"):
        fastdata.convert(str(src), str(tmp_path / "alias" / "out.lmdb"), workers=1, progress=False)
    done = _cli(capsys, "convert", str(src), str(src / "out.lmdb"), "--workers", "1")
    assert done.returncode != 0 and "inside the source folder" in done.stderr and "Traceback" not in done.stderr
    assert scan(str(src)).classes == ["a"]                       # no phantom class was created
    # control: next to the source is fine, and a list file's folder may hold the store
    fastdata.convert(str(src), str(tmp_path / "out.lmdb"), workers=1, progress=False)
    lst = src / "list.csv"
    lst.write_text("a/x.jpg,cat\n")
    fastdata.convert(str(lst), str(src / "from_list.lmdb"), workers=1, progress=False)


# ----------------------------------------------------------------------------- list files

def test_integer_labels_are_the_targets(tmp_path):
    for i in range(4):
        make_jpeg(tmp_path / f"{i}.jpg", size=(8, 8), seed=i)
    lst = tmp_path / "l.csv"
    lst.write_text("0.jpg,2\n1.jpg,10\n2.jpg,0\n3.jpg,1\n")
    s = scan(str(lst))
    assert s.classes == [str(i) for i in range(11)]
    assert s.labels.tolist() == [2, 10, 0, 1]
    # through the converter: the dataset's target is the integer written in the list
    dst = str(tmp_path / "s.lmdb")
    fastdata.convert(str(lst), dst, workers=1, progress=False)
    ds = open_dataset(dst)
    assert [int(ds.targets[i]) for i in range(len(ds))] == [2, 10, 0, 1]
    assert ds.classes[10] == "10"
    # control: one non-integer label makes every label a class name, sorted as text
    lst.write_text("0.jpg,2\n1.jpg,10\n2.jpg,cat\n")
    s = scan(str(lst))
    assert s.classes == ["10", "2", "cat"] and s.labels.tolist() == [1, 0, 2]


def test_a_huge_integer_label_is_refused_naming_its_line(tmp_path):
    lst = tmp_path / "l.tsv"
    lst.write_text("a.jpg\t3\nb.jpg\t123456789\n")
    with pytest.raises(SourceError, match=r"l\.tsv:2: integer label 123456789"):
        scan(str(lst))


def test_every_bad_list_row_is_reported_at_once(tmp_path):
    lst = tmp_path / "l.csv"
    lst.write_text("path,label\nok.jpg,cat\na.jpg\nb.jpg,cat,extra\nok2.jpg,dog\n,cat\nc.jpg,\n")
    with pytest.raises(SourceError) as err:
        scan(str(lst))
    message = str(err.value)
    assert str(lst) in message and "4 bad rows" in message and len(message.splitlines()) == 1, message
    for line in (3, 4, 6, 7):
        assert f"line {line}:" in message, message
    assert "line 2:" not in message and "line 5:" not in message
    assert message.count("expected 2 columns") == 2 and message.count("empty path or label") == 2
    # many bad rows: the first 20 are quoted, the rest counted
    lst.write_text("".join(f"img{i}.jpg\n" for i in range(25)))
    message = str(pytest.raises(SourceError, scan, str(lst)).value)
    assert "25 bad rows" in message and "line 20:" in message and "line 21:" not in message
    assert "and 5 more" in message


def test_only_files_that_start_like_a_jpeg_are_ingested_in_the_converter_process(real_photo_tree, tmp_path):
    """While the pool starts, the converter ingests chunks itself only when libjpeg is
    the one decoder they can reach; the content decides, so a PNG named .JPEG must
    go to a worker (a decoder crash there does not take the converter down)."""
    from fastdata.writer.ingest import starts_like_jpeg

    assert starts_like_jpeg(os.fsencode(os.path.join(real_photo_tree, "dog", "plain.jpg")))
    assert starts_like_jpeg(os.fsencode(os.path.join(real_photo_tree, "cat", "phone.jpg")))   # MPO: a JPEG
    assert not starts_like_jpeg(os.fsencode(os.path.join(real_photo_tree, "dog", "n02105855_2933.JPEG")))
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    assert not starts_like_jpeg(os.fsencode(fifo))            # returns at once, without a writer
    assert not starts_like_jpeg(os.fsencode(tmp_path / "missing.jpg"))
