"""Raw-pixel stores against FFCV's raw mode, side by side in one run: RandomResizedCrop(224) -> uint8.

Data: ``--images`` ImageNet-like JPEGs (``fastdata.synth.make_image_folder(..., size="imagenet")``,
~400x350, some over 512 px), kept in ``--workdir`` and reused. Stores of the same images:

* ``fastdata-raw``     ``fastdata.convert(src, dst, storage="raw", max_side=512)`` (LMDB): decoded RGB
  pixels at native size, the longer side capped at 512 (Pillow LANCZOS);
* ``fastdata-mixed``   ``storage="mixed", raw_fraction=0.5, max_side=512``: half raw, half the original
  JPEG bytes;
* ``ffcv-raw``         ``ffcv.writer.DatasetWriter`` with ``RGBImageField(write_mode="raw",
  max_resolution=512)`` (FFCV's raw mode: decoded pixels, the longer side capped at 512 by OpenCV
  INTER_AREA) and an ``IntField`` label;
* ``ffcv-mixed``       ``RGBImageField(write_mode="proportion", compress_probability=0.5,
  max_resolution=512, jpeg_quality=90)``: FFCV's mixed mode (the JPEG half re-encoded at quality 90,
  as FFCV's ImageNet recipe does);
* ``ceiling``          the raw-pixel ceiling: the fastdata-raw store's pixels as PPM bytes held in RAM,
  cropped by fastdata's fused transform (no storage layer).

Loading, each library's fastest documented path, batch ``--batch-size`` (64), ``--workers`` (2):
fastdata through ``fastdata.loader(fastdata.open_dataset(store, decode=RandomResizedCrop(224),
output="tensor"), num_workers=2)`` (worker processes); FFCV through ``ffcv.loader.Loader(beton,
batch_size, num_workers=2, order=OrderOption.RANDOM, os_cache=True, pipelines={"image":
[RandomResizedCropRGBImageDecoder((224, 224)), ToTensor(), ToTorchImage()], "label": [IntDecoder(),
ToTensor()]})`` (its compiled threads). Both give ``[64, 3, 224, 224]`` uint8 tensors. Page cache
warm: one warm-up epoch of each, then ``--epochs`` epochs run round-robin (one of each contender in
turn); images/s are medians of the epochs, ratios medians of the per-round ratios. The disk of each
store (its files) is reported against the JPEG bytes.

Needs FFCV beside fastdata, in the bench venv only (Debian's ``libopencv-dev`` and
``libturbojpeg0-dev``, then ``pip install ffcv``)::

    python benchmarks/bench_ffcv_raw.py --workdir /tmp/ffcv-raw --epochs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fastdata  # noqa: E402
from fastdata import transforms  # noqa: E402

CONTENDERS = ("fastdata-raw", "ffcv-raw", "ceiling", "fastdata-mixed", "ffcv-mixed")
MAX_SIDE = 512


def disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class FolderImages:
    """(RGB uint8 array, label) per image of a folder: what FFCV's writer takes."""

    def __init__(self, root: str):
        from fastdata.writer.sources.folder import scan_folder

        scan = scan_folder(root)
        self.paths = [os.fsdecode(p) for p in scan.paths]
        self.labels = [int(x) for x in scan.labels]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            return np.asarray(im.convert("RGB")), self.labels[i]


def prepare(work: str, images: int) -> dict[str, str]:
    src = os.path.join(work, "jpeg")
    if not os.path.isdir(src):
        from fastdata.synth import make_image_folder  # (OpenCV: only to generate the images)

        make_image_folder(src, num_classes=10, per_class=images // 10, size="imagenet", workers=2)
    paths = {"jpeg": src, "fastdata-raw": os.path.join(work, "raw.lmdb"),
             "fastdata-mixed": os.path.join(work, "mixed.lmdb"), "ffcv-raw": os.path.join(work, "raw.beton"),
             "ffcv-mixed": os.path.join(work, "mixed.beton"), "ppm": os.path.join(work, "ppm")}
    for name, kw in (("fastdata-raw", {"storage": "raw"}),
                     ("fastdata-mixed", {"storage": "mixed", "raw_fraction": 0.5})):
        if not os.path.isdir(paths[name]):
            t0 = time.perf_counter()
            fastdata.convert(src, paths[name], max_side=MAX_SIDE, workers=2, progress=False, **kw)
            print(f"{name}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    for name, field in (("ffcv-raw", dict(write_mode="raw", max_resolution=MAX_SIDE)),
                        ("ffcv-mixed", dict(write_mode="proportion", compress_probability=0.5,
                                            max_resolution=MAX_SIDE, jpeg_quality=90))):
        if not os.path.isfile(paths[name]):
            t0 = time.perf_counter()
            DatasetWriter(paths[name], {"image": RGBImageField(**field), "label": IntField()},
                          num_workers=2).from_indexed_dataset(FolderImages(src))
            print(f"{name}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    if not os.path.isdir(paths["ppm"]):
        from bench_speed import write_ppm_folder

        write_ppm_folder(src, paths["ppm"], MAX_SIDE)
    return paths


def loaders(paths: dict[str, str], names: list[str], args) -> dict:
    rrc = transforms.RandomResizedCrop(224)
    out = {}
    for name in names:
        if name.startswith("fastdata-"):
            ds = fastdata.open_dataset(paths[name], decode=rrc, output="tensor")
            out[name] = fastdata.loader(ds, batch_size=args.batch_size, num_workers=args.workers, seed=0)
        elif name == "ceiling":
            from bench_speed import RamDataset

            from fastdata.reader.batching import collate
            from fastdata.reader.seeding import seed_worker

            out[name] = torch.utils.data.DataLoader(
                RamDataset(paths["ppm"], rrc, (224, 224)), batch_size=args.batch_size, shuffle=True,
                num_workers=args.workers, persistent_workers=args.workers > 0, worker_init_fn=seed_worker,
                collate_fn=collate, generator=torch.Generator().manual_seed(0))
        else:
            from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
            from ffcv.loader import Loader, OrderOption
            from ffcv.transforms import ToTensor, ToTorchImage

            out[name] = Loader(paths[name], batch_size=args.batch_size, num_workers=args.workers,
                               order=OrderOption.RANDOM, os_cache=True, drop_last=False, seed=0,
                               pipelines={"image": [RandomResizedCropRGBImageDecoder((224, 224)), ToTensor(),
                                                    ToTorchImage()],
                                          "label": [IntDecoder(), ToTensor()]})
    return out


def epoch(loader) -> tuple[int, tuple]:
    n, shape = 0, ()
    for images, labels in loader:
        n += len(labels)
        shape = (tuple(images.shape), images.dtype)
    return n, shape


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="generated images and stores (kept and reused)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--epochs", type=int, default=5, help="measured epochs per contender (after one warm-up)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    names = [n for n in args.contenders.split(",") if n]
    paths = prepare(args.workdir, args.images)
    sizes = {name: disk_bytes(paths[name if name != "ceiling" else "ppm"]) for name in names}
    jpeg = disk_bytes(paths["jpeg"])
    run = loaders(paths, names, args)
    rates: dict[str, list[float]] = {n: [] for n in names}
    shapes = {}
    for e in range(args.epochs + 1):  # epoch 0 is the warm-up
        for name in names:
            t0 = time.perf_counter()
            n, shapes[name] = epoch(run[name])
            if e > 0:
                rates[name].append(n / (time.perf_counter() - t0))
        print(f"round {e}: " + ", ".join(f"{n} {rates[n][-1]:.0f}" for n in names if rates[n]), flush=True)
    med = {n: statistics.median(r) for n, r in rates.items()}
    ref = "fastdata-raw" if "fastdata-raw" in names else names[0]
    print(f"\n{args.images} images, RandomResizedCrop(224) -> uint8, batch {args.batch_size}, {args.workers} workers, "
          f"medians of {args.epochs} interleaved epochs; JPEG bytes {jpeg / 1e6:.0f} MB")
    print("| contender | images/s | epochs | disk MB | x JPEG disk | fastdata-raw x this (per-round median) |")
    print("|---|---:|---|---:|---:|---:|")
    result = {"args": vars(args), "jpeg_bytes": jpeg, "rows": {}}
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(rates[ref], rates[n], strict=True))
        print(f"| {n} | {med[n]:.0f} | {', '.join(f'{r:.0f}' for r in rates[n])} | {sizes[n] / 1e6:.0f} | "
              f"{sizes[n] / jpeg:.2f} | {ratio:.2f} |")
        result["rows"][n] = {"median_img_s": med[n], "epochs": rates[n], "disk_bytes": sizes[n],
                             "ref_over_this": ratio, "batch": str(shapes[n])}
    print("batches:", {n: str(s) for n, s in shapes.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
