"""Views of a fastdata dataset over some of its samples, and reproducible splits.

:class:`StoreSubset` (``ds.subset(indices)``) is what ``torch.utils.data.Subset`` is for a
fastdata dataset, minus what makes that one slow or unsafe here:

* It pickles light: the base dataset (already light: numpy metadata, no handle) and one int64
  numpy array of base indices. No Python object per sample, so DataLoader workers neither
  copy-on-write a list page by page nor receive a large pickle under spawn.
* A batch of indices goes to the base dataset's ``__getitems__`` in one call, mapped, so its
  batched fast paths (shard-ordered reads, one preallocated :class:`~fastdata.reader.batching.Batch`)
  are kept.
* Random decode-time crops stay a pure function of ``(seed, epoch, base index)``: the epoch tag
  :func:`fastdata.loader` puts on a batch's first index (an
  :class:`~fastdata.reader.seeding.EpochIndex`) is carried over to the mapped index, so a sample
  read through a subset is bit for bit the sample read from the store directly.
* With sorted indices (storage order, what :func:`random_split` makes) it has ``shard_starts``
  in the base store's shard numbering, so :class:`~fastdata.DistributedShardSampler` computes
  its blocks and shard windows over the subset, and ``prefetch_shards`` reaches the store.

Attributes of the base dataset that hold per-sample data (``targets``, ``column``,
``shard_starts``, ``relpath``) are the subset's own; the settings that are the same for every
sample (``seed``, ``epoch``, ``classes``, ``output``, ``decode``...) are the base's, through
explicit properties. There is deliberately no blanket ``__getattr__``: a per-sample attribute
added to the datasets later (``samples``, ``uniform_shape``...) would otherwise silently answer
for the whole store instead of the subset.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.seeding import EpochIndex, epoch_of

#: a fastdata store dataset (:class:`fastdata.reader.dataset.StoreDataset`); not imported here, since
#: that module imports this one (for ``StoreDataset.subset``) and the layering forbids cycles
BaseDataset = Any

__all__ = ["StoreSubset", "random_split", "split_sizes", "stratified_counts"]

#: fractions given to :func:`random_split` must sum to 1 within this
FRACTION_TOLERANCE = 1e-6


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (the caller cannot write through it into an index)."""
    view = array.view()
    view.flags.writeable = False
    return view


def code_names(codes: np.ndarray, names: Mapping[int, str]) -> np.ndarray:
    """The names of an index's 1-byte ``codes`` (a str array; ``""`` for a code not in ``names``,
    e.g. 0: not recorded)."""
    table = np.array([names.get(code, "") for code in range(int(codes.max(initial=0)) + 1)] or [""])
    return table[codes.astype(np.intp)]


def _base_indices(indices: Any, n: int) -> np.ndarray:
    """``indices`` (ints, negative ones wrapping, or a bool mask of ``n`` values) as int64 in
    ``[0, n)``."""
    if isinstance(indices, (str, bytes)) or isinstance(indices, Mapping):
        raise ValueError(f"subset indices must be a sequence of ints or a bool mask, got {type(indices).__name__}")
    try:
        arr = np.asarray(indices)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"subset indices must be a sequence of ints or a bool mask: {err}") from None
    if arr.ndim != 1:
        raise ValueError(f"subset indices must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if len(arr) != n:
            raise ValueError(f"a bool mask must have one value per sample: {len(arr)} values for a dataset of {n}")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"subset indices must be integers (or a bool mask), got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise IndexError(f"index {int(arr.max())} out of range for a dataset of {n} samples")
    idx = arr.astype(np.int64)
    idx = np.where(idx < 0, idx + n, idx)
    bad = np.flatnonzero((idx < 0) | (idx >= n))
    if len(bad):
        raise IndexError(f"index {int(arr[bad[0]])} out of range for a dataset of {n} samples")
    return idx


class StoreSubset(Dataset):
    """A fastdata dataset seen through a list of its indices: ``view[i]`` is ``dataset[indices[i]]``.

    Made by ``ds.subset(indices)`` or :func:`random_split`; see the module docstring. Repeated
    indices are allowed (as in ``torch.utils.data.Subset``); :func:`random_split` never makes
    them. Under the base dataset's ``on_error="skip"``, a damaged sample is replaced by the next
    readable sample of the *store* (which may lie outside the subset), counted in :attr:`skipped`.
    """

    def __init__(self, dataset: BaseDataset | StoreSubset, indices: Sequence[int] | np.ndarray):
        """Make the view.

        Args:
            dataset: a fastdata dataset, or a :class:`StoreSubset` (its indices are then
                positions in that subset, and the new view maps straight to its base dataset:
                subsets of subsets never nest).
            indices: ints (negative ones count from the end of ``dataset``) or a bool mask of
                ``len(dataset)`` values.

        Raises:
            IndexError: an index out of range.
            ValueError: indices that are not one-dimensional ints or a bool mask of the right length.
        """
        idx = _base_indices(indices, len(dataset))
        base: BaseDataset
        if isinstance(dataset, StoreSubset):
            idx, base = dataset.indices[idx], dataset.dataset
        else:
            base = dataset
        #: the base dataset (as ``torch.utils.data.Subset.dataset``)
        self.dataset: BaseDataset = base
        self._indices = read_only(idx)
        # non-decreasing: storage order, so shard_starts exist (duplicates allowed)
        self._sorted = bool(np.all(idx[1:] >= idx[:-1]))
        self._targets: np.ndarray | None = None

    # -- indices ------------------------------------------------------------------------------
    @property
    def indices(self) -> np.ndarray:
        """The base dataset's index of each sample of the view (int64, read-only)."""
        return self._indices

    def __len__(self) -> int:
        return len(self._indices)

    def _position(self, position: int) -> int:
        n = len(self._indices)
        if isinstance(position, bool) or not isinstance(position, numbers.Integral):
            raise TypeError(f"subset indices must be ints, got {type(position).__name__}")
        i = int(position)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {position} out of range for a subset of {n} samples")
        return i

    def base_index(self, position: int) -> int:
        """The base dataset's index of sample ``position`` of the view (negative counts from the end).

        Raises:
            IndexError: ``position`` out of range.
        """
        return int(self._indices[self._position(position)])

    def __getitem__(self, position: int):
        index: int = self.base_index(position)
        if isinstance(position, EpochIndex):  # the loader's epoch tag travels to the base index
            index = EpochIndex(index, position.epoch)
        return self.dataset[index]

    def __getitems__(self, positions: Sequence[int]):
        """A batch: ``dataset.__getitems__`` of the mapped indices (its batched fast paths kept),
        the first one carrying the epoch tag of ``positions[0]`` if it has one; ``self[p]`` for each
        position when a subclass overrides ``__getitem__`` (:mod:`fastdata.reader.overrides`)."""
        if overrides_getitem(type(self)):
            before = self.skipped
            samples = each_sample(self, positions, epoch_of(positions, None))
            # counted under the base dataset's name, as the base's own batches are
            samples.skips, samples.token = self.skipped - before, getattr(self.dataset, "_token", "")
            return samples
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = len(self._indices)
        pos = np.where(pos < 0, pos + n, pos)
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            bad = int(np.asarray(positions).reshape(-1)[np.flatnonzero((pos < 0) | (pos >= n))[0]])
            raise IndexError(f"index {bad} out of range for a subset of {n} samples")
        mapped: list[int] = self._indices[pos].tolist()
        epoch = epoch_of(positions, None)
        if epoch is not None and mapped:
            mapped[0] = EpochIndex(mapped[0], epoch)
        return self.dataset.__getitems__(mapped)

    def subset(self, indices: Sequence[int] | np.ndarray) -> StoreSubset:
        """A view over ``indices``, positions in this view, mapped to the base dataset (not nested).

        Args:
            indices: ints (negative ones count from the end) or a bool mask of ``len(self)`` values.

        Returns:
            StoreSubset: over the same base dataset.

        Raises:
            IndexError: an index out of range.
            ValueError: indices that are not ints or a bool mask of the right length.
        """
        return StoreSubset(self, indices)

    # -- per-sample metadata ------------------------------------------------------------------
    @property
    def targets(self) -> np.ndarray:
        """The labels of the view's samples (int64, read-only; empty when the store has none)."""
        if self._targets is None:
            base = self.dataset.targets
            self._targets = read_only(base[self._indices] if len(base) else base)
        return self._targets

    def columns(self) -> tuple[str, ...]:
        """The names :meth:`column` accepts (the base dataset's)."""
        return self.dataset.columns()

    def column(self, name: str) -> np.ndarray:
        """The base dataset's :meth:`~fastdata.reader.dataset.StoreDataset.column` ``name`` for the
        view's samples, in the view's order (read-only).

        Raises:
            KeyError: no such column; the message lists the available ones.
        """
        return read_only(self.dataset.column(name)[self._indices])

    def relpath(self, position: int) -> str:
        """Source path of sample ``position`` relative to the converted root."""
        return self.dataset.relpath(self.base_index(position))

    @property
    def shard_starts(self) -> np.ndarray | None:
        """Where each of the base store's shards starts in the view (int64, one per base shard,
        so shard numbers are the store's; a shard with no sample of the view is empty), when the
        indices are sorted; None otherwise (a shuffled view has no shard boundaries)."""
        if not self._sorted:
            return None
        starts: np.ndarray = self.dataset.shard_starts
        return np.searchsorted(self._indices, starts, side="left").astype(np.int64)

    def prefetch_shards(self, shards: Sequence[int], keep: Sequence[int] = ()) -> None:
        """The base dataset's ``prefetch_shards`` (shard numbers are the store's: see :attr:`shard_starts`)."""
        self.dataset.prefetch_shards(shards, keep)

    # -- settings shared with the base dataset ------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The base dataset's :meth:`~fastdata.reader.dataset.StoreDataset.set_epoch`: crops are
        keyed by ``(seed, epoch, base index)``, the same as reading the store directly."""
        self.dataset.set_epoch(epoch)

    @property
    def epoch(self) -> int | None:
        """The base dataset's epoch."""
        return self.dataset.epoch

    @property
    def seed(self) -> int:
        """The base dataset's seed of the random crops (``fastdata.loader(seed=)`` sets it)."""
        return self.dataset.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.dataset.seed = int(value)

    @property
    def classes(self) -> list[str]:
        """The store's class names (all of them, as ``torch.utils.data.Subset`` users expect)."""
        return self.dataset.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.dataset.class_to_idx

    @property
    def skipped(self) -> int:
        """Damaged samples replaced so far (the base dataset's count: the view reads through it)."""
        return self.dataset.skipped

    @property
    def root(self) -> str:
        return self.dataset.root

    @property
    def on_error(self) -> str:
        return self.dataset.on_error

    @property
    def backend(self) -> str:
        return self.dataset.backend

    @property
    def output(self) -> str:
        return self.dataset.output

    @property
    def decode(self) -> Callable | None:
        return self.dataset.decode

    @property
    def transform(self) -> Callable | None:
        return self.dataset.transform

    @property
    def target_transform(self) -> Callable | None:
        return getattr(self.dataset, "target_transform", None)

    @property
    def image_modes(self) -> dict[str, str]:
        return self.dataset.image_modes

    def close(self) -> None:
        """Close this process's handles of the base dataset (they reopen lazily)."""
        self.dataset.close()

    def __enter__(self) -> StoreSubset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_targets"] = None  # rebuilt on demand: a pickle carries one index array, no more
        return state

    def __repr__(self) -> str:
        order = "sorted" if self._sorted else "unsorted"
        inner = "\n".join("    " + line for line in repr(self.dataset).splitlines())
        return f"StoreSubset of {len(self)} of {len(self.dataset)} samples ({order})\n{inner}"


# -- splits -------------------------------------------------------------------------------------
def split_sizes(lengths: Sequence[float] | Sequence[int], n: int) -> np.ndarray:
    """The sizes of the splits :func:`random_split` makes of ``n`` samples.

    Args:
        lengths: int counts summing to ``n``, or fractions (each in ``[0, 1]``) summing to 1 within
            1e-6. Fractions are rounded by largest remainder (ties to the earlier split), so a split
            of fraction 0 stays empty and every size is within 1 of ``n * fraction``.
        n: the dataset's length.

    Returns:
        np.ndarray: int64 sizes summing to ``n``.

    Raises:
        ValueError: not a non-empty sequence of numbers; negative values; counts that do not sum
            to ``n``; fractions that do not sum to 1.
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence | np.ndarray) or not len(lengths):
        raise ValueError(f"lengths must be a non-empty list of fractions or counts, got {lengths!r:.80}")
    values = list(lengths)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
        raise ValueError(f"lengths must be numbers (fractions summing to 1, or counts), got {values!r:.80}")
    if all(isinstance(v, numbers.Integral) for v in values):
        counts = np.array([int(v) for v in values], dtype=np.int64)
        if (counts < 0).any() or int(counts.sum()) != n:
            raise ValueError(f"split counts {counts.tolist()} must be >= 0 and sum to the dataset's {n} samples "
                             f"(they sum to {int(counts.sum())}); or give fractions summing to 1")
        return counts
    fractions = np.array([float(v) for v in values], dtype=np.float64)
    if not np.isfinite(fractions).all() or (fractions < 0).any() or (fractions > 1).any():
        raise ValueError(f"split fractions must each be in [0, 1], got {values!r:.80}")
    if abs(float(fractions.sum()) - 1.0) > FRACTION_TOLERANCE:
        raise ValueError(f"split fractions must sum to 1, got {values!r:.80} (sum {float(fractions.sum())!r}); "
                         "or give int counts summing to the dataset's length")
    quotas = n * fractions / fractions.sum()
    sizes = np.floor(quotas).astype(np.int64)
    remainders = quotas - sizes
    short = n - int(sizes.sum())
    # largest remainders first, ties to the earlier split (stable sort)
    for j in np.argsort(-remainders, kind="stable")[:max(short, 0)]:
        sizes[j] += 1
    # float rounding could make the floors overshoot n by one: take it from the smallest remainders
    for j in [j for j in np.argsort(remainders, kind="stable") if sizes[j] > 0][:max(-short, 0)]:
        sizes[j] -= 1
    return sizes


def stratified_counts(class_counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """How many samples of each class each split gets: a ``(classes, splits)`` int64 matrix whose
    rows sum to ``class_counts`` and columns to ``sizes``, each entry the floor or the ceiling of
    its target ``class_count * size / n`` (the class's share of the split), so within 1 of it.

    Largest-remainder rounding within each class, then a global correction: while a split has
    more than its size, one sample moves along a chain of classes from it to a split that has
    fewer (each move turns an entry rounded up into its floor and one rounded down into its
    ceiling). Such a chain exists whenever the sizes are off (a rounding with both margins
    exists: Bacharach 1966, and the difference to it contains the chain).

    Args:
        class_counts: samples per class (>= 0).
        sizes: samples per split, summing to ``class_counts.sum()``.

    Returns:
        np.ndarray: the ``(len(class_counts), len(sizes))`` matrix.
    """
    counts = np.asarray(class_counts, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    n = int(counts.sum())
    if int(sizes.sum()) != n:
        raise ValueError(f"split sizes sum to {int(sizes.sum())}, the classes to {n}")
    if n == 0:
        return np.zeros((len(counts), len(sizes)), dtype=np.int64)
    # exact integer arithmetic: target = floor + rem / n (int64 holds n**2 for n < 3e9)
    product = counts[:, None] * sizes[None, :]
    floor, rem = product // n, product % n
    alloc = floor.copy()
    short = counts - floor.sum(axis=1)  # per class: entries to round up
    rank = np.argsort(np.argsort(-rem, axis=1, kind="stable"), axis=1, kind="stable")
    alloc += (rank < short[:, None]) & (rem > 0)
    up = (rem > 0) & (alloc > floor)     # rounded up: may go down to its floor
    down = (rem > 0) & (alloc == floor)  # rounded down: may go up to its ceiling
    excess = alloc.sum(axis=0) - sizes
    k = len(sizes)
    while (excess > 0).any():
        source = int(np.flatnonzero(excess > 0)[0])
        # breadth-first search over splits: edge j -> j2 through a class c that may go down in j, up in j2
        parent: dict[int, tuple[int, int]] = {source: (-1, -1)}
        frontier, target = [source], -1
        while frontier and target < 0:
            nxt = []
            for j in frontier:
                for j2 in range(k):
                    if j2 in parent:
                        continue
                    movable = np.flatnonzero(up[:, j] & down[:, j2])
                    if not len(movable):
                        continue
                    # the move that strays least from the targets: smallest rounded-up remainder
                    # given back, largest rounded-down remainder taken
                    c = int(movable[np.argmax(rem[movable, j2] - rem[movable, j])])
                    parent[j2] = (j, c)
                    if excess[j2] < 0:
                        target = j2
                        break
                    nxt.append(j2)
                if target >= 0:
                    break
            frontier = nxt
        if target < 0:  # cannot happen (see the docstring); never return wrong sizes silently
            raise RuntimeError(f"stratified rounding found no correction for counts {counts} and sizes {sizes}")
        j2 = target
        while j2 != source:
            j, c = parent[j2]
            alloc[c, j] -= 1
            alloc[c, j2] += 1
            up[c, j], down[c, j] = False, True
            up[c, j2], down[c, j2] = True, False
            j2 = j
        excess[source] -= 1
        excess[target] += 1
    return alloc


def random_split(
    dataset: BaseDataset | StoreSubset,
    lengths: Sequence[float] | Sequence[int],
    *,
    seed: int = 0,
    stratify: str | Sequence | np.ndarray | None = None,
) -> list[StoreSubset]:
    """Split a fastdata dataset into disjoint random subsets, as ``torch.utils.data.random_split``.

    The splits are disjoint and cover the dataset, and are a pure function of ``(len(dataset),
    lengths, seed, stratify)``: a numpy Generator seeded with ``seed`` draws them (torch's global
    RNG is not touched, nor read). Each split's indices are sorted (storage order), so its reads
    stay sequential and :class:`~fastdata.DistributedShardSampler` can use ``shard_window``.

    Args:
        dataset: a fastdata dataset or a :class:`StoreSubset` (the splits are then subsets of it).
        lengths: fractions summing to 1 (within 1e-6; sizes rounded by largest remainder, see
            :func:`split_sizes`) or int counts summing to ``len(dataset)``.
        seed (int): a non-negative seed; the same seed gives the same splits.
        stratify: a column name (``"label"``, any name of ``dataset.columns()``) or an array of
            one value per sample: each class (distinct value) is split in the same proportions,
            every split holding within 1 of its share of each class, and the split sizes are
            exactly those of the unstratified split (see :func:`stratified_counts`).

    Returns:
        list[StoreSubset]: one per entry of ``lengths``.

    Raises:
        TypeError: ``dataset`` is not a fastdata dataset (use ``torch.utils.data.random_split``).
        ValueError: bad ``lengths`` (negative, not summing to 1 or to ``len(dataset)``, empty), a
            bad seed, or a ``stratify`` array that does not have one value per sample.
        KeyError: ``stratify`` names no column.
    """
    if not callable(getattr(dataset, "subset", None)):
        raise TypeError(f"random_split needs a fastdata dataset (with .subset), got {type(dataset).__name__}; "
                        "use torch.utils.data.random_split for other datasets")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    n = len(dataset)
    sizes = split_sizes(lengths, n)
    rng = np.random.default_rng(int(seed))
    perm = rng.permutation(n)
    if stratify is None:
        parts = np.split(perm, np.cumsum(sizes)[:-1])
    else:
        values = dataset.column(stratify) if isinstance(stratify, str) else np.asarray(stratify)
        if values.ndim != 1 or len(values) != n:
            raise ValueError(f"stratify must give one value per sample: got shape {values.shape} for a dataset of "
                             f"{n} samples")
        _, classes = np.unique(values, return_inverse=True)
        classes = classes.reshape(-1)
        counts = np.bincount(classes, minlength=int(classes.max(initial=-1)) + 1)
        alloc = stratified_counts(counts, sizes)
        # samples grouped by class (ascending), in random order within each class
        grouped = perm[np.argsort(classes[perm], kind="stable")]
        split_of = np.repeat(np.tile(np.arange(len(sizes)), len(counts)), alloc.ravel())
        parts = [grouped[split_of == j] for j in range(len(sizes))]
    return [dataset.subset(np.sort(part)) for part in parts]
