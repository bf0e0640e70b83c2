"""One random record of a remote store: a ranged read (``cache="records"``) against the whole-shard
download of the default shard cache, side by side in one run, on a real SeaweedFS server started here.

For each backend (LMDB, HDF5) an ImageNet-like store of photo-like JPEGs (mostly 40-120 KB) is
written locally and uploaded. Then, interleaved, each round reads one random record:

* ``records``  ``ds[i]`` on a dataset opened with ``cache="records"`` (open not timed: the manifest
               and ``index.fdi``, read once per process)
* ``shard``    ``ds[i]`` on a dataset opened with an empty cache (``cache="shards"``, the default):
               the record's shard is downloaded whole, checked and read

Latencies are timed against the server directly. Requests and bytes are counted in a second pass
of the same reads through an HTTP proxy that forwards to the server and records each reply
(tests/helpers/counting_proxy.py): what the server sent, not what a client library says.

    python benchmarks/bench_remote_record.py            # ~40 s on 2 cores
    python benchmarks/bench_remote_record.py --quick    # smoke size
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import fastdata
from fastdata.format.manifest import read_manifest
from fastdata.format.store_index import parse_store_index
from fastdata.remote.location import RemoteLocation
from fastdata.synth import make_image_folder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.counting_proxy import CountingProxy  # noqa: E402  (the tests' counting proxy)
from helpers.s3server import S3Server  # noqa: E402  (the tests' SeaweedFS launcher)


def upload(local: str, url: str, endpoint: str) -> None:
    loc = RemoteLocation(url, {"endpoint_url": endpoint})
    for name in sorted(os.listdir(local)):
        if os.path.isfile(os.path.join(local, name)):
            loc.upload(os.path.join(local, name), name)


def record_sizes(local: str) -> np.ndarray:
    """Each record's stored bytes (the sum of its pieces in ``record_ranges``), in store order."""
    m = read_manifest(local)
    with open(os.path.join(local, "index.fdi"), "rb") as fh:
        indexes = parse_store_index(fh.read(), m, None, local)
    return np.concatenate([index.record_ranges[:, :, 1].sum(axis=1) for index in indexes]).astype(np.int64)


def read_one(url: str, endpoint: str, cache: str, cache_dir: str, i: int, ds=None) -> tuple[float, object]:
    """Seconds to read sample ``i`` (a dataset opened with ``cache``; ``ds`` reused when given)."""
    if ds is None:
        ds = fastdata.open_dataset(url, cache=cache, cache_dir=cache_dir, storage_options={"endpoint_url": endpoint})
    t0 = time.perf_counter()
    ds[i]
    return time.perf_counter() - t0, ds


def run_backend(suffix: str, imgs: str, work: str, server: S3Server, proxy: CountingProxy, bucket: str,
                rounds: int, shard_size: str) -> dict:
    local = os.path.join(work, f"store{suffix}")
    fastdata.convert(imgs, local, shard_size=shard_size, progress=False)
    url = f"s3://{bucket}/store{suffix}"
    upload(local, url, server.endpoint)
    sizes = record_sizes(local)
    shard_bytes = [s["bytes"] for s in read_manifest(local)["shards"]]
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(sizes), rounds).tolist()
    timed = {"records": [], "shard": []}
    records_ds = None
    for k, i in enumerate(picks):  # interleaved, alternating which goes first
        order = ("records", "shard") if k % 2 == 0 else ("shard", "records")
        for mode in order:
            cache_dir = tempfile.mkdtemp(dir=work, prefix="cache-")
            if mode == "records":
                seconds, records_ds = read_one(url, server.endpoint, "records", cache_dir, i, records_ds)
            else:
                seconds, _ = read_one(url, server.endpoint, "shards", cache_dir, i)
            timed[mode].append(seconds)
            shutil.rmtree(cache_dir, ignore_errors=True)
    # the counting pass: the same reads through the proxy
    counted = {"records": [], "shard": []}
    proxied = fastdata.open_dataset(url, cache="records", cache_dir=tempfile.mkdtemp(dir=work),
                                    storage_options={"endpoint_url": proxy.endpoint})
    for i in picks:
        proxy.clear()
        proxied[i]
        gets = proxy.gets("/shard-")
        counted["records"].append((len(gets), sum(g.body_bytes for g in gets), int(sizes[i])))
    for i in picks[:3]:  # (each moves a whole shard: three are enough to count)
        proxy.clear()
        read_one(url, proxy.endpoint, "shards", tempfile.mkdtemp(dir=work), i)
        gets = proxy.gets("/shard-")
        counted["shard"].append((len(gets), sum(g.body_bytes for g in gets), int(sizes[i])))
    return {"timed": timed, "counted": counted, "records": len(sizes), "shards": len(shard_bytes),
            "shard_mb": statistics.median(shard_bytes) / 1e6, "record_kb": float(np.median(sizes)) / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--images", type=int, default=320, help="images in the store")
    parser.add_argument("--shard-size", default="16MB")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.images, args.shard_size = 4, 60, "2MB"
    work = tempfile.mkdtemp(prefix="bench-remote-record-")
    server = S3Server(os.path.join(work, "s3")).start()
    proxy = CountingProxy(server.endpoint).start()
    try:
        for key, value in server.env().items():
            os.environ[key] = value
        bucket = "bench"
        server.make_bucket(bucket)
        imgs = os.path.join(work, "imgs")
        make_image_folder(imgs, num_classes=4, per_class=max(1, args.images // 4), size="imagenet", workers=2)
        print(f"{'backend':8} {'mode':8} {'median ms':>10} {'p90 ms':>8} {'GETs/record':>12} "
              f"{'bytes/record size':>18}   store")
        for suffix in (".lmdb", ".h5"):
            out = run_backend(suffix, imgs, work, server, proxy, bucket, args.rounds, args.shard_size)
            for mode in ("records", "shard"):
                ms = [1e3 * s for s in out["timed"][mode]]
                gets = [c[0] for c in out["counted"][mode]]
                ratio = [c[1] / c[2] for c in out["counted"][mode]]
                get_text = f"{statistics.mean(gets):.2f} ({min(gets)}-{max(gets)})"
                print(f"{suffix[1:]:8} {mode:8} {statistics.median(ms):10.1f} {np.percentile(ms, 90):8.1f} "
                      f"{get_text:>12} {statistics.median(ratio):9.2f} (max {max(ratio):5.2f})   "
                      f"{out['records']} records, {out['shards']} shards of {out['shard_mb']:.1f} MB, "
                      f"records {out['record_kb']:.0f} kB (median)")
            single = sum(c[0] == 1 for c in out["counted"]["records"])
            print(f"{'':8} records read with one GET: {single}/{len(out['counted']['records'])}")
    finally:
        proxy.stop()
        server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
