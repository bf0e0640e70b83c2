"""fastdata.write: general samples into version-2 stores, read back by SampleDataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import fastdata
from fastdata.errors import IncompleteStoreError
from fastdata.fields import CLASSIFICATION, Image, SchemaError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.format.manifest import read_manifest, schema_of
from fastdata.format.names import STAGING_DIR
from fastdata.format.record import decode_record_v2
from fastdata.reader.samples import SampleDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.backends import NAME_SUFFIXES, first_in_ci
from helpers.procs import sigkill_once_a_shard_is_staged  # noqa: E402
from helpers.samples import SCHEMA, SampleList, jpeg, keep, sample  # noqa: E402

BACKENDS = dict(NAME_SUFFIXES)


@pytest.fixture(autouse=True)
def _small_shards(monkeypatch):
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")


def stored_records(store: str) -> list[dict]:
    """Every record of a store, decoded from the shards directly (image bytes as stored)."""
    m = read_manifest(store)
    schema = schema_of(m)
    out = []
    for shard in m["shards"]:
        with reader_class(m["backend"])(os.path.join(store, shard["name"]), StorageSpec(), schema=schema) as r:
            r.read_index()
            out += [decode_record_v2(r.get(i), schema, where="t") for i in range(shard["count"])]
    return out


def assert_round_trip(store: str, n: int) -> None:
    ds = fastdata.open_dataset(store, output="numpy")
    assert isinstance(ds, SampleDataset) and len(ds) == n
    records = stored_records(store)
    for i in range(n):
        want, got = sample(i), ds[i]
        assert list(got) == list(SCHEMA.names)
        assert records[i]["image"] == want["image"]  # stored bit-exact
        assert np.array_equal(got["mask"], want["mask"])  # an array stored as lossless PNG
        assert type(got["label"]) is int and got["label"] == want["label"]
        assert type(got["score"]) is float and got["score"] == want["score"]
        assert got["caption"] == want["caption"]
        for name in ("embedding", "big", "boxes", "labels"):
            assert got[name].dtype == SCHEMA[name].dtype and got[name].tobytes() == want[name].tobytes(), name
            assert got[name].shape == np.asarray(want[name]).shape
        assert got["meta"] == want["meta"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_round_trip_every_field_kind(tmp_path, backend, workers):
    dst = str(tmp_path / f"s{BACKENDS[backend]}")
    report = fastdata.write([sample(i) for i in range(23)], dst, SCHEMA, workers=workers, shard_size=4000,
                            progress=False)
    m = read_manifest(dst)
    assert m["version"] == 2 and schema_of(m) == SCHEMA and report.shards == len(m["shards"]) > 1
    assert_round_trip(dst, 23)
    report = fastdata.verify(dst, decode=True)
    assert report.ok, report.problems
    assert report.records_checked == report.decoded == 23


def _contents(store: str) -> list:
    return [json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in s.items() if k != "meta"},
                       sort_keys=True) for s in fastdata.open_dataset(store, output="numpy")]


def test_list_torch_dataset_and_generator_give_the_same_store(tmp_path):
    fastdata.write([sample(i) for i in range(9)], tmp_path / "list.lmdb", SCHEMA, workers=0, progress=False)
    fastdata.write(SampleList(9), tmp_path / "torch.lmdb", SCHEMA, workers=2, progress=False)
    fastdata.write((sample(i) for i in range(9)), tmp_path / "gen.lmdb", SCHEMA, workers=2, progress=False)
    a, b, c = (_contents(str(tmp_path / f"{k}.lmdb")) for k in ("list", "torch", "gen"))
    assert a == b == c and len(a) == 9


def test_schema_is_inferred_from_the_first_sample(tmp_path):
    samples = [{"image": jpeg(i), "label": i, "score": 0.5, "name": f"n{i}", "boxes": np.zeros((i, 4), np.float32),
                "extra": {"k": [i]}} for i in range(4)]
    fastdata.write(samples, tmp_path / "s.h5", workers=0, progress=False)
    schema = schema_of(read_manifest(str(tmp_path / "s.h5")))
    assert [(n, f.kind) for n, f in schema] == [("image", "image"), ("label", "int"), ("score", "float"),
                                                ("name", "string"), ("boxes", "ragged"), ("extra", "json")]
    assert fastdata.open_dataset(tmp_path / "s.h5")[3]["boxes"].shape == (3, 4)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad, field, message", [
    ({"label": 1.5}, "label", "expected an integer"),
    ({"embedding": np.zeros((3, 2), np.float16)}, "embedding", "shape"),
    ({"boxes": np.zeros((2, 5), np.float32)}, "boxes", "shape"),
    ({"labels": np.array([0.5])}, "labels", "do not fit int64"),
    ({"meta": {"x": object()}}, "meta", "msgpack-native"),
    ({"caption": None}, "caption", "expected a str"),
    ({"mask": 3}, "mask", "image field"),
    ({"image": b"not an image"}, "image", "not a usable image"),
])
def test_a_sample_mismatching_the_schema_names_sample_and_field_and_publishes_nothing(tmp_path, workers, bad, field,
                                                                                      message):
    samples = [sample(i) for i in range(12)]
    samples[7] = {**samples[7], **bad}
    dst = tmp_path / "s.lmdb"
    with pytest.raises(fastdata.errors.FastdataError, match=f"sample 7 field '{field}'.*{message}"):
        fastdata.write(samples, dst, SCHEMA, workers=workers, shard_size=1500, progress=False)
    assert not (dst / "manifest.json").exists()
    with pytest.raises(IncompleteStoreError):
        read_manifest(str(dst))
    report = fastdata.verify(str(dst))
    assert report.status == "unfinished" and "fastdata.write(): finish it" in report.summary()


def test_a_missing_key_is_named(tmp_path):
    samples = [sample(i) for i in range(5)]
    del samples[3]["caption"]
    with pytest.raises(SchemaError, match="sample 3: missing 'caption'"):
        fastdata.write(samples, tmp_path / "s.h5", SCHEMA, workers=0, progress=False)
    assert not (tmp_path / "s.h5" / "manifest.json").exists()


def test_resume_refuses_an_iterable(tmp_path):
    with pytest.raises(ValueError, match="overwrite=True"):
        fastdata.write(iter([sample(0)]), tmp_path / "s.h5", SCHEMA, resume=True)


def test_images_as_paths_pil_and_arrays(tmp_path):
    from PIL import Image as PILImage

    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg(3))
    pixels = np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3)
    samples = [{"image": path}, {"image": str(path)}, {"image": PILImage.fromarray(pixels)}, {"image": pixels}]
    dst = tmp_path / "s.lmdb"
    fastdata.write(samples, dst, {"image": Image()}, workers=0, progress=False)
    records = stored_records(str(dst))
    assert records[0]["image"] == records[1]["image"] == jpeg(3) and records[0]["path"] == os.fsencode(path)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert np.array_equal(ds[2]["image"], pixels) and np.array_equal(ds[3]["image"], pixels)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_verify_finds_a_flipped_byte_in_a_record(tmp_path, backend):
    dst = tmp_path / f"s{BACKENDS[backend]}"
    samples = [sample(i) for i in range(6)]
    samples[4]["caption"] = "FLIP-ME-" * 8
    fastdata.write(samples, dst, SCHEMA, workers=0, shard_size=2500, progress=False)
    assert fastdata.verify(str(dst)).ok
    for shard in dst.glob("shard-*"):
        data = bytearray(shard.read_bytes())
        at = data.find(b"FLIP-ME-")
        if at >= 0:
            data[at + 3] ^= 0x20
            shard.write_bytes(bytes(data))
            break
    report = fastdata.verify(str(dst))
    assert not report.ok
    assert any("checksum mismatch" in p and "record" in p for p in report.problems), report.problems
    ds = fastdata.open_dataset(dst)
    with pytest.raises(fastdata.errors.CorruptRecordError, match="sample 4"):
        ds[4]
    skipping = fastdata.open_dataset(dst, on_error="skip", output="numpy")
    with pytest.warns(RuntimeWarning, match="damaged sample 4"):
        assert skipping[4]["label"] == sample(5)["label"]


# spawn: nightly; in CI tests/reader/test_packed_batches.py::test_a_dict_batch_from_workers_is_one_segment_and_
# equals_the_in_process_batch[spawn] reads a general store in spawn workers, and tests/reader/test_dataset_mp.py::
# test_loader_matrix[hdf5-spawn-persistent] reopens HDF5 shards in them
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", first_in_ci(sorted(BACKENDS)))
def test_dataloader_workers_read_a_general_store(tmp_path, backend, context):
    dst = tmp_path / f"s{BACKENDS[backend]}"
    fastdata.write([sample(i) for i in range(10)], dst, SCHEMA, workers=0, shard_size=3000, progress=False)
    ds = fastdata.open_dataset(dst, output="numpy")
    ds[0]  # handles opened in the parent must not be used by forked children
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=keep,
                                         multiprocessing_context=context)
    got = [s for batch in loader for s in batch]
    assert [s["label"] for s in got] == [sample(i)["label"] for i in range(10)]
    assert all(np.array_equal(s["boxes"], sample(i)["boxes"]) for i, s in enumerate(got))


def test_fused_crop_is_refused_when_boxes_would_not_follow(tmp_path):
    fastdata.write([sample(i) for i in range(2)], tmp_path / "s.h5", SCHEMA, workers=0, progress=False)
    with pytest.raises(ValueError, match="fused crop would move the image but not its boxes"):
        fastdata.open_dataset(tmp_path / "s.h5", decode=fastdata.transforms.CenterCrop(4))
    fastdata.write([{"image": jpeg(i), "label": i} for i in range(2)], tmp_path / "c.h5", CLASSIFICATION, workers=0,
                   progress=False)
    ds = fastdata.open_dataset(tmp_path / "c.h5", decode=fastdata.transforms.CenterCrop(4), output="numpy")
    assert ds[1]["image"].shape == (4, 4, 3) and ds[1]["label"] == 1


# Nightly: the write session's resume after SIGKILL is the same for every source, and CI runs it
# through folders, COCO, ranks, appends and memmapped volumes; this is the samples-source variant.
@pytest.mark.slow
def test_sigkill_then_resume_equals_a_clean_run(tmp_path):
    dst = tmp_path / "out.lmdb"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        import fastdata
        from helpers.samples import SCHEMA, SampleList
        if __name__ == "__main__":
            fastdata.write(SampleList(120, delay=0.01), {str(dst)!r}, SCHEMA, workers=2, shard_size=6000,
                           progress=False)
    """)
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "writer")
    assert not (dst / "manifest.json").exists()
    kept = {p.name[:-len(".json")] for p in (dst / STAGING_DIR).glob("shard-*.json")}
    report = fastdata.write(SampleList(120), dst, SCHEMA, workers=2, shard_size=6000, resume=True, progress=False)
    assert report.resumed_shards == len(kept) >= 1
    # the dead writer's lock is taken over and said so, as convert does
    assert report.warnings == [f"took over the lock of converter pid {proc.pid}, which is no longer running"]
    clean = tmp_path / "clean.lmdb"
    fastdata.write(SampleList(120), clean, SCHEMA, workers=0, shard_size=6000, progress=False)
    comparable = lambda store: [{k: (v.tobytes(), v.shape) if isinstance(v, np.ndarray) else v  # noqa: E731
                                 for k, v in r.items()} for r in stored_records(str(store))]
    assert comparable(dst) == comparable(clean)
    shards = lambda m: [(s["name"], s["count"], s["xxh"]) for s in m["shards"]]  # noqa: E731
    assert shards(read_manifest(str(dst))) == shards(read_manifest(str(clean)))
    assert fastdata.verify(str(dst)).ok



def test_cli_info_prints_the_schema_and_verify_decodes_a_general_store(tmp_path, capsys):
    from fastdata.cli.main import main

    dst = tmp_path / "s.h5"
    fastdata.write([sample(i) for i in range(4)], dst, SCHEMA, workers=0, progress=False)
    assert main(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "layout version 2" in out and SCHEMA.describe_markdown().splitlines()[-1] in out
    assert main(["verify", str(dst), "--decode"]) == 0
    assert "4 records verified, 4 decoded" in capsys.readouterr().out


def test_classification_dataset_classes_refuse_a_general_store(tmp_path):
    dst = tmp_path / "s.lmdb"
    fastdata.write([sample(i) for i in range(2)], dst, SCHEMA, workers=0, progress=False)
    with pytest.raises(fastdata.errors.FormatError, match="open it with fastdata.open_dataset"):
        fastdata.LMDBImageDataset(dst)
    ds = fastdata.open_dataset(dst, output="numpy")
    shard, local = ds.locate(1)
    assert ds._reader(shard).get_many([local]) == [ds._reader(shard).get(local)]  # fresh reader, batch path first
