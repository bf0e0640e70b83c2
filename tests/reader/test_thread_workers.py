"""Thread workers (``fastdata.loader(..., worker_type="thread")``): exactly the batches of worker
processes for the same seed (order, random crops, labels, resume points, skips), built in
parallel by threads of this process, delivered in order, with errors raised at their batch.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from helpers.backends import NAME_SUFFIXES
from helpers.images import make_jpeg, make_tree
from test_dataset import _flip_payload_byte

import fastdata
from fastdata import transforms
from fastdata.fields import Image, Int, NDArray

SEED = 99
N = 40


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    """40 JPEGs of assorted sizes in 3 classes, one classification store per backend (4 shards each)."""
    root = tmp_path_factory.mktemp("threads")
    for i in range(N):
        make_jpeg(root / "src" / f"c{i % 3}" / f"{i:02d}.jpg", size=(36 + 2 * i, 28 + 3 * (i % 7)), seed=i)
    out = {}
    for backend, ext in NAME_SUFFIXES:
        out[backend] = str(root / f"s{ext}")
        fastdata.convert(str(root / "src"), out[backend], workers=1, progress=False, shard_size=10 * 2600)
    return out


def epochs_of(ds_factory, worker_type: str, workers: int = 2, epochs: int = 2, **kw) -> list:
    """Every batch of ``epochs`` epochs of a shuffled ``fastdata.loader``, as numpy copies."""
    loader = fastdata.loader(ds_factory(), batch_size=6, num_workers=workers, worker_type=worker_type, seed=SEED,
                             **kw)
    return [as_numpy(batch) for _ in range(epochs) for batch in loader]


def as_numpy(batch):
    if isinstance(batch, dict):
        return {k: as_numpy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [as_numpy(v) for v in batch]
    return batch.numpy().copy() if isinstance(batch, torch.Tensor) else batch


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("backend", [name for name, _ in NAME_SUFFIXES])
def test_threads_give_the_batches_of_processes(stores, backend):
    """Fused random crops, shuffled, two epochs, both backends: bit-identical to process workers."""
    def open_ds():
        return fastdata.open_dataset(stores[backend], decode=transforms.RandomResizedCrop(20), output="tensor")

    threads = epochs_of(open_ds, "thread")
    processes = epochs_of(open_ds, "process")
    assert len(threads) == len(processes) == 2 * -(-N // 6)
    assert_same(threads, processes)
    # control: the epochs differ (order and crops), so equal runs are not equal by accident
    first, second = threads[: len(threads) // 2], threads[len(threads) // 2:]
    assert not np.array_equal(first[0][0], second[0][0])
    labels = sorted(int(v) for _, y in first for v in y)
    assert labels == sorted(int(v) for v in fastdata.open_dataset(stores[backend]).targets)


def test_threads_give_the_batches_of_processes_for_sample_dicts(tmp_path):
    """A general store (image, int, array fields), transform per sample in the thread."""
    rng = np.random.default_rng(0)
    rows = [{"image": rng.integers(0, 255, (8 + i % 5, 10, 3), dtype=np.uint8), "label": i % 4,
             "vec": rng.standard_normal(3).astype(np.float32)} for i in range(30)]
    dst = str(tmp_path / "g.lmdb")
    fastdata.write(rows, dst, schema={"image": Image(), "label": Int(), "vec": NDArray("float32", (3,))},
                   progress=False)

    def open_ds():
        return fastdata.open_dataset(dst, output="numpy",
                                     transform=lambda s: {"image": s["image"][:8].copy(), "label": s["label"],
                                                          "vec": s["vec"] * 2})

    threads = epochs_of(open_ds, "thread")
    assert_same(threads, epochs_of(open_ds, "process"))


def test_threads_give_the_batches_of_processes_for_a_mix(stores):
    """A mix of both backends' stores: fixed-shape batches with each sample's source id (the split
    first batch is joined with its sources)."""
    def open_ds():
        return fastdata.mix({b: fastdata.open_dataset(stores[b], decode=transforms.CenterCrop(12), output="tensor")
                             for b in stores}, seed=4)

    threads = epochs_of(open_ds, "thread")
    assert len(threads[0]) == 3 and len(set(threads[0][2].tolist())) == 2  # (images, labels, sources)
    assert_same(threads, epochs_of(open_ds, "process"))


def test_the_first_batch_of_each_epoch_is_built_by_every_thread(tmp_path):
    """Each thread decodes a part of an epoch's first batch (its samples come from both threads), and
    the joined batch is the one a single thread gives; later batches are built whole, by one thread."""
    rows = [{"image": np.full((6, 6, 3), i, dtype=np.uint8), "label": i} for i in range(24)]
    dst = str(tmp_path / "g.lmdb")
    fastdata.write(rows, dst, schema={"image": Image(), "label": Int()}, progress=False)
    builders: dict[int, str] = {}

    def note(sample):
        time.sleep(0.01)  # long enough for both threads to be at work
        builders[int(sample["label"])] = threading.current_thread().name
        return sample

    def run(workers):
        loader = fastdata.loader(fastdata.open_dataset(dst, output="numpy", transform=note), batch_size=8,
                                 num_workers=workers, worker_type="thread", seed=SEED)
        batches = []
        for _ in range(2):
            builders.clear()
            epoch = [as_numpy(b) for b in loader]
            first, second = epoch[0]["label"].tolist(), epoch[1]["label"].tolist()
            if workers == 2:
                assert len({builders[i] for i in first}) == 2, "the first batch was not split"
                assert len({builders[i] for i in second}) == 1  # (the control: later batches are one thread's)
            batches += epoch
        return batches

    assert_same(run(2), run(1))


def test_resume_mid_epoch_with_two_threads(stores):
    """state_dict after 3 batches, a new loader resumes: the rest of the epoch, exactly."""
    def run(state=None, stop=None):
        ds = fastdata.open_dataset(stores["lmdb"], decode=transforms.RandomResizedCrop(16), output="tensor")
        loader = fastdata.loader(ds, batch_size=4, num_workers=2, worker_type="thread", seed=SEED)
        loader.set_epoch(1)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for batch in loader:
            out.append(as_numpy(batch))
            if len(out) == stop:
                return out, loader.state_dict()
        return out, loader.state_dict()

    full, _ = run()
    head, state = run(stop=3)
    assert state["epoch"] == 1 and state["batches"] == 3  # what was handed out, not what was prefetched
    tail, _ = run(state=state)
    assert_same(head + tail, full)
    assert len(tail) == len(full) - 3


def test_persistent_threads_keep_their_pool_and_batches(stores):
    names: list[set[str]] = []

    class Spy(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            names[-1].add(threading.current_thread().name)
            time.sleep(0.002)  # both threads get work
            return self.inner[i]

    def open_ds():
        return fastdata.open_dataset(stores["hdf5"], decode=transforms.CenterCrop(16), output="tensor")

    loader = fastdata.loader(Spy(open_ds()), batch_size=5, num_workers=2, worker_type="thread",
                             persistent_workers=True, shuffle=False)
    batches = []
    for _ in range(2):
        names.append(set())
        batches += [as_numpy(b) for b in loader]
    assert len(names[0]) == 2 and names[1] <= names[0]  # no new thread served the second epoch
    assert all(n.startswith("fastdata-loader") for n in names[0])
    plain = fastdata.loader(open_ds(), batch_size=5, num_workers=0, shuffle=False)
    assert_same(batches, [as_numpy(b) for _ in range(2) for b in plain])


class Probe(torch.utils.data.Dataset):
    """Items are their index; item ``fail_at`` raises; ``delay`` sleeps; counts items in flight."""

    def __init__(self, n=24, fail_at=None, delay=None, barrier=None):
        self.n, self.fail_at, self.delay, self.barrier = n, fail_at, delay, barrier
        self.lock = threading.Lock()
        self.started = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.started += 1
        if self.barrier is not None:
            self.barrier.wait()
        if self.delay is not None:
            time.sleep(self.delay(i))
        if i == self.fail_at:
            raise KeyError(f"sample {i} is missing")
        return i


def test_batches_come_in_order_whatever_order_threads_finish():
    ds = Probe(delay=lambda i: 0.02 * ((7 * i) % 5))  # later batches often finish first
    loader = fastdata.loader(ds, batch_size=3, num_workers=4, worker_type="thread", shuffle=False)
    assert [b.tolist() for b in loader] == [[i, i + 1, i + 2] for i in range(0, 24, 3)]


def test_threads_really_build_batches_at_once():
    """Two batches are in their threads at the same time (a barrier of 2 passes); with one thread
    (the control) the barrier times out."""
    loader = fastdata.loader(Probe(n=4, barrier=threading.Barrier(2, timeout=10)), batch_size=2, num_workers=2,
                             worker_type="thread", shuffle=False)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    single = fastdata.loader(Probe(n=4, barrier=threading.Barrier(2, timeout=0.5)), batch_size=2, num_workers=1,
                             worker_type="thread", shuffle=False)
    with pytest.raises(threading.BrokenBarrierError):
        list(single)


class OpThreads(torch.utils.data.Dataset):
    """Each sample is the number of threads torch's operators would use in the thread reading it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return torch.get_num_threads()


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch's own thread pool has one count for the process: the loader leaves it alone")
def test_loader_threads_run_operators_on_one_thread_and_the_training_thread_keeps_its_count():
    """As a worker process does (torch.set_num_threads(1)): two loader threads each spreading one
    small resize over every core spent twice the CPU for nothing. The training thread's count is
    what it was, before and after; a second pool (a new epoch) is set the same way."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loader = fastdata.loader(OpThreads(), batch_size=2, num_workers=2, worker_type="thread", shuffle=False)
        for _ in range(2):
            assert [b.tolist() for b in loader] == [[1, 1]] * 4
            assert torch.get_num_threads() == 2
        control = torch.utils.data.DataLoader(OpThreads(), batch_size=2)  # read in this thread: its count
        assert [b.tolist() for b in control] == [[2, 2]] * 4
    finally:
        torch.set_num_threads(before)


def test_prefetch_depth_is_bounded():
    ds = Probe(n=60)
    loader = fastdata.loader(ds, batch_size=2, num_workers=2, worker_type="thread", shuffle=False, prefetch_factor=3)
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.3)  # let the threads fill what they may
    # one batch handed out, then at most workers x prefetch = 6 batches in flight (12 samples)
    assert ds.started <= 2 + 12
    assert ds.started >= 2 + 2  # and the threads did work ahead
    assert len(list(iterator)) == 29


def test_an_error_is_raised_at_its_batch_with_its_type():
    loader = fastdata.loader(Probe(fail_at=10), batch_size=4, num_workers=2, worker_type="thread", shuffle=False)
    got = []
    with pytest.raises(KeyError, match="sample 10 is missing"):
        for batch in loader:
            got.append(batch.tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]  # every batch before the failing one was delivered
    assert [b.tolist() for b in fastdata.loader(Probe(), batch_size=4, num_workers=2, worker_type="thread",
                                                shuffle=False)][-1] == [20, 21, 22, 23]  # a new loader works


def test_timeout_bounds_the_wait_for_a_batch():
    loader = fastdata.loader(Probe(delay=lambda i: 2.0 if i == 4 else 0), batch_size=4, num_workers=1,
                             worker_type="thread", shuffle=False, timeout=0.5)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(iterator)


def test_skips_are_counted_from_threads(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 8, "b": 8}, size=(32, 24), seed=3)
    store = str(tmp_path / "s.lmdb")
    fastdata.convert(src, store, workers=1, progress=False)
    ds = fastdata.open_dataset(store)
    for victim in (2, 9, 13):
        with open(f"{src}/{ds.relpath(victim)}", "rb") as f:
            _flip_payload_byte(store, f.read())

    def run(worker_type):
        ds = fastdata.open_dataset(store, output="tensor", decode=transforms.CenterCrop(16), on_error="skip")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            batches = [as_numpy(b) for b in fastdata.loader(ds, batch_size=3, num_workers=2, worker_type=worker_type,
                                                            seed=SEED)]
        return batches, ds.skipped

    threads, skipped = run("thread")
    assert skipped == 3
    processes, skipped_in_processes = run("process")
    assert skipped_in_processes == 3
    assert_same(threads, processes)


def test_worker_init_fn_runs_once_per_thread_and_seed_worker_not_at_all():
    seen = []
    loader = fastdata.loader(Probe(n=40, delay=lambda i: 0.01), batch_size=2, num_workers=3, worker_type="thread",
                             shuffle=False, worker_init_fn=seen.append)
    list(loader)
    assert sorted(seen) == [0, 1, 2]
    # the default worker_init_fn (fastdata.seed_worker) would reseed this process's generators
    np.random.seed(5)
    expected = np.random.random()
    np.random.seed(5)
    list(fastdata.loader(Probe(), batch_size=4, num_workers=2, worker_type="thread",
                         worker_init_fn=fastdata.seed_worker))
    assert np.random.random() == expected


def test_shared_shard_readers_under_a_cap_of_one(stores):
    """Four threads read a 4-shard store whose readers are capped at one open shard: a reader is never
    closed under another thread, and every sample reads back as in one thread."""
    ds = fastdata.open_dataset(stores["lmdb"], output="numpy", max_open_shards=1)
    assert len(ds.shard_starts) >= 4
    expected = [ds[i][0].tobytes() for i in range(N)]
    order = np.random.default_rng(0).permutation(N).tolist() * 3
    fresh = fastdata.open_dataset(stores["lmdb"], output="numpy", max_open_shards=1)
    loader = fastdata.loader(fresh, batch_size=1, num_workers=4, worker_type="thread", sampler=order,
                             collate_fn=lambda b: b[0])
    got = [img.tobytes() for img, _ in loader]
    assert got == [expected[i] for i in order]


def test_ended_threads_do_not_keep_shards_open(stores):
    """Each epoch's pool has new threads; once they have ended, the cap holds again for the next reads
    (a dead thread's last shard is not one it may still be reading)."""
    ds = fastdata.open_dataset(stores["lmdb"], output="numpy", max_open_shards=1)
    loader = fastdata.loader(ds, batch_size=1, num_workers=2, worker_type="thread", seed=SEED,
                             collate_fn=lambda b: b[0])
    for _ in range(3):
        for _sample in loader:
            pass
    for thread in threading.enumerate():
        if thread.name.startswith("fastdata-loader"):
            thread.join(timeout=10)
    for start in ds.shard_starts.tolist():  # one read in each shard, from this thread
        ds[start]
    assert len(ds._shards.open_readers()) == 1


def test_hdf5_reads_do_not_wait_on_h5pys_global_lock(stores, tmp_path):
    """With h5py's global lock held by this thread, another thread still reads and decodes every sample
    of an HDF5 store whose shards are open (payloads are read through a map of their known offsets);
    the control, a read through h5py, waits for the lock."""
    import h5py
    from h5py._objects import phil  # the lock every h5py call takes

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    ds = fastdata.open_dataset(stores["hdf5"], output="numpy")
    expected = [ds[i][0].tobytes() for i in range(N)]  # every shard opened, its index read
    got: list = []

    def read_all():
        got.extend(ds[i][0].tobytes() for i in range(N))

    def read_with_h5py():
        with h5py.File(other, "r") as f:
            got.append(int(f["x"][2]))

    with phil:
        reader = threading.Thread(target=read_all)
        reader.start()
        reader.join(timeout=20)
        assert not reader.is_alive(), "reading waited for h5py's lock"
        control = threading.Thread(target=read_with_h5py)
        control.start()
        control.join(timeout=0.5)
        assert control.is_alive()  # h5py itself waits for the lock
    control.join(timeout=20)
    assert got == [*expected, 2]


def test_refusals():
    with pytest.raises(ValueError, match="worker_type must be one of 'process', 'thread'"):
        fastdata.loader(Probe(), worker_type="threads")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="needs a map-style dataset"):
        fastdata.loader(Stream(), batch_size=2, num_workers=2, worker_type="thread", shuffle=None,
                        sampler=None)
