"""Single records of a remote store read with ranged requests (``cache="records"``), against the real
SeaweedFS server, through a counting HTTP proxy (tests/helpers/counting_proxy.py): the requests and
bytes counted are those the server answered, whatever the client library did."""

from __future__ import annotations

import os
import warnings

import msgpack
import numpy as np
import pytest
from helpers.backends import first_in_ci
from helpers.counting_proxy import CountingProxy
from helpers.hostile import index_entries, resign

import fastdata
from fastdata.errors import CorruptRecordError, StoreChangedError
from fastdata.format.manifest import read_manifest
from fastdata.format.store_index import parse_store_index
from fastdata.remote.location import RemoteLocation
from fastdata.remote.records import MAX_READ_FACTOR, plan_record
from fastdata.remote.store import RecordsFallbackWarning

VARIANTS = [("lmdb", 1), ("hdf5", 1), ("lmdb", 2), ("hdf5", 2)]
SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


def upload_store(local: str, url: str) -> None:
    loc = RemoteLocation(url)
    for name in sorted(os.listdir(local)):
        if os.path.isfile(os.path.join(local, name)):
            loc.upload(os.path.join(local, name), name)


def _samples(n: int) -> list[dict]:
    rng = np.random.default_rng(0)  # noise: PNGs of ~7 kB, records LMDB cuts into heads and tails
    return [{"image": rng.integers(0, 255, (40, 56, 3), dtype=np.uint8), "idx": i, "caption": f"sample {i}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[tuple[str, int], str]:
    """A small local store of each backend and record model (v1: ImageFolder JPEGs of 10-16 kB; v2:
    a general store written by fastdata.write), a few records a shard."""
    from fastdata.synth import make_image_folder

    root = tmp_path_factory.mktemp("records")
    make_image_folder(root / "imgs", num_classes=3, per_class=4, size=(120, 160))
    out = {}
    for backend, version in VARIANTS:
        dst = str(root / f"v{version}{SUFFIX[backend]}")
        if version == 1:
            fastdata.convert(str(root / "imgs"), dst, shard_size="40kB", workers=1, progress=False)
        else:
            fastdata.write(_samples(12), dst, shard_size="20kB", workers=1, progress=False)
        out[backend, version] = dst
    return out


@pytest.fixture
def proxy(s3):
    server, _bucket = s3
    p = CountingProxy(server.endpoint).start()
    yield p
    p.stop()


def _open(url: str, proxy: CountingProxy, cache_dir: str, **kwargs):
    return fastdata.open_dataset(url, storage_options={"endpoint_url": proxy.endpoint}, cache_dir=cache_dir,
                                 output="numpy", **kwargs)


def _pieces(local: str) -> list[np.ndarray]:
    """Each record's pieces (store order), as the local store's index file places them."""
    m = read_manifest(local)
    schema = None if m["version"] == 1 else fastdata.fields.Schema.from_json(m["schema"])
    with open(os.path.join(local, "index.fdi"), "rb") as fh:
        indexes = parse_store_index(fh.read(), m, schema, local)
    return [index.record_ranges[j] for index in indexes for j in range(len(index))]


def _same(got, want) -> None:
    if isinstance(want, tuple):
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]
    else:
        assert got.keys() == want.keys() and got["idx"] == want["idx"] and got["caption"] == want["caption"]
        np.testing.assert_array_equal(got["image"], want["image"])


def _shard_files(cache_dir: str) -> list[str]:
    """The shard files in the cache (not their pins and locks)."""
    return [f for _d, _s, files in os.walk(cache_dir) for f in files if f.startswith("shard-")
            and f.endswith((".lmdb", ".h5"))]


@pytest.mark.parametrize("backend,version", VARIANTS)
def test_a_record_is_one_ranged_get_of_its_own_bytes(s3, proxy, stores, tmp_path, backend, version):
    """Each record: the GETs its plan says (one for every HDF5 record, and for an LMDB record whose
    head and tail parts lie close; never more than its pieces), each with a Range header, moving fewer
    than twice its bytes; it equals the local store's record; no shard reaches the cache."""
    _server, bucket = s3
    local = stores[backend, version]
    url = f"{bucket}/s{SUFFIX[backend]}"
    upload_store(local, url)
    cache_dir = str(tmp_path / "cache")
    ds, ref = _open(url, proxy, cache_dir, cache="records"), fastdata.open_dataset(local, output="numpy")
    pieces = _pieces(local)
    assert len(ds) == len(ref) == len(pieces) and len(ref.shard_starts) > 1
    single = 0
    for i in np.random.default_rng(1).permutation(len(ds)).tolist():
        proxy.clear()
        _same(ds[i], ref[i])
        gets = proxy.gets("/shard-")
        size = int(pieces[i][:, 1].sum())
        assert len(gets) == len(plan_record(pieces[i])) <= int((pieces[i][:, 1] > 0).sum()), (i, gets)
        assert all(g.range and g.status == 206 for g in gets)
        assert sum(g.body_bytes for g in gets) < MAX_READ_FACTOR * size
        single += len(gets) == 1
    if backend == "hdf5":
        assert single == len(ds)
    else:
        assert single >= len(ds) // 2  # (the others: a tail part in a leaf page beyond the previous record's head)
    assert _shard_files(cache_dir) == []
    # a batch: its records' requests side by side, neighbours merged: fewer requests than records
    proxy.clear()
    batch = ds.__getitems__(list(range(len(ds))))
    for got, i in zip(batch, range(len(ds)), strict=True):
        _same(got, ref[i])
    assert 0 < len(proxy.gets("/shard-")) < len(ds) and all(g.range for g in proxy.gets("/shard-"))
    assert _shard_files(cache_dir) == []


def test_control_the_default_shard_cache_downloads_the_whole_shard(s3, proxy, stores, tmp_path):
    """The control of the claim above: the same read with the default cache moves the whole shard."""
    _server, bucket = s3
    local = stores["hdf5", 1]
    upload_store(local, f"{bucket}/s.h5")
    cache_dir = str(tmp_path / "cache")
    ds = _open(f"{bucket}/s.h5", proxy, cache_dir)
    proxy.clear()
    ds[1]
    shard = read_manifest(local)["shards"][0]
    gets = proxy.gets("/shard-")
    assert sum(g.body_bytes for g in gets) == shard["bytes"] > 3 * int(_pieces(local)[1][:, 1].sum())
    assert _shard_files(cache_dir) == [shard["name"]]


def _flip_in_record(local: str, copy: str, sample: int) -> tuple[str, int]:
    """``copy`` := ``local`` with one byte of ``sample``'s stored bytes flipped in its shard file;
    returns (shard name, record within it)."""
    import shutil

    shutil.copytree(local, copy)
    m = read_manifest(copy)
    starts = [s["first_index"] for s in m["shards"]]
    shard = int(np.searchsorted(starts, sample, side="right")) - 1
    offset, length = (int(x) for x in _pieces(copy)[sample][0])
    name = m["shards"][shard]["name"]
    with open(os.path.join(copy, name), "r+b") as fh:
        fh.seek(offset + length - 3)  # (the image's last bytes: the record still unpacks)
        byte = fh.read(1)
        fh.seek(offset + length - 3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return name, sample - starts[shard]


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_a_damaged_record_on_the_server_is_a_checksum_error_naming_shard_and_record(s3, proxy, stores, tmp_path,
                                                                                    backend):
    _server, bucket = s3
    local = stores[backend, 1]
    url = f"{bucket}/s{SUFFIX[backend]}"
    upload_store(local, url)
    ds = _open(url, proxy, str(tmp_path / "cache"), cache="records")
    damaged = str(tmp_path / "damaged")
    name, record = _flip_in_record(local, damaged, 5)
    RemoteLocation(url).upload(os.path.join(damaged, name), name)  # the server's copy damaged, the manifest as it was
    with pytest.raises(CorruptRecordError, match=rf"shard {name} record {record} \(sample 5\).*checksum mismatch"):
        ds[5]
    ds[4 if record else 6]  # the others read on


def _craft(local: str, copy: str, rewrite) -> None:
    """``copy`` := ``local`` whose index file's ``record_ranges`` are ``rewrite(shard name, ranges)``
    (None: the array removed), the manifest signed again (a hostile store consistent with itself)."""
    import shutil

    shutil.copytree(local, copy)
    body = index_entries(copy)
    for entry in body["shards"]:
        _dtype, shape, raw = entry["arrays"]["record_ranges"]
        ranges = rewrite(entry["name"], np.frombuffer(raw, "<u8").reshape(shape).copy())
        if ranges is None:
            del entry["arrays"]["record_ranges"]
        else:
            entry["arrays"]["record_ranges"] = ["<u8", list(ranges.shape), ranges.tobytes()]
    with open(os.path.join(copy, "index.fdi"), "wb") as fh:
        fh.write(msgpack.packb(body, use_bin_type=True))
    resign(copy)


def test_out_of_range_offsets_in_a_crafted_index_are_refused_before_any_read(s3, proxy, stores, tmp_path):
    _server, bucket = s3
    local = stores["lmdb", 2]
    first = read_manifest(local)["shards"][0]["name"]

    def rewrite(name, ranges):
        if name == first:
            ranges[0, 0] = (1 << 62, 1 << 40)  # far past the shard: a read of a terabyte
            ranges[1, 0, 1] = ranges[1, 0, 1] + 50  # inside the shard, but longer than the record's nbytes
        return ranges

    crafted = str(tmp_path / "crafted.lmdb")
    _craft(local, crafted, rewrite)
    url = f"{bucket}/crafted.lmdb"
    upload_store(crafted, url)
    ds = _open(url, proxy, str(tmp_path / "cache"), cache="records")
    proxy.clear()
    with pytest.raises(CorruptRecordError, match=rf"shard {first} record 0 .*past the end of the shard.*nothing was"):
        ds[0]
    with pytest.raises(CorruptRecordError, match=rf"shard {first} record 1 .*stored bytes.*nothing was read"):
        ds[1]
    assert proxy.gets("/shard-") == []
    last = len(ds) - 1  # (another shard: read as ever)
    np.testing.assert_array_equal(ds[last]["image"], fastdata.open_dataset(local, output="numpy")[last]["image"])


def test_a_store_without_record_ranges_falls_back_to_whole_shards_with_a_warning(s3, proxy, stores, tmp_path):
    """A store written before ``record_ranges`` existed: one warning saying why, then its shards are
    read whole through the cache, as with cache='shards'."""
    _server, bucket = s3
    old = str(tmp_path / "old.h5")
    _craft(stores["hdf5", 1], old, lambda name, ranges: None)
    upload_store(old, f"{bucket}/old.h5")
    cache_dir = str(tmp_path / "cache")
    with pytest.warns(RecordsFallbackWarning, match="records no byte ranges"):
        ds = _open(f"{bucket}/old.h5", proxy, cache_dir, cache="records")
    _same(ds[1], fastdata.open_dataset(old, output="numpy")[1])
    assert _shard_files(cache_dir) == [read_manifest(old)["shards"][0]["name"]]


def test_a_store_rewritten_on_the_server_while_open_is_detected(s3, proxy, stores, tmp_path):
    _server, bucket = s3
    url = f"{bucket}/s.h5"
    upload_store(stores["hdf5", 1], url)
    ds = _open(url, proxy, str(tmp_path / "cache"), cache="records")
    ds[0]
    other = str(tmp_path / "other.h5")
    fastdata.write(_samples(12), other, shard_size="20kB", progress=False)  # another store at the same URL
    upload_store(other, url)
    with pytest.raises(StoreChangedError, match="rewritten since it was opened"):
        ds[3]


# fork in CI; spawn (13 s: each worker imports torch) nightly
@pytest.mark.parametrize("start", first_in_ci(["fork", "spawn"]))
def test_a_loader_with_two_workers_reads_every_sample_once(s3, stores, tmp_path, start):
    """Pickled into spawned workers, or forked after the parent read a record (its filesystem and
    request pool are the parent's, never used in a child), each worker reads its records with its
    own requests: every sample once, and no shard downloaded."""
    _server, bucket = s3
    url = f"{bucket}/s.lmdb"
    upload_store(stores["lmdb", 2], url)
    cache_dir = str(tmp_path / "cache")
    ds = fastdata.open_dataset(url, cache="records", output="numpy", cache_dir=cache_dir)
    ds[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecordsFallbackWarning)
        loader = fastdata.loader(ds, batch_size=3, num_workers=2, multiprocessing_context=start, shuffle=True,
                                 seed=0)
        seen = [int(i) for batch in loader for i in batch["idx"]]
    assert sorted(seen) == list(range(12))
    assert _shard_files(cache_dir) == []


def test_cache_must_be_shards_or_records(stores):
    with pytest.raises(ValueError, match="cache must be one of 'shards', 'records'"):
        fastdata.open_dataset(stores["lmdb", 1], cache="pages")
    assert len(fastdata.open_dataset(stores["lmdb", 1], cache="records")) == 12  # (a local store: no effect)


def test_plan_joins_pieces_while_under_twice_the_record():
    def plan(*pieces):
        return plan_record(np.array(pieces, dtype=np.uint64).reshape(-1, 2))

    assert plan((100, 50)) == [(100, 150)]
    assert plan((0, 0), (100, 50), (0, 0)) == [(100, 150)]  # zero-length pieces are nothing to read
    assert plan((1000, 4000), (200, 500), (5100, 300)) == [(200, 5400)]  # gaps 300 + 100 < 4800
    assert plan((1000, 4000), (9000, 500)) == [(1000, 9500)]  # 8500 bytes moved for 4500: under twice
    assert plan((1000, 4000), (10_000, 500)) == [(1000, 5000), (10_000, 10_500)]  # 9500 for 4500 would not be
    assert plan((0, 100), (150, 100), (10_000, 100)) == [(0, 250), (10_000, 10_100)]  # the small gap joined only
    assert plan() == []


def test_an_http_store_reads_records_by_range_and_a_server_ignoring_ranges_is_refused(stores, tmp_path, monkeypatch):
    """https:// (plain http on loopback): records read by range where the server answers ranges; a
    server that answers a ranged GET with the whole object is refused before its body is read."""
    import http.server
    import shutil
    import threading

    from test_remote_read import _RangeHandler

    from fastdata.errors import RemoteStoreError

    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "0")
    www = tmp_path / "www"
    shutil.copytree(stores["hdf5", 2], www / "s.h5")
    ref = fastdata.open_dataset(stores["hdf5", 2], output="numpy")

    class Plain(http.server.SimpleHTTPRequestHandler):  # ignores Range: answers 200 and the whole file
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(www), **kw)

        def log_message(self, *args):
            pass

    for handler, ranged in ((_RangeHandler.make(str(www)), True), (Plain, False)):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/s.h5"
            ds = fastdata.open_dataset(url, cache="records", output="numpy", cache_dir=str(tmp_path / "cache"))
            if ranged:
                _same(ds[7], ref[7])
            else:
                with pytest.raises(RemoteStoreError, match="does not answer range requests"):
                    ds[7]
        finally:
            server.shutdown()
            server.server_close()
    assert _shard_files(str(tmp_path / "cache")) == []


def test_read_range_reads_exactly_the_range_and_a_short_object_is_not_retried(s3, monkeypatch):
    """RemoteLocation.read_range: the bytes asked for; an object that ends inside the range, or
    before it (S3's 416), is a RemoteSizeError at once (no retry can make it longer)."""
    import fastdata.remote.location as location
    from fastdata.remote.location import RemoteSizeError

    _server, bucket = s3
    retries: list[int] = []
    monkeypatch.setattr(location, "backoff", retries.append)
    loc = RemoteLocation(f"{bucket}/obj")
    loc.write_bytes("o", b"0123456789")
    assert loc.read_range("o", 2, 5) == b"234" and loc.read_range("o", 3, 3) == b""
    with pytest.raises(RemoteSizeError, match="answered with 2 bytes"):
        loc.read_range("o", 8, 20)
    with pytest.raises(RemoteSizeError, match="shorter than the store's index says"):
        loc.read_range("o", 50, 60)
    with pytest.raises(FileNotFoundError):
        loc.read_range("missing", 0, 4)
    assert retries == []
