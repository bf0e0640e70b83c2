"""``fastdata convert`` of JSONL and CSV/TSV lists with more fields than path,label:
general (layout version 2) stores, read back by SampleDataset; plain lists unchanged."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.backends import NAME_SUFFIXES
from helpers.images import make_jpeg, make_tree
from helpers.lists import jsonl_rows, write_list
from helpers.stores import general_records, store_records

import fastdata
from fastdata.cli.main import build_parser, main
from fastdata.errors import RejectedInputError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.reader.samples import SampleDataset
from fastdata.tools.verify import verify
from fastdata.writer.report import ProgressBar

api_module = importlib.import_module("fastdata.writer.api")
BACKENDS = dict(NAME_SUFFIXES)


def stored_records(store) -> list[dict]:
    """Every record of a store, decoded from the shards directly (image bytes as stored)."""
    return general_records(store)


@pytest.mark.parametrize("suffix", BACKENDS.values())
def test_jsonl_list_round_trips_every_field_bit_exact(tmp_path, suffix, capsys):
    rows = jsonl_rows(7)
    lst = write_list(tmp_path, rows)
    dst = tmp_path / f"out{suffix}"
    assert main(["convert", str(lst), str(dst), "--workers", "2", "--shard-size", "3kB"]) == 0
    assert "wrote 7 images" in capsys.readouterr().out
    manifest = read_manifest(str(dst))
    assert manifest["version"] == 2 and len(manifest["shards"]) > 1
    ds = fastdata.open_dataset(dst, output="numpy")
    assert isinstance(ds, SampleDataset) and len(ds) == len(rows)
    assert ds.classes == ["bird", "cat", "dog"] == manifest["classes"]
    assert ds.class_tables == manifest["class_tables"] == {"label": ["bird", "cat", "dog"], "labels": ["x", "y"]}
    assert manifest["class_counts"] == [2, 3, 2]
    labels = [ds.classes.index(r["label"]) for r in rows]
    assert ds.targets.dtype == np.int64 and ds.targets.tolist() == labels  # ImageFolder-like targets
    assert not ds.targets.flags.writeable  # read-only, as a classification store's (tests/reader/test_dataset.py)
    records = stored_records(dst)
    for i, row in enumerate(rows):
        got = ds[i]
        assert list(got) == ["image", "n", "score", "caption", "boxes", "meta", "label", "labels"]
        assert records[i]["image"] == (tmp_path / row["path"]).read_bytes()  # stored bit-exact
        assert got["image"].shape == (16, 24 + i, 3)
        assert type(got["n"]) is int and got["n"] == row["n"]
        assert type(got["score"]) is float and got["score"] == row["score"]
        assert got["caption"] == row["caption"]
        want_boxes = np.asarray(row["boxes"], dtype=np.float64).reshape(-1, 4)
        assert got["boxes"].dtype == np.float64 and got["boxes"].tobytes() == want_boxes.tobytes()
        assert got["boxes"].shape == want_boxes.shape
        assert got["meta"] == row["meta"]
        assert got["label"] == labels[i]
        assert [ds.class_tables["labels"][k] for k in got["labels"].tolist()] == row["labels"]
        assert ds.relpath(i) == row["path"]  # the path as written in the list, not an absolute one
    assert [p for p, _ in ds.samples] == [str(tmp_path / r["path"]) for r in rows]
    assert verify(str(dst), decode=True).ok


def test_csv_with_extra_columns_inferred_and_declared(tmp_path):
    for i in range(4):
        make_jpeg(tmp_path / f"{i}.jpg", size=(20, 20), seed=i)
    lst = tmp_path / "rows.csv"
    lst.write_text("path,label,score,count,caption,boxes\n"
                   "0.jpg,cat|dog,0.5,3,a cat,\"[[1, 2, 3, 4]]\"\n"
                   "1.jpg,dog,,4,two words,[]\n"
                   "2.jpg,cat,1e3,5,x,\"[[5.5, 6, 7, 8], [9, 10, 11, 12]]\"\n"
                   "3.jpg,,2,6,y,[]\n")
    # inferred: the empty score and label cells are bad rows, named with their lines
    assert main(["convert", str(lst), str(tmp_path / "bad.lmdb")]) == 2
    assert not (tmp_path / "bad.lmdb").exists()
    # declared: defaults fill the empty cells; boxes read as JSON arrays of float32
    dst = tmp_path / "out.lmdb"
    spec = "boxes:ragged[float32,4],score:float32=0,label:multilabel="
    assert main(["convert", str(lst), str(dst), "--schema", spec, "--quiet", "--workers", "1"]) == 0
    ds = fastdata.open_dataset(dst)
    assert ds.class_tables == {"label": ["cat", "dog"]} and ds.classes == [] and len(ds.targets) == 0
    got = [ds[i] for i in range(4)]
    assert [g["label"].tolist() for g in got] == [[0, 1], [1], [0], []]
    assert [g["score"] for g in got] == [0.5, 0.0, 1000.0, 2.0]
    assert [g["count"] for g in got] == [3, 4, 5, 6] and [g["caption"] for g in got] == ["a cat", "two words", "x", "y"]
    assert got[2]["boxes"].dtype == np.float32
    assert got[2]["boxes"].tobytes() == np.array([[5.5, 6, 7, 8], [9, 10, 11, 12]], np.float32).tobytes()
    assert got[1]["boxes"].shape == (0, 4)
    assert [r["image"] for r in stored_records(dst)] == [(tmp_path / f"{i}.jpg").read_bytes() for i in range(4)]

    # a CSV without empty cells converts with everything inferred
    lst2 = tmp_path / "ok.tsv"
    lst2.write_text("path\tlabel\tscore\n0.jpg\t3\t0.5\n1.jpg\t1\t2\n")
    dst2 = tmp_path / "ok.lmdb"
    fastdata.convert(lst2, dst2, workers=1, progress=False)
    ds2 = fastdata.open_dataset(dst2)
    assert ds2.classes == ["0", "1", "2", "3"] and ds2.targets.tolist() == [3, 1]  # integer labels are the index
    assert [ds2[i]["score"] for i in range(2)] == [0.5, 2.0]
    assert read_manifest(str(dst2))["class_counts"] == [0, 1, 0, 1]


def test_plain_path_label_lists_keep_making_version_1_stores(tmp_path, monkeypatch):
    tree = Path(make_tree(tmp_path / "src", {"a": 3, "b": 4}, size=(20, 16), seed=2))
    rel = sorted(str(p.relative_to(tmp_path / "src")) for p in tree.rglob("*.jpg"))
    with_header, headerless = tmp_path / "src" / "with_header.csv", tmp_path / "src" / "headerless.tsv"
    with_header.write_text("path,label\n" + "".join(f"{r},{r.split('/')[0]}\n" for r in rel))
    headerless.write_text("".join(f"{r}\t{r.split('/')[0]}\n" for r in rel))
    stores = {}
    for lst in (with_header, headerless):
        stores[lst.name] = store_records(fastdata.convert(lst, tmp_path / f"{lst.name}.lmdb", workers=1,
                                                          progress=False).dst)
    # the same lists forced through the classification code path alone give the same stores
    monkeypatch.setattr(api_module, "is_general_list", lambda src, schema: False)
    for lst in (with_header, headerless):
        classic = store_records(fastdata.convert(lst, tmp_path / f"{lst.name}.classic.lmdb", workers=1,
                                                 progress=False).dst)
        (m1, r1), (m2, r2) = stores[lst.name], classic
        assert m1["version"] == 1 and "schema" not in m1 and "class_tables" not in m1
        assert r1 == r2 and m1["classes"] == m2["classes"] == ["a", "b"]
        assert m1["class_counts"] == m2["class_counts"] and m1["shards"][0]["xxh"] == m2["shards"][0]["xxh"]
    # an ImageFolder tree is untouched too
    folder = read_manifest(fastdata.convert(tree, tmp_path / "tree.lmdb", workers=1, progress=False).dst)
    assert folder["version"] == 1 and "class_tables" not in folder


def test_missing_images_are_rejected_and_strict_stops(tmp_path, capsys):
    rows = jsonl_rows(5)
    lst = write_list(tmp_path, rows)
    os.unlink(tmp_path / "img/1.jpg")
    (tmp_path / "img/3.jpg").write_bytes(b"not an image")
    dst = tmp_path / "out.lmdb"
    assert main(["convert", str(lst), str(dst), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "rejected 2 input(s)" in out and "img/1.jpg: file not found" in out and "(rows.jsonl:2)" in out
    manifest = read_manifest(str(dst))
    assert [r["path"] for r in manifest["rejected"]] == ["img/1.jpg", "img/3.jpg"]
    assert "rows.jsonl:4" in manifest["rejected"][1]["reason"]
    assert "img/1.jpg" in (dst / "rejected.tsv").read_text()
    ds = fastdata.open_dataset(dst)
    kept = [rows[i] for i in (0, 2, 4)]
    assert [ds[i]["n"] for i in range(len(ds))] == [r["n"] for r in kept]
    assert sum(manifest["class_counts"]) == 3 and ds.targets.tolist() == [1, 0, 2]
    # --strict stops at the first, in one line naming it; nothing is published
    strict_dst = tmp_path / "strict.lmdb"
    assert main(["convert", str(lst), str(strict_dst), "--strict", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "img/1.jpg" in err and "--strict" in err
    assert not (strict_dst / "manifest.json").exists()
    with pytest.raises(RejectedInputError):
        fastdata.convert(lst, tmp_path / "strict2.lmdb", strict=True, workers=1, progress=False)


def _interrupt_after(monkeypatch, chunks: int) -> None:
    """Make the converter stop like a Ctrl-C after ``chunks`` chunks are written."""
    real = ProgressBar.update_counts
    seen = [0]

    def update_counts(self, *args):
        real(self, *args)
        seen[0] += 1
        if seen[0] == chunks:
            raise KeyboardInterrupt

    monkeypatch.setattr(ProgressBar, "update_counts", update_counts)


def test_resume_after_an_interrupted_list_conversion_equals_a_clean_run(tmp_path, monkeypatch, capsys):
    rows = jsonl_rows(24)
    lst = write_list(tmp_path, rows)
    dst = tmp_path / "out.lmdb"
    args = ["convert", str(lst), str(dst), "--workers", "1", "--shard-size", "2kB", "--quiet"]
    with monkeypatch.context() as m:
        _interrupt_after(m, 5)
        assert main(args) == 130
    finished = sorted(p.name for p in (dst / STAGING_DIR).glob("shard-*.json"))
    assert finished and not (dst / "manifest.json").exists()
    kept = {n[:-5]: (dst / n[:-5]).stat().st_mtime_ns for n in finished}
    # an option that differs from the recorded run is refused, naming it
    assert main([*args[:-3], "--shard-size", "4kB", "--resume"]) == 2
    assert "shard size" in capsys.readouterr().err
    assert main([*args[:-3], "--resume"]) == 0  # options left out: the recorded ones
    assert {n: (dst / n).stat().st_mtime_ns for n in kept} == kept  # finished shards were kept
    clean = tmp_path / "clean.lmdb"
    assert main([*args[:2], str(clean), *args[3:]]) == 0
    m1, m2 = read_manifest(str(dst)), read_manifest(str(clean))
    assert [s["xxh"] for s in m1["shards"]] == [s["xxh"] for s in m2["shards"]]
    assert m1["class_tables"] == m2["class_tables"] and m1["class_counts"] == m2["class_counts"]
    assert len(stored_records(dst)) == len(rows)  # the shards are byte-identical (checksums above)
    # resuming a finished store: nothing to do; a changed list: refused
    assert main([*args[:-3], "--resume"]) == 0
    lst.write_text(lst.read_text().replace("photo 3", "photo three"))
    assert main([*args[:-3], "--resume"]) == 2
    assert "different inputs" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--schema", "boxes:ragged[float32"], "boxes"),
    (["--schema", "nosuch:int"], "nosuch"),
    (["--raw", "8x8"], "--raw"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, words):
    lst = write_list(tmp_path, jsonl_rows(2))
    assert main(["convert", str(lst), str(tmp_path / "o.lmdb"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastdata: error:") and words in err
    assert len(err.splitlines()) <= 1 or "grammar" in err  # a malformed spec shows the grammar after the line
    assert not (tmp_path / "o.lmdb").exists()


def test_bad_rows_and_a_folder_with_schema_are_one_line_errors(tmp_path, capsys):
    lst = write_list(tmp_path, jsonl_rows(3))
    lst.write_text(lst.read_text() + "{not json\n" + json.dumps({"n": 1}) + "\n")
    assert main(["convert", str(lst), str(tmp_path / "o.lmdb")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "line 4" in err and "line 5" in err
    assert main(["convert", str(tmp_path / "img"), str(tmp_path / "o.lmdb"), "--schema", "n:int"]) == 2
    assert "list file" in capsys.readouterr().err


def test_help_documents_lists_and_schema():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["convert"].format_help()
    for words in ("--schema", "boxes:ragged[float32,4],score:float32=0,caption:string,label:multilabel",
                  "(cat|dog)", "ragged arrays", "json", "multi-label", ".jsonl"):
        assert words in text, words


def test_manifest_class_tables_are_validated(tmp_path):
    from fastdata.errors import FormatError
    from fastdata.format.manifest import validate_manifest

    lst = write_list(tmp_path, jsonl_rows(3))
    dst = fastdata.convert(lst, tmp_path / "out.lmdb", workers=1, progress=False).dst
    body = read_manifest(dst)
    validate_manifest(body, where="m", check_sum=False)
    for bad in ({"nosuch": ["a"]}, {"label": [1, 2]}, ["label"]):
        with pytest.raises(FormatError, match="class_tables"):
            validate_manifest(dict(body, class_tables=bad), where="m", check_sum=False)
    with pytest.raises(FormatError, match="classes"):  # classes must be the single-label field's table
        validate_manifest(dict(body, classes=["x", "y", "z"]), where="m", check_sum=False)
