"""Input scanning: ImageFolder-identical classes and order, CSV/TSV lists, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.images import make_jpeg
from helpers.reference import ref_image_folder

from fastdata.common.extensions import IMG_EXTENSIONS, has_image_extension
from fastdata.errors import SourceError
from fastdata.writer.sources.folder import scan, scan_folder


def assert_same_as_image_folder(root: str) -> None:
    root = os.path.abspath(root)
    classes, samples = ref_image_folder(root)
    got = scan_folder(root)
    assert got.classes == classes
    assert [os.fsdecode(p) for p in got.paths] == [p for p, _ in samples]
    assert got.labels.tolist() == [c for _, c in samples]
    assert [os.fsdecode(r) for r in got.relpaths] == [os.path.relpath(p, root) for p, _ in samples]
    assert got.labels.dtype.kind == "i" and len(got.sizes) == len(samples)


def _touch_jpeg(path: Path, seed: int) -> None:
    make_jpeg(path, size=(16, 12), seed=seed)


# --- ImageFolder equivalence ---

def test_small_tree_matches_image_folder(small_tree):
    assert_same_as_image_folder(small_tree)
    s = scan_folder(small_tree)
    assert s.classes == ["ant", "bee", "wasp"]
    assert len(s) == 24
    assert any(p.endswith(b".JPG") for p in s.paths)  # uppercase extension kept


def test_awkward_tree_matches_image_folder(tmp_path):
    root = tmp_path / "tree"
    seed = iter(range(1000))
    # names chosen so that plain sorting and walk-order sorting interleave
    for rel in ["b/x.jpg", "b/a/z.jpeg", "b/a/A.JPEG", "b/a-b/m.Jpg", "b/a.b/n.png", "b/a0/q.jpg",
                "b/Z.jpg", "b/_u.webp", "a/deep/er/st/f.jpg", "a/1.jpg", "a/10.jpg", "a/2.jpg",
                "B/upper.jpg", "c/.hidden_file.jpg", "c/p.TIFF", "c/p.tif", "c/p.bmp", "c/p.ppm", "c/p.pgm"]:
        _touch_jpeg(root / rel, next(seed))
    # files with non-image extensions, and near misses
    for rel in ["a/readme.txt", "a/img.jpg.txt", "a/img.jpgx", "b/noext", "a/photo.gif", "a/x.JPG~"]:
        (root / rel).write_bytes(b"not an image")
    # empty class folder, class folder holding only non-images, an empty nested folder
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "a.txt").write_text("x")
    (root / "a" / "emptysub").mkdir()
    # a file at the root is not a class and not a sample
    (root / "stray.jpg").write_bytes(b"x")
    # hidden class dir (ImageFolder takes it as a class)
    _touch_jpeg(root / ".ipynb_checkpoints" / "c.jpg", next(seed))
    # symlinked file, symlinked dir inside a class, symlinked class dir, broken symlink
    outside = tmp_path / "outside"
    _touch_jpeg(outside / "o1.jpg", next(seed))
    _touch_jpeg(outside / "sub" / "o2.jpg", next(seed))
    os.symlink(outside / "o1.jpg", root / "a" / "linked.jpg")
    os.symlink(outside / "sub", root / "b" / "linkdir")
    os.symlink(outside, root / "linkedclass")
    os.symlink(tmp_path / "missing.jpg", root / "c" / "broken.jpg")

    assert_same_as_image_folder(str(root))
    s = scan_folder(str(root))
    assert "empty" in s.classes and "notes" in s.classes and "linkedclass" in s.classes
    assert "stray" not in " ".join(s.classes)
    assert s.class_to_idx["empty"] not in s.labels.tolist()
    rels = {os.fsdecode(r) for r in s.relpaths}
    assert {"a/linked.jpg", "b/linkdir/o2.jpg", "linkedclass/sub/o2.jpg", "c/broken.jpg"} <= rels
    assert not any(r.endswith((".txt", ".gif", "noext", "jpgx", "~")) for r in rels)
    assert s.hidden_classes == [".ipynb_checkpoints"]
    broken = [os.fsdecode(r) for r in s.relpaths].index("c/broken.jpg")
    assert s.sizes[broken] == -1  # stat failed: the reader will reject it with a reason


def test_reference_and_scan_disagree_on_shuffled_order_control(tmp_path):
    # control: the comparison can fail. An order that is plain-sorted by full
    # path differs from ImageFolder's walk order when a sibling dir sorts between files.
    root = tmp_path / "t"
    for rel in ["k/a/f.jpg", "k/b.jpg", "k/c.jpg"]:
        _touch_jpeg(root / rel, 1)
    _, samples = ref_image_folder(str(root))
    walk_order = [os.path.relpath(p, root) for p, _ in samples]
    assert walk_order == ["k/b.jpg", "k/c.jpg", "k/a/f.jpg"]  # files of a dir before its subdirs
    assert sorted(walk_order) != walk_order
    assert [os.fsdecode(r) for r in scan_folder(str(root)).relpaths] == walk_order


def test_symlink_loop_terminates_and_is_reported(tmp_path):
    root = tmp_path / "loop"
    _touch_jpeg(root / "a" / "x.jpg", 1)
    os.symlink("..", root / "a" / "up")  # a/up -> a: a directory loop
    s = scan_folder(str(root))
    assert [os.fsdecode(r) for r in s.relpaths] == ["a/x.jpg"]
    assert any("loop" in why for _, why in s.walk_problems)


def test_extension_test_is_case_insensitive():
    for ext in IMG_EXTENSIONS:
        assert has_image_extension("x" + ext) and has_image_extension("x" + ext.upper())
        assert has_image_extension(os.fsencode("d/x" + ext.title()))
    assert not has_image_extension("x.jpg.txt")
    assert not has_image_extension("x.gif")


def test_missing_or_invalid_source(tmp_path):
    with pytest.raises(SourceError, match="not found"):
        scan(str(tmp_path / "nope"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(SourceError, match="not a folder"):
        scan(str(f))


def test_non_utf8_file_name_survives(tmp_path):
    root = tmp_path / "r"
    make_jpeg(root / "c" / "ok.jpg", size=(8, 8))
    raw = os.path.join(os.fsencode(root / "c"), b"bad_\xff.jpg")
    with open(raw, "wb") as fh:
        fh.write(Path(root / "c" / "ok.jpg").read_bytes())
    s = scan_folder(str(root))
    assert b"c/bad_\xff.jpg" in s.relpaths
    assert_same_as_image_folder(str(root))


# --- list files ---

def test_csv_list(tmp_path):
    imgs = tmp_path / "imgs"
    a = make_jpeg(imgs / "one.jpg", size=(8, 8), seed=1)
    b = make_jpeg(imgs / "sub" / "two.jpg", size=(8, 8), seed=2)
    c = make_jpeg(tmp_path / "elsewhere" / "three.jpg", size=(8, 8), seed=3)
    lst = imgs / "list.csv"
    # header row, relative paths (to the list's folder), an absolute path, a blank line;
    # order is the file's, classes are the sorted label names
    lst.write_text(f"path,label\nsub/two.jpg,zebra\none.jpg,ape\n\n{c},zebra\n")
    s = scan(str(lst))
    assert s.classes == ["ape", "zebra"]
    assert [os.fsdecode(p) for p in s.paths] == [b, a, c]
    assert s.labels.tolist() == [1, 0, 1]
    assert s.sizes.tolist() == [os.path.getsize(p) for p in (b, a, c)]


def test_tsv_list_and_label_with_comma(tmp_path):
    a = make_jpeg(tmp_path / "x y.jpg", size=(8, 8))
    lst = tmp_path / "l.tsv"
    lst.write_text("x y.jpg\tlabel, with comma\n")
    s = scan(str(lst))
    assert s.classes == ["label, with comma"]
    assert [os.fsdecode(p) for p in s.paths] == [a]


@pytest.mark.parametrize("body, match", [
    ("a.jpg,cat,extra\n", "expected 2 columns"),
    ("a.jpg\n", "expected 2 columns"),
    ("a.jpg,\n", "empty path or label"),
])
def test_bad_list_lines_name_the_line(tmp_path, body, match):
    lst = tmp_path / "l.csv"
    lst.write_text("ok.jpg,cat\n" + body)
    with pytest.raises(SourceError, match=match) as err:
        scan(str(lst))
    assert "l.csv:2" in str(err.value)


def test_list_with_byte_order_mark_keeps_its_header(tmp_path):
    make_jpeg(tmp_path / "a.jpg", size=(8, 8))
    lst = tmp_path / "bom.csv"
    lst.write_bytes("\ufeffpath,label\na.jpg,cat\n".encode("utf-8"))
    s = scan(str(lst))
    assert s.classes == ["cat"] and len(s) == 1


def test_missing_list_file(tmp_path):
    for missing in (tmp_path / "missing.csv", str(tmp_path / "missing.TSV")):
        with pytest.raises(SourceError, match="list file not found"):
            scan(missing)
