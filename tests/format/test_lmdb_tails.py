"""LMDB shards of layout version 3 cut a record whose last overflow page would be mostly empty
into a page-exact head (``records``) and inline tail parts (``tails``): LMDB keeps every value
larger than about half a page in whole pages, so a value a record wasted about 2 KiB a record.
The store then stays within a fraction of a percent of its records' bytes; every read path
joins a record's head and tail; raw pixels stay whole (views of the map); shards of one value a
record (versions 1 and 2, written before tails) still read; a damaged or missing tail is named."""

from __future__ import annotations

import os
import sys

import lmdb
import msgpack
import numpy as np
import pytest

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.fields import Int, Ragged
from fastdata.format.backends.lmdb import reader as lmdb_reader
from fastdata.format.backends.lmdb import spec
from fastdata.format.manifest import read_manifest
from fastdata.tools.verify import verify
from helpers.hostile import copy_store, lmdb_put, lmdb_record, resign
from helpers.images import make_tree

#: a ragged uint8 field: records of the sizes a test asks for
SCHEMA = {"blob": Ragged("uint8"), "k": Int()}


def _shards(store) -> list[str]:
    return [os.path.join(store, s["name"]) for s in read_manifest(str(store))["shards"]]


def _blobs(sizes, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"blob": rng.integers(0, 256, int(n), dtype=np.uint8), "k": i} for i, n in enumerate(sizes)]


def _layout(shard: str) -> dict:
    """What the shard holds: its records (joined as the format says), the heads' lengths, the
    tail parts per record, the page size and the ``tails`` database's statistics."""
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            records = env.open_db(spec.RECORDS_DB, txn=txn, create=False)
            tails = env.open_db(spec.TAILS_DB, txn=txn, create=False)
            heads = [bytes(v) for _k, v in txn.cursor(db=records)]
            parts: dict[int, list[bytes]] = {}
            for key, value in txn.cursor(db=tails):
                parts.setdefault(int.from_bytes(key[:8], "big"), []).append(bytes(value))
            stat = txn.stat(tails)
    finally:
        env.close()
    joined = [head + b"".join(parts.get(j, [])) for j, head in enumerate(heads)]
    return {"records": joined, "heads": [len(h) for h in heads], "parts": parts, "stat": stat}


def _whole_records_size(tmp_path, records: list[bytes]) -> int:
    """The control: the same records one LMDB value each (the layout before tails)."""
    path = str(tmp_path / "control.lmdb")
    env = lmdb.open(path, subdir=False, lock=False, max_dbs=3, map_size=1 << 30)
    db = env.open_db(spec.RECORDS_DB)
    with env.begin(write=True) as txn:
        for j, value in enumerate(records):
            txn.put(spec.encode_key(j), value, db=db, append=True)
    env.close()
    return os.path.getsize(path)


def test_tails_keep_the_shard_near_its_records_bytes(tmp_path):
    """600 records of 5-7 KB: with tails the shard holds under 450 bytes a record more than the
    records' bytes (the index, LMDB's nodes, branch and free pages: ~340 measured); the same
    records one value each (the control) leave about 2 KiB of each record's last page empty."""
    store = tmp_path / "s.lmdb"
    fastdata.write(_blobs(np.random.default_rng(0).integers(5000, 7000, 600)), store, SCHEMA, workers=0,
                   progress=False)
    (shard,) = _shards(store)
    layout = _layout(shard)
    payload = sum(map(len, layout["records"]))
    assert len(layout["parts"]) > 500 and layout["stat"]["overflow_pages"] == 0  # parts are inline
    stored_tails = sum(len(r) - h for r, h in zip(layout["records"], layout["heads"], strict=True))
    assert layout["stat"]["leaf_pages"] * 4096 <= stored_tails / 0.95  # leaf pages filled by cut_tail
    assert os.path.getsize(shard) - payload <= 450 * 600
    assert _whole_records_size(tmp_path, layout["records"]) - payload >= 1800 * 600


@pytest.mark.parametrize("psize", [4096, 16384, 65536])
def test_the_split_fills_pages_and_keeps_every_part_inline(psize):
    """For every record length: kept whole (inline, or wasting less than SPLIT_MIN_WASTE of its
    last page), or a head of exactly k pages (or empty) with parts LMDB keeps inline."""
    part = spec.inline_max(psize, spec.KEY.size + 1)
    for length in [*range(1, 3 * psize, 7), 10 * psize - 16, 10 * psize - 15, 1 << 20]:
        cut = spec.split_point(length, psize)
        if cut == length:
            pages = -(-(length + spec.PAGE_HEADER) // psize)
            assert length <= spec.inline_max(psize, 8) or pages * psize - 16 - length < spec.SPLIT_MIN_WASTE
        else:
            assert 0 <= cut < length and spec.fills_pages(cut, psize)
            assert length - cut < psize and -(-(length - cut) // part) <= spec.MAX_TAIL_PARTS
    assert spec.inline_max(4096, 8) == 2022 and spec.inline_max(4096, 9) == 2021  # measured with lmdb


def test_every_read_path_joins_heads_and_tails(tmp_path):
    """Records inline, of less than a page (empty head), of several pages with a tail of one or
    two parts, and of more than a megabyte: one at a time, in a batch in any order, and through
    verify, each equals what was written."""
    sizes = [100, 2022, 2500, 4000, 4080, 5000, 8176, 9000, 40000, (1 << 20) + 77] * 3
    samples = _blobs(sizes, seed=1)
    store = tmp_path / "s.lmdb"
    fastdata.write(samples, store, SCHEMA, workers=0, progress=False)
    (shard,) = _shards(store)
    layout = _layout(shard)
    assert {len(layout["parts"].get(j, [])) for j in range(len(sizes))} >= {0, 1, 2}
    assert 0 in layout["heads"]  # (records of less than a page are all tail)
    ds = fastdata.open_dataset(store)
    assert [ds[i]["blob"].tobytes() for i in range(len(ds))] == [s["blob"].tobytes() for s in samples]
    order = np.random.default_rng(2).permutation(len(ds)).tolist()
    batch = ds.__getitems__(order)
    assert [b["blob"].tobytes() for b in batch] == [samples[i]["blob"].tobytes() for i in order]
    assert [int(b["k"]) for b in batch] == order
    assert verify(str(store)).ok
    ds.close()


def test_a_classification_store_reads_the_same_with_tails(tmp_path):
    """JPEG records (cut, with tails) read one by one and in batches equal their source files."""
    root = make_tree(tmp_path / "src", classes={"cat": 6, "dog": 6}, size=(160, 120))
    store = str(tmp_path / "c.lmdb")
    fastdata.convert(root, store, workers=0, progress=False)
    assert any(_layout(s)["parts"] for s in _shards(store))
    ds = fastdata.open_dataset(store, output="numpy")
    singles = [ds[i] for i in range(len(ds))]
    batch = ds.__getitems__(list(range(len(ds)))[::-1])[::-1]
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(singles, batch, strict=True))
    for i in range(len(ds)):  # the stored bytes are the files' own
        with open(os.path.join(root, ds.relpath(i)), "rb") as fh:
            assert ds._raw_bytes(i) == fh.read()
    ds.close()
    assert verify(store).ok


def test_raw_pixels_stay_whole(tmp_path):
    """Raw PPM records are never cut (the batch path decodes them as views of the map)."""
    root = make_tree(tmp_path / "src", classes={"cat": 4}, size=(120, 90))
    store = str(tmp_path / "r.lmdb")
    fastdata.convert(root, store, storage="raw", max_side=100, workers=0, progress=False)
    layout = _layout(_shards(store)[0])
    assert not layout["parts"] and min(layout["heads"]) > 4096  # several pages each, and whole


@pytest.mark.parametrize("kind", ["classification", "general"])
def test_shards_of_one_value_a_record_still_read(tmp_path, kind):
    """A store whose shards were written before tails (header version 1 / 2, each record whole
    under its key, no tails database) reads and verifies as the same store with tails; the
    control: the rewritten shards really have no tails."""
    store = tmp_path / "s.lmdb"
    if kind == "classification":
        fastdata.convert(make_tree(tmp_path / "src", classes={"a": 5, "b": 5}, size=(160, 120)), str(store),
                         workers=0, progress=False)
    else:
        fastdata.write(_blobs([100, 3000, 9000, 40000] * 5, seed=3), store, SCHEMA, workers=0, progress=False)
    reference = copy_store(store, tmp_path / "reference.lmdb")
    for shard in _shards(store):
        records = _layout(shard)["records"]
        env = lmdb.open(shard, subdir=False, lock=False, max_dbs=4, map_size=1 << 30)
        with env.begin(write=True) as txn:
            index = env.open_db(spec.INDEX_DB, txn=txn, create=False)
            db = env.open_db(spec.RECORDS_DB, txn=txn, create=False)
            txn.drop(env.open_db(spec.TAILS_DB, txn=txn, create=False), delete=True)
            for j, value in enumerate(records):
                txn.put(spec.encode_key(j), value, db=db)
            txn.delete(spec.TAIL_SPANS_KEY, db=index)
            txn.put(spec.HEADER_KEY, msgpack.packb({"layout": spec.LAYOUT, "version": 1 if kind == "classification"
                                                    else 2, "count": len(records)}), db=index)
        env.close()
        env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
        with env.begin() as txn, pytest.raises(lmdb.NotFoundError):
            env.open_db(spec.TAILS_DB, txn=txn, create=False)
        env.close()
    resign(str(store))
    before, after = fastdata.open_dataset(reference), fastdata.open_dataset(store)
    assert len(before) == len(after) > 0
    for i in range(len(before)):
        if kind == "classification":
            assert (before._raw_bytes(i), before[i][1]) == (after._raw_bytes(i), after[i][1])
        else:
            a, b = before[i], after[i]
            assert (a["blob"].tobytes(), int(a["k"])) == (b["blob"].tobytes(), int(b["k"]))
    before.close()
    after.close()
    assert verify(str(store)).ok


def _general_store(tmp_path) -> tuple[str, str, int]:
    """A store and its shard, and a record with a tail of two parts (the last record is inline)."""
    store = tmp_path / "s.lmdb"
    fastdata.write(_blobs([9000, 5000, 7000, 3000, 6000, 100], seed=4), store, SCHEMA, workers=0, progress=False)
    (shard,) = _shards(store)
    parts = _layout(shard)["parts"]
    j = next(j for j, p in parts.items() if len(p) == 2)
    return str(store), shard, j


@pytest.mark.parametrize("damage", ["flipped byte", "missing part", "extra part"])
def test_a_damaged_tail_is_named(tmp_path, damage):
    store, shard, j = _general_store(tmp_path)
    assert len(lmdb_record(shard, j)) > spec.inline_max(4096, 9) * 1.2  # (the whole record: head and tail)
    env = lmdb.open(shard, subdir=False, lock=False, max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        tails = env.open_db(spec.TAILS_DB, txn=txn, create=False)
        if damage == "flipped byte":
            value = bytearray(txn.get(spec.tail_key(j, 1), db=tails))
            value[7] ^= 0x40
            txn.put(spec.tail_key(j, 1), bytes(value), db=tails)
        elif damage == "missing part":
            txn.delete(spec.tail_key(j, 1), db=tails)
        else:
            txn.put(spec.tail_key(j, 2), b"\x00" * 10, db=tails)
    env.close()
    with fastdata.open_dataset(store) as ds:
        others = [i for i in range(len(ds)) if i != j]
        assert all(len(ds[i]["blob"]) for i in others)  # the other records read
        with pytest.raises(CorruptRecordError, match=rf"record {j}: record checksum mismatch"):
            ds[j]
    report = verify(store)
    assert not report.ok and any(f"record {j}" in p for p in report.problems)


def test_tails_are_looked_up_only_behind_a_head_that_fills_its_pages(tmp_path):
    """A part put behind a record kept whole (its value does not fill its pages) is never read:
    the record reads as written (the control: the same part behind a cut record is damage,
    above)."""
    store, shard, _j = _general_store(tmp_path)
    layout = _layout(shard)
    whole = next(i for i, n in enumerate(layout["heads"]) if not spec.fills_pages(n, 4096))
    with fastdata.open_dataset(store) as ds:
        expected = ds[whole]["blob"].tobytes()
    lmdb_put(shard, {(spec.TAILS_DB, spec.tail_key(whole, 0)): b"\x01" * 50})
    with fastdata.open_dataset(store) as ds:
        assert ds[whole]["blob"].tobytes() == expected


def _tail_part_places(shard: str) -> dict[int, list[tuple[int, int]]]:
    """Each record's tail parts as (file offset, length) where LMDB reads them: the address of each
    part's buffer in this process's map of the file (``/proc/self/maps``), checked against the
    file's bytes (freed pages may hold stale copies of a part, so the bytes alone cannot place it)."""
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
    places: dict[int, list[tuple[int, int]]] = {}
    try:
        real = os.path.realpath(shard)
        with env.begin(buffers=True) as txn, open(shard, "rb") as fh:
            maps = [m for m in (line.split() for line in open("/proc/self/maps")) if len(m) == 6 and m[5] == real]
            tails = env.open_db(spec.TAILS_DB, txn=txn, create=False)
            for key, value in txn.cursor(db=tails):
                address = np.frombuffer(value, np.uint8).ctypes.data
                start, offset = next((int(m[0].split("-")[0], 16), int(m[2], 16)) for m in maps
                                     if int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16))
                at = address - start + offset
                fh.seek(at)
                assert fh.read(len(value)) == bytes(value)
                places.setdefault(int.from_bytes(key[:8], "big"), []).append((at, len(value)))
    finally:
        env.close()
    return places


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spans are learned from /proc")
def test_a_cold_batch_is_advised_every_tail_part_even_far_from_the_first(tmp_path, monkeypatch):
    """Written in many small commits, a record's tail parts are often on two leaf pages far apart
    in the file (LMDB takes a new leaf page from its free list, where an earlier commit left one;
    the control below finds such records). ``tail_spans`` holds one span a part, so the advice a
    batch asks for covers every part of every record in it: a part left out would be a
    synchronous page fault per record on a cold read (what one span a record covering only the
    first part cost: 0.65 major faults a record, 40x slower, in a memory-limited run)."""
    store = tmp_path / "s.lmdb"
    fastdata.write(_blobs(np.random.default_rng(5).integers(5000, 7000, 240), seed=5), store, SCHEMA,
                   workers=0, progress=False, chunk_size=3)
    (shard,) = _shards(store)
    places = _tail_part_places(shard)
    far = [j for j, p in places.items() if len(p) > 1 and max(a for a, _ in p) - min(a for a, _ in p) > 2 * 4096]
    assert len(far) >= 10, far  # the control: parts far apart are common
    advised: list[np.ndarray] = []
    real_advise = lmdb_reader.advise_spans
    monkeypatch.setattr(lmdb_reader, "advise_spans",
                        lambda fd, spans, *rest: advised.append(spans.copy()) or real_advise(fd, spans, *rest))
    batch = np.random.default_rng(6).permutation(240)[:64].tolist()
    with fastdata.open_dataset(store) as ds:
        ds.__getitems__(batch)
    (spans,) = advised
    covered = {(int(a), int(n)) for a, n in spans.tolist() if n}
    wanted = [place for j in batch for place in places.get(j, [])]
    assert len(wanted) > 64 and not [w for w in wanted if w not in covered]


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise")
def test_the_structure_check_asks_for_scattered_tree_pages_before_reading_them(tmp_path, monkeypatch):
    """The tails database's leaf pages lie between the records' overflow pages; the structure check
    (which reads every tree page with pread before LMDB maps the file) asks the kernel for each
    level's scattered pages before reading them, so that a cold shard is not read one synchronous
    page at a time. Every tree page it reads was advised first, except runs read alone."""
    from fastdata.format.backends.lmdb import structure

    store = tmp_path / "s.lmdb"
    fastdata.write(_blobs(np.random.default_rng(7).integers(5000, 7000, 300), seed=7), store, SCHEMA,
                   workers=0, progress=False)
    (shard,) = _shards(store)
    advised: set[int] = set()
    read_unadvised: list[int] = []
    real_fadvise, real_preadv = os.posix_fadvise, os.preadv

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.update(range(offset // 4096, (offset + length) // 4096))
        return real_fadvise(fd, offset, length, advice)

    def preadv(fd, buffers, offset):
        if offset >= 2 * 4096 and offset // 4096 not in advised:
            read_unadvised.append(offset // 4096)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "preadv", preadv)
    with open(shard, "rb") as fh:
        summary = structure.check_structure(shard, fh.fileno())
    assert summary.tree_pages > 100 and len(advised) >= summary.tree_pages - 10
    assert len(read_unadvised) <= 10, read_unadvised  # (roots and single-page levels)


def test_a_crafted_tail_span_table_of_too_many_parts_is_ignored(tmp_path, monkeypatch):
    """``tail_spans`` of more than MAX_TAIL_PARTS spans a record (not what fastdata writes) is
    ignored: a batch repeating one index would otherwise select k spans per entry (k up to the
    file's size over 16 n); the records still read and only the heads are advised. The control:
    the table as written is advised."""
    store, shard, j = _general_store(tmp_path)
    count = len(_layout(shard)["heads"])
    batch = [j] * 64
    advised: list[np.ndarray] = []
    real_advise = lmdb_reader.advise_spans
    monkeypatch.setattr(lmdb_reader, "advise_spans",
                        lambda fd, spans, *rest: advised.append(spans.copy()) or real_advise(fd, spans, *rest))
    with fastdata.open_dataset(store) as ds:
        expected = ds[j]["blob"].tobytes()
        ds.__getitems__(batch)
    assert len(advised[-1]) > len(batch)  # control: heads and tail parts
    crafted = np.zeros((count, spec.MAX_TAIL_PARTS + 1, 2), "<u8")
    crafted[:, :] = (4096, 16)  # (not all empty: an empty table is dropped before its shape counts)
    lmdb_put(shard, {(spec.INDEX_DB, spec.TAIL_SPANS_KEY): crafted.tobytes()})
    with fastdata.open_dataset(store) as ds:
        assert all(b["blob"].tobytes() == expected for b in ds.__getitems__(batch))
    assert len(advised[-1]) == len(batch)
