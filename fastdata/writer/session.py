"""THE write session: the one lifecycle behind ``fastdata.convert``, ``convert_table``,
``write``, ``convert_coco`` and the CLI's ``convert``, for every input kind.

An entry point checks its own arguments, builds a :class:`~fastdata.writer.sources.base.WriteSource`
for its input and runs ``WriteSession(source, dst, WriteOptions(...)).run()``. The session does
the rest, in this order:

1. ``resume`` and ``overwrite`` are exclusive; a URL destination runs the steps below into a
   local staging folder uploaded as it goes (:func:`fastdata.writer.remote_sink.write_to_url`);
2. a live writer holding the destination's lock is named before any other complaint;
3. the content options are resolved (with ``resume``, those not given again come from the
   interrupted run's record), ``workers`` is checked (:func:`fastdata.writer.options.resolve_workers`);
4. the source plans its shards (scan, parse, infer the schema) and fingerprints them;
5. rank 0 checks the destination (a file, foreign files, a complete store, an unfinished
   conversion), takes the lock, clears it for ``overwrite``, compares a resume with the
   recorded run (the source names the differences), prepares staging, records the run's
   options for a later ``resume=True`` and removes an interrupted run's temporaries;
6. every rank loads the shards it finished before (``resume``) and writes the others
   through the pipeline (:func:`fastdata.writer.pipeline.run_shards`) behind a progress bar;
7. rank 0 checks every planned shard is finished and publishes the manifest (its
   ``options`` are built here, and only here); the report is filled from it.

A run outside torchrun is the group of one (:class:`~fastdata.writer.distributed.RankGroup`
``(0, 1)``, whose collectives are trivial); under torchrun a source that splits across ranks
runs the same steps on every rank (shard ``k`` on rank ``k % world_size``).

Never imports :mod:`fastdata.reader`.
"""

from __future__ import annotations

import contextlib
import os
import time

from fastdata.common.paths import check_local_path
from fastdata.common.units import parse_size
from fastdata.errors import ConversionError, FastdataError, ResumeMismatchError, StoreExistsError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR
from fastdata.remote.store import is_remote
from fastdata.writer import append
from fastdata.writer.distributed import RankGroup, current_group, error_text, shards_for_rank
from fastdata.writer.lock import StoreLock, raise_if_locked
from fastdata.writer.options import WriteOptions, resolve_options, resolve_workers
from fastdata.writer.pipeline import (
    check_store_entries,
    clear_store,
    ExecutorFactory,
    first_free_shard,
    load_finished,
    prepare_staging,
    PublishedBase,
    prestart_pool,
    publish,
    recorded_first_shard,
    remove_staging,
    remove_temporaries,
    remove_unlisted_shards,
    run_shards,
    ShardSink,
    store_entries,
)
from fastdata.writer.plan import ShardPlan
from fastdata.writer.remote_sink import write_to_url
from fastdata.writer.report import ConvertReport, ProgressBar
from fastdata.writer.resume import RecordedRun, RunOptions, read_recorded_run
from fastdata.writer.sources.base import WriteSource


def check_destination(dst: str, resume: bool, overwrite: bool) -> None:
    """Refuse ``dst`` when it is a file, holds files that are not a store's, or holds a store
    (complete or unfinished) and neither ``resume`` nor ``overwrite`` is given.

    Raises:
        StoreExistsError: saying which, and what to pass or choose instead.
        UnsafeStoreError: an entry a conversion writes (the lock, the staging folder, a shard,
            the manifest, a temporary) is a symlink, FIFO or device, or a folder where a file
            belongs: refused before anything is written, whatever the flags.
    """
    if not os.path.exists(dst):
        return
    if not os.path.isdir(dst):
        raise StoreExistsError(f"{dst} exists and is not a directory; choose another destination")
    check_store_entries(dst)
    ours = set(store_entries(dst))
    foreign = [n for n in os.listdir(dst) if n not in ours and not n.startswith(".fastdata")]
    if foreign:
        raise StoreExistsError(
            f"{dst} exists and holds files that are not part of a fastdata store (e.g. {foreign[0]!r}); "
            "refusing to write there: choose an empty or new destination")
    if resume or overwrite or not ours:
        return
    if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
        raise StoreExistsError(f"{dst} already holds a fastdata store; pass overwrite=True to replace it, append=True "
                               "to add to it, or choose another destination")
    raise StoreExistsError(f"{dst} holds an unfinished conversion; pass resume=True to finish it "
                           "or overwrite=True to start again")


def _identities(path: str) -> list[tuple[tuple[int, int], str]]:
    """``((st_dev, st_ino), path)`` of ``path`` once resolved and of each of its folders up to ``/``
    (those that exist: a destination not made yet is placed by its nearest existing folder)."""
    out = []
    cur = os.path.realpath(path)
    while True:
        try:
            st = os.stat(cur)
            out.append(((st.st_dev, st.st_ino), cur))
        except OSError:
            pass
        parent = os.path.dirname(cur)
        if parent == cur:
            return out
        cur = parent


def refuse_input_as_destination(dst: str, inputs: list[str], error: type[Exception] = StoreExistsError,
                                inside: bool = True) -> None:
    """Refuse a destination that is one of ``inputs`` under another name, or would hold one.

    Compared by identity, not by name: the resolved paths' ``(st_dev, st_ino)``, so a symbolic
    link, a ``..`` spelling or a bind mount of an input is recognised. Refused: ``dst`` is an
    input; an input lies inside ``dst`` (clearing it would delete the input); with ``inside``,
    ``dst`` lies inside an input, also when ``dst`` does not exist yet and only a folder above it
    resolves into the input (a merge would write into an input store). Inputs that do not exist
    (a glob, a Python object) are skipped. A URL destination is compared with the URL inputs by
    :func:`~fastdata.remote.location.url_identity` (another spelling of one prefix is that prefix).

    Raises:
        error: naming both paths (``StoreExistsError`` by default; merge raises ``MergeError``).
    """
    if is_remote(dst):
        _refuse_url_input_as_destination(dst, [p for p in inputs if is_remote(p)], error, inside)
        return
    chain = _identities(dst)
    exists = bool(chain) and chain[0][1] == os.path.realpath(dst)
    for given in inputs:
        try:
            st = os.stat(given)
        except OSError:
            continue
        ident = (st.st_dev, st.st_ino)
        if exists and chain[0][0] == ident:
            kind = "folder" if os.path.isdir(given) else "file"
            raise error(f"the destination {dst} is the input {given} (the same {kind}, {chain[0][1]}): write into "
                        "a new destination")
        if inside and any(i == ident for i, _ in chain):
            raise error(f"the destination {dst} lies inside the input {given} (resolved: {os.path.realpath(dst)}): "
                        "write into a destination outside every input")
        if exists and any(i == chain[0][0] for i, _ in _identities(given)[1:]):
            raise error(f"the input {given} lies inside the destination {dst} (resolved: {chain[0][1]}): write into "
                        "a destination that holds no input")


def _refuse_url_input_as_destination(dst: str, inputs: list[str], error: type[Exception], inside: bool) -> None:
    """:func:`refuse_input_as_destination` for URLs: compared by :func:`url_identity` (scheme aliases,
    case of bucket names, ``//``, ``.`` and ``..`` segments), prefixes standing for folders."""
    from fastdata.remote.location import url_identity

    target = url_identity(dst)
    for given in inputs:
        ident = url_identity(given)
        if ident == target:
            raise error(f"the destination {dst} is the input {given} (the same prefix, {'/'.join(target[1:])} on "
                        f"{target[0]}://): write into a new destination")
        if inside and target[:len(ident)] == ident:
            raise error(f"the destination {dst} lies inside the input {given}: write into a destination outside "
                        "every input")
        if ident[:len(target)] == target:
            raise error(f"the input {given} lies inside the destination {dst}: write into a destination that holds "
                        "no input")


class WriteSession:
    """One write of ``source`` into ``dst`` (a directory or a URL) with ``options``; :meth:`run` does it.

    Args:
        source (WriteSource): the input.
        dst (str | os.PathLike): the destination directory, or a URL (``s3://``, ``gs://``, ``az://``).
        options (WriteOptions): how to write.
        executor_factory (ExecutorFactory | None): makes the worker pool when ``options.workers``
            asks for worker processes, given to :func:`~fastdata.writer.pipeline.run_shards`
            (see :data:`~fastdata.writer.pipeline.ExecutorFactory`); None: a
            :class:`concurrent.futures.ProcessPoolExecutor`.
    """

    def __init__(self, source: WriteSource, dst: str | os.PathLike, options: WriteOptions, *,
                 executor_factory: ExecutorFactory | None = None):
        self.source = source
        self.dst = os.fspath(dst)
        self.options = options
        #: what makes the pipeline's worker pool (None: the process pool); an argument, so that a
        #: caller supplies its own pool without replacing the standard library's class
        self.executor_factory = executor_factory
        self.group = RankGroup()
        #: this rank's shard results (those kept from an interrupted run first)
        self._results: list = []
        #: the published store an append adds to (None: not an append)
        self.base: PublishedBase | None = None
        #: the input's own fingerprint (an append's fingerprint also names the store version)
        self.input_fingerprint = ""
        #: where finished shards go besides the local directory (a URL destination's uploads), or None
        self.sink: ShardSink | None = None
        #: the local directory being written (set by _write), and the first shard number of a run
        #: that is not an append (read from its staging: past shards an overwrite left in use)
        self._local = ""
        self._fresh_first: int | None = None
        #: shards of an earlier version still open in other processes, left in place (Windows)
        self._left_in_use: list[str] = []
        #: an append's values for the store's added fields (None: the store has none)
        self._added: append.AddedValues | None = None

    def run(self) -> ConvertReport:
        """Write the store; see the module docstring for the steps.

        Returns:
            ConvertReport: what was written (or ``already_complete`` for a resume of a published store).

        Raises:
            ValueError: conflicting or invalid options. FastdataError subclasses: the destination
                (exists, locked, a different store), the resume (:class:`ResumeMismatchError`),
                the input, I/O; under torchrun a :class:`ConversionError` naming the failed rank.
        """
        o, source = self.options, self.source
        if o.resume and o.overwrite:
            raise ValueError("resume=True and overwrite=True are exclusive")
        if o.append and o.overwrite:
            raise ValueError("append=True and overwrite=True are exclusive")
        if o.add_classes and not o.append:
            raise ValueError("add_classes=True applies to an append (append=True) only")
        if (o.added_values is not None or o.added_defaults is not None) and not o.append:
            raise ValueError("added_values and added_defaults apply to an append (append=True) to a store with added "
                             "fields only")
        if o.resume and source.resume_refusal:
            raise ValueError(source.resume_refusal)
        group = current_group()
        if group is not None and source.torchrun_refusal:
            raise ValueError(source.torchrun_refusal)
        if group is not None and source.splits_across_ranks:
            self.group = group
        if source.reads_urls:
            source.use_storage_options(o.storage_options)
        if is_remote(self.dst):
            if o.append and self.group.world_size > 1:
                raise ValueError(f"{self.dst}: an append into a URL runs in one process, not under torchrun")
            rank = self.group.rank if self.group.world_size > 1 else None
            return write_to_url(self.dst, o.storage_options, o.staging_dir, resume=o.resume, overwrite=o.overwrite,
                                rank=rank, run=lambda local, sink: self._write(local, overwrite=False, sink=sink),
                                append=o.append)
        if (o.storage_options and not source.reads_urls) or o.staging_dir is not None:
            raise ValueError(f"{self.dst}: storage_options and staging_dir apply to a URL destination or source "
                             "only (s3://, gs://, az://), not to a local path")
        return self._write(self.dst, overwrite=o.overwrite)

    def _write(self, dst: str, overwrite: bool, sink: ShardSink | None = None) -> ConvertReport:
        """Write the store into the local directory ``dst``; ``sink``: where finished shards go as
        well (a URL destination's uploads), given to every pipeline call of this write."""
        self.sink = sink
        o, source, group = self.options, self.source, self.group
        check_local_path(dst, "destination", must_exist=False)
        self._local, self._fresh_first = os.path.abspath(dst), None
        if group.world_size == 1:  # (ranks: rank 0 checks it while preparing, so that all ranks stop together)
            raise_if_locked(dst)  # a live writer is named before any other complaint about DST
        dst = os.path.abspath(dst)
        recorded_source = source.recorded_source
        if isinstance(recorded_source, str) and os.path.isabs(recorded_source):  # a path source: never written
            refuse_input_as_destination(dst, [recorded_source], inside=False)  # into, nor deleted
        self.base = append.open_base(dst) if o.append else None
        recorded: RecordedRun | None
        if self.base is not None:
            recorded = append.recorded_run(self.base)  # an append takes the store's options not given again
        else:
            recorded = read_recorded_run(dst) if o.resume and source.reuses_recorded_options else None
        run = resolve_options(dst, recorded.options if recorded else None, format=o.format, shard_size=o.shard_size,
                              strict=o.strict, **source.storage_request)
        if self.base is not None:
            append.check_options(dst, self.base, run)
            self._added = append.plan_added_values(dst, self.base, o.added_values, o.added_defaults)
            source.raw_budget_used = append.stored_bytes(self.base)
        workers, workers_warning = resolve_workers(o.workers)
        writer_options = {"initial_map_size": parse_size(o.lmdb_map_size)} if o.lmdb_map_size else {}
        started = time.perf_counter()
        if workers:
            prestart_pool(source.worker_modules)  # the forkserver's imports overlap the scan
        plans = source.plan(run, dst)
        report = ConvertReport(dst=dst, backend=run.backend, unit=source.unit, options=source.options_text(run) + (
            " (recorded by the interrupted run)" if recorded and not recorded.complete else ""))
        report.warnings.extend(source.warnings + ([workers_warning] if workers_warning else []))
        if self.base is not None:
            append.check_source(dst, self.base, source, o.add_classes)
            if self._added is not None:
                append.check_added_count(dst, self._added, sum(p.stop - p.start for p in plans)
                                         if plans is not None else None)
        fingerprint = self.input_fingerprint = source.fingerprint(run)
        if self.base is not None:
            fingerprint = append.fingerprint(fingerprint, self.base)
        fingerprints = group.all_gather(fingerprint)
        differing = [r for r, fp in enumerate(fingerprints) if fp != fingerprints[0]]
        if differing:
            raise ConversionError(f"rank(s) {differing} see different input files or options than rank 0; "
                                  "SRC must be the same shared folder on every node")
        with contextlib.ExitStack() as held:
            published = group.on_rank0(lambda: self._prepare(held, dst, run, recorded, fingerprint, report, overwrite),
                                       failed=lambda err: f"rank 0: {err}")
            if published is not None:
                report.already_complete = True
                report.images = published
                report.elapsed = time.perf_counter() - started
                return report
            counts = group.on_every_rank(
                lambda: self._write_shards(dst, run, plans, workers, writer_options),
                failed=lambda text: f"distributed conversion failed: {text} (finished shards are kept: rerun with "
                                    "resume=True)")
            manifest = group.on_rank0(lambda: self._publish(dst, run, plans, fingerprint),
                                      failed=lambda err: f"rank 0 could not publish the store: {error_text(err)}")
        report.notes = source.report_notes()
        shards, rejected = manifest["shards"], manifest["rejected"]
        if self.base is not None:  # the report counts what this append added
            kept = len(self.base.manifest["shards"])
            report.store_total = (manifest["num_samples"], len(shards))
            shards, rejected = shards[kept:], rejected[len(self.base.manifest["rejected"]):]
            report.images = sum(s["count"] for s in shards)
        else:
            report.images = manifest["num_samples"]
        report.rejected = len(rejected)
        report.rejected_items = [(r["path"], r["reason"]) for r in rejected]
        if self._left_in_use:
            report.warnings.append(
                f"{len(self._left_in_use)} shard file(s) of the store's earlier version are open in another process "
                f"({', '.join(self._left_in_use[:3])}{', ...' if len(self._left_in_use) > 3 else ''}): they were "
                "left in place for their readers, and the next write of the store deletes them")
        # inputs kept with a remark (the source's own remarks are already in the report)
        report.warnings.extend(w for w in (f"{x['path']}: {x['warning']}" for x in manifest.get("warnings", []))
                               if w not in report.warnings)
        report.input_bytes = sum(nbytes for nbytes, _ in counts)
        report.output_bytes = sum(s["bytes"] for s in shards)
        report.shards = len(shards)
        report.resumed_shards = sum(kept for _, kept in counts)
        report.elapsed = time.perf_counter() - started
        return report

    def _prepare(self, held: contextlib.ExitStack, dst: str, run: RunOptions, recorded: RecordedRun | None,
                 fingerprint: str, report: ConvertReport, overwrite: bool) -> int | None:
        """Rank 0's steps before any shard is written: check the destination, lock it (the lock
        joins ``held``), clear it (``overwrite``), check a resume, prepare staging and record the run.

        Returns:
            int | None: the sample count of the store a resume finds already published (nothing
            is to be written), else None.
        """
        source, resume = self.source, self.options.resume
        raise_if_locked(dst)  # (a group of one checked it first thing; ranks check it here)
        check_destination(dst, resume or self.base is not None, overwrite)
        os.makedirs(dst, exist_ok=True)
        lock = held.enter_context(StoreLock(dst))
        if lock.stale_pid:
            report.warnings.append(f"took over the lock of converter pid {lock.stale_pid}, which is no longer running")
        if self.base is not None:
            return self._prepare_append(lock, dst, run, fingerprint)
        first = 0
        if overwrite:  # (where an open file cannot be deleted, the new shards are numbered past those left)
            first = first_free_shard(clear_store(dst))
        if resume:
            source.check_resume(dst, recorded, run, fingerprint)
            if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
                return self._already_published(dst, fingerprint)
        lock.record_token(prepare_staging(dst, fingerprint, resume, source.staging_source, first_shard=first))
        if recorded is None or recorded.fingerprint != fingerprint:
            source.record(dst, run, fingerprint)  # what a later resume=True reuses and compares against
        remove_temporaries(dst)
        return None

    def _prepare_append(self, lock: StoreLock, dst: str, run: RunOptions, fingerprint: str) -> int | None:
        """:meth:`_prepare` of an append, once the store is locked: the store's sample count when a
        resume finds this append published already; else staging is ready (an unfinished earlier
        append is finished by a resume, discarded by a new append) and None is returned."""
        assert self.base is not None
        self.base = append.open_base(dst)  # (again, under the lock: the version this append extends)
        if self._added is not None and self._added.base_checksum != self.base.manifest["checksum"]:
            o = self.options  # (the store changed since the values were checked: check them against it)
            self._added = append.plan_added_values(dst, self.base, o.added_values, o.added_defaults)
        if self.options.resume:
            if append.already_appended(self.base, self.input_fingerprint) and not os.path.lexists(
                    os.path.join(dst, STAGING_DIR)):
                return int(self.base.manifest["num_samples"])
        else:
            append.discard_unpublished(dst, self.base)
        lock.record_token(prepare_staging(dst, fingerprint, self.options.resume, self.source.staging_source))
        self.source.record(dst, run, fingerprint)
        remove_temporaries(dst)
        return None

    def _already_published(self, dst: str, fingerprint: str) -> int:
        """A resume that finds ``dst`` published: refuse it when made from other inputs, else
        remove what a run killed right after publishing may have left (staging, temporaries)."""
        manifest = read_manifest(dst)
        if manifest["options"].get("fingerprint") != fingerprint:
            raise ResumeMismatchError(f"{dst} is a complete store {self.source.made_from}; "
                                      "use overwrite=True to replace it")
        remove_staging(dst)
        remove_temporaries(dst)
        return manifest["num_samples"]

    def _write_shards(self, dst: str, run: RunOptions, plans: list[ShardPlan] | None, workers: int,
                      writer_options: dict) -> tuple[int, int]:
        """This rank's shards: those an interrupted run finished are kept (``resume``), the others
        written. Returns ``(input bytes, shards kept)`` for the report."""
        source, group, o = self.source, self.group, self.options
        mine = shards_for_rank(plans, group.rank, group.world_size) if plans is not None else None
        first = self.first_shard
        finished = (load_finished(dst, run.backend, mine, first_shard=first, sink=self.sink)
                    if o.resume and mine is not None else {})
        todo = [p for p in mine if p.shard_id + first not in finished] if mine is not None else None
        label = source.progress_label if group.world_size == 1 else f"rank {group.rank}"
        with ProgressBar(sum(p.stop - p.start for p in todo) if todo is not None else 0, o.progress,
                         desc=label) as bar:
            stats = run_shards(dst=dst, backend=run.backend, source=source.chunks(run, o.task_size), plans=todo,
                               storage=run.storage, workers=workers, strict=run.strict, writer_options=writer_options,
                               on_progress=bar.update_counts, schema=source.schema,
                               num_classes=len(source.classes()) if source.schema is None else 0, first_shard=first,
                               sink=self.sink, executor_factory=self.executor_factory)
        self._results = list(finished.values()) + stats.results
        return stats.input_bytes + sum(r.input_bytes for r in finished.values()), len(finished)

    def _publish(self, dst: str, run: RunOptions, plans: list[ShardPlan] | None, fingerprint: str) -> dict:
        """Rank 0, once every rank is done: check every planned shard is finished, publish; the manifest."""
        source = self.source
        first = self.first_shard
        results = (self._results if self.group.world_size == 1  # (the other ranks' shards: from their sidecars)
                   else list(load_finished(dst, run.backend, plans or [], verify_files=False,
                                           first_shard=first, sink=self.sink).values()))
        missing = sorted({p.shard_id + first for p in plans or []} - {r.shard_id for r in results})
        if missing:
            raise FastdataError(f"{dst}: shard(s) {missing} did not finish; rerun with resume=True")
        source.finish_results(dst, run.backend, results)
        if self.base is not None:
            options, extra = append.manifest_parts(self.base, source, self.input_fingerprint,
                                                   sum(r.count for r in results), len(results))
            # the new shards' field files (one for every generation of added fields), before the manifest
            field_files = (append.write_added_field_files(dst, self._added, results,
                                                          sum(len(r.rejected) for r in results))
                           if self._added is not None else None)
            manifest = publish(dst=dst, backend=run.backend,
                               classes=source.classes() or self.base.manifest["classes"], remarks=source.remarks(),
                               storage=run.storage, results=results, options=options, schema=source.schema,
                               extra=extra, base=self.base, sink=self.sink, field_files=field_files)
        else:
            options = {"source": source.recorded_source, "shard_size": run.shard_size.bytes,
                       "shard_size_unit": run.shard_size.unit, "strict": run.strict, "fingerprint": fingerprint,
                       **source.manifest_options()}
            manifest = publish(dst=dst, backend=run.backend, classes=source.classes(), remarks=source.remarks(),
                               storage=run.storage, results=results, options=options, schema=source.schema,
                               extra=source.manifest_extra(), sink=self.sink)
        # shards of an earlier version an overwrite left to their readers (Windows): deleted once closed
        self._left_in_use = remove_unlisted_shards(dst, {s["name"] for s in manifest["shards"]})
        return manifest

    @property
    def first_shard(self) -> int:
        """The number of this run's first shard: one past the store's for an append; else 0, or, after an
        overwrite that left shards in use (Windows), one past them, as the run's staging records it."""
        if self.base is not None:
            return append.next_shard(self.base)
        if self._fresh_first is None:
            self._fresh_first = recorded_first_shard(self._local) if self._local else 0
        return self._fresh_first
