"""LMDBImageDataset / HDF5ImageDataset in one process: ImageFolder drop-in, batched
fetch, pickling, handles, corrupt records, DistributedSampler and ``fastdata.loader``.

Everything with DataLoader worker processes is in ``test_dataset_mp.py``.
"""

from __future__ import annotations

import gc
import os
import pickle
import pickletools
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import xxhash
from helpers.backends import NAME_SUFFIXES
from helpers.images import make_tree
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

import fastdata
from fastdata.errors import CorruptRecordError, FormatError
from fastdata.format.manifest import read_manifest
from fastdata.reader.batching import Batch

BACKENDS = dict(NAME_SUFFIXES)
OUTPUTS = ("pil", "numpy", "tensor")
#: torchvision.datasets.folder.IMG_EXTENSIONS, spelled out so the reference does not use ours
TV_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def convert(src, dst, **kw) -> str:
    fastdata.convert(str(src), str(dst), workers=1, progress=False, **kw)
    return str(dst)


def pil_loader(path) -> Image.Image:
    """torchvision.datasets.folder.pil_loader."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


class ReferenceImageFolder:
    """torchvision.datasets.ImageFolder(root, allow_empty=True), reimplemented from
    torchvision/datasets/folder.py (find_classes + make_dataset + pil_loader)."""

    def __init__(self, root: str):
        self.root = root
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = []
        for target_class in sorted(self.class_to_idx):
            target_dir = os.path.join(root, target_class)
            for dirpath, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
                for fname in sorted(fnames):
                    if fname.lower().endswith(TV_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, fname), self.class_to_idx[target_class]))
        self.targets = [s[1] for s in self.samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        return pil_loader(path), target


def as_hwc(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image)
    if isinstance(image, torch.Tensor):
        return image.permute(1, 2, 0).numpy()
    return np.asarray(image)


def assert_same_sample(a, b):
    (ia, la), (ib, lb) = a, b
    assert la == lb
    assert type(ia) is type(ib)
    np.testing.assert_array_equal(as_hwc(ia), as_hwc(ib))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    """24 distinct JPEGs, 3 classes, same size."""
    return make_tree(tmp_path_factory.mktemp("src") / "tree", {"ant": 9, "bee": 7, "cow": 8}, size=(24, 20), seed=5)


@pytest.fixture(scope="module")
def sharded(src, tmp_path_factory) -> dict:
    """Both backends, each with several shards (tiny shard_size)."""
    base = tmp_path_factory.mktemp("sharded")
    stores = {b: convert(src, base / f"s{sfx}", shard_size=3000) for b, sfx in BACKENDS.items()}
    for path in stores.values():
        assert len(read_manifest(path)["shards"]) >= 4
    return stores


@pytest.fixture(scope="module")
def raw_stores(src, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("raw")
    return {b: convert(src, base / f"r{sfx}", raw="16x16", shard_size=3000) for b, sfx in BACKENDS.items()}


# --------------------------------------------------------------------------- ImageFolder drop-in
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_imagefolder_drop_in(small_tree, tmp_path, backend):
    ref = ReferenceImageFolder(small_tree)
    ds = {"lmdb": fastdata.LMDBImageDataset, "hdf5": fastdata.HDF5ImageDataset}[backend](
        convert(small_tree, tmp_path / f"s{BACKENDS[backend]}"))
    assert isinstance(ds, torch.utils.data.Dataset)
    assert ds.classes == ref.classes
    assert ds.class_to_idx == ref.class_to_idx
    assert isinstance(ds.targets, np.ndarray) and ds.targets.dtype == np.int64
    assert ds.targets.tolist() == ref.targets  # tolist(): ImageFolder's list of ints
    with pytest.raises(ValueError, match="read-only"):
        ds.targets[0] = 1  # ds[i] takes its label from there: a write would change it (ImageFolder's would not)
    assert len(ds) == len(ref) == 24
    ref_by_rel = {os.path.relpath(p, small_tree): j for j, (p, _) in enumerate(ref.samples)}
    # the store keeps ImageFolder's order, so even the index is the same
    assert [ds.relpath(i) for i in range(len(ds))] == [os.path.relpath(p, small_tree) for p, _ in ref.samples]
    for i in range(len(ds)):
        image, label = ds[i]
        ref_image, ref_label = ref[ref_by_rel[ds.relpath(i)]]
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == ref_image.size
        assert label == ref_label and type(label) is int
        np.testing.assert_array_equal(np.asarray(image), np.asarray(ref_image))
    assert ds[-1][1] == ref[-1][1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    ds.close()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_samples_imgs_and_repr_like_imagefolder(small_tree, tmp_path, backend):
    ref = ReferenceImageFolder(small_tree)
    ds = fastdata.open_dataset(convert(small_tree, tmp_path / f"s{BACKENDS[backend]}"))
    assert ds.samples == ref.samples  # absolute source paths, ImageFolder's order and targets
    assert ds.imgs == ref.samples
    assert all(type(t) is int for _, t in ds.samples)
    assert isinstance(ds.targets, np.ndarray)  # stays an array: no per-sample Python objects
    # the list is built on demand and never pickled (DataLoader workers do not carry it)
    data = pickle.dumps(ds)
    assert os.fsencode(ref.samples[5][0]) not in data and len(data) < 16 * 1024
    assert pickle.loads(data).samples == ref.samples
    assert repr(ds) == (f"Dataset {type(ds).__name__}\n"
                        "    Number of datapoints: 24\n"
                        f"    Root location: {ds.root}\n"
                        f"    Backend: {backend}\n"
                        "    Output: pil")
    shown = fastdata.open_dataset(ds.root, output="numpy", decode=fastdata.transforms.CenterCrop(8),
                                  transform=ShowsTwoLines(), target_transform=str)
    assert repr(shown).splitlines()[3:] == [
        "    Backend: " + backend, "    Output: numpy", "    Decode: CenterCrop(size=(8, 8), resize=None)",
        "    StandardTransform", "Transform: Compose(", "               first", "           )",
        f"Target transform: {str!r}"]


class ShowsTwoLines:
    """A transform whose repr spans lines, like torchvision's ``Compose``."""

    def __call__(self, x):
        return x

    def __repr__(self) -> str:
        return "Compose(\n    first\n)"


def test_samples_of_a_list_source_are_relative_to_the_list_folder(tmp_path):
    tree = make_tree(tmp_path / "imgs", {"a": 2, "b": 2}, size=(24, 20))
    lines = ["path,label"] + [f"imgs/{c}/{c}_{i:03d}.jpg,{c}" for c in "ab" for i in range(2)]
    (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    ds = fastdata.open_dataset(convert(tmp_path / "list.csv", tmp_path / "s.lmdb"))
    assert [p for p, _ in ds.samples] == [os.path.join(tree, c, f"{c}_{i:03d}.jpg") for c in "ab" for i in range(2)]
    assert all(os.path.isfile(p) for p, _ in ds.samples)


def test_open_dataset_picks_the_class_and_checks_the_backend(sharded):
    assert type(fastdata.open_dataset(sharded["lmdb"])) is fastdata.LMDBImageDataset
    assert type(fastdata.open_dataset(sharded["hdf5"])) is fastdata.HDF5ImageDataset
    with pytest.raises(FormatError):
        fastdata.LMDBImageDataset(sharded["hdf5"])
    with pytest.raises(FormatError):
        fastdata.HDF5ImageDataset(sharded["lmdb"])
    with pytest.raises(ValueError):
        fastdata.open_dataset(sharded["lmdb"], output="float")


def test_transforms_are_applied(sharded):
    ds = fastdata.open_dataset(sharded["lmdb"], output="numpy",
                               transform=lambda a: a.shape, target_transform=lambda t: t + 100)
    plain = fastdata.open_dataset(sharded["lmdb"], output="numpy")
    for i in (0, 13, len(ds) - 1):
        assert ds[i] == (plain[i][0].shape, plain[i][1] + 100)
        assert ds.__getitems__([i]) == [ds[i]]


# --------------------------------------------------------------------------- __getitems__
BATCH = [17, 3, 3, 0, 23, 9, 17, 11, 4, 20]  # unordered, duplicates, every shard region


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_getitems_equals_per_item(sharded, backend, output):
    ds = fastdata.open_dataset(sharded[backend], output=output)
    shards = {ds.locate(i)[0] for i in BATCH}
    assert len(shards) >= 4
    batch = ds.__getitems__(BATCH)
    assert len(batch) == len(BATCH)
    fresh = fastdata.open_dataset(sharded[backend], output=output)  # per-item on cold handles too
    for i, got in zip(BATCH, batch, strict=False):
        assert_same_sample(got, fresh[i])
    assert ds.__getitems__([]) == []
    with pytest.raises(IndexError):
        ds.__getitems__([0, len(ds)])


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_getitems_raw_store(raw_stores, backend, output):
    ds = fastdata.open_dataset(raw_stores[backend], output=output)
    assert len({ds.locate(i)[0] for i in BATCH}) >= 2
    singles = [ds[i] for i in BATCH]
    for img, _ in singles:
        assert as_hwc(img).shape == (16, 16, 3)
    batch = ds.__getitems__(BATCH)
    assert len(batch) == len(BATCH)
    for got, want in zip(batch, singles, strict=False):
        assert_same_sample(got, want)
    if output == "pil":
        assert not isinstance(batch, Batch)
        return
    # fixed shape: one preallocated array, passed through by fastdata.collate
    assert isinstance(batch, Batch)
    images, labels = fastdata.collate(batch)
    assert images is batch.images and labels is batch.labels
    assert labels.tolist() == [t for _, t in singles]
    stacked = np.stack([as_hwc(img) for img, _ in singles])
    if output == "tensor":
        assert isinstance(images, torch.Tensor) and images.dtype == torch.uint8
        assert tuple(images.shape) == (len(BATCH), 3, 16, 16)
        np.testing.assert_array_equal(images.permute(0, 2, 3, 1).numpy(), stacked)
    else:
        assert isinstance(images, np.ndarray) and images.shape == (len(BATCH), 16, 16, 3)
        np.testing.assert_array_equal(images, stacked)
    # a user's own collate_fn gets a plain list of pairs and still works
    dc_images, dc_labels = torch.utils.data.default_collate(batch)
    np.testing.assert_array_equal(np.asarray(dc_images), np.asarray(images))
    assert dc_labels.tolist() == labels.tolist()


# --------------------------------------------------------------------------- pickling / handles
def _globals_in_pickle(data: bytes) -> set:
    """Module names referenced by a pickle (GLOBAL / STACK_GLOBAL opcodes)."""
    names, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str):
            strings.append(arg)
        if op.name == "GLOBAL":
            names.add(arg.split(" ")[0])
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.add(strings[-2])
    return names


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_pickle_is_small_and_holds_no_handles(tmp_path, backend):
    sfx = BACKENDS[backend]
    classes = {f"c{k}": 10 for k in range(10)}
    small = fastdata.open_dataset(convert(make_tree(tmp_path / "a", classes, size=(32, 24)), tmp_path / f"a{sfx}"))
    big = fastdata.open_dataset(convert(make_tree(tmp_path / "b", classes, size=(192, 144)), tmp_path / f"b{sfx}"))
    assert len(small) == len(big) == 100
    image_bytes = [sum(s["image_bytes"] for s in read_manifest(d.root)["shards"]) for d in (small, big)]
    assert image_bytes[1] > image_bytes[0] + 300_000

    before = pickle.dumps(small)
    small[0], small[99]  # open this process's handles
    after = pickle.dumps(small)
    assert after == before  # handles and their pid are dropped, nothing else changes
    assert len(after) < 64 * 1024
    # metadata only: the pickle does not grow with the image bytes
    assert abs(len(pickle.dumps(big)) - len(after)) < 1024
    modules = _globals_in_pickle(after)
    assert not any(m.split(".")[0] in ("lmdb", "h5py") for m in modules), modules

    clone = pickle.loads(after)
    for i in (0, 57, 99):
        assert_same_sample(clone[i], small[i])


def test_no_handle_survives_init_and_close_releases(sharded):
    gc.collect()  # datasets of earlier tests share the per-process LMDB environment cache
    base = fd_count()
    lmdb_ds = fastdata.open_dataset(sharded["lmdb"])
    h5_ds = fastdata.open_dataset(sharded["hdf5"])
    assert fd_count() == base  # __init__ read the index and closed what it opened
    counts = []
    for _ in range(2):
        for ds in (lmdb_ds, h5_ds):
            for i in range(len(ds)):
                ds[i]
            ds.__getitems__(list(range(len(ds))))
        counts.append(fd_count())
    # handles opened on first use, then reused: a second pass opens nothing
    assert counts[0] >= base + len(lmdb_ds.shard_starts) + len(h5_ds.shard_starts)
    assert counts[1] == counts[0]
    def mapped(store):
        with open("/proc/self/maps") as f:
            return sum(store in line for line in f)

    assert mapped(sharded["lmdb"]) > 0
    lmdb_ds.close()
    h5_ds.close()
    assert fd_count() == base
    assert mapped(sharded["lmdb"]) == mapped(sharded["hdf5"]) == 0  # every mapping released
    # reopen lazily after close; context manager and __del__ release too
    with fastdata.open_dataset(sharded["lmdb"]) as ds:
        ds[0]
        assert fd_count() > base
    assert fd_count() == base
    ds = fastdata.open_dataset(sharded["hdf5"])
    ds[0]
    assert fd_count() > base
    del ds
    gc.collect()
    assert fd_count() == base


def test_fd_check_detects_a_handle_opened_in_init(sharded):
    """Control for the test above: the naive recipe (environment opened in
    __init__) is visible to the fd count."""
    import lmdb

    base = fd_count()
    shard = os.path.join(sharded["lmdb"], read_manifest(sharded["lmdb"])["shards"][0]["name"])
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=2)
    assert fd_count() > base
    env.close()


# --------------------------------------------------------------------------- corrupt records
def _flip_payload_byte(store: str, payload: bytes) -> str:
    """Flip one byte in the middle of ``payload`` wherever it is stored; returns the
    shard name. LMDB may also hold a stale copy in a page freed by copy-on-write
    during the conversion, so every copy is flipped (all in one shard)."""
    hits = []
    for shard in read_manifest(store)["shards"]:
        path = os.path.join(store, shard["name"])
        with open(path, "rb") as f:
            data = f.read()
        pos = data.find(payload)
        while pos >= 0:
            hits.append((shard["name"], path, pos))
            pos = data.find(payload, pos + 1)
    assert hits and len({name for name, _, _ in hits}) == 1, hits
    for _, path, pos in hits:
        with open(path, "r+b") as f:
            f.seek(pos + len(payload) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
    return hits[0][0]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_flipped_byte_raises_named_error_or_is_skipped(tmp_path, backend):
    src = make_tree(tmp_path / "src", {"a": 6, "b": 6}, size=(32, 24), seed=9)
    store = convert(src, tmp_path / f"s{BACKENDS[backend]}", shard_size=4000)
    ds = fastdata.open_dataset(store, output="numpy")
    victim = 7
    expected = {}
    for i in range(len(ds)):
        with open(os.path.join(src, ds.relpath(i)), "rb") as f:
            expected[i] = (xxhash.xxh3_64_hexdigest(np.asarray(Image.open(f).convert("RGB")).tobytes()),
                           int(ds.targets[i]))
    with open(os.path.join(src, ds.relpath(victim)), "rb") as f:
        shard_name = _flip_payload_byte(store, f.read())
    assert ds.locate(victim)[0] > 0  # not trivially the first shard

    ds = fastdata.open_dataset(store, output="numpy")
    with pytest.raises(CorruptRecordError) as info:
        ds[victim]
    err = info.value
    assert err.store == store and err.shard == shard_name and err.index == victim
    assert store in str(err) and shard_name in str(err) and str(victim) in str(err)
    with pytest.raises(CorruptRecordError) as info:
        ds.__getitems__([0, victim, 11])
    assert info.value.index == victim and info.value.shard == shard_name
    # every other sample is intact and correct
    for i in range(len(ds)):
        if i != victim:
            img, label = ds[i]
            assert (xxhash.xxh3_64_hexdigest(img.tobytes()), label) == expected[i]

    skipping = fastdata.open_dataset(store, output="numpy", on_error="skip")
    with pytest.warns(RuntimeWarning):
        img, label = skipping[victim]
    got = (xxhash.xxh3_64_hexdigest(img.tobytes()), label)
    assert got != expected[victim] and got in set(expected.values())  # another real sample, not garbage
    assert skipping.skipped == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batch = skipping.__getitems__([victim, 0, victim])
    assert skipping.skipped == 3
    for img, label in batch:
        assert (xxhash.xxh3_64_hexdigest(img.tobytes()), label) in set(expected.values()) - {expected[victim]}


# --------------------------------------------------------------------------- user code vs damage
class UserDecodeBug(Exception):
    pass


class FlakyDecode:
    """A user's decode callable that fails on every other call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, data):
        self.calls += 1
        if self.calls % 2 == 0:
            raise UserDecodeBug(f"call {self.calls}")
        return fastdata.transforms.full_decode(data)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("output", ["numpy", "pil"])
def test_user_decode_errors_propagate_unchanged(sharded, on_error, output):
    ds = fastdata.open_dataset(sharded["lmdb"], output=output, decode=FlakyDecode(), on_error=on_error)
    ds[0]  # call 1 works
    with pytest.raises(UserDecodeBug) as info:
        ds[1]
    assert info.traceback[-1].frame.code.raw is FlakyDecode.__call__.__code__  # its own traceback
    with pytest.raises(UserDecodeBug):
        ds.__getitems__([2, 3, 4])
    assert ds.skipped == 0  # nothing was blamed on the store


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_user_transform_errors_are_not_corrupt_records(sharded, on_error):
    def transform(image):
        raise ZeroDivisionError("bug in my transform")

    def target_transform(target):
        raise KeyError(target)

    for kwargs in ({"transform": transform}, {"target_transform": target_transform}):
        ds = fastdata.open_dataset(sharded["hdf5"], output="tensor", on_error=on_error, **kwargs)
        expected = ZeroDivisionError if "transform" in kwargs else KeyError
        with pytest.raises(expected):
            ds[3]
        with pytest.raises(expected):
            ds.__getitems__([0, 1])
        assert ds.skipped == 0


@pytest.fixture(scope="module")
def garbage_store(sharded, tmp_path_factory) -> str:
    """A copy of the sharded LMDB store whose sample 5 holds bytes no decoder reads but whose
    checksums agree (a record damaged, then re-checksummed): only the decode can find it."""
    import shutil

    import msgpack
    from helpers.hostile import lmdb_record, replace_item

    from fastdata.format.record import encode_record

    store = str(tmp_path_factory.mktemp("garbage") / "g.lmdb")
    shutil.copytree(sharded["lmdb"], store)
    shard = next(s for s in reversed(read_manifest(store)["shards"]) if s["first_index"] <= 5)
    local, path = 5 - shard["first_index"], os.path.join(store, shard["name"])
    old = msgpack.unpackb(lmdb_record(path, local), raw=False)
    garbage = b"\xff\xd8\xff\xe0 not a jpeg at all" * 4
    record = encode_record(garbage, label=old["label"], width=old["w"], height=old["h"], fmt=old["fmt"],
                           relpath=old["path"])
    replace_item(store, "lmdb", path, local, record, checksummed=garbage)
    return store


class MyCrop(fastdata.transforms.RandomResizedCrop):
    """A user subclass: user code, so its failures are its own."""


@pytest.mark.parametrize("decode", ["default", "rrc", "center", "full_decode"])
def test_fastdata_decoders_failing_on_stored_bytes_mean_damage(garbage_store, decode):
    make = {"default": lambda: None, "rrc": lambda: fastdata.transforms.RandomResizedCrop(8),
            "center": lambda: fastdata.transforms.CenterCrop(8), "full_decode": lambda: fastdata.transforms.full_decode}
    victim = 5
    for output in ("numpy", "tensor"):
        ds = fastdata.open_dataset(garbage_store, output=output, decode=make[decode]())
        with pytest.raises(CorruptRecordError, match=f"sample {victim}.*cannot decode") as info:
            ds[victim]
        assert info.value.index == victim
        with pytest.raises(CorruptRecordError):
            ds.__getitems__([4, victim, 6])
        skipping = fastdata.open_dataset(garbage_store, output=output, decode=make[decode](), on_error="skip")
        with pytest.warns(RuntimeWarning, match=f"skipping damaged sample {victim}"):
            batch = skipping.__getitems__([4, victim, 6])
        assert [label for _, label in batch] == [int(skipping.targets[k]) for k in (4, 6, 6)]
        assert skipping.skipped == 1


def test_user_subclass_of_a_fastdata_transform_is_user_code(garbage_store):
    ds = fastdata.open_dataset(garbage_store, output="numpy", decode=MyCrop(8), on_error="skip")
    with pytest.raises(Exception) as info:  # Pillow's own error, whatever its type
        ds[5]
    assert not isinstance(info.value, CorruptRecordError) and ds.skipped == 0


# --------------------------------------------------------------------------- samplers / loader
@pytest.mark.parametrize("shuffle", [True, False])
def test_distributed_sampler_partitions(sharded, shuffle):
    ds = fastdata.open_dataset(sharded["hdf5"], output="numpy")
    assert len(ds) % 2 == 0  # no padding: the halves must be disjoint
    for epoch in (0, 3):
        parts = []
        for rank in range(2):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=shuffle, seed=11)
            sampler.set_epoch(epoch)
            parts.append(list(sampler))
        assert len(parts[0]) == len(parts[1]) == len(ds) // 2
        assert not set(parts[0]) & set(parts[1])
        assert sorted(parts[0] + parts[1]) == list(range(len(ds)))
        labels = []
        for rank in range(2):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=shuffle, seed=11)
            sampler.set_epoch(epoch)
            for _images, batch_labels in DataLoader(ds, batch_size=5, sampler=sampler, num_workers=0,
                                                   collate_fn=lambda b: (None, [t for _, t in b])):
                labels += batch_labels
        assert Counter(labels) == Counter(ds.targets.tolist())


def test_loader_defaults(sharded):
    from fastdata.reader.loader import default_num_workers

    ds = fastdata.open_dataset(sharded["lmdb"], output="tensor")
    dl = fastdata.loader(ds)
    workers = default_num_workers()
    assert 0 < workers <= 8 and workers <= len(os.sched_getaffinity(0))
    assert dl.num_workers == workers
    # not persistent: a training loader's workers would stay alive through every validation loop
    assert dl.persistent_workers is False
    assert dl.pin_memory is torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert dl.pin_memory is False
    assert dl.worker_init_fn is fastdata.seed_worker
    assert dl.collate_fn is fastdata.collate
    assert dl.batch_size == 64
    assert isinstance(dl.sampler, RandomSampler)


def test_loader_overrides(sharded):
    ds = fastdata.open_dataset(sharded["lmdb"], output="tensor")
    dl = fastdata.loader(ds, batch_size=5, num_workers=0)
    assert dl.num_workers == 0 and dl.persistent_workers is False and dl.batch_size == 5
    dl = fastdata.loader(ds, num_workers=2, persistent_workers=False, pin_memory=True, worker_init_fn=None,
                         collate_fn=list, shuffle=False)
    assert dl.persistent_workers is False and dl.pin_memory is True
    assert dl.worker_init_fn is None and dl.collate_fn is list
    assert isinstance(dl.sampler, SequentialSampler)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False)
    dl = fastdata.loader(ds, sampler=sampler, num_workers=0)
    assert dl.sampler is sampler
    sampler.set_epoch(3)  # the batches of indices carry the sampler's epoch
    assert {batch[0].epoch for batch in dl._index_sampler} == {3}
    bs = BatchSampler(SequentialSampler(ds), batch_size=6, drop_last=False)
    dl = fastdata.loader(ds, batch_sampler=bs, num_workers=0)
    assert dl.batch_sampler is bs
    labels = [t for _, batch_labels in dl for t in batch_labels.tolist()]
    assert labels == ds.targets.tolist()


def test_dropping_the_loader_frees_its_persistent_iterator_at_once(sharded):
    """No reference cycle between the loader and its iterator (the epoch tagging must not
    point back at the loader): its workers stop when the loader is dropped, not when the
    garbage collector happens to run (seconds later, or inside another forked child)."""
    import weakref

    dl = fastdata.loader(fastdata.open_dataset(sharded["lmdb"], output="tensor"), batch_size=4, num_workers=1,
                         persistent_workers=True)
    gc.disable()
    try:
        it = iter(dl)
        next(it)
        del it
        iterator = weakref.ref(dl._iterator)
        del dl
        assert iterator() is None
    finally:
        gc.enable()
