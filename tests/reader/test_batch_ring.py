"""The worker -> main batch ring (fastdata.reader.batch_ring): batches arrive intact,
travel through the ring (not silently by value), and a batch the training loop
still holds is never overwritten by a later one. The control breaks the
protocol (slots freed at once) and shows the held-batch check catching it."""

from __future__ import annotations

import gc
import multiprocessing
import os

import numpy as np
import pytest
import torch
from helpers.backends import SUFFIXES
from helpers.images import make_tree
from torch.utils.data import DataLoader

import fastdata
from fastdata.reader import batch_ring

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the ring needs memfd (Linux)")]

N = 60


@pytest.fixture(scope="module")
def raw_stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring")
    src = make_tree(root / "src", classes={"a": N // 2, "b": N // 2}, size=(20, 12))
    out = {}
    for suffix in SUFFIXES:
        out[suffix] = str(root / f"raw{suffix}")
        fastdata.convert(src, out[suffix], workers=1, raw="16x16", progress=False)
    return out


def _loader(ds, batch_size=2):
    return DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=2, persistent_workers=True,
                      prefetch_factor=2, multiprocessing_context="fork", collate_fn=fastdata.collate)


def _truth(ds):
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.as_tensor(ds.targets)


def _held_epoch(loader):
    """One epoch, keeping every batch alive until the end."""
    held = [(images, labels) for images, labels in loader]
    return torch.cat([h[0] for h in held]), torch.cat([h[1] for h in held]), held


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_batches_travel_through_the_ring_and_held_ones_stay_intact(raw_stores, suffix):
    ds = fastdata.open_dataset(raw_stores[suffix], output="tensor")
    images_truth, labels_truth = _truth(ds)
    loader = _loader(ds)
    before = dict(batch_ring.received)
    # epoch 1: all 30 batches held, so each worker's 8 slots fill up and later
    # batches must come by value; none of the held ones may change meanwhile
    images, labels, held = _held_epoch(loader)
    assert torch.equal(images, images_truth) and torch.equal(labels, labels_truth)
    for k, (img, _lab) in enumerate(held):
        assert torch.equal(img, images_truth[2 * k:2 * k + 2]), f"held batch {k} was overwritten"
    first_ring = batch_ring.received["ring"] - before["ring"]
    assert 1 <= first_ring <= 2 * batch_ring.SLOTS, first_ring
    del held, images, labels
    gc.collect()
    # epochs 2-3: batches dropped as the loop goes, so every one fits a free slot
    for _ in range(2):
        ring_before = batch_ring.received["ring"]
        for k, (img, lab) in enumerate(loader):
            assert torch.equal(img, images_truth[2 * k:2 * k + 2]) and torch.equal(lab, labels_truth[2 * k:2 * k + 2])
        assert batch_ring.received["ring"] - ring_before == N // 2, "batches fell back to by-value transport"
    del loader
    ds.close()


def test_control_freeing_slots_early_is_caught(raw_stores, monkeypatch):
    """Break the protocol (a slot is freed as soon as it is received) and the
    held-batch check above sees batches overwritten."""
    original = batch_ring.AttachedRing.take

    def take_and_free(self, slot, nbytes):
        arr = original(self, slot, nbytes)
        self.map[1 + slot] = 0
        return arr

    monkeypatch.setattr(batch_ring.AttachedRing, "take", take_and_free)
    ds = fastdata.open_dataset(raw_stores[".lmdb"], output="tensor")
    images_truth, _ = _truth(ds)
    _images, _labels, held = _held_epoch(_loader(ds))
    overwritten = [k for k, (img, _) in enumerate(held) if not torch.equal(img, images_truth[2 * k:2 * k + 2])]
    assert overwritten, "the control did not corrupt anything: the held-batch check proves nothing"
    ds.close()


def _drop_in_child(held, conn):
    held.clear()
    gc.collect()
    conn.send("dropped")


def test_ring_slot_frees_with_its_last_view_and_never_from_a_forked_child():
    ring = batch_ring.WorkerRing(4096)
    try:
        batch_ring.attach(*ring.descriptor())
        assert ring.attached
        data = np.arange(4096, dtype=np.uint8) * 7
        slot = ring.put(data)
        arr = batch_ring.ring_array(*ring.descriptor(), slot, data.nbytes)
        np.testing.assert_array_equal(arr, data)
        view = torch.from_numpy(arr).view(64, 64).t()  # a view of a tensor of the array
        held = [arr]
        del arr
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=_drop_in_child, args=(held, child_end))
        child.start()
        assert parent_end.recv() == "dropped"
        child.join(10)
        assert ring.map[1 + slot] == 1, "a forked child freed a slot the parent still holds"
        held.clear()
        gc.collect()
        assert ring.map[1 + slot] == 1, "freed while a tensor still views it"
        del view
        gc.collect()
        assert ring.map[1 + slot] == 0, "not freed after the last view died"
    finally:
        ring.close()
