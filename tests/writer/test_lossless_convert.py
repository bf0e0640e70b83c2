"""convert --lossless tiff (storage mode "lossless"): every image but JPEG/WebP/DICOM (and palette
images, whose pixels need their palette) re-encoded as a zstd TIFF, bit-exact, with the sizes
and what was kept in the summary; exclusive with the other storage modes."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import tifffile
from helpers.images import make_jpeg
from helpers.native import ramp, v1_records, write_png16
from PIL import Image

import fastdata
from fastdata.cli.main import main
from fastdata.format.manifest import read_manifest


def pixels(data: bytes) -> np.ndarray:
    """Pixels as stored through independent decoders (tifffile for TIFF, cv2 for the rest,
    colour channels back in RGB order)."""
    if data[:4] in (b"II*\0", b"MM\0*"):
        return tifffile.imread(io.BytesIO(data))
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if arr.ndim == 3:
        arr = cv2.cvtColor(arr, cv2.COLOR_BGRA2RGBA if arr.shape[2] == 4 else cv2.COLOR_BGR2RGB)
    return arr


@pytest.fixture
def tree(tmp_path):
    """A class-folder tree of every kind the lossless mode treats differently."""
    root = tmp_path / "src"
    originals = {}
    for i in range(2):
        originals[f"deep/{i}.png"] = write_png16(root / f"deep/{i}.png", (24, 20), seed=i)
    (root / "eight").mkdir(parents=True)
    rgb = ramp((12, 16, 3), np.uint8, 5)
    Image.fromarray(rgb).save(root / "eight/rgb.png")
    originals["eight/rgb.png"] = rgb
    rgba = ramp((12, 16, 4), np.uint8, 6)
    Image.fromarray(rgba).save(root / "eight/rgba.png")
    originals["eight/rgba.png"] = rgba
    Image.fromarray(ramp((12, 16), np.uint8, 7)).convert("P").save(root / "eight/palette.png")
    make_jpeg(root / "eight/photo.jpg")
    f32 = ramp((10, 8), np.float32, 8)
    tifffile.imwrite(root / "deep/float.tif", f32)  # uncompressed float TIFF (Pillow opens it as mode F)
    originals["deep/float.tif"] = f32
    return root, originals


def test_lossless_reencodes_as_tiff_bit_exact_and_keeps_jpeg_and_palette(tmp_path, tree):
    root, originals = tree
    report = fastdata.convert(root, tmp_path / "out.lmdb", lossless="tiff", workers=0, progress=False)
    assert report.rejected == 0 and report.images == 7
    manifest = read_manifest(str(tmp_path / "out.lmdb"))
    assert manifest["storage"]["mode"] == "lossless"
    records = {r["relpath"]: r for r in v1_records(tmp_path / "out.lmdb")}
    src = {rel: (root / rel).read_bytes() for rel in records}
    for rel, want in originals.items():
        rec = records[rel]
        assert rec["fmt"] == "TIFF", rel
        got = pixels(rec["image"])
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), rel
        assert (rec["dtype"], rec["channels"]) == (want.dtype.name, 1 if want.ndim == 2 else want.shape[2])
    # a JPEG and a palette PNG are kept byte for byte (re-encoding would grow one and lose the other's palette)
    assert records["eight/photo.jpg"]["image"] == src["eight/photo.jpg"]
    assert records["eight/palette.png"]["image"] == src["eight/palette.png"]
    summary = report.summary()
    assert "storage lossless" in summary and "kept as they were: JPEG 1, PNG 1" in summary
    assert "stored image bytes" in summary and "uint16 x1 2" in summary


def test_lossless_resume_refuses_another_storage_mode(tmp_path, tree):
    root, _ = tree
    dst = tmp_path / "out.h5"
    fastdata.convert(root, dst, lossless="tiff", workers=0, progress=False)
    again = fastdata.convert(root, dst, resume=True, workers=0, progress=False)
    assert again.already_complete
    with pytest.raises(fastdata.errors.ResumeMismatchError, match="lossless"):
        fastdata.convert(root, dst, resume=True, max_side=8, workers=0, progress=False)


@pytest.mark.parametrize("other", [{"raw": "8x8"}, {"max_side": 8}, {"quality": 80}])
def test_lossless_is_exclusive_with_the_other_storage_modes(tmp_path, tree, other):
    root, _ = tree
    with pytest.raises(ValueError, match='lossless="tiff" and .* are exclusive'):
        fastdata.convert(root, tmp_path / "x.lmdb", lossless="tiff", workers=0, progress=False, **other)
    with pytest.raises(ValueError, match="lossless must be one of tiff"):
        fastdata.convert(root, tmp_path / "x.lmdb", lossless="png", workers=0, progress=False)


def test_cli_lossless_and_its_conflicts(tmp_path, tree, capsys):
    root, _ = tree
    assert main(["convert", str(root), str(tmp_path / "c.lmdb"), "--lossless", "tiff", "--workers", "0"]) == 0
    assert "lossless" in capsys.readouterr().out
    for extra in (["--raw", "8x8"], ["--max-side", "8"], ["--quality", "70"]):
        try:  # argparse refuses the exclusive group itself (exit 2); --quality is refused by the API
            code = main(["convert", str(root), str(tmp_path / "d.lmdb"), "--lossless", "tiff", *extra])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err and "Traceback" not in "\n".join(err) and "--lossless" in err[-1], err
        assert not (tmp_path / "d.lmdb").exists()


def test_the_summary_points_deep_pngs_at_lossless_and_unchanged(tmp_path):
    """A folder of 16-bit PNGs converted as given: the summary names the faster storage and the read mode
    that keeps them; stored with --lossless tiff and --image-mode unchanged, neither hint is given."""
    root = tmp_path / "src"
    for i in range(2):
        write_png16(root / f"a/{i}.png", (12, 10), seed=i)
    plain = fastdata.convert(root, tmp_path / "plain.lmdb", workers=0, progress=False).summary()
    assert "lossless='tiff' keeps the same pixels" in plain and "image_mode='unchanged'" in plain
    tuned = fastdata.convert(root, tmp_path / "tuned.lmdb", workers=0, progress=False, lossless="tiff",
                             image_mode="unchanged").summary()
    assert "decodes about 2.5x faster" not in tuned and "read as 8-bit RGB by default" not in tuned
