"""PatchDataset over real stores: image and label volumes stored as chunked fields, cut at
the same place through fastdata.loader workers, grid tiles stitched back bit-exact, exact
resume, bounded chunk reads, and damaged chunks under on_error."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.volumes import volume

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.fields import Chunked, Int
from fastdata.format.backends.lmdb.reader import LMDBShardReader

SCHEMA = {"ct": Chunked("uint16", (16, 16, 16)), "mask": Chunked("uint8", (16, 16, 16)), "label": Int()}
SHAPES = [(48, 40, 36), (33, 50, 20), (40, 40, 40), (20, 64, 24)]
PATCH = (16, 16, 16)


def volumes():
    out = []
    for i, shape in enumerate(SHAPES):
        ct = volume(i, shape)
        mask = (ct > np.percentile(ct, 97)).astype(np.uint8)  # a rare foreground
        out.append({"ct": ct, "mask": mask, "label": i})
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("patches")
    samples = volumes()
    out = {}
    for suffix in (".lmdb", ".h5"):
        out[suffix] = root / f"v{suffix}"
        fastdata.write(samples, out[suffix], SCHEMA, workers=0, shard_size="1MiB", progress=False)
    return out, samples


def items(loader):
    return [(int(s), tuple(p.tolist()), ct.numpy().tobytes(), mask.numpy().tobytes())
            for batch in loader for s, p, ct, mask in zip(batch["sample"], batch["position"], batch["ct"],
                                                          batch["mask"], strict=True)]


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_uniform_patches_through_loader_workers_are_the_stored_regions(stores, suffix):
    paths, samples = stores
    ds = fastdata.PatchDataset(fastdata.open_dataset(paths[suffix]), PATCH, fields=("ct", "mask"),
                               patches_per_sample=3, seed=1, output="tensor")
    got = items(fastdata.loader(ds, batch_size=4, shuffle=True, num_workers=2, seed=3))
    assert len(got) == len(samples) * 3
    for s, position, ct, mask in got:
        region = tuple(slice(a, a + n) for a, n in zip(position, PATCH, strict=True))
        assert ct == samples[s]["ct"][region].tobytes()  # image and label from the same place
        assert mask == samples[s]["mask"][region].tobytes()
    in_process = items(fastdata.loader(ds, batch_size=4, shuffle=True, num_workers=0, seed=3))
    assert sorted(got) == sorted(in_process)  # positions do not depend on the workers


def test_grid_tiles_stitch_back_to_every_stored_volume(stores):
    paths, samples = stores
    ds = fastdata.PatchDataset(fastdata.open_dataset(paths[".h5"]), PATCH, fields=("ct",), sampler="grid",
                               overlap=4)
    for i, sample in enumerate(samples):
        tiles = [ds[p] for p in ds.patches_of(i)]
        assert np.array_equal(fastdata.stitch(ds, i, tiles, "ct"), sample["ct"])


def test_weighted_patches_are_centred_on_foreground(stores):
    paths, samples = stores
    ds = fastdata.PatchDataset(fastdata.open_dataset(paths[".lmdb"]), PATCH, fields=("ct", "mask"),
                               sampler="weighted", weight_field="mask", pos_ratio=1.0, patches_per_sample=4, seed=2)
    for p in range(len(ds)):
        item = ds[p]
        assert item["mask"].any()  # a positive voxel is in every patch (its centre is one)


def test_a_patch_reads_only_the_chunks_it_covers(stores, monkeypatch):
    paths, _ = stores
    fetched: list[int] = []
    original = LMDBShardReader.read_chunks

    def counting(self, first, table, chunks, where, consume):  # the shard reader's one read of a batch
        fetched.append(len(chunks))
        return original(self, first, table, chunks, where, consume)

    monkeypatch.setattr(LMDBShardReader, "read_chunks", counting)
    ds = fastdata.PatchDataset(fastdata.open_dataset(paths[".lmdb"]), PATCH, fields=("ct",),
                               patches_per_sample=5, seed=4)
    for p in range(len(ds)):
        ds[p]
    assert len(fetched) == len(ds) and max(fetched) <= 8  # a 16^3 patch straddles at most 2x2x2 chunks


def test_resume_from_the_sampler_state_gives_the_remaining_patches(stores):
    paths, _ = stores

    def run(state=None, stop=None):
        ds = fastdata.PatchDataset(fastdata.open_dataset(paths[".h5"]), PATCH, fields=("ct", "mask"),
                                   patches_per_sample=2, seed=7, output="tensor")
        sampler = fastdata.DistributedShardSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_epoch(1)
        dl = fastdata.loader(ds, batch_size=2, sampler=sampler, num_workers=2)
        out = []
        for batch in dl:
            out.append(items([batch]))
            if stop == len(out):
                return out, sampler.state_dict(consumed=stop * 2)
        return out, None

    full, _ = run()
    head, state = run(stop=2)
    tail, _ = run(state=state)
    assert head == full[:2] and tail == full[2:]


def _damage_a_chunk(store, sample: int) -> None:
    ds = fastdata.open_dataset(store)
    arr = ds[sample]["ct"]
    shard, _ = ds.locate(sample)
    stored = bytes(ds._reader(shard).get_chunks(arr._first, arr._table, [0], "x")[0])
    ds.close()
    path = store / ds._shard_files[shard]
    data = path.read_bytes()
    at = data.find(stored) + len(stored) // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([data[at] ^ 0xFF]))


def test_a_damaged_chunk_raises_or_is_replaced_under_on_error_skip(tmp_path):
    dst = tmp_path / "d.lmdb"
    fastdata.write(volumes(), dst, SCHEMA, workers=0, progress=False)
    _damage_a_chunk(dst, 1)
    whole = fastdata.PatchDataset(fastdata.open_dataset(dst), (48, 50, 40), fields=("ct",), pad_value=0)
    with pytest.raises(CorruptRecordError, match=r"sample 1\) field 'ct' chunk 0: checksum mismatch"):
        whole[1]  # the whole volume, padded: chunk 0 is read
    base = fastdata.open_dataset(dst, on_error="skip")
    skipping = fastdata.PatchDataset(base, (48, 50, 40), fields=("ct",), pad_value=0)
    with pytest.warns(RuntimeWarning, match="skipping damaged sample 1"):
        item = skipping[1]
    assert item["sample"] == 2 and skipping.skipped == 1  # the same patch of the next sample
