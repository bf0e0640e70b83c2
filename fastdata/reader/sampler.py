"""Rank-aware, block-shuffling, resumable sampler for (distributed) DataLoaders.

:class:`DistributedShardSampler` is a drop-in for ``torch.utils.data.distributed.DistributedSampler``
(the same indices for the same seed and epoch with ``block_size=1``) with three additions: ``block_size``
shuffles blocks of consecutive records, so a batch reads a few storage regions instead of scattered
records; ``shard_window=W`` has each rank read its shards W at a time, so a store larger than the local
cache of remote shards streams through it; ``state_dict(consumed)``/``load_state_dict`` resume mid-epoch,
also on another number of ranks. Everything follows from one sequence per epoch, the global order ``Q``,
a pure function of the dataset's length, seed, epoch, settings and the starting world size, which every
rank computes without communicating; rank ``r`` yields ``Q[r::R]``, so a resume point is one integer.

The specification (the global order, shard windows, resuming) and the shuffle-quality measurements
behind the defaults: ``docs/sampling.md``.
"""

from __future__ import annotations

import hashlib
import numbers
import sys
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

__all__ = ["DistributedShardSampler", "STATE_VERSION", "epoch_order"]

#: Version of the dict written by :meth:`DistributedShardSampler.state_dict`.
STATE_VERSION = 1

# Settings that fix the global order; a state dict only applies to a sampler with equal values.
_ORDER_KEYS = ("seed", "shuffle", "drop_last", "dataset_len", "block_size", "window")
# Present only in shard-window mode, so states of the other modes keep their exact keys.
_SHARD_KEYS = ("shard_window", "shard_layout")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _num_samples(n: int, replicas: int, drop_last: bool) -> int:
    """Per-rank count for ``n`` indices, DistributedSampler's rule."""
    return n // replicas if drop_last else -(-n // replicas)


def _pad_or_drop(seq: np.ndarray, replicas: int, drop_last: bool) -> np.ndarray:
    """Cut ``seq`` to, or pad it by cycling from its start to, a multiple of ``replicas``."""
    total = _num_samples(len(seq), replicas, drop_last) * replicas
    if total <= len(seq):
        return seq[:total]
    # np.resize repeats cyclically: DistributedSampler's (indices * k)[:padding_size].
    return np.concatenate([seq, np.resize(seq, total - len(seq))])


def _base_order(n: int, shuffle: bool, block_size: int, gen: torch.Generator) -> np.ndarray:
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    if block_size == 1:
        return torch.randperm(n, generator=gen).numpy().astype(np.int64, copy=False)
    offset = int(torch.randint(block_size, (1,), generator=gen))
    n_full = n // block_size
    perm = torch.randperm(n_full, generator=gen).numpy().astype(np.int64, copy=False)
    within = np.arange(block_size, dtype=np.int64)
    full = (offset + perm[:, None] * block_size + within[None, :]).ravel()
    short = offset + n_full * block_size + np.arange(n - n_full * block_size, dtype=np.int64)
    return np.concatenate([full, short]) % n


def _deal(padded: np.ndarray, replicas: int, block_size: int) -> np.ndarray:
    """Split ``padded`` into ``replicas`` equal streams, ``block_size`` consecutive positions each
    per round; returns shape ``(replicas, len(padded) // replicas)``."""
    per_rank = len(padded) // replicas
    rounds = per_rank // block_size
    cut = rounds * replicas * block_size
    blocks = padded[:cut].reshape(rounds, replicas, block_size).transpose(1, 0, 2)
    head = blocks.reshape(replicas, rounds * block_size)
    tail = padded[cut:].reshape(replicas, per_rank - rounds * block_size)
    return np.concatenate([head, tail], axis=1)


def _window_shuffle(streams: np.ndarray, window: int, gen: torch.Generator) -> np.ndarray:
    """Jittered sort of each row: positions ``window`` or more apart keep their order."""
    if window <= 1 or streams.shape[1] < 2:
        return streams
    # float64: float32 cannot hold position + fraction exactly beyond ~2**24 / window.
    noise = torch.rand(streams.shape, generator=gen, dtype=torch.float64).numpy()
    keys = np.arange(streams.shape[1], dtype=np.float64)[None, :] + noise * window
    return np.take_along_axis(streams, np.argsort(keys, axis=1, kind="stable"), axis=1)


@dataclass(frozen=True)
class _Window:
    """One window of a rank's stream in shard-window mode.

    ``pieces`` are ``(shard, first, end)`` global index ranges, one per shard, in the rank's shard
    order; ``extra`` are padding indices repeated from this window (at most one per rank except
    when the dataset has fewer samples than ranks)."""

    pieces: tuple[tuple[int, int, int], ...]
    extra: tuple[int, ...] = ()

    @property
    def shards(self) -> list[int]:
        return [shard for shard, _, _ in self.pieces]

    @property
    def size(self) -> int:
        return sum(end - first for _, first, end in self.pieces) + len(self.extra)

    def indices(self) -> np.ndarray:
        """The window's indices in storage order (padding last)."""
        parts = [np.arange(first, end, dtype=np.int64) for _, first, end in self.pieces]
        return np.concatenate([*parts, np.asarray(self.extra, dtype=np.int64)])


def _shard_order(sizes: np.ndarray, shuffle: bool, gen: torch.Generator) -> np.ndarray:
    """Shards in this epoch's reading order, empty shards left out (nothing to read there)."""
    order = np.arange(len(sizes), dtype=np.int64)
    if shuffle and len(sizes) > 1:
        order = torch.randperm(len(sizes), generator=gen).numpy().astype(np.int64, copy=False)
    return order[sizes[order] > 0]


def _pieces(a: int, b: int, order: np.ndarray, ends: np.ndarray, sizes: np.ndarray,
            starts: np.ndarray) -> list[tuple[int, int, int]]:
    """``(shard, first, end)`` ranges covering positions ``[a, b)`` of the shard-ordered sequence
    (the shards of ``order`` laid end to end, each in storage order; ``ends`` its cumulative
    sizes)."""
    pieces = []
    j = int(np.searchsorted(ends, a, side="right"))
    while a < b and j < len(order):
        shard = int(order[j])
        seq_start = int(ends[j]) - int(sizes[shard])
        lo, hi = max(a, seq_start) - seq_start, min(b, int(ends[j])) - seq_start
        pieces.append((shard, int(starts[shard]) + lo, int(starts[shard]) + hi))
        a, j = seq_start + hi, j + 1
    return pieces


def _shard_layout(sizes: np.ndarray, *, epoch: int, seed: int, shuffle: bool, drop_last: bool,
                  shard_window: int, replicas: int) -> list[list[_Window]]:
    """Every rank's windows for one epoch (see "Shard windows" in the module docstring)."""
    n = int(sizes.sum())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    order = _shard_order(sizes, shuffle, gen)
    ends = np.cumsum(sizes[order])
    per_rank = _num_samples(n, replicas, drop_last)
    q, rem = divmod(n, replicas)
    longer = 0 if drop_last else rem  # the first `longer` ranks take q + 1 positions, the rest q
    layout = []
    for rank in range(replicas):
        a, b = rank * q + min(rank, longer), (rank + 1) * q + min(rank + 1, longer)
        if a == b and per_rank:
            # Fewer samples than ranks: this rank's one sample repeats an index, as
            # DistributedSampler's padding does (position rank of the cyclic sequence).
            a, b = rank % n, rank % n + 1
        pieces = _pieces(a, b, order, ends, sizes, starts)
        windows = [_Window(tuple(pieces[i:i + shard_window]))
                   for i in range(0, len(pieces), shard_window)]
        pad = per_rank - sum(w.size for w in windows)
        if pad:
            # Pad from the rank's own last window so padding needs no other shard on disk.
            extra = np.resize(windows[-1].indices(), pad)
            windows[-1] = _Window(windows[-1].pieces, tuple(int(i) for i in extra))
        layout.append(windows)
    return layout


def _window_rng(seed: int, epoch: int, replicas: int, rank: int, window: int) -> np.random.Generator:
    # One independent stream per window: a rank shuffles its own windows without drawing the
    # other ranks' shuffles first (O(samples per rank), not O(dataset), per epoch).
    return np.random.default_rng([(seed + epoch) % 2**64, replicas, rank, window])


def _rank_stream(windows: list[_Window], *, epoch: int, seed: int, shuffle: bool, replicas: int,
                 rank: int) -> np.ndarray:
    """One rank's indices for the epoch: its windows in order, each shuffled within itself."""
    parts = []
    for w, window in enumerate(windows):
        indices = window.indices()
        if shuffle:
            indices = _window_rng(seed, epoch, replicas, rank, w).permutation(indices)
        parts.append(indices)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def shard_sizes_from_starts(starts: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """Records per shard from each shard's first global index (a StoreDataset's ``shard_starts``).

    Args:
        starts: first index of each shard, non-decreasing, starting at 0.
        n: dataset length; the last shard ends there.

    Returns:
        ``np.ndarray`` of int64 sizes summing to ``n``.

    Raises:
        ValueError: starts that do not tile ``[0, n)``.
    """
    arr = np.asarray(starts)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"shard starts must be a 1-D sequence of ints, got {starts!r}")
    arr = arr.astype(np.int64)
    if arr.size == 0:
        if n:
            raise ValueError(f"no shard starts for a dataset of {n} samples")
        return arr
    sizes = np.diff(np.append(arr, n))
    if arr[0] != 0 or (sizes < 0).any():
        raise ValueError(
            f"shard starts must begin at 0 and not decrease up to the dataset length {n}, got "
            f"{arr.tolist()[:8]}{'...' if arr.size > 8 else ''}"
        )
    return sizes


def _check_shard_sizes(shard_sizes: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    values = list(shard_sizes)
    if not all(_is_int(v) or isinstance(v, np.integer) for v in values) or any(v < 0 for v in values):
        raise ValueError(f"shard_sizes must be ints >= 0, got {values[:8]}")
    sizes = np.asarray(values, dtype=np.int64)
    if int(sizes.sum()) != n:
        raise ValueError(
            f"shard_sizes sum to {int(sizes.sum())} but the dataset has {n} samples; give the "
            "number of records of every shard in storage order"
        )
    return sizes


def _layout_digest(sizes: np.ndarray) -> str:
    """Short fingerprint of the shard sizes: a state only resumes on the same shard layout."""
    return f"{len(sizes)}:{hashlib.sha256(sizes.astype('<i8').tobytes()).hexdigest()[:16]}"


def epoch_order(
    n: int,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
    block_size: int,
    window: int,
    replicas: int,
    shard_sizes: Sequence[int] | np.ndarray | None = None,
    shard_window: int | None = None,
) -> np.ndarray:
    """Return the global order ``Q`` of one epoch (see the module docstring).

    Args:
        n: dataset length.
        epoch, seed: the generator is seeded with ``seed + epoch``.
        shuffle, drop_last, block_size, window: as in :class:`DistributedShardSampler`.
        replicas: number of ranks the epoch started on (``R0``).
        shard_sizes, shard_window: shard-window mode when ``shard_window`` is set (records per
            shard in storage order, and shards per window); ``block_size`` must then be 1.

    Returns:
        ``np.ndarray`` of int64, length ``num_samples * replicas``; rank ``r`` of ``replicas``
        reads ``Q[r::replicas]``.
    """
    if shard_window is not None:
        sizes = _check_shard_sizes(shard_sizes if shard_sizes is not None else [n], n)
        layout = _shard_layout(sizes, epoch=epoch, seed=seed, shuffle=shuffle, drop_last=drop_last,
                               shard_window=shard_window, replicas=replicas)
        return np.stack([_rank_stream(windows, epoch=epoch, seed=seed, shuffle=shuffle,
                                      replicas=replicas, rank=rank)
                         for rank, windows in enumerate(layout)]).T.ravel()
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    padded = _pad_or_drop(_base_order(n, shuffle, block_size, gen), replicas, drop_last)
    if block_size == 1:
        return padded
    streams = _deal(padded, replicas, block_size)
    if shuffle:
        streams = _window_shuffle(streams, window, gen)
    return streams.T.ravel()


def _shard_mode(dataset: Sized, n: int, shard_window: int | None,
                shard_sizes: Sequence[int] | None,
                block_size: int) -> tuple[int | None, np.ndarray | None]:
    """Validated ``(shard_window, records per shard)``; ``(None, None)`` when the mode is off."""
    if shard_window is None:
        if shard_sizes is not None:
            raise ValueError("shard_sizes is used only with shard_window= (shards per window)")
        return None, None
    if not _is_int(shard_window) or shard_window < 1:
        raise ValueError(f"shard_window must be None or an int >= 1, got {shard_window!r}")
    if block_size > 1:
        raise ValueError(
            "shard_window and block_size > 1 are two ways to read sequentially; use one: "
            "block_size for runs of consecutive records over a store on local disk, "
            "shard_window to read a few whole shards at a time (a store larger than the local "
            "cache)"
        )
    if shard_sizes is not None:
        return int(shard_window), _check_shard_sizes(shard_sizes, n)
    starts = getattr(dataset, "shard_starts", None)
    if starts is None:
        raise ValueError(
            f"shard_window needs the shard boundaries, and {type(dataset).__name__} has no "
            "shard_starts: pass a fastdata store dataset, a subset of one with sorted indices "
            "(ds.subset(np.sort(indices)); an unsorted subset has no shard boundaries), or "
            "shard_sizes=[records of each shard, in storage order]"
        )
    return int(shard_window), shard_sizes_from_starts(starts, n)


def _check_world(num_replicas: Any, rank: Any) -> None:
    """Validate the ranks a caller gave (either may be None: resolved when first used)."""
    if num_replicas is not None and (not _is_int(num_replicas) or num_replicas < 1):
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if rank is not None and (not _is_int(rank) or rank < 0
                             or (num_replicas is not None and rank >= num_replicas)):
        top = "num_replicas - 1" if num_replicas is None else num_replicas - 1
        raise ValueError(f"Invalid rank {rank!r}, rank should be in [0, {top}]")


#: how many callers up the stack :func:`_resharding_wrapper` looks (sampler <- batch sampler(s) <- wrapper)
_WRAPPER_DEPTH = 12


def _resharding_wrapper() -> Any:
    """Accelerate's ``BatchSamplerShard`` if one is driving this call (iterating or sizing the
    sampler through a batch sampler), else None.

    ``accelerator.prepare(loader)`` wraps the batch sampler of any map-style loader in a
    ``BatchSamplerShard`` that deals whole batches round-robin to the processes, whatever the
    sampler is (``prepare_data_loader`` in ``accelerate/data_loader.py``; there is no attribute
    that tells it a sampler is split already). Nothing is passed down to the sampler either, so
    the only trace is the wrapper's frame on the call stack: a few frames up, read once per
    epoch (``__iter__``) or size query, never per index.
    """
    frame: Any = sys._getframe(2)
    for _ in range(_WRAPPER_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        kind = type(owner)
        if kind.__name__ == "BatchSamplerShard" and kind.__module__.startswith("accelerate"):
            return owner
        frame = frame.f_back
    return None


def _resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        if not initialised and num_replicas != 1:
            raise ValueError(
                f"rank is required with num_replicas={num_replicas} when torch.distributed "
                "is not initialised"
            )
        rank = dist.get_rank() if initialised else 0
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if not _is_int(rank) or not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank!r}, rank should be in [0, {num_replicas - 1}]")
    return int(num_replicas), int(rank)


class DistributedShardSampler(DistributedSampler):
    """Sampler giving each rank an equal, disjoint share of a dataset, optionally block-shuffled
    for sequential reads, with mid-epoch resume across world sizes.

    Args:
        dataset (Sized): anything with ``len()``; only its length is used.
        num_replicas (int | None): number of ranks. ``None``: ``torch.distributed``'s world size
            if a process group is initialised, else 1, read each time the sampler is sized or
            iterated, so the sampler can be made before the process group exists (in a Lightning
            module's ``__init__``, say) and still split the data once it does.
        rank (int | None): this rank. ``None``: ``torch.distributed``'s rank if initialised, else
            0 (a ``ValueError`` when the sampler is used with ``num_replicas > 1`` and no
            process group).
        shuffle (bool): shuffle each epoch (``False``: storage order, dealt to ranks).
        seed (int): base seed; epoch ``e`` uses ``seed + e`` on every rank.
        drop_last (bool): drop the tail so ranks get equal counts, instead of padding.
        block_size (int): ``1`` = per-index shuffle, identical to ``DistributedSampler``.
            ``B > 1`` shuffles blocks of ``B`` consecutive indices and gives each rank whole
            blocks (the module docstring explains the order and its trade-off).
        window (int | None): span of the local shuffle inside each rank's stream in block mode;
            ``1`` disables it; ``None`` = ``4 * block_size``. Must be ``None`` or 1 when
            ``block_size == 1``.
        shard_window (int | None): keyword only. ``None``: off (the modes above, unchanged).
            ``W >= 1``: shard-window mode: shuffle the shard order per epoch, cut it into equal
            runs per rank, and read each rank's shards ``W`` at a time, shuffled per index
            within each window (module docstring, "Shard windows"). Needs ``block_size == 1``.
        shard_sizes (Sequence[int] | None): keyword only; records of each shard in storage
            order (summing to ``len(dataset)``), for shard-window mode over a dataset without
            ``shard_starts`` (fastdata store datasets have it; an explicit value takes
            precedence).

    Shuffle quality and read locality for ``block_size`` 1/16/64/256 (default window), 50,000
    label-sorted samples, batch 256, from the module docstring: distinct labels per batch
    226 / 24.8 / 16.9 / 28.2, storage regions read per batch 235 / 19.7 / 8.6 / 11.0.
    For ``shard_window`` 1/2/4/8 (shards of 1,000 samples): 24.3 / 43.5 / 77.9 / 126.6 labels per
    batch, with 1 / 2 / 4 / 8 shards needed on disk at a time (50 for a per-index shuffle).

    Inside training frameworks. It is a subclass of ``torch.utils.data.DistributedSampler``, which
    is how Lightning tells a loader needs no sampler of its own (its default
    ``use_distributed_sampler=True`` leaves an ``isinstance(sampler, DistributedSampler)`` alone).
    Accelerate's ``prepare`` deals the batches of any loader to its processes again
    (``BatchSamplerShard``): under it, a sampler whose ``num_replicas`` was not given yields the
    whole epoch's global order on every process (as for one rank), so that Accelerate's dealing
    is the only split; an explicit ``num_replicas > 1`` there raises a ``ValueError`` before the
    first batch. ``len()`` is always the whole epoch of this rank, also after
    :meth:`load_state_dict` (an iterator resumed mid-epoch yields the rest), as
    ``DistributedSampler`` and torchdata's samplers do: frameworks size their epochs from it.

    :meth:`set_epoch` and :meth:`load_state_dict` also call ``dataset.set_epoch`` when the dataset
    has one, so a fastdata Dataset's random crops follow the sampler's epoch; under
    :func:`fastdata.loader` the epoch also reaches persistent workers (it travels with each batch
    of indices). With another DataLoader and persistent workers, the workers keep the epoch they
    started with: use ``persistent_workers=False`` there.

    Raises:
        ValueError: bad settings; in shard-window mode also ``shard_window < 1``, ``block_size >
            1``, or no shard boundaries (neither ``dataset.shard_starts`` nor ``shard_sizes``).

    Attributes:
        num_samples (int): per-rank count of a fresh epoch (as in ``DistributedSampler``).
        total_size (int): ``num_samples * num_replicas``.
        shard_window (int | None): shards per window, ``None`` when the mode is off.
        shard_sizes (np.ndarray | None): records per shard in shard-window mode.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        block_size: int = 1,
        window: int | None = None,
        *,
        shard_window: int | None = None,
        shard_sizes: Sequence[int] | None = None,
    ) -> None:
        _check_world(num_replicas, rank)
        self._requested_world = (num_replicas, rank)
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if window is None:
            window = 4 * block_size if block_size > 1 else 1
        elif not _is_int(window) or window < 1:
            raise ValueError(f"window must be None or an int >= 1, got {window!r}")
        elif block_size == 1 and window != 1:
            raise ValueError("window applies only to block mode (block_size > 1)")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.dataset = dataset  # type: ignore[assignment]  # only its len() is needed
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.block_size = int(block_size)
        self.window = int(window)
        self.epoch = 0
        self._n = len(dataset)
        self.shard_window, self.shard_sizes = _shard_mode(dataset, self._n, shard_window,
                                                          shard_sizes, self.block_size)
        self._layout_cache: tuple[tuple[int, int], list[list[_Window]]] | None = None
        # (R0, start) of the next __iter__, and (R0, consumed) of the latest one: see docstring.
        # R0 None: a fresh epoch, laid out for the world size found when it starts.
        self._resume: tuple[int | None, int] = (None, 0)
        self._position: tuple[int | None, int] = (None, 0)

    # -- ranks ------------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` now: the ones given, else torch.distributed's (see the class
        docstring for Accelerate's ``prepare``)."""
        requested, requested_rank = self._requested_world
        world = _resolve_world(requested, requested_rank)
        if world[0] > 1 or requested is None:
            wrapper = _resharding_wrapper() if (dist.is_available() and dist.is_initialized()) else None
            if wrapper is not None:
                if requested is not None:
                    raise ValueError(
                        f"DistributedShardSampler(num_replicas={requested}) is split again by "
                        f"accelerate's prepare() ({type(wrapper).__name__} deals the batches to "
                        f"{getattr(wrapper, 'num_processes', '?')} processes): leave num_replicas "
                        "and rank unset, or do not pass this loader to prepare()")
                return 1, 0  # prepare() deals the global order's batches to the processes
        return world

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """Number of ranks the data is split over (resolved now, see ``num_replicas=``)."""
        return self._world()[0]

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's rank (resolved now, see ``rank=``)."""
        return self._world()[1]

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """Per-rank count of a whole epoch (as in ``DistributedSampler``)."""
        return _num_samples(self._n, self.num_replicas, self.drop_last)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """``num_samples * num_replicas``."""
        replicas = self.num_replicas
        return _num_samples(self._n, replicas, self.drop_last) * replicas

    # -- order ------------------------------------------------------------------------------
    def _order(self, replicas: int) -> np.ndarray:
        if self.shard_window is not None:
            layout = self._layout(self.epoch, replicas)
            streams = [self._stream(windows, self.epoch, replicas, rank)
                       for rank, windows in enumerate(layout)]
            return np.stack(streams).T.ravel()
        return epoch_order(
            self._n,
            epoch=self.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            block_size=self.block_size,
            window=self.window,
            replicas=replicas,
        )

    def _layout(self, epoch: int, replicas: int) -> list[list[_Window]]:
        """Every rank's windows (cached: a prefetcher asks for them while the epoch is read)."""
        if self._layout_cache is None or self._layout_cache[0] != (epoch, replicas):
            assert self.shard_sizes is not None and self.shard_window is not None
            layout = _shard_layout(self.shard_sizes, epoch=epoch, seed=self.seed,
                                   shuffle=self.shuffle, drop_last=self.drop_last,
                                   shard_window=self.shard_window, replicas=replicas)
            self._layout_cache = ((epoch, replicas), layout)
        return self._layout_cache[1]

    def _stream(self, windows: list[_Window], epoch: int, replicas: int, rank: int) -> np.ndarray:
        return _rank_stream(windows, epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                            replicas=replicas, rank=rank)

    def _own_windows(self, epoch: int | None, world: tuple[int, int] | None = None) -> list[_Window]:
        if self.shard_window is None:
            raise ValueError("windows exist only in shard-window mode: pass shard_window=")
        epoch = self.epoch if epoch is None else epoch
        if not _is_int(epoch):
            raise ValueError(f"epoch must be an int, got {epoch!r}")
        replicas, rank = self._world() if world is None else world
        return self._layout(int(epoch), replicas)[rank]

    def window_shards(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's windows for an epoch, in reading order, each the list of its shard numbers.

        A prefetcher downloads window ``w + 1``'s shards while window ``w`` is read (see
        :meth:`window_index`). Empty shards are never listed; a shard split between two ranks
        (see "Shard windows" in the module docstring) is listed by both.

        Args:
            epoch (int | None): epoch number; ``None``: the current epoch (:meth:`set_epoch`).

        Returns:
            list[list[int]]: at most ``shard_window`` shard numbers per window.

        Raises:
            ValueError: the sampler is not in shard-window mode.
        """
        return [window.shards for window in self._own_windows(epoch)]

    def window_index(self, position: int, epoch: int | None = None) -> int:
        """Index into :meth:`window_shards` of the window that position ``position`` of this
        rank's stream (its ``position``-th index of the epoch, counted from 0 at the epoch start,
        also after a resume) reads from.

        Args:
            position (int): ``0 <= position < num_samples``. After resuming from a state with
                ``consumed`` samples, the next index is position ``consumed // num_replicas``.
            epoch (int | None): epoch number; ``None``: the current epoch.

        Returns:
            int: the window index.

        Raises:
            ValueError: not in shard-window mode, or position out of range.
        """
        windows = self._own_windows(epoch)
        if not _is_int(position) or not 0 <= position < self.num_samples:
            raise ValueError(f"position must be an int in [0, {self.num_samples}), got {position!r}")
        ends = np.cumsum([window.size for window in windows])
        return int(np.searchsorted(ends, position, side="right"))

    def _order_len(self, replicas: int) -> int:
        return _num_samples(self._n, replicas, self.drop_last) * replicas

    def __len__(self) -> int:
        """Number of indices a whole epoch has on this rank (also after :meth:`load_state_dict`,
        whose resumed iterator yields fewer: the rest of the epoch)."""
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        world = self._world()
        current, rank = world
        replicas, start = self._resume
        if replicas is None:
            replicas = current
        if self.shard_window is not None and replicas == current and start % replicas == 0:
            # Same world, whole lockstep steps consumed: continue this rank's own stream (its
            # share of the global order) without computing the other ranks' shuffles.
            stream = self._stream(self._layout(self.epoch, replicas)[rank], self.epoch, replicas, rank)
            self._position = (replicas, start)
            return self._prefetching(self._track(stream[start // replicas:].tolist(), replicas, start,
                                                 self._order_len(replicas), current),
                                     start // replicas, world)
        order = self._order(replicas)
        remainder = order[start:]
        mine = _pad_or_drop(remainder, current, self.drop_last)[rank::current]
        self._position = (replicas, start)
        return self._track(mine.tolist(), replicas, start, len(order), current)

    def _prefetching(self, stream: Iterator[int], position: int, world: tuple[int, int]) -> Iterator[int]:
        """``stream`` (this rank's indices from ``position`` on), telling a dataset that can
        prefetch (a remote store: ``prefetch_shards``) the next window's shards each time the
        stream enters a window, so they download while this one is read."""
        prefetch = getattr(self.dataset, "prefetch_shards", None)
        if prefetch is None or _num_samples(self._n, world[0], self.drop_last) == 0:
            yield from stream
            return
        own = self._own_windows(None, world)
        windows = [window.shards for window in own]
        ends = np.cumsum([window.size for window in own])
        current = -1
        for index in stream:
            w = int(np.searchsorted(ends, position, side="right"))
            if w != current:
                current = w
                ahead = windows[w + 1] if w + 1 < len(windows) else []
                prefetch(windows[w] + ahead, keep=windows[w] + ahead)
            position += 1
            yield index

    def _track(self, mine: list[int], replicas: int, start: int, end: int, current: int) -> Iterator[int]:
        for k, index in enumerate(mine, 1):
            # Lockstep: after every rank yielded k, positions start .. start + k*R are consumed.
            self._position = (replicas, min(start + k * current, end))
            yield index
        # Exhausted: this epoch is complete; iterating again without set_epoch restarts it.
        self._position = (replicas, end)
        self._resume = (None, 0)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` yields.

        Args:
            epoch (int): epoch number. A different epoch starts from its beginning; the current
                epoch (e.g. the one just loaded by :meth:`load_state_dict`) keeps its resume point.
        """
        if not _is_int(epoch):
            raise ValueError(f"epoch must be an int, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._resume = (None, 0)
            self._position = (None, 0)
        self._tell_dataset()

    def _tell_dataset(self) -> None:
        # A fastdata Dataset keys its random crops by (seed, epoch, index): keep its epoch ours.
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_dataset_epoch):
            set_dataset_epoch(self.epoch)

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Return a JSON-serialisable resume point for the current epoch.

        Args:
            consumed (int | None): samples consumed in this epoch by all ranks together, counted
                from the epoch start (e.g. ``steps * batch_size * world_size``). ``None`` uses
                the sampler's own count, which runs ahead of training by the DataLoader's
                prefetch. Counts up to ``num_replicas - 1`` past the end (padding) mean "epoch
                complete".

        Returns:
            dict with ``version, epoch, seed, shuffle, drop_last, dataset_len, block_size,
            window, order_replicas`` (ranks the epoch's order was made for), ``num_replicas``
            (informational) and ``consumed`` (prefix of the global order already consumed);
            in shard-window mode also ``shard_window`` and ``shard_layout`` (a fingerprint of
            the shard sizes).
        """
        current = self.num_replicas
        replicas, tracked = self._position
        if replicas is None:
            replicas = current
        end = self._order_len(replicas)
        if consumed is None:
            consumed = tracked
        elif not _is_int(consumed) or consumed < 0:
            raise ValueError(f"consumed must be an int >= 0, got {consumed!r}")
        elif consumed > end + current - 1:
            raise ValueError(
                f"consumed={consumed} exceeds this epoch's {end} samples; count only samples "
                "of the current epoch, summed over ranks"
            )
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self._n,
            "block_size": self.block_size,
            "window": self.window,
            "order_replicas": replicas,
            "num_replicas": current,
            "consumed": min(int(consumed), end),
        }
        if self.shard_window is not None and self.shard_sizes is not None:
            state["shard_window"] = self.shard_window
            state["shard_layout"] = _layout_digest(self.shard_sizes)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output; the next ``iter()`` yields this rank's share of
        the epoch's unconsumed remainder.

        Args:
            state (Mapping): a dict from :meth:`state_dict` (possibly after a JSON round trip),
                made with any ``num_replicas`` (shard-window mode, mid-epoch: the same).

        Raises:
            ValueError: wrong version, missing or malformed keys, or settings (seed, shuffle,
                drop_last, block_size, window, dataset length, shard_window, shard sizes) that
                differ from this sampler's; in shard-window mode, a mid-epoch state saved with
                another number of ranks.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"sampler state must be a mapping, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"sampler state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        for key in ("epoch", "order_replicas", "consumed", "seed", "dataset_len", "block_size",
                    "window"):
            if not _is_int(state.get(key)):
                raise ValueError(f"sampler state key {key!r} must be an int, got "
                                 f"{state.get(key)!r}")
        mine = self.state_dict()
        for key in _ORDER_KEYS + _SHARD_KEYS:
            if state.get(key) != mine.get(key):
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has "
                    f"{key}={mine.get(key)!r}; the saved epoch order cannot be reproduced"
                )
        current = self.num_replicas
        replicas, consumed = int(state["order_replicas"]), int(state["consumed"])
        if replicas < 1 or not 0 <= consumed <= self._order_len(replicas):
            raise ValueError(
                f"sampler state order_replicas={replicas}, consumed={consumed} is out of range"
            )
        if (self.shard_window is not None and replicas != current
                and 0 < consumed < self._order_len(replicas)):
            raise ValueError(
                f"this sampler state was saved mid-epoch by {replicas} ranks in shard-window "
                f"mode; the rest of that epoch lies in each rank's own windows of shards and "
                f"cannot be split over {current} ranks without every rank reading "
                f"every other rank's window. Resume with num_replicas={replicas}, or start "
                f"epoch {int(state['epoch']) + 1} on {current} ranks (set_epoch) "
                "without loading this state"
            )
        if consumed == 0:
            # Nothing consumed yet: start the epoch afresh, laid out for the world size then.
            self.epoch = int(state["epoch"])
            self._resume = self._position = (None, 0)
            self._tell_dataset()
            return
        self.epoch = int(state["epoch"])
        self._resume = (replicas, consumed)
        self._position = (replicas, consumed)
        self._tell_dataset()
