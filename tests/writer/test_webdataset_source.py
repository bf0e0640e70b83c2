"""``fastdata convert`` of WebDataset tar shards: members grouped into samples by key, image bytes
stored bit-exact, ``cls``/``txt``/``json``/``npy`` values decoded, nothing ever extracted; bad
members reported. The tars are written by Python's tarfile (exact member names and sizes, hostile ones
included) and by webdataset's own ShardWriter; nothing is mocked."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from helpers.samples import jpeg
from helpers.stores import general_records

import fastdata
from fastdata.cli.main import main
from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.manifest import read_manifest


def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (5, 4), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def sample(i: int) -> dict[str, bytes]:
    """Sample ``i``'s members by extension: every kind of value WebDataset shards hold."""
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    np.save(buf, rng.random((i % 3, 2)).astype(np.float32))
    return {"jpg": jpeg(i), "seg.png": png(i), "cls": str(i % 4).encode(), "txt": f"caption {i} é".encode(),
            "json": json.dumps({"id": i, "tags": ["a"] * (i % 2)}).encode(), "npy": buf.getvalue(),
            "bin": bytes([i, 0, 255])}


def write_tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def write_shards(root, n: int, per_tar: int) -> list[dict[str, bytes]]:
    root.mkdir(parents=True, exist_ok=True)
    samples = [sample(i) for i in range(n)]
    for t in range(0, n, per_tar):
        write_tar(root / f"train-{t // per_tar:06d}.tar",
                  [(f"s/{i:05d}.{ext}", data) for i in range(t, min(t + per_tar, n))
                   for ext, data in samples[i].items()])
    return samples


def test_shards_named_by_a_brace_pattern_round_trip_every_member(tmp_path, capsys):
    samples = write_shards(tmp_path / "shards", 10, 4)
    dst = tmp_path / "out.lmdb"
    pattern = str(tmp_path / "shards" / "train-{000000..000002}.tar")
    assert main(["convert", pattern, str(dst), "--workers", "2", "--shard-size", "3000"]) == 0
    assert "wrote 10 samples" in capsys.readouterr().out
    assert len(read_manifest(str(dst))["shards"]) > 1
    ds = fastdata.open_dataset(dst, output="numpy")
    kinds = {name: f.kind for name, f in ds.schema}
    assert kinds == {"__key__": "string", "jpg": "image", "seg_png": "image", "cls": "int", "txt": "string",
                     "json": "json", "npy": "ragged", "bin": "json"}
    records = general_records(dst)
    for i, want in enumerate(samples):
        got = ds[i]
        assert records[i]["jpg"] == want["jpg"] and records[i]["seg_png"] == want["seg.png"]  # bit-exact
        assert got["__key__"] == f"s/{i:05d}"
        assert got["cls"] == i % 4 and got["txt"] == f"caption {i} é" and got["json"] == json.loads(want["json"])
        assert np.array_equal(got["npy"], np.load(io.BytesIO(want["npy"])))
        assert got["bin"] == want["bin"]
    assert fastdata.verify(str(dst)).ok


def test_members_named_absolute_or_with_dotdot_are_only_keys_never_extracted(tmp_path):
    write_tar(tmp_path / "evil.tar", [("/etc/evil.jpg", jpeg(1)), ("/etc/evil.cls", b"1"),
                                      ("../../up.jpg", jpeg(2)), ("../../up.cls", b"2")])
    dst = tmp_path / "out.lmdb"
    fastdata.convert(tmp_path / "evil.tar", dst, workers=0)
    ds = fastdata.open_dataset(dst, output="numpy")
    assert [ds[i]["__key__"] for i in range(2)] == ["/etc/evil", "../../up"]
    assert [r["jpg"] for r in general_records(dst)] == [jpeg(1), jpeg(2)]
    assert not (tmp_path.parent / "up.jpg").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "evil.tar", "out.lmdb"]


def test_a_member_claiming_more_than_the_file_holds_is_a_reported_reject(tmp_path):
    write_tar(tmp_path / "t.tar", [("a.jpg", jpeg(1)), ("a.cls", b"0"), ("b.jpg", jpeg(2)), ("b.cls", b"1")])
    data = bytearray((tmp_path / "t.tar").read_bytes())
    with tarfile.open(tmp_path / "t.tar") as tf:
        offset = tf.getmember("b.jpg").offset
    # b.jpg's header claims 4 GiB
    header = bytearray(data[offset:offset + 512])
    assert header[:5] == b"b.jpg"
    header[124:136] = b"%011o\0" % (4 << 30)
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    data[offset:offset + 512] = header
    (tmp_path / "t.tar").write_bytes(bytes(data))
    report = fastdata.convert(tmp_path / "t.tar", tmp_path / "out.lmdb", workers=0)
    assert report.images == 1 and len(report.rejected_items) == 1
    name, reason = report.rejected_items[0]
    assert name == "t.tar b" and "claims 4,294,967,296 bytes, more than the" in reason
    with pytest.raises(RejectedInputError, match="claims"):
        fastdata.convert(tmp_path / "t.tar", tmp_path / "strict.lmdb", workers=0, strict=True)


def test_a_sample_without_a_member_or_with_a_bad_value_is_a_reported_reject(tmp_path):
    write_tar(tmp_path / "t.tar", [("a.jpg", jpeg(1)), ("a.cls", b"0"), ("b.jpg", jpeg(2)),
                                   ("c.jpg", b"not an image"), ("c.cls", b"2"), ("d.jpg", jpeg(4)), ("d.cls", b"x")])
    report = fastdata.convert(tmp_path / "t.tar", tmp_path / "out.lmdb", workers=0)
    reasons = dict(report.rejected_items)
    assert report.images == 1 and set(reasons) == {"t.tar b", "t.tar c", "t.tar d"}
    assert "no .cls member" in reasons["t.tar b"] and "not a usable image" in reasons["t.tar c"]
    assert "'x' is not an integer" in reasons["t.tar d"]


def test_a_compressed_or_damaged_tar_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "a.tar.gz").write_bytes(b"\x1f\x8b")
    assert main(["convert", str(tmp_path / "a.tar.gz"), str(tmp_path / "o.lmdb")]) == 2
    assert "decompress it first (gunzip" in capsys.readouterr().err
    write_tar(tmp_path / "t.tar", [("a.jpg", jpeg(1)), ("b.jpg", jpeg(2)), ("c.jpg", jpeg(3))])
    data = bytearray((tmp_path / "t.tar").read_bytes())
    with tarfile.open(tmp_path / "t.tar") as tf:
        second = tf.getmember("b.jpg").offset
    data[second:second + 512] = b"\x07" * 512
    (tmp_path / "t.tar").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=f"the tar header at byte {second:,} is damaged"):
        fastdata.convert(tmp_path / "t.tar", tmp_path / "o2.lmdb", workers=0)
    with pytest.raises(SourceError, match="does not exist"):
        fastdata.convert(str(tmp_path / "x-{0..3}.tar"), tmp_path / "o3.lmdb")


def test_a_pickled_npy_member_is_rejected_never_unpickled(tmp_path):
    good, bad = io.BytesIO(), io.BytesIO()
    np.save(good, np.arange(3, dtype=np.int16))
    np.save(bad, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    write_tar(tmp_path / "t.tar", [("a.npy", good.getvalue()), ("b.npy", bad.getvalue())])
    report = fastdata.convert(tmp_path / "t.tar", tmp_path / "out.lmdb", workers=0)
    assert report.images == 1 and "not a .npy array" in dict(report.rejected_items)["t.tar b"]
    assert fastdata.open_dataset(tmp_path / "out.lmdb")[0]["npy"].tolist() == [0, 1, 2]


def test_a_folder_of_tars_is_a_webdataset_source_and_an_image_folder_is_not(tmp_path):
    samples = write_shards(tmp_path / "shards", 5, 2)
    report = fastdata.convert(tmp_path / "shards", tmp_path / "out.lmdb", workers=0)
    assert report.images == 5 and [r["jpg"] for r in general_records(tmp_path / "out.lmdb")] == [
        s["jpg"] for s in samples]
    assert fastdata.convert(tmp_path / "shards", tmp_path / "out.lmdb", workers=0, resume=True).already_complete
    (tmp_path / "tree" / "cat").mkdir(parents=True)
    (tmp_path / "tree" / "cat" / "0.jpg").write_bytes(jpeg(0))
    write_tar(tmp_path / "tree" / "backup.tar", [("x.jpg", jpeg(1))])
    tree = fastdata.convert(tmp_path / "tree", tmp_path / "tree.lmdb", workers=0)
    assert tree.images == 1 and read_manifest(str(tmp_path / "tree.lmdb"))["version"] == 1  # an ImageFolder


def test_shards_written_by_webdataset_read_as_webdataset_reads_them(tmp_path):
    """Shards made by ``webdataset.ShardWriter`` (its own naming, member order and encoders):
    the store holds, per sample in tar order, what ``webdataset.WebDataset`` itself yields
    (the raw member bytes; image bytes bit-exact, ``cls`` as the int it encoded)."""
    wds = pytest.importorskip("webdataset")
    root = tmp_path / "shards"
    root.mkdir()
    with wds.ShardWriter(str(root / "part-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"sample{i:04d}", "jpg": jpeg(i), "cls": i % 3, "txt": f"caption {i}",
                        "json": {"id": i}})
    urls = sorted(str(p) for p in root.glob("*.tar"))
    assert len(urls) == 3
    want = list(wds.WebDataset(urls, shardshuffle=False))  # raw bytes per member, in tar order
    dst = tmp_path / "out.h5"
    assert main(["convert", str(root / "part-{000000..000002}.tar"), str(dst), "--workers", "2"]) == 0
    ds = fastdata.open_dataset(dst, output="numpy")
    records = general_records(dst)
    assert len(ds) == len(want) == 10
    for i, sample_ in enumerate(want):
        got = ds[i]
        assert got["__key__"] == sample_["__key__"]
        assert records[i]["jpg"] == sample_["jpg"]  # bit-exact
        assert got["cls"] == int(sample_["cls"]) == i % 3
        assert got["txt"] == sample_["txt"].decode()
        assert got["json"] == json.loads(sample_["json"])
    assert fastdata.verify(str(dst)).ok


# nightly (FASTDATA_NIGHTLY=1): the write session's resume after SIGKILL runs in CI through the folder,
# Python-sample, COCO, Parquet and distributed conversions; this source's own plan units resume the same way
@pytest.mark.slow
def test_sigkill_then_resume_of_a_tar_conversion_equals_a_clean_run(tmp_path):
    """``fastdata convert shards/ out.lmdb`` killed once a shard is finished, then run again with
    ``--resume``: the finished shards are kept and the store equals an uninterrupted run's."""
    import os
    import sys

    from helpers.procs import killed_resumed_and_clean

    write_shards(tmp_path / "shards", 120, 10)
    env = {**os.environ, "FASTDATA_MIN_SHARD_SIZE": "1"}

    def command(dst, *extra):
        return [sys.executable, "-m", "fastdata", "convert", str(tmp_path / "shards"), str(dst),
                "--shard-size", "4000", "--workers", "2", *extra]

    killed_resumed_and_clean(command, tmp_path / "out.lmdb", tmp_path / "clean.lmdb", env)
