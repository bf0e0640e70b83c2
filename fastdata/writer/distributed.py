"""The ranks a write runs on: one process, or every rank of a ``torch.distributed`` job (gloo; no GPU needed).

``fastdata convert`` launched by torchrun on N nodes of P processes each (or
``fastdata.convert`` called inside an initialised process group) runs the one write
session (:mod:`fastdata.writer.session`) on every rank, as a :class:`RankGroup`; a run
outside torchrun is the same session on a group of one, whose collectives are trivial:

1. every rank scans SRC (a path every node sees) and computes the same
   deterministic plan; the ranks compare plan fingerprints and stop if any
   rank sees different inputs;
2. rank 0 takes the store lock, checks/clears the destination and prepares
   staging; the others wait (:meth:`RankGroup.on_rank0`);
3. shard ``k`` is converted by rank ``k % world_size`` (:func:`shards_for_rank`) with
   that rank's local parallel writer; sidecars land in the shared staging folder;
4. the ranks exchange their outcome (:meth:`RankGroup.on_every_rank`); if any rank
   failed, every rank raises a :class:`~fastdata.errors.ConversionError` naming it;
   otherwise rank 0 publishes the manifest after all ranks are done, and sends it to the others.

The result is identical to a single-machine conversion with the same options,
because the plan does not depend on who converts which shard. ``resume=True``
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdata.errors import ConversionError, FastdataError

#: how long ranks wait for each other at a collective before failing
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class RankGroup:
    """The processes one write runs on: ``RankGroup(0, 1)`` for a single process (no torch needed),
    else the current ``torch.distributed`` process group as seen by fastdata."""

    rank: int = 0
    world_size: int = 1

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a group of one: ``[obj]``)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def on_rank0(self, fn: Callable[[], Any], failed: Callable[[BaseException], str]) -> Any:
        """``fn()`` run on rank 0, its (picklable) result returned on every rank.

        A group of one runs ``fn`` and lets its errors through as they are. In a larger group
        a :class:`FastdataError` or :class:`OSError` on rank 0 makes every rank raise
        :class:`ConversionError` saying ``failed(error)``, so that all ranks stop together.
        """
        if self.world_size == 1:
            return fn()
        outcome: tuple[str | None, Any] = (None, None)
        if self.rank == 0:
            try:
                outcome = (None, fn())
            except (FastdataError, OSError) as err:
                outcome = (failed(err), None)
        error, result = self.all_gather(outcome)[0]
        if error is not None:
            raise ConversionError(error)
        return result

    def on_every_rank(self, fn: Callable[[], Any], failed: Callable[[str], str]) -> list:
        """``fn()`` run on every rank; the results of all ranks, in rank order.

        A group of one lets the errors of ``fn`` through as they are. In a larger group a
        :class:`FastdataError` or :class:`OSError` on any rank makes every rank raise
        :class:`ConversionError` saying ``failed("rank 1 failed: ...; ...")``; any other error
        (e.g. a Ctrl-C) is told to the other ranks before it is raised, so none waits for the timeout.
        """
        if self.world_size == 1:
            return [fn()]
        outcome: tuple[str | None, Any] = (None, None)
        try:
            outcome = (None, fn())
        except (FastdataError, OSError) as err:
            outcome = (error_text(err), None)
        except BaseException as err:
            self.all_gather((error_text(err), None))
            raise
        outcomes = self.all_gather(outcome)
        failures = [f"rank {r} failed: {error}" for r, (error, _) in enumerate(outcomes) if error]
        if failures:
            raise ConversionError(failed("; ".join(failures)))
        return [result for _, result in outcomes]


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


def error_text(err: BaseException) -> str:
    """``"ConversionError: ..."``: an error as one rank tells the others."""
    return f"{type(err).__name__}: {err}"
