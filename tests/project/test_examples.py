"""The examples in examples/ run end to end (they need torchvision: CI runs them in its torchvision venv)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.torchvision
def test_detection_example_trains_with_finite_loss(tmp_path):
    pytest.importorskip("torchvision", reason="the detection example needs torchvision (not importable here)")
    summary = tmp_path / "summary.json"
    # a smaller run than the example's defaults: a handful of images and steps, small crops
    cmd = [sys.executable, str(ROOT / "examples" / "detection.py"), "--images", "12", "--image-size", "96", "128",
           "--steps", "3", "--batch-size", "2", "--size", "128", "--workers", "2",
           "--workdir", str(tmp_path / "work"), "--json", str(summary)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert result["images"] == 6  # 3 steps of 2 images, each batch from the store through the loader
    assert all(math.isfinite(loss) and loss > 0 for loss in result["losses"])
    assert "converted 12 images" in proc.stdout and "trained 3 steps" in proc.stdout


def test_medical_images_example_reads_16_bit_and_bands_unchanged(tmp_path):
    pytest.importorskip("tifffile", reason="the medical-images example needs tifffile and imagecodecs")
    pytest.importorskip("imagecodecs", reason="the medical-images example needs tifffile and imagecodecs")
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "examples" / "medical_images.py"), "--ct", "8", "--bands", "8",
           "--batch-size", "4", "--batches", "2", "--workers", "2", "--json", str(summary)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    ct, bands = result["ct"], result["bands"]
    assert (ct["dtype"], ct["shape"], ct["bit_exact"]) == ("uint16", [512, 512], True)
    assert (bands["dtype"], bands["shape"], bands["bit_exact"]) == ("uint16", [256, 256, 4], True)
    # the decode-time crop keeps uint16 and the channels; the loader batches them as (N, C, H, W)
    assert (ct["batch_dtype"], ct["batch_shape"]) == ("torch.uint16", [4, 1, 224, 224])
    assert (bands["batch_dtype"], bands["batch_shape"]) == ("torch.uint16", [4, 4, 128, 128])
    assert ct["images"] == bands["images"] == 8
    for part in (ct, bands):
        assert all(math.isfinite(v) for v in (part["normalized_mean"], part["normalized_std"]))
        assert 0.5 < part["normalized_std"] < 2.0  # normalized with the data's own range, not 0-255


def test_ct_patches_example_trains_on_patches_and_stitches_grid_inference(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "examples" / "ct_patches.py"), "--volumes", "3", "--shape", "64", "80", "72",
           "--batches", "2", "--json", str(summary)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["scans"] == 3 and result["batches"] == 2 and result["batch_shape"] == [8, 32, 32, 32]
    assert result["stored_bytes"] < result["raw_bytes"]  # compressed chunks
    # half the patches are centred on labelled voxels: more of their voxels are labelled than of the scans'
    assert result["labelled_fraction"] > 1.5 * result["scans_labelled_fraction"]
    assert result["stitched_equal"] and result["tiles"] > 3
    assert "leaked semaphore" not in proc.stderr


def test_grow_and_mix_example_appends_merges_splits_and_resumes_a_mix(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "examples" / "grow_and_mix.py"), "--per-class", "4", "--workers", "0",
           "--json", str(summary)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["appended"] == [8, 28]  # week 1 (2 classes x 4), then weeks 2 and 3 (+8, +12)
    assert sum(result["split"]) == 28 + 8 and result["split"][1] == 4
    assert result["mix"]["real"] == 45 and result["mix"]["synthetic"] == 19 and result["mix"]["resumed_batches"] == 5
    assert "the other 5 batches equal the uninterrupted epoch's" in proc.stdout


#: the page of the documentation that shows ``fastdata.write`` of Python samples
SOURCES_GUIDE = ROOT / "docs" / "guides" / "sources.md"


def _doc_block(containing: str) -> str:
    """The sources guide's python code block that contains ``containing``, as written."""
    from helpers.docblocks import blocks_of

    found = [b.code for b in blocks_of(SOURCES_GUIDE) if b.language == "python" and containing in b.code]
    assert len(found) == 1, f"{len(found)} python blocks of {SOURCES_GUIDE.name} contain {containing!r}"
    return found[0]


def _run_script(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# a thread besides the main one, as numpy's BLAS pool makes in most processes: the conversion pool
# then starts its workers through the forkserver, whose children would run the script again
_THREADED = ("import threading, time\n"
             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
             "print('the script ran')\n")


def test_the_documented_write_snippet_runs_as_a_script_without_the_main_guard(tmp_path):
    """A conversion of Python samples at a script's top level, with worker processes, as the sources guide
    shows it (``fastdata.convert(Samples(...), ..., WriteOptions(workers=2))``):
    the workers do not run the script again (it ran once), and the store holds the sample."""
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "imgs" / "0001.jpg")
    snippet = _doc_block('"det.lmdb", fastdata.WriteOptions(workers=2)')
    assert "__main__" not in snippet and "workers=2" in snippet
    proc = _run_script(tmp_path, "snippet.py", _THREADED + snippet + "\nprint('samples', len(ds), ds[0]['caption'])\n")
    assert proc.stdout.count("the script ran") == 1
    assert "samples 1 a dog on a sofa" in proc.stdout


def test_samples_of_classes_the_script_defines_still_convert(tmp_path):
    """The other side: a map-style dataset class defined in the script reaches workers that import
    the script (under the guard, as any multiprocessing code), and an iterable's samples holding an
    instance of a script class are encoded in the converting process, never sent to workers that
    skipped the script (they could not unpickle them)."""
    import fastdata

    source = _THREADED + '''
import numpy as np
import fastdata


class Squares:  # map-style, as a torch Dataset (torch is not imported: a faster test)
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"value": np.full((2,), i * i, np.int64), "label": i % 2}


class Caption(str):
    pass


if __name__ == "__main__":
    fastdata.write(Squares(), "squares.lmdb", workers=2)
    fastdata.write(({"caption": Caption(f"c{i}"), "label": i} for i in range(5)), "captions.lmdb", workers=2)
'''
    _run_script(tmp_path, "guarded.py", source)
    squares = fastdata.open_dataset(tmp_path / "squares.lmdb", output="numpy")
    assert [int(squares[i]["value"][0]) for i in range(len(squares))] == [0, 1, 4, 9, 16, 25]
    captions = fastdata.open_dataset(tmp_path / "captions.lmdb")
    assert [captions[i]["caption"] for i in range(len(captions))] == ["c0", "c1", "c2", "c3", "c4"]
