"""The ``bench``, ``tune`` and ``doctor`` subcommands (thin layers over the bench API).

``fastdata.cli.main`` calls :func:`add_commands`; exit codes follow it: 0 success, 1 a
check failed (a configuration failed, a hazard found), 2 a usage or data error
(one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from fastdata.cli.options import add_remote_options, remote_options

EXIT_OK, EXIT_FAILED_CHECK = 0, 1

_GRID_EPILOG = """\
Comma lists make a grid: every combination runs, each in a fresh process
(a failure marks that row failed and the grid goes on). Figures per row: images/s
and MB/s (median over measured epochs after warm-up), time to first batch, peak PSS
of main + workers, peak USS per worker, peak RSS (overcounts shared pages),
memory growth first->last epoch, CPU use, data-wait fraction (--step-ms), and
host-to-device copy time and GPU memory when CUDA is available. Output: a table,
results.json and results.csv (every figure + machine fingerprint) and PNG plots in
--out. Exit status: 0 all rows ok, 1 some row failed, 2 bad usage or target.

Pipelines: a folder is read like torchvision's ImageFolder (PIL decode, PIL
transforms); a store through fastdata with the transform fused into decoding.
  none       full decode
  resize224  Resize(224) (shorter side) + CenterCrop(224)
  rrc224     RandomResizedCrop(224)

example:
  fastdata bench train/ train.lmdb train.h5 --workers 0,2,4 --transform rrc224 --out results/
  fastdata bench train.lmdb --workers 2,4,8 --worker-type both --transform rrc224
"""


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=79)


def _add_loader_options(p: argparse.ArgumentParser, grid: bool) -> None:
    many = " (comma list)" if grid else ""
    p.add_argument("--transform", default="none", metavar="T",
                   help=f"none, resize224 or rrc224 (RandomResizedCrop 224){many}; default none")
    p.add_argument("--output", default="tensor", metavar="O", help=f"pil or tensor (uint8 CHW){many}; default tensor")
    p.add_argument("--pin-memory", default=None, metavar="on|off",
                   help=f"DataLoader pin_memory{many}; default on when CUDA is available")
    p.add_argument("--start-method", default="default", metavar="M",
                   help=f"fork, spawn or forkserver{many}; default: the platform's")
    p.add_argument("--step-ms", type=float, default=0.0, metavar="MS",
                   help="simulate a training step of MS milliseconds per batch and report the fraction of time "
                        "spent waiting for data")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="seconds per configuration before it is killed and marked failed (default 900)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def add_commands(subparsers) -> None:
    """Add ``bench``, ``tune`` and ``doctor`` to the ``fastdata`` argparse subparsers."""
    b = subparsers.add_parser(
        "bench", help="measure loading speed and memory of folders/stores over DataLoader settings",
        description=_wrap("Measure images/s, MB/s and memory of image folders and fastdata stores under a grid of "
                    "DataLoader settings."),
        epilog=_GRID_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("targets", nargs="+", metavar="TARGET",
                   help="image folder, LMDB store or HDF5 store (a directory, or a store's URL: s3://, gs://, "
                        "az://, https://, read through the shard cache)")
    b.add_argument("--workers", default="default", metavar="N,..",
                   help="num_workers values (default: 0,1,.. up to the core count)")
    b.add_argument("--batch-size", default="64", metavar="B,..", help="batch sizes (default 64)")
    b.add_argument("--prefetch-factor", default="2", metavar="P,..", help="prefetch factors (default 2)")
    b.add_argument("--persistent-workers", default="on", metavar="on,off", help="persistent workers (default on)")
    b.add_argument("--worker-type", default="process", metavar="process,thread",
                   help="worker processes (DataLoader's) and/or threads of the loading process "
                        "(fastdata.loader(..., worker_type='thread')): process, thread, process,thread or both "
                        "(a row of each per worker count, side by side); default process")
    _add_loader_options(b, grid=True)
    b.add_argument("--epochs", type=int, default=2, metavar="N", help="measured epochs (default 2)")
    b.add_argument("--warmup-epochs", type=int, default=1, metavar="N", help="epochs run before measuring (default 1)")
    b.add_argument("--max-batches", type=int, default=50, metavar="N",
                   help="batches per epoch, over a fixed random subset (default 50; 0 = the whole dataset)")
    b.add_argument("--cold", nargs="?", const="on", default="off", metavar="off,on",
                   help="evict every file the target reads from the page cache before each epoch "
                        "(posix_fadvise DONTNEED; no root needed); --cold alone = on, --cold off,on measures "
                        "a warm and a cold row of every configuration in one run; local targets only: for a "
                        "URL, empty its shard cache first (fastdata cache clear URL)")
    b.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sample subset and shuffling")
    b.add_argument("--out", default="fastdata-bench", metavar="DIR",
                   help="folder for results.json, results.csv, table.txt and plots (default ./fastdata-bench)")
    b.add_argument("--no-plots", action="store_false", dest="plots", help="skip the PNG plots")
    _add_remote_options(b)
    b.set_defaults(func=_cmd_bench)

    t = subparsers.add_parser(
        "tune", help="find the fastest DataLoader settings within a memory budget",
        description=_wrap("Find the DataLoader settings (num_workers, worker processes or threads, prefetch_factor, "
                    "batch_size) that load TARGET "
                    "fastest while the measured peak PSS of main process + workers stays within the budget. "
                    "Worker processes and thread workers are both measured (--worker-types) and the faster that "
                    "fits is recommended, with the reason. "
                    "Prints the estimator's prediction before measuring and the measurement next to it, then a "
                    "ready-to-paste DataLoader(...) call, saved with every trial as tune.json in --out. The "
                    "budget covers data loading only: leave room for your model."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  fastdata tune train.lmdb --memory-budget 16GiB --batch-size 256 --step-ms 120\n"
               "  fastdata tune train.lmdb --memory-budget 4GiB --effective-batch-size 1024")
    t.add_argument("target", metavar="TARGET",
                   help="image folder, LMDB store or HDF5 store (a directory, or a store's URL: s3://, gs://, "
                        "az://, https://, read through the shard cache)")
    t.add_argument("--memory-budget", required=True, metavar="SIZE",
                   help="most memory the loading processes may use, e.g. 8GiB, 500MB")
    t.add_argument("--batch-size", type=int, default=None, metavar="N", help="batch size (default 64)")
    t.add_argument("--effective-batch-size", type=int, default=None, metavar="E",
                   help="batch your recipe needs; if it does not fit, recommend the largest batch that does and "
                        "gradient accumulation over ceil(E / batch) steps (it takes the place of --batch-size, "
                        "and the output says so)")
    t.add_argument("--allow-no-workers", action="store_true",
                   help="also consider num_workers=0 (loading in the training process: it never overlaps the "
                        "training step); recommended only when measurably faster. With --step-ms it is always "
                        "considered, since the simulated step shows the missing overlap")
    t.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="most workers to try (default: core count)")
    t.add_argument("--worker-types", default="process,thread", metavar="process,thread",
                   help="worker kinds to measure: DataLoader worker processes and/or threads of the training "
                        "process (fastdata.loader(..., worker_type='thread')); with both (the default), each "
                        "is searched and the faster that fits the budget is recommended, threads when within "
                        "--min-gain (they use one process's memory)")
    t.add_argument("--min-gain", type=float, default=0.05, metavar="F",
                   help="relative throughput gain that justifies another step (default 0.05)")
    t.add_argument("--epochs", type=int, default=2, metavar="N", help="measured epochs per trial (default 2)")
    t.add_argument("--max-batches", type=int, default=20, metavar="N", help="batches per epoch per trial (default 20)")
    t.add_argument("--out", default="fastdata-tune", metavar="DIR",
                   help="folder for tune.json (default ./fastdata-tune)")
    _add_loader_options(t, grid=False)
    _add_remote_options(t)
    t.set_defaults(func=_cmd_tune)

    d = subparsers.add_parser(
        "doctor", help="check a Dataset object for DataLoader hazards, and this platform's limits",
        description=_wrap("Import module:attribute (calling it when it is a class or factory with no required "
                    "arguments), check the dataset for known DataLoader hazards (per-sample Python containers "
                    "copied into every worker, open file/LMDB/HDF5/database handles, unpicklable attributes, "
                    "random generators cloned into every worker) and print each with its fix; time a few "
                    "batches with one thread worker and with two, to say whether the dataset holds the GIL "
                    "while it loads (worker_type='thread' then serialises); then report "
                    "which operating-system facilities fastdata uses this system lacks (macOS, Windows) and "
                    "what each absence costs. Without MODULE:ATTRIBUTE, only that platform report. "
                    "Exit 0 when clean, 1 when a hazard is found, 2 when the object cannot be loaded."),
        epilog="examples:\n  fastdata doctor mypkg.data:make_train_set --sample 4\n  fastdata doctor",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("spec", metavar="MODULE:ATTRIBUTE", nargs="?",
                   help="e.g. mypkg.data:train_set (the current directory is importable) "
                        "or path/to/data.py:train_set; omitted: the platform report alone")
    d.add_argument("--sample", type=int, default=0, metavar="N",
                   help="fetch N items first (finds handles that __getitem__ opens, and items that raise)")
    d.add_argument("--threshold", type=int, default=1000, metavar="N",
                   help="report Python containers with at least N elements (default 1000)")
    d.add_argument("--no-thread-check", action="store_false", dest="thread_check",
                   help="skip timing a few batches with one thread worker and with two (about 2 s), which says "
                        "whether the dataset holds the GIL while it loads (then worker_type='thread' would "
                        "not load in parallel)")
    d.set_defaults(func=_cmd_doctor)


def _add_remote_options(p: argparse.ArgumentParser) -> None:
    add_remote_options(p, "shard cache directory for a URL target (default: $FASTDATA_CACHE_DIR, else "
                          "~/.cache/fastdata); a warm cache measures warm epochs: empty it first (fastdata cache "
                          "clear URL) for a cold first read")


def _store_options(args) -> dict:
    return remote_options(args)


def _pin(value):
    if value is not None:
        return value
    try:
        import torch

        return "on" if torch.cuda.is_available() else "off"
    except Exception:  # noqa: BLE001
        return "off"


def _cmd_bench(args) -> int:
    from fastdata.bench.grid import expand_grid
    from fastdata.bench.harness import run_bench

    configs = expand_grid(
        args.targets, workers=args.workers, batch_size=args.batch_size, prefetch_factor=args.prefetch_factor,
        persistent_workers=args.persistent_workers, pin_memory=_pin(args.pin_memory),
        start_method=args.start_method, output=args.output, transform=args.transform, epochs=args.epochs,
        warmup_epochs=args.warmup_epochs, max_batches=args.max_batches, cold=args.cold, step_ms=args.step_ms,
        seed=args.seed, store_options=_store_options(args), worker_type=args.worker_type)
    if args.plots:  # say so now, not after the whole run
        from fastdata.bench.plots import check_plotting

        check_plotting()
    if not args.quiet:
        print(f"measuring {len(configs)} configuration(s), each in a fresh process", file=sys.stderr)
    result = run_bench(configs, args.out, timeout=args.timeout, progress=not args.quiet, plots=args.plots,
                       store_options=_store_options(args) or None)
    print(result.table)
    if not args.quiet:
        print("wrote " + ", ".join(sorted(os.path.basename(p) for p in result.files.values())) + f" to {args.out}")
    return EXIT_FAILED_CHECK if result.failed else EXIT_OK


def _cmd_tune(args) -> int:
    from fastdata.bench.grid import BenchConfig, default_start_method, parse_bool, parse_worker_types, target_kind
    from fastdata.bench.report import fingerprint
    from fastdata.bench.tune import (
        accumulation_snippet,
        dataloader_snippet,
        harness_measure,
        harness_probe,
        tune,
        write_json,
    )
    from fastdata.common.units import format_size, parse_size

    budget = parse_size(args.memory_budget)
    if args.transform not in ("none", "resize224", "rrc224"):
        raise ValueError("--transform must be none, resize224 or rrc224")
    if args.output not in ("pil", "tensor"):
        raise ValueError("--output must be pil or tensor")
    if args.max_batches < 1 or args.epochs < 1:
        raise ValueError("--max-batches and --epochs must be >= 1")
    start = default_start_method() if args.start_method == "default" else args.start_method
    if start not in ("fork", "spawn", "forkserver"):
        raise ValueError("--start-method must be fork, spawn or forkserver")
    pin = parse_bool(_pin(args.pin_memory))
    worker_types = parse_worker_types(args.worker_types)
    from fastdata.remote.store import is_remote

    remote = _store_options(args)
    kind = target_kind(args.target, remote)
    target = args.target if is_remote(args.target) else os.path.abspath(args.target)
    base = BenchConfig(target=target, kind=kind, batch_size=args.batch_size, output=args.output,
                       transform=args.transform, pin_memory=pin, start_method=start, epochs=args.epochs,
                       warmup_epochs=1, max_batches=args.max_batches, step_ms=args.step_ms)
    log = (lambda line: None) if args.quiet else (lambda line: print(args.say(line), flush=True))
    from dataclasses import replace

    from fastdata.bench.grid import available_cores
    from fastdata.bench.harness import environment_warnings

    most = replace(base, workers=args.max_workers or available_cores(), prefetch_factor=8)
    for warning in environment_warnings([most]):
        print(f"warning: {args.say(warning)}", file=sys.stderr)
    uniform = _uniform_size(target, kind, args.transform, remote)
    result = tune(harness_measure(base, args.timeout, store_options=remote or None),
                  harness_probe(base, args.timeout, remote or None), budget,
                  batch_size=args.batch_size, effective_batch_size=args.effective_batch_size,
                  max_workers=args.max_workers, min_gain=args.min_gain, step_ms=args.step_ms,
                  allow_no_workers=args.allow_no_workers, log=log, worker_types=worker_types)
    snippet = dataloader_snippet(result, target, kind, args.transform, args.output, pin,
                                 None if args.start_method == "default" else start, uniform_size=uniform,
                                 store_options=remote)
    loop = accumulation_snippet(result)
    m = result.measured
    print(f"\nrecommended: {result.settings.describe()}: {m.images_per_s:.0f} images/s, peak PSS "
          f"{format_size(m.peak_pss)} (predicted {format_size(result.predicted_pss)}) of a "
          f"{format_size(budget)} budget")
    print(f"  {_wait_sentence(m.data_wait_fraction, args.step_ms)}")
    for line in _worker_type_lines(result):
        print(f"  {line}")
    notes = [n for n in result.notes if n != result.reason]  # (the reason is printed with the two lines above)
    for note in notes + _size_notes(kind, args.transform, args.output, uniform):
        print(f"  {args.say(note)}")
    print("\n" + snippet)
    if loop:
        print("\n# gradient accumulation\n" + loop)
    path = write_json(result, os.path.join(args.out, "tune.json"),
                      {"target": target, "kind": kind, "transform": args.transform, "output": args.output,
                       "step_ms": args.step_ms, "snippet": snippet, "accumulation_snippet": loop,
                       "machine": fingerprint()})
    print(f"\nsaved {path}")
    return EXIT_OK


def _worker_type_lines(result) -> list:
    """The best measured line of each worker type, side by side, then why one was recommended."""
    if len(result.by_worker_type) < 2:
        return []
    from fastdata.common.units import format_size

    lines = []
    for kind, trial in result.by_worker_type.items():
        m = trial.measured
        label = "threads:" if kind == "thread" else "processes:"
        lines.append(f"{label:<11} {trial.settings.describe():<58} {m.images_per_s:8.0f} images/s, "
                     f"peak PSS {format_size(m.peak_pss)}")
    lines.append(f"picked {result.reason}")
    return lines


def _uniform_size(target: str, kind: str, transform: str, store_options: dict | None = None):
    """True/False: every image of a store has one size (its index knows); None for a folder or a resizing transform.
    ``store_options``: a URL target's ``storage_options``/``cache_dir``/``cache_limit`` (no shard is downloaded)."""
    if kind == "folder" or transform != "none":
        return None
    from fastdata.reader.open import open_dataset

    ds = open_dataset(target, **(store_options or {}))
    try:
        return ds.storage.mode.holds_fixed_size_pixels or ds.uniform_shape is not None
    finally:
        ds.close()


def _wait_sentence(fraction, step_ms: float) -> str:
    if fraction is None:
        return "data wait: not measured"
    if step_ms:
        return (f"data wait: {fraction:.0%} of the time the loop (a {step_ms:g} ms step per batch) waited for the "
                "next batch")
    return (f"data wait: {fraction:.0%} of the loop's time (no --step-ms: the loop does nothing but load, so this "
            "is near 100%; give your step time to see how much of it loading hides)")


def _size_notes(kind: str, transform: str, output: str, uniform) -> list:
    from fastdata.bench.tune import needs_list_collate

    if not needs_list_collate(kind, transform, output, uniform):
        return []
    if kind != "folder" and output == "pil":
        return ["--output pil: batches are lists of PIL images (collate_fn=fastdata.collate_lists in the snippet)"]
    what = "the images differ in size" if uniform is False else "the images may differ in size"
    return [f"{what} and --transform none keeps them whole: batches are (list of images, labels) "
            "(collate_fn=fastdata.collate_lists in the snippet); a model needs one size: tune with "
            "--transform rrc224 or resize224 to measure the loader you will train with"]


def _cmd_doctor(args) -> int:
    from fastdata.bench.doctor import load_object
    from fastdata.tools.diagnose import diagnose
    from fastdata.tools.platform_report import platform_report

    if args.spec is None:
        print(platform_report())
        return EXIT_OK
    dataset = load_object(args.spec)
    report = diagnose(dataset, sample_items=args.sample, container_threshold=args.threshold,
                      check_threads=args.thread_check)
    print(report)
    print(platform_report())
    return EXIT_OK if report.ok else EXIT_FAILED_CHECK
