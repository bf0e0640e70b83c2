"""``fastdata demo`` end to end at the reduced (tiny) size."""

from __future__ import annotations

import json
import os
import re

import pytest

from fastdata.bench.report import FIELDS
from fastdata.cli.main import main


# nightly (FASTDATA_NIGHTLY=1): the demo with its loading comparison; in CI the demo runs without it
# (test_demo_keep_without_bench) and the comparison's harness runs in tests/bench/test_bench.py
@pytest.mark.slow
def test_demo_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--size", "tiny", "--out", str(out)]) == 0
    text = capsys.readouterr().out

    # every step reported, both stores verified with every image decoded
    for step in ("[1/5] synthesizing", "[2/5] converting to LMDB", "[3/5] converting to HDF5", "[4/5] verifying",
                 "[5/5] loading comparison"):
        assert step in text, step
    assert len(re.findall(r"OK \(1 shard\(s\), 20 records verified, 20 decoded\)", text)) == 2

    # the comparison: folder vs LMDB vs HDF5 x workers 0, 1, all measured
    doc = json.loads((out / "results.json").read_text())
    rows = doc["results"]
    assert sorted((r["kind"], r["workers"]) for r in rows) == [
        ("folder", 0), ("folder", 1), ("hdf5", 0), ("hdf5", 1), ("lmdb", 0), ("lmdb", 1)]
    assert all(r["status"] == "ok" and r["images_per_s"] > 0 and set(FIELDS) <= set(r) for r in rows)
    assert {r["transform"] for r in rows} == {"rrc224"}
    assert "ImageFolder-equivalent" in rows[0]["pipeline"]
    assert "img/s" in text and "best images/s vs the folder baseline" in text
    for name in ("results.csv", "table.txt", "throughput_vs_workers.png", "pss_vs_workers.png",
                 "throughput_vs_memory.png"):
        assert (out / name).stat().st_size > 0, name

    # the synthesized JPEGs are photo-like, not flat colour: tens of KB each
    mean_kib = int(re.search(r"mean (\d+) KiB", text).group(1))
    assert mean_kib >= 20

    # the temporary dataset is removed afterwards
    work = re.search(r"in (\S+)/images", text).group(1)
    assert not os.path.exists(work)


def test_demo_keep_without_bench(tmp_path, capsys):
    import shutil

    assert main(["demo", "--size", "tiny", "--no-bench", "--keep", "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    kept = re.search(r"data kept in (\S+)", text).group(1)
    try:
        assert "[4/4] verifying" in text and "loading comparison" not in text
        assert os.path.exists(os.path.join(kept, "train.lmdb", "manifest.json"))
        assert os.path.exists(os.path.join(kept, "train.h5", "manifest.json"))
        assert not (tmp_path / "o").exists()  # no comparison, nothing written
    finally:
        shutil.rmtree(kept, ignore_errors=True)
