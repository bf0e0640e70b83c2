"""``--resume`` reuses the options the interrupted run recorded, and a real
mismatch names each differing option (was/now) and what changed in the source."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from helpers.images import make_jpeg, make_tree

import fastdata
from fastdata.cli.main import main
from fastdata.errors import ResumeMismatchError
from fastdata.format.names import STAGING_DIR

session_module = importlib.import_module("fastdata.writer.session")  # the module, not the function fastdata re-exports

SHARD = "30kB"


@pytest.fixture
def src(tmp_path) -> Path:
    # ~2.5 kB per image: 40 images make ~4 shards of 30 kB
    return Path(make_tree(tmp_path / "src", {"a": 20, "b": 20}, size=(64, 48), seed=3))


def interrupt_after_first_shard(monkeypatch, src, dst, **options) -> None:
    """Convert, with a Ctrl-C once the first shard is finished: the state a user's Ctrl-C leaves
    (staging with one finished shard, no manifest)."""
    real = session_module.run_shards

    def first_shard_then_ctrl_c(**kwargs):
        real(**dict(kwargs, plans=kwargs["plans"][:1]))
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(session_module, "run_shards", first_shard_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            fastdata.convert(str(src), str(dst), workers=1, progress=False, **options)
    assert (dst / STAGING_DIR).is_dir() and not (dst / "manifest.json").exists()


def shard_layout(dst: Path) -> list:
    manifest = json.loads((dst / "manifest.json").read_text())
    return [(s["name"], s["count"], s["xxh"]) for s in manifest["shards"]], manifest


def test_resume_without_options_reuses_the_recorded_ones(src, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out.lmdb"
    interrupt_after_first_shard(monkeypatch, src, dst, shard_size=SHARD)
    # only SRC DST --resume: the recorded 30 kB shard size is reused (the default is 1 GiB)
    assert main(["convert", str(src), str(dst), "--resume", "--workers", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "1 kept from the interrupted run" in out
    assert "shard size 30 kB (30,000 bytes)" in out and "recorded by the interrupted run" in out
    clean = tmp_path / "clean.lmdb"
    fastdata.convert(str(src), str(clean), workers=1, shard_size=SHARD, progress=False)
    (resumed, manifest), (expected, _) = shard_layout(dst), shard_layout(clean)
    assert resumed == expected and len(expected) >= 3
    assert manifest["options"]["shard_size"] == 30_000
    assert fastdata.verify(str(dst)).ok


def test_resume_names_each_differing_option(src, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out.lmdb"
    interrupt_after_first_shard(monkeypatch, src, dst, shard_size=SHARD)
    with pytest.raises(ResumeMismatchError) as err:
        fastdata.convert(str(src), str(dst), resume=True, shard_size="40kB", strict=True, format="hdf5",
                         workers=1, progress=False)
    message = str(err.value)
    assert "shard size: was 30 kB (30,000 bytes), now 40 kB (40,000 bytes)" in message
    assert "strict: was off, now on" in message
    assert "format: was lmdb, now hdf5" in message
    assert "added" not in message and "removed" not in message  # the source did not change
    assert "overwrite=True" in message and "--overwrite" not in message
    # the CLI says the same in one line
    assert main(["convert", str(src), str(dst), "--resume", "--shard-size", "40kB", "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and "shard size: was 30 kB" in line and "--overwrite" in line
    # the same size spelt differently is not a difference
    report = fastdata.convert(str(src), str(dst), resume=True, shard_size=30_000, workers=1, progress=False)
    assert report.resumed_shards == 1 and fastdata.verify(str(dst)).ok


def test_resume_names_the_source_changes(src, tmp_path, monkeypatch):
    dst = tmp_path / "out.lmdb"
    interrupt_after_first_shard(monkeypatch, src, dst, shard_size=SHARD)
    for i in range(3):
        make_jpeg(src / "b" / f"new_{i}.jpg", size=(64, 48), seed=100 + i)
    (src / "a" / "a_000.jpg").unlink()
    (src / "a" / "a_001.jpg").unlink()
    make_jpeg(src / "a" / "a_002.jpg", size=(200, 150), seed=7)  # same name, other size
    with pytest.raises(ResumeMismatchError) as err:
        fastdata.convert(str(src), str(dst), resume=True, workers=1, progress=False)
    message = str(err.value)
    assert "3 files added under b/" in message
    assert "2 files removed under a/" in message
    assert "1 file changed size (e.g. a/a_002.jpg)" in message
    assert "shard size:" not in message  # no option was given, so none differs


def test_resume_of_a_complete_store_reuses_its_options(src, tmp_path):
    dst = tmp_path / "out.h5"
    fastdata.convert(str(src), str(dst), workers=1, shard_size=SHARD, progress=False)
    report = fastdata.convert(str(src), str(dst), resume=True, workers=1, progress=False)
    assert report.already_complete
    with pytest.raises(ResumeMismatchError, match=r"storage: was original, now raw 8x8.*overwrite=True"):
        fastdata.convert(str(src), str(dst), resume=True, raw="8x8", workers=1, progress=False)


def test_recorded_storage_mode_is_reused(src, tmp_path, monkeypatch):
    dst = tmp_path / "out.lmdb"
    interrupt_after_first_shard(monkeypatch, src, dst, shard_size="2kB", raw="16x16")
    report = fastdata.convert(str(src), str(dst), resume=True, workers=1, progress=False)
    assert report.resumed_shards == 1 and "raw 16x16" in report.options
    _, manifest = shard_layout(dst)
    assert manifest["storage"]["mode"] == "raw" and manifest["storage"]["raw_shape"] == [16, 16]
    with pytest.raises(ResumeMismatchError, match=r"storage: was raw 16x16, now re-encode above 32 px"):
        fastdata.convert(str(src), str(dst), resume=True, max_side=32, workers=1, progress=False)
