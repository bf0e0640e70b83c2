"""``ShardHandles`` (fastdata.reader.shards) on its own: opened lazily per process, reopened
after a fork without touching the parent's, dropped by pickling, capped LRU, closed with
their cache pins released. Each behaviour has a control where one is cheap."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading

import pytest
from helpers.backends import NAME_SUFFIXES
from helpers.images import make_tree

import fastdata
from fastdata.format.backends.base import StorageSpec
from fastdata.reader import shards as shards_module
from fastdata.reader.shards import ShardHandles
from fastdata.remote.store import StoreLocation

BACKENDS = dict(NAME_SUFFIXES)


class CountedPins(StoreLocation):
    """A local store whose shards come with pins that count their releases (as a remote
    store's cache pins would), and a chosen default cap."""

    def __init__(self, root: str, default_cap: int | None = None):
        super().__init__(root)
        self.default_cap = default_cap
        self.acquired: list[int] = []
        self.released: list[int] = []
        self.asked: list[int] = []  # open_shards_per_process's arguments, one per question

    def open_shard(self, shard, release_idle=None):
        path, _ = super().open_shard(shard)
        self.acquired.append(shard)
        return path, _Pin(self, shard)

    def open_shards_per_process(self, processes=1):
        self.asked.append(processes)
        return self.default_cap


class _Pin:
    def __init__(self, store: CountedPins, shard: int):
        self.store, self.shard = store, shard

    def release(self) -> None:
        self.store.released.append(self.shard)


def _handle(reader):
    """The reader's OS-level object (None once closed)."""
    return reader.env if hasattr(reader, "env") else reader.file


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def store(request, tmp_path_factory) -> str:
    """A store of four or more shards."""
    base = tmp_path_factory.mktemp("shards")
    src = make_tree(base / "tree", {"ant": 6, "bee": 6}, size=(24, 20), seed=3)
    dst = str(base / f"s{BACKENDS[request.param]}")
    fastdata.convert(src, dst, workers=1, progress=False, shard_size=3000)
    assert len(StoreLocation(dst).manifest["shards"]) >= 4
    return dst


def handles(store: str, **kw) -> ShardHandles:
    location = kw.pop("location", None) or StoreLocation(store)
    manifest = location.manifest
    return ShardHandles(location, manifest["backend"], StorageSpec.from_json(manifest["storage"]),
                        readahead=False, **kw)


def test_nothing_opens_until_asked_and_a_reader_is_reused(store):
    h = handles(store)
    assert h.open_readers() == {}
    reader = h.get(1)
    assert reader.get(0)  # a real, working reader
    assert h.get(1) is reader  # reused, not reopened
    assert list(h.open_readers()) == [1]
    h.close()


def test_the_cap_closes_the_least_recently_used_reader(store):
    pins = CountedPins(store)
    h = handles(store, location=pins, max_open=2)
    first, second = h.get(0), h.get(1)
    h.get(0)  # 0 is now the most recently used
    h.get(2)  # over the cap: 1 goes
    assert list(h.open_readers()) == [0, 2]
    assert _handle(second) is None and _handle(first) is not None
    assert pins.released == [1]
    h.close()
    # control: without a cap (the local store's default) every reader stays open
    pins = CountedPins(store)
    h = handles(store, location=pins)
    for shard in range(4):
        h.get(shard)
    assert list(h.open_readers()) == [0, 1, 2, 3] and pins.released == []
    h.close()


def test_the_store_default_cap_applies_when_none_is_given(store):
    h = handles(store, location=CountedPins(store, default_cap=1))
    h.get(0)
    h.get(1)
    assert list(h.open_readers()) == [1]
    h.close()
    # control: an explicit max_open wins over the store's default
    h = handles(store, location=CountedPins(store, default_cap=1), max_open=3)
    for shard in range(3):
        h.get(shard)
    assert list(h.open_readers()) == [0, 1, 2]
    h.close()


def test_close_closes_every_reader_releases_every_pin_and_reads_reopen(store):
    pins = CountedPins(store)
    h = handles(store, location=pins)
    readers = [h.get(0), h.get(3)]
    h.close()
    assert all(_handle(r) is None for r in readers)
    assert sorted(pins.released) == sorted(pins.acquired) == [0, 3]
    assert h.open_readers() == {}
    again = h.get(0)
    assert again is not readers[0] and again.get(0)
    h.close()


def test_pickling_drops_the_readers(store):
    h = handles(store)
    reader = h.get(2)
    with pytest.raises(TypeError):  # control: a reader's OS handle cannot travel in a pickle
        pickle.dumps(_handle(reader))
    copy = pickle.loads(pickle.dumps(h))
    assert copy.open_readers() == {} and copy._readers == {} and copy._pins == {}
    assert copy.get(2) is not reader and copy.get(2).get(0) == reader.get(0)
    assert h.open_readers() == {2: reader}  # the original keeps its own
    copy.close()
    h.close()


def _in_child(h: ShardHandles, parent_ids: tuple[int, int], close_first: bool, out) -> None:
    if close_first:
        h.close()  # in a child: forgets the parent's readers without closing them
    reader = h.get(0)
    data = reader.get(0)
    out.put((id(reader) in parent_ids or id(_handle(reader)) in parent_ids, list(h.open_readers()), data))
    h.close()  # the child's own reader


@pytest.mark.parametrize("close_first", [False, True])
def test_a_forked_child_opens_its_own_reader_and_leaves_the_parents_alone(store, close_first):
    h = handles(store)
    parent = h.get(0)
    parent_ids = (id(parent), id(_handle(parent)))
    want = parent.get(0)
    assert h.get(0) is parent  # control: no fork, no reopening
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(h, parent_ids, close_first, out))
    child.start()
    reused, open_in_child, data = out.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert not reused and open_in_child == [0] and data == want
    # the parent's reader is still its own, open and reading
    assert h.get(0) is parent and _handle(parent) is not None and parent.get(0) == want
    h.close()


def test_threads_whose_first_reads_meet_take_the_process_over_once(store, monkeypatch):
    """A process's first read takes the handles over (a fresh lock, marks and readers, and the
    cap); loader threads make their first reads together, and only one may do it. Two that both
    did would each install their own lock, marks and readers, so a reader one thread opened and is
    reading could be closed under its read by the other's cap (seen once as "operation forbidden
    on released memoryview" on free-threaded Python). Each thread's first look at the process id
    waits here until all have looked, so all find the handles not yet taken over; the take-over
    asks the store its cap once, and the test counts those questions (control: the code without
    the lock around the take-over asked once per thread)."""
    threads = 4
    for _ in range(5):
        location = CountedPins(store, default_cap=8)
        h = handles(store, location=location)
        met = threading.Barrier(threads)
        looked: set[int] = set()

        def first_look_waits_for_all(met=met, looked=looked) -> int:
            me = threading.get_ident()
            if me not in looked:
                looked.add(me)
                met.wait(timeout=10)
            return os.getpid()

        monkeypatch.setattr(shards_module, "getpid", first_look_waits_for_all)
        got: dict[int, object] = {}

        def first_read(shard: int, h=h, got=got) -> None:
            got[shard] = h.get(shard)

        workers = [threading.Thread(target=first_read, args=(shard,)) for shard in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        monkeypatch.undo()
        assert len(got) == threads, "a thread's first read failed"
        assert location.asked == [1], f"the process was taken over {len(location.asked)} times"
        open_now = h.open_readers()
        assert sorted(open_now) == list(range(threads))
        assert all(open_now[shard] is reader and _handle(reader) is not None for shard, reader in got.items())
        h.close()
