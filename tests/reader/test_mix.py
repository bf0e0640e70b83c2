"""``fastdata.mix``: per-epoch proportions globally and per rank, draws without replacement within a
pass, a pure-function order, samples marked with their source, the combined batch's collate, exact
mid-epoch resume through the sampler's state (0 and 2 workers), per-source schema mapping, and
every bad input."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.images import make_jpeg
from helpers.samples import jpeg

import fastdata
from fastdata import transforms
from fastdata.fields import Float, Image, Int, Schema, String
from fastdata.reader import batching
from fastdata.reader.batching import Batch
from fastdata.reader.mix import largest_remainder
from fastdata.reader.seeding import EpochIndex

SEED = 99
W = {"a": 0.7, "b": 0.3}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    """Two classification stores (20 and 7 JPEGs of assorted sizes, classes c0/c1) and a general
    store (fastdata.write) of 5 image/label/score samples."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, n, base in (("a", 20, 0), ("b", 7, 500)):
        for i in range(n):
            make_jpeg(root / name / f"c{i % 2}" / f"{i:02d}.jpg", size=(24 + 2 * i, 20 + i % 5), seed=base + i)
        out[name] = str(root / f"{name}.lmdb")
        fastdata.convert(str(root / name), out[name], workers=1, progress=False)
    schema = Schema.of({"image": Image(), "label": Int("int64"), "score": Float("float32")})
    out["g"] = str(root / "g.lmdb")
    fastdata.write([{"image": jpeg(i, (20, 18)), "label": 10 + i, "score": i / 4} for i in range(5)],
                   out["g"], schema, workers=0, progress=False)
    return out


def opened(path: str, seed: int = SEED):
    return fastdata.open_dataset(path, output="tensor", decode=transforms.RandomResizedCrop(16), seed=seed)


def ab(stores, **kw):
    return fastdata.mix({"a": opened(stores["a"]), "b": opened(stores["b"])}, **kw)


class Plain(torch.utils.data.Dataset):
    """A plain torch Dataset (no set_epoch): sample i is (i, -i); records the index types it gets."""

    def __init__(self, n: int):
        self.n, self.seen = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.seen.append(type(i))
        return int(i), -int(i)


def plain_mix(**kw):
    return fastdata.mix({"a": Plain(20), "b": Plain(7)}, **kw)


# --------------------------------------------------------------------------- proportions
def test_largest_remainder_is_within_one_and_sums_exactly():
    from fractions import Fraction
    shares = largest_remainder(10, [Fraction(0.7), Fraction(0.3)])
    assert shares == [7, 3]
    for total in (1, 7, 31, 1000):
        w = [Fraction(1, 3), Fraction(1, 3), Fraction(1, 3), Fraction(0)]
        got = largest_remainder(total, w)
        assert sum(got) == total and got[3] == 0
        assert all(abs(g - total / 3) < 1 for g in got[:3])


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_counts_within_one_of_the_weights_globally_and_on_every_rank(replicas):
    m = plain_mix(weights=W, epoch_size=31, num_replicas=replicas, batch_size=2)
    assert m.epoch_size == 31 // replicas * replicas and len(m) == m.epoch_size
    assert sum(m.counts.values()) == m.epoch_size
    per_rank_size = m.epoch_size // replicas
    for epoch in (0, 1, 2):
        m.set_epoch(epoch)
        src = m.order()[0]
        glob = Counter(m.source_names[s] for s in src.tolist())
        assert glob == Counter(m.counts)
        for name, w in W.items():
            assert abs(glob[name] - w * m.epoch_size) < 1
        totals = Counter()
        lengths, batches = set(), set()
        for rank in range(replicas):
            sampler = m.sampler(rank=rank)
            sampler.set_epoch(epoch)
            positions = list(sampler)
            lengths.add(len(positions))
            mine = Counter(m.source_names[src[p]] for p in positions)
            for name, w in W.items():
                assert abs(mine[name] - w * per_rank_size) < 1, (rank, mine)
            totals += mine
            # what a rank reads through the loader: samples marked with their source
            got = Counter()
            dl = fastdata.loader(m, batch_size=2, sampler=sampler, num_workers=0)
            n_batches = 0
            for batch in dl:
                n_batches += 1
                got.update(m.source_names[s] for s in batch[2].tolist())
            assert got == mine
            batches.add(n_batches)
        assert totals == glob  # the ranks' counts sum to the epoch's
        assert lengths == {per_rank_size} and len(batches) == 1  # equal samples and batches per rank


def test_a_shuffling_sampler_keeps_the_counts_with_one_rank(stores):
    m = plain_mix(weights=W, epoch_size=30)
    dl = fastdata.loader(m, batch_size=4, num_workers=0, shuffle=True)
    got = Counter(m.source_names[s] for batch in dl for s in batch[2].tolist())
    assert got == Counter(m.counts) == Counter({"a": 21, "b": 9})


def test_repeat_and_samples_derive_the_epoch(stores):
    m = plain_mix(repeat={"a": 0.5, "b": 2})
    assert m.counts == {"a": 10, "b": 14} and m.epoch_size == 24
    assert m.weights == pytest.approx({"a": 10 / 24, "b": 14 / 24})
    m = plain_mix(samples={"a": 3, "b": 0})
    assert m.counts == {"a": 3, "b": 0} and set(m.order()[0].tolist()) == {0}
    # counts that do not fit the ranks: rounded down, the proportions kept (within 1)
    m = plain_mix(repeat={"a": 1, "b": 1}, num_replicas=2)
    assert m.requested_epoch_size == 27 and m.epoch_size == 26 and m.counts == {"a": 19, "b": 7}
    assert "rounded down" in repr(m) and "'b': 7 samples" in repr(m)
    m = plain_mix()  # no sizing at all: proportional to the lengths
    assert m.counts == {"a": 20, "b": 7} and m.weights == pytest.approx({"a": 20 / 27, "b": 7 / 27})


# --------------------------------------------------------------------------- draws
def test_repeat_one_yields_every_sample_once_per_epoch():
    m = plain_mix(repeat={"a": 1, "b": 1})
    for epoch in range(3):
        src, idx, _ = m.order(epoch)
        for s, n in ((0, 20), (1, 7)):
            assert sorted(idx[src == s].tolist()) == list(range(n))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_repeated_source_reads_a_permutation_every_pass(replicas):
    m = plain_mix(weights={"a": 0.5, "b": 0.5}, epoch_size=40, num_replicas=replicas)
    assert m.counts["b"] == 20  # 20 draws per epoch of 7 samples: passes cross epochs
    draws, passes = [], []
    for epoch in range(4):
        src, idx, pas = m.order(epoch)
        # through the samplers too: the ranks' positions of b are exactly the epoch's
        positions = sorted(p for r in range(replicas) for p in _rank_positions(m, r, epoch))
        assert positions == list(range(m.epoch_size))
        draws += idx[src == 1].tolist()
        passes += pas[src == 1].tolist()
    assert passes == [d // 7 for d in range(80)]
    chunks = [draws[k:k + 7] for k in range(0, 77, 7)]
    assert all(sorted(c) == list(range(7)) for c in chunks)
    assert len({tuple(c) for c in chunks}) > 1  # each pass its own permutation


def _rank_positions(m, rank, epoch):
    sampler = m.sampler(rank=rank)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_order_is_a_pure_function_of_seed_epoch_and_index():
    a, b = plain_mix(weights=W, epoch_size=30, seed=3), plain_mix(weights=W, epoch_size=30, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a.order(2), b.order(2), strict=True))
    other = plain_mix(weights=W, epoch_size=30, seed=4)
    assert not all(np.array_equal(x, y) for x, y in zip(a.order(2), other.order(2), strict=True))
    assert not np.array_equal(a.order(1)[0], a.order(2)[0])  # epochs differ
    # a new process sees the same order: pickled without its table, rebuilt identically
    a.order(2)
    blob = pickle.dumps(a)
    assert len(blob) < 5000
    back = pickle.loads(blob)
    assert back._table is None
    assert all(np.array_equal(x, y) for x, y in zip(a.order(2), back.order(2), strict=True))
    # a source's draws are keyed by its name, not its place in the dict
    swapped = fastdata.mix({"b": Plain(7), "a": Plain(20)}, samples={"a": 21, "b": 9}, seed=3)
    orig = fastdata.mix({"a": Plain(20), "b": Plain(7)}, samples={"a": 21, "b": 9}, seed=3)
    for name in ("a", "b"):
        draws = [m.order(1)[1][m.order(1)[0] == m.source_names.index(name)] for m in (swapped, orig)]
        assert len(draws[0]) and sorted(draws[0].tolist()) == sorted(draws[1].tolist())


# --------------------------------------------------------------------------- samples
def test_samples_say_their_source_and_equal_the_sources_draw(stores):
    m = ab(stores, weights={"a": 0.5, "b": 0.5}, epoch_size=24)
    m.set_epoch(1)
    src, idx, passes = m.order()
    sources = {n: opened(stores[n]) for n in "ab"}
    expected = [sources[m.source_names[s]][EpochIndex(i, p)] for s, i, p in
                zip(src.tolist(), idx.tolist(), passes.tolist(), strict=True)]
    for i in (0, 5, 23):  # __getitem__: (image, label, source_id)
        image, label, s = m[i]
        assert s == src[i] and label == expected[i][1] and torch.equal(image, expected[i][0])
    batch = m.__getitems__(list(range(24)))
    assert isinstance(batch, Batch) and batch.sources.tolist() == src.tolist()
    for (image, label, s), exp, s_exp in zip(batch, expected, src.tolist(), strict=True):
        assert s == s_exp and label == exp[1] and torch.equal(image, exp[0])
    images, labels, ids = fastdata.collate(batch)
    assert ids.dtype == torch.int64 and ids.tolist() == src.tolist()
    assert torch.equal(images, torch.stack([e[0] for e in expected]))
    assert labels.tolist() == [e[1] for e in expected]
    # the epoch carried by the batch's first index wins over the mix's own
    m.set_epoch(0)
    tagged = m.__getitems__([EpochIndex(0, 1), 1, 2])
    assert all(torch.equal(t[0], e[0]) for t, e in zip(tagged, expected[:3], strict=True))


def test_each_pass_of_a_repeated_sample_gets_its_own_crop(stores):
    m = ab(stores, samples={"a": 0, "b": 14})  # two passes over b per epoch
    src, idx, passes = m.order(0)
    first, second = np.flatnonzero(passes == 0), np.flatnonzero(passes == 1)
    by_index = {int(idx[j]): j for j in second}
    differ = sum(not torch.equal(m[int(j)][0], m[by_index[int(idx[j])]][0]) for j in first)
    assert differ >= 5  # the same image, another crop (a crop can repeat by chance)


def test_a_plain_dataset_gets_plain_ints_and_a_fastdata_one_the_pass():
    a, b = Plain(20), Plain(7)
    m = fastdata.mix({"a": a, "b": b}, weights=W, epoch_size=10)
    m.__getitems__(list(range(10)))
    m[3]
    assert set(a.seen) | set(b.seen) == {int}
    samples = m.__getitems__([0, 1, 2])
    src, idx, _ = m.order()
    assert list(samples) == [(int(idx[j]), -int(idx[j]), int(src[j])) for j in range(3)]


def test_collate_gives_sources_through_workers_also_in_shared_memory(stores, monkeypatch):
    """Batches from a worker: small ones travel inline (ring/by value), large ones in shared memory;
    both carry the source ids (forked workers see the patched limit)."""
    m = ab(stores, weights=W, epoch_size=20)
    m.set_epoch(0)
    expected = m.order(0)[0].tolist()
    monkeypatch.setattr(batching, "INLINE_BATCH_BYTES", 0)
    dl = fastdata.loader(m, batch_size=5, sampler=m.sampler(rank=0), num_workers=1,
                         multiprocessing_context="fork", persistent_workers=False)
    got = [s for images, labels, ids in dl for s in ids.tolist()]
    assert got == expected


def test_a_per_source_transform_maps_two_schemas_to_one(stores):
    a = opened(stores["a"])
    g = fastdata.open_dataset(stores["g"], output="tensor", decode=transforms.RandomResizedCrop(16), seed=SEED)
    m = fastdata.mix({"cls": a, "gen": g}, samples={"cls": 4, "gen": 4},
                     transforms={"cls": lambda s: {"image": s[0], "label": s[1]},
                                 "gen": lambda s: {"image": s["image"], "label": s["label"]}})
    assert m.classes is None  # a general store has no class list like a's
    batch = fastdata.collate(m.__getitems__(list(range(8))))
    src = m.order()[0].tolist()
    assert batch["source"] == [m.source_names[s] for s in src]
    assert batch["image"].shape == (8, 3, 16, 16)
    for label, s in zip(batch["label"].tolist(), src, strict=True):
        assert (label >= 10) == (s == 1)  # g's labels are 10..14, a's 0/1
    assert set(m[0]) == {"image", "label", "source"}


def test_attributes_classes_skipped_close_and_repr(stores):
    m = ab(stores, weights=W, epoch_size=20)
    assert m.classes == ["c0", "c1"] and m.skipped == 0
    text = repr(m)
    assert "Source 'a': 20 samples, weight 0.7, 14 per epoch" in text and "'b': 7 samples" in text
    m[0]
    m.close()
    m[1]  # handles reopen lazily
    m.seed = 5  # fastdata.loader(seed=) sets the order seed and the sources' crop seeds
    assert m.seed == 5 and all(m.sources[n].seed == 5 for n in "ab")
    fastdata.loader(m, seed=6, sampler=m.sampler(rank=0), num_workers=0)
    assert m.seed == 6 and m.sources["b"].seed == 6


# --------------------------------------------------------------------------- resume
def run(stores, workers: int, epochs=(0, 1), stop=None, state=None, replicas: int = 1, rank: int = 0):
    """Epochs of a mix through fastdata.loader + mix.sampler (persistent workers) on one rank;
    ``stop=(epoch, k)`` stops after k batches and returns the state a checkpoint would hold."""
    m = ab(stores, weights={"a": 0.5, "b": 0.5}, epoch_size=24, seed=7, num_replicas=replicas)
    sampler = m.sampler(rank=rank)
    if state is not None:
        sampler.load_state_dict(state)
    dl = fastdata.loader(m, batch_size=4, sampler=sampler, num_workers=workers)
    out = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out[epoch] = []
        for images, labels, ids in dl:
            out[epoch] += [(im.contiguous().numpy().tobytes(), int(lab), int(s))
                           for im, lab, s in zip(images, labels, ids, strict=True)]
            if stop == (epoch, len(out[epoch]) // 4):
                return out, sampler.state_dict(consumed=len(out[epoch]) * replicas)
    return out, None


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_the_uninterrupted_remainder(stores, workers):
    full, _ = run(stores, workers)
    assert full[0] != full[1]  # control: the second epoch is another order and other crops
    assert Counter(s for _, _, s in full[1]) == Counter({0: 12, 1: 12})
    head, state = run(stores, workers, stop=(1, 2))
    assert head[1] == full[1][:8] and state["epoch"] == 1 and state["consumed"] == 8
    tail, _ = run(stores, workers, epochs=(1,), state=state)
    assert tail[1] == full[1][8:]


def test_resume_mid_epoch_on_one_of_two_ranks(stores):
    full, _ = run(stores, 0, replicas=2, rank=1)
    assert len(full[1]) == 12 and Counter(s for _, _, s in full[1]) == Counter({0: 6, 1: 6})
    head, state = run(stores, 0, stop=(1, 1), replicas=2, rank=1)
    assert head[1] == full[1][:4] and state["consumed"] == 8
    tail, _ = run(stores, 0, epochs=(1,), state=state, replicas=2, rank=1)
    assert tail[1] == full[1][4:]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    ({"weights": {"a": -1, "b": 1}}, r"weights\['a'\] is -1.0: weights must be >= 0"),
    ({"weights": {"a": 0, "b": 0}}, "weights are all zero"),
    ({"weights": {"a": float("nan"), "b": 1}}, r"weights\['a'\] must be finite"),
    ({"weights": {"a": 1}}, "missing 'b'"),
    ({"weights": {"a": 1, "b": 1, "c": 1}}, "unknown 'c'"),
    ({"weights": {"a": "x", "b": 1}}, "must be a number"),
    ({"repeat": {"a": 0, "b": 1}}, r"repeat\['a'\] must be > 0"),
    ({"repeat": {"a": 1, "b": -2}}, r"repeat\['b'\] must be > 0"),
    ({"samples": {"a": -1, "b": 1}}, r"samples\['a'\] must be an int >= 0"),
    ({"samples": {"a": 0, "b": 0}}, "every source's count is zero"),
    ({"samples": {"a": 1.5, "b": 0}}, r"samples\['a'\] must be an int"),
    ({"weights": W, "repeat": {"a": 1, "b": 1}}, "give one of weights=, repeat= or samples=.*weights and repeat"),
    ({"repeat": {"a": 1, "b": 1}, "epoch_size": 10}, "epoch_size is the sum of the counts"),
    ({"weights": W, "epoch_size": 0}, "epoch_size must be an int >= 1"),
    ({"weights": W, "epoch_size": 3, "num_replicas": 4}, "epoch_size 3 is smaller than num_replicas=4"),
    ({"weights": W, "epoch_size": 15, "num_replicas": 2, "batch_size": 8},
     r"epoch_size 14 is smaller than num_replicas x batch_size = 2 x 8 = 16"),
    ({"transforms": {"z": lambda s: s}}, "transforms names 'z', which are not sources"),
    ({"transforms": {"a": 3}}, r"transforms\['a'\] must be callable"),
    ({"num_replicas": 0}, "num_replicas must be an int >= 1"),
    ({"seed": "x"}, "seed must be an int"),
])
def test_bad_input_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        plain_mix(**kw)


def test_bad_sources_and_empty_sources(stores):
    with pytest.raises(ValueError, match="non-empty dict"):
        fastdata.mix({})
    with pytest.raises(ValueError, match="source 'x' is not a map-style dataset"):
        fastdata.mix({"x": 3})
    with pytest.raises(ValueError, match="source 'e' is empty but its share is 3 samples"):
        fastdata.mix({"a": Plain(5), "e": Plain(0)}, weights={"a": 1, "e": 1}, epoch_size=6)
    fastdata.mix({"a": Plain(5), "e": Plain(0)}, weights={"a": 1, "e": 0})  # weight 0: fine
    with pytest.raises(ValueError, match="shuffle=False"):
        plain_mix().sampler(rank=0, shuffle=True)
    with pytest.raises(IndexError, match="index 27 out of range"):
        plain_mix()[27]


def test_a_source_key_clash_is_an_error(stores):
    schema = Schema.of({"image": Image(), "source": String()})
    root = stores["g"].replace("g.lmdb", "clash.lmdb")
    fastdata.write([{"image": jpeg(0), "source": "x"}], root, schema, workers=0, progress=False)
    clash = fastdata.open_dataset(root)
    with pytest.raises(ValueError, match="source 'c' has a field named 'source'"):
        fastdata.mix({"c": clash})
    renamed = fastdata.mix({"c": clash}, transforms={"c": lambda s: {"image": s["image"], "origin": s["source"]}})
    assert renamed[0]["source"] == "c" and renamed[0]["origin"] == "x"

    class Dicts(Plain):
        def __getitem__(self, i):
            return {"source": i}

    with pytest.raises(ValueError, match="a sample of source 'd' already has a 'source' key"):
        fastdata.mix({"d": Dicts(3)})[0]


def test_parts_are_built_in_private_memory_and_the_batch_where_it_travels(stores, monkeypatch):
    """In a worker (simulated here), a shared-memory segment per part would cost its creation and
    faults for nothing: the parts are copied into the batch, which alone is built to travel."""
    import fastdata.reader.dataset as dataset_module

    shared = []
    real = dataset_module.build_batch

    def recording(*args, **kwargs):
        batch = real(*args, **kwargs)
        shared.append(batch.images.is_shared())
        return batch

    monkeypatch.setattr(dataset_module, "build_batch", recording)
    monkeypatch.setattr(batching, "INLINE_BATCH_BYTES", 0)
    m = ab(stores, weights={"a": 0.5, "b": 0.5}, epoch_size=20)
    m[0]  # shards opened before "becoming a worker"
    info = type("Info", (), {"num_workers": 1, "id": 0})()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)
    src = m.order(0)[0]
    batch = m.__getitems__(list(range(10)))
    assert len(set(src[:10].tolist())) == 2 and shared == [False, False]  # two parts, both private
    assert batch.images.is_shared()  # the batch itself: shared memory, as the source would build it
    one = int(np.flatnonzero(src == src[0])[1])
    shared.clear()
    assert m.__getitems__([0, one]).images.is_shared() and shared == [True]  # one part: the batch itself
    with batching.private_batches():
        assert not m.sources["a"].__getitems__([0, 1]).images.is_shared()
    assert m.sources["a"].__getitems__([0, 1]).images.is_shared()


def test_skips_of_the_parts_reach_the_mix(monkeypatch):
    """Damaged samples a source replaced (its part's ``skips``) are counted on the mix: in this
    process by the sources themselves, from a worker with the batch, under the mix's name."""
    from fastdata.reader.batching import Samples

    class Skipping(Plain):
        skipped = 2

        def __getitems__(self, indices):
            out = Samples(self[i] for i in indices)
            out.skips = 1  # one damaged sample replaced in this part
            return out

    m = fastdata.mix({"a": Skipping(20), "b": Skipping(7)}, weights=W, epoch_size=20)
    src = m.order()[0]
    j = [int(np.flatnonzero(src == 0)[0]), int(np.flatnonzero(src == 1)[0])]
    batch = m.__getitems__(j)
    assert batch.skips == 2 and batch.token == m._token
    assert m.skipped == 4  # the sources' own counts (this process)
    info = type("Info", (), {"num_workers": 1, "id": 0})()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)
    sent = pickle.dumps(fastdata.collate(batch))  # what a worker puts on its queue
    monkeypatch.undo()
    pickle.loads(sent)  # received by the main process
    assert m.skipped == 6


def test_a_sampler_state_of_another_mix_does_not_load():
    m = plain_mix(weights=W, epoch_size=20, seed=1)
    sampler = m.sampler(rank=0)
    sampler.set_epoch(2)
    state = sampler.state_dict(consumed=8)
    assert state["mix"] == m.fingerprint()
    same = plain_mix(weights=W, epoch_size=20, seed=1).sampler(rank=0)
    same.load_state_dict(state)
    assert list(same) == list(range(8, 20))
    for other in (plain_mix(weights=W, epoch_size=20, seed=2),  # same length, another order
                  plain_mix(weights={"a": 0.5, "b": 0.5}, epoch_size=20, seed=1)):
        with pytest.raises(ValueError, match="saved over another mix"):
            other.sampler(rank=0).load_state_dict(state)
