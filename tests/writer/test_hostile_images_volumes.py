"""Hostile input files (issue 36, items 1 and 7): a few KB that a codec's own header, or a gzip stream,
would expand to gigabytes. Each attack runs in a forked child under ``RLIMIT_AS`` (the child's size at
the fork + 1 GiB) and a timeout, and must end in a refusal that names the file and says why (never a
MemoryError, a signal or a hang); each has its control, the same file without the attack, that converts
(and reads).

* A tiled JPEG TIFF whose tile's JPEG frame header claims 60000x60000 (10.8 GB of RGB) though the TIFF
  says 16x16 tiles: refused before the tile is decoded, at conversion (ImageFolder, and ``--chunks``
  tile by tile), at read (``image_mode="unchanged"``) and by ``verify --decode``.
* A ``.nii.gz`` whose header claims 4x4x4 voxels but whose stream decompresses to 2 GB (through a header
  extension nibabel would read whole, or after the voxels), and one whose header claims 16 GiB of voxels.

See docs/SECURITY.md, "Sources: untrusted input files".
"""

from __future__ import annotations

import gzip
import io
import os
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tifffile")
pytest.importorskip("imagecodecs")

import tifffile  # noqa: E402

import fastdata  # noqa: E402
from helpers.bounded import run_bounded  # noqa: E402

#: address space a child may grow by: far below what any attack here would allocate unbounded
GROWTH = 1 << 30
TIMEOUT = 20.0
MODES = ["control", "attack"]


# -- a bounded child ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reader_imported():
    """What the children run, imported before they are forked (a library mapped under the child's
    RLIMIT_AS could fail to map: torch alone is more than GROWTH)."""
    pytest.importorskip("torch")
    import fastdata.reader.open  # noqa: F401
    import fastdata.tools.verify  # noqa: F401
    import fastdata.writer.api  # noqa: F401

    fastdata.open_dataset  # noqa: B018 - resolve the lazy names
    fastdata.convert  # noqa: B018


def bounded(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)`` (returning a dict with ``outcome``) in a forked child under ``RLIMIT_AS`` =
    its size + GROWTH, killed after TIMEOUT seconds (:func:`helpers.bounded.run_bounded`): its dict,
    or the child's ``typed_error`` / ``untyped_error`` / ``memory`` / ``signal`` / ``timeout``."""
    result = run_bounded(fn, *args, growth=GROWTH, timeout=TIMEOUT, **kwargs)
    return result["value"] if result["outcome"] == "ok" else result


def convert_op(src: str, dst: str, **kwargs) -> dict:
    report = fastdata.convert(src, dst, workers=0, progress=False, **kwargs)
    return {"outcome": "ok", "written": report.images,
            "rejected": [[os.fsdecode(p) if isinstance(p, bytes) else str(p), str(why)]
                         for p, why in report.rejected_items]}


def read_op(store: str) -> dict:
    ds = fastdata.open_dataset(store, image_mode="unchanged", output="numpy")
    shapes = [list(np.asarray(ds[i][0]).shape) for i in range(len(ds))]
    return {"outcome": "ok", "shapes": shapes}


def verify_op(store: str) -> dict:
    report = fastdata.verify(store, decode=True)
    return {"outcome": "ok" if report.ok else "damaged", "summary": report.summary()}


def converted(result: dict, rejected: str | None, *words: str) -> None:
    """A conversion that went on: nothing rejected (control), or exactly the file ``rejected``, its reason
    holding ``words``."""
    assert result["outcome"] == "ok", result
    if rejected is None:
        assert result["rejected"] == [], result
        return
    assert [Path(p).name for p, _ in result["rejected"]] == [rejected], result
    reason = result["rejected"][0][1]
    assert "MemoryError" not in reason and all(w in reason for w in words), reason


# -- TIFF: a JPEG tile whose own header claims 60000x60000 -----------------------------------------------------

def jpeg_tiff(size=(32, 32), tile=(16, 16), seed=0) -> bytes:
    """A tiled, JPEG-compressed RGB TIFF (each tile a full JPEG stream)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    tifffile.imwrite(buf, pixels, tile=tile, compression="jpeg", photometric="rgb", metadata=None)
    return buf.getvalue()


def patch_sof(data: bytes, height: int = 60000, width: int = 60000) -> bytes:
    """``data`` with every tile's JPEG frame header (SOF0/1/2) claiming ``height`` x ``width``: the TIFF's
    own tags (image and tile size) unchanged, the file's length unchanged."""
    out = bytearray(data)
    with tifffile.TiffFile(io.BytesIO(data)) as tif:
        page = tif.pages.first
        segments = list(zip(page.dataoffsets, page.databytecounts, strict=True))
    for offset, count in segments:
        pos = offset + 2
        while pos < offset + count:
            assert out[pos] == 0xFF
            marker, length = out[pos + 1], struct.unpack(">H", out[pos + 2:pos + 4])[0]
            if marker in (0xC0, 0xC1, 0xC2):
                out[pos + 5:pos + 9] = struct.pack(">HH", height, width)
                break
            pos += 2 + length
        else:
            raise AssertionError("no SOF marker in a tile")
    return bytes(out)


def test_the_crafted_tiff_is_small_and_only_its_jpeg_header_lies():
    sound = jpeg_tiff()
    bomb = patch_sof(sound)
    assert len(bomb) == len(sound) < 16_000
    with tifffile.TiffFile(io.BytesIO(bomb)) as tif:
        assert tif.pages.first.shape == (32, 32, 3) and tif.pages.first.chunks == (16, 16, 3)


@pytest.fixture
def tiff_tree(tmp_path):
    def make(mode: str) -> Path:
        root = tmp_path / f"tiffs-{mode}"
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
        (root / "a" / "good.tif").write_bytes(jpeg_tiff(seed=1))
        sound = jpeg_tiff(seed=2)
        (root / "b" / "x.tif").write_bytes(patch_sof(sound) if mode == "attack" else sound)
        return root
    return make


@pytest.mark.parametrize("mode", MODES)
def test_jpeg_tile_bomb_is_rejected_at_conversion(tiff_tree, tmp_path, mode):
    root = tiff_tree(mode)
    result = bounded(convert_op, str(root), str(tmp_path / "s.lmdb"))
    converted(result, "x.tif" if mode == "attack" else None, "decompression bomb", "60000x60000")
    assert result["written"] == (1 if mode == "attack" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_jpeg_tile_bomb_is_rejected_tile_by_tile(tiff_tree, tmp_path, mode):
    """``--chunks``: the TIFF read tile by tile (fastdata.writer.sources.volumes.tiff)."""
    root = tiff_tree(mode)
    result = bounded(convert_op, str(root), str(tmp_path / "c.lmdb"), chunks="16,16")
    converted(result, "x.tif" if mode == "attack" else None, "decompression bomb", "60000x60000")


@pytest.mark.parametrize("mode", MODES)
def test_jpeg_tile_bomb_inside_a_store_is_a_typed_error_at_read_and_verify(reader_imported, tiff_tree, tmp_path, mode):
    """The bomb put in a store (record re-signed, index agreeing): ``image_mode="unchanged"`` reads raise
    CorruptRecordError naming the store, ``verify --decode`` reports the record."""
    from helpers import hostile as H

    from fastdata.format.record import decode_record, encode_record

    root = tiff_tree("control")
    store = str(tmp_path / "v.lmdb")
    fastdata.convert(str(root), store, workers=0, progress=False)
    shard = H.first_shard(store)
    for i in range(2):
        rec = decode_record(H.stored_item("lmdb", shard, i))
        if rec.relpath.endswith(b"x.tif"):
            break
    assert rec.image == (root / "b" / "x.tif").read_bytes()  # the file is stored as it is
    img = patch_sof(rec.image) if mode == "attack" else rec.image
    data = encode_record(img, label=rec.label, width=rec.width, height=rec.height, fmt=rec.fmt, relpath=rec.relpath)
    H.replace_item(store, "lmdb", shard, i, data, checksummed=img)
    H.resign(store)

    read = bounded(read_op, store)
    checked = bounded(verify_op, store)
    if mode == "control":
        assert read == {"outcome": "ok", "shapes": [[32, 32, 3], [32, 32, 3]]}, read
        assert checked["outcome"] == "ok", checked
        return
    assert read["outcome"] == "typed_error" and read["type"] == "CorruptRecordError", read
    assert store in read["message"] and "decompression bomb" in read["message"], read
    assert "MemoryError" not in read["message"], read
    assert checked["outcome"] == "damaged" and "decompression bomb" in checked["summary"], checked


def test_tile_codec_headers_are_read_for_every_image_codec():
    """The other image codecs tifffile hands a tile to (sizes from their own headers) decode as before;
    the tile check passes them; a JPEG tile claiming one row more than its tile is refused."""
    from fastdata.common.imageio import ImageDecodeError, decode_image

    pixels = np.random.default_rng(3).integers(0, 255, (40, 48, 3), dtype=np.uint8)
    for compression in ("jpeg", "jpeg2000", "png", "webp"):
        buf = io.BytesIO()
        tifffile.imwrite(buf, pixels, tile=(16, 16), compression=compression, photometric="rgb", metadata=None)
        assert decode_image(buf.getvalue(), "unchanged").shape == (40, 48, 3), compression
    buf = io.BytesIO()
    tifffile.imwrite(buf, pixels, rowsperstrip=16, compression="jpeg", photometric="rgb", metadata=None)
    assert decode_image(buf.getvalue(), "unchanged").shape == (40, 48, 3)
    with pytest.raises(ImageDecodeError, match="decompression bomb.*16x17"):
        decode_image(patch_sof(jpeg_tiff(), 17, 16), "unchanged")


# -- NIfTI: a .nii.gz that decompresses to far more than its header declares -------------------------------

ZEROS_MEMBER = gzip.compress(bytes(64 << 20), compresslevel=9)  # 64 MiB of zeros in ~64 KB


def nifti_bytes(shape=(4, 4, 4), *, extension: int | None = None, claim: tuple[int, int, int] | None = None) -> bytes:
    """An uncompressed single-file NIfTI-1 of int16 ``shape`` (values 0..n-1). ``extension``: the header's
    extension flag set and one extension of that declared size (esize) right after the header, the voxel
    offset moved past 16 bytes of extension. ``claim``: the header's dims replaced by these (the voxels
    left as they are)."""
    import nibabel as nib

    data = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    img = nib.Nifti1Image(data, np.eye(4), dtype=np.int16)
    raw = bytearray(img.to_bytes())
    if claim is not None:
        raw[40:48] = struct.pack("<4h", 3, *claim)
    if extension is None:
        return bytes(raw)
    header = bytearray(raw[:348])
    header[108:112] = struct.pack("<f", 368.0)  # vox_offset: header, flag, one 16-byte extension
    return bytes(header) + b"\x01\x00\x00\x00" + struct.pack("<ii", extension, 0) + bytes(8) + bytes(raw[352:])


def gz(data: bytes, zero_members: int = 0) -> bytes:
    """``data`` gzipped, followed by ``zero_members`` gzip members of 64 MiB of zeros (one stream to gzip
    readers: 32 members are 2 GiB from 2 MB)."""
    return gzip.compress(data, compresslevel=1) + ZEROS_MEMBER * zero_members


@pytest.fixture
def nifti_tree(tmp_path):
    pytest.importorskip("nibabel")

    def make(name: str, bad: bytes) -> Path:
        root = tmp_path / f"nii-{name}"
        root.mkdir()
        (root / "good.nii.gz").write_bytes(gz(nifti_bytes((6, 5, 4))))
        (root / name).write_bytes(bad)
        return root
    return make


#: attack -> (file name, its bytes, words the rejection must hold)
NIFTI_CASES = {
    # nibabel reads an extension of esize 7 with read(7 - 8), read(-1): the whole 2 GB stream
    "extension_reads_whole_stream": ("bad.nii.gz", lambda: gz(nifti_bytes(extension=7), 32), "extension of 7 bytes"),
    # an extension declaring 2 GB: nibabel reads it whole
    "extension_declares_2gb": ("bad.nii.gz", lambda: gz(nifti_bytes(extension=(2 << 30) - 16), 32),
                               "extension of 2,147,483,632 bytes"),
    # small dims, then 2 GB more of stream after the voxels (never decompressed: refused after 1 MiB of it)
    "stream_beyond_the_voxels": ("bad.nii.gz", lambda: gz(nifti_bytes(), 32), "holds more than the"),
    # header claims 2048^3 int16 (16 GiB), the stream holds 64 voxels
    "huge_dims": ("bad.nii.gz", lambda: gz(nifti_bytes(claim=(2048, 2048, 2048))), "FASTDATA_MAX_NIFTI_GZ_BYTES"),
    # the same, uncompressed: the file does not hold what the header declares
    "huge_dims_uncompressed": ("bad.nii", lambda: nifti_bytes(claim=(2048, 2048, 2048)), "truncated NIfTI"),
}


def test_nifti_crafts_are_small():
    """The attack files are a few MB at most (each expands to gigabytes, or claims them)."""
    assert len(ZEROS_MEMBER) * 32 < 3 << 20
    assert len(nifti_bytes(claim=(2048, 2048, 2048))) == 352 + 128
    with gzip.open(io.BytesIO(gz(nifti_bytes(extension=16)))) as fh:  # a sound extension: the control below
        assert len(fh.read()) == 368 + 128


@pytest.mark.parametrize("case", list(NIFTI_CASES))
def test_nifti_bombs_are_rejected_naming_the_file(nifti_tree, tmp_path, case):
    name, make, words = NIFTI_CASES[case]
    root = nifti_tree(name, make())
    result = bounded(convert_op, str(root), str(tmp_path / "n.lmdb"))
    converted(result, name, words)
    assert result["written"] == 1


@pytest.mark.parametrize("name,data", [("ok.nii.gz", lambda: gz(nifti_bytes())),
                                       ("ext.nii.gz", lambda: gz(nifti_bytes(extension=16))),
                                       ("ok.nii", lambda: nifti_bytes())])
def test_nifti_controls_convert(nifti_tree, tmp_path, name, data):
    """The same files without their attack (a sound 16-byte extension included) convert."""
    root = nifti_tree(name, data())
    result = bounded(convert_op, str(root), str(tmp_path / "n.lmdb"))
    converted(result, None)
    assert result["written"] == 2


def test_the_gzip_limit_is_the_users_to_raise(nifti_tree, tmp_path, monkeypatch):
    """FASTDATA_MAX_NIFTI_GZ_BYTES below a sound volume's size refuses it, naming the variable."""
    from fastdata.writer.sources.volumes import nifti

    monkeypatch.setenv(nifti.GZIP_LIMIT_ENV, "1000")
    assert nifti.max_gzip_bytes() == 1000
    root = nifti_tree("ok.nii.gz", gz(nifti_bytes((10, 10, 10))))
    result = bounded(convert_op, str(root), str(tmp_path / "n.lmdb"))
    converted(result, "ok.nii.gz", "FASTDATA_MAX_NIFTI_GZ_BYTES")
