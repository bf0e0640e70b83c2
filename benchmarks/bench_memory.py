"""Memory of a DataLoader with persistent workers over many epochs: fastdata vs a naive dataset.

For each variant, in its own fresh Python process, the script runs ``--epochs``
epochs with ``--workers`` persistent fork workers over a store of ``--n`` small
records (32x32 JPEGs, converted once) and prints, after every epoch, the memory
of the main process plus all workers:

* **PSS** (proportional set size): each shared page divided among the processes
  sharing it, so the tree's PSS sums to the memory it really uses;
* **USS** (unique set size): pages private to one process, i.e. what copy-on-write
  has copied;
* **RSS**, for comparison only: it overstates, because every worker's RSS counts
  in full every page it shares with the parent and the other workers, including
  the mmap'd shard pages that all of them read.

Variants:

* ``fastdata``: ``fastdata.open_dataset`` (per-sample metadata in numpy arrays,
  storage opened lazily in each worker) through ``fastdata.loader``;
* ``fastdata-freeze`` (optional): the same with ``gc.freeze()`` at worker start.
  A worker's first full garbage collection walks every object inherited from the
  parent (torch's modules included) and so copies the pages they live on; a frozen
  heap is never walked;
* ``fastdata-u16`` (optional): images as they are: a store of ``--native-n`` CT-like
  512x512 16-bit grayscale PNGs (:mod:`fastdata.tools.synth_native`) read with
  ``image_mode="unchanged"`` into uint16 tensors, batch ``--native-batch-size``
  (batches of native dtype and channels must stay as flat as the uint8 ones);
* ``naive`` (the control): the recipe found in many blog posts: LMDB environments
  opened in ``__init__`` and a Python list of per-sample ``(path, key, label)``
  tuples, decoding with Pillow. It grows for two reasons: reading those tuples in
  a worker writes their reference counts, so each worker copies the pages they
  live on (pytorch/pytorch#13246, a one-time cost proportional to the dataset
  size); and py-lmdb (>= 1.6) does not free a transaction of an environment that
  another process opened, so every read through the inherited environment leaks
  a few hundred bytes in the worker (growth proportional to reads, every epoch).

Target: fastdata's total PSS grows less than 1% from epoch 2 to epoch 10.

Usage::

    python benchmarks/bench_memory.py                  # 100k records, 10 epochs
    python benchmarks/bench_memory.py --n 20000        # quicker
    python benchmarks/bench_memory.py --data /tmp/mem  # keep/reuse the generated store
    python benchmarks/bench_memory.py --backend hdf5   # the fastdata variant on HDF5
    python benchmarks/bench_memory.py --variants fastdata-u16 --native-n 1000   # 16-bit CT-like, unchanged
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 1 << 20
RSS_NOTE = ("RSS overstates: every worker's RSS counts in full the pages it shares with the parent "
            "and the other workers, including the mmap'd shard pages all of them read; PSS divides them.\n"
            "anonPSS is the anonymous part of PSS (heap, copy-on-write copies): file-backed pages (libtorch, "
            "the store's mmap) turn private or shared as unrelated processes map the same files, so total "
            "PSS/USS can jump by tens of MB on a shared machine without this loader doing anything.")


# --------------------------------------------------------------------------- data
def make_tree(root: Path, n: int, classes: int = 100, seed: int = 0) -> None:
    """``n`` distinct 32x32 photo-like JPEGs in ``classes`` class folders."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        img = cv2.resize(coarse, (32, 32), interpolation=cv2.INTER_CUBIC).astype(np.int16)
        img += rng.integers(-12, 13, (32, 32, 1), dtype=np.int16)
        ok, buf = cv2.imencode(".jpg", np.clip(img, 0, 255).astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])
        if not ok:
            raise RuntimeError("cv2.imencode failed")
        (root / f"class_{i % classes:03d}" / f"img_{i:07d}.jpg").write_bytes(buf.tobytes())


def prepare_native(data: Path, n: int, backend: str, workers: int) -> str:
    """The ``fastdata-u16`` variant's store: ``n`` CT-like 512x512 16-bit PNGs, converted
    (reused when ``data`` already holds it)."""
    import fastdata
    from fastdata.format.manifest import read_manifest
    from fastdata.tools.synth_native import make_ct_folder

    src = data / f"ct16-{n}"
    dst = data / f"ct16-{n}.{'lmdb' if backend == 'lmdb' else 'h5'}"
    try:
        ok = read_manifest(str(dst))["num_samples"] == n
    except Exception:
        ok = False
    if not ok:
        stamp = data / f"ct16-{n}.count"
        if not (stamp.exists() and stamp.read_text() == str(n)):
            shutil.rmtree(src, ignore_errors=True)
            s = make_ct_folder(src, num_classes=4, per_class=n // 4, workers=workers)
            stamp.write_text(str(n))
            print(f"generated {s.num_images} CT-like 16-bit PNGs in {s.elapsed_s:.1f} s", file=sys.stderr)
        fastdata.convert(str(src), str(dst), workers=workers, overwrite=dst.exists(), progress=False)
    return str(dst)


def prepare(data: Path, n: int, backends: list[str], workers: int) -> dict:
    """Generate the tree and convert it (reused when ``data`` already holds them)."""
    import fastdata
    from fastdata.format.manifest import read_manifest

    src = data / "src"
    stamp = data / "src.count"
    if not (stamp.exists() and stamp.read_text() == str(n)):
        shutil.rmtree(src, ignore_errors=True)
        t0 = time.perf_counter()
        make_tree(src, n)
        stamp.write_text(str(n))
        print(f"generated {n} JPEGs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    stores = {}
    for backend in sorted(set(backends) | {"lmdb"}):  # the naive control reads LMDB
        dst = data / f"store.{'lmdb' if backend == 'lmdb' else 'h5'}"
        try:
            ok = read_manifest(str(dst))["num_samples"] == n
        except Exception:
            ok = False
        if not ok:
            t0 = time.perf_counter()
            fastdata.convert(str(src), str(dst), workers=workers, overwrite=dst.exists(), progress=False)
            print(f"converted to {dst.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        stores[backend] = str(dst)
    return stores


# --------------------------------------------------------------------------- the naive control
def naive_dataset(store: str):
    """The control: environments opened in ``__init__``, per-sample Python tuples."""
    import lmdb
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import Dataset

    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.lmdb import spec
    from fastdata.format.backends.lmdb.reader import LMDBShardReader
    from fastdata.format.manifest import read_manifest
    from fastdata.format.record import decode_record

    class NaiveLMDBDataset(Dataset):
        def __init__(self, root: str):
            manifest = read_manifest(root)
            self.samples = []
            self.envs = []
            for k, shard in enumerate(manifest["shards"]):
                path = os.path.join(root, shard["name"])
                with LMDBShardReader(path, StorageSpec.from_json(manifest["storage"])) as reader:
                    index = reader.read_index()
                self.samples += [(os.fsdecode(index.relpath(j)), k, spec.encode_key(j), int(index.labels[j]))
                                 for j in range(len(index))]
                self.envs.append(lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=False,
                                           meminit=False, max_dbs=2))
            self.dbs = [env.open_db(spec.RECORDS_DB, create=False) for env in self.envs]

        def __len__(self):
            return len(self.samples)

        def __getitem__(self, i):
            _path, shard, key, label = self.samples[i]
            with self.envs[shard].begin(db=self.dbs[shard]) as txn:
                record = decode_record(txn.get(key))
            image = np.array(Image.open(io.BytesIO(record.image)).convert("RGB"))
            return torch.from_numpy(image).permute(2, 0, 1), label

    return NaiveLMDBDataset(store)


def freeze_then_seed(worker_id: int) -> None:
    """worker_init_fn of the ``fastdata-freeze`` variant: ``gc.freeze()`` first, so
    the worker's garbage collector never walks (and so never copies) the objects
    it inherited from the parent, then ``fastdata.seed_worker``."""
    import fastdata

    gc.freeze()
    fastdata.seed_worker(worker_id)


# --------------------------------------------------------------------------- one variant
def run_variant(variant: str, store: str, epochs: int, workers: int, batch_size: int) -> list[dict]:
    """Run in a fresh process: ``epochs`` epochs, one memory snapshot after each."""
    import torch
    from torch.utils.data import DataLoader

    import fastdata
    from fastdata.bench.memory import MemorySampler

    torch.manual_seed(0)
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=True,
                  multiprocessing_context="fork")
    if variant == "naive":
        loader = DataLoader(naive_dataset(store), **common)
    elif variant == "fastdata-u16":
        loader = fastdata.loader(fastdata.open_dataset(store, image_mode="unchanged", output="tensor"), **common)
    elif variant == "fastdata-freeze":
        loader = fastdata.loader(fastdata.open_dataset(store, output="tensor"), worker_init_fn=freeze_then_seed,
                                 **common)
    else:
        loader = fastdata.loader(fastdata.open_dataset(store, output="tensor"), **common)
    rows = []
    with MemorySampler(interval=0.25) as sampler:
        snap = sampler.mark("start")
        rows.append(_row(0, 0.0, snap, 0))
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            count = 0
            for images, _labels in loader:
                count += len(images)
            elapsed = time.perf_counter() - t0
            # settle before the snapshot: the last batches' shared-memory blocks are
            # freed by the garbage collector and by the workers' queue threads
            gc.collect()
            time.sleep(0.2)
            rows.append(_row(epoch, elapsed, sampler.mark(f"epoch{epoch}"), count))
    rows.append({"peak_pss": sampler.peak_pss, "peak_rss": sampler.peak_rss})
    return rows


def anon_pss(pid: int) -> int | None:
    """``Pss_Anon`` of ``pid`` in bytes (``/proc/PID/smaps_rollup``), None if unavailable.

    Anonymous memory (heap, copy-on-write copies) is what a leak or copy-on-write
    growth shows up in. File-backed pages (shared libraries, the store's mmap)
    move between private and shared whenever any other process on the machine maps
    the same file (another Python importing torch), so total PSS/USS jump by tens
    of MB for reasons that have nothing to do with this loader."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _row(epoch: int, elapsed: float, snap, count: int) -> dict:
    procs = [p for p in snap.processes if p.role != "helper"]
    workers = [p for p in procs if p.role == "worker"]
    anon = [anon_pss(p.pid) for p in procs]
    return {
        "epoch": epoch, "seconds": elapsed, "images": count, "workers": len(workers),
        "pss": sum(p.pss for p in procs), "uss": sum(p.uss for p in procs), "rss": sum(p.rss for p in procs),
        "anon_pss": None if None in anon else sum(anon),
        "worker_uss": sum(p.uss for p in workers), "pss_exact": snap.pss_exact,
    }


# --------------------------------------------------------------------------- report
def _mb(value) -> str:
    return f"{value / MB:8.1f}" if value is not None else f"{'-':>8}"


def print_table(name: str, rows: list[dict]) -> dict:
    epochs = [r for r in rows if "epoch" in r]
    print(f"\n{name}")
    print(f"{'epoch':>5} {'s':>6} {'img/s':>8} {'workers':>7} {'PSS MB':>8} {'anonPSS':>8} {'USS MB':>8} "
          f"{'wrk USS':>8} {'RSS MB':>8}")
    for r in epochs:
        rate = f"{r['images'] / r['seconds']:8.0f}" if r["seconds"] else f"{'-':>8}"
        print(f"{r['epoch']:>5} {r['seconds']:6.1f} {rate} {r['workers']:>7} {_mb(r['pss'])} {_mb(r['anon_pss'])} "
              f"{_mb(r['uss'])} {_mb(r['worker_uss'])} {_mb(r['rss'])}")
    by_epoch = {r["epoch"]: r for r in epochs}
    last = max(by_epoch)
    summary = {"variant": name}
    for a in (1, 2):
        if a in by_epoch and last > a:
            summary[f"pss_growth_{a}_{last}_pct"] = 100.0 * (by_epoch[last]["pss"] / by_epoch[a]["pss"] - 1.0)
            if by_epoch[a]["anon_pss"] and by_epoch[last]["anon_pss"]:
                summary[f"anon_pss_growth_{a}_{last}_pct"] = 100.0 * (
                    by_epoch[last]["anon_pss"] / by_epoch[a]["anon_pss"] - 1.0)
    if 1 in by_epoch:
        summary["pss_added_by_epoch1_mb"] = (by_epoch[1]["pss"] - by_epoch[0]["pss"]) / MB
        summary["worker_uss_epoch_last_mb"] = by_epoch[last]["worker_uss"] / MB
        summary["rss_over_pss"] = by_epoch[last]["rss"] / by_epoch[last]["pss"]
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000, help="records in the store (default 100000)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (persistent)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--backend", choices=("lmdb", "hdf5"), default="lmdb", help="store of the fastdata variant")
    p.add_argument("--variants", default="fastdata,naive",
                   help="comma-separated: fastdata, naive, fastdata-freeze (gc.freeze() in each worker), "
                        "fastdata-u16 (16-bit CT-like PNGs, image_mode='unchanged')")
    p.add_argument("--native-n", type=int, default=1000, help="images of the fastdata-u16 store (default 1000)")
    p.add_argument("--native-batch-size", type=int, default=32,
                   help="batch of the fastdata-u16 variant (default 32: 512x512 uint16 images are 512 KB each)")
    p.add_argument("--data", help="directory to keep/reuse the generated data (default: a temporary one)")
    p.add_argument("--convert-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", help="also write the rows and summaries here")
    p.add_argument("--_run", help=argparse.SUPPRESS)
    p.add_argument("--_store", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._run:  # child mode: one variant, rows as JSON on stdout
        rows = run_variant(args._run, args._store, args.epochs, args.workers, args.batch_size)
        print(json.dumps(rows))
        return 0

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"fastdata", "fastdata-freeze", "fastdata-u16", "naive"}
    if unknown:
        p.error(f"unknown variant(s): {', '.join(sorted(unknown))}")
    temp = None if args.data else tempfile.mkdtemp(prefix="fastdata-mem-")
    data = Path(args.data or temp)
    data.mkdir(parents=True, exist_ok=True)
    try:
        stores = prepare(data, args.n, [args.backend], args.convert_workers) if set(variants) - {"fastdata-u16"} \
            else {}
        results, summaries = {}, []
        for variant in variants:
            batch_size, records = args.batch_size, f"{args.n} records"
            if variant == "fastdata-u16":
                store = prepare_native(data, args.native_n, args.backend, args.convert_workers)
                batch_size, records = args.native_batch_size, f"{args.native_n} 16-bit 512x512 PNGs, unchanged"
            else:
                store = stores["lmdb"] if variant == "naive" else stores[args.backend]
            name = f"{variant} ({'lmdb' if variant == 'naive' else args.backend}, {records}, "\
                   f"{args.workers} persistent workers, batch {batch_size})"
            cmd = [sys.executable, os.path.abspath(__file__), "--_run", variant, "--_store", store,
                   "--epochs", str(args.epochs), "--workers", str(args.workers), "--batch-size", str(batch_size)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows = json.loads(out.strip().splitlines()[-1])
            results[variant] = rows
            summaries.append(print_table(name, rows))
        print()
        for s in summaries:
            parts = [f"{k}={v:.2f}" for k, v in s.items() if isinstance(v, float)]
            print(f"{s['variant'].split(' ')[0]:>12}: " + ", ".join(parts))
        for fd in summaries:
            label = fd["variant"].split(" ")[0]
            if label not in ("fastdata", "fastdata-u16") or f"pss_growth_2_{args.epochs}_pct" not in fd:
                continue
            growth = fd[f"pss_growth_2_{args.epochs}_pct"]
            anon = fd.get(f"anon_pss_growth_2_{args.epochs}_pct")
            print(f"\ntarget: {label} PSS growth epoch 2 -> {args.epochs} < 1%: {growth:+.2f}% "
                  f"{'OK' if growth < 1.0 else 'MISSED'}"
                  + (f" (anonymous PSS: {anon:+.2f}%)" if anon is not None else ""))
        print(RSS_NOTE)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": results, "summary": summaries}, indent=1))
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
