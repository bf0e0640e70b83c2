"""Hostile or malformed source files: each is rejected with a reason, the
conversion completes, nothing hangs, exhausts memory or executes code.

Covered: decompression bombs (over Pillow's limit, and in the warning band
between the limit and twice it), a truncated JPEG, a GIF named .png and a
PostScript file named .jpg (formats outside the allow-list: Pillow is
restricted, so no Ghostscript ever runs), a 0-byte file, an
unreadable file (real EACCES: the converter runs without CAP_DAC_OVERRIDE), a
broken symlink, a symlink loop (file and directory), a FIFO and a /dev/zero
symlink named .jpg (would block or read forever), a sparse file larger than a
record may be, a file deleted between scan and read, and non-UTF-8 file names
(a valid one is kept under its byte-exact relpath; an invalid one is rejected
and reported under the same bytes).

A PNG named .jpg is *not* hostile: ImageFolder loads it, so it is kept, stored
as PNG, and reported as a warning (not a rejection).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import os
import struct
import subprocess
import sys
import zlib

import pytest
from helpers.backends import SUFFIXES
from helpers.images import make_jpeg
from helpers.stores import store_records
from PIL import Image

import fastdata
from fastdata.format.names import REJECTED_NAME
from fastdata.writer.ingest import MAX_INPUT_BYTES

folder_module = importlib.import_module("fastdata.writer.sources.folder")  # the module, not the function

pytestmark = pytest.mark.timeout(120)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring ``width x height`` pixels, a few dozen bytes on disk."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def _image_bytes(fmt: str, size=(16, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format=fmt)
    return buf.getvalue()


#: relpath (bytes) -> expected substring of the rejection reason
EXPECTED_REJECTIONS = {
    b"a/bomb_error.png": "decompression bomb",
    b"a/bomb_warning.png": "decompression bomb",
    b"a/truncated.jpg": "truncated or corrupt",
    b"a/gif_named.png": "not a recognised image",
    b"a/postscript.jpg": "not a recognised image",
    b"a/zero.jpg": "empty file",
    b"a/broken_link.jpg": "broken symlink",
    b"a/loop_a.jpg": "symlink loop",
    b"a/loop_b.jpg": "symlink loop",
    b"a/fifo.jpg": "not a regular file",
    b"a/dev_zero.jpg": "not a regular file",
    b"a/huge_sparse.jpg": "exceeds the",
    b"b/bad\xff\xfename.jpg": "not a recognised image",
    b"b/vanishes.jpg": "after the scan",
}


@pytest.fixture
def hostile_tree(tmp_path):
    """Returns (src, valid relpaths in scan order, outside file)."""
    src = tmp_path / "src"
    a, b = src / "a", src / "b"
    valid = []
    for i in range(3):
        make_jpeg(a / f"good_{i}.jpg", seed=i)
        make_jpeg(b / f"good_{i}.jpg", seed=10 + i)
    (a / "bomb_error.png").write_bytes(_png_header_only(30_000, 30_000))   # 900 Mpx > 2x the limit
    (a / "bomb_warning.png").write_bytes(_png_header_only(12_000, 10_000))  # 120 Mpx: Pillow only warns
    assert Image.MAX_IMAGE_PIXELS < 120_000_000 < 2 * Image.MAX_IMAGE_PIXELS
    good = (a / "good_0.jpg").read_bytes()
    (a / "truncated.jpg").write_bytes(good[: len(good) * 3 // 5])
    (a / "png_named.jpg").write_bytes(_image_bytes("PNG"))
    (a / "gif_named.png").write_bytes(_image_bytes("GIF"))
    (a / "postscript.jpg").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    (a / "zero.jpg").write_bytes(b"")
    os.symlink("no_such_target.jpg", a / "broken_link.jpg")
    os.symlink("loop_b.jpg", a / "loop_a.jpg")
    os.symlink("loop_a.jpg", a / "loop_b.jpg")
    os.mkfifo(a / "fifo.jpg")
    os.symlink("/dev/zero", a / "dev_zero.jpg")
    with open(a / "huge_sparse.jpg", "wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk used
    # non-UTF-8 names (bytes paths): one valid image, one garbage
    os.makedirs(b, exist_ok=True)
    with open(os.path.join(os.fsencode(b), b"caf\xe9.jpg"), "wb") as fh:
        fh.write((a / "good_1.jpg").read_bytes())
    with open(os.path.join(os.fsencode(b), b"bad\xff\xfename.jpg"), "wb") as fh:
        fh.write(b"\x00garbage" * 50)
    make_jpeg(b / "vanishes.jpg", seed=99)
    # a directory symlink to itself: walked once, reported, no hang
    os.symlink(".", b / "up_loop")
    # a file link escaping the root: followed, as ImageFolder does, stored under the link's path
    outside = tmp_path / "outside.jpg"
    make_jpeg(outside, seed=42)
    os.symlink(outside, b / "outside_link.jpg")
    valid = [b"a/good_0.jpg", b"a/good_1.jpg", b"a/good_2.jpg", b"a/png_named.jpg",
             b"b/caf\xe9.jpg", b"b/good_0.jpg", b"b/good_1.jpg", b"b/good_2.jpg", b"b/outside_link.jpg"]
    return str(src), valid, str(outside)


@pytest.fixture
def delete_after_scan(monkeypatch):
    """Delete ``b/vanishes.jpg`` right after the scan saw it (a file removed mid-run)."""
    real_scan = folder_module.scan

    def scan_then_delete(src):
        result = real_scan(src)
        assert b"b/vanishes.jpg" in result.relpaths
        os.unlink(os.path.join(src, "b", "vanishes.jpg"))
        return result

    monkeypatch.setattr(folder_module, "scan", scan_then_delete)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_hostile_input_is_rejected_with_a_reason_and_the_conversion_completes(
        hostile_tree, delete_after_scan, tmp_path, suffix):
    src, valid, outside = hostile_tree
    dst = str(tmp_path / ("store" + suffix))
    report = fastdata.convert(src, dst, workers=2, progress=False)

    rejected = {os.fsencode(path): reason for path, reason in report.rejected_items}
    assert set(rejected) == set(EXPECTED_REJECTIONS), (
        f"missing: {set(EXPECTED_REJECTIONS) - set(rejected)}; unexpected: {set(rejected) - set(EXPECTED_REJECTIONS)}")
    for path, expected in EXPECTED_REJECTIONS.items():
        assert expected in rejected[path], f"{path!r}: {rejected[path]!r}"
    assert report.images == len(valid) and report.rejected == len(EXPECTED_REJECTIONS)
    assert any("symlink loop" in w and "up_loop" in w for w in report.warnings), report.warnings
    assert any("a/png_named.jpg" in w and "content is PNG" in w for w in report.warnings), report.warnings

    # the valid inputs, in scan order, byte-exact; non-UTF-8 relpaths kept as their bytes
    manifest, records = store_records(dst)
    assert [os.fsencode(r["relpath"]) for r in records] == valid
    for rel, record in zip(valid, records, strict=False):
        source = outside if rel == b"b/outside_link.jpg" else os.path.join(os.fsencode(src), rel)
        with open(source, "rb") as fh:
            assert record["image"] == fh.read(), rel
    assert fastdata.verify(dst).ok

    # the reports name the exact bytes of a non-UTF-8 path (surrogate escapes in JSON, raw bytes in the TSV)
    assert os.fsencode(next(r["path"] for r in manifest["rejected"] if "bad" in r["path"])) == b"b/bad\xff\xfename.jpg"
    with open(os.path.join(dst, REJECTED_NAME), "rb") as fh:
        tsv = fh.read()
    assert b"b/bad\xff\xfename.jpg\tnot a recognised image" in tsv
    assert tsv.count(b"\n") == len(EXPECTED_REJECTIONS) + 1


def test_fifo_named_jpg_does_not_block_the_converter(tmp_path):
    """Focused regression: opening a FIFO for reading blocks until a writer
    appears; the converter must reject it without opening it blocking."""
    src = tmp_path / "src"
    make_jpeg(src / "a" / "ok.jpg")
    os.mkfifo(src / "a" / "pipe.jpg")
    done = subprocess.run([sys.executable, "-m", "fastdata", "convert", str(src), str(tmp_path / "s.lmdb"),
                           "--workers", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "a/pipe.jpg: not a regular file" in done.stdout


def _drop_dac_override() -> None:
    """preexec_fn: remove CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set, so even root (after exec) obeys file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_unreadable_file_is_rejected_with_permission_denied(tmp_path):
    src = tmp_path / "src"
    make_jpeg(src / "a" / "ok.jpg")
    secret = src / "a" / "secret.jpg"
    make_jpeg(secret, seed=3)
    os.chmod(secret, 0)
    try:
        probe = subprocess.run([sys.executable, "-c", f"open({str(secret)!r}, 'rb').read()"],
                               preexec_fn=_drop_dac_override, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here ({err}); as root, chmod 000 does not stop reads")
    if "PermissionError" not in probe.stderr:
        pytest.skip("file permissions are not enforced for this process (root with CAP_DAC_OVERRIDE)")
    done = subprocess.run([sys.executable, "-m", "fastdata", "convert", str(src), str(tmp_path / "s.h5"),
                           "--workers", "2"], preexec_fn=_drop_dac_override, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a/secret.jpg: permission denied" in done.stdout
    assert "wrote 1 images" in done.stdout
