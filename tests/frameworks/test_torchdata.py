"""torchdata's ``StatefulDataLoader`` over fastdata in a plain DDP loop on 2 gloo processes
(``examples/frameworks/torchdata_stateful.py``): every sample once per epoch across the ranks, and
an epoch restarted from ``loader.state_dict()`` after 6 batches continues with exactly the samples,
order and crops of the uninterrupted epoch (computed here from the sampler and the dataset)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from framework_runs import SAMPLES, check_epochs_differ, check_every_sample_once, order_by_epoch, read_logs, torchrun

import fastdata
from fastdata import transforms
from fastdata.reader.seeding import EpochIndex

pytest.importorskip("torchdata")


def test_stateful_dataloader_two_ranks_resumed_mid_epoch(store, tmp_path):
    torchrun("torchdata_stateful.py", "--store", str(store), "--log-dir", str(tmp_path), "--stop-after", "6")
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)
    order = order_by_epoch(logs)
    dataset = fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=0)
    for rank in (0, 1):
        sampler = fastdata.DistributedShardSampler(dataset, num_replicas=2, rank=rank, seed=0)
        sampler.set_epoch(1)
        assert order[1][rank] == list(sampler), f"rank {rank}: the resumed epoch left the sampler's order"
        crops = [step["crop"] for step in logs[rank] if step["epoch"] == 1]
        flat = [c for batch in crops for c in batch]
        expected = [hashlib.blake2b(np.ascontiguousarray(dataset[EpochIndex(i, 1)]["image"].numpy()).tobytes(),
                                    digest_size=8).hexdigest() for i in order[1][rank]]
        assert flat == expected, f"rank {rank}: crops after the restart are not epoch 1's"
