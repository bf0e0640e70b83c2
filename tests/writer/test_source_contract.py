"""The write-source contract (issue 37, item 4): every kind of input the write session takes (each
:class:`fastdata.writer.sources.base.WriteSource`) runs the same five tests through the public
API, as torchvision's ``DatasetTestCase`` and zarr's ``StoreTests`` run one suite over every
dataset or store; on an LMDB store in CI, on an HDF5 store too nightly (``slow``):

1. plan / convert / verify: the expected number of samples; ``verify`` passes, with and without
   decoding; one byte flipped inside a record fails it, naming the shard (the control).
2. fingerprint: the same input converted again (made again in another folder) gives the same
   shards (checksums); ``resume=True`` over that store is accepted with the same input (the
   control) and refused with one item changed (``ResumeMismatchError``). An iterable cannot
   resume: its documented refusal is the contract.
3. interrupt and resume: a conversion SIGKILLed once a shard is finished, then ``resume=True``,
   gives the store of an uninterrupted one (shard checksums and every sample).
4. append: part A, then part B appended, reads sample by sample as A's then B's source values,
   and holds the samples of the store of A+B.
5. read back: every sample read by ``open_dataset`` equals the source's own values (pixels decoded
   with Pillow, arrays read with nibabel/tifffile/pydicom, fields as written).

A case is one small input kind (:class:`Case`, :data:`CASES`; every concrete WriteSource has one,
which a test checks): how to make it (every item a pure function of its number, so that a part is
the items of a range and A+B is the whole), how to convert it, how to change one item, and what
its samples hold. The change is one the source's documented fingerprint covers: names, labels and
sizes of files (docs/RELIABILITY.md), a row of a list or a Parquet file; for Python samples and
``datasets.Dataset`` one of the samples their fingerprint reads (first, quartiles, last). A case
whose library is missing fails under ``CI=true`` and is skipped elsewhere, with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.images import photo_array
from helpers.native import write_dicom
from helpers.nifti import affine_of, image, volume, write_nifti, write_tiff
from PIL import Image as PILImage

import fastdata
from fastdata.errors import ResumeMismatchError
from fastdata.fields import Image, Int, NDArray, Schema
from fastdata.format.manifest import read_manifest
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR

FAST = dict(workers=0, progress=False)
CLASSES = ("ant", "bee", "cat")


def jpeg_bytes(i: int, size=(16, 12)) -> bytes:
    """Item ``i``'s JPEG: photo-like, ``size=(w, h)``, distinct per ``i``."""
    buf = io.BytesIO()
    PILImage.fromarray(photo_array(size, seed=i)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def pixels(data: bytes | str | os.PathLike, mode: str = "RGB") -> np.ndarray:
    """An encoded image (bytes or a file) decoded by Pillow."""
    with PILImage.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
        return np.asarray(im.convert(mode))


def plain(value: Any) -> Any:
    """A read value as plain, comparable data: images as their pixels, arrays (numpy, torch,
    chunked) as numpy arrays, containers recursively."""
    if isinstance(value, PILImage.Image):
        return np.asarray(value)
    if hasattr(value, "numpy") and callable(value.numpy):
        return value.numpy()
    if type(value).__name__ == "ChunkedArray":
        return np.asarray(value[...])
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def same(a: Any, b: Any, where: str = "") -> None:
    """``a == b`` for plain data (NaN equal to NaN; arrays by dtype, shape and values); fails naming where."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{where}: values differ"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def key(value: Any) -> bytes:
    """A sortable digest of a plain value (to compare two stores as multisets of samples)."""
    if isinstance(value, np.ndarray):
        return repr((value.dtype.str, value.shape)).encode() + value.tobytes()
    if isinstance(value, dict):
        return b"{" + b",".join(k.encode() + b":" + key(v) for k, v in sorted(value.items())) + b"}"
    if isinstance(value, list | tuple):
        return b"[" + b",".join(key(v) for v in value) + b"]"
    return repr(value).encode()


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One kind of input, small: ``build(root, items)`` makes the input holding the items
    numbered ``items`` (a ``range``) under ``root`` and returns what ``convert(input, dst,
    **options)`` takes; ``change(input, root)`` rewrites one item (a file's bytes to another size,
    a row) and returns the input to resume with; ``expected(input)`` lists the source's own values
    of its samples, in store order, as :func:`plain` makes a read item."""

    name: str
    #: the WriteSource subclass this case runs through
    source: str
    count: int
    build: Callable[[Path, range], Any]
    convert: Callable[..., Any]
    change: Callable[[Any, Path], Any]
    expected: Callable[[Any], list]
    #: where B starts when the items are split into A and B for the append test
    split: int = 0
    needs: tuple[str, ...] = ()
    shard_size: str = "4kB"
    #: None: resumable; else the exception type its documented refusal of resume=True raises
    resume_refused: type[BaseException] | None = None
    #: what the change test changes (named when a resume accepts it)
    changed: str = ""
    #: None, or why the store depends on where the input is (then the same input made again in
    #: another folder gives other shards; the determinism check converts it where it was)
    keeps_input_paths: str | None = None
    marks: Sequence[Any] = field(default_factory=tuple)


def _convert_path(inp, dst, **options):
    return fastdata.convert(inp, dst, **{**FAST, **options})


def _rewrite_jpeg(path: Path) -> None:
    """Another image in ``path``, of another size (what resume compares: names, labels, sizes)."""
    path.write_bytes(jpeg_bytes(999, size=(20, 12)))


# -- an image folder (FolderInput)

def folder_build(root: Path, items: range) -> Path:
    for i in items:
        path = root / "tree" / CLASSES[i % 3] / f"{CLASSES[i % 3]}_{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(i))
    return root / "tree"


def folder_expected(tree: Path) -> list:
    return [(pixels(p), CLASSES.index(c.name)) for c in sorted(tree.iterdir()) for p in sorted(c.iterdir())]


def folder_change(tree: Path, root: Path) -> Path:
    _rewrite_jpeg(tree / "bee" / "bee_007.jpg")
    return tree


# -- an image folder on the S3 test server (RemoteFolderInput)

#: the bucket of the remote case (set by the ``case`` fixture from the session's S3 server), and
#: each uploaded prefix's local tree (what ``expected`` and ``change`` look at)
REMOTE: dict[str, Any] = {"bucket": None, "trees": {}}


def remote_folder_build(root: Path, items: range) -> str:
    """The folder's tree uploaded to a prefix of its own; returns its URL."""
    from fastdata.remote.location import RemoteLocation

    tree = folder_build(root, items)
    url = f"{REMOTE['bucket']}/f{len(REMOTE['trees'])}"
    loc = RemoteLocation(url)
    for path in sorted(tree.rglob("*.jpg")):
        loc.upload(str(path), path.relative_to(tree).as_posix())
    REMOTE["trees"][url] = tree
    return url


def remote_folder_expected(url: str) -> list:
    return folder_expected(REMOTE["trees"][url])


def remote_folder_change(url: str, root: Path) -> str:
    from fastdata.remote.location import RemoteLocation

    tree = REMOTE["trees"][url]
    folder_change(tree, root)
    RemoteLocation(url).upload(str(tree / "bee" / "bee_007.jpg"), "bee/bee_007.jpg")
    return url


# -- a path,label list (FolderInput)

def list_build(root: Path, items: range) -> Path:
    folder_build(root, items)
    lines = [f"tree/{CLASSES[i % 3]}/{CLASSES[i % 3]}_{i:03d}.jpg,{CLASSES[i % 3]}\n" for i in items]
    (root / "list.csv").write_text("path,label\n" + "".join(lines))
    return root / "list.csv"


def list_expected(path: Path) -> list:
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]]
    names = sorted({label for _, label in rows})
    return [(pixels(path.parent / rel), names.index(label)) for rel, label in rows]


def list_change(path: Path, root: Path) -> Path:
    lines = path.read_text().splitlines(keepends=True)
    lines[8] = lines[8].replace(",bee", ",ant")  # item 7: another label
    path.write_text("".join(lines))
    return path


# -- a list with more fields than path,label (TableInput)

def table_build(root: Path, items: range) -> Path:
    rows = []
    for i in items:
        make = root / "img" / f"{i:03d}.jpg"
        make.parent.mkdir(parents=True, exist_ok=True)
        make.write_bytes(jpeg_bytes(i))
        rows.append({"path": f"img/{i:03d}.jpg", "n": i * 3 - 7, "caption": f"item {i}", "label": CLASSES[i % 3]})
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "rows.jsonl"


def table_expected(path: Path) -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    names = sorted({r["label"] for r in rows})
    return [{"image": pixels(path.parent / r["path"]), "n": r["n"], "caption": r["caption"],
             "label": names.index(r["label"])} for r in rows]


def table_change(path: Path, root: Path) -> Path:
    rows = path.read_text().splitlines(keepends=True)
    rows[7] = rows[7].replace('"n": 14', '"n": 15')
    path.write_text("".join(rows))
    return path


# -- a JSONL list on the S3 test server (RemoteTableInput)

def remote_table_build(root: Path, items: range) -> str:
    """The list and its images uploaded to a prefix of their own; returns the list's URL."""
    from fastdata.remote.location import RemoteLocation

    path = table_build(root, items)
    url = f"{REMOTE['bucket']}/t{len(REMOTE['trees'])}"
    loc = RemoteLocation(url)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        loc.upload(str(file), file.relative_to(root).as_posix())
    REMOTE["trees"][f"{url}/rows.jsonl"] = path
    return f"{url}/rows.jsonl"


def remote_table_expected(url: str) -> list:
    return table_expected(REMOTE["trees"][url])


def remote_table_change(url: str, root: Path) -> str:
    from fastdata.remote.location import RemoteLocation

    path = REMOTE["trees"][url]
    table_change(path, root)
    RemoteLocation(url.rsplit("/", 1)[0]).upload(str(path), "rows.jsonl")
    return url


# -- Python samples (MapInput, IterInput)

SAMPLE_SCHEMA = Schema.of({"image": Image(), "label": Int("int64"), "vec": NDArray("float32", (3,))})


def python_sample(i: int) -> dict:
    return {"image": jpeg_bytes(i), "label": i % 3, "vec": np.arange(3, dtype=np.float32) * i - 0.5}


def python_build(root: Path, items: range) -> list:
    return [python_sample(i) for i in items]


def python_expected(samples: list) -> list:
    return [{"image": pixels(s["image"]), "label": s["label"], "vec": s["vec"]} for s in samples]


def python_change(samples: list, root: Path) -> list:
    # A map-style dataset's fingerprint hashes the encoded samples at 0, n/4, n/2, 3n/4 and n-1
    # (documented: fastdata.writer.sources.python._fingerprint, "a change elsewhere in a large
    # dataset is not detected"): the change is one of them.
    return [python_sample(100), *samples[1:]]


def map_convert(samples, dst, **options):
    return fastdata.write(samples, dst, SAMPLE_SCHEMA, **{**FAST, **options})


def iter_convert(samples, dst, **options):
    return fastdata.write(iter(samples), dst, SAMPLE_SCHEMA, **{**FAST, **options})


# -- Parquet files in the Hugging Face layout (ParquetInput)

def parquet_rows(items: range) -> dict:
    return {
        "image": [{"bytes": jpeg_bytes(i), "path": f"img_{i:03d}.jpg"} for i in items],
        "label": [i % 3 for i in items],
        "idx": [i * 3 - 7 for i in items],
        "score": [float("nan") if i == 1 else float(np.float32(i / 7)) for i in items],
        "caption": [f"photo {i} \N{SNOWMAN}" for i in items],
    }


def parquet_build(root: Path, items: range) -> Path:
    """A Hub-style folder of ``train-0000k-of-00002.parquet`` files, the items split between the two."""
    from helpers.parquet import write_hf_parquet

    half = items.start + len(items) // 2
    for k, part in enumerate((range(items.start, half), range(half, items.stop))):
        write_hf_parquet(root / "data" / f"train-{k:05d}-of-00002.parquet", parquet_rows(part), row_group_size=4)
    return root / "data"


def parquet_expected(folder: Path) -> list:
    import pyarrow.parquet as pq

    rows = [r for f in sorted(folder.iterdir()) for r in pq.read_table(f).to_pylist()]
    return [{"image": pixels(r["image"]["bytes"]), "label": r["label"], "idx": r["idx"],
             "score": r["score"], "caption": r["caption"]} for r in rows]


def parquet_change(folder: Path, root: Path) -> Path:
    import pyarrow.parquet as pq
    from helpers.parquet import write_hf_parquet

    path = folder / "train-00000-of-00002.parquet"
    rows = pq.read_table(path).to_pydict()
    rows["caption"][7] = "another caption"
    write_hf_parquet(path, rows, row_group_size=4)
    return folder


# -- a datasets.Dataset (DatasetInput)

def hf_build(root: Path, items: range):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES)),
                                  "idx": datasets.Value("int32")})
    return datasets.Dataset.from_dict({"image": [{"bytes": jpeg_bytes(i), "path": None} for i in items],
                                       "label": [i % 3 for i in items], "idx": [i * 3 - 7 for i in items]},
                                      features=features)


def hf_expected(ds) -> list:
    rows = ds.with_format("arrow")[:].to_pylist()
    return [{"image": pixels(r["image"]["bytes"]), "label": r["label"], "idx": r["idx"]} for r in rows]


def hf_change(ds, root: Path):
    # As a map-style dataset, a Dataset's fingerprint reads the rows at 0, n/4, n/2, 3n/4 and n-1
    # (documented in DatasetInput.fingerprint): the change is one of them.
    return ds.map(lambda row, i: {"idx": 1000 if i == 0 else row["idx"]}, with_indices=True)


def write_convert(ds, dst, **options):
    return fastdata.write(ds, dst, **{**FAST, **options})


def iterable_dataset_convert(ds, dst, **options):
    return fastdata.write(ds.to_iterable_dataset(), dst, **{**FAST, **options})


# -- WebDataset shards (TarInput)

def tar_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tf.addfile(info, io.BytesIO(data))


def tar_build(root: Path, items: range) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / "shard.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in items:
            tar_member(tf, f"s/{i:04d}.jpg", jpeg_bytes(i))
            tar_member(tf, f"s/{i:04d}.cls", str(i % 3).encode())
    return root / "shard.tar"


def tar_expected(path: Path) -> list:
    with tarfile.open(path) as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    keys = sorted({name.rsplit(".", 1)[0] for name in members})
    return [{"__key__": k, "jpg": pixels(members[k + ".jpg"]), "cls": int(members[k + ".cls"])} for k in keys]


def tar_change(path: Path, root: Path) -> Path:
    with tarfile.open(path) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            tar_member(tf, name, jpeg_bytes(999, size=(20, 12)) if name == "s/0007.jpg" else data)
    return path


# -- COCO detection (CocoInput)

def coco_build(root: Path, items: range) -> tuple[Path, Path]:
    images, anns = [], []
    for i in items:
        name = f"{i:03d}.jpg"
        path = root / "images" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(i))
        images.append({"id": 100 + i, "file_name": name, "width": 16, "height": 12})
        for k in range(i % 3):
            box = [float(k), float(i % 5), 4.0 + k, 3.0]
            anns.append({"id": 1000 + 10 * i + k, "image_id": 100 + i, "category_id": 1 + (i + k) % 2,
                         "bbox": box, "area": box[2] * box[3], "iscrowd": 0, "segmentation": []})
    coco = {"images": images, "annotations": anns,
            "categories": [{"id": 1, "name": "ant"}, {"id": 2, "name": "bee"}]}
    ann_file = root / f"ann-{items.start}-{items.stop}.json"
    ann_file.write_text(json.dumps(coco))
    return ann_file, root / "images"


def coco_convert(inp, dst, **options):
    return fastdata.convert_coco(inp[0], inp[1], dst, **{**FAST, **options})


def coco_expected(inp) -> list:
    coco = json.loads(inp[0].read_text())
    out = []
    for info in sorted(coco["images"], key=lambda im: im["id"]):
        anns = [a for a in coco["annotations"] if a["image_id"] == info["id"]]
        out.append((pixels(inp[1] / info["file_name"]), anns))
    return out


def coco_change(inp, root: Path):
    _rewrite_jpeg(inp[1] / "007.jpg")  # an image file (not one of the probed samples)
    return inp


# -- a COCO file and its images on the S3 test server (RemoteCocoInput)

def _upload_tree(root: Path, prefix: str) -> str:
    """Every file under ``root`` uploaded to ``<bucket>/<prefix>``; returns that URL."""
    from fastdata.remote.location import RemoteLocation

    url = f"{REMOTE['bucket']}/{prefix}{len(REMOTE['trees'])}"
    loc = RemoteLocation(url)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        loc.upload(str(file), file.relative_to(root).as_posix())
    return url


def remote_coco_build(root: Path, items: range) -> tuple[str, str]:
    ann_file, _ = coco_build(root, items)
    url = _upload_tree(root, "coco")
    REMOTE["trees"][url] = (ann_file, root / "images")
    return f"{url}/{ann_file.name}", f"{url}/images"


def remote_coco_expected(inp) -> list:
    return coco_expected(REMOTE["trees"][inp[1].rsplit("/", 1)[0]])


def remote_coco_change(inp, root: Path):
    from fastdata.remote.location import RemoteLocation

    local = REMOTE["trees"][inp[1].rsplit("/", 1)[0]]
    coco_change(local, root)
    RemoteLocation(inp[1]).upload(str(local[1] / "007.jpg"), "007.jpg")
    return inp


# -- Parquet files (a Hub dataset folder) on the S3 test server (RemoteParquetInput)

def remote_parquet_build(root: Path, items: range) -> str:
    folder = parquet_build(root, items)
    url = _upload_tree(folder, "pq")
    REMOTE["trees"][url] = folder
    return url


def remote_parquet_convert(inp, dst, **options):
    return fastdata.convert(fastdata.sources.Parquet(inp), dst, **{**FAST, **options})


def remote_parquet_expected(url: str) -> list:
    return parquet_expected(REMOTE["trees"][url])


def remote_parquet_change(url: str, root: Path) -> str:
    folder = REMOTE["trees"][url]
    parquet_change(folder, root)
    from fastdata.remote.location import RemoteLocation

    loc = RemoteLocation(url)
    for file in sorted(p for p in folder.rglob("*.parquet")):
        loc.upload(str(file), file.relative_to(folder).as_posix())
    return url


# -- WebDataset tars, NIfTI volumes and DICOM files on the S3 test server (RemoteTarInput,
#    RemoteVolumeInput, RemoteDicomFolderInput)

def _remote_upload_file(url: str, local: Path, rel: str) -> None:
    from fastdata.remote.location import RemoteLocation

    RemoteLocation(url).upload(str(local), rel)


def remote_tar_build(root: Path, items: range) -> str:
    path = tar_build(root / "wds", items)
    url = f"{_upload_tree(path.parent, 'wds')}/shard.tar"
    REMOTE["trees"][url] = path
    return url


def remote_tar_expected(url: str) -> list:
    return tar_expected(REMOTE["trees"][url])


def remote_tar_change(url: str, root: Path) -> str:
    tar_change(REMOTE["trees"][url], root)
    _remote_upload_file(url.rsplit("/", 1)[0], REMOTE["trees"][url], "shard.tar")
    return url


def remote_nifti_build(root: Path, items: range) -> str:
    folder = nifti_build(root, items)
    url = _upload_tree(folder, "nii")
    REMOTE["trees"][url] = folder
    return url


def remote_nifti_expected(url: str) -> list:
    return nifti_expected(REMOTE["trees"][url])


def remote_nifti_change(url: str, root: Path) -> str:
    folder = nifti_change(REMOTE["trees"][url], root)
    _remote_upload_file(url, folder / "case07.nii.gz", "case07.nii.gz")
    return url


def remote_dicom_build(root: Path, items: range) -> str:
    folder = dicom_build(root, items)
    url = _upload_tree(folder, "dcm")
    REMOTE["trees"][url] = folder
    return url


def remote_dicom_expected(url: str) -> list:
    return dicom_expected(REMOTE["trees"][url])


def remote_dicom_change(url: str, root: Path) -> str:
    folder = dicom_change(REMOTE["trees"][url], root)
    _remote_upload_file(url, folder / "liver" / "s002.dcm", "liver/s002.dcm")
    return url


# -- NIfTI volumes (VolumeInput)

def nifti_build(root: Path, items: range) -> Path:
    for i in items:
        write_nifti(root / "nifti" / f"case{i:02d}.nii.gz", volume(i, (8, 8, 8)), affine_of(i))
    return root / "nifti"


def nifti_expected(folder: Path) -> list:
    import nibabel as nib

    out = []
    for path in sorted(folder.iterdir()):
        img = nib.load(str(path))
        out.append({"image": np.asanyarray(img.dataobj.get_unscaled()), "affine": img.affine})
    return out


def nifti_change(folder: Path, root: Path) -> Path:
    write_nifti(folder / "case07.nii.gz", volume(99, (8, 8, 8)), affine_of(7))
    return folder


def volume_convert(inp, dst, **options):
    return fastdata.convert(inp, dst, **{**FAST, **options})


# -- TIFF images as chunked arrays (TiffImageInput)

def tiff_build(root: Path, items: range) -> Path:
    for i in items:
        write_tiff(root / "tiffs" / "c" / f"t{i:02d}.tif", image(i, (12, 16)))
    return root / "tiffs"


def tiff_convert(inp, dst, **options):
    return fastdata.convert(inp, dst, chunks="8,8", **{**FAST, **options})


def tiff_expected(folder: Path) -> list:
    import tifffile

    return [{"image": tifffile.imread(str(p))} for p in sorted((folder / "c").iterdir())]


def tiff_change(folder: Path, root: Path) -> Path:
    write_tiff(folder / "c" / "t07.tif", image(99, (12, 18)))
    return folder


# -- a DICOM folder with tags as fields (DicomFolderInput)

def dicom_build(root: Path, items: range) -> Path:
    for i in items:
        cls = ("liver", "lung")[i % 2]
        write_dicom(root / "ct" / cls / f"s{i:03d}.dcm", seed=i, slope=1.0 + i % 3, spacing=(0.5, 0.25 + i / 100))
    return root / "ct"


def dicom_convert(inp, dst, **options):
    return fastdata.convert(inp, dst, dicom_tags="RescaleSlope,PixelSpacing", **{**FAST, **options})


def dicom_expected(folder: Path) -> list:
    import pydicom

    out = []
    for ci, cls in enumerate(sorted(p.name for p in folder.iterdir())):
        for path in sorted((folder / cls).iterdir()):
            ds = pydicom.dcmread(str(path))
            out.append({"image": ds.pixel_array, "label": ci, "RescaleSlope": float(ds.RescaleSlope),
                        "PixelSpacing": [float(v) for v in ds.PixelSpacing]})
    return out


def dicom_change(folder: Path, root: Path) -> Path:
    # sample 1 (not one of the samples a map-style input probes: 0, n/4, n/2, 3n/4, n-1): a file of another size
    write_dicom(folder / "liver" / "s002.dcm", pixels=np.zeros((20, 12), np.int16), seed=2)
    return folder


CASES = [
    Case("folder", "FolderInput", 21, folder_build, _convert_path, folder_change, folder_expected, split=12,
         changed="an image file of another size"),
    Case("remote folder (S3)", "RemoteFolderInput", 21, remote_folder_build, _convert_path, remote_folder_change,
         remote_folder_expected, split=12, changed="an object of another size", marks=(pytest.mark.slow,)),
    Case("remote table (S3)", "RemoteTableInput", 21, remote_table_build, _convert_path, remote_table_change,
         remote_table_expected, split=12, changed="a row's value", marks=(pytest.mark.slow,)),
    Case("path,label list", "FolderInput", 21, list_build, _convert_path, list_change, list_expected, split=12,
         changed="a row's label"),
    Case("table", "TableInput", 21, table_build, _convert_path, table_change, table_expected, split=12,
         changed="a row's value"),
    Case("map-style samples", "MapInput", 20, python_build, map_convert, python_change, python_expected, split=12,
         changed="sample 0 (one of the probed samples)"),
    Case("iterable samples", "IterInput", 20, python_build, iter_convert, python_change, python_expected, split=12,
         resume_refused=ValueError, changed="(an iterable cannot resume)"),
    Case("parquet (Hub folder)", "ParquetInput", 20, parquet_build, _convert_path, parquet_change, parquet_expected,
         split=12, needs=("pyarrow",), changed="a row (its file rewritten)"),
    Case("datasets.Dataset", "DatasetInput", 20, hf_build, write_convert, hf_change, hf_expected, split=12,
         needs=("pyarrow", "datasets"), changed="row 0 (one of the probed rows)"),
    Case("datasets.IterableDataset", "IterableInput", 20, hf_build, iterable_dataset_convert, hf_change, hf_expected,
         split=12, needs=("pyarrow", "datasets"), resume_refused=ValueError, changed="(an iterable cannot resume)"),
    Case("webdataset", "TarInput", 20, tar_build, _convert_path, tar_change, tar_expected, split=12,
         changed="a member's bytes (the tar rewritten)"),
    Case("remote coco (S3)", "RemoteCocoInput", 20, remote_coco_build, coco_convert, remote_coco_change,
         remote_coco_expected, split=12, changed="an image object of another size", marks=(pytest.mark.slow,),
         keeps_input_paths="each record keeps its image's URL as the store index's relpath"),
    Case("remote parquet (S3)", "RemoteParquetInput", 20, remote_parquet_build, remote_parquet_convert,
         remote_parquet_change, remote_parquet_expected, split=12, needs=("pyarrow",),
         changed="a row (its file rewritten)", marks=(pytest.mark.slow,)),
    Case("coco", "CocoInput", 20, coco_build, coco_convert, coco_change, coco_expected, split=12,
         changed="an image file of another size",
         keeps_input_paths="each record keeps its image file's absolute path (image_dir joined with file_name) "
                           "as the store index's relpath"),
    Case("nifti", "VolumeInput", 12, nifti_build, volume_convert, nifti_change, nifti_expected, split=7,
         needs=("nibabel",), shard_size="2kB", changed="a volume file"),
    Case("tiff", "TiffImageInput", 12, tiff_build, tiff_convert, tiff_change, tiff_expected, split=7,
         needs=("tifffile",), shard_size="600B", changed="an image file of another size"),
    Case("remote webdataset (S3)", "RemoteTarInput", 20, remote_tar_build, _convert_path, remote_tar_change,
         remote_tar_expected, split=12, changed="a member's bytes (the tar rewritten)", marks=(pytest.mark.slow,)),
    Case("remote nifti (S3)", "RemoteVolumeInput", 12, remote_nifti_build, volume_convert, remote_nifti_change,
         remote_nifti_expected, split=7, needs=("nibabel",), shard_size="2kB", changed="a volume object",
         marks=(pytest.mark.slow,)),
    Case("remote dicom (S3)", "RemoteDicomFolderInput", 14, remote_dicom_build, dicom_convert, remote_dicom_change,
         remote_dicom_expected, split=8, needs=("pydicom",), changed="a DICOM object of another size",
         marks=(pytest.mark.slow,),
         keeps_input_paths="each record keeps the DICOM file's URL as the store index's relpath"),
    Case("dicom", "DicomFolderInput", 14, dicom_build, dicom_convert, dicom_change, dicom_expected, split=8,
         needs=("pydicom",), changed="a DICOM file of another size",
         keeps_input_paths="each record keeps the DICOM file's absolute path as the store index's relpath "
                           "(an image folder keeps the path relative to the folder)"),
]


@pytest.fixture(scope="module", params=[pytest.param(c, id=c.name.replace(" ", "-"), marks=c.marks) for c in CASES])
def case(request) -> Case:
    c = request.param
    if c.source.startswith("Remote"):  # the session's S3 server, a bucket of the module's
        server = request.getfixturevalue("s3_server")
        patch = pytest.MonkeyPatch()
        request.addfinalizer(patch.undo)
        for name, value in server.env().items():
            patch.setenv(name, value)
        REMOTE["bucket"] = f"s3://{server.take_bucket(f'contract{os.getpid()}-{c.source.lower()}')}"
    for module in c.needs:
        try:
            importlib.import_module(module)
        except ImportError as err:
            why = f"{c.name}: {module} is not installed ({err}); it is in the test extra (pip install -e .[test])"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
    return c


@dataclass
class Converted:
    """A case's whole input (``inp``, left unchanged) converted once into ``dst`` (left unchanged:
    a test that damages or grows a store works on its own), and the store's samples (:func:`read_all`)."""

    inp: Any
    dst: Path
    report: Any
    samples: list


@pytest.fixture(scope="module", params=[".lmdb", pytest.param(".h5", marks=pytest.mark.slow)], ids=["lmdb", "h5"])
def converted(case, tmp_path_factory, request) -> Converted:
    """The case's input converted once; the backend (the destination's suffix) is the one of every
    store a test of the case writes: LMDB in CI, HDF5 too nightly."""
    root = tmp_path_factory.mktemp("contract")
    inp = case.build(root / "in", range(case.count))
    dst = root / f"store{request.param}"
    report = convert(case, inp, dst)
    return Converted(inp, dst, report, read_all(dst))


def test_every_kind_of_input_has_a_case():
    """Each concrete WriteSource of fastdata.writer.sources is run by a case (a new source needs one)."""
    import pkgutil

    import fastdata.writer.sources as package
    from fastdata.writer.sources.base import WriteSource

    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)

    def subclasses(cls: type) -> set[type]:
        return {sub for s in cls.__subclasses__() for sub in (s, *subclasses(s))}

    kinds = {c.__name__ for c in subclasses(WriteSource)
             if c.__module__.startswith(package.__name__) and not c.__name__.startswith("_")
             and not inspect.isabstract(c)}
    assert kinds == {c.source for c in CASES}


# --------------------------------------------------------------------------- reading stores


def read_all(dst: Path) -> list:
    """Every sample of the store ``dst`` as :func:`plain` data, in store order, through
    ``open_dataset`` (images as numpy arrays of their decoded pixels)."""
    ds = fastdata.open_dataset(dst, output="numpy")
    try:
        return [plain(ds[i]) for i in range(len(ds))]
    finally:
        close = getattr(ds, "close", None)
        if close is not None:
            close()


def shards(dst: Path) -> list:
    return [(s["name"], s["count"], s["xxh"]) for s in read_manifest(str(dst))["shards"]]


def same_samples(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} samples vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        same(x, y, f"{what}: sample {i}")


def as_the_source_holds_them(got: list, want: list, what: str) -> None:
    """The samples read (``got``) hold the source's own values (``want``, from :attr:`Case.expected`);
    a general store may hold more fields than the case lists (e.g. a volume's spacing)."""
    assert len(got) == len(want), f"{what}: {len(got)} samples vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, dict) and isinstance(g, dict) and set(w) <= set(g):
            g = {k: g[k] for k in w}
        same(g, w, f"{what}: sample {i}")


def convert(case: Case, inp, dst: Path, **options):
    return case.convert(inp, dst, shard_size=case.shard_size, **options)


def flip_a_record_byte(dst: Path) -> str:
    """Flip one byte in the middle of the first record of the store's first shard (found by its
    stored bytes in the shard file); returns the shard's name."""
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import schema_of

    manifest = read_manifest(str(dst))
    name = manifest["shards"][0]["name"]
    path = dst / name
    schema = schema_of(manifest) if manifest.get("schema") else None
    storage = StorageSpec.from_json(manifest["storage"]) if "storage" in manifest else StorageSpec()
    with reader_class(manifest["backend"])(str(path), storage, schema=schema) as reader:
        record = bytes(reader.get(0))
    data = bytearray(path.read_bytes())
    at = data.find(record)
    assert at >= 0 and data.find(record, at + 1) < 0, "the record's bytes are found once in the shard"
    data[at + len(record) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    return name


# --------------------------------------------------------------------------- 1. plan / convert / verify


def test_convert_gives_the_samples_and_verifies_and_a_flipped_byte_fails_verify(case, converted, tmp_path):
    manifest = read_manifest(str(converted.dst))
    assert manifest["num_samples"] == case.count == converted.report.images == len(converted.samples)
    assert len(manifest["shards"]) > 1, "the shard size makes several shards"
    assert fastdata.verify(str(converted.dst)).ok
    decoded = fastdata.verify(str(converted.dst), decode=True)
    assert decoded.ok and decoded.decoded > 0, decoded.problems
    # the control: one byte of a record flipped (in a copy) fails verify, naming the shard
    damaged = tmp_path / f"damaged{converted.dst.suffix}"
    shutil.copytree(converted.dst, damaged)
    shard = flip_a_record_byte(damaged)
    report = fastdata.verify(str(damaged))
    assert not report.ok and report.status == "damaged"
    assert shard in " ".join(report.problems), report.problems


# --------------------------------------------------------------------------- 2. fingerprint


def test_same_input_same_shards_and_a_changed_item_is_refused_by_resume(case, converted, tmp_path):
    """The input made again elsewhere converts into the same shards; ``resume=True`` over that
    complete store accepts the same input (nothing to do) and refuses it with one item changed."""
    inp = case.build(tmp_path / "in", range(case.count))
    dst = tmp_path / f"again{converted.dst.suffix}"
    convert(case, inp, dst)
    if case.keeps_input_paths is None:
        assert shards(dst) == shards(converted.dst), "the same input, made again elsewhere, gives the same shards"
    else:  # known (see Case.keeps_input_paths): then the same input where it was
        assert shards(dst) != shards(converted.dst), f"fixed? {case.keeps_input_paths}"
        same_place = tmp_path / f"same{converted.dst.suffix}"
        convert(case, converted.inp, same_place)
        assert shards(same_place) == shards(converted.dst), "the same input gives the same shards"
    before = shards(dst)
    if case.resume_refused is not None:  # its documented refusal is the contract
        with pytest.raises(case.resume_refused, match="resume"):
            convert(case, inp, dst, resume=True)
    else:
        convert(case, inp, dst, resume=True)  # the control: a complete store, nothing to do
        changed = case.change(inp, tmp_path / "in")
        try:
            convert(case, changed, dst, resume=True)
        except ResumeMismatchError:
            pass
        else:
            pytest.fail(f"{case.name}: resume=True accepted the input with {case.changed} changed")
    assert shards(dst) == before, "a refused resume changes nothing"


# --------------------------------------------------------------------------- 3. interrupt and resume


def _convert_until_killed(case: Case, inp, dst: Path) -> None:
    """In a forked child: convert ``inp`` into ``dst``, and once a shard's result sidecar is in
    staging (the proof a shard is finished), block at the next file opened, to be SIGKILLed there
    (an audit hook: the pause is deterministic, not a race with a fast conversion)."""
    staged = []

    def hook(event: str, args: tuple) -> None:
        if event == "os.rename" and len(args) > 1 and isinstance(args[1], str | bytes | os.PathLike):
            target = os.fsdecode(args[1])
            base = os.path.basename(target)
            if STAGING_DIR in target and base.startswith("shard-") and base.endswith(".json"):
                staged.append(target)
        elif event == "open" and staged:
            time.sleep(120)

    try:
        sys.addaudithook(hook)
        convert(case, inp, dst)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def kill_once_a_shard_is_finished(case: Case, inp, dst: Path) -> None:
    """Convert in a forked child, SIGKILLed once a shard is finished (its sidecar is in staging)."""
    child = multiprocessing.get_context("fork").Process(target=_convert_until_killed, args=(case, inp, dst))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not any((dst / STAGING_DIR).glob("shard-*.json")):
            assert child.is_alive(), f"the conversion ended (exit {child.exitcode}) before a shard was finished"
            assert time.monotonic() < deadline, "no shard finished within 60 s"
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
    assert not (dst / MANIFEST_NAME).exists()


def test_a_killed_conversion_resumes_into_the_uninterrupted_store(case, converted, tmp_path):
    dst = tmp_path / f"killed{converted.dst.suffix}"
    kill_once_a_shard_is_finished(case, converted.inp, dst)
    if case.resume_refused is not None:  # the documented refusal; overwrite=True starts over
        with pytest.raises(case.resume_refused, match="resume"):
            convert(case, converted.inp, dst, resume=True)
        convert(case, converted.inp, dst, overwrite=True)
    else:
        report = convert(case, converted.inp, dst, resume=True)
        assert 1 <= report.resumed_shards < len(shards(converted.dst)), "finished shards kept, the rest written"
    assert shards(dst) == shards(converted.dst)
    assert fastdata.verify(str(dst)).ok
    same_samples(read_all(dst), converted.samples, "resumed vs uninterrupted")


# --------------------------------------------------------------------------- 4. append


def test_append_reads_as_the_two_parts_in_turn_and_holds_the_whole(case, converted, tmp_path):
    """Part A converted, part B appended: the store reads, sample by sample, as A's samples then
    B's (the source's values), and holds the samples of the store of A+B."""
    part_a = case.build(tmp_path / "a", range(case.split))
    part_b = case.build(tmp_path / "b", range(case.split, case.count))
    dst = tmp_path / f"grown{converted.dst.suffix}"
    convert(case, part_a, dst)
    before = shards(dst)
    report = convert(case, part_b, dst, append=True)
    assert report.images == case.count - case.split
    assert shards(dst)[:len(before)] == before, "the shards of A are kept as they were"
    assert fastdata.verify(str(dst)).ok
    grown = read_all(dst)
    as_the_source_holds_them(grown, case.expected(part_a) + case.expected(part_b), "A + appended B")
    assert sorted(map(key, grown)) == sorted(map(key, converted.samples)), \
        "the grown store holds the samples of the store of A+B"


# --------------------------------------------------------------------------- 5. read back


def test_every_sample_reads_back_as_the_source_holds_it(case, converted):
    as_the_source_holds_them(converted.samples, case.expected(converted.inp), "read back")
