"""``fastdata.loader``: a DataLoader with defaults that suit fastdata datasets."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from .dataset import collate
from .seeding import seed_worker


def default_num_workers() -> int:
    """Cores this process may use, capped at 8 (beyond that, measure with ``fastdata tune``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(8, cores))


def loader(dataset, batch_size: int = 64, **kwargs) -> DataLoader:
    """Build a ``torch.utils.data.DataLoader`` for ``dataset``.

    Defaults (each overridable by passing the keyword): ``num_workers`` =
    :func:`default_num_workers`, ``persistent_workers=True`` when workers > 0,
    ``pin_memory`` when CUDA is available, ``worker_init_fn=fastdata.seed_worker``
    (distinct, reproducible per-worker seeds), ``collate_fn=fastdata.collate``
    (passes batches decoded into one array through without another copy), and
    ``shuffle=True`` unless a ``sampler`` or ``batch_sampler`` is given.

    Returns:
        torch.utils.data.DataLoader
    """
    kwargs.setdefault("num_workers", default_num_workers())
    if kwargs["num_workers"] > 0:
        kwargs.setdefault("persistent_workers", True)
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    kwargs.setdefault("worker_init_fn", seed_worker)
    kwargs.setdefault("collate_fn", collate)
    if "sampler" not in kwargs and "batch_sampler" not in kwargs:
        kwargs.setdefault("shuffle", True)
    if "batch_sampler" in kwargs:
        return DataLoader(dataset, **kwargs)
    return DataLoader(dataset, batch_size=batch_size, **kwargs)
