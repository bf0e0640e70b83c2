"""Cold epochs: fastdata's stores against WebDataset and LitData with nothing in the page cache,
side by side in one run, on two setups.

* ``evict``: the page cache of every file a contender reads is dropped right before each of its
  epochs (``posix_fadvise(DONTNEED)``, no root needed); fastdata's persistent workers close their
  store handles after every batch (:class:`fastdata.bench.runner.CloseAfterFetch`) so that no
  page stays mapped across the eviction. A warm row (the same loaders, nothing evicted) gives
  each contender's cold/warm ratio.
* ``--memory-limit MB``: the whole run (this process and its DataLoader workers) is put in a
  memory cgroup of that size (cgroup v1 ``memory.limit_in_bytes`` or v2 ``memory.max``; needs
  root), so a store several times larger than the limit cannot stay in the page cache whatever
  is evicted: every epoch reads the disk, as ImageNet does on a machine with less RAM than the
  dataset. Use ``--images`` to make the stores several times the limit.

Data: ``--images`` ImageNet-like JPEGs (``fastdata.synth``, photo-like, ~63 KB), written as
* ``fastdata-lmdb`` / ``fastdata-hdf5``: ``fastdata.convert`` (default settings);
* ``webdataset``: tar shards of at most 64 MB (``webdataset.ShardWriter``), samples in a random
  order (seed 0) as WebDataset users write them, read with its documented pipeline:
  ``WebDataset(urls, shardshuffle=True, nodesplitter=split_by_node, workersplitter=split_by_worker)
  .shuffle(1000)`` through ``WebLoader``;
* ``litdata``: ``litdata.optimize(..., chunk_bytes="64MB", num_workers=2)`` of the same bytes,
  read with ``StreamingDataset(shuffle=True)`` through ``StreamingDataLoader``.

Every contender decodes the same JPEG bytes with the same function (fastdata's fused
``RandomResizedCrop(224)`` decode: simplejpeg + OpenCV crop-resize, to uint8), batches of 64
through 2 workers: the rows differ in storage and reading only. Reported per contender and setup:
images/s (median of ``--epochs`` epochs after one warm-up, epochs interleaved round-robin across
contenders), every epoch's figure (reported, not just the best), the first batch's latency (from
the loader's ``iter()`` to its first batch) and the fraction of the files' pages still cached
right after eviction.

Needs the bench venv (webdataset, litdata) beside fastdata::

    python benchmarks/bench_cold.py --workdir /tmp/cold                        # 2000 images, evicted
    python benchmarks/bench_cold.py --workdir /tmp/cold-big --images 40000 --memory-limit 1200 --setups limit
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdata  # noqa: E402
from fastdata import transforms  # noqa: E402
from fastdata.bench.cache import evict_page_cache, resident_fraction  # noqa: E402
from fastdata.bench.runner import CloseAfterFetch  # noqa: E402
from fastdata.format.manifest import read_manifest  # noqa: E402
from fastdata.reader.seeding import seed_worker  # noqa: E402
from fastdata.synth import make_image_folder  # noqa: E402

CONTENDERS = ("fastdata-lmdb", "fastdata-hdf5", "webdataset", "litdata")
#: the control: fastdata-lmdb with the batch prefetch off in its workers
CONTROLS = ("fastdata-lmdb-noprefetch",)
SHARD_BYTES = 64 << 20


# --------------------------------------------------------------------------- data
def files_under(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def prepare(work: str, images: int) -> dict[str, str]:
    """Generate the JPEGs and every contender's store (reused when present); their paths."""
    src = os.path.join(work, "jpeg")
    if not os.path.isdir(src):
        make_image_folder(src, num_classes=10, per_class=images // 10, size="imagenet", workers=2)
    from fastdata.writer.sources.folder import scan_folder

    scan = scan_folder(src)
    paths = {"src": src, "fastdata-lmdb": src + ".lmdb", "fastdata-hdf5": src + ".h5",
             "webdataset": os.path.join(work, "wds"), "litdata": os.path.join(work, "litdata")}
    for name in ("fastdata-lmdb", "fastdata-hdf5"):
        if not os.path.isdir(paths[name]):
            t0 = time.perf_counter()
            fastdata.convert(src, paths[name], workers=2, progress=False)
            print(f"  {name}: converted in {time.perf_counter() - t0:.1f} s", flush=True)
    order = np.random.default_rng(0).permutation(len(scan.paths))
    if not os.path.isdir(paths["webdataset"]):
        import webdataset as wds

        t0 = time.perf_counter()
        os.makedirs(paths["webdataset"] + ".tmp", exist_ok=True)
        with wds.ShardWriter(os.path.join(paths["webdataset"] + ".tmp", "train-%06d.tar"), maxsize=SHARD_BYTES,
                             verbose=0) as sink:
            for i in order.tolist():
                with open(scan.paths[i], "rb") as fh:
                    sink.write({"__key__": f"{i:08d}", "jpg": fh.read(), "cls": int(scan.labels[i])})
        os.rename(paths["webdataset"] + ".tmp", paths["webdataset"])
        print(f"  webdataset: written in {time.perf_counter() - t0:.1f} s", flush=True)
    if not os.path.isdir(paths["litdata"]):
        import litdata

        t0 = time.perf_counter()
        litdata.optimize(fn=_litdata_item, inputs=[(scan.paths[i], int(scan.labels[i])) for i in order.tolist()],
                         output_dir=paths["litdata"] + ".tmp", chunk_bytes="64MB", num_workers=2)
        os.rename(paths["litdata"] + ".tmp", paths["litdata"])
        print(f"  litdata: optimized in {time.perf_counter() - t0:.1f} s", flush=True)
    return paths


def _litdata_item(item: tuple[str, int]) -> dict:
    path, label = item
    with open(path, "rb") as fh:
        return {"jpg": fh.read(), "cls": label}


# --------------------------------------------------------------------------- loaders
class _Decode:
    """The shared decode: fastdata's fused RandomResizedCrop(224) of JPEG bytes, to CHW uint8."""

    def __init__(self) -> None:
        self.rrc = transforms.RandomResizedCrop(224)

    def __call__(self, data: bytes) -> torch.Tensor:
        return torch.from_numpy(self.rrc(data)).permute(2, 0, 1)


def _wds_pair(sample, decode=_Decode()):  # noqa: B008 - one decoder per process, made on import
    return decode(sample["jpg"]), int(sample["cls"])


try:  # the bench venv's peer; a module-level class, so that spawned workers can unpickle it
    import litdata as _litdata

    class LitDataPairs(_litdata.StreamingDataset):
        """litdata.StreamingDataset yielding ``(image, label)`` decoded by the shared function."""

        decode = _Decode()

        def __getitem__(self, index):
            item = super().__getitem__(index)
            return self.decode(item["jpg"]), int(item["cls"])
except ImportError:  # pragma: no cover - reported when the contender is asked for
    _litdata = None


class NoPrefetch(CloseAfterFetch):
    """The control: LMDB's batch prefetch (``posix_fadvise`` of a batch's records) off in the
    worker that reads (a module switch of that process only)."""

    def __init__(self, inner, close: bool):
        super().__init__(inner)
        self.closing = close

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        from fastdata.format.backends.lmdb import reader

        reader.PREFETCH = False
        if self.closing:
            return super().__getitems__(indices)
        return self.inner.__getitems__(indices)


def make_loader(name: str, paths: dict, args, cold: bool):
    common = dict(batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True,
                  prefetch_factor=args.prefetch_factor)
    if name.startswith("fastdata-"):
        ds = fastdata.open_dataset(paths[name.removesuffix("-noprefetch")], output="tensor",
                                   decode=transforms.RandomResizedCrop(224))
        ds.seed = 0
        wrapped = NoPrefetch(ds, cold) if name.endswith("-noprefetch") else CloseAfterFetch(ds) if cold else ds
        return fastdata.loader(wrapped, shuffle=True, **common), ds
    if name == "webdataset":
        import webdataset as wds

        urls = files_under(paths["webdataset"])
        pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node,
                                   workersplitter=wds.split_by_worker, seed=0)
                    .shuffle(1000).map(_wds_pair).batched(args.batch_size, partial=True))
        loader = wds.WebLoader(pipeline, batch_size=None, num_workers=args.workers, persistent_workers=True,
                               prefetch_factor=args.prefetch_factor, worker_init_fn=seed_worker)
        return loader, None
    if name == "litdata":
        if _litdata is None:
            raise SystemExit("the litdata contender needs litdata (pip install litdata)")
        # LitData's workers keep its chunk files mapped, so that an eviction leaves them cached:
        # cold, its workers end with each epoch (and their mappings with them)
        return _litdata.StreamingDataLoader(LitDataPairs(paths["litdata"], shuffle=True, seed=0),
                                            **{**common, "persistent_workers": not cold}), None
    raise ValueError(name)


def store_files(name: str, paths: dict) -> list[str]:
    name = name.removesuffix("-noprefetch")
    if name.startswith("fastdata-"):
        return [os.path.join(paths[name], s["name"]) for s in read_manifest(paths[name])["shards"]]
    files = files_under(paths[name])
    if name == "litdata":  # and whatever LitData copied to its cache
        cache = os.path.expanduser("~/.lightning/chunks")
        files += files_under(cache) if os.path.isdir(cache) else []
    return files


def epoch(loader, files: list[str] | None, store) -> dict:
    row: dict = {}
    if files is not None:
        if store is not None:
            store.close()  # the main process's handles too: a mapped page cannot be evicted
        evict_page_cache(files)
        row["cached"] = resident_fraction(files)
    t0 = time.perf_counter()
    n = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        images = batch[0]
        n += len(images)
    row["seconds"] = time.perf_counter() - t0
    row["images"] = n
    row["img_s"] = n / row["seconds"]
    row["first_batch_s"] = first
    return row


def shutdown_workers(loader) -> None:
    """End a loader's persistent workers now, not when the garbage collector gets to it.

    A worker kept alive past its phase keeps its store files mapped, and mapped pages survive
    every later eviction: LitData's warm-phase workers (a reference cycle held their loader)
    kept its chunk files 100% cached through the whole cold phase."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None
    gc.collect()


def run_setup(setup: str, paths: dict, args) -> dict:
    cold = setup == "evict"
    names = [c for c in args.contenders.split(",") if c]
    out: dict = {}
    for state in (("warm", "cold") if cold else ("limit",)):
        evicting = state == "cold"
        loaders = {name: make_loader(name, paths, args, evicting) for name in names}
        files = {name: store_files(name, paths) for name in names}
        rows: dict[str, list[dict]] = {name: [] for name in names}
        for e in range(args.epochs + 1):
            for name, (loader, store) in loaders.items():
                row = epoch(loader, files[name] if evicting else None, store)
                if e > 0:
                    rows[name].append(row)
                cached = f", cached {row['cached']:.0%}" if "cached" in row else ""
                print(f"    {state} epoch {e} {name:14s} {row['img_s']:8.0f} img/s, first batch "
                      f"{row['first_batch_s']:.2f} s{cached}{' (warm-up)' if e == 0 else ''}", flush=True)
        for loader, _store in loaders.values():
            shutdown_workers(loader)
        loaders.clear()
        out[state] = {name: {"median_img_s": statistics.median(r["img_s"] for r in rs),
                             "median_first_batch_s": statistics.median(r["first_batch_s"] for r in rs),
                             "epochs": rs} for name, rs in rows.items()}
    return out


# --------------------------------------------------------------------------- memory cgroup
def confine(limit_mb: int) -> str:
    """Put this process (and so its future children) in a new memory cgroup of ``limit_mb``."""
    name = f"fastdata-cold-{os.getpid()}"
    for root, knob in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max"),
                       ("/sys/fs/cgroup/unified", "memory.max")):
        if os.path.exists(os.path.join(root, knob if root.endswith("memory") else "cgroup.controllers")):
            group = os.path.join(root, name)
            try:
                os.makedirs(group, exist_ok=True)
                with open(os.path.join(group, knob), "w") as fh:
                    fh.write(str(limit_mb << 20))
                with open(os.path.join(group, "cgroup.procs"), "w") as fh:
                    fh.write(str(os.getpid()))
                return group
            except OSError:
                continue
    raise SystemExit("--memory-limit: cannot make a memory cgroup here (needs root and cgroup v1 or v2 memory)")


# --------------------------------------------------------------------------- report
def markdown(res: dict, command: str) -> str:
    lines = []
    for setup, sres in res["setups"].items():
        states = list(sres)
        head = [f"{s} img/s (epochs)" for s in states] + [f"{s} first batch s" for s in states]
        if "cold" in sres:
            head.append("cold / warm")
        lines += [f"Setup `{setup}` ({res['images']} ImageNet-like JPEGs, "
                  f"{res['store_mb']['fastdata-lmdb']:.0f} MB as LMDB"
                  + (f", loader confined to {res['memory_limit_mb']} MB" if setup == "limit" else "") + ")", "",
                  "| contender | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
        for name in sres[states[0]]:
            cells = [f"{sres[s][name]['median_img_s']:.0f} ("
                     + ", ".join(f"{r['img_s']:.0f}" for r in sres[s][name]["epochs"]) + ")" for s in states]
            cells += [f"{sres[s][name]['median_first_batch_s']:.2f}" for s in states]
            if "cold" in sres:
                cells.append(f"{sres['cold'][name]['median_img_s'] / sres['warm'][name]['median_img_s']:.2f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        last = states[-1]
        for peer in ("webdataset", "litdata"):
            if peer in sres[last] and "fastdata-lmdb" in sres[last]:
                ratio = sres[last]["fastdata-lmdb"]["median_img_s"] / sres[last][peer]["median_img_s"]
                lines.append(f"fastdata-lmdb / {peer} ({last}): {ratio:.2f}x")
        lines.append("")
    mc = res["machine"]
    lines.append(f"Machine: {mc['cores']} cores, Python {mc['python']}, torch {mc['torch']}; fastdata "
                 f"{mc['commit']}; {mc['versions']}; store sizes (MB): "
                 + ", ".join(f"{k} {v:.0f}" for k, v in res["store_mb"].items())
                 + f". Command: `{command}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="generated images and stores (kept and reused)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--setups", default="evict", help="comma-separated: evict, limit (limit needs --memory-limit)")
    p.add_argument("--memory-limit", type=int, default=0, metavar="MB", help="memory cgroup for the 'limit' setup")
    p.add_argument("--contenders", default=",".join(CONTENDERS + CONTROLS),
                   help=f"comma-separated, of {', '.join(CONTENDERS + CONTROLS)}")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    if "limit" in setups and not args.memory_limit:
        p.error("the 'limit' setup needs --memory-limit MB")
    os.makedirs(args.workdir, exist_ok=True)
    torch.set_num_threads(1)
    print(f"preparing {args.images} images in {args.workdir}", flush=True)
    paths = prepare(args.workdir, args.images)
    # litdata.optimize (when it ran above) switches the start method to spawn: every contender's
    # workers are forked again, as each library's default on Linux
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    res: dict = {"images": args.images, "memory_limit_mb": args.memory_limit, "setups": {},
                 "store_mb": {n: sum(os.path.getsize(f) for f in files_under(paths[n])) / 1e6 for n in CONTENDERS},
                 "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                             "commit": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip(),
                             "versions": ", ".join(f"{k} {version(k)}" for k in ("webdataset", "litdata", "lmdb",
                                                                                  "h5py", "simplejpeg"))}}
    group = None
    for setup in setups:
        if setup == "limit":
            group = confine(args.memory_limit)
            for name in CONTENDERS:
                evict_page_cache(store_files(name, paths))
        print(f"setup {setup}", flush=True)
        res["setups"][setup] = run_setup(setup, paths, args)
    command = "python benchmarks/bench_cold.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(res, command)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.md:
        Path(args.md).write_text(text)
    if group is not None:  # back to the parent group; the group goes once its last process has
        with open(os.path.join(os.path.dirname(group), "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
        try:
            os.rmdir(group)
        except OSError as err:  # a helper process (the resource tracker) may still be in it
            print(f"note: {group} not removed yet ({err.strerror}); rmdir it later", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
