"""LMDB layout 3 (records cut into a page-exact head and inline tail parts) against the layout
before it (each record one LMDB value), on the same records, side by side in one run.

The store of layout 3 is ``fastdata.convert`` of ``--images`` ImageNet-like photos
(``fastdata.synth``, ~63 KB); the control is a copy whose shards are rewritten with every record
whole under its key (header version 1, no ``tails`` database, its own ``record_spans``, written in
commits of 32 records as the writer commits), which fastdata still reads. Both are read by the
same fastdata through identical DataLoaders (RandomResizedCrop(224) -> uint8, batch 64, 2 persistent
workers, shuffled), epochs interleaved after one warm-up each, page cache warm; reported: each
store's size against the image bytes, images/s per epoch and the ratio of the medians.

    python benchmarks/bench_tails.py --workdir /tmp/tails                 # 2000 photos, 7 epochs
    python benchmarks/bench_tails.py --workdir /tmp/tails --images 200 --epochs 1   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdata  # noqa: E402
from fastdata import transforms  # noqa: E402
from fastdata.common.fileio import file_checksum  # noqa: E402
from fastdata.format.backends.lmdb import spec  # noqa: E402
from fastdata.format.backends.lmdb.writer import value_spans  # noqa: E402
from fastdata.format.manifest import read_manifest, write_manifest  # noqa: E402

COMMIT = 32  # records a write transaction, as the converter's default chunk


def whole_records_copy(shard: str, dst: str) -> None:
    """Write ``dst``: the shard ``shard`` (layout 3, a classification store) with every record
    joined from its head and tail parts and stored whole (layout version 1)."""
    src = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
    out = lmdb.open(dst, subdir=False, map_size=4 * os.path.getsize(shard) + (64 << 20), max_dbs=4, lock=False,
                    sync=False, metasync=False)
    try:
        records_in, index_in = src.open_db(spec.RECORDS_DB, create=False), src.open_db(spec.INDEX_DB, create=False)
        tails = src.open_db(spec.TAILS_DB, create=False)
        records_out, index_out = out.open_db(spec.RECORDS_DB), out.open_db(spec.INDEX_DB)
        psize = int(src.stat()["psize"])
        with src.begin() as rtxn:
            count = msgpack.unpackb(rtxn.get(spec.HEADER_KEY, db=index_in))["count"]
            for first in range(0, count, COMMIT):
                with out.begin(write=True) as wtxn:
                    for j in range(first, min(first + COMMIT, count)):
                        value = rtxn.get(spec.encode_key(j), db=records_in)
                        if spec.fills_pages(len(value), psize):
                            part = 0
                            while (data := rtxn.get(spec.tail_key(j, part), db=tails)) is not None:
                                value, part = value + data, part + 1
                        wtxn.put(spec.encode_key(j), value, db=records_out, append=True)
            index = {bytes(k): bytes(v) for k, v in rtxn.cursor(db=index_in)
                     if bytes(k) not in (spec.TAIL_SPANS_KEY, spec.RECORD_SPANS_KEY)}
        index[spec.HEADER_KEY] = msgpack.packb({"layout": spec.LAYOUT, "version": spec.VERSION, "count": count})
        spans = value_spans(out, records_out, dst, count)
        if spans is not None:
            index[spec.RECORD_SPANS_KEY] = spans.tobytes()
        with out.begin(write=True) as wtxn:
            for key, value in index.items():
                wtxn.put(key, value, db=index_out)
        out.sync(True)
    finally:
        src.close()
        out.close()


def prepare(work: str, images: int) -> tuple[str, str, int]:
    """The photos, the layout-3 store and its whole-record copy (reused when present)."""
    src = os.path.join(work, "jpeg")
    if not os.path.isdir(src):
        from fastdata.synth import make_image_folder

        make_image_folder(src, num_classes=10, per_class=images // 10, size="imagenet", workers=2)
    tails, whole = os.path.join(work, "tails.lmdb"), os.path.join(work, "whole.lmdb")
    if not os.path.isdir(tails):
        fastdata.convert(src, tails, workers=2, progress=False)
    if not os.path.isdir(whole):
        shutil.copytree(tails, whole + ".tmp")
        body = read_manifest(whole + ".tmp")
        for shard in body["shards"]:
            path = os.path.join(whole + ".tmp", shard["name"])
            whole_records_copy(path, path + ".whole")
            os.replace(path + ".whole", path)
            shard["bytes"], shard["xxh"] = os.path.getsize(path), file_checksum(path)
        write_manifest(whole + ".tmp", body)
        os.rename(whole + ".tmp", whole)
    image_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    return tails, whole, image_bytes


def store_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def loader(path: str):
    ds = fastdata.open_dataset(path, output="tensor", decode=transforms.RandomResizedCrop(224))
    return fastdata.loader(ds, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True,
                           prefetch_factor=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="photos and stores (kept and reused)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=7, help="measured epochs of each store (after one warm-up)")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tails, whole, image_bytes = prepare(args.workdir, args.images)
    with fastdata.open_dataset(tails) as a, fastdata.open_dataset(whole) as b:  # the same records
        if len(a) != len(b) or any(a._raw_bytes(i) != b._raw_bytes(i) for i in range(len(a))):
            raise SystemExit("the whole-record copy does not hold the store's records")
    stores = {"layout 3 (tails)": tails, "whole records (before)": whole}
    loaders = {name: loader(path) for name, path in stores.items()}
    rates: dict[str, list[float]] = {name: [] for name in stores}
    for epoch in range(args.epochs + 1):
        for name, dl in loaders.items():
            t0 = time.perf_counter()
            n = sum(len(batch[0]) for batch in dl)
            rate = n / (time.perf_counter() - t0)
            if epoch:
                rates[name].append(rate)
            print(f"  epoch {epoch}{' (warm-up)' if not epoch else ''} {name:24s} {rate:6.0f} img/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\n{args.images} ImageNet-like photos ({image_bytes / 1e6:.1f} MB of image bytes), RRC224 -> uint8, "
          f"batch 64, 2 workers, medians of {args.epochs} interleaved epochs\n")
    print("| store | MB | / image bytes | img/s (epochs) |\n|---|---:|---:|---:|")
    for name, path in stores.items():
        size = store_bytes(path)
        epochs = ", ".join(f"{r:.0f}" for r in rates[name])
        print(f"| {name} | {size / 1e6:.1f} | {size / image_bytes:.3f} | {medians[name]:.0f} ({epochs}) |")
    names = list(stores)
    print(f"\nlayout 3 / before: speed {medians[names[0]] / medians[names[1]]:.3f}x, "
          f"size {store_bytes(tails) / store_bytes(whole):.3f}x")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = "?"
    print(f"fastdata {rev}, Python {platform.python_version()}, {os.cpu_count()} cores. Command: "
          f"`python benchmarks/bench_tails.py {' '.join(sys.argv[1:])}`")


if __name__ == "__main__":
    main()
