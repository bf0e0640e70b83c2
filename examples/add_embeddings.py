"""Add embeddings and predictions to a store, then train on its hard examples: no rewrite.

Run it (seconds on 2 cores; no data needed, the images are synthesized, nothing is downloaded)::

    python examples/add_embeddings.py
    python examples/add_embeddings.py --per-class 8 --workdir /tmp/embed   # smaller, and keep the files

What it does, printing each step:

1. a folder of photo-like JPEGs is converted to ``train.lmdb``;
2. ``fastdata.compute_fields`` runs a small torchvision model (``resnet18``, untrained unless
   ``--weights DEFAULT``, which downloads torchvision's ImageNet weights; a tiny CNN of the same
   output when torchvision is not installed) over every batch of the store on the CPU (the loader's
   workers decode): a 512-d float16 embedding, and the model's per-sample loss against the labels;
3. both are added to the store as a new version: new field files beside the shards, no shard
   rewritten (their checksums are compared), the manifest replaced last;
4. the hard examples (highest loss) are selected with ``ds.column("loss")``, which reads no
   record, and read through ``ds.subset`` and ``fastdata.loader`` with their embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

import fastdata
from fastdata.common.fileio import file_checksum


def embedding_model(weights: str | None) -> tuple[torch.nn.Module, str]:
    """``(model, name)``: images ``(B, 3, H, W)`` float in [0, 1] -> ``(B, 512)`` features."""
    try:
        import torchvision
    except ImportError:
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(32, 512, 3, stride=2),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        return net.eval(), "a tiny CNN (torchvision is not installed)"
    net = torchvision.models.resnet18(weights=weights)
    net.fc = torch.nn.Identity()  # the 512-d pooled features
    return net.eval(), f"torchvision resnet18 (weights={weights})"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-class", type=int, default=20)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--hard", type=float, default=0.25, help="the share of samples kept as hard examples")
    p.add_argument("--weights", default=None, help="torchvision weights, e.g. DEFAULT (downloads them)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", help="keep the files here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write a summary here")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fastdata-embed-"))
    try:
        # 1. a store
        fastdata.synth.make_image_folder(work / "imgs", num_classes=args.classes, per_class=args.per_class,
                                         size=(96, 80), seed=0)
        store = str(work / "train.lmdb")
        fastdata.convert(str(work / "imgs"), store, overwrite=True, progress=False)
        ds = fastdata.open_dataset(store, output="tensor", decode=fastdata.transforms.CenterCrop(64))
        print(f"1. converted {len(ds)} images of {len(ds.classes)} classes to {store}")

        # 2.-3. embeddings and losses computed by the model over every batch of the store, added as
        # fields: a new version of the store, no shard rewritten
        model, name = embedding_model(args.weights)
        head = torch.nn.Linear(512, len(ds.classes))

        def embed(batch):
            images, labels = batch
            with torch.no_grad():
                features = model(images.float() / 255)
                loss = torch.nn.functional.cross_entropy(head(features), labels, reduction="none")
            return {"clip": features.half(), "loss": loss}

        shards = {s["name"]: file_checksum(os.path.join(store, s["name"])) for s in fastdata.info(store)["shards"]}
        fastdata.compute_fields(store, embed, batch_size=16, num_workers=args.workers, output="tensor",
                                decode=fastdata.transforms.CenterCrop(64))
        ds = fastdata.open_dataset(store, output="tensor", decode=fastdata.transforms.CenterCrop(64))
        clip = ds.column("clip")
        print(f"2. embedded every image with {name}: {clip.shape[0]} x {clip.shape[1]} {clip.dtype}")
        unchanged = all(file_checksum(os.path.join(store, n)) == c for n, c in shards.items())
        report = fastdata.verify(store)
        print(f"3. added clip and loss; shard files unchanged: {unchanged}; verify: {report.summary()}")

        # 4. hard examples, chosen from the index alone, read with their embeddings
        keep = int(len(ds) * args.hard)
        hard = np.sort(np.argsort(ds.column("loss"))[-keep:])
        subset = ds.subset(hard)
        seen = 0
        for _images, labels in fastdata.loader(subset, batch_size=8, num_workers=args.workers, seed=0):
            seen += len(labels)  # (a training step would go here)
        vectors = subset.column("clip")
        print(f"4. {keep} hard examples (loss >= {ds.column('loss')[hard].min():.3f}) read through the loader: "
              f"{seen} samples; their embeddings {vectors.shape}")
        summary = {"samples": len(ds), "hard": keep, "read": seen, "shards_unchanged": unchanged,
                   "verified": report.ok, "embedding_shape": list(vectors.shape), "model": name,
                   "columns": list(ds.columns())}
        if args.json:
            Path(args.json).write_text(json.dumps(summary))
        return summary
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
