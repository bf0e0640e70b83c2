"""docs/FORMAT.md is precise enough to read a store without fastdata.

Stores are written with ``fastdata.convert``; every read in this file uses only
``json``, ``struct``, ``lmdb``, ``h5py``, ``msgpack``, ``numpy`` and ``xxhash``,
following the document (section numbers in the comments). Nothing from
``fastdata`` is imported for reading.
"""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import h5py
import lmdb
import msgpack
import numpy as np
import pytest
import xxhash
from helpers.backends import SUFFIXES
from helpers.images import make_jpeg, make_tree
from helpers.reference import ref_image_folder
from PIL import Image

import fastdata
from fastdata.format.backends.registry import backend_for_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"
FORMAT_CODES = {"JPEG": 0, "PNG": 1, "PPM": 2, "BMP": 3, "TIFF": 4, "WEBP": 5, "RAW": 6}  # section 4
INDEX_DTYPES = {"labels": "<i8", "checksums": "<u8", "widths": "<i4", "heights": "<i4", "formats": "u1",
                "nbytes": "<i8", "relpaths": "u1", "relpath_offsets": "<i8"}  # section 4
RECORD_KEYS = ["v", "label", "w", "h", "fmt", "xxh", "path", "img"]  # section 4


# --- a reader written from the document ---

def read_manifest_by_spec(store: Path) -> dict:
    """Section 2: load, check format/version/checksum and index arithmetic."""
    m = json.loads((store / "manifest.json").read_bytes())
    assert m["format"] == "fastdata-store" and m["version"] == 1
    body = {k: v for k, v in m.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    assert xxhash.xxh3_64_hexdigest(canon) == m["checksum"]
    first = 0
    for shard in m["shards"]:
        assert shard["first_index"] == first and "/" not in shard["name"]
        data = (store / shard["name"]).read_bytes()
        assert len(data) == shard["bytes"] and xxhash.xxh3_64_hexdigest(data) == shard["xxh"]
        first += shard["count"]
    assert first == m["num_samples"] == sum(m["class_counts"])
    assert len(m["class_counts"]) == len(m["classes"])
    return m


def _index_arrays(get) -> dict:
    arrays = {name: np.frombuffer(get(name), dtype) for name, dtype in INDEX_DTYPES.items()}
    n = len(arrays["labels"])
    assert all(len(arrays[k]) == n for k in ("checksums", "widths", "heights", "formats", "nbytes"))
    off = arrays["relpath_offsets"]
    assert len(off) == n + 1 and off[0] == 0 and off[-1] == len(arrays["relpaths"])
    return arrays


def read_lmdb_shard(path: Path) -> list[dict]:
    """Section 5."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False, max_dbs=3)
    try:
        records_db = env.open_db(b"records", create=False)
        index_db = env.open_db(b"index", create=False)
        tails_db = env.open_db(b"tails", create=False)
        psize = env.stat()["psize"]
        with env.begin() as txn:
            header = msgpack.unpackb(txn.get(b"header", db=index_db), raw=False)
            assert header == {"layout": "fastdata-lmdb-shard", "version": 3, "count": header["count"]}
            n = header["count"]
            arrays = _index_arrays(lambda name: txn.get(name.encode(), db=index_db))
            assert len(arrays["labels"]) == n
            # keys are 8-byte big-endian local indices 0..n-1, without gaps, in order
            keys = [k for k, _ in txn.cursor(db=records_db)]
            assert keys == [struct.pack(">Q", j) for j in range(n)]
            # tail keys: a local index and a part number, parts 0.. without gaps, only behind a
            # head that fills its pages exactly; every part inline (no overflow page of its own)
            tail_keys = [struct.unpack(">QB", k) for k, _ in txn.cursor(db=tails_db)]
            assert txn.stat(tails_db)["overflow_pages"] == 0
            out = []
            for j in range(n):
                raw = txn.get(struct.pack(">Q", j), db=records_db)
                parts = [p for i, p in tail_keys if i == j]
                assert parts == list(range(len(parts)))
                assert not parts or len(raw) == 0 or (len(raw) + 16) % psize == 0
                raw += b"".join(txn.get(struct.pack(">QB", j, p), db=tails_db) for p in parts)
                rec = msgpack.unpackb(raw, raw=False)
                assert list(rec) == RECORD_KEYS and rec["v"] == 1
                assert isinstance(rec["img"], bytes) and isinstance(rec["path"], bytes)
                assert xxhash.xxh3_64_intdigest(rec["img"]) == rec["xxh"]
                a, b = arrays["relpath_offsets"][j], arrays["relpath_offsets"][j + 1]
                assert arrays["relpaths"][a:b].tobytes() == rec["path"]
                assert (arrays["labels"][j], arrays["checksums"][j], arrays["widths"][j], arrays["heights"][j],
                        arrays["formats"][j], arrays["nbytes"][j]) == (
                    rec["label"], rec["xxh"], rec["w"], rec["h"], FORMAT_CODES[rec["fmt"]], len(rec["img"]))
                out.append({k: rec[k] for k in ("label", "w", "h", "fmt", "path", "img")})
            return out
    finally:
        env.close()


def read_hdf5_shard(path: Path, mode: str) -> list[dict]:
    """Section 6."""
    codes = {v: k for k, v in FORMAT_CODES.items()}
    with h5py.File(path, "r", locking=False) as f:
        assert f.attrs["layout"] == "fastdata-hdf5-shard" and int(f.attrs["version"]) == 1
        n = int(f.attrs["count"])
        arrays = _index_arrays(lambda name: f[name][()].astype(INDEX_DTYPES[name]).tobytes())
        assert len(arrays["labels"]) == n
        if mode == "raw":
            assert "images" not in f and "offsets" not in f
            pixels = f["pixels"]
            assert pixels.dtype == np.uint8 and pixels.ndim == 4 and pixels.shape[0] == n and pixels.shape[3] == 3
            images = [pixels[j].tobytes() for j in range(n)]
        else:
            assert "pixels" not in f
            offsets = f["offsets"][()]
            assert f["images"].dtype == np.uint8 and offsets.dtype == np.int64
            assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == f["images"].shape[0]
            flat = f["images"][()]
            images = [flat[offsets[j]:offsets[j + 1]].tobytes() for j in range(n)]
        out = []
        for j, img in enumerate(images):
            assert xxhash.xxh3_64_intdigest(img) == int(arrays["checksums"][j])
            assert len(img) == arrays["nbytes"][j]
            a, b = arrays["relpath_offsets"][j], arrays["relpath_offsets"][j + 1]
            out.append({"label": int(arrays["labels"][j]), "w": int(arrays["widths"][j]),
                        "h": int(arrays["heights"][j]), "fmt": codes[int(arrays["formats"][j])],
                        "path": arrays["relpaths"][a:b].tobytes(), "img": img})
        return out


def read_store_by_spec(store) -> tuple[dict, list[dict]]:
    store = Path(store)
    m = read_manifest_by_spec(store)
    records = []
    for shard in m["shards"]:
        path = store / shard["name"]
        recs = read_lmdb_shard(path) if m["backend"] == "lmdb" else read_hdf5_shard(path, m["storage"]["mode"])
        assert len(recs) == shard["count"]
        assert sum(len(r["img"]) for r in recs) == shard["image_bytes"]
        records.extend(recs)
    assert np.bincount([r["label"] for r in records], minlength=len(m["classes"])).tolist() == m["class_counts"]
    return m, records


def read_rejected_tsv(store) -> list[dict]:
    """Section 3."""
    lines = Path(store, "rejected.tsv").read_bytes().decode("utf-8", "surrogateescape").split("\n")
    assert lines[0] == "path\treason" and lines[-1] == ""

    def unescape(field: str) -> str:
        out, i = [], 0
        while i < len(field):
            if field[i] == "\\":
                out.append({"\\": "\\", "t": "\t", "n": "\n"}[field[i + 1]])
                i += 2
            else:
                out.append(field[i])
                i += 1
        return "".join(out)

    rows = []
    for line in lines[1:-1]:
        path, reason = line.split("\t")
        rows.append({"path": unescape(path), "reason": unescape(reason)})
    return rows


# --- the stores ---

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = Path(make_tree(tmp_path_factory.mktemp("spec") / "src", {"b_cls": 6, "a_cls": 5}, size=(40, 32), seed=2))
    make_jpeg(root / "a_cls" / "nested" / "deep.JPG", size=(30, 20), seed=50, mode="CMYK")
    make_jpeg(root / "c_cls" / "gray.jpeg", size=(21, 13), seed=51, mode="L")
    palette = Image.open(make_jpeg(root / "c_cls" / "tmp.jpg", size=(30, 20), seed=52)).convert("P")
    palette.save(root / "c_cls" / "p.png")
    os.unlink(root / "c_cls" / "tmp.jpg")
    with open(os.path.join(os.fsencode(root / "c_cls"), b"non_utf8_\xe9.jpg"), "wb") as fh:
        fh.write(Path(make_jpeg(root / "c_cls" / "tmp2.jpg", size=(20, 20), seed=53)).read_bytes())
    os.unlink(root / "c_cls" / "tmp2.jpg")
    # rejected inputs, with names that need escaping in rejected.tsv
    (root / "b_cls" / "empty\twith tab.jpg").write_bytes(b"")
    (root / "b_cls" / "back\\slash.jpg").write_bytes(b"garbage")
    with open(os.path.join(os.fsencode(root / "b_cls"), b"bad_\xff.jpg"), "wb") as fh:
        fh.write(b"")
    return root


def check_store_index_by_spec(dst: Path, m: dict, records: list) -> None:
    """index.fdi as section 3a describes it: size and digest in the manifest, the manifest's
    shards in order, and arrays equal to what the records say (labels, sizes, checksums)."""
    import msgpack
    import xxhash

    data = (dst / "index.fdi").read_bytes()
    assert m["store_index"] == {"name": "index.fdi", "bytes": len(data), "xxh": xxhash.xxh3_64_hexdigest(data)}
    body = msgpack.unpackb(data, raw=False)
    assert (body["format"], body["version"]) == ("fastdata-store-index", 1)
    assert [(e["name"], e["count"]) for e in body["shards"]] == [(s["name"], s["count"]) for s in m["shards"]]

    def column(key):
        parts = []
        for e in body["shards"]:
            dtype, shape, raw = e["arrays"][key]
            parts.append(np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape))
        return np.concatenate(parts)
    assert column("labels").tolist() == [r["label"] for r in records]
    assert column("nbytes").tolist() == [len(r["img"]) for r in records]
    assert column("widths").tolist() == [r["w"] for r in records]
    assert column("checksums").tolist() == [xxhash.xxh3_64_intdigest(r["img"]) for r in records]


def _expected_samples(root: Path):
    classes, samples = ref_image_folder(str(root))
    return classes, [(os.fsencode(os.path.relpath(p, root)), c) for p, c in samples]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_original_mode_store_read_by_the_spec(source, tmp_path, suffix):
    dst = tmp_path / f"store{suffix}"
    fastdata.convert(str(source), str(dst), workers=2, shard_size="8KB", progress=False)
    m, records = read_store_by_spec(dst)
    assert m["backend"] == backend_for_path(suffix)
    assert [s["name"] for s in m["shards"]] == [f"shard-{i:05d}{suffix}" for i in range(len(m["shards"]))]
    assert len(m["shards"]) > 2
    assert sorted(os.listdir(dst)) == sorted(["manifest.json", "rejected.tsv", "index.fdi"]
                                             + [s["name"] for s in m["shards"]])
    check_store_index_by_spec(dst, m, records)

    classes, samples = _expected_samples(source)
    rejected_paths = {b"b_cls/empty\twith tab.jpg", b"b_cls/back\\slash.jpg", b"b_cls/bad_\xff.jpg"}
    expected = [(p, c) for p, c in samples if p not in rejected_paths]
    assert m["classes"] == classes
    assert [(r["path"], r["label"]) for r in records] == expected  # ImageFolder order, rejects left out
    for r in records:
        src = os.path.join(os.fsencode(source), r["path"])
        with open(src, "rb") as fh:
            assert r["img"] == fh.read()
        with Image.open(io.BytesIO(r["img"])) as im:
            assert (r["w"], r["h"], r["fmt"]) == (*im.size, im.format)
            assert im.convert("RGB").size == im.size  # decodes as the doc says

    rejected = read_rejected_tsv(dst)
    assert rejected == m["rejected"]
    assert {os.fsencode(r["path"]) for r in rejected} == rejected_paths  # surrogateescape round trip
    assert [os.fsencode(r["path"]) for r in rejected] == [p for p, _ in samples if p in rejected_paths]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_raw_mode_store_read_by_the_spec(source, tmp_path, suffix):
    dst = tmp_path / f"raw{suffix}"
    fastdata.convert(str(source), str(dst), raw="12x10", workers=1, progress=False)
    m, records = read_store_by_spec(dst)
    assert m["storage"]["mode"] == "raw" and m["storage"]["raw_shape"] == [12, 10]
    h, w = m["storage"]["raw_shape"]
    for r in records:
        assert r["fmt"] == "RAW" and (r["h"], r["w"]) == (h, w) and len(r["img"]) == h * w * 3
        pixels = np.frombuffer(r["img"], np.uint8).reshape(h, w, 3)
        with Image.open(os.path.join(os.fsencode(source), r["path"])) as im:
            ref = im.convert("RGB")
            # same decode + resize as the converter; exact equality shows the byte layout (HWC, RGB)
            ref = ref if ref.size == (w, h) else ref.resize((w, h), Image.BILINEAR)
        assert np.array_equal(pixels, np.asarray(ref))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_reencode_mode_store_read_by_the_spec(source, tmp_path, suffix):
    dst = tmp_path / f"re{suffix}"
    fastdata.convert(str(source), str(dst), max_side=24, quality=70, workers=1, progress=False)
    m, records = read_store_by_spec(dst)
    assert m["storage"] == {"mode": "reencode", "max_side": 24, "quality": 70, "raw_shape": None}
    for r in records:
        with open(os.path.join(os.fsencode(source), r["path"]), "rb") as fh:
            original = fh.read()
        with Image.open(io.BytesIO(original)) as im:
            small = max(im.size) <= 24
        with Image.open(io.BytesIO(r["img"])) as im:
            assert (r["w"], r["h"]) == im.size and max(im.size) <= 24
            assert r["fmt"] == im.format
        assert (r["img"] == original) == small


def test_doc_snippets_run_as_written(source, tmp_path):
    """The two example readers in section 8, executed verbatim from the document."""
    text = DOC.read_text()
    blocks = text.split("```python\n")[1:]
    code = {b.split("\n", 1)[0]: b.split("```", 1)[0] for b in blocks}
    lmdb_src = next(c for c in code.values() if "def read_lmdb_store" in c)
    hdf5_src = next(c for c in code.values() if "def read_hdf5_store" in c)
    ns: dict = {}
    exec(compile(lmdb_src, "FORMAT.md:lmdb", "exec"), ns)
    exec(compile(hdf5_src, "FORMAT.md:hdf5", "exec"), ns)
    for suffix, fn in ((".lmdb", "read_lmdb_store"), (".h5", "read_hdf5_store")):
        dst = tmp_path / f"snip{suffix}"
        fastdata.convert(str(source), str(dst), workers=1, shard_size="8KB", progress=False)
        _, records = read_store_by_spec(dst)
        got = list(ns[fn](str(dst)))
        assert [g[0] for g in got] == list(range(len(records)))
        assert [(g[1], g[2]) for g in got] == [(r["label"], r["img"]) for r in records]


def test_spec_reader_rejects_a_damaged_manifest(source, tmp_path):
    # control: the spec reader's checks can fail
    dst = tmp_path / "c.lmdb"
    fastdata.convert(str(source), str(dst), workers=1, progress=False)
    path = dst / "manifest.json"
    m = json.loads(path.read_bytes())
    m["class_counts"][0] += 1
    m["class_counts"][1] -= 1
    path.write_text(json.dumps(m))
    with pytest.raises(AssertionError):
        read_manifest_by_spec(dst)
