"""``fastdata convert`` of Parquet files (a file, a folder, a glob): a general store with a field per
column, image bytes stored bit-exact, Hugging Face ``ClassLabel`` names kept, row groups as the
plan's units, bad input named. Every file is written by pyarrow in the Hub's layout or by
``datasets.Dataset.to_parquet``; nothing is mocked."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from helpers.parquet import NAMES, decoded_rgb, hf_rows, write_hf_parquet  # noqa: E402
from helpers.samples import jpeg  # noqa: E402
from helpers.stores import general_records  # noqa: E402

import fastdata  # noqa: E402
from fastdata.cli.main import main  # noqa: E402
from fastdata.errors import RejectedInputError, ResumeMismatchError, SourceError  # noqa: E402
from fastdata.format.manifest import read_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (6, 5, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_hub_layout_files_round_trip_every_column_with_image_bytes_bit_exact(tmp_path, suffix, capsys):
    """Two Hub-named files (row groups of 4) through a glob, with 2 workers and chunks smaller than
    a row group: the image bytes are the files' own, every value equals the source, the classes
    are the ClassLabel names, and every shard starts at a row group boundary."""
    rows = hf_rows(14)
    data = tmp_path / "data"
    write_hf_parquet(data / "train-00000-of-00002.parquet", {k: v[:9] for k, v in rows.items()})
    write_hf_parquet(data / "train-00001-of-00002.parquet", {k: v[9:] for k, v in rows.items()})
    dst = tmp_path / f"out{suffix}"
    assert main(["convert", str(data / "train-*.parquet"), str(dst), "--workers", "2", "--shard-size", "1500"]) == 0
    out = capsys.readouterr().out
    assert "wrote 14 samples" in out and "not re-encoded" in out and "3 names" in out
    manifest = read_manifest(str(dst))
    assert manifest["version"] == 2 and len(manifest["shards"]) > 2
    # row groups start at rows 0, 4, 8 of the first file and 9, 13 of the second
    assert {s["first_index"] for s in manifest["shards"]} <= {0, 4, 8, 9, 13}
    assert manifest["class_counts"] == np.bincount(rows["label"], minlength=3).tolist()
    records = general_records(dst)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.classes == NAMES and ds.class_tables == {"label": NAMES}
    assert ds.targets.tolist() == rows["label"]
    assert list(ds[0]) == ["image", "label", "idx", "score", "caption", "boxes", "embedding", "meta"]
    for i in range(14):
        assert records[i]["image"] == rows["image"][i]["bytes"]  # stored bit-exact
        assert records[i]["path"] == rows["image"][i]["path"].encode()  # the image's own path
        got = ds[i]
        assert np.array_equal(got["image"], decoded_rgb(rows["image"][i]["bytes"]))
        assert got["label"] == rows["label"][i] and got["idx"] == rows["idx"][i]
        assert got["score"] == pytest.approx(rows["score"][i], nan_ok=True)
        assert got["caption"] == rows["caption"][i]
        assert got["boxes"].dtype == np.float32 and got["boxes"].tolist() == rows["boxes"][i]
        assert got["embedding"].shape == (3,) and got["embedding"].tolist() == rows["embedding"][i]
        assert got["meta"] == rows["meta"][i]
    assert fastdata.verify(str(dst)).ok


def test_a_datasets_to_parquet_file_gives_the_store_datasets_reads(tmp_path):
    """A file written by ``datasets.Dataset.to_parquet`` (Image, ClassLabel, List, Array2D features):
    ``open_dataset(store)[i]`` equals ``ds[i]`` for every index, images as decoded RGB arrays."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "fish"]),
        "lengths": datasets.List(datasets.Value("int32")), "grid": datasets.Array2D((2, 3), "float32"),
        "text": datasets.Value("string")})
    n = 11
    ds = datasets.Dataset.from_dict({
        "image": [{"bytes": jpeg(i), "path": None} for i in range(n)], "label": [(i * 2) % 3 for i in range(n)],
        "lengths": [list(range(i % 4)) for i in range(n)],
        "grid": [np.arange(6, dtype=np.float32).reshape(2, 3) * i for i in range(n)],
        "text": [f"t{i}" for i in range(n)]}, features=features)
    src = tmp_path / "train.parquet"
    ds.to_parquet(str(src))
    dst = tmp_path / "out.lmdb"
    report = fastdata.convert(src, dst, workers=2, shard_size=2000, chunk_size=4)  # each worker skips the others' rows
    assert report.images == n and report.rejected == 0
    store = fastdata.open_dataset(dst, output="numpy")
    assert store.classes == ds.features["label"].names
    records = general_records(dst)
    for i in range(n):
        want, got = ds[i], store[i]
        assert records[i]["image"] == jpeg(i)
        assert np.array_equal(got["image"], np.asarray(want["image"].convert("RGB")))
        assert got["label"] == want["label"] and got["text"] == want["text"]
        assert got["lengths"].tolist() == want["lengths"]
        assert got["grid"].shape == (2, 3) and got["grid"].tolist() == want["grid"]


def test_a_row_group_cursor_reads_forward_ranges_exactly(tmp_path):
    """What a worker reads of a row group: any increasing ranges, across batch boundaries, equal
    the rows of the file (the values and shapes of sliced list columns included)."""
    from fastdata.writer.sources.parquet.columns import row_values
    from fastdata.writer.resume import RunOptions
    from fastdata.writer.sources.parquet.input import ParquetInput, ParquetRows, _Cursor

    rows = hf_rows(30)
    src = write_hf_parquet(tmp_path / "t.parquet", rows, row_group_size=30)
    source = ParquetInput(src, [src])
    source.plan(RunOptions.from_json({"backend": "lmdb", "storage": {"mode": "original"}, "shard_size": 1 << 20}),
                str(tmp_path / "x"))
    parts: ParquetRows = source._rows()
    cursor = _Cursor(parts, 0, 0, 4)
    try:
        for a, b in ((0, 3), (5, 9), (9, 10), (10, 21), (29, 30)):
            values, _ = row_values(parts.layout, cursor.take(a, b))
            assert [v["caption"] for v in values] == rows["caption"][a:b]
            assert [v["boxes"].tolist() for v in values] == rows["boxes"][a:b]
            assert [v["embedding"].tolist() for v in values] == rows["embedding"][a:b]
            assert [v["image"] for v in values] == [r["bytes"] for r in rows["image"][a:b]]
    finally:
        cursor.close()


def test_a_split_labelled_minus_one_keeps_its_labels_as_ints_and_out_of_range_labels_are_rejects(tmp_path):
    """A Hub test split is labelled -1 ("no label"): a class field cannot hold it (every sample of
    one is in a class), so the column is a plain int field, its names in the manifest's metadata.
    A label past the names is a reported reject."""
    rows = hf_rows(5)
    rows["label"] = [-1] * 5
    dst = tmp_path / "test.lmdb"
    report = fastdata.convert(write_hf_parquet(tmp_path / "test.parquet", rows), dst, workers=0)
    assert any("'label' holds label -1 (no label): stored as a plain int field" in w for w in report.warnings)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.classes == [] and [ds[i]["label"] for i in range(5)] == [-1] * 5
    assert read_manifest(str(dst))["metadata"]["class_names"] == {"label": NAMES}
    from helpers.parquet import hf_table

    pq.write_table(hf_table(rows), tmp_path / "nostats.parquet", write_statistics=False)  # the column is read
    report = fastdata.convert(tmp_path / "nostats.parquet", tmp_path / "nostats.lmdb", workers=0)
    assert fastdata.open_dataset(tmp_path / "nostats.lmdb").classes == [] and report.images == 5
    rows["label"] = [0, 1, 7, 2, 0]
    report = fastdata.convert(write_hf_parquet(tmp_path / "odd.parquet", rows), tmp_path / "odd.lmdb", workers=0)
    assert report.rejected_items == [("odd.parquet row 2", "column 'label': label 7 is not a class index (0..2)")]
    assert fastdata.open_dataset(tmp_path / "odd.lmdb").classes == NAMES


def test_a_non_image_in_an_image_column_is_a_reported_reject_and_strict_makes_it_fatal(tmp_path):
    rows = hf_rows(6)
    rows["image"][2] = {"bytes": b"not an image at all", "path": "broken.jpg"}
    rows["image"][4] = {"bytes": None, "path": None}
    src = write_hf_parquet(tmp_path / "train.parquet", rows)
    dst = tmp_path / "out.lmdb"
    report = fastdata.convert(src, dst, workers=0)
    assert report.images == 4 and report.rejected == 2
    reasons = dict(report.rejected_items)
    assert "not a usable image" in reasons["train.parquet row 2"]
    assert "no bytes and no path" in reasons["train.parquet row 4"]
    assert (dst / "rejected.tsv").read_text().count("train.parquet row") == 2
    assert [r["image"] for r in general_records(dst)] == [rows["image"][i]["bytes"] for i in (0, 1, 3, 5)]
    with pytest.raises(RejectedInputError, match=r"train\.parquet row 2.*not a usable image"):
        fastdata.convert(src, tmp_path / "strict.lmdb", workers=0, strict=True)


@pytest.mark.parametrize("damage", ["truncated", "not parquet", "empty"])
def test_an_unreadable_file_is_one_clear_error_naming_it(tmp_path, damage, capsys):
    good = Path(write_hf_parquet(tmp_path / "a.parquet", hf_rows(5)))
    bad = tmp_path / "b.parquet"
    data = good.read_bytes()
    bad.write_bytes({"truncated": data[: len(data) // 2], "not parquet": b"id,label\n1,cat\n", "empty": b""}[damage])
    code = main(["convert", str(tmp_path), str(tmp_path / "out.lmdb"), "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("fastdata: error: ") and f"{bad}: not a readable Parquet file" in err
    assert not (tmp_path / "out.lmdb" / "manifest.json").exists()


def test_a_damaged_row_group_is_an_error_naming_the_file_and_row_group(tmp_path):
    """Damage inside the data (the footer intact) shows where it is read, in a worker: named there."""
    rows = hf_rows(12)
    src = Path(write_hf_parquet(tmp_path / "train.parquet", rows))
    meta = pq.read_metadata(src)
    column = meta.row_group(1).column(0)  # the second row group's image bytes
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(src.read_bytes())
    data[start:start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    src.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"train\.parquet row group 1: cannot be read"):
        fastdata.convert(src, tmp_path / "out.lmdb", workers=2, shard_size=1500)


def test_files_with_different_columns_are_refused_naming_both(tmp_path, capsys):
    rows = hf_rows(4)
    a = write_hf_parquet(tmp_path / "a.parquet", rows)
    b = write_hf_parquet(tmp_path / "b.parquet", {k: v for k, v in rows.items() if k != "caption"})
    code = main(["convert", str(tmp_path), str(tmp_path / "out.lmdb")])
    err = capsys.readouterr().err
    assert code == 2 and a in err and b in err and "'caption' only in the first" in err, err


def test_a_folder_of_several_splits_is_refused_and_a_glob_picks_one(tmp_path):
    rows = hf_rows(4)
    write_hf_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", rows)
    write_hf_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", {k: v[:2] for k, v in rows.items()})
    with pytest.raises(SourceError, match=r"several splits \(test, train\)"):
        fastdata.convert(tmp_path / "data", tmp_path / "out.lmdb", workers=0)
    report = fastdata.convert(str(tmp_path / "data" / "test-*.parquet"), tmp_path / "test.lmdb", workers=0)
    assert report.images == 2


@pytest.mark.parametrize("where", ["dataset_info.json", "README.md"])
def test_class_names_come_from_a_dataset_info_or_a_card_beside_the_files(tmp_path, where):
    """Files without the ``huggingface`` metadata: the names come from the Hub repository's
    ``dataset_info.json`` or ``README.md`` card, beside the files or in the folder above."""
    if where == "README.md":
        pytest.importorskip("yaml")
    table = pa.table({"image": pa.array([png(i) for i in range(5)], pa.binary()), "label": [2, 0, 1, 1, 0]})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "train-00000-of-00001.parquet")
    if where == "dataset_info.json":
        (tmp_path / where).write_text(json.dumps(
            {"features": {"label": {"names": ["n0", "n1", "n2"], "_type": "ClassLabel"}}}))
    else:
        (tmp_path / where).write_text("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n"
                                      "  - name: label\n    dtype:\n      class_label:\n        names:\n"
                                      "          '0': n0\n          '1': n1\n          '2': n2\n---\n# card\n")
    dst = tmp_path / "out.h5"
    fastdata.convert(tmp_path / "data", dst, workers=0)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.classes == ["n0", "n1", "n2"] and ds.targets.tolist() == [2, 0, 1, 1, 0]
    assert [r["image"] for r in general_records(dst)] == [png(i) for i in range(5)]  # a binary column of images


def test_arrow_types_become_field_kinds(tmp_path):
    """bool -> int bool, int8 -> int8, a nullable int -> json keeping None (with a warning),
    non-image binary -> bytes, list of strings and maps -> json, a plain int label -> int, and a
    column named like no field is renamed (reported), never onto another column's name."""
    table = pa.table({
        "image": pa.array([png(i) for i in range(3)], pa.binary()),
        "flag": [True, False, True], "small": pa.array([-1, 2, 3], pa.int8()),
        "maybe": pa.array([1, None, 3], pa.int64()), "blob": [b"\x00\x01", b"", b"x"],
        "words": [["a"], [], ["b", "c"]],
        "attrs": pa.array([[("k", 1)], [], [("j", 2)]], pa.map_(pa.string(), pa.int64())),
        "label": [5, 6, 7], "image.path": ["a", "b", "c"], "image_path": ["x", "y", "z"]})
    src = tmp_path / "t.parquet"
    pq.write_table(table, src)
    dst = tmp_path / "out.lmdb"
    report = fastdata.convert(src, dst, workers=0)
    assert any("'maybe' holds 1 null" in w for w in report.warnings)
    assert any("'image.path' is stored as field 'image_path'" in w for w in report.warnings)
    ds = fastdata.open_dataset(dst, output="numpy")
    kinds = {name: f.to_json() for name, f in ds.schema}
    assert kinds["flag"] == {"kind": "int", "dtype": "bool"} and kinds["small"] == {"kind": "int", "dtype": "int8"}
    assert kinds["maybe"]["kind"] == kinds["blob"]["kind"] == kinds["words"]["kind"] == "json"
    assert kinds["label"] == {"kind": "int", "dtype": "int64"} and ds.classes == []
    assert [ds[i]["maybe"] for i in range(3)] == [1, None, 3]
    assert [ds[i]["blob"] for i in range(3)] == [b"\x00\x01", b"", b"x"]
    assert [ds[i]["small"] for i in range(3)] == [-1, 2, 3] and [ds[i]["flag"] for i in range(3)] == [1, 0, 1]
    assert ds[2]["words"] == ["b", "c"] and ds[2]["image_path"] == "c" and ds[2]["image_path_"] == "z"


def test_a_column_type_no_field_holds_is_refused_naming_file_and_column(tmp_path, capsys):
    table = pa.table({"image": pa.array([png(0)], pa.binary()),
                      "when": pa.array([0], pa.timestamp("s"))})
    src = tmp_path / "t.parquet"
    pq.write_table(table, src)
    code = main(["convert", str(src), str(tmp_path / "out.lmdb")])
    err = capsys.readouterr().err
    assert code == 2 and str(src) in err and "column 'when' has Arrow type timestamp[" in err, err


def test_image_column_names_a_column_of_paths_or_bytes(tmp_path):
    """``--image-column``: file paths relative to the Parquet file's folder, read as they are; a
    name that is no column is refused naming the columns."""
    (tmp_path / "imgs").mkdir()
    for i in range(3):
        (tmp_path / "imgs" / f"{i}.png").write_bytes(png(i))
    pq.write_table(pa.table({"file": [f"imgs/{i}.png" for i in range(3)], "y": [0.5, 1.5, 2.5]}),
                   tmp_path / "list.parquet")
    dst = tmp_path / "out.lmdb"
    assert main(["convert", str(tmp_path / "list.parquet"), str(dst), "--image-column", "file", "--quiet"]) == 0
    assert [r["file"] for r in general_records(dst)] == [png(i) for i in range(3)]
    assert [r["path"] for r in general_records(dst)] == [f"imgs/{i}.png".encode() for i in range(3)]
    with pytest.raises(SourceError, match=r"no column 'picture' \(image_column\); the columns are file, y"):
        fastdata.convert(tmp_path / "list.parquet", tmp_path / "o2.lmdb", image_column="picture")


# Nightly, as the tar and datasets variants: the resume is the write session's, run in CI through
# folders, COCO, ranks, appends and memmapped volumes.
@pytest.mark.slow
def test_sigkill_then_resume_of_a_parquet_conversion_equals_a_clean_run(tmp_path):
    """``fastdata convert file.parquet out.lmdb`` killed once a shard is finished, then run again
    with ``--resume``: the finished shards (whole row groups) are kept and the store equals an
    uninterrupted run's."""
    from helpers.procs import killed_resumed_and_clean

    rows = hf_rows(120)
    src = write_hf_parquet(tmp_path / "train.parquet", rows, row_group_size=6)
    env = {**os.environ, "FASTDATA_MIN_SHARD_SIZE": "1", "PYTHONPATH": str(ROOT)}

    def command(dst, *extra):
        return [sys.executable, "-m", "fastdata", "convert", src, str(dst), "--shard-size", "2000",
                "--workers", "1", *extra]

    dst = tmp_path / "out.lmdb"
    killed_resumed_and_clean(command, dst, tmp_path / "clean.lmdb", env)
    assert [r["image"] for r in general_records(dst)] == [r["bytes"] for r in rows["image"]]


def test_a_resume_of_changed_files_is_refused(tmp_path):
    rows = hf_rows(8)
    src = write_hf_parquet(tmp_path / "train.parquet", rows)
    dst = tmp_path / "out.lmdb"
    fastdata.convert(src, dst, workers=0)
    assert fastdata.convert(src, dst, workers=0, resume=True).already_complete
    write_hf_parquet(src, {k: v[:7] for k, v in rows.items()})
    with pytest.raises(ResumeMismatchError, match="complete store made from different inputs"):
        fastdata.convert(src, dst, workers=0, resume=True)


def test_options_for_images_are_refused_for_parquet(tmp_path):
    src = write_hf_parquet(tmp_path / "train.parquet", hf_rows(2))
    with pytest.raises(ValueError, match="max_side=64 do\\(es\\) not apply to Parquet files"):
        fastdata.convert(src, tmp_path / "out.lmdb", max_side=64)
    with pytest.raises(ValueError, match="image_column applies to Parquet files"):
        fastdata.convert(tmp_path / "images", tmp_path / "out.lmdb", image_column="x")


def test_without_pyarrow_a_parquet_source_names_the_extra(tmp_path):
    src = write_hf_parquet(tmp_path / "train.parquet", hf_rows(2))
    script = ("import sys\nsys.modules['pyarrow'] = None\nfrom fastdata.cli.main import main\n"
              f"sys.exit(main(['convert', {src!r}, {str(tmp_path / 'out.lmdb')!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert 'converting Parquet files needs pyarrow, which is not installed: pip install "fastdata[parquet]"' in (
        result.stderr)


def test_convert_help_documents_parquet_and_webdataset_sources():
    from fastdata.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["convert"].format_help()
    for words in ("--image-column", "'data/train-*.parquet'", "struct<bytes, path>", "ClassLabel",
                  "'shards/train-{000000..000099}.tar'", "__key__", "cls/cls2/index -> int"):
        assert words in text, words
