"""convert --storage raw|mixed: decoded RGB pixels at their own size (the longer side capped at
--max-side, Pillow LANCZOS with reducing_gap=3.0) stored as binary PPM records, for all images or
for the share that xxh3(relpath) picks; read without decoding by every read path, with the same
crop box and resize kernel as an encoded record of the same pixels; info's raw/encoded split;
verify's PPM header checks on hostile records; the option errors."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers import hostile as H
from helpers.images import make_jpeg, make_tree, photo_array
from helpers.native import v1_records
from PIL import Image

import fastdata
from fastdata.cli.main import main
from fastdata.common.imageio import ImageDecodeError, encode_ppm, ppm_pixels
from fastdata.errors import CorruptRecordError
from fastdata.format.manifest import read_manifest
from fastdata.tools.verify import info, verify
from fastdata.transforms import CenterCrop, RandomResizedCrop, Resize, full_decode

MAX_SIDE = 64
#: mean absolute difference (levels of 255) between a JPEG decoded at a DCT scale and a full decode, for
#: helpers.images.photo_array's per-pixel grain: the "strong noise at a few pixels" case of
#: fastdata.reader.transforms' docstring (1-3 levels); a full decode of the same pixels is exact
JPEG_DCT_TOLERANCE = 3.0


def expected_pixels(data: bytes, max_side: int) -> np.ndarray:
    """The documented rule, spelled out here: convert("RGB"), then, when the longer side exceeds
    max_side, resize to max(1, round(side * scale)) with LANCZOS, reducing_gap=3.0."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    longer = max(im.size)
    if longer > max_side:
        scale = max_side / longer
        size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
        im = im.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return np.asarray(im)


@pytest.fixture
def tree(tmp_path):
    """Images larger and smaller than MAX_SIDE, gray, RGBA and odd aspect ratios."""
    root = tmp_path / "src"
    make_jpeg(root / "a/big.jpg", size=(150, 100), seed=1)
    make_jpeg(root / "a/tall.jpg", size=(37, 129), seed=2)
    make_jpeg(root / "a/small.jpg", size=(40, 30), seed=3)
    make_jpeg(root / "b/gray.jpg", size=(90, 70), seed=4, mode="L")
    (root / "b").mkdir(parents=True, exist_ok=True)
    rgba = np.dstack([photo_array((30, 70), 5), np.full((70, 30), 128, np.uint8)])
    Image.fromarray(rgba).save(root / "b/alpha.png")
    Image.fromarray(photo_array((64, 20), 6)[:, :, 0]).save(root / "b/exact.png")  # longer side == MAX_SIDE
    return root


def test_raw_records_are_the_decoded_pixels_capped_as_documented(tmp_path, tree):
    dst = tmp_path / "raw.lmdb"
    report = fastdata.convert(tree, dst, storage="raw", max_side=MAX_SIDE, workers=0, progress=False)
    assert report.rejected == 0 and report.images == 6
    storage = read_manifest(str(dst))["storage"]
    assert storage == {"mode": "raw-native", "max_side": MAX_SIDE, "quality": None, "raw_shape": None}
    records = v1_records(dst)
    for rec in records:
        src = (tree / rec["relpath"]).read_bytes()
        want = expected_pixels(src, MAX_SIDE)
        assert rec["fmt"] == "PPM" and rec["image"][:2] == b"P6", rec["relpath"]
        got = np.asarray(Image.open(io.BytesIO(rec["image"])))  # Pillow reads the record as the PPM it is
        assert got.shape == want.shape and np.array_equal(got, want), rec["relpath"]
        assert (rec["width"], rec["height"]) == (want.shape[1], want.shape[0])
        assert max(want.shape[:2]) <= MAX_SIDE
    shapes = {rec["relpath"]: np.asarray(Image.open(io.BytesIO(rec["image"]))).shape for rec in records}
    assert shapes["a/big.jpg"] == (43, 64, 3) and shapes["a/tall.jpg"] == (64, 18, 3)
    # small enough: stored unresized, the exact decoded pixels
    small = np.asarray(Image.open(tree / "a/small.jpg").convert("RGB"))
    assert np.array_equal(ppm_pixels(next(r["image"] for r in records if r["relpath"] == "a/small.jpg")), small)
    assert verify(str(dst), decode=True).ok
    split = info(str(dst))["raw_split"]
    assert split["raw"]["count"] == 6 and split["encoded"] == {"count": 0, "bytes": 0}
    assert split["raw"]["bytes"] == sum(len(r["image"]) for r in records)


def test_an_image_without_an_rgb_form_is_rejected_with_the_reason(tmp_path):
    import tifffile

    root = make_tree(tmp_path / "src", classes={"cat": 2}, size=(40, 30))
    tifffile.imwrite(root + "/cat/bands.tif", np.zeros((20, 20, 5), np.uint8), planarconfig="contig")
    report = fastdata.convert(root, tmp_path / "r.lmdb", storage="raw", max_side=MAX_SIDE, workers=0, progress=False)
    assert report.images == 2 and report.rejected == 1
    reason = read_manifest(str(tmp_path / "r.lmdb"))["rejected"][0]
    assert "no 8-bit RGB form" in str(reason), reason


def test_mixed_store_follows_the_hash_rule_and_keeps_the_rest_bit_exact(tmp_path):
    root = make_tree(tmp_path / "src", classes={"cat": 20, "dog": 20}, size=(80, 60))
    dst = tmp_path / "mixed.h5"
    fastdata.convert(root, dst, storage="mixed", raw_fraction=0.5, max_side=MAX_SIDE, workers=0, progress=False)
    assert read_manifest(str(dst))["storage"]["raw_fraction"] == 0.5
    records = v1_records(dst)
    raw = encoded = 0
    for rec in records:
        rel = rec["relpath"]
        src = (tmp_path / "src" / rel).read_bytes()
        if xxhash.xxh3_64_intdigest(rel.encode()) / 2.0**64 < 0.5:
            raw += 1
            assert rec["fmt"] == "PPM" and np.array_equal(ppm_pixels(rec["image"]), expected_pixels(src, MAX_SIDE))
        else:
            encoded += 1
            assert rec["fmt"] == "JPEG" and rec["image"] == src, rel
    assert raw and encoded  # both kinds, exactly as the rule says (about half: 40 images)
    split = info(str(dst))["raw_split"]
    assert (split["raw"]["count"], split["encoded"]["count"]) == (raw, encoded)
    assert verify(str(dst), decode=True).ok
    # fraction 0 and 1 are the two ends of the rule
    for fraction, fmts in ((0.0, {"JPEG"}), (1.0, {"PPM"})):
        out = tmp_path / f"f{fraction}.lmdb"
        fastdata.convert(root, out, storage="mixed", raw_fraction=fraction, max_side=MAX_SIDE, workers=0,
                         progress=False)
        assert {r["fmt"] for r in v1_records(out)} == fmts


def test_mixed_resume_checks_the_fraction(tmp_path):
    root = make_tree(tmp_path / "src", classes={"cat": 3}, size=(40, 30))
    dst = tmp_path / "m.lmdb"
    fastdata.convert(root, dst, storage="mixed", raw_fraction=0.5, max_side=MAX_SIDE, workers=0, progress=False)
    assert fastdata.convert(root, dst, resume=True, workers=0, progress=False).already_complete
    with pytest.raises(fastdata.errors.ResumeMismatchError, match="raw fraction 0.5"):
        fastdata.convert(root, dst, resume=True, storage="mixed", raw_fraction=0.25, max_side=MAX_SIDE, workers=0,
                         progress=False)


# -- --raw-budget: as many images as pixels as the budget holds, the costliest decodes first ----------------

def _budget_tree(root):
    """Images of several sizes and JPEG qualities: a high quality decodes slower per pixel (more
    bytes to entropy-decode) and its pixels cost fewer bytes more than its file."""
    for i, (size, quality) in enumerate([((150, 100), 95), ((150, 100), 40), ((90, 120), 95), ((90, 120), 40),
                                         ((60, 50), 90), ((60, 50), 30), ((200, 40), 97), ((200, 40), 50)]):
        make_jpeg(root / ("a" if i % 2 else "b") / f"{i}.jpg", size=size, seed=i, quality=quality)
    return root


def _priorities(root, rels):
    """The documented priority of each image, from Pillow's view of the files (not fastdata's plan)."""
    from fastdata.writer.raw_budget import decode_priority, raw_record_bytes

    sizes = [Image.open(root / rel).size for rel in rels]
    w, h = np.array([a for a, _ in sizes]), np.array([b for _, b in sizes])
    files = np.array([(root / rel).stat().st_size for rel in rels])
    raw = raw_record_bytes(w, h, MAX_SIDE)
    return decode_priority(w, h, files, raw), raw, files


def test_raw_budget_keeps_the_costliest_decodes_as_pixels_within_the_budget(tmp_path):
    from fastdata.writer.raw_budget import RECORD_ALLOWANCE, WRITE_ALLOWANCE

    root = _budget_tree(tmp_path / "src")
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*.jpg"))
    priority, raw_bytes, files = _priorities(root, rels)
    allowance = RECORD_ALLOWANCE * len(rels) + WRITE_ALLOWANCE
    extra = np.maximum(raw_bytes - files, 0)
    # a budget that holds about half of the extra bytes (in priority order): some raw, some not
    budget = int(files.sum() + allowance + np.sort(extra)[: len(rels) // 2].sum())
    dst = tmp_path / "b.lmdb"
    report = fastdata.convert(root, dst, storage="mixed", raw_budget=budget, max_side=MAX_SIDE, workers=0,
                              progress=False)
    assert read_manifest(str(dst))["storage"]["raw_budget"] == budget
    records = {rec["relpath"]: rec for rec in v1_records(dst)}
    raw = np.array([records[rel]["fmt"] == "PPM" for rel in rels])
    assert 0 < raw.sum() < len(rels)
    stored = sum(len(rec["image"]) for rec in records.values())
    assert stored + allowance <= budget  # within the budget, counted as documented
    assert sum(s["bytes"] for s in read_manifest(str(dst))["shards"]) <= budget  # and on disk
    # the images kept raw are the highest priorities (a prefix of the order), each raw record the
    # capped pixels and each other record the file itself
    assert priority[raw].min() >= priority[~raw].max()
    for rel, rec in records.items():
        src = (root / rel).read_bytes()
        if rec["fmt"] == "PPM":
            assert np.array_equal(ppm_pixels(rec["image"]), expected_pixels(src, MAX_SIDE))
        else:
            assert rec["image"] == src, rel
    assert any("raw budget" in note and f"{int(raw.sum())} of {len(rels)}" in note for note in report.notes)
    split = info(str(dst))["raw_split"]
    assert (split["raw"]["count"], split["encoded"]["count"]) == (int(raw.sum()), int((~raw).sum()))
    assert verify(str(dst), decode=True).ok
    # control: the rule is monotone in the budget: room for every image's pixels keeps all raw
    roomy = tmp_path / "all.lmdb"
    fastdata.convert(root, roomy, storage="mixed", raw_budget=int(files.sum() + extra.sum() + allowance),
                     max_side=MAX_SIDE, workers=0, progress=False)
    assert {rec["fmt"] for rec in v1_records(roomy)} == {"PPM"}


def test_raw_budget_that_cannot_hold_the_images_is_refused_before_writing(tmp_path):
    root = _budget_tree(tmp_path / "src")
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*.jpg"))
    _, raw_bytes, files = _priorities(root, rels)
    with pytest.raises(ValueError, match=r"take .* as they are, over raw_budget='1 kB'"):
        fastdata.convert(root, tmp_path / "m.lmdb", storage="mixed", raw_budget="1kB", max_side=MAX_SIDE,
                         workers=0, progress=False)
    assert not (tmp_path / "m.lmdb").exists()
    # --storage raw: all pixels or nothing; a budget just under what they take is refused, at it accepted
    need = int(raw_bytes.sum()) + 4096 * len(rels) + (256 << 10)  # the documented allowances
    with pytest.raises(ValueError, match=r"storage='raw' max_side=64 stores these 8 images .* over raw_budget="):
        fastdata.convert(root, tmp_path / "r.lmdb", storage="raw", raw_budget=need - 1, max_side=MAX_SIDE, workers=0,
                         progress=False)
    assert not (tmp_path / "r.lmdb").exists()
    fastdata.convert(root, tmp_path / "r.lmdb", storage="raw", raw_budget=need, max_side=MAX_SIDE, workers=0,
                     progress=False)
    assert {rec["fmt"] for rec in v1_records(tmp_path / "r.lmdb")} == {"PPM"}


def test_an_append_plans_against_what_the_budget_still_holds(tmp_path):
    """The store's shards count against its budget: the appended images get only the rest of it."""
    from fastdata.format.backends.base import StorageSpec
    from fastdata.writer.raw_budget import RECORD_ALLOWANCE, WRITE_ALLOWANCE, choose_raw, header_sizes

    side = 100  # the 120x90 JPEGs' pixels at 100x75 take about twice their files
    first = make_tree(tmp_path / "s1", classes={"cat": 4}, size=(120, 90))
    second = make_tree(tmp_path / "s2", classes={"cat": 4}, size=(120, 90), seed=5)
    paths = sorted((tmp_path / "s2").rglob("*.jpg"))
    files = np.array([p.stat().st_size for p in paths])
    # the first store's shard bytes, as a scratch conversion with the same options writes them
    fastdata.convert(first, tmp_path / "scratch.lmdb", storage="mixed", raw_budget=10**9, max_side=side,
                     workers=0, progress=False)
    held = sum(s["bytes"] for s in read_manifest(str(tmp_path / "scratch.lmdb"))["shards"])
    dst = tmp_path / "m.lmdb"
    # room for the first store and for the second's files, but not for any of the second's pixels
    budget = held + int(files.sum()) + 4 * RECORD_ALLOWANCE + WRITE_ALLOWANCE + 4096
    fastdata.convert(first, dst, storage="mixed", raw_budget=budget, max_side=side, workers=0, progress=False)
    assert {rec["fmt"] for rec in v1_records(dst)} == {"PPM"}
    # control: planned alone, the second's images would all fit the budget as pixels
    spec = StorageSpec(mode="mixed", max_side=side, raw_budget=budget)
    w, h = header_sizes([bytes(p) for p in paths])
    assert choose_raw(spec, files, w, h, "s2").all()
    fastdata.convert(second, dst, append=True, workers=0, progress=False)
    records = v1_records(dst)
    assert len(records) == 8 and {rec["fmt"] for rec in records[4:]} == {"JPEG"}  # the budget was spent
    assert sum(s["bytes"] for s in read_manifest(str(dst))["shards"]) <= budget
    third = make_tree(tmp_path / "s3", classes={"cat": 40}, size=(120, 90), seed=9)
    with pytest.raises(ValueError, match="beside the store's .* into a new store with a larger raw_budget"):
        fastdata.convert(third, dst, append=True, workers=0, progress=False)
    assert len(v1_records(dst)) == 8


def test_raw_budget_resume_and_cli(tmp_path, capsys):
    root = _budget_tree(tmp_path / "src")
    dst = str(tmp_path / "c.lmdb")
    assert main(["convert", str(root), dst, "--storage", "mixed", "--raw-budget", "400kB", "--max-side", "64",
                 "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "raw budget 400 kB:" in out and "of the raw budget 400 kB" in out
    assert main(["info", dst]) == 0
    assert "mixed (pixels up to 64 px, raw budget 400 kB)" in capsys.readouterr().out
    assert fastdata.convert(root, dst, resume=True, workers=0, progress=False).already_complete
    with pytest.raises(fastdata.errors.ResumeMismatchError, match="raw budget 400 kB"):
        fastdata.convert(root, dst, resume=True, storage="mixed", raw_budget="500kB", max_side=MAX_SIDE, workers=0,
                         progress=False)
    code = main(["convert", str(root), str(tmp_path / "d.lmdb"), "--storage", "mixed", "--raw-budget", "lots",
                 "--max-side", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--raw-budget must be a positive size such as 200GB" in err[0]
    assert not (tmp_path / "d.lmdb").exists()


# -- reading PPM records: the same crop box and kernel as an encoded record of the same pixels ----------------

def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("size", [(300, 200), (97, 233)])
def test_transforms_on_a_ppm_equal_those_on_a_png_and_jpeg_of_the_same_pixels(size):
    pixels = photo_array(size, 7)
    jpeg = _jpeg(pixels)
    decoded = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    # a PNG is decoded whole, as a PPM's view is: the same output exactly; a JPEG may be decoded at a DCT
    # scale (Resize, CenterCrop, large RRC crops), documented within a mean 1 level of a full decode
    cases = [(encode_ppm(pixels), _png(pixels), 0.0), (encode_ppm(decoded), jpeg, JPEG_DCT_TOLERANCE)]
    transforms = [RandomResizedCrop(224), RandomResizedCrop(64), Resize(50), Resize((31, 40)), CenterCrop(48, 60),
                  CenterCrop(250)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch.from_numpy of the read-only view of the record
        for ppm, other, tolerance in cases:
            assert np.array_equal(full_decode(ppm), full_decode(other))
            assert full_decode(ppm).flags.writeable
            for t in transforms:
                for seed in range(4):
                    a = t(ppm, np.random.default_rng(seed))
                    b = t(other, np.random.default_rng(seed))
                    assert a.shape == b.shape, (t, seed)
                    assert np.abs(a.astype(np.int16) - b).mean() <= tolerance, (t, seed)
                    assert a.flags.writeable and a.flags.c_contiguous
                    out = np.empty_like(a) if t.output_size else None
                    if out is not None:
                        t.decode_into(ppm, out, np.random.default_rng(seed))
                        assert np.array_equal(out, a)
                # other read modes: the pixels as stored are the RGB pixels
                unchanged = t(ppm, np.random.default_rng(0), mode="unchanged")
                assert np.array_equal(unchanged, t(ppm, np.random.default_rng(0)))


def test_rrc_box_on_a_ppm_is_the_jpeg_box_and_the_crop_within_tolerance_with_dct_scaling():
    """A large JPEG's RandomResizedCrop may decode at a DCT scale; a PPM of its decoded pixels then
    gives the same box (drawn from the same size) and a crop within the documented tolerance."""
    jpeg = _jpeg(photo_array((1024, 768), 8))
    ppm = encode_ppm(np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    t = RandomResizedCrop(64)
    for seed in range(6):
        assert t.get_params(768, 1024, np.random.default_rng(seed)) == t.get_params(
            *ppm_pixels(ppm).shape[:2], np.random.default_rng(seed))
        a = t(ppm, np.random.default_rng(seed)).astype(np.int16)
        b = t(jpeg, np.random.default_rng(seed)).astype(np.int16)
        assert np.abs(a - b).mean() <= JPEG_DCT_TOLERANCE, seed


@pytest.mark.parametrize("kind", ["raw", "mixed", "jpeg"])
def test_open_dataset_rrc_with_two_workers(tmp_path, kind):
    root = make_tree(tmp_path / "src", classes={"cat": 6, "dog": 6}, size=(120, 90))
    dst = tmp_path / ("s.h5" if kind == "raw" else "s.lmdb")  # both backends' record reads
    options = {"raw": {"storage": "raw", "max_side": 100},
               "mixed": {"storage": "mixed", "raw_fraction": 0.5, "max_side": 100}, "jpeg": {}}[kind]
    fastdata.convert(root, dst, workers=0, progress=False, **options)
    ds = fastdata.open_dataset(str(dst), decode=RandomResizedCrop(224), output="tensor")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    batches = list(loader)
    assert sum(len(b[1]) for b in batches) == 12
    assert all(tuple(b[0].shape[1:]) == (3, 224, 224) and b[0].dtype == torch.uint8 for b in batches)
    # full decode, PIL output: the stored pixels
    plain = fastdata.open_dataset(str(dst), output="pil")
    for i in range(len(plain)):
        image, _ = plain[i]
        rel = plain.relpath(i)
        src = (tmp_path / "src" / rel).read_bytes()
        raw = kind == "raw" or (kind == "mixed" and xxhash.xxh3_64_intdigest(rel.encode()) / 2.0**64 < 0.5)
        want = expected_pixels(src, 100) if raw else np.asarray(Image.open(io.BytesIO(src)).convert("RGB"))
        assert isinstance(image, Image.Image) and np.array_equal(np.asarray(image), want), rel
    assert verify(str(dst)).ok


# -- a batch of PPM records is read from the map, not copied -------------------------------------------------

def test_a_batch_of_ppm_records_decodes_from_views_and_equals_per_sample_reads(tmp_path, monkeypatch):
    import fastdata.format.backends.lmdb.reader as lmdb_reader

    root = make_tree(tmp_path / "src", classes={"cat": 6, "dog": 6}, size=(120, 90))
    dst = str(tmp_path / "m.lmdb")
    fastdata.convert(root, dst, storage="mixed", raw_fraction=0.5, max_side=100, workers=0, progress=False)
    ds = fastdata.open_dataset(dst, decode=CenterCrop(64), output="numpy")
    idx = list(range(len(ds)))
    per_sample = [ds[i][0] for i in idx]  # each record copied out by msgpack, as ds[i] reads it
    ds.close()
    fmts = [rec["fmt"] for rec in v1_records(dst)]
    assert "PPM" in fmts and "JPEG" in fmts
    real = lmdb_reader.record_image

    def copy_only_jpegs(buf, *, where=""):
        data = real(buf, where=where)
        assert not data.startswith(b"P6"), f"{where}: a PPM record was copied out of the map"
        return data

    monkeypatch.setattr(lmdb_reader, "record_image", copy_only_jpegs)
    ds = fastdata.open_dataset(dst, decode=CenterCrop(64), output="numpy")
    batch = ds.__getitems__(idx)
    assert np.array_equal(np.asarray(batch.images if hasattr(batch, "images") else [b[0] for b in batch]),
                          np.stack(per_sample))
    with pytest.raises(AssertionError, match="a PPM record was copied"):  # control: ds[i] copies
        ds[fmts.index("PPM")]


@pytest.mark.parametrize("n", [10, 300, 70_000])  # the image after a bin8, bin16 and bin32 header
def test_record_image_view_checks_as_record_image_does_without_a_copy(n):
    from fastdata.format.record import encode_record, record_image, record_image_view

    image = bytes(range(256)) * (n // 256) + bytes(n % 256)
    rec = encode_record(image, label=1, width=1, height=1, fmt="PPM", relpath=b"a/x.ppm")
    view = record_image_view(memoryview(rec), n)
    assert isinstance(view, memoryview) and view == image == record_image(rec)
    # nbytes the record does not hold: the copying path's verdict (here: the image, copied)
    assert type(record_image_view(memoryview(rec), n - 1)) is bytes
    damaged = bytearray(rec)
    damaged[-1] ^= 1
    for read in (lambda b: record_image(b), lambda b: record_image_view(memoryview(b), n)):
        with pytest.raises(CorruptRecordError, match="image checksum mismatch"):
            read(bytes(damaged))
    wrong_version = rec.replace(b"\xa1v\x01", b"\xa1v\x07", 1)
    for read in (lambda b: record_image(b), lambda b: record_image_view(memoryview(b), n)):
        with pytest.raises(CorruptRecordError, match="record version 7"):
            read(wrong_version)


def _damage_pixels(store: str, local: int) -> None:
    """Flip the last pixel byte of record ``local`` of the store's first shard where it lies in the
    file (as a bad sector would: LMDB and a read at the record's span both see it), keeping its
    checksum field."""
    from helpers.hostile import stored_item

    shard = sorted(Path(store).glob("*.lmdb"))[0]
    value = stored_item("lmdb", str(shard), local)  # the image is the record's last field
    data = bytearray(shard.read_bytes())
    at = data.find(value)
    assert at >= 0 and data.find(value, at + 1) < 0
    data[at + len(value) - 1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_damaged_ppm_record_in_a_batch_is_named_or_skipped(tmp_path):
    root = make_tree(tmp_path / "src", classes={"cat": 4}, size=(120, 90))
    dst = str(tmp_path / "r.lmdb")
    fastdata.convert(root, dst, storage="raw", max_side=100, workers=0, progress=False)
    _damage_pixels(dst, 2)
    ds = fastdata.open_dataset(dst, decode=RandomResizedCrop(64), output="numpy")
    with pytest.raises(CorruptRecordError, match=r"record 2 \(sample 2\) is damaged: .*checksum mismatch") as info:
        ds.__getitems__([0, 1, 2, 3])
    assert info.value.index == 2
    skipping = fastdata.open_dataset(dst, decode=RandomResizedCrop(64), output="numpy", on_error="skip")
    with pytest.warns(RuntimeWarning, match="skipping damaged sample 2"):
        batch = skipping.__getitems__([0, 1, 2, 3])
    assert skipping.skipped == 1 and len(batch) == 4


# -- hostile PPM records --------------------------------------------------------------------------------------

HOSTILE = {
    "truncated": lambda good: good[:-7],
    "bomb": lambda good: b"P6\n60000 60000\n255\n" + good[good.index(b"255\n") + 4:],
    "garbage": lambda good: b"P6\nxx yy\n255\n" + good[good.index(b"255\n") + 4:],
    "zero": lambda good: b"P6\n0 10\n255\n" + good[good.index(b"255\n") + 4:],
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_ppm_record_is_a_corrupt_record_error_naming_it(tmp_path, attack):
    from fastdata.format.record import decode_record, encode_record

    root = make_tree(tmp_path / "src", classes={"cat": 3}, size=(40, 30))
    store = str(tmp_path / "h.lmdb")
    fastdata.convert(root, store, storage="raw", max_side=MAX_SIDE, workers=0, progress=False)
    shard = f"{store}/{read_manifest(store)['shards'][0]['name']}"
    rec = decode_record(H.stored_item("lmdb", shard, 0))
    img = HOSTILE[attack](rec.image)
    with pytest.raises(ImageDecodeError):
        ppm_pixels(img)
    data = encode_record(img, label=rec.label, width=rec.width, height=rec.height, fmt="PPM", relpath=rec.relpath)
    H.replace_item(store, "lmdb", shard, 0, data, checksummed=img)
    H.resign(store)
    for decode in (None, RandomResizedCrop(224), CenterCrop(32, 40)):
        ds = fastdata.open_dataset(store, decode=decode)
        with pytest.raises(CorruptRecordError, match=r"record 0 \(sample 0\).*PPM"):
            ds[0]
        ds[1]  # the others read
    report = verify(store)  # the header check needs no --decode
    assert not report.ok and len(report.problems) == 1 and "record 0" in report.problems[0], report.problems


def test_verify_finds_a_ppm_header_that_disagrees_with_the_index(tmp_path):
    from fastdata.format.record import decode_record, encode_record

    root = make_tree(tmp_path / "src", classes={"cat": 2}, size=(40, 30))
    store = str(tmp_path / "h.lmdb")
    fastdata.convert(root, store, storage="raw", max_side=MAX_SIDE, workers=0, progress=False)
    shard = f"{store}/{read_manifest(store)['shards'][0]['name']}"
    rec = decode_record(H.stored_item("lmdb", shard, 0))
    img = rec.image.replace(b"P6\n40 30\n", b"P6\n30 40\n", 1)  # same bytes, sides swapped
    H.replace_item(store, "lmdb", shard, 0, encode_record(img, label=rec.label, width=40, height=30, fmt="PPM",
                                                          relpath=rec.relpath), checksummed=img)
    H.resign(store)
    problems = verify(store).problems
    assert len(problems) == 1 and "record 0" in problems[0] and "30x40" in problems[0], problems
    # bytes after the pixels: readers ignore them (as Pillow does), verify does not
    rec = decode_record(H.stored_item("lmdb", shard, 1))
    img = rec.image + b"\0" * 5
    H.replace_item(store, "lmdb", shard, 1, encode_record(img, label=rec.label, width=40, height=30, fmt="PPM",
                                                          relpath=rec.relpath), checksummed=img)
    H.resign(store)
    problems = verify(store).problems
    assert len(problems) == 2 and "record 1" in problems[1] and "5 bytes after" in problems[1], problems
    assert fastdata.open_dataset(store, decode=RandomResizedCrop(16), output="numpy")[1][0].shape == (16, 16, 3)


def test_raw_shards_are_planned_from_the_pixels_they_will_hold(tmp_path):
    """The planner cannot know decoded sizes: each raw image counts as a max-side square (its upper
    bound), so shards of raw images stay near the target instead of holding the files' few KB each."""
    root = make_tree(tmp_path / "src", classes={"cat": 6}, size=(80, 60))
    dst = tmp_path / "p.lmdb"
    fastdata.convert(root, dst, storage="raw", max_side=MAX_SIDE, shard_size=3 * (3 * MAX_SIDE**2 + 32), workers=0,
                     progress=False)
    assert [s["count"] for s in read_manifest(str(dst))["shards"]] == [3, 3]


# -- option errors, before anything is written ----------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"storage": "raw"}, 'storage="raw" needs max_side'),
    ({"storage": "raw", "max_side": 31}, "at least 32"),
    ({"storage": "mixed", "max_side": 64}, "needs raw_fraction"),
    ({"storage": "mixed", "max_side": 64, "raw_fraction": 1.5}, "raw_fraction must be from 0 to 1"),
    ({"storage": "mixed", "max_side": 64, "raw_fraction": -0.1}, "raw_fraction must be from 0 to 1"),
    ({"storage": "mixed", "max_side": 64, "raw_fraction": float("nan")}, "raw_fraction must be from 0 to 1"),
    ({"storage": "raw", "max_side": 64, "raw_fraction": 0.5}, 'applies to storage="mixed"'),
    ({"storage": "raw", "max_side": 64, "raw": "32x32"}, "are exclusive"),
    ({"storage": "mixed", "max_side": 64, "raw_fraction": 0.5, "lossless": "tiff"}, "are exclusive"),
    ({"storage": "raw", "max_side": 64, "quality": 80}, "are exclusive"),
    ({"raw_fraction": 0.5}, 'applies to storage="mixed" only'),
    ({"raw_budget": "1GB"}, 'raw_budget applies to storage="raw" or "mixed"'),
    ({"storage": "mixed", "max_side": 64, "raw_fraction": 0.5, "raw_budget": "1GB"}, "are exclusive"),
    ({"storage": "mixed", "max_side": 64, "raw_budget": 0}, "raw_budget must be a positive size"),
    ({"storage": "mixed", "max_side": 64, "raw_budget": "-5GB"}, "raw_budget must be a positive size"),
    ({"storage": "mixed", "max_side": 64, "raw_budget": True}, "raw_budget must be a positive size"),
    ({"storage": "ppm", "max_side": 64}, "storage must be one of raw, mixed"),
])
def test_bad_storage_options_are_refused_before_writing(tmp_path, options, message):
    root = make_tree(tmp_path / "src", classes={"cat": 1}, size=(40, 30))
    with pytest.raises(ValueError, match=message):
        fastdata.convert(root, tmp_path / "x.lmdb", workers=0, progress=False, **options)
    assert not (tmp_path / "x.lmdb").exists()


def test_cli_storage_raw_and_its_errors(tmp_path, capsys):
    root = make_tree(tmp_path / "src", classes={"cat": 2}, size=(40, 30))
    dst = str(tmp_path / "c.lmdb")
    assert main(["convert", str(root), dst, "--storage", "mixed", "--raw-fraction", "1", "--max-side", "32",
                 "--workers", "0"]) == 0
    capsys.readouterr()
    assert main(["info", dst]) == 0
    out = capsys.readouterr().out
    assert "mixed (pixels up to 32 px, raw fraction 1)" in out and "records:  2 raw (PPM pixels" in out
    code = main(["convert", str(root), str(tmp_path / "d.lmdb"), "--storage", "mixed", "--raw-fraction", "2",
                 "--max-side", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--raw-fraction must be from 0 to 1" in err[0]
    assert not (tmp_path / "d.lmdb").exists()


def test_ppm_records_are_not_decoded_but_viewed(monkeypatch):
    """The fused transforms take a PPM record's pixels as a view of its bytes: no decoder runs."""
    import fastdata.common.imageio as imageio
    import fastdata.reader.transforms as transforms

    pixels = photo_array((120, 90), 9)
    ppm = encode_ppm(pixels)
    view = ppm_pixels(ppm)
    assert np.shares_memory(view, np.frombuffer(ppm, np.uint8)) and not view.flags.writeable

    def refuse(*args, **kwargs):
        raise AssertionError("a PPM record went through a decoder")

    monkeypatch.setattr(transforms, "decode_rgb_array", refuse)
    monkeypatch.setattr(imageio, "open_image", refuse)
    assert np.array_equal(full_decode(ppm), pixels)
    assert RandomResizedCrop(64)(ppm, np.random.default_rng(0)).shape == (64, 64, 3)
    assert Resize(90)(ppm).shape == (90, 120, 3) and CenterCrop(32)(ppm).shape == (32, 32, 3)


@pytest.mark.parametrize("storage", [{"raw_budget": 0}, {"raw_budget": "1GB"}, {"raw_budget": 1.5e9},
                                     {"raw_budget": 10**9, "raw_fraction": 0.5}, {"raw_budget": True}])
def test_a_manifest_with_an_invalid_raw_budget_is_refused(tmp_path, storage):
    root = make_tree(tmp_path / "src", classes={"cat": 2}, size=(40, 30))
    store = str(tmp_path / "m.lmdb")
    fastdata.convert(root, store, storage="mixed", raw_budget=10**9, max_side=MAX_SIDE, workers=0, progress=False)
    fastdata.open_dataset(store)  # control: the store as written opens
    body = H.load_manifest(store)
    body["storage"].update(storage)
    H.resign(store, body)
    with pytest.raises(fastdata.errors.FormatError, match="not a valid storage mode"):
        fastdata.open_dataset(store)


def test_a_manifest_with_an_invalid_raw_fraction_is_refused(tmp_path):
    root = make_tree(tmp_path / "src", classes={"cat": 2}, size=(40, 30))
    store = str(tmp_path / "m.lmdb")
    fastdata.convert(root, store, storage="mixed", raw_fraction=0.5, max_side=MAX_SIDE, workers=0, progress=False)
    body = H.load_manifest(store)
    body["storage"]["raw_fraction"] = 1.5
    H.resign(store, body)
    with pytest.raises(fastdata.errors.FormatError, match="not a valid storage mode"):
        fastdata.open_dataset(store)
