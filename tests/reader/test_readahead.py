"""LMDB readahead: the default lets a cold record come in with one read, not one per page."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

import fastdata
from fastdata.bench import cache
from fastdata.format.backends.lmdb import reader as lmdb_reader
from fastdata.format.manifest import read_manifest
from fastdata.reader.dataset import READAHEAD_RECORD_BYTES, wants_readahead

GiB = 1 << 30


def _manifest(record_bytes: int, records: int) -> dict:
    half = records // 2
    return {"shards": [{"bytes": record_bytes * half, "count": half},
                       {"bytes": record_bytes * (records - half), "count": records - half}]}


def test_readahead_is_on_for_multi_page_records_whatever_the_store_size():
    big = _manifest(READAHEAD_RECORD_BYTES, 10_000_000)  # 160 GB of 16 KiB records
    assert wants_readahead(big, memory_bytes=8 * GiB)


def test_readahead_is_off_only_for_small_records_in_a_store_larger_than_half_the_memory():
    small = _manifest(3_000, 2_000_000)  # 6 GB of CIFAR-sized records
    assert not wants_readahead(small, memory_bytes=8 * GiB)
    assert wants_readahead(small, memory_bytes=12 * GiB)  # fits in half: read ahead
    assert wants_readahead({"shards": []}, memory_bytes=GiB)


def test_dataset_resolves_the_default_once_and_keeps_an_explicit_choice(tmp_path, monkeypatch):
    from fastdata.synth import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=2, per_class=4, size="cifar", seed=0)
    store = str(tmp_path / "s.lmdb")
    fastdata.convert(str(tmp_path / "src"), store, workers=1, progress=False)
    assert fastdata.open_dataset(store).readahead is True  # a few KB store: fits in memory
    monkeypatch.setattr("fastdata.reader.dataset.machine_memory", lambda: 1000)
    assert fastdata.open_dataset(store).readahead is False  # small records, store > memory / 2
    assert fastdata.open_dataset(store, readahead=True).readahead is True
    ds = fastdata.open_dataset(store, readahead=False)
    ds[0]
    assert next(iter(ds._shards.open_readers().values())).env.flags()["readahead"] is False
    ds.close()


def _major_faults_reading(store: str, readahead, indices: np.ndarray, files: list[str], prefetch: bool,
                          monkeypatch) -> int:
    monkeypatch.setattr(lmdb_reader, "PREFETCH", prefetch)
    ds = fastdata.open_dataset(store, readahead=readahead, output="numpy")
    ds.__getitems__(indices[:1].tolist())  # libraries and the B-tree's pages: not counted
    ds.close()
    cache.evict_page_cache(files)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    ds.__getitems__(indices.tolist())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
    ds.close()
    return faults


def _device_read_ahead_kb(path) -> int | None:
    """The block device's read-ahead setting for ``path`` (None if unknown)."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):  # disk, or partition
        try:
            with open(queue) as fh:
                return int(fh.read())
        except (OSError, ValueError):
            continue
    return None


@pytest.fixture(scope="module")
def cold_store(tmp_path_factory):
    """A store of multi-page ImageNet-like records on a disk whose page cache can be evicted:
    (store, its shard files, pages per record); made once for the module (the tests only read it)."""
    from fastdata.synth import make_image_folder

    tmp_path = tmp_path_factory.mktemp("cold")

    if _device_read_ahead_kb(tmp_path) == 0:
        pytest.skip(f"read-ahead is switched off on the device of {tmp_path} (read_ahead_kb = 0)")
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 16))
    probe.read_bytes()
    cache.evict_page_cache([str(probe)])
    if cache.resident_fraction([str(probe)]) != 0.0:
        pytest.skip(f"{tmp_path} is on a filesystem whose page cache is its storage (tmpfs)")
    make_image_folder(tmp_path / "src", num_classes=2, per_class=24, size="imagenet", seed=1)
    store = str(tmp_path / "s.lmdb")
    fastdata.convert(str(tmp_path / "src"), store, workers=1, progress=False)
    manifest = read_manifest(store)
    files = [os.path.join(store, s["name"]) for s in manifest["shards"]]
    pages = sum(s["bytes"] for s in manifest["shards"]) / sum(s["count"] for s in manifest["shards"]) / 4096
    assert pages > 8  # records of many pages: the case the default is for
    return store, files, pages


def test_a_cold_record_is_read_with_a_few_faults_not_one_per_page(cold_store, monkeypatch):
    store, files, pages = cold_store
    indices = np.random.default_rng(0).permutation(48)[:32]
    paged = _major_faults_reading(store, False, indices, files, False, monkeypatch)
    default = _major_faults_reading(store, None, indices, files, False, monkeypatch)
    # control: without readahead (and without the prefetch) every page of a cold record is a
    # synchronous read
    assert paged >= 0.5 * pages * len(indices), (paged, pages)
    assert default <= 3 * len(indices), (default, paged)


def test_a_cold_batch_is_prefetched_whole_before_it_is_read(cold_store, monkeypatch):
    """The writer records each record's span in the shard; a reader asks the kernel for the
    whole batch at once before reading it, so the reads that follow wait on no synchronous
    fault of their own (control: the same batch without the prefetch, one or more major
    faults per record). Without the OS readahead (the default for stores of small records
    larger than half the memory), where each page would otherwise be a read of its own; with
    it, this small store would be read ahead whole by the first fault, hiding the difference."""
    store, files, pages = cold_store
    indices = np.random.default_rng(1).permutation(48)[:32]
    without = _major_faults_reading(store, False, indices, files, False, monkeypatch)
    with_prefetch = _major_faults_reading(store, False, indices, files, True, monkeypatch)
    assert without >= len(indices), without
    assert with_prefetch <= 0.25 * len(indices), (with_prefetch, without)
