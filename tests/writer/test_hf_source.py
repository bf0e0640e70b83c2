"""``fastdata.write`` of Hugging Face ``datasets`` objects built locally (no Hub access): a
``Dataset``'s encoded image bytes stored bit-exact (never decoded and re-encoded), ``ClassLabel``
names kept, arrays as ragged/fixed fields, ``open_dataset(store)[i] == ds[i]``; a ``DatasetDict``
needs ``split=``; an ``IterableDataset`` is an iterable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from helpers.samples import jpeg  # noqa: E402
from helpers.stores import general_records  # noqa: E402

import fastdata  # noqa: E402
from fastdata.errors import RejectedInputError, ResumeMismatchError  # noqa: E402
from fastdata.fields import SchemaError, String  # noqa: E402
from fastdata.reader.dataset import ImagesReducedWarning  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["cat", "dog", "fish"]
FEATURES = datasets.Features({
    "image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
    "tags": datasets.List(datasets.ClassLabel(names=["x", "y", "z"])),
    "boxes": datasets.List(datasets.List(datasets.Value("float32"), length=4)),
    "grid": datasets.Array2D((2, 3), "int16"), "volume": datasets.Array3D((2, 2, 2), "uint8"),
    "text": datasets.Value("string"), "score": datasets.Value("float64")})


def columns(n: int) -> dict[str, list]:
    return {
        "image": [{"bytes": jpeg(i, size=(10 + i % 4, 8)), "path": None} for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "tags": [[0, 2][: i % 3] for i in range(n)],
        "boxes": [[[i, 1.5, 2.0, 3.25]] * (i % 3) for i in range(n)],
        "grid": [np.arange(6, dtype=np.int16).reshape(2, 3) + i for i in range(n)],
        "volume": [np.full((2, 2, 2), i, dtype=np.uint8) for i in range(n)],
        "text": [f"caption {i}" for i in range(n)],
        "score": [i / 3 for i in range(n)],
    }


def make_dataset(n: int = 12):
    return datasets.Dataset.from_dict(columns(n), features=FEATURES)


def assert_same_sample(got: dict, want: dict) -> None:
    """A store's sample (output="numpy") against ``datasets``' own ``ds[i]``."""
    assert list(got) == list(want)
    assert np.array_equal(got["image"], np.asarray(want["image"].convert("RGB")))
    assert got["label"] == want["label"] and got["text"] == want["text"] and got["score"] == want["score"]
    assert got["tags"].tolist() == want["tags"]
    assert got["boxes"].reshape(-1, 4).tolist() == [list(b) for b in want["boxes"]]
    assert got["grid"].dtype == np.int16 and got["grid"].tolist() == want["grid"]
    assert got["volume"].shape == (2, 2, 2) and got["volume"].tolist() == want["volume"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_is_stored_bit_exact_and_reads_back_as_datasets_reads_it(tmp_path, workers):
    """A shuffled Dataset (an indices mapping over its table): the store's image bytes are the
    dataset's JPEG bytes (never decoded to PIL and re-encoded), its classes are the ClassLabel's
    names, and every sample equals ``ds[i]``."""
    ds = make_dataset().shuffle(seed=3)
    dst = tmp_path / "out.h5"
    report = fastdata.write(ds, dst, workers=workers, shard_size=3000)
    assert report.images == len(ds) and report.shards > 1
    assert "not re-encoded" in report.summary()
    store = fastdata.open_dataset(dst, output="numpy")
    assert store.classes == ds.features["label"].names == NAMES
    assert store.class_tables == {"label": NAMES, "tags": ["x", "y", "z"]}
    kinds = {name: f.to_json() for name, f in store.schema}
    assert kinds["grid"] == {"kind": "ndarray", "dtype": "int16", "shape": [2, 3]}
    assert kinds["boxes"] == {"kind": "ragged", "dtype": "float32", "inner_shape": [4]}
    raw = ds.cast_column("image", datasets.Image(decode=False))
    records = general_records(dst)
    for i in range(len(ds)):
        assert records[i]["image"] == raw[i]["image"]["bytes"]  # bit-exact
        assert_same_sample(store[i], ds[i])
    assert store.targets.tolist() == ds["label"]


def test_images_given_as_file_paths_are_read_from_their_files(tmp_path):
    """An Image column made from file paths holds no bytes in its table: each file's bytes are stored."""
    paths = []
    for i in range(4):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(jpeg(i))
        paths.append(str(path))
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    dst = tmp_path / "out.lmdb"
    fastdata.write(ds, dst, workers=0)
    assert [r["image"] for r in general_records(dst)] == [jpeg(i) for i in range(4)]
    assert [r["path"] for r in general_records(dst)] == [p.encode() for p in paths]


def test_an_image_feature_with_a_mode_reads_back_in_that_mode(tmp_path):
    """``Image(mode="L")`` decodes to grayscale in ``datasets``: the store's default read mode is "L" too."""
    ds = datasets.Dataset.from_dict({"image": [{"bytes": jpeg(i), "path": None} for i in range(3)]},
                                    features=datasets.Features({"image": datasets.Image(mode="L")}))
    fastdata.write(ds, tmp_path / "out.lmdb", workers=0)
    with pytest.warns(ImagesReducedWarning, match="read in image_mode='L'"):  # as datasets reduces them
        store = fastdata.open_dataset(tmp_path / "out.lmdb", output="numpy")
    assert store.schema["image"].mode == "L"
    assert [r["image"] for r in general_records(tmp_path / "out.lmdb")] == [jpeg(i) for i in range(3)]
    for i in range(3):
        assert np.array_equal(store[i]["image"], np.asarray(ds[i]["image"]))


def test_a_non_image_in_an_image_column_stops_the_write_or_is_reported(tmp_path):
    data = columns(5)
    data["image"][3] = {"bytes": b"definitely not an image", "path": None}
    ds = datasets.Dataset.from_dict(data, features=FEATURES)
    with pytest.raises(RejectedInputError, match=r"sample 3.*not a usable image"):
        fastdata.write(ds, tmp_path / "strict.lmdb", workers=0)
    report = fastdata.write(ds, tmp_path / "out.lmdb", workers=0, strict=False)
    assert report.images == 4 and [p for p, _ in report.rejected_items] == ["sample 3"]


def test_labels_minus_one_are_plain_ints_unless_the_dataset_selects_only_labelled_rows(tmp_path):
    data = columns(6)
    data["label"] = [-1, 0, -1, 1, 2, -1]
    ds = datasets.Dataset.from_dict(data, features=FEATURES)
    report = fastdata.write(ds, tmp_path / "all.lmdb", workers=0)
    assert any("holds label -1 (no label)" in w for w in report.warnings)
    store = fastdata.open_dataset(tmp_path / "all.lmdb", output="numpy")
    assert store.classes == [] and [store[i]["label"] for i in range(6)] == data["label"]
    labelled = ds.filter(lambda row: row["label"] >= 0)  # an indices mapping over the same table
    fastdata.write(labelled, tmp_path / "labelled.lmdb", workers=0)
    store = fastdata.open_dataset(tmp_path / "labelled.lmdb", output="numpy")
    assert store.classes == NAMES and store.targets.tolist() == [0, 1, 2]
    with pytest.raises(SchemaError, match=r"sample 0 field 'label': label -1 \(no label\).*cast_column"):
        fastdata.write(ds.to_iterable_dataset(), tmp_path / "it.lmdb", workers=0)


def test_a_dataset_dict_needs_a_split_and_the_error_lists_them(tmp_path):
    dd = datasets.DatasetDict({"train": make_dataset(6), "test": make_dataset(3)})
    with pytest.raises(ValueError, match=r"several splits \('train', 'test'\): pass split="):
        fastdata.write(dd, tmp_path / "out.lmdb")
    with pytest.raises(ValueError, match=r"no split 'valid'; its splits are 'train', 'test'"):
        fastdata.write(dd, tmp_path / "out.lmdb", split="valid")
    assert fastdata.write(dd, tmp_path / "test.lmdb", split="test", workers=0).images == 3
    with pytest.raises(ValueError, match="split= picks a split"):
        fastdata.write([{"x": 1}], tmp_path / "list.lmdb", split="train")
    with pytest.raises(ValueError, match=r"a datasets.DatasetDict is written with fastdata.write\(ds, dst\)"):
        fastdata.convert(dd, tmp_path / "c.lmdb")


def test_a_dataset_write_resumes_and_refuses_another_dataset(tmp_path):
    ds = make_dataset(8)
    dst = tmp_path / "out.lmdb"
    fastdata.write(ds, dst, workers=0)
    assert fastdata.write(ds, dst, workers=0, resume=True).already_complete
    other = datasets.Dataset.from_dict({**columns(8), "text": [f"other {i}" for i in range(8)]}, features=FEATURES)
    with pytest.raises(ResumeMismatchError, match="written from other samples"):
        fastdata.write(other, dst, workers=0, resume=True)
    with pytest.raises(SchemaError, match="features decide the fields"):
        fastdata.write(ds, tmp_path / "s.lmdb", schema={"text": String()})


def test_an_iterable_dataset_is_written_as_an_iterable_keeping_the_bytes(tmp_path):
    ids = make_dataset(7).to_iterable_dataset()
    dst = tmp_path / "out.lmdb"
    report = fastdata.write(ids, dst, workers=0)
    assert report.images == 7 and "re-encoded" not in report.summary()
    store = fastdata.open_dataset(dst, output="numpy")
    assert store.classes == NAMES and store.targets.tolist() == [i % 3 for i in range(7)]
    assert [r["image"] for r in general_records(dst)] == [jpeg(i, size=(10 + i % 4, 8)) for i in range(7)]
    ds = make_dataset(7)
    for i in range(7):
        assert_same_sample(store[i], ds[i])
    with pytest.raises(ValueError, match="resume=True needs a map-style dataset"):
        fastdata.write(ids, dst, resume=True)


def test_pil_images_of_an_iterable_are_re_encoded_losslessly_and_the_summary_says_what_it_cost(tmp_path):
    from PIL import Image

    arrays = [np.random.default_rng(i).integers(0, 255, (6, 7, 3), dtype=np.uint8) for i in range(3)]

    def examples():
        for i, a in enumerate(arrays):
            yield {"image": Image.fromarray(a), "label": i}

    ids = datasets.IterableDataset.from_generator(examples)
    report = fastdata.write(ids, tmp_path / "out.lmdb", workers=0)
    notes = [n for n in report.notes if "re-encoded losslessly as PNG" in n]
    assert len(notes) == 1 and notes[0].startswith("3 image(s) arrived decoded") and "of pixels" in notes[0]
    store = fastdata.open_dataset(tmp_path / "out.lmdb", output="numpy")
    assert all(np.array_equal(store[i]["image"], arrays[i]) for i in range(3))


def test_fastdata_imports_neither_datasets_nor_pyarrow_until_given_such_an_input():
    script = ("import sys, fastdata, fastdata.writer.api, fastdata.cli.main\n"
              "fastdata.write([{'x': 1}], sys.argv[1], workers=0)\n"
              "print(sorted(m for m in ('datasets', 'pyarrow') if m in sys.modules))\n")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-c", script, str(Path(tmp) / "x.lmdb")], capture_output=True,
                                text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# nightly (FASTDATA_NIGHTLY=1): the write session's resume after SIGKILL runs in CI through the folder,
# Python-sample, COCO, Parquet and distributed conversions; this source's own plan units resume the same way
@pytest.mark.slow
def test_sigkill_then_resume_of_a_dataset_write_equals_a_clean_run(tmp_path, monkeypatch):
    """``fastdata.write(ds, dst)`` of a Dataset (saved with ``save_to_disk``, memory-mapped) killed once a
    shard is finished, then run again with ``resume=True``: the finished shards are kept and the store
    equals an uninterrupted write's."""
    import os
    import subprocess

    from helpers.procs import sigkill_once_a_shard_is_staged

    from fastdata.format.manifest import read_manifest

    make_dataset(60).save_to_disk(str(tmp_path / "ds"))
    script = ("import sys, datasets, fastdata\n"
              "ds = datasets.load_from_disk(sys.argv[1])\n"
              "r = fastdata.write(ds, sys.argv[2], workers=1, shard_size=3000, resume=sys.argv[3] == 'resume')\n"
              "print(r.resumed_shards)\n")
    env = {**os.environ, "FASTDATA_MIN_SHARD_SIZE": "1", "PYTHONPATH": str(ROOT)}

    def command(dst, mode):
        return [sys.executable, "-c", script, str(tmp_path / "ds"), str(dst), mode]

    dst = tmp_path / "out.lmdb"
    proc = subprocess.Popen(command(dst, "new"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "write")
    assert not (dst / "manifest.json").exists()
    again = subprocess.run(command(dst, "resume"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert int(again.stdout.split()[-1]) >= 1  # the finished shards were kept, not rewritten
    # the uninterrupted write in this process (the same call; a third interpreter would only import datasets again)
    clean = tmp_path / "clean.lmdb"
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    fastdata.write(datasets.load_from_disk(str(tmp_path / "ds")), clean, workers=1, shard_size=3000, progress=False)
    shards = lambda m: [(s["name"], s["count"], s["xxh"]) for s in m["shards"]]  # noqa: E731
    assert len(read_manifest(str(dst))["shards"]) > 1
    assert shards(read_manifest(str(dst))) == shards(read_manifest(str(clean)))
    assert fastdata.verify(str(dst)).ok
