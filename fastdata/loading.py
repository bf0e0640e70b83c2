"""``fastdata.loader``: a DataLoader with defaults that suit fastdata datasets.

Epochs and random crops. A fastdata Dataset draws the random crops of sample ``i`` from a
generator keyed by ``(dataset.seed, epoch, i)`` (:func:`fastdata.seeding.sample_rng`), so
crops are a pure function of the epoch and the index. The loader feeds it the epoch in the
one way that reaches every worker, persistent or not, forked or spawned: with the indices
themselves. Its sampler yields :class:`fastdata.seeding.EpochIndex` values (ints that carry
``.epoch``), read by the Dataset in whichever process builds the batch. Which epoch:

* a sampler that tags indices itself (:class:`fastdata.DistributedShardSampler`): its own,
  set with ``sampler.set_epoch(e)`` as usual;
* another sampler with ``set_epoch`` (e.g. ``DistributedSampler``): its ``epoch``;
* otherwise the loader counts: its n-th iteration (from 0) is epoch n, and
  :meth:`Loader.set_epoch` picks the epoch of the next one (e.g. when resuming).

A resume point is then just ``(seed, epoch, position)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from .dataset import collate
from .sampler import DistributedShardSampler
from .seeding import EpochIndex, seed_worker


def default_num_workers() -> int:
    """Cores this process may use, capped at 8 (beyond that, measure with ``fastdata tune``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(8, cores))


class _EpochTagging:
    """Shared by the two wrappers: delegate everything else to the wrapped sampler
    (so ``loader.sampler.set_epoch(...)`` still reaches it)."""

    inner: object

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


class EpochSampler(_EpochTagging):
    """Yield the indices of ``sampler`` as :class:`~fastdata.seeding.EpochIndex` tagged
    with ``epoch()``, read once when an iteration starts.

    Args:
        sampler: any iterable of int indices.
        epoch (Callable[[], int]): the epoch of the iteration starting now.
    """

    def __init__(self, sampler, epoch: Callable[[], int]):
        self.inner, self._epoch = sampler, epoch

    def __iter__(self) -> Iterator[int]:
        epoch = self._epoch()
        for index in self.inner:
            yield EpochIndex(index, epoch)


class EpochBatchSampler(_EpochTagging):
    """:class:`EpochSampler` for a batch sampler: every index of every batch is tagged."""

    def __init__(self, batch_sampler, epoch: Callable[[], int]):
        self.inner, self._epoch = batch_sampler, epoch

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._epoch()
        for batch in self.inner:
            yield [EpochIndex(index, epoch) for index in batch]


class Loader(DataLoader):
    """The ``DataLoader`` :func:`loader` returns: it also advances a fastdata Dataset's epoch
    at each new iteration when no sampler does (see the module docstring)."""

    def __init__(self, dataset, *args, drives_epoch: bool = False, **kwargs):
        super().__init__(dataset, *args, **kwargs)
        self._drives_epoch = drives_epoch
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (the following ones count on from it).

        Args:
            epoch (int): a non-negative epoch number.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._next_epoch = epoch

    def __iter__(self):
        if self._drives_epoch:
            self.dataset.set_epoch(self._next_epoch)
            self._next_epoch += 1
        return super().__iter__()


def _tag_epochs(dataset, kwargs: dict) -> bool:
    """Wrap the sampler (or batch sampler) in ``kwargs`` so that it yields epoch-tagged
    indices; returns whether the loader must count epochs itself."""
    def dataset_epoch() -> int:
        return dataset.epoch

    key = "batch_sampler" if "batch_sampler" in kwargs else "sampler"
    inner = kwargs.get(key)
    if inner is None:
        generator = kwargs.get("generator")
        inner = RandomSampler(dataset, generator=generator) if kwargs.pop("shuffle", True) else SequentialSampler(
            dataset)
    elif isinstance(inner, DistributedShardSampler) or isinstance(getattr(inner, "sampler", None),
                                                                 DistributedShardSampler):
        return False  # it tags indices with its own epoch
    sampler_has_epoch = hasattr(inner, "set_epoch") and hasattr(inner, "epoch")
    source = (lambda: inner.epoch) if sampler_has_epoch else dataset_epoch
    kwargs[key] = (EpochBatchSampler if key == "batch_sampler" else EpochSampler)(inner, source)
    return not sampler_has_epoch


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
    drives_epoch = False
    if callable(getattr(dataset, "set_epoch", None)):
        if seed is not None:
            dataset.seed = int(seed)
        drives_epoch = _tag_epochs(dataset, kwargs)
    elif "sampler" not in kwargs and "batch_sampler" not in kwargs:
        kwargs.setdefault("shuffle", True)
    if "batch_sampler" in kwargs:
        return Loader(dataset, drives_epoch=drives_epoch, **kwargs)
    return Loader(dataset, batch_size=batch_size, drives_epoch=drives_epoch, **kwargs)
