"""The public source objects (``fastdata.sources``) and ``fastdata.WriteOptions``: each source
class writes the very store the older keyword call writes (the whole manifest, shard checksums
included, compared), constructors name the parameter they refuse, ``convert`` stays within 12
parameters, and keywords that are unknown or do not apply are refused by name. The keyword calls
themselves are checked by the rest of the suite, unchanged."""

from __future__ import annotations

import inspect
import io
import json
import re
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_jpeg, make_tree
from helpers.native import dicom_tree
from helpers.nifti import affine_of, image, volume, write_nifti, write_tiff
from helpers.parquet import hf_rows, write_hf_parquet
from helpers.samples import SCHEMA, sample
from helpers.stores import general_records, store_records
from PIL import Image as PILImage

import fastdata
from fastdata import sources
from fastdata.format.manifest import read_manifest
from fastdata.synth_coco import make_coco

FAST = dict(workers=0, progress=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    tree = Path(make_tree(root / "tree", {"a": 4, "b": 3}, size=(48, 40), seed=7))
    rel = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.jpg"))
    (root / "list.csv").write_text("path,label\n" + "".join(f"tree/{r},{r.split('/')[0]}\n" for r in rel))
    rows = [{"path": f"img/{i}.jpg", "n": i, "label": ["x", "y"][i % 2]} for i in range(6)]
    for i, row in enumerate(rows):
        make_jpeg(root / row["path"], size=(20 + i, 16), seed=i)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    coco = make_coco(root / "coco", 5, seed=2, max_boxes=3, size=(40, 30))
    pngs = root / "pngs" / "x"
    pngs.mkdir(parents=True)
    for i in range(3):
        pixels = np.random.default_rng(i).integers(0, 255, (12, 10, 3), dtype=np.uint8)
        PILImage.fromarray(pixels).save(pngs / f"{i}.png")
    parquet = write_hf_parquet(root / "train.parquet", hf_rows(5))
    with tarfile.open(root / "shards.tar", "w") as tf:
        for i in range(4):
            for ext, data in (("jpg", (root / rows[i]["path"]).read_bytes()), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"s/{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    nifti = root / "nifti"
    for k in range(3):
        write_nifti(nifti / f"case{k}.nii.gz", volume(k, (10, 9, 8)), affine_of(k))
    tiffs = root / "tiffs" / "c"
    for k in range(2):
        write_tiff(tiffs / f"t{k}.tif", image(k, (40, 36)))
    dicom = root / "ct"
    dicom_tree(dicom, {"lung": 2, "liver": 1})
    return {"tree": tree, "list": root / "list.csv", "table": root / "rows.jsonl", "ann_file": Path(coco.ann_file),
            "image_dir": Path(coco.image_dir), "pngs": root / "pngs", "parquet": Path(parquet),
            "tar": root / "shards.tar", "nifti": nifti, "tiffs": root / "tiffs", "dicom": dicom}


def same_store(a: Path, b: Path) -> None:
    """The two stores are bit-identical: the whole manifest (shard checksums, storage, options,
    classes, schema) and every shard file."""
    ma, mb = read_manifest(str(a)), read_manifest(str(b))
    assert ma == mb
    for shard in ma["shards"]:
        assert (a / shard["name"]).read_bytes() == (b / shard["name"]).read_bytes()


# (source object, the older keyword call's source and keywords)
CASES = {
    "folder": (lambda i: sources.ImageFolder(i["tree"]), lambda i: (i["tree"], {})),
    "reencode": (lambda i: sources.ImageFolder(i["tree"], storage=sources.Reencode(24, quality=70)),
                 lambda i: (i["tree"], {"max_side": 24, "quality": 70})),
    "fixed-size pixels": (lambda i: sources.ImageFolder(i["tree"], storage=sources.FixedSizePixels((8, 6))),
                          lambda i: (i["tree"], {"raw": "8x6"})),
    "native-size pixels": (lambda i: sources.ImageFolder(i["tree"], storage=sources.NativeSizePixels(32)),
                           lambda i: (i["tree"], {"storage": "raw", "max_side": 32})),
    "mixed pixels": (lambda i: sources.ImageFolder(i["tree"], storage=sources.MixedPixels(32, fraction=0.5)),
                     lambda i: (i["tree"], {"storage": "mixed", "max_side": 32, "raw_fraction": 0.5})),
    "mixed pixels by budget": (
        lambda i: sources.ImageFolder(i["tree"], storage=sources.MixedPixels(32, budget="400kB")),
        lambda i: (i["tree"], {"storage": "mixed", "max_side": 32, "raw_budget": "400kB"})),
    "lossless": (lambda i: sources.ImageFolder(i["pngs"], storage=sources.Lossless(), image_mode="L"),
                 lambda i: (i["pngs"], {"lossless": "tiff", "image_mode": "L"})),
    "path,label list": (lambda i: sources.ImageFolder(i["list"]), lambda i: (i["list"], {})),
    "table": (lambda i: sources.Table(i["table"]), lambda i: (i["table"], {})),
    "table with schema": (lambda i: sources.Table(i["list"], schema="label:class"),
                          lambda i: (i["list"], {"schema": "label:class"})),
    "parquet": (lambda i: sources.Parquet(i["parquet"]), lambda i: (i["parquet"], {})),
    "webdataset": (lambda i: sources.WebDataset(i["tar"]), lambda i: (i["tar"], {})),
    "nifti": (lambda i: sources.Volumes(i["nifti"], chunks=(4, 4, 4), codec="blosc-zstd"),
              lambda i: (i["nifti"], {"chunks": "4,4,4", "codec": "blosc-zstd"})),
    "tiff": (lambda i: sources.Volumes(i["tiffs"], chunks=(16, 16), max_pixels=10_000),
             lambda i: (i["tiffs"], {"chunks": "16,16", "max_pixels": 10_000})),
    "dicom": (lambda i: sources.Dicom(i["dicom"], ["RescaleSlope", "PixelSpacing"], image_mode="L"),
              lambda i: (i["dicom"], {"dicom_tags": "RescaleSlope,PixelSpacing", "image_mode": "L"})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_source_object_writes_the_store_its_keyword_call_writes(inputs, tmp_path, case):
    make_source, keyword_call = CASES[case]
    src, keywords = keyword_call(inputs)
    fastdata.convert(src, tmp_path / "keywords.lmdb", shard_size="4kB", **keywords, **FAST)
    fastdata.convert(make_source(inputs), tmp_path / "object.lmdb",
                     fastdata.WriteOptions(shard_size="4kB", workers=0, progress=False))
    same_store(tmp_path / "keywords.lmdb", tmp_path / "object.lmdb")


def test_the_comparison_tells_stores_apart(inputs, tmp_path):
    """Control for the test above: another storage mode is another store."""
    fastdata.convert(inputs["tree"], tmp_path / "original.lmdb", **FAST)
    fastdata.convert(sources.ImageFolder(inputs["tree"], storage=sources.Reencode(24)), tmp_path / "small.lmdb",
                     **FAST)
    with pytest.raises(AssertionError):
        same_store(tmp_path / "original.lmdb", tmp_path / "small.lmdb")


def test_coco_and_samples_objects_write_what_convert_coco_and_write_do(inputs, tmp_path):
    fastdata.convert_coco(inputs["ann_file"], inputs["image_dir"], tmp_path / "a.lmdb", **FAST)
    fastdata.convert(sources.Coco(inputs["ann_file"], inputs["image_dir"]), tmp_path / "b.lmdb", **FAST)
    same_store(tmp_path / "a.lmdb", tmp_path / "b.lmdb")
    rows = [sample(i) for i in range(6)]
    fastdata.write(rows, tmp_path / "c.lmdb", SCHEMA, metadata={"k": 1}, **FAST)
    fastdata.convert(sources.Samples(rows, SCHEMA, metadata={"k": 1}), tmp_path / "d.lmdb", **FAST)
    same_store(tmp_path / "c.lmdb", tmp_path / "d.lmdb")
    fastdata.convert_table(inputs["table"], tmp_path / "e.lmdb", **FAST)
    fastdata.convert(sources.Table(inputs["table"]), tmp_path / "f.lmdb", **FAST)
    same_store(tmp_path / "e.lmdb", tmp_path / "f.lmdb")


def test_samples_are_strict_unless_told_and_coco_is_not(inputs, tmp_path):
    """``write``'s default (strict) is the Samples source's; an explicit strict=False overrides it."""
    rows = [sample(i) for i in range(4)]
    rows[2] = {**rows[2], "image": b"not an image"}
    with pytest.raises(fastdata.errors.RejectedInputError):
        fastdata.convert(sources.Samples(rows, SCHEMA), tmp_path / "strict.lmdb", **FAST)
    report = fastdata.convert(sources.Samples(rows, SCHEMA), tmp_path / "lenient.lmdb", strict=False, **FAST)
    assert report.images == 3 and report.rejected == 1
    assert len(general_records(tmp_path / "lenient.lmdb")) == 3


def test_options_and_keywords_combine_keywords_winning(inputs, tmp_path):
    options = fastdata.WriteOptions(workers=0, progress=False, shard_size="4kB")
    fastdata.convert(sources.ImageFolder(inputs["tree"]), tmp_path / "a.lmdb", options)
    with pytest.raises(fastdata.errors.StoreExistsError):
        fastdata.convert(sources.ImageFolder(inputs["tree"]), tmp_path / "a.lmdb", options)
    report = fastdata.convert(sources.ImageFolder(inputs["tree"]), tmp_path / "a.lmdb", options, overwrite=True,
                              shard_size="1MB")
    assert report.shards == 1 and len(store_records(tmp_path / "a.lmdb")[1]) == 7
    assert options.shard_size == "4kB" and not options.overwrite  # the object itself is unchanged


# --------------------------------------------------------------------------- the signature and its keywords


def test_convert_has_at_most_twelve_parameters():
    params = inspect.signature(fastdata.convert).parameters
    assert len(params) <= 12, list(params)
    assert list(params)[:3] == ["source", "dst", "options"]


def test_every_older_keyword_is_still_accepted():
    """The 29 keywords of the older signature: each is a parameter, a WriteOptions field or a
    source keyword of convert (older calls are run unchanged by the rest of the suite)."""
    older = ("format workers shard_size max_side quality raw lossless image_mode dicom_tags strict resume overwrite "
             "append add_classes progress lmdb_map_size chunk_size schema storage_options staging_dir chunks codec "
             "max_pixels image_column storage raw_fraction raw_budget").split()
    assert len(older) == 27  # plus src and dst
    from fastdata.writer.api import SOURCE_KEYWORDS, WRITE_KEYWORDS

    known = set(inspect.signature(fastdata.convert).parameters) | set(WRITE_KEYWORDS) | set(SOURCE_KEYWORDS)
    assert set(older) - known == {"chunk_size"}  # the deprecated name of task_size, still taken


def test_an_unknown_keyword_is_a_type_error_naming_it(inputs, tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_sides'"):
        fastdata.convert(inputs["tree"], tmp_path / "x.lmdb", max_sides=3, **FAST)
    with pytest.raises(TypeError, match="write\\(\\) got an unexpected keyword argument 'max_side'"):
        fastdata.write([sample(0)], tmp_path / "x.lmdb", max_side=3)
    assert not (tmp_path / "x.lmdb").exists()


@pytest.mark.parametrize("src, keywords, message", [
    ("parquet", {"max_side": 64}, "max_side=64 do(es) not apply to Parquet files"),
    ("tar", {"image_mode": "L"}, 'image_mode="L" do(es) not apply to WebDataset shards'),
    ("nifti", {"quality": 80}, "quality=80 do(es) not apply to chunked arrays"),
    ("table", {"raw": "8x8"}, 'raw="8x8" do(es) not apply to a list with more fields than path,label'),
    ("dicom", {"storage": "raw", "max_side": 64}, 'dicom_tags keeps each DICOM file\'s bytes as they are: leave out '
     'max_side=64, storage="raw"'),
])
def test_a_keyword_of_another_kind_is_refused_naming_it_and_the_kind(inputs, tmp_path, src, keywords, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fastdata.convert(inputs[src], tmp_path / "x.lmdb", dicom_tags="RescaleSlope" if src == "dicom" else None,
                         **keywords, **FAST)
    assert not (tmp_path / "x.lmdb").exists()


def test_source_keywords_are_refused_beside_a_source_object(inputs, tmp_path):
    with pytest.raises(ValueError, match="max_side do\\(es\\) not apply to a source object \\(ImageFolder"):
        fastdata.convert(sources.ImageFolder(inputs["tree"]), tmp_path / "x.lmdb", max_side=32, **FAST)
    fastdata.convert(sources.ImageFolder(inputs["tree"]), tmp_path / "x.lmdb", max_side=None, **FAST)  # not given


def test_a_source_of_the_wrong_kind_says_so(inputs, tmp_path):
    with pytest.raises(ValueError, match="not Parquet files"):
        fastdata.convert(sources.Parquet(inputs["tree"]), tmp_path / "x.lmdb", **FAST)
    with pytest.raises(ValueError, match="not WebDataset shards"):
        fastdata.convert(sources.WebDataset(inputs["table"]), tmp_path / "x.lmdb", **FAST)
    with pytest.raises(ValueError, match="is a folder"):
        fastdata.convert(sources.Table(inputs["tree"]), tmp_path / "x.lmdb", **FAST)
    with pytest.raises(TypeError, match="fastdata.sources.Samples"):
        fastdata.convert([sample(0)], tmp_path / "x.lmdb", **FAST)


# --------------------------------------------------------------------------- constructors name what they refuse


@pytest.mark.parametrize("make, error, name", [
    (lambda: sources.ImageFolder(3), TypeError, "path"),
    (lambda: sources.ImageFolder("x", storage="raw"), TypeError, "storage"),
    (lambda: sources.ImageFolder("x", image_mode="CMYK"), ValueError, "image_mode"),
    (lambda: sources.Reencode(0), ValueError, "max_side"),
    (lambda: sources.Reencode(64, quality=101), ValueError, "quality"),
    (lambda: sources.Reencode(64.5), TypeError, "max_side"),
    (lambda: sources.Lossless("png"), ValueError, "codec"),
    (lambda: sources.FixedSizePixels((8, 0)), ValueError, "size"),
    (lambda: sources.FixedSizePixels("8x8"), TypeError, "size"),
    (lambda: sources.NativeSizePixels(31), ValueError, "max_side"),
    (lambda: sources.NativeSizePixels(64, budget="lots"), ValueError, "budget"),
    (lambda: sources.MixedPixels(64), ValueError, "fraction"),
    (lambda: sources.MixedPixels(64, fraction=0.5, budget="1GB"), ValueError, "budget"),
    (lambda: sources.MixedPixels(64, fraction=1.5), ValueError, "fraction"),
    (lambda: sources.MixedPixels(64, fraction=float("nan")), ValueError, "fraction"),
    (lambda: sources.Dicom("x", 3), TypeError, "tags"),
    (lambda: sources.Coco("a.json", None), TypeError, "images"),
    (lambda: sources.Parquet("x", image_columns=3), TypeError, "image_columns"),
    (lambda: sources.Volumes("x", codec="gzip"), ValueError, "codec"),
    (lambda: sources.Volumes("x", chunks=3.5), TypeError, "chunks"),
    (lambda: sources.Samples("data.csv"), TypeError, "samples"),
    (lambda: sources.Samples([], metadata=[1]), TypeError, "metadata"),
    (lambda: sources.Samples([], split="train"), ValueError, "split"),
    (lambda: fastdata.WriteOptions(workers=-1), ValueError, "workers"),
    (lambda: fastdata.WriteOptions(workers=True), TypeError, "workers"),
    (lambda: fastdata.WriteOptions(task_size=0), ValueError, "task_size"),
    (lambda: fastdata.WriteOptions(shard_size="big"), ValueError, "shard_size"),
    (lambda: fastdata.WriteOptions(format="zip"), ValueError, "format"),
    (lambda: fastdata.WriteOptions(resume="yes"), TypeError, "resume"),
    (lambda: fastdata.WriteOptions(storage_options="k=v"), TypeError, "storage_options"),
])
def test_constructors_refuse_bad_values_naming_the_parameter(make, error, name):
    with pytest.raises(error, match=name):
        make()


def test_good_values_are_accepted_and_kept():
    """Control for the refusals above: the same constructors with good values."""
    assert sources.FixedSizePixels(8).size == (8, 8) and sources.FixedSizePixels((8, 6)).size == (8, 6)
    assert sources.Parquet("x", image_columns="a, b,a").image_columns == ("a", "b")
    assert sources.Dicom("x", "RescaleSlope,PixelSpacing").tags == ("RescaleSlope", "PixelSpacing")
    assert sources.Volumes("x", chunks="4,4,4", max_pixels="2G").chunks == (4, 4, 4)
    assert sources.MixedPixels(64, budget="1GB").keywords()["raw_budget"] == "1GB"
    assert fastdata.WriteOptions(workers=0, shard_size="2MiB", format="h5").workers == 0


# --------------------------------------------------------------------------- task_size and its older name


def test_chunk_size_is_a_deprecated_name_of_task_size(inputs, tmp_path):
    with pytest.warns(DeprecationWarning, match="task_size"):
        assert fastdata.WriteOptions(chunk_size=4).task_size == 4
    with pytest.warns(DeprecationWarning, match="task_size") as caught:
        fastdata.convert(inputs["tree"], tmp_path / "a.lmdb", chunk_size=2, **FAST)
    assert caught[0].filename == __file__  # the warning points at the caller
    with pytest.warns(DeprecationWarning, match="task_size") as caught:
        fastdata.write([sample(i) for i in range(3)], tmp_path / "c.lmdb", SCHEMA, chunk_size=2, **FAST)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastdata.convert(inputs["tree"], tmp_path / "b.lmdb", task_size=2, **FAST)
    same_store(tmp_path / "a.lmdb", tmp_path / "b.lmdb")
    with pytest.raises(ValueError, match="give task_size only"), pytest.warns(DeprecationWarning):
        fastdata.WriteOptions(chunk_size=4, task_size=8)
