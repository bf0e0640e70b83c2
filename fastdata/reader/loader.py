"""``fastdata.loader``: a DataLoader with defaults that suit fastdata datasets, and that the
training frameworks (Lightning, Accelerate, transformers) can rebuild, re-wrap and resume
without losing its epoch.

Epochs and random crops. A fastdata Dataset draws the random crops of sample ``i`` from a
generator keyed by ``(dataset.seed, epoch, i)`` (:func:`fastdata.reader.seeding.sample_rng`), so
crops are a pure function of the epoch and the index. Worker processes hold their own copy
of the dataset (persistent workers keep it across epochs), so the epoch travels with the
indices: :class:`EpochBatchSampler`, the loader's ``batch_sampler``, makes the first index of
every batch a :class:`fastdata.reader.seeding.EpochIndex` (an int that carries ``.epoch``), which
the Dataset reads in whichever process builds the batch. The tag lives in the batch sampler,
not in the loader, because frameworks rebuild loaders around it: Accelerate's ``prepare``
makes a new DataLoader whose batch sampler wraps this one (``BatchSamplerShard``), Lightning
re-instantiates the loader with its own sampler. One tagged int per batch costs about a
microsecond; tagging every index would cost the main process about 3 us per sample, which
is why samplers themselves yield plain ints.

Which epoch an iteration is (read when it starts):

* a sampler with ``set_epoch`` and ``epoch`` (:class:`fastdata.DistributedShardSampler`,
  ``DistributedSampler``, Accelerate's seedable sampler): its ``epoch``;
* otherwise the dataset's ``epoch``, which the loader counts: its n-th iteration (from 0) is
  epoch n. A framework that calls ``set_epoch`` on the loader, the sampler or the dataset moves
  the same epoch (:meth:`Loader.set_epoch` forwards to the sampler).

With ``shuffle=True`` and no ``generator`` of the caller's, the loader's generator is re-seeded
from ``(seed, epoch)`` at the start of every iteration, so the order of an epoch, and the seeds
of its workers, are a pure function of them too. That is what makes :meth:`Loader.state_dict`
small: ``(epoch, batches yielded)``; :meth:`Loader.load_state_dict` makes the next iteration
that epoch, minus the batches already yielded (their indices are drawn and dropped, no sample
is read). This is the protocol of torchdata's ``StatefulDataLoader``, which Lightning saves in
its checkpoints and restores by itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader

from fastdata.common import portable
from fastdata.reader.batching import collate
from fastdata.reader.seeding import EpochIndex, seed_worker
from fastdata.reader.threads import ThreadLoaderIter
from fastdata.reader.worker_types import WORKER_TYPES

__all__ = ["EpochBatchSampler", "Loader", "LOADER_STATE_VERSION", "WORKER_TYPES", "default_num_workers", "loader"]

#: version of the dict :meth:`Loader.state_dict` returns
LOADER_STATE_VERSION = 1
# keeps the generator seeds derived here apart from other uses of the dataset's seed
_TAG_ORDER = 0x5EED_0D0E


def default_num_workers() -> int:
    """Cores this process may use, capped at 8 (beyond that, measure with ``fastdata tune``)."""
    return max(0, min(8, portable.available_cores()))


def _keeps_epoch(sampler: Any) -> bool:
    """Whether ``sampler`` keeps its own epoch (``set_epoch`` and an int ``epoch``)."""
    return callable(getattr(sampler, "set_epoch", None)) and isinstance(getattr(sampler, "epoch", None), int)


def iteration_epoch(sampler: Any, dataset: Any) -> int | None:
    """The epoch an iteration over ``sampler`` and ``dataset`` is for: the sampler's own epoch when it
    has one, else the dataset's (None: the dataset has no epoch set, so nothing is tagged)."""
    if _keeps_epoch(sampler):
        return int(sampler.epoch)
    epoch = getattr(dataset, "epoch", None)
    return int(epoch) if isinstance(epoch, (int, np.integer)) and not isinstance(epoch, bool) else None


class EpochBatchSampler(BatchSampler):
    """torch's ``BatchSampler`` whose batches carry the epoch they were drawn for: the first
    index of each batch is an :class:`~fastdata.reader.seeding.EpochIndex` (module docstring).

    It is what :func:`fastdata.loader` installs as ``loader.batch_sampler``, so the epoch keeps
    reaching the workers when a framework re-wraps the batch sampler (Accelerate's
    ``BatchSamplerShard``) or rebuilds the loader with another sampler (Lightning; its
    re-instantiation passes ``sampler``, ``batch_size`` and ``drop_last`` as here).

    Args:
        sampler: the index sampler (any iterable of ints with ``len``).
        batch_size (int): indices per batch.
        drop_last (bool): drop a last, short batch.
        dataset: the dataset whose ``epoch`` is used when the sampler has none (None: set by
            the :class:`Loader` that takes this batch sampler).
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, dataset: Any = None) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.dataset = dataset
        # batches of the next iteration to drop unread: a resume point, set by Loader.__iter__
        # (a one-item list the Loader shares, so neither object refers to the other)
        self.skip_next = [0]

    def __iter__(self) -> Iterator[list[int]]:
        return _tagged_batches(super().__iter__(), self.sampler, self.dataset, self.skip_next, per_index=False,
                               batch_size=self.batch_size)


def _tagged_batches(batches, sampler, dataset, skip_next: list[int], per_index: bool, tag: bool = True,
                    batch_size: int | None = None) -> Iterator:
    """``batches`` (an iterator of index lists, or of single indices when ``per_index``) with the
    first ``skip_next[0]`` dropped and the rest tagged with the iteration's epoch.

    A generator: nothing runs until the first batch is asked for, which is after the framework
    has set this iteration's epoch (DataLoader iterators call iter() twice and advance only the
    second; the skip is taken, and cleared, by the one that runs).

    The first batch and a short last one have every index tagged, not just their first: a wrapper
    that evens out the processes' batch counts (Accelerate's ``BatchSamplerShard``) builds its
    padding batches from pieces of exactly those two, and the dataset reads a batch's first index.
    """
    skip, skip_next[0] = skip_next[0], 0
    epoch = iteration_epoch(sampler, dataset) if tag else None
    for number, batch in enumerate(batches):
        if number < skip:
            continue
        if epoch is None:
            yield batch
        elif per_index:
            yield EpochIndex(batch, epoch)
        elif number == 0 or (batch_size is not None and len(batch) < batch_size):
            yield [EpochIndex(index, epoch) for index in batch]
        else:
            batch = list(batch)
            if batch:
                batch[0] = EpochIndex(batch[0], epoch)
            yield batch


class _TaggedIndexSampler:
    """The index sampler of a loader whose batch sampler is the caller's own (or that has no
    batching: every index tagged), with the same skip and tags as :class:`EpochBatchSampler`."""

    def __init__(self, inner, sampler, dataset, skip_next: list[int], per_index: bool, tag: bool) -> None:
        self.inner, self.sampler, self.dataset = inner, sampler, dataset
        self._skip_next, self._per_index, self._tag = skip_next, per_index, tag

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator:
        return _tagged_batches(iter(self.inner), self.sampler, self.dataset, self._skip_next, self._per_index,
                               self._tag, getattr(self.inner, "batch_size", None))


def _order_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch ``epoch`` of a run seeded with ``seed`` (63 bits)."""
    state = np.random.SeedSequence([int(seed) & ((1 << 64) - 1), int(epoch), _TAG_ORDER]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class Loader(DataLoader):
    """The ``DataLoader`` :func:`loader` returns.

    For a dataset with ``set_epoch`` (a fastdata Dataset) its batch sampler is an
    :class:`EpochBatchSampler` (the epoch reaches persistent workers, and survives frameworks
    that re-wrap the loader), it counts epochs when the sampler has none, and it can be
    checkpointed mid-epoch (:meth:`state_dict`, :meth:`load_state_dict`: the protocol of
    torchdata's ``StatefulDataLoader`` that Lightning saves and restores itself). ``sampler``,
    ``batch_sampler``, ``batch_size`` and ``len()`` (the whole epoch, also after a resume) are
    the usual ones.

    ``worker_type="thread"`` loads with ``num_workers`` threads of the training process instead of
    worker processes (:mod:`fastdata.reader.threads`): the same batches, in the same order, with
    the same random crops and resume points. ``num_workers`` keeps its value, so a framework that
    reads or copies it sees the loader's parallelism.
    """

    def __init__(self, dataset, *args, _reseeds_order: bool = False, worker_type: str = "process", **kwargs):
        if worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type must be one of {', '.join(map(repr, WORKER_TYPES))}, got {worker_type!r}")
        #: ``"process"`` (DataLoader worker processes) or ``"thread"`` (threads of this process)
        self.worker_type = worker_type  # (before DataLoader.__init__, which checks the worker count)
        super().__init__(dataset, *args, **kwargs)
        if worker_type == "thread" and self._dataset_kind != 0:  # torch's _DatasetKind.Map
            raise ValueError("worker_type='thread' needs a map-style dataset (one with __getitem__ and __len__); "
                             "an IterableDataset is iterated by one process or by worker processes")
        saved = self.__dict__.get("__pl_saved_kwargs")
        if worker_type != "process" and isinstance(saved, dict):
            # Lightning rebuilds a loader (to put its DistributedSampler in) from the arguments it saw
            # passed to __init__. When this class was defined inside its recording (fastdata imported
            # lazily, in a *_dataloader hook), it saw only DataLoader's: without this, the rebuilt
            # loader would quietly go back to worker processes.
            saved.setdefault("worker_type", worker_type)
        self._tags_epochs = callable(getattr(dataset, "set_epoch", None))
        batches = self.batch_sampler
        if self._tags_epochs and type(batches) is BatchSampler and "batch_sampler" not in kwargs:
            # The batch sampler DataLoader made from batch_size: the same, tagging its batches.
            # object.__setattr__: DataLoader refuses to change batch_sampler after __init__.
            batches = EpochBatchSampler(batches.sampler, batches.batch_size, batches.drop_last, dataset)
            object.__setattr__(self, "batch_sampler", batches)
        elif isinstance(batches, EpochBatchSampler) and batches.dataset is None:
            batches.dataset = dataset  # rebuilt by a framework from the sampler, size and drop_last
        # the skip of the next iteration (a resume point), shared with whatever tags the batches
        self._skip_next = batches.skip_next if isinstance(batches, EpochBatchSampler) else [0]
        self._reseeds_order = bool(_reseeds_order) and self.generator is not None
        self._next_epoch = 0
        self._resume_skip = 0
        self._iteration: tuple[int | None, int, weakref.ref] | None = None  # (epoch, skipped, iterator)

    # -- epochs -------------------------------------------------------------------------------
    def _epoch_sampler(self):
        for candidate in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if _keeps_epoch(candidate):
                return candidate
        return None

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (the following ones count on from it).

        Forwarded to the sampler's ``set_epoch`` when it has its own epoch (as transformers'
        ``Trainer`` and Accelerate expect of a loader) and to the dataset's.

        Args:
            epoch (int): a non-negative epoch number.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self._next_epoch:
            self._resume_skip = 0  # another epoch than a loaded resume point: start it afresh
        self._next_epoch = epoch
        sampler = self._epoch_sampler()
        if sampler is not None:
            sampler.set_epoch(epoch)
        if self._tags_epochs:
            cast(Any, self.dataset).set_epoch(epoch)

    @property
    def _index_sampler(self):
        # What every DataLoader iterator draws its indices from (also at each reset of persistent
        # workers). An EpochBatchSampler tags and skips by itself; anything else is wrapped here
        # (tagged only for a dataset with epochs; skipped in any case, after load_state_dict).
        inner = super()._index_sampler
        if isinstance(inner, EpochBatchSampler) or not hasattr(self, "_skip_next"):
            return inner
        sampler = self.sampler if not self._auto_collation else getattr(inner, "sampler", self.sampler)
        return _TaggedIndexSampler(inner, sampler, self.dataset, self._skip_next,
                                   per_index=not self._auto_collation, tag=self._tags_epochs)

    def __iter__(self):
        sampler = self._epoch_sampler()
        if sampler is None and self._tags_epochs:
            cast(Any, self.dataset).set_epoch(self._next_epoch)
        epoch = int(sampler.epoch) if sampler is not None else self._next_epoch
        self._next_epoch = epoch + 1
        if self._reseeds_order and self.generator is not None:
            self.generator.manual_seed(_order_seed(getattr(self.dataset, "seed", 0), epoch))
        skip, self._resume_skip = self._resume_skip, 0
        self._skip_next[0] = skip
        iterator = super().__iter__()
        self._iteration = (epoch, skip, weakref.ref(iterator))
        return iterator

    def check_worker_number_rationality(self) -> None:
        # (torch warns when worker processes outnumber the cores; threads that wait on I/O or
        # hand the GIL back while decoding do not cost a process each)
        if self.worker_type != "thread":
            super().check_worker_number_rationality()

    def _get_iterator(self):
        if self.worker_type == "thread" and self.num_workers > 0:
            return ThreadLoaderIter(self)
        return super()._get_iterator()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The resume point: the epoch in progress and the batches this process has taken from it.

        Counted from what the loader's iterator has yielded (not what workers prefetched), as
        torchdata's ``StatefulDataLoader`` does; Lightning calls it when it saves a checkpoint.

        Returns:
            dict: ``{"version", "epoch", "batches", "complete"}``, JSON-serialisable.
        """
        epoch, batches = self._next_epoch, 0
        if self._iteration is not None:
            epoch_of_iter, skipped, ref = self._iteration
            iterator = ref()
            if iterator is not None and epoch_of_iter is not None:
                epoch = epoch_of_iter
                batches = skipped + int(getattr(iterator, "_num_yielded", 0))
        if self._resume_skip:  # loaded but not iterated yet: the loaded point is still the state
            epoch, batches = self._next_epoch, self._resume_skip
        total = len(self)
        return {"version": LOADER_STATE_VERSION, "epoch": int(epoch), "batches": int(min(batches, total)),
                "complete": bool(batches >= total)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration is that epoch without the batches
        already taken (or the next epoch from its start, when that one was complete).

        The order must be reproducible from the epoch: a fastdata sampler, ``DistributedSampler``
        or this loader's own shuffle (``shuffle=True`` without a ``generator``); the same number
        of ranks and the same batch size as when it was saved.

        Args:
            state (Mapping): a dict from :meth:`state_dict`.

        Raises:
            ValueError: not a loader state of this version, or a batch count beyond the epoch.
        """
        if not isinstance(state, Mapping) or state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"not a fastdata loader state (version {LOADER_STATE_VERSION}): {state!r:.200}")
        epoch, batches = state.get("epoch"), state.get("batches")
        for key, value in (("epoch", epoch), ("batches", batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loader state {key!r} must be an int >= 0, got {value!r}")
        assert isinstance(epoch, int) and isinstance(batches, int)
        if batches > len(self):
            raise ValueError(f"loader state has {batches} batches taken from an epoch of {len(self)}: "
                             "it was saved with another batch size, dataset or number of ranks")
        if state.get("complete") or batches == len(self):
            epoch, batches = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume_skip = batches
        self._iteration = None


def loader(dataset, batch_size: int = 64, *, seed: int | None = None, worker_type: str = "process",
           **kwargs) -> Loader:
    """Build a ``torch.utils.data.DataLoader`` (a :class:`Loader`) for ``dataset``.

    Defaults (each overridable by passing the keyword): ``num_workers`` =
    :func:`default_num_workers`, ``pin_memory`` when CUDA is available,
    ``worker_init_fn=fastdata.seed_worker`` (distinct, reproducible per-worker seeds),
    ``collate_fn=fastdata.collate`` (passes batches decoded into one array through without
    another copy, and carries counts of skipped damaged samples to ``dataset.skipped``), and
    ``shuffle=True`` unless a ``sampler`` or ``batch_sampler`` is given. Workers are not
    persistent by default: a training loader's workers would otherwise stay alive (with their
    memory) through every validation loop; pass ``persistent_workers=True`` to keep them
    between epochs, which saves their start-up (about 0.1 s per worker with fork).

    Args:
        dataset: a fastdata Dataset (any map-style Dataset works; the epoch plumbing
            applies to datasets with ``set_epoch``).
        batch_size (int): samples per batch (ignored with ``batch_sampler``).
        seed (int | None): seed of the dataset's random decode-time crops and of the loader's
            shuffle (``dataset.seed``); None keeps the dataset's own (``torch.initial_seed()``
            when it was created).
        worker_type (str): ``"process"`` (DataLoader worker processes, the default) or
            ``"thread"``: ``num_workers`` threads in this process read, decode and collate whole
            batches (:mod:`fastdata.reader.threads`): no worker start-up, no copy between
            processes, one process's memory. Fast when decoding releases the GIL (fastdata's
            decoders and fused crops do); a Python ``transform`` that holds it serialises the
            threads (``fastdata doctor`` and ``fastdata tune`` measure which is faster).

    Random crops depend only on ``(seed, epoch, sample index)``, and the shuffled order only on
    ``(seed, epoch)``: the same whatever ``num_workers``, batch size, start method or resume
    point (module docstring).

    Returns:
        Loader: a ``torch.utils.data.DataLoader`` with ``state_dict``/``load_state_dict``.
    """
    kwargs.setdefault("num_workers", default_num_workers())
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    if worker_type != "thread":
        # (seed_worker seeds process-wide generators and freezes the GC: right in a worker process,
        # wrong in a thread of the training process; threads draw crops from per-sample streams)
        kwargs.setdefault("worker_init_fn", seed_worker)
    kwargs.setdefault("collate_fn", collate)
    if seed is not None:
        if not hasattr(dataset, "seed"):
            raise ValueError("seed= applies to fastdata datasets (the seed of their decode-time crops)")
        dataset.seed = int(seed)
    for key in ("sampler", "batch_sampler"):  # sampler=None means no sampler, as in DataLoader
        if key in kwargs and kwargs[key] is None:
            del kwargs[key]
    if "sampler" not in kwargs and "batch_sampler" not in kwargs:
        kwargs.setdefault("shuffle", True)
    reseeds = bool(kwargs.get("shuffle")) and kwargs.get("generator") is None
    if reseeds:
        kwargs["generator"] = torch.Generator()
    if "batch_sampler" in kwargs:
        return Loader(dataset, _reseeds_order=reseeds, worker_type=worker_type, **kwargs)
    return Loader(dataset, batch_size=batch_size, _reseeds_order=reseeds, worker_type=worker_type, **kwargs)
