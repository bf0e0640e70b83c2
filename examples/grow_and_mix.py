"""Stores that grow and combine: weekly appends, a merge, a stratified split and a 70/30 mix that
resumes mid-epoch exactly.

Run it (about 20 s on 2 cores; no data needed, the images are synthesized)::

    python examples/grow_and_mix.py
    python examples/grow_and_mix.py --per-class 4 --workdir /tmp/grow   # smaller, and keep the files

What it does, printing each step:

1. three "weeks" of photo-like JPEGs (week 3 brings a new class); week 1 is converted, weeks 2
   and 3 are appended (``--append``, week 3 with ``--add-classes``); a dataset opened after week 1
   still reads its own version afterwards;
2. a second site's store is merged with it (``fastdata.merge``: hard links, no record read);
3. a stratified 90/10 split of the merged store;
4. a 70/30 mix of the training split and a synthetic store, read through ``fastdata.loader`` with
   2 workers; the run is stopped mid-epoch, its sampler state saved, and a new loader resumed
   from it: the rest of the epoch equals the uninterrupted run's, batch for batch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

import fastdata
from fastdata import transforms
from fastdata.synth import make_image_folder


def week(root: Path, classes: list[str], per_class: int, seed: int) -> Path:
    """A folder of ``per_class`` photo-like JPEGs for each of ``classes``."""
    make_image_folder(root / "tmp", num_classes=len(classes), per_class=per_class, seed=seed, size=(96, 80))
    for made, name in zip(sorted((root / "tmp").iterdir()), classes, strict=True):
        made.rename(root / name)
    (root / "tmp").rmdir()
    return root


def batches(loader, limit: int | None = None) -> list[tuple[bytes, list[int], list[int]]]:
    out = []
    for images, labels, sources in loader:
        out.append((images.numpy().tobytes(), labels.tolist(), sources.tolist()))
        if limit is not None and len(out) == limit:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-class", type=int, default=12, help="images per class and week (default 12)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", help="write a summary here")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fastdata-grow-"))
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    try:
        # 1. weekly appends
        weeks = [week(work / "week1", ["cat", "dog"], args.per_class, 1),
                 week(work / "week2", ["cat", "dog"], args.per_class, 2),
                 week(work / "week3", ["cat", "dog", "fox"], args.per_class, 3)]
        store = work / "site-a.lmdb"
        fastdata.convert(weeks[0], store, workers=args.workers, progress=False, overwrite=True)
        first = fastdata.open_dataset(store)
        for i, folder in enumerate(weeks[1:], 2):
            report = fastdata.convert(folder, store, workers=args.workers, progress=False, append=True,
                                      add_classes=True)
            print(f"week {i}: {report.summary().splitlines()[0]}")
        grown = fastdata.open_dataset(store)
        print(f"the store: {len(grown)} images, classes {grown.classes}; a dataset opened after week 1 "
              f"still reads its {len(first)} (sample 0 label {first[0][1]})")
        summary["appended"] = [len(first), len(grown)]

        # 2. a merge with another site's store
        other = work / "site-b.lmdb"
        fastdata.convert(week(work / "site-b", ["dog", "fox"], args.per_class, 4), other, workers=args.workers,
                         progress=False, overwrite=True)
        both = work / "both.lmdb"
        print(fastdata.merge([store, other], both, overwrite=True).summary())
        assert fastdata.verify(str(both)).ok

        # 3. a stratified 90/10 split
        def opened(path: Path):
            return fastdata.open_dataset(path, output="tensor", decode=transforms.RandomResizedCrop(64), seed=0)

        merged = opened(both)
        train, val = fastdata.random_split(merged, [0.9, 0.1], seed=0, stratify="label")
        counts = [np.bincount(s.targets, minlength=len(merged.classes)).tolist() for s in (train, val)]
        print(f"split: train {len(train)}, val {len(val)}; per class {counts[0]} / {counts[1]}")
        summary["split"] = [len(train), len(val)]

        # 4. a 70/30 mix with a synthetic store, resumed mid-epoch
        synth = work / "synthetic.lmdb"
        fastdata.convert(week(work / "synthetic", ["cat", "dog", "fox"], args.per_class, 5), synth,
                         workers=args.workers, progress=False, overwrite=True)
        epoch_size, batch = 8 * 8, 8

        def mixed_loader():
            mixed = fastdata.mix({"real": train, "synthetic": opened(synth)},
                                 weights={"real": 0.7, "synthetic": 0.3}, epoch_size=epoch_size, seed=0,
                                 batch_size=batch)
            sampler = mixed.sampler()
            return mixed, sampler, fastdata.loader(mixed, batch_size=batch, sampler=sampler,
                                                   num_workers=args.workers)

        mixed, sampler, loader = mixed_loader()
        sampler.set_epoch(1)
        whole = batches(loader)
        drawn = sum((b[2] for b in whole), [])
        print(f"mix: {mixed!r}".replace("\n", " "))
        print(f"epoch 1 drew {drawn.count(0)} real and {drawn.count(1)} synthetic samples")
        mixed, sampler, loader = mixed_loader()
        sampler.set_epoch(1)
        head = batches(loader, limit=3)
        state = sampler.state_dict(3 * batch)  # what a checkpoint after 3 steps saves
        mixed, sampler, loader = mixed_loader()
        sampler.load_state_dict(state)
        rest = batches(loader)
        assert head + rest == whole, "the resumed epoch differs from the uninterrupted one"
        print(f"stopped after 3 batches, resumed from the sampler state: the other {len(rest)} batches equal "
              "the uninterrupted epoch's")
        summary["mix"] = {"real": drawn.count(0), "synthetic": drawn.count(1), "resumed_batches": len(rest)}
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
