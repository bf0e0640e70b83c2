"""``fastdata info`` on a detection store (converted from COCO) names its categories.

Its manifest's class table is empty (labels are per annotation, not per sample), so ``info``
reads the categories from ``metadata.coco``: ``--json`` gives ``categories`` (id, name,
supercategory) and ``num_categories``, the text says "N categories (detection)" and lists them,
never "0 classes". Control: a classification store still reports its classes and no categories.
"""

from __future__ import annotations

import json

import pytest
from helpers.images import make_jpeg

import fastdata
from fastdata.cli.main import main
from fastdata.synth_coco import make_coco


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("info-coco")
    synth = make_coco(root / "set", 4, seed=1, max_boxes=2, size=(64, 80), workers=1)
    dst = root / "coco.lmdb"
    fastdata.convert_coco(synth.ann_file, synth.image_dir, dst, workers=1, progress=False)
    return dst, json.loads((root / "set" / "annotations.json").read_text())["categories"]


def test_info_names_a_detection_stores_categories(coco, capsys):
    store, categories = coco
    assert main(["info", str(store), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_categories"] == len(categories) >= 10
    assert data["categories"] == [{"id": c["id"], "name": c["name"], "supercategory": c["supercategory"]}
                                  for c in categories]
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    assert f"samples:  4 in {len(categories)} categories (detection)" in out
    assert "0 classes" not in out and "classes:" not in out
    listed = out.split("categories:\n", 1)[1].splitlines()
    first = categories[0]
    assert listed[0].split() == [str(first["id"]), first["name"], f"({first['supercategory']})"]
    assert [line.split()[1] for line in listed[:len(categories)]] == [c["name"] for c in categories]


def test_control_a_classification_store_still_reports_classes(tmp_path, capsys):
    for i, name in enumerate(["cat", "cat", "dog"]):
        make_jpeg(tmp_path / "src" / name / f"{i}.jpg", size=(16, 12), seed=i)
    store = tmp_path / "c.lmdb"
    fastdata.convert(str(tmp_path / "src"), str(store), workers=1, progress=False)
    assert main(["info", str(store), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["categories"] is None and data["num_categories"] == 0 and data["num_classes"] == 2
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    assert "samples:  3 in 2 classes" in out and "categories" not in out and "classes:" in out
