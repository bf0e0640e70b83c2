"""Accelerate from a fastdata store: ``accelerator.prepare(fastdata.loader(...))``, as written first.

    torchrun --standalone --nproc_per_node=2 examples/frameworks/accelerate_prepare.py --store demo.lmdb

What it relies on (docs/frameworks.md): ``prepare`` rebuilds the loader as its own
``DataLoaderShard``, whose batch sampler deals the batches of ``fastdata.loader``'s batch sampler
round-robin to the processes, whatever the sampler is. So:

* ``--sampler shuffle`` (the loader's default shuffle): Accelerate's split is the only one; the
  epoch still reaches the workers, because fastdata's batch sampler (kept inside Accelerate's)
  tags every batch with it, so each epoch draws new random crops.
* ``--sampler shard``: a ``fastdata.DistributedShardSampler`` whose ranks are left unset sees that
  it is iterated through Accelerate's ``BatchSamplerShard`` and yields the whole epoch's order,
  which Accelerate then splits (block or shard-window locality kept within each batch). One made
  with an explicit ``num_replicas`` there raises a ``ValueError`` before the first batch.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from demo_store import StepLog, make_store

import fastdata
from fastdata import transforms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store to train on (made with 300 images if missing)")
    parser.add_argument("--sampler", choices=["shuffle", "shard", "shard-explicit"], default="shuffle")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-dir", help="write what each rank saw here (one JSON line per step)")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    if accelerator.is_main_process:
        make_store(args.store)
    accelerator.wait_for_everyone()
    set_seed(0)
    dataset = fastdata.open_dataset(args.store, output="tensor", decode=transforms.RandomResizedCrop(16))
    sampler = None
    if args.sampler == "shard":
        sampler = fastdata.DistributedShardSampler(dataset)
    elif args.sampler == "shard-explicit":
        sampler = fastdata.DistributedShardSampler(dataset, num_replicas=accelerator.num_processes,
                                                   rank=accelerator.process_index)
    loader = fastdata.loader(dataset, batch_size=10, num_workers=args.workers, sampler=sampler)
    model = torch.nn.Linear(3 * 16 * 16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    steps, step = StepLog(args.log_dir, accelerator.process_index), 0
    for epoch in range(args.epochs):
        for batch in loader:
            steps.write(epoch, step, batch["index"], batch["image"])
            logits = model(batch["image"].float().flatten(1) / 255)
            loss = torch.nn.functional.cross_entropy(logits, batch["index"] % 2)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
    accelerator.print(f"trained {step} steps per process, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
