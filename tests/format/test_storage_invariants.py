"""Optional storage fields and reader state used outside their invariant give a clear error.

``StorageSpec.raw_shape`` exists only for raw-mode stores and ``max_side`` only for
reencode-mode ones; an HDF5 shard reader's mapping exists only while it is open.
Code reaching for them anyway used to fail with ``TypeError: cannot unpack
non-iterable NoneType object`` or ``'NoneType' object is not subscriptable``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.backends import SUFFIXES

from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.format.manifest import read_manifest
from fastdata.reader.decode import decode_numpy
from fastdata.writer.api import convert


def test_raw_hw_is_the_raw_shape_of_a_raw_store():
    assert StorageSpec(mode="raw", raw_shape=(4, 6)).fixed_pixel_shape() == (4, 6)


@pytest.mark.parametrize("spec", [StorageSpec(), StorageSpec(mode="reencode", max_side=64, quality=90)])
def test_raw_hw_of_a_store_without_raw_pixels_says_so(spec):
    with pytest.raises(ValueError, match=rf"storage mode '{spec.mode}' has no raw_shape"):
        spec.fixed_pixel_shape()


def test_reencode_max_side_of_a_store_that_keeps_originals_says_so():
    assert StorageSpec(mode="reencode", max_side=64, quality=90).reencode_max_side() == 64
    with pytest.raises(ValueError, match="storage mode 'original' has no max_side"):
        StorageSpec().reencode_max_side()


def test_raw_record_without_its_shape_is_a_clear_error():
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8)
    assert decode_numpy(pixels.tobytes(), "RAW", (2, 3)).shape == (2, 3, 3)
    with pytest.raises(ValueError, match="RAW record needs raw_shape"):
        decode_numpy(pixels.tobytes(), "RAW")


@pytest.mark.parametrize("storage", ["original", "raw"])
def test_hdf5_reader_used_after_close_says_it_is_closed(small_tree, tmp_path, storage):
    """Every read path of a closed reader names the shard and says it is closed
    (the mapping is gone), instead of a TypeError from deep inside."""
    dst = str(tmp_path / "store.h5")
    convert(small_tree, dst, format="hdf5", raw="8x8" if storage == "raw" else None)
    manifest = read_manifest(dst)
    spec = StorageSpec.from_json(manifest["storage"])
    path = os.path.join(dst, manifest["shards"][0]["name"])

    reader = reader_class("hdf5")(path, spec)
    first = reader.get(0)  # control: reads while open
    assert reader.get_many([0]) == [first]
    reader.close()
    for read in (lambda: reader.get(0), lambda: reader.get_many([0])):
        with pytest.raises(ValueError, match=rf"{path}: the shard reader is closed"):
            read()
    if storage == "raw":
        with pytest.raises(ValueError, match="the shard reader is closed"):
            reader.get_raw_batch(np.array([0]), np.empty((1, 8, 8, 3), dtype=np.uint8))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_closed_shard_reader_says_so_on_every_read(small_tree, tmp_path, suffix):
    """Every read method of a closed reader raises ValueError naming the shard, not an
    AttributeError from deep inside the backend."""
    dst = tmp_path / f"o{suffix}"
    convert(small_tree, str(dst), progress=False)
    m = read_manifest(str(dst))
    path = str(dst / m["shards"][0]["name"])
    reader = reader_class(m["backend"])(path, StorageSpec())
    assert len(reader.get(0)) > 0
    reader.close()
    for read in (lambda: reader.get(0), reader.read_index, lambda: reader.get_many([0, 1])):
        with pytest.raises(ValueError, match="reader is closed") as info:
            read()
        assert path in str(info.value)
