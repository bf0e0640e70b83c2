"""The steps a user takes, run inside a platform proxy (``proxy_site/sitecustomize.py``):
``python proxy_steps.py WORKDIR`` converts, verifies, appends, overwrites, locks, opens, reads,
merges and loads a small image folder with each backend, writes Python samples, converts to and
reads from ``s3://`` (the S3 server the file ``FASTDATA_PROXY_S3_FILE`` describes; skipped
without one) and prints one JSON object: per backend,
per step, ``{"ok": true, ...what it found}`` or ``{"ok": false, "error": ...}``. A step
that fails does not stop the next ones (each starts from what the earlier ones left, so a
failure early may fail later steps too). The test beside this file asserts on the results.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

import numpy as np  # noqa: E402
from helpers.images import make_tree  # noqa: E402
from PIL import Image  # noqa: E402

import fastdata  # noqa: E402

#: the backends this run covers (the test may run the macOS proxy on one: see test_platform_proxies.py)
BACKENDS = tuple(os.environ.get("FASTDATA_PROXY_BACKENDS", "lmdb,hdf5").split(","))
CLASSES = {"cat": 5, "dog": 4}
APPENDED = {"cat": 2, "dog": 1}
#: the source of the interrupted conversion: one shard per image (shard size 1k), 40 shards
MANY = {"a": 20, "b": 20}
SIZE = (24, 16)
#: samples of the write step
WRITTEN = 7


def _truth(root: str) -> dict[str, tuple[int, np.ndarray]]:
    """relpath -> (label, RGB pixels as Pillow decodes the source)."""
    out = {}
    classes = sorted(os.listdir(root))
    for label, cls in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(root, cls))):
            with Image.open(os.path.join(root, cls, name)) as im:
                out[f"{cls}/{name}"] = (label, np.asarray(im.convert("RGB")))
    return out


def _hold_lock(store: str, ready, release) -> None:
    """Child: take the store's lock; on ``release`` either let go (not set) or die holding it."""
    from fastdata.writer.lock import StoreLock

    lock = StoreLock(store).acquire()
    ready.set()
    release.wait(60)
    os._exit(0)  # dies holding the lock: the OS must drop it
    lock.release()


def step_convert_cli(ctx: dict) -> dict:
    args = [sys.executable, "-m", "fastdata", "convert", ctx["src"], ctx["dst"], "--format", ctx["backend"],
            "--workers", "2", "--shard-size", "4k", "--quiet"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if run.returncode:
        raise RuntimeError(f"exit {run.returncode}: {run.stderr[-2000:]}")
    info = fastdata.info(ctx["dst"])
    return {"samples": info["num_samples"], "shards": len(info["shards"]), "classes": info["classes"]}


def step_verify(ctx: dict) -> dict:
    report = fastdata.verify(ctx["dst"], decode=True)
    return {"verified": bool(report.ok), "problems": [str(p) for p in getattr(report, "problems", [])][:3]}


def step_append(ctx: dict) -> dict:
    report = fastdata.convert(ctx["more"], ctx["dst"], format=ctx["backend"], append=True, workers=0,
                              shard_size="4k", progress=False)
    return {"appended": report.images, "samples": fastdata.info(ctx["dst"])["num_samples"],
            "warnings": report.warnings}


def step_overwrite(ctx: dict) -> dict:
    report = fastdata.convert(ctx["src"], ctx["dst"], format=ctx["backend"], overwrite=True, workers=0,
                              shard_size="4k", progress=False)
    return {"images": report.images, "samples": fastdata.info(ctx["dst"])["num_samples"],
            "verified": bool(fastdata.verify(ctx["dst"]).ok), "warnings": report.warnings}


def step_lock(ctx: dict) -> dict:
    """A live converter's lock refuses a second one; a dead one's is taken over, naming it."""
    spawn = multiprocessing.get_context("spawn")
    ready, release = spawn.Event(), spawn.Event()
    holder = spawn.Process(target=_hold_lock, args=(ctx["dst"], ready, release))
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(0.05):
            if not holder.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the lock holder did not take the lock (exit code {holder.exitcode})")
        try:
            fastdata.convert(ctx["src"], ctx["dst"], format=ctx["backend"], overwrite=True, workers=0,
                             progress=False)
            refused = ""
        except fastdata.errors.StoreLockedError as err:
            refused = str(err)
    finally:
        release.set()
        holder.join(60)
    report = fastdata.convert(ctx["src"], ctx["dst"], format=ctx["backend"], overwrite=True, workers=0,
                              shard_size="4k", progress=False)
    return {"refused_live": f"pid {holder.pid}" in refused,
            "took_over_dead": any(f"pid {holder.pid}" in w for w in report.warnings),
            "samples": fastdata.info(ctx["dst"])["num_samples"]}


def step_resume(ctx: dict) -> dict:
    """A CLI conversion killed (SIGKILL; TerminateProcess on Windows) once its first shard is
    finished, then resumed: its lock is taken over and its finished shards kept."""
    from fastdata.format.names import STAGING_DIR

    dst = ctx["dst"] + "-resumed"
    args = [sys.executable, "-m", "fastdata", "convert", ctx["many"], dst, "--format", ctx["backend"],
            "--workers", "0", "--shard-size", "1k", "--quiet"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging, deadline = os.path.join(dst, STAGING_DIR), time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            names = os.listdir(staging)
        except FileNotFoundError:
            names = []
        if any(n.endswith(".json") and n != "plan.json" for n in names):  # a finished shard's sidecar
            break
        time.sleep(0.002)
    killed = proc.poll() is None
    proc.kill()
    proc.communicate(timeout=60)
    report = fastdata.convert(ctx["many"], dst, format=ctx["backend"], resume=True, workers=0, shard_size="1k",
                              progress=False)
    return {"killed_mid_run": killed, "resumed_shards": report.resumed_shards,
            "took_over": any(f"pid {proc.pid}" in w for w in report.warnings),
            "samples": fastdata.info(dst)["num_samples"], "verified": bool(fastdata.verify(dst).ok)}


def step_volumes(ctx: dict) -> dict:
    """Chunked volumes from memmaps (read with positioned reads; HDF5 copies its chunks into place):
    the store gives back every voxel."""
    from helpers.volumes import SCHEMA, open_memmap, volume, write_memmaps

    folder = os.path.join(os.path.dirname(ctx["dst"]), f"volumes-{ctx['backend']}")
    os.makedirs(folder)
    paths = write_memmaps(folder, 3)
    dst = os.path.join(folder, f"vols.{ctx['backend']}")
    fastdata.write([{"ct": open_memmap(p, i), "label": i} for i, p in enumerate(paths)], dst, SCHEMA, workers=0,
                   progress=False)
    ds = fastdata.open_dataset(dst)
    try:
        same = sum(np.array_equal(np.asarray(ds[i]["ct"]), volume(i)) for i in range(len(ds)))
    finally:
        ds.close()
    return {"volumes": len(paths), "voxels_equal": int(same)}


def step_open_read(ctx: dict) -> dict:
    truth = ctx["truth"]
    names = sorted(truth)
    ds = fastdata.open_dataset(ctx["dst"])
    try:
        labels, same = [], 0
        for i in range(len(ds)):
            image, label = ds[i]
            pixels = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
            labels.append(int(label))
            same += int(np.array_equal(pixels, truth[names[i]][1]))
    finally:
        ds.close()
    return {"samples": len(labels), "labels_match": labels == [truth[n][0] for n in names],
            "pixels_equal": same}


def _sample(i: int) -> dict:
    """Sample ``i`` of the write step: an RGB image array, an int, a float and a ragged array."""
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 255, (6, 5, 3), dtype=np.uint8), "label": i * 3 - 4,
            "score": float(np.float32(i / 7)), "boxes": rng.random((i % 3, 4)).astype(np.float32)}


def step_write(ctx: dict) -> dict:
    """``fastdata.write`` of Python samples with 2 workers (spawned: they import this script, whose
    top level starts nothing), read back field by field."""
    from fastdata.fields import Float, Image, Int, Ragged

    schema = {"image": Image(), "label": Int("int32"), "score": Float("float32"), "boxes": Ragged("float32", (4,))}
    import concurrent.futures as cf

    dst = os.path.join(os.path.dirname(ctx["dst"]), f"written.{ctx['backend']}")
    pools, real_init = [], cf.ProcessPoolExecutor.__init__

    def init(self, max_workers=None, mp_context=None, *args, **kwargs):  # notes how the pool starts its workers
        pools.append((max_workers, mp_context.get_start_method() if mp_context else None))
        real_init(self, max_workers, mp_context, *args, **kwargs)

    cf.ProcessPoolExecutor.__init__ = init  # type: ignore[method-assign]
    try:
        report = fastdata.write([_sample(i) for i in range(WRITTEN)], dst, schema, workers=2, shard_size="1k",
                                progress=False)
    finally:
        cf.ProcessPoolExecutor.__init__ = real_init  # type: ignore[method-assign]
    ds = fastdata.open_dataset(dst, output="numpy")
    try:
        same = {name: 0 for name in schema}
        for i in range(len(ds)):
            got, want = ds[i], _sample(i)
            same["image"] += int(np.array_equal(got["image"], want["image"]))
            same["label"] += int(type(got["label"]) is int and got["label"] == want["label"])
            same["score"] += int(type(got["score"]) is float and got["score"] == want["score"])
            same["boxes"] += int(got["boxes"].dtype == np.float32 and got["boxes"].shape == want["boxes"].shape
                                 and got["boxes"].tobytes() == want["boxes"].tobytes())
        samples = len(ds)
    finally:
        ds.close()
    return {"written": report.images, "shards": report.shards, "pools": pools, "samples": samples, "fields_equal": same,
            "verified": bool(fastdata.verify(dst, decode=True).ok)}


def step_merge(ctx: dict) -> dict:
    """``fastdata.merge`` of the store and one converted from the appended tree into a third."""
    folder = os.path.dirname(ctx["dst"])
    second = os.path.join(folder, f"second.{ctx['backend']}")
    merged = os.path.join(folder, f"merged.{ctx['backend']}")
    fastdata.convert(ctx["more"], second, format=ctx["backend"], workers=0, shard_size="4k", progress=False)
    report = fastdata.merge([ctx["dst"], second], merged)
    verified = fastdata.verify(merged, decode=True)
    info = fastdata.info(merged)
    ds = fastdata.open_dataset(merged, output="numpy")
    try:
        labels = [int(ds[i][1]) for i in range(len(ds))]
    finally:
        ds.close()
    return {"samples": report.samples, "shards": report.shards, "read": len(labels), "labels": labels,
            "classes": [(c["name"], c["count"]) for c in info["classes"]], "verified": bool(verified.ok),
            "problems": [str(p) for p in getattr(verified, "problems", [])][:3]}


def step_add_fields(ctx: dict) -> dict:
    """``fastdata.add_fields`` on the merged store (a number and a string a sample), replaced by a
    second call while a dataset opened on the first version is still open, then ``gc`` with that
    dataset open (Windows cannot remove the field file it holds: it stays) and after it closed."""
    from fastdata.errors import FastdataError
    from fastdata.reader.dataset import StoreDataset

    merged = os.path.join(os.path.dirname(ctx["dst"]), f"merged.{ctx['backend']}")
    n = len(fastdata.open_dataset(merged))
    fastdata.add_fields(merged, {"score": np.arange(n, dtype=np.float32), "tag": [f"a{i}" for i in range(n)]})
    old = StoreDataset(merged)
    old_first = old[0]["tag"]
    fastdata.add_fields(merged, {"score": np.arange(n, dtype=np.float32) * 2, "tag": [f"b{i}" for i in range(n)]},
                        replace=True)
    removed_while_open = fastdata.gc(merged)
    old_after = old[0]["tag"]  # the old version, from the field file it holds open
    try:  # a field file it had not opened yet is gone: said, never misread
        old_unopened = old[n - 1]["tag"]
    except FastdataError as err:
        old_unopened = type(err).__name__
    old.close()
    removed_after = fastdata.gc(merged)
    new = StoreDataset(merged)
    try:
        scores = [float(x) for x in new.column("score")]
        tags = [new[i]["tag"] for i in range(n)]
    finally:
        new.close()
    return {"samples": n, "old_first": old_first, "old_after": old_after, "old_unopened": old_unopened,
            "scores": scores, "tags": tags,
            "removed_while_open": len(removed_while_open), "removed_after": len(removed_after),
            "field_files": sorted(f for f in os.listdir(merged) if f.startswith("fields-")),
            "verified": bool(fastdata.verify(merged).ok)}


def _s3_settings() -> dict[str, str]:
    """The S3 server's variables (AWS_*, ``FASTDATA_PROXY_S3``: a bucket URL), from the file
    ``FASTDATA_PROXY_S3_FILE`` names, waiting for the test to write it; empty without a server."""
    path = os.environ.get("FASTDATA_PROXY_S3_FILE")
    if not path:
        return {}
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after 120 s: the test did not say where its S3 server is")
        time.sleep(0.05)
    with open(path) as fh:
        return json.load(fh)


def step_remote(ctx: dict) -> dict:
    """Convert straight to ``s3://`` (shards staged locally and uploaded), then open the URL through the
    shard cache and read every sample, under a cache limit of two shards and one open shard at a
    time, so reading evicts (Windows: the cache pins a shard by holding it open, having no shared
    locks)."""
    from fastdata.remote.cache import default_cache_dir
    from fastdata.remote.location import RemoteLocation

    s3 = _s3_settings()
    if not s3:
        return {"skipped": "no S3 server"}
    os.environ.update(s3)  # read when the first remote call is made
    url = f"{s3['FASTDATA_PROXY_S3']}/{ctx['system'] or 'linux'}/store.{ctx['backend']}"
    report = fastdata.convert(ctx["src"], url, format=ctx["backend"], workers=0, shard_size="4k", progress=False)
    location = RemoteLocation(url)
    manifest, objects = json.loads(location.read_bytes("manifest.json")), location.listing()
    staging = os.path.join(default_cache_dir(), "uploads")
    out: dict = {"uploaded": report.images, "shards": report.shards,
                 "objects_match": all(objects.get(shard["name"]) == shard["bytes"] for shard in manifest["shards"]),
                 "remote_leftovers": sorted(n for n in objects if n.startswith(".fastdata")),
                 "staging_left": [f for _, _, files in os.walk(staging) for f in files]}
    truth, names = ctx["truth"], sorted(ctx["truth"])
    cache = os.path.join(os.path.dirname(ctx["dst"]), f"cache-{ctx['backend']}")
    try:
        limit = 2 * max(shard["bytes"] for shard in manifest["shards"])
        ds = fastdata.open_dataset(url, cache_dir=cache, cache_limit=limit, max_open_shards=1, output="numpy")
        try:
            labels, same = [], 0
            for i in range(len(ds)):
                image, label = ds[i]
                labels.append(int(label))
                same += int(np.array_equal(np.asarray(image), truth[names[i]][1]))
        finally:
            ds.close()
        cached = [os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(cache)
                  if os.path.basename(root) == "shards" for f in files]
        out.update(read=len(labels), labels_match=labels == [truth[n][0] for n in names], pixels_equal=same,
                   cached_shards=len(cached), cached_bytes=sum(cached), cache_limit=limit)
    except fastdata.errors.FastdataError as err:
        out["read_error"] = f"{type(err).__name__}: {err}"
    return out


def loader_epoch(stores: dict[str, str], truth: dict, worker_type: str = "process") -> dict:
    """One epoch of a 2-worker loader (spawn, or 2 threads) over every backend's store at once (one
    ConcatDataset: the workers start once, not once per backend); per backend, what arrived."""
    import torch

    from fastdata.reader import batch_ring

    names = sorted(truth)
    datasets = [fastdata.open_dataset(stores[b], output="tensor") for b in BACKENDS]
    try:
        want = [(b, i, ds[i][0]) for b, ds in zip(BACKENDS, datasets, strict=True) for i in range(len(ds))]
        workers: dict = ({"worker_type": "thread"} if worker_type == "thread"
                         else {"multiprocessing_context": multiprocessing.get_context("spawn")})
        loader = fastdata.loader(torch.utils.data.ConcatDataset(datasets), batch_size=4, num_workers=2,
                                 shuffle=False, **workers)
        got: dict = {b: {"samples": 0, "labels": [], "pixels_equal": 0} for b in BACKENDS}
        seen = 0
        for images, targets in loader:
            for image, target in zip(images, targets, strict=True):
                backend, _i, pixels = want[seen]
                got[backend]["samples"] += 1
                got[backend]["labels"].append(int(target))
                got[backend]["pixels_equal"] += int(torch.equal(image, pixels))
                seen += 1
    finally:
        for ds in datasets:
            ds.close()
    for backend in BACKENDS:
        got[backend]["labels_match"] = got[backend].pop("labels") == [truth[n][0] for n in names]
    return {**got, "ring_batches": batch_ring.received["ring"]}


STEPS = [step_convert_cli, step_verify, step_append, step_overwrite, step_lock, step_resume, step_volumes,
         step_open_read, step_write, step_merge, step_add_fields, step_remote]


def proxy_check() -> dict:
    """What this process lacks, seen from inside (the test checks the proxy is what it says)."""
    import importlib

    from fastdata.common import portable

    try:
        importlib.import_module("fcntl")
        fcntl_importable = True
    except ImportError:
        fcntl_importable = False
    try:
        multiprocessing.get_context("fork")
        fork = True
    except ValueError:
        fork = False
    try:
        portable.file_mappings(sys.executable)
        proc_readable = True
    except OSError:
        proc_readable = False
    import tempfile

    from fastdata.format.names import LOCK_NAME
    from fastdata.writer.lock import StoreLock

    with tempfile.TemporaryDirectory() as folder:
        StoreLock(folder).acquire().release()
        lock_file = os.path.join(folder, LOCK_NAME)
        lock_left = os.path.getsize(lock_file) if os.path.exists(lock_file) else None
    names = ("memfd_create", "posix_fadvise", "sched_getaffinity", "copy_file_range", "fdatasync", "pread", "preadv",
             "pwrite", "O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_DIRECTORY", "set_blocking")
    return {"os_missing": [n for n in names if not hasattr(os, n)], "fcntl_importable": fcntl_importable,
            "fork_context": fork, "start_methods": multiprocessing.get_all_start_methods(),
            "proc_readable_by_fastdata": proc_readable, "native_threads": portable.native_thread_count(),
            "cores": portable.available_cores(), "lock_file_left_after_release": lock_left}


def doctor_report() -> dict:
    """``fastdata doctor`` without a dataset: the platform report, as the CLI prints it."""
    import contextlib
    import io

    from fastdata.cli.main import main as cli
    from fastdata.tools.platform_report import facilities

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli(["doctor"])
    return {"rc": rc, "text": printed.getvalue(), "missing": [f.name for f in facilities() if not f.present]}


def _run(results: dict, name: str, step, *args) -> None:
    t0 = time.monotonic()
    try:
        results[name] = {"ok": True, **step(*args)}
    except BaseException as err:  # noqa: B036  # every failure is a result to report
        results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "where": traceback.format_exc()[-1500:]}
    results[name]["seconds"] = round(time.monotonic() - t0, 2)


def main(work: str) -> dict:
    from fastdata.common import portable

    src = make_tree(os.path.join(work, "src"), classes=CLASSES, size=SIZE)
    more = make_tree(os.path.join(work, "more"), classes=APPENDED, size=SIZE, seed=1)
    many = make_tree(os.path.join(work, "many"), classes=MANY, size=SIZE, seed=2)
    truth = _truth(src)
    out: dict = {"system": os.environ.get("FASTDATA_PROXY_SYSTEM", ""), "start": multiprocessing.get_start_method(),
                 "locking": portable.LOCKING, "pread": portable.HAS_PREAD, "proxy": proxy_check()}
    stores = {}
    for backend in BACKENDS:
        stores[backend] = os.path.join(work, f"store.{backend}")
        ctx = {"backend": backend, "src": src, "more": more, "many": many, "truth": truth, "dst": stores[backend],
               "system": out["system"]}
        results = out[backend] = {}
        for step in STEPS:
            _run(results, step.__name__[5:], step, ctx)
    _run(out, "loader", loader_epoch, stores, truth)
    _run(out, "thread_loader", loader_epoch, stores, truth, "thread")
    _run(out, "doctor", doctor_report)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
