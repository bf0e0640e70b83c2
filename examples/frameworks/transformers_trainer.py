"""transformers' ``Trainer`` over a fastdata store: the dataset as ``train_dataset``, or a
``Trainer`` subclass whose ``get_train_dataloader`` returns ``fastdata.loader``.

    torchrun --standalone --nproc_per_node=2 examples/frameworks/transformers_trainer.py --store demo.lmdb

What it relies on (docs/frameworks.md): with ``train_dataset=`` the Trainer builds its own
DataLoader and passes it through Accelerate's ``prepare``, which splits it over the processes and
calls the dataset's ``set_epoch`` each epoch (fresh workers each epoch, its default, then draw new
crops). A subclass returning ``fastdata.loader(ds, sampler=fastdata.DistributedShardSampler(ds))``
bypasses ``prepare``: the sampler splits the data, and the ``loader.set_epoch(epoch)`` that
Trainer calls each epoch reaches the sampler (new order) and the dataset (new crops).
"""

from __future__ import annotations

import argparse
import os

import torch
from demo_store import StepLog, make_store
from transformers import Trainer, TrainerCallback, TrainingArguments

import fastdata
from fastdata import transforms


class TinyClassifier(torch.nn.Module):
    """A model Trainer can drive: the batch's fields as keyword arguments, a dict with the loss back."""

    def __init__(self, steps: StepLog) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 16 * 16, 2)
        self.steps, self.step, self.epoch = steps, 0, 0

    def forward(self, image, index):
        if self.training:
            self.steps.write(self.epoch, self.step, index, image)
            self.step += 1
        logits = self.net(image.float().flatten(1) / 255)
        return {"loss": torch.nn.functional.cross_entropy(logits, index % 2), "logits": logits}


class EpochToModel(TrainerCallback):
    """Tells the model which epoch a step belongs to (for the step log only)."""

    def __init__(self, model: TinyClassifier) -> None:
        self.model = model

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.model.epoch = int(round(state.epoch or 0))


class FastdataTrainer(Trainer):
    """A Trainer that trains from ``fastdata.loader`` (not passed through Accelerate's ``prepare``)."""

    def get_train_dataloader(self):
        dataset = self.train_dataset
        return fastdata.loader(dataset, batch_size=self.args.per_device_train_batch_size,
                               num_workers=self.args.dataloader_num_workers,
                               sampler=fastdata.DistributedShardSampler(dataset))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store to train on (made with 300 images if missing)")
    parser.add_argument("--loader", choices=["trainer", "fastdata"], default="trainer",
                        help="Trainer's own DataLoader, or a subclass returning fastdata.loader")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-dir", help="write what each rank saw here (one JSON line per step)")
    parser.add_argument("--output-dir", default="trainer-out")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        make_store(args.store)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    dataset = fastdata.open_dataset(args.store, output="tensor", decode=transforms.RandomResizedCrop(16), seed=0)
    model = TinyClassifier(StepLog(args.log_dir, rank))
    training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=10,
                                 num_train_epochs=args.epochs, dataloader_num_workers=args.workers,
                                 use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0)
    trainer_class = FastdataTrainer if args.loader == "fastdata" else Trainer
    trainer = trainer_class(model=model, args=training, train_dataset=dataset)
    trainer.add_callback(EpochToModel(model))
    trainer.train()


if __name__ == "__main__":
    main()
