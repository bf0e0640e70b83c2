"""fastdata inside Lightning DDP (2 gloo processes on CPU, the real ``lightning`` package).

Each run is ``examples/frameworks/lightning_ddp.py`` under torchrun; every rank logs the sample
indices and a digest of each random crop it trained on. The failures these catch, as a user
first met them: a ``DistributedShardSampler`` made in ``train_dataloader`` split a second time by
Lightning's sampler wrapper (150 of 300 samples never seen); one made in ``__init__`` with
``use_distributed_sampler=False`` giving every sample to both ranks; a mid-epoch
``fit(ckpt_path=...)`` restarting the epoch from its first batch.
"""

from __future__ import annotations

import pytest
from framework_runs import SAMPLES, check_epochs_differ, check_every_sample_once, expected_steps, read_logs, torchrun

pytest.importorskip("lightning")


def crash_and_resume(run: list[str], tmp_path) -> tuple[dict, dict]:
    """``run`` of the Lightning example crashed at global step 22 (checkpoints every 4 steps), then
    resumed with fit(ckpt_path=last.ckpt): the step logs of the crashed run and of the resumed one."""
    crashed = torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "crash"), "--ckpt-dir",
                       str(tmp_path / "ckpt"), "--crash-at", "22", check=False)
    assert crashed.returncode != 0 and "simulated crash at step 22" in crashed.stderr + crashed.stdout
    resumed = torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "resume"), "--resume",
                       str(tmp_path / "ckpt" / "last.ckpt"))
    assert "not resumable" not in resumed.stderr + resumed.stdout
    return read_logs(tmp_path / "crash"), read_logs(tmp_path / "resume")


def test_sampler_made_in_train_dataloader_splits_once_and_resumes_exactly(store, tmp_path):
    """Default Trainer, a DistributedShardSampler made in train_dataloader(), 2 workers per rank.
    A run that crashes in epoch 1 (global step 22) and is resumed with fit(ckpt_path=last.ckpt)
    (the checkpoint after step 20, 5 batches into epoch 1) trains on exactly what an uninterrupted
    run does: every sample once per epoch over the 2 ranks, the sampler's order, each epoch's crops
    (computed here from the store), with no state code in the module: the loader's own state
    rides in Lightning's checkpoint."""
    run = ["--store", str(store), "--sampler", "hook", "--workers", "2"]
    before, after = crash_and_resume(run, tmp_path)
    for rank in (0, 1):
        assert [s["step"] for s in before[rank]] == list(range(22))
        assert [s["step"] for s in after[rank]] == list(range(20, 30)), "the resumed run did not start at step 20"
    combined = {rank: [s for s in before[rank] if s["step"] < 20] + after[rank] for rank in (0, 1)}
    check_every_sample_once(combined, SAMPLES, epochs=2)
    check_epochs_differ(combined)
    for rank in (0, 1):
        assert combined[rank] == expected_steps(store, rank, epochs=2), f"rank {rank} did not resume exactly"


THREADS = ["--sampler", "shuffle", "--workers", "2", "--worker-type", "thread"]


# nightly (24 s of DDP start-up): .ci/run keeps the process-worker Lightning tests and tests the
# thread loader's semantics in tests/reader/test_thread_workers.py
@pytest.mark.slow
def test_thread_workers_survive_lightnings_rebuild(store, tmp_path):
    """The loader's own shuffle with 2 thread workers per rank: Lightning replaces the sampler with
    its DistributedSampler, so it rebuilds the loader; the rebuilt loader keeps its thread workers
    (fastdata imported lazily, inside Lightning's hook, as a user's first script does) and every
    sample is seen once per epoch."""
    torchrun("lightning_ddp.py", "--store", str(store), *THREADS, "--log-dir", str(tmp_path))
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.workers").read_text().splitlines() == ["Loader thread 2"] * 2
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)


@pytest.mark.slow
def test_thread_workers_resume_exactly_in_lightning(store, tmp_path):
    """A run with thread workers crashed in epoch 1 and resumed from last.ckpt trains on exactly
    what an uninterrupted run does."""
    run = ["--store", str(store), *THREADS]
    torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "whole"))
    before, after = crash_and_resume(run, tmp_path)
    reference = read_logs(tmp_path / "whole")
    for rank in (0, 1):
        assert [s["step"] for s in after[rank]] == list(range(20, 30))
        combined = [s for s in before[rank] if s["step"] < 20] + after[rank]
        assert combined == reference[rank], f"rank {rank} did not resume exactly"


@pytest.mark.slow
@pytest.mark.parametrize("sampler, workers, distributed_sampler", [
    ("init", 2, True),      # made before the process group exists
    ("init", 0, False),     # Trainer(use_distributed_sampler=False): the sampler alone splits
    ("hook", 0, False),
    ("shuffle", 2, True),   # the loader's own shuffle, replaced by Lightning's DistributedSampler
])
def test_every_sample_once_per_epoch(store, tmp_path, sampler, workers, distributed_sampler):
    args = ["--store", str(store), "--sampler", sampler, "--workers", str(workers), "--log-dir", str(tmp_path)]
    torchrun("lightning_ddp.py", *args, *([] if distributed_sampler else ["--no-distributed-sampler"]))
    logs = read_logs(tmp_path)
    check_every_sample_once(logs, SAMPLES, epochs=2)
    check_epochs_differ(logs)


@pytest.mark.slow
@pytest.mark.parametrize("workers, crash_at", [(0, 7), (2, 17), (0, 29)])
def test_resume_mid_epoch_matrix(store, tmp_path, workers, crash_at):
    run = ["--store", str(store), "--sampler", "init", "--workers", str(workers)]
    torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "full"))
    full = read_logs(tmp_path / "full")
    torchrun("lightning_ddp.py", *run, "--ckpt-dir", str(tmp_path / "ckpt"), "--crash-at", str(crash_at),
             "--log-dir", str(tmp_path / "crash"), check=False)
    saved = crash_at // 4 * 4
    torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "resume"), "--resume",
             str(tmp_path / "ckpt" / "last.ckpt"))
    after = read_logs(tmp_path / "resume")
    for rank in (0, 1):
        assert after[rank] == [s for s in full[rank] if s["step"] >= saved]


def test_store_data_module_trains_and_validates_in_one_process(store, tmp_path):
    """fastdata.integrations.lightning.StoreDataModule: stores by path, opened in setup(), the
    train loader shuffled by a DistributedShardSampler (Lightning adds no sampler of its own)."""
    import lightning as L
    import torch

    from fastdata import transforms
    from fastdata.integrations.lightning import StoreDataModule
    from fastdata.reader.sampler import DistributedShardSampler

    seen: dict[str, list[tuple[int, list[int]]]] = {"train": [], "val": []}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3 * 16 * 16, 2)

        def training_step(self, batch, _):
            seen["train"].append((self.current_epoch, batch["index"].tolist()))
            return torch.nn.functional.cross_entropy(self.net(batch["image"].float().flatten(1)), batch["index"] % 2)

        def validation_step(self, batch, _):
            seen["val"].append((self.current_epoch, batch["index"].tolist()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = StoreDataModule(train=store, val=store, batch_size=20, num_workers=0,
                           dataset_options={"output": "tensor"},
                           train_options={"decode": transforms.RandomResizedCrop(16)},
                           sampler_options={"seed": 3})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path)
    trainer.fit(Module(), datamodule=data)
    assert isinstance(trainer.train_dataloader.sampler, DistributedShardSampler)
    for epoch in (0, 1):
        train = [i for e, batch in seen["train"] if e == epoch for i in batch]
        assert sorted(train) == list(range(SAMPLES))
        assert [i for e, batch in seen["val"] if e == epoch for i in batch] == list(range(SAMPLES))
    assert [b for e, b in seen["train"] if e == 0] != [b for e, b in seen["train"] if e == 1]
    with pytest.raises(ValueError, match="at least one"):
        StoreDataModule()


@pytest.mark.parametrize("inside_hook", [False, True])
def test_lightning_rebuilds_a_fastdata_loader_with_its_sampler_and_keeps_the_epoch(store, inside_hook):
    """What Lightning does under DDP to a loader whose sampler is not a DistributedSampler
    (``_update_dataloader``, the real function): rebuild it with its own sampler, from the saved
    init arguments when the loader was made inside a hook, else from its attributes. The rebuilt
    loader is still a fastdata loader whose batches carry the new sampler's epoch."""
    import torch
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader

    import fastdata
    from fastdata.reader.loader import EpochBatchSampler, Loader
    from fastdata.reader.seeding import EpochIndex

    ds = fastdata.open_dataset(store, output="tensor")
    if inside_hook:  # as Lightning calls train_dataloader() (data_connector.py): init arguments recorded
        with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"), \
                _replace_dunder_methods(torch.utils.data.BatchSampler):
            loader = fastdata.loader(ds, batch_size=10, num_workers=0)
    else:
        loader = fastdata.loader(ds, batch_size=10, num_workers=0)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    rebuilt = _update_dataloader(loader, sampler)
    assert isinstance(rebuilt, Loader) and isinstance(rebuilt.batch_sampler, EpochBatchSampler)
    assert rebuilt.batch_sampler.sampler is sampler and len(rebuilt) == 15
    sampler.set_epoch(3)  # Lightning's _set_sampler_epoch
    batches = list(rebuilt.batch_sampler)
    assert all(isinstance(b[0], EpochIndex) and b[0].epoch == 3 for b in batches)
    assert [i for b in batches for i in b] == list(sampler)
