"""Smoke test of an installed fastdata (a wheel, not the checkout): ``python scripts/wheel_smoke.py``.

Run by ``.ci/run`` (Python 3.11) and ``.ci/nightly`` (3.12, 3.13, the oldest torch claimed) in a
fresh virtual environment holding the wheel and torch, from a temporary folder. It checks:

- ``fastdata`` imports from the environment's site-packages (not a checkout, not editable), its
  ``__version__`` is the installed distribution's version (and the wheel's, given ``--wheel``), and
  the ``py.typed`` marker is installed;
- a few generated PNG images convert with the ``fastdata convert`` command (LMDB, 2 workers) and
  with the API (``fastdata.convert``, ``sources.ImageFolder``, ``WriteOptions``; HDF5, 2 workers);
- ``fastdata verify --decode`` passes on both stores;
- both stores, opened, load every sample exactly once through ``fastdata.loader`` with 2 workers
  started by spawn, with the right count, labels and pixels.

It prints one line per check and a summary, and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import json
import multiprocessing
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

#: class name -> images; distinct counts, so a label mixed up with another shows in the counts
CLASSES = {"ant": 5, "bee": 7, "cat": 4}
SIZE = (20, 12)  # width, height


def make_images(root: Path) -> dict[int, int]:
    """Solid-colour PNGs, image ``i`` red ``i`` (its identity), under root/<class>/; i -> label."""
    from PIL import Image

    truth, i = {}, 0
    for label, cls in enumerate(sorted(CLASSES)):
        (root / cls).mkdir(parents=True)
        for k in range(CLASSES[cls]):
            Image.new("RGB", SIZE, (i, 40 * label, 200)).save(root / cls / f"{k:03d}.png")
            truth[i] = label
            i += 1
    return truth


def cli(*args: str) -> subprocess.CompletedProcess:
    """The ``fastdata`` command this environment installed (its console script, not ``-m``)."""
    exe = Path(sys.executable).parent / ("fastdata.exe" if os.name == "nt" else "fastdata")
    if not exe.is_file():
        raise AssertionError(f"the fastdata command is not installed beside {sys.executable}")
    run = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise AssertionError(f"fastdata {' '.join(args)}: exit {run.returncode}\n{run.stdout[-2000:]}"
                             f"{run.stderr[-2000:]}")
    return run


def check_install(wheel: str | None) -> str:
    import fastdata

    where = Path(fastdata.__file__).resolve().parent
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if site not in where.parents:
        raise AssertionError(f"fastdata imports from {where}, not from site-packages ({site})")
    dist = importlib.metadata.distribution("fastdata")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        raise AssertionError(f"fastdata is an editable install ({direct.get('url')})")
    if fastdata.__version__ != dist.version:
        raise AssertionError(f"fastdata.__version__ {fastdata.__version__} != installed {dist.version}")
    if wheel:
        wheel_version = Path(wheel).name.split("-")[1]
        if fastdata.__version__ != wheel_version:
            raise AssertionError(f"fastdata.__version__ {fastdata.__version__} != the wheel's {wheel_version}")
    if not importlib.resources.files("fastdata").joinpath("py.typed").is_file():
        raise AssertionError("fastdata/py.typed is not installed")
    if not any(str(f).replace("\\", "/") == "fastdata/py.typed" for f in dist.files or ()):
        raise AssertionError("fastdata/py.typed is not in the distribution's RECORD")
    return f"fastdata {fastdata.__version__} from {where}"


def convert_cli(src: Path, dst: Path, n: int) -> str:
    import fastdata

    cli("convert", str(src), str(dst), "--format", "lmdb", "--workers", "2", "--quiet")
    info = fastdata.info(str(dst))
    if info["num_samples"] != n:
        raise AssertionError(f"{dst.name}: {info['num_samples']} samples, expected {n}")
    return f"{n} samples, {len(info['shards'])} shards"


def convert_api(src: Path, dst: Path, n: int) -> str:
    import fastdata

    report = fastdata.convert(fastdata.sources.ImageFolder(src), str(dst),
                              fastdata.WriteOptions(format="hdf5", workers=2))
    info = fastdata.info(str(dst))
    if info["num_samples"] != n:
        raise AssertionError(f"{dst.name}: {info['num_samples']} samples, expected {n} ({report})")
    return f"{n} samples, {len(info['shards'])} shards"


def verify(stores: list[Path]) -> str:
    for store in stores:
        cli("verify", "--decode", str(store))
    return f"{len(stores)} stores sound"


def load(stores: list[Path], truth: dict[int, int]) -> str:
    """Every sample of every store once, through a 2-worker spawn loader."""
    import torch

    import fastdata

    datasets = [fastdata.open_dataset(str(s), output="tensor") for s in stores]
    try:
        for store, ds in zip(stores, datasets, strict=True):
            if len(ds) != len(truth):
                raise AssertionError(f"{store.name}: {len(ds)} samples, expected {len(truth)}")
        # shuffle=False: the concatenation's order, each store's samples in ImageFolder order, whose
        # sample k is the image of red k
        loader = fastdata.loader(torch.utils.data.ConcatDataset(datasets), batch_size=4, num_workers=2,
                                 shuffle=False, multiprocessing_context=multiprocessing.get_context("spawn"))
        arrived = []
        for images, labels in loader:
            for image, label in zip(images, labels, strict=True):
                pixels = image.numpy()
                if pixels.shape[-1] == 3 and pixels.shape[0] != 3:
                    pixels = pixels.transpose(2, 0, 1)  # HWC -> CHW
                red = int(pixels[0, 0, 0])
                if truth.get(red) is None or pixels.shape != (3, SIZE[1], SIZE[0]) or not (
                        (pixels[0] == red).all() and (pixels[1] == 40 * truth[red]).all() and (pixels[2] == 200).all()):
                    raise AssertionError(f"sample {len(arrived)}: shape {pixels.shape} or its pixels changed")
                if truth.get(red) != int(label):
                    raise AssertionError(f"sample of red {red}: label {int(label)}, expected {truth.get(red)}")
                arrived.append(red)
        expected = list(truth) * len(stores)
        if arrived != expected:
            raise AssertionError(f"loaded in order {arrived}, expected {expected}")
    finally:
        for ds in datasets:
            ds.close()
    return f"{len(arrived)} samples ({len(stores)} stores x {len(truth)}), 2 spawn workers"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", help="the wheel installed: its version must be fastdata.__version__")
    args = parser.parse_args()
    results: list[tuple[str, bool, str, float]] = []

    def step(name: str, fn, *a) -> bool:
        t0 = time.perf_counter()
        try:
            detail, ok = fn(*a), True
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the run fails
            detail, ok = f"{type(err).__name__}: {err}", False
            traceback.print_exc()
        results.append((name, ok, detail, time.perf_counter() - t0))
        print(f"{'ok  ' if ok else 'FAIL'} {name} ({results[-1][3]:.1f} s): {detail}", flush=True)
        return ok

    with tempfile.TemporaryDirectory(prefix="fastdata-wheel-smoke-") as tmp:
        work = Path(tmp)
        os.chdir(work)  # nothing of a checkout in the working folder
        src = work / "imgs"
        truth = make_images(src)
        lmdb, h5 = work / "cli.lmdb", work / "api.h5"
        if step("install", check_install, args.wheel):
            step("convert (CLI, LMDB)", convert_cli, src, lmdb, len(truth))
            step("convert (API, HDF5)", convert_api, src, h5, len(truth))
            if all(ok for _, ok, _, _ in results):
                step("fastdata verify --decode", verify, [lmdb, h5])
                step("load (fastdata.loader)", load, [lmdb, h5], truth)
        os.chdir(Path(tmp).parent)
    failed = [name for name, ok, _, _ in results if not ok]
    total = sum(t for *_, t in results)
    print(f"wheel smoke test, Python {sys.version.split()[0]}: {len(results) - len(failed)}/{len(results)} "
          f"checks passed in {total:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed or len(results) < 5 else 0


if __name__ == "__main__":
    sys.exit(main())
