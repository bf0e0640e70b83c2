"""A damaged store is detected, never silently read: byte flips (many seeds) in
every shard file of both backends and in ``manifest.json``, a truncated shard,
a missing shard and hand-edited manifests.

Promises tested (docs/RELIABILITY.md, "Damaged stores"):

* ``fastdata.verify`` reports not-ok and names the shard; when the flip hits a
  record's image bytes it also names the record. It never hangs (each case has
  a time bound) and never raises.
* The shard readers and the Dataset raise :class:`CorruptRecordError` naming
  shard and record for a damaged record (or skip it under ``on_error="skip"``),
  and never return bytes that differ from what was written.

Sizes: ``FASTDATA_NIGHTLY=1`` multiplies the number of seeds (see RELIABILITY.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import shutil
import time
import warnings

import h5py
import lmdb
import numpy as np
import pytest
import xxhash
from helpers.backends import NAMES

import fastdata
from fastdata.cli import main as cli
from fastdata.errors import CorruptRecordError, FastdataError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.lmdb import spec as lmdb_spec
from fastdata.format.backends.registry import reader_class
from fastdata.format.manifest import canonical_json
from fastdata.format.names import MANIFEST_NAME
from fastdata.format.record import decode_record

NIGHTLY = os.environ.get("FASTDATA_NIGHTLY") == "1"
RANDOM_FLIPS = 300 if NIGHTLY else 12       # per backend, anywhere in each shard file in turn
PAYLOAD_FLIPS = 100 if NIGHTLY else 8       # per backend, inside a record's image bytes
MANIFEST_FLIPS = 400 if NIGHTLY else 40
#: wall-clock bound of one verify of a damaged store (the whole store is ~1 MB)
CASE_BUDGET_S = 30.0

pytestmark = pytest.mark.timeout(300 if NIGHTLY else 120)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Pristine LMDB and HDF5 stores (4 shards each) plus, per shard file, the
    original bytes of every record and where its image bytes lie in the file."""
    from helpers.images import make_tree

    root = tmp_path_factory.mktemp("corruption")
    src = make_tree(root / "src", classes={"ant": 10, "bee": 8, "wasp": 6}, size=(24, 16))
    out = {}
    for backend, suffix in (("lmdb", ".lmdb"), ("hdf5", ".h5")):
        dst = str(root / f"pristine{suffix}")
        fastdata.convert(src, dst, workers=1, shard_size=6000, progress=False)
        manifest = json.loads(open(os.path.join(dst, MANIFEST_NAME), "rb").read())
        assert len(manifest["shards"]) >= 3
        shards = {}
        for shard in manifest["shards"]:
            path = os.path.join(dst, shard["name"])
            locate = _lmdb_image_spans if backend == "lmdb" else _hdf5_image_spans
            shards[shard["name"]] = {"first": shard["first_index"], **locate(path)}
        out[backend] = {"dst": dst, "manifest": manifest, "shards": shards}
    return out


def _lmdb_image_spans(path: str) -> dict:
    """File offsets of each live record's image bytes in an LMDB shard.

    Found from the address of the zero-copy value buffer inside LMDB's file
    mapping (``/proc/self/maps`` gives the mapping's start): searching the file
    for the bytes is ambiguous, as copy-on-write leaves stale page copies behind.
    """
    path = os.path.abspath(path)
    data = open(path, "rb").read()
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=2)
    images, spans = [], []
    try:
        with open("/proc/self/maps") as maps:
            base = next(int(line.split("-")[0], 16) for line in maps
                        if line.rstrip().endswith(path) and line.split()[2] == "00000000")
        db = env.open_db(lmdb_spec.RECORDS_DB, create=False)
        with env.begin(db=db, buffers=True) as txn:
            for _key, value in txn.cursor():
                at = np.frombuffer(value, dtype=np.uint8).ctypes.data - base
                value = bytes(value)
                assert data[at:at + len(value)] == value
                image = decode_record(value).image
                start = at + len(value) - len(image)  # 'img' is the record's last field
                images.append(image)
                spans.append((start, start + len(image)))
    finally:
        env.close()
    return {"images": images, "spans": spans}


def _hdf5_image_spans(path: str) -> dict:
    """File offsets of each record's image bytes in an HDF5 shard (from the
    storage address of the ``images`` dataset: contiguous, or chunked)."""
    with h5py.File(path, "r") as f:
        offsets = f["offsets"][()]
        flat = f["images"][()]
        dset = f["images"]
        if dset.chunks is None:
            extents = [(0, dset.id.get_offset(), len(flat))]
        else:
            extents = [(info.chunk_offset[0], info.byte_offset, info.size)
                       for info in (dset.id.get_chunk_info(k) for k in range(dset.id.get_num_chunks()))]
    images = [flat[offsets[i]:offsets[i + 1]].tobytes() for i in range(len(offsets) - 1)]
    spans = []
    for i in range(len(images)):
        a, b = int(offsets[i]), int(offsets[i + 1])
        for first, at, size in extents:
            if first <= a and b <= first + size:  # one extent holds the whole image
                spans.append((at + a - first, at + b - first))
                break
        else:
            spans.append(None)
    return {"images": images, "spans": spans}


def _copy(store: str, tmp_path, name: str = "case") -> str:
    dst = str(tmp_path / (name + os.path.splitext(store)[1]))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(store, dst)
    return dst


def _flip(path: str, offset: int, xor: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ xor]))


def _record_at(info: dict, offset: int) -> int | None:
    for i, span in enumerate(info["spans"]):
        if span and span[0] <= offset < span[1]:
            return i
    return None


def _timed_verify(store: str):
    t0 = time.perf_counter()
    report = fastdata.verify(store, timeout=CASE_BUDGET_S)
    assert time.perf_counter() - t0 < CASE_BUDGET_S, "verify of a damaged store took too long"
    return report


# ----------------------------------------------------------------------------- reading in a child

def _read_all(backend: str, path: str, count: int, conn) -> None:
    """Child: read every record; report per record the bytes or the error type."""
    out = []
    try:
        with reader_class(backend)(path, StorageSpec()) as reader:
            reader.read_index()
            for i in range(count):
                try:
                    out.append(("ok", reader.get(i)))
                except FastdataError as err:
                    out.append(("typed", type(err).__name__))
                except Exception as err:  # reported, and the test fails on it
                    out.append(("UNTYPED", f"{type(err).__name__}: {err}"))
    except FastdataError as err:
        out = [("typed-open", type(err).__name__)]
    except Exception as err:
        out = [("UNTYPED-open", f"{type(err).__name__}: {err}")]
    conn.send(out)
    conn.close()


def _read_in_child(backend: str, path: str, count: int):
    """Outcome of reading a damaged shard in a forked child: a list of per-record
    outcomes, or ('crashed', exitcode). A damaged LMDB *internal* page may crash
    the C library (LMDB keeps no page checksums): documented, not promised."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_read_all, args=(backend, path, count, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(CASE_BUDGET_S):
            proc.kill()
            pytest.fail(f"reading {path} hung")
        return parent.recv()
    except EOFError:
        proc.join(5)
        return ("crashed", proc.exitcode)
    finally:
        proc.join(5)
        parent.close()


# ----------------------------------------------------------------------------- byte flips in shards

@pytest.mark.parametrize("backend", NAMES)
def test_random_flip_anywhere_in_a_shard_is_reported_naming_the_shard(stores, tmp_path, backend):
    rng = random.Random(f"anywhere-{backend}")
    store = stores[backend]
    names = sorted(store["shards"])
    outcomes = {"record named": 0, "shard only": 0, "reader crashed": 0}
    for case in range(RANDOM_FLIPS):
        dst = _copy(store["dst"], tmp_path)
        name = names[case % len(names)]  # every shard file in turn
        info = store["shards"][name]
        path = os.path.join(dst, name)
        offset = rng.randrange(os.path.getsize(path))
        _flip(path, offset, rng.randrange(1, 256))
        report = _timed_verify(dst)
        where = f"case {case}: {name} byte {offset}"
        assert not report.ok, where
        assert any(p.startswith(name) for p in report.problems), (where, report.problems)
        assert not any(p.startswith(n) for n in names if n != name for p in report.problems), \
            f"{where}: an intact shard was blamed: {report.problems}"
        hit = _record_at(info, offset)
        if hit is not None:
            assert any(p.startswith(f"{name} record {hit}:") for p in report.problems), (where, report.problems)
            outcomes["record named"] += 1
        else:
            outcomes["shard only"] += 1
        # Readers (isolated: a damaged LMDB branch page can crash the C library) must
        # never hand out bytes that differ from what was written.
        result = _read_in_child(backend, path, len(info["images"]))
        if result and result[0] == "crashed":
            assert backend == "lmdb", f"{where}: the HDF5 reader crashed ({result})"
            outcomes["reader crashed"] += 1
            continue
        for i, (kind, value) in enumerate(result):
            assert not kind.startswith("UNTYPED"), f"{where}: record {i}: untyped error {value}"
            if kind == "ok":
                assert value == info["images"][i], f"{where}: record {i}: wrong bytes"
    print(f"{backend}: {outcomes}")


@pytest.mark.parametrize("backend", NAMES)
def test_flip_in_record_image_bytes_names_shard_and_record(stores, tmp_path, backend):
    rng = random.Random(f"payload-{backend}")
    store = stores[backend]
    for case in range(PAYLOAD_FLIPS):
        dst = _copy(store["dst"], tmp_path)
        names = sorted(store["shards"])
        name = names[case % len(names)]
        info = store["shards"][name]
        candidates = [i for i, s in enumerate(info["spans"]) if s]
        i = rng.choice(candidates)
        start, stop = info["spans"][i]
        path = os.path.join(dst, name)
        _flip(path, rng.randrange(start, stop), rng.randrange(1, 256))

        report = _timed_verify(dst)
        assert not report.ok
        assert any(p.startswith(f"{name} record {i}:") and "checksum" in p for p in report.problems), report.problems
        assert report.records_checked == store["manifest"]["num_samples"] - 1

        # the shard reader: a typed error naming shard and record; neighbours intact
        with reader_class(backend)(path, StorageSpec()) as reader:
            with pytest.raises(CorruptRecordError) as exc:
                reader.get(i)
            assert exc.value.shard == path and exc.value.index == i
            assert str(exc.value).startswith(f"{path} record {i}:")
            for j in {0, i - 1, i + 1, len(info["images"]) - 1} - {i, -1, len(info["images"])}:
                assert reader.get(j) == info["images"][j]
            others = [j for j in range(len(info["images"])) if j != i]
            assert reader.get_many(others) == [info["images"][j] for j in others]
            with pytest.raises(CorruptRecordError):
                reader.get_many([i] + others[:2])


def test_control_the_payload_map_points_at_the_image_bytes(stores, tmp_path):
    """Control for the test above: the mapped span really holds the image bytes."""
    for backend in NAMES:
        store = stores[backend]
        for name, info in store["shards"].items():
            data = open(os.path.join(store["dst"], name), "rb").read()
            for image, span in zip(info["images"], info["spans"], strict=False):
                assert span is None or data[span[0]:span[1]] == image


@pytest.mark.parametrize("backend", NAMES)
def test_dataset_raises_or_skips_a_damaged_record(stores, tmp_path, backend):
    pytest.importorskip("torch")
    from fastdata.reader.open import open_dataset

    store = stores[backend]
    name = sorted(store["shards"])[1]
    info = store["shards"][name]
    local = 2
    dst = _copy(store["dst"], tmp_path)
    start, stop = info["spans"][local]
    _flip(os.path.join(dst, name), (start + stop) // 2, 0x5A)
    index = info["first"] + local

    ds = open_dataset(dst, output="numpy")
    with pytest.raises(CorruptRecordError) as exc:
        ds[index]
    assert exc.value.shard == name and exc.value.index == index
    assert name in str(exc.value) and f"record {local}" in str(exc.value)
    good, label = ds[index + 1]
    ds.close()

    skipping = open_dataset(dst, output="numpy", on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image, _ = skipping[index]
    assert skipping.skipped == 1
    assert (image == good).all(), "skip must substitute a readable sample, never the damaged one"
    assert any(name in str(w.message) for w in caught)
    skipping.close()


# ----------------------------------------------------------------------------- the manifest

@pytest.mark.parametrize("backend", NAMES)
def test_flip_in_manifest_is_detected_or_harmless(stores, tmp_path, backend):
    rng = random.Random(f"manifest-{backend}")
    store = stores[backend]
    dst = _copy(store["dst"], tmp_path)
    path = os.path.join(dst, MANIFEST_NAME)
    pristine = open(path, "rb").read()
    detected = 0
    for case in range(MANIFEST_FLIPS // 2):
        raw = bytearray(pristine)
        offset = rng.randrange(len(raw))
        raw[offset] ^= rng.randrange(1, 256)
        open(path, "wb").write(raw)
        report = _timed_verify(dst)
        if report.ok:
            # only a flip that leaves the same JSON content (whitespace, an
            # equivalent escape) may pass; it changes nothing a reader uses
            assert json.loads(raw) == json.loads(pristine), f"case {case}: byte {offset} passed verify"
        else:
            detected += 1
            assert len(report.problems) == 1 and MANIFEST_NAME in report.problems[0], report.problems
    open(path, "wb").write(pristine)
    assert _timed_verify(dst).ok
    assert detected >= MANIFEST_FLIPS // 4, "most flips must land in content and be caught"


# ----------------------------------------------------------------------------- truncation, deletion, edits

@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_truncated_shard_is_reported(stores, tmp_path, backend, keep):
    store = stores[backend]
    dst = _copy(store["dst"], tmp_path)
    name = sorted(store["shards"])[1]
    path = os.path.join(dst, name)
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))
    report = _timed_verify(dst)
    assert not report.ok
    assert any(p.startswith(name) and "truncated" in p and str(size) in p for p in report.problems), report.problems


@pytest.mark.parametrize("backend", NAMES)
def test_missing_shard_is_reported_and_readers_refuse(stores, tmp_path, backend):
    store = stores[backend]
    dst = _copy(store["dst"], tmp_path)
    name = sorted(store["shards"])[-1]
    os.unlink(os.path.join(dst, name))
    report = _timed_verify(dst)
    assert not report.ok
    assert report.problems[0].startswith(f"{name}: shard file missing")
    with pytest.raises(FastdataError, match=name):
        reader_class(backend)(os.path.join(dst, name), StorageSpec()).close()


def _edit_manifest(dst: str, edit, fix_checksum: bool) -> None:
    path = os.path.join(dst, MANIFEST_NAME)
    body = json.loads(open(path, "rb").read())
    body.pop("checksum")
    edit(body)
    if fix_checksum:
        body["checksum"] = xxhash.xxh3_64_hexdigest(canonical_json(body))
    open(path, "w").write(json.dumps(body, indent=1))


def _drop_one_from_first_shard(body: dict) -> None:
    """A consistent edit: shard 0 'loses' one record; totals and offsets adjusted."""
    body["shards"][0]["count"] -= 1
    for shard in body["shards"][1:]:
        shard["first_index"] -= 1
    body["num_samples"] -= 1
    body["class_counts"][0] -= 1


def _move_one_between_classes(body: dict) -> None:
    body["class_counts"][0] -= 1
    body["class_counts"][1] += 1


def _swap_two_shards(body: dict) -> None:
    a, b = body["shards"][0], body["shards"][1]
    a["name"], b["name"] = b["name"], a["name"]


def _claim_raw_pixels(body: dict) -> None:
    body["storage"] = {"mode": "raw", "max_side": None, "quality": None, "raw_shape": [4, 4]}


def _other_backend(body: dict) -> None:
    body["backend"] = "hdf5" if body["backend"] == "lmdb" else "lmdb"


EDITS = {
    "count": (_drop_one_from_first_shard, "holds"),
    "class counts": (_move_one_between_classes, "per-class counts"),
    "shard order": (_swap_two_shards, "shard-0000"),
    "storage mode": (_claim_raw_pixels, "raw|pixels"),
    "backend": (_other_backend, "shard-0000"),
}


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_hand_edited_manifest_is_detected(stores, tmp_path, backend, edit):
    store = stores[backend]
    change, expected = EDITS[edit]
    # a naive edit breaks the manifest's own checksum
    dst = _copy(store["dst"], tmp_path, "naive")
    _edit_manifest(dst, change, fix_checksum=False)
    report = _timed_verify(dst)
    assert not report.ok and "checksum mismatch" in report.problems[0]
    # a careful edit (checksum recomputed) is caught against the shards themselves
    dst = _copy(store["dst"], tmp_path, "careful")
    _edit_manifest(dst, change, fix_checksum=True)
    report = _timed_verify(dst)
    assert not report.ok, f"{edit}: a consistent manifest edit passed verify"
    assert any(re.search(expected, p) for p in report.problems), report.problems


def test_verify_cli_exit_code_and_message_name_the_damage(stores, tmp_path, capsys):
    store = stores["lmdb"]
    dst = _copy(store["dst"], tmp_path)
    name = sorted(store["shards"])[0]
    start, stop = store["shards"][name]["spans"][1]
    _flip(os.path.join(dst, name), start, 0x01)
    assert cli.main(["verify", dst]) == cli.EXIT_FAILED_CHECK
    err = capsys.readouterr().err
    assert "DAMAGED" in err and f"{name} record 1:" in err
    assert cli.main(["verify", store["dst"]]) == cli.EXIT_OK


def test_verify_names_the_record_whose_metadata_was_flipped(tmp_path):
    """A flipped byte in an LMDB record's *label* (not its image) is pinned to that
    record: verify cross-checks each record's own fields with the shard index."""
    from helpers.images import make_tree

    src = make_tree(tmp_path / "src", {"a": 3, "b": 3})
    dst = tmp_path / "out.lmdb"
    fastdata.convert(src, str(dst), workers=1, progress=False)
    shard = dst / "shard-00000.lmdb"
    raw = bytearray(shard.read_bytes())
    target = b"b/b_001.jpg"  # store index 4
    flips = 0
    pos = raw.find(target)
    while pos != -1:  # every copy (LMDB keeps stale copies of rewritten pages)
        label_at = raw.rfind(b"\xa5label", 0, pos) + len(b"\xa5label")
        raw[label_at] ^= 0x01
        flips += 1
        pos = raw.find(target, pos + 1)
    assert flips >= 1
    shard.write_bytes(bytes(raw))
    report = fastdata.verify(str(dst))
    assert not report.ok
    record_problems = [p for p in report.problems if "record" in p]
    assert record_problems == [record_problems[0]] and "shard-00000.lmdb record 4:" in record_problems[0]
    assert "label" in record_problems[0]
