"""Random 3-D patches from CT-like volumes through a DataLoader: fastdata's chunked stores next to
the pipelines users write without it (whole ``.npy`` loads, nibabel, torchio's queue), side by side
in one run.

Data (generated once per scenario, kept with ``--workdir``): ``N`` CT-like uint16 volumes of ``S^3``
and their uint8 organ labels (:func:`fastdata.tools.synth_volumes.ct_pair`, seeds 0..N-1), saved as
``.npy`` and as ``.nii.gz`` (``nibabel.save``, its default gzip level), and written with
``fastdata.write(..., workers=2)`` into an LMDB and an HDF5 store with
``{"ct": Chunked("uint16", (c,) * 3), "label": Chunked("uint8", (c,) * 3)}``: the default codec
(blosc-lz4 level 5, byte shuffle, 256 KiB Blosc blocks) and ``--chunks c`` (default 48, what ``fastdata
convert`` uses for NIfTI volumes; 64 was the issue's example); a third store
(LMDB) with ``codec="blosc-zstd"`` (level 1), the smaller store, shows what that choice costs. Scenarios are
``SIDExCOUNT`` (default ``256x8,512x4``: 8 volumes of 256^3 and 4 of 512^3).

Every contender yields the same thing: batches (``--batch-size``, default 4) of ``--patch``^3
(default 96^3) patches of ``ct`` and ``label`` cut at the same place, at uniformly random positions
inside the volume, ``--patches-per-volume`` (default 8) patches per volume per epoch, through 2
DataLoader worker processes (``--workers``):

* ``fastdata-lmdb`` / ``fastdata-hdf5`` / ``fastdata-lmdb-zstd``  ``fastdata.PatchDataset(fastdata.open_dataset(
  store), (96,) * 3, fields=("ct", "label"), sampler="uniform", patches_per_sample=k, output="tensor")`` through
  ``fastdata.loader`` (persistent workers, shuffled): each patch decodes only the chunks it touches;
* ``npy``       a map-style Dataset whose item ``p`` ``np.load``s the whole ``.npy`` volume (and label) of
  volume ``p // k`` and crops (what a user writes first), plain DataLoader, same settings;
* ``nibabel``   the same over the ``.nii.gz`` files, each patch read as ``nib.load(f).dataobj[region]``
  (nibabel's array proxy: it decompresses the gzip stream only up to the region's last byte,
  which is the fastest way nibabel offers; ``get_fdata()`` of the whole volume is slower);
* ``torchio``   torchio's documented fast path: ``tio.Queue(tio.SubjectsDataset(subjects of
  tio.ScalarImage + tio.LabelMap of the .nii.gz files), max_length, samples_per_volume=k,
  tio.UniformSampler(96), num_workers=2)`` read through ``tio.SubjectsLoader(queue, batch_size,
  num_workers=0)`` as torchio requires. It loads each volume once per epoch (SimpleITK, as int32)
  and cuts its k patches from it; ``max_length`` = k x min(N, 4) (patches of up to 4 volumes
  mixed in the queue).

Rows: page cache warm (every file read once before, then one warm-up epoch of every contender) and
cold (every file the contender reads evicted with ``posix_fadvise(DONTNEED)`` right before each of
its epochs; fastdata's persistent workers close their store handles after every batch, as
``fastdata bench --cold`` does, so that no mapped page survives the eviction; the ``cached`` figure
is the fraction of those files' pages still cached right after eviction). After the warm-up, epochs
run round-robin (one of each contender in turn), so a slow spell of a shared machine hits them all;
patches/s are medians over ``--epochs`` measured epochs, and each ratio is the median over the rounds
of that round's ratio.

Also measured:

* bytes decoded per patch, in-process: ``chunks_read x chunk bytes / patch bytes`` of the ``ct``
  field over ``--decoded-patches`` uniform patches (and the same figure computed from the positions);
* stored size: the store (default codec) vs the raw bytes vs the ``.nii.gz`` files of the same volumes;
* region reads in one process (no DataLoader): random ``--patch``^3 regions of the ``ct`` volumes of the
  largest scenario, MB/s of output, fastdata's ``ChunkedArray`` vs a zarr v3 array of the same data with
  the same chunks and codec (``BloscCodec(cname="zstd", clevel=1, shuffle="shuffle",
  blocksize=2**18)``); both with their default threading (wall time and the process's CPU time are reported);
* worker memory: peak PSS (and RSS) of the loader's process tree (main + workers, sampled every 50 ms
  by :class:`fastdata.bench.memory.MemorySampler`) over ``--memory-epochs`` epochs of the same number
  of patches from ``--memory-volumes`` volumes of 512^3 vs of 128^3 (``--memory-sides``), each run in a
  fresh process; ratio of the peaks.

Needs torch, torchio, nibabel and zarr (v3) beside fastdata::

    python3 -m venv /tmp/venv-bench
    /tmp/venv-bench/bin/pip install torch==2.13.0 -e ".[bench]" torchio nibabel zarr psutil

Usage::

    python benchmarks/bench_patches.py                                 # 8 x 256^3 + 4 x 512^3, ~15 min on 2 cores
    python benchmarks/bench_patches.py --quick                         # smoke size, ~2 min
    python benchmarks/bench_patches.py --scenarios 256x8 --no-cold     # one scenario, warm only
    python benchmarks/bench_patches.py --workdir /tmp/patches --json patches.json --md patches.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
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
from fastdata.bench.cache import evict_page_cache, resident_fraction  # noqa: E402
from fastdata.bench.memory import MemorySampler, pss_split  # noqa: E402
from fastdata.fields import Chunked  # noqa: E402
from fastdata.format.chunk_codecs import BLOSC_BLOCK_BYTES, CHUNK_CODECS, DEFAULT_CODEC  # noqa: E402
from fastdata.reader.seeding import seed_worker  # noqa: E402
from fastdata.tools.synth_volumes import ct_pair  # noqa: E402
from fastdata.writer.sources.volumes.nifti import VOLUME_CHUNK  # noqa: E402

MB = 1 << 20
#: the stores' chunk shape: fastdata's default for NIfTI volumes unless --chunks says otherwise
CHUNKS = (VOLUME_CHUNK,) * 3
CONTENDERS = ("fastdata-lmdb", "fastdata-hdf5", "fastdata-lmdb-zstd", "npy", "nibabel", "torchio")
#: the stores of a scenario: kind -> (backend, codec); the first is the one measured in process
STORES = {"lmdb": ("lmdb", DEFAULT_CODEC), "hdf5": ("hdf5", DEFAULT_CODEC), "lmdb-zstd": ("lmdb", "blosc-zstd")}
BASELINES = ("npy", "nibabel", "torchio")
TARGETS = {"npy@256": 4.0, "npy@512": 20.0, "nibabel": 20.0, "torchio": 1.0}


# --------------------------------------------------------------------------- data
def schema(codec: str = DEFAULT_CODEC) -> dict:
    return {"ct": Chunked("uint16", CHUNKS, codec=codec), "label": Chunked("uint8", CHUNKS, codec=codec)}


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


class Volumes:
    """The files of one scenario: ``side``^3 volumes ``0..count-1`` under ``root``."""

    def __init__(self, work: str, side: int, count: int):
        self.side, self.count = side, count
        self.root = os.path.join(work, f"vol{side}")
        os.makedirs(self.root, exist_ok=True)

    def npy(self, i: int, field: str) -> str:
        return os.path.join(self.root, f"{i:03d}_{field}.npy")

    def nii(self, i: int, field: str) -> str:
        return os.path.join(self.root, f"{i:03d}_{field}.nii.gz")

    def store(self, kind: str) -> str:
        backend, codec = STORES[kind]
        tag = ("" if codec == DEFAULT_CODEC else f"-{codec}") + ("" if CHUNKS == (64, 64, 64) else f"-c{CHUNKS[0]}")
        return os.path.join(self.root, f"x{self.count}{tag}.{'lmdb' if backend == 'lmdb' else 'h5'}")

    def _stamp(self, kind: str) -> Path:
        return Path(self.root) / f".{kind}-{self.count}.done"

    def prepare(self, kinds: tuple[str, ...] = ("npy", "nii", *STORES)) -> dict:
        """Generate what is missing (npy first: every other form is made from it); seconds spent."""
        spent: dict[str, float] = {}
        missing = [i for i in range(self.count) if not all(os.path.isfile(self.npy(i, f)) for f in ("ct", "label"))]
        if missing:
            t0 = time.perf_counter()
            for i in missing:
                ct, label = ct_pair((self.side,) * 3, seed=i)
                np.save(self.npy(i, "ct"), ct)
                np.save(self.npy(i, "label"), label)
                del ct, label
            spent["generate"] = time.perf_counter() - t0
        if "nii" in kinds and not self._stamp("nii").exists():
            import nibabel as nib

            t0 = time.perf_counter()
            for i in range(self.count):
                for field in ("ct", "label"):
                    nib.save(nib.Nifti1Image(np.load(self.npy(i, field)), np.eye(4)), self.nii(i, field))
            self._stamp("nii").touch()
            spent["nii.gz"] = time.perf_counter() - t0
        for kind, (_backend, codec) in STORES.items():
            if kind in kinds and not self._stamp(f"{kind}-{codec}-c{CHUNKS[0]}").exists():
                t0 = time.perf_counter()
                samples = [{f: np.load(self.npy(i, f), mmap_mode="r") for f in ("ct", "label")}
                           for i in range(self.count)]
                fastdata.write(samples, self.store(kind), schema(codec), workers=2, overwrite=True, progress=False)
                self._stamp(f"{kind}-{codec}-c{CHUNKS[0]}").touch()
                spent[kind] = time.perf_counter() - t0
        return spent

    def check_store(self, store: str) -> None:
        """A few patches of the store equal the same regions of the ``.npy`` volumes."""
        pd = fastdata.PatchDataset(fastdata.open_dataset(store), (32,) * 3, fields=("ct", "label"),
                                   patches_per_sample=2, seed=123)
        for p in range(len(pd)):
            item = pd[p]
            region = tuple(slice(a, a + 32) for a in item["position"].tolist())
            for f in ("ct", "label"):
                want = np.load(self.npy(item["sample"], f), mmap_mode="r")[region]
                if not np.array_equal(item[f], want):
                    raise SystemExit(f"{store}: patch {p} field {f} differs from the .npy volume")
        pd.base.close()


# --------------------------------------------------------------------------- baselines
class CropDataset(torch.utils.data.Dataset):
    """Item ``p``: a random ``patch``^3 crop of volume ``p // k`` and of its label, read whole from
    ``.npy`` (``np.load``) or through nibabel's proxy (``nib.load(f).dataobj[region]``)."""

    def __init__(self, vols: Volumes, patch: int, per_volume: int, reader: str):
        self.vols, self.patch, self.k, self.reader = vols, patch, per_volume, reader
        self._rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return self.vols.count * self.k

    def __getitem__(self, p: int) -> dict:
        if self._rng is None:  # per process: seed_worker has seeded torch differently in each worker
            self._rng = np.random.default_rng(torch.initial_seed() % (1 << 63))
        i = p // self.k
        start = self._rng.integers(0, self.vols.side - self.patch + 1, size=3)
        region = tuple(slice(int(a), int(a) + self.patch) for a in start)
        out = {}
        for field in ("ct", "label"):
            if self.reader == "npy":
                crop = np.load(self.vols.npy(i, field))[region].copy()
            else:
                import nibabel as nib

                crop = np.ascontiguousarray(nib.load(self.vols.nii(i, field)).dataobj[region])
            out[field] = torch.from_numpy(crop)
        return out


class ClosingPatches(fastdata.PatchDataset):
    """For the cold rows: the base store's handles closed after every fetch (they reopen lazily),
    so persistent workers keep no mapped page of the store between epochs (``fastdata bench --cold``
    does the same, ``fastdata.bench.runner.CloseAfterFetch``)."""

    def __getitem__(self, index):
        try:
            return super().__getitem__(index)
        finally:
            self.base.close()

    def __getitems__(self, indices):
        try:
            return super().__getitems__(indices)
        finally:
            self.base.close()


def torchio_queue(vols: Volumes, patch: int, per_volume: int, workers: int):
    import torchio as tio

    subjects = [tio.Subject(ct=tio.ScalarImage(vols.nii(i, "ct")), label=tio.LabelMap(vols.nii(i, "label")))
                for i in range(vols.count)]
    # start_background=False: the queue's workers start loading at its first epoch, not while the other
    # contenders' warm-up epochs run (every later epoch starts a new subjects loader either way)
    return tio.Queue(tio.SubjectsDataset(subjects), max_length=per_volume * min(vols.count, 4),
                     samples_per_volume=per_volume, sampler=tio.UniformSampler(patch), num_workers=workers,
                     start_background=False)


class Contender:
    """One pipeline: its loader, the files it reads (for eviction), and how to count a batch."""

    def __init__(self, name: str, vols: Volumes, args, cold: bool):
        self.name = name
        self.dataset = None
        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                      persistent_workers=args.workers > 0, prefetch_factor=2 if args.workers else None)
        if name.startswith("fastdata-"):
            kind = name.split("-", 1)[1]
            cls = ClosingPatches if cold else fastdata.PatchDataset
            self.dataset = cls(fastdata.open_dataset(vols.store(kind)), (args.patch,) * 3, fields=("ct", "label"),
                               sampler="uniform", patches_per_sample=args.patches_per_volume, seed=0, output="tensor")
            self.loader = fastdata.loader(self.dataset, **common)
            self.files = files_under(vols.store(kind))
        elif name in ("npy", "nibabel"):
            ds = CropDataset(vols, args.patch, args.patches_per_volume, name)
            self.loader = torch.utils.data.DataLoader(ds, worker_init_fn=seed_worker, **common)
            self.files = [(vols.npy if name == "npy" else vols.nii)(i, f) for i in range(vols.count)
                          for f in ("ct", "label")]
        elif name == "torchio":
            import torchio as tio

            queue = torchio_queue(vols, args.patch, args.patches_per_volume, args.workers)
            self.loader = tio.SubjectsLoader(queue, batch_size=args.batch_size, num_workers=0)
            self.files = [vols.nii(i, f) for i in range(vols.count) for f in ("ct", "label")]
        else:
            raise ValueError(name)

    @staticmethod
    def count(batch) -> tuple[int, str]:
        ct = batch["ct"]
        if isinstance(ct, dict):  # torchio: {"data": (B, 1, X, Y, Z), "affine": ...}
            ct = ct["data"]
        return len(ct), f"{str(ct.dtype).replace('torch.', '')}{tuple(ct.shape[1:])}"

    def epoch(self, cold: bool) -> dict:
        row: dict = {}
        if cold:
            if self.dataset is not None:
                self.dataset.base.close()  # a mapped page cannot be evicted
            evict_page_cache(self.files)
            row["cached"] = resident_fraction(self.files)
        t0 = time.perf_counter()
        n = 0
        for batch in self.loader:
            got, shape = self.count(batch)
            n += got
            row["batch"] = shape
        row["seconds"] = time.perf_counter() - t0
        row["patches"] = n
        row["patches_s"] = n / row["seconds"]
        return row


def paired_ratio(rates: list[float], reference: list[float]) -> float:
    """Median over rounds of the round's ratio (a slow spell of the machine cancels out of each)."""
    return statistics.median(a / b for a, b in zip(rates, reference, strict=True))


def run_loaders(vols: Volumes, args, cold: bool, names: list[str]) -> dict:
    contenders = {name: Contender(name, vols, args, cold) for name in names}
    epochs: dict[str, list[dict]] = {name: [] for name in names}
    load: list[float] = []
    for epoch in range(args.epochs + 1):
        for name, c in contenders.items():
            row = c.epoch(cold)
            if epoch > 0:
                epochs[name].append(row)
            cached = f"  cached {row['cached']:.0%}" if row.get("cached") is not None else ""
            print(f"    {'cold' if cold else 'warm'} epoch {epoch} {name:14s} {row['patches_s']:8.1f} patches/s  "
                  f"({row['patches']} in {row['seconds']:.1f} s){cached}{'  (warm-up)' if epoch == 0 else ''}",
                  flush=True)
        load.append(os.getloadavg()[0])
    contenders.clear()
    rows = {}
    for name in names:
        rates = [r["patches_s"] for r in epochs[name]]
        rows[name] = {"median_patches_s": statistics.median(rates), "epochs": epochs[name],
                      "batch": epochs[name][0]["batch"]}
        cached = [r["cached"] for r in epochs[name] if r.get("cached") is not None]
        if cached:
            rows[name]["cached_max"] = max(cached)
    for name in names:
        if name.startswith("fastdata-"):
            mine = [r["patches_s"] for r in epochs[name]]
            rows[name]["x"] = {b: paired_ratio(mine, [r["patches_s"] for r in epochs[b]]) for b in BASELINES
                               if b in epochs}
    return {"rows": rows, "loadavg_1m": load}


# --------------------------------------------------------------------------- in-process figures
class RecordingBase(torch.utils.data.Dataset):
    """A store dataset whose samples' lazy arrays are remembered (to read their ``chunks_read``)."""

    def __init__(self, ds):
        self.ds, self.arrays = ds, []

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        item = self.ds[i]
        self.arrays.append(item["ct"])
        return item


def decoded_per_patch(vols: Volumes, args) -> dict:
    """``chunks_read x chunk bytes / patch bytes`` of ``ct`` per uniform patch, in this process."""
    base = RecordingBase(fastdata.open_dataset(vols.store("lmdb")))
    per_volume = max(args.patches_per_volume, -(-args.decoded_patches // vols.count))
    pd = fastdata.PatchDataset(base, (args.patch,) * 3, fields=("ct",), patches_per_sample=per_volume, seed=7)
    chunk_bytes = math.prod(CHUNKS) * 2
    patch_bytes = args.patch ** 3 * 2
    measured, expected = [], []
    order = np.random.default_rng(0).permutation(len(pd))[:args.decoded_patches]
    for p in order.tolist():
        base.arrays.clear()
        item = pd[p]
        read = sum(a.chunks_read for a in base.arrays)
        measured.append(read * chunk_bytes / patch_bytes)
        touched = math.prod((s + args.patch - 1) // c - s // c + 1 for s, c in zip(item["position"].tolist(), CHUNKS,
                                                                                   strict=True))
        expected.append(touched * chunk_bytes / patch_bytes)
    base.ds.close()
    # the exact expectation over uniform starts: the axes are independent, so the mean of the product of
    # the chunks touched per axis is the product of the per-axis means
    per_axis = [statistics.fmean((s + args.patch - 1) // c - s // c + 1 for s in range(vols.side - args.patch + 1))
                for c in CHUNKS]
    return {"patches": len(measured), "mean": statistics.fmean(measured), "median": statistics.median(measured),
            "max": max(measured), "min": min(measured), "from_positions_mean": statistics.fmean(expected),
            "expected_uniform": math.prod(per_axis) * chunk_bytes / patch_bytes,
            "chunk_bytes": chunk_bytes, "patch_bytes": patch_bytes}


def stored_sizes(vols: Volumes) -> dict:
    ds = fastdata.open_dataset(vols.store("lmdb"))
    out = {}
    for field, itemsize in (("ct", 2), ("label", 1)):
        stored = sum(ds[i][field].stored_bytes for i in range(vols.count))
        out[field] = {"raw": vols.count * vols.side ** 3 * itemsize, "fastdata_chunks": stored,
                      "nii_gz": sum(os.path.getsize(vols.nii(i, field)) for i in range(vols.count))}
    ds.close()
    out["total"] = {k: out["ct"][k] + out["label"][k] for k in ("raw", "fastdata_chunks", "nii_gz")}
    for kind in STORES:
        out["total"][f"{kind}_dir"] = dir_bytes(vols.store(kind))
    return out


def zarr_codec() -> tuple[str, int]:
    """The Blosc compressor name and level of the default codec (zarr gets the same)."""
    codec = CHUNK_CODECS[DEFAULT_CODEC]
    assert codec.name.startswith("blosc-") and codec.default_level is not None
    return codec.name.split("-", 1)[1], codec.default_level


def region_reads(vols: Volumes, args) -> dict:
    """Random regions of the ``ct`` volumes: fastdata ChunkedArray vs zarr v3 (same chunks, same codec: the
    default store's Blosc compressor, level and shuffle)."""
    import zarr
    from zarr.codecs import BloscCodec

    cname, level = zarr_codec()
    paths = [os.path.join(vols.root, f"{i:03d}_ct-{cname}-c{CHUNKS[0]}.zarr") for i in range(vols.count)]
    stamp = Path(vols.root) / f".zarr-{cname}-{vols.count}-c{CHUNKS[0]}.done"
    if not stamp.exists():
        for i, path in enumerate(paths):
            shutil.rmtree(path, ignore_errors=True)
            z = zarr.create_array(store=path, shape=(vols.side,) * 3, chunks=CHUNKS, dtype="uint16",
                                  compressors=BloscCodec(cname=cname, clevel=level, shuffle="shuffle",
                                                         blocksize=BLOSC_BLOCK_BYTES), zarr_format=3)
            src = np.load(vols.npy(i, "ct"), mmap_mode="r")
            for z0 in range(0, vols.side, CHUNKS[0]):
                z[z0:z0 + CHUNKS[0]] = src[z0:z0 + CHUNKS[0]]
        stamp.touch()
    zs = [zarr.open_array(p, mode="r") for p in paths]
    ds = fastdata.open_dataset(vols.store("lmdb"))
    fa = [ds[i]["ct"] for i in range(vols.count)]
    rng = np.random.default_rng(11)
    regions = [(int(rng.integers(vols.count)),
                tuple(slice(int(a), int(a) + args.patch) for a in rng.integers(0, vols.side - args.patch + 1, 3)))
               for _ in range(args.regions)]
    for i, r in regions[:4]:  # same values as the written data
        want = np.load(vols.npy(i, "ct"), mmap_mode="r")[r]
        if not (np.array_equal(fa[i][r], want) and np.array_equal(zs[i][r], want)):
            raise SystemExit(f"region {r} of volume {i}: fastdata or zarr differs from the .npy volume")
    mb = len(regions) * args.patch ** 3 * 2 / 1e6
    runs: dict[str, list[dict]] = {"fastdata": [], "zarr": []}
    readers = {"fastdata": fa, "zarr": zs}
    for _ in range(args.region_repeats):
        for name, arrays in readers.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for i, r in regions:
                arrays[i][r]
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            runs[name].append({"wall_s": wall, "cpu_s": cpu, "mb_s": mb / wall})
    ds.close()
    out = {name: {"median_mb_s": statistics.median(r["mb_s"] for r in rs),
                  "median_cpu_s_per_gb": statistics.median(r["cpu_s"] / mb * 1000 for r in rs), "runs": rs}
           for name, rs in runs.items()}
    out["x_zarr"] = paired_ratio([r["mb_s"] for r in runs["fastdata"]], [r["mb_s"] for r in runs["zarr"]])
    out["regions"] = len(regions)
    out["zarr_bytes"] = sum(dir_bytes(p) for p in paths)
    out["zarr_version"] = zarr.__version__
    out["codec"] = f"{cname} {level}"
    return out


# --------------------------------------------------------------------------- worker memory
def memory_child(store: str, args) -> dict:
    """In a fresh process: ``--memory-epochs`` epochs of patches through ``fastdata.loader``, the
    process tree's memory sampled in a thread (and its anonymous / file-backed split in another)."""
    import threading

    import psutil

    pd = fastdata.PatchDataset(fastdata.open_dataset(store), (args.patch,) * 3, fields=("ct", "label"),
                               patches_per_sample=args.patches_per_volume, seed=0, output="tensor")
    loader = fastdata.loader(pd, batch_size=args.batch_size, num_workers=args.workers, shuffle=True)
    peaks = {"anon": 0, "file": 0}
    stop = threading.Event()

    def split() -> None:
        me = psutil.Process()
        while not stop.wait(0.1):
            now = pss_split([me.pid] + [c.pid for c in me.children(recursive=True)])
            for k in peaks:
                peaks[k] = max(peaks[k], now[k])

    thread = threading.Thread(target=split, daemon=True)
    thread.start()
    n = 0
    with MemorySampler(interval=0.05) as mem:
        for epoch in range(args.memory_epochs):
            for batch in loader:
                n += len(batch["ct"])
            mem.mark(f"epoch{epoch}")
    stop.set()
    thread.join()
    s = mem.summary()
    return {"patches": n, "peak_pss": s["peak_pss"], "peak_rss": s["peak_rss"], "peak_uss": s["peak_uss"],
            "peak_anon_pss": peaks["anon"], "peak_file_pss": peaks["file"],
            "max_workers": s["max_workers"], "epoch_pss": [m["total_pss"] for m in s["marks"]]}


def worker_memory(work: str, args) -> dict:
    sides = [int(s) for s in args.memory_sides.split(",")]
    stores = {}
    for side in sides:
        vols = Volumes(work, side, args.memory_volumes)
        vols.prepare(("lmdb",))
        stores[side] = vols.store("lmdb")
    runs: dict[int, list[dict]] = {side: [] for side in sides}
    for _ in range(args.memory_repeats):
        for side in sides:
            cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", stores[side],
                   "--patch", str(args.patch), "--patches-per-volume", str(args.patches_per_volume),
                   "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                   "--memory-epochs", str(args.memory_epochs)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"memory child failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[side].append(row)
            print(f"    memory {side}^3: peak PSS {row['peak_pss'] / MB:.0f} MB (anonymous "
                  f"{row['peak_anon_pss'] / MB:.0f}, file-backed {row['peak_file_pss'] / MB:.0f}), peak RSS "
                  f"{row['peak_rss'] / MB:.0f} MB "
                  f"({row['patches']} patches)", flush=True)
    res: dict = {"sides": sides, "volumes": args.memory_volumes, "epochs": args.memory_epochs, "runs": runs}
    res["peak_pss"] = {side: statistics.median(r["peak_pss"] for r in rs) for side, rs in runs.items()}
    for key in ("peak_rss", "peak_anon_pss", "peak_file_pss"):
        res[key] = {side: statistics.median(r[key] for r in rs) for side, rs in runs.items()}
    big, small = max(sides), min(sides)
    res["ratio_pss"] = res["peak_pss"][big] / res["peak_pss"][small]
    res["ratio_anon_pss"] = res["peak_anon_pss"][big] / res["peak_anon_pss"][small]
    return res


# --------------------------------------------------------------------------- report
def fmt_ratio(x: float | None, target: float | None) -> str:
    if x is None:
        return ""
    if target is None:
        return f"{x:.2f}x"
    return f"{x:.2f}x ({'meets' if x >= target else 'below'} {target:g}x)"


def markdown(res: dict, command: str) -> str:
    lines: list[str] = []
    if any("warm" in sres for sres in res["scenarios"].values()):
        lines += loader_tables(res)
    return "\n".join(lines + in_process_tables(res, command)) + "\n"


def loader_tables(res: dict) -> list[str]:
    a = res["args"]
    lines = [f"Random {a['patch']}^3 patches of ct (uint16) + label (uint8), {a['patches_per_volume']} per volume "
             f"per epoch, batch {a['batch_size']}, {a['workers']} workers; patches/s, medians of {a['epochs']} "
              "interleaved epochs; ratios: medians of per-round ratios of fastdata-lmdb (target in brackets)", "",
              "| volumes | cache | " + " | ".join(CONTENDERS) + " | x npy | x nibabel | x torchio |",
              "|---|---|" + "---:|" * (len(CONTENDERS) + 3)]
    for sres in res["scenarios"].values():
        side = sres["side"]
        for cache in ("warm", "cold"):
            if cache not in sres:
                continue
            rows = sres[cache]["rows"]
            cells = [f"{rows[c]['median_patches_s']:.1f}" if c in rows else "" for c in CONTENDERS]
            x = rows.get("fastdata-lmdb", {}).get("x", {})
            npy_target = TARGETS["npy@512"] if side >= 512 else TARGETS["npy@256"] if side >= 256 else None
            lines.append(f"| {sres['count']} x {side}^3 | {cache} | " + " | ".join(cells) + " | "
                         f"{fmt_ratio(x.get('npy'), npy_target)} | {fmt_ratio(x.get('nibabel'), TARGETS['nibabel'])} | "
                         f"{fmt_ratio(x.get('torchio'), TARGETS['torchio'])} |")
    for other in ("fastdata-hdf5", "fastdata-lmdb-zstd"):
        lines += ["", f"{other} vs the baselines (same rounds): " + "; ".join(
            f"{scen} {cache}: " + ", ".join(f"x {b} {v:.2f}" for b, v in sres[cache]["rows"][other]["x"].items())
            for scen, sres in res["scenarios"].items() for cache in ("warm", "cold")
            if cache in sres and other in sres[cache]["rows"])]
    cold_cached = [f"{scen} {name} {r['cached_max']:.0%}" for scen, sres in res["scenarios"].items()
                   if "cold" in sres for name, r in sres["cold"]["rows"].items() if "cached_max" in r]
    if cold_cached:
        lines += ["", "Cold rows, the largest fraction of the files' pages still cached right after eviction: "
                  + ", ".join(cold_cached)]
    return lines + [""]


def in_process_tables(res: dict, command: str) -> list[str]:
    a = res["args"]
    lines: list[str] = []
    lines += ["| volumes | bytes decoded per patch (ct, chunks_read x chunk / patch) | from the positions | "
              "exact expectation, uniform starts | target |", "|---|---:|---:|---:|---|"]
    for sres in res["scenarios"].values():
        d = sres["decoded"]
        lines.append(f"| {sres['count']} x {sres['side']}^3 | mean {d['mean']:.2f}x (median {d['median']:.2f}, "
                     f"{d['min']:.2f}-{d['max']:.2f}, {d['patches']} patches) | {d['from_positions_mean']:.2f}x | "
                     f"{d['expected_uniform']:.2f}x | <= 4x: {'meets' if d['mean'] <= 4 else 'above'} |")
    lines += ["", f"| volumes | field | raw MB | fastdata {DEFAULT_CODEC} MB (x smaller) | .nii.gz MB (x smaller) |",
              "|---|---|---:|---:|---:|"]
    for sres in res["scenarios"].values():
        for field in ("ct", "label", "total"):
            s = sres["sizes"][field]
            lines.append(f"| {sres['count']} x {sres['side']}^3 | {field} | {s['raw'] / MB:.0f} | "
                         f"{s['fastdata_chunks'] / MB:.1f} ({s['raw'] / s['fastdata_chunks']:.2f}) | "
                         f"{s['nii_gz'] / MB:.1f} ({s['raw'] / s['nii_gz']:.2f}) |")
        t = sres["sizes"]["total"]
        lines.append("| | store dirs (MB, x smaller than raw) | | " + ", ".join(
            f"{kind} {t[f'{kind}_dir'] / MB:.1f} ({t['raw'] / t[f'{kind}_dir']:.2f})" for kind in STORES
            if f"{kind}_dir" in t) + " | |")
    rr = res.get("regions")
    if rr:
        lines += ["", f"Region reads, one process: {rr['regions']} random {a['patch']}^3 regions of the ct volumes "
                  f"({rr['scenario']}), medians of {a['region_repeats']} interleaved repeats", "",
                  "| reader | MB/s of output | CPU s per GB | x zarr |", "|---|---:|---:|---:|",
                  f"| fastdata ChunkedArray | {rr['fastdata']['median_mb_s']:.0f} | "
                  f"{rr['fastdata']['median_cpu_s_per_gb']:.2f} | "
                  f"{fmt_ratio(rr['x_zarr'], 0.8)} |",
                  f"| zarr {rr['zarr_version']} (BloscCodec {rr['codec']} shuffle 256 KiB blocks, {CHUNKS[0]}^3) | "
                  f"{rr['zarr']['median_mb_s']:.0f} | "
                  f"{rr['zarr']['median_cpu_s_per_gb']:.2f} | 1.00 |",
                  f"zarr store: {rr['zarr_bytes'] / MB:.1f} MB"]
    m = res.get("memory")
    if m:
        big, small = max(m["sides"]), min(m["sides"])
        lines += ["", f"Worker memory: loader process tree (main + {a['workers']} workers), {m['epochs']} epochs of "
                  f"{m['volumes'] * a['patches_per_volume']} patches, {m['volumes']} volumes, medians of "
                  f"{len(m['runs'][big])} fresh-process runs", "",
                  "| volumes | peak PSS MB | of it anonymous (peak) | file-backed (peak) | peak RSS MB |",
                  "|---|---:|---:|---:|---:|"]
        for side in m["sides"]:
            lines.append(f"| {side}^3 | {m['peak_pss'][side] / MB:.0f} | {m['peak_anon_pss'][side] / MB:.0f} | "
                         f"{m['peak_file_pss'][side] / MB:.0f} | {m['peak_rss'][side] / MB:.0f} |")
        lines.append(f"PSS ratio {big}^3 / {small}^3: {m['ratio_pss']:.2f}x (target <= 1.5x: "
                     f"{'meets' if m['ratio_pss'] <= 1.5 else 'above'}); anonymous PSS ratio "
                     f"{m['ratio_anon_pss']:.2f}x. File-backed PSS is mostly pages of the mapped store (and of "
                     "libraries), clean pages the kernel drops under pressure; the anonymous part is what the "
                     "workers really hold.")
    mc = res["machine"]
    lines += ["", f"Machine: {mc['cores']} cores, {mc['mem_gb']:.0f} GB, Python {mc['python']}, torch {mc['torch']}, "
              f"{mc['platform']}; fastdata {mc['fastdata_commit']}; {mc['versions']}; 1-min load average "
              f"{mc['loadavg_start']:.1f} at start, {mc['loadavg_end']:.1f} at end (above {mc['cores']} = busy). "
              f"Command: `{command}`"]
    return lines


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("numpy", "numcodecs", "nibabel", "torchio", "SimpleITK", "zarr", "lmdb", "h5py"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} -")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="256x8,512x4",
                   help="comma-separated SIDExCOUNT: COUNT volumes of SIDE^3 (default 256x8,512x4)")
    p.add_argument("--patch", type=int, default=96, help="patch side (default 96)")
    p.add_argument("--chunks", type=int, default=VOLUME_CHUNK,
                   help=f"chunk side of the stores (default {VOLUME_CHUNK}, fastdata's for NIfTI volumes)")
    p.add_argument("--patches-per-volume", type=int, default=8, help="patches per volume per epoch, every contender "
                   "(default 8)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (torchio: the queue's)")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs per cache state, after one warm-up")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {CONTENDERS} ('': no loader runs, only the in-process figures)")
    p.add_argument("--no-cold", action="store_true", help="warm page cache only")
    p.add_argument("--decoded-patches", type=int, default=200, help="patches for the bytes-decoded figure")
    p.add_argument("--regions", type=int, default=64, help="regions per repeat of the zarr comparison (0: skip it)")
    p.add_argument("--region-repeats", type=int, default=5)
    p.add_argument("--memory-sides", default="512,128", help="volume sides of the worker-memory runs ('' skips them)")
    p.add_argument("--memory-volumes", type=int, default=4, help="volumes of each worker-memory run")
    p.add_argument("--memory-epochs", type=int, default=5)
    p.add_argument("--memory-repeats", type=int, default=2, help="fresh-process runs per side (medians)")
    p.add_argument("--memory-child", metavar="STORE", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help="keep and reuse the generated volumes, files and stores here")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--md", help="write the markdown tables here")
    p.add_argument("--quick", action="store_true", help="smoke size: 128x3,160x2, 4 patches per volume, 1 epoch, "
                   "memory 160 vs 128")
    args = p.parse_args(argv)
    if args.memory_child:
        torch.set_num_threads(1)
        print(json.dumps(memory_child(args.memory_child, args)))
        return 0
    global CHUNKS
    CHUNKS = (args.chunks,) * 3
    if args.quick:
        args.scenarios, args.patches_per_volume, args.epochs = "128x3,160x2", 4, 1
        args.decoded_patches, args.regions, args.region_repeats = 40, 16, 2
        args.memory_sides, args.memory_epochs, args.memory_repeats, args.memory_volumes = "160,128", 2, 1, 2
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if unknown := set(names) - set(CONTENDERS):
        p.error(f"unknown contenders {sorted(unknown)}")
    scenarios = []
    for spec in args.scenarios.split(","):
        side, _, count = spec.strip().partition("x")
        if not (side.isdigit() and count.isdigit()) or int(side) < args.patch:
            p.error(f"scenario {spec!r}: SIDExCOUNT with SIDE >= --patch ({args.patch})")
        scenarios.append((int(side), int(count)))
    temp = None if args.workdir else tempfile.mkdtemp(prefix="fastdata-patches-")
    work = args.workdir or temp
    os.makedirs(work, exist_ok=True)
    command = shlex.join(["python", "benchmarks/bench_patches.py", *(argv or sys.argv[1:])])
    import psutil

    res: dict = {"args": vars(args), "scenarios": {}, "machine": {
        "cores": os.cpu_count(), "mem_gb": psutil.virtual_memory().total / 2 ** 30, "python": platform.python_version(),
        "torch": torch.__version__, "platform": platform.platform(), "fastdata_commit": git_commit(),
        "versions": versions(), "loadavg_start": os.getloadavg()[0]}}
    torch.set_num_threads(1)  # the main process only collates (workers run one thread each anyway)
    try:
        for side, count in scenarios:
            name = f"{count}x{side}^3"
            vols = Volumes(work, side, count)
            spent = vols.prepare()
            if spent:
                print(f"{name}: prepared " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()), flush=True)
            for kind in STORES:
                vols.check_store(vols.store(kind))
            sres: dict = {"side": side, "count": count, "prepare_s": spent}
            sres["sizes"] = stored_sizes(vols)
            sres["decoded"] = decoded_per_patch(vols, args)
            print(f"{name}: bytes decoded per patch {sres['decoded']['mean']:.2f}x", flush=True)
            files = [f for f in files_under(vols.root) if not f.endswith(".done") and ".zarr" not in f]
            for f in files:  # warm: every file read once
                with open(f, "rb") as fh:
                    while fh.read(16 << 20):
                        pass
            if names:
                print(f"{name}: {count * args.patches_per_volume} patches per epoch", flush=True)
                sres["warm"] = run_loaders(vols, args, False, names)
                if not args.no_cold:
                    sres["cold"] = run_loaders(vols, args, True, names)
            res["scenarios"][name] = sres
        if args.regions > 0:
            side, count = max(scenarios)
            vols = Volumes(work, side, count)
            res["regions"] = region_reads(vols, args)
            res["regions"]["scenario"] = f"{count} x {side}^3"
            print(f"regions: fastdata {res['regions']['fastdata']['median_mb_s']:.0f} MB/s, zarr "
                  f"{res['regions']['zarr']['median_mb_s']:.0f} MB/s", flush=True)
        if args.memory_sides:
            res["memory"] = worker_memory(work, args)
        res["machine"]["loadavg_end"] = os.getloadavg()[0]
        md = markdown(res, command)
        print("\n" + md)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        if args.md:
            Path(args.md).write_text(md)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
