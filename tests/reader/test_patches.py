"""PatchDataset: patches of N-D array fields, placed by (seed, epoch, patch index) only.

The base samples encode their own coordinates (``image[z, y, x] = sample * 10**6 + flat index``),
so every patch proves where it was cut from; lazy fields are a small array-like that counts the
regions read, standing in for a chunked store's lazy arrays.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import fastdata
from fastdata.reader import patches as patches_module
from fastdata.reader.patches import PatchDataset, Stitcher, stitch
from fastdata.reader.seeding import EpochIndex

SAMPLE_STRIDE = 10**6


def coordinates(index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Sample ``index``'s image: each voxel holds its own sample and flat position."""
    return index * SAMPLE_STRIDE + np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)


def label_of(image: np.ndarray) -> np.ndarray:
    """The label field: another function of the coordinates, so an image patch and a label
    patch cut at different places would disagree."""
    return (image % 5 == 0).astype(np.uint8)


class CoordinateVolumes:
    """A plain map-style base: dicts of numpy volumes plus scalar and string fields; counts reads."""

    def __init__(self, shapes, shard_starts=None):
        self.shapes = [tuple(s) for s in shapes]
        self.reads = 0
        if shard_starts is not None:
            self.shard_starts = np.asarray(shard_starts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index):
        self.reads += 1
        image = coordinates(int(index), self.shapes[int(index)])
        return {"image": image, "label": label_of(image), "id": int(index), "name": f"vol{int(index)}"}


class IndexedVolumes(CoordinateVolumes):
    """A base with the store's ``array_shapes``: shapes known without opening a sample."""

    def array_shapes(self, name: str) -> np.ndarray:
        if name not in ("image", "label"):
            raise KeyError(name)
        return np.array(self.shapes, dtype=np.int64)


class CountingArray:
    """A lazy array: reads only the region asked for and records its size (elements)."""

    def __init__(self, data: np.ndarray, chunks=None):
        self.data = data
        self.shape, self.dtype, self.ndim = data.shape, data.dtype, data.ndim
        self.reads: list[int] = []
        if chunks is not None:
            self.chunks = chunks

    def __getitem__(self, key):
        region = np.array(self.data[key])
        self.reads.append(region.size)
        return region

    def __array__(self, dtype=None, copy=None):
        self.reads.append(self.data.size)
        return np.asarray(self.data, dtype=dtype)


class LazyVolumes:
    """A base whose array fields are lazy (the same CountingArray objects every read)."""

    def __init__(self, images, labels, chunks=None):
        self.images = [CountingArray(a, chunks) for a in images]
        self.labels = [CountingArray(a, chunks) for a in labels]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index):
        return {"image": self.images[int(index)], "label": self.labels[int(index)], "id": int(index)}


def assert_cut_from(item, base, patch_size):
    """The patch's image and label are the base sample's regions at ``position`` (no padding)."""
    sample = base[item["sample"]]
    region = tuple(slice(int(a), int(a) + p) for a, p in zip(item["position"], patch_size, strict=True))
    np.testing.assert_array_equal(item["image"], sample["image"][region])
    np.testing.assert_array_equal(item["label"], sample["label"][region])


# --------------------------------------------------------------------------- uniform
def test_uniform_positions_stay_inside_cover_every_start_and_cut_every_field_at_the_same_place():
    base = CoordinateVolumes([(9, 11, 7), (6, 8, 12)])
    patch = (4, 5, 3)
    ds = PatchDataset(base, patch, sampler="uniform", patches_per_sample=300, seed=3)
    assert len(ds) == 600
    starts = {0: [], 1: []}
    for p in range(len(ds)):
        item = ds[p]
        assert item["sample"] == p // 300 and item["id"] == item["sample"] and item["name"] == f"vol{p // 300}"
        assert_cut_from(item, base, patch)
        starts[item["sample"]].append(item["position"])
    for i, shape in enumerate(base.shapes):
        seen = np.array(starts[i])
        assert seen.min(axis=0).tolist() == [0, 0, 0]
        assert seen.max(axis=0).tolist() == [s - p for s, p in zip(shape, patch, strict=True)]  # far edge reached
        for axis in range(3):  # every valid start is drawn over 300 draws
            assert set(seen[:, axis].tolist()) == set(range(shape[axis] - patch[axis] + 1))


def test_trailing_axes_are_taken_whole_and_none_takes_a_whole_axis():
    base = CoordinateVolumes([(20, 16, 3)])  # an HxWx3 image
    item = PatchDataset(base, (8, 8), seed=0)[0]
    assert item["image"].shape == (8, 8, 3) and item["position"].shape == (2,)
    y, x = item["position"]
    np.testing.assert_array_equal(item["image"], base[0]["image"][y:y + 8, x:x + 8])
    channel_first = CoordinateVolumes([(2, 10, 12)])  # CxHxW: None keeps every channel
    item = PatchDataset(channel_first, (None, 4, 4), seed=0)[0]
    assert item["image"].shape == (2, 4, 4) and item["position"][0] == 0
    assert_cut_from(item, channel_first, (2, 4, 4))


def test_default_fields_skip_scalars_and_arrays_with_fewer_axes():
    class WithVector(CoordinateVolumes):
        def __getitem__(self, index):
            return {**super().__getitem__(index), "spacing": np.array([1.0, 1.0, 2.5])}

    item = PatchDataset(WithVector([(6, 6, 6)]), (2, 2, 2), seed=0)[0]
    assert item["image"].shape == item["label"].shape == (2, 2, 2)
    np.testing.assert_array_equal(item["spacing"], [1.0, 1.0, 2.5])  # 1-D: passed through
    only_image = PatchDataset(CoordinateVolumes([(6, 6, 6)]), (2, 2, 2), fields="image", seed=0)[0]
    assert only_image["image"].shape == (2, 2, 2) and only_image["label"].shape == (6, 6, 6)


def test_patches_are_copies_not_views_of_the_base_arrays():
    base_image = coordinates(0, (6, 6))

    class Fixed:
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return {"image": base_image}

    item = PatchDataset(Fixed(), (3, 3), seed=0)[0]
    item["image"][...] = -1
    assert (base_image >= 0).all()


def test_lazy_fields_are_read_only_where_the_patch_lies():
    image = coordinates(0, (32, 32, 32))
    base = LazyVolumes([image], [label_of(image)])
    ds = PatchDataset(base, (8, 4, 2), patches_per_sample=5, seed=1)
    for p in range(5):
        item = ds[p]
        z, y, x = item["position"]
        np.testing.assert_array_equal(item["image"], image[z:z + 8, y:y + 4, x:x + 2])
    assert base.images[0].reads == [64] * 5 and base.labels[0].reads == [64] * 5


# --------------------------------------------------------------------------- grid
@pytest.mark.parametrize("overlap", [0, 2, (1, 0, 3), 0.5])
def test_grid_tiles_cover_every_voxel_stay_inside_respect_the_overlap_and_stitch_back_exactly(overlap):
    base = IndexedVolumes([(11, 9, 13), (5, 6, 7), (4, 12, 6)])
    patch = (4, 6, 5)
    ds = PatchDataset(base, patch, sampler="grid", overlap=overlap)
    assert ds.overlap is not None
    step = [p - o for p, o in zip(patch, ds.overlap, strict=True)]
    total = 0
    for i, shape in enumerate(base.shapes):
        items = [ds[p] for p in ds.patches_of(i)]
        assert all(item["sample"] == i for item in items)
        positions = np.array([item["position"] for item in items])
        assert (positions >= 0).all() and (positions + patch <= np.array(shape)).all()  # no tile outside
        for axis in range(3):
            starts = sorted(set(positions[:, axis].tolist()))
            last = max(shape[axis] - patch[axis], 0)
            expected = sorted({min(k * step[axis], last) for k in range(shape[axis] // step[axis] + 2)})
            assert starts == expected  # regular steps of patch - overlap, the last on the far edge
        for item in items:
            assert_cut_from(item, base, patch)
        coverage = np.zeros(shape, dtype=np.int64)
        for position in positions:
            coverage[tuple(slice(a, a + p) for a, p in zip(position, patch, strict=True))] += 1
        assert (coverage >= 1).all()
        restored = stitch(ds, i, items, "image")  # a per-tile identity stitched back
        np.testing.assert_array_equal(restored, base[i]["image"])
        total += len(items)
    assert len(ds) == total
    again = PatchDataset(IndexedVolumes(base.shapes), patch, sampler="grid", overlap=overlap)
    assert [tuple(again[p]["position"]) for p in range(len(again))] == [
        tuple(ds[p]["position"]) for p in range(len(ds))]  # a deterministic order


def test_grid_order_is_sample_major_then_c_order():
    ds = PatchDataset(IndexedVolumes([(4, 4), (2, 6)]), (2, 2), sampler="grid")
    got = [(int(ds[p]["sample"]), tuple(ds[p]["position"].tolist())) for p in range(len(ds))]
    assert got == [(0, (0, 0)), (0, (0, 2)), (0, (2, 0)), (0, (2, 2)), (1, (0, 0)), (1, (0, 2)), (1, (0, 4))]


def test_grid_shapes_come_from_array_shapes_without_reading_samples_else_from_one_read_each():
    indexed = IndexedVolumes([(8, 8), (10, 4), (4, 9)])
    ds = PatchDataset(indexed, (4, 4), sampler="grid", fields=("image", "label"))
    assert indexed.reads == 0 and len(ds) == 4 + 3 + 3
    assert ds.spatial_shape(1) == (10, 4)
    PatchDataset(indexed, (4, 4), sampler="grid")
    assert indexed.reads == 1  # fields=None: base[0] names the field whose shapes are asked for
    plain = CoordinateVolumes(indexed.shapes)
    ds = PatchDataset(plain, (4, 4), sampler="grid", fields=("image",))
    assert plain.reads == 3 and len(ds) == 10  # one read per sample, kept in a numpy array
    assert isinstance(ds._shapes, np.ndarray)


def test_stitcher_averages_overlaps_takes_channels_first_batches_and_refuses_gaps():
    image = coordinates(0, (6, 10)).astype(np.float64)
    base = IndexedVolumes([(6, 10)])
    ds = PatchDataset(base, (4, 4), sampler="grid", overlap=2, output="tensor")
    out = ds.stitcher(0, channels_first=True)
    batch = fastdata.collate([ds[p] for p in ds.patches_of(0)])
    tiles = torch.stack([batch["image"].double(), 2 * batch["image"].double()], dim=1)  # a 2-channel output
    out.add_batch(batch["position"], tiles)
    assert out.coverage.max() >= 4
    np.testing.assert_array_equal(out.result(), np.stack([image, 2 * image]))
    partial = Stitcher((6, 10))
    partial.add(np.array([0, 0]), np.ones((4, 4)))
    with pytest.raises(ValueError, match="covered by no tile"):
        partial.result()
    with pytest.raises(ValueError, match="outside"):
        partial.add([6, 0], np.ones((4, 4)))


# --------------------------------------------------------------------------- weighted
def sparse_labels(shape, points):
    label = np.zeros(shape, dtype=np.uint8)
    for point in points:
        label[point] = 1
    return label


@pytest.mark.parametrize("pos_ratio", [1.0, 0.0])
def test_weighted_centres_are_positive_with_pos_ratio_1_and_negative_with_0(pos_ratio):
    shape, patch = (20, 20, 20), (5, 5, 5)
    points = [(8, 9, 10), (12, 7, 11), (10, 12, 8)]  # interior: the centre is never moved
    image = coordinates(0, shape)
    base = LazyVolumes([image], [sparse_labels(shape, points)])
    ds = PatchDataset(base, patch, sampler="weighted", weight_field="label", pos_ratio=pos_ratio,
                      patches_per_sample=60, seed=2)
    for p in range(len(ds)):
        item = ds[p]
        centre = item["label"][2, 2, 2]
        assert centre == (1 if pos_ratio == 1.0 else 0)
        z, y, x = item["position"]
        np.testing.assert_array_equal(item["image"], image[z:z + 5, y:y + 5, x:x + 5])


def test_weighted_draws_voxels_uniformly_not_cells_uniformly():
    # two positives share a cell, one is alone in another: uniform over cells would pick the lone
    # one half of the time, uniform over voxels a third
    shape = (16, 16)
    points = [(2, 2), (3, 3), (12, 12)]
    ds = PatchDataset(LazyVolumes([coordinates(0, shape)], [sparse_labels(shape, points)]), (3, 3),
                      sampler="weighted", weight_field="label", pos_ratio=1.0, cell_size=8,
                      patches_per_sample=900, seed=4)
    counts = {point: 0 for point in points}
    for p in range(len(ds)):
        y, x = ds[p]["position"]
        counts[(int(y) + 1, int(x) + 1)] += 1
    assert all(220 < c < 380 for c in counts.values()), counts


def test_weighted_mixes_positives_and_negatives_by_pos_ratio():
    shape = (24, 24)
    label = np.zeros(shape, dtype=np.uint8)
    label[8:16, 8:16] = 1
    ds = PatchDataset(LazyVolumes([coordinates(0, shape)], [label]), (3, 3), sampler="weighted",
                      weight_field="label", pos_ratio=0.25, patches_per_sample=800, seed=5)
    positives = sum(int(ds[p]["label"][1, 1]) for p in range(len(ds)))
    assert 150 < positives < 250  # 200 expected


def test_weighted_proportional_mode_follows_the_weights():
    weights = np.zeros((10, 10), dtype=np.float32)
    weights[2, 2], weights[7, 7] = 1.0, 3.0
    ds = PatchDataset(LazyVolumes([coordinates(0, (10, 10))], [weights]), (1, 1), sampler="weighted",
                      weight_field="label", pos_ratio=None, patches_per_sample=400, seed=6)
    heavy = sum(tuple(ds[p]["position"].tolist()) == (7, 7) for p in range(len(ds)))
    assert sum(tuple(ds[p]["position"].tolist()) in ((2, 2), (7, 7)) for p in range(len(ds))) == 400
    assert 260 < heavy < 340  # 300 expected


def test_weighted_sample_without_positives_falls_back_to_negatives_and_warns_once():
    shape = (8, 8)
    ds = PatchDataset(LazyVolumes([coordinates(i, shape) for i in range(2)], [np.zeros(shape, np.uint8)] * 2),
                      (2, 2), sampler="weighted", weight_field="label", pos_ratio=1.0, patches_per_sample=5, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = [ds[p] for p in range(len(ds))]
    assert [str(w.message) for w in caught if "no voxel > 0" in str(w.message)] == [
        str(caught[0].message)]  # once, for all such samples
    assert "sample 0" in str(caught[0].message)
    assert all(item["label"].max() == 0 for item in items)


def test_weighted_reads_the_label_once_then_one_cell_per_patch_with_a_bounded_cache(monkeypatch):
    monkeypatch.setattr(patches_module, "MAP_BLOCK_ELEMENTS", 4096)  # several blocks per map
    shape, patch, cell = (32, 32, 32), (8, 8, 8), (16, 16, 16)
    rng = np.random.default_rng(0)
    labels = [(rng.random(shape) < 0.01).astype(np.uint8) for _ in range(3)]
    base = LazyVolumes([coordinates(i, shape) for i in range(3)], labels, chunks=cell)
    ds = PatchDataset(base, patch, fields="image", sampler="weighted", weight_field="label", pos_ratio=0.5,
                      patches_per_sample=20, seed=1, map_cache_size=2)
    volume, cell_elements = 32**3, 16**3
    for p in range(20):  # sample 0's patches
        ds[p]
    reads = base.labels[0].reads
    assert max(reads) <= 4096  # the map is built in bounded blocks...
    map_reads = len(reads) - 20
    assert sum(reads[:map_reads]) == volume  # ...that read the label exactly once
    assert all(r <= cell_elements for r in reads[map_reads:])  # then one cell (its chunk) per patch
    for p in range(20, 60):  # samples 1 and 2: sample 0's map is evicted (map_cache_size=2)
        ds[p]
    before = sum(base.labels[0].reads)
    ds[0]
    assert sum(base.labels[0].reads) - before > volume - 1  # rebuilt: the cache is bounded
    before = sum(base.labels[2].reads)
    ds[59]
    assert sum(base.labels[2].reads) - before <= cell_elements  # still cached


# --------------------------------------------------------------------------- padding and errors
def test_a_patch_larger_than_the_sample_without_pad_value_names_sample_field_axis_and_sizes():
    ds = PatchDataset(CoordinateVolumes([(9, 9, 9), (9, 3, 9)]), (4, 5, 4), patches_per_sample=2, seed=0)
    ds[0]
    with pytest.raises(ValueError, match=r"sample 1: field 'image' has 3 voxels on axis 1, fewer than the "
                                         r"patch's 5.*pad_value="):
        ds[2]
    with pytest.raises(ValueError, match=r"sample 1: field 'image' has 3 voxels on axis 1.*pad_value="):
        PatchDataset(IndexedVolumes([(9, 9, 9), (9, 3, 9)]), (4, 5, 4), sampler="grid")


@pytest.mark.parametrize("sampler", ["uniform", "grid", "weighted"])
def test_padding_centres_the_sample_and_fills_with_pad_value(sampler):
    base = IndexedVolumes([(6, 3)])
    weighted = {"weight_field": "label"} if sampler == "weighted" else {}
    ds = PatchDataset(base, (4, 7), sampler=sampler, pad_value={"image": -7, "label": 9}, seed=0, **weighted)
    item = ds[0]
    y, x = item["position"]
    assert x == (3 - 7) // 2 == -2 and 0 <= y <= 2
    image = base[0]["image"]
    np.testing.assert_array_equal(item["image"][:, 2:5], image[y:y + 4, :])
    assert (item["image"][:, :2] == -7).all() and (item["image"][:, 5:] == -7).all()
    assert (item["label"][:, :2] == 9).all() and (item["label"][:, 5:] == 9).all()
    if sampler == "grid":
        assert len(ds) == 2  # 6 rows in tiles of 4: starts 0 and 2; one tile across the padded axis
        restored = stitch(ds, 0, [ds[p] for p in range(len(ds))], "image")
        np.testing.assert_array_equal(restored, image)  # padding is dropped on the way back


def test_pad_values_the_dtype_cannot_hold_are_refused():
    ds = PatchDataset(CoordinateVolumes([(2, 2)]), (3, 3), pad_value=-1, seed=0)
    with pytest.raises(ValueError, match=r"pad_value -1 of field 'label' .*uint8"):
        ds[0]


def test_fields_cut_together_must_agree_on_the_cut_axes():
    class Mismatched(CoordinateVolumes):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            return {**sample, "label": sample["label"][:, :-1]}

    with pytest.raises(ValueError, match=r"sample 0: the fields cut together differ.*image \(8, 8\), label \(8, 7\)"):
        PatchDataset(Mismatched([(8, 8)]), (2, 2), seed=0)[0]


def test_settings_that_do_not_fit_are_refused():
    base = CoordinateVolumes([(8, 8)])
    for kwargs, message in [
        ({"patch_size": 4}, "patch_size"),
        ({"patch_size": (4, 0)}, "patch_size"),
        ({"patch_size": (4, 4), "sampler": "random"}, "sampler"),
        ({"patch_size": (4, 4), "sampler": "weighted"}, "weight_field"),
        ({"patch_size": (4, 4), "overlap": 1}, "overlap applies only"),
        ({"patch_size": (4, 4), "sampler": "grid", "overlap": 4}, "leaves no step"),
        ({"patch_size": (4, 4), "sampler": "grid", "patches_per_sample": 2}, "patches_per_sample"),
        ({"patch_size": (4, 4), "sampler": "weighted", "weight_field": "label", "pos_ratio": 2}, "pos_ratio"),
    ]:
        with pytest.raises(ValueError, match=message):
            PatchDataset(base, **kwargs)


def test_a_base_field_named_like_the_added_keys_is_refused():
    class HasPosition(CoordinateVolumes):
        def __getitem__(self, index):
            return {**super().__getitem__(index), "position": 3}

    with pytest.raises(ValueError, match="already has a field 'position'"):
        PatchDataset(HasPosition([(4, 4)]), (2, 2), seed=0)[0]


# --------------------------------------------------------------------------- determinism and resume
def flat(batches) -> list[tuple]:
    """Every patch of ``batches`` as (sample, position, image bytes), in order."""
    return [(int(s), tuple(pos.tolist()), img.numpy().tobytes()) for batch in batches
            for s, pos, img in zip(batch["sample"], batch["position"], batch["image"], strict=True)]


def volumes_dataset(sampler="uniform", seed=11, base_cls=CoordinateVolumes):
    base = base_cls([(12, 10, 9), (9, 14, 8), (10, 10, 10), (8, 9, 12), (11, 8, 10), (9, 9, 9)],
                    shard_starts=[0, 2, 4])
    weighted = {"weight_field": "label"} if sampler == "weighted" else {}
    return PatchDataset(base, (4, 4, 4), sampler=sampler, patches_per_sample=3, seed=seed, **weighted)


def test_positions_are_a_function_of_seed_epoch_and_index_only():
    ds = volumes_dataset()
    first = [tuple(ds[p]["position"]) for p in range(len(ds))]
    assert [tuple(ds[p]["position"]) for p in reversed(range(len(ds)))] == first[::-1]  # order-free
    assert [tuple(volumes_dataset()[EpochIndex(p, 0)]["position"]) for p in range(len(ds))] == first
    ds.set_epoch(1)
    epoch1 = [tuple(ds[p]["position"]) for p in range(len(ds))]
    assert sum(a != b for a, b in zip(first, epoch1, strict=True)) >= len(ds) - 2
    assert [tuple(ds[EpochIndex(p, 0)]["position"]) for p in range(len(ds))] == first  # the tag wins
    other = volumes_dataset(seed=12)
    assert sum(tuple(other[p]["position"]) != a for p, a in enumerate(first)) >= len(ds) - 2


def test_getitems_matches_getitem_and_reads_each_sample_once():
    ds = volumes_dataset("weighted")
    batch = ds.__getitems__([EpochIndex(4, 2), 3, 5, 0, 17])
    assert ds.base.reads == 3  # samples 1, 0 and 5
    ds.set_epoch(2)
    for p, item in zip([4, 3, 5, 0, 17], batch, strict=True):
        single = ds[p]
        assert item["sample"] == single["sample"] and np.array_equal(item["position"], single["position"])
        np.testing.assert_array_equal(item["image"], single["image"])


@pytest.mark.parametrize("sampler", ["uniform", "weighted"])
def test_the_same_patches_with_0_and_2_workers_through_fastdata_loader(sampler):
    def run(workers):
        dl = fastdata.loader(volumes_dataset(sampler), batch_size=4, shuffle=False, num_workers=workers)
        return [flat(dl) for _ in range(2)]  # epochs 0 and 1 (persistent workers learn each)

    in_process = run(0)
    assert in_process[0] != in_process[1]
    assert run(2) == in_process


def test_a_plain_dataloader_with_set_epoch_matches_fastdata_loader():
    ds = volumes_dataset()
    ds.set_epoch(3)
    plain = flat(DataLoader(ds, batch_size=5, num_workers=2, collate_fn=fastdata.collate))
    dl = fastdata.loader(volumes_dataset(), batch_size=4, shuffle=False, num_workers=0)
    dl.set_epoch(3)
    assert plain == flat(dl)


def sampler_run(workers, epochs=(0, 1), stop=None, state=None, shard_window=None):
    """Epochs through fastdata.loader + DistributedShardSampler; ``stop=(epoch, k)`` stops after
    k batches of that epoch and returns the sampler state a checkpoint would hold."""
    ds = volumes_dataset("weighted")
    sampler = fastdata.DistributedShardSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5,
                                               shard_window=shard_window)
    if state is not None:
        sampler.load_state_dict(state)
    dl = fastdata.loader(ds, batch_size=4, sampler=sampler, num_workers=workers)
    out = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out[epoch] = []
        for batch in dl:
            out[epoch].append(batch)
            if stop == (epoch, len(out[epoch])):
                return out, sampler.state_dict(consumed=len(out[epoch]) * 4)
    return out, None


@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_shard_sampler_resumes_the_exact_patches(workers):
    full, _ = sampler_run(workers)
    assert flat(full[0]) != flat(full[1])
    head, state = sampler_run(workers, stop=(1, 2))
    assert flat(head[1]) == flat(full[1][:2]) and state["consumed"] == 8
    tail, _ = sampler_run(workers, epochs=(state["epoch"],), state=state)
    assert flat(tail[1]) == flat(full[1][2:])


def test_shard_starts_map_the_base_shards_to_patch_ranges_for_shard_windows():
    ds = volumes_dataset()
    assert ds.shard_starts.tolist() == [0, 6, 12]  # 3 patches per sample
    grid = PatchDataset(IndexedVolumes([(4, 4), (8, 4), (4, 8), (2, 2)], shard_starts=[0, 1, 3]), (2, 2),
                        sampler="grid")
    assert grid.shard_starts.tolist() == [0, 4, 4 + 8 + 8]
    assert PatchDataset(CoordinateVolumes([(4, 4)]), (2, 2)).shard_starts is None
    full, _ = sampler_run(0, epochs=(0,), shard_window=1)
    shards = [int(np.searchsorted(ds.shard_starts, s * 3, side="right")) - 1 for s, _, _ in flat(full[0])]
    assert shards == sorted(shards, key=shards.index)  # one shard's patches, then the next's
    head, state = sampler_run(0, epochs=(0,), stop=(0, 2), shard_window=1)
    tail, _ = sampler_run(0, epochs=(0,), state=state, shard_window=1)
    assert flat(head[0]) + flat(tail[0]) == flat(full[0])


# --------------------------------------------------------------------------- pickling
def test_pickles_without_its_per_process_cache_and_reads_the_same_after():
    ds = volumes_dataset("weighted")
    before = pickle.dumps(ds)
    items = [ds[p] for p in range(len(ds))]  # builds every sample's foreground map
    after = pickle.dumps(ds)
    assert len(after) == len(before)
    copy = pickle.loads(after)
    for p, item in enumerate(items):
        again = copy[p]
        assert again["sample"] == item["sample"] and np.array_equal(again["position"], item["position"])
        np.testing.assert_array_equal(again["image"], item["image"])
    grid = PatchDataset(IndexedVolumes([(40, 40)] * 3), (4, 4), sampler="grid")
    assert len(pickle.dumps(grid)) < 4000  # numpy arrays of shapes and offsets, nothing per tile


def test_output_tensor_and_transform():
    ds = PatchDataset(CoordinateVolumes([(6, 6)]), (3, 3), output="tensor", seed=0,
                      transform=lambda item: {**item, "image": item["image"] + 1})
    item = ds[0]
    assert isinstance(item["image"], torch.Tensor) and isinstance(item["position"], torch.Tensor)
    y, x = item["position"].tolist()
    assert torch.equal(item["image"], torch.from_numpy(coordinates(0, (6, 6))[y:y + 3, x:x + 3] + 1))
