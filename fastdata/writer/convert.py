"""``fastdata.writer.convert``: the public conversion API (the CLI is a thin layer over it)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastdata.common.paths import check_local_path
from fastdata.common.units import Size, describe_size, format_size, parse_size, parse_size_spec
from fastdata.errors import FastdataError, ResumeMismatchError, SourceError, StoreExistsError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import backend_for_path
from fastdata.format.manifest import read_manifest
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR
from fastdata.writer.distributed import current_group
from fastdata.writer.lock import StoreLock, raise_if_locked
from fastdata.writer.pipeline import (
    PipelineStats,
    clear_store,
    load_finished,
    prepare_staging,
    prestart_pool,
    publish,
    remove_temporaries,
    run_shards,
    store_entries,
)
from fastdata.writer.plan import ShardPlan, estimated_sizes, plan_fingerprint, plan_shards
from fastdata.writer.report import ConvertReport, ProgressBar
from fastdata.writer.resume import (
    RecordedRun,
    RunOptions,
    option_differences,
    read_recorded_run,
    record_run,
    source_differences,
)
from fastdata.writer.sources.folder import check_destination_outside
from fastdata.writer.sources.folder import scan as scan_source

DEFAULT_SHARD_SIZE = "1GiB"
#: smallest --shard-size accepted: below it a store is thousands of tiny files to open and check.
#: FASTDATA_MIN_SHARD_SIZE lowers it (the test suite converts kilobyte-sized trees into several shards).
MIN_SHARD_SIZE = 1 << 20
#: most shards one conversion may make (each shard is a file a reader opens and maps)
MAX_SHARDS = 10_000
#: --workers above this many times the core count gets a warning
WORKERS_PER_CORE_WARNING = 4


def parse_raw_shape(value) -> tuple[int, int]:
    """``"32x32"`` / ``"32"`` / ``(32, 32)`` -> (H, W)."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        h, w = int(value[0]), int(value[1])
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", str(value))
        if not m:
            raise ValueError(f"raw shape must look like HxW (e.g. 32x32), got {value!r}")
        h = int(m.group(1))
        w = int(m.group(2) or h)
    if h <= 0 or w <= 0:
        raise ValueError(f"raw shape must be positive, got {value!r}")
    return h, w


def storage_spec(max_side: int | None = None, quality: int | None = None, raw=None) -> StorageSpec:
    """Build the :class:`StorageSpec` for the chosen storage mode."""
    if raw is not None and max_side is not None:
        raise ValueError("--raw and --max-side are exclusive: choose one storage mode")
    if raw is not None:
        return StorageSpec(mode="raw", raw_shape=parse_raw_shape(raw))
    if max_side is not None:
        if int(max_side) <= 0:
            raise ValueError("--max-side must be a positive number of pixels")
        if quality is not None and not 1 <= int(quality) <= 100:
            raise ValueError("--quality must be within 1..100")
        return StorageSpec(mode="reencode", max_side=int(max_side), quality=int(quality or 90))
    if quality is not None:
        raise ValueError("--quality only applies with --max-side (original mode keeps the bytes unchanged)")
    return StorageSpec()


def choose_backend(dst: str, fmt: str | None) -> str:
    """Backend from ``--format`` or from DST's suffix."""
    from fastdata.format.backends.registry import get_backend, suffix_hint

    if fmt:
        return get_backend(fmt).name
    backend = backend_for_path(dst)
    if backend is None:
        raise ValueError(f"cannot tell the backend from {dst!r}: name it {suffix_hint()}, or pass --format")
    return backend


def min_shard_size() -> int:
    """The smallest shard size accepted (``FASTDATA_MIN_SHARD_SIZE`` lowers the 1 MiB floor)."""
    override = os.environ.get("FASTDATA_MIN_SHARD_SIZE")
    return parse_size(override) if override else MIN_SHARD_SIZE


def check_shard_size(size: Size) -> Size:
    """Refuse a shard size below :func:`min_shard_size`, saying what to pick."""
    floor = min_shard_size()
    if size.bytes < floor:
        raise ValueError(f"shard size {size} is below the {describe_size(floor)} minimum (tiny shards make a store "
                         "of thousands of files to open and check): pick e.g. --shard-size 256MiB, or leave the "
                         f"default {DEFAULT_SHARD_SIZE}")
    return size


def check_shard_count(plans: list[ShardPlan], sizes_total: int, size: Size) -> None:
    """Refuse a plan of more than :data:`MAX_SHARDS` shards, suggesting a shard size that fits."""
    if len(plans) <= MAX_SHARDS:
        return
    suggest = MIN_SHARD_SIZE  # a power of two MiB with room for greedy packing's slack
    while suggest * MAX_SHARDS < 2 * sizes_total:
        suggest *= 2
    raise ValueError(f"shard size {size} would split {format_size(sizes_total)} of images into {len(plans):,} shards "
                     f"(more than {MAX_SHARDS:,}): pick at least --shard-size {suggest >> 20}MiB")


def resolve_workers(workers: int | None) -> tuple[int, str | None]:
    """``(processes, warning or None)``: None or 0 means all cores; negative is an error;
    more than 4x the cores is allowed (slow network storage can use it) but warned about."""
    cores = os.cpu_count() or 1
    if workers is None or int(workers) == 0:
        return cores, None
    workers = int(workers)
    if workers < 0:
        raise ValueError(f"--workers must be 0 (all cores) or a positive number of processes, got {workers}")
    if workers > WORKERS_PER_CORE_WARNING * cores:
        return workers, (f"--workers {workers} is more than {WORKERS_PER_CORE_WARNING}x the {cores} core(s) here: "
                         "each worker is a process with its own memory, and past the core count they mostly wait; "
                         f"{cores} is usually fastest for local disks")
    return workers, None


def resolve_options(dst: str, recorded: RunOptions | None, *, format: str | None, shard_size, max_side: int | None,
                    quality: int | None, raw, strict: bool | None) -> RunOptions:
    """The content options of this run.

    Each option given (not None) is used as given; each one not given takes the
    value recorded by the run being resumed (``recorded``), else its default.
    The storage options (``max_side``, ``quality``, ``raw``) count as one: giving
    any of them replaces the recorded storage mode.

    Raises:
        ValueError: an option is invalid (the message says what to give instead).
    """
    backend = choose_backend(dst, format) if format is not None or recorded is None else recorded.backend
    storage_given = any(v is not None for v in (max_side, quality, raw))
    storage = storage_spec(max_side, quality, raw) if storage_given or recorded is None else recorded.storage
    if shard_size is not None:
        size = check_shard_size(parse_size_spec(shard_size))
    else:
        size = recorded.shard_size if recorded is not None else parse_size_spec(DEFAULT_SHARD_SIZE)
    strict = bool(strict) if strict is not None else (recorded.strict if recorded is not None else False)
    return RunOptions(backend=backend, storage=storage, shard_size=size, strict=strict)


def check_resume(dst: str, src: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str, scan) -> None:
    """Refuse a resume whose options or source differ from the recorded run, naming each difference.

    Without a record (a run from an older fastdata) the staging fingerprint check decides.

    Raises:
        ResumeMismatchError: listing every differing option (was/now) and the source changes.
    """
    if recorded is None or recorded.fingerprint == fingerprint:
        return
    diffs = option_differences(recorded.options, run)
    if recorded.listing is not None:
        changes = source_differences(recorded.listing, scan)
    else:  # a published store keeps no listing: tell whether the source (not only the options) changed
        same = plan_fingerprint(scan, recorded.options.backend, recorded.options.storage,
                                recorded.options.shard_size.bytes) == recorded.fingerprint
        changes = [] if same else ["the source files differ (files added, removed or changed)"]
    if changes and recorded.source and os.path.abspath(src) != recorded.source:
        changes.append(f"source: was {recorded.source}, now {os.path.abspath(src)}")
    what = "; ".join(diffs + changes) or "the inputs differ"
    if recorded.complete:
        raise ResumeMismatchError(f"{dst} is a complete store made from different inputs or options ({what}); "
                                  "use --overwrite to replace it")
    hint = (" Leave out the differing options: --resume reuses the recorded ones "
            f"({recorded.options.describe()})." if diffs else "")
    raise ResumeMismatchError(f"cannot resume {dst}: {what}.{hint} Or start over with --overwrite "
                              "(this discards the finished shards)")


def _check_destination(dst: str, resume: bool, overwrite: bool) -> None:
    if not os.path.exists(dst):
        return
    if not os.path.isdir(dst):
        raise StoreExistsError(f"{dst} exists and is not a directory; choose another destination")
    ours = set(store_entries(dst))
    foreign = [n for n in os.listdir(dst) if n not in ours and not n.startswith(".fastdata")]
    if foreign:
        raise StoreExistsError(
            f"{dst} exists and holds files that are not part of a fastdata store (e.g. {foreign[0]!r}); "
            "refusing to write there: choose an empty or new destination")
    if resume or overwrite or not ours:
        return
    if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
        raise StoreExistsError(f"{dst} already holds a fastdata store; pass --overwrite to replace it "
                               "or choose another destination")
    raise StoreExistsError(f"{dst} holds an unfinished conversion; pass --resume to finish it "
                           "or --overwrite to start again")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    max_side: int | None = None,
    quality: int | None = None,
    raw=None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    lmdb_map_size: int | str | None = None,
    chunk_size: int = 32,
    schema=None,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> ConvertReport:
    """Convert an ImageFolder tree or a CSV/TSV list file into a fastdata store.

    Args:
        src: image folder (class subfolders) or a ``.csv``/``.tsv`` list of ``path,label``
            (a classification store, layout version 1); or a JSONL list, or a CSV/TSV list
            whose header names more columns than ``path,label`` (a general store, layout
            version 2, written by :func:`convert_table`).
        dst: destination directory, or a URL (``s3://bucket/train.lmdb``, ``gs://``, ``az://``: shards
            are staged locally and uploaded as each finishes, manifest last; see
            :mod:`fastdata.writer.remote_sink`); its suffix picks the backend unless ``format`` is given.
        format: ``"lmdb"`` or ``"hdf5"``.
        workers: reader/validator processes (default or 0: all cores; negative is an error; more than
            4x the cores is allowed with a warning).
        shard_size: target bytes per shard file (``int`` or e.g. ``"512MiB"``, ``"2GB"``; default 1GiB).
            At least 1 MiB, and at most 10,000 shards per store.
        max_side, quality: re-encode images whose longer side exceeds ``max_side`` as JPEG.
        raw: ``"HxW"``: store decoded RGB pixels resized to that shape.
        strict: stop at the first unusable input instead of skipping and reporting it (default False).
        resume: finish an interrupted conversion, keeping its completed shards. The content options
            (``format``, ``shard_size``, ``max_side``/``quality``/``raw``, ``strict``) left as None take
            the values the interrupted run recorded; one given that differs refuses the resume, naming it.
        overwrite: replace an existing store at ``dst``.
        progress: show a progress bar (default: when stderr is a terminal).
        lmdb_map_size: initial LMDB map size (it grows automatically).
        chunk_size: inputs per worker task.
        schema: declared fields of a list file (``--schema``: an inline spec, a JSON file, or a
            loaded JSON value; see :func:`fastdata.writer.sources.table.parse_schema`); makes ``src``
            a general list (:func:`convert_table`).
        storage_options: fsspec options for a URL ``dst`` (endpoint, credentials, ...).
        staging_dir: local directory shards of a URL ``dst`` are written in before upload
            (default: under the cache directory).

    Returns:
        A :class:`ConvertReport`.

    Raises:
        FastdataError subclasses, each naming the file or store at fault.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    remote = _remote_destination(src, dst, storage_options, staging_dir, resume=resume, overwrite=overwrite)
    if remote is not None:
        return remote(lambda local: convert(
            src, local, format=format, workers=workers, shard_size=shard_size,
            max_side=max_side, quality=quality, raw=raw, strict=strict, resume=resume, progress=progress,
            lmdb_map_size=lmdb_map_size, chunk_size=chunk_size, schema=schema))
    if _is_general_list(src, schema):
        if any(v is not None for v in (max_side, quality, raw)):
            raise ValueError(f"{src}: --max-side/--quality/--raw apply to image folders and path,label lists; a "
                             "list with more fields keeps each image's bytes as they are (leave them out)")
        return convert_table(src, dst, schema=schema, format=format, workers=workers, shard_size=shard_size,
                             strict=strict, resume=resume, overwrite=overwrite, progress=progress,
                             lmdb_map_size=lmdb_map_size, chunk_size=chunk_size)
    check_local_path(src, "source")
    check_local_path(dst, "destination", must_exist=False)
    if current_group() is None:  # (ranks: rank 0 checks, so that all ranks stop together)
        raise_if_locked(dst)  # a live writer is named before any other complaint about DST
    recorded = read_recorded_run(os.path.abspath(dst)) if resume else None
    run = resolve_options(dst, recorded.options if recorded else None, format=format, shard_size=shard_size,
                          max_side=max_side, quality=quality, raw=raw, strict=strict)
    backend, storage, shard_bytes, strict = run.backend, run.storage, run.shard_size.bytes, run.strict
    workers, workers_warning = resolve_workers(workers)
    writer_options = {"initial_map_size": parse_size(lmdb_map_size)} if lmdb_map_size else {}
    started = time.perf_counter()
    dst = os.path.abspath(dst)
    prestart_pool()

    scan = scan_source(src)
    if not scan.classes:
        raise SourceError(f"{src}: no class folders found (expected SRC/<class>/<image files>)")
    report = ConvertReport(dst=dst, backend=backend)
    if scan.hidden_classes:
        report.warnings.append("hidden folder(s) taken as classes, as ImageFolder does: "
                               f"{', '.join(scan.hidden_classes)} "
                               "(remove them if they are not classes)")
    for path, problem in scan.walk_problems:
        report.warnings.append(f"{path}: {problem}")
    check_destination_outside(scan, dst)
    report.warnings.extend([workers_warning] if workers_warning else [])
    report.options = run.describe() + (" (recorded by the interrupted run)" if recorded and not recorded.complete
                                       else "")
    sizes = estimated_sizes(scan, storage)
    plans = plan_shards(sizes, shard_bytes)
    check_shard_count(plans, int(sizes.sum()), run.shard_size)

    group = current_group()
    if group is not None:
        from fastdata.writer.distributed import convert_distributed

        return convert_distributed(
            group, scan=scan, dst=dst, src=src, run=run, recorded=recorded, plans=plans,
            workers=workers, resume=resume, overwrite=overwrite, progress=progress,
            writer_options=writer_options, chunk_size=chunk_size, report=report)
    with _locked_destination(dst, report, resume=resume, overwrite=overwrite):
        fingerprint = plan_fingerprint(scan, backend, storage, shard_bytes)
        if resume:
            check_resume(dst, src, recorded, run, fingerprint, scan)
        if resume and os.path.exists(os.path.join(dst, MANIFEST_NAME)):
            return _resume_published(report, dst, started, fingerprint=fingerprint,
                                     mismatch=f"{dst} is a complete store made from different inputs or options; "
                                              "use --overwrite to replace it")
        prepare_staging(dst, fingerprint, resume)
        if recorded is None or recorded.fingerprint != fingerprint:
            record_run(dst, run, src, fingerprint, scan)  # what a later --resume reuses and compares against
        remove_temporaries(dst)
        finished, todo = _shards_to_do(dst, backend, plans, resume)
        with ProgressBar(sum(p.stop - p.start for p in todo), progress) as bar:
            stats = run_shards(
                dst=dst, backend=backend, scan=scan, plans=todo, storage=storage, workers=workers,
                strict=strict, writer_options=writer_options, on_progress=bar.update_counts, chunk_size=chunk_size,
            )
        results = list(finished.values()) + stats.results
        _check_all_finished(dst, plans, results, rerun="--resume")
        options = {
            "source": os.path.abspath(src),
            "shard_size": shard_bytes,
            "shard_size_unit": run.shard_size.unit,
            "strict": strict,
            "fingerprint": fingerprint,
        }
        manifest = publish(dst=dst, backend=backend, scan=scan, storage=storage, results=results, options=options)
    _fill_report(report, manifest, stats, finished, started)
    return report


def _remote_destination(src: str, dst: str, storage_options: dict | None, staging_dir, *, resume: bool,
                        overwrite: bool):
    """For a URL ``dst``: a function that runs ``run(local_dir)`` (the local conversion) as an upload to
    ``dst`` (:func:`fastdata.writer.remote_sink.write_to_url`); None for a local ``dst``. A URL ``src``
    is refused (inputs are local), and so are ``storage_options``/``staging_dir`` with a local ``dst``,
    and ``resume`` together with ``overwrite`` (the checks every writer makes first)."""
    from fastdata.remote.store import is_remote
    from fastdata.writer.remote_sink import refuse_remote_source, write_to_url

    if resume and overwrite:
        raise ValueError("resume and overwrite (--resume, --overwrite) are exclusive")
    refuse_remote_source(src)
    if not is_remote(dst):
        if storage_options or staging_dir is not None:
            raise ValueError(f"{dst}: storage_options and staging_dir apply to a URL destination only "
                             "(s3://, gs://, az://), not to a local path")
        return None
    return lambda run: write_to_url(dst, storage_options, staging_dir, resume=resume, overwrite=overwrite, run=run)


@contextmanager
def _locked_destination(dst: str, report: ConvertReport, *, resume: bool, overwrite: bool) -> Iterator[StoreLock]:
    """Hold ``dst``'s lock for a conversion or write into it, the steps every writer takes first.

    Args:
        dst (str): absolute destination directory; refused (:func:`_check_destination`) when it is not a
            store, or holds one and neither ``resume`` nor ``overwrite`` is given; created if missing.
        report (ConvertReport): gets a warning when the lock is taken over from a converter that died.
        resume (bool): an existing (unfinished or complete) store there is to be finished.
        overwrite (bool): an existing store there is emptied once the lock is held.

    Yields:
        StoreLock: the held lock, released when the block ends.
    """
    _check_destination(dst, resume, overwrite)
    os.makedirs(dst, exist_ok=True)
    with StoreLock(dst) as lock:
        if lock.stale_pid:
            report.warnings.append(f"took over the lock of converter pid {lock.stale_pid}, which is no longer running")
        if overwrite:
            clear_store(dst)
        yield lock


def _resume_published(report: ConvertReport, dst: str, started: float, *, fingerprint: str | None = None,
                      mismatch: str = "") -> ConvertReport:
    """Finish a resume that finds ``dst`` already published: nothing is written.

    Args:
        report (ConvertReport): filled (``already_complete``, ``images``, ``elapsed``) and returned.
        dst (str): the store.
        started (float): ``time.perf_counter()`` when the run started.
        fingerprint (str | None): what this run would write; a published store with another one
            is refused with :class:`ResumeMismatchError` saying ``mismatch``. None: not compared.
        mismatch (str): the refusal's message (names ``dst`` and what to do).

    A run killed right after publishing may have left its staging folder and temporary files
    behind; they are removed.
    """
    manifest = read_manifest(dst)
    if fingerprint is not None and manifest["options"].get("fingerprint") != fingerprint:
        raise ResumeMismatchError(mismatch)
    shutil.rmtree(os.path.join(dst, STAGING_DIR), ignore_errors=True)
    remove_temporaries(dst)
    report.already_complete = True
    report.images = manifest["num_samples"]
    report.elapsed = time.perf_counter() - started
    return report


def _shards_to_do(dst: str, backend: str, plans: list[ShardPlan], resume: bool) -> tuple[dict, list[ShardPlan]]:
    """Split ``plans`` into the shards an interrupted run already finished (``{shard_id: ShardResult}``,
    verified; empty unless ``resume``) and the plans still to write."""
    finished = load_finished(dst, backend, plans) if resume else {}
    return finished, [p for p in plans if p.shard_id not in finished]


def _check_all_finished(dst: str, plans: list[ShardPlan], results: list, rerun: str) -> None:
    """Raise :class:`FastdataError` naming the planned shards that have no result (nothing is
    published then); ``rerun`` is how the caller resumes (``"--resume"``, ``"resume=True"``)."""
    missing = sorted({p.shard_id for p in plans} - {r.shard_id for r in results})
    if missing:
        raise FastdataError(f"{dst}: shard(s) {missing} did not finish; rerun with {rerun}")


def _fill_report(report: ConvertReport, manifest: dict, stats: PipelineStats, finished: dict, started: float) -> None:
    """Fill ``report`` from the published ``manifest``, this run's pipeline ``stats`` and the shards
    ``finished`` by an interrupted run (``{shard_id: ShardResult}``); ``started``: ``time.perf_counter()``
    at the start."""
    report.images = manifest["num_samples"]
    report.rejected = len(manifest["rejected"])
    report.rejected_items = [(r["path"], r["reason"]) for r in manifest["rejected"]]
    # inputs kept with a remark (the scan's own remarks are already in the report)
    report.warnings.extend(w for w in (f"{x['path']}: {x['warning']}" for x in manifest.get("warnings", []))
                           if w not in report.warnings)
    report.input_bytes = stats.input_bytes + sum(r.input_bytes for r in finished.values())
    report.output_bytes = sum(s["bytes"] for s in manifest["shards"])
    report.shards = len(manifest["shards"])
    report.resumed_shards = len(finished)
    report.elapsed = time.perf_counter() - started


# --------------------------------------------------------------------------- list files with more than a label


def _is_general_list(src: str, schema) -> bool:
    """Whether ``src`` becomes a general (layout version 2) store: a ``--schema`` was
    given, or ``src`` is a JSONL file or a CSV/TSV whose header names more than
    ``path,label`` (:func:`fastdata.writer.sources.table.is_table_list`)."""
    from fastdata.writer.sources.table import is_table_list

    if schema is not None:
        return True
    return os.path.isfile(src) and is_table_list(src, None)


#: the list source of this worker process (set by the pool initializer)
_TABLE = None


def _set_table(table) -> None:
    """Worker initializer: keep the list source for :func:`encode_table_chunk`."""
    global _TABLE
    _TABLE = table


def _table_row(table, i: int) -> dict | str:
    """Row ``i`` of the list with its image read (bytes), or why the image is unusable."""
    from fastdata.writer.ingest import Rejected, read_bytes

    row = table.row(i)
    try:
        row["image"] = read_bytes(table.path(i))
    except Rejected as why:
        return str(why)
    return row


def _encode_table_row(schema, row: dict, i: int, relpath: bytes):
    """Row ``i`` (its first image already read) validated and encoded as a version-2
    record keeping ``relpath``: every image fully decoded under the image policy (which
    gives its stored format and size), the other values checked against the schema."""
    from fastdata.common.imageio import ImageDecodeError, validate_image
    from fastdata.errors import RejectedInputError
    from fastdata.format.record import encode_sample
    from fastdata.writer.ingest import Rejected, read_bytes

    images: dict[str, tuple[str, int, int]] = {}
    for name in schema.image_fields():
        data = row[name]
        if isinstance(data, str):  # a second image column: its absolute path
            try:
                data = row[name] = read_bytes(os.fsencode(data))
            except Rejected as why:
                raise RejectedInputError(f"field {name!r}: {data}: {why}") from None
        try:
            images[name] = validate_image(data)
        except ImageDecodeError as err:
            raise RejectedInputError(f"field {name!r}: not a usable image ({err})") from None
    return encode_sample(schema, schema.check(row, f"sample {i}"), images, relpath)


def encode_table_chunk(schema, start: int, stop: int, spill_dir: str | None):
    """Worker entry point: rows ``start .. stop-1`` of the list source given to this
    worker, each an :class:`~fastdata.format.record.EncodedSample` keeping the path as written
    in the list, or the reason (``str``, naming the list line) it is rejected."""
    from fastdata.errors import RejectedInputError
    from fastdata.writer.ingest import spill

    table = _TABLE
    assert table is not None, "encode_table_chunk runs in workers started with _set_table"
    results: list = []
    nbytes = 0
    for i in range(start, stop):
        line = f"{os.path.basename(table.list_file)}:{int(table.lines[i])}"
        row = _table_row(table, i)
        if isinstance(row, str):
            results.append(f"{row} ({line})")
            continue
        nbytes += len(row["image"])
        try:
            results.append(_encode_table_row(schema, row, i, table.relpaths[i]))
        except RejectedInputError as err:  # an image that does not decode, or a second image file unreadable
            results.append(f"{err} ({line})")
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


def _table_chunk_source(table, plans: list[ShardPlan], chunk_size: int):
    """The pipeline's :class:`~fastdata.writer.pipeline.ChunkSource` for a list: index ranges
    the workers read themselves from the list source they received once."""
    from fastdata.writer.pipeline import Chunk, ChunkSource

    class TableChunks(ChunkSource):
        worker = staticmethod(encode_table_chunk)
        worker_init = (_set_table, (table,))

        def chunks(self):
            for plan in plans:
                for a in range(plan.start, plan.stop, chunk_size):
                    b = min(a + chunk_size, plan.stop)
                    yield Chunk(plan, a, b, b == plan.stop, (table.schema, a, b))

        def describe(self, start: int, stop: int) -> str:
            return f"{table.list_file} lines {int(table.lines[start])} .. {int(table.lines[stop - 1])}"

        def input_name(self, i: int) -> str:
            return os.fsdecode(table.relpaths[i])

    return TableChunks()


def _table_fingerprint(table, backend: str, shard_bytes: int) -> str:
    """A hash of what decides a list store's content (the list file's bytes, its schema
    and class tables, the image sizes, backend and shard size), for ``--resume``."""
    import json

    import xxhash

    h = xxhash.xxh3_128()
    h.update(json.dumps([backend, shard_bytes, table.schema.to_json(), table.class_tables]).encode())
    with open(table.list_file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    h.update(table.sizes.astype("<i8").tobytes())
    return h.hexdigest()


def _record_table_run(dst: str, run: RunOptions, src: str, fingerprint: str) -> None:
    """What a later ``--resume`` reuses (the options) and compares against (the fingerprint)."""
    import json

    from fastdata.common.fileio import atomic_write
    from fastdata.format.names import PLAN_FILE
    from fastdata.writer.pipeline import io_error

    path = os.path.join(dst, STAGING_DIR, PLAN_FILE)
    body = {"source": os.path.abspath(src), "fingerprint": fingerprint, "options": run.to_json()}
    try:
        atomic_write(path, json.dumps(body).encode())
    except OSError as err:
        raise io_error(err, path) from err


def _check_table_resume(dst: str, src: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
    """Refuse a resume of a list conversion whose options or list differ, naming the options."""
    if recorded is None or recorded.fingerprint == fingerprint:
        return
    diffs = option_differences(recorded.options, run)
    if not diffs:
        diffs = [f"the list {src} or its image files changed"]
    what = "; ".join(diffs)
    if recorded.complete:
        raise ResumeMismatchError(f"{dst} is a complete store made from different inputs or options ({what}); "
                                  "use --overwrite to replace it")
    raise ResumeMismatchError(f"cannot resume {dst}: {what}. Leave out differing options (--resume reuses the "
                              f"recorded ones: {recorded.options.describe()}), or start over with --overwrite")


def _class_counts(dst: str, backend: str, table, results: list, target: str | None) -> None:
    """Fill each shard result's ``class_counts`` from the class indices its shard holds
    (rejected rows are not in it), for the manifest's ``class_counts``."""
    import numpy as np

    from fastdata.format.record import FIELD_PREFIX, SampleIndex
    from fastdata.format.store_index import decode_shard_index
    from fastdata.writer.pipeline import shard_index_bytes

    for r in results:
        if target is None:
            r.class_counts = []
            continue
        # from the index sidecar, not the shard: a shard uploaded to a URL destination is no longer here
        index = decode_shard_index(shard_index_bytes(dst, backend, r.name, table.schema), table.schema, r.name)
        assert isinstance(index, SampleIndex), "a general store's shards hold a SampleIndex"
        labels = np.asarray(index.arrays[FIELD_PREFIX + target], dtype=np.int64)
        r.class_counts = np.bincount(labels, minlength=len(table.class_tables[target])).tolist()


def convert_table(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    schema=None,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    lmdb_map_size: int | str | None = None,
    chunk_size: int = 32,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> ConvertReport:
    """Convert a JSONL or CSV/TSV list with any fields into a general (layout version 2) store.

    The list is parsed by :func:`fastdata.writer.sources.table.scan_table` (fields typed by
    inference or by ``schema``); workers read and fully decode each row's image and
    encode the row (:func:`fastdata.writer.sources.python.prepare_sample`), through the same writer
    pipeline, lock, resume and atomic publish as :func:`convert`. Records keep the
    image path as written in the list. Unreadable images are rejected and reported
    (``strict`` stops at the first). The manifest holds every class field's table under
    ``class_tables`` and the single-label one's under ``classes``, with ``class_counts``.

    Args: as :func:`convert`; ``schema`` as :func:`fastdata.writer.sources.table.parse_schema`.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        SourceError: the list is missing or has bad rows (all named with line numbers).
        SchemaError: the schema spec is malformed.
        FastdataError subclasses for the destination, resume and I/O, as :func:`convert`.
    """
    from fastdata.format.manifest import CLASS_TABLES_KEY, target_field
    from fastdata.writer.sources.table import scan_table

    src, dst = os.fspath(src), os.fspath(dst)
    remote = _remote_destination(src, dst, storage_options, staging_dir, resume=resume, overwrite=overwrite)
    if remote is not None:
        return remote(lambda local: convert_table(
            src, local, schema=schema, format=format, workers=workers,
            shard_size=shard_size, strict=strict, resume=resume, progress=progress, lmdb_map_size=lmdb_map_size,
            chunk_size=chunk_size))
    check_local_path(src, "source")
    check_local_path(dst, "destination", must_exist=False)
    if os.path.isdir(src):
        raise ValueError(f"{src} is a folder: --schema applies to a JSONL/CSV/TSV list file (path plus fields)")
    if current_group() is not None:
        raise ValueError("a list with more fields than path,label converts on one machine: run it without torchrun")
    raise_if_locked(dst)
    recorded = read_recorded_run(os.path.abspath(dst)) if resume else None
    run = resolve_options(dst, recorded.options if recorded else None, format=format, shard_size=shard_size,
                          max_side=None, quality=None, raw=None, strict=strict)
    backend, shard_bytes = run.backend, run.shard_size.bytes
    workers, workers_warning = resolve_workers(workers)
    writer_options = {"initial_map_size": parse_size(lmdb_map_size)} if lmdb_map_size else {}
    started = time.perf_counter()
    dst = os.path.abspath(dst)
    prestart_pool()
    table = scan_table(src, schema)
    target = target_field(table.schema, table.class_tables)
    report = ConvertReport(dst=dst, backend=backend)
    report.warnings.extend([workers_warning] if workers_warning else [])
    report.options = run.describe() + (" (recorded by the interrupted run)" if recorded and not recorded.complete
                                       else "")
    # planned from the image file sizes plus a little for the other fields (exact sizes are known only once encoded)
    sizes = table.sizes.clip(min=0) + 64
    plans = plan_shards(sizes, shard_bytes)
    check_shard_count(plans, int(sizes.sum()), run.shard_size)
    with _locked_destination(dst, report, resume=resume, overwrite=overwrite):
        fingerprint = _table_fingerprint(table, backend, shard_bytes)
        if resume:
            _check_table_resume(dst, src, recorded, run, fingerprint)
        if resume and os.path.exists(os.path.join(dst, MANIFEST_NAME)):
            return _resume_published(report, dst, started)  # the recorded run was compared above
        prepare_staging(dst, fingerprint, resume)
        if recorded is None or recorded.fingerprint != fingerprint:
            _record_table_run(dst, run, src, fingerprint)
        remove_temporaries(dst)
        finished, todo = _shards_to_do(dst, backend, plans, resume)
        with ProgressBar(sum(p.stop - p.start for p in todo), progress) as bar:
            stats = run_shards(dst=dst, backend=backend, storage=StorageSpec(), workers=workers, strict=run.strict,
                               writer_options=writer_options, on_progress=bar.update_counts, chunk_size=chunk_size,
                               source=_table_chunk_source(table, todo, chunk_size), schema=table.schema)
        results = list(finished.values()) + stats.results
        _check_all_finished(dst, plans, results, rerun="--resume")
        _class_counts(dst, backend, table, results, target)
        classes = table.class_tables[target] if target is not None else []
        options = {"source": os.path.abspath(src), "shard_size": shard_bytes,
                   "shard_size_unit": run.shard_size.unit, "strict": run.strict, "fingerprint": fingerprint}
        manifest = publish(dst=dst, backend=backend, scan=_ClassesOnly(classes),  # type: ignore[arg-type]
                           storage=StorageSpec(),
                           results=results, options=options, schema=table.schema,
                           extra={CLASS_TABLES_KEY: table.class_tables})
    _fill_report(report, manifest, stats, finished, started)
    return report


@dataclass
class _ClassesOnly:
    """What :func:`~fastdata.writer.pipeline.publish` reads of a scan: the classes (the rejected
    images are reported per shard, so no scan-level remarks)."""

    classes: list
    walk_problems: list = field(default_factory=list)
