"""The benchmark grid: what one configuration is, and how comma lists expand into many.

A :class:`BenchConfig` is everything one measurement needs; it travels to the
runner process as JSON (:meth:`BenchConfig.to_json`), so it holds only plain
values. :func:`expand_grid` takes one list per axis and returns the cartesian
product in a stable order (targets outermost, then workers, ...). Axes that only
matter with workers (``worker_type``, ``prefetch_factor``, ``persistent_workers``,
``start_method``) collapse to a single row when ``workers == 0``; ``start_method``
also collapses for thread workers (``worker_type="thread"``: threads of the
measuring process, no worker process to start).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields

from fastdata.common import portable
from fastdata.common.paths import check_local_path
from fastdata.errors import FastdataError
from fastdata.format.backends.registry import backend_for_path
from fastdata.format.manifest import read_manifest
from fastdata.reader.worker_types import WORKER_TYPES
from fastdata.remote.store import is_remote

KINDS = ("folder", "lmdb", "hdf5")
OUTPUTS = ("pil", "tensor")
TRANSFORMS = ("none", "resize224", "rrc224")
START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration (one row of the results).

    Attributes:
        target: absolute path of an image folder or a fastdata store, or a store's URL.
        kind: ``"folder"``, ``"lmdb"`` or ``"hdf5"``.
        workers: DataLoader ``num_workers``.
        worker_type: ``"process"`` (DataLoader worker processes) or ``"thread"`` (``num_workers``
            threads of the measuring process, ``fastdata.loader(..., worker_type="thread")``);
            ``"process"`` when ``workers == 0``.
        batch_size: DataLoader ``batch_size``.
        prefetch_factor: batches each worker keeps in flight (None when ``workers == 0``).
        persistent_workers: keep workers between epochs (False when ``workers == 0``).
        pin_memory: DataLoader ``pin_memory``.
        start_method: worker start method (None when ``workers == 0`` or with thread workers).
        output: ``"pil"`` or ``"tensor"`` (uint8 CHW).
        transform: ``"none"``, ``"resize224"`` or ``"rrc224"``.
        epochs: measured epochs (after ``warmup_epochs``).
        warmup_epochs: epochs run first and left out of the throughput median.
        max_batches: batches per epoch (a fixed random subset of the dataset); 0 = all.
        cold: evict the page cache of every file the target reads before each epoch.
        step_ms: simulated training step per batch, in milliseconds (0 = none).
        seed: seed of the sample subset and of the shuffling.
    """

    target: str
    kind: str
    workers: int = 0
    batch_size: int = 64
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False
    start_method: str | None = None
    output: str = "tensor"
    transform: str = "none"
    epochs: int = 2
    warmup_epochs: int = 1
    max_batches: int = 50
    cold: bool = False
    step_ms: float = 0.0
    seed: int = 0
    worker_type: str = "process"

    def to_json(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> BenchConfig:
        """Inverse of :meth:`to_json`; unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = set(obj) - names
        if unknown:
            raise ValueError(f"unknown configuration keys: {sorted(unknown)}")
        return cls(**obj)

    def label(self) -> str:
        """Short human description, e.g. ``lmdb w=2 bs=64 pf=2``."""
        parts = [f"{os.path.basename(self.target.rstrip('/'))} ({self.kind})", f"w={self.workers}",
                 f"bs={self.batch_size}"]
        if self.workers:
            parts += [f"pf={self.prefetch_factor}", "persist" if self.persistent_workers else "no-persist"]
            parts.append("threads" if self.worker_type == "thread" else str(self.start_method))
        parts += [self.output, self.transform]
        if self.pin_memory:
            parts.append("pin")
        if self.cold:
            parts.append("cold")
        if self.step_ms:
            parts.append(f"step={self.step_ms:g}ms")
        return " ".join(parts)


def available_cores() -> int:
    """Cores this process may run on (CPU affinity where the OS has it)."""
    return portable.available_cores()


def target_kind(path: str, store_options: dict | None = None) -> str:
    """``"lmdb"``/``"hdf5"`` for a published fastdata store (a directory or a URL), ``"folder"`` for a
    directory of class folders.

    Args:
        path: the target.
        store_options: for a URL, :func:`fastdata.open_dataset`'s ``storage_options``/``cache_dir``.

    Raises:
        FastdataError: the path does not exist or is not a directory; a URL is not a store or
            cannot be reached.
    """
    from fastdata.remote.store import locate_store

    if is_remote(path):
        opts = store_options or {}
        return locate_store(path, storage_options=opts.get("storage_options"),
                            cache_dir=opts.get("cache_dir")).manifest["backend"]
    check_local_path(path, "target")
    if not os.path.isdir(path):
        raise FastdataError(f"{path}: not a directory (a target is an image folder or a fastdata store)")
    if os.path.exists(os.path.join(path, "manifest.json")):
        return read_manifest(path)["backend"]
    if backend_for_path(path) is not None:
        # read_manifest names what is wrong (unfinished conversion, missing manifest)
        return read_manifest(path)["backend"]
    return "folder"


def _absolute(target: str) -> str:
    """A local target as an absolute path; a URL as it is (abspath would make "s3://b/x" "<cwd>/s3:/b/x")."""
    return target if is_remote(target) else os.path.abspath(target)


def split_list(text: str | Sequence, cast=str, name: str = "value") -> list:
    """``"0,1,2"`` -> ``[0, 1, 2]`` with ``cast``; a list passes through (each item cast).

    Raises:
        ValueError: an item cannot be cast, or the list is empty.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        item = item.strip() if isinstance(item, str) else item
        if item == "":
            continue
        try:
            out.append(cast(item))
        except (TypeError, ValueError) as err:
            why = str(err)
            if not why or why.startswith("invalid literal"):  # int()'s own wording helps nobody
                why = f"cannot read {item!r}"
            raise ValueError(f"{name}: {why}") from None
    if not out:
        raise ValueError(f"{name}: empty list")
    return list(dict.fromkeys(out))  # keep order, drop repeats


def parse_bool(text) -> bool:
    """on/off, true/false, yes/no, 1/0 -> bool."""
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("on", "true", "yes", "1"):
        return True
    if low in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected on/off, got {text!r}")


def _choice(allowed: Sequence[str], name: str):
    def cast(value):
        value = str(value).strip().lower()
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}")
        return value
    return cast


def _positive(name: str, minimum: int = 1):
    def cast(value):
        number = int(value)
        if number < minimum:
            raise ValueError(f"{name} must be >= {minimum}")
        return number
    return cast


def default_workers() -> list[int]:
    """0, 1, 2, ... up to the number of available cores."""
    return list(range(available_cores() + 1))


def parse_worker_types(text) -> list[str]:
    """``"process"``, ``"thread"``, ``"process,thread"`` or ``"both"`` (a list passes through) -> the list.

    Raises:
        ValueError: an unknown worker type, or an empty list.
    """
    if isinstance(text, str) and text.strip().lower() in ("both", "all"):
        return list(WORKER_TYPES)
    return split_list(text, _choice(WORKER_TYPES, "worker-type"), "worker-type")


def default_start_method() -> str:
    """The platform's default multiprocessing start method (what DataLoader uses)."""
    return multiprocessing.get_start_method(allow_none=False)


def expand_grid(
    targets: Iterable[str],
    *,
    workers="default",
    batch_size="64",
    prefetch_factor="2",
    persistent_workers="on",
    pin_memory="off",
    start_method="default",
    output="tensor",
    transform="none",
    epochs: int = 2,
    warmup_epochs: int = 1,
    max_batches: int = 50,
    cold: bool | str = False,
    step_ms: float = 0.0,
    seed: int = 0,
    store_options: dict | None = None,
    worker_type="process",
) -> list[BenchConfig]:
    """Every combination of the axes, one :class:`BenchConfig` each.

    Each axis takes a comma list (``"0,1,2"``) or a sequence. ``workers="default"``
    means 0..cores, ``start_method="default"`` the platform default. A target may be a
    store's URL (``store_options``: its ``storage_options``/``cache_dir``); ``cold`` then
    applies to local targets only. ``cold`` is an axis too: a bool, or ``"off"``, ``"on"`` or
    ``"off,on"`` (a warm and a cold row for every configuration, side by side in one run).
    ``worker_type`` is an axis too: ``"process"`` (the default), ``"thread"``, ``"process,thread"``
    or ``"both"``: a row of each beside the other for every worker count.

    Returns:
        list[BenchConfig]: targets outermost, then workers, worker type, batch size, prefetch factor,
        persistent workers, pin memory, start method, output, transform, cold.

    Raises:
        ValueError: a value is out of range or unknown.
        FastdataError: a target does not exist or is an unfinished store.
    """
    if epochs < 1:
        raise ValueError("epochs must be >= 1")
    if warmup_epochs < 0:
        raise ValueError("warmup epochs must be >= 0")
    if max_batches < 0:
        raise ValueError("max-batches must be >= 0 (0 = whole epoch)")
    if step_ms < 0:
        raise ValueError("step-ms must be >= 0")
    axes = [
        default_workers() if workers == "default" else split_list(workers, _positive("workers", 0), "workers"),
        parse_worker_types(worker_type),
        split_list(batch_size, _positive("batch-size"), "batch-size"),
        split_list(prefetch_factor, _positive("prefetch-factor"), "prefetch-factor"),
        split_list(persistent_workers, parse_bool, "persistent-workers"),
        split_list(pin_memory, parse_bool, "pin-memory"),
        [default_start_method()] if start_method == "default"
        else split_list(start_method, _choice(START_METHODS, "start-method"), "start-method"),
        split_list(output, _choice(OUTPUTS, "output"), "output"),
        split_list(transform, _choice(TRANSFORMS, "transform"), "transform"),
        [cold] if isinstance(cold, bool) else split_list(cold, parse_bool, "cold"),
    ]
    resolved = [(_absolute(t), target_kind(t, store_options)) for t in targets]
    if any(axes[-1]) and any(is_remote(path) for path, _ in resolved):
        raise ValueError("cold=True evicts local files from the page cache and does not apply to a URL target; "
                         "to measure a cold remote read, empty its shard cache first (fastdata cache clear URL)")
    if not resolved:
        raise ValueError("give at least one target")
    out: list[BenchConfig] = []
    seen = set()
    for (path, kind), combo in itertools.product(resolved, itertools.product(*axes)):
        w, wtype, bs, pf, persist, pin, method, outp, tf, cold_epochs = combo
        if w == 0:  # these only mean something with workers
            wtype, pf, persist, method = "process", None, False, None
        elif wtype == "thread":  # no process to start (persistent_workers keeps the thread pool)
            method = None
        cfg = BenchConfig(target=path, kind=kind, workers=w, worker_type=wtype, batch_size=bs, prefetch_factor=pf,
                          persistent_workers=persist, pin_memory=pin, start_method=method, output=outp,
                          transform=tf, epochs=epochs, warmup_epochs=warmup_epochs, max_batches=max_batches,
                          cold=cold_epochs, step_ms=float(step_ms), seed=seed)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


# -- the protocol between the harness and the runner process it starts for each configuration

#: the remote-store options (storage_options, cache_dir, cache_limit) of a URL target, as JSON, for
#: the runner process: kept out of the configuration so credentials never reach results.json
STORE_OPTIONS_ENV = "FASTDATA_BENCH_STORE_OPTIONS"
#: the line prefix of the runner's result (one JSON object) on its standard output
RESULT_MARK = "FASTDATA_RESULT "
