"""Store text printed by the CLI has its control characters escaped (fastdata.common.text.printable),
and hostile manifests and index files end in one error line, never a hang."""

from __future__ import annotations

import os

import pytest
from helpers import hostile as H

from fastdata.cli.main import main
from fastdata.common.text import printable


@pytest.mark.parametrize("text, shown", [
    ("plain", "plain"), ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("\x1b]0;owned\x07dog", "\\x1b]0;owned\\x07dog"), ("a\nb\tc", "a\\x0ab\\x09c"), ("del\x7f", "del\\x7f"),
    ("c1\x9b2J", "c1\\x9b2J"), ("rtl\u202eevil", "rtl\\u202eevil"),
    ("C:\\path\\x", "C:\\path\\x"), ("é ü 漢字", "é ü 漢字")])
def test_printable(text, shown):
    assert printable(text) == shown


def test_printable_keeps_newlines_when_asked():
    assert printable("line 1\n  \x1b[2Jline 2", keep_newlines=True) == "line 1\n  \\x1b[2Jline 2"
    assert printable(42) == "42"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tree = H.build_tree(tmp_path_factory.mktemp("tree"))
    return H.build_store(str(tmp_path_factory.mktemp("st") / H.store_name("lmdb")), tree=tree)


def test_info_escapes_class_names(store, tmp_path, capsys):
    copy = H.copy_store(store, tmp_path / "s.lmdb")
    body = H.load_manifest(copy)
    body["classes"] = ["\x1b[31mred\x1b[0m", "\x1b]0;owned\x07dog"]
    H.resign(copy, body)
    assert main(["info", copy]) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err and "\x07" not in out.out
    assert "\\x1b[31mred\\x1b[0m" in out.out and "\\x1b]0;owned\\x07dog" in out.out
    assert main(["info", "--json", copy]) == 0
    assert "\x1b" not in capsys.readouterr().out


def test_errors_quoting_store_text_are_escaped(store, tmp_path, capsys):
    copy = H.copy_store(store, tmp_path / "s.lmdb")
    body = H.load_manifest(copy)
    body["backend"] = "\x1b[2Jlmdb"
    H.resign(copy, body)
    assert main(["info", copy]) != 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "unknown backend" in err


@pytest.mark.parametrize("what", ["manifest.json", "index.fdi"])
def test_verify_on_a_fifo_is_one_line_and_non_zero(store, tmp_path, capsys, what):
    copy = H.copy_store(store, tmp_path / "s.lmdb")
    os.unlink(os.path.join(copy, what))
    os.mkfifo(os.path.join(copy, what))
    assert main(["verify", copy]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "FIFO" in text and "Traceback" not in text
    if what == "manifest.json":
        assert main(["info", copy]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "FIFO" in err


def test_verify_checks_index_fdi_against_the_manifest(store, tmp_path):
    import fastdata

    copy = H.copy_store(store, tmp_path / "s.lmdb")
    path = os.path.join(copy, "index.fdi")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    with open(path, "wb") as fh:
        fh.write(bytes(data))  # same size, other bytes: the manifest's checksum does not match
    report = fastdata.verify(copy)
    assert not report.ok and any(p.startswith("index.fdi:") and "checksum" in p for p in report.problems)
    with open(path, "ab") as fh:
        fh.write(b"more")
    report = fastdata.verify(copy)
    assert any(p.startswith("index.fdi:") and "more than the" in p for p in report.problems), report.problems
    os.unlink(path)
    report = fastdata.verify(copy)
    assert any(p.startswith("index.fdi: missing") for p in report.problems), report.problems


def test_coco_file_name_with_a_nul_is_one_clear_error(tmp_path, capsys):
    import json

    from helpers.images import make_jpeg

    images = tmp_path / "images"
    make_jpeg(images / "a.jpg", size=(16, 12))
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "width": 16, "height": 12},
                      {"id": 7, "file_name": "b\x00.jpg", "width": 16, "height": 12}],
           "annotations": [], "categories": [{"id": 1, "name": "thing"}]}
    (tmp_path / "ann.json").write_text(json.dumps(ann))
    rc = main(["convert", "--coco", str(tmp_path / "ann.json"), str(images), str(tmp_path / "out.lmdb"), "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "images[1] (image id 7)" in err and "NUL" in err and "internal error" not in err, err
