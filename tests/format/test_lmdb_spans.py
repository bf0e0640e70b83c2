"""LMDB shards record where each record and chunk lies in the file (the index's ``record_spans``
and ``chunk_spans``): the bytes at each span are exactly the value LMDB returns for that key, so
a reader can ask the kernel for a batch before reading it. Advice only: a shard without spans,
or with wrong ones, reads the same values."""

from __future__ import annotations

import os
import shutil
import sys

import lmdb
import numpy as np
import pytest

import fastdata
from fastdata.fields import Chunked, Int, Ragged
from fastdata.format.backends.lmdb import reader as lmdb_reader
from fastdata.format.backends.lmdb import spec
from fastdata.format.manifest import read_manifest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spans are learned from /proc")


def _shards(store) -> list[str]:
    return [os.path.join(store, s["name"]) for s in read_manifest(str(store))["shards"]]


def _check_spans(path: str, db_name: bytes, key: bytes) -> int:
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=3)
    try:
        with env.begin() as txn:
            spans = np.frombuffer(txn.get(key, db=env.open_db(spec.INDEX_DB, txn=txn, create=False)), "<u8")
            spans = spans.reshape(-1, 2)
            db = env.open_db(db_name, txn=txn, create=False)
            values = [txn.get(spec.encode_key(i), db=db) for i in range(len(spans))]
            assert txn.stat(db)["entries"] == len(spans)
    finally:
        env.close()
    with open(path, "rb") as fh:
        for (offset, length), value in zip(spans.tolist(), values, strict=True):
            fh.seek(offset)
            assert fh.read(length) == value
    return len(spans)


def test_record_and_chunk_spans_point_at_the_values(tmp_path):
    rng = np.random.default_rng(0)
    vols = [rng.integers(0, 4096, (20 + i, 17, 9), dtype=np.uint16) for i in range(5)]
    store = tmp_path / "s.lmdb"
    fastdata.write([{"ct": v, "k": i} for i, v in enumerate(vols)], store,
                   {"ct": Chunked("uint16", (8, 8, 8)), "k": Int()}, workers=0, progress=False)
    (shard,) = _shards(store)
    assert _check_spans(shard, spec.RECORDS_DB, spec.RECORD_SPANS_KEY) == 5
    assert _check_spans(shard, spec.CHUNKS_DB, spec.CHUNK_SPANS_KEY) == sum(
        -(-v.shape[0] // 8) * 3 * 2 for v in vols)


def test_classification_store_records_spans(tmp_path):
    from fastdata.synth import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=2, per_class=6, size="cifar", seed=0)
    store = tmp_path / "c.lmdb"
    fastdata.convert(str(tmp_path / "src"), str(store), workers=1, progress=False)
    assert sum(_check_spans(p, spec.RECORDS_DB, spec.RECORD_SPANS_KEY) for p in _shards(store)) == 12


def _replace_spans(path: str, key: bytes, spans: np.ndarray) -> None:
    """Overwrite the span table ``key`` of the shard ``path``'s index with ``spans`` (as a damaged
    or crafted shard would hold them)."""
    env = lmdb.open(path, subdir=False, max_dbs=3, lock=False)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, spans.astype("<u8").tobytes(), db=env.open_db(spec.INDEX_DB, txn=txn, create=False))
    finally:
        env.close()


def test_wrong_spans_are_only_advice(tmp_path, monkeypatch):
    """Spans pointing past the file or at the wrong place change nothing that is read."""
    store = tmp_path / "s.lmdb"
    rng = np.random.default_rng(1)
    vols = [rng.integers(0, 4096, (24, 24, 24), dtype=np.uint16) for _ in range(3)]
    fastdata.write([{"ct": v} for v in vols], store, {"ct": Chunked("uint16", (8, 8, 8))}, workers=0,
                   progress=False)
    bogus = np.array([[1 << 62, 1 << 40]] * 40 + [[0, 5]] * 41, dtype="<u8")  # past the file, or wrong
    (shard,) = _shards(store)
    _replace_spans(shard, spec.RECORD_SPANS_KEY, bogus[38:41])  # 3 records, 81 chunks: as many rows each
    _replace_spans(shard, spec.CHUNK_SPANS_KEY, bogus)
    calls: list[np.ndarray] = []
    real = lmdb_reader.advise_spans
    monkeypatch.setattr(lmdb_reader, "advise_spans",
                        lambda fd, spans, size, *rest: calls.append(np.array(spans)) or real(fd, spans, size, *rest))
    ds = fastdata.open_dataset(store)
    for i, v in enumerate(vols):
        assert np.array_equal(ds[i]["ct"][...], v)
    # the bogus spans were advised (clamped to the file), and changed nothing read
    advised = np.concatenate(calls)
    assert ((advised == [1 << 62, 1 << 40]).all(axis=1).any() and (advised == [0, 5]).all(axis=1).any())
    ds.close()


def test_advice_is_clamped_to_the_file_and_merged(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = np.array([[0, 10], [20, 10], [1 << 40, 1 << 40], [90_000, 1 << 50], [50, 0]], dtype="<u8")
        # [0, 10) and [20, 30) merged (closer than 64 KiB); past the end: nothing; [90000, 100000)
        # clamped, a call of its own (further than 64 KiB); the empty one skipped
        assert lmdb_reader.advise_spans(fd, spans, 100_000) == 2
        assert lmdb_reader.advise_spans(fd, np.array([[0, 10], [10 << 20, 10]], dtype="<u8"), 20 << 20) == 2
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def span_stores(tmp_path_factory):
    """A classification store of raw pixels (PPM records, read as views), one of JPEGs, and a
    general store: three shapes of record that batches read at their spans."""
    from fastdata.synth import make_image_folder

    root = tmp_path_factory.mktemp("spans")
    make_image_folder(root / "src", num_classes=2, per_class=4, size="cifar", seed=3)
    raw, jpeg, general = root / "raw.lmdb", root / "jpeg.lmdb", root / "general.lmdb"
    fastdata.convert(str(root / "src"), str(raw), storage="raw", max_side=64, workers=0, progress=False)
    fastdata.convert(str(root / "src"), str(jpeg), workers=0, progress=False)
    rng = np.random.default_rng(2)
    fastdata.write([{"arr": rng.integers(0, 255, (5000 + i, 7), dtype=np.uint8), "k": i} for i in range(8)],
                   general, {"arr": Ragged("uint8", (7,)), "k": Int()}, workers=0, progress=False)
    return {"raw": str(raw), "jpeg": str(jpeg), "general": str(general)}


def _batch(store) -> tuple[list, int, int]:
    """Every sample of ``store`` read as one batch, and how many records its shards read at their
    spans and through LMDB."""
    ds = fastdata.open_dataset(store)
    try:
        items = ds.__getitems__(list(range(len(ds))))
        values = [(np.asarray(x[0]), int(x[1])) if isinstance(x, tuple) else int(x["k"]) for x in items]
        readers = [ds._reader(shard) for shard in range(len(read_manifest(store)["shards"]))]
        return values, sum(r.mapped_reads for r in readers), sum(r.lmdb_reads for r in readers)
    finally:
        ds.close()


def _equal(a: list, b: list) -> bool:
    return all(np.array_equal(x[0], y[0]) and x[1] == y[1] if isinstance(x, tuple) else x == y
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["raw", "jpeg", "general"])
def test_batches_read_records_at_their_spans(span_stores, kind, tmp_path):
    """A batch reads each record through the file map at its span, not through LMDB (no ``txn.get``:
    py-lmdb releases the GIL twice a record, which thread workers pay for); a span that points at
    another record's bytes is caught by the index's checksum, and the shard is then read through
    LMDB: the same values as a healthy copy, nothing served from the wrong place."""
    truth, mapped, through_lmdb = _batch(span_stores[kind])
    assert (mapped, through_lmdb) == (len(truth), 0)  # every record came from its span

    crafted = tmp_path / "crafted.lmdb"
    shutil.copytree(span_stores[kind], crafted)
    shard = _shards(crafted)[0]
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        spans = np.frombuffer(txn.get(spec.RECORD_SPANS_KEY, db=env.open_db(spec.INDEX_DB, txn=txn, create=False)),
                              "<u8").reshape(-1, 2).copy()
    env.close()
    spans[[0, 1]] = spans[[1, 0]]  # record 0's span names record 1's bytes, and the other way round
    _replace_spans(shard, spec.RECORD_SPANS_KEY, spans)
    values, mapped, through_lmdb = _batch(str(crafted))
    assert _equal(values, truth)
    assert through_lmdb == len(truth)  # the swapped span was refused, the shard then read through LMDB
