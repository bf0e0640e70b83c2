"""Rewriting a store while another process reads it, where an open file cannot be deleted or replaced
(Windows; ``proxy_site/sitecustomize.py`` makes the proxy refuse it as Windows does).

``python open_files_steps.py WORKDIR``, run in a proxy (or on Linux, as the control), does with
each backend: convert tree A; start a reader process that opens the store and reads every sample
(its shards stay open: LMDB maps them, h5py holds them); convert tree B over the store with
overwrite=True while the reader waits; open the new store; let the reader read again (it is told
the store was rewritten) and close it; append tree C.
It prints one JSON object: what each step found (shard names on disk and in the manifest, the
report's warnings, digests of what each reader read).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from helpers.images import make_tree  # noqa: E402

import fastdata  # noqa: E402
from fastdata.errors import FastdataError  # noqa: E402

BACKENDS = ("lmdb", "hdf5")
SIZE = (20, 14)


def _digests(ds) -> list[tuple[int, str]]:
    """(label, sha256 of the pixels) of every sample of ``ds``, in order."""
    return [(int(label), hashlib.sha256(image.tobytes()).hexdigest()) for image, label in
            (ds[i] for i in range(len(ds)))]


def digest(store: str) -> list[tuple[int, str]]:
    """:func:`_digests` of the store, opened for this and closed."""
    ds = fastdata.open_dataset(store, output="numpy")
    out = _digests(ds)
    ds.close()
    return out


def _reader(store: str, ready, go, results) -> None:
    """Child: open the store, read it all (its shards stay open), wait, then read again: the store
    was rewritten meanwhile, which the read must say; then close it (its shards with it)."""
    ds = fastdata.open_dataset(store, output="numpy")
    first = _digests(ds)
    ready.set()
    go.wait(120)
    try:
        ds[0]
        again = "read on"
    except FastdataError as err:
        again = type(err).__name__
    ds.close()
    results.put({"first": first, "again": again})


def _shards_on_disk(store: str) -> list[str]:
    return sorted(n for n in os.listdir(store) if n.startswith("shard-"))


def _listed(store: str) -> list[str]:
    with open(os.path.join(store, "manifest.json")) as fh:
        return [s["name"] for s in json.load(fh)["shards"]]


def run(work: str, backend: str) -> dict:
    trees = {name: make_tree(os.path.join(work, f"{backend}-{name}"), classes=classes, size=SIZE, seed=seed)
             for name, classes, seed in (("a", {"x": 3, "y": 2}, 0), ("b", {"x": 2, "y": 2}, 1),
                                         ("c", {"x": 1, "y": 1}, 2))}
    store = os.path.join(work, f"store.{backend}")
    fastdata.convert(trees["a"], store, format=backend, workers=0, shard_size="2kB")
    out: dict = {"a": digest(store), "a_shards": _listed(store)}
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(store, ready, go, results))
    reader.start()
    try:
        assert ready.wait(120), "the reader did not start"
        report = fastdata.convert(trees["b"], store, format=backend, workers=0, shard_size="2kB", overwrite=True)
        out.update(overwrite_warnings=report.warnings, b_listed=_listed(store), b_on_disk=_shards_on_disk(store),
                   b=digest(store))
        go.set()
        read = results.get(timeout=60)
        out.update(reader_first=read["first"], reader_again=read["again"])
    finally:
        go.set()
        reader.join(60)
    report = fastdata.convert(trees["c"], store, format=backend, workers=0, shard_size="2kB", append=True)
    out.update(append_warnings=report.warnings, c_listed=_listed(store), c_on_disk=_shards_on_disk(store),
               bc=digest(store), c_alone=digest(fastdata.convert(trees["c"], os.path.join(work, f"c.{backend}"),
                                                                  format=backend, workers=0).dst))
    return out


if __name__ == "__main__":  # WORKDIR [BACKEND...] (default: both)
    print(json.dumps({backend: run(sys.argv[1], backend) for backend in sys.argv[2:] or BACKENDS}))
