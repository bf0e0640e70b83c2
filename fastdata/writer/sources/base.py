"""What a kind of input gives the write session (:mod:`fastdata.writer.session`).

A :class:`WriteSource` is everything the session needs to know about one input, and
nothing about destinations, locks, resume or publishing: adding an input kind (a
Hugging Face dataset, Parquet files, WebDataset shards) is one module with one
subclass, and no change to the session.

The session calls, in this order: :meth:`~WriteSource.plan` (on every rank, before the
destination is locked), :meth:`~WriteSource.fingerprint`, then on the rank that prepares
the destination :meth:`~WriteSource.check_resume` and :meth:`~WriteSource.record`,
:meth:`~WriteSource.chunks` for the shards left to write, and on the publishing rank
:meth:`~WriteSource.finish_results` before the manifest is written.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any

from fastdata.common.fileio import atomic_write
from fastdata.errors import ResumeMismatchError, SourceError
from fastdata.format.fields import Schema
from fastdata.format.names import PLAN_FILE, STAGING_DIR
from fastdata.writer.pipeline import ChunkSource, ShardResult, io_error
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RecordedRun, RunOptions, option_differences


class WriteSource(abc.ABC):
    """One input, as the write session sees it (see the module docstring)."""

    #: what the report counts ("images", "samples")
    unit: str = "images"
    #: the progress bar's label
    progress_label: str = "convert"
    #: how a published store made from other inputs is described ("<dst> is a complete store <made_from>; ...")
    made_from: str = "made from different inputs or options"
    #: whether ``resume`` takes the content options not given again from the interrupted run's record
    reuses_recorded_options: bool = True
    #: None: ``resume=True`` is possible; else why not (raised as a ValueError)
    resume_refusal: str | None = None
    #: whether the shards are split across torchrun's ranks (every rank computes the same plan);
    #: False: under torchrun each calling process writes the store alone, as outside torchrun
    splits_across_ranks: bool = False
    #: None, or why this input refuses to run under torchrun (raised as a ValueError)
    torchrun_refusal: str | None = None
    #: keyword arguments for :func:`fastdata.writer.options.resolve_options` that pick the storage
    #: mode (``max_side``, ``quality``, ``raw``): only for inputs whose images may be re-encoded
    storage_request: dict[str, Any] = {}
    #: bytes a raw budget (``raw_budget``) already holds before this write: the store's shards when
    #: appending to it (set by the session before :meth:`plan`)
    raw_budget_used: int = 0
    #: recorded in ``plan.json`` next to the fingerprint by :func:`~fastdata.writer.pipeline.prepare_staging`
    staging_source: str | None = None
    #: the general store's schema (set by :meth:`plan`); None for a classification (version-1) store
    schema: Schema | None = None
    #: whether the input is read from URLs (then the write's ``storage_options`` are its own too,
    #: given by :meth:`use_storage_options`, also when the destination is a local path)
    reads_urls: bool = False
    #: modules the pipeline's worker processes will import (preloaded by a forkserver started for them)
    worker_modules: tuple[str, ...] = ()

    def __init__(self, recorded_source: str) -> None:
        #: what the manifest's ``options.source`` names (an absolute path, or ``fastdata.write``)
        self.recorded_source = recorded_source
        #: remarks about the input for the report, set by :meth:`plan` (e.g. hidden class folders)
        self.warnings: list[str] = []

    @abc.abstractmethod
    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan] | None:
        """Read the input (scan, parse, infer the schema) and split it into shards for ``run``'s
        options; None when the shards are only known while writing (an iterable). ``dst`` is the
        absolute destination directory (e.g. to refuse one inside a source folder)."""

    @abc.abstractmethod
    def fingerprint(self, run: RunOptions) -> str:
        """A hash of what decides the store's content, for ``resume`` (after :meth:`plan`)."""

    @abc.abstractmethod
    def chunks(self, run: RunOptions, chunk_size: int) -> ChunkSource:
        """The pipeline's feed of ``chunk_size`` inputs per task (:meth:`ChunkSource.chunks` is
        given the plans left to write)."""

    def use_storage_options(self, options: Any) -> None:
        """Take the write's ``storage_options`` (a mapping or None) for the input's URLs
        (:attr:`reads_urls` sources; by default nothing to do)."""
        return None

    def options_text(self, run: RunOptions) -> str:
        """The content options used, for the report (``ConvertReport.options``)."""
        return run.describe()

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        """Refuse a resume whose options or input differ from the run ``recorded`` (None: no
        record), naming the differences (raises :class:`~fastdata.errors.ResumeMismatchError`).
        By default the staging fingerprint alone decides."""
        return None  # (by default nothing to do)

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        """Write what a later ``resume`` reuses and compares against into ``dst``'s staging
        (called once staging is prepared, unless the record there is this run's already)."""
        return None  # (by default nothing to do)

    def classes(self) -> list[str]:
        """The manifest's ``classes`` (a classification store's, or a general store's single-label field's)."""
        return []

    def adopt_classes(self, store_classes: list[str], add_classes: bool) -> None:
        """Use ``store_classes`` (the table of the classification store being appended to) as this
        input's class table, so that each sample's label is the store's index of its class name.

        The default (an input whose labels cannot be renumbered) accepts only the same table.

        Raises:
            SourceError: a class the store lacks (without ``add_classes``), or tables that differ.
        """
        if self.classes() != store_classes:
            raise SourceError(f"the store's classes ({len(store_classes)}) differ from this input's "
                              f"({len(self.classes())}); appending needs the same class table")

    def remarks(self) -> list[tuple[str, str]]:
        """``(path, warning)`` pairs about the whole input, for the manifest's ``warnings``."""
        return []

    def manifest_options(self) -> dict[str, Any]:
        """Keys the manifest's ``options`` holds for this input, after the common ones."""
        return {}

    def manifest_extra(self) -> dict[str, Any] | None:
        """Top-level manifest keys of this input (e.g. ``class_tables``, ``metadata``)."""
        return None

    def report_notes(self) -> list[str]:
        """Lines for the conversion's summary about what was stored (after :meth:`finish_results`),
        e.g. the dtypes and channel counts held and the default read mode recorded."""
        return []

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Complete the shard results before publishing (e.g. per-shard class counts from the index sidecars)."""
        return None  # (by default nothing to do)


def refuse_changed_resume(dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str,
                          changed: str) -> None:
    """The usual :meth:`WriteSource.check_resume`: nothing when there is no record or its fingerprint
    is ``fingerprint``; else a :class:`~fastdata.errors.ResumeMismatchError` naming the options that
    differ, or ``changed`` (e.g. "the Parquet files data/ changed") when none does."""
    if recorded is None or recorded.fingerprint == fingerprint:
        return
    what = "; ".join(option_differences(recorded.options, run) or [changed])
    if recorded.complete:
        raise ResumeMismatchError(f"{dst} is a complete store made from different inputs or options ({what}); "
                                  "use overwrite=True to replace it")
    raise ResumeMismatchError(f"cannot resume {dst}: {what}. Leave out differing options (resume=True reuses the "
                              f"recorded ones: {recorded.options.describe()}), or start over with overwrite=True")


def record_run(dst: str, source: str, run: RunOptions, fingerprint: str) -> None:
    """The usual :meth:`WriteSource.record`: ``source``, ``fingerprint`` and ``run``'s options in
    ``dst``'s staging plan file, written atomically."""
    path = os.path.join(dst, STAGING_DIR, PLAN_FILE)
    body = {"source": source, "fingerprint": fingerprint, "options": run.to_json()}
    try:
        atomic_write(path, json.dumps(body).encode())
    except OSError as err:
        raise io_error(err, path) from err
