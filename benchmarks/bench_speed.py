"""Loading speed against the folder baseline and the decode-only ceiling, measured side by side in one run.

Pipelines, all through a real DataLoader (2 workers, persistent, shuffled):

* ``folder``   ImageFolder-equivalent + PIL transforms + PILToTensor (fastdata.bench.folder)
* ``ceiling``  the decode-only limit: the same encoded bytes held in RAM (one numpy
               blob), decoded with fastdata's fastest path into a batch array; no storage
* ``lmdb`` / ``hdf5``  fastdata stores with the same decode path

Scenarios (``--scenario``, default all):

1. ``imagenet``   ImageNet-like JPEGs, RandomResizedCrop(224) -> uint8 tensors, batch 64
   ``imagenet-fast`` the same with ``RandomResizedCrop(224, fast=True)`` (libjpeg-turbo's
                  fast IDCT and upsampling) for fastdata and the ceiling
2. ``cifar``      32x32 JPEGs, uint8 tensors, batch 256
3. ``cifar-cold`` as 2, page cache of every file evicted before each epoch
4. ``cifar-raw``  a ``--raw 32x32`` store vs the folder
5. ``imagenet-raw`` ``--storage raw --max-side 512`` stores (LMDB, HDF5) of the ImageNet-like images,
                  RandomResizedCrop(224) -> uint8, against the raw-pixel ceiling (the same images as
                  PPM files held in RAM, cropped and resized by the same path), with a ``--storage
                  mixed --raw-fraction 0.5`` store and the JPEG store beside them (not in the default
                  ``--scenario`` list: ``--scenario imagenet-raw``)

Median images/s over ``--epochs`` measured epochs after one warm-up epoch, the
pipelines of a scenario interleaved epoch by epoch (so a slow spell of a shared
machine hits all of them); the table shows ratios to the folder baseline and to
the ceiling.

    python benchmarks/bench_speed.py                  # full size (~10 min on 2 cores)
    python benchmarks/bench_speed.py --quick          # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import fastdata
from fastdata import transforms
from fastdata.bench.cache import evict_page_cache
from fastdata.bench.folder import FolderDataset
from fastdata.format.manifest import read_manifest
from fastdata.reader.batching import build_batch, collate
from fastdata.reader.seeding import seed_worker
from fastdata.synth import make_image_folder


class RamDataset(torch.utils.data.Dataset):
    """The ceiling: encoded bytes in RAM (numpy blob + offsets), no storage layer.
    Batches decode straight into one array, exactly like fastdata's fast path."""

    def __init__(self, root: str, decode, shape):
        from fastdata.writer.sources.folder import scan_folder

        scan = scan_folder(root)
        blobs = [open(p, "rb").read() for p in scan.paths]
        self.offsets = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        self.blob = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        self.targets = scan.labels
        self.decode = decode
        self.shape = shape

    def __len__(self):
        return len(self.targets)

    def _bytes(self, i):
        return self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes()

    def __getitem__(self, i):
        return torch.from_numpy(self.decode(self._bytes(i))).permute(2, 0, 1), int(self.targets[i])

    def __getitems__(self, indices):
        # the same batch builder (allocation, queue transport) as fastdata's datasets:
        # the ceiling differs only in where the encoded bytes come from
        indices = np.asarray(indices)

        def fill(arr):
            for j, i in enumerate(indices.tolist()):
                self.decode.decode_into(self._bytes(i), arr[j])

        return build_batch(self.targets[indices], self.shape, fill, channels_first=True)


class FullDecode:
    """decode-time transform for plain full decode of fixed-size images (ceiling for cifar)."""

    def __init__(self, shape):
        self.output_size = shape

    def __call__(self, data):
        return transforms.full_decode(data)

    def decode_into(self, data, out):
        from fastdata.reader.decode import decode_numpy_into

        decode_numpy_into(data, "JPEG", out)


#: the baseline collates exactly as users' loaders do (into shared memory inside workers)
folder_collate = torch.utils.data.default_collate


def measure_interleaved(pipelines, *, batch_size, workers, epochs):
    """Median images/s per pipeline. ``pipelines``: name -> (dataset, collate_fn, files).

    All loaders keep persistent workers and their epochs run round-robin (one
    epoch of each pipeline in turn), so a slow spell of this shared machine hits
    every pipeline alike and the *ratios* stay fair. ``files``, when given, have
    their page cache evicted before each of that pipeline's epochs.
    """
    loaders = {
        name: torch.utils.data.DataLoader(
            ds, batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
            worker_init_fn=seed_worker, collate_fn=collate_fn, prefetch_factor=4 if workers else None,
            generator=torch.Generator().manual_seed(0))
        for name, (ds, collate_fn, _files) in pipelines.items()
    }
    rates = {name: [] for name in pipelines}
    for epoch in range(epochs + 1):  # epoch 0 is the warm-up
        for name, loader in loaders.items():
            files = pipelines[name][2]
            if files:
                evict_page_cache(files)
            t0 = time.perf_counter()
            n = 0
            for _images, labels in loader:
                n += len(labels)
            if epoch > 0:
                rates[name].append(n / (time.perf_counter() - t0))
    loaders.clear()
    return {name: (statistics.median(r), r) for name, r in rates.items()}


def write_ppm_folder(src: str, dst: str, max_side: int) -> None:
    """The images of ``src`` as binary PPM files under ``dst`` (same class folders), RGB, scaled
    down as ``--storage raw --max-side`` does: the raw-pixel ceiling's bytes."""
    from PIL import Image

    from fastdata.writer.sources.folder import scan_folder

    scan = scan_folder(src)
    for path in scan.paths:
        path = os.fsdecode(path)
        out = os.path.join(dst, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with Image.open(path) as im:
            rgb = im.convert("RGB")
        longer = max(rgb.size)
        if longer > max_side:
            size = tuple(max(1, round(side * max_side / longer)) for side in rgb.size)
            rgb = rgb.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        rgb.save(os.path.splitext(out)[0] + ".ppm", format="PPM")


def store_files(path):
    return [os.path.join(path, s["name"]) for s in read_manifest(path)["shards"]]


def folder_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def run(args):
    work = args.workdir or tempfile.mkdtemp(prefix="fastdata-speed-")
    results = {}
    wanted = set(args.scenario.split(","))

    def row(scenario, name, rate, rates):
        results.setdefault(scenario, {})[name] = {"median_img_s": rate, "epochs": rates}
        print(f"  {scenario:11s} {name:8s} {rate:10.0f} img/s   epochs: {', '.join(f'{r:.0f}' for r in rates)}",
              flush=True)

    common = dict(workers=args.workers, epochs=args.epochs)

    def scenario_rows(scenario, pipelines, batch_size):
        for name, (rate, rates) in measure_interleaved(pipelines, batch_size=batch_size, **common).items():
            row(scenario, name, rate, rates)

    if wanted & {"imagenet", "imagenet-fast"}:
        src = os.path.join(work, "imagenet")
        if not os.path.isdir(src):
            make_image_folder(src, num_classes=10, per_class=args.imagenet // 10, size="imagenet", workers=2)
        for suffix in (".lmdb", ".h5"):
            if not os.path.isdir(src + suffix):
                fastdata.convert(src, src + suffix, progress=False)
        for scenario, fast in (("imagenet", False), ("imagenet-fast", True)):
            if scenario not in wanted:
                continue
            # fast=True: libjpeg-turbo's fast IDCT and upsampling, for fastdata and the ceiling alike
            rrc = transforms.RandomResizedCrop(224, fast=fast)
            print(f"{scenario}: {args.imagenet} JPEGs, RandomResizedCrop(224{', fast=True' if fast else ''}) "
                  "-> uint8, batch 64", flush=True)
            scenario_rows(scenario, {
                "folder": (FolderDataset(src, "rrc224", "tensor"), folder_collate, None),
                "ceiling": (RamDataset(src, rrc, (224, 224)), collate, None),
                "lmdb": (fastdata.open_dataset(src + ".lmdb", output="tensor", decode=rrc), collate, None),
                "hdf5": (fastdata.open_dataset(src + ".h5", output="tensor", decode=rrc), collate, None),
            }, 64)

    if "imagenet-raw" in wanted:
        src = os.path.join(work, "imagenet")
        if not os.path.isdir(src):
            make_image_folder(src, num_classes=10, per_class=args.imagenet // 10, size="imagenet", workers=2)
        for suffix, kw in ((".lmdb", {}), ("-raw.lmdb", {"storage": "raw", "max_side": 512}),
                           ("-raw.h5", {"storage": "raw", "max_side": 512}),
                           ("-mixed.lmdb", {"storage": "mixed", "raw_fraction": 0.5, "max_side": 512})):
            if not os.path.isdir(src + suffix):
                fastdata.convert(src, src + suffix, progress=False, **kw)
        ppm = src + "-ppm"
        if not os.path.isdir(ppm):
            write_ppm_folder(src, ppm, 512)
        rrc = transforms.RandomResizedCrop(224)
        sizes = {k: sum(os.path.getsize(f) for f in store_files(src + k)) / 1e6
                 for k in (".lmdb", "-raw.lmdb", "-mixed.lmdb")}
        print(f"imagenet-raw: {args.imagenet} images as --storage raw --max-side 512 stores (and mixed 0.5, and "
              f"JPEG), RandomResizedCrop(224) -> uint8, batch 64; store MB: "
              + ", ".join(f"{k} {v:.0f}" for k, v in sizes.items()), flush=True)
        results.setdefault("imagenet-raw", {})["store_mb"] = sizes
        scenario_rows("imagenet-raw", {
            "folder": (FolderDataset(src, "rrc224", "tensor"), folder_collate, None),
            "ceiling": (RamDataset(ppm, rrc, (224, 224)), collate, None),
            "lmdb": (fastdata.open_dataset(src + "-raw.lmdb", output="tensor", decode=rrc), collate, None),
            "hdf5": (fastdata.open_dataset(src + "-raw.h5", output="tensor", decode=rrc), collate, None),
            "lmdb-mixed": (fastdata.open_dataset(src + "-mixed.lmdb", output="tensor", decode=rrc), collate, None),
            "lmdb-jpeg": (fastdata.open_dataset(src + ".lmdb", output="tensor", decode=rrc), collate, None),
        }, 64)

    if wanted & {"cifar", "cifar-cold", "cifar-raw"}:
        src = os.path.join(work, "cifar")
        if not os.path.isdir(src):
            make_image_folder(src, num_classes=10, per_class=args.cifar // 10, size="cifar", workers=2)
        for suffix, kw in ((".lmdb", {}), (".h5", {}), ("-raw.lmdb", {"raw": "32x32"}), ("-raw.h5", {"raw": "32x32"})):
            if not os.path.isdir(src + suffix):
                fastdata.convert(src, src + suffix, progress=False, **kw)
        for scenario in ("cifar", "cifar-cold"):
            if scenario not in wanted:
                continue
            cold = scenario == "cifar-cold"
            print(f"{scenario}: {args.cifar} 32x32 JPEGs -> uint8, batch 256"
                  f"{' (page cache evicted each epoch)' if cold else ''}", flush=True)
            pipelines = {"folder": (FolderDataset(src, "none", "tensor"), folder_collate,
                                    folder_files(src) if cold else None)}
            if not cold:
                pipelines["ceiling"] = (RamDataset(src, FullDecode((32, 32)), (32, 32)), collate, None)
            for suffix, name in ((".lmdb", "lmdb"), (".h5", "hdf5")):
                pipelines[name] = (fastdata.open_dataset(src + suffix, output="tensor"), collate,
                                   store_files(src + suffix) if cold else None)
            scenario_rows(scenario, pipelines, 256)
        if "cifar-raw" in wanted:
            print("cifar-raw: --raw 32x32 stores vs the folder, batch 256", flush=True)
            scenario_rows("cifar-raw", {
                "folder": (FolderDataset(src, "none", "tensor"), folder_collate, None),
                "lmdb": (fastdata.open_dataset(src + "-raw.lmdb", output="tensor"), collate, None),
                "hdf5": (fastdata.open_dataset(src + "-raw.h5", output="tensor"), collate, None),
            }, 256)

    print("\nratios (median images/s, same run)")
    print(f"{'scenario':11s} {'store':6s} {'x folder':>9s} {'x ceiling':>10s}")
    for scenario, rows in results.items():
        rows = {k: v for k, v in rows.items() if k != "store_mb"}
        base = rows["folder"]["median_img_s"]
        ceil = rows.get("ceiling", {}).get("median_img_s")
        for name in ("lmdb", "hdf5", "lmdb-mixed", "lmdb-jpeg"):
            if name in rows:
                r = rows[name]["median_img_s"]
                print(f"{scenario:11s} {name:6s} {r / base:9.2f} {(r / ceil) if ceil else float('nan'):10.2f}")
        if ceil:
            print(f"{scenario:11s} {'(ceil)':6s} {ceil / base:9.2f}")
    results["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "platform": platform.platform(), "workers": args.workers, "epochs": args.epochs}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="imagenet,imagenet-fast,cifar,cifar-cold,cifar-raw")
    p.add_argument("--imagenet", type=int, default=2000, help="number of ImageNet-like images")
    p.add_argument("--cifar", type=int, default=20000, help="number of 32x32 images")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="measured epochs (after one warm-up)")
    p.add_argument("--workdir", help="reuse generated data and stores here")
    p.add_argument("--json", help="write results as JSON")
    p.add_argument("--quick", action="store_true", help="smoke size")
    args = p.parse_args(argv)
    if args.quick:
        args.imagenet, args.cifar, args.epochs = 200, 2000, 2
    run(args)


if __name__ == "__main__":
    sys.exit(main())
