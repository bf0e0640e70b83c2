"""Train on random patches of CT volumes, then run a sliding-window (grid) inference
stitched back into whole volumes.

1. Synthetic CT-like volumes (uint16, 12-bit values) and their organ label volumes are
   written to a store as chunked fields: each volume is kept as independently compressed
   64^3 chunks, so a patch reads only the chunks it touches, never the whole volume.
2. ``fastdata.PatchDataset`` cuts 32^3 training patches (image and label from the same
   place), half of them centred on labelled voxels (``sampler="weighted"``), loaded by
   ``fastdata.loader`` with two worker processes. The positions are a pure function of
   (seed, epoch, patch index): the same with any number of workers, and resumable.
3. A grid of overlapping tiles covers each volume; a toy "model" (a threshold) runs on
   every tile and ``fastdata.Stitcher`` averages the overlaps back into a whole volume.

Run: ``python examples/ct_patches.py`` (``--help`` for the sizes). Writes a JSON summary
with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

import fastdata
from fastdata.fields import Chunked, Int, NDArray
from fastdata.tools.synth_volumes import ct_pair


class Volumes:
    """A map-style dataset of synthetic scans: what a user's own Dataset of volumes looks like
    (fastdata.write reads it in its worker processes, chunk slab by slab)."""

    def __init__(self, count: int, shape: tuple[int, int, int]):
        self.count, self.shape = count, shape

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        ct, label = ct_pair(self.shape, seed=i)
        return {"ct": ct, "label": label, "spacing": np.array([2.0, 0.8, 0.8]), "patient": i}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--volumes", type=int, default=6, help="scans to write (default 6)")
    parser.add_argument("--shape", type=int, nargs=3, default=(96, 128, 128), metavar=("Z", "Y", "X"),
                        help="voxels of each scan (default 96 128 128)")
    parser.add_argument("--patch", type=int, default=32, help="side of the training patches (default 32)")
    parser.add_argument("--batches", type=int, default=4, help="training batches to load (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--out", help="store path (default: a temporary folder, removed at the end)")
    parser.add_argument("--json", help="write a summary here")
    args = parser.parse_args(argv)

    if args.out is not None:
        return run(args, args.out)
    with tempfile.TemporaryDirectory(prefix="fastdata-ct-") as root:  # removed when the example ends
        return run(args, os.path.join(root, "ct.lmdb"))


def run(args, store: str) -> int:
    """Write the scans into ``store``, train on patches, run the grid inference."""
    schema = {"ct": Chunked("uint16", (64, 64, 64)), "label": Chunked("uint8", (64, 64, 64)),
              "spacing": NDArray("float64", (3,)), "patient": Int()}
    t0 = time.perf_counter()
    report = fastdata.write(Volumes(args.volumes, tuple(args.shape)), store, schema, workers=args.workers,
                            progress=False)
    ds = fastdata.open_dataset(store)
    raw = args.volumes * int(np.prod(args.shape)) * 3  # uint16 scan + uint8 label
    stored = sum(ds[i]["ct"].stored_bytes + ds[i]["label"].stored_bytes for i in range(len(ds)))
    print(f"wrote {report.images} scans in {time.perf_counter() - t0:.1f} s: {stored / 1e6:.1f} MB stored for "
          f"{raw / 1e6:.1f} MB of voxels ({raw / stored:.1f}x smaller)")

    # -- training: random patches, half centred on labelled voxels --------------------------
    patches = fastdata.PatchDataset(ds, (args.patch,) * 3, fields=("ct", "label"), sampler="weighted",
                                    weight_field="label", pos_ratio=0.5, patches_per_sample=8, seed=0,
                                    output="tensor")
    loader = fastdata.loader(patches, batch_size=8, shuffle=True, num_workers=args.workers, seed=0)
    shapes, foreground = [], []
    for k, batch in enumerate(loader):
        ct = batch["ct"].to(torch.float32) / 4095.0  # 12-bit CT to [0, 1]
        shapes.append(list(ct.shape))
        foreground.append(float((batch["label"] > 0).float().mean()))
        if k + 1 == args.batches:
            break
    overall = float(np.mean([np.count_nonzero(np.asarray(ds[i]["label"])) / ds[i]["label"].size
                             for i in range(len(ds))]))
    print(f"loaded {len(shapes)} batches of {shapes[0]} patches with {args.workers} workers; "
          f"{np.mean(foreground):.0%} of their voxels labelled ({overall:.0%} of the scans' voxels are)")

    # -- inference: overlapping tiles of every scan, stitched back ---------------------------
    grid = fastdata.PatchDataset(ds, (64, 64, 64), fields=("ct",), sampler="grid", overlap=16)
    agree = []
    for i in range(len(ds)):
        stitcher = grid.stitcher(i, dtype=np.float32)
        for p in grid.patches_of(i):
            tile = grid[p]
            stitcher.add(tile["position"], (tile["ct"] > 1150).astype(np.float32))  # a toy model: bright tissue
        prediction = stitcher.result() > 0.5
        truth = np.asarray(ds[i]["ct"]) > 1150
        agree.append(bool(np.array_equal(prediction, truth)))
    print(f"grid inference: {len(grid)} tiles over {len(ds)} scans, stitched predictions equal the whole-volume "
          f"ones: {all(agree)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"scans": report.images, "stored_bytes": stored, "raw_bytes": raw, "batch_shape": shapes[0],
                       "batches": len(shapes), "labelled_fraction": float(np.mean(foreground)),
                       "scans_labelled_fraction": overall,
                       "tiles": len(grid), "stitched_equal": all(agree)}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
