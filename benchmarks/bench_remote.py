"""Remote store (S3, a real SeaweedFS server on this machine) against the same store on local disk.

Rows, each a fresh DataLoader (2 workers, persistent) over the same ImageNet-like LMDB store,
``RandomResizedCrop(224)`` decoded into uint8 batches of 64, read in the order of
``DistributedShardSampler(shard_window=2)`` (a store larger than its cache is read a few
whole shards at a time; the sampler has the next window's shards downloaded while the
current one is read):

* ``local-cold``   the local store, page cache of its shard files evicted first
* ``remote-cold``  the store on S3 with an empty cache (``cache_limit`` about 4 shards):
                   every shard is downloaded, checked and renamed into the cache this epoch
* ``local-warm``   a second epoch on the same loader
* ``remote-warm``  an unbounded cache already holding every shard (filled by an untimed epoch)
* ``remote-bounded-2nd``  the second epoch under ``cache_limit``: shards evicted during the
                   first epoch are downloaded again (prefetched a window ahead)

Rounds alternate which of local/remote goes first; the table gives medians and the ratios
remote/local. The cache's disk use is sampled every 20 ms during the remote epochs: its
peak is printed next to the limit plus one shard (the promise).

With ``--convert`` it also times converting the image folder to a local store and to an
S3 store (shards staged locally and uploaded as they finish), interleaved.

    python benchmarks/bench_remote.py                # ~5 min on 2 cores
    python benchmarks/bench_remote.py --quick        # smoke size
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import psutil

import fastdata
from fastdata import transforms
from fastdata.bench.cache import evict_page_cache
from fastdata.format.manifest import read_manifest
from fastdata.reader.sampler import DistributedShardSampler
from fastdata.remote.location import RemoteLocation
from fastdata.synth import make_image_folder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.s3server import S3Server  # noqa: E402  (the tests' SeaweedFS launcher)


def dir_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


class PeakDisk:
    """Samples the shard bytes under a cache directory every 20 ms; ``peak`` is the largest seen."""

    def __init__(self, path: str):
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, dir_bytes(self.path))
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def epoch(loader) -> float:
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch[1])
    return n / (time.perf_counter() - t0)


def make_loader(ds, workers: int, seed: int):
    sampler = DistributedShardSampler(ds, num_replicas=1, rank=0, shard_window=2, seed=seed)
    return fastdata.loader(ds, batch_size=64, sampler=sampler, num_workers=workers, prefetch_factor=4)


def run(args) -> dict:
    work = args.workdir or tempfile.mkdtemp(prefix="fastdata-remote-")
    src = os.path.join(work, "imagenet")
    if not os.path.isdir(src):
        make_image_folder(src, num_classes=10, per_class=args.n // 10, size="imagenet", workers=2)
    local = os.path.join(work, "imagenet.lmdb")
    if not os.path.isdir(local):
        fastdata.convert(src, local, shard_size=args.shard_size, progress=False)
    manifest = read_manifest(local)
    shard_bytes = [s["bytes"] for s in manifest["shards"]]
    limit = int(args.cache_shards * max(shard_bytes))
    server = bench_server(work, args.pin)
    try:
        url = "s3://bench/imagenet.lmdb"
        loc = RemoteLocation(url)
        for name in sorted(os.listdir(local)):
            if os.path.isfile(os.path.join(local, name)):
                loc.upload(os.path.join(local, name), name)
        print(f"{manifest['num_samples']} images, {len(shard_bytes)} shards of ~{max(shard_bytes) >> 20} MiB, "
              f"cache_limit {limit >> 20} MiB ({args.cache_shards} shards), {args.workers} workers", flush=True)
        out = {} if args.skip_read else read_rounds(local, url, manifest, limit, server, work, args)
        if args.convert:
            out["convert"] = convert_rounds(src, work, url.replace("imagenet.lmdb", "conv"), server, args)
        return out
    finally:
        server.kill()


def read_rounds(local: str, url: str, manifest: dict, limit: int, server: S3Server, work: str, args) -> dict:
    """The read rows (module docstring), interleaved round by round."""
    shard_bytes = [s["bytes"] for s in manifest["shards"]]
    rrc = transforms.RandomResizedCrop(224)
    rates: dict[str, list[float]] = {k: [] for k in ("local-cold", "remote-cold", "local-warm", "remote-warm",
                                                     "remote-bounded-2nd")}
    peaks = []
    files = [os.path.join(local, s["name"]) for s in manifest["shards"]]
    for rnd in range(args.rounds):
        order = ("local", "remote") if rnd % 2 == 0 else ("remote", "local")
        for kind in order:
            if kind == "local":
                ds = fastdata.open_dataset(local, output="tensor", decode=rrc)
                evict_page_cache(files)
                loader = make_loader(ds, args.workers, rnd)
                rates["local-cold"].append(epoch(loader))
                rates["local-warm"].append(epoch(loader))
            else:
                cache_dir = os.path.join(work, f"cache-{rnd}")
                shutil.rmtree(cache_dir, ignore_errors=True)
                ds = fastdata.open_dataset(url, output="tensor", decode=rrc, cache_dir=cache_dir,
                                           cache_limit=limit)
                loader = make_loader(ds, args.workers, rnd)
                with PeakDisk(cache_dir) as disk:
                    rates["remote-cold"].append(epoch(loader))
                    rates["remote-bounded-2nd"].append(epoch(loader))
                peaks.append(disk.peak)
                shutil.rmtree(cache_dir, ignore_errors=True)
                # warm: a cache holding the whole store, filled by an untimed epoch
                ds = fastdata.open_dataset(url, output="tensor", decode=rrc, cache_dir=cache_dir)
                loader = make_loader(ds, args.workers, rnd)
                epoch(loader)
                rates["remote-warm"].append(epoch(loader))
                shutil.rmtree(cache_dir, ignore_errors=True)
            del loader, ds
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()) + " img/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("\nmedian images/s and ratios (same run)")
    for k, v in med.items():
        print(f"  {k:12s} {v:8.0f}")
    print(f"  remote-cold / local-cold  {med['remote-cold'] / med['local-cold']:.2f}  (target >= 0.85)")
    print(f"  remote-warm / local-warm  {med['remote-warm'] / med['local-warm']:.2f}  (target >= 0.95)")
    print(f"  cache peak {max(peaks) / 2**20:.1f} MiB; "
          f"limit + one shard = {(limit + max(shard_bytes)) / 2**20:.1f} MiB")
    out = {"rates": rates, "median": med, "peak_bytes": max(peaks), "limit": limit, "shard_max": max(shard_bytes)}
    return out


def server_files(server: S3Server) -> list[str]:
    """The S3 server's data files (volumes, filer metadata)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(server.root, "data")) for f in fs]


def bench_server(work: str, pin: bool) -> S3Server:
    """The S3 test server with its data under ``work`` (a reused ``--workdir`` keeps it), pinned
    with ``pin`` (:func:`pin_cores`), this process's AWS_* variables pointing at it, and its bucket
    ``bench``; the caller kills it."""
    server = S3Server(os.path.join(work, "s3")).start()
    if pin:
        pin_cores(server)
    os.environ.update(server.env())
    try:
        server.make_bucket("bench")
    except FileExistsError:  # a reused --workdir keeps the server's data
        pass
    return server


def pin_cores(server: S3Server) -> None:
    """The S3 server on the last core, this process (and the workers it starts) on the others:
    the server then takes no CPU from the converter or the loaders, as a real object store
    on other machines would not (both sides of every comparison run on the same cores)."""
    last = max(os.sched_getaffinity(0))
    for task in os.listdir(f"/proc/{server.proc.pid}/task"):  # threads started later inherit it
        os.sched_setaffinity(int(task), {last})
    os.sched_setaffinity(0, os.sched_getaffinity(0) - {last})


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the converter's workers)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def server_cpu_s(server: S3Server) -> float:
    """CPU seconds the S3 server has used so far (it shares this machine's cores with the converter)."""
    proc = psutil.Process(server.proc.pid)
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def convert_rounds(src: str, work: str, base_url: str, server: S3Server, args) -> dict:
    """Conversion to local disk and to the S3 server, interleaved; the server's CPU time during
    each remote conversion is measured too: on this machine the server runs on the converter's
    cores, where a real object store would not."""
    rates: dict[str, list[float]] = {"local": [], "remote": []}
    server_share: list[float] = []
    client_cpu: dict[str, list[float]] = {"local": [], "remote": []}
    for rnd in range(args.rounds):
        for kind in (("local", "remote") if rnd % 2 == 0 else ("remote", "local")):
            dst = os.path.join(work, f"conv-{rnd}.lmdb") if kind == "local" else f"{base_url}-{rnd}.lmdb"
            if kind == "remote":  # a store left by an interrupted run of this benchmark
                RemoteLocation(dst).remove(list(RemoteLocation(dst).listing()))
            cpu0, own0 = server_cpu_s(server), own_cpu_s()
            t0 = time.perf_counter()
            report = fastdata.convert(src, dst, shard_size=args.shard_size, progress=False,
                                      workers=args.convert_workers)
            wall = time.perf_counter() - t0
            rates[kind].append(report.images / wall)
            client_cpu[kind].append(own_cpu_s() - own0)
            if kind == "local":
                shutil.rmtree(dst, ignore_errors=True)
            else:
                server_share.append((server_cpu_s(server) - cpu0) / wall)
                remote = RemoteLocation(dst)
                remote.remove(list(remote.listing()))
        print(f"convert round {rnd + 1}: local {rates['local'][-1]:.0f}, remote {rates['remote'][-1]:.0f} img/s; "
              f"the server used {server_share[-1]:.2f} cores meanwhile", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"  convert remote / local  {med['remote'] / med['local']:.2f}  (target >= 0.8; "
          f"{'all' if args.convert_workers is None else args.convert_workers} converter workers; the server used a "
          f"median {statistics.median(server_share):.2f} of this machine's {os.cpu_count()} cores)")
    cpu = {k: statistics.median(v) for k, v in client_cpu.items()}
    print(f"  converter CPU seconds (process + workers): local {cpu['local']:.1f}, remote {cpu['remote']:.1f} "
          f"({cpu['remote'] / cpu['local']:.2f}x)")
    return {"rates": rates, "median": med, "server_cores": server_share, "client_cpu_s": client_cpu}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=3000, help="number of ImageNet-like images")
    p.add_argument("--shard-size", default="16MiB")
    p.add_argument("--cache-shards", type=float, default=6.0,
                   help="cache_limit in shards (3 windows of 2: the one read, the next, the one finishing)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--convert", action="store_true", help="also time conversion to local vs to S3")
    p.add_argument("--convert-workers", type=int, default=None,
                   help="converter workers (default: all cores; 0: none, in this process; 1 leaves a core to the "
                        "S3 server running here)")
    p.add_argument("--skip-read", action="store_true", help="only the conversion rows (with --convert)")
    p.add_argument("--pin", action="store_true",
                   help="run the S3 server on the last core and everything else on the others (the server "
                        "then competes with neither side); on 2 cores both sides get one core")
    p.add_argument("--evict-server", action="store_true",
                   help="also evict the S3 server's own files from the page cache before each remote-cold epoch")
    p.add_argument("--workdir", help="reuse generated data here")
    p.add_argument("--quick", action="store_true", help="smoke size")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds, args.shard_size = 400, 1, "4MiB"
    run(args)


if __name__ == "__main__":
    main()
