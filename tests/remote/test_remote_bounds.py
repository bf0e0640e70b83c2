"""Remote reads never read more than the manifest says, and never follow a store elsewhere:
``RemoteLocation.read_bytes(limit=...)`` stops at limit + 1 bytes (a compressed body counted
after decoding), ``download`` writes at most the declared size, and http(s) redirects to another
origin are refused unless ``storage_options={"allow_redirects": True}``."""

from __future__ import annotations

import gzip
import http.server
import os
import threading
import tracemalloc

import pytest
from helpers import hostile as H

import fastdata
from fastdata.remote.location import RedirectRefusedError, RemoteLocation, RemoteSizeError


class Server:
    """http://127.0.0.1 serving ``routes``: path -> (status, headers, body)."""

    def __init__(self, routes: dict):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, body: bool):
                status, headers, data = routes.get(self.path, (404, {}, b""))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    try:
                        self.wfile.write(data)
                    except (BrokenPipeError, ConnectionResetError):
                        pass

            def do_GET(self):
                self._answer(True)

            def do_HEAD(self):
                self._answer(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # polled every 50 ms: shutdown() waits for the loop's next poll, 0.5 s by default
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "0")


def test_read_bytes_limit_just_inside_and_outside():
    server = Server({"/s/obj": (200, {}, b"x" * 1000)})
    try:
        loc = RemoteLocation(f"{server.url}/s")
        assert loc.read_bytes("obj", limit=1000) == b"x" * 1000
        with pytest.raises(RemoteSizeError, match=r"obj: larger than the 999 bytes"):
            loc.read_bytes("obj", limit=999)
    finally:
        server.close()


def test_a_gzip_body_is_counted_after_decoding_and_cut_off():
    """A small gzip-encoded response (60 kB) that decodes to 64 MiB: refused at the limit, without
    holding the decoded whole."""
    big = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    server = Server({"/s/index.fdi": (200, {"Content-Encoding": "gzip"}, big)})
    try:
        loc = RemoteLocation(f"{server.url}/s")
        tracemalloc.start()
        with pytest.raises(RemoteSizeError, match="larger than the 4,096 bytes"):
            loc.read_bytes("index.fdi", limit=4096)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 48 << 20, f"{peak / 2**20:.0f} MiB held while reading a 4 KiB-limited object"
    finally:
        server.close()


def test_download_writes_at_most_the_declared_size(tmp_path):
    server = Server({"/s/shard": (200, {}, b"y" * (1 << 20))})  # a range-less server: the whole body to any GET
    try:
        loc = RemoteLocation(f"{server.url}/s")
        out = tmp_path / "part"
        with pytest.raises(RemoteSizeError, match="downloaded more than 1000 bytes"):
            loc.download("shard", str(out), 1000)
        assert os.path.getsize(out) <= 1000
    finally:
        server.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tree = H.build_tree(tmp_path_factory.mktemp("tree"))
    return H.build_store(str(tmp_path_factory.mktemp("st") / H.store_name("lmdb")), tree=tree)


def _files(store: str, prefix: str) -> dict:
    out = {}
    for name in os.listdir(store):
        with open(os.path.join(store, name), "rb") as fh:
            data = fh.read()
        out[f"{prefix}/{name}"] = (200, {"Accept-Ranges": "bytes"}, data)
    return out


def test_a_redirect_within_the_same_origin_is_followed(store, tmp_path):
    routes = _files(store, "/new/victim.lmdb")
    server = Server(routes)
    for path in list(routes):
        routes["/old" + path.removeprefix("/new")] = (302, {"Location": path}, b"")
    try:
        ds = fastdata.open_dataset(f"{server.url}/old/victim.lmdb", output="numpy", cache_dir=str(tmp_path / "c"))
        assert len(ds) == 6 and ds[0][0].shape == (48, 64, 3)
    finally:
        server.close()


def test_a_redirect_to_another_origin_is_refused_unless_allowed(store, tmp_path):
    target = Server(_files(store, "/victim.lmdb"))
    routes = {p: (302, {"Location": target.url + p}, b"") for p in _files(store, "/victim.lmdb")}
    redirector = Server(routes)
    url = f"{redirector.url}/victim.lmdb"
    try:
        with pytest.raises(RedirectRefusedError, match=r"redirects to http://127\.0\.0\.1:\d+/victim\.lmdb/manifest"
                                                       r"\.json, another origin.*allow_redirects"):
            fastdata.open_dataset(url, cache_dir=str(tmp_path / "c1"))
        with pytest.raises(RedirectRefusedError):
            fastdata.info(url, cache_dir=str(tmp_path / "c2"))
        ds = fastdata.open_dataset(url, output="numpy", cache_dir=str(tmp_path / "c3"),
                                   storage_options={"allow_redirects": True})
        assert len(ds) == 6 and ds[5][0].shape == (48, 64, 3)
    finally:
        redirector.close()
        target.close()


def test_remote_verify_never_downloads_more_than_the_manifest_says(store, tmp_path):
    root = tmp_path / "www"
    copy = H.copy_store(store, root / "victim.lmdb")
    shard = H.first_shard(copy)
    with open(shard, "ab") as fh:  # the server's object is 4 MiB longer than the manifest says
        fh.write(b"\0" * (4 << 20))
    server = H.HTTPStoreServer(str(root))
    try:
        report = fastdata.verify(f"{server.url}/victim.lmdb", scratch_dir=str(tmp_path / "scratch"))
    finally:
        server.close()
    assert not report.ok
    assert any("the server says the object is" in p and "the manifest says" in p for p in report.problems), \
        report.problems
