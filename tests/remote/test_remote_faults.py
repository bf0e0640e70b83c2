"""Faults of remote stores, against a real S3 server (SeaweedFS, see tests/helpers/s3server.py).

Each test names the promise of docs/RELIABILITY.md ("Remote stores") it checks, and
where it can, a control shows the check would see the failure: a counter that counts,
a pin that does block eviction, a ``.part`` file that is really there before it is cleaned.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import xxhash
from helpers.backends import first_in_ci
from helpers.images import make_tree
from helpers.procs import reaped
from test_remote_read import upload_store

import fastdata
from fastdata.errors import CacheFullError, CorruptRecordError, RemoteStoreError
from fastdata.remote import location as location_module
from fastdata.remote.location import RemoteLocation
from fastdata.remote.store import RemoteStore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and tmpfs are Linux here")


# -- helpers ------------------------------------------------------------------------------------

def make_store(tmp_path, name: str, classes: dict, size=(64, 48), shard_size="64MB", seed=0) -> str:
    """A published local LMDB store converted from a fresh tree; returns its path."""
    tree = make_tree(tmp_path / f"{name}-tree", classes, size=size, seed=seed)
    local = str(tmp_path / f"{name}.lmdb")
    fastdata.convert(tree, local, shard_size=shard_size, progress=False, workers=1)
    return local


def big_store(tmp_path, name="big") -> str:
    """One shard of about 3 MB (20 photo-like 640x480 JPEGs)."""
    return make_store(tmp_path, name, {"a": 10, "b": 10}, size=(640, 480))


def samples(ds) -> list[tuple[bytes, int]]:
    """Every sample of ``ds`` as (pixel bytes, label)."""
    out = []
    for i in range(len(ds)):
        img, label = ds[i]
        out.append((np.asarray(img).tobytes(), int(label)))
    return out


def shard_files(cache_dir: str) -> dict[str, list[str]]:
    """``{store key: sorted names in its shards/ folder}`` (finished shards and ``.part`` files)."""
    out = {}
    if not os.path.isdir(cache_dir):
        return out
    for key in sorted(os.listdir(cache_dir)):
        d = os.path.join(cache_dir, key, "shards")
        if os.path.isdir(d):
            out[key] = sorted(os.listdir(d))
    return out


def assert_only_verified_shards(cache_dir: str, local: str) -> None:
    """Every file in the cache's shards/ folders is a whole shard whose bytes equal the local store's."""
    for key, names in shard_files(cache_dir).items():
        for name in names:
            assert ".part" not in name, f"{key}/shards/{name}: a download in progress was left behind"
            with open(os.path.join(cache_dir, key, "shards", name), "rb") as cached, \
                    open(os.path.join(local, name), "rb") as orig:
                assert xxhash.xxh3_64(cached.read()).hexdigest() == xxhash.xxh3_64(orig.read()).hexdigest(), name


def count_downloads(monkeypatch) -> list[str]:
    """Record each shard download this process starts (the list of names grows)."""
    calls: list[str] = []
    orig = RemoteLocation.download

    def counted(self, name, out_path, expected_size):
        calls.append(name)
        return orig(self, name, out_path, expected_size)
    monkeypatch.setattr(RemoteLocation, "download", counted)
    return calls


# -- the server killed mid-download --------------------------------------------------------------

@pytest.fixture
def lone_s3(tmp_path, monkeypatch):
    """A SeaweedFS server of this test alone (the test kills it), with a bucket; yields
    ``(server, "s3://bucket")``. Killed at the end whatever state the test left it in."""
    from helpers.s3server import lone_server

    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "fastdata-cache"))
    yield from lone_server(tmp_path, monkeypatch, "faults")


class _WrappedFile:
    """A file object standing in for ``fh``: everything it does not override goes to ``fh``."""

    def __init__(self, fh):
        self._fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def __getattr__(self, name):
        return getattr(self._fh, name)


class _HookedAsyncFile:
    """An async file object of the remote filesystem (what its ``open_async`` gives) that calls
    ``hook`` once, after its first read; everything else goes to ``f``."""

    def __init__(self, f, hook):
        self._f, self._hook, self._reads = f, hook, 0

    async def read(self, n=-1):
        data = await self._f.read(n)
        self._reads += 1
        if self._reads == 1:
            self._hook()
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)


def hook_first_shard_block(monkeypatch, url: str, hook) -> None:
    """Run ``hook`` once, after the first read of the first shard download of the store at ``url``
    (at most 256 KiB; the rest is still on the server), where that read ends: in the filesystem's
    event loop. An s3 object is read as one streamed GET through the filesystem's ``open_async``
    (fsspec's public call), which is wrapped on the filesystem this process reads ``url`` with
    (:meth:`RemoteLocation.filesystem`: one per process, options and environment)."""
    monkeypatch.setattr(location_module, "BLOCK", 256 << 10)
    done = []
    fs = RemoteLocation(url).filesystem()
    real_open = fs.open_async

    async def open_async(path, mode="rb", **kwargs):
        f = await real_open(path, mode, **kwargs)
        if "shard-" in path and not done:
            done.append(path)
            return _HookedAsyncFile(f, hook)
        return f
    monkeypatch.setattr(fs, "open_async", open_async)


def test_a_connection_dropped_mid_download_is_retried_within_the_one_download(s3, tmp_path, monkeypatch):
    """The CI form of the server-restart test below (nightly, 30 s of SeaweedFS recovery): the
    connection drops after the first block of the shard (an OSError from the stream, as a dying
    server gives) and the same download's next attempt fetches the whole shard, verified."""
    _, bucket = s3
    ds, local = _big_remote_store(bucket, tmp_path, monkeypatch, retries=2)
    backoffs: list[int] = []
    monkeypatch.setattr(location_module, "backoff", backoffs.append)  # the retries' pauses, recorded

    def drop():
        raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer (injected)")
    hook_first_shard_block(monkeypatch, f"{bucket}/big.lmdb", drop)
    downloads = count_downloads(monkeypatch)
    got = samples(ds)
    assert backoffs == [0], "the dropped connection was not retried (or not dropped)"
    assert downloads == ["shard-00000.lmdb"]  # one download, retried inside
    assert got == samples(fastdata.open_dataset(local, output="numpy"))
    assert_only_verified_shards(os.environ["FASTDATA_CACHE_DIR"], local)


def _reset_by_dying_server() -> None:
    """The stream's next read after the server was killed: a shard of 3 MB may have arrived whole in
    the socket's buffers before the kill (the object is read as one streamed GET), where a larger one
    would not have; the connection reset a dying server gives is raised here so that the rest of the
    download, and its retries, meet the server as it now is."""
    raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer (the server was killed)")


def _big_remote_store(bucket: str, tmp_path, monkeypatch, retries: int):
    """The big store uploaded to ``bucket`` and opened from there with ``retries`` of our retries
    (botocore's own off, so only ours count). Returns ``(dataset, local store)``."""
    local = big_store(tmp_path)
    url = f"{bucket}/big.lmdb"
    upload_store(local, url)
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", str(retries))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    return fastdata.open_dataset(url, output="numpy"), local


# A real SeaweedFS restart takes 12-30 s to recover its raft state: nightly. In CI the dropped
# connection above checks the same retry inside one download, and the test after this one the
# server going away for good.
@pytest.mark.slow
def test_server_killed_mid_download_and_back_within_the_retries(lone_s3, tmp_path, monkeypatch):
    server, bucket = lone_s3
    # backoff 0.25 s doubling, capped at 8 s: about 2 minutes of retries, far more than the restart
    # needs (SeaweedFS resuming its raft state took 12-21 s here), ending as soon as it is back
    ds, local = _big_remote_store(bucket, tmp_path, monkeypatch, retries=20)
    restarted = threading.Event()

    def kill_then_restart():
        server.kill()
        threading.Thread(target=lambda: (server.start(timeout=150), restarted.set()), daemon=True).start()
        _reset_by_dying_server()
    hook_first_shard_block(monkeypatch, f"{bucket}/big.lmdb", kill_then_restart)
    downloads = count_downloads(monkeypatch)
    got = samples(ds)
    assert restarted.is_set(), "the read finished without the server having been down"
    assert downloads == ["shard-00000.lmdb"]  # one download, retried inside
    assert got == samples(fastdata.open_dataset(local, output="numpy"))
    assert_only_verified_shards(os.environ["FASTDATA_CACHE_DIR"], local)


def _kill_mid_download_and_fail(server, bucket, tmp_path, monkeypatch):
    """Kill the server after the first block of the shard: one clear error, nothing kept.
    Returns ``(dataset, local store)``."""
    ds, local = _big_remote_store(bucket, tmp_path, monkeypatch, retries=2)
    def kill():
        server.kill()
        _reset_by_dying_server()
    hook_first_shard_block(monkeypatch, f"{bucket}/big.lmdb", kill)
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError) as info:
        ds[0]
    assert time.monotonic() - t0 < 60  # a watchdog: 3 attempts at a closed port take about a second
    message = str(info.value)
    assert f"{bucket}/big.lmdb/shard-00000.lmdb" in message and "after 3 attempts" in message, message
    assert list(shard_files(os.environ["FASTDATA_CACHE_DIR"]).values()) == [[]], "a half-downloaded shard was kept"
    return ds, local


def test_server_killed_mid_download_and_gone_is_one_clear_error(lone_s3, tmp_path, monkeypatch):
    server, bucket = lone_s3
    # the retries' sleeps (1.5 s of them), recorded instead of slept: a server that is gone stays gone
    backoffs: list[int] = []
    monkeypatch.setattr(location_module, "backoff", backoffs.append)
    _kill_mid_download_and_fail(server, bucket, tmp_path, monkeypatch)
    assert backoffs and set(backoffs) == {0, 1}, backoffs  # each failed read was retried twice, then given up


# The restart: nightly (see above).
@pytest.mark.slow
def test_after_a_failed_download_the_same_dataset_reads_once_the_server_is_back(lone_s3, tmp_path, monkeypatch):
    server, bucket = lone_s3
    ds, local = _kill_mid_download_and_fail(server, bucket, tmp_path, monkeypatch)
    # nothing of the failure was kept; the gateway answers a few seconds before every object is
    # readable again: retry long enough
    server.start(timeout=150)
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "20")
    assert samples(ds) == samples(fastdata.open_dataset(local, output="numpy"))
    assert_only_verified_shards(os.environ["FASTDATA_CACHE_DIR"], local)


# -- a corrupted or truncated download ------------------------------------------------------------

def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def test_corrupted_remote_shard_is_downloaded_again_never_used_then_named(s3, tmp_path, monkeypatch):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    ds = fastdata.open_dataset(url, output="numpy")  # the manifest (and its checksums) is read now
    with open(os.path.join(local, "shard-00000.lmdb"), "rb") as fh:
        good = fh.read()
    RemoteLocation(url).write_bytes("shard-00000.lmdb", flipped(good, len(good) // 2))
    downloads = count_downloads(monkeypatch)
    with pytest.raises(CorruptRecordError) as info:
        ds[0]
    assert info.value.shard == "shard-00000.lmdb" and "shard-00000.lmdb" in str(info.value)
    assert downloads == ["shard-00000.lmdb"] * 3  # downloaded again, then given up
    cache = os.environ["FASTDATA_CACHE_DIR"]
    assert list(shard_files(cache).values()) == [[]], "bytes that failed their checksum were kept"


def test_skipping_a_shard_that_never_matches_downloads_it_only_once_per_process(s3, tmp_path, monkeypatch):
    """on_error="skip" moves past every sample of a damaged shard: the shard's downloads are
    tried once (3 attempts), not again for each sample skipped to."""
    _, bucket = s3
    local = make_store(tmp_path, "two", {"a": 6, "b": 6}, shard_size="20kB")
    url = f"{bucket}/two.lmdb"
    upload_store(local, url)
    ds = fastdata.open_dataset(url, output="numpy", on_error="skip")
    first = ds._shard_files[0]
    assert len(ds._shard_files) >= 2 and int(ds.shard_starts[1]) >= 2
    with open(os.path.join(local, first), "rb") as fh:
        good = fh.read()
    RemoteLocation(url).write_bytes(first, flipped(good, len(good) // 2))
    downloads = count_downloads(monkeypatch)
    with pytest.warns(RuntimeWarning, match="did not match the manifest"):
        for i in range(int(ds.shard_starts[1])):
            ds[i]
    assert downloads.count(first) == 3, downloads
    assert ds.skipped == int(ds.shard_starts[1])


def test_transient_corruption_is_downloaded_again_and_read(s3, tmp_path, monkeypatch):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    ds = fastdata.open_dataset(url, output="numpy")
    with open(os.path.join(local, "shard-00000.lmdb"), "rb") as fh:
        good = fh.read()
    remote = RemoteLocation(url)
    remote.write_bytes("shard-00000.lmdb", flipped(good, 100))
    calls: list[str] = []
    orig = RemoteLocation.download

    def bad_once(self, name, out_path, expected_size):
        digest = orig(self, name, out_path, expected_size)
        calls.append(name)
        if len(calls) == 1:
            remote.write_bytes(name, good)  # the remote copy is whole again for the next attempt
        return digest
    monkeypatch.setattr(RemoteLocation, "download", bad_once)
    assert samples(ds) == samples(fastdata.open_dataset(local, output="numpy"))
    assert calls == ["shard-00000.lmdb"] * 2
    assert_only_verified_shards(os.environ["FASTDATA_CACHE_DIR"], local)


def test_truncated_remote_shard_is_a_clear_error_and_never_used(s3, tmp_path):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    ds = fastdata.open_dataset(url, output="numpy")
    with open(os.path.join(local, "shard-00000.lmdb"), "rb") as fh:
        good = fh.read()
    RemoteLocation(url).write_bytes("shard-00000.lmdb", good[: len(good) // 2])
    with pytest.raises(RemoteStoreError, match=r"shard-00000\.lmdb: downloaded \d+ bytes, the manifest says"):
        ds[0]
    assert list(shard_files(os.environ["FASTDATA_CACHE_DIR"]).values()) == [[]]


# -- a full cache disk ---------------------------------------------------------------------------

@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs (skipped where mounting is not allowed); unmounted at the end."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()}); the ENOSPC-injection test "
                    "covers the same path")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_cache_disk_names_the_cache_dir(s3, tmp_path, tiny_fs):
    _, bucket = s3
    local = big_store(tmp_path)  # one 3 MB shard: more than the 2 MiB disk
    url = f"{bucket}/big.lmdb"
    upload_store(local, url)
    cache = os.path.join(tiny_fs, "cache")
    ds = fastdata.open_dataset(url, output="numpy", cache_dir=cache)
    with pytest.raises(CacheFullError) as info:
        ds[0]
    assert cache in str(info.value) and "full" in str(info.value)
    assert list(shard_files(cache).values()) == [[]]


def test_enospc_while_reserving_names_the_cache_dir(s3, tmp_path, monkeypatch):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    ds = fastdata.open_dataset(url, output="numpy")

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(CacheFullError) as info:
        ds[0]
    assert os.environ["FASTDATA_CACHE_DIR"] in str(info.value)
    assert list(shard_files(os.environ["FASTDATA_CACHE_DIR"]).values()) == [[]]


def test_enospc_while_downloading_is_a_prompt_cache_full_error(s3, tmp_path, monkeypatch):
    """Preallocation can succeed and a write still fail (copy-on-write filesystems, quotas):
    that is the local disk, not the network: no retries, CacheFullError naming the cache dir."""
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "6")
    ds = fastdata.open_dataset(url, output="numpy")
    real_open = open
    failing = {"errno": errno.ENOSPC, "left": 1 << 30}  # every write fails with ENOSPC

    class FullDisk(_WrappedFile):
        def write(self, data):
            if failing["left"]:
                failing["left"] -= 1
                raise OSError(failing["errno"], os.strerror(failing["errno"]))
            return self._fh.write(data)

    attempts: list[str] = []

    def open_full(path, mode="r", *args, **kw):
        fh = real_open(path, mode, *args, **kw)
        if ".part-" not in str(path):
            return fh
        attempts.append(os.path.basename(str(path)))
        return FullDisk(fh)
    monkeypatch.setattr(location_module, "open", open_full, raising=False)
    backoffs: list[int] = []  # the retry loop's sleeps, recorded instead of slept
    monkeypatch.setattr(location_module, "backoff", backoffs.append)
    with pytest.raises(CacheFullError) as info:
        ds[0]
    assert backoffs == [] and len(attempts) == 1, f"a full local disk was retried like a network error: {attempts}"
    assert os.environ["FASTDATA_CACHE_DIR"] in str(info.value) and "shard-00000.lmdb" in str(info.value)
    assert list(shard_files(os.environ["FASTDATA_CACHE_DIR"]).values()) == [[]]
    # control: another error on the same write is retried, and the counters see it
    failing.update(errno=errno.EIO, left=1)
    attempts.clear()
    assert samples(ds) == samples(fastdata.open_dataset(local, output="numpy"))
    assert backoffs == [0] and len(attempts) == 2, (backoffs, attempts)


# -- processes racing for one shard ---------------------------------------------------------------

def _race_child(url: str, cache: str, counter: str, barrier, results) -> None:
    """Open the store, wait for the others, read every sample; each download this process
    starts appends a line to ``counter`` (and takes half a second, so the others arrive
    while it is in progress)."""
    orig = RemoteLocation.download

    def counted(self, name, out_path, expected_size):
        with open(counter, "a") as fh:
            fh.write(f"{cache} {name}\n")
        time.sleep(0.5)
        return orig(self, name, out_path, expected_size)
    RemoteLocation.download = counted  # type: ignore[method-assign]
    ds = fastdata.open_dataset(url, output="numpy", cache_dir=cache)
    barrier.wait(120)
    results.put(xxhash.xxh3_64(repr(samples(ds)).encode()).hexdigest())


def _race(url: str, caches: list[str], counter: str) -> list[str]:
    ctx = mp.get_context("fork")  # separate processes all the same, and seconds cheaper than spawn
    barrier = ctx.Barrier(len(caches))
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_child, args=(url, cache, counter, barrier, results)) for cache in caches]
    for proc in procs:
        proc.start()
    try:
        digests = [results.get(timeout=180) for _ in procs]
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return digests


def test_processes_racing_for_a_shard_download_it_once(s3, tmp_path):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    expected = xxhash.xxh3_64(repr(samples(fastdata.open_dataset(local, output="numpy"))).encode()).hexdigest()
    shared, own = str(tmp_path / "shared-cache"), str(tmp_path / "own-cache")
    counter = str(tmp_path / "downloads.txt")
    # three processes share a cache; a fourth, with a cache of its own, is the control that
    # shows the counter sees every process's download
    assert _race(url, [shared, shared, shared, own], counter) == [expected] * 4
    with open(counter) as fh:
        caches = [line.split(" ", 1)[0] for line in fh.read().splitlines()]
    assert sorted(caches) == sorted([shared, own]), caches  # one download per cache, not per process
    assert_only_verified_shards(shared, local)


# -- a store rewritten remotely between two runs ------------------------------------------------

def test_store_rewritten_remotely_gets_a_new_cache_key_and_new_data(s3, tmp_path):
    _, bucket = s3
    url = f"{bucket}/train.lmdb"
    first = make_store(tmp_path, "first", {"a": 6, "b": 6}, seed=1)
    second = make_store(tmp_path, "second", {"a": 6, "b": 6}, seed=2)  # same names and layout, new pixels
    upload_store(first, url)
    ds = fastdata.open_dataset(url, output="numpy")
    assert samples(ds) == samples(fastdata.open_dataset(first, output="numpy"))
    ds.close()
    upload_store(second, url)
    again = fastdata.open_dataset(url, output="numpy")
    want = samples(fastdata.open_dataset(second, output="numpy"))
    assert want != samples(fastdata.open_dataset(first, output="numpy"))
    assert samples(again) == want
    cache = os.environ["FASTDATA_CACHE_DIR"]
    keys = shard_files(cache)
    assert len(keys) == 2 and all(names == ["shard-00000.lmdb"] for names in keys.values()), keys
    assert again._store.key != ds._store.key
    # the first version's shard is still cached (same name): it was not what the second open served
    with open(os.path.join(cache, ds._store.key, "shards", "shard-00000.lmdb"), "rb") as fh, \
            open(os.path.join(first, "shard-00000.lmdb"), "rb") as orig:
        assert fh.read() == orig.read()


# -- processes killed while holding pins or downloading ----------------------------------------

_HOLD_PINS = """
import sys, fastdata
url, cache, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
ds = fastdata.open_dataset(url, output="numpy", cache_dir=cache, cache_limit=limit)
for i in map(int, sys.argv[4:]):
    ds[i]  # its shard stays open, so pinned
print("ready", flush=True)
sys.stdin.read()
"""

_DIE_MID_DOWNLOAD = """
import sys, time, fastdata
from fastdata.remote.location import RemoteLocation
def half_then_hang(self, name, out_path, expected_size):
    with open(out_path, "r+b") as fh:
        fh.write(b"\\xee" * (expected_size // 2))
    print("ready", flush=True)
    time.sleep(120)
RemoteLocation.download = half_then_hang
ds = fastdata.open_dataset(sys.argv[1], output="numpy", cache_dir=sys.argv[2])
ds[0]
"""


def _start_child(code: str, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        pytest.fail(f"child did not get ready (exit {proc.wait()}, said {line!r})")
    return proc


def test_sigkilled_pin_holder_leaves_its_shards_evictable(s3, tmp_path):
    _, bucket = s3
    local = make_store(tmp_path, "four", {"a": 12, "b": 12}, shard_size="8kB")
    url = f"{bucket}/four.lmdb"
    upload_store(local, url)
    cache = str(tmp_path / "pins-cache")
    probe = RemoteStore(url, cache_dir=cache)
    shards = probe.manifest["shards"]
    assert len(shards) >= 3
    sizes = [s["bytes"] for s in shards]
    limit = sizes[1] + sizes[2] + sizes[0] // 2  # shards 0 and 1 fit; shard 2 needs shard 0 gone
    firsts = [s["first_index"] for s in shards]
    with reaped(_start_child(_HOLD_PINS, url, cache, limit, firsts[0], firsts[1])) as child:
        store = RemoteStore(url, cache_dir=cache, cache_limit=limit)
        store.cache.wait_s = 0.5
        # control: while the holder lives, its shards are not evicted
        with pytest.raises(CacheFullError, match="in use by a live process"):
            store.open_shard(2)
        assert sorted(shard_files(cache)[store.key]) == [shards[0]["name"], shards[1]["name"]]
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    path, pin = store.open_shard(2)
    pin.release()
    assert sorted(shard_files(cache)[store.key]) == [shards[1]["name"], shards[2]["name"]]  # LRU went
    assert_only_verified_shards(cache, local)


def test_part_file_of_a_sigkilled_download_is_deleted_never_used(s3, tmp_path):
    _, bucket = s3
    local = make_store(tmp_path, "small", {"a": 6, "b": 6})
    url = f"{bucket}/small.lmdb"
    upload_store(local, url)
    cache = str(tmp_path / "part-cache")
    with reaped(_start_child(_DIE_MID_DOWNLOAD, url, cache)) as child:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    (key, names), = shard_files(cache).items()
    assert names == [f"shard-00000.lmdb.part-{child.pid}"]  # control: the dead download's file is there
    assert samples(fastdata.open_dataset(url, output="numpy", cache_dir=cache)) == \
        samples(fastdata.open_dataset(local, output="numpy"))
    assert shard_files(cache)[key] == ["shard-00000.lmdb"]
    assert_only_verified_shards(cache, local)


# -- eviction under a limit, with DataLoader workers -----------------------------------------------

def cache_disk_bytes(cache_dir: str) -> int:
    """Disk blocks of every file in the cache's shards/ folders (downloads in progress included)."""
    total = 0
    for key, names in shard_files(cache_dir).items():
        for name in names:
            try:
                total += os.stat(os.path.join(cache_dir, key, "shards", name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class DiskSampler(threading.Thread):
    """Samples :func:`cache_disk_bytes` every few ms until stopped; ``peak`` is the largest seen."""

    def __init__(self, cache_dir: str):
        super().__init__(daemon=True)
        self.cache_dir, self.peak, self.count = cache_dir, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.003):
            self.peak = max(self.peak, cache_disk_bytes(self.cache_dir))
            self.count += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# spawn nightly (3.5 s: fresh interpreters): the cache's limit is kept across processes the same way whichever
# way they started; CI's loader matrix covers spawned workers' datasets
@pytest.mark.parametrize("context", first_in_ci(["fork", "spawn"]))
def test_eviction_keeps_the_cache_under_its_limit_with_dataloader_workers(s3, tmp_path, monkeypatch, context):
    import torch

    _, bucket = s3
    monkeypatch.setenv("FASTDATA_CACHE_WAIT_S", "15")  # a stuck wait fails in 15 s, not 120 (workers inherit it)
    local = make_store(tmp_path, "six", {"a": 18, "b": 18}, shard_size="12kB")
    url = f"{bucket}/six.lmdb"
    upload_store(local, url)
    ref = fastdata.open_dataset(local, output="numpy")
    sizes = [s["bytes"] for s in RemoteStore(url, cache_dir=str(tmp_path / "probe")).manifest["shards"]]
    assert len(sizes) >= 6, sizes
    limit = 2 * max(sizes)
    cache = str(tmp_path / "bounded-cache")
    ds = fastdata.open_dataset(url, output="numpy", cache_dir=cache, cache_limit=limit)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    sampler = DiskSampler(cache)
    sampler.start()
    try:
        got = [(np.asarray(img), int(label))
               for images, labels in loader for img, label in zip(images, labels, strict=True)]
    finally:
        sampler.stop()
    want = [(np.asarray(img), int(label)) for img, label in (ref[i] for i in range(len(ref)))]
    assert len(got) == len(want)
    for (a, la), (b, lb) in zip(got, want, strict=True):
        assert la == lb
        np.testing.assert_array_equal(a, b)
    assert sampler.count > 10
    assert sampler.peak <= limit + max(sizes), (sampler.peak, limit, sizes)
    assert sampler.peak > 0


# -- worker memory and descriptors across epochs ------------------------------------------------

def _labels(batch):
    return [int(label) for _, label in batch]


def _worker_series(ds, epochs: int) -> list[list[tuple[int, int]]]:
    """Per epoch, each persistent fork worker's (PSS bytes, open fds) after the epoch."""
    import psutil
    import torch

    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                         persistent_workers=True, collate_fn=_labels)
    series = []
    for _ in range(epochs):
        assert sum(len(b) for b in loader) == len(ds)
        workers = sorted((c for c in me.children(recursive=True) if c.pid not in before), key=lambda c: c.pid)
        assert len(workers) == 2
        series.append([(w.memory_full_info().pss, w.num_fds()) for w in workers])
    del loader
    return series


def test_worker_memory_and_fds_stay_flat_across_epochs_of_a_bounded_remote_store(s3, tmp_path, monkeypatch):
    """Every epoch evicts and downloads again (the cache holds 2 of 6 shards): what a worker
    keeps per download (buffers, filesystem objects, pins) would grow its memory or fds."""
    _, bucket = s3
    local = make_store(tmp_path, "six", {"a": 18, "b": 18}, shard_size="12kB")
    url = f"{bucket}/six.lmdb"
    upload_store(local, url)
    sizes = [s["bytes"] for s in RemoteStore(url, cache_dir=str(tmp_path / "probe")).manifest["shards"]]
    cache = str(tmp_path / "bounded-cache")
    ds = fastdata.open_dataset(url, output="numpy", cache_dir=cache, cache_limit=2 * max(sizes))
    counter = tmp_path / "downloads.txt"
    orig = RemoteLocation.download

    def counted(self, name, out_path, expected_size):  # forked workers inherit it
        with open(counter, "a") as fh:
            fh.write(name + "\n")
        return orig(self, name, out_path, expected_size)
    monkeypatch.setattr(RemoteLocation, "download", counted)
    series = _worker_series(ds, epochs=5)
    assert len(counter.read_text().splitlines()) >= 4 * len(sizes)  # evicted and downloaded again every epoch
    MB = 1 << 20
    for w in range(2):
        pss = [epoch[w][0] for epoch in series]
        fds = [epoch[w][1] for epoch in series]
        assert pss[-1] - pss[1] < 4 * MB, [p / MB for p in pss]
        assert max(fds[1:]) - min(fds[1:]) <= 1, fds
    # control: pins that are never released show up as descriptors growing every epoch
    from fastdata.remote.cache import Pin
    monkeypatch.setattr(Pin, "release", lambda self: None)
    leaky = fastdata.open_dataset(url, output="numpy", cache_dir=str(tmp_path / "unbounded-cache"))
    fds = [epoch[0][1] for epoch in _worker_series(leaky, epochs=3)]
    assert fds[2] > fds[1] + 1, fds
