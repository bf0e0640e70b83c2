"""Thread workers against process workers and FFCV, side by side in one run: RandomResizedCrop(224) -> uint8.

Data: ``--images`` ImageNet-like JPEGs (``fastdata.synth.make_image_folder(..., size="imagenet")``,
~400x350, some over 512 px), kept in ``--workdir`` and reused; or ``--src DIR``, a folder of your own
photos (class sub-folders or flat). Stores of the same images, written once into ``--workdir``:

* ``jpeg.lmdb``   ``fastdata.convert(src, dst)``: the original JPEG bytes;
* ``raw.lmdb``    ``fastdata.convert(src, dst, storage="raw", max_side=512)``: decoded RGB pixels, the
  longer side capped at 512 (as in ``bench_ffcv_raw.py``);
* ``jpeg.beton``  ``ffcv.writer.DatasetWriter`` with ``RGBImageField(write_mode="jpg")`` (FFCV's JPEG
  mode: every image re-encoded by OpenCV at ``jpeg_quality=90``, native size) and an ``IntField``;
* ``raw.beton``   ``RGBImageField(write_mode="raw", max_resolution=512)`` (FFCV's raw mode).

Contenders, batch ``--batch-size`` (64), ``--workers`` W (2), each giving ``[64, 3, 224, 224]`` uint8:

* ``fastdata-thread``       ``fastdata.loader(fastdata.open_dataset(jpeg.lmdb,
  decode=transforms.RandomResizedCrop(224), output="tensor"), batch_size=64, num_workers=W,
  worker_type="thread")``: W threads of the training process decode and collate whole batches;
* ``fastdata-process``      the same with DataLoader worker processes (no ``worker_type``; the
  loader's defaults, so workers are not persistent: each epoch starts its workers; fork on Linux);
* ``fastdata-spawn``        the same with ``multiprocessing_context="spawn"``: workers started as they
  are on macOS and Windows (each a fresh interpreter that imports torch);
* ``ffcv-jpeg``             ``ffcv.loader.Loader(jpeg.beton, batch_size=64, num_workers=W,
  order=OrderOption.RANDOM, os_cache=True, pipelines={"image": [RandomResizedCropRGBImageDecoder((224,
  224)), ToTensor(), ToTorchImage()], "label": [IntDecoder(), ToTensor()]})`` (its compiled threads;
  ``OPENCV_FOR_THREADS_NUM=1`` unless set: one OpenCV thread inside each of them, its faster setting);
* ``fastdata-thread-raw``, ``fastdata-process-raw``, ``ffcv-raw``: the same three over the raw stores.

Measured, per contender: images/s of an epoch; the time to the first batch of an epoch; start-up (from
building the dataset and loader to the first batch of its very first epoch: worker start-up, FFCV's
Numba compilation; the Python imports before it are timed apart, ``imports s``); the peak PSS of the
process tree (the process iterating the loader plus all its descendants, ``psutil``
``memory_full_info().pss`` summed, sampled every 50 ms by a thread of the parent,
``fastdata.bench.memory.MemorySampler(pid=child)``: a sampling thread in the measured process
would take the GIL from thread workers, which cost them about 10% of their images/s) during the
measured epoch, and its held part: anonymous memory (heap, batches, copy-on-write copies) plus shared
memory (``/dev/shm`` and memfd pages: the batches that process workers hand to the main process
travel there, and would be missed by a count of anonymous memory alone), what the kernel cannot
drop; the rest is mapped files, mostly the store's pages that the epoch read, page cache the kernel
can drop, which every contender maps alike.

Every measurement runs in a fresh child process (``bench_threads.py --_child NAME``) that imports only
what its contender needs, builds the loader, runs one warm-up epoch (its start-up is measured there),
then one measured epoch with the memory sampler on, and prints its figures as JSON. The parent runs
one such child per contender per round, ``--epochs`` rounds, the contenders in turn (the first of
each round rotates): rounds stay interleaved, so a slow spell of a shared machine hits every
contender alike, and only one contender's processes exist while it is measured (a second live tree
would share library and store pages, and PSS would split them between the two). The page cache is
warm (every store is read by each child's warm-up epoch). Figures are medians over the rounds
(start-up too: every round starts afresh); ratios (thread / process, thread / ffcv-jpeg,
thread-raw / ffcv-raw, and the same for peak PSS) are medians of the rounds' own ratios.

``--python-transform N`` adds a ``transform=`` written in Python to the fastdata contenders: N turns of
a bytecode loop per sample (``PythonWork``), which holds the GIL. With the GIL, loader threads take
turns running it; on a free-threaded build (``PYTHON_GIL=0 python3.13t``) they run it at once. Each
child records whether the GIL was on (``gil`` in the JSON); the table's first line says it.

Needs FFCV beside fastdata, in the bench venv only (Debian's ``libopencv-dev``, ``libturbojpeg0-dev``
and ``pkg-config``, then ``pip install ffcv``); without FFCV leave the ``ffcv-*`` contenders out::

    python benchmarks/bench_threads.py --workdir /tmp/bench-threads            # 2000 images, 2 workers, 5 rounds
    python benchmarks/bench_threads.py --workdir /tmp/bench-threads --workers 4 --md threads.md
    python benchmarks/bench_threads.py --src ~/photos --workdir /tmp/mine --contenders fastdata-thread,fastdata-process
    PYTHON_GIL=0 python3.13t benchmarks/bench_threads.py --workdir /tmp/bench-threads \
        --contenders fastdata-thread,fastdata-process --python-transform 20000   # no FFCV, no OpenCV there:
                                                                              # the stores made by a run above
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CONTENDERS = ("fastdata-thread", "fastdata-process", "fastdata-spawn", "ffcv-jpeg",
              "fastdata-thread-raw", "fastdata-process-raw", "ffcv-raw")
STORE = {"fastdata-thread": "jpeg.lmdb", "fastdata-process": "jpeg.lmdb", "fastdata-spawn": "jpeg.lmdb",
         "ffcv-jpeg": "jpeg.beton",
         "fastdata-thread-raw": "raw.lmdb", "fastdata-process-raw": "raw.lmdb", "ffcv-raw": "raw.beton"}
# (label, numerator, denominator, metric): medians of the per-round ratios
RATIOS = (("thread / process", "fastdata-thread", "fastdata-process", "img_s"),
          ("thread / ffcv-jpeg", "fastdata-thread", "ffcv-jpeg", "img_s"),
          ("thread-raw / process-raw", "fastdata-thread-raw", "fastdata-process-raw", "img_s"),
          ("thread-raw / ffcv-raw", "fastdata-thread-raw", "ffcv-raw", "img_s"),
          ("thread / spawn", "fastdata-thread", "fastdata-spawn", "img_s"),
          ("PSS thread / process", "fastdata-thread", "fastdata-process", "peak_pss"),
          ("PSS thread / spawn", "fastdata-thread", "fastdata-spawn", "peak_pss"),
          ("PSS thread / ffcv-jpeg", "fastdata-thread", "ffcv-jpeg", "peak_pss"),
          ("PSS thread-raw / process-raw", "fastdata-thread-raw", "fastdata-process-raw", "peak_pss"),
          ("PSS thread-raw / ffcv-raw", "fastdata-thread-raw", "ffcv-raw", "peak_pss"),
          ("held PSS thread / process", "fastdata-thread", "fastdata-process", "peak_pss_held"),
          ("held PSS thread / spawn", "fastdata-thread", "fastdata-spawn", "peak_pss_held"),
          ("held PSS thread / ffcv-jpeg", "fastdata-thread", "ffcv-jpeg", "peak_pss_held"),
          ("held PSS thread-raw / process-raw", "fastdata-thread-raw", "fastdata-process-raw", "peak_pss_held"),
          ("held PSS thread-raw / ffcv-raw", "fastdata-thread-raw", "ffcv-raw", "peak_pss_held"))
MAX_SIDE = 512
MB = 1 << 20


# --------------------------------------------------------------------------- the measured child
def build_loader(name: str, store: str, args):
    if name.startswith("fastdata-"):
        import fastdata
        from fastdata import transforms

        work = PythonWork(args.python_transform) if args.python_transform else None
        ds = fastdata.open_dataset(store, decode=transforms.RandomResizedCrop(224), output="tensor", transform=work)
        kw: dict = {"worker_type": "thread"} if name.startswith("fastdata-thread") else {}
        if name == "fastdata-spawn":  # worker processes started as on macOS and Windows (and forkserver-like)
            kw["multiprocessing_context"] = "spawn"
        return fastdata.loader(ds, batch_size=args.batch_size, num_workers=args.workers, seed=args._seed, **kw)
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor, ToTorchImage

    return Loader(store, batch_size=args.batch_size, num_workers=args.workers, order=OrderOption.RANDOM,
                  os_cache=True, drop_last=False, seed=args._seed,
                  pipelines={"image": [RandomResizedCropRGBImageDecoder((224, 224)), ToTensor(), ToTorchImage()],
                             "label": [IntDecoder(), ToTensor()]})


class PythonWork:
    """A ``transform=`` written in Python: ``iterations`` turns of a bytecode loop per sample, the
    image returned unchanged. It holds the GIL throughout (no C call releases it), as a per-sample
    augmentation policy or label logic in Python does: with the GIL, loader threads take turns
    running it; on a free-threaded build they run it at once."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def __call__(self, image):
        acc = 0
        for i in range(self.iterations):
            acc += i * i
        return image


def import_for(name: str) -> None:
    """Import what ``build_loader`` will use, so that start-up does not count Python imports."""
    if name.startswith("fastdata-"):
        import fastdata  # noqa: F401
        from fastdata import transforms  # noqa: F401
    else:
        import ffcv.fields.decoders  # noqa: F401
        import ffcv.loader  # noqa: F401
        import ffcv.transforms  # noqa: F401


def timed_epoch(loader, t0: float) -> dict:
    """One pass; ``first_s`` is the time from ``t0`` to the first batch."""
    n, first, shape = 0, None, None
    for images, labels in loader:
        if first is None:
            first = time.perf_counter() - t0
            shape = [list(images.shape), str(images.dtype)]
        n += len(labels)
    return {"n": n, "s": time.perf_counter() - t0, "first_s": first, "batch": shape}


def child(args) -> dict:
    t = time.perf_counter()
    import_for(args._child)
    imported = time.perf_counter() - t
    t0 = time.perf_counter()
    loader = build_loader(args._child, args._store, args)
    warm = timed_epoch(loader, t0)  # the very first epoch: start-up = building -> its first batch
    # The parent samples this process tree's memory during the measured epoch: a sampling thread
    # in this process would take the GIL from thread workers (it cost them ~10% of images/s)
    print(MEASURE_START, flush=True)
    sys.stdin.readline()  # the parent's sampler runs
    t1 = time.perf_counter()
    measured = timed_epoch(loader, t1)
    print(MEASURE_END, flush=True)
    sys.stdin.readline()  # the parent's sampler stopped
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()  # (after the imports: an extension may enable it)
    return {"contender": args._child, "gil": gil, "import_s": imported, "startup_s": warm["first_s"],
            "warmup_img_s": warm["n"] / warm["s"],
            "img_s": measured["n"] / measured["s"], "first_batch_s": measured["first_s"],
            "epoch_s": measured["s"], "n": measured["n"], "batch": measured["batch"]}


#: the lines a child prints around its measured epoch (the parent samples its memory in between)
MEASURE_START, MEASURE_END = "MEASURE start", "MEASURE end"


def run_child(name: str, store: str, args, seed: int) -> dict:
    """Run one contender in a fresh child; its memory is sampled from here, by a thread of this
    process (``MemorySampler(pid=child)``: the child and all its descendants), while it runs its
    measured epoch."""
    from fastdata.bench.memory import MemorySampler

    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", name, "--_store", store,
           "--_seed", str(seed), "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--python-transform", str(args.python_transform)]
    errors = tempfile.TemporaryFile(mode="w+")  # (a pipe read only at the end could fill and stall the child)
    env = dict(os.environ)
    if name.startswith("ffcv-"):
        # FFCV at its best: each of its threads resizes with OpenCV, which would split every resize
        # over all the cores again (two threads each running two: 10-20% fewer images/s measured
        # here); one OpenCV thread each, as fastdata's threads run torch's operators on one
        env.setdefault("OPENCV_FOR_THREADS_NUM", "1")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    mem = None
    lines = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line == MEASURE_START:
            mem = MemorySampler(interval=0.05, pid=proc.pid).__enter__()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        elif line == MEASURE_END and mem is not None:
            mem.__exit__(None, None, None)
            proc.stdin.write("ok\n")
            proc.stdin.flush()
        else:
            lines.append(line)
    proc.wait()
    errors.seek(0)
    err = errors.read()
    errors.close()
    results = [ln for ln in lines if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not results or mem is None:
        sys.stderr.write("\n".join(lines)[-4000:] + err[-4000:])
        raise SystemExit(f"{name}: the child failed (exit {proc.returncode}): {' '.join(cmd)}")
    res = json.loads(results[-1][len("RESULT "):])
    res.update({"peak_pss": mem.peak_pss, "peak_uss": mem.peak_uss, "peak_rss": mem.peak_rss,
                "peak_pss_anon": mem.peak_pss_anon, "peak_pss_file": mem.peak_pss_file,
                "peak_pss_shmem": mem.peak_pss_shmem, "peak_pss_held": mem.peak_pss_held,
                "processes": 1 + mem.max_workers, "pss_samples": len(mem.samples)})
    return res


# --------------------------------------------------------------------------- data and stores
def prepare(work: str, args, names: list[str]) -> dict[str, str]:
    import fastdata

    src = os.path.abspath(os.path.expanduser(args.src)) if args.src else os.path.join(work, "jpeg")
    marker = os.path.join(work, "source.txt")
    if os.path.exists(marker) and Path(marker).read_text().strip() != src:
        raise SystemExit(f"{work} holds stores of {Path(marker).read_text().strip()}, not of {src}: "
                         f"give another --workdir")
    if not args.src and not os.path.isdir(src):
        from fastdata.synth import make_image_folder  # (OpenCV: only to generate the images)

        make_image_folder(src, num_classes=10, per_class=max(1, args.images // 10), size="imagenet", workers=2)
    Path(marker).write_text(src + "\n")
    paths = {"jpeg": src, **{f: os.path.join(work, f) for f in set(STORE.values())}}
    wanted = {STORE[n] for n in names}
    for f, kw in (("jpeg.lmdb", {}), ("raw.lmdb", {"storage": "raw", "max_side": MAX_SIDE})):
        if f in wanted and not os.path.isdir(paths[f]):
            t0 = time.perf_counter()
            fastdata.convert(src, paths[f], workers=2, progress=False, **kw)
            print(f"{f}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    betons = [(f, field) for f, field in (("jpeg.beton", dict(write_mode="jpg", jpeg_quality=90)),
                                          ("raw.beton", dict(write_mode="raw", max_resolution=MAX_SIDE)))
              if f in wanted and not os.path.isfile(paths[f])]
    if betons:
        from bench_ffcv_raw import FolderImages
        from ffcv.fields import IntField, RGBImageField
        from ffcv.writer import DatasetWriter

        for f, field in betons:
            t0 = time.perf_counter()
            DatasetWriter(paths[f], {"image": RGBImageField(**field), "label": IntField()},
                          num_workers=2).from_indexed_dataset(FolderImages(src))
            print(f"{f}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    return paths


# --------------------------------------------------------------------------- the report
def summarise(names: list[str], rounds: list[dict], args, sizes: dict, jpeg: int, n_images: int) -> dict:
    med = statistics.median
    rows = {}
    for n in names:
        rs = [r[n] for r in rounds]
        rows[n] = {**{k: med([r[k] for r in rs]) for k in ("img_s", "first_batch_s", "startup_s", "import_s",
                                                            "peak_pss", "peak_pss_anon", "peak_pss_file",
                                                            "peak_pss_shmem", "peak_pss_held")},
                   "peak_pss_max": max(r["peak_pss"] for r in rs), "processes": max(r["processes"] for r in rs),
                   "store": STORE[n], "disk_bytes": sizes[n], "batch": rs[-1]["batch"], "rounds": rs}
    ratios = {}
    for label, a, b, metric in RATIOS:
        if a in names and b in names:
            ratios[label] = med([r[a][metric] / r[b][metric] for r in rounds])
    return {"images": n_images, "jpeg_bytes": jpeg, "rows": rows, "ratios": ratios}


def markdown(res: dict, args, command: str) -> str:
    work = f" + a Python transform of {args.python_transform} loop turns" if args.python_transform else ""
    gil = {r["gil"] for row in res["rows"].values() for r in row["rounds"]}
    build = "free-threaded build, " if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
    state = "GIL disabled" if gil == {False} else "GIL enabled" if gil == {True} else "GIL mixed"
    lines = [f"Python {res['machine']['python']} ({build}{state})"
             + f"; {res['images']} images, RandomResizedCrop(224) -> uint8{work}, batch {args.batch_size}, "
             f"{args.workers} workers; medians of {args.epochs} interleaved rounds (each contender in a fresh "
             f"process per round: warm-up epoch, then the measured one); JPEG bytes "
             f"{res['jpeg_bytes'] / 1e6:.0f} MB",
             "",
             "| contender | store | images/s | first batch ms | start-up s | imports s | peak PSS MiB "
             "| of which held MiB | anon MiB | shmem MiB | processes | disk MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in res["rows"].items():
        lines.append(f"| {n} | {r['store']} | {r['img_s']:.0f} | {r['first_batch_s'] * 1e3:.0f} | "
                     f"{r['startup_s']:.2f} | {r['import_s']:.2f} | {r['peak_pss'] / MB:.0f} | "
                     f"{r['peak_pss_held'] / MB:.0f} | {r['peak_pss_anon'] / MB:.0f} | "
                     f"{r['peak_pss_shmem'] / MB:.0f} | {r['processes']} | "
                     f"{r['disk_bytes'] / 1e6:.0f} |")
    if res["ratios"]:
        lines += ["", "| ratio (median of per-round ratios) | |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in res["ratios"].items()]
    lines += ["", f"`{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="generated images and stores (kept and reused); default a temporary folder")
    p.add_argument("--src", help="a folder of your own photos instead of generated ones")
    p.add_argument("--images", type=int, default=2000, help="generated images (ignored with --src)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {', '.join(CONTENDERS)}")
    p.add_argument("--epochs", type=int, default=5, help="measured rounds (one epoch of each contender per round)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--python-transform", type=int, default=0, metavar="ITERATIONS",
                   help="add a transform= in Python that holds the GIL for ITERATIONS loop turns per sample "
                        "(PythonWork); 0: none")
    p.add_argument("--json", default=str(HERE / "results" / "threads.json"))
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_store", help=argparse.SUPPRESS)
    p.add_argument("--_seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        p.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    from bench_ffcv_raw import disk_bytes

    from fastdata.bench.report import fingerprint

    temp = None if args.workdir else tempfile.mkdtemp(prefix="fastdata-threads-")
    work = args.workdir or temp
    os.makedirs(work, exist_ok=True)
    try:
        paths = prepare(work, args, names)
        sizes = {n: disk_bytes(paths[STORE[n]]) for n in names}
        jpeg = disk_bytes(paths["jpeg"])
        rounds: list[dict] = []
        for r in range(args.epochs):
            order = names[r % len(names):] + names[:r % len(names)]
            rounds.append({n: run_child(n, paths[STORE[n]], args, seed=r) for n in order})
            print(f"round {r + 1}: " + ", ".join(
                f"{n} {rounds[-1][n]['img_s']:.0f} img/s {rounds[-1][n]['peak_pss'] / MB:.0f} MiB" for n in names),
                flush=True)
        res = summarise(names, rounds, args, sizes, jpeg, rounds[0][names[0]]["n"])
        try:
            from importlib import metadata

            ffcv_version = metadata.version("ffcv")
        except Exception:  # noqa: BLE001 - no FFCV in this environment
            ffcv_version = None
        res["machine"] = {**fingerprint(), "ffcv": ffcv_version}
        res["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        command = "python benchmarks/bench_threads.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
        md = markdown(res, args, command)
        print("\n" + md)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1))
        if args.md:
            Path(args.md).write_text(md)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
