"""Sizes a store declares are checked before memory is allocated from them: index widths and
heights against the pixel limit (fastdata.common.imageio.pixel_limit), a raw store's raw_shape
against that limit and against every record's stored size."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import hostile as H
from PIL import Image

import fastdata
from fastdata.common.imageio import PIXEL_LIMIT_WITHOUT_PILLOW_LIMIT, pixel_limit
from fastdata.errors import CorruptRecordError, FormatError


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return H.build_tree(tmp_path_factory.mktemp("tree"))  # 64x48 JPEGs


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def store(request, tree, tmp_path_factory):
    return H.build_store(str(tmp_path_factory.mktemp("s") / H.store_name(request.param)), tree=tree)


def test_pixel_limit_follows_pillow(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1234)
    assert pixel_limit() == 1234
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert pixel_limit() == PIXEL_LIMIT_WITHOUT_PILLOW_LIMIT


@pytest.mark.parametrize("output", ["numpy", "tensor"])
def test_index_sizes_just_inside_the_pixel_limit_read(store, monkeypatch, output):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48)
    ds = fastdata.open_dataset(store, output=output)
    assert len(ds.__getitems__([0, 1])) == 2


def test_index_sizes_just_outside_the_pixel_limit_are_refused_before_the_batch(store, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48 - 1)
    ds = fastdata.open_dataset(store, output="tensor")  # per sample, as every read path: a decode refuses it
    with pytest.raises(CorruptRecordError, match=r"shard shard-00000\.\w+ record 1 \(sample 1\): the index's "
                                                 r"widths/heights say 64x48, not a size an image may have") as err:
        ds.__getitems__([1, 2])
    assert err.value.store == store and err.value.shard.startswith("shard-00000")


@pytest.mark.parametrize("output", ["numpy", "tensor"])
@pytest.mark.parametrize("size", [46340, -1, 0])
def test_hostile_index_sizes_are_refused_before_a_batch_is_allocated(store, tmp_path, output, size):
    backend = "lmdb" if store.endswith(".lmdb") else "hdf5"
    copy = H.copy_store(store, tmp_path / os.path.basename(store))
    shard = H.first_shard(copy)
    widths = H.index_array(backend, shard, "widths", "<i4")
    heights = H.index_array(backend, shard, "heights", "<i4")
    widths[:] = size
    heights[:] = 46340
    H.set_index_arrays(copy, backend, shard, {"widths": widths, "heights": heights})
    H.resign(copy)
    ds = fastdata.open_dataset(copy, output=output)
    with pytest.raises(CorruptRecordError, match=rf"record 0 \(sample 0\).*say {size}x46340"):
        ds.__getitems__([0, 1])


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def raw_store(request, tree, tmp_path_factory):
    return H.build_store(str(tmp_path_factory.mktemp("r") / H.store_name(request.param)), tree=tree, raw="8x8")


def test_raw_shape_must_match_every_record(raw_store, tmp_path):
    copy = H.copy_store(raw_store, tmp_path / os.path.basename(raw_store))
    assert fastdata.open_dataset(copy, output="numpy").__getitems__([0, 1]).images.shape == (2, 8, 8, 3)
    body = H.load_manifest(copy)
    body["storage"]["raw_shape"] = [8, 4]  # fewer bytes than stored: the manifest check passes, the index's does not
    H.resign(copy, body)
    # HDF5's reader finds it first (its pixels dataset has the stored shape); LMDB's index then
    with pytest.raises(FormatError, match=r"holds 192 bytes, but the manifest's raw_shape 8x4 needs 96|"
                                          r"expected \(n, 8, 4, 3\)|"
                                          r"has shape \(\d+, 8, 8, 3\), expected \(\d+, 8, 4, 3\)"):
        fastdata.open_dataset(copy, output="numpy")


def test_huge_raw_shape_is_refused_by_the_manifest(raw_store, tmp_path):
    copy = H.copy_store(raw_store, tmp_path / os.path.basename(raw_store))
    body = H.load_manifest(copy)
    body["storage"]["raw_shape"] = [10**5, 10**5]
    H.resign(copy, body)
    with pytest.raises(FormatError, match="raw_shape"):
        fastdata.open_dataset(copy, output="numpy")
    assert np.int64(1)  # numpy is the index's type
