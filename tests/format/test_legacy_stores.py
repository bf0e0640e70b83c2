"""Stores written by every earlier layout and version read bit-exact with the current readers.

Each fixture under tests/fixtures/legacy/ is a tiny store written by an old fastdata commit
(``store.tar.gz``) and ``expected.json``: what that commit's own readers returned from it, every
sample described by ``digest.describe`` (pixel and array bytes as sha256 with dtype and shape,
ints, floats and strings by type and exact repr). ``head-*`` fixtures are the current layouts,
written by the commit named in their ``expected.json``. tests/fixtures/legacy/make_fixtures.py
says which commit made which fixture and why, and regenerates them.

Each store is unpacked into ``tmp_path`` and made read-only; after the reads its files are
checked unchanged (readers and verify write nothing into a store).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import warnings

import numpy as np
import pytest

import fastdata
from fastdata.errors import FastdataError

LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fixtures", "legacy")
sys.path.insert(0, LEGACY)  # digest.py, shared with the generator (which runs under old commits)

from digest import describe, describe_classes, describe_targets  # noqa: E402
from make_fixtures import ARCHIVE, FIXTURES, build, sample_path  # noqa: E402

NAMES = sorted(n for n in os.listdir(LEGACY) if os.path.isfile(os.path.join(LEGACY, n, "expected.json")))

#: fixtures whose current reading differs from the old one: name -> the difference (a bug). (The
#: HDF5 shards of the first commits, 7b5ad17..66eaed2, hold their payload chunked: refused from
#: 82851c8 until the reader read them through h5py again.)
KNOWN_DIFFERENCES: dict[str, str] = {}

#: samples the old reader refused with one error class and the current one with another:
#: name -> sorted [(read, old class, current class)]. b49de8f called a DICOM or 5-band TIFF image
#: read in image_mode="RGB" a damaged record (CorruptRecordError: "cannot decode DICOM image");
#: since then it is an ImageModeError naming the mode (the record is fine; still a refusal)
_RGB = "g4-lmdb-native: LMDBImageDataset(**{'image_mode': 'RGB'}): sample"
KNOWN_ERROR_CHANGES: dict[str, list] = {
    "g4-lmdb-native": [(f"{_RGB} {i}", "CorruptRecordError", "ImageModeError") for i in (0, 1, 4)],
}


def _expected(name: str) -> dict:
    with open(os.path.join(LEGACY, name, "expected.json")) as fh:
        return json.load(fh)


def _unpack(name: str, dst) -> str:
    """The fixture's store unpacked under ``dst``, its files and folders read-only."""
    with tarfile.open(os.path.join(LEGACY, name, ARCHIVE)) as tar:
        tar.extractall(dst, filter="data")
    (store,) = [os.path.join(dst, n) for n in os.listdir(dst) if n.startswith("store.")]
    for root, _, files in os.walk(store):
        for f in files:
            os.chmod(os.path.join(root, f), 0o444)
    for root, dirs, _ in os.walk(store, topdown=False):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o555)
    os.chmod(store, 0o555)
    return store


def _snapshot(store: str) -> dict:
    """Every file under ``store`` and its sha256."""
    out = {}
    for root, _, files in os.walk(store):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, store)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _samples_kept(store: str, n: int) -> int:
    """How many of ``ds.samples`` are compared: not those of an append (their paths are joined
    with the first conversion's source, by old and current readers alike: a bug of its own, not
    a reading difference) nor any of a merged store (the source ``fastdata.merge`` names no folder)."""
    with open(os.path.join(store, "manifest.json")) as fh:
        options = json.load(fh)["options"]
    if options.get("source") == "fastdata.merge":
        return 0
    return n - sum(entry["samples"] for entry in options.get("appends", []))


def _reader(name: str):
    return fastdata.open_dataset if name == "open_dataset" else getattr(fastdata, name)


def _params() -> list:
    return [pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_DIFFERENCES[name])]
                         if name in KNOWN_DIFFERENCES else []) for name in NAMES]


def test_every_fixture_is_listed_and_packed():
    """The generator's table and the fixtures on disk agree (a fixture cannot go missing silently)."""
    assert NAMES == sorted(FIXTURES)
    for name in NAMES:
        expected = _expected(name)
        assert expected["name"] == name and expected["commit"] == FIXTURES[name][0]
        assert os.path.getsize(os.path.join(LEGACY, name, ARCHIVE)) < 100_000


@pytest.mark.parametrize("name", _params())
def test_legacy_store_reads_as_its_writer_read_it(name, tmp_path):
    expected = _expected(name)
    store = _unpack(name, tmp_path)
    before = _snapshot(store)
    refusals = []
    for read in expected["reads"]:
        what = f"{name}: {read['reader']}(**{read['kwargs']})"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. ImagesReducedWarning for the RGBA image
            if "error" in read:  # the old reader refused the store: so must this one
                with pytest.raises(FastdataError) as refused:
                    _reader(read["reader"])(store, **read["kwargs"])
                refusals.append((what, read["error"], type(refused.value).__name__))
                continue
            ds = _reader(read["reader"])(store, **read["kwargs"])
            public = getattr(fastdata, read["type"], None)
            if isinstance(public, type):  # the class the old reader returned, where it is public
                assert isinstance(ds, public), what
            assert len(ds) == read["len"], what
            for i, want in enumerate(read["items"]):
                if "error" in want:  # the old reader refused this sample: so must this one
                    with pytest.raises(FastdataError) as refused:
                        ds[i]
                    refusals.append((f"{what}: sample {i}", want["error"], type(refused.value).__name__))
                    continue
                assert describe(ds[i]) == want, f"{what}: sample {i}"
            if "classes" in read:
                assert describe_classes(ds.classes) == read["classes"], what
            if "targets" in read:
                assert describe_targets(ds.targets) == read["targets"], what
            if "samples" in read:
                got = [[sample_path(p), int(t)] for p, t in ds.samples]
                keep = _samples_kept(store, len(got))
                assert got[:keep] == read["samples"][:keep], what
    # a refusal may name its reason by another error class than the old reader did, but only as listed
    changed = sorted((what, old, new) for what, old, new in refusals if old != new)
    assert changed == KNOWN_ERROR_CHANGES.get(name, []), f"{name}: refusals now raise other errors"
    info = fastdata.info(store)
    for key, want in expected["info"].items():
        got = info[key]
        if isinstance(want, dict):  # keys added later (e.g. storage.raw_fraction) may be there too
            got = {k: got.get(k) for k in want}
        assert json.loads(json.dumps(got)) == want, f"{name}: info[{key!r}]"
    assert expected["verify_ok"]
    report = fastdata.verify(store, decode=True)
    assert report.ok, f"{name}: {report.problems}"
    assert _snapshot(store) == before, f"{name}: reading changed the store's files"


@pytest.mark.parametrize("name", [n for n in NAMES if FIXTURES[n][1] == "coco"])
def test_coco_ground_truth_images(name, tmp_path):
    """``ds.coco`` lists the annotation file's images: as stored (``image_info``, since 81c93ed),
    else rebuilt from ``image_id``, the path and the size (older stores)."""
    pytest.importorskip("pycocotools")
    expected = _expected(name)
    ds = fastdata.open_dataset(_unpack(name, tmp_path))
    stored = "image_info" in [f["name"] for f in expected["info"]["schema"]]
    source = expected["made"]["images"]
    want = source if stored else [{k: e[k] for k in ("id", "file_name", "height", "width")} for e in source]
    assert ds.coco.dataset["images"] == want
    assert sorted(ds.coco.getImgIds()) == [e["id"] for e in source]


def test_one_pixel_changes_the_description():
    """Control: the descriptions compared above see a single changed pixel value and a dtype."""
    from PIL import Image

    pixels = np.zeros((3, 4, 3), np.uint8)
    flipped = pixels.copy()
    flipped[2, 3, 1] = 1
    assert describe(Image.fromarray(pixels)) != describe(Image.fromarray(flipped))
    assert describe(pixels) != describe(flipped)
    assert describe(pixels) != describe(pixels.astype(np.int8))
    assert describe((1, 2)) != describe([1, 2]) and describe(1) != describe(np.int64(1)) != describe(1.0)


def _layout(store: str) -> dict:
    """What a store's files are made of, without what differs from one conversion to the next
    (checksums, source paths, fingerprints, file sizes): the manifest's keys and values that
    describe the store, and per shard the LMDB databases, header and index keys, or the HDF5
    attributes and datasets (dtype, shape)."""
    import h5py
    import lmdb
    import msgpack

    with open(os.path.join(store, "manifest.json")) as fh:
        m = json.load(fh)
    out = {"keys": sorted(m), "options": sorted(m["options"]),
           "store_index": m.get("store_index", {}).get("name"),
           **{k: m.get(k) for k in ("format", "version", "backend", "storage", "classes", "class_counts",
                                     "num_samples", "schema", "image_modes", "class_tables")},
           "shards": [{k: v for k, v in s.items() if k not in ("xxh", "bytes")} for s in m["shards"]], "files": []}
    for shard in m["shards"]:
        path = os.path.join(store, shard["name"])
        if m["backend"] == "lmdb":
            env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=8)
            try:
                with env.begin() as txn:
                    dbs = [k for k, _ in txn.cursor()]
                    index = env.open_db(b"index", txn=txn, create=False)
                    keys = [k for k, _ in txn.cursor(db=index)]
                    header = msgpack.unpackb(txn.get(b"header", db=index))
                    counts = {db: txn.stat(env.open_db(db, txn=txn, create=False))["entries"] for db in dbs}
            finally:
                env.close()
            out["files"].append({"dbs": counts, "header": header, "index": keys})
        else:
            with h5py.File(path, "r", locking=False) as f:
                names: list[str] = []
                f.visit(names.append)
                datasets = {n: [f[n].dtype.str, list(f[n].shape)] for n in names if isinstance(f[n], h5py.Dataset)}
                out["files"].append({"attrs": {k: int(v) if isinstance(v, np.integer) else str(v)
                                               for k, v in f.attrs.items()}, "datasets": datasets})
    return out


@pytest.mark.parametrize("name", ["head-lmdb-original", "head-hdf5-general"])
def test_current_writer_writes_the_head_layout(name, tmp_path):
    """The current writer, given the fixture's inputs, writes the layout of its ``head-*`` fixture
    (databases, headers, index keys, datasets, manifest) and the same samples: a change to the
    format shows here, and is then deliberate (regenerate the ``head-*`` fixtures, say so in
    docs/FORMAT.md)."""
    fixture = _unpack(name, tmp_path / "fixture")
    fresh = str(tmp_path / os.path.basename(fixture))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(name, fresh, src_root=str(tmp_path / "src"))
        assert _layout(fresh) == _layout(fixture)
        want = _expected(name)["reads"][0]["items"]
        ds = fastdata.open_dataset(fresh)
        assert [describe(ds[i]) for i in range(len(ds))] == want
