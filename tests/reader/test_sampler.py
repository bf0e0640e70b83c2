"""DistributedShardSampler: DistributedSampler parity, partitions, block shuffling, resume."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from fastdata.reader.sampler import DistributedShardSampler


class Sized:
    """Stand-in dataset: the sampler only needs len()."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def outputs(n: int, replicas: int, epoch: int = 0, **kw) -> list[list[int]]:
    """Every rank's indices for one epoch."""
    result = []
    for rank in range(replicas):
        s = DistributedShardSampler(Sized(n), num_replicas=replicas, rank=rank, **kw)
        s.set_epoch(epoch)
        result.append(list(s))
    return result


def interleave(per_rank: list[list[int]]) -> list[int]:
    """The rank-interleaved global order: position k*R + r is rank r's k-th index."""
    return [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(len(per_rank))]


def load(n: int, replicas: int, state: dict, **kw) -> list[list[int]]:
    """Every rank's output after loading ``state`` into fresh samplers."""
    result = []
    for rank in range(replicas):
        s = DistributedShardSampler(Sized(n), num_replicas=replicas, rank=rank, **kw)
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])  # the usual training-loop call must keep the resume point
        result.append(list(s))
        # len() stays the whole epoch (frameworks size every later epoch from it); the resumed
        # iterator yields at most that many: the rest of this epoch
        assert len(s) == -(-n // replicas) if not kw.get("drop_last") else n // replicas
        assert len(result[-1]) <= len(s)
    return result


def is_cyclic_run(values: list[int], n: int) -> bool:
    return all((b - a) % n == 1 for a, b in zip(values, values[1:], strict=False))


# -- DistributedSampler parity ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 10, 11, 100])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_block1_equals_distributed_sampler(n, replicas, drop_last, shuffle):
    for epoch, seed in [(0, 0), (3, 17)]:
        for rank in range(replicas):
            kw = dict(num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                      drop_last=drop_last)
            ref = DistributedSampler(Sized(n), **kw)
            ours = DistributedShardSampler(Sized(n), **kw)
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)
            assert (ours.num_samples, ours.total_size) == (ref.num_samples, ref.total_size)


# -- partitions ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("n", [3, 20, 31, 103])
def test_partition_padding(n, replicas, block_size):
    per_rank = outputs(n, replicas, block_size=block_size, seed=5)
    sizes = {len(p) for p in per_rank}
    assert sizes == {-(-n // replicas)}
    counts = Counter(i for p in per_rank for i in p)
    assert set(counts) == set(range(n))
    pad = sum(len(p) for p in per_rank) - n
    duplicated = sorted(i for i, c in counts.items() if c == 2)
    assert len(duplicated) == pad and max(counts.values()) <= 2
    if block_size == 1:
        # Padding repeats the start of the epoch's permutation.
        g = torch.Generator()
        g.manual_seed(5)
        assert duplicated == sorted(torch.randperm(n, generator=g).tolist()[:pad])
    else:
        # ... which in block mode is the start of the first block, rank 0's first indices
        # when the window shuffle is off (the window only reorders within a rank).
        unmixed = outputs(n, replicas, block_size=block_size, seed=5, window=1)
        assert duplicated == sorted(unmixed[0][:pad])
        assert is_cyclic_run(unmixed[0][:pad], n)


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("n", [2, 20, 31, 103])
def test_partition_drop_last(n, replicas, block_size):
    per_rank = outputs(n, replicas, block_size=block_size, drop_last=True)
    assert {len(p) for p in per_rank} == {n // replicas}
    flat = [i for p in per_rank for i in p]
    assert len(set(flat)) == len(flat) == n - n % replicas


def test_too_few_samples_pad_by_repetition():
    per_rank = outputs(2, 5, block_size=4)
    assert all(len(p) == 1 for p in per_rank)
    assert Counter(i for p in per_rank for i in p) in (Counter({0: 3, 1: 2}),
                                                       Counter({1: 3, 0: 2}))


def test_empty_dataset():
    s = DistributedShardSampler(Sized(0), num_replicas=2, rank=1, block_size=8)
    assert len(s) == 0 and list(s) == []


# -- epochs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 8])
def test_set_epoch_is_deterministic(block_size):
    a = outputs(500, 2, epoch=1, block_size=block_size)
    assert a == outputs(500, 2, epoch=1, block_size=block_size)
    assert a != outputs(500, 2, epoch=2, block_size=block_size)
    assert a != outputs(500, 2, epoch=1, block_size=block_size, seed=1)
    s = DistributedShardSampler(Sized(500), num_replicas=2, rank=0, block_size=block_size)
    s.set_epoch(1)
    assert list(s) == list(s) == a[0]


# -- block shuffling -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 16, 64])
@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 1000, 1001])
def test_block_shuffle_is_a_permutation(n, block_size):
    for epoch in range(3):
        (single,) = outputs(n, 1, epoch=epoch, block_size=block_size)
        assert sorted(single) == list(range(n))
    if n % 4 == 0:
        per_rank = outputs(n, 4, block_size=block_size)
        assert sorted(i for p in per_rank for i in p) == list(range(n))


@pytest.mark.parametrize("replicas", [1, 3])
def test_ranks_read_whole_blocks(replicas):
    n, block = 1000, 16
    for rank_stream in outputs(n, replicas, block_size=block, window=1):
        full = len(rank_stream) // block
        assert full > 0
        for k in range(full):
            chunk = rank_stream[k * block:(k + 1) * block]
            assert is_cyclic_run(chunk, n), chunk
    # Control: per-index shuffling has almost no storage-adjacent neighbours.
    (plain,) = outputs(n, 1)
    assert sum(b - a == 1 for a, b in zip(plain, plain[1:], strict=False)) < 0.05 * n


def test_block_offset_varies_between_epochs():
    # Which samples share a block changes with the epoch (random cut offset).
    starts = set()
    for epoch in range(8):
        (stream,) = outputs(1000, 1, epoch=epoch, block_size=16, window=1)
        starts.add(min(stream[k] for k in range(0, 992, 16)) % 16)
    assert len(starts) > 1


@pytest.mark.parametrize("window", [2, 16, 64])
def test_window_moves_indices_less_than_window(window):
    n, block = 2000, 16
    for base, mixed in zip(outputs(n, 2, block_size=block, window=1),
                           outputs(n, 2, block_size=block, window=window), strict=False):
        assert mixed != base and sorted(mixed) == sorted(base)
        where = {index: pos for pos, index in enumerate(base)}
        shifts = [abs(where[index] - pos) for pos, index in enumerate(mixed)]
        assert max(shifts) < window
        assert max(shifts) >= window // 2


def test_default_window_and_validation():
    s = DistributedShardSampler(Sized(10), num_replicas=1, rank=0, block_size=8)
    assert s.window == 32
    for bad in [dict(block_size=0), dict(block_size=2.0), dict(block_size=4, window=0),
                dict(window=4), dict(seed="1")]:
        with pytest.raises(ValueError):
            DistributedShardSampler(Sized(10), num_replicas=1, rank=0, **bad)


def test_shuffle_false_block_mode_is_storage_order_dealt():
    assert outputs(12, 2, shuffle=False, block_size=3) == [[0, 1, 2, 6, 7, 8],
                                                            [3, 4, 5, 9, 10, 11]]


# -- world defaults --------------------------------------------------------------------------


def test_world_defaults_without_process_group():
    assert not torch.distributed.is_initialized()
    s = DistributedShardSampler(Sized(10))
    assert (s.num_replicas, s.rank) == (1, 0)
    # resolved when used, not made: the process group may not exist yet when the sampler is made
    unresolved = DistributedShardSampler(Sized(10), num_replicas=2)
    with pytest.raises(ValueError, match="rank is required"):
        list(unresolved)
    for replicas, rank in [(2, 2), (2, -1), (0, 0)]:
        with pytest.raises(ValueError):
            DistributedShardSampler(Sized(10), num_replicas=replicas, rank=rank)


# -- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_same_world_continues_each_rank(replicas, block_size, drop_last):
    n = 301
    kw = dict(block_size=block_size, drop_last=drop_last, seed=3)
    full = outputs(n, replicas, epoch=2, **kw)
    for k in [0, 1, 17, len(full[0]) - 1, len(full[0])]:
        ref = DistributedShardSampler(Sized(n), num_replicas=replicas, rank=0, **kw)
        ref.set_epoch(2)
        state = ref.state_dict(k * replicas)
        resumed = load(n, replicas, state, **kw)
        assert resumed == [p[k:] for p in full]


def check_resume_across(n, old, new, kw, k_old):
    """Resume after every one of ``old`` ranks consumed ``k_old``; return new outputs."""
    before = outputs(n, old, epoch=1, **kw)
    order = interleave(before)
    consumed = k_old * old
    sampler = DistributedShardSampler(Sized(n), num_replicas=old, rank=1, **kw)
    sampler.set_epoch(1)
    state = json.loads(json.dumps(sampler.state_dict(consumed)))
    after = load(n, new, state, **kw)
    assert len({len(p) for p in after}) == 1
    remainder = order[consumed:]
    produced = Counter(i for p in after for i in p)
    padding = produced - Counter(remainder)
    # Everything not yet consumed comes exactly once (drop_last may cut < new items) ...
    missing = Counter(remainder) - produced
    if kw.get("drop_last"):
        assert sum(missing.values()) < new and not padding
    else:
        assert not missing
        assert sum(padding.values()) < new
        assert sorted(padding.elements()) == sorted(remainder[:sum(padding.values())])
    # ... in this exact global order: lockstep consumption again takes a prefix of it.
    total = sum(len(p) for p in after)
    cycled = (remainder * (total // max(len(remainder), 1) + 1))
    assert interleave(after) == (remainder + cycled)[:total]
    seen = set(order[:consumed])
    # Consumed and resumed indices overlap only by padding (the old world's and the new one's).
    assert len(seen & set(produced)) <= max(len(order) - n, 0) + sum(padding.values())
    if not kw.get("drop_last"):
        assert seen | set(produced) == set(range(n))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_on_other_world_size(old, new, block_size, drop_last):
    kw = dict(block_size=block_size, drop_last=drop_last)
    for n in (100, 257):
        for k_old in (1, 10, n // old // 2):
            check_resume_across(n, old, new, kw, k_old)


def test_resume_chain_2_3_2():
    n, kw = 211, dict(block_size=8)
    first = interleave(outputs(n, 2, epoch=1, **kw))
    state = DistributedShardSampler(Sized(n), num_replicas=2, rank=0, **kw)
    state.set_epoch(1)
    s1 = state.state_dict(40)
    mid = load(n, 3, s1, **kw)
    assert interleave(mid) == first[40:] + first[40:42]  # 172 left, padded to 3 x 58
    # Each of the 3 ranks consumes 9 more: 40 + 27 samples of the epoch are done.
    s3 = DistributedShardSampler(Sized(n), num_replicas=3, rank=2, **kw)
    s3.load_state_dict(s1)
    it = iter(s3)
    for _ in range(9):
        next(it)
    s2 = s3.state_dict()
    assert s2["consumed"] == 67 and s2["order_replicas"] == 2
    last = load(n, 2, s2, **kw)
    assert sorted(i for p in last for i in p) == sorted(first[67:] + first[67:68])
    assert set(first[:67]) | {i for p in last for i in p} == set(range(n))


def test_state_dict_tracks_iteration_and_epoch_end():
    n = 50
    s = DistributedShardSampler(Sized(n), num_replicas=2, rank=0, block_size=4)
    assert s.state_dict()["consumed"] == 0
    it = iter(s)
    taken = [next(it) for _ in range(7)]
    assert s.state_dict()["consumed"] == 14
    rest = list(it)
    assert taken + rest == outputs(n, 2, block_size=4)[0]
    done = s.state_dict()
    assert done["consumed"] == 50
    fresh = DistributedShardSampler(Sized(n), num_replicas=3, rank=0, block_size=4)
    fresh.load_state_dict(done)
    assert len(fresh) == len(outputs(n, 3, epoch=0, block_size=4)[0]) and list(fresh) == []
    fresh.set_epoch(1)
    assert list(fresh) == outputs(n, 3, epoch=1, block_size=4)[0]
    # A completed iteration restarts the same epoch from its beginning, like DistributedSampler.
    assert list(s) == taken + rest


def test_set_epoch_other_epoch_drops_resume_point():
    s = DistributedShardSampler(Sized(40), num_replicas=2, rank=1)
    s.load_state_dict(DistributedShardSampler(Sized(40), num_replicas=2, rank=0).state_dict(10))
    assert len(s) == 20 and len(list(s)) == 15  # len() the whole epoch, iteration the rest
    s.load_state_dict(DistributedShardSampler(Sized(40), num_replicas=2, rank=0).state_dict(10))
    s.set_epoch(0)
    assert len(s) == 20 and len(list(s)) == 15
    s.load_state_dict(DistributedShardSampler(Sized(40), num_replicas=2, rank=0).state_dict(10))
    s.set_epoch(1)
    assert len(s) == 20 and s.state_dict()["consumed"] == 0 and len(list(s)) == 20


def test_zero_consumed_state_starts_fresh_layout():
    n, kw = 100, dict(block_size=8)
    src = DistributedShardSampler(Sized(n), num_replicas=2, rank=0, **kw)
    src.set_epoch(4)
    assert load(n, 3, src.state_dict(), **kw) == outputs(n, 3, epoch=4, **kw)


def test_state_json_round_trip_and_validation():
    s = DistributedShardSampler(Sized(30), num_replicas=3, rank=0, block_size=4, window=8,
                                seed=9, drop_last=True)
    s.set_epoch(5)
    state = s.state_dict(12)
    assert json.loads(json.dumps(state)) == state
    assert state["epoch"] == 5 and state["consumed"] == 12 and state["dataset_len"] == 30
    kw = dict(block_size=4, window=8, seed=9, drop_last=True)
    other = DistributedShardSampler(Sized(30), num_replicas=2, rank=0, **kw)
    other.load_state_dict(json.loads(json.dumps(state)))
    assert other.state_dict()["consumed"] == 12 and other.epoch == 5
    bad_states = [dict(state, version=2), dict(state, seed=1), dict(state, dataset_len=31),
                  dict(state, block_size=8), dict(state, consumed=31), dict(state, consumed=-1),
                  dict(state, consumed="3"), {k: v for k, v in state.items() if k != "epoch"},
                  [1, 2]]
    for bad in bad_states:
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
    for bad_count in (-1, 1.5, 30 + 3):
        with pytest.raises(ValueError):
            s.state_dict(bad_count)
    assert s.state_dict(31)["consumed"] == 30  # padding past the end = epoch complete


def test_works_with_dataloader():
    data = Sized(37)
    s = DistributedShardSampler(data, num_replicas=2, rank=1, block_size=4)
    loader = DataLoader(data, batch_size=5, sampler=s)
    assert len(loader) == 4
    assert torch.cat(list(loader)).tolist() == outputs(37, 2, block_size=4)[1]


# -- real process group ----------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=world)
    try:
        s = DistributedShardSampler(Sized(101), block_size=4)  # world/rank from the group
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, list(s))
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump({"replicas": s.num_replicas, "per_rank": gathered}, f)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_two_ranks_default_world(tmp_path):
    torch.multiprocessing.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)),
                                nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["replicas"] == 2
    assert result["per_rank"] == outputs(101, 2, block_size=4)


class EpochRecorder(Sized):
    """A dataset that, like fastdata's, takes the epoch for its random crops."""

    def __init__(self, n: int):
        super().__init__(n)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_and_load_state_dict_tell_the_dataset():
    ds = EpochRecorder(10)
    sampler = DistributedShardSampler(ds, num_replicas=1, rank=0)
    sampler.set_epoch(4)
    state = sampler.state_dict(consumed=3)
    other = DistributedShardSampler(EpochRecorder(10), num_replicas=1, rank=0)
    other.load_state_dict(state)
    assert ds.epochs == [4] and other.dataset.epochs == [4]
    DistributedShardSampler(Sized(10), num_replicas=1, rank=0).set_epoch(2)  # no set_epoch: nothing to tell
