"""Per-process random streams for DataLoader workers and decode-time transforms.

Two hazards this module exists for:

* A ``numpy.random.Generator`` (or any RNG object) created before the DataLoader forks
  its workers is copied into every worker with the same state, so every worker draws
  the same "random" crops (pytorch/pytorch#5059 is the classic report for numpy's
  legacy global stream; torch seeds that one itself since 1.9, but it cannot reach a
  Generator held by your code or ours).
* Seeds that are not derived from the DataLoader's seed make runs irreproducible.

So the generator that fastdata's transforms draw from (:func:`get_rng`) is keyed by
``os.getpid()``: a process that did not seed it itself never sees its parent's copy,
and gets a fresh stream derived from ``torch.initial_seed()`` (which the DataLoader
sets to ``base_seed + worker_id`` in each worker) mixed with the pid. Use
:func:`seed_worker` as ``worker_init_fn`` to make worker streams reproducible for a
fixed ``torch.manual_seed`` / DataLoader ``generator``, and :func:`seed_rng` in the main
process.

Per-sample streams (what the Datasets use)
------------------------------------------
A per-process stream still depends on which worker gets which batch, so crops change
with ``num_workers``, the batch size or a resume point. The Datasets therefore give
fastdata's decode-time transforms a generator that is a pure function of
``(seed, epoch, sample index)``: :func:`sample_rng`. The seed is fixed in the main process
(the dataset's ``seed``) and is copied into every worker; the epoch has to reach workers
that outlive an epoch (persistent workers keep their own copy of the dataset), so it
travels with the indices: :func:`fastdata.loader` makes the first index of every batch an
:class:`EpochIndex`, a plain int that carries ``.epoch``. A dataset given untagged indices
uses its own ``epoch`` (right in the main process, and in workers started after
``set_epoch``).
"""

from __future__ import annotations

import gc
import os
import random
import threading
from typing import Any

import numpy as np
import torch

__all__ = ["EpochIndex", "get_rng", "sample_rng", "seed_rng", "seed_worker"]

# Domain tags keep the streams derived here apart from any other use of the same seed.
_TAG_WORKER = 0x5EED_0001
_TAG_UNSEEDED = 0x5EED_0002
_TAG_SAMPLE = 0x5EED_0003
#: a fixed seed for the bit generators :func:`sample_rng` builds before it sets their key and counter
_NO_ENTROPY = np.random.SeedSequence(0)
_U64 = (1 << 64) - 1

# (pid, generator), replaced as one tuple so a reader never pairs one pid with
# another process's generator.
_state: tuple[int, np.random.Generator] | None = None
_lock = threading.Lock()


def _reset_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX only; there is no fork elsewhere
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def _install(rng: np.random.Generator) -> None:
    global _state
    _state = (os.getpid(), rng)


def seed_rng(seed: int) -> None:
    """Seed this process's fastdata generator explicitly.

    Args:
        seed (int): a non-negative integer; the same seed gives the same stream.

    Only the calling process is affected: a child forked afterwards does not reuse
    this stream (see :func:`get_rng`).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    _install(np.random.default_rng(np.random.SeedSequence([int(seed)])))


def get_rng() -> np.random.Generator:
    """Return the generator that decode-time transforms draw from in this process.

    Returns:
        numpy.random.Generator: seeded by :func:`seed_rng` or :func:`seed_worker` in this
        process if either was called here; otherwise a fresh generator derived from
        ``torch.initial_seed()`` and ``os.getpid()``. A forked child therefore never
        continues its parent's (cloned) stream.
    """
    global _state
    pid = os.getpid()
    state = _state
    if state is not None and state[0] == pid:
        return state[1]
    with _lock:
        state = _state
        if state is None or state[0] != pid:
            # Without the pid, children forked from one parent outside a DataLoader
            # (all sharing the parent's torch seed) would share one stream again.
            ss = np.random.SeedSequence([torch.initial_seed(), pid, _TAG_UNSEEDED])
            state = (pid, np.random.default_rng(ss))
            _state = state
        return state[1]


def seed_worker(worker_id: int) -> None:
    """Seed ``random``, numpy's legacy global stream and :func:`get_rng` in a worker.

    Pass it as ``DataLoader(..., worker_init_fn=seed_worker)``.

    Args:
        worker_id (int): the DataLoader worker id (also mixed into the seed, so calling
            it by hand for several ids in one process gives distinct streams).

    The seed comes from ``torch.initial_seed()``, which the DataLoader sets to
    ``base_seed + worker_id``; ``base_seed`` is drawn from the loader's ``generator``
    (or torch's global RNG) once per epoch, so streams differ per worker and per epoch
    and repeat exactly for a fixed ``torch.manual_seed``. The three generators get
    independent child seeds of one ``SeedSequence`` rather than the same integer.
    """
    root = np.random.SeedSequence([torch.initial_seed(), int(worker_id), _TAG_WORKER])
    py_ss, np_ss, fd_ss = root.spawn(3)
    random.seed(int.from_bytes(py_ss.generate_state(4, np.uint32).tobytes(), "little"))
    # The legacy global RandomState takes an array of uint32 (MT19937 init_by_array),
    # which keeps all 128 bits instead of the usual `seed % 2**32`.
    np.random.seed(np_ss.generate_state(4, np.uint32))
    _install(np.random.default_rng(fd_ss))
    # Move every object inherited from the parent into the GC's permanent
    # generation: otherwise the worker's first full collection walks (and so
    # copies-on-write) every page holding them. Measured with
    # benchmarks/bench_memory.py: worker USS about 49 MB -> 18 MB.
    gc.freeze()


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator for sample ``index`` in ``epoch`` of a run seeded with ``seed``.

    Args:
        seed (int): the run's seed (any int; reduced modulo 2**64).
        epoch (int): the epoch number (>= 0).
        index (int): the dataset index of the sample (>= 0).

    Returns:
        numpy.random.Generator: a Philox stream keyed by ``seed`` whose counter starts at
        ``(index, epoch)`` in its high words, so streams of different samples or epochs
        never overlap (each may draw up to 2**128 values). The same arguments give the same
        draws in any process. Creating one costs about 15 us, against about 1 ms for
        decoding and cropping a photo (measured in tests/reader/test_seeding.py).
    """
    # Built from a fixed SeedSequence and then given its key and counter: Philox(counter=, key=)
    # would draw 128 bits of OS entropy first, only to discard them (a getrandom system call a
    # sample, which releases the GIL: with thread workers, a wait for it to come back).
    bit_generator = np.random.Philox(_NO_ENTROPY)
    bit_generator.state = _sample_state(seed, epoch, index)
    return np.random.Generator(bit_generator)


def _sample_state(seed: int, epoch: int, index: int) -> Any:
    """The Philox state at the start of :func:`sample_rng`'s stream ``(seed, epoch, index)``."""
    return {
        "bit_generator": "Philox",
        "state": {"counter": np.array([0, 0, int(index) & _U64, int(epoch) & _U64], dtype=np.uint64),
                  "key": np.array([int(seed) & _U64, _TAG_SAMPLE], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }


_THREAD_STREAM = threading.local()


def reused_sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """:func:`sample_rng`'s stream in a generator that this thread reuses: the same draws, valid
    until this thread's next call. For fastdata's own decode-time transforms, which draw a crop
    box from it at once and keep nothing: a new Philox and Generator a sample cost about three
    times as much, all of it holding the GIL (a quarter of the GIL time of thread workers
    reading a raw-pixel store, by py-spy samples of the thread holding the GIL)."""
    pair = getattr(_THREAD_STREAM, "pair", None)
    if pair is None:
        bit_generator = np.random.Philox(_NO_ENTROPY)
        pair = _THREAD_STREAM.pair = (bit_generator, np.random.Generator(bit_generator))
    pair[0].state = _sample_state(seed, epoch, index)
    return pair[1]


class EpochIndex(int):
    """A dataset index that also carries the epoch it was drawn for (``.epoch``).

    It behaves as the plain int everywhere (comparison, hashing, numpy, JSON); a fastdata
    Dataset reads ``.epoch`` of a batch's first index to key its per-sample random streams
    (:func:`sample_rng`). :func:`fastdata.loader` tags each batch this way, so that the epoch
    reaches DataLoader workers with the indices themselves, whatever the workers' start
    method or lifetime.
    """

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        value = super().__new__(cls, index)
        value.epoch = int(epoch)
        return value

    def __reduce__(self):
        return EpochIndex, (int(self), self.epoch)


def epoch_of(indices, default: int | None) -> int | None:
    """The epoch an index (or the first of a batch of indices) was tagged with, else ``default``."""
    first = indices
    if not isinstance(indices, EpochIndex) and isinstance(indices, (list, tuple)) and indices:
        first = indices[0]
    return first.epoch if isinstance(first, EpochIndex) else default
