"""A subclass's own ``__getitem__`` is honoured by batched reads.

torch's DataLoader (and so :func:`fastdata.loader`) asks a dataset that has ``__getitems__`` for
whole batches through it and never calls ``__getitem__``. fastdata's datasets define
``__getitems__`` (reads in storage order, one preallocated batch...), so a subclass that
overrides only ``__getitem__`` would be bypassed without a word: torchvision's detection
references do exactly that to ``CocoDetection`` (``img, target = super().__getitem__(idx)``,
then their own transforms). The datasets' ``__getitems__`` therefore ask
:func:`overrides_getitem` first and, when the subclass brought its own ``__getitem__``,
build the batch with :func:`each_sample`, one ``self[i]`` per index; every other class keeps
its batched path.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastdata.reader.batching import Samples
from fastdata.reader.seeding import EpochIndex

__all__ = ["each_sample", "overrides_getitem"]


def _owner(mro: tuple[type, ...], name: str) -> int:
    """Position in ``mro`` of the class that defines ``name`` (``len(mro)`` when none does)."""
    return next((k for k, cls in enumerate(mro) if name in vars(cls)), len(mro))


def overrides_getitem(cls: type) -> bool:
    """Whether instances of ``cls`` must be read one ``__getitem__`` at a time in a batch.

    True when the ``__getitem__`` that ``cls`` uses comes from a class before (more derived
    than, mixins included) the one whose ``__getitems__`` it uses: that ``__getitems__`` was
    written for another ``__getitem__`` and would bypass this one. A class that overrides both
    keeps its own ``__getitems__``, which is then its author's to keep consistent.

    Looked up from the class each time (a walk of a few ``__dict__`` s, well under a
    microsecond a batch), not cached: a ``__getitem__`` patched onto a class later counts too.

    Args:
        cls (type): the dataset's class (``type(self)``).

    Returns:
        bool: True when the batch must go through ``cls.__getitem__``.
    """
    mro = cls.__mro__
    return _owner(mro, "__getitem__") < _owner(mro, "__getitems__")


def each_sample(dataset, indices: Sequence[int], epoch: int | None) -> Samples:
    """``[dataset[i] for i in indices]`` as a :class:`~fastdata.reader.batching.Samples` (the
    caller sets its ``skips``, ``token`` and markers).

    :func:`fastdata.loader` tags only a batch's first index with its epoch
    (:class:`~fastdata.reader.seeding.EpochIndex`); here every index is given that tag, so
    that each ``dataset[i]``, read on its own, keys its random crops by the epoch the batch
    was drawn for, exactly as the batched path would.

    Args:
        dataset: the dataset (its ``__getitem__`` is called for each index).
        indices (Sequence[int]): the batch's indices, as the DataLoader gave them.
        epoch (int | None): the batch's epoch (None: untagged; each read uses the dataset's own).

    Returns:
        Samples: the samples in the order asked.
    """
    if epoch is None:
        return Samples(dataset[i] for i in indices)
    return Samples(dataset[EpochIndex(i, epoch)] for i in indices)
