"""The converter end to end: round trips, determinism, bad inputs, resume, locking,
map growth and the storage modes. Stores are read back through the shard readers."""

from __future__ import annotations

import ctypes
import io
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers.backends import NAME_SUFFIXES, SUFFIXES
from helpers.images import make_jpeg, make_tree
from helpers.procs import reaped
from helpers.stores import store_records
from PIL import Image

import fastdata
from fastdata.cli.main import main
from fastdata.errors import (
    IncompleteStoreError,
    ResumeMismatchError,
    SourceError,
    StoreExistsError,
    StoreLockedError,
)
from fastdata.format.backends.base import Sample, StorageSpec
from fastdata.format.backends.lmdb.reader import LMDBShardReader
from fastdata.format.backends.lmdb.writer import LMDBShardWriter
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.format.record import checksum
from fastdata.tools.verify import verify
from fastdata.writer.lock import StoreLock
from fastdata.writer.options import choose_backend, storage_spec
from fastdata.writer.plan import plan_shards
from fastdata.writer.sources.folder import scan_folder

BACKENDS = [(name, "out" + suffix) for name, suffix in NAME_SUFFIXES]


def _scan_order(root) -> list[str]:
    return [os.fsdecode(r) for r in scan_folder(str(root)).relpaths]


def _odd_images(root: Path) -> None:
    """Valid images the converter must keep unchanged (decoded to RGB only at read time)."""
    make_jpeg(root / "odd" / "cmyk.jpg", size=(30, 20), seed=1, mode="CMYK")
    make_jpeg(root / "odd" / "gray.jpg", size=(30, 20), seed=2, mode="L")
    make_jpeg(root / "odd" / "prog444.jpg", size=(33, 17), seed=3, progressive=True, subsampling=0)
    rgb = Image.open(make_jpeg(root / "odd" / "tmp_src.jpg", size=(24, 24), seed=4)).convert("RGB")
    os.unlink(root / "odd" / "tmp_src.jpg")
    rgb.convert("P").save(root / "odd" / "palette.png")
    rgb.convert("RGBA").save(root / "odd" / "rgba.PNG")


def _shard_layout(manifest: dict) -> list[tuple]:
    return [(s["name"], s["first_index"], s["count"], s["image_bytes"]) for s in manifest["shards"]]


def _comparable(records: list[dict]) -> list[tuple]:
    return [(r["relpath"], r["label"], r["width"], r["height"], r["fmt"], r["shard"], r["local"], r["image"])
            for r in records]


# --- round trip ---

@pytest.mark.parametrize("backend, name", BACKENDS)
def test_round_trip_is_bit_exact_in_original_mode(small_tree, tmp_path, backend, name):
    root = Path(small_tree)
    _odd_images(root)
    dst = tmp_path / name
    report = fastdata.convert(str(root), str(dst), workers=2, shard_size="9KB", progress=False)
    manifest, records = store_records(dst)

    expected = _scan_order(root)
    assert [r["relpath"] for r in records] == expected
    assert report.images == len(expected) == manifest["num_samples"] and report.rejected == 0
    assert len(manifest["shards"]) > 2  # rotation happened: first_index arithmetic is exercised
    assert manifest["backend"] == backend and manifest["storage"]["mode"] == "original"
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert manifest["classes"] == classes
    for r in records:
        src = root / r["relpath"]
        assert r["image"] == src.read_bytes(), r["relpath"]
        assert r["label"] == classes.index(r["relpath"].split("/")[0])
        with Image.open(src) as im:
            assert (r["width"], r["height"]) == im.size
            assert r["fmt"] == im.format
    assert manifest["class_counts"] == [sum(r["label"] == i for r in records) for i in range(len(classes))]
    assert report.input_bytes == sum((root / p).stat().st_size for p in expected)
    assert report.output_bytes == sum(s["bytes"] for s in manifest["shards"])
    assert verify(str(dst)).ok
    assert not (dst / STAGING_DIR).exists()
    assert (dst / "rejected.tsv").read_text() == "path\treason\n"


def test_csv_list_input(tmp_path):
    imgs = tmp_path / "flat"
    paths = [make_jpeg(imgs / f"{i}.jpg", size=(20, 20), seed=i) for i in range(5)]
    lst = imgs / "list.csv"
    labels = ["b", "a", "b", "c", "a"]
    lst.write_text("path,label\n" + "".join(f"{i}.jpg,{lab}\n" for i, lab in enumerate(labels))
                   + "gone.jpg,c\n")
    dst = tmp_path / "list.lmdb"
    report = fastdata.convert(lst, dst, workers=1, progress=False)  # os.PathLike accepted
    manifest, records = store_records(dst)
    assert manifest["classes"] == ["a", "b", "c"]
    assert [r["label"] for r in records] == [1, 0, 1, 2, 0]
    assert [r["image"] for r in records] == [Path(p).read_bytes() for p in paths]
    assert report.rejected_items == [("gone.jpg", "file not found (a wrong path in the list, "
                                                  "or deleted or moved after the scan)")]


# --- determinism ---

@pytest.mark.parametrize("backend, name", BACKENDS)
def test_same_records_and_shards_for_1_and_2_workers(tmp_path, backend, name):
    root = make_tree(tmp_path / "src", {"a": 14, "b": 9, "c": 13}, size=(40, 30), seed=3)
    dsts = []
    for workers in (1, 2):
        dst = tmp_path / f"w{workers}" / name
        # chunk_size=2: many small tasks, so the 2 workers finish them out of order
        fastdata.convert(root, str(dst), workers=workers, shard_size="11KB", chunk_size=2, progress=False)
        dsts.append(dst)
    (m1, r1), (m2, r2) = (store_records(d) for d in dsts)
    assert _comparable(r1) == _comparable(r2)
    assert _shard_layout(m1) == _shard_layout(m2) and len(m1["shards"]) > 2
    assert m1["options"]["fingerprint"] == m2["options"]["fingerprint"]
    assert [r["relpath"] for r in r1] == _scan_order(root)


def test_shard_plan_is_greedy_and_independent_of_workers():
    sizes = np.array([5, 5, 5, 20, 1, 1, 9, 0])
    plans = [(p.start, p.stop) for p in plan_shards(sizes, 10)]
    assert plans == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 8)]
    assert [(p.start, p.stop) for p in plan_shards(np.array([], dtype=np.int64), 10)] == [(0, 0)]


# --- bad inputs ---

def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _write_bad_inputs(cls_dir: Path) -> dict[str, str]:
    """name -> expected substring of the rejection reason. Also writes a PNG named
    .jpg and a JPEG named .png, which ImageFolder loads: kept, with a warning."""
    cls_dir.mkdir(parents=True, exist_ok=True)
    good = Path(make_jpeg(cls_dir / "tmp_good.jpg", size=(64, 48), seed=9)).read_bytes()
    os.unlink(cls_dir / "tmp_good.jpg")
    limit = Image.MAX_IMAGE_PIXELS
    (cls_dir / "zero.jpg").write_bytes(b"")
    (cls_dir / "truncated.jpg").write_bytes(good[: len(good) * 3 // 5])
    (cls_dir / "garbage.jpg").write_bytes(b"GARBAGE" + np.random.default_rng(1).bytes(3000))
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PNG")
    (cls_dir / "png_named.jpg").write_bytes(buf.getvalue())
    (cls_dir / "jpeg_named.png").write_bytes(good)
    side = int((2.5 * limit) ** 0.5) + 1
    (cls_dir / "bomb.png").write_bytes(_png_header_only(side, side))  # > 2x limit: Pillow raises
    side = int((1.5 * limit) ** 0.5) + 1
    (cls_dir / "bomb_warning.png").write_bytes(_png_header_only(side, side))  # 1x-2x: Pillow only warns
    os.symlink(cls_dir / "nowhere.jpg", cls_dir / "broken_link.jpg")
    return {
        "zero.jpg": "empty file",
        "truncated.jpg": "truncated",
        "garbage.jpg": "not a recognised image",
        "bomb.png": "decompression bomb",
        "bomb_warning.png": "decompression bomb",
        "broken_link.jpg": "broken symlink",
    }


@pytest.fixture
def tree_with_bad_inputs(tmp_path):
    root = make_tree(tmp_path / "src", {"good": 4, "mixed": 3}, size=(32, 24))
    expected = {f"mixed/{k}": v for k, v in _write_bad_inputs(Path(root) / "mixed").items()}
    return root, expected


@pytest.mark.parametrize("backend, name", BACKENDS)
def test_bad_inputs_are_skipped_and_reported(tree_with_bad_inputs, tmp_path, backend, name, capsys):
    root, expected = tree_with_bad_inputs
    dst = tmp_path / name
    assert main(["convert", root, str(dst), "--workers", "2", "--quiet"]) == 0
    manifest, records = store_records(dst)
    rejected = {r["path"]: r["reason"] for r in manifest["rejected"]}
    assert set(rejected) == set(expected)
    for path, why in expected.items():
        assert why in rejected[path], (path, rejected[path])
    # nothing lost silently: every scanned input is either stored or rejected
    assert sorted([r["relpath"] for r in records] + list(rejected)) == sorted(_scan_order(root))
    assert len(records) == 9 and manifest["num_samples"] == 9  # 7 good + 2 misnamed but loadable
    assert {w["path"] for w in manifest["warnings"]} == {"mixed/png_named.jpg", "mixed/jpeg_named.png"}
    lines = (dst / "rejected.tsv").read_text().splitlines()
    assert lines[0] == "path\treason"
    assert {tuple(line.split("\t")) for line in lines[1:]} == set(rejected.items())
    assert verify(str(dst), decode=True).ok

    report = fastdata.convert(root, str(tmp_path / "again" / name), workers=1, progress=False)
    assert report.rejected == len(expected) and report.images == 9
    assert f"rejected {len(expected)} input(s)" in report.summary()
    assert sorted(report.rejected_items) == sorted(rejected.items())


@pytest.mark.parametrize("bad", ["zero.jpg", "garbage.jpg", "bomb.png", "broken_link.jpg"])
def test_strict_stops_at_first_bad_input_naming_it(tree_with_bad_inputs, tmp_path, bad, capsys):
    root, expected = tree_with_bad_inputs
    for name in expected:  # leave only the one bad input under test
        if name != f"mixed/{bad}":
            os.unlink(Path(root) / name)
    dst = tmp_path / "strict.lmdb"
    assert main(["convert", root, str(dst), "--strict", "--workers", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert os.path.join(root, "mixed", bad) in err and expected[f"mixed/{bad}"] in err
    assert not (dst / "manifest.json").exists()
    with pytest.raises(IncompleteStoreError):
        read_manifest(str(dst))


def _drop_dac_capabilities() -> None:
    """preexec_fn: remove CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH from the bounding set,
    so a root process (and what it execs) obeys file permission bits."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_file_is_skipped_and_reported(tmp_path):
    root = make_tree(tmp_path / "src", {"a": 3}, size=(16, 16))
    locked = Path(root) / "a" / "locked.jpg"
    make_jpeg(locked, size=(16, 16))
    os.chmod(locked, 0)
    dst = tmp_path / "out.lmdb"
    cmd = [sys.executable, "-m", "fastdata", "convert", root, str(dst), "--workers", "1", "--quiet"]
    preexec = None
    if os.geteuid() == 0:  # root reads mode-000 files; make this run obey permissions
        preexec = _drop_dac_capabilities
        probe = subprocess.run([sys.executable, "-c", f"open({str(locked)!r}, 'rb')"], preexec_fn=preexec,
                               capture_output=True, text=True)
        if "PermissionError" not in probe.stderr:
            pytest.skip("cannot drop root's file-permission override here (no CAP_SETPCAP)")
    run = subprocess.run(cmd, preexec_fn=preexec, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    manifest, records = store_records(dst)
    assert manifest["rejected"] == [{"path": "a/locked.jpg", "reason": "permission denied (cannot read the file)"}]
    assert len(records) == 3


def test_symlink_loop_file_is_rejected(tmp_path):
    root = make_tree(tmp_path / "src", {"a": 2}, size=(16, 16))
    os.symlink("loop_b.jpg", Path(root) / "a" / "loop_a.jpg")
    os.symlink("loop_a.jpg", Path(root) / "a" / "loop_b.jpg")
    report = fastdata.convert(root, str(tmp_path / "o.lmdb"), workers=1, progress=False)
    assert report.images == 2
    assert sorted(report.rejected_items) == [("a/loop_a.jpg", "symlink loop (too many levels of symbolic links)"),
                                             ("a/loop_b.jpg", "symlink loop (too many levels of symbolic links)")]


# --- interrupted conversion, then --resume ---

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastdata", "convert", *args]


def test_sigkill_then_resume_keeps_finished_shards_and_equals_clean_run(tmp_path, capsys):
    # ~900 small images in ~20 shards of ~40 (two worker chunks each): a couple of
    # seconds of converting, during which we SIGKILL the converter as soon as one
    # shard is finished (its sidecar exists) while another is half written (.tmp).
    root = Path(make_tree(tmp_path / "src", {"a": 300, "b": 300, "c": 300}, size=(40, 30), seed=5))
    shard_size = int(scan_folder(str(root)).sizes.mean() * 40)
    dst = tmp_path / "out.lmdb"
    args = [str(root), str(dst), "--workers", "2", "--shard-size", str(shard_size), "--quiet"]
    staging = dst / STAGING_DIR
    proc = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    helpers: list = []
    try:
        with reaped(proc):
            while True:
                sidecars = [p for p in staging.glob("shard-*.json")] if staging.exists() else []
                if sidecars and list(dst.glob("shard-*.lmdb.tmp")):
                    proc.send_signal(signal.SIGSTOP)  # freeze it right here, then look and kill
                    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
                        time.sleep(0.001)  # (the stop is delivered asynchronously)
                    # the .tmp may have been renamed between the look and the stop: look again frozen
                    if list(dst.glob("shard-*.lmdb.tmp")):
                        break
                    proc.send_signal(signal.SIGCONT)
                if proc.poll() is not None:
                    pytest.fail(f"the converter finished (exit {proc.returncode}) before it could be killed "
                                f"mid-run; use a larger dataset for this machine: {proc.communicate()}")
                time.sleep(0.005)
            helpers = psutil.Process(proc.pid).children(recursive=True)
            finished = {p.name[:-len(".json")] for p in staging.glob("shard-*.json")}
            half_written = [p.name for p in dst.glob("shard-*.lmdb.tmp")]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    finally:
        # the killed converter's pool workers, forkserver and resource tracker must
        # notice and exit on their own; anything left is killed here and fails below
        _, orphans = psutil.wait_procs(helpers, timeout=10)
        for p in orphans:
            p.kill()

    assert proc.returncode == -signal.SIGKILL
    assert helpers and not orphans, f"processes outlived the killed converter: {orphans}"
    assert finished and half_written
    assert not (dst / "manifest.json").exists()  # nothing reads as a finished store
    with pytest.raises(IncompleteStoreError, match="resume=True"):
        read_manifest(str(dst))
    kept = {name: ((dst / name).stat().st_ino, (dst / name).stat().st_mtime_ns) for name in finished}
    # without --resume (or --overwrite) the half-done store is an error that says what to do
    with pytest.raises(StoreExistsError, match="resume=True"):
        fastdata.convert(str(root), str(dst), workers=1, shard_size=shard_size)

    # the resume through the CLI in this process: only the killed run needed a process of its own
    capsys.readouterr()
    assert main(["convert", *args[:-1], "--resume"]) == 0
    resumed = capsys.readouterr()
    assert f"{len(finished)} kept from the interrupted run" in resumed.out
    assert "took over the lock" in resumed.err  # the dead converter's lock was detected as stale
    for name, ident in kept.items():
        p = dst / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == ident, f"{name} was rewritten"

    clean = tmp_path / "clean.lmdb"
    fastdata.convert(str(root), str(clean), workers=1, shard_size=shard_size, progress=False)
    (m1, r1), (m2, r2) = store_records(dst), store_records(clean)
    assert len(r1) == 900
    assert _comparable(r1) == _comparable(r2)
    assert _shard_layout(m1) == _shard_layout(m2)
    assert m1["rejected"] == m2["rejected"] == []
    assert verify(str(dst)).ok
    assert not staging.exists() and not list(dst.glob("*.tmp*"))


def test_resume_refuses_a_changed_source(tmp_path):
    root = Path(make_tree(tmp_path / "src", {"a": 3}, size=(16, 16)))
    dst = tmp_path / "o.lmdb"
    fastdata.convert(str(root), str(dst), workers=1, progress=False)
    # resume of a complete store with the same inputs: nothing to do
    assert fastdata.convert(str(root), str(dst), workers=1, resume=True, progress=False).already_complete
    make_jpeg(root / "a" / "new.jpg", size=(16, 16), seed=99)
    with pytest.raises(ResumeMismatchError, match="overwrite=True"):
        fastdata.convert(str(root), str(dst), workers=1, resume=True, progress=False)


# --- existing destination, lock ---

def test_refuses_to_overwrite_then_overwrite_replaces(tmp_path, capsys):
    root = Path(make_tree(tmp_path / "src", {"a": 2, "b": 2}, size=(16, 16)))
    dst = tmp_path / "o.h5"
    assert main(["convert", str(root), str(dst), "--workers", "1", "--quiet"]) == 0
    before = (dst / "manifest.json").read_bytes()
    assert main(["convert", str(root), str(dst), "--workers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already holds a fastdata store" in err and "--overwrite" in err
    assert (dst / "manifest.json").read_bytes() == before  # untouched

    make_jpeg(root / "c" / "c0.jpg", size=(16, 16), seed=5)
    assert main(["convert", str(root), str(dst), "--workers", "1", "--quiet", "--overwrite"]) == 0
    manifest, records = store_records(dst)
    assert manifest["classes"] == ["a", "b", "c"] and len(records) == 5


def test_refuses_a_destination_with_foreign_files(tmp_path):
    root = make_tree(tmp_path / "src", {"a": 1}, size=(16, 16))
    dst = tmp_path / "o.lmdb"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(StoreExistsError, match="precious.txt"):
            fastdata.convert(root, str(dst), workers=1, **kw)
    assert (dst / "precious.txt").read_text() == "keep me"


def test_lock_keeps_a_second_writer_out(tmp_path, capsys):
    root = make_tree(tmp_path / "src", {"a": 2}, size=(16, 16))
    dst = tmp_path / "o.lmdb"
    dst.mkdir()
    with StoreLock(str(dst)):
        with pytest.raises(StoreLockedError, match=str(os.getpid())):
            fastdata.convert(root, str(dst), workers=1)
        assert main(["convert", root, str(dst), "--workers", "1", "--quiet"]) == 2
        assert "being written by another converter" in capsys.readouterr().err
    assert not (dst / "manifest.json").exists()
    # once released, the same command works
    assert fastdata.convert(root, str(dst), workers=1, progress=False).images == 2


# --- LMDB map growth ---

def test_lmdb_map_grows_from_a_tiny_initial_size(tmp_path):
    root = make_tree(tmp_path / "src", {"a": 12, "b": 12}, size=(128, 96))
    total = sum(p.stat().st_size for p in Path(root).rglob("*.jpg"))
    assert total > 2 * 64 * 1024  # must outgrow the initial map at least once
    dst = tmp_path / "o.lmdb"
    report = fastdata.convert(root, str(dst), workers=2, lmdb_map_size="64KiB", progress=False)
    manifest, records = store_records(dst)
    assert report.images == 24 and len(records) == 24
    assert all(r["image"] == (Path(root) / r["relpath"]).read_bytes() for r in records)
    shard = manifest["shards"][0]
    # not inflated far beyond its data (a file sized like the map would be)
    assert shard["bytes"] < 3 * shard["image_bytes"] + (128 << 10)


def test_lmdb_writer_grows_map_and_keeps_every_record(tmp_path):
    path = str(tmp_path / "s.lmdb")
    rng = np.random.default_rng(0)
    samples = [Sample(image=rng.bytes(3000 + i), label=i % 3, width=1, height=1, fmt="JPEG", xxh=0, relpath=b"p")
               for i in range(60)]
    samples = [Sample(**{**s.__dict__, "xxh": checksum(s.image)}) for s in samples]
    writer = LMDBShardWriter(path, StorageSpec(), initial_map_size=32 << 10)
    for i in range(0, 60, 7):
        writer.put(samples[i:i + 7])
    writer.close()
    assert writer.map_growths >= 2  # control: the tiny map really was too small
    with LMDBShardReader(path, StorageSpec()) as reader:
        assert reader.get_many(list(range(60))) == [s.image for s in samples]
        assert reader.read_index().labels.tolist() == [i % 3 for i in range(60)]
    assert os.path.getsize(path) < 2 * sum(len(s.image) for s in samples) + (64 << 10)


# --- storage modes ---

@pytest.mark.parametrize("backend, name", BACKENDS)
def test_max_side_reencodes_only_large_images(tmp_path, backend, name):
    root = tmp_path / "src"
    big = [make_jpeg(root / "a" / f"big{i}.jpg", size=(200 - 40 * i, 120), seed=i) for i in range(3)]
    small = [make_jpeg(root / "a" / f"small{i}.jpg", size=(64, 30 + i), seed=10 + i) for i in range(2)]
    png_big = root / "b" / "big.png"
    png_big.parent.mkdir()
    Image.open(big[0]).save(png_big)
    dst = tmp_path / name
    report = fastdata.convert(str(root), str(dst), max_side=64, quality=80, workers=2, progress=False)
    manifest, records = store_records(dst)
    assert manifest["storage"] == {"mode": "reencode", "max_side": 64, "quality": 80, "raw_shape": None}
    assert report.images == 6
    by_path = {r["relpath"]: r for r in records}
    for p in small:
        assert by_path[os.path.relpath(p, root)]["image"] == Path(p).read_bytes()  # bit-exact
    for p in big + [str(png_big)]:
        r = by_path[os.path.relpath(p, root)]
        src_w, src_h = Image.open(p).size
        with Image.open(io.BytesIO(r["image"])) as im:
            assert im.format == "JPEG" and r["fmt"] == "JPEG"
            assert im.size == (r["width"], r["height"])
            assert max(im.size) == 64
            assert abs(im.size[0] / im.size[1] - src_w / src_h) < 0.05
    assert verify(str(dst), decode=True).ok


@pytest.mark.parametrize("backend, name", BACKENDS)
def test_raw_mode_stores_resized_rgb_pixels(tmp_path, backend, name):
    root = tmp_path / "src"
    paths = [make_jpeg(root / "a" / "x.jpg", size=(50, 30), seed=1),
             make_jpeg(root / "a" / "y.jpg", size=(16, 16), seed=2, mode="L"),
             make_jpeg(root / "b" / "z.jpg", size=(20, 40), seed=3, mode="CMYK")]
    dst = tmp_path / name
    fastdata.convert(str(root), str(dst), raw="16x12", workers=1, progress=False)
    manifest, records = store_records(dst)
    assert manifest["storage"]["mode"] == "raw" and manifest["storage"]["raw_shape"] == [16, 12]
    for p, r in zip(paths, records, strict=False):
        assert r["fmt"] == "RAW" and (r["height"], r["width"]) == (16, 12)
        ref = Image.open(p).convert("RGB")
        if ref.size != (12, 16):
            ref = ref.resize((12, 16), Image.BILINEAR)
        assert r["image"] == ref.tobytes()
    assert verify(str(dst), decode=True).ok


def test_storage_options_are_validated():
    assert storage_spec() == StorageSpec()
    assert storage_spec(raw="8x4").raw_shape == (8, 4) and storage_spec(raw="8").raw_shape == (8, 8)
    for kwargs in ({"raw": "8x", "max_side": None}, {"raw": "0x4"}, {"max_side": 0}, {"quality": 80},
                   {"max_side": 10, "quality": 101}, {"raw": "8x8", "max_side": 10}):
        with pytest.raises(ValueError):
            storage_spec(**kwargs)


def test_backend_choice():
    assert choose_backend("x.lmdb", None) == "lmdb"
    assert choose_backend("x.h5", None) == choose_backend("x.HDF5/", None) == "hdf5"
    assert choose_backend("x.store", "hdf5") == choose_backend("x.lmdb", "h5") == "hdf5"
    with pytest.raises(ValueError, match="pass format="):
        choose_backend("x.store", None)


def test_hidden_class_and_empty_source_are_reported(tmp_path, capsys):
    root = Path(make_tree(tmp_path / "src", {"a": 2}, size=(16, 16)))
    make_jpeg(root / ".cache" / "x.jpg", size=(16, 16))
    report = fastdata.convert(str(root), str(tmp_path / "o.lmdb"), workers=1, progress=False)
    assert any(".cache" in w and "hidden" in w for w in report.warnings)
    assert main(["convert", str(root), str(tmp_path / "o2.lmdb"), "--workers", "1", "--quiet"]) == 0
    assert "warning: hidden folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match="no class folders"):
        fastdata.convert(str(empty), str(tmp_path / "e.lmdb"))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_overwrite_killed_while_clearing_never_leaves_a_published_store_without_its_shards(
        tmp_path, monkeypatch, suffix):
    """--overwrite removes the old manifest first: a run that dies while deleting the old
    shards leaves an unfinished conversion, not a published store missing shards (seen
    as a verify failure in the crash loop). The crash is simulated by failing the
    deletion of the second shard; every listing order is tried by reversing it too."""
    import fastdata.writer.pipeline as pipeline

    src = make_tree(tmp_path / "src", classes={"a": 6, "b": 6}, size=(32, 24))
    for order in (list, lambda names: list(reversed(names))):
        dst = str(tmp_path / f"order{len(list(tmp_path.iterdir()))}{suffix}")
        fastdata.convert(src, dst, shard_size=3000, workers=1, progress=False)
        shards = [n for n in os.listdir(dst) if n.startswith("shard-")]
        assert len(shards) >= 3
        real_entries, real_unlink, deleted = pipeline.store_entries, os.unlink, []

        def dying_unlink(path, *args, deleted=deleted, real_unlink=real_unlink, **kwargs):
            if os.path.basename(path).startswith("shard-"):
                deleted.append(path)
                if len(deleted) == 2:
                    raise OSError("simulated crash while clearing")
            return real_unlink(path, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(pipeline, "store_entries", lambda d, _order=order, _entries=real_entries: _order(_entries(d)))
            m.setattr(pipeline.os, "unlink", dying_unlink)
            with pytest.raises(OSError, match="simulated crash"):
                pipeline.clear_store(dst)
        assert not os.path.exists(os.path.join(dst, "manifest.json")), "a store missing shards is still published"
        assert fastdata.verify(dst).status in ("not_a_store", "unfinished")  # not published, not "damaged"
