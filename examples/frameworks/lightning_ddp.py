"""Lightning DDP from a fastdata store, with no data code beyond ``train_dataloader``.

    torchrun --standalone --nproc_per_node=2 examples/frameworks/lightning_ddp.py --store demo.lmdb

What it relies on (docs/frameworks.md):

* Lightning's default ``use_distributed_sampler=True`` replaces a loader's sampler unless it is a
  ``torch.utils.data.DistributedSampler``. ``fastdata.DistributedShardSampler`` is one, and it
  resolves rank and world size when first used, so it may be made in ``__init__`` (before the
  process group exists) or in ``train_dataloader``; ``--sampler shuffle`` uses the loader's own
  shuffle, which Lightning swaps for a ``DistributedSampler``.
* ``fastdata.loader`` has ``state_dict``/``load_state_dict``, which Lightning saves in every
  checkpoint and restores on ``fit(ckpt_path=...)``: a run resumed mid-epoch continues exactly.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from demo_store import StepLog, make_store

import fastdata
from fastdata import transforms


class Classifier(L.LightningModule):
    def __init__(self, store: str, sampler: str, workers: int, log_dir: str | None, crash_at: int | None,
                 worker_type: str = "process"):
        super().__init__()
        self.store, self.sampler_kind, self.workers, self.crash_at = store, sampler, workers, crash_at
        self.worker_type = worker_type
        self.log_dir = log_dir
        self.net = torch.nn.Linear(3 * 16 * 16, 2)
        if sampler == "init":  # made before the process group exists: resolved when first used
            self.dataset = self._dataset()
            self.sampler = fastdata.DistributedShardSampler(self.dataset)

    def _dataset(self):
        # a random crop of each image, drawn from (seed, epoch, index): seed_everything sets the seed
        return fastdata.open_dataset(self.store, output="tensor", decode=transforms.RandomResizedCrop(16))

    def train_dataloader(self):
        workers = dict(num_workers=self.workers, worker_type=self.worker_type)
        if self.sampler_kind == "init":
            return fastdata.loader(self.dataset, batch_size=10, sampler=self.sampler, **workers)
        dataset = self._dataset()
        if self.sampler_kind == "hook":
            return fastdata.loader(dataset, batch_size=10, sampler=fastdata.DistributedShardSampler(dataset), **workers)
        return fastdata.loader(dataset, batch_size=10, **workers)  # shuffle=True

    def on_fit_start(self):
        self.steps = StepLog(self.log_dir, self.global_rank)

    def on_train_epoch_start(self):
        if self.log_dir:  # which workers the loader Lightning iterates (it may have rebuilt it) has
            loader = self.trainer.train_dataloader
            with open(os.path.join(self.log_dir, f"rank{self.global_rank}.workers"), "a") as f:
                f.write(f"{type(loader).__name__} {getattr(loader, 'worker_type', 'process')} {loader.num_workers}\n")

    def training_step(self, batch, batch_idx):
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise RuntimeError(f"simulated crash at step {self.global_step}")
        self.steps.write(self.current_epoch, self.global_step, batch["index"], batch["image"])
        logits = self.net(batch["image"].float().flatten(1) / 255)
        return torch.nn.functional.cross_entropy(logits, batch["index"] % 2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store to train on (made with 300 images if missing)")
    parser.add_argument("--sampler", choices=["init", "hook", "shuffle"], default="hook")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-type", choices=["process", "thread"], default="process",
                        help="fastdata.loader's worker_type")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-dir", help="write what each rank saw here (one JSON line per step)")
    parser.add_argument("--ckpt-dir", help="checkpoint every 4 steps here")
    parser.add_argument("--resume", help="a checkpoint to resume from (fit(ckpt_path=...))")
    parser.add_argument("--crash-at", type=int, help="raise in training_step at this global step")
    parser.add_argument("--no-distributed-sampler", action="store_true",
                        help="Trainer(use_distributed_sampler=False)")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) == 0:
        make_store(args.store)
    L.seed_everything(0)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=4,
                                                             save_top_k=-1, save_last=True))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), max_epochs=args.epochs,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.ckpt_dir),
                        use_distributed_sampler=not args.no_distributed_sampler)
    model = Classifier(args.store, args.sampler, args.workers, args.log_dir, args.crash_at, args.worker_type)
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
