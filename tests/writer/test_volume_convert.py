"""NIfTI volumes (folders, lists, Decathlon dataset.json) and large tiled TIFFs convert into stores of
chunked arrays, read back bit-exact by region. Every fixture is a real file written by nibabel or
tifffile (tests/helpers/nifti.py); nothing of either library is mocked."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from helpers.nifti import affine_of, image, label_of, raw_values, truncate, volume, write_nifti, write_tiff

import fastdata
from fastdata.cli.main import main
from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.fields import Chunked, Float, Int, String
from fastdata.format.manifest import read_manifest, schema_of
from fastdata.writer.sources.volumes.input import VolumeInput, encode_file
from fastdata.writer.sources.volumes.nifti import VolumeSamples, volume_layout, volume_schema
from fastdata.writer.sources.volumes.scan import NIFTI_SUFFIXES, scan_file_folder
from fastdata.writer.sources.volumes.tiff import TIFF_SUFFIXES, TiffRegions, TiffSamples, image_layout, open_tiff

nib = pytest.importorskip("nibabel")
tifffile = pytest.importorskip("tifffile")

CHUNKS = (16, 16, 16)


def rejected_tsv(dst) -> list[list[str]]:
    with open(f"{dst}/rejected.tsv", newline="") as fh:
        return [row for row in csv.reader(fh, delimiter="\t")][1:]


def by_path(ds) -> dict[str, int]:
    return {ds.relpath(i): i for i in range(len(ds))}


# --------------------------------------------------------------------------- NIfTI folders


@pytest.fixture
def nifti_classes(tmp_path):
    """Two class folders: .nii int16 volumes with scaling, a .nii.gz uint8 one (nested), a
    .nii.gz int16; shapes not multiples of the chunks. Returns (root, {relpath: (path, label)})."""
    root = tmp_path / "mri"
    files = {
        "healthy/a.nii": ((40, 33, 21), "int16", 0.5, -1024.0),
        "healthy/sub/b.nii.gz": ((17, 30, 16), "uint8", None, None),
        "tumour/c.nii.gz": ((33, 16, 40), "int16", 2.0, 5.0),
        "tumour/d.nii": ((20, 20, 20), "int16", None, None),
    }
    out = {}
    for k, (rel, (shape, dtype, slope, inter)) in enumerate(files.items()):
        path = write_nifti(root / rel, volume(k, shape, dtype), affine_of(k), slope, inter)
        out[rel] = (path, ["healthy", "tumour"].index(rel.split("/")[0]))
    return root, out


@pytest.mark.parametrize("backend, workers", [("lmdb", 0), ("hdf5", 0), ("lmdb", 2), ("hdf5", 2)])
def test_nifti_folder_round_trips_raw_values_affine_and_spacing(tmp_path, nifti_classes, backend, workers):
    root, files = nifti_classes
    dst = tmp_path / f"mri.{'lmdb' if backend == 'lmdb' else 'h5'}"
    report = fastdata.convert(root, dst, chunks=CHUNKS, workers=workers, progress=False)
    assert report.images == 4 and report.rejected == 0
    manifest = read_manifest(str(dst))
    schema = schema_of(manifest)
    assert schema.names == ("image", "label", "affine", "spacing", "scl_slope", "scl_inter")
    assert isinstance(schema["image"], Chunked) and schema["image"].dtype == np.int16  # uint8 + int16 -> int16
    assert schema["image"].chunks == CHUNKS and isinstance(schema["label"], Int)
    assert manifest["classes"] == ["healthy", "tumour"] and manifest["class_counts"] == [2, 2]
    ds = fastdata.open_dataset(dst)
    assert sorted(by_path(ds)) == sorted(files)
    for rel, i in by_path(ds).items():
        path, label = files[rel]
        img = nib.load(str(path))
        sample = ds[i]
        got = sample["image"][...]
        raw = raw_values(path)
        assert got.dtype == np.int16 and np.array_equal(got, raw)  # bit-exact, unscaled
        assert sample["image"].shape == img.shape
        assert np.array_equal(sample["image"][3:9, 14:30, 1:2], raw[3:9, 14:30, 1:2])
        assert sample["label"] == label
        assert np.array_equal(sample["affine"], img.affine)
        assert np.array_equal(sample["spacing"], np.asarray(img.header.get_zooms()[:3], dtype=np.float64))
        assert (sample["scl_slope"], sample["scl_inter"]) == (img.dataobj.slope, img.dataobj.inter)
        # the physical values are the user's to make, and they are nibabel's
        np.testing.assert_allclose(got * sample["scl_slope"] + sample["scl_inter"], img.get_fdata())


def test_a_flat_folder_has_no_label_and_4d_volumes_chunk_their_fourth_axis_by_one(tmp_path):
    root = tmp_path / "fmri"
    arrays = {f"run{k}.nii.gz": volume(k, (18, 20, 9, 3), "float32") for k in range(2)}
    for name, array in arrays.items():
        write_nifti(root / name, array, affine_of(0))
    write_nifti(root / "odd3d.nii", volume(9, (8, 8, 8), "float32"))  # fewer axes than most: rejected
    report = fastdata.convert(root, tmp_path / "f.lmdb", workers=0, progress=False)
    schema = schema_of(read_manifest(str(tmp_path / "f.lmdb")))
    assert "label" not in schema.names and schema["image"].chunks == (48, 48, 48, 1)
    assert schema["spacing"].shape == (3,)
    assert [p for p, _ in report.rejected_items] == ["odd3d.nii"]
    assert "3-D volume" in report.rejected_items[0][1] and "4-D" in report.rejected_items[0][1]
    ds = fastdata.open_dataset(tmp_path / "f.lmdb")
    for name, i in by_path(ds).items():
        assert np.array_equal(ds[i]["image"][:, :, :, 1:3], arrays[name][:, :, :, 1:3])


@pytest.mark.parametrize("ext", [".nii", ".nii.gz"])
def test_big_endian_files_keep_their_values(tmp_path, ext):
    array = volume(3, (19, 23, 17), "int16")
    header = nib.Nifti1Header(endianness=">")
    header.set_data_dtype(np.int16)
    (tmp_path / "be").mkdir()
    nib.Nifti1Image(array, affine_of(3), header=header).to_filename(str(tmp_path / "be" / f"v{ext}"))
    assert nib.load(str(tmp_path / "be" / f"v{ext}")).get_data_dtype() == np.dtype(">i2")
    fastdata.convert(tmp_path / "be", tmp_path / "be.lmdb", chunks=CHUNKS, workers=0, progress=False)
    got = fastdata.open_dataset(tmp_path / "be.lmdb")[0]["image"][...]
    assert got.dtype == np.int16 and np.array_equal(got, array)


# --------------------------------------------------------------------------- lists, label volumes


@pytest.fixture
def seg_list(tmp_path):
    """A CSV of image,label,age,site: three good pairs, one whose label has another shape, one
    truncated .nii.gz image, one file that is not NIfTI at all."""
    root = tmp_path / "seg"
    rows, arrays = [], {}
    for k, (shape, ext) in enumerate([((30, 25, 20), ".nii.gz"), ((17, 33, 16), ".nii"), ((24, 24, 40), ".nii")]):
        img = volume(k, shape, "int16")
        lab = label_of(img)
        write_nifti(root / "images" / f"case{k}{ext}", img, affine_of(k))
        write_nifti(root / "labels" / f"case{k}{ext}", lab, affine_of(k))
        rows.append([f"images/case{k}{ext}", f"labels/case{k}{ext}", str(40 + k), f"site{k % 2}"])
        arrays[f"images/case{k}{ext}"] = (img, lab)
    write_nifti(root / "images" / "mismatch.nii", volume(5, (20, 20, 20)))
    write_nifti(root / "labels" / "mismatch.nii", label_of(volume(5, (20, 21, 20))))
    rows.append(["images/mismatch.nii", "labels/mismatch.nii", "50", "site0"])
    truncate(write_nifti(root / "images" / "cut.nii.gz", volume(6, (30, 30, 30))))
    write_nifti(root / "labels" / "cut.nii.gz", label_of(volume(6, (30, 30, 30))))
    rows.append(["images/cut.nii.gz", "labels/cut.nii.gz", "51", "site1"])
    (root / "images" / "notes.nii").write_bytes(b"not a volume at all\n" * 30)
    write_nifti(root / "labels" / "notes.nii", label_of(volume(7, (10, 10, 10))))
    rows.append(["images/notes.nii", "labels/notes.nii", "52", "site1"])
    with open(root / "train.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["image", "label", "age", "site"], *rows])
    return root, arrays


def test_list_with_label_volumes_keeps_columns_and_rejects_bad_rows_naming_the_files(tmp_path, seg_list):
    root, arrays = seg_list
    dst = tmp_path / "seg.h5"
    report = fastdata.convert(root / "train.csv", dst, chunks=(16, 16, 16), workers=0, progress=False)
    assert report.images == 3
    reasons = dict(report.rejected_items)
    assert sorted(reasons) == ["images/cut.nii.gz", "images/mismatch.nii", "images/notes.nii"]
    assert "labels/mismatch.nii" in reasons["images/mismatch.nii"]
    assert "images/mismatch.nii" in reasons["images/mismatch.nii"]  # both files named
    assert "(20, 21, 20)" in reasons["images/mismatch.nii"] and "(20, 20, 20)" in reasons["images/mismatch.nii"]
    assert "truncated or corrupt" in reasons["images/cut.nii.gz"]
    assert "not a readable NIfTI file" in reasons["images/notes.nii"]
    assert {tuple(r) for r in rejected_tsv(dst)} == set(reasons.items())
    schema = schema_of(read_manifest(str(dst)))
    assert isinstance(schema["label"], Chunked) and schema["label"].dtype == np.uint8
    assert isinstance(schema["age"], Int) and isinstance(schema["site"], String)
    ds = fastdata.open_dataset(dst)
    for rel, i in by_path(ds).items():
        img, lab = arrays[rel]
        sample = ds[i]
        assert np.array_equal(sample["image"][...], img) and np.array_equal(sample["label"][...], lab)
        assert sample["age"] == 40 + int(rel[len("images/case")]) and sample["site"].startswith("site")
    assert "rejected 3 input(s)" in report.summary()


def test_strict_stops_at_the_first_bad_volume_naming_it(tmp_path, seg_list):
    root, _ = seg_list
    with pytest.raises(RejectedInputError, match=r"mismatch\.nii.*strict=True"):
        fastdata.convert(root / "train.csv", tmp_path / "s.lmdb", strict=True, workers=0, progress=False)
    assert not (tmp_path / "s.lmdb" / "manifest.json").exists()


def test_patches_cut_image_and_label_volumes_at_the_same_place(tmp_path, seg_list):
    root, arrays = seg_list
    dst = tmp_path / "seg.lmdb"
    fastdata.convert(root / "train.csv", dst, chunks=(16, 16, 16), workers=0, progress=False)
    ds = fastdata.open_dataset(dst)
    patches = fastdata.PatchDataset(ds, (12, 10, 8), fields=["image", "label"], patches_per_sample=4, seed=3)
    names = [ds.relpath(i) for i in range(len(ds))]
    seen = set()
    for p in range(len(patches)):
        item = patches[p]
        img, lab = arrays[names[item["sample"]]]
        x, y, z = (int(v) for v in item["position"])
        seen.add((x, y, z))
        assert np.array_equal(item["image"], img[x:x + 12, y:y + 10, z:z + 8])
        assert np.array_equal(item["label"], lab[x:x + 12, y:y + 10, z:z + 8])
    assert len(seen) > 1


def test_jsonl_list_with_class_labels_and_json_columns(tmp_path):
    root = tmp_path / "cls"
    lines = []
    for k in range(3):
        write_nifti(root / f"v{k}.nii", volume(k, (10, 12, 14), "uint16"))
        lines.append({"path": f"v{k}.nii", "label": ["cat", "dog", "cat"][k], "dose": 1.5 * k,
                      "meta": {"scanner": "x"} if k else None})
    (root / "list.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    fastdata.convert(root / "list.jsonl", tmp_path / "c.lmdb", workers=0, progress=False)
    manifest = read_manifest(str(tmp_path / "c.lmdb"))
    schema = schema_of(manifest)
    assert isinstance(schema["label"], Int) and manifest["classes"] == ["cat", "dog"]
    assert isinstance(schema["dose"], Float) and schema["meta"].kind == "json"
    ds = fastdata.open_dataset(tmp_path / "c.lmdb")
    assert [ds[i]["label"] for i in range(3)] == [0, 1, 0] and ds[1]["meta"] == {"scanner": "x"}
    assert ds[0]["meta"] is None and ds[2]["dose"] == 3.0


NESTED = "[" * 200_000 + "]" * 200_000  # json.loads recurses once per level: past Python's limit


@pytest.mark.parametrize(("name", "text", "expect"), [
    ("list.jsonl", '{"image": "a.nii"}\n{"image": "b.nii", "x": ' + NESTED + "}\n",
     "list.jsonl:2: JSON nested too deeply"),
    ("list.jsonl", '{"image": ' + NESTED + "}\n", "list.jsonl:1: JSON nested too deeply"),
    ("dataset.json", '{"training": ' + NESTED + "}", "dataset.json"),
], ids=["volume-list-row", "first-row", "decathlon"])
def test_json_nested_too_deeply_is_one_line_naming_the_file(tmp_path, capsys, name, text, expect):
    """A list line or a ``dataset.json`` nesting 200000 arrays: one line naming the file (and the
    line), as any other unreadable one; before, the JSON parser's RecursionError escaped every
    place that reads such a file ahead of the scan, as "internal error: RecursionError"."""
    src = tmp_path / name
    src.write_text(text)
    assert main(["convert", str(src), str(tmp_path / "o.lmdb")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and expect in err and "internal error" not in err, err


def test_decathlon_dataset_json_pairs_4d_images_with_3d_labels(tmp_path):
    root = tmp_path / "Task01_BrainTumour"
    training = []
    arrays = {}
    for k in range(2):
        img = volume(k, (20, 18, 12, 2), "float32")
        lab = label_of(img[..., 0])
        write_nifti(root / "imagesTr" / f"BRATS_{k:03d}.nii.gz", img)
        write_nifti(root / "labelsTr" / f"BRATS_{k:03d}.nii.gz", lab)
        training.append({"image": f"./imagesTr/BRATS_{k:03d}.nii.gz", "label": f"./labelsTr/BRATS_{k:03d}.nii.gz"})
        arrays[f"imagesTr/BRATS_{k:03d}.nii.gz"] = (img, lab)
    body = {"name": "BRATS", "modality": {"0": "FLAIR", "1": "T1w"}, "labels": {"0": "background", "1": "edema"},
            "numTraining": 2, "training": training, "test": ["./imagesTs/BRATS_900.nii.gz"]}
    (root / "dataset.json").write_text(json.dumps(body))
    fastdata.convert(root / "dataset.json", tmp_path / "b.lmdb", workers=0, progress=False)
    manifest = read_manifest(str(tmp_path / "b.lmdb"))
    schema = schema_of(manifest)
    assert schema["image"].chunks == (48, 48, 48, 1) and schema["label"].chunks == (48, 48, 48)
    assert manifest["metadata"]["decathlon"]["labels"] == {"0": "background", "1": "edema"}
    assert "training" not in manifest["metadata"]["decathlon"]
    ds = fastdata.open_dataset(tmp_path / "b.lmdb")
    for rel, i in by_path(ds).items():
        img, lab = arrays[rel]
        assert np.array_equal(ds[i]["image"][...], img) and np.array_equal(ds[i]["label"][...], lab)


def test_bad_list_rows_are_all_reported_at_once(tmp_path):
    write_nifti(tmp_path / "a.nii", volume(0, (4, 4, 4)))
    (tmp_path / "l.csv").write_text("image,label\na.nii,a.nii\n,a.nii\na.nii,\na.nii\n")
    with pytest.raises(SourceError) as err:
        fastdata.convert(tmp_path / "l.csv", tmp_path / "o.lmdb", workers=0, progress=False)
    assert "3 bad row(s)" in str(err.value) and "line 3" in str(err.value) and "line 5" in str(err.value)


# --------------------------------------------------------------------------- reading bounded


def _encode_peak(samples, schema) -> int:
    """Peak bytes numpy allocates while sample 0 is read and compressed (tracemalloc sees numpy)."""
    tracemalloc.start()
    try:
        result = encode_file(samples, schema, 0, None)
        assert not isinstance(result, str), result
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_uncompressed_nii_is_read_slab_by_slab_and_nii_gz_whole(tmp_path):
    array = volume(0, (64, 96, 96), "int16")  # 1.2 MB; slabs of 8 x-planes are 147 kB
    peaks = {}
    for ext in (".nii", ".nii.gz"):
        write_nifti(tmp_path / ext[1:] / f"v{ext}", array)
        scan = scan_file_folder(str(tmp_path / ext[1:]), NIFTI_SUFFIXES, "NIfTI")
        layout = volume_layout(scan, (8, 32, 32))
        peaks[ext] = _encode_peak(VolumeSamples(scan, layout), volume_schema(scan, layout, "lz4"))
    assert peaks[".nii"] < array.nbytes / 3, peaks
    assert peaks[".nii.gz"] >= array.nbytes, peaks


def test_resume_fingerprint_is_stable_for_the_same_files_and_changes_with_them(tmp_path):
    """Float noise is where Blosc's output bytes differ from run to run: the fingerprint must not
    hash encoded chunks (a resume would be refused), but must see a rewritten file."""
    from fastdata.common.units import parse_size_spec
    from fastdata.format.backends.base import StorageSpec
    from fastdata.writer.resume import RunOptions

    for k in range(3):
        write_nifti(tmp_path / "v" / f"n{k}.nii.gz", volume(k, (64, 64, 40), "float32"))
    run = RunOptions("lmdb", StorageSpec(), parse_size_spec("1GiB"), False)

    def fingerprint() -> str:
        source = VolumeInput(str(tmp_path / "v"), None, None)
        source.plan(run, str(tmp_path / "out.lmdb"))
        return source.fingerprint(run)

    first = fingerprint()
    assert fingerprint() == first
    write_nifti(tmp_path / "v" / "n1.nii.gz", volume(7, (64, 64, 40), "float32"))
    assert fingerprint() != first


# --------------------------------------------------------------------------- the CLI


def test_cli_converts_a_nifti_folder_end_to_end(tmp_path, capsys, nifti_classes):
    root, files = nifti_classes
    dst = tmp_path / "cli.lmdb"
    assert main(["convert", str(root), str(dst), "--chunks", "16,16,16", "--codec", "zstd", "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"wrote 4 volumes to {dst} (lmdb, 1 shard(s))"
    assert "chunks 16,16,16, codec zstd" in out and "scl_slope" in out
    field = schema_of(read_manifest(str(dst)))["image"]
    assert (field.chunks, field.codec) == (CHUNKS, "zstd")
    ds = fastdata.open_dataset(dst)
    i = by_path(ds)["tumour/c.nii.gz"]
    assert np.array_equal(ds[i]["image"][...], raw_values(files["tumour/c.nii.gz"][0]))


@pytest.mark.parametrize("extra, expect", [
    (["--max-pixels", "2G"], "--max-pixels applies to TIFF images"),
    (["--chunks", "16,16,16,16,16"], "names 5 sides, but the volumes have 3 axes"),
    (["--chunks", "16,x,16"], "--chunks SIDES takes positive integers"),
    (["--chunks", "0,16,16"], "--chunks SIDES takes positive integers"),
    (["--lossless", "tiff"], "do(es) not apply to chunked arrays"),
])
def test_cli_volume_option_errors_are_one_line(tmp_path, capsys, nifti_classes, extra, expect):
    root, _ = nifti_classes
    assert main(["convert", str(root), str(tmp_path / "o.lmdb"), "--workers", "0", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fastdata: error: ") and expect in err, err
    assert not (tmp_path / "o.lmdb" / "manifest.json").exists()


def test_chunks_refused_for_an_ordinary_list(tmp_path, capsys):
    (tmp_path / "l.csv").write_text("path,label\na.jpg,cat\n")
    assert main(["convert", str(tmp_path / "l.csv"), str(tmp_path / "o.lmdb"), "--chunks", "8,8"]) == 2
    assert "apply to NIfTI volumes" in capsys.readouterr().err


def test_without_nibabel_the_error_names_the_extra(tmp_path, nifti_classes):
    root, _ = nifti_classes
    code = textwrap.dedent(f"""
        import sys
        sys.modules["nibabel"] = None
        from fastdata.cli.main import main
        sys.exit(main(["convert", {str(root)!r}, {str(tmp_path / "o.lmdb")!r}, "--workers", "0"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "nibabel" in lines[0] and "pip install 'fastdata[volumes]'" in lines[0]


# --------------------------------------------------------------------------- tiled TIFFs


@pytest.fixture
def slides(tmp_path):
    """Class folders of TIFFs: RGB tiled zlib, uint16 one-band tiled, RGB planar-separate tiled, RGB
    stripped; sizes not multiples of the tiles. Returns (root, {relpath: array as (H, W, C)})."""
    root = tmp_path / "slides"
    out = {}
    rgb = image(0, (700, 530, 3))
    write_tiff(root / "benign" / "a.tif", rgb, tile=(256, 256), compression="zlib", photometric="rgb")
    out["benign/a.tif"] = rgb
    gray = image(1, (300, 610), "uint16")
    write_tiff(root / "benign" / "b.tiff", gray, tile=(128, 128))
    out["benign/b.tiff"] = gray[..., None]
    planar = image(2, (290, 400, 3))
    write_tiff(root / "malignant" / "c.tif", np.moveaxis(planar, -1, 0), tile=(128, 256), planarconfig="separate",
               photometric="rgb", compression="zlib")
    out["malignant/c.tif"] = planar
    strips = image(3, (333, 257, 3))
    write_tiff(root / "malignant" / "d.tif", strips, rowsperstrip=50, photometric="rgb")
    out["malignant/d.tif"] = strips
    return root, out


@pytest.mark.parametrize("backend, workers", [("lmdb", 0), ("hdf5", 2)])
def test_tiff_folder_round_trips_tile_by_tile(tmp_path, slides, backend, workers):
    root, arrays = slides
    dst = tmp_path / ("s.lmdb" if backend == "lmdb" else "s.h5")
    report = fastdata.convert(root, dst, chunks="200,200", workers=workers, progress=False)
    assert report.images == 4 and report.rejected == 0
    manifest = read_manifest(str(dst))
    schema = schema_of(manifest)
    assert schema["image"].chunks == (200, 200, 3) and schema["image"].dtype == np.uint16
    assert manifest["classes"] == ["benign", "malignant"]
    ds = fastdata.open_dataset(dst)
    for rel, i in by_path(ds).items():
        want = arrays[rel]
        got = ds[i]["image"]
        assert got.shape == want.shape
        assert np.array_equal(got[...], want), rel
        assert np.array_equal(got[150:260, 190:411], want[150:260, 190:411])
        assert ds[i]["label"] == ["benign", "malignant"].index(rel.split("/")[0])


def test_one_band_tiffs_make_a_2d_store_and_a_region_decodes_only_its_tiles(tmp_path):
    gray = image(5, (1000, 1100), "uint8")
    write_tiff(tmp_path / "g" / "x.tif", gray, tile=(256, 256), compression="zlib")
    fastdata.convert(tmp_path / "g", tmp_path / "g.lmdb", max_pixels="2M", workers=0, progress=False)
    schema = schema_of(read_manifest(str(tmp_path / "g.lmdb")))
    assert schema["image"].chunks == (512, 512) and "label" not in schema.names
    assert np.array_equal(fastdata.open_dataset(tmp_path / "g.lmdb")[0]["image"][...], gray)
    tif, page, _, dtype = open_tiff(str(tmp_path / "g" / "x.tif").encode(), "x.tif", None)
    with tif:
        regions = TiffRegions(tif, page, dtype, 2, "x.tif")
        assert np.array_equal(regions[300:520, 10:300], gray[300:520, 10:300])
        assert regions.decoded == 4  # tiles (1, 0), (1, 1), (2, 0), (2, 1) of 4 x 5


def test_tiff_read_holds_a_slab_not_the_image(tmp_path):
    big = image(6, (2048, 1536, 3))  # 9.4 MB decoded; a slab of 128 rows is 0.6 MB
    write_tiff(tmp_path / "b" / "big.tif", big, tile=(128, 128), compression="zlib", photometric="rgb")
    scan = scan_file_folder(str(tmp_path / "b"), TIFF_SUFFIXES, "TIFF")
    layout = image_layout(scan, (128, 128), None)
    schema = fastdata.fields.Schema.of({"image": Chunked(layout.dtype, layout.chunks, codec="lz4")})
    peak = _encode_peak(TiffSamples(scan, layout, None), schema)
    assert peak < big.nbytes / 4, peak


def test_pixel_limit_names_the_option_and_max_pixels_lifts_it_explicitly(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200_000)  # workers=0: the limit of this process
    root = tmp_path / "wsi"
    big = image(7, (600, 500, 3))  # 300,000 pixels
    write_tiff(root / "x" / "big.tif", big, tile=(256, 256), photometric="rgb")
    write_tiff(root / "x" / "small.tif", image(8, (100, 100, 3)), tile=(256, 256), photometric="rgb")
    # as an ordinary image folder: refused by the bomb limit, and the summary names the way out
    plain = fastdata.convert(root, tmp_path / "p.lmdb", workers=0, progress=False)
    assert [p for p, _ in plain.rejected_items] == ["x/big.tif"]
    assert "decompression bomb" in plain.rejected_items[0][1]
    assert "chunks=512,512 and max_pixels=N" in plain.summary()
    with pytest.raises(RejectedInputError, match="max_pixels"):
        fastdata.convert(root, tmp_path / "q.lmdb", strict=True, workers=0, progress=False)
    # chunked, but the limit still holds without --max-pixels
    limited = fastdata.convert(root, tmp_path / "c.lmdb", chunks="256,256", workers=0, progress=False)
    assert [p for p, _ in limited.rejected_items] == ["x/big.tif"]
    assert "max_pixels=N" in limited.rejected_items[0][1] and "300,000 pixels" in limited.rejected_items[0][1]
    lifted = fastdata.convert(root, tmp_path / "l.lmdb", chunks="256,256", max_pixels="1M", workers=0,
                              progress=False)
    assert lifted.rejected == 0
    ds = fastdata.open_dataset(tmp_path / "l.lmdb")
    assert np.array_equal(ds[by_path(ds)["x/big.tif"]]["image"][...], big)


def test_corrupt_and_non_tiff_files_are_rejected_naming_them(tmp_path, capsys):
    root = tmp_path / "mixed" / "a"
    good = image(9, (300, 300, 3))
    write_tiff(root / "good.tif", good, tile=(128, 128), compression="zlib", photometric="rgb")
    path = write_tiff(root / "cut.tif", image(10, (600, 600, 3)), tile=(128, 128), compression="zlib",
                      photometric="rgb")
    with tifffile.TiffFile(str(path)) as tif:
        offset, count = tif.pages[0].dataoffsets[3], tif.pages[0].databytecounts[3]
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = b"\0" * count  # tile 3's zlib stream destroyed
    path.write_bytes(bytes(data))
    (root / "fake.tif").write_bytes(b"GIF89a not a tiff" * 10)
    image_root = tmp_path / "mixed"
    assert main(["convert", str(image_root), str(tmp_path / "m.lmdb"), "--chunks", "128,128", "--workers",
                 "0"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("wrote 1 images to") and "rejected 2 input(s)" in out
    reasons = dict(rejected_tsv(tmp_path / "m.lmdb"))
    assert sorted(reasons) == ["a/cut.tif", "a/fake.tif"]
    assert "corrupt TIFF data" in reasons["a/cut.tif"] and "not a readable TIFF file" in reasons["a/fake.tif"]
    assert np.array_equal(fastdata.open_dataset(tmp_path / "m.lmdb")[0]["image"][...], good)


@pytest.mark.slow
def test_large_tiff_worker_peak_rss_stays_near_one_slab(tmp_path):
    """8000x8000x3 uint8 (192 MB decoded) in 256x256 zlib tiles: the worker's peak RSS grows by
    far less than the image (measured ~30 MB over a small image's)."""
    script = textwrap.dedent("""
        import sys, threading, time, psutil, fastdata
        def main():
            peaks, done, me = {}, threading.Event(), psutil.Process()
            def poll():
                while not done.is_set():
                    for p in me.children(recursive=True):
                        try:
                            peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
                        except psutil.Error:
                            pass
                    time.sleep(0.02)
            t = threading.Thread(target=poll, daemon=True)
            t.start()
            fastdata.convert(sys.argv[1], sys.argv[2], chunks="512,512", codec="lz4", workers=1, progress=False)
            done.set(); t.join()
            print(max(peaks.values()))
        if __name__ == "__main__":
            main()
    """)
    (tmp_path / "rss.py").write_text(script)
    height = width = 8000
    (tmp_path / "big" / "a").mkdir(parents=True)
    with tifffile.TiffWriter(str(tmp_path / "big" / "a" / "x.tif"), bigtiff=True) as tw:
        def tiles():
            for ty in range(0, height, 256):
                for tx in range(0, width, 256):
                    yield image(ty // 256 * 40 + tx // 256, (256, 256, 3))
        tw.write(tiles(), shape=(height, width, 3), dtype=np.uint8, tile=(256, 256), compression="zlib",
                 photometric="rgb")
    write_tiff(tmp_path / "small" / "a" / "x.tif", image(0, (256, 256, 3)), tile=(256, 256), photometric="rgb")

    def peak(src):
        run = subprocess.run([sys.executable, str(tmp_path / "rss.py"), str(tmp_path / src),
                              str(tmp_path / f"{src}.lmdb")], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])

    growth = peak("big") - peak("small")
    assert growth < 80 << 20, growth  # the decoded image is 192 MB


# nightly (FASTDATA_NIGHTLY=1): the write session's resume after SIGKILL runs in CI through the folder,
# Python-sample, COCO, Parquet and distributed conversions; this source's own plan units resume the same way
@pytest.mark.slow
def test_sigkill_then_resume_of_a_nifti_folder_conversion_equals_a_clean_run(tmp_path):
    """``fastdata convert scans/ out.lmdb`` killed once a shard is finished, then run again with
    ``--resume``: the shards it kept are reused and the store equals an uninterrupted run's."""
    from helpers.procs import killed_resumed_and_clean

    scans = tmp_path / "scans"
    for i in range(40):
        write_nifti(scans / f"s{i:02d}.nii.gz", volume(i, (24, 20, 18)), affine_of(i))
    env = {**__import__("os").environ, "FASTDATA_MIN_SHARD_SIZE": "1"}

    def command(dst, *extra):
        return [sys.executable, "-m", "fastdata", "convert", str(scans), str(dst), "--chunks", "16,16,16",
                "--shard-size", "20000", "--workers", "2", *extra]

    dst = tmp_path / "out.lmdb"
    killed_resumed_and_clean(command, dst, tmp_path / "clean.lmdb", env)
    ds = fastdata.open_dataset(dst)
    for i, rel in ((by_path(ds)[f"s{i:02d}.nii.gz"], i) for i in range(40)):
        assert np.array_equal(ds[i]["image"][...], raw_values(scans / f"s{rel:02d}.nii.gz"))
    assert fastdata.verify(str(dst)).ok
