"""The shard cache on its own (no server): fork safety of its locks, and the filesystem per environment."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import sys
import threading
import time

import pytest
import xxhash

from fastdata.remote.cache import ShardCache
from fastdata.remote.location import RemoteLocation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and fork are Linux here")


def _writer(data: bytes, before=None):
    """A download function that writes ``data`` (after ``before()``, when given)."""
    def download(part: str) -> str:
        if before is not None:
            before()
        with open(part, "r+b") as fh:
            fh.write(data)
        return xxhash.xxh3_64(data).hexdigest()
    return download


def _start_idle_child():
    """A forked child that idles like a persistent DataLoader worker; returned once it runs."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_idle, args=(ready,))
    child.start()
    assert ready.wait(30)
    return child


def _idle(ready) -> None:
    ready.set()
    time.sleep(60)


def test_a_process_forked_mid_download_does_not_keep_the_locks(tmp_path):
    """A DataLoader forks its workers while a prefetch thread of the main process downloads:
    the workers must not keep that download's lock or pin (flock locks belong to the open
    file, which fork shares), or the shard could never be evicted or downloaded again while
    they live."""
    cache = ShardCache(str(tmp_path / "cache"))
    data = os.urandom(4096)
    started, go = threading.Event(), threading.Event()
    pins = []

    def hold():
        started.set()
        go.wait(30)
    thread = threading.Thread(target=lambda: pins.append(cache.acquire(
        "k", "shard-0", size=len(data), xxh=xxhash.xxh3_64(data).hexdigest(), download=_writer(data, hold))))
    thread.start()
    assert started.wait(30)
    child = _start_idle_child()
    try:
        go.set()
        thread.join(30)
        pins[0].release()
        lock = os.path.join(cache.root, "k", "locks", "shard-0.lock")
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: the child still holds it
        finally:
            os.close(fd)
        assert cache.clear("k") == (1, 0), "the forked child still pins the shard"
    finally:
        child.kill()
        child.join()


def test_a_process_forked_while_a_pin_is_held_does_not_keep_it(tmp_path):
    """The same for a pin the parent holds at fork time and releases afterwards (control of
    the pin half: while the parent holds it, the shard is kept)."""
    cache = ShardCache(str(tmp_path / "cache"))
    data = os.urandom(4096)
    pin = cache.acquire("k", "shard-0", size=len(data), xxh=xxhash.xxh3_64(data).hexdigest(), download=_writer(data))
    child = _start_idle_child()
    try:
        assert cache.clear("k") == (0, 1)  # control: a live holder keeps it
        pin.release()
        assert cache.clear("k") == (1, 0), "the forked child still pins the shard"
    finally:
        child.kill()
        child.join()


def test_filesystem_follows_the_endpoint_in_the_environment(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    first = RemoteLocation("s3://bucket/store").filesystem()
    assert RemoteLocation("s3://bucket/store").filesystem() is first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    second = RemoteLocation("s3://bucket/store").filesystem()
    assert second is not first  # remade: its client will be created for the new endpoint
