"""torchdata's ``StatefulDataLoader`` over a fastdata store in a plain DDP loop, resumed mid-epoch.

    torchrun --standalone --nproc_per_node=2 examples/frameworks/torchdata_stateful.py --store demo.lmdb

Epoch 0 runs whole; epoch 1 stops after ``--stop-after`` batches, saves ``loader.state_dict()``
(torchdata saves the sampler's state with it), and a new dataset, sampler and loader, as a restarted
job would make them, load that state and finish the epoch. ``StatefulDataLoader``'s workers get
plain indices, so the epoch is given to the dataset as well as to the sampler.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from demo_store import StepLog, make_store
from torchdata.stateful_dataloader import StatefulDataLoader

import fastdata
from fastdata import transforms


def build(store: str, workers: int):
    dataset = fastdata.open_dataset(store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=0)
    sampler = fastdata.DistributedShardSampler(dataset, seed=0)
    loader = StatefulDataLoader(dataset, batch_size=10, sampler=sampler, num_workers=workers,
                                collate_fn=fastdata.collate, worker_init_fn=fastdata.seed_worker)
    return dataset, sampler, loader


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store to train on (made with 300 images if missing)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=6, help="batches of epoch 1 before the restart")
    parser.add_argument("--log-dir", help="write what each rank saw here (one JSON line per step)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        make_store(args.store)
    dist.barrier()
    steps, step = StepLog(args.log_dir, rank), 0

    dataset, sampler, loader = build(args.store, args.workers)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        for number, batch in enumerate(loader, 1):
            steps.write(epoch, step, batch["index"], batch["image"])
            step += 1
            if epoch == 1 and number == args.stop_after:
                break  # the job stops here; the state counts exactly the batches taken
    state = loader.state_dict()  # what a checkpoint would hold
    del loader

    dataset, sampler, loader = build(args.store, args.workers)  # the restarted job
    loader.load_state_dict(state)
    sampler.set_epoch(1)
    dataset.set_epoch(1)
    for batch in loader:
        steps.write(1, step, batch["index"], batch["image"])
        step += 1
    dist.barrier()
    if rank == 0:
        print(f"{step} steps per rank, resumed after {args.stop_after} batches of epoch 1")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
