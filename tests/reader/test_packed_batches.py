"""Ragged and dict batches cross a DataLoader worker's queue in one shared-memory segment."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.backends import first_in_ci
from helpers.samples import jpeg
from torch.utils.data import DataLoader

import fastdata
from fastdata.fields import Int, NDArray
from fastdata.reader import batching
from fastdata.reader.batching import PackedBatch, collate_samples


class _Boxes(torch.Tensor):
    """Stands in for torchvision's tv_tensors (a tensor subclass with metadata)."""


def _unpack_here(batch):
    """What the main process gets, without a queue in between."""
    rebuild, args = PackedBatch(batch).__reduce__()
    return rebuild(*args)


def test_packing_keeps_values_dtypes_shapes_and_strides():
    hwc = torch.arange(5 * 7 * 3, dtype=torch.uint8).reshape(5, 7, 3)
    # more than BY_VALUE_BYTES in all, so the batch travels in one shared segment (smaller ones travel
    # inside the pickle: test_small_tensors_travel_inside_the_pickle)
    wide = torch.arange(40 * 1000, dtype=torch.float64).reshape(40, 1000)
    boxes = torch.arange(8.0).reshape(2, 4).as_subclass(_Boxes)
    boxes.canvas = (5, 7)
    batch = ({"image": [hwc.permute(2, 0, 1), hwc[1:].permute(2, 0, 1)],
              "cols": wide[:, ::2], "mask": torch.tensor([True, False]), "none": torch.empty(0, 4),
              "polygon": [[1.0, 2.0, 3.0]], "boxes": boxes}, [{"labels": torch.tensor([3, 1])}], "text")
    got = _unpack_here(batch)
    flat = [got[0]["image"][0], got[0]["image"][1], got[0]["cols"], got[0]["mask"], got[0]["none"],
            got[1][0]["labels"]]
    want = [batch[0]["image"][0], batch[0]["image"][1], batch[0]["cols"], batch[0]["mask"], batch[0]["none"],
            batch[1][0]["labels"]]
    for g, w in zip(flat, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert got[0]["image"][0].stride() == hwc.permute(2, 0, 1).stride()  # still a CHW view of HWC
    assert len({t.untyped_storage().data_ptr() for t in flat if t.numel()}) == 1  # one segment
    assert all(t.is_shared() for t in flat)
    assert got[0]["polygon"] == [[1.0, 2.0, 3.0]] and got[2] == "text"
    # a subclass comes back as itself, attributes included
    assert type(got[0]["boxes"]) is _Boxes and got[0]["boxes"].canvas == (5, 7)
    assert torch.equal(got[0]["boxes"].as_subclass(torch.Tensor), boxes.as_subclass(torch.Tensor))


def _write_store(tmp_path, n=24):
    samples = [{"image": jpeg(i, size=(10 + i, 8 + i % 5)), "label": i % 3,
                "boxes": np.full((i % 4, 4), i, dtype=np.float32), "labels": np.arange(i % 4, dtype=np.int64)}
               for i in range(n)]
    dst = str(tmp_path / "s.lmdb")
    fastdata.write(samples, dst, workers=0, progress=False)
    return dst


def _storages(batch) -> set:
    return {t.untyped_storage().data_ptr() for t in (*batch["image"], *batch["boxes"], *batch["labels"]) if t.numel()}


# spawn nightly (3.6 s: fresh interpreters): the batch's transport is the same from either start method, and
# CI's loader matrix covers spawned workers' datasets
@pytest.mark.parametrize("start_method", first_in_ci(["fork", "spawn"]))
def test_a_dict_batch_from_workers_is_one_segment_and_equals_the_in_process_batch(tmp_path, start_method):
    ds = fastdata.open_dataset(_write_store(tmp_path), output="tensor")
    want = [fastdata.collate(ds.__getitems__(list(range(b, b + 8)))) for b in range(0, 24, 8)]
    before = batching.received_packed
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=fastdata.collate,
                        multiprocessing_context=start_method)
    got = list(loader)
    assert batching.received_packed - before == 3
    for g, w in zip(got, want, strict=True):
        for key in ("image", "boxes", "labels"):
            assert len(g[key]) == len(w[key])
            for a, b in zip(g[key], w[key], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
                assert a.stride() == b.stride() or not a.numel()
        assert torch.equal(g["label"], w["label"])
        # the images were decoded into one segment, the ragged fields packed into another
        assert len({t.untyped_storage().data_ptr() for t in g["image"]}) == 1
        assert len(_storages(g)) == 2
    # control: the same batches collated without packing arrive one segment per tensor (what the
    # check above would see; it does not depend on the start method: with fork only, not twice)
    if start_method == "fork":
        plain = list(DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_samples,
                                multiprocessing_context=start_method))
        assert all(len(_storages(b)) > 8 for b in plain)


def test_a_coco_batch_from_workers_is_one_segment(tmp_path):
    from fastdata.synth_coco import make_coco

    coco = make_coco(tmp_path / "c", 12, seed=1, max_boxes=5, workers=1)
    store = str(tmp_path / "coco.lmdb")
    fastdata.convert_coco(coco.ann_file, coco.image_dir, store, workers=1, progress=False)
    ds = fastdata.open_dataset(store, output="tensor")
    loader = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=fastdata.collate,
                        multiprocessing_context="fork")
    seen = 0
    for images, targets in loader:
        assert len({im.untyped_storage().data_ptr() for im in images}) == 1
        for image, target in zip(images, targets, strict=True):
            want_image, want_target = ds[seen]
            assert torch.equal(image, want_image) and image.stride() == want_image.stride()
            assert target == want_target
            seen += 1
    assert seen == 12


def test_images_are_decoded_into_ring_slots_that_come_back_epoch_after_epoch(tmp_path):
    """After the first batch maps a worker's ring, images are decoded straight into its slots;
    the main process frees each slot when the batch is gone, so later epochs keep using them
    (a slot never freed would leave all 8 taken after 8 batches and every later batch would
    travel in a new segment)."""
    from fastdata.reader import batch_ring
    ds = fastdata.open_dataset(_write_store(tmp_path, n=40), output="tensor")
    want = {i: ds[i] for i in range(40)}
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=fastdata.collate, persistent_workers=True,
                        multiprocessing_context="fork", sampler=range(40))
    per_epoch = []
    for _epoch in range(3):
        before = batch_ring.received["ring"]
        for b, batch in enumerate(loader):
            for k, image in enumerate(batch["image"]):
                assert torch.equal(image, want[2 * b + k]["image"])
        per_epoch.append(batch_ring.received["ring"] - before)
    assert per_epoch[0] >= 10 and per_epoch[1] >= 18 and per_epoch[2] >= 18, per_epoch


def test_a_lent_slot_is_freed_by_the_worker_unless_it_was_sent():
    from fastdata.reader import batch_ring
    batch_ring.drop_ring()
    assert batch_ring.lend(1000) is None  # a new ring: not mapped by the main process yet
    ring = batch_ring.current_ring()
    assert ring is not None
    ring.map[0] = 1  # what the main process does when it maps the ring
    kept = batch_ring.lend(1000)
    dropped = batch_ring.lend(1000)
    assert kept is not None and dropped is not None
    states = lambda: [ring.map[1 + k] for k in range(batch_ring.SLOTS)]  # noqa: E731
    assert states()[:3] == [1, 1, 0]
    del dropped  # never sent: the worker gives it back
    assert states()[:3] == [1, 0, 0]
    tensor = torch.from_numpy(kept)
    rebuild, args = PackedBatch({"a": [tensor[:10], tensor[10:30]]}).__reduce__()
    assert ring.sent == {0}
    del kept, tensor, args
    assert states()[:2] == [1, 0]  # sent: only the main process frees it
    assert ring.sent == set()
    batch_ring.drop_ring()
    assert batch_ring.current_ring() is None


def test_a_foreign_collate_gets_the_same_images(tmp_path):
    ds = fastdata.open_dataset(_write_store(tmp_path, n=40), output="tensor")
    want = {i: ds[i]["image"] for i in range(40)}
    foreign = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=collate_samples,
                         multiprocessing_context="fork", sampler=list(range(40)) * 3)
    for b, batch in enumerate(foreign):
        for k, image in enumerate(batch["image"]):
            assert torch.equal(image, want[(2 * b + k) % 40])


def test_a_coco_batch_of_pil_images_from_workers_equals_the_samples(tmp_path):
    from fastdata.synth_coco import make_coco

    coco = make_coco(tmp_path / "c", 10, seed=2, max_boxes=3, workers=1)
    store = str(tmp_path / "coco.lmdb")
    fastdata.convert_coco(coco.ann_file, coco.image_dir, store, workers=1, progress=False)
    ds = fastdata.open_dataset(store)
    got = [pair for images, targets in DataLoader(ds, batch_size=5, num_workers=2, collate_fn=fastdata.collate,
                                                  multiprocessing_context="fork")
           for pair in zip(images, targets, strict=True)]
    for i, (image, target) in enumerate(got):
        want_image, want_target = ds[i]
        assert image.mode == "RGB" and image.tobytes() == want_image.tobytes() and target == want_target


class _KeepsEveryImage:
    """A transform holding on to every image it saw (as mosaic-style augmentations keep a
    buffer of earlier images); each sample reports whether all kept images still hold
    their own pixels."""

    def __init__(self, reference: dict):
        self.reference = reference
        self.kept: list = []

    def __call__(self, sample):
        sample["kept_intact"] = all(torch.equal(image, self.reference[label]) for label, image in self.kept)
        self.kept.append((int(sample["label"]), sample["image"]))
        return sample


def test_an_image_a_worker_keeps_is_never_overwritten_by_later_batches(tmp_path):
    samples = [{"image": jpeg(i, size=(10 + i % 7, 8 + i % 5)), "label": i} for i in range(40)]
    dst = str(tmp_path / "s.lmdb")
    fastdata.write(samples, dst, workers=0, progress=False)
    plain = fastdata.open_dataset(dst, output="tensor")
    reference = {i: plain[i]["image"] for i in range(40)}
    ds = fastdata.open_dataset(dst, output="tensor", transform=_KeepsEveryImage(reference))
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=fastdata.collate, persistent_workers=True,
                        multiprocessing_context="fork", sampler=range(40))
    for _epoch in range(2):  # 40 batches through a ring of 8 slots
        for batch in loader:
            assert bool(batch["kept_intact"].all())
            for label, image in zip(batch["label"].tolist(), batch["image"], strict=True):
                assert torch.equal(image, reference[label])


def _fixed_store(tmp_path, n=32):
    samples = [{"x": np.full((64, 64), i, dtype=np.float32), "y": i, "m": np.arange(3, dtype=np.int16) + i}
               for i in range(n)]
    dst = str(tmp_path / "fixed.lmdb")
    schema = {"x": NDArray("float32", (64, 64)), "y": Int(), "m": NDArray("int16", (3,))}
    fastdata.write(samples, dst, schema, workers=0, progress=False)
    return dst


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "control"])
def test_fixed_shape_dict_fields_are_stacked_into_ring_slots(tmp_path, ring, request):
    """Fields of one shape and dtype are stacked into one slot of the worker's ring (only the slot
    number crosses the queue; slots come back once a batch is gone); without a ring the same
    batches arrive as before (control: no batch through the ring)."""
    from fastdata.reader import batch_ring
    if not ring:
        batch_ring.set_enabled(False)  # inherited by the forked workers
        request.addfinalizer(lambda: batch_ring.set_enabled(True))
    ds = fastdata.open_dataset(_fixed_store(tmp_path), output="tensor")
    want = [fastdata.collate(ds.__getitems__(list(range(b, b + 4)))) for b in range(0, 32, 4)]
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=fastdata.collate, persistent_workers=True,
                        multiprocessing_context="fork", sampler=range(32))
    through_ring = []
    for _epoch in range(2):
        before = batch_ring.received["ring"]
        for g, w in zip(loader, want, strict=True):
            assert list(g) == list(w)
            for key in w:
                assert g[key].dtype == w[key].dtype and torch.equal(g[key], w[key])
            if ring and _epoch == 1:  # every batch through the ring by now: x and m in one slot
                assert g["x"].untyped_storage().data_ptr() == g["m"].untyped_storage().data_ptr()
        through_ring.append(batch_ring.received["ring"] - before)
    if ring:
        # the first batch of each worker announces its ring; the batches it made before the main
        # process mapped the ring (prefetch_factor 2 ahead) travel as before; every later one uses it
        assert through_ring[0] >= 8 - 2 * 2 and through_ring[1] == 8, through_ring
    else:
        assert through_ring == [0, 0]


def test_small_tensors_travel_inside_the_pickle():
    """A packed batch whose tensors total at most BY_VALUE_BYTES needs no shared segment (no
    descriptor round trip to the worker); a larger one gets one segment."""
    small = {"a": torch.arange(10), "b": torch.ones(3, 4)}
    got = _unpack_here(small)
    assert all(torch.equal(got[k], small[k]) for k in small)
    assert not any(got[k].is_shared() for k in small)
    big = {"a": torch.arange(batching.BY_VALUE_BYTES // 8 + 1), "b": torch.ones(3, 4)}
    got = _unpack_here(big)
    assert all(torch.equal(got[k], big[k]) for k in big)
    assert all(got[k].is_shared() for k in big)
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
