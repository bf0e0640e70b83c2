"""Every code block of the documentation runs, as written (README.md and docs/).

Each page's blocks run in order in a temporary folder, python blocks in one namespace (as a reader
pastes them into one session), after the page's *prelude* here made the files its examples name
(``imgs/``, ``train.lmdb``, ...): small generated data, so a page takes seconds. Shell blocks:
``fastdata ...`` runs the CLI in this process and must exit 0; ``pip install`` must name extras that
pyproject.toml defines and the torch pins CI installs; ``python -m pytest`` must be what ``.ci/run``
runs; anything else must be marked (tests/helpers/docblocks.py says how).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.docblocks import LANGUAGES, ROOT, Block, all_blocks, blocks_of, pages

#: blocks marked "Not run in the tests", per page: a new one must be added here, on purpose
NOT_RUN = {
    "docs/RELIABILITY.md": 1,  # the nightly reliability runs
    "docs/guides/adding-fields.md": 1,  # the benchmark
}
#: pages whose commands measure for minutes (bench, tune): run nightly (the slow marker)
SLOW_PAGES = {"docs/guides/tuning.md"}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- preludes: the files each page's examples name -------------------------------------------------

def _image_folder(root: str = "imgs", classes: int = 3, per_class: int = 4, size=(48, 40)) -> None:
    import fastdata

    fastdata.synth.make_image_folder(root, num_classes=classes, per_class=per_class, size=size, seed=0)


def _store(dst: str, src: str = "imgs", **options) -> None:
    import fastdata

    if not os.path.isdir(src):
        _image_folder(src)
    fastdata.convert(src, dst, workers=0, progress=False, **options)


def _coco(root: str = ".", images: int = 6) -> None:
    """``annotations/instances_train2017.json`` and ``train2017/``, as COCO's files are named."""
    from fastdata.tools.synth_coco import make_coco

    make_coco("coco-synth", images, seed=0, size=(64, 80), max_boxes=3)
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    os.replace("coco-synth/annotations.json", os.path.join(root, "annotations", "instances_train2017.json"))
    os.replace("coco-synth/images", os.path.join(root, "train2017"))


def _cifar_parquet() -> None:
    """``cifar10/plain_text/{train,test}-*.parquet`` as the Hub lays CIFAR-10 out (``img``, ``label``),
    written by ``datasets`` itself, and ``datasets.load_dataset("uoft-cs/cifar10", ...)`` answered from
    them (no network in the tests: the same loader, on the local files)."""
    import datasets
    import numpy as np
    from PIL import Image

    names = ["airplane", "automobile", "bird"]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("test", 6)):
        rows = {"img": [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)],
                "label": [i % len(names) for i in range(n)]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            f"cifar10/plain_text/{split}-00000-of-00001.parquet")
    files = {s: os.path.abspath(f"cifar10/plain_text/{s}-00000-of-00001.parquet") for s in ("train", "test")}
    hub = datasets.load_dataset

    def load_dataset(path, **kwargs):
        assert path == "uoft-cs/cifar10", path
        return hub("parquet", data_files=files, **kwargs)

    return load_dataset


def _readme(tmp: Path, monkeypatch) -> dict:
    from helpers.parquet import hf_rows, write_hf_parquet

    _image_folder()
    _coco()
    rows = hf_rows(12)
    write_hf_parquet("cifar10/plain_text/train-00000-of-00001.parquet", {k: rows[k] for k in ("image", "label")})
    return {}


def _classification(tmp: Path, monkeypatch) -> dict:
    _image_folder()
    return {}


def _detection(tmp: Path, monkeypatch) -> dict:
    import torch

    _coco()

    def model(images, targets):
        """Checks what torchvision's detection models require of their inputs, as they would."""
        assert len(images) == len(targets) and all(im.dtype == torch.float32 and im.ndim == 3 for im in images)
        for target in targets:
            assert target["boxes"].shape[-1] == 4 and len(target["labels"]) == len(target["boxes"])
        return {"loss": torch.zeros(())}

    return {"model": model}


def _format(tmp: Path, monkeypatch) -> dict:
    """The names FORMAT.md's fragments use: a manifest (``obj``), an LMDB shard (``path``), a
    store ``store.h5`` with a chunked field ``ct``, and sample ``i``'s chunk ``j``."""
    import json

    import h5py
    import lmdb
    import msgpack
    import numcodecs
    import numpy as np

    import fastdata
    from fastdata.fields import Chunked

    _store("store.lmdb")
    volumes = [{"ct": np.arange(40 * 30 * 20, dtype=np.uint16).reshape(40, 30, 20)}]
    fastdata.write(volumes, "store.h5", {"ct": Chunked("uint16", (16, 16, 16))}, workers=0, progress=False)
    obj = json.loads(Path("store.lmdb/manifest.json").read_text())
    return {"json": json, "lmdb": lmdb, "h5py": h5py, "msgpack": msgpack, "numcodecs": numcodecs, "np": np,
            "obj": obj, "path": "store.lmdb/" + obj["shards"][0]["name"], "i": 0, "j": 1}


def _ct_store(name: str = "ct.lmdb", fields=("image", "label"), shape=(112, 112, 112), count: int = 2):
    """CT-like volumes with a label volume (a smooth field and its bright part; the phantoms of
    fastdata.tools.synth_volumes take seconds to render at these sizes)."""
    import numpy as np

    import fastdata
    from fastdata.fields import Chunked, Int

    samples = []
    for i in range(count):
        z, y, x = np.ogrid[: shape[0], : shape[1], : shape[2]]
        field = np.sin(z / (7 + i)) + np.cos(y / 9) * np.sin(x / 11)
        ct = ((field + 2) * 1000).astype(np.uint16)
        label = (field > 1).astype(np.uint8)
        samples.append({fields[0]: ct, fields[1]: label, "id": i} if fields[0] == "image"
                       else {fields[0]: ct, fields[1]: label, "patient": i})
    if name:
        schema = {fields[0]: Chunked("uint16", (48, 48, 48)), fields[1]: Chunked("uint8", (48, 48, 48)), "id": Int()}
        fastdata.write(samples, name, schema, workers=0, progress=False)
    return samples


def _patches(tmp: Path, monkeypatch) -> dict:
    import numpy as np
    import torch
    from torch.utils.data import Subset

    import fastdata

    _ct_store(shape=(96, 104, 112))

    def model(x):  # what a segmentation network returns: one channel per class, the tile's shape
        x = x.float() / 4095
        return torch.cat([x, 1 - x], dim=1)

    def loss_fn(prediction, target):
        return torch.nn.functional.mse_loss(prediction.float(), target.float())

    return {"fastdata": fastdata, "np": np, "torch": torch, "Subset": Subset, "model": model, "loss_fn": loss_fn}


def _growing(tmp: Path, monkeypatch) -> dict:
    import fastdata
    from fastdata import transforms

    _image_folder("week-48", classes=2)
    _store("train.lmdb", "week-48")
    _image_folder("week-49", classes=2)
    _image_folder("week-50", classes=3)
    _image_folder("week-51", classes=2)
    _store("site-a.lmdb", "week-49")
    _store("site-b.lmdb", "week-50")
    _store("synthetic.lmdb", "week-51")
    return {"fastdata": fastdata, "transforms": transforms, "start_epoch": 0, "epochs": 1, "world_size": 1,
            "ckpt": {}}


def _sampling(tmp: Path, monkeypatch) -> dict:
    """Two stores to mix (``real``, ``synth``; ``real.lmdb`` by path), and the training loop's names
    the sampler's resume example uses, at the start of an epoch."""
    import fastdata

    _store("real.lmdb")
    _store("synthetic.lmdb", "week-1")
    real = fastdata.open_dataset("real.lmdb", output="tensor")
    synth = fastdata.open_dataset("synthetic.lmdb", output="tensor")
    sampler = fastdata.DistributedShardSampler(real)
    return {"fastdata": fastdata, "real": real, "synth": synth, "relabel": lambda sample: sample,
            "sampler": sampler, "loader": fastdata.loader(real, batch_size=8, sampler=sampler), "ckpt": {},
            "steps_done_this_epoch": 0, "batch_size": 8, "world_size": 1, "epochs": 1, "n_epochs": 1}


def _multi_node(tmp: Path, monkeypatch) -> dict:
    import torch

    import fastdata

    _store("train.lmdb")
    ds = fastdata.open_dataset("train.lmdb", output="tensor")
    return {"fastdata": fastdata, "torch": torch, "ds": ds, "epochs": 2, "steps": 0, "world_size": 1}


def _remote(tmp: Path, monkeypatch, request) -> dict:
    """The page's ``s3://bucket`` on the session's S3 server (SeaweedFS), its endpoint in the
    environment as the page says to set it."""
    import fastdata
    from fastdata import transforms

    server = request.getfixturevalue("s3_server")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    server.make_bucket("bucket")
    _image_folder()
    # "Remote sources": the folder in the bucket too, and a path,label list beside it
    from fastdata.remote.location import RemoteLocation

    files = sorted(p for p in Path("imgs").rglob("*") if p.is_file())
    RemoteLocation("s3://bucket/imgs").filesystem().put([str(p) for p in files],
                                                         [f"bucket/{p.as_posix()}" for p in files])
    rows = "".join(f"../{p.as_posix()},{p.parent.name}\n" for p in files)
    RemoteLocation("s3://bucket/lists").write_bytes("train.csv", ("path,label\n" + rows).encode())
    jsonl = "".join(f'{{"path": "../{p.as_posix()}", "label": "{p.parent.name}", "score": 0.5}}\n' for p in files)
    RemoteLocation("s3://bucket/lists").write_bytes("rows.jsonl", jsonl.encode())
    # a local list whose rows are URLs, and a local COCO file with its images in the bucket
    Path("lists").mkdir()
    Path("lists", "urls.csv").write_text("".join(f"s3://bucket/{p.as_posix()},{p.parent.name}\n" for p in files))
    from fastdata.tools.synth_coco import make_coco

    coco = make_coco("coco-remote", 3, seed=0, size=(40, 50), max_boxes=2)
    os.replace(coco.ann_file, "instances.json")
    images = sorted(Path(coco.image_dir).iterdir())
    RemoteLocation("s3://bucket/coco").filesystem().put([str(p) for p in images],
                                                         [f"bucket/coco/images/{p.name}" for p in images])
    # WebDataset tars, NIfTI volumes and a DICOM tree in the bucket (the page converts them from there)
    import io
    import json
    import tarfile

    from helpers.native import dicom_tree
    from helpers.nifti import volume, write_nifti

    for t in range(10):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, data in ((f"{t:04d}.jpg", files[t].read_bytes()), (f"{t:04d}.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        RemoteLocation("s3://bucket/shards").write_bytes(f"train-{t:06d}.tar", buf.getvalue())
    for k in range(2):
        write_nifti(Path("scans", f"v{k}.nii.gz"), volume(k, (12, 10, 6)))
        write_nifti(Path("Task02_Heart", "imagesTr", f"la_{k:03d}.nii.gz"), volume(k, (12, 10, 6)))
        write_nifti(Path("Task02_Heart", "labelsTr", f"la_{k:03d}.nii.gz"), volume(k, (12, 10, 6), "uint8") % 3)
    Path("Task02_Heart", "dataset.json").write_text(json.dumps({"name": "LeftAtrium", "training": [
        {"image": f"./imagesTr/la_{k:03d}.nii.gz", "label": f"./labelsTr/la_{k:03d}.nii.gz"} for k in range(2)]}))
    dicom_tree(Path("dicom"), {"lung": 2, "liver": 1})
    for folder in ("scans", "dicom", "Task02_Heart"):
        local = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        RemoteLocation(f"s3://bucket/{folder}").filesystem().put([str(p) for p in local],
                                                                 [f"bucket/{p.as_posix()}" for p in local])
    return {"fastdata": fastdata, "transforms": transforms}


def _sources(tmp: Path, monkeypatch) -> dict:
    import io
    import json
    import tarfile

    import datasets
    import numpy as np
    from PIL import Image

    _image_folder()
    os.makedirs("imgs", exist_ok=True)
    Image.new("RGB", (40, 30), (200, 10, 10)).save("imgs/0001.jpg")
    Image.new("RGB", (40, 30), (10, 200, 10)).save("a.jpg")
    Image.new("RGB", (30, 40), (10, 10, 200)).save("b.jpg")
    rows = [{"path": "a.jpg", "boxes": [[1.5, 2.0, 30.0, 40.0]], "score": 0.9, "caption": "a cat", "label": "cat"},
            {"path": "b.jpg", "boxes": [], "score": 0.5, "caption": "a dog", "label": "dog"}]
    Path("rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("rows.csv").write_text('path,boxes,score,caption,label\na.jpg,"[[1.5, 2.0, 30.0, 40.0]]",0.9,a cat,cat|dog\n'
                                'b.jpg,[],,a dog,dog\n')
    monkeypatch.setattr(datasets, "load_dataset", _cifar_parquet())
    with open("a.jpg", "rb") as fh:
        photo = fh.read()
    datasets.Dataset.from_dict({"photo": [photo, photo], "score": [0.5, 0.25]}).to_parquet("features.parquet")
    os.makedirs("shards")
    for s in range(100):  # train-{000000..000099}.tar: one sample each
        with tarfile.open(f"shards/train-{s:06d}.tar", "w") as tar:
            for name, data in ((f"{s:04d}.jpg", photo), (f"{s:04d}.cls", str(s % 3).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return {"np": np}


def _tuning(tmp: Path, monkeypatch) -> dict:
    _store("train.lmdb")
    _store("train.h5")
    os.makedirs("mypackage")
    Path("mypackage/__init__.py").write_text("")
    Path("mypackage/data.py").write_text(
        "import fastdata\n\n\ndef make_dataset():\n    return fastdata.open_dataset('train.lmdb')\n")
    return {}


def _volumes(tmp: Path, monkeypatch) -> dict:
    import fastdata
    from fastdata.tools.synth_native import make_ct_folder

    make_ct_folder("ct-slices", num_classes=2, per_class=3, size=(64, 64))
    return {"fastdata": fastdata, "my_volumes": _ct_store(name="", fields=("ct", "label"))}


def _adding_fields(tmp: Path, monkeypatch) -> dict:
    """``train.lmdb``, and the files its CLI examples read: ``scores.csv`` keyed by the samples'
    paths and ``emb.npy`` in store order."""
    import numpy as np

    import fastdata

    _store("train.lmdb")
    ds = fastdata.open_dataset("train.lmdb")
    with open("scores.csv", "w") as fh:
        fh.write("path,score\n" + "".join(f"{ds.relpath(i)},{i / 10}\n" for i in range(len(ds))))
    np.save("emb.npy", np.zeros((len(ds), 8), dtype=np.float32))
    return {}


PRELUDES: dict[str, Callable] = {
    "docs/guides/adding-fields.md": _adding_fields,
    "README.md": _readme,
    "docs/FORMAT.md": _format,
    "docs/PATCHES.md": _patches,
    "docs/getting-started.md": lambda tmp, mp: {},
    "docs/guides/classification.md": _classification,
    "docs/guides/detection.md": _detection,
    "docs/guides/growing-and-mixing.md": _growing,
    "docs/guides/multi-node.md": _multi_node,
    "docs/sampling.md": _sampling,
    "docs/guides/remote.md": _remote,
    "docs/guides/sources.md": _sources,
    "docs/guides/tuning.md": _tuning,
    "docs/guides/thread-workers.md": lambda tmp, mp: {"_": _store("train.lmdb")},
    "docs/guides/volumes.md": _volumes,
    "docs/platforms.md": lambda tmp, mp: {},
}


# -- shell commands --------------------------------------------------------------------------------

def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&`` split."""
    joined = re.sub(r"\\\n", " ", code)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words:
            if word == "&&":
                commands.append(current)
                current = []
            else:
                current.append(word)
        if current:
            commands.append(current)
    return commands


def _check_pip_install(words: list[str], where: str) -> None:
    """``pip install ...``: the extras exist in pyproject.toml, and a pinned torch is one CI installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    ci = (ROOT / ".ci" / "run").read_text()
    for word in words[2:]:
        m = re.fullmatch(r"(?:\.|fastdata)\[([\w,-]+)\]", word)
        if m:
            unknown = set(m[1].split(",")) - extras
            assert not unknown, f"{where}: pip install names extras pyproject.toml lacks: {sorted(unknown)}"
        elif re.fullmatch(r"(torch|torchvision)==[\w.+]+", word):
            assert word in ci, f"{where}: {word} is not the pin .ci/run installs"
        else:
            assert word in ("-e", "-U") or re.fullmatch(r"[\w.-]+(\[[\w,-]+\])?([<>=]=?[\w.]+)?", word), \
                f"{where}: pip install {word!r}"


def run_shell(block: Block, monkeypatch) -> None:
    from fastdata.cli.main import main

    for words in _commands(block.code):
        where = f"{block.where}: {shlex.join(words)}"
        if words[0] == "fastdata":
            rc = main(words[1:])
            assert rc == 0, f"{where} exited {rc}"
        elif words[:2] == ["pip", "install"]:
            _check_pip_install(words, where)
        elif words[:3] == ["python", "-m", "pytest"]:
            assert shlex.join(words) in (ROOT / ".ci" / "run").read_text(), f"{where}: not what .ci/run runs"
        elif words[0] == "export":
            name, _, value = words[1].partition("=")
            monkeypatch.setenv(name, value)
        else:
            raise AssertionError(f"{where}: the docs tests cannot run this command; mark the block "
                                 "(tests/helpers/docblocks.py)")


# -- the tests -------------------------------------------------------------------------------------

def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks_of(page) if b.language in ("python", "bash") and not b.not_run_reason
            and not b.run_by]


def _needs_torchvision(page: Path) -> bool:
    return any(re.search(r"^\s*(from|import) torchvision\b", b.code, re.M) for b in _runnable(page))


def _page_param(page: Path):
    marks = [pytest.mark.slow] if _rel(page) in SLOW_PAGES else []
    return pytest.param(_rel(page), marks=marks, id=_rel(page))


RUNNABLE_PAGES = [_page_param(p) for p in pages() if _runnable(p) and not _needs_torchvision(p)]
#: pages with blocks that use torchvision: .ci/run's torchvision venv runs them (torch 2.13's CPU build has none)
TORCHVISION_PAGES = [_rel(p) for p in pages() if _runnable(p) and _needs_torchvision(p)]


def test_every_block_names_its_language():
    untagged = [b.where for b in all_blocks() if b.language not in LANGUAGES]
    assert not untagged, f"code blocks without a language of {LANGUAGES}: {untagged}"


def test_the_blocks_that_do_not_run_are_the_counted_ones():
    not_run = Counter(b.page for b in all_blocks() if b.not_run_reason is not None)
    assert dict(not_run) == NOT_RUN
    for b in all_blocks():
        if b.not_run_reason is not None:
            assert len(b.not_run_reason.strip()) > 10, f"{b.where}: say why the block cannot run"


def test_blocks_run_elsewhere_name_a_test_that_runs_them():
    for b in all_blocks():
        if b.run_by is None:
            continue
        test = ROOT / b.run_by
        assert test.is_file() and test.name.startswith("test_"), f"{b.where}: {b.run_by} is not a test file"
        words = set(re.findall(r"[A-Za-z_][\w.]{5,}", b.code))
        assert any(w in test.read_text() for w in words), f"{b.where}: {b.run_by} names nothing of the block"


def test_control_a_block_without_language_or_with_an_unknown_command_fails(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```\nfastdata info x\n```\n\n```bash\nrm -rf build/\n```\n")
    untagged, shell = blocks_of(page, page.read_text())
    assert untagged.language == "" and untagged.language not in LANGUAGES
    with pytest.raises(AssertionError, match="cannot run this command"):
        run_shell(shell, monkeypatch)
    with pytest.raises(AssertionError, match="extras pyproject.toml lacks"):
        _check_pip_install(["pip", "install", "-e", ".[no-such-extra]"], "x")


def _run_page(page: str, tmp_path: Path, monkeypatch, request) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "fastdata-cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = (request,) if page == "docs/guides/remote.md" else ()
    namespace: dict = {"__name__": "__docs__"}
    namespace.update(PRELUDES[page](tmp_path, monkeypatch, *extra))
    try:
        for block in _runnable(ROOT / page):
            if block.language == "python":
                exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102
            else:
                run_shell(block, monkeypatch)
    finally:
        for name in [m for m in sys.modules if m == "mypackage" or m.startswith("mypackage.")]:
            del sys.modules[name]  # the tuning page's own package, made in this test's folder


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_code_runs(page, tmp_path, monkeypatch, request):
    _run_page(page, tmp_path, monkeypatch, request)


@pytest.mark.torchvision
@pytest.mark.parametrize("page", TORCHVISION_PAGES)
def test_torchvision_page_code_runs(page, tmp_path, monkeypatch, request):
    pytest.importorskip("torchvision", reason="these pages' examples use torchvision (.ci/run's torchvision venv)")
    _run_page(page, tmp_path, monkeypatch, request)


def test_the_torchvision_pages_are_the_detection_guide():
    """A control for the split above: the page whose examples use torchvision's v2 transforms is
    found, and no other page is moved out of the main run by accident."""
    assert TORCHVISION_PAGES == ["docs/guides/detection.md"]
