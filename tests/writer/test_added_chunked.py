"""Chunked added fields (issue 41): per-sample N-D arrays (segmentation masks, feature maps of a
volume store) added with ``fastdata.add_fields``, their chunks in the field files beside the shards,
read back by region through the same ``ChunkedArray`` as a chunked field written at conversion.

One small store per backend is written once per module; each test works on a copy.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import fastdata
from fastdata.common.fileio import file_checksum
from fastdata.errors import CorruptRecordError
from fastdata.fields import Chunked
from fastdata.format.added import FIELD_FILES_KEY
from fastdata.format.manifest import read_manifest
from fastdata.reader.chunked import ChunkedArray
from fastdata.writer.add_fields import AddFieldsError
from helpers.backends import NAME_SUFFIXES
from helpers.hostile import copy_store

N = 8
FIELD = Chunked("uint8", (4, 4, 4))


@pytest.fixture(scope="module", params=NAME_SUFFIXES, ids=[n for n, _ in NAME_SUFFIXES])
def base_store(request, tmp_path_factory):
    name, suffix = request.param
    dst = str(tmp_path_factory.mktemp(f"chunked-{name}") / f"s{suffix}")
    fastdata.write([{"x": float(i)} for i in range(N)], dst, shard_size=60, progress=False, workers=0)
    assert len(read_manifest(dst)["shards"]) >= 2
    return dst


@pytest.fixture
def store(base_store, tmp_path):
    return copy_store(base_store, tmp_path / os.path.basename(base_store))


def _masks(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4, size=(5 + i, 9, 6 + (i % 3))).astype(np.uint8) for i in range(N)]


def _checksums(store: str) -> dict[str, str]:
    return {n: file_checksum(os.path.join(store, n)) for n in os.listdir(store)
            if n.startswith("shard-") or n.startswith("index")}


def test_chunked_field_added_and_read_by_region(store):
    masks = _masks()
    before = _checksums(store)
    fastdata.add_fields(store, {"mask": masks}, fields={"mask": FIELD})
    assert _checksums(store) == before  # no shard or index file rewritten
    assert not os.path.exists(os.path.join(store, ".fastdata-fields-staging"))  # the chunks' spill folder: gone
    ds = fastdata.open_dataset(store)
    np.testing.assert_array_equal(ds.array_shapes("mask"), [m.shape for m in masks])  # from the index
    assert "mask.shape" in ds.columns()
    for i in (0, N - 1):
        value = ds[i]["mask"]
        assert isinstance(value, ChunkedArray) and value.shape == masks[i].shape and value.dtype == np.uint8
        np.testing.assert_array_equal(value[2:5, 3:8:2, 1], masks[i][2:5, 3:8:2, 1])
        assert value.chunks_read == 4  # only the 2 x 2 x 1 chunks the region touches (of 2 x 3 x 2 or more)
        np.testing.assert_array_equal(np.asarray(value), masks[i])
    patches = fastdata.PatchDataset(ds, (4, 4, 4), fields="mask", sampler="grid")
    p = patches[0]["mask"]
    np.testing.assert_array_equal(p, masks[0][:4, :4, :4])
    report = fastdata.verify(store)
    assert report.ok and report.field_values_checked == N, report.problems


def test_damaged_chunk_is_found_by_verify_and_by_a_read(store):
    masks = _masks()
    fastdata.add_fields(store, {"mask": masks}, fields={"mask": FIELD})
    assert fastdata.verify(store).ok  # control: undamaged
    entry = read_manifest(store)["shards"][0][FIELD_FILES_KEY][0]
    path = os.path.join(store, entry["name"])
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # inside the last value's chunks (the file's last array)
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    report = fastdata.verify(store)
    assert not report.ok and any(entry["name"] in p for p in report.problems)
    # a reader that trusts the file's size: the value's chunk is refused when read, named
    from fastdata.common.fileio import file_checksum as xxh

    manifest = read_manifest(store)
    manifest["shards"][0][FIELD_FILES_KEY][0]["xxh"] = xxh(path)
    from fastdata.format.manifest import write_manifest

    write_manifest(store, {k: v for k, v in manifest.items() if k != "checksum"})
    last = read_manifest(store)["shards"][0]["count"] - 1
    value = fastdata.open_dataset(store)[last]["mask"]
    with pytest.raises(CorruptRecordError, match="added field 'mask'.*chunk"):
        value[...]


@pytest.mark.parametrize("values, message", [
    ([np.zeros((4, 4), np.uint8)] * N, "sample 0: shape \\[4, 4\\] does not have the 3 axes"),
    ([np.zeros((4, 4, 4), np.uint8)] * (N - 1) + [np.full((4, 4, 4), 0.5)], "sample 7.*do not fit uint8 exactly"),
])
def test_bad_chunked_values_refused_nothing_published(store, values, message):
    before = read_manifest(store)["checksum"]
    with pytest.raises(AddFieldsError, match=f"field 'mask' {message}"):
        fastdata.add_fields(store, {"mask": values}, fields={"mask": FIELD})
    assert read_manifest(store)["checksum"] == before


def test_append_merge_drop_gc_carry_chunked_fields(store, tmp_path):
    masks = _masks()
    fastdata.add_fields(store, {"mask": masks}, fields={"mask": FIELD})
    more = _masks(1)[:3]
    fastdata.write([{"x": float(i)} for i in range(N, N + 3)], store, append=True, progress=False, workers=0,
                   added_values={"mask": more})
    ds = fastdata.open_dataset(store)
    for i, want in ((0, masks[0]), (N, more[0]), (N + 2, more[2])):
        np.testing.assert_array_equal(ds[i]["mask"][...], want)
    merged = str(tmp_path / ("merged" + os.path.splitext(store)[1]))
    fastdata.merge([store, store], merged)
    m = fastdata.open_dataset(merged)
    np.testing.assert_array_equal(m[len(ds) + 1]["mask"][1:3], masks[1][1:3])
    assert fastdata.verify(merged).ok
    fastdata.rename_field(store, "mask", "seg")
    np.testing.assert_array_equal(fastdata.open_dataset(store)[3]["seg"][...], masks[3])
    fastdata.drop_fields(store, ["seg"])
    assert fastdata.gc(store) and not [n for n in os.listdir(store) if n.startswith("fields-")]
    assert fastdata.verify(store).ok
