"""DistributedShardSampler's shard-window mode: each rank reads a few whole shards at a time
(shard order shuffled per epoch, per-index shuffle inside each window), with exact resume; and
the other modes unchanged bit for bit."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.images import make_tree
from torchdata.stateful_dataloader import StatefulDataLoader

import fastdata
from fastdata.reader.sampler import DistributedShardSampler, epoch_order

# Uneven sizes with empty shards (one first, one inside), and a simple even layout.
LAYOUTS = [[0, 5, 0, 7, 3, 10, 2, 1, 9], [4, 4, 4, 4, 4, 4], [13], [1, 0, 1]]


class Sharded:
    """Stand-in for a fastdata store: a length and the first index of each shard."""

    def __init__(self, sizes: list[int]):
        self.n = sum(sizes)
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def sampler(sizes, replicas=1, rank=0, epoch=0, **kw) -> DistributedShardSampler:
    kw.setdefault("shard_window", 2)
    s = DistributedShardSampler(Sharded(sizes), num_replicas=replicas, rank=rank, **kw)
    s.set_epoch(epoch)
    return s


def outputs(sizes, replicas, epoch=0, **kw) -> list[list[int]]:
    return [list(sampler(sizes, replicas, r, epoch, **kw)) for r in range(replicas)]


def shard_of(sizes) -> np.ndarray:
    """Shard number of every global index."""
    return np.repeat(np.arange(len(sizes)), sizes)


def interleave(per_rank: list[list[int]]) -> list[int]:
    return [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(len(per_rank))]


# -- partition -------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_once_per_epoch(sizes, replicas, drop_last, shuffle):
    n = sum(sizes)
    for epoch in (0, 1):
        per_rank = outputs(sizes, replicas, epoch, drop_last=drop_last, shuffle=shuffle, seed=4)
        expected = n // replicas if drop_last else -(-n // replicas)
        assert [len(p) for p in per_rank] == [expected] * replicas
        assert len(sampler(sizes, replicas, drop_last=drop_last)) == expected
        counts = Counter(i for p in per_rank for i in p)
        assert set(counts) <= set(range(n))
        if drop_last:  # nothing twice, fewer than `replicas` left out (DistributedSampler's rule)
            assert max(counts.values(), default=1) == 1 and n - len(counts) < replicas
        else:  # everything, and fewer than `replicas` repeats
            assert set(counts) == set(range(n))
            assert sum(counts.values()) - n < replicas
        if n >= replicas:  # padding repeats an index of the rank's own stream, no other's
            for r in range(1, replicas):
                assert not set(per_rank[r]) & set().union(*per_rank[:r])


def test_ranks_share_a_shard_only_where_their_ranges_meet():
    """Ranks take consecutive runs of the shuffled shard sequence: a shard read by two ranks is
    the last of one and the first of the next (at most ``replicas - 1`` such shards)."""
    sizes = LAYOUTS[0]
    for replicas in (2, 3, 4):
        windows = [sampler(sizes, replicas, r, epoch=5).window_shards() for r in range(replicas)]
        flat = [[s for w in ws for s in w] for ws in windows]
        shared = [s for s, c in Counter(s for f in flat for s in set(f)).items() if c > 1]
        assert len(shared) <= replicas - 1
        for s in shared:
            owners = [r for r in range(replicas) if s in flat[r]]
            assert owners == list(range(owners[0], owners[0] + len(owners)))
            assert all(flat[r][-1] == s for r in owners[:-1])
            assert all(flat[r][0] == s for r in owners[1:])
        non_empty = {k for k, size in enumerate(sizes) if size}
        assert set().union(*map(set, flat)) == non_empty


# -- windows ---------------------------------------------------------------------------------


def check_windows(s: DistributedShardSampler, sizes, stream: list[int]) -> None:
    """Every position reads a shard of its window; windows come in window_shards order."""
    windows = s.window_shards()
    shards = shard_of(sizes)[stream]
    index = [s.window_index(k) for k in range(len(stream))]
    # window_index walks the windows in order, one after the other, none skipped
    assert index == sorted(index) and (not index or set(index) == set(range(len(windows))))
    seen: dict[int, set[int]] = {}
    for k, w in enumerate(index):
        assert shards[k] in windows[w], (k, w)
        seen.setdefault(w, set()).add(int(shards[k]))
    assert [sorted(seen[w]) for w in range(len(windows))] == [sorted(w) for w in windows]
    assert all(1 <= len(w) <= s.shard_window for w in windows)


@pytest.mark.parametrize("shard_window", [1, 2, 3])
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_stream_stays_inside_its_window(shard_window, replicas, drop_last):
    sizes = LAYOUTS[0]
    for epoch in (0, 3):
        for r in range(replicas):
            s = sampler(sizes, replicas, r, epoch, shard_window=shard_window, drop_last=drop_last)
            stream = list(s)
            check_windows(s, sizes, stream)
            # Without window_index: consecutive stretches of shard_window shards' worth of
            # samples. Count the distinct shards of every run of positions that lies in one
            # window: never more than shard_window (a full per-index shuffle would mix them all).
            shards = shard_of(sizes)[stream]
            start = 0
            for w in s.window_shards():
                size = int(np.isin(shards, w).sum())  # a rank reads a shard in one window only
                assert len(set(shards[start:start + size].tolist())) <= shard_window
                assert set(shards[start:start + size].tolist()) == set(w)
                start += size
            assert start == len(stream)


def test_windows_mix_inside_and_keep_shards_whole():
    sizes = [50] * 8
    s = sampler(sizes, 1, 0, epoch=2, shard_window=4)
    stream = np.array(list(s))
    first = shard_of(sizes)[stream[:200]]
    assert len(set(first.tolist())) == 4  # one window: 4 whole shards, all their samples
    assert sorted(stream[:200].tolist()) == sorted(
        i for k in s.window_shards()[0] for i in range(50 * k, 50 * k + 50))
    # shuffled per index inside the window: neither storage order nor shard after shard
    assert (np.diff(first) != 0).sum() > 100


def test_window_shards_agrees_with_iter_on_a_real_store(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 9, "b": 8, "c": 7})
    dst = str(tmp_path / "s.lmdb")
    fastdata.convert(src, dst, workers=1, progress=False, shard_size=3000)
    ds = fastdata.open_dataset(dst)
    starts = ds.shard_starts.tolist()
    assert len(starts) >= 4  # several shards, so windows matter
    sizes = np.diff(starts + [len(ds)]).tolist()
    for replicas in (1, 2):
        per_rank = []
        for r in range(replicas):
            s = DistributedShardSampler(ds, num_replicas=replicas, rank=r, shard_window=2, seed=8)
            s.set_epoch(1)
            per_rank.append(list(s))
            check_windows(s, sizes, per_rank[-1])
        assert set().union(*per_rank) == set(range(len(ds)))
        assert sum(map(len, per_rank)) - len(ds) < replicas
    ds.close()


def test_reshuffled_between_epochs_identical_across_ranks():
    sizes = [10] * 12
    replicas = 3
    by_epoch = []
    for epoch in range(4):
        # every rank computes the whole epoch's plan from (seed, epoch) alone: a rank built in
        # another process (another sampler object) agrees on every rank's windows
        plans = [[sampler(sizes, replicas, r, epoch, seed=9).window_shards()
                  for r in range(replicas)] for _ in range(2)]
        assert plans[0] == plans[1]
        order = [k for ws in plans[0] for w in ws for k in w]
        assert sorted(order) == list(range(12))  # disjoint shards (sizes divide evenly here)
        by_epoch.append(order)
        assert epoch_order(sum(sizes), epoch=epoch, seed=9, shuffle=True, drop_last=False,
                           block_size=1, window=1, replicas=replicas, shard_sizes=sizes,
                           shard_window=2).tolist() == interleave(outputs(sizes, replicas, epoch,
                                                                          seed=9))
    assert len({tuple(o) for o in by_epoch}) == 4  # shard order reshuffled every epoch
    assert outputs(sizes, 1, 0, seed=9) != outputs(sizes, 1, 0, seed=10)
    # same windows, different within-window order: a window is reshuffled per index as well
    a = sampler([10, 10], 1, 0, epoch=0, shard_window=2)
    b = sampler([10, 10], 1, 0, epoch=1, shard_window=2)
    assert sorted(a.window_shards()[0]) == sorted(b.window_shards()[0]) == [0, 1]
    assert list(a) != list(b) and sorted(a) == sorted(b)


def test_shuffle_false_reads_own_shards_in_storage_order():
    sizes = LAYOUTS[0]
    per_rank = outputs(sizes, 3, epoch=4, shuffle=False, drop_last=True)  # 37 samples
    assert per_rank == [list(range(k * 12, k * 12 + 12)) for k in range(3)]
    windows = [sampler(sizes, 3, r, shuffle=False).window_shards() for r in range(3)]
    # ranks of 13, 12, 12 samples; shard 4 (indices 12-14) is split between ranks 0 and 1
    assert windows == [[[1, 3], [4]], [[4, 5]], [[6, 7], [8]]]


def test_window_index_validation():
    s = sampler([3, 4], 1, 0)
    with pytest.raises(ValueError, match="position"):
        s.window_index(7)
    with pytest.raises(ValueError, match="shard-window mode"):
        DistributedShardSampler(Sharded([3]), num_replicas=1, rank=0).window_shards()


# -- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_same_world_is_exact(replicas, drop_last):
    sizes = LAYOUTS[0]
    kw = dict(drop_last=drop_last, seed=3, shard_window=2)
    full = outputs(sizes, replicas, 2, **kw)
    for k in [0, 1, 5, len(full[0]) - 1, len(full[0])]:
        state = json.loads(json.dumps(sampler(sizes, replicas, 0, 2, **kw).state_dict(k * replicas)))
        assert state["shard_window"] == 2
        resumed = []
        for r in range(replicas):
            s = DistributedShardSampler(Sharded(sizes), num_replicas=replicas, rank=r, **kw)
            s.load_state_dict(state)
            s.set_epoch(2)  # the training loop's call keeps the resume point
            assert len(s) == len(full[r])  # the whole epoch; the resumed iterator yields the rest
            resumed.append(list(s))
            assert len(resumed[-1]) == len(full[r]) - k
            if k < len(full[r]):  # the prefetcher's view: the next position's window
                assert shard_of(sizes)[resumed[-1][0]] in s.window_shards()[s.window_index(k)]
        assert resumed == [p[k:] for p in full]
    # A count that is not a whole lockstep step: still exactly the rest of the global order.
    order = interleave(full)
    state = sampler(sizes, replicas, 0, 2, **kw).state_dict(7)
    rest = []
    for r in range(replicas):
        s = DistributedShardSampler(Sharded(sizes), num_replicas=replicas, rank=r, **kw)
        s.load_state_dict(state)
        rest.append(list(s))
    remainder, total = order[7:], len(rest[0]) * replicas
    assert interleave(rest) == (remainder + remainder)[:total]
    assert len(remainder) - total < replicas if drop_last else total - len(remainder) < replicas


def test_resume_from_the_samplers_own_count():
    sizes = LAYOUTS[0]
    s = sampler(sizes, 2, 1, 1)
    it = iter(s)
    head = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert state["consumed"] == 12
    other = DistributedShardSampler(Sharded(sizes), num_replicas=2, rank=1, shard_window=2)
    other.load_state_dict(state)
    assert head + list(other) == outputs(sizes, 2, 1)[1]


def test_resume_on_another_world_size_mid_epoch_is_refused():
    sizes = LAYOUTS[0]
    state = sampler(sizes, 2, 0, 1).state_dict(10)
    three = DistributedShardSampler(Sharded(sizes), num_replicas=3, rank=0, shard_window=2)
    with pytest.raises(ValueError, match="Resume with num_replicas=2"):
        three.load_state_dict(state)
    # nothing or everything consumed: no window to carry over, so any world size resumes
    three.load_state_dict(sampler(sizes, 2, 0, 1).state_dict(0))
    assert list(three) == outputs(sizes, 3, 1)[0]
    three.load_state_dict(sampler(sizes, 2, 0, 1).state_dict(len(sampler(sizes, 2)) * 2))
    assert list(three) == []
    three.set_epoch(2)
    assert list(three) == outputs(sizes, 3, 2)[0]


def test_state_checks_mode_and_shard_layout():
    sizes = LAYOUTS[0]
    state = sampler(sizes, 1, 0).state_dict(4)
    for other in (
        DistributedShardSampler(Sharded(sizes), num_replicas=1, rank=0),  # mode off
        sampler(sizes, 1, 0, shard_window=3),
        DistributedShardSampler(Sharded(sizes), num_replicas=1, rank=0, shard_window=2,
                                shard_sizes=sorted(sizes)),  # same length, other shards
    ):
        with pytest.raises(ValueError, match="cannot be reproduced"):
            other.load_state_dict(state)
    plain = DistributedShardSampler(Sharded(sizes), num_replicas=1, rank=0).state_dict(4)
    with pytest.raises(ValueError, match="shard_window"):
        sampler(sizes, 1, 0).load_state_dict(plain)


class Indexed(torch.utils.data.Dataset):
    def __init__(self, sizes):
        self.inner = Sharded(sizes)
        self.shard_starts = self.inner.shard_starts

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> int:
        return i


def stateful_run(sizes, stop_after=None, state=None):
    ds = Indexed(sizes)
    s = DistributedShardSampler(ds, num_replicas=1, rank=0, shard_window=2, seed=6)
    s.set_epoch(3)
    dl = StatefulDataLoader(ds, batch_size=4, sampler=s, num_workers=2)
    if state is not None:
        dl.load_state_dict(state)
    batches = []
    for batch in dl:
        batches.append(batch.tolist())
        if len(batches) == stop_after:
            return batches, dl.state_dict()
    return batches, None


@pytest.mark.timeout(120)
def test_stateful_dataloader_two_workers_resumes_exactly():
    sizes = [6, 0, 9, 5, 11, 7]
    full, _ = stateful_run(sizes)
    assert [i for b in full for i in b] == outputs(sizes, 1, 3, seed=6)[0]
    head, state = stateful_run(sizes, stop_after=3)
    assert head == full[:3]
    tail, _ = stateful_run(sizes, state=state)
    assert tail == full[3:]


# -- settings --------------------------------------------------------------------------------


def test_validation_errors_say_what_to_do():
    class Plain:
        def __len__(self) -> int:
            return 10

    with pytest.raises(ValueError, match="shard_sizes="):
        DistributedShardSampler(Plain(), num_replicas=1, rank=0, shard_window=2)
    ok = DistributedShardSampler(Plain(), num_replicas=1, rank=0, shard_window=2, shard_sizes=[4, 6])
    assert sorted(ok) == list(range(10)) and ok.window_shards() in ([[0, 1]], [[1, 0]])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shard_window"):
            sampler([4, 6], shard_window=bad)
    with pytest.raises(ValueError, match="use one: block_size"):
        sampler([4, 6], block_size=4)
    with pytest.raises(ValueError, match="sum to 9"):
        DistributedShardSampler(Plain(), num_replicas=1, rank=0, shard_window=2, shard_sizes=[4, 5])
    with pytest.raises(ValueError, match=">= 0"):
        DistributedShardSampler(Plain(), num_replicas=1, rank=0, shard_window=2, shard_sizes=[12, -2])
    with pytest.raises(ValueError, match="only with shard_window"):
        DistributedShardSampler(Plain(), num_replicas=1, rank=0, shard_sizes=[4, 6])
    broken = Sharded([4, 6])
    broken.shard_starts = np.array([0, 7, 5])
    with pytest.raises(ValueError, match="not decrease"):
        DistributedShardSampler(broken, num_replicas=1, rank=0, shard_window=2)


# -- mode off: unchanged -----------------------------------------------------------------------


class Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


# Produced by the sampler before shard windows existed (seed 5, epoch 1, 23 samples, 2 ranks).
EXPECTED_BEFORE = [
    ({}, [[19, 8, 9, 1, 12, 11, 16, 21, 4, 5, 6, 0], [20, 15, 14, 17, 3, 2, 18, 7, 22, 13, 10, 19]]),
    ({"block_size": 4},
     [[2, 8, 5, 3, 6, 12, 10, 9, 7, 4, 11, 13], [19, 16, 18, 15, 21, 22, 20, 1, 0, 14, 17, 6]]),
    ({"shuffle": False, "block_size": 3},
     [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20], [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 0]]),
]
# sha256 of every rank's output over a grid of settings, from the same earlier sampler.
GRID_DIGEST_BEFORE = "9e22d7607dce7ee13fff0e83d56e61f9101ebdabcc57b27001a46a7711af66e5"


def test_mode_off_is_bit_for_bit_unchanged():
    for kw, expected in EXPECTED_BEFORE:
        got = []
        for r in range(2):
            s = DistributedShardSampler(Sized(23), num_replicas=2, rank=r, seed=5, shard_window=None, **kw)
            s.set_epoch(1)
            got.append(list(s))
        assert got == expected, kw
    digest = hashlib.sha256()
    for n in (0, 1, 7, 100, 257):
        for replicas in (1, 2, 3):
            for drop_last in (False, True):
                for shuffle in (False, True):
                    for block, window in ((1, None), (8, None), (8, 1), (16, 32)):
                        for epoch in (0, 2):
                            for r in range(replicas):
                                s = DistributedShardSampler(
                                    Sized(n), num_replicas=replicas, rank=r, shuffle=shuffle,
                                    drop_last=drop_last, block_size=block, window=window, seed=11,
                                    shard_window=None)
                                s.set_epoch(epoch)
                                digest.update(np.asarray(list(s), dtype=np.int64).tobytes())
                                digest.update(b"|")
    assert digest.hexdigest() == GRID_DIGEST_BEFORE
    state = DistributedShardSampler(Sized(23), num_replicas=2, rank=0, shard_window=None).state_dict(4)
    assert set(state) == {"version", "epoch", "seed", "shuffle", "drop_last", "dataset_len",
                          "block_size", "window", "order_replicas", "num_replicas", "consumed"}
    # a store dataset (it has shard_starts) stays in the per-index mode unless asked
    plain = DistributedShardSampler(Sharded([3, 4]), num_replicas=1, rank=0, seed=5)
    assert list(plain) == torch.randperm(7, generator=torch.Generator().manual_seed(5)).tolist()


def test_set_epoch_reaches_the_dataset_in_shard_mode():
    class Recorder(Sharded):
        def __init__(self, sizes):
            super().__init__(sizes)
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    ds = Recorder([3, 4, 5])
    s = DistributedShardSampler(ds, num_replicas=1, rank=0, shard_window=1)
    s.set_epoch(3)
    other = DistributedShardSampler(Recorder([3, 4, 5]), num_replicas=1, rank=0, shard_window=1)
    other.load_state_dict(s.state_dict(5))
    assert ds.epochs == [3] and other.dataset.epochs == [3] and len(other) == 12 and len(list(other)) == 7
