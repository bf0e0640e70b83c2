"""``fastdata demo``: the whole story on generated data, no dataset of the user's needed.

1. synthesize a photo-like JPEG class-folder dataset (ImageNet-like sizes and file
   sizes, see :mod:`fastdata.tools.synth`) in a temporary folder;
2. convert it to LMDB and to HDF5;
3. verify both stores record by record;
4. measure loading (folder through an ImageFolder-equivalent reader vs LMDB vs
   HDF5, a few ``num_workers`` values, RandomResizedCrop(224) to uint8 tensors),
   print the table and write JSON/CSV/plots to ``out``.

Sizes: ``full`` (1000 images, about two minutes on 2 cores), ``small`` (160) and
``tiny`` (20, for tests; about 20 s).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from fastdata.common.units import format_size


@dataclass(frozen=True)
class DemoSize:
    """Dataset and grid of one demo size."""

    classes: int
    per_class: int
    workers: tuple
    batch_size: int
    max_batches: int
    epochs: int


def _sizes() -> dict:
    from fastdata.bench.grid import available_cores

    cores = available_cores()
    many = tuple(sorted({0, 1, 2, min(cores, 4)}))
    return {
        "full": DemoSize(classes=10, per_class=100, workers=many, batch_size=32, max_batches=8, epochs=2),
        "small": DemoSize(classes=4, per_class=40, workers=(0, 1, 2), batch_size=16, max_batches=5, epochs=2),
        "tiny": DemoSize(classes=2, per_class=10, workers=(0, 1), batch_size=4, max_batches=2, epochs=1),
    }


def run_demo(size: str = "full", out: str | None = None, keep: bool = False, quiet: bool = False,
             bench: bool = True) -> int:
    """Run the demo; returns the exit code (0 ok, 1 a store failed verification or a row failed).

    Args:
        size: ``"full"``, ``"small"`` or ``"tiny"``.
        out: folder for the results (default ``./fastdata-demo``).
        keep: keep the generated dataset and stores (their folder is printed).
        quiet: no progress bars, only the results.
        bench: run the loading comparison.
    """
    from fastdata.common.extras import require
    from fastdata.tools.verify import verify
    from fastdata.writer.api import convert

    # Before any work: the demo's images and plots come with the bench extra.
    require("cv2", "fastdata demo")
    if bench:
        require("matplotlib", "fastdata demo (its plots)")
    from fastdata.tools.synth import make_image_folder

    sizes = _sizes()
    if size not in sizes:
        raise ValueError(f"size must be one of {', '.join(sizes)}, got {size!r}")
    spec = sizes[size]
    out = os.path.abspath(out or "fastdata-demo")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    steps = 5 if bench else 4
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="fastdata-demo-")
    code = 0
    try:
        from fastdata.bench.grid import available_cores

        cores = available_cores()
        src = os.path.join(work, "images")
        n = spec.classes * spec.per_class
        say(f"[1/{steps}] synthesizing {n} photo-like JPEGs ({spec.classes} classes, ImageNet-like sizes) in {src}")
        synth = make_image_folder(src, spec.classes, spec.per_class, size="imagenet", seed=0, workers=cores)
        say(f"      {synth.num_images} images, {format_size(synth.total_bytes)} "
            f"(mean {synth.total_bytes / synth.num_images / 1024:.0f} KiB), {synth.elapsed_s:.1f} s")

        stores = {}
        for step, (backend, name) in enumerate((("lmdb", "train.lmdb"), ("hdf5", "train.h5")), start=2):
            dst = os.path.join(work, name)
            say(f"[{step}/{steps}] converting to {backend.upper()}: {dst}")
            report = convert(src, dst, workers=cores, progress=False if quiet else None)
            for line in report.summary().splitlines():
                say(f"      {line}")
            stores[backend] = dst

        say(f"[4/{steps}] verifying both stores (every record against its checksum, every image decoded)")
        for dst in stores.values():
            result = verify(dst, decode=True)
            say(f"      {result.summary()}")
            if not result.ok:
                print(result.summary(), file=sys.stderr)
                code = 1
        if code:
            return code

        if bench:
            code = _compare(src, stores, spec, out, quiet, say, steps)
        say(f"done in {time.perf_counter() - started:.0f} s" + (f"; data kept in {work}" if keep else ""))
        return code
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _compare(src: str, stores: dict, spec: DemoSize, out: str, quiet: bool, say, steps: int) -> int:
    from fastdata.bench.grid import expand_grid
    from fastdata.bench.harness import run_bench

    configs = expand_grid([src, stores["lmdb"], stores["hdf5"]], workers=list(spec.workers),
                          batch_size=[spec.batch_size], transform="rrc224", output="tensor",
                          epochs=spec.epochs, warmup_epochs=1, max_batches=spec.max_batches)
    say(f"[{steps}/{steps}] loading comparison: folder vs LMDB vs HDF5 x num_workers "
        f"{', '.join(map(str, spec.workers))}; RandomResizedCrop(224) -> uint8 tensors, batch {spec.batch_size}; "
        f"{len(configs)} runs, each in a fresh process")
    result = run_bench(configs, out, progress=not quiet, timeout=600)
    print()
    print(result.table)
    print()
    for name in ("json", "csv", "plot_throughput", "plot_pss", "plot_frontier"):
        if name in result.files:
            say(f"wrote {result.files[name]}")
    return 1 if result.failed else 0
