"""Converting an image folder from S3 (a real SeaweedFS server on this machine) against converting
the same folder from local disk, into a local LMDB store, in one run (issue 40's target: remote
>= 0.8x local).

Rows, interleaved (rounds alternate which goes first), each a fresh ``fastdata.convert`` with the
same options:

* ``local``   ``fastdata.convert("<dir>/imagenet", "<dir>/out.lmdb")``: files read from the page
              cache (the folder was just written or read; a first cold read is not the point here)
* ``remote``  ``fastdata.convert("s3://bench/imagenet", "<dir>/out.lmdb")``: the folder uploaded
              to the server; listed, then each object fetched by the worker that ingests it

Both validate every image by decoding it fully (what dominates a conversion's CPU), so the ratio
is the cost of listing and the GETs. Besides img/s, the converter's CPU
time per image (this process, the forkserver and the workers, sampled every 20 ms) is reported for
each side: on a machine shared with other work the wall-clock rates swing with that work, the CPU
per image much less. The stores are checked equal
(shard checksums) once. The table gives img/s medians and the ratio remote/local; the server's
CPU during the remote rounds is reported, since here it shares the converter's machine (with
``--pin`` it runs on the last core and everything else on the others, as ``bench_remote.py
--pin`` does: both sides then have the same cores).

    python benchmarks/bench_remote_source.py --pin        # ~2 min on 2 cores
    python benchmarks/bench_remote_source.py --quick      # smoke size
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
from fastdata.format.manifest import read_manifest
from fastdata.remote.location import RemoteLocation
from fastdata.tools.synth import make_image_folder
from fastdata.writer.pipeline import prestart_pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench_remote import bench_server, server_cpu_s  # noqa: E402  (the remote store bench's helpers)


def upload_folder(src: str, url: str) -> int:
    """Every file under ``src`` to ``url``/<relative path> (all at once); returns the count."""
    loc = RemoteLocation(url)
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(src) for f in files)
    loc.filesystem().put(paths, [loc.child(os.path.relpath(p, src)).split("://", 1)[1] for p in paths])
    return len(paths)


class CpuSampler:
    """CPU seconds of this process and every process below it (the forkserver, the converter's
    workers) but the S3 server's (``exclude``: its process, which this process started, and its
    children; its CPU is reported apart), sampled every 20 ms while a conversion runs: workers that
    exit are counted at their last sample. Less sensitive than wall time to other load on a shared
    machine."""

    def __init__(self, exclude: int | None = None) -> None:
        self.exclude = exclude
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        skip: set[int] = set()
        if self.exclude is not None:
            try:
                server = psutil.Process(self.exclude)
                skip = {self.exclude, *(p.pid for p in server.children(recursive=True))}
            except psutil.Error:
                skip = {self.exclude}
        for proc in [me, *me.children(recursive=True)]:
            if proc.pid in skip:
                continue
            try:
                times = proc.cpu_times()
                self.seen[proc.pid] = times.user + times.system
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self.start = dict(self.seen)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def seconds(self) -> float:
        return sum(t - self.start.get(pid, 0.0) for pid, t in self.seen.items())


def shards(store: str) -> list:
    return [(s["name"], s["count"], s["xxh"]) for s in read_manifest(store)["shards"]]


def run(args) -> dict:
    work = args.workdir or tempfile.mkdtemp(prefix="fastdata-remote-source-")
    src = os.path.join(work, "imagenet")
    if not os.path.isdir(src):
        make_image_folder(src, num_classes=10, per_class=args.n // 10, size="imagenet", workers=2)
    server = bench_server(work, args.pin)
    try:
        url = "s3://bench/imagenet"
        count = upload_folder(src, url)
        # A CLI conversion from s3:// starts its pool's forkserver with s3fs imported (the source asks for
        # it before listing); in this one process the first conversion's forkserver serves every later
        # one, so it is started here as a remote conversion starts it, whichever kind goes first.
        prestart_pool(("s3fs",))
        print(f"{count} ImageNet-like JPEGs, {args.workers if args.workers is not None else 'all'} converter "
              f"workers, shard size {args.shard_size}, {args.rounds} rounds; pinned: {args.pin}", flush=True)
        rates: dict[str, list[float]] = {"local": [], "remote": []}
        server_share: list[float] = []
        cpu_ms: dict[str, list[float]] = {"local": [], "remote": []}
        kept: dict[str, list] = {}
        for rnd in range(args.rounds):
            for kind in (("local", "remote") if rnd % 2 == 0 else ("remote", "local")):
                dst = os.path.join(work, f"out-{kind}.lmdb")
                shutil.rmtree(dst, ignore_errors=True)
                server0 = server_cpu_s(server)
                t0 = time.perf_counter()
                with CpuSampler(exclude=server.proc.pid) as sampler:
                    report = fastdata.convert(src if kind == "local" else url, dst, shard_size=args.shard_size,
                                              workers=args.workers, progress=False)
                wall = time.perf_counter() - t0
                rates[kind].append(report.images / wall)
                cpu_ms[kind].append(1000 * sampler.seconds() / report.images)
                if kind == "remote":
                    server_share.append((server_cpu_s(server) - server0) / wall)
                kept.setdefault(kind, shards(dst))
            print(f"round {rnd + 1}: local {rates['local'][-1]:.0f}, remote {rates['remote'][-1]:.0f} img/s; converter "
                  f"CPU {cpu_ms['local'][-1]:.2f} / {cpu_ms['remote'][-1]:.2f} ms per image; the server used "
                  f"{server_share[-1]:.2f} cores meanwhile", flush=True)
        assert kept["local"] == kept["remote"], "the remote conversion made another store than the local one"
        med = {k: statistics.median(v) for k, v in rates.items()}
        cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
        print(f"\n  {'source':<8}{'img/s (median)':>16}{'converter CPU ms/image':>25}")
        for kind in ("local", "remote"):
            print(f"  {kind:<8}{med[kind]:>16.0f}{cpu[kind]:>25.2f}")
        print(f"  CPU per image local / remote  {cpu['local'] / cpu['remote']:.2f} (the throughput ratio a converter "
              "bound by its CPU reaches, whatever else runs on the machine)")
        per_round = [r / loc for r, loc in zip(rates["remote"], rates["local"], strict=True)]
        print(f"  remote / local  {med['remote'] / med['local']:.2f} (of the medians), "
              f"{statistics.median(per_round):.2f} (median of the rounds' own ratios, "
              f"{min(per_round):.2f}-{max(per_round):.2f}; target >= 0.8; the "
              f"stores are equal: {len(kept['local'])} shards, same checksums)")
        print(f"  the S3 server used a median {statistics.median(server_share):.2f} cores during the remote rounds")
        return {"rates": rates, "median": med, "cpu_ms": cpu_ms, "ratio": med["remote"] / med["local"],
                "round_ratio": statistics.median(per_round),
                "server_cores": server_share}
    finally:
        server.kill()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="number of ImageNet-like images")
    p.add_argument("--shard-size", default="32MiB")
    p.add_argument("--workers", type=int, default=None, help="converter workers (default: all cores)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pin", action="store_true",
                   help="run the S3 server on the last core and everything else on the others (both sides of "
                        "the comparison get the same cores; the server takes none of them)")
    p.add_argument("--workdir", help="reuse generated data here")
    p.add_argument("--quick", action="store_true", help="smoke size")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds, args.shard_size = 200, 1, "4MiB"
    run(args)


if __name__ == "__main__":
    main()
