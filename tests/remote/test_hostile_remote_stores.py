"""Hostile remote stores: read over http:// from a loopback server (``helpers.hostile.HTTPStoreServer``)
by the same harness as ``tests/format/test_hostile_stores.py`` (a fresh fork per case, bounded
memory and time), and a URL destination whose path climbs out of its prefix (``s3://bucket/a/..``).

Each attack must end in a typed error; each ``control`` (the same surgery, benign) reads fine.
"""

from __future__ import annotations

import os
import random

import pytest
from helpers import hostile as H
from helpers.backends import first_in_ci
from helpers.hostile import describe, expect

from fastdata.format.backends.registry import BACKENDS

pytestmark = pytest.mark.timeout(300)

ALL = list(BACKENDS)
MODES = ["control", "attack"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-remote")


@pytest.fixture(scope="module")
def tree(work):
    return H.build_tree(work / "tree")


@pytest.fixture(scope="module")
def pristine(work, tree):
    out = {}
    for backend in ALL:
        dst = str(work / "pristine" / H.store_name(backend))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        out[backend] = H.build_store(dst, tree=tree)
    return out


@pytest.fixture(scope="module")
def harness(work, pristine):
    h = H.Harness(work / "logs", env={"FASTDATA_REMOTE_RETRIES": "0"})
    h.calibrate(list(pristine.values()))
    yield h
    h.close()


@pytest.fixture
def www(tmp_path):
    """``(root folder, server)``: a loopback http server of ``root``."""
    root = tmp_path / "www"
    root.mkdir()
    server = H.HTTPStoreServer(str(root))
    yield str(root), server
    server.close()


def _open_url(harness, url: str, tmp_path) -> dict:
    return harness.run("open", store=url, cache_dir=str(tmp_path / f"cache-{random.random()}"))




@pytest.mark.parametrize("mode", MODES)
def test_http_store_redirecting_to_another_host(harness, pristine, www, tmp_path, mode):
    """The server the URL names answers 302 to another origin (another port): a reader must not
    follow a store's reads to wherever the first server points."""
    root, target = www
    backend = ALL[0]
    H.copy_store(pristine[backend], os.path.join(root, H.store_name(backend)))
    redirector = H.HTTPStoreServer(root, redirect_to=target.url)
    try:
        base = target.url if mode == "control" else redirector.url
        url = f"{base}/{H.store_name(backend)}"
        expect(_open_url(harness, url, tmp_path), mode, url)
    finally:
        redirector.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_store_index_of_8_million_empty_lists(harness, pristine, www, tmp_path, backend, mode):
    """``index.fdi`` (size and checksum re-signed in the manifest) is an 8 MB msgpack list of empty
    lists: ~586 MB as Python objects before anything checks its layout."""
    root, server = www
    store = H.copy_store(pristine[backend], os.path.join(root, H.store_name(backend)))
    if mode == "attack":
        with open(os.path.join(store, H.STORE_INDEX), "wb") as fh:
            fh.write(H.empty_lists_msgpack(8_000_000))
    H.resign(store)
    url = f"{server.url}/{H.store_name(backend)}"
    expect(_open_url(harness, url, tmp_path), mode, url)


_HOSTILE = [None, -1, 2**63, 2**64 + 1, "", "|O", "<f8", ">i8", [], [2**40], [-1], [2**32, 2**32], b"", b"\x00" * 7,
            {"x": 1}]


# every seed over one backend in CI, over every backend nightly: index.fdi is the store's own file,
# checked against the manifest by one backend-agnostic reader (store_index.parse_store_index) before
# any shard is opened; test_store_index_of_8_million_empty_lists above runs over every backend in CI
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", first_in_ci(ALL))
def test_fuzz_store_index_entries(harness, pristine, www, tmp_path, backend, seed):
    """One random part of ``index.fdi`` (a count, an array's dtype, shape or bytes, a name) replaced
    by a hostile value and the file re-signed: a typed error or a correct read."""
    import msgpack

    root, server = www
    store = H.copy_store(pristine[backend], os.path.join(root, H.store_name(backend)))
    body = H.index_entries(store)
    rng = random.Random(seed)
    entry = body["shards"][0]
    target = rng.choice(["count", "name", "array"])
    if target == "array":
        key = rng.choice(sorted(entry["arrays"]))
        entry["arrays"][key][rng.randrange(3)] = rng.choice(_HOSTILE)
    else:
        entry[target] = rng.choice(_HOSTILE)
    with open(os.path.join(store, H.STORE_INDEX), "wb") as fh:
        fh.write(msgpack.packb(body, use_bin_type=True))
    H.resign(store)
    url = f"{server.url}/{H.store_name(backend)}"
    result = _open_url(harness, url, tmp_path)
    if result["outcome"] == "ok":
        ref = harness.run("open", store=pristine[backend])
        assert result["digest"] == ref["digest"], f"a wrong read without an error: {describe(result)}"
        return
    assert result["outcome"] == "typed_error", describe(result)


@pytest.mark.parametrize("mode", MODES)
def test_url_destination_climbing_out_of_its_prefix(s3, tree, mode):
    """``convert(..., "s3://bucket/a/..", overwrite=True)``: refused with a typed error, and nothing
    outside ``a/`` (here the object ``keep/canary.txt``) is deleted or written."""
    import fastdata
    from fastdata.errors import FastdataError
    from fastdata.remote.location import RemoteLocation

    _, bucket = s3
    RemoteLocation(f"{bucket}/keep").write_bytes("canary.txt", H.CANARY_FILE_TEXT.encode())
    dst = f"{bucket}/a/victim.lmdb" if mode == "control" else f"{bucket}/a/.."
    error = None
    try:
        fastdata.convert(tree, dst, format="lmdb", overwrite=True, progress=False, workers=1)
    except FastdataError as err:
        error = err
    listing = RemoteLocation(bucket).listing()
    assert listing.get("keep/canary.txt") == len(H.CANARY_FILE_TEXT), f"the canary was touched: {listing}"
    outside = sorted(n for n in listing if not n.startswith(("a/", "keep/")))
    assert not outside, f"objects written outside a/: {outside}"
    if mode == "control":
        assert error is None, error
    else:
        assert error is not None, f"{dst} was accepted as a destination; the bucket now holds {sorted(listing)}"
