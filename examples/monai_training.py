"""Train a MONAI UNet on patches of NIfTI volumes read from a fastdata store.

What it does, end to end on CPU (seconds with the defaults):

1. without ``--data``: writes a tiny synthetic Decathlon-style set (``dataset.json``,
   ``imagesTr/``, ``labelsTr/``): CT-like ``.nii.gz`` volumes and their organ labels
   (:mod:`fastdata.tools.synth_volumes`), with an LPS-like affine as scanners write them;
2. converts it (``fastdata convert dataset.json store.lmdb --chunks 16,16,16``: each volume a
   chunked field; the affine, the spacing and the file's relative path kept per sample);
3. cuts training patches with ``fastdata.PatchDataset`` (``sampler="weighted"``, ``pos_ratio=0.5``:
   MONAI's ``RandCropByPosNegLabeld``; only the chunks a patch touches are read), each with a
   channel axis, as float32, with its own affine, as MONAI MetaTensors (``output="monai"``);
4. runs MONAI dictionary transforms on each patch in the DataLoader's worker processes
   (``transform=``): ``Orientationd`` (to RAS), ``Spacingd`` (resampling each patch: fine for a
   demo, costly for real training, where the volumes would be resampled before conversion),
   ``ScaleIntensityRanged`` (12-bit CT to [0, 1]) and a binary foreground label;
5. batches with ``fastdata.loader(..., num_workers=2)`` (``fastdata.collate`` keeps MetaTensors,
   each patch's affine stacked) and trains a small ``monai.networks.nets.UNet`` with ``DiceLoss``
   for a few steps, printing the loss.

Usage::

    python examples/monai_training.py
    python examples/monai_training.py --data Task09_Spleen/dataset.json --patch 64 --steps 20

``--data``: a Decathlon ``dataset.json``, a NIfTI folder or a CSV of ``image,label`` volume paths
(anything ``fastdata convert`` takes with label volumes).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import fastdata
from fastdata.tools.synth_volumes import CT_MAX, ct_pair

#: the synthetic volumes' voxel sizes (mm) on x, y, z, and the spacing the transforms resample to
SPACING = (1.5, 1.5, 2.0)
PIXDIM = (2.0, 2.0, 2.0)


def write_synthetic_set(root: str, count: int = 4, shape: Sequence[int] = (40, 40, 32)) -> str:
    """``count`` CT-like volumes and their labels as a Decathlon-style set under ``root``.

    Args:
        root: the folder to write (``dataset.json``, ``imagesTr/``, ``labelsTr/``).
        count: volumes to write.
        shape: each volume's size on x, y, z.

    Returns:
        str: the path of ``dataset.json``.
    """
    import nibabel as nib

    os.makedirs(os.path.join(root, "imagesTr"), exist_ok=True)
    os.makedirs(os.path.join(root, "labelsTr"), exist_ok=True)
    # x and y pointing to the patient's right and front (LPS, as DICOM scanners write): Orientationd
    # has something to flip
    affine = np.diag([-SPACING[0], -SPACING[1], SPACING[2], 1.0])
    affine[:3, 3] = [120.0, 90.0, -300.0]
    training = []
    x, y, z = shape
    for i in range(count):
        ct, label = ct_pair((z, y, x), seed=i)  # rendered as (z, y, x); NIfTI arrays are (x, y, z)
        name = f"ct_{i:03d}.nii.gz"
        nib.Nifti1Image(np.ascontiguousarray(ct.transpose(2, 1, 0)), affine).to_filename(
            os.path.join(root, "imagesTr", name))
        nib.Nifti1Image(np.ascontiguousarray(label.transpose(2, 1, 0)), affine).to_filename(
            os.path.join(root, "labelsTr", name))
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    path = os.path.join(root, "dataset.json")
    with open(path, "w") as fh:
        json.dump({"name": "synthetic CT", "modality": {"0": "CT"}, "labels": {"0": "background", "1": "organ"},
                   "numTraining": count, "training": training, "test": []}, fh)
    return path


def monai_transform() -> Callable[[dict], dict]:
    """The per-patch MONAI dictionary transforms (run in the DataLoader's workers)."""
    from monai.transforms import AsDiscreted, Compose, DivisiblePadd, Orientationd, ScaleIntensityRanged, Spacingd

    keys = ["image", "label"]
    return Compose([
        # the labels named: MONAI 1.6 warns that their default will follow the MetaTensor's space
        Orientationd(keys=keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
        Spacingd(keys=keys, pixdim=PIXDIM, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=0.0, a_max=float(CT_MAX), b_min=0.0, b_max=1.0, clip=True),
        AsDiscreted(keys="label", threshold=0.5),  # organs (labels >= 1) against background
        DivisiblePadd(keys=keys, k=4),  # the UNet halves twice
    ])


def patch_loader(store: str, patch: int = 24, batch_size: int = 2, workers: int = 2, seed: int = 0) -> Any:
    """A ``fastdata.loader`` of MONAI-ready training patches of the volume store ``store``.

    Args:
        store: a store converted from NIfTI volumes with label volumes.
        patch: the side of the cubic patches cut (voxels of the stored volumes).
        batch_size: patches per batch.
        workers: DataLoader worker processes (they cut, cast and transform the patches).
        seed: seed of the patch positions and the workers.

    Returns:
        fastdata.Loader: batches of ``{"image": MetaTensor B x 1 x ..., "label": ..., "affine": ...}``.
    """
    ds = fastdata.open_dataset(store)
    patches = fastdata.PatchDataset(
        ds, (patch,) * 3, fields=("image", "label"), sampler="weighted", weight_field="label", pos_ratio=0.5,
        patches_per_sample=4, seed=seed, channel_first=True, dtype=np.float32, output="monai",
        transform=monai_transform())
    return fastdata.loader(patches, batch_size=batch_size, shuffle=True, num_workers=workers, seed=seed)


def train(loader: Any, steps: int = 2, lr: float = 1e-2, log: Callable[[str], Any] | None = print
          ) -> tuple[torch.nn.Module, list[float], dict[str, torch.Tensor]]:
    """``steps`` optimisation steps of a small 3-D UNet with Dice loss on ``loader``'s batches.

    Args:
        loader: batches of ``image`` and ``label`` (B x 1 x D x H x W).
        steps: optimisation steps (the loader is restarted if it runs out).
        lr: Adam's learning rate.
        log: called with a line per step (None: silent).

    Returns:
        tuple: the trained model, the loss of each step, and the model's parameters before training.
    """
    from monai.losses import DiceLoss
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2),
                 num_res_units=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = DiceLoss(sigmoid=True)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            image, label = batch["image"], batch["label"]
            optimizer.zero_grad()
            loss = loss_fn(model(image.as_tensor()), label.as_tensor())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if log is not None:
                log(f"step {len(losses)}: Dice loss {losses[-1]:.4f} (batch {tuple(image.shape)}, "
                    f"{len(set(image.meta['filename_or_obj']))} volume(s), affines {tuple(image.affine.shape)})")
            if len(losses) == steps:
                break
    return model, losses, before


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="dataset.json, NIfTI folder or volume list (default: a synthetic set)")
    parser.add_argument("--patch", type=int, default=24, help="side of the training patches (default 24)")
    parser.add_argument("--batch-size", type=int, default=2, help="patches per batch (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fastdata-monai-") as tmp:  # removed when the example ends
        source = args.data or write_synthetic_set(os.path.join(tmp, "synthetic"))
        store = os.path.join(tmp, "volumes.lmdb")
        t0 = time.perf_counter()
        report = fastdata.convert(source, store, chunks=(16, 16, 16), workers=0, progress=False)
        print(f"converted {report.images} volumes in {time.perf_counter() - t0:.1f} s")
        loader = patch_loader(store, args.patch, args.batch_size, args.workers)
        _, losses, _ = train(loader, args.steps)
        print(f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
