"""Hostile chunked values (issue 36): a value with an empty axis, a region over many edge
shapes, a small store claiming gigabytes per read or per batch, a grid whose tile count
wraps in int64. Each attack runs in a forked child under ``RLIMIT_AS`` (the child's own
address space plus :data:`GROWTH`) and a timeout, and must end in a typed error or the
right (empty) result, cheaply; each has a control, the benign store read correctly."""

from __future__ import annotations

import os
import tracemalloc

import h5py
import numpy as np
import pytest
import torch  # noqa: F401 - imported before any fork: a child under its limit cannot map libtorch
from helpers.hostile import resign
from helpers.volumes import SCHEMA, volume

import fastdata
import fastdata.reader.open  # noqa: F401 - as torch: what the children run is imported here first
import fastdata.tools.verify  # noqa: F401
from fastdata.errors import ReadLimitError
from fastdata.fields import Chunked, Int, Schema
from helpers.bounded import TIMEOUT, run_bounded

fastdata.open_dataset  # noqa: B018 - resolve the lazy names before forking
fastdata.collate  # noqa: B018

def bounded(fn, *args, env: dict[str, str] | None = None, timeout: float = TIMEOUT) -> dict:
    """``fn(*args)`` in a forked child limited to 1 GiB more address space and ``timeout`` seconds
    (:func:`helpers.bounded.run_bounded`)."""
    return run_bounded(fn, *args, env=env, timeout=timeout)


def _write(dst, values, schema=SCHEMA) -> str:
    fastdata.write([{"ct": v, "label": i} for i, v in enumerate(values)], dst, schema, workers=0, progress=False)
    return str(dst)


def _set_shapes(store: str, shapes: dict[int, list[int]]) -> None:
    """Give samples of an HDF5 store's only shard other stored ``ct`` shapes (a hostile index),
    and re-sign the store as its crafter would."""
    with h5py.File(os.path.join(store, "shard-00000.h5"), "r+") as f:
        for i, shape in shapes.items():
            f["fields/ct.shape"][i] = shape
    resign(store)


# -- 1. a value with one empty axis ------------------------------------------------------------

def _read_empty(store: str) -> dict:
    ds = fastdata.open_dataset(store)
    arr = ds[0]["ct"]
    batch = fastdata.collate([ds[0], ds[0]])
    report = fastdata.verify(store, decode=True)
    return {"shape": arr.shape, "whole": arr[...].shape, "strided": arr[::3, :, 1:5].shape,
            "reversed": arr[::-7, :, ::2].shape, "int": arr[..., 3].shape, "asarray": np.asarray(arr).shape,
            "batch": tuple(batch["ct"].shape), "verify": (report.ok, report.summary()),
            "other": np.asarray(ds[1]["ct"]).tolist()}


@pytest.mark.parametrize("attack", [False, True])
def test_a_value_with_an_empty_axis_reads_empty_at_once(tmp_path, attack):
    store = _write(tmp_path / "e.h5", [np.zeros((0, 4, 4), np.uint16), volume(1, (2, 2, 2))])
    huge = [1 << 40, 0, 20]
    _set_shapes(store, {0: huge if attack else [0, 4, 4]})
    result = bounded(_read_empty, store, timeout=10)
    assert result["outcome"] == "ok", result
    got = result["value"]
    shape = tuple(huge) if attack else (0, 4, 4)
    assert got["shape"] == got["whole"] == got["asarray"] == shape
    assert got["strided"] == (-(-shape[0] // 3), shape[1], min(shape[2], 5) - 1)
    assert got["reversed"] == (-(-shape[0] // 7), shape[1], -(-shape[2] // 2))
    assert got["int"] == shape[:2]
    assert got["batch"] == (2, *shape)
    assert got["verify"][0], got["verify"]  # a legal empty value: no chunk, nothing damaged
    assert got["other"] == volume(1, (2, 2, 2)).tolist()


def test_a_strided_slice_walks_only_the_chunks_it_takes_from():
    from fastdata.reader.chunked import _Axis

    def pieces():
        return _Axis(3, 1 << 30, 3).pieces(16, 1 << 40)  # 3 indices 2^30 apart: 3 chunks of 2^36

    result = bounded(pieces, timeout=5)
    assert result["outcome"] == "ok", result
    assert [p[0] for p in result["value"]] == [0, (3 + (1 << 30)) // 16, (3 + (2 << 30)) // 16]
    assert _Axis(1, 5, 4).pieces(4, 20) == [(0, slice(1, 2), slice(0, 1)), (1, slice(2, 3), slice(1, 2)),
                                            (2, slice(3, 4), slice(2, 3)), (4, slice(0, 1), slice(3, 4))]


# -- 2. one scratch buffer, however many edge shapes ----------------------------------------------

EDGE_AXES = 8
EDGE_CHUNK = 4
EDGE_SCHEMA = Schema.of({"ct": Chunked("float64", (EDGE_CHUNK,) * EDGE_AXES, codec="lz4"), "label": Int()})


def _edge_region_peak(store: str) -> dict:
    arr = fastdata.open_dataset(store)[0]["ct"]
    tracemalloc.start()
    region = arr[(slice(EDGE_CHUNK - 1, EDGE_CHUNK + 1),) * EDGE_AXES]  # 2 chunks per axis: 256 edge shapes
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak": peak, "region": region, "chunks_read": arr.chunks_read}


def test_a_region_over_many_edge_shapes_keeps_one_scratch_buffer(tmp_path):
    shape = (EDGE_CHUNK + 1,) * EDGE_AXES  # 5^8 float64 (3 MB): each axis a full chunk and an edge of 1
    value = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    store = _write(tmp_path / "edges.lmdb", [value], EDGE_SCHEMA)
    result = bounded(_edge_region_peak, store, timeout=15)
    assert result["outcome"] == "ok", result
    got = result["value"]
    assert np.array_equal(got["region"], value[(slice(EDGE_CHUNK - 1, EDGE_CHUNK + 1),) * EDGE_AXES])  # control
    assert got["chunks_read"] == 2 ** EDGE_AXES
    chunk = EDGE_CHUNK ** EDGE_AXES * 8  # 512 KiB; one buffer per edge shape was the whole value (3.1 MB)
    assert got["peak"] < 2 * chunk, f"a 2 KiB region's read peaked at {got['peak']:,} bytes"


# -- 3. per-read and per-batch bounds -------------------------------------------------------------

#: 256 MiB chunks: a store of a few bytes per chunk can claim gigabytes with a valid chunk table
BIG_SCHEMA = Schema.of({"ct": Chunked("uint8", (1024, 1024, 256)), "label": Int()})


def _read_whole(store: str, i: int) -> tuple:
    arr = fastdata.open_dataset(store)[i]["ct"]
    return arr.shape, np.asarray(arr).sum(dtype=np.int64).item()


def _collate(store: str, indices: list[int]) -> tuple:
    ds = fastdata.open_dataset(store)
    return tuple(fastdata.collate([ds[i] for i in indices])["ct"].shape)


def test_the_read_bounds_have_documented_defaults_the_store_cannot_raise(monkeypatch):
    from fastdata.reader import chunked

    monkeypatch.delenv(chunked.REGION_LIMIT_ENV, raising=False)
    monkeypatch.delenv(chunked.BATCH_LIMIT_ENV, raising=False)
    assert chunked.max_region_bytes() == 2 << 30 and chunked.max_batch_bytes() == 4 << 30
    monkeypatch.setenv(chunked.BATCH_LIMIT_ENV, "12345")
    monkeypatch.setenv(chunked.REGION_LIMIT_ENV, "not a number")
    assert chunked.max_batch_bytes() == 12345 and chunked.max_region_bytes() == 2 << 30


@pytest.mark.parametrize("attack", [False, True])
def test_a_small_store_claiming_gigabytes_per_read_is_refused_before_allocating(tmp_path, attack):
    value = np.arange(9 * 256, dtype=np.uint8).reshape(1, 1, -1)  # 9 chunks along the last axis
    store = _write(tmp_path / "big.h5", [value], BIG_SCHEMA)
    _set_shapes(store, {0: [1024, 1024, 9 * 256] if attack else list(value.shape)})  # 2.25 GiB, same 9 chunks
    result = bounded(_read_whole, store, 0)
    if not attack:
        assert result["outcome"] == "ok", result
        assert result["value"] == ((1, 1, 2304), int(value.sum()))
        return
    assert result["outcome"] == "typed_error" and result["type"] == "ReadLimitError", result
    assert "sample 0) field 'ct'" in result["message"] and "FASTDATA_MAX_REGION_BYTES" in result["message"]
    assert "2,415,919,104 bytes" in result["message"]


@pytest.mark.parametrize("attack", [False, True])
def test_a_batch_of_values_under_the_read_bound_is_held_to_the_batch_bound(tmp_path, attack):
    values = [np.full((1, 1, 6 * 256), i, dtype=np.uint8) for i in range(3)]  # 6 chunks each
    store = _write(tmp_path / "batch.h5", values, BIG_SCHEMA)
    claimed = [1024, 1024, 6 * 256]  # 1.5 GiB each: under the 2 GiB per read, 4.5 GiB a batch
    _set_shapes(store, {i: claimed if attack else [1, 1, 6 * 256] for i in range(3)})
    result = bounded(_collate, store, [0, 1, 2])
    if not attack:
        assert result["outcome"] == "ok" and result["value"] == (3, 1, 1, 1536), result
        return
    assert result["outcome"] == "typed_error" and result["type"] == "ReadLimitError", result
    assert "FASTDATA_MAX_BATCH_BYTES" in result["message"] and "field 'ct'" in result["message"]
    assert "4,831,838,208 bytes" in result["message"]


def test_the_user_sets_the_bounds(tmp_path):
    values = [volume(i, (64, 64, 64)) for i in range(4)]  # 512 KiB each
    store = _write(tmp_path / "user.lmdb", values)
    limits = {"FASTDATA_MAX_REGION_BYTES": str(1 << 20), "FASTDATA_MAX_BATCH_BYTES": str(1 << 20)}
    assert bounded(_collate, store, [0, 1], env=limits) == {"outcome": "ok", "value": (2, 64, 64, 64)}
    refused = bounded(_collate, store, [0, 1, 2], env=limits)
    assert refused["type"] == "ReadLimitError" and "1,572,864 bytes, more than the 1,048,576" in refused["message"]
    refused = bounded(_read_whole, store, 0, env={"FASTDATA_MAX_REGION_BYTES": str(1 << 18)})
    assert refused["type"] == "ReadLimitError" and "(FASTDATA_MAX_REGION_BYTES)" in refused["message"]
    with pytest.raises(ReadLimitError):  # a ValueError too, as this limit always raised
        from fastdata.reader.chunked import check_batch_bytes

        os.environ["FASTDATA_MAX_BATCH_BYTES"] = "1"
        try:
            check_batch_bytes([fastdata.open_dataset(store)[0]["ct"]])
        finally:
            del os.environ["FASTDATA_MAX_BATCH_BYTES"]
    assert issubclass(ReadLimitError, ValueError)


# -- 4. a grid whose tile count wraps in int64 ----------------------------------------------------

@pytest.mark.parametrize("attack", [False, True])
def test_a_grid_tile_count_beyond_int64_is_refused_naming_the_sample(tmp_path, attack):
    store = _write(tmp_path / "grid.h5", [volume(0, (4, 4, 4)), np.zeros((0, 4, 4), np.uint16)])
    _set_shapes(store, {1: [1 << 40, 1 << 40, 0] if attack else [0, 4, 4]})  # 2^80 tiles of (1, 1) wrap to 0
    ds = fastdata.open_dataset(store)
    if not attack:
        grid = fastdata.PatchDataset(ds, (1, 1), fields="ct", sampler="grid", pad_value=0)
        assert len(grid) == 16 + 4 and len(grid.patches_of(1)) == 4
        assert np.array_equal(grid[5]["ct"], volume(0, (4, 4, 4))[1:2, 1:2])
        return
    with pytest.raises(ReadLimitError, match=r"sample 1: field 'ct' of leading shape \[1099511627776, "
                                             r"1099511627776\] makes a grid of .* = 1,208,925,819,614,629,174,706,"
                                             r"176 tiles"):
        fastdata.PatchDataset(ds, (1, 1), fields="ct", sampler="grid", pad_value=0)
