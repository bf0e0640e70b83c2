"""The LMDB structure checker (``fastdata.format.backends.lmdb.structure``): a sound file passes;
each mutation that could make LMDB fault inside its memory map (or read garbage) is refused,
before LMDB opens the file, with a message naming the file and what is wrong.

The files are built with py-lmdb in fastdata's layout (named databases ``records`` and
``index``): enough small records for a two-level B-tree (branch pages), and overflow values.
Mutated files are never opened with LMDB in this process (they could kill it).
"""

from __future__ import annotations

import os
import shutil
import struct

import lmdb
import pytest

from fastdata.errors import FastdataError, UnsafeStoreError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.lmdb import reader as lmdb_reader
from fastdata.format.backends.lmdb.reader import LMDBShardReader
from fastdata.format.backends.lmdb.structure import (
    F_BIGDATA,
    NODE_HEADER,
    P_BRANCH,
    P_LEAF,
    PAGE_HEADER,
    check_structure,
)

PSIZE = 4096


def _build(path: str, small: int = 600, big: int = 5, big_size: int = 10_000) -> str:
    env = lmdb.open(path, subdir=False, map_size=64 << 20, max_dbs=2, lock=False)
    records, index = env.open_db(b"records"), env.open_db(b"index")
    with env.begin(write=True) as txn:
        for i in range(small):
            txn.put(struct.pack(">Q", i), bytes([i % 251]) * 100, db=records, append=True)
        for i in range(small, small + big):
            txn.put(struct.pack(">Q", i), bytes([i % 251]) * big_size, db=records, append=True)
        txn.put(b"header", b"\x80", db=index)
    env.sync(True)
    env.close()
    return path


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("lmdb") / "sound.lmdb"))


@pytest.fixture
def shard(sound, tmp_path) -> str:
    dst = str(tmp_path / "shard.lmdb")
    shutil.copyfile(sound, dst)
    return dst


def _page(path: str, pgno: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(pgno * PSIZE)
        return fh.read(PSIZE)


def _write(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _nodes(page: bytes) -> list[int]:
    lower = struct.unpack_from("<H", page, 12)[0]
    return [struct.unpack_from("<H", page, PAGE_HEADER + 2 * k)[0] for k in range((lower - PAGE_HEADER) // 2)]


def _records_pages(path: str) -> tuple[int, list[int]]:
    """(root of ``records``, its leaf page numbers)."""
    summary = check_structure(path)
    root = summary.databases["records"].root
    leaves = []
    for ptr in _nodes(_page(path, root)):
        lo, hi, fl = struct.unpack_from("<HHH", _page(path, root), ptr)
        leaves.append(lo | hi << 16 | fl << 32)
    return root, leaves


def _set_meta(path: str, offset: int, fmt: str, value: int) -> None:
    for page in (0, 1):
        _write(path, page * PSIZE + offset, struct.pack(fmt, value))


def refused(path: str, *words: str, full: bool = False) -> str:
    with pytest.raises(UnsafeStoreError) as err:
        check_structure(path, full=full)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    for word in words:
        assert word in message, message
    return message


def test_a_sound_file_passes_and_is_walked_whole(sound):
    summary = check_structure(sound, full=True)
    assert set(summary.databases) == {"main", "records", "index"}
    root = summary.databases["records"].root
    flags = struct.unpack_from("<H", _page(sound, root), 10)[0]
    assert flags & P_BRANCH, "the fixture must have a two-level B-tree"
    assert summary.databases["records"].entries == 605
    assert summary.overflow_values == 5 and summary.overflow_pages == 5 * 3
    _root, leaves = _records_pages(sound)
    assert len(leaves) > 1
    assert summary.tree_pages == 1 + 1 + 1 + len(leaves)  # main, index, records' root and its leaves


def test_control_the_untouched_copy_passes_and_reads(shard):
    check_structure(shard, full=True)
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=2)
    with env.begin(db=env.open_db(b"records", create=False)) as txn:
        assert len(txn.get(struct.pack(">Q", 600))) == 10_000
    env.close()


def test_meta_magic(shard):
    _write(shard, 16, struct.pack("<I", 0xDEADBEEF))
    refused(shard, "meta page 0 is not an LMDB meta page", "magic 0xdeadbeef")


def test_meta_version(shard):
    _set_meta(shard, 20, "<I", 2)
    refused(shard, "data version 2")


def test_page_size_that_is_no_power_of_two(shard):
    _set_meta(shard, 40, "<I", 3000)
    refused(shard, "page size of 3000 bytes")


def test_a_file_too_short_for_its_meta_pages(tmp_path):
    path = str(tmp_path / "short.lmdb")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 100)
    refused(path, "too short")


def test_last_page_past_the_end_of_the_file(shard):
    pages = os.path.getsize(shard) // PSIZE
    _set_meta(shard, 136, "<Q", pages + 200)
    refused(shard, f"the last page is {pages + 200}, past the end of the file ({pages} pages of 4096 bytes)")


def test_main_root_past_the_last_page(shard):
    pages = os.path.getsize(shard) // PSIZE
    _set_meta(shard, 128, "<Q", pages + 100)
    refused(shard, f"the main database's root is page {pages + 100}, past the end of the file ({pages} pages)")


def test_a_named_database_root_past_the_end(shard):
    """The ``records`` MDB_db record (in the main DB's leaf) gets a root page past the end."""
    pages = os.path.getsize(shard) // PSIZE
    main_root = check_structure(shard).databases["main"].root
    page = _page(shard, main_root)
    for ptr in _nodes(page):
        _lo, _hi, _fl, ksize = struct.unpack_from("<HHHH", page, ptr)
        if page[ptr + NODE_HEADER:ptr + NODE_HEADER + ksize] == b"records":
            _write(shard, main_root * PSIZE + ptr + NODE_HEADER + ksize + 40, struct.pack("<Q", pages + 7))
    refused(shard, "'records'", f"page {pages + 7}, past the end of the file")


def test_a_branch_page_pointing_past_the_end(shard):
    pages = os.path.getsize(shard) // PSIZE
    root, _leaves = _records_pages(shard)
    ptr = _nodes(_page(shard, root))[1]
    target = pages + 9123
    _write(shard, root * PSIZE + ptr, struct.pack("<HHH", target & 0xFFFF, target >> 16 & 0xFFFF, target >> 32))
    refused(shard, f"branch page {root} points to page {target}, past the end of the file ({pages} pages)")


def test_a_branch_page_pointing_back_at_itself(shard):
    root, _leaves = _records_pages(shard)
    ptr = _nodes(_page(shard, root))[1]
    _write(shard, root * PSIZE + ptr, struct.pack("<HHH", root & 0xFFFF, root >> 16, 0))
    refused(shard, f"page {root} is reached twice")


def test_a_leaf_node_data_size_past_its_page(shard):
    _root, leaves = _records_pages(shard)
    leaf = leaves[0]
    ptr = _nodes(_page(shard, leaf))[0]
    _write(shard, leaf * PSIZE + ptr, struct.pack("<HH", 0, 16))  # 1 MiB inline
    refused(shard, f"page {leaf}: node 0's data (1048576 bytes) runs past the end of its page")


def test_a_node_pointer_outside_the_page(shard):
    _root, leaves = _records_pages(shard)
    leaf = leaves[0]
    _write(shard, leaf * PSIZE + PAGE_HEADER, struct.pack("<H", PSIZE - 4))
    refused(shard, f"page {leaf}: node 0 is at offset {PSIZE - 4}, outside the page's node area")


def test_a_page_header_that_is_impossible(shard):
    _root, leaves = _records_pages(shard)
    _write(shard, leaves[0] * PSIZE + 12, struct.pack("<HH", 3000, 2000))  # lower > upper
    refused(shard, f"page {leaves[0]}: header (lower 3000, upper 2000) is impossible")


def test_a_page_that_is_not_a_tree_page(shard):
    _root, leaves = _records_pages(shard)
    _write(shard, leaves[0] * PSIZE + 10, struct.pack("<H", 0x04))  # P_OVERFLOW where a leaf belongs
    refused(shard, f"page {leaves[0]}: flags 0x4 are not those of a branch or leaf page")


def _bigdata(path: str) -> tuple[int, int, int, int]:
    """(leaf page, node offset in it, its size, its overflow page) of the first overflow value."""
    _root, leaves = _records_pages(path)
    for leaf in leaves:
        page = _page(path, leaf)
        for ptr in _nodes(page):
            lo, hi, flags, ksize = struct.unpack_from("<HHHH", page, ptr)
            if flags & F_BIGDATA:
                return leaf, ptr, lo | hi << 16, struct.unpack_from("<Q", page, ptr + NODE_HEADER + ksize)[0]
    raise LookupError("no overflow value")


def test_an_overflow_extent_past_the_last_page(shard):
    leaf, ptr, _size, over = _bigdata(shard)
    pages = os.path.getsize(shard) // PSIZE
    size = (pages - over) * PSIZE + (1 << 20)
    _write(shard, leaf * PSIZE + ptr, struct.pack("<HH", size & 0xFFFF, size >> 16))
    message = refused(shard, f"page {leaf}: node", f"overflow value ({size} bytes) spans pages {over}..",
                      "past the end of the file")
    assert f"({pages} pages)" in message


def test_an_overflow_page_number_past_the_end(shard):
    leaf, ptr, _size, _over = _bigdata(shard)
    ksize = struct.unpack_from("<H", _page(shard, leaf), ptr + 6)[0]
    _write(shard, leaf * PSIZE + ptr + NODE_HEADER + ksize, struct.pack("<Q", 2**63 + 5))
    refused(shard, "overflow value", f"starts at page {2**63 + 5}, past the end of the file")


def test_overflow_page_headers_are_checked_in_full_mode_only(shard):
    """A damaged overflow page header cannot make LMDB fault (it reads by the node's size, checked
    on open), so only ``verify`` (``full``) reads those headers."""
    _leaf, _ptr, _size, over = _bigdata(shard)
    _write(shard, over * PSIZE + 12, struct.pack("<I", 1))  # mp_pages: 1 page for a 3-page value
    check_structure(shard)
    refused(shard, f"overflow page {over}: header", "does not hold a value of 3 pages", full=True)


def test_the_reader_refuses_before_lmdb_opens_the_file(shard, monkeypatch):
    pages = os.path.getsize(shard) // PSIZE
    _set_meta(shard, 136, "<Q", pages + 200)
    opened = []
    monkeypatch.setattr(lmdb_reader.lmdb, "open", lambda *a, **k: opened.append(a))
    with pytest.raises(UnsafeStoreError, match="past the end of the file"):
        LMDBShardReader(shard, StorageSpec())
    with pytest.raises(UnsafeStoreError, match="past the end of the file"):
        LMDBShardReader.check_structure(shard, full=True)
    assert not opened


def test_checked_once_per_file_identity(shard, monkeypatch):
    calls = []
    real = lmdb_reader.check_structure
    monkeypatch.setattr(lmdb_reader, "check_structure", lambda *a, **k: calls.append(a) or real(*a, **k))
    for _ in range(3):
        lmdb_reader.checked_open(shard)
    assert len(calls) <= 1
    _write(shard, os.path.getsize(shard), b"\0" * PSIZE)  # a new identity: checked again
    lmdb_reader.checked_open(shard)
    lmdb_reader.checked_open(shard, full=True)  # full: always
    assert len(calls) in (2, 3) and calls[-1][0] == shard


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_not_a_regular_file(tmp_path, kind):
    path = str(tmp_path / "shard.lmdb")
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    with pytest.raises(UnsafeStoreError, match=f"a {'FIFO' if kind == 'fifo' else 'directory'}, not a regular"):
        LMDBShardReader(path, StorageSpec())
    with pytest.raises(UnsafeStoreError):
        LMDBShardReader.check_structure(path)


def test_a_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(FastdataError, match="cannot open"):
        LMDBShardReader(str(tmp_path / "none.lmdb"), StorageSpec())


def test_leaf_flags_bigdata_are_leaves_only(shard):
    """Sanity of the fixture's page kinds (what the mutations above rely on)."""
    _root, leaves = _records_pages(shard)
    assert all(struct.unpack_from("<H", _page(shard, leaf), 10)[0] & P_LEAF for leaf in leaves)
