"""Converting data from where it already lives: Parquet in the Hugging Face layout, WebDataset tar
shards and a ``datasets.Dataset``, next to the folder conversion and the read + full-decode ceiling,
side by side in one run; and ``fastdata.write(dataset)`` against ``litdata.optimize`` of the same
dataset.

Data: ``--n`` photo-like ImageNet-like JPEGs (``fastdata.synth.make_image_folder``, ~63 KB),
the same bytes written as

* a folder (the reference conversion: ``fastdata convert imgs/ out.lmdb``);
* Parquet in the Hub's layout: ``datasets.Dataset.from_dict({"image": paths, "label": ...},
  features=Features(image=Image(), label=ClassLabel(names)))``, cast to keep the files' bytes,
  ``to_parquet`` in row groups of ``--row-group`` rows (what ``load_dataset`` downloads);
* WebDataset tar shards of 64 MB (``webdataset.ShardWriter``, ``jpg`` + ``cls``);
* the ``datasets.Dataset`` itself, for ``fastdata.write(ds)`` and ``litdata.optimize``.

Rows (each conversion in a fresh child process, 2 workers, the page cache warm, ``--rounds``
interleaved rounds, medians; ratios are medians of the rounds' own ratios; a fastdata conversion's
time is its own elapsed time, as ``bench_convert.py`` reports it: scan or plan, pool start, read,
validate, write, fsync, publish; ``litdata.optimize``'s is the call's wall time):

* ``ceiling``: read every JPEG and fully decode it with Pillow over 2 processes (the work the
  converter's validation does anyway; ``benchmarks/bench_convert.py``'s ceiling);
* ``folder`` / ``parquet`` / ``webdataset``: ``fastdata.convert`` of each form into LMDB (and the
  Parquet file into HDF5), images/s and the ratio to the ceiling; the store's size against the
  source's image bytes (the index, checksums and paths included; LMDB layout 3 keeps each
  record's last partial page as inline tail parts, where it used to leave ~2 KB of it empty);
* ``fastdata.write(ds)`` / ``litdata.optimize``: wall time and size on disk of each, as ratios
  (litdata only where it is installed: the bench venv);
* peak RSS of the Parquet conversion's process tree, for the ``--n`` file and a file
  ``--scale`` times larger (the same rows repeated), to show it does not grow with the file.

Usage::

    python benchmarks/bench_sources.py --workdir /tmp/sources            # 5000 images, ~6 min
    python benchmarks/bench_sources.py --workdir /tmp/sources --n 500 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import PssSampler, ceiling, warm_page_cache  # noqa: E402

from fastdata.synth import make_image_folder  # noqa: E402

REPO = str(Path(__file__).resolve().parents[1])
NAMES = [f"class{i}" for i in range(10)]

_CONVERT = """
import json, sys, time
import fastdata
src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3]
if __name__ == "__main__":
    t0 = time.perf_counter()
    if kind == "write-dataset":
        import datasets
        ds = datasets.load_from_disk(src)
        t0 = time.perf_counter()
        report = fastdata.write(ds, dst, workers=2, progress=False)
    elif kind == "litdata":
        import datasets, litdata
        from bench_sources import litdata_item  # importable: LitData's workers are spawned
        n = len(datasets.load_from_disk(src))
        t0 = time.perf_counter()
        litdata.optimize(fn=litdata_item, inputs=[(src, i) for i in range(n)], output_dir=dst, chunk_bytes="64MB",
                         num_workers=2)
        report = None
    else:
        report = fastdata.convert(src, dst, workers=2, progress=False)
    # fastdata: the converter's own elapsed time (scan or plan, pool start, read, validate, write,
    # fsync, publish), as benchmarks/bench_convert.py reports it; litdata: optimize's wall time
    wall = time.perf_counter() - t0
    elapsed = report.elapsed if report is not None else wall
    print(json.dumps({"elapsed": elapsed, "wall": wall, "images": report.images if report is not None else None}))
"""


_DATASETS: dict = {}


def litdata_item(item: tuple[str, int]) -> dict:
    """Row ``i`` of the saved dataset as LitData stores it: the image's encoded bytes and the label
    (the dataset opened once per LitData worker, its images not decoded)."""
    import datasets

    path, i = item
    ds = _DATASETS.get(path)
    if ds is None:
        ds = _DATASETS[path] = datasets.load_from_disk(path).cast_column("image", datasets.Image(decode=False))
    row = ds[i]
    return {"image": row["image"]["bytes"], "label": row["label"]}


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def prepare(work: str, n: int, row_group: int, scale: int) -> dict:
    """The JPEGs and every form of them (reused when present); their paths and the image bytes."""
    import datasets

    src = os.path.join(work, "jpeg")
    if not os.path.isdir(src):
        make_image_folder(src, num_classes=10, per_class=n // 10, size="imagenet", workers=2)
    from fastdata.writer.sources.folder import scan_folder

    scan = scan_folder(src)
    paths = [p.decode() if isinstance(p, bytes) else p for p in scan.paths]
    labels = [int(x) for x in scan.labels]
    out = {"folder": src, "files": paths, "image_bytes": sum(os.path.getsize(p) for p in paths)}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    dataset_dir = os.path.join(work, "hf-dataset")
    if not os.path.isdir(dataset_dir):
        ds = datasets.Dataset.from_dict({"image": paths, "label": labels}, features=features)
        ds = ds.cast_column("image", datasets.Image(decode=False))
        # embed the bytes (a Hub dataset holds them, not paths): map reads each file once
        ds = ds.map(lambda row: {"image": {"bytes": open(row["image"]["path"], "rb").read(),
                                           "path": os.path.basename(row["image"]["path"])}},
                    features=datasets.Features({"image": datasets.Image(decode=False),
                                                "label": datasets.ClassLabel(names=NAMES)}))
        ds = ds.cast_column("image", datasets.Image())
        ds.save_to_disk(dataset_dir)
    out["dataset"] = dataset_dir
    ds = datasets.load_from_disk(dataset_dir)
    for name, times in (("parquet", 1), ("parquet-big", scale)):
        path = os.path.join(work, f"{name}.parquet")
        if not os.path.exists(path):
            part = ds if times == 1 else datasets.concatenate_datasets([ds] * times)
            part.to_parquet(path, batch_size=row_group)
        out[name] = path
    tars = os.path.join(work, "wds")
    if not os.path.isdir(tars):
        import webdataset as wds

        os.makedirs(tars + ".tmp", exist_ok=True)
        with wds.ShardWriter(os.path.join(tars + ".tmp", "train-%06d.tar"), maxsize=64 << 20, verbose=0) as sink:
            for i, (p, label) in enumerate(zip(paths, labels, strict=True)):
                with open(p, "rb") as fh:
                    sink.write({"__key__": f"{i:08d}", "jpg": fh.read(), "cls": label})
        os.rename(tars + ".tmp", tars)
    out["webdataset"] = tars
    return out


def convert_child(src: str, dst: str, kind: str, sample: bool = False) -> dict:
    """One conversion in a fresh Python; its elapsed time (and the tree's peak RSS when ``sample``)."""
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((REPO, os.path.join(REPO, "benchmarks"))))
    proc = subprocess.Popen([sys.executable, "-c", _CONVERT, src, dst, kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    sampler = None
    if sample:
        sampler = RssSampler(proc.pid)
        sampler.start()
    out, err = proc.communicate()
    if sampler is not None:
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} of {src} failed (exit {proc.returncode}): {err.strip()[-1500:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["bytes"] = dir_bytes(dst)
    if sampler is not None:
        res["peak_rss"], res["peak_anon"] = sampler.peak, sampler.peak_anon
    shutil.rmtree(dst, ignore_errors=True)
    return res


class RssSampler(PssSampler):
    """Peak summed RSS of a process tree (the figure a user's top shows) and, beside it, its peak
    anonymous memory (``Anonymous:`` of ``/proc/<pid>/smaps_rollup``): RSS also counts the pages of
    the shard being written that the LMDB writer maps, which grow with the shard (up to
    ``--shard-size``), not with the input; anonymous memory is what the processes really hold."""

    peak_anon = 0

    def measure(self, proc) -> int:
        return proc.memory_info().rss

    def sampled(self, procs: list, total: int) -> None:
        anon = 0
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/smaps_rollup") as fh:
                    anon += next((int(line.split()[1]) << 10 for line in fh if line.startswith("Anonymous:")), 0)
            except OSError:  # exited meanwhile
                pass
        self.peak_anon = max(self.peak_anon, anon)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--row-group", type=int, default=1000, help="rows per Parquet row group")
    p.add_argument("--scale", type=int, default=4, help="the large Parquet file is this many times the rows")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    data = prepare(args.workdir, args.n, args.row_group, args.scale)
    try:
        import litdata  # noqa: F401

        have_litdata = True
    except ImportError:
        have_litdata = False
    out_dir = os.path.join(args.workdir, "out.lmdb")  # litdata's output takes the same name
    kinds = {"folder": (data["folder"], "convert"), "parquet": (data["parquet"], "convert"),
             "parquet -> hdf5": (data["parquet"], "convert"),
             "webdataset": (data["webdataset"], "convert"), "write(dataset)": (data["dataset"], "write-dataset")}
    if have_litdata:
        kinds["litdata.optimize"] = (data["dataset"], "litdata")
    rounds: dict[str, list[dict]] = {k: [] for k in ["ceiling", *kinds]}
    for r in range(args.rounds):
        warm_page_cache(data["files"])
        for f in (data["parquet"], *[os.path.join(d, x) for d, _, fs in os.walk(data["webdataset"]) for x in fs]):
            warm_page_cache([f])
        c = ceiling(data["files"], 2)
        rounds["ceiling"].append({"elapsed": c["elapsed"], "images": c["images"]})
        for name, (src, kind) in kinds.items():
            rounds[name].append(convert_child(src, out_dir.replace(".lmdb", ".h5") if "hdf5" in name else out_dir,
                                              kind))
            print(f"round {r}: {name:18s} {rounds[name][-1]['elapsed']:6.2f} s", flush=True)
        print(f"round {r}: {'ceiling':18s} {c['elapsed']:6.2f} s", flush=True)
    n = len(data["files"])
    rows = {}
    for name, rs in rounds.items():
        rows[name] = {"median_s": statistics.median(x["elapsed"] for x in rs),
                      "img_s": statistics.median(n / x["elapsed"] for x in rs),
                      "bytes": rs[0].get("bytes"), "runs_s": [x["elapsed"] for x in rs]}
        if name != "ceiling":
            rows[name]["x_ceiling"] = statistics.median(c["elapsed"] / x["elapsed"] for c, x in
                                                        zip(rounds["ceiling"], rs, strict=True))
    memory = {}
    for name in ("parquet", "parquet-big"):
        res = convert_child(data[name], out_dir, "convert", sample=True)
        memory[name] = {"peak_rss": res["peak_rss"], "peak_anon": res["peak_anon"],
                        "file_bytes": os.path.getsize(data[name]), "elapsed": res["elapsed"]}
    res = {"n": n, "image_bytes": data["image_bytes"], "rows": rows, "memory": memory,
           "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                       "commit": os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip()}}
    lines = [f"{n} ImageNet-like JPEGs ({data['image_bytes'] / 1e6:.0f} MB of image bytes), 2 workers, "
             f"medians of {args.rounds} interleaved rounds", "",
             "| conversion | s | images/s | x ceiling | store MB | store / image bytes |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        size = row["bytes"]
        store = "" if size is None else f"{size / 1e6:.1f}"
        share = "" if size is None else f"{size / data['image_bytes']:.3f}"
        lines.append(f"| {name} | {row['median_s']:.2f} | {row['img_s']:.0f} | "
                     f"{row.get('x_ceiling', 1.0):.2f} | {store} | {share} |")
    if "litdata.optimize" in rows:
        w, lit = rows["write(dataset)"], rows["litdata.optimize"]
        lines.append(f"\nfastdata.write(ds) vs litdata.optimize: {lit['median_s'] / w['median_s']:.2f}x faster, "
                     f"size {w['bytes'] / lit['bytes']:.3f}x of litdata's")
    lines.append("\nPeak memory of the Parquet conversion's process tree (anonymous / RSS, which also counts the "
                 "mapped pages of the shard being written): " + ", ".join(
                     f"{m['file_bytes'] / 1e6:.0f} MB file: {m['peak_anon'] / 1e6:.0f} / {m['peak_rss'] / 1e6:.0f} MB"
                     for m in memory.values()))
    lines.append(f"\nfastdata {res['machine']['commit']}, Python {res['machine']['python']}, "
                 f"{res['machine']['cores']} cores. Command: `python benchmarks/bench_sources.py "
                 + " ".join(argv if argv is not None else sys.argv[1:]) + "`")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
