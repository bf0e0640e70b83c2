"""Image added fields (issue 41: "images such as masks"): each value stored bit-exact in the field
file (the encoded image, as a record holds a written image field), with the per-sample format,
size, dtype and channels a written image field keeps in the index; read back like a written image
field (read modes, ``output``, columns, the loader). (Chunked added fields: test_added_chunked.py.)
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from helpers.backends import NAME_SUFFIXES
from helpers.hostile import copy_store
from PIL import Image as PILImage

import fastdata
from fastdata.common.fileio import file_checksum
from fastdata.fields import Float, Image
from fastdata.format.manifest import read_manifest
from fastdata.reader.loader import loader
from fastdata.writer.add_fields import AddFieldsError

N = 10


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _masks(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4, size=(8 + i % 3, 6), dtype=np.uint8) for i in range(count)]


def _write(store: str, first: int, count: int, **options):
    return fastdata.write([{"x": float(i)} for i in range(first, first + count)], store,
                          {"x": Float("float64")}, **{"progress": False, "workers": 0, **options})


@pytest.fixture(scope="module", params=NAME_SUFFIXES, ids=[n for n, _ in NAME_SUFFIXES])
def base_store(request, tmp_path_factory):
    name, suffix = request.param
    dst = str(tmp_path_factory.mktemp(f"img-{name}") / f"s{suffix}")
    _write(dst, 0, N, shard_size=300)  # several shards
    return dst


@pytest.fixture
def store(base_store, tmp_path):
    """A copy of the module's store, for a test that changes it."""
    return copy_store(base_store, tmp_path / os.path.basename(base_store))


def test_masks_and_encoded_images_read_back_like_written_image_fields(store, tmp_path):
    masks = _masks(N, 0)
    rng = np.random.default_rng(1)
    thumbs = [_png(rng.integers(0, 255, size=(5, 7, 3), dtype=np.uint8)) for _ in range(N)]
    before = {n: file_checksum(os.path.join(store, n)) for n in os.listdir(store) if n != "manifest.json"}
    # masks as arrays (declared: an array alone is a ragged field), PNG bytes inferred as an image
    fastdata.add_fields(store, {"mask": masks, "thumb": thumbs}, fields={"mask": Image()})
    assert all(file_checksum(os.path.join(store, n)) == c for n, c in before.items())  # nothing rewritten
    ds = fastdata.open_dataset(store, output="numpy")
    for i in (0, 4, N - 1):
        np.testing.assert_array_equal(ds[i]["mask"], masks[i])  # "unchanged": the stored pixels, bit-exact
        assert ds[i]["thumb"].shape == (5, 7, 3)
    assert ds.column("mask.height").tolist() == [m.shape[0] for m in masks]  # no record read
    assert set(ds.column("thumb.format")) == {"PNG"} and set(ds.column("mask.dtype")) == {"uint8"}
    raw = fastdata.open_dataset(store, output="bytes")
    assert raw[3]["thumb"] == thumbs[3]  # the given bytes, as they are
    gray = fastdata.open_dataset(store, output="numpy", image_mode={"thumb": "L"})
    assert gray[2]["thumb"].shape == (5, 7)  # decode options apply as to a written image field
    batch = next(iter(loader(fastdata.open_dataset(store, output="tensor"), batch_size=4, num_workers=0,
                             collate_fn=list)))
    assert tuple(batch[1]["thumb"].shape) == (3, 5, 7)
    assert fastdata.verify(store).ok
    # an append gives the new samples their masks (or is refused without them); a merge carries them
    new = _masks(3, 2)
    _write(store, N, 3, append=True, added_values={"mask": new, "thumb": thumbs[:3]})
    ds = fastdata.open_dataset(store, output="numpy")
    np.testing.assert_array_equal(ds[N + 2]["mask"], new[2])
    merged = str(tmp_path / ("m" + os.path.splitext(store)[1]))
    fastdata.merge([store, store], merged)
    m = fastdata.open_dataset(merged, output="numpy")
    np.testing.assert_array_equal(m[N + 3 + 1]["mask"], masks[1])
    assert m.column("mask.width").tolist() == [6] * (2 * (N + 3)) and fastdata.verify(merged).ok


def test_bad_images_are_refused_with_nothing_published(store):
    checksum = read_manifest(store)["checksum"]
    thumbs = [_png(np.zeros((4, 4, 3), np.uint8))] * N
    thumbs[6] = b"\x89PNG not really"
    with pytest.raises(AddFieldsError, match="field 'thumb' sample 6: not a usable image"):
        fastdata.add_fields(store, {"thumb": thumbs})
    with pytest.raises(AddFieldsError, match="field 'mask' sample 0: an image field takes"):
        fastdata.add_fields(store, {"mask": [{"a": 1}] * N}, fields={"mask": Image()})
    assert read_manifest(store)["checksum"] == checksum
    assert not [n for n in os.listdir(store) if n.startswith("fields-")]
