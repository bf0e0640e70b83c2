"""A ``LightningDataModule`` over fastdata stores.

Nothing here is needed to use fastdata with Lightning: ``fastdata.loader`` in a module's
``train_dataloader`` is split once under DDP, keeps the epoch and resumes from Lightning's own
checkpoints (``docs/frameworks.md``). :class:`StoreDataModule` only saves writing those hooks for
the common case: one store (path, URL or dataset) per stage, opened in each process when Lightning
calls ``setup``, read through ``fastdata.loader`` with a :class:`fastdata.DistributedShardSampler`
for training.

Requires the ``lightning`` package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch import LightningDataModule
except ImportError as exc:  # pragma: no cover - depends on what is installed
    from fastdata.errors import MissingExtraError

    raise MissingExtraError("fastdata.integrations.lightning needs Lightning: pip install lightning") from exc

from fastdata.reader.loader import loader
from fastdata.reader.open import open_dataset
from fastdata.reader.sampler import DistributedShardSampler

__all__ = ["StoreDataModule"]

#: the stages, in the order of the hooks Lightning calls
STAGES = ("train", "val", "test", "predict")


class StoreDataModule(LightningDataModule):
    """One fastdata store per stage, read through :func:`fastdata.loader`.

    Args:
        train, val, test, predict: a store path or URL (opened with :func:`fastdata.open_dataset`
            and ``dataset_options``) or a dataset already made (a fastdata dataset, a subset, a
            mix, a ``PatchDataset``); None: no loader for that stage.
        batch_size (int): samples per batch and per process.
        num_workers (int | None): DataLoader workers per process (None: ``fastdata.loader``'s
            default, the usable cores up to 8).
        dataset_options (Mapping | None): keywords of :func:`fastdata.open_dataset` for every
            stage opened from a path (e.g. ``output="tensor"``).
        train_options (Mapping | None): keywords of :func:`fastdata.open_dataset` for the train
            store only, on top of ``dataset_options`` (e.g. a random ``decode=`` crop).
        sampler_options (Mapping | None): keywords of :class:`fastdata.DistributedShardSampler`
            for training (``shuffle``, ``seed``, ``block_size``, ``shard_window``, ``drop_last``).
        loader_options (Mapping | None): keywords of :func:`fastdata.loader` for every stage
            (``collate_fn``, ``pin_memory``, ``persistent_workers``, ...).

    Training reads through a :class:`fastdata.DistributedShardSampler` (a ``DistributedSampler``,
    so Lightning adds none of its own); the other stages read in storage order, and Lightning
    splits them over the processes as it splits any evaluation loader.
    """

    def __init__(self, train: Any = None, val: Any = None, test: Any = None, predict: Any = None, *,
                 batch_size: int = 64, num_workers: int | None = None,
                 dataset_options: Mapping[str, Any] | None = None, train_options: Mapping[str, Any] | None = None,
                 sampler_options: Mapping[str, Any] | None = None,
                 loader_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.sources = {"train": train, "val": val, "test": test, "predict": predict}
        if all(source is None for source in self.sources.values()):
            raise ValueError("StoreDataModule needs a store for at least one of train, val, test, predict")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.dataset_options = dict(dataset_options or {})
        self.train_options = dict(train_options or {})
        self.sampler_options = dict(sampler_options or {})
        self.loader_options = dict(loader_options or {})
        self.datasets: dict[str, Any] = {}

    def _open(self, stage: str) -> Any:
        source = self.sources[stage]
        if not isinstance(source, (str, os.PathLike)):
            return source
        options = {**self.dataset_options, **(self.train_options if stage == "train" else {})}
        return open_dataset(source, **options)

    def setup(self, stage: str | None = None) -> None:
        """Open the stores (each process opens its own; no file stays open until a worker reads)."""
        for name, source in self.sources.items():
            if source is not None and name not in self.datasets:
                self.datasets[name] = self._open(name)

    def _dataset(self, stage: str) -> Any:
        if self.sources[stage] is None:
            raise ValueError(f"StoreDataModule has no {stage} store: pass {stage}=PATH")
        if stage not in self.datasets:
            self.datasets[stage] = self._open(stage)
        return self.datasets[stage]

    def _loader(self, stage: str, **kwargs: Any):
        options = {**self.loader_options, **kwargs}
        if self.num_workers is not None:
            options.setdefault("num_workers", self.num_workers)
        return loader(self._dataset(stage), batch_size=self.batch_size, **options)

    def train_dataloader(self):
        """The training loader: shuffled by a :class:`fastdata.DistributedShardSampler`."""
        dataset = self._dataset("train")
        return self._loader("train", sampler=DistributedShardSampler(dataset, **self.sampler_options))

    def val_dataloader(self):
        """The validation loader, in storage order."""
        return self._loader("val", shuffle=False)

    def test_dataloader(self):
        """The test loader, in storage order."""
        return self._loader("test", shuffle=False)

    def predict_dataloader(self):
        """The prediction loader, in storage order."""
        return self._loader("predict", shuffle=False)
