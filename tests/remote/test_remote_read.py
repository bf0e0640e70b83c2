"""Reading stores from an S3-compatible server (a real SeaweedFS, see tests/helpers/s3server.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.backends import SUFFIXES

import fastdata
from fastdata.remote.location import RemoteLocation


def upload_store(local: str, url: str) -> None:
    """Copy a published local store to ``url`` object by object (as `aws s3 sync` would)."""
    loc = RemoteLocation(url)
    for name in sorted(os.listdir(local)):
        path = os.path.join(local, name)
        if os.path.isfile(path):
            loc.upload(path, name)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_remote_store_reads_like_the_local_one(s3, small_tree, tmp_path, suffix):
    server, bucket = s3
    local = str(tmp_path / f"train{suffix}")
    fastdata.convert(small_tree, local, shard_size="20kB", progress=False)
    url = f"{bucket}/train{suffix}"
    upload_store(local, url)
    assert len(fastdata.open_dataset(local).shard_starts) > 1
    same_samples(url, local)


def same_samples(url: str, local: str, **open_options) -> None:
    """The store at ``url`` reads exactly like the local store ``local`` (every image bit-exact);
    ``open_options`` (``storage_options``, ``cache``, ...) go to ``open_dataset(url)``."""
    ref = fastdata.open_dataset(local, output="numpy")
    ds = fastdata.open_dataset(url, output="numpy", **open_options)
    assert len(ds) == len(ref) > 0 and ds.classes == ref.classes
    np.testing.assert_array_equal(ds.targets, ref.targets)
    for i in range(len(ref)):
        img, label = ds[i]
        ref_img, ref_label = ref[i]
        assert label == ref_label
        np.testing.assert_array_equal(img, ref_img)


def _cached_shards(cache_dir: str) -> set[str]:
    return {name for d, _, files in os.walk(cache_dir) if d.endswith("shards") for name in files
            if ".part-" not in name}


def test_shard_window_sampler_prefetches_the_next_window(s3, small_tree, tmp_path):
    """Iterating the sampler alone (no sample read) downloads the current and next windows'
    shards in the background, and nothing else; a sampler without windows prefetches nothing."""
    import time

    from fastdata.reader.sampler import DistributedShardSampler

    server, bucket = s3
    local = str(tmp_path / "train.lmdb")
    fastdata.convert(small_tree, local, shard_size="4kB", progress=False)
    url = f"{bucket}/train.lmdb"
    upload_store(local, url)
    cache_dir = str(tmp_path / "cache")
    ds = fastdata.open_dataset(url, cache_dir=cache_dir)
    names = [s for s in ds._shard_files]
    assert len(names) >= 6
    plain = DistributedShardSampler(ds, num_replicas=1, rank=0)
    next(iter(plain))
    time.sleep(0.5)
    assert _cached_shards(cache_dir) == set(), "a sampler without shard windows prefetched"
    sampler = DistributedShardSampler(ds, num_replicas=1, rank=0, shard_window=2, seed=3)
    windows = sampler.window_shards()
    next(iter(sampler))
    expected = {names[k] for k in windows[0] + windows[1]}
    deadline = time.monotonic() + 30
    while _cached_shards(cache_dir) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cached_shards(cache_dir) == expected


def test_a_general_store_reads_remotely_like_the_local_one(s3, tmp_path):
    server, bucket = s3
    rng = np.random.default_rng(0)
    samples = [{"id": i, "boxes": rng.random((i % 4, 4), dtype=np.float32), "caption": f"sample {i}"}
               for i in range(40)]
    local = str(tmp_path / "gen.lmdb")
    fastdata.write(samples, local, shard_size="1kB", progress=False)
    url = f"{bucket}/gen.lmdb"
    upload_store(local, url)
    ref, ds = fastdata.open_dataset(local), fastdata.open_dataset(url)
    assert type(ds) is type(ref) and len(ds) == len(ref) == 40 and len(ref.shard_starts) > 1
    for i in range(len(ref)):
        got, want = ds[i], ref[i]
        assert got.keys() == want.keys() and got["caption"] == want["caption"] and got["id"] == want["id"]
        np.testing.assert_array_equal(got["boxes"], want["boxes"])


def test_a_store_without_an_index_file_is_refused_remotely_with_the_reason(s3):
    """Stores published before index.fdi existed (the committed version-1 store) read locally;
    remotely they would need every shard downloaded first: a clear error instead."""
    server, bucket = s3
    old = os.path.join(os.path.dirname(__file__), os.pardir, "data", "v1-lmdb")
    assert "index.fdi" not in os.listdir(old)
    url = f"{bucket}/v1.lmdb"
    upload_store(old, url)
    assert len(fastdata.open_dataset(old)) > 0
    with pytest.raises(fastdata.errors.FormatError, match="older fastdata"):
        fastdata.open_dataset(url)


class _RangeHandler:
    """http.server handler serving a folder with HTTP range requests (what object stores and
    CDNs answer), built on SimpleHTTPRequestHandler, which ignores Range."""

    @staticmethod
    def make(root: str):
        import http.server
        import re

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=root, **kw)

            def log_message(self, *args):
                pass

            def send_head(self):
                m = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
                path = self.translate_path(self.path)
                if not m or not os.path.isfile(path):
                    return super().send_head()
                size = os.path.getsize(path)
                start, end = int(m.group(1)), int(m.group(2) or size - 1)
                end = min(end, size - 1)
                fh = open(path, "rb")
                fh.seek(start)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("Content-Length", str(end - start + 1))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                import io
                data = fh.read(end - start + 1)
                fh.close()
                return io.BytesIO(data)
        return Handler


def test_an_http_store_reads_like_the_local_one_and_an_unreachable_server_is_named(small_tree, tmp_path,
                                                                                   monkeypatch):
    """https:// (here plain http on loopback) is read-only: the same reads through the cache."""
    import http.server
    import threading

    from fastdata.errors import RemoteStoreError

    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "0")
    local = str(tmp_path / "www" / "train.lmdb")
    fastdata.convert(small_tree, local, shard_size="20kB", progress=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler.make(str(tmp_path / "www")))
    # polled every 50 ms: shutdown() waits for the loop's next poll, 0.5 s by default
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/train.lmdb"
        ref, ds = fastdata.open_dataset(local, output="numpy"), fastdata.open_dataset(url, output="numpy")
        assert len(ds) == len(ref) and len(ref.shard_starts) > 1
        for i in range(len(ref)):
            np.testing.assert_array_equal(ds[i][0], ref[i][0])
        with pytest.raises(fastdata.errors.FormatError, match="not a fastdata store"):
            fastdata.open_dataset(url.replace("train.lmdb", "missing.lmdb"))
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(RemoteStoreError, match="cannot reach the server"):
        fastdata.open_dataset(url)  # the port is closed now
