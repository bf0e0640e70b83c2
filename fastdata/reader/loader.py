"""``fastdata.loader``: a DataLoader with defaults that suit fastdata datasets.

Epochs and random crops. A fastdata Dataset draws the random crops of sample ``i`` from a
generator keyed by ``(dataset.seed, epoch, i)`` (:func:`fastdata.reader.seeding.sample_rng`), so
crops are a pure function of the epoch and the index. Worker processes hold their own copy
of the dataset (persistent workers keep it across epochs), so the loader sends the epoch
with the indices: the first index of every batch is a :class:`fastdata.reader.seeding.EpochIndex`
(an int that carries ``.epoch``), which the Dataset reads in whichever process builds the
batch. One tagged int per batch costs about a microsecond; tagging every index would cost
the main process about 3 us per sample (creating and pickling int subclasses), which is
why samplers themselves yield plain ints. Which epoch:

* a sampler with ``set_epoch`` and ``epoch`` (:class:`fastdata.DistributedShardSampler`,
  ``DistributedSampler``): its ``epoch``, set with ``sampler.set_epoch(e)`` as usual;
* otherwise the loader counts: its n-th iteration (from 0) is epoch n, and
  :meth:`Loader.set_epoch` picks the epoch of the next one (e.g. when resuming).

A resume point is then just ``(seed, epoch, position)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader

from fastdata.reader.batching import collate
from fastdata.reader.seeding import EpochIndex, seed_worker


def default_num_workers() -> int:
    """Cores this process may use, capped at 8 (beyond that, measure with ``fastdata tune``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(8, cores))


class _EpochTagged:
    """The loader's index sampler with the first index of each batch (or, without
    batching, every index) tagged with ``source.epoch`` as it is when an iteration starts.

    It must not refer back to the loader: the loader holds its persistent iterator, which
    holds this object, and such a cycle would leave the workers' shutdown to whenever the
    garbage collector runs (possibly inside a later forked child) instead of when the
    loader is dropped.
    """

    def __init__(self, inner, source, batched: bool):
        self.inner, self._source, self._batched = inner, source, batched

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator:
        epoch = int(self._source.epoch)
        if not self._batched:
            for index in self.inner:
                yield EpochIndex(index, epoch)
            return
        for batch in self.inner:
            batch = list(batch)
            if batch:
                batch[0] = EpochIndex(batch[0], epoch)
            yield batch


@runtime_checkable
class _EpochSettable(Protocol):
    """A dataset whose epoch the loader advances (a fastdata Dataset)."""

    def set_epoch(self, epoch: int) -> None: ...


def _sampler_with_epoch(loader: DataLoader):
    """The loader's sampler if it has its own epoch (``set_epoch`` and ``epoch``), else None."""
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(candidate, "set_epoch") and hasattr(candidate, "epoch"):
            return candidate
    return None


class Loader(DataLoader):
    """The ``DataLoader`` :func:`loader` returns: for a dataset with ``set_epoch`` (a fastdata
    Dataset) it sends the epoch to the workers with each batch of indices, and advances the
    dataset's epoch at each new iteration when the sampler has no epoch of its own (see the
    module docstring). ``sampler``, ``batch_sampler`` and ``batch_size`` are the usual ones."""

    def __init__(self, dataset, *args, **kwargs):
        super().__init__(dataset, *args, **kwargs)
        self._tags_epochs = callable(getattr(dataset, "set_epoch", None))
        self._epoch_sampler = _sampler_with_epoch(self)
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (the following ones count on from it).

        With a sampler that has its own epoch, call the sampler's ``set_epoch`` instead.

        Args:
            epoch (int): a non-negative epoch number.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._next_epoch = epoch

    @property
    def _index_sampler(self):
        # What every DataLoader iterator draws its indices from (also at each reset of
        # persistent workers); wrapping it leaves loader.sampler / batch_sampler untouched.
        inner = super()._index_sampler
        if not getattr(self, "_tags_epochs", False):
            return inner
        source = self._epoch_sampler if self._epoch_sampler is not None else self.dataset
        return _EpochTagged(inner, source, batched=self._auto_collation)

    def __iter__(self):
        dataset = self.dataset
        # _tags_epochs already says set_epoch is callable; isinstance tells the type checker
        if self._tags_epochs and self._epoch_sampler is None and isinstance(dataset, _EpochSettable):
            dataset.set_epoch(self._next_epoch)
            self._next_epoch += 1
        return super().__iter__()


def loader(dataset, batch_size: int = 64, *, seed: int | None = None, **kwargs) -> Loader:
    """Build a ``torch.utils.data.DataLoader`` (a :class:`Loader`) for ``dataset``.

    Defaults (each overridable by passing the keyword): ``num_workers`` =
    :func:`default_num_workers`, ``persistent_workers=True`` when workers > 0,
    ``pin_memory`` when CUDA is available, ``worker_init_fn=fastdata.seed_worker``
    (distinct, reproducible per-worker seeds), ``collate_fn=fastdata.collate``
    (passes batches decoded into one array through without another copy, and carries
    counts of skipped damaged samples to ``dataset.skipped``), and ``shuffle=True``
    unless a ``sampler`` or ``batch_sampler`` is given.

    Args:
        dataset: a fastdata Dataset (any map-style Dataset works; the epoch plumbing
            applies to datasets with ``set_epoch``).
        batch_size (int): samples per batch (ignored with ``batch_sampler``).
        seed (int | None): seed of the dataset's random decode-time crops
            (``dataset.seed``); None keeps the dataset's own (``torch.initial_seed()``
            when it was created).

    Random crops depend only on ``(seed, epoch, sample index)``: the same whatever
    ``num_workers``, batch size, start method or resume point (module docstring).

    Returns:
        Loader: a ``torch.utils.data.DataLoader``.
    """
    kwargs.setdefault("num_workers", default_num_workers())
    if kwargs["num_workers"] > 0:
        kwargs.setdefault("persistent_workers", True)
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    kwargs.setdefault("worker_init_fn", seed_worker)
    kwargs.setdefault("collate_fn", collate)
    if seed is not None:
        if not hasattr(dataset, "seed"):
            raise ValueError("seed= applies to fastdata datasets (the seed of their decode-time crops)")
        dataset.seed = int(seed)
    if "sampler" not in kwargs and "batch_sampler" not in kwargs:
        kwargs.setdefault("shuffle", True)
    if "batch_sampler" in kwargs:
        return Loader(dataset, **kwargs)
    return Loader(dataset, batch_size=batch_size, **kwargs)
