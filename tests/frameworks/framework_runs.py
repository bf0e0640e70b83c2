"""Two-process runs of the framework examples, and judging what each rank saw in them (the
examples' ``StepLog`` files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "frameworks"
#: samples in the shared store: 2 ranks x 15 batches of 10 per epoch
SAMPLES = 300


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``examples/frameworks/<script>`` on ``nproc`` CPU processes (torchrun, gloo)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(EXAMPLES / script), *args]
    # offline: nothing here may reach a model hub; one thread per process on a 2-core machine
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
                   **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def read_logs(log_dir: Path) -> dict[int, list[dict]]:
    """rank -> its step records, in order."""
    logs = {}
    for path in sorted(Path(log_dir).glob("rank*.jsonl")):
        logs[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines()]
    return logs


def check_every_sample_once(logs: dict[int, list[dict]], n: int, epochs: int, ranks: int = 2) -> None:
    """Every sample exactly once per epoch across the ranks, with equal batch counts per rank."""
    assert sorted(logs) == list(range(ranks)), f"logs of ranks {sorted(logs)}"
    for epoch in range(epochs):
        steps = {rank: [s for s in records if s["epoch"] == epoch] for rank, records in logs.items()}
        counts = {rank: len(s) for rank, s in steps.items()}
        assert len(set(counts.values())) == 1, f"epoch {epoch}: batches per rank differ: {counts}"
        seen = Counter(i for s in steps.values() for step in s for i in step["index"])
        missing = n - len(seen)
        repeated = {i: c for i, c in seen.items() if c > 1}
        assert missing == 0 and not repeated, (
            f"epoch {epoch}: {missing} of {n} samples never seen, {len(repeated)} seen more than once")


def crops_by_epoch(logs: dict[int, list[dict]]) -> dict[int, dict[int, str]]:
    """epoch -> {sample index: digest of its augmented image}."""
    crops: dict[int, dict[int, str]] = {}
    for records in logs.values():
        for step in records:
            crops.setdefault(step["epoch"], {}).update(zip(step["index"], step["crop"], strict=True))
    return crops


def check_epochs_differ(logs: dict[int, list[dict]], at_least: float = 0.9) -> float:
    """Epoch 1 is a new epoch: another order than epoch 0's on every rank, and a new random crop
    for at least ``at_least`` of the samples. Returns the fraction of new crops."""
    order = order_by_epoch(logs)
    for rank in sorted(logs):
        assert order[0][rank] != order[1][rank], f"rank {rank} read epoch 1 in epoch 0's order"
        assert order[0][rank] != sorted(order[0][rank]), f"rank {rank} read epoch 0 in storage order, unshuffled"
    crops = crops_by_epoch(logs)
    common = set(crops[0]) & set(crops[1])
    assert common, "no sample seen in both epochs"
    changed = sum(crops[0][i] != crops[1][i] for i in common) / len(common)
    assert changed >= at_least, f"only {changed:.0%} of the samples got a new random crop in epoch 1"
    return changed


def order_by_epoch(logs: dict[int, list[dict]]) -> dict[int, list[list[int]]]:
    """epoch -> per rank, the sample indices in the order they arrived."""
    order: dict[int, list[list[int]]] = {}
    for rank in sorted(logs):
        for step in logs[rank]:
            per_rank = order.setdefault(step["epoch"], [[] for _ in logs])
            per_rank[rank].extend(step["index"])
    return order


def expected_steps(store: Path, rank: int, epochs: int, batch_size: int = 10, ranks: int = 2,
                   seed: int = 0) -> list[dict]:
    """The step records an uninterrupted run must log on ``rank``: the batches of a
    ``DistributedShardSampler(seed=seed)`` over ``ranks`` ranks, epoch by epoch, each sample's crop
    computed from the store as the dataset draws it for that epoch (``RandomResizedCrop(16)``,
    the examples' seed 0), steps numbered from 0 over the epochs."""
    import hashlib

    import numpy as np

    import fastdata
    from fastdata import transforms
    from fastdata.reader.seeding import EpochIndex

    dataset = fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=seed)
    sampler = fastdata.DistributedShardSampler(dataset, num_replicas=ranks, rank=rank, seed=seed)
    steps, step = [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), batch_size):
            indices = order[start:start + batch_size]
            crops = [hashlib.blake2b(np.ascontiguousarray(dataset[EpochIndex(i, epoch)]["image"].numpy()).tobytes(),
                                     digest_size=8).hexdigest() for i in indices]
            steps.append({"epoch": epoch, "step": step, "index": indices, "crop": crops})
            step += 1
    return steps
