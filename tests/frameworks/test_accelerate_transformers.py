"""fastdata under Accelerate's ``prepare`` and transformers' ``Trainer`` (2 gloo processes on CPU,
the real packages), as ``examples/frameworks/accelerate_prepare.py`` and
``transformers_trainer.py`` write them.

The failures these catch, as a user first met them: a ``DistributedShardSampler`` loader passed to
``prepare`` sharded a second time (140 of 300 samples never seen); ``prepare`` with the loader's
shuffle repeating half the random crops from epoch 0 to epoch 1 (the rebuilt loader lost the
epoch); a Trainer subclass returning ``fastdata.loader`` repeating epoch 0's order and crops
(``loader.set_epoch`` ignored).
"""

from __future__ import annotations

import pytest
from framework_runs import SAMPLES, check_epochs_differ, check_every_sample_once, order_by_epoch, read_logs, torchrun

pytest.importorskip("accelerate")


def test_accelerate_prepare_of_a_shard_sampler_loader_splits_once(store, tmp_path):
    torchrun("accelerate_prepare.py", "--store", str(store), "--sampler", "shard", "--log-dir", str(tmp_path))
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)


def test_trainer_subclass_returning_fastdata_loader_gets_new_epochs(store, tmp_path):
    pytest.importorskip("transformers")
    torchrun("transformers_trainer.py", "--store", str(store), "--loader", "fastdata", "--log-dir", str(tmp_path),
             "--output-dir", str(tmp_path / "out"))
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)
    order = order_by_epoch(logs)
    assert order[0] != order[1], "epoch 1 repeated epoch 0's order"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_prepare_of_the_loaders_shuffle(store, tmp_path, workers):
    torchrun("accelerate_prepare.py", "--store", str(store), "--sampler", "shuffle", "--workers", str(workers),
             "--log-dir", str(tmp_path))
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)


@pytest.mark.slow
def test_trainer_with_the_dataset_as_train_dataset(store, tmp_path):
    pytest.importorskip("transformers")
    torchrun("transformers_trainer.py", "--store", str(store), "--loader", "trainer", "--log-dir", str(tmp_path),
             "--output-dir", str(tmp_path / "out"))
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)
