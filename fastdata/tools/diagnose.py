"""Inspect any map-style Dataset for the known DataLoader hazards, each with its fix.

:func:`diagnose` walks the dataset's attributes (recursively, to a small depth, into
nested objects and the first few elements of containers, guarding against cycles) and
reports:

``python_container``
    a large list/dict/tuple/set (or numpy ``object`` array) of per-sample Python
    objects. Forked workers share the parent's pages copy-on-write, but merely reading
    an element writes its reference count, so each worker ends up with a private copy
    of every page it touched (pytorch/pytorch#13246). ``bytes_at_risk`` estimates that
    copy from ``sys.getsizeof`` of a sample of elements (and their direct members).
``open_handle``
    an open LMDB environment/transaction/cursor, h5py file/group/dataset, OS-level
    file object, sqlite3 connection or socket. Forked workers inherit it; none of these
    survive that (LMDB and HDF5 state, shared file offsets, sqlite locks).
``unpicklable``
    an attribute that cannot be pickled: spawn and forkserver (the default on macOS,
    and on Linux from Python 3.14) pickle the dataset into each worker, so the
    DataLoader fails there. Pickling happens in memory only, into a byte counter; it
    only tests picklability (fastdata never stores pickles).
``shared_rng``
    a ``numpy.random.Generator``/``RandomState``, ``random.Random`` or
    ``torch.Generator`` created before the workers start: each worker gets an
    identical copy, so "random" augmentations repeat across workers
    (pytorch/pytorch#5059).
``item_error``
    with ``sample_items > 0``, ``dataset[i]`` raised.

With ``check_threads=True`` (``fastdata doctor`` does), :func:`check_thread_workers` also
says, by timing one thread worker against two, whether the dataset holds the GIL while it loads.

Only ``__dict__``/``__slots__`` values are read: properties are never called, so the
walk has no side effects. Handles and RNGs are recognised by type; modules that were
never imported (``lmdb``, ``h5py``, ``torch``) are not imported here.

An object whose class sets ``__fastdata_fork_safe__ = True`` declares that it reopens
its handles after a fork (e.g. by checking ``os.getpid()``); its open handles are then
reported as notes, not hazards.
"""

from __future__ import annotations

import io
import itertools
import pickle
import random
import socket
import sqlite3
import sys
import time
import types
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Hazard",
    "DiagnosisReport",
    "diagnose",
    "PYTHON_CONTAINER",
    "OPEN_HANDLE",
    "UNPICKLABLE",
    "SHARED_RNG",
    "ITEM_ERROR",
    "ThreadScaling",
    "check_thread_workers",
]

PYTHON_CONTAINER = "python_container"
OPEN_HANDLE = "open_handle"
UNPICKLABLE = "unpicklable"
SHARED_RNG = "shared_rng"
ITEM_ERROR = "item_error"
_KIND_ORDER = (PYTHON_CONTAINER, OPEN_HANDLE, UNPICKLABLE, SHARED_RNG, ITEM_ERROR)

_CONTAINERS = (list, tuple, dict, set, frozenset, deque)
_SIZE_SAMPLE = 64  # elements measured to estimate a container's per-element size
_PEEK = 3  # elements of each container that the walk descends into
_PICKLE_SCAN = 256  # container elements tried one by one to pinpoint a pickle failure
_MAX_NODES = 20_000  # bound on objects visited, whatever the dataset looks like

_CONTAINER_FIX = (
    "keep per-sample data in numpy arrays (e.g. paths as one np.bytes_ array or a uint8 "
    "buffer + int64 offsets, labels as int64), or pyarrow/torch tensors: an array is one "
    "object, so reading it touches no per-element reference counts (pytorch/pytorch#13246)"
)
_RNG_FIX = (
    "create the generator per worker: lazily on first use in __getitem__, or in a "
    "worker_init_fn (fastdata.seed_worker) seeded from torch.initial_seed(); or draw from "
    "the global numpy/random/torch RNGs, which the DataLoader and seed_worker reseed per worker"
)


@dataclass(frozen=True)
class Hazard:
    """One DataLoader hazard found in a dataset.

    Attributes:
        kind: one of ``python_container``, ``open_handle``, ``unpicklable``,
            ``shared_rng``, ``item_error``.
        attribute: where, relative to the dataset (``"samples"``, ``"meta['paths']"``,
            ``"reader.env"``, ``"transforms[0].rng"``); ``""`` is the dataset itself.
        detail: what was found and why it matters.
        fix: what to do instead.
        bytes_at_risk: for ``python_container``, the estimated bytes each forked worker
            ends up copying; ``None`` otherwise.
    """

    kind: str
    attribute: str
    detail: str
    fix: str
    bytes_at_risk: int | None = None


@dataclass(frozen=True)
class ThreadScaling:
    """How a dataset's loading scales from one thread worker to two (:func:`check_thread_workers`).

    Attributes:
        speedup: time with one thread divided by time with two (2.0 = perfect scaling).
        one_thread_s, two_threads_s: seconds to load the timed batches (the faster of the rounds).
        batches, batch_size: what was timed (the same fixed indices for both).
        cores: usable cores when measured.
        min_speedup: the speed-up under which the dataset is said to hold the GIL.
    """

    speedup: float
    one_thread_s: float
    two_threads_s: float
    batches: int
    batch_size: int
    cores: int
    min_speedup: float = 1.3

    @property
    def blocks(self) -> bool:
        """True when two threads were not ``min_speedup`` times as fast as one: loading holds the GIL."""
        return self.speedup < self.min_speedup

    def message(self) -> str:
        """The sentence ``fastdata doctor`` prints."""
        if self.blocks:
            text = (f"your Dataset holds the GIL while it loads (2 threads ran at {self.speedup:.2f}x one): use "
                    "worker_type='process' (the default)")
            per_batch = self.one_thread_s / max(self.batches, 1)
            if per_batch < 1e-3:  # too quick to matter (and to time): say so
                text += f"; at {per_batch * 1e3:.2f} ms per batch of {self.batch_size}, loading costs little either way"
            return text
        return (f"thread workers scale ({self.speedup:.2f}x with 2 threads): worker_type='thread' may load as fast "
                "with one process's memory (fastdata tune measures both)")


@dataclass
class DiagnosisReport:
    """The result of :func:`diagnose`.

    Attributes:
        dataset_type: qualified class name of the dataset.
        hazards: the hazards found, grouped by kind.
        notes: informational lines (pickled size, items sampled, declared fork-safe handles).
        pickled_bytes: size of the dataset pickled as spawn would send it, or ``None``
            when it cannot be pickled.
        threads: with ``check_threads``, how loading scaled from one thread worker to two
            (None when not measured; a note says why).
    """

    dataset_type: str
    hazards: list[Hazard] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pickled_bytes: int | None = None
    threads: ThreadScaling | None = None

    @property
    def ok(self) -> bool:
        """True when no hazard was found."""
        return not self.hazards

    def of_kind(self, kind: str) -> list[Hazard]:
        """The hazards of one kind."""
        return [h for h in self.hazards if h.kind == kind]

    def __str__(self) -> str:
        n = len(self.hazards)
        head = f"diagnose({self.dataset_type}): "
        lines = [head + ("no hazards found" if n == 0 else f"{n} hazard{'s' * (n != 1)}")]
        for i, h in enumerate(self.hazards, 1):
            where = _join("dataset", h.attribute) if h.attribute else "dataset"
            lines.append(f"  {i}. [{h.kind}] {where}")
            lines.append(f"     {h.detail}")
            if h.bytes_at_risk is not None:
                lines.append(f"     at risk: ~{_fmt_bytes(h.bytes_at_risk)} per worker")
            lines.append(f"     fix: {h.fix}")
        if self.threads is not None:
            lines.append(f"  thread workers: {self.threads.message()}")
        if self.notes:
            lines.append("  notes:")
            lines.extend(f"   - {note}" for note in self.notes)
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    unit = "B"
    for larger in ("KB", "MB", "GB"):
        if abs(n) < 1024:
            break
        n, unit = n / 1024, larger
    return f"{n:.1f} {unit}"


def _join(path: str, suffix: str) -> str:
    if suffix.startswith(("[", "{")):
        return path + suffix
    return f"{path}.{suffix}" if path else suffix


def _short_repr(key: Any) -> str:
    r = repr(key)
    return r if len(r) <= 40 else r[:37] + "..."


# ---------------------------------------------------------------- object graph walk

_LEAF_TYPES = (
    str, bytes, bytearray, memoryview, int, float, complex, bool, type(None),
    np.ndarray, np.generic, types.ModuleType, type, types.FunctionType,
    types.BuiltinFunctionType, types.MethodType, types.LambdaType,
)


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:  # no __dict__, or an exotic proxy: nothing to read
        d = None
    if isinstance(d, dict):
        for k, v in list(d.items()):
            yield str(k), v
    seen = set()
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        for name in slots:
            if name in seen or name in ("__dict__", "__weakref__"):
                continue
            seen.add(name)
            try:
                yield name, object.__getattribute__(obj, name)
            except AttributeError:  # unset slot
                continue


def _children(obj: Any, limit: int) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in itertools.islice(obj.items(), limit):
            yield f"[{_short_repr(k)}]", v
    elif isinstance(obj, (list, tuple, deque)):
        for i, v in enumerate(itertools.islice(obj, limit)):
            yield f"[{i}]", v
    elif isinstance(obj, (set, frozenset)):
        for i, v in enumerate(itertools.islice(obj, limit)):
            yield f"{{#{i}}}", v
    elif not isinstance(obj, _LEAF_TYPES):
        yield from _attributes(obj)


def _walk(root: Any, max_depth: int):
    """Breadth-first generator of (path, value, owner).

    ``owner`` is the nearest enclosing non-container object. ``send(False)`` after a
    value skips its children. Each object is visited once (cycles, shared references).
    """
    seen = {id(root)}
    queue = deque([("", root, None, 0)])
    visited = 0
    while queue and visited < _MAX_NODES:
        path, obj, owner, depth = queue.popleft()
        visited += 1
        descend = yield path, obj, owner
        if descend is False or depth >= max_depth:
            continue
        child_owner = owner if isinstance(obj, _CONTAINERS) else obj
        for suffix, child in _children(obj, _PEEK):
            if id(child) in seen or isinstance(child, (str, bytes, int, float, bool, type(None))):
                continue
            seen.add(id(child))
            queue.append((_join(path, suffix), child, child_owner, depth + 1))


# ---------------------------------------------------------------- classifiers

def _elem_size(e: Any) -> int:
    """getsizeof of an element plus its direct members: what reading it ends up touching."""
    size = sys.getsizeof(e)
    members: Iterator[Any]
    if isinstance(e, dict):
        members = itertools.chain.from_iterable(itertools.islice(e.items(), _SIZE_SAMPLE))
    elif isinstance(e, (list, tuple, set, frozenset, deque)):
        members = itertools.islice(e, _SIZE_SAMPLE)
    elif isinstance(getattr(e, "__dict__", None), dict) and not isinstance(e, _LEAF_TYPES):
        size += sys.getsizeof(e.__dict__)
        members = itertools.islice(e.__dict__.values(), _SIZE_SAMPLE)
    else:
        return size
    return size + sum(sys.getsizeof(m) for m in members)


def _container_hazard(path: str, obj: Any, threshold: int) -> Hazard | None:
    if isinstance(obj, np.ndarray):
        if obj.dtype != object or obj.size < threshold:
            return None
        n = int(obj.size)
        flat = obj.reshape(-1)
        idx = np.linspace(0, n - 1, min(n, _SIZE_SAMPLE)).astype(np.int64)
        sample = [flat[i] for i in idx]
        what = f"numpy array of dtype=object holding {n:,} Python objects"
    elif isinstance(obj, _CONTAINERS):
        n = len(obj)
        if n < threshold:
            return None
        if isinstance(obj, (list, tuple)):
            idx = np.linspace(0, n - 1, min(n, _SIZE_SAMPLE)).astype(np.int64)
            sample = [obj[int(i)] for i in idx]
        elif isinstance(obj, dict):
            sample = list(itertools.islice(obj.items(), _SIZE_SAMPLE))  # (key, value) pairs
        else:
            sample = list(itertools.islice(obj, _SIZE_SAMPLE))
        what = f"{type(obj).__name__} of {n:,} Python objects"
    else:
        return None
    if isinstance(obj, dict):
        per = float(np.mean([sys.getsizeof(k) + _elem_size(v) for k, v in sample]))
    else:
        per = float(np.mean([_elem_size(e) for e in sample]))
    at_risk = int(per * n)
    detail = (
        f"{what} (~{per:.0f} B each). Forked workers share it copy-on-write, but reading "
        "an element writes its reference count, so each worker gradually copies every page "
        "it touches: memory climbs over the first epochs and scales with the number of "
        "workers (pytorch/pytorch#13246)"
    )
    return Hazard(PYTHON_CONTAINER, path, detail, _CONTAINER_FIX, bytes_at_risk=at_risk)


def _is_open(probe) -> bool:
    try:
        probe()
    except Exception:  # closed handles raise library-specific errors
        return False
    return True


def _handle_info(obj: Any) -> tuple[str, str] | None:
    """(description, fix) if obj is an open OS-level handle, else None."""
    lmdb = sys.modules.get("lmdb")
    if lmdb is not None:
        lazy_lmdb = (
            "open the LMDB Environment lazily on first use in each worker (attribute None in "
            "__init__, dropped in __getstate__), with readonly=True, lock=False; "
            "never use an Environment/transaction/cursor across a fork "
            "(py-lmdb 'Forking & multiprocessing', jnwatson/py-lmdb#159)"
        )
        if isinstance(obj, lmdb.Environment) and _is_open(obj.path):
            return "open lmdb.Environment", lazy_lmdb
        if isinstance(obj, lmdb.Transaction) and _is_open(obj.id):
            return (
                "live lmdb.Transaction (a parent holding a read transaction when workers fork "
                "gets MDB_BAD_RSLOT later: jnwatson/py-lmdb#346)",
                lazy_lmdb,
            )
        if isinstance(obj, lmdb.Cursor) and _is_open(obj.key):
            return "live lmdb.Cursor", lazy_lmdb
    h5py = sys.modules.get("h5py")
    if h5py is not None and isinstance(obj, (h5py.File, h5py.Group, h5py.Dataset)):
        if obj.id.valid:
            return (
                f"open h5py.{type(obj).__name__} (libhdf5 state does not survive fork)",
                "open the h5py.File lazily in each worker, never before the DataLoader forks "
                "(h5py docs; pytorch/pytorch#11929); use locking=False for published files",
            )
    if isinstance(obj, io.IOBase) and not obj.closed:
        try:
            fd = obj.fileno()
        except (OSError, ValueError):  # BytesIO/StringIO: in memory, nothing to inherit
            return None
        if fd <= 2:  # stdin/stdout/stderr are meant to be inherited
            return None
        return (
            f"open file object (fd {fd}); forked workers share its file offset, so "
            "concurrent seek()+read() return other samples' bytes",
            "open the file lazily in each worker (or read with os.pread, which takes no "
            "shared offset) and drop it in __getstate__",
        )
    if isinstance(obj, sqlite3.Connection) and _is_open(lambda: obj.total_changes):
        return (
            "open sqlite3.Connection (a connection carried across fork can corrupt the "
            "database: sqlite.org/howtocorrupt.html)",
            "connect lazily in each worker and drop the connection in __getstate__",
        )
    if isinstance(obj, socket.socket) and obj.fileno() != -1:
        return (
            "open socket, shared by every forked worker",
            "connect lazily in each worker and drop the socket in __getstate__",
        )
    return None


def _rng_info(obj: Any) -> str | None:
    if isinstance(obj, np.random.Generator):
        return "numpy.random.Generator"
    if isinstance(obj, np.random.RandomState):
        # The global RandomState behind np.random.* is reseeded by the DataLoader (torch>=1.9).
        if obj is getattr(np.random.mtrand, "_rand", None):
            return None
        return "numpy.random.RandomState"
    if isinstance(obj, random.Random):
        if isinstance(obj, random.SystemRandom) or obj is getattr(random, "_inst", None):
            return None  # OS entropy, or the global instance the DataLoader reseeds
        return "random.Random"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Generator):
        if obj is torch.default_generator:
            return None
        return "torch.Generator"
    return None


# ---------------------------------------------------------------- picklability

class _ByteCounter:
    """A write-only file that counts bytes: pickling into it allocates nothing large."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


def _pickle_size(obj: Any) -> tuple[int | None, BaseException | None]:
    sink = _ByteCounter()
    try:
        # Protocol 5 passes numpy buffers out without a tobytes() copy.
        pickle.Pickler(sink, protocol=5).dump(obj)
    except Exception as exc:  # any failure is exactly what spawn would hit
        return None, exc
    return sink.n, None


def _pickle_state(obj: Any) -> Iterator[tuple[str, Any]] | None:
    """The parts pickle would serialise, for objects using the default protocol."""
    if isinstance(obj, _CONTAINERS):
        return _children(obj, _PICKLE_SCAN)
    if isinstance(obj, _LEAF_TYPES):
        return None
    klass = type(obj)
    if klass.__reduce_ex__ is not object.__reduce_ex__ or klass.__reduce__ is not object.__reduce__:
        return None  # custom reduction: cannot see inside
    getstate = getattr(klass, "__getstate__", None)
    if getstate is not None and getstate is not getattr(object, "__getstate__", None):
        try:
            state = obj.__getstate__()
        except Exception:
            return None
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots dict)
            return _dict_items([part for part in state if isinstance(part, dict)])
        if isinstance(state, dict):
            return _dict_items([state])
        return None
    return _attributes(obj)


def _dict_items(dicts) -> Iterator[tuple[str, Any]]:
    for d in dicts:
        for k, v in d.items():
            yield str(k), v


def _locate_unpicklable(obj: Any, path: str, depth: int) -> list[tuple[str, Any, BaseException]]:
    """The deepest parts of obj that fail to pickle, as (path, value, error)."""
    found: list[tuple[str, Any, BaseException]] = []
    parts = _pickle_state(obj) if depth > 0 else None
    if parts is None:
        return found
    for suffix, child in parts:
        _, err = _pickle_size(child)
        if err is None:
            continue
        child_path = _join(path, suffix)
        deeper = _locate_unpicklable(child, child_path, depth - 1)
        found.extend(deeper or [(child_path, child, err)])
    return found


def _is_handle_type(value: Any) -> bool:
    """True for handle types, open or closed (closed ones still refuse to pickle)."""
    types_ = [io.IOBase, sqlite3.Connection, socket.socket]
    lmdb = sys.modules.get("lmdb")
    if lmdb is not None:
        types_ += [lmdb.Environment, lmdb.Transaction, lmdb.Cursor]
    h5py = sys.modules.get("h5py")
    if h5py is not None:
        types_ += [h5py.File, h5py.Group, h5py.Dataset]
    return isinstance(value, tuple(types_))


def _unpicklable_fix(value: Any) -> str:
    if _is_handle_type(value):
        return ("drop the handle in __getstate__ (set it to None) and reopen it lazily "
                "in the worker")
    if isinstance(value, types.FunctionType) and (
        value.__name__ == "<lambda>" or "<locals>" in value.__qualname__
    ):
        return ("use a module-level function, a callable class or functools.partial "
                "instead of a lambda or nested function")
    if "<locals>" in type(value).__qualname__:
        return "define the class at module level so that workers can import it"
    return ("make it picklable, or exclude it in __getstate__ and rebuild it in the "
            "worker (e.g. lazily on first use)")


# ---------------------------------------------------------------- entry point

def _sample(dataset: Any, count: int, report: DiagnosisReport) -> None:
    try:
        n = len(dataset)
    except TypeError:
        n = None
    if n is not None:
        spaced: Iterable[float] = np.linspace(0, max(n - 1, 0), min(count, n)) if n else []
        indices = sorted({int(i) for i in spaced})
    else:
        indices = list(range(count))
    fetched = 0
    for i in indices:
        try:
            dataset[i]
            fetched += 1
        except Exception as exc:  # report every failure, whatever the dataset raises
            report.hazards.append(Hazard(
                ITEM_ERROR, f"[{i}]",
                f"dataset[{i}] raised {type(exc).__name__}: {exc}",
                "fix or skip the bad sample (a DataLoader worker re-raises this and the "
                "whole epoch stops)",
            ))
    report.notes.append(f"fetched {fetched} of {len(indices)} sampled items")


def _as_is(batch):
    """The collate of the thread check: the items as the dataset returns them (no stacking)."""
    return batch


def _load_with_threads(dataset: Any, indices: list[int], batch_size: int, threads: int) -> float:
    """Seconds to load ``indices`` in batches with ``threads`` thread workers."""
    from fastdata.reader.loader import loader

    t0 = time.perf_counter()
    it = iter(loader(dataset, batch_size=batch_size, sampler=indices, shuffle=False, num_workers=threads,
                     worker_type="thread", collate_fn=_as_is, pin_memory=False))
    for _ in it:
        pass
    elapsed = time.perf_counter() - t0
    del it
    return elapsed


def check_thread_workers(
    dataset: Any,
    *,
    batch_size: int = 16,
    batches: int = 8,
    budget_s: float = 2.0,
    min_speedup: float = 1.3,
    min_batches: int = 4,
) -> tuple[ThreadScaling | None, str]:
    """Time loading a fixed subset with one thread worker and with two.

    One warm-up batch first (it also sizes the run to ``budget_s``: fewer batches, or smaller
    ones, for a slow dataset; more batches for a fast one, so that a run is long enough to
    time); then the same indices with one thread and with two, twice each, interleaved, when
    the budget allows (the faster run of each counts: a busy machine slows runs, never speeds
    them up).

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size, batches: the timed run (at most ``len(dataset) // batch_size`` batches).
        budget_s: about the most the check takes.
        min_speedup: two threads under this multiple of one: loading holds the GIL.
        min_batches: a dataset shorter than this many batches is not timed.

    Returns:
        tuple: ``(ThreadScaling, "")``, or ``(None, why it was not measured)``.
    """
    from fastdata.common.portable import available_cores

    try:
        import torch.utils.data as tud

        if isinstance(dataset, tud.IterableDataset):
            return None, "an IterableDataset cannot load with thread workers"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if not callable(getattr(dataset, "__getitem__", None)):
        return None, "not a map-style dataset"
    try:
        n = len(dataset)
    except TypeError:
        return None, "the dataset has no len()"
    cores = available_cores()
    if cores < 2:
        return None, "one usable core: two threads cannot run at once here"
    bs = max(1, min(batch_size, n // (2 * min_batches)))
    if n < min_batches * bs or n < 2 * min_batches:
        return None, f"{n} items is too few to time"
    try:
        warm = _load_with_threads(dataset, list(range(bs)), bs, 1)
        per_batch = max(warm, 1e-6)
        k = max(batches, min(64, int(0.05 / per_batch)))  # fast items: runs long enough to time
        k = min(k, n // bs)
        cost = 1.5 * per_batch  # one batch with one thread, and with two
        while k > 2 and k * cost > budget_s:
            k -= 1
        if k * cost > budget_s:  # two batches are over the budget: smaller batches
            old, bs = bs, max(1, int(bs * budget_s / (2 * cost)))
            per_batch = per_batch * bs / old
            cost = 1.5 * per_batch
        k -= k % 2  # (an even count: an odd one leaves the second thread idle for the last batch)
        k = max(k, 2)
        rounds = 2 if 2 * k * cost <= budget_s else 1
        spread = np.linspace(0, n - 1, k * bs).astype(np.int64).tolist()
        one, two = [], []
        for _ in range(rounds):
            one.append(_load_with_threads(dataset, spread, bs, 1))
            two.append(_load_with_threads(dataset, spread, bs, 2))
    except Exception as exc:  # noqa: BLE001 - the dataset's own error: say so, judge nothing
        return None, f"loading raised {type(exc).__name__}: {exc}"
    t1, t2 = min(one), min(two)
    return ThreadScaling(speedup=t1 / max(t2, 1e-9), one_thread_s=t1, two_threads_s=t2, batches=k, batch_size=bs,
                         cores=cores, min_speedup=min_speedup), ""


def _handle_paths(dataset: Any, max_depth: int) -> set:
    paths = set()
    walker = _walk(dataset, max_depth)
    try:
        path, obj, _ = next(walker)
        while True:
            leaf = _handle_info(obj) is not None
            if leaf:
                paths.add(path)
            path, obj, _ = walker.send(not leaf)
    except StopIteration:
        pass
    return paths


def diagnose(
    dataset: Any,
    *,
    sample_items: int = 0,
    container_threshold: int = 1000,
    max_depth: int = 4,
    check_threads: bool = False,
) -> DiagnosisReport:
    """Check a map-style Dataset for the known DataLoader hazards.

    Args:
        dataset: any object (typically a ``torch.utils.data.Dataset``).
        sample_items: fetch this many items (evenly spaced over ``len(dataset)``) before
            inspecting, which reports items that raise and handles that ``__getitem__``
            opens in this process (a DataLoader forked afterwards inherits them).
        container_threshold: Python containers with at least this many elements are
            reported.
        max_depth: how deep to follow attributes and container elements.
        check_threads: also time loading with one thread worker and with two
            (:func:`check_thread_workers`, about 2 s at most; after the inspection, whose
            findings it cannot change): ``.threads`` says whether the dataset holds the GIL
            while it loads. Advice, not a hazard.

    Returns:
        DiagnosisReport: ``.hazards`` (each with a fix), ``.ok``, ``.notes``; ``str()``
        renders a readable report.
    """
    klass = type(dataset)
    report = DiagnosisReport(dataset_type=f"{klass.__module__}.{klass.__qualname__}")
    before: set | None = None
    if sample_items > 0:
        before = _handle_paths(dataset, max_depth)
        _sample(dataset, sample_items, report)

    found: list[Hazard] = []
    walker = _walk(dataset, max_depth)
    try:
        path, obj, owner = next(walker)
        while True:
            descend = True
            container = _container_hazard(path, obj, container_threshold)
            handle = _handle_info(obj)
            rng = _rng_info(obj)
            if container is not None:
                found.append(container)
                descend = False
            elif handle is not None:
                what, fix = handle
                if getattr(type(owner), "__fastdata_fork_safe__", False):
                    report.notes.append(
                        f"{path}: {what}, but {type(owner).__name__} declares it reopens "
                        "handles after fork"
                    )
                else:
                    detail = f"{what}; forked DataLoader workers inherit it"
                    if before is not None and path not in before:
                        detail += (" (opened by __getitem__ during this diagnosis: using the "
                                   "dataset in the main process before the workers fork "
                                   "hands them this handle)")
                    found.append(Hazard(OPEN_HANDLE, path, detail, fix))
                descend = False
            elif rng is not None:
                found.append(Hazard(
                    SHARED_RNG, path,
                    f"{rng} created before the workers start: every worker receives an "
                    "identical copy, so random augmentations repeat across workers unless a "
                    "worker_init_fn reseeds this object (pytorch/pytorch#5059)",
                    _RNG_FIX,
                ))
                descend = False
            path, obj, owner = walker.send(descend)
    except StopIteration:
        pass

    size, err = _pickle_size(dataset)
    report.pickled_bytes = size
    if err is None:
        assert size is not None  # _pickle_size returns a size exactly when pickling raised nothing
        report.notes.append(
            f"pickles to {_fmt_bytes(size)}: spawn/forkserver send this to every worker"
        )
    else:
        culprits = _locate_unpicklable(dataset, "", max_depth) or [("", dataset, err)]
        for path, value, exc in culprits:
            found.append(Hazard(
                UNPICKLABLE, path,
                f"{type(value).__name__} cannot be pickled ({type(exc).__name__}: {exc}); "
                "spawn/forkserver (macOS default; Linux default from Python 3.14) pickle the "
                "dataset into each worker, so the DataLoader fails there",
                _unpicklable_fix(value),
            ))

    report.hazards.extend(found)
    report.hazards.sort(key=lambda h: _KIND_ORDER.index(h.kind))  # stable: walk order within a kind
    if check_threads:
        report.threads, why = check_thread_workers(dataset)
        if report.threads is None:
            report.notes.append(f"thread workers not timed: {why}")
        else:
            t = report.threads
            report.notes.append(f"thread check: {t.batches} batches of {t.batch_size} in {t.one_thread_s:.3f} s "
                                f"with 1 thread, {t.two_threads_s:.3f} s with 2 ({t.cores} usable cores)")
    return report
