"""Index columns (``ds.column``), subset views (``ds.subset``) and ``fastdata.random_split``:
columns read from the index alone; a subset's samples are the store's samples bit for bit
(random crops included), through every read path, both backends and general stores; it pickles
light, keeps the batched fast path, gives DistributedShardSampler blocks and shard windows over
the subset, and resumes exactly; splits are disjoint, covering, reproducible and stratified."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from helpers.images import make_jpeg

import fastdata
from fastdata import transforms
from fastdata.fields import Float, Image, Int, Schema
from fastdata.reader.batching import Batch
from fastdata.reader.seeding import EpochIndex
from fastdata.reader.subset import StoreSubset, split_sizes, stratified_counts

SEED = 77
#: samples per class: uneven, so stratification has remainders to round
CLASSES = {"a": 11, "b": 8, "c": 5}
N = sum(CLASSES.values())


def size_of(i: int) -> tuple[int, int]:
    """(width, height) of sample ``i``'s JPEG: assorted, so crops and columns depend on it."""
    return 16 + (i * 7) % 17, 16 + (i * 5) % 11


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("subset") / "src"
    i = 0
    for name, count in CLASSES.items():
        for k in range(count):
            make_jpeg(root / name / f"{k:02d}.jpg", size=size_of(i), seed=i)
            i += 1
    return str(root)


@pytest.fixture(scope="module")
def stores(tree, tmp_path_factory) -> dict[str, str]:
    """The tree as an LMDB and an HDF5 store of several shards (a few kilobytes each)."""
    out = tmp_path_factory.mktemp("stores")
    paths = {"lmdb": str(out / "s.lmdb"), "hdf5": str(out / "s.h5")}
    for backend, dst in paths.items():
        fastdata.convert(tree, dst, format=backend, workers=1, progress=False, shard_size=4000)
    return paths


@pytest.fixture(scope="module")
def general_store(tmp_path_factory) -> str:
    """A general store (fastdata.write): one image field, an int and a float in the index."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(18):
        w, h = size_of(i)
        samples.append({"image": rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "label": i % 3,
                        "score": float(np.float32(i / 4))})
    dst = str(tmp_path_factory.mktemp("general") / "g.lmdb")
    schema = Schema.of({"image": Image(), "label": Int("int16"), "score": Float("float32")})
    fastdata.write(samples, dst, schema=schema, workers=1, progress=False, shard_size=3000)
    return dst


def open_ds(path: str, **kw):
    kw.setdefault("output", "tensor")
    kw.setdefault("decode", transforms.RandomResizedCrop(16))
    return fastdata.open_dataset(path, seed=SEED, **kw)


def pixels(sample) -> bytes:
    image = sample[0] if isinstance(sample, tuple) else sample["image"]
    return image.contiguous().numpy().tobytes()


# -- columns -------------------------------------------------------------------------------------
def test_classification_columns_come_from_the_index(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    assert ds.columns() == ("label", "width", "height", "channels", "dtype", "format", "nbytes")
    assert np.array_equal(ds.column("label"), ds.targets)
    assert ds.column("label").tolist() == [c for c, count in enumerate(CLASSES.values()) for _ in range(count)]
    assert ds.column("width").tolist() == [size_of(i)[0] for i in range(N)]
    assert ds.column("height").tolist() == [size_of(i)[1] for i in range(N)]
    assert ds.column("channels").tolist() == [3] * N
    assert ds.column("dtype").tolist() == ["uint8"] * N
    assert ds.column("format").tolist() == ["JPEG"] * N
    assert (ds.column("nbytes") > 100).all()
    with pytest.raises(ValueError, match="read-only"):
        ds.column("width")[0] = 1  # the index itself is never writable through a column


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_columns_read_no_record(stores, backend, tmp_path):
    """Columns come from the index read when the dataset was opened: with every shard file gone
    afterwards, each column still reads, and a sample read (the control) fails."""
    store = str(tmp_path / f"copy.{backend}")
    shutil.copytree(stores[backend], store)
    ds = fastdata.open_dataset(store)
    shards = [name for name in os.listdir(store) if name.startswith("shard-")]
    assert shards
    for name in shards:
        os.remove(os.path.join(store, name))
    for name in ds.columns():
        assert len(ds.column(name)) == N
    sub = ds.subset([3, 1])
    assert sub.column("width").tolist() == [size_of(3)[0], size_of(1)[0]]
    with pytest.raises(Exception):  # noqa: B017 - control: a sample read needs its (missing) shard
        ds[0]


def test_unknown_column_lists_the_available_ones(stores, general_store):
    with pytest.raises(KeyError, match="no column 'area'.*label, width, height"):
        fastdata.open_dataset(stores["lmdb"]).column("area")
    with pytest.raises(KeyError, match=r"image\.width"):
        fastdata.open_dataset(general_store).column("image.area")


def test_general_store_columns(general_store):
    ds = fastdata.open_dataset(general_store)
    names = ds.columns()
    assert {"label", "score", "image.width", "image.height", "image.channels", "image.dtype",
            "image.format", "width", "height"} <= set(names)
    assert ds.column("label").dtype == np.int16 and ds.column("label").tolist() == [i % 3 for i in range(18)]
    assert ds.column("score").tolist() == [float(np.float32(i / 4)) for i in range(18)]
    assert ds.column("image.width").tolist() == [size_of(i)[0] for i in range(18)]
    # one image field: its metadata also without the prefix
    assert np.array_equal(ds.column("height"), ds.column("image.height"))
    assert ds.column("dtype").tolist() == ["uint8"] * 18
    assert ds.column("image.channels").tolist() == [3] * 18
    assert set(ds.column("format").tolist()) == {"PNG"}


def test_general_store_with_two_image_fields_has_only_prefixed_sizes(tmp_path):
    from helpers.samples import SCHEMA, sample

    dst = str(tmp_path / "two.lmdb")
    fastdata.write([sample(i) for i in range(5)], dst, schema=SCHEMA, workers=1, progress=False)
    ds = fastdata.open_dataset(dst)
    assert ds.column("mask.width").tolist() == [5] * 5 and ds.column("mask.height").tolist() == [7] * 5
    assert ds.column("image.width").tolist() == [12] * 5
    assert ds.column("embedding").shape == (5, 2, 3)  # a fixed-shape field: one row per sample
    assert ds.column("label").tolist() == [i * 3 - 7 for i in range(5)]
    with pytest.raises(KeyError, match="no column 'width'"):  # ambiguous between image and mask
        ds.column("width")


# -- subset views --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_subset_sample_is_the_base_sample_bit_for_bit(stores, backend):
    ds = open_ds(stores[backend])
    picks = [17, 2, 2, -1, 9]  # a repeat and a negative index, as torch's Subset allows
    sub = ds.subset(picks)
    assert len(sub) == 5 and sub.indices.tolist() == [17, 2, 2, N - 1, 9]
    for epoch in (0, 3):
        sub.set_epoch(epoch)
        assert ds.epoch == epoch
        direct = [pixels(ds[i]) for i in sub.indices.tolist()]
        assert [pixels(sub[k]) for k in range(5)] == direct
        assert [pixels(s) for s in sub.__getitems__(list(range(5)))] == direct
        assert [sub[k][1] for k in range(5)] == ds.targets[sub.indices].tolist() == sub.targets.tolist()
    # the epoch a loader tags on the first index reaches the base index
    tagged = sub.__getitems__([EpochIndex(0, 1), 1])
    ds.set_epoch(1)
    assert [pixels(s) for s in tagged] == [pixels(ds[17]), pixels(ds[2])]
    ds.set_epoch(0)
    assert pixels(sub[EpochIndex(4, 1)]) == pixels(ds[EpochIndex(9, 1)]) != pixels(ds[9])


def test_subset_sample_of_a_general_store_is_the_base_sample(general_store):
    ds = open_ds(general_store)
    sub = ds.subset(np.array([11, 4, 0]))
    sub.set_epoch(2)
    got = sub.__getitems__([0, 1, 2])
    assert [pixels(s) for s in got] == [pixels(ds[i]) for i in (11, 4, 0)]
    assert [int(s["label"]) for s in got] == [11 % 3, 4 % 3, 0]
    assert sub.column("score").tolist() == [11 / 4, 1.0, 0.0]


def test_subset_keeps_the_batched_fast_path(stores):
    ds = open_ds(stores["lmdb"])  # a fixed-size decode into a tensor: a Batch, one array
    assert isinstance(ds.__getitems__([0, 1]), Batch)
    batch = ds.subset([5, 3, 20]).__getitems__([0, 1, 2])
    assert isinstance(batch, Batch)
    assert batch.labels.tolist() == ds.targets[[5, 3, 20]].tolist()


def test_subset_indices_validation(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    mask = np.zeros(N, dtype=bool)
    mask[[1, 4, 6]] = True
    assert ds.subset(mask).indices.tolist() == [1, 4, 6]
    assert ds.subset(range(3)).indices.dtype == np.int64
    assert len(ds.subset([])) == 0
    with pytest.raises(IndexError, match=f"index {N} out of range"):
        ds.subset([0, N])
    with pytest.raises(IndexError, match="out of range"):
        ds.subset([-N - 1])
    with pytest.raises(ValueError, match="bool mask must have one value per sample"):
        ds.subset(mask[:-1])
    with pytest.raises(ValueError, match="integers"):
        ds.subset([0.5, 1.0])
    with pytest.raises(ValueError, match="one-dimensional"):
        ds.subset([[0, 1]])
    sub = ds.subset([3, 4])
    with pytest.raises(IndexError, match="out of range for a subset of 2"):
        sub[2]
    with pytest.raises(IndexError, match="out of range for a subset of 2"):
        sub.__getitems__([0, 5])
    with pytest.raises(TypeError, match="ints"):
        sub[0.0]
    with pytest.raises(ValueError, match="read-only"):
        sub.indices[0] = 1


def test_subset_of_a_subset_maps_to_the_base(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    sub = ds.subset([10, 11, 12, 13, 14])
    inner = sub.subset([4, 0, -2])
    assert inner.dataset is ds and not isinstance(inner.dataset, StoreSubset)
    assert inner.indices.tolist() == [14, 10, 13]
    assert inner.relpath(0) == ds.relpath(14)
    assert inner.column("label").tolist() == ds.targets[[14, 10, 13]].tolist()


def test_subset_shares_the_base_settings(stores):
    ds = open_ds(stores["lmdb"])
    sub = ds.subset([0, 1])
    sub.seed = 5
    assert ds.seed == 5 == sub.seed
    assert sub.classes == ["a", "b", "c"] and sub.class_to_idx == ds.class_to_idx
    assert (sub.root, sub.on_error, sub.backend, sub.output) == (ds.root, "raise", "lmdb", "tensor")
    assert sub.skipped == 0 and sub.image_modes == ds.image_modes
    assert "StoreSubset of 2 of 24 samples (sorted)" in repr(sub) and "LMDBImageDataset" in repr(sub)
    with sub:
        sub[0]
    fastdata.loader(sub, seed=9, num_workers=0)
    assert ds.seed == 9


def test_subset_pickles_light(stores):
    ds = open_ds(stores["lmdb"])
    picks = np.arange(0, N, 2)
    sub = ds.subset(picks)
    assert len(sub.targets) == len(sub.column("label")) == len(picks)  # a per-sample cache: not pickled
    size = len(pickle.dumps(sub))
    # the base dataset's pickle, the index array's 8 bytes per index, and little more
    assert size <= len(pickle.dumps(ds)) + 8 * len(picks) + 400
    state = sub.__getstate__()
    assert state["_targets"] is None
    # no per-sample Python objects: every value is the base dataset, an ndarray or a scalar
    assert all(isinstance(v, (fastdata.LMDBImageDataset, np.ndarray, bool, type(None))) for v in state.values())
    back = pickle.loads(pickle.dumps(sub))
    assert back.indices.tolist() == picks.tolist() and back.indices.dtype == np.int64
    back.set_epoch(1)
    ds.set_epoch(1)
    assert pixels(back[3]) == pixels(ds[6])


def test_loader_over_a_subset_equals_direct_reads(stores):
    ds = open_ds(stores["hdf5"])
    sub = ds.subset([20, 3, 7, 8, 15, 1, 0])
    dl = fastdata.loader(sub, batch_size=3, shuffle=False, num_workers=0)
    dl.set_epoch(4)
    got = [(img.contiguous().numpy().tobytes(), int(lab)) for images, labels in dl
           for img, lab in zip(images, labels, strict=True)]
    ds.set_epoch(4)
    assert got == [(pixels(ds[i]), int(ds.targets[i])) for i in sub.indices.tolist()]


# -- the sampler over a subset -------------------------------------------------------------------
def test_sorted_subset_has_shard_starts_of_the_base_shards(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    starts = ds.shard_starts
    assert len(starts) >= 4  # several shards, so windows matter
    picks = np.array([i for i in range(N) if i < starts[1] or i >= starts[3]])  # shards 1 and 2 unused
    sub = ds.subset(picks)
    assert len(sub.shard_starts) == len(starts)
    assert sub.shard_starts.tolist() == np.searchsorted(picks, starts).tolist()
    sizes = np.diff(np.append(sub.shard_starts, len(sub)))
    assert sizes[1] == sizes[2] == 0 and sizes.sum() == len(sub)
    sampler = fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0, shard_window=2, seed=1)
    listed = {s for window in sampler.window_shards() for s in window}
    assert listed == {int(s) for s in np.unique(np.searchsorted(starts, picks, side="right") - 1)}
    assert 1 not in listed and 2 not in listed
    # each window's positions are the subset's samples of exactly those base shards
    order = list(sampler)
    shard_of_position = np.searchsorted(starts, picks, side="right") - 1
    first = sampler.window_shards()[0]
    assert set(shard_of_position[order[:int(sizes[first].sum())]].tolist()) == set(first)


def test_unsorted_subset_refuses_shard_windows_saying_to_sort(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    sub = ds.subset([5, 1, 3])
    assert sub.shard_starts is None
    with pytest.raises(ValueError, match="sorted indices"):
        fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0, shard_window=2)
    fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0)  # the other modes need no shards


def test_block_mode_over_a_sorted_subset_gives_runs_of_subset_positions(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    sub = ds.subset(np.arange(1, N, 3))  # 8 samples, every third of the store
    sampler = fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0, block_size=4, window=1, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(len(sub)))
    steps = np.diff(order)
    # blocks of 4 consecutive subset positions (cut cyclically): at most a wrap inside a block
    # and a jump between blocks
    assert (steps == 1).sum() >= len(sub) - 4
    assert all(b - a in (1, 1 - len(sub)) for blk in (order[:4], order[4:]) for a, b in zip(blk, blk[1:], strict=False))


def test_prefetch_gets_base_shard_numbers(stores, monkeypatch):
    ds = fastdata.open_dataset(stores["lmdb"])
    starts = ds.shard_starts
    picks = np.arange(int(starts[2]), N)
    calls = []
    monkeypatch.setattr(ds, "prefetch_shards", lambda shards, keep=(): calls.append(list(shards)))
    sub = ds.subset(picks)
    sampler = fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0, shard_window=1, seed=0)
    list(sampler)
    assert calls and {s for call in calls for s in call} == set(range(2, len(starts)))


# -- exact resume ----------------------------------------------------------------------------------
def flat(batches) -> list[tuple[bytes, int]]:
    return [(img.contiguous().numpy().tobytes(), int(lab)) for images, labels in batches
            for img, lab in zip(images, labels, strict=True)]


def sampler_run(path: str, picks, workers: int, stop=None, state=None, **sampler_kw):
    """Epochs 0 and 1 of a subset through fastdata.loader + DistributedShardSampler; ``stop=(epoch,
    k)`` stops after k batches of that epoch and returns the state a checkpoint would hold."""
    sub = open_ds(path).subset(picks)
    sampler = fastdata.DistributedShardSampler(sub, num_replicas=1, rank=0, seed=5, **sampler_kw)
    epochs = (0, 1)
    if state is not None:
        sampler.load_state_dict(state)
        epochs = (state["epoch"],)
    dl = fastdata.loader(sub, batch_size=3, sampler=sampler, num_workers=workers)
    out = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out[epoch] = []
        for batch in dl:
            out[epoch].append(batch)
            if stop == (epoch, len(out[epoch])):
                return out, sampler.state_dict(consumed=len(out[epoch]) * 3)
    return out, None


@pytest.mark.parametrize(("workers", "mode"), [(0, {"block_size": 2}), (2, {"shard_window": 2})])
def test_subset_resumes_the_exact_batches(stores, workers, mode):
    path = stores["lmdb"]
    picks = np.sort(np.random.default_rng(1).choice(N, 16, replace=False))
    full, _ = sampler_run(path, picks, workers, **mode)
    assert flat(full[0]) != flat(full[1])  # control: the second epoch has other crops and order
    head, state = sampler_run(path, picks, workers, stop=(1, 2), **mode)
    assert flat(head[1]) == flat(full[1][:2])
    assert state["epoch"] == 1 and state["consumed"] == 6
    tail, _ = sampler_run(path, picks, workers, state=state, **mode)
    assert flat(tail[1]) == flat(full[1][2:])
    # and every sample is the store's own for its base index in that epoch
    ds = open_ds(path)
    ds.set_epoch(1)
    assert sorted(flat(full[1])) == sorted((pixels(ds[i]), int(ds.targets[i])) for i in picks.tolist())


# -- random_split ----------------------------------------------------------------------------------
def test_random_split_is_disjoint_covering_sorted_and_reproducible(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    state = torch.random.get_rng_state()
    parts = fastdata.random_split(ds, [0.5, 0.3, 0.2], seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # torch's global RNG is left alone
    assert [len(p) for p in parts] == [12, 7, 5]
    joined = np.concatenate([p.indices for p in parts])
    assert sorted(joined.tolist()) == list(range(N))
    assert all((np.diff(p.indices) > 0).all() for p in parts)
    torch.manual_seed(123)  # nor does it depend on it
    again = fastdata.random_split(ds, [0.5, 0.3, 0.2], seed=4)
    assert [p.indices.tolist() for p in again] == [p.indices.tolist() for p in parts]
    other = fastdata.random_split(ds, [0.5, 0.3, 0.2], seed=5)
    assert [p.indices.tolist() for p in other] != [p.indices.tolist() for p in parts]
    counts = fastdata.random_split(ds, [20, 4], seed=4)
    assert [len(p) for p in counts] == [20, 4]
    assert all(p.shard_starts is not None for p in parts)  # sorted: shard windows work


@pytest.mark.parametrize("stratify", ["label", "array"])
def test_stratified_split_keeps_class_proportions(stores, stratify):
    ds = fastdata.open_dataset(stores["hdf5"])
    by = "label" if stratify == "label" else np.array(["x", "y", "z"])[ds.targets]
    parts = fastdata.random_split(ds, [0.6, 0.25, 0.15], seed=2, stratify=by)
    sizes = [len(p) for p in parts]
    assert sizes == [len(p) for p in fastdata.random_split(ds, [0.6, 0.25, 0.15], seed=2)]
    assert sorted(np.concatenate([p.indices for p in parts]).tolist()) == list(range(N))
    for c, count in enumerate(CLASSES.values()):
        for part, size in zip(parts, sizes, strict=True):
            assert abs(int((part.targets == c).sum()) - count * size / N) < 1
    again = fastdata.random_split(ds, [0.6, 0.25, 0.15], seed=2, stratify=by)
    assert [p.indices.tolist() for p in again] == [p.indices.tolist() for p in parts]


def test_split_of_a_subset_and_of_a_general_store(stores, general_store):
    sub = fastdata.open_dataset(stores["lmdb"]).subset(np.arange(4, 20))
    parts = fastdata.random_split(sub, [0.5, 0.5], seed=0, stratify="label")
    assert sorted(np.concatenate([p.indices for p in parts]).tolist()) == list(range(4, 20))
    g = fastdata.open_dataset(general_store)
    gparts = fastdata.random_split(g, [12, 6], seed=0, stratify="label")
    assert [np.bincount(g.column("label")[p.indices]).tolist() for p in gparts] == [[4, 4, 4], [2, 2, 2]]


def test_random_split_refuses_bad_arguments(stores):
    ds = fastdata.open_dataset(stores["lmdb"])
    for lengths, match in [([0.5, 0.6], "sum to 1"), ([1.2, -0.2], r"in \[0, 1\]"), ([], "non-empty"),
                           ([10, 10], "sum to the dataset's 24"), ([30, -6], ">= 0"), ("ab", "non-empty"),
                           ([0.5, "x"], "numbers")]:
        with pytest.raises(ValueError, match=match):
            fastdata.random_split(ds, lengths)
    with pytest.raises(ValueError, match="one value per sample"):
        fastdata.random_split(ds, [0.5, 0.5], stratify=np.zeros(N - 1))
    with pytest.raises(ValueError, match="seed"):
        fastdata.random_split(ds, [0.5, 0.5], seed=-1)
    with pytest.raises(KeyError, match="no column"):
        fastdata.random_split(ds, [0.5, 0.5], stratify="colour")
    with pytest.raises(TypeError, match="torch.utils.data.random_split"):
        fastdata.random_split(list(range(4)), [0.5, 0.5])


def test_split_sizes_round_by_largest_remainder():
    assert split_sizes([0.9, 0.1], 10).tolist() == [9, 1]
    assert split_sizes([1 / 3] * 3, 10).tolist() == [4, 3, 3]
    assert split_sizes([0.7, 0.3, 0.0], 11).tolist() == [8, 3, 0]  # a fraction of 0 stays empty
    assert split_sizes([0.5, 0.5 + 1e-7], 7).sum() == 7
    assert split_sizes([3, 4], 7).tolist() == [3, 4]


def test_stratified_counts_keep_both_margins_and_stay_within_one():
    rng = np.random.default_rng(0)
    for _ in range(300):
        counts = rng.integers(0, 30, rng.integers(1, 40))
        n = int(counts.sum())
        k = int(rng.integers(1, 6))
        sizes = split_sizes(list(rng.dirichlet(np.ones(k))), n)
        alloc = stratified_counts(counts, sizes)
        assert alloc.sum(axis=1).tolist() == counts.tolist()
        assert alloc.sum(axis=0).tolist() == sizes.tolist()
        if n:
            assert (np.abs(alloc - counts[:, None] * sizes[None, :] / n) < 1).all()
