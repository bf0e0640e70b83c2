"""THE writer pipeline, shared by both backends.

Workflow for one destination (the caller holds the store lock):

1. The plan (``plan.py``) splits the input into shards; ``.fastdata-staging/plan.json``
   records its fingerprint so ``resume=True`` can refuse a changed source.
2. A pool of worker processes reads, validates and encodes chunks of inputs.
   What the inputs are is a :class:`ChunkSource`, which each input kind of
   :mod:`fastdata.writer.sources` provides (image folders and ``path,label`` lists,
   JSONL/CSV tables, map-style datasets read by index range in the workers,
   iterables chunked by the caller); everything below is shared by all of them.
   ``workers=0`` runs the chunks in this process (no worker process at all). The main
   process submits chunks in store order with a bounded window (memory stays flat
   whatever the dataset size) and consumes results in the same order, so the store
   order is the input order for any worker count. A worker that dies breaks the pool: we raise, never hang.
3. Each shard is written by its own backend writer to ``<name>.tmp``; when its
   last chunk is in, the writer syncs and closes, the file is renamed to its
   final name, checksummed, and a sidecar ``<name>.json`` is written atomically
   into staging. A sidecar is the only proof a shard is complete: a crash at any
   earlier moment leaves a shard that resume rewrites.
4. Publishing gathers the sidecars in shard order, writes ``rejected.tsv`` and
   finally ``manifest.json`` (atomic rename + directory fsync), then removes staging.

A :class:`ShardSink`, passed as an argument (``sink=``), also receives each finished
shard, decides which shards an earlier run finished, and publishes after the local
manifest is written: a URL destination uploads through one (:mod:`fastdata.writer.remote_sink`).
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures as cf
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Protocol

from fastdata._version import __version__
from fastdata.common import portable
from fastdata.common.fileio import ATOMIC_TMP_MARK, atomic_write, file_checksum, fsync_dir, read_regular
from fastdata.common.units import format_size
from fastdata.errors import ConversionError, FastdataError, RejectedInputError, ResumeMismatchError
from fastdata.format.added import FIELD_FILES_KEY, FIELDS_STAGING_DIR, is_field_file_name
from fastdata.format.backends.base import Sample, StorageSpec
from fastdata.format.backends.registry import reader_class, writer_class
from fastdata.format.fields import Schema
from fastdata.format.manifest import STORE_FORMAT, STORE_VERSION, STORE_VERSION_2, write_manifest
from fastdata.format.names import (
    LISTING_FILE,
    MANIFEST_NAME,
    NUMBERING_FILE,
    PLAN_FILE,
    REJECTED_NAME,
    STAGING_DIR,
    STORE_INDEX_NAME,
    TMP_SUFFIX,
    is_store_index_name,
    shard_name,
    shard_number,
    store_index_name,
)
from fastdata.format.record import EncodedSample  # noqa: F401  (named in docstrings; what general sources produce)
from fastdata.format.store_index import MANIFEST_KEY as STORE_INDEX_KEY
from fastdata.format.store_index import build_store_index, encode_shard_index, sidecar_path
from fastdata.format.store_index import manifest_entry as store_index_entry
from fastdata.writer.ingest import SPILL_PREFIX, SPILL_SUFFIX, IngestedSample, unspill
from fastdata.writer.mainless import is_mainless, pool_context, refers_to_main
from fastdata.writer.owned import (
    MARKER_NAME,
    check_dir,
    check_entries,
    create_file,
    ensure_dir,
    remove_dir,
    remove_file,
)
from fastdata.writer.plan import ShardPlan

#: the "source" fastdata.write records (in the manifest's options and the staging plan)
WRITE_SOURCE = "fastdata.write"
#: most bytes a staging record (plan.json, a shard's result sidecar) may hold
MAX_RECORD_BYTES = 64 << 20


@dataclass
class ShardResult:
    """What a finished shard contributes to the manifest (also its sidecar)."""

    shard_id: int
    name: str
    count: int
    bytes: int
    xxh: str
    image_bytes: int
    input_bytes: int
    class_counts: list[int]
    rejected: list[list[str]]
    #: [relpath, warning] for inputs kept with a remark (e.g. a PNG named .jpg);
    #: a default so sidecars written before this field existed still load
    warnings: list[list[str]] = field(default_factory=list)
    resumed: bool = False

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("resumed")
        return d


@dataclass
class PipelineStats:
    """What a pipeline run gives the report: the bytes it read and the results of the shards it wrote."""

    input_bytes: int = 0
    results: list = field(default_factory=list)


class ShardSink(Protocol):
    """Where finished shards go besides the local destination directory (e.g. a remote store:
    :class:`fastdata.writer.remote_sink.RemoteDestination`). Passed as ``sink=`` to :func:`run_shards`,
    :func:`load_finished` and :func:`publish`, which call it."""

    def start(self, dst: str) -> None:
        """The pipeline is about to write shards into ``dst`` (its staging plan is written)."""

    def shard_finished(self, dst: str, result: ShardResult) -> None:
        """Shard ``result.name`` and its sidecars are complete in ``dst`` (may block to bound
        how many finished shards wait)."""

    def drain(self) -> None:
        """Wait until every finished shard is handled; raise the first failure."""

    def abort(self) -> None:
        """The run failed: stop handling shards (never raises)."""

    def load_finished(self, dst: str, backend: str, plans: list[ShardPlan]) -> dict[int, ShardResult]:
        """The shards of ``plans`` already finished where the sink keeps them (sidecars into ``dst``'s staging)."""

    def publish(self, dst: str) -> None:
        """``dst`` now holds the store index, rejected.tsv and manifest.json: make them visible."""




def staging_path(dst: str, *parts: str) -> str:
    return os.path.join(dst, STAGING_DIR, *parts)


def staging_made(name: str) -> bool:
    """Whether ``name`` is a file a conversion writes in its staging folder (what clearing a
    staging folder of an older fastdata, which wrote no marker, may delete)."""
    return (name in (PLAN_FILE, MARKER_NAME, LISTING_FILE) or (name.startswith("shard-") and name.endswith(
        (".json", ".index"))) or ATOMIC_TMP_MARK in name or (name.startswith(SPILL_PREFIX) and name.endswith(
            SPILL_SUFFIX)))


def remove_staging(dst: str, ignore_errors: bool = False) -> None:
    """Delete ``dst``'s staging folder: only a real directory carrying the marker the
    converter wrote (see :mod:`fastdata.writer.owned`), or an older fastdata's holding only
    the files a conversion writes there."""
    remove_dir(staging_path(dst), legacy=staging_made, ignore_errors=ignore_errors)


def prepare_staging(dst: str, fingerprint: str, resume: bool, source: str | None = None,
                    first_shard: int = 0) -> str:
    """Create staging for a new run, or check it matches when resuming. ``source`` (if
    given) is recorded next to the fingerprint, for messages about an unfinished run, and
    ``first_shard`` (a store's first shard number, past shards left in use: see
    :func:`clear_store`) beside it, for a resume to number the shards as the run did
    (:func:`recorded_first_shard`).
    Returns the token of the staging folder's marker (kept by a resume)."""
    plan_path = staging_path(dst, PLAN_FILE)
    if resume and check_dir(staging_path(dst)) and os.path.lexists(plan_path):
        try:
            previous = json.loads(read_regular(plan_path, MAX_RECORD_BYTES, "staging plan")).get("fingerprint")
        except (ValueError, AttributeError):
            previous = None
        except OSError as err:
            raise io_error(err, plan_path) from err
        if previous != fingerprint:
            raise ResumeMismatchError(
                f"{dst}: cannot resume: the source files or options differ from the interrupted run "
                "(a file was added, removed or changed, or an option differs); rerun with overwrite=True to start over"
            )
        try:
            return ensure_dir(staging_path(dst))
        except OSError as err:
            raise io_error(err, staging_path(dst)) from err
    try:
        token = ensure_dir(staging_path(dst))
        plan = {"fingerprint": fingerprint, **({"source": source} if source else {})}
        atomic_write(plan_path, json.dumps(plan).encode())
        if first_shard:
            atomic_write(staging_path(dst, NUMBERING_FILE), json.dumps({"first_shard": first_shard}).encode())
    except OSError as err:
        raise io_error(err, plan_path) from err
    return token


def recorded_first_shard(dst: str) -> int:
    """The first shard number the run staged in ``dst`` recorded (:func:`prepare_staging`): 0 when
    none was recorded (every run but an overwrite that left shards in use)."""
    try:
        numbering = json.loads(read_regular(staging_path(dst, NUMBERING_FILE), 4096, "staging numbering"))
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as err:
        raise ConversionError(f"{dst}: the staged run's {NUMBERING_FILE} does not read ({err}); rerun with "
                              "overwrite=True") from None
    first = numbering.get("first_shard") if isinstance(numbering, dict) else None
    if type(first) is not int or not 0 < first < 10**5:
        raise ConversionError(f"{dst}: the staged run's {NUMBERING_FILE} holds no shard number; rerun with "
                              "overwrite=True")
    return first


def io_error(err: Exception, where: str) -> ConversionError:
    """A :class:`ConversionError` naming the file, the cause of an I/O failure and
    the free space left (LMDB reports a full disk as a short write, i.e. EIO)."""
    path = getattr(err, "filename", None) or where
    try:
        st = os.statvfs(os.path.dirname(os.fsdecode(path)) or ".")
        free = f" ({format_size(st.f_bavail * st.f_frsize)} free on that filesystem)"
    except OSError:
        free = ""
    return ConversionError(
        f"I/O error while writing {path}: {getattr(err, 'strerror', None) or err}{free}; "
        "nothing incomplete was published: fix the cause (e.g. free disk space) and rerun with resume=True"
    )


def remove_temporaries(dst: str) -> None:
    """Delete half-written shards and manifests left by an interrupted run (regular files
    only: anything else there is refused, see :func:`fastdata.writer.owned.remove_file`)."""
    for name in os.listdir(dst):
        if name.endswith(TMP_SUFFIX) or ATOMIC_TMP_MARK in name or name.endswith(TMP_SUFFIX + "-lock"):
            remove_file(os.path.join(dst, name))
    staging = staging_path(dst)
    if check_dir(staging):
        for name in os.listdir(staging):
            if (name.startswith(SPILL_PREFIX) and name.endswith(SPILL_SUFFIX)) or ATOMIC_TMP_MARK in name:
                remove_file(os.path.join(staging, name))


def load_finished(dst: str, backend: str, plans: list[ShardPlan], verify_files: bool = True,
                  first_shard: int = 0, sink: ShardSink | None = None) -> dict[int, ShardResult]:
    """Shards whose sidecar exists and whose file still matches it (size, and the
    whole-file checksum unless ``verify_files`` is False: for shards this run just wrote),
    keyed by shard number (a plan's ``shard_id`` plus ``first_shard``: an append numbers its
    shards after the store's). With a ``sink``, the sink decides (e.g. the remote objects)."""
    if sink is not None:
        return sink.load_finished(dst, backend, [ShardPlan(p.shard_id + first_shard, p.start, p.stop)
                                                 for p in plans])
    done: dict[int, ShardResult] = {}
    for plan in (ShardPlan(p.shard_id + first_shard, p.start, p.stop) for p in plans):
        name = shard_name(backend, plan.shard_id)
        side = staging_path(dst, name + ".json")
        path = os.path.join(dst, name)
        try:
            info = json.loads(read_regular(side, MAX_RECORD_BYTES, "shard sidecar"))
            result = ShardResult(**info, resumed=True)
            st = os.lstat(path)
            if (stat.S_ISREG(st.st_mode) and st.st_size == result.bytes
                    and (not verify_files or file_checksum(path) == result.xxh)):
                done[plan.shard_id] = result
                continue
        except (OSError, ValueError, TypeError):
            pass
        for stale in (side, path):
            remove_file(stale)
    return done


class _ShardInProgress:
    def __init__(self, dst: str, backend: str, plan: ShardPlan, storage: StorageSpec, num_classes: int,
                 writer_options: dict, schema: Schema | None = None, first_shard: int = 0):
        self.plan = plan
        #: the shard's number in the store (an append's shards come after the store's own)
        self.shard_id = plan.shard_id + first_shard
        self.name = shard_name(backend, self.shard_id)
        self.final_path = os.path.join(dst, self.name)
        self.tmp_path = self.final_path + TMP_SUFFIX
        # created here (O_EXCL | O_NOFOLLOW) so the backend's writer opens a file we made,
        # never a symlink planted at that name
        remove_file(self.tmp_path)
        os.close(create_file(self.tmp_path))
        try:
            self.writer = writer_class(backend)(self.tmp_path, storage, schema=schema, **writer_options)
        except BaseException:
            remove_file(self.tmp_path)
            raise
        self.pending = 0
        self.count = 0
        self.image_bytes = 0
        self.input_bytes = 0
        self.class_counts = [0] * num_classes
        self.rejected: list[list[str]] = []
        self.warnings: list[list[str]] = []

    def add(self, samples: list) -> None:
        """Append :class:`Sample` objects (classification) or :class:`EncodedSample` objects (general)."""
        self.writer.put(samples)
        for s in samples:
            if isinstance(s, Sample):
                self.class_counts[s.label] += 1
                self.image_bytes += len(s.image)
            else:
                self.image_bytes += len(s.record)
        self.count += len(samples)

    def finish(self, dst: str) -> ShardResult:
        """Sync, close and rename the shard, then write its sidecars: its index (for the
        store index file) and its result (the proof it is complete, written last)."""
        index = self.writer.close()
        os.replace(self.tmp_path, self.final_path)
        sidecar = staging_path(dst, self.name + ".json")
        index_sidecar = sidecar_path(staging_path(dst), self.name)
        try:
            fsync_dir(dst)
            atomic_write(index_sidecar, encode_shard_index(index))
            result = ShardResult(
                shard_id=self.shard_id, name=self.name, count=self.count,
                bytes=os.path.getsize(self.final_path), xxh=file_checksum(self.final_path),
                image_bytes=self.image_bytes, input_bytes=self.input_bytes,
                class_counts=self.class_counts, rejected=self.rejected, warnings=self.warnings,
            )
            atomic_write(sidecar, json.dumps(result.to_json()).encode())
        except BaseException:
            # After a failed fsync the kernel may already have dropped the dirty pages
            # ("fsyncgate"): never trust this shard; resume rewrites it from the source.
            for path in (sidecar, index_sidecar, self.final_path):
                try:
                    remove_file(path)
                except (OSError, FastdataError):
                    pass
            raise
        return result

    def abort(self) -> None:
        self.writer.abort()
        for path in (self.tmp_path, self.tmp_path + "-lock"):
            remove_file(path)


@dataclass(frozen=True)
class Chunk:
    """Inputs ``start .. stop-1`` (store order) of shard ``plan``; ``last`` when the shard
    ends with it; ``args`` what the source's worker function receives for it."""

    plan: ShardPlan
    start: int
    stop: int
    last: bool
    args: tuple


class ChunkSource(abc.ABC):
    """What feeds the pipeline: chunks of inputs in store order, and the module-level
    function a worker process turns one chunk into stored items with.

    ``worker(*chunk.args, spill_dir)`` returns ``(items, input_bytes)``, ``items`` one
    per input: a :class:`Sample` or :class:`EncodedSample` to store, or a rejection
    reason (``str``); with a ``spill_dir`` the list comes back spilled
    (:func:`fastdata.writer.ingest.spill`). An error it raises stops the whole run.
    """

    #: the worker function (module level, so that it pickles by name)
    worker: Callable
    #: ``(function, args)`` run once in each worker process before any chunk, or None; with
    #: ``workers=0`` it runs in this process, and afterwards again with every argument None
    #: (so that the function lets go of what it was given)
    worker_init: tuple[Callable, tuple] | None = None

    @abc.abstractmethod
    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        """The chunks of the shards ``plans`` (None: a source that makes its shards as it goes), in store order."""

    @abc.abstractmethod
    def describe(self, start: int, stop: int) -> str:
        """Which inputs a chunk holds, for messages (e.g. the first and last file)."""

    @abc.abstractmethod
    def input_name(self, i: int) -> str:
        """The name input ``i`` is reported under (rejected.tsv, warnings)."""

    def input_path(self, i: int) -> str:
        """Where input ``i`` is, for the message that stops a ``strict=True`` run (default: its name)."""
        return self.input_name(i)

    def runs_in_main_first(self, chunk: Chunk) -> bool:
        """Whether the main process may ingest ``chunk`` itself while the pool starts."""
        return False

    @contextlib.contextmanager
    def in_this_process(self) -> Iterator[None]:
        """Make this process a worker for the block (``workers=0``): :attr:`worker_init` runs
        here first, and again with every argument None when the block ends."""
        if self.worker_init is None:
            yield
            return
        init, args = self.worker_init
        init(*args)
        try:
            yield
        finally:
            init(*(None for _ in args))


def _single_threaded() -> bool:
    """True when this process has exactly one OS thread (counts native threads too, e.g. a
    torch or OpenMP pool, which ``threading`` cannot see); False where that is unknown."""
    return portable.native_thread_count() == 1


def _mp_context():
    """fork when that is safe, else forkserver (else spawn).

    fork copies a lock held by another thread in a locked state forever, so it is
    only safe in a single-threaded process; there it starts the pool in
    milliseconds, where a forkserver first imports fastdata in a fresh
    interpreter (~0.3 s, 8% of converting 3000 images with one worker). The pool
    starts before any shard writer is open, so no LMDB/HDF5 handle is inherited,
    and the store lock closes its descriptor in children (``lock.py``).
    """
    methods = multiprocessing.get_all_start_methods()
    if sys.platform == "linux" and "fork" in methods and _single_threaded():
        return multiprocessing.get_context("fork")
    # forkserver: no inherited threads or handles from the (possibly threaded) caller
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["fastdata.writer.ingest", "psutil", *sorted(_WORKER_MODULES)])
    return ctx


#: modules the workers of this process's pools import besides the ingest module (a remote
#: source's filesystem library: s3fs and botocore take a second to import), added by
#: :func:`prestart_pool`; a forkserver started after that imports them once for every worker
_WORKER_MODULES: set[str] = set()


def prestart_pool(modules: tuple[str, ...] = ()) -> None:
    """Start the forkserver (if the pool will use one) without waiting for it, so
    its ~0.3 s of imports (and those of ``modules``, which the workers will need) overlap the
    source scan instead of following it."""
    _WORKER_MODULES.update(modules)
    if _mp_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _exit_with_converter(converter_pid: int, interval: float = 0.25) -> None:
    """Worker initializer: exit as soon as the converter process is gone.

    A converter killed with SIGKILL (or by the OOM killer) cannot stop its pool,
    and an idle worker blocks on the task queue forever (it holds a write end of
    that pipe itself, so it never sees EOF), keeping the forkserver alive too.
    A daemon thread polls the converter and ends the worker instead.
    """
    import psutil

    def watch() -> None:
        try:
            converter = psutil.Process(converter_pid)
            while converter.is_running() and converter.status() != psutil.STATUS_ZOMBIE:
                time.sleep(interval)
        except psutil.Error:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="fastdata-converter-watch", daemon=True).start()


def _init_worker(converter_pid: int, extra: tuple[Callable, tuple] | None) -> None:
    """Worker initializer: the converter watchdog, then the source's own set-up."""
    _exit_with_converter(converter_pid)
    if extra is not None:
        extra[0](*extra[1])


class _PoolStart(threading.Thread):
    """The thread :func:`_start_in_background` starts; ``started_pool`` is set when its work is done.

    The converter waits for that event rather than joining the thread: on Python 3.12.1 a join of
    this thread once hung for good (the thread stopped, its state lock never released), under load."""

    def __init__(self, executor: cf.ProcessPoolExecutor) -> None:
        super().__init__(name="fastdata-pool-start", daemon=True)
        self.executor = executor
        self.started_pool = threading.Event()

    def run(self) -> None:
        try:
            self.executor.submit(os.getpid).result()
        except BaseException:  # noqa: BLE001 - a broken pool is reported by the next submit
            pass
        finally:
            self.started_pool.set()

    def finish(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) until the pool's first worker has started, or failed to."""
        self.started_pool.wait(timeout)


def _start_in_background(executor: cf.ProcessPoolExecutor) -> _PoolStart:
    """Start the pool's first worker from a thread: with forkserver, the first
    ``submit`` blocks until the server has imported fastdata and forked (it forks,
    not this process, so a thread here is safe). A broken pool is left for the
    next ``submit`` to report."""
    thread = _PoolStart(executor)
    thread.start()
    return thread


#: What makes the worker pool of :func:`run_shards` (``executor_factory=``): called with the
#: keywords of :class:`concurrent.futures.ProcessPoolExecutor` (``max_workers``, ``mp_context``,
#: ``initializer``, ``initargs``), it returns the executor the chunks are submitted to. A
#: :class:`~concurrent.futures.ProcessPoolExecutor` (or a subclass) is started in the background
#: and stopped as the default pool is; any other executor is shut down without waiting. The
#: argument exists so that a caller (or a test counting or failing pools) supplies its own pool
#: without replacing ``concurrent.futures.ProcessPoolExecutor`` for the whole process.
ExecutorFactory = Callable[..., cf.Executor]


class _InProcess:
    """An executor that runs each task at once in this process (``workers=0``)."""

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as err:  # re-raised by result(), as a pool would
            fut.set_exception(err)
        return fut


def run_shards(
    *,
    dst: str,
    backend: str,
    source: ChunkSource,
    plans: list[ShardPlan] | None,
    storage: StorageSpec,
    workers: int,
    strict: bool,
    writer_options: dict,
    on_progress: Callable[[int, int, int], None] | None = None,
    schema: Schema | None = None,
    num_classes: int = 0,
    first_shard: int = 0,
    sink: ShardSink | None = None,
    executor_factory: ExecutorFactory | None = None,
) -> PipelineStats:
    """Write the shards ``plans`` (None: those ``source`` makes as it goes) that ``source`` feeds into ``dst``.

    ``schema`` is None for a classification (version-1) store of ``num_classes`` classes,
    else the general store's schema (its writers take :class:`EncodedSample` objects).
    ``workers=0`` runs every chunk in this process (no worker process is started).
    ``on_progress(images, rejected, input_bytes)`` is called after each chunk. Raises
    :class:`ConversionError` on a dead worker or an I/O error, :class:`RejectedInputError`
    in strict mode, and any error a worker raises (e.g. a
    :class:`~fastdata.format.fields.SchemaError`) as it is. Plan ``k`` is written as shard
    ``first_shard + k`` (an append numbers its shards after the store's). ``sink``, when given, is
    told of each finished shard (:class:`ShardSink`: e.g. an upload to a URL).
    ``executor_factory`` makes the worker pool when ``workers > 0`` (see :data:`ExecutorFactory`;
    None: :class:`concurrent.futures.ProcessPoolExecutor`); ``workers=0`` never calls it.
    """
    if plans is not None and not plans:
        return PipelineStats()  # nothing left to write (a resume of finished shards): no pool to start
    if workers == 0:
        with source.in_this_process():
            return _run_shards(dst, backend, source, plans, storage, 0, strict, writer_options, on_progress, schema,
                               num_classes, first_shard, sink)
    return _run_shards(dst, backend, source, plans, storage, workers, strict, writer_options, on_progress, schema,
                       num_classes, first_shard, sink, executor_factory)


def _run_shards(dst: str, backend: str, source: ChunkSource, plans: list[ShardPlan] | None, storage: StorageSpec,
                workers: int, strict: bool, writer_options: dict,
                on_progress: Callable[[int, int, int], None] | None, schema: Schema | None,
                num_classes: int, first_shard: int = 0, sink: ShardSink | None = None,
                executor_factory: ExecutorFactory | None = None) -> PipelineStats:
    stats = PipelineStats()
    window = max(2, workers * 4)
    spill_dir = staging_path(dst)
    ensure_dir(spill_dir)
    open_shards: dict[int, _ShardInProgress] = {}
    io_errors: tuple[type[Exception], ...] = (OSError, *writer_class(backend).io_errors)
    ctx = _mp_context()
    executor: cf.Executor | _InProcess
    if workers == 0:
        executor, spill_to = _InProcess(), None
    else:
        # children that skip re-running the caller's script when nothing sent to them needs it:
        # a fastdata.write/convert at a script's top level then works without the __main__ guard
        ctx = pool_context(ctx, (source.worker, source.worker_init))
        make_pool = executor_factory if executor_factory is not None else cf.ProcessPoolExecutor
        executor = make_pool(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(os.getpid(), source.worker_init))
        spill_to = spill_dir
    mainless = is_mainless(ctx)
    inflight: collections.deque = collections.deque()
    if sink is not None:
        sink.start(dst)
    source_chunks = source.chunks(plans)
    current_files = ""
    writing = dst  # the file being written when an I/O error strikes
    starting: _PoolStart | None = None
    try:
        def submit_next() -> bool:
            nxt = next(source_chunks, None)
            if nxt is None:
                return False
            if mainless and source.worker_init is None and refers_to_main(nxt.args):
                # samples of classes the script defines: workers that skipped the script cannot
                # unpickle them, so this chunk is encoded here (in order, as any other)
                inflight.append((nxt, _InProcess().submit(source.worker, *nxt.args, spill_to)))
            else:
                inflight.append((nxt, executor.submit(source.worker, *nxt.args, spill_to)))
            return True

        def consume(chunk: Chunk, results: list, read_bytes: int) -> None:
            nonlocal writing
            plan, a = chunk.plan, chunk.start
            shard = open_shards.get(plan.shard_id)
            if shard is None:
                writing = os.path.join(dst, shard_name(backend, plan.shard_id + first_shard)) + TMP_SUFFIX
                shard = open_shards[plan.shard_id] = _ShardInProgress(
                    dst, backend, plan, storage, num_classes, writer_options, schema, first_shard)
            writing = shard.tmp_path
            samples = []
            for offset, item in enumerate(results):
                if not isinstance(item, str):
                    samples.append(item)
                    if isinstance(item, IngestedSample) and item.warning:
                        shard.warnings.append([source.input_name(a + offset), item.warning])
                    continue
                rel = source.input_name(a + offset)
                if strict:
                    where = source.input_path(a + offset)
                    raise RejectedInputError(
                        f"{where}: {item} "
                        "(strict=True stops at the first unusable input; without it such files are skipped and "
                        "reported)")
                shard.rejected.append([rel, item])
            shard.add(samples)
            shard.input_bytes += read_bytes
            stats.input_bytes += read_bytes
            if chunk.last:
                # pop only after finish succeeds: a failed finish must still be aborted and named
                stats.results.append(shard.finish(dst))
                del open_shards[plan.shard_id]
                if sink is not None:
                    sink.shard_finished(dst, stats.results[-1])
            if on_progress:
                on_progress(len(samples), len(results) - len(samples), read_bytes)

        # While the pool starts (a fresh forkserver first imports fastdata: ~0.3 s),
        # the converter ingests the first chunks itself instead of waiting, when the
        # source says that is safe (see ChunkSource.runs_in_main_first).
        if isinstance(executor, cf.ProcessPoolExecutor) and ctx.get_start_method() != "fork":
            starting = _start_in_background(executor)
        while starting is not None and not starting.started_pool.is_set():
            nxt = next(source_chunks, None)
            if nxt is None:
                break
            if not source.runs_in_main_first(nxt):
                source_chunks = itertools.chain([nxt], source_chunks)  # the pool takes it first
                break
            current_files = source.describe(nxt.start, nxt.stop)
            consume(nxt, *source.worker(*nxt.args, None))
        if starting is not None:
            starting.finish()
            starting = None
        while len(inflight) < window and submit_next():
            pass
        while inflight:
            chunk, fut = inflight.popleft()
            current_files = source.describe(chunk.start, chunk.stop) if chunk.stop > chunk.start else ""
            results, read_bytes = fut.result()
            if spill_to is not None:
                results = unspill(results)
            submit_next()
            consume(chunk, results, read_bytes)
        if sink is not None:
            sink.drain()
            sink = None  # drained: nothing to abort
    except BrokenProcessPool:
        raise ConversionError(
            f"a conversion worker died unexpectedly (killed, or out of memory?) "
            f"{f'while reading {current_files}' if current_files else 'while starting'}; "
            "finished shards are kept: rerun the same command with resume=True."
            + ("" if mainless else " (Calling fastdata.convert or write from a script whose samples need it, e.g. a "
               "Dataset class defined there? Workers then import your main module: put the call under "
               "`if __name__ == \"__main__\":`.)")
        ) from None
    except io_errors as err:
        raise io_error(err, writing) from err
    finally:
        if sink is not None:
            sink.abort()
        for shard in open_shards.values():
            shard.abort()
        if starting is not None:
            # stopping early: let it finish starting what it started, but never wait
            # long (a worker it starts after this is still ended by its watchdog
            # when the converter exits)
            starting.finish(timeout=10)
        if isinstance(executor, cf.ProcessPoolExecutor):
            _stop_pool(executor)
        elif isinstance(executor, cf.Executor):  # a factory's other executor: its own shutdown, not waiting
            executor.shutdown(wait=False, cancel_futures=True)
    return stats


def _stop_pool(executor: cf.ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting on work we no longer want, and without hanging.

    A worker terminated while sending a result leaves a partial message in the
    result pipe: the executor's manager thread then blocks in ``recv`` forever,
    and so does the interpreter at exit, when it joins that thread. Closing the
    parent's copy of that pipe's write end once the workers are gone turns the
    read into EOF, which the manager handles as a broken pool and exits.
    """
    # shutdown() drops these references: take them first
    processes = list((getattr(executor, "_processes", None) or {}).values())
    writer = getattr(getattr(executor, "_result_queue", None), "_writer", None)
    manager = getattr(executor, "_executor_manager_thread", None)
    executor.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if writer is not None:
        try:
            writer.close()
        except OSError:
            pass
    if manager is not None:
        manager.join(timeout=10)


@dataclass
class PublishedBase:
    """The published store an append (or a merge) adds shards to: its manifest, and its shards'
    entries of the store index file (``(name, encode_shard_index bytes)``), carried into the new
    version's index file as they are."""

    manifest: dict
    index_entries: list[tuple[str, bytes]]

    @property
    def generation(self) -> int:
        """The version number of the store index file it lists (0: ``index.fdi``)."""
        name = (self.manifest.get(STORE_INDEX_KEY) or {}).get("name", STORE_INDEX_NAME)
        return 0 if name == STORE_INDEX_NAME else int(name[len("index-"):-len(".fdi")])


def publish(*, dst: str, backend: str, classes: list[str], remarks: list[tuple[str, str]], storage: StorageSpec,
            results: list[ShardResult], options: dict, schema: Schema | None = None, extra: dict | None = None,
            base: PublishedBase | None = None, sink: ShardSink | None = None,
            field_files: dict[str, list[dict]] | None = None) -> dict:
    """Write ``rejected.tsv``, the store index file and then ``manifest.json`` (last); remove staging.

    ``schema`` None publishes a classification store (layout version 1) of ``classes``; a
    schema publishes a general store (version 2; ``classes``: its single-label field's table,
    or empty). ``remarks`` are ``(path, warning)`` pairs about the input as a whole (empty class
    folders, folders named like splits, ...), listed before the per-input warnings of the shards.
    ``extra`` adds top-level manifest keys (e.g. ``class_tables``).

    ``base`` (an append): the published store whose shards, class counts, rejected inputs and
    warnings come first; ``classes`` then extends its table (the same names first). The new
    version's index file gets the next generation's name (``index-00001.fdi``, ...) so the
    file the current manifest lists is never replaced: a crash before the new manifest is in
    place leaves the store as it was, and a reader of the old version reads on. Index files of
    versions before the previous one are then deleted.

    ``field_files`` (an append to a store with added fields): each new shard's field file
    entries, the files already written beside it (see :func:`fastdata.writer.append.write_added_field_files`)."""
    results = sorted(results, key=lambda r: r.shard_id)
    shards, first = [], 0
    classes = list(classes)
    class_counts = [0] * len(classes)
    rejected: list[dict[str, str]] = []
    warnings = [{"path": p, "warning": why} for p, why in remarks]
    if base is not None:
        old = base.manifest
        shards = [dict(entry) for entry in old["shards"]]
        first = int(old["num_samples"])
        class_counts[:len(old["class_counts"])] = old["class_counts"]
        rejected = list(old["rejected"])
        warnings = list(old["warnings"]) + warnings
    for r in results:
        shards.append({"name": r.name, "first_index": first, "count": r.count, "bytes": r.bytes,
                       "xxh": r.xxh, "image_bytes": r.image_bytes})
        if field_files is not None:
            shards[-1][FIELD_FILES_KEY] = field_files[r.name]
        first += r.count
        class_counts = [x + y for x, y in zip(class_counts, r.class_counts, strict=False)]
        rejected.extend({"path": p, "reason": why} for p, why in r.rejected)
        warnings.extend({"path": p, "warning": why} for p, why in r.warnings)
    tsv = "path\treason\n" + "".join(
        f"{_tsv_field(item['path'])}\t{_tsv_field(item['reason'])}\n" for item in rejected)
    body = {
        "format": STORE_FORMAT,
        # (an append keeps its store's version: e.g. 3, a merged store whose shards carry label maps)
        "version": base.manifest["version"] if base is not None else STORE_VERSION if schema is None else
        STORE_VERSION_2,
        "backend": backend,
        "storage": storage.to_json(),
        "classes": classes,
        "num_samples": first,
        "class_counts": class_counts,
        "shards": shards,
        "rejected": rejected,
        "warnings": warnings,
        "options": dict(options, fastdata_version=__version__),
    }
    if schema is not None:
        body["schema"] = schema.to_json()
    body.update(extra or {})
    generation = base.generation + 1 if base is not None else 0
    index_name = store_index_name(generation)
    try:
        kept = base.index_entries if base is not None else []
        index_file = build_store_index(itertools.chain(
            kept, ((r.name, shard_index_bytes(dst, backend, r.name, schema)) for r in results)))
        atomic_write(os.path.join(dst, index_name), index_file)
        body[STORE_INDEX_KEY] = store_index_entry(index_file, index_name)
        atomic_write(os.path.join(dst, REJECTED_NAME), tsv.encode("utf-8", "surrogateescape"))
        manifest = write_manifest(dst, body)
    except OSError as err:
        raise io_error(err, os.path.join(dst, MANIFEST_NAME)) from err
    for older in range(generation - 1):  # (the previous version's stays: a reader may be opening it)
        with contextlib.suppress(OSError, FastdataError):
            remove_file(os.path.join(dst, store_index_name(older)))
    if sink is not None:
        sink.publish(dst)
    try:
        remove_staging(dst, ignore_errors=True)
    except FastdataError:
        pass  # (checked when the run started: only a swap since leaves it, and it is left alone)
    return manifest


def shard_index_bytes(dst: str, backend: str, name: str, schema: Schema | None) -> bytes:
    """A finished shard's index for the store index file: its staging sidecar, or (a shard
    finished by an older fastdata, which wrote none) read back from the shard itself."""
    try:
        with open(sidecar_path(staging_path(dst), name), "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        with reader_class(backend)(os.path.join(dst, name), StorageSpec(), schema=schema) as reader:
            return encode_shard_index(reader.read_index())


def count_labels(dst: str, backend: str, results: list[ShardResult], schema: Schema, classes: int,
                 field: str = "label") -> None:
    """Set each finished shard's ``class_counts`` from the int field ``field`` of its index sidecar
    (rejected inputs are not in it), for general stores whose sources know the class of each sample."""
    import numpy as np

    from fastdata.format.record import FIELD_PREFIX, SampleIndex
    from fastdata.format.store_index import decode_shard_index

    for r in results:
        index = decode_shard_index(shard_index_bytes(dst, backend, r.name, schema), schema, r.name)
        assert isinstance(index, SampleIndex), "a general store's shards hold a SampleIndex"
        labels = np.asarray(index.arrays[FIELD_PREFIX + field], dtype=np.int64)
        r.class_counts = np.bincount(labels, minlength=classes).tolist()


def _tsv_field(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def store_entries(dst: str) -> list[str]:
    """Names in ``dst`` that a conversion may create (and ``overwrite=True`` may delete)."""
    names = []
    for name in os.listdir(dst):
        if (name in (MANIFEST_NAME, REJECTED_NAME, STAGING_DIR, FIELDS_STAGING_DIR) or name.startswith("shard-")
                or is_store_index_name(name) or is_field_file_name(name) or ATOMIC_TMP_MARK in name):
            names.append(name)
    return names


def check_store_entries(dst: str) -> None:
    """Refuse a destination whose store entries (the manifest, shards, temporaries, the lock
    and the staging folder and its files) are anything but what a conversion makes there:
    a symlink, FIFO, device, or a folder where a file belongs (before anything is written).

    Raises:
        UnsafeStoreError: naming the entry.
    """
    names = store_entries(dst) + [n for n in os.listdir(dst) if n.startswith(".fastdata")
                                  and n not in (STAGING_DIR, FIELDS_STAGING_DIR)]
    check_entries(dst, sorted(set(names)), dirs=(STAGING_DIR, FIELDS_STAGING_DIR))


def clear_store(dst: str) -> list[str]:
    """Delete a previous store's files (``overwrite=True``); refuses on foreign files.

    Only what a conversion made is deleted: regular files of the store's names, and the
    staging folder when it carries the converter's marker (see :func:`remove_staging`);
    a symlink or anything else in their place is refused, never followed.

    The manifest goes first, durably (directory synced), so a run killed part-way
    through leaves an unfinished conversion, never a published store whose shards
    are gone.

    Where an open file cannot be deleted (Windows), a shard that a reader of the old store
    still holds open is left where it is: its reader keeps reading the old version, the new
    store's shards are numbered past it (:func:`first_free_shard`), and the next write of the
    store deletes it once it is closed (:func:`remove_unlisted_shards`).

    Returns:
        list[str]: the names of the shards left in use (always empty on Linux and macOS).
    """
    check_store_entries(dst)
    manifest = os.path.join(dst, MANIFEST_NAME)
    if os.path.lexists(manifest):
        _remove_soon(manifest)  # a reader may be reading it this instant (Windows)
        fsync_dir(dst)
    left = []
    for name in store_entries(dst):
        if name == STAGING_DIR:
            remove_staging(dst)
        elif name == FIELDS_STAGING_DIR:  # (an interrupted compute_fields: its staged field files)
            shutil.rmtree(os.path.join(dst, name))
        elif not _remove_unless_held(os.path.join(dst, name), shard_number(name) is not None):
            left.append(name)
    return left


def _remove_unless_held(path: str, may_stay: bool) -> bool:
    """Remove ``path``; False (it stays) when ``may_stay`` and a handle holds it open (Windows)."""
    if may_stay:
        return portable.remove_unless_held(remove_file, path)
    remove_file(path)
    return True


def _remove_soon(path: str, wait_s: float = 2.0) -> None:
    """Remove ``path``, retrying for ``wait_s`` while a handle holds it open (Windows: a reader
    reading a small file that it closes at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            remove_file(path)
            return
        except OSError as err:
            if not portable.held_open_elsewhere(err) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def first_free_shard(left: list[str]) -> int:
    """The number of a new store's first shard: 0, or one past the highest shard left in use
    (:func:`clear_store`), so that no new shard needs a name an open file still has."""
    return max((n for n in map(shard_number, left) if n is not None), default=-1) + 1


def remove_unlisted_shards(dst: str, listed: set[str]) -> list[str]:
    """Delete the shard files in ``dst`` that ``listed`` (a published manifest's shard names)
    does not name: an earlier version's, left in use by its readers (Windows), or an unfinished
    append's. One a handle still holds open stays, for the next write.

    Returns:
        list[str]: the names that stayed (in use).
    """
    left = []
    for name in os.listdir(dst):
        if shard_number(name) is not None and name not in listed:
            if not _remove_unless_held(os.path.join(dst, name), True):
                left.append(name)
    return left
