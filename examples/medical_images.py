"""Medical and scientific images with fastdata: 16-bit CT slices and 4-band satellite tiles,
read as they are stored (no conversion to 8-bit RGB), cropped at decode time, batched and
normalized.

What it does, end to end on CPU (seconds with the defaults):

1. writes two small synthetic ImageFolder sets (:mod:`fastdata.tools.synth_native`):
   CT-like 512x512 16-bit grayscale PNGs (12-bit values, 0-4095) and satellite-like
   256x256 4-band uint16 TIFFs;
2. converts the CT set with ``lossless="tiff"`` (``fastdata convert SRC DST --lossless tiff``:
   the deep PNGs re-encoded as zstd TIFF, bit for bit, faster to decode) and the 4-band set
   as it is;
3. opens the stores with ``image_mode="unchanged"``: uint16 pixels, one channel for CT and
   four for the tiles (the default, ``image_mode="RGB"``, would give ImageFolder's 8-bit RGB)
   and checks a sample against the original file, bit for bit;
4. crops at decode time (``decode=fastdata.transforms.RandomResizedCrop(224)``: the crop
   keeps uint16), batches through ``fastdata.loader`` with 2 worker processes, and
   normalizes on the batch's device with the data's own value range
   (``normalize_on_device(..., value_range=(0, 4095))``: 12-bit data stored in uint16).

Usage::

    python examples/medical_images.py
    python examples/medical_images.py --ct 16 --bands 8 --json summary.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fastdata
from fastdata.tools.synth_native import CT_MAX, make_ct_folder, make_multiband_folder


def read_original(path: Path) -> np.ndarray:
    """The original file's pixels as stored, by the usual tool for its format."""
    if path.suffix == ".tif":
        import tifffile

        return tifffile.imread(path)
    import cv2

    return cv2.imread(str(path), cv2.IMREAD_UNCHANGED)


def train_batches(store: Path, crop: int, value_range: tuple[float, float], batches: int,
                  batch_size: int, workers: int, device: torch.device) -> dict:
    """Decode-time crop -> uint16 batches from ``fastdata.loader`` -> float32 on ``device``."""
    ds = fastdata.open_dataset(store, image_mode="unchanged", output="tensor",
                               decode=fastdata.transforms.RandomResizedCrop(crop))
    loader = fastdata.loader(ds, batch_size=batch_size, num_workers=workers, seed=0)
    lo, hi = value_range
    mean = std = None
    seen, t0 = 0, time.perf_counter()
    for step, (images, _labels) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        if mean is None:
            # per-channel statistics in 0-1 units of value_range; a stand-in, taken from the first
            # batch, for the dataset statistics a training script computes once
            unit = (images.float() - lo) / (hi - lo)
            mean = unit.mean(dim=(0, 2, 3)).tolist()
            std = unit.std(dim=(0, 2, 3)).tolist()
            print(f"  batch from the loader: {images.dtype} {tuple(images.shape)}; "
                  f"mean {[round(m, 3) for m in mean]}, std {[round(s, 3) for s in std]} (0-1 units)")
        x = fastdata.transforms.normalize_on_device(images, mean, std, value_range=value_range)
        seen += len(images)
        if step + 1 == batches:
            break
    elapsed = time.perf_counter() - t0
    print(f"  normalized on {device}: {x.dtype} {tuple(x.shape)}, mean {x.mean():.3f}, std {x.std():.3f}; "
          f"{seen} images in {elapsed:.1f} s")
    return {"mean": mean, "std": std, "batch_dtype": str(images.dtype), "batch_shape": list(images.shape),
            "images": seen, "normalized_mean": float(x.mean()), "normalized_std": float(x.std())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ct", type=int, default=64, help="CT-like images (default 64)")
    p.add_argument("--bands", type=int, default=64, help="4-band images (default 64)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=4, help="batches to run of each set")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (and conversion workers)")
    p.add_argument("--workdir", help="keep the data and stores here (default: a temporary directory)")
    p.add_argument("--json", help="write a summary here")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fastdata-medical-"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    summary: dict = {}
    try:
        # 1. the data: CT-like 16-bit PNGs (two classes), satellite-like 4-band TIFFs (four)
        ct_src, bands_src = work / "ct", work / "bands"
        make_ct_folder(ct_src, num_classes=2, per_class=max(1, args.ct // 2), workers=args.workers)
        make_multiband_folder(bands_src, num_classes=4, per_class=max(1, args.bands // 4), workers=args.workers)

        # 2. convert: deep PNGs re-encoded as zstd TIFF (bit-exact); the TIFF tiles as they are
        ct_store, bands_store = work / "ct.lmdb", work / "bands.h5"
        for src, dst, kw in ((ct_src, ct_store, {"lossless": "tiff"}), (bands_src, bands_store, {})):
            report = fastdata.convert(src, dst, workers=args.workers, overwrite=True, progress=False, **kw)
            print(f"converted {report.images} images into {dst.name} in {report.elapsed:.1f} s"
                  f"{' (--lossless tiff)' if kw else ''}")

        # 3. read them unchanged: uint16, 1 or 4 channels, equal to the files
        for name, src, store in (("ct", ct_src, ct_store), ("bands", bands_src, bands_store)):
            ds = fastdata.open_dataset(store, image_mode="unchanged", output="numpy")
            image, label = ds[0]
            rel = ds.relpath(0)  # the file it came from, relative to the converted folder
            path = src / rel
            exact = bool(np.array_equal(image, read_original(path)))
            print(f"{name}: sample 0 ({rel}, class {label}): {image.dtype} {image.shape}, "
                  f"values {image.min()}-{image.max()}, equal to the file: {exact}")
            if not exact:
                raise SystemExit(f"{store}: sample 0 differs from {path}")
            summary[name] = {"dtype": str(image.dtype), "shape": list(image.shape), "bit_exact": exact}

        # 4. train-time reads: decode-time crop, loader, normalize with the data's own range
        print("ct: RandomResizedCrop(224) at decode time, 12-bit range")
        summary["ct"] |= train_batches(ct_store, 224, (0, CT_MAX), args.batches, args.batch_size, args.workers,
                                       device)
        print("bands: RandomResizedCrop(128) at decode time, reflectance 0-10000")
        summary["bands"] |= train_batches(bands_store, 128, (0, 10000), args.batches, args.batch_size,
                                          args.workers, device)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
