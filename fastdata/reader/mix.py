"""``fastdata.mix``: several datasets drawn in fixed proportions, as one map-style dataset.

::

    train = fastdata.mix({"real": real, "synthetic": synth}, weights={"real": 0.7, "synthetic": 0.3},
                         epoch_size=100_000, seed=0, batch_size=64)
    sampler = train.sampler()                    # rank and world size from torch.distributed
    loader = fastdata.loader(train, batch_size=64, sampler=sampler)

Sources are sized by ``weights``, ``repeat`` or ``samples`` (or per source with :class:`MixPart`, as
MosaicML Streaming's ``Stream``); every rank reads the same number of samples and within 1 of its
share of each source; each source is read without replacement within a pass; the order, the draws
and the random crops are pure functions of (seed, epoch, position), so ``sampler.state_dict()``
resumes exactly. The specification (epoch sizes and ranks, the order of an epoch, draws, samples,
random crops, resuming) and what it costs: ``docs/sampling.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from fastdata.reader.batching import WORKER_SKIPS, Batch, Samples, build_batch, private_batches
from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.sampler import DistributedShardSampler
from fastdata.reader.seeding import EpochIndex, epoch_of

__all__ = ["MixPart", "MixSampler", "MixedDataset", "mix"]

_U64 = (1 << 64) - 1
# Domain tags keep the mix's streams apart from every other use of the same seed.
_TAG_PATTERN = 0x5EED_0101
_TAG_PASS = 0x5EED_0102
#: draws per block of pass permutations (see "Draws" in the module docstring)
_BLOCK_DRAWS = 1 << 16
#: the key a dict sample's source name goes under
SOURCE_KEY = "source"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _name_key(name: str) -> int:
    # hashlib, not hash(): str hashes differ per process (PYTHONHASHSEED), workers must agree
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _philox(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([w & _U64 for w in words])))


def largest_remainder(total: int, weights: Sequence[Fraction]) -> list[int]:
    """Integer shares of ``total`` in proportion to ``weights`` (Hamilton's method).

    Args:
        total (int): the number to split (>= 0).
        weights (Sequence[Fraction]): non-negative, summing to something positive (exact
            fractions: the rounding must not depend on float error).

    Returns:
        list[int]: shares summing to ``total``, each within 1 of its quota
        ``total * w / sum(weights)`` (floor or ceil of it); ties go to the earlier weight.
    """
    whole = sum(weights, Fraction(0))
    quotas = [Fraction(total) * w / whole for w in weights]
    shares = [math.floor(q) for q in quotas]
    left = total - sum(shares)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def _world_size(num_replicas: int | None) -> int:
    if num_replicas is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    return int(num_replicas)


def _per_source(arg: Mapping[str, Any], names: Sequence[str], what: str) -> list[Any]:
    """``arg``'s values in the sources' order; its keys must be exactly the sources' names."""
    if not isinstance(arg, Mapping):
        raise ValueError(f"{what} must be a dict keyed by source name ({', '.join(names)}), got "
                         f"{type(arg).__name__}")
    missing = [n for n in names if n not in arg]
    extra = [repr(k) for k in arg if k not in names]
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"unknown {', '.join(extra)}"] if extra else [])
        raise ValueError(f"{what} must name every source exactly ({', '.join(map(repr, names))}): "
                         f"{'; '.join(parts)}")
    return [arg[n] for n in names]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return value


class MixPart:
    """One source of a :func:`mix`: a dataset (or a store's path) with its share of each epoch
    and its transform, as MosaicML Streaming's ``Stream(remote, local, proportion, repeat, choose)``.

    Named for what it is, a part of a mix, and not a "source" or "stream": a source in fastdata
    is what a store is written from (:mod:`fastdata.sources`), and a mix reads map-style
    datasets by index rather than streaming them.

    Args:
        dataset (Dataset | str | os.PathLike): a map-style dataset (a fastdata store, or any
            ``torch.utils.data.Dataset``), or a store's path or URL, opened with
            :func:`fastdata.open_dataset` and its defaults.
        name (str | None): the part's name: a dict sample's ``"source"`` value, and the key of its
            draws (so adding another part keeps this one's). None: a path's file name without its
            suffix (``"real"`` for ``"data/real.lmdb"``); a dataset object needs one.
        weight (float | None): its relative weight (>= 0) in an epoch of ``epoch_size`` samples.
        repeat (float | None): passes over it per epoch (> 0; 0.5 is half of it, 2 every sample twice).
        samples (int | None): samples of it per epoch (>= 0).
        transform (Callable | None): ``fn(sample) -> sample`` applied to its samples before they
            are marked with the part's name (e.g. to map schemas to one).

    Give at most one of ``weight``, ``repeat`` and ``samples``, and the same one on every part of
    a mix (none on any: proportional to the lengths).

    Raises:
        TypeError, ValueError: naming the parameter.
    """

    def __init__(self, dataset: Any, *, name: str | None = None, weight: float | None = None,
                 repeat: float | None = None, samples: int | None = None,
                 transform: Callable[[Any], Any] | None = None):
        if isinstance(dataset, str | os.PathLike):
            path = os.fspath(dataset)
            if name is None:
                base = os.path.basename(str(path).rstrip("/"))
                name = os.path.splitext(base)[0] or base
            from fastdata.reader.open import open_dataset

            dataset = open_dataset(path)
        elif not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"dataset must be a map-style dataset (__len__ and __getitem__) or a store's path, got "
                            f"{type(dataset).__name__}")
        if name is None:
            raise ValueError("name is needed for a dataset object: it marks the part's samples and keys its draws")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        given = [k for k, v in (("weight", weight), ("repeat", repeat), ("samples", samples)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one of weight, repeat or samples (each sizes the part), got {' and '.join(given)}")
        if weight is not None and _number(weight, "weight") < 0:
            raise ValueError(f"weight must be >= 0, got {weight!r}")
        if repeat is not None and _number(repeat, "repeat") <= 0:
            raise ValueError(f"repeat must be > 0 (passes over the part per epoch), got {repeat!r}")
        if samples is not None and (not (_is_int(samples) or isinstance(samples, np.integer)) or samples < 0):
            raise ValueError(f"samples must be an int >= 0 (samples per epoch), got {samples!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable (sample -> sample), got {transform!r}")
        self.dataset, self.name, self.transform = dataset, name, transform
        self.weight, self.repeat, self.samples = weight, repeat, samples

    @property
    def sizing(self) -> str | None:
        """Which of ``"weight"``, ``"repeat"``, ``"samples"`` sizes this part (None: none)."""
        return next((k for k in ("weight", "repeat", "samples") if getattr(self, k) is not None), None)

    def __repr__(self) -> str:
        size = f", {self.sizing}={getattr(self, self.sizing)!r}" if self.sizing else ""
        return f"MixPart({type(self.dataset).__name__}, name={self.name!r}{size})"


def _from_parts(parts: Sequence[Any], weights, repeat, samples, transforms) -> dict[str, Any]:
    """``mix``'s dict arguments (sources, weights, repeat, samples, transforms) from a list of
    :class:`MixPart`."""
    given = [k for k, v in (("weights", weights), ("repeat", repeat), ("samples", samples),
                            ("transforms", transforms)) if v is not None]
    if given:
        raise ValueError(f"with MixPart objects, give weight/repeat/samples/transform on each part, not "
                         f"{'/'.join(given)}= to mix")
    if not parts:
        raise ValueError("sources must be a non-empty list of MixPart (or a dict of name -> dataset)")
    for part in parts:
        if not isinstance(part, MixPart):
            raise TypeError(f"sources must be MixPart objects (or a dict of name -> dataset), got "
                            f"{type(part).__name__}")
    names = [p.name for p in parts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two parts are named {', '.join(map(repr, twice))}: give each part its own name=")
    sizings = {p.sizing for p in parts}
    if len(sizings) > 1:
        by = ", ".join(f"{p.name!r}: {p.sizing or 'none'}" for p in parts)
        raise ValueError(f"every part must be sized the same way (weight, repeat or samples; or none on any), "
                         f"got {by}")
    sizing = sizings.pop()
    sized = {p.name: getattr(p, sizing) for p in parts} if sizing is not None else None
    return {"sources": {p.name: p.dataset for p in parts},
            "weights": sized if sizing == "weight" else None,
            "repeat": sized if sizing == "repeat" else None,
            "samples": sized if sizing == "samples" else None,
            "transforms": {p.name: p.transform for p in parts if p.transform is not None} or None}


class MixedDataset(Dataset):
    """Several map-style datasets drawn in fixed per-epoch proportions (see the module
    docstring for the order, the draws and the samples). Build it with :func:`mix`.

    Attributes:
        source_names (tuple[str, ...]): the sources' names in the order given; a tuple
            sample's ``source_id`` indexes it.
        sources (dict[str, Dataset]): the sources by name.
        counts (dict[str, int]): samples of each source per epoch (global, all ranks).
        weights (dict[str, float]): the normalised proportions the counts were derived from.
        epoch_size (int): ``len(mix)``: samples per epoch, a multiple of ``num_replicas``.
        requested_epoch_size (int): the size asked for (or derived) before that rounding.
        num_replicas (int): the number of ranks the order is made for.
        rank_counts (numpy.ndarray): ``[num_replicas, sources]`` per-rank counts per epoch.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        *,
        repeat: Mapping[str, float] | None = None,
        samples: Mapping[str, int] | None = None,
        epoch_size: int | None = None,
        seed: int = 0,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        num_replicas: int | None = None,
        batch_size: int | None = None,
    ):
        """See :func:`mix` (the same arguments)."""
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty dict of name -> dataset")
        names = list(sources)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"source names must be non-empty strings, got {name!r}")
            ds = sources[name]
            if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise ValueError(f"source {name!r} is not a map-style dataset (it needs __len__ and "
                                 f"__getitem__), got {type(ds).__name__}")
        if len(names) > np.iinfo(np.int16).max:
            raise ValueError(f"at most {np.iinfo(np.int16).max} sources, got {len(names)}")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.source_names: tuple[str, ...] = tuple(names)
        self.sources: dict[str, Any] = dict(sources)
        self._lengths = [len(sources[n]) for n in names]
        self.num_replicas = _world_size(num_replicas)
        given = [k for k, v in (("weights", weights), ("repeat", repeat), ("samples", samples)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one of weights=, repeat= or samples= (each sizes the sources), got "
                             f"{' and '.join(given)}")
        requested = self._requested_counts(weights, repeat, samples, epoch_size)
        self._check_counts(requested)
        if isinstance(requested, tuple):  # weights: (epoch size, exact weights)
            self.requested_epoch_size, shares = requested
        else:
            self.requested_epoch_size, shares = sum(requested), [Fraction(c) for c in requested]
        replicas = self.num_replicas
        self.epoch_size = self.requested_epoch_size // replicas * replicas
        if self.epoch_size == 0:
            raise ValueError(f"epoch_size {self.requested_epoch_size} is smaller than num_replicas={replicas}: "
                             "every rank needs at least one sample per epoch")
        if batch_size is not None:
            if not _is_int(batch_size) or batch_size < 1:
                raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
            if self.epoch_size < replicas * batch_size:
                raise ValueError(f"epoch_size {self.epoch_size} is smaller than num_replicas x batch_size = "
                                 f"{replicas} x {batch_size} = {replicas * batch_size}: not one full batch per "
                                 "rank; raise epoch_size (or the weights' sources' sizes) or lower batch_size")
        if not isinstance(requested, tuple) and self.epoch_size == self.requested_epoch_size:
            counts = list(requested)  # repeat/samples that fit the ranks: exactly as asked
        else:
            counts = largest_remainder(self.epoch_size, shares)
        total = sum(shares, Fraction(0))
        self.weights: dict[str, float] = {n: float(w / total) for n, w in zip(names, shares, strict=True)}
        self.counts: dict[str, int] = dict(zip(names, counts, strict=True))
        for name, count, n in zip(names, counts, self._lengths, strict=True):
            if count and not n:
                raise ValueError(f"source {name!r} is empty but its share is {count} samples per epoch; "
                                 "give it weight 0 (or leave it out)")
        self._counts = np.asarray(counts, dtype=np.int64)
        self.rank_counts = self._split_over_ranks(self._counts, replicas)
        self._transforms = self._check_transforms(transforms)
        for name in names:
            schema = getattr(self.sources[name], "schema", None)
            if (name not in self._transforms and schema is not None and hasattr(schema, "__contains__")
                    and SOURCE_KEY in schema):
                raise ValueError(f"source {name!r} has a field named {SOURCE_KEY!r}, the key a mix marks each "
                                 f"sample's source with; rename it with transforms={{{name!r}: fn}}")
        # a fastdata dataset keys its crops by the epoch it is told (EpochIndex): tell it the pass
        self._tells_epoch = [callable(getattr(self.sources[n], "set_epoch", None)) for n in names]
        self._name_keys = [_name_key(n) for n in names]
        self._seed = int(seed)
        self._epoch = 0
        self._table: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        # names this mix's skip count in the main process (batches from workers carry it)
        self._token = os.urandom(8).hex()

    # -- sizing ------------------------------------------------------------------------------
    def _requested_counts(self, weights, repeat, samples, epoch_size) -> tuple[int, list[Fraction]] | list[int]:
        """``(epoch size, weights)`` for weights, else the requested count of each source."""
        names = self.source_names
        if repeat is not None or samples is not None:
            if epoch_size is not None:
                kind = "repeat" if repeat is not None else "samples"
                raise ValueError(f"epoch_size is the sum of the counts with {kind}=; give either epoch_size with "
                                 "weights=, or counts alone")
        if repeat is not None:
            counts = []
            for name, r, n in zip(names, _per_source(repeat, names, "repeat"), self._lengths, strict=True):
                r = _number(r, f"repeat[{name!r}]")
                if r <= 0:
                    raise ValueError(f"repeat[{name!r}] must be > 0 (passes over the source per epoch), got {r!r}; "
                                     "leave a source out to not draw it")
                counts.append(int(math.floor(r * n + 0.5)))
            return counts
        if samples is not None:
            counts = []
            for name, k in zip(names, _per_source(samples, names, "samples"), strict=True):
                if not (_is_int(k) or isinstance(k, np.integer)) or k < 0:
                    raise ValueError(f"samples[{name!r}] must be an int >= 0 (samples per epoch), got {k!r}")
                counts.append(int(k))
            return counts
        if weights is None:
            shares = [Fraction(n) for n in self._lengths]
            if not sum(shares):
                raise ValueError("every source is empty: nothing to mix")
        else:
            shares = []
            for name, w in zip(names, _per_source(weights, names, "weights"), strict=True):
                w = _number(w, f"weights[{name!r}]")
                if w < 0:
                    raise ValueError(f"weights[{name!r}] is {w!r}: weights must be >= 0")
                shares.append(Fraction(w))
            if not sum(shares):
                raise ValueError(f"weights are all zero ({dict(zip(names, map(float, shares), strict=True))}): "
                                 "at least one source needs a positive weight")
        if epoch_size is None:
            epoch_size = sum(self._lengths)
        elif not _is_int(epoch_size) or epoch_size < 1:
            raise ValueError(f"epoch_size must be an int >= 1, got {epoch_size!r}")
        return int(epoch_size), shares

    def _check_counts(self, requested) -> None:
        if isinstance(requested, list) and not sum(requested):
            raise ValueError(f"every source's count is zero ({dict(zip(self.source_names, requested, strict=True))}): "
                             "nothing to draw per epoch")

    def _check_transforms(self, transforms) -> dict[str, Callable[[Any], Any]]:
        if transforms is None:
            return {}
        if not isinstance(transforms, Mapping):
            raise ValueError(f"transforms must be a dict of source name -> callable, got {type(transforms).__name__}")
        unknown = [repr(k) for k in transforms if k not in self.sources]
        if unknown:
            raise ValueError(f"transforms names {', '.join(unknown)}, which are not sources "
                             f"({', '.join(map(repr, self.source_names))})")
        for name, fn in transforms.items():
            if not callable(fn):
                raise ValueError(f"transforms[{name!r}] must be callable (sample -> sample), got {fn!r}")
        return dict(transforms)

    @staticmethod
    def _split_over_ranks(counts: np.ndarray, replicas: int) -> np.ndarray:
        """``[R, S]``: the sources laid end to end and dealt round-robin (module docstring)."""
        ends = np.cumsum(counts)
        starts = ends - counts
        ranks = np.arange(replicas, dtype=np.int64)[:, None]

        def dealt(x: np.ndarray) -> np.ndarray:  # positions j < x with j % R == r (x >= 0)
            return (x[None, :] + replicas - 1 - ranks) // replicas

        return dealt(ends) - dealt(starts)

    # -- epoch, seed and order ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch whose order unmarked indices read (set by :meth:`set_epoch`)."""
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next reads use.

        :class:`fastdata.DistributedShardSampler` (``set_epoch``, ``load_state_dict``) and
        :func:`fastdata.loader` call it; DataLoader workers learn the epoch from the indices
        (the loader tags each batch's first one).

        Args:
            epoch (int): a non-negative epoch number.

        Raises:
            ValueError: not a non-negative int.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = int(epoch)

    @property
    def seed(self) -> int:
        """The seed of the mix's order. Setting it (``fastdata.loader(seed=)`` does) also sets every
        source's ``seed`` (its crop seed) to the same value (module docstring, "Random crops")."""
        return self._seed

    @seed.setter
    def seed(self, seed: int) -> None:
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._seed = int(seed)
        self._table = None
        for name in self.source_names:
            source = self.sources[name]
            if hasattr(source, "seed"):
                source.seed = int(seed)

    def order(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every position's draw in an epoch.

        Args:
            epoch (int | None): the epoch; None = :attr:`epoch`.

        Returns:
            tuple of three ``numpy.ndarray`` of length ``epoch_size``: the source id (int16,
            indexing :attr:`source_names`), the index into that source (int64) and the pass over
            that source (int64) of each position. Read-only views of the cached table.
        """
        epoch = self._epoch if epoch is None else epoch
        if isinstance(epoch, bool) or not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        table = self._table
        if table is None or table[0] != int(epoch):
            table = (int(epoch), *self._build_table(int(epoch)))
            for array in table[1:]:
                array.flags.writeable = False
            self._table = table
        return table[1], table[2], table[3]

    def _build_table(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        replicas, per_rank = self.num_replicas, self.epoch_size // self.num_replicas
        n_src = len(self.source_names)
        ids = np.repeat(np.tile(np.arange(n_src, dtype=np.int16), replicas), self.rank_counts.ravel())
        patterns = _philox(self._seed, _TAG_PATTERN, epoch, replicas).permuted(
            ids.reshape(replicas, per_rank), axis=1)
        src = np.ascontiguousarray(patterns.T).ravel()  # position k * R + r = pattern_r[k]
        index = np.empty(self.epoch_size, dtype=np.int64)
        passes = np.empty(self.epoch_size, dtype=np.int64)
        by_source = np.argsort(src, kind="stable")  # each source's positions, in position order
        offset = 0
        for s, count in enumerate(self._counts.tolist()):
            where = by_source[offset:offset + count]
            offset += count
            if not count:
                continue
            draws = count * epoch + np.arange(count, dtype=np.int64)
            index[where], passes[where] = self._draw(s, draws)
        return src, index, passes

    def _draw(self, s: int, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample index and pass of source ``s``'s draws (consecutive, increasing)."""
        n = self._lengths[s]
        per_block = max(1, _BLOCK_DRAWS // n)
        passes = draws // n
        first, last = int(passes[0]) // per_block, int(passes[-1]) // per_block
        blocks = [self._pass_block(s, b, per_block) for b in range(first, last + 1)]
        table = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return table[passes - first * per_block, draws % n], passes

    def _pass_block(self, s: int, block: int, per_block: int) -> np.ndarray:
        """Permutations of passes ``block * per_block ...`` of source ``s``, one per row."""
        n = self._lengths[s]
        rows = np.broadcast_to(np.arange(n, dtype=np.int64), (per_block, n))
        return _philox(self._seed, _TAG_PASS, self._name_keys[s], n, block).permuted(rows, axis=1)

    def sampler(self, rank: int | None = None, **kwargs: Any):
        """The sampler that reads this mix as its order was made for (the documented way).

        Args:
            rank (int | None): this rank; None = ``torch.distributed``'s rank when initialised,
                else 0 (``num_replicas`` must then be 1).
            **kwargs: passed on to :class:`fastdata.DistributedShardSampler` (not ``shuffle``,
                ``num_replicas`` or ``drop_last``, which the mix fixes).

        Returns:
            MixSampler: a :class:`fastdata.DistributedShardSampler` with ``num_replicas`` = the
            mix's and ``shuffle=False``: rank ``r`` reads its pattern (module docstring). Its
            ``state_dict`` also records a fingerprint of the mix (``"mix"``: sources, lengths,
            counts, seed, ranks), and ``load_state_dict`` refuses a state of another mix, whose
            positions would mean other samples.

        Raises:
            ValueError: ``shuffle``, ``num_replicas`` or ``drop_last`` in ``kwargs`` that differ
                from what the mix needs.
        """
        fixed: dict[str, Any] = {"shuffle": False, "num_replicas": self.num_replicas, "drop_last": False}
        for key, value in fixed.items():
            if key in kwargs and kwargs.pop(key) != value:
                raise ValueError(f"a mix's sampler needs {key}={value!r}: the mix orders and splits its "
                                 f"epoch itself for num_replicas={self.num_replicas} ranks")
        return MixSampler(self, rank=rank, **fixed, **kwargs)

    def fingerprint(self) -> str:
        """A short digest of what fixes the mix's order: the sources' names and lengths, the
        per-epoch counts, the seed and ``num_replicas`` (a resume point applies to an equal one)."""
        described = repr((self.source_names, self._lengths, self._counts.tolist(), self._seed, self.num_replicas))
        return hashlib.sha256(described.encode()).hexdigest()[:16]

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.epoch_size

    def _positions(self, indices: Sequence[int]) -> np.ndarray:
        pos = np.fromiter((int(i) for i in indices), dtype=np.int64, count=len(indices))
        if pos.size and (pos.min() < 0 or pos.max() >= self.epoch_size):
            bad = int(pos[(pos < 0) | (pos >= self.epoch_size)][0])
            raise IndexError(f"index {bad} out of range for a mix of {self.epoch_size} samples per epoch")
        return pos

    def _read_one(self, s: int, index: int, pass_: int):
        source = self.sources[self.source_names[s]]
        sample = source[EpochIndex(index, pass_) if self._tells_epoch[s] else index]
        transform = self._transforms.get(self.source_names[s])
        return transform(sample) if transform is not None else sample

    def __getitem__(self, index: int):
        epoch = epoch_of(index, self._epoch)
        i = int(self._positions([index])[0])
        src, idx, passes = self.order(epoch)
        s = int(src[i])
        return self._mark(self._read_one(s, int(idx[i]), int(passes[i])), s)

    def _read_part(self, s: int, pass_: int, indices: np.ndarray):
        """Source ``s``'s samples ``indices`` of pass ``pass_``, with its own ``__getitems__``."""
        source = self.sources[self.source_names[s]]
        listed = indices.tolist()
        getitems = getattr(source, "__getitems__", None)
        if self._tells_epoch[s]:
            if callable(getitems):
                listed[0] = EpochIndex(listed[0], pass_)
            else:
                listed = [EpochIndex(i, pass_) for i in listed]
        part = getitems(listed) if callable(getitems) else [source[i] for i in listed]
        transform = self._transforms.get(self.source_names[s])
        if transform is not None:
            marked = Samples(transform(sample) for sample in part)
            marked.skips = getattr(part, "skips", 0)
            return marked
        return part

    def __getitems__(self, indices: Sequence[int]):
        """A batch: each source's part read with its own ``__getitems__`` (one call per source and
        pass), the samples marked and returned in the order asked; one combined
        :class:`~fastdata.reader.batching.Batch` when every part is one (module docstring);
        ``self[i]`` for each index when a subclass overrides ``__getitem__``
        (:mod:`fastdata.reader.overrides`)."""
        epoch = epoch_of(indices, self._epoch)
        if overrides_getitem(type(self)):
            before = self.skipped
            samples = each_sample(self, indices, epoch)
            samples.skips, samples.token = self.skipped - before, self._token
            return samples
        pos = self._positions(indices)
        if not len(pos):
            return Samples()
        src, idx, passes = self.order(epoch)
        ids, sample_idx, sample_pass = src[pos], idx[pos], passes[pos]
        groups, inverse = np.unique(np.stack([ids.astype(np.int64), sample_pass]), axis=1, return_inverse=True)
        inverse = inverse.reshape(-1)
        parts = []
        # parts of a batch are copied into one before it travels: built in private memory (see
        # private_batches); a batch of one part (one source and pass) is that part, built as usual
        with contextlib.nullcontext() if groups.shape[1] == 1 else private_batches():
            for g, (s, pass_) in enumerate(groups.T.tolist()):
                where = np.flatnonzero(inverse == g)
                parts.append((where, int(s), self._read_part(int(s), int(pass_), sample_idx[where])))
        combined = self._combined_batch(parts, ids, len(pos))
        if combined is not None:
            return combined
        out = Samples([None] * len(pos))
        skips, ragged = 0, set[str]()
        for where, s, part in parts:
            for j, sample in zip(where.tolist(), part, strict=True):
                out[j] = self._mark(sample, s)
            skips += getattr(part, "skips", 0)
            ragged.update(getattr(part, "ragged", ()))
        out.skips, out.token, out.ragged = skips, self._token, tuple(sorted(ragged))
        return out

    def _combined_batch(self, parts: list, ids: np.ndarray, n: int) -> Batch | None:
        """One :class:`Batch` of every part's stacked pixels in the order asked, or None when a part
        is not a Batch or the parts' layouts differ."""
        batches = [part for _, _, part in parts]
        if not all(isinstance(b, Batch) for b in batches):
            return None
        first = batches[0]
        layout = (first.pixels.shape[1:], first.pixels.dtype, isinstance(first.images, torch.Tensor),
                  getattr(first, "squeeze", False))
        for b in batches:
            if ((b.pixels.shape[1:], b.pixels.dtype, isinstance(b.images, torch.Tensor),
                 getattr(b, "squeeze", False)) != layout or b.labels.dtype != torch.int64):
                return None
        sources = ids.astype(np.int64)
        if len(parts) == 1:
            batch = first  # one source and pass: the part is the batch, in the order asked
        else:
            labels = np.empty(n, dtype=np.int64)
            for where, _, b in parts:
                labels[where] = b.labels.numpy()

            def fill(arr: np.ndarray) -> None:
                for where, _, b in parts:
                    arr[where] = b.pixels

            batch = build_batch(labels, layout[0], fill, channels_first=layout[2], dtype=layout[1],
                                squeeze=layout[3])
        batch[:] = list(zip(batch.images, batch.labels.tolist(), sources.tolist(), strict=True))
        batch.sources = sources
        batch.skips, batch.token = sum(getattr(b, "skips", 0) for b in batches), self._token
        return batch

    def _mark(self, sample: Any, s: int) -> Any:
        """``sample`` marked with its source (module docstring, "Samples")."""
        if isinstance(sample, Mapping):
            if SOURCE_KEY in sample:
                raise ValueError(f"a sample of source {self.source_names[s]!r} already has a {SOURCE_KEY!r} key, "
                                 f"the key a mix marks each sample's source with; rename it with "
                                 f"transforms={{{self.source_names[s]!r}: fn}}")
            return {**sample, SOURCE_KEY: self.source_names[s]}
        if isinstance(sample, (tuple, list)):
            return (*sample, s)
        return sample, s

    # -- attributes --------------------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Damaged samples replaced so far by the sources (``on_error="skip"``): the sources' own
        counts, plus those made in DataLoader workers for batches of this mix (carried by
        :func:`fastdata.collate` under the mix's name, not the source's)."""
        own = sum(int(getattr(self.sources[n], "skipped", 0)) for n in self.source_names)
        return own + WORKER_SKIPS.get(self._token, 0)

    @property
    def classes(self) -> list[str] | None:
        """The sources' ``classes`` when every source has the same list, else None."""
        lists = [getattr(self.sources[n], "classes", None) for n in self.source_names]
        if any(c is None for c in lists):
            return None
        first = list(lists[0])  # type: ignore[arg-type]
        return first if all(list(c) == first for c in lists[1:]) else None  # type: ignore[arg-type]

    def close(self) -> None:
        """Close every source that can be closed (their handles reopen lazily on next access)."""
        for name in self.source_names:
            close = getattr(self.sources[name], "close", None)
            if callable(close):
                close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_table"] = None  # up to tens of MB per epoch, rebuilt on demand
        return state

    def __repr__(self) -> str:
        lines = [f"Number of datapoints: {self.epoch_size} per epoch"
                 + (f" (requested {self.requested_epoch_size}, rounded down to a multiple of "
                    f"num_replicas={self.num_replicas})" if self.epoch_size != self.requested_epoch_size
                    else f" (num_replicas={self.num_replicas})"),
                 f"Seed: {self._seed}, epoch: {self._epoch}"]
        for name, n in zip(self.source_names, self._lengths, strict=True):
            count = self.counts[name]
            passes = f"{count / n:.3g} passes" if n else "empty"
            extra = ", transformed" if name in self._transforms else ""
            lines.append(f"Source {name!r}: {n} samples, weight {self.weights[name]:.4g}, {count} per epoch "
                         f"({passes}){extra}")
        return "\n".join([f"Dataset {type(self).__name__}"] + ["    " + line for line in lines])


class MixSampler(DistributedShardSampler):
    """The :class:`fastdata.DistributedShardSampler` :meth:`MixedDataset.sampler` builds: its state
    also names the mix (``"mix"``: :meth:`MixedDataset.fingerprint`), and a state of another mix
    does not load."""

    dataset: MixedDataset

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """:meth:`DistributedShardSampler.state_dict`, plus ``"mix"``: the mix's fingerprint."""
        state = super().state_dict(consumed)
        state["mix"] = self.dataset.fingerprint()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`DistributedShardSampler.load_state_dict`, refusing a state saved over another mix.

        Raises:
            ValueError: as the base class; also a ``"mix"`` fingerprint that is not this mix's.
        """
        if isinstance(state, Mapping) and "mix" in state and state["mix"] != self.dataset.fingerprint():
            raise ValueError(
                f"this sampler state was saved over another mix (fingerprint {state['mix']!r}, this one "
                f"{self.dataset.fingerprint()!r}): the sources, their lengths, the counts, the seed or "
                "num_replicas differ, so its positions would mean other samples")
        super().load_state_dict(state)


def mix(
    sources: Sequence[MixPart] | Mapping[str, Any],
    weights: Mapping[str, float] | None = None,
    *,
    repeat: Mapping[str, float] | None = None,
    samples: Mapping[str, int] | None = None,
    epoch_size: int | None = None,
    seed: int = 0,
    transforms: Mapping[str, Callable[[Any], Any]] | None = None,
    num_replicas: int | None = None,
    batch_size: int | None = None,
) -> MixedDataset:
    """Mix datasets in fixed per-epoch proportions (see :mod:`fastdata.reader.mix`).

    Args:
        sources (Sequence[MixPart] | Mapping[str, Dataset]): the parts, each with its own size and
            transform (:class:`MixPart`); or name -> map-style dataset (fastdata stores, or any
            ``torch.utils.data.Dataset``), sized by the dicts below.
        weights (Mapping[str, float] | None): relative weights (>= 0, sum > 0), keyed like
            ``sources``; None (and no ``repeat``/``samples``) = proportional to the lengths.
        repeat (Mapping[str, float] | None): passes over each source per epoch (> 0).
        samples (Mapping[str, int] | None): samples of each source per epoch (>= 0).
        epoch_size (int | None): samples per epoch with weights (default: the sources' total
            length); not with ``repeat``/``samples``. Rounded down to a multiple of
            ``num_replicas``.
        seed (int): seed of the order and the draws (not of the sources' crops; see ``mix.seed``).
        transforms (Mapping[str, Callable] | None): per source, ``fn(sample) -> sample`` applied
            before the sample is marked with its source (e.g. to map schemas to one).
        num_replicas (int | None): ranks the order is made for; None = ``torch.distributed``'s
            world size when initialised, else 1.
        batch_size (int | None): per-rank batch size, only checked: an epoch smaller than
            ``num_replicas * batch_size`` is an error.

    Returns:
        MixedDataset: ``len()`` = ``epoch_size``; read it with :meth:`MixedDataset.sampler`.

    Raises:
        TypeError: a list of something else than :class:`MixPart`.
        ValueError: more than one of weights/repeat/samples; keys not matching the sources;
            parts named twice, sized in different ways, or a list with the dict arguments;
            weights negative, NaN or all zero; repeat <= 0; samples < 0 or all zero; an empty
            source with a positive count; epoch_size with repeat/samples; an epoch smaller than
            ``num_replicas`` (or ``num_replicas * batch_size``); a ``"source"`` field clash.
    """
    by_name: Any = sources
    if not isinstance(sources, Mapping) and isinstance(sources, Sequence):
        parts = _from_parts(sources, weights, repeat, samples, transforms)
        by_name, weights, repeat, samples, transforms = (parts["sources"], parts["weights"], parts["repeat"],
                                                         parts["samples"], parts["transforms"])
    return MixedDataset(by_name, weights, repeat=repeat, samples=samples, epoch_size=epoch_size, seed=seed,
                        transforms=transforms, num_replicas=num_replicas, batch_size=batch_size)
