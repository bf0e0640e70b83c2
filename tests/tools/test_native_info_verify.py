"""fastdata info lists the dtypes and channel counts a store holds (from its index, "not recorded"
for older stores) and its default read mode; verify --decode checks them against the images."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import hostile as H
from helpers.images import DATA_DIR, make_jpeg
from helpers.native import ramp, write_png16

import fastdata
from fastdata.cli.main import main
from fastdata.tools.verify import info, verify
from fastdata.fields import Image, Int


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for i in range(3):
        write_png16(root / "deep" / f"{i}.png", (16, 12), seed=i)
    for i in range(2):
        make_jpeg(root / "photo" / f"{i}.jpg", size=(16, 12), seed=i)
    return root


@pytest.mark.parametrize("backend", ["lmdb", "h5"])
def test_info_lists_dtypes_and_channels_and_the_read_mode(tmp_path, tree, backend, capsys):
    dst = tmp_path / f"s.{backend}"
    fastdata.convert(tree, dst, image_mode="unchanged", workers=0, progress=False)
    data = info(str(dst))
    assert data["images"]["image"]["kinds"] == {"uint16 x1": 3, "uint8 x3": 2}
    assert data["images"]["image"]["formats"] == {"PNG": 3, "JPEG": 2}
    assert data["image_modes"] == {"image": "unchanged"}
    assert main(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "images:   uint16 x1 3, uint8 x3 2 (PNG 3, JPEG 2); read as 'unchanged' by default" in out
    assert main(["info", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"]["image"]["kinds"]["uint16 x1"] == 3


def test_info_of_a_general_store_lists_each_image_field(tmp_path):
    samples = [{"image": ramp((5, 4, 5), np.float32, i), "mask": ramp((5, 4), np.uint8, i), "label": i}
               for i in range(3)]
    fastdata.write(samples, tmp_path / "g.lmdb", {"image": Image(), "mask": Image(), "label": Int()}, workers=0,
                   progress=False)
    data = info(str(tmp_path / "g.lmdb"))
    assert data["images"]["image"]["kinds"] == {"float32 x5": 3}
    assert data["images"]["mask"]["kinds"] == {"uint8 x1": 3}
    assert data["image_modes"] == {"image": "RGB", "mask": "unchanged"}


def test_info_of_an_older_store_says_not_recorded(tmp_path, capsys):
    store = shutil.copytree(DATA_DIR / "v1-lmdb", tmp_path / "old.lmdb")
    data = info(str(store))
    assert data["images"] is None or data["images"]["image"]["kinds"] == {"not recorded": data["num_samples"]}
    assert main(["info", str(store)]) == 0
    assert "not recorded" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_verify_decode_checks_recorded_dtype_and_channels(tmp_path, tree, backend):
    dst = str(tmp_path / ("s.lmdb" if backend == "lmdb" else "s.h5"))
    fastdata.convert(tree, dst, workers=0, progress=False)
    report = verify(dst, decode=True)
    assert report.ok and report.decoded == 5
    shard = H.first_shard(dst)
    channels = H.index_array(backend, shard, "channels", "<u2").copy()
    channels[0] = 3  # record 0 is a one-channel 16-bit PNG
    H.set_index_arrays(dst, backend, shard, {"channels": channels})
    H.resign(dst)
    assert verify(dst).ok  # without decoding there is nothing to compare
    report = verify(dst, decode=True)
    assert not report.ok
    assert any("record 0" in p and "decodes as uint16 x1 but the index records uint16 x3" in p
               for p in report.problems), report.problems
