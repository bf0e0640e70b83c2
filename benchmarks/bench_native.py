"""Images as they are (16-bit, multi-band) through a DataLoader: fastdata stores next to their
decode ceilings and a plain OpenCV baseline, measured side by side in one run.

Scenario ``ct16`` (default 2000 CT-like 512x512 16-bit grayscale PNGs from
:mod:`fastdata.tools.synth_native`, 200-240 KB each), every pipeline yielding uint16
tensors of shape (N, 1, H, W) with the same settings (2 persistent workers, batch 32,
shuffled, prefetch 2):

* ``cv2``        the baseline: a plain map-style Dataset over the folder's file paths,
                 ``cv2.imread(path, cv2.IMREAD_UNCHANGED)`` -> tensor, ``default_collate``
                 (what a user writes without fastdata);
* ``lmdb`` / ``hdf5``  ``fastdata.open_dataset(store, image_mode="unchanged", output="tensor")``
                 through ``fastdata.loader``, over a store of the original PNGs;
* ``lmdb-lossless`` / ``hdf5-lossless``  the same over a ``--lossless tiff`` store (deep
                 PNGs re-encoded as zstd TIFF, bit-exact), when the installed fastdata has it;
* ``ceiling`` / ``ceiling-lossless``  the decode ceiling of each kind of store: the same
                 stored bytes (read out of the store once) held in RAM in a plain map-style
                 Dataset, decoded by the same decoder as the store's reads
                 (``fastdata.common.imageio.decode_image(b, "unchanged")``) -> tensor,
                 ``default_collate``, same DataLoader settings: no storage layer at all.

Scenario ``bands4`` (default 2000 satellite-like 256x256 4-band uint16 TIFFs, deflate):
the same rows over the original TIFFs, with ``tifffile.imread`` as the baseline
(OpenCV maps 4 samples to BGRA, so it is not a faithful baseline for bands).

The page cache is warm: every file is read once before the first epoch (the data fits in
RAM many times over). After one warm-up epoch of every pipeline, the epochs of a scenario
run round-robin (one of each pipeline in turn) so a slow spell of a shared machine hits
every pipeline alike; img/s are medians over ``--epochs`` measured epochs, and each ratio
is the median over the rounds of that round's ratio (the machine's speed drifts between
rounds more than within one). Before timing, each store's images are checked
bit-exact against the original files.

    python benchmarks/bench_native.py                           # 2000 + 2000 images, 5 epochs
    python benchmarks/bench_native.py --n 500 --epochs 3        # quicker
    python benchmarks/bench_native.py --quick                   # smoke size
    python benchmarks/bench_native.py --workdir /tmp/native --json native.json --md native.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdata  # noqa: E402
from fastdata.common.imageio import decode_image  # noqa: E402
from fastdata.format.backends.base import StorageSpec  # noqa: E402
from fastdata.format.backends.registry import reader_class  # noqa: E402
from fastdata.format.manifest import read_manifest  # noqa: E402
from fastdata.reader.seeding import seed_worker  # noqa: E402
from fastdata.tools.synth_native import make_ct_folder, make_multiband_folder  # noqa: E402

MB = 1 << 20


# --------------------------------------------------------------------------- the other pipelines
def to_chw(arr: np.ndarray) -> torch.Tensor:
    """HxW or HxWxC array -> CxHxW tensor of the same dtype (fastdata's ``output="tensor"``)."""
    t = torch.from_numpy(arr)
    return t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)


class Cv2Folder(torch.utils.data.Dataset):
    """The baseline: file paths in a list, each read and decoded by ``cv2.imread(IMREAD_UNCHANGED)``
    (or ``tifffile.imread`` for multi-band TIFFs, whose bands OpenCV would reorder as BGRA)."""

    def __init__(self, paths: list[str], labels: list[int], reader: str = "cv2"):
        self.paths, self.labels, self.reader = paths, labels, reader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        if self.reader == "tifffile":
            import tifffile

            arr = tifffile.imread(self.paths[i])
        else:
            import cv2

            arr = cv2.imread(self.paths[i], cv2.IMREAD_UNCHANGED)
        return to_chw(arr), self.labels[i]


class InRamBytes(torch.utils.data.Dataset):
    """The decode ceiling: a store's own image bytes held in RAM, decoded by fastdata's decoder."""

    def __init__(self, blobs: list[bytes], labels: list[int]):
        self.blobs, self.labels = blobs, labels

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int):
        return to_chw(decode_image(self.blobs[i], "unchanged")), self.labels[i]


def stored_images(store: str) -> tuple[list[bytes], list[int], list[str]]:
    """Every image of a classification store as stored (bytes), with its label and relative path,
    in the store's order (read through the shard readers, checksums verified)."""
    manifest = read_manifest(store)
    cls = reader_class(manifest["backend"])
    storage = StorageSpec.from_json(manifest["storage"])
    blobs, labels, paths = [], [], []
    for shard in manifest["shards"]:
        with cls(os.path.join(store, shard["name"]), storage) as reader:
            index = reader.read_index()
            blobs += reader.get_many(range(len(index)))
            labels += [int(x) for x in index.labels]
            paths += [os.fsdecode(index.relpath(j)) for j in range(len(index))]
    return blobs, labels, paths


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def folder_files(root: str) -> tuple[list[str], list[int]]:
    """ImageFolder order: sorted class folders, sorted files."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths, labels = [], []
    for k, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(root, c))):
            paths.append(os.path.join(root, c, f))
            labels.append(k)
    return paths, labels


# --------------------------------------------------------------------------- stores
def lossless_supported() -> bool:
    """Whether the installed fastdata's convert takes ``lossless=`` (``--lossless tiff``)."""
    return "lossless" in inspect.signature(fastdata.convert).parameters


class Skipped(Exception):
    """A scenario this fastdata cannot run (its images are rejected by the converter)."""


def convert(src: str, dst: str, lossless: str | None, expected: int) -> float:
    """Convert once (kept in the workdir); the seconds it took, 0 when reused.

    Raises:
        Skipped: the converter rejected images (e.g. a fastdata without multi-band TIFF support).
    """
    if os.path.isfile(os.path.join(dst, "manifest.json")) and read_manifest(dst)["num_samples"] == expected:
        return 0.0
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    kw = {"lossless": lossless} if lossless else {}
    report = fastdata.convert(src, dst, workers=2, progress=False, **kw)
    if report.images != expected:
        first = report.rejected_items[0] if report.rejected_items else ("?", "?")
        shutil.rmtree(dst, ignore_errors=True)
        raise Skipped(f"converting {src} kept {report.images} of {expected} images ({report.rejected} rejected, "
                      f"first: {first[0]}: {first[1]})")
    return time.perf_counter() - t0


def check_bit_exact(store: str, src: str, reader: str, sample: int = 25) -> None:
    """The store's images (through the dataset, ``image_mode="unchanged"``) equal the originals."""
    import cv2
    import tifffile

    _blobs, _labels, rel = stored_images(store)
    ds = fastdata.open_dataset(store, image_mode="unchanged", output="numpy")
    for i in np.linspace(0, len(ds) - 1, min(sample, len(ds))).astype(int).tolist():
        path = os.path.join(src, rel[i])
        want = tifffile.imread(path) if reader == "tifffile" else cv2.imread(path, cv2.IMREAD_UNCHANGED)
        got = ds[i][0]
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            raise SystemExit(f"{store}: image {i} ({rel[i]}) is not bit-exact: {got.dtype}{got.shape} "
                             f"vs {want.dtype}{want.shape}")


# --------------------------------------------------------------------------- timing
def make_loader(name: str, ds, batch_size: int, workers: int):
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                  worker_init_fn=seed_worker, prefetch_factor=2 if workers else None, pin_memory=False,
                  generator=torch.Generator().manual_seed(0))
    if isinstance(ds, (Cv2Folder, InRamBytes)):
        return torch.utils.data.DataLoader(ds, **common)
    return fastdata.loader(ds, **common)


def measure_interleaved(pipelines: dict, *, batch_size: int, workers: int, epochs: int) -> dict:
    """name -> (median images/s, per-epoch images/s). Epoch 0 (every pipeline's) is the warm-up."""
    loaders = {name: make_loader(name, ds, batch_size, workers) for name, ds in pipelines.items()}
    rates: dict[str, list[float]] = {name: [] for name in pipelines}
    shapes: dict[str, str] = {}
    for epoch in range(epochs + 1):
        for name, loader in loaders.items():
            t0 = time.perf_counter()
            n = 0
            for images, labels in loader:
                n += len(labels)
                if name not in shapes:  # what the pipeline yields, for the table (all must agree)
                    shapes[name] = f"{str(images.dtype).replace('torch.', '')}{tuple(images.shape[1:])}"
            elapsed = time.perf_counter() - t0
            if epoch > 0:
                rates[name].append(n / elapsed)
            print(f"    epoch {epoch} {name:13s} {n / elapsed:8.0f} img/s{'  (warm-up)' if epoch == 0 else ''}",
                  flush=True)
    loaders.clear()
    return {name: {"median_img_s": statistics.median(r), "epochs": r, "batch": shapes[name]}
            for name, r in rates.items()}


def warm(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


def store_shard_files(store: str) -> list[str]:
    return [os.path.join(store, s["name"]) for s in read_manifest(store)["shards"]]


# --------------------------------------------------------------------------- scenarios
def run_scenario(name: str, src: str, reader: str, args, lossless: bool) -> dict:
    paths, labels = folder_files(src)
    stores = {"lmdb": src + ".lmdb", "hdf5": src + ".h5"}
    if lossless:
        stores |= {"lmdb-lossless": src + "-lossless.lmdb", "hdf5-lossless": src + "-lossless.h5"}
    convert_s = {}
    for row, store in stores.items():
        convert_s[row] = convert(src, store, "tiff" if row.endswith("-lossless") else None, len(paths))
        check_bit_exact(store, src, reader)
    # the ceilings: each kind of store's own bytes, read out once (LMDB and HDF5 hold the same bytes)
    blobs_orig, labels_orig, _ = stored_images(stores["lmdb"])
    pipelines: dict = {"cv2" if reader == "cv2" else "tifffile": Cv2Folder(paths, labels, reader),
                       "ceiling": InRamBytes(blobs_orig, labels_orig)}
    formats = {"ceiling": _format(blobs_orig[0])}
    if lossless:
        blobs_tiff, labels_tiff, _ = stored_images(stores["lmdb-lossless"])
        pipelines["ceiling-lossless"] = InRamBytes(blobs_tiff, labels_tiff)
        formats["ceiling-lossless"] = _format(blobs_tiff[0])
    for row, store in stores.items():
        pipelines[row] = fastdata.open_dataset(store, image_mode="unchanged", output="tensor")
        formats[row] = formats["ceiling-lossless" if row.endswith("-lossless") else "ceiling"]
    warm(paths + [f for s in stores.values() for f in store_shard_files(s)])
    print(f"{name}: {len(paths)} images, batch {args.batch_size}, {args.workers} persistent workers, "
          f"warm page cache, {args.epochs} measured epochs", flush=True)
    rows = measure_interleaved(pipelines, batch_size=args.batch_size, workers=args.workers, epochs=args.epochs)
    base = rows["cv2" if reader == "cv2" else "tifffile"]["epochs"]
    for row, r in rows.items():
        r["stored_as"] = formats.get(row, f"{formats['ceiling']} files")
        r["x_baseline"] = paired_ratio(r["epochs"], base)
        ceiling = "ceiling-lossless" if row.endswith("-lossless") else "ceiling"
        if row in stores:
            r["x_ceiling"] = paired_ratio(r["epochs"], rows[ceiling]["epochs"])
            r["store_mb"] = dir_bytes(stores[row]) / MB
            r["convert_s"] = convert_s[row]
    return {"images": len(paths), "folder_mb": sum(os.path.getsize(p) for p in paths) / MB, "rows": rows}


def paired_ratio(rates: list[float], reference: list[float]) -> float:
    """Median over rounds of the round's ratio: each round runs one epoch of every pipeline back
    to back, so a slow spell of a shared machine that spans a round cancels out of its ratio
    (a ratio of medians would mix epochs from different spells)."""
    return statistics.median(a / b for a, b in zip(rates, reference, strict=True))


def _format(blob: bytes) -> str:
    return {b"\x89P": "PNG", b"II": "TIFF", b"MM": "TIFF"}.get(bytes(blob[:2]), "?")


ORDER = ("cv2", "tifffile", "lmdb", "hdf5", "ceiling", "lmdb-lossless", "hdf5-lossless", "ceiling-lossless")


def markdown(results: dict, command: str) -> str:
    lines = []
    for scenario, res in results["scenarios"].items():
        batch = next(iter(res["rows"].values()))["batch"]
        lines += [f"**{scenario}**: {res['images']} images, {res['description']}, {batch} per sample; "
                  f"folder {res['folder_mb']:.0f} MB",
                  "", "| pipeline | stored as | img/s | x ceiling | x baseline | size MB |",
                  "|---|---|---:|---:|---:|---:|"]
        for name in ORDER:
            r = res["rows"].get(name)
            if r is None:
                continue
            xc = f"{r['x_ceiling']:.2f}" if "x_ceiling" in r else ""
            size = f"{r['store_mb']:.0f}" if "store_mb" in r else ""
            lines.append(f"| {name} | {r['stored_as']} | {r['median_img_s']:.0f} | {xc} | {r['x_baseline']:.2f} | "
                         f"{size} |")
        lines.append("")
    for scenario, why in results.get("skipped", {}).items():
        lines += [f"**{scenario}**: left out: {why}", ""]
    m = results["machine"]
    if not m["lossless_rows"]:
        lines += ["No `--lossless tiff` rows: not run (`--no-lossless`) or this fastdata's convert has no `lossless=`.",
                  ""]
    lines.append(f"Machine: {m['cores']} cores, Python {m['python']}, torch {m['torch']}, {m['platform']}; "
                 f"fastdata {m['fastdata_commit']}. Command: `{command}`")
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def one_scenario(p: argparse.ArgumentParser, scenario: str, work: str, args, lossless: bool) -> dict:
    """Generate (once, kept in ``work``) and run one scenario."""
    if scenario == "ct16":
        src = os.path.join(work, f"ct16-{args.n}-{args.size}")
        if not os.path.isdir(src):
            s = make_ct_folder(src, num_classes=4, per_class=args.n // 4, size=(args.size, args.size), workers=2)
            print(f"generated {s.num_images} CT-like PNGs in {s.elapsed_s:.0f} s", flush=True)
        res = run_scenario(scenario, src, "cv2", args, lossless)
        res["description"] = f"CT-like {args.size}x{args.size} 16-bit grayscale PNG"
        return res
    if scenario == "bands4":
        src = os.path.join(work, f"bands4-{args.bands_n}-{args.bands_size}")
        if not os.path.isdir(src):
            s = make_multiband_folder(src, num_classes=4, per_class=args.bands_n // 4,
                                      size=(args.bands_size, args.bands_size), bands=4, workers=2)
            print(f"generated {s.num_images} 4-band TIFFs in {s.elapsed_s:.0f} s", flush=True)
        res = run_scenario(scenario, src, "tifffile", args, lossless)
        res["description"] = f"satellite-like {args.bands_size}x{args.bands_size} 4-band uint16 TIFF (deflate)"
        return res
    p.error(f"unknown scenario {scenario!r}")
    raise AssertionError  # p.error exits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="ct16,bands4", help="comma-separated: ct16, bands4")
    p.add_argument("--n", type=int, default=2000, help="CT-like images (default 2000)")
    p.add_argument("--size", type=int, default=512, help="side of the CT-like images (default 512)")
    p.add_argument("--bands-n", type=int, default=2000, help="4-band images (default 2000)")
    p.add_argument("--bands-size", type=int, default=256, help="side of the 4-band images (default 256)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5, help="measured epochs (after one warm-up)")
    p.add_argument("--no-lossless", action="store_true", help="skip the --lossless tiff stores")
    p.add_argument("--workdir", help="keep and reuse the generated data and stores here")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--quick", action="store_true", help="smoke size: 200 + 200 images, 2 epochs")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.bands_n, args.epochs = 200, 200, 2
    wanted = [s.strip() for s in args.scenario.split(",") if s.strip()]
    lossless = not args.no_lossless and lossless_supported()
    if not args.no_lossless and not lossless:
        print("note: this fastdata's convert has no lossless= (--lossless tiff): those rows are left out",
              flush=True)
    temp = None if args.workdir else tempfile.mkdtemp(prefix="fastdata-native-")
    work = args.workdir or temp
    os.makedirs(work, exist_ok=True)
    results: dict = {"scenarios": {}}
    try:
        for scenario in wanted:
            try:
                results["scenarios"][scenario] = one_scenario(p, scenario, work, args, lossless)
            except Skipped as err:
                print(f"{scenario}: left out: {err}", flush=True)
                results.setdefault("skipped", {})[scenario] = str(err)
        results["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                              "torch": torch.__version__, "platform": platform.platform(),
                              "fastdata_commit": git_commit(), "workers": args.workers,
                              "batch_size": args.batch_size, "epochs": args.epochs, "lossless_rows": lossless}
        command = "python benchmarks/bench_native.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
        md = markdown(results, command)
        print("\n" + md)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if args.md:
            Path(args.md).write_text(md)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
