"""Distributed conversion over ``torch.distributed`` (gloo; no GPU needed).

``torchrun --nnodes N --nproc-per-node P -m fastdata convert SRC DST`` (or
``fastdata.writer.convert`` called inside an initialised process group) splits the
work across ranks:

1. every rank scans SRC (a path every node sees) and computes the same
   deterministic plan; the ranks compare plan fingerprints and stop if any
   rank sees different inputs;
2. rank 0 takes the store lock, checks/clears the destination and prepares
   staging; the others wait;
3. shard ``k`` is converted by rank ``k % world_size`` with that rank's local
   parallel writer; sidecars land in the shared staging folder;
4. the ranks exchange their outcome; if any rank failed, every rank raises a
   :class:`~fastdata.errors.ConversionError` naming it; otherwise rank 0
   publishes the manifest after all ranks are done.

The result is identical to a single-machine conversion with the same options,
because the plan does not depend on who converts which shard. ``--resume``
works across ranks: each rank keeps its finished shards, and options not given
again take the values the interrupted run recorded (rank 0 compares them). DST must be on a
filesystem all ranks share (NFS is fine for writing shard files; do not *read*
LMDB over NFS in training: copy shards to node-local disk), or a URL
(``s3://bucket/train.lmdb``): then each rank writes its shards in its own local
staging folder and uploads them itself (:mod:`fastdata.writer.remote_sink`); rank 0
checks and clears the URL, and publishes after collecting every rank's shard
sidecars from the remote staging.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass

from fastdata.errors import ConversionError, FastdataError

#: how long ranks wait for each other at a collective before failing
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class RankGroup:
    """The current process group as seen by fastdata."""

    rank: int
    world_size: int

    def all_gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self.all_gather(None)


def current_group() -> RankGroup | None:
    """The initialised default process group with more than one rank, else None.

    Does not import torch when the caller has not (plain conversions stay light).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    return RankGroup(dist.get_rank(), world) if world > 1 else None


def init_from_env(timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> bool:
    """Initialise a gloo process group from torchrun's environment variables
    (``WORLD_SIZE`` > 1, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Returns True when this call created the group (the caller destroys it).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", timeout=timeout)
    return True


def shutdown(created: bool) -> None:
    """Destroy the process group if :func:`init_from_env` created it."""
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()


def shards_for_rank(plans: list, rank: int, world_size: int) -> list:
    """The shards rank ``rank`` converts: shard k goes to rank k % world_size."""
    return [p for p in plans if p.shard_id % world_size == rank]


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def convert_distributed(group: RankGroup, *, scan, dst: str, src: str, run, recorded, plans: list, workers: int,
                        resume: bool, overwrite: bool, progress, writer_options: dict, chunk_size: int, report):
    """Run one conversion across all ranks of ``group`` (see the module docstring).

    ``run`` holds the resolved content options (a :class:`~fastdata.writer.resume.RunOptions`; with
    ``resume``, options not given were taken from ``recorded``, the interrupted run's record),
    ``plans`` the shard plan every rank computed from the same scan.
    """
    from fastdata.format.manifest import read_manifest
    from fastdata.format.names import MANIFEST_NAME
    from fastdata.writer.convert import _check_destination, _fill_report, check_resume
    from fastdata.writer.lock import StoreLock, raise_if_locked
    from fastdata.writer.pipeline import (
        PipelineStats,
        clear_store,
        load_finished,
        prepare_staging,
        publish,
        remove_temporaries,
        run_shards,
    )
    from fastdata.writer.plan import plan_fingerprint
    from fastdata.writer.report import ProgressBar
    from fastdata.writer.resume import record_run

    backend, storage, shard_bytes, strict = run.backend, run.storage, run.shard_size.bytes, run.strict
    started = time.perf_counter()
    rank, world = group.rank, group.world_size
    fingerprint = plan_fingerprint(scan, backend, storage, shard_bytes)
    fingerprints = group.all_gather(fingerprint)
    differing = [r for r, fp in enumerate(fingerprints) if fp != fingerprints[0]]
    if differing:
        raise ConversionError(f"rank(s) {differing} see different input files or options than rank 0; "
                              "SRC must be the same shared folder on every node")

    # rank 0 prepares the destination; the others wait for its verdict
    lock = None
    verdict = None
    if rank == 0:
        try:
            raise_if_locked(dst)  # a live writer is named before any other complaint about DST
            _check_destination(dst, resume, overwrite)
            os.makedirs(dst, exist_ok=True)
            lock = StoreLock(dst).acquire()
            if lock.stale_pid:
                report.warnings.append(f"took over the lock of converter pid {lock.stale_pid}, "
                                       "which is no longer running")
            if overwrite:
                clear_store(dst)
            if resume:
                check_resume(dst, src, recorded, run, fingerprint, scan)
            if resume and os.path.exists(os.path.join(dst, MANIFEST_NAME)):
                manifest = read_manifest(dst)
                verdict = ("complete", manifest["num_samples"]) if manifest["options"].get(
                    "fingerprint") == fingerprint else ("error", f"{dst} is a complete store made from different "
                                                                 "inputs or options; use --overwrite to replace it")
            else:
                prepare_staging(dst, fingerprint, resume)
                if recorded is None or recorded.fingerprint != fingerprint:
                    record_run(dst, run, src, fingerprint, scan)  # what a later --resume reuses and compares
                remove_temporaries(dst)
                verdict = ("go", None)
        except (FastdataError, OSError) as err:
            verdict = ("error", str(err))
    verdict = group.all_gather(verdict)[0]
    try:
        if verdict[0] == "error":
            raise ConversionError(f"rank 0: {verdict[1]}")
        if verdict[0] == "complete":
            report.already_complete = True
            report.images = verdict[1]
            report.elapsed = time.perf_counter() - started
            return report

        mine = shards_for_rank(plans, rank, world)
        status, stats, finished = None, PipelineStats(), {}
        try:
            finished = load_finished(dst, backend, mine) if resume else {}
            todo = [p for p in mine if p.shard_id not in finished]
            with ProgressBar(sum(p.stop - p.start for p in todo), progress, desc=f"rank {rank}") as bar:
                stats = run_shards(dst=dst, backend=backend, scan=scan, plans=todo, storage=storage, workers=workers,
                                   strict=strict, writer_options=writer_options, on_progress=bar.update_counts,
                                   chunk_size=chunk_size)
        except (FastdataError, OSError) as err:
            status = _error_text(err)
        except BaseException as err:  # tell the other ranks before dying, or they wait for the timeout
            group.all_gather((f"{_error_text(err)}", 0, 0))
            raise
        outcomes = group.all_gather((status, stats.input_bytes + sum(r.input_bytes for r in finished.values()),
                                     len(finished)))
        failed = [(r, s) for r, (s, _, _) in enumerate(outcomes) if s]
        if failed:
            raise ConversionError("distributed conversion failed: " + "; ".join(
                f"rank {r} failed: {s}" for r, s in failed) + " (finished shards are kept: rerun with --resume)")

        published: tuple[str, dict | None] = ("", None)
        if rank == 0:
            try:
                results = load_finished(dst, backend, plans, verify_files=False)
                missing = sorted({p.shard_id for p in plans} - set(results))
                if missing:
                    raise ConversionError(f"{dst}: shard(s) {missing} have no completion record; rerun with --resume")
                options = {"source": os.path.abspath(src), "shard_size": shard_bytes,
                           "shard_size_unit": run.shard_size.unit, "strict": strict, "fingerprint": fingerprint}
                manifest = publish(dst=dst, backend=backend, scan=scan, storage=storage,
                                   results=list(results.values()), options=options)
                published = ("ok", manifest)
            except (FastdataError, OSError) as err:
                published = (_error_text(err), None)
        # rank 0 sends the manifest: the other ranks' DST may be their own staging folder (a URL destination)
        published = group.all_gather(published)[0]
        if published[0] != "ok":
            raise ConversionError(f"rank 0 could not publish the store: {published[0]}")
        shared = published[1]
        assert shared is not None, "rank 0 sends the manifest with its ok"
        manifest = shared
        stats.input_bytes = sum(b for _, b, _ in outcomes)
        _fill_report(report, manifest, stats, {}, started)
        report.resumed_shards = sum(k for _, _, k in outcomes)
        return report
    finally:
        if lock is not None:
            lock.release()
