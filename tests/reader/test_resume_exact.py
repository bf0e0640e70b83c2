"""Reproducible augmentation: random decode-time crops are a pure function of
(seed, epoch, sample index), so an interrupted run resumed from a ``state_dict`` yields
exactly the batches (pixels and labels) an uninterrupted run would have, whatever the
number of workers, the batch size or the start method.

Both resume paths are covered: torchdata's ``StatefulDataLoader`` (the dataset's epoch
set by the training loop), and ``fastdata.DistributedShardSampler`` under
``fastdata.loader`` with persistent workers (the epoch travels with the indices).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.images import make_jpeg
from torchdata.stateful_dataloader import StatefulDataLoader

import fastdata
from fastdata import transforms

SEED = 1234
N = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """24 JPEGs of assorted sizes in 2 classes (a crop's box depends on the size)."""
    root = tmp_path_factory.mktemp("resume")
    for i in range(N):
        make_jpeg(root / "src" / f"c{i % 2}" / f"{i:02d}.jpg", size=(40 + 3 * i, 30 + 2 * (i % 5)), seed=i)
    dst = str(root / "s.lmdb")
    fastdata.convert(str(root / "src"), dst, workers=1, progress=False)
    return dst


def open_ds(store: str):
    return fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=SEED)


def flat(batches) -> list[tuple[bytes, int]]:
    """Every sample of ``batches`` as (pixel bytes, label), in order."""
    return [(img.contiguous().numpy().tobytes(), int(lab)) for images, labels in batches
            for img, lab in zip(images, labels, strict=False)]


# --------------------------------------------------------------------------- StatefulDataLoader
def stateful_run(store: str, epoch: int, workers: int, batch_size: int = 4, stop_after: int | None = None,
                 state: dict | None = None, **kw):
    """One epoch through a StatefulDataLoader: the batches, and the state after ``stop_after``."""
    ds = open_ds(store)
    ds.set_epoch(epoch)  # what a training loop does at the start of each epoch
    if "sampler" not in kw:
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(7))
    dl = StatefulDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=fastdata.collate, **kw)
    if state is not None:
        dl.load_state_dict(state)
    batches = []
    for batch in dl:
        batches.append(batch)
        if len(batches) == stop_after:
            return batches, dl.state_dict()
    return batches, None


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_the_exact_batches(store, workers):
    full, _ = stateful_run(store, epoch=3, workers=workers)
    head, state = stateful_run(store, epoch=3, workers=workers, stop_after=2)
    assert flat(head) == flat(full[:2])
    tail, _ = stateful_run(store, epoch=3, workers=workers, state=state)  # a new process would do the same
    assert len(tail) == len(full) - 2
    assert flat(tail) == flat(full[2:])


def test_crops_do_not_depend_on_workers_batch_size_or_start_method(store):
    # one fixed order for every run (the loader draws its workers' base seed from the
    # shuffling generator, so a shuffled order itself differs between 0 and 1+ workers)
    order = np.random.default_rng(3).permutation(N).tolist()
    reference = flat(stateful_run(store, epoch=1, workers=0, sampler=order)[0])
    assert flat(stateful_run(store, epoch=1, workers=1, sampler=order)[0]) == reference
    assert flat(stateful_run(store, epoch=1, workers=2, sampler=order)[0]) == reference
    assert flat(stateful_run(store, epoch=1, workers=0, batch_size=6, sampler=order)[0]) == reference
    spawned = stateful_run(store, epoch=1, workers=1, sampler=order, multiprocessing_context="spawn")
    assert flat(spawned[0]) == reference
    # and what a sample looks like does not depend on its neighbours: same as reading it alone
    ds = open_ds(store)
    ds.set_epoch(1)
    assert [(ds[i][0].contiguous().numpy().tobytes(), ds[i][1]) for i in order] == reference


def test_control_other_epochs_give_other_crops(store):
    ds = open_ds(store)
    ds.set_epoch(0)
    epoch0 = [ds[i][0].clone() for i in range(N)]
    ds.set_epoch(1)
    epoch1 = [ds[i][0] for i in range(N)]
    differ = sum(not torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=False))
    assert differ >= N - 2  # a crop can repeat by chance (e.g. the whole image), not most
    ds.set_epoch(0)
    assert all(torch.equal(ds[i][0], epoch0[i]) for i in range(N))
    other_seed = fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=SEED + 1)
    other_seed.set_epoch(0)
    assert sum(not torch.equal(other_seed[i][0], epoch0[i]) for i in range(N)) >= N - 2


def test_without_any_epoch_crops_stay_random_every_epoch(store):
    """A plain DataLoader whose loop never sets an epoch must not freeze the augmentation
    (the same crops every epoch): crops then come from the per-process stream."""
    ds = open_ds(store)
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                                     collate_fn=fastdata.collate)
    first, second = flat(dl), flat(dl)
    assert sum(a != b for a, b in zip(first, second, strict=False)) >= N - 2


# --------------------------------------------------------------------------- DistributedShardSampler
def sampler_run(store: str, workers: int, epochs=(0, 1), stop=None, state=None):
    """Epochs through fastdata.loader + DistributedShardSampler (persistent workers: the
    same worker processes serve every epoch). ``stop=(epoch, k)`` stops after k batches of
    that epoch and returns the sampler state a checkpoint would hold."""
    ds = open_ds(store)
    sampler = fastdata.DistributedShardSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
    if state is not None:
        sampler.load_state_dict(state)
    dl = fastdata.loader(ds, batch_size=4, sampler=sampler, num_workers=workers)
    out = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out[epoch] = []
        for batch in dl:
            out[epoch].append(batch)
            if stop == (epoch, len(out[epoch])):
                return out, sampler.state_dict(consumed=len(out[epoch]) * 4)
    return out, None


@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_shard_sampler_resumes_the_exact_batches(store, workers):
    full, _ = sampler_run(store, workers)
    assert flat(full[0]) != flat(full[1])  # control: persistent workers did see the new epoch
    head, state = sampler_run(store, workers, stop=(1, 2))
    assert flat(head[1]) == flat(full[1][:2])
    assert state["epoch"] == 1 and state["consumed"] == 8
    tail, _ = sampler_run(store, workers, epochs=(state["epoch"],), state=state)
    assert flat(tail[1]) == flat(full[1][2:])


def test_distributed_shard_sampler_crops_do_not_depend_on_workers(store):
    assert flat(sampler_run(store, 1)[0][1]) == flat(sampler_run(store, 2)[0][1]) == flat(sampler_run(store, 0)[0][1])


# --------------------------------------------------------------------------- fastdata.loader alone
def test_loader_counts_epochs_and_resumes_at_a_chosen_one(store):
    ds = open_ds(store)
    dl = fastdata.loader(ds, batch_size=4, shuffle=False, num_workers=2)
    epochs = [flat(dl) for _ in range(3)]  # iteration n is epoch n
    assert len({tuple(e) for e in epochs}) == 3
    again = fastdata.loader(open_ds(store), batch_size=6, shuffle=False, num_workers=0)
    again.set_epoch(2)
    assert flat(again) == epochs[2]
