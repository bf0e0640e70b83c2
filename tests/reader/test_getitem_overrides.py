"""A subclass's own ``__getitem__`` is what batches go through (``fastdata.reader.overrides``).

The datasets define ``__getitems__``, which torch's DataLoader calls instead of ``__getitem__``;
a subclass overriding only ``__getitem__`` (torchvision's detection references subclass
``CocoDetection`` that way) must still see every sample, with the DataLoader (0 and 2 workers)
and with ``fastdata.loader``, and its random crops keyed by the epoch of the batch (the loader
tags only a batch's first index). Controls: the classes as shipped keep their batched path, and a
subclass overriding both methods keeps its own ``__getitems__``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.images import make_jpeg

import fastdata
from fastdata import transforms
from fastdata.fields import Image, Int, Schema
from fastdata.reader.batching import Batch
from fastdata.reader.coco import CocoStoreDataset
from fastdata.reader.dataset import LMDBImageDataset, StoreDataset
from fastdata.reader.mix import MixedDataset
from fastdata.reader.overrides import overrides_getitem
from fastdata.reader.samples import SampleDataset
from fastdata.reader.seeding import EpochIndex
from fastdata.reader.subset import StoreSubset
from fastdata.synth_coco import make_coco

N = 10
MARK = "through the override"


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    """A classification store (two shards), a general store and a COCO store, ten samples each."""
    root = tmp_path_factory.mktemp("overrides")
    for i in range(N):
        make_jpeg(root / "tree" / "ab"[i % 2] / f"{i:02d}.jpg", size=(20 + i, 18 + i), seed=i)
    paths = {"classification": str(root / "c.lmdb"), "general": str(root / "g.lmdb"),
             "coco": str(root / "coco.lmdb")}
    fastdata.convert(str(root / "tree"), paths["classification"], workers=1, progress=False, shard_size=3000)
    rng = np.random.default_rng(0)
    fastdata.write([{"image": rng.integers(0, 255, (12, 10 + i, 3), dtype=np.uint8), "label": i} for i in range(N)],
                   paths["general"], schema=Schema.of({"image": Image(), "label": Int("int16")}), workers=1,
                   progress=False)
    synth = make_coco(root / "cocoset", N, seed=3, max_boxes=3)
    fastdata.convert_coco(synth.ann_file, synth.image_dir, paths["coco"], workers=1, progress=False)
    return paths


class CountingClassification(LMDBImageDataset):
    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label, MARK, getattr(index, "epoch", None)


class CountingGeneral(SampleDataset):
    def __getitem__(self, index):
        return {**super().__getitem__(index), "mark": MARK}


class CountingCoco(CocoStoreDataset):
    """What torchvision's detection references do to CocoDetection."""

    def __getitem__(self, idx):
        img, target = super().__getitem__(idx)
        return img, {"image_id": self.ids[int(idx)], "annotations": target, "mark": MARK}


class CountingSubset(StoreSubset):
    def __getitem__(self, position):
        image, label = super().__getitem__(position)
        return image, label, MARK, getattr(position, "epoch", None)


def listed(batch):
    """collate_fn keeping each sample as the dataset returned it (module level: workers pickle it)."""
    return list(batch)


def marks(sample) -> bool:
    if isinstance(sample, dict):
        return sample.get("mark") == MARK
    return MARK in sample[2:3] or (isinstance(sample[1], dict) and sample[1].get("mark") == MARK)


def opened(kind: str, path: str, **kw):
    cls = {"classification": CountingClassification, "general": CountingGeneral, "coco": CountingCoco}[kind]
    return cls(path, **kw)


@pytest.mark.parametrize("kind", ["classification", "general", "coco", "subset"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_goes_through_the_override_with_a_dataloader(stores, kind, workers):
    if kind == "subset":
        ds = CountingSubset(LMDBImageDataset(stores["classification"], output="numpy"), list(range(N - 1, -1, -1)))
    else:
        ds = opened(kind, stores[kind], output="numpy")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=listed)
    samples = [s for batch in loader for s in batch]
    assert len(samples) == N and all(marks(s) for s in samples)


@pytest.mark.parametrize("kind", ["classification", "coco"])
def test_fastdata_loader_goes_through_the_override_with_fastdata_collate(stores, kind):
    ds = opened(kind, stores[kind], output="tensor", **({"decode": transforms.CenterCrop(8)}
                                                        if kind == "classification" else {}))
    loader = fastdata.loader(ds, batch_size=3, num_workers=2, shuffle=False, persistent_workers=False)
    seen = 0
    for batch in loader:
        if kind == "coco":  # fastdata.collate: detection lists, as the references' collate_fn
            images, targets = batch
            assert isinstance(images, list) and all(t["mark"] == MARK for t in targets)
            seen += len(targets)
        else:
            assert list(batch[2]) == [MARK] * len(batch[2])
            seen += len(batch[2])
    assert seen == N


def test_random_crops_of_the_override_are_the_batched_paths_for_every_epoch(stores):
    """Every index of a per-sample batch carries the batch's epoch, so each crop equals the one
    the class without an override cuts in the same epoch (not only the batch's first)."""
    kw = dict(output="numpy", decode=transforms.RandomResizedCrop(8), seed=5)
    plain = LMDBImageDataset(stores["classification"], **kw)
    counting = CountingClassification(stores["classification"], **kw)
    plain_loader = fastdata.loader(plain, batch_size=4, num_workers=0, shuffle=False)
    loader = fastdata.loader(counting, batch_size=4, num_workers=2, shuffle=False, collate_fn=listed)
    for epoch in range(2):
        got = [s for batch in loader for s in batch]
        want = np.concatenate([images for images, _ in plain_loader])  # fixed-shape Batches
        assert [s[3] for s in got] == [epoch] * N
        assert np.array_equal(np.stack([s[0] for s in got]), want), epoch
    # another epoch cuts other crops: the comparison above tells epochs apart
    assert not np.array_equal(plain.__getitems__([EpochIndex(0, 7), *range(1, N)]).images, want)


def test_a_mix_subclass_overriding_getitem_sees_every_sample(stores):
    class CountingMix(MixedDataset):
        def __getitem__(self, index):
            return (*super().__getitem__(index), MARK)

    mixed = CountingMix({"a": LMDBImageDataset(stores["classification"], output="numpy")})
    loader = fastdata.loader(mixed, batch_size=4, num_workers=0, shuffle=False, collate_fn=listed)
    samples = [s for batch in loader for s in batch]
    assert len(samples) == len(mixed) == N and all(s[-1] == MARK for s in samples)


# ------------------------------------------------------------------------------------------- controls


@pytest.mark.parametrize("workers", [0, 2])
def test_control_the_shipped_classes_keep_their_batched_path(stores, workers, monkeypatch):
    """A spy on the shipped classes' one ``__getitem__`` (StoreDataset's, below every class that
    owns a ``__getitems__``, so nothing is overridden) is never called, and a fixed-shape batch
    stays a Batch."""
    calls = []
    real = StoreDataset.__getitem__
    assert all(type_.__getitem__ is real for type_ in (LMDBImageDataset, SampleDataset, CocoStoreDataset))

    def spy(self, index):
        calls.append(index)
        return real(self, index)

    monkeypatch.setattr(StoreDataset, "__getitem__", spy)
    for ds in (LMDBImageDataset(stores["classification"], output="numpy", decode=transforms.CenterCrop(8)),
               SampleDataset(stores["general"]), CocoStoreDataset(stores["coco"]),
               StoreSubset(LMDBImageDataset(stores["classification"]), [3, 1, 2])):
        assert not overrides_getitem(type(ds))
        batches = list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=listed))
        assert sum(len(b) for b in batches) == len(ds)
    assert calls == []
    fixed = LMDBImageDataset(stores["classification"], output="numpy", decode=transforms.CenterCrop(8))
    assert isinstance(fixed.__getitems__([0, 1, 2]), Batch)


def test_control_a_subclass_overriding_both_keeps_its_own_getitems(stores):
    class Both(LMDBImageDataset):
        def __getitem__(self, index):
            raise AssertionError("not called: this class brings its own __getitems__")

        def __getitems__(self, indices):
            return super().__getitems__(indices)

    class Mixin:
        def __getitem__(self, index):
            return "mixin"

    class WithMixin(Mixin, CocoStoreDataset):
        pass

    assert not overrides_getitem(Both) and overrides_getitem(WithMixin)
    assert overrides_getitem(CountingCoco) and overrides_getitem(CountingSubset)
    assert len(Both(stores["classification"]).__getitems__([0, 1])) == 2
    assert list(WithMixin(stores["coco"]).__getitems__([0, 1])) == ["mixin", "mixin"]


def test_a_patch_dataset_subclass_overriding_getitem_sees_every_patch():
    from fastdata.reader.patches import PatchDataset

    class Counted(PatchDataset):
        calls = 0

        def __getitem__(self, index):
            type(self).calls += 1
            return super().__getitem__(index)

    volumes = [{"image": np.arange(8 * 8, dtype=np.float32).reshape(8, 8)} for _ in range(3)]
    ds = Counted(volumes, patch_size=(4, 4), sampler="grid")
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=0, collate_fn=listed)
    got = [item for batch in loader for item in batch]
    assert len(got) == len(ds) and Counted.calls == len(ds)
    assert not overrides_getitem(PatchDataset)  # control: the shipped class keeps its batched path
