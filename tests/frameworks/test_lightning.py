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
from framework_runs import SAMPLES, check_crops_change, check_every_sample_once, read_logs, torchrun

pytest.importorskip("lightning")


def test_sampler_made_in_train_dataloader_splits_once_and_resumes_exactly(store, tmp_path):
    """Default Trainer: every sample once per epoch on 2 ranks, new crops in epoch 1; a crash in
    epoch 1 resumed with fit(ckpt_path=last.ckpt) continues exactly as the uninterrupted run
    (same samples, same order, same crops), through the loader's own state in the checkpoint."""
    run = ["--store", str(store), "--sampler", "hook", "--workers", "2"]
    torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "full"))
    full = read_logs(tmp_path / "full")
    check_every_sample_once(full, SAMPLES, epochs=2)
    check_crops_change(full)

    crashed = torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "crash"), "--ckpt-dir",
                       str(tmp_path / "ckpt"), "--crash-at", "22", check=False)
    assert crashed.returncode != 0 and "simulated crash at step 22" in crashed.stderr + crashed.stdout
    # the last checkpoint is after step 20: epoch 1 (steps 15-29), 5 batches in
    resumed = torchrun("lightning_ddp.py", *run, "--log-dir", str(tmp_path / "resume"), "--resume",
                       str(tmp_path / "ckpt" / "last.ckpt"))
    assert "not resumable" not in resumed.stderr + resumed.stdout
    after = read_logs(tmp_path / "resume")
    for rank in (0, 1):
        assert [s["step"] for s in after[rank]] == list(range(20, 30))
        assert after[rank] == [s for s in full[rank] if s["step"] >= 20], f"rank {rank} did not resume exactly"


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
    check_crops_change(logs)


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
