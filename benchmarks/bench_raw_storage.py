"""Raw-native storage (``convert --storage raw|mixed``): disk cost and decode-time speed.

1. Disk: photo-like synthetic JPEGs (``fastdata.synth.make_image_folder``, ImageNet-like ~400x350 by
   default) converted three ways: original bytes, ``--storage raw --max-side 512`` and ``--storage
   mixed --raw-fraction 0.5 --max-side 512``; prints each store's bytes and the ratio to the JPEG store.
2. Speed, in this one process with one torch thread (as in a DataLoader worker): the same images'
   JPEG bytes and PPM records (the raw store's records: images over --max-side scaled down, the
   output says how many) through ``fastdata.transforms.RandomResizedCrop(224)`` with the same seeds; median
   images/s over ``--repeats`` interleaved passes after a warm-up. Not a loading benchmark: no
   store, no DataLoader, no disk (the raw store's extra bytes cost page cache and I/O there).
3. Mixed stores at the same disk: ``--raw-fraction 0.5`` (images chosen by a hash of the path)
   against ``--raw-budget`` set to that store's size (images chosen by decode cost per extra byte):
   each store's size, and every sample read through ``open_dataset(decode=RandomResizedCrop(224))``
   in this process, median images/s over interleaved passes.

    python benchmarks/bench_raw_storage.py
    python benchmarks/bench_raw_storage.py --images 400 --repeats 7
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import fastdata
from fastdata.common.imageio import decode_image, encode_ppm
from fastdata.synth import make_image_folder
from fastdata.tools.verify import info
from fastdata.transforms import RandomResizedCrop
from fastdata.writer.ingest import raw_native_rgb


def _files(root: str) -> list[bytes]:
    import pathlib

    return [p.read_bytes() for p in sorted(pathlib.Path(root).rglob("*.jpg"))]


def _pass(transform, images: list[bytes]) -> float:
    started = time.perf_counter()
    for i, data in enumerate(images):
        transform(data, np.random.default_rng(i))
    return len(images) / (time.perf_counter() - started)


def _read_rates(stores: dict[str, str], names: tuple[str, ...], repeats: int) -> dict[str, float]:
    """Median images/s of reading every sample of each named store in this process, interleaved."""
    datasets = {name: fastdata.open_dataset(stores[name], decode=RandomResizedCrop(224), output="numpy", seed=0)
                for name in names}
    for name in names:
        mixed_split[name] = info(stores[name])["raw_split"]["raw"]["count"]

    def one_pass(ds) -> float:
        started = time.perf_counter()
        for i in range(len(ds)):
            ds[i]
        return len(ds) / (time.perf_counter() - started)

    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        one_pass(datasets[name])  # warm-up: page cache and first opens
    for _ in range(repeats):
        for name in names:
            rates[name].append(one_pass(datasets[name]))
    for ds in datasets.values():
        ds.close()
    return {name: statistics.median(r) for name, r in rates.items()}


#: the raw record count of each store :func:`_read_rates` read
mixed_split: dict[str, int] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200, help="images (in 4 classes)")
    parser.add_argument("--repeats", type=int, default=5, help="measured passes per pipeline")
    parser.add_argument("--max-side", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/src"
        make_image_folder(src, num_classes=4, per_class=args.images // 4, size="imagenet", seed=0)
        sizes: dict[str, int] = {}
        stores: dict[str, str] = {}
        for name, options in (("jpeg (original)", {}),
                              ("raw", {"storage": "raw", "max_side": args.max_side}),
                              ("mixed 0.5", {"storage": "mixed", "raw_fraction": 0.5, "max_side": args.max_side})):
            dst = f"{tmp}/{len(sizes)}.lmdb"
            fastdata.convert(src, dst, progress=False, **options)
            sizes[name] = info(dst)["total_bytes"]
            stores[name] = dst
        # the same disk as the fraction's store, chosen by decode cost instead of the path
        budget_name = "mixed budget"
        stores[budget_name] = f"{tmp}/budget.lmdb"
        fastdata.convert(src, stores[budget_name], progress=False, storage="mixed", max_side=args.max_side,
                         raw_budget=sizes["mixed 0.5"])
        sizes[budget_name] = info(stores[budget_name])["total_bytes"]
        base = sizes["jpeg (original)"]
        print(f"{args.images} ImageNet-like JPEGs, --max-side {args.max_side}:")
        for name, size in sizes.items():
            print(f"  {name:<16} {size / 1e6:8.1f} MB  {size / base:5.2f}x the JPEG store")
        mixed = _read_rates(stores, ("mixed 0.5", budget_name), args.repeats)
        jpegs = _files(src)
        # exactly the raw store's records (the writer's own function): larger images scaled down to --max-side
        ppms = [encode_ppm(raw_native_rgb(decode_image(j, "RGB"), args.max_side)) for j in jpegs]
    resized = sum(max(Image.open(io.BytesIO(j)).size) > args.max_side for j in jpegs)
    rrc = RandomResizedCrop(224)
    rates: dict[str, list[float]] = {"jpeg": [], "ppm": []}
    _pass(rrc, jpegs), _pass(rrc, ppms)  # warm-up
    for _ in range(args.repeats):
        rates["jpeg"].append(_pass(rrc, jpegs))
        rates["ppm"].append(_pass(rrc, ppms))
    jpeg, ppm = statistics.median(rates["jpeg"]), statistics.median(rates["ppm"])
    print(f"RandomResizedCrop(224), one process, one torch thread, median of {args.repeats} passes "
          f"({resized} of {len(jpegs)} images larger than {args.max_side} px, their PPMs scaled down):")
    print(f"  from JPEG {jpeg:8.0f} images/s")
    print(f"  from PPM  {ppm:8.0f} images/s  ({ppm / jpeg:.2f}x)")
    print(f"Mixed stores at the same disk, every sample through open_dataset(decode=RandomResizedCrop(224)), "
          f"median of {args.repeats} interleaved passes:")
    for name, rate in mixed.items():
        split = mixed_split[name]
        print(f"  {name:<13} {sizes[name] / 1e6:7.1f} MB, {split} raw, {rate:8.0f} images/s "
              f"({rate / mixed['mixed 0.5']:.2f}x the fraction's)")


if __name__ == "__main__":
    main()
