"""Hostile stores: craft a store that carries one attack, re-sign it so every checksum the
manifest holds agrees again, and read it in a fresh process under bounded memory and time.

A store is untrusted input (a colleague's directory, a shared bucket, an https:// store), so
its checksums prove nothing: whoever crafted it recomputed them. The helpers here do the same
(:func:`resign`), so a crafted store differs from a sound one only by its attack.

The harness (:class:`Harness`) is a *zygote*: one Python process that imports fastdata, torch,
h5py and lmdb once, then forks a fresh child per case. The child drops to
``RLIMIT_AS = baseline + MEMORY_GROWTH`` (the baseline is measured: the peak address space of a
child that opened and read a small sound store), runs one operation (:data:`OPS`) and reports
one JSON result; the zygote kills it after ``timeout`` seconds. Outcomes:

``ok``             the operation finished (``digest`` says what it read)
``typed_error``    a :class:`fastdata.errors.FastdataError` (or ``verify`` reported damage)
``untyped_error``  any other exception
``memory``         a MemoryError under the address-space limit
``signal``         the child was killed by a signal (SIGBUS, SIGSEGV...)
``timeout``        still running after ``timeout`` seconds (killed)
``leak``           what was read contains a canary: bytes from outside the store
``clobbered``      a file outside the destination was written or deleted (convert cases)

Every crafting function here takes the store path and ``attack``: with ``attack=False`` it
goes through the same motions (delete and recreate a dataset, rewrite a page, re-sign) with
benign content, the control proving the store is sound apart from its one attack.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import numpy as np
import xxhash

from helpers.bounded import vm_size, wait_for_child
from helpers.images import TESTS_DIR, make_tree

#: what a hostile store may cost a reader beyond a reader's own baseline
MEMORY_GROWTH = 384 << 20
#: seconds a case may run
TIMEOUT = 20.0
#: an environment variable every harness child carries: found in what a reader returns, it
#: came from ``/proc/self/environ``
CANARY_ENV = "FASTDATA_HOSTILE_CANARY"
CANARY = os.environ.get(CANARY_ENV) or "canary-" + xxhash.xxh3_64_hexdigest(str(time.time_ns()).encode())
#: the content of canary files placed outside a store
CANARY_FILE_TEXT = CANARY + "-outside-the-store\n"

MANIFEST = "manifest.json"
STORE_INDEX = "index.fdi"


# -- building sound stores -------------------------------------------------------------------

def store_name(backend: str, stem: str = "victim") -> str:
    """``victim.lmdb`` / ``victim.h5``: a store directory name selecting ``backend``."""
    from fastdata.format.backends.registry import BACKENDS

    return stem + BACKENDS[backend].shard_suffix


def build_store(dst: str | os.PathLike, *, tree: str | os.PathLike, raw: str | None = None,
                shard_size: str | None = None) -> str:
    """Convert ``tree`` (an ImageFolder) into the store ``dst`` (its suffix picks the backend)."""
    import fastdata

    fastdata.convert(str(tree), str(dst), raw=raw, shard_size=shard_size, progress=False, workers=1)
    return str(dst)


def build_tree(root: str | os.PathLike, classes: dict[str, int] | None = None, size=(64, 48), seed: int = 0) -> str:
    """A small ImageFolder tree; 64x48 JPEGs are ~3 KB, less than an LMDB page: fastdata's LMDB
    layout 3 keeps such a record as an empty head and an inline tail (pass a larger ``size``
    for overflow values)."""
    return make_tree(root, classes or {"cat": 3, "dog": 3}, size=size, seed=seed)


#: the general (version 2) stores' schema: an image, an int, a JSON field and a small array
V2_SCHEMA = {"image": {"kind": "image"}, "label": {"kind": "int", "dtype": "int64"},
             "meta": {"kind": "json"}, "vec": {"kind": "ndarray", "dtype": "float32", "shape": [4]}}


def build_v2_store(dst: str | os.PathLike, n: int = 4) -> str:
    """A general store (``fastdata.write``) with every field kind the attacks need."""
    import io

    from PIL import Image

    import fastdata
    from fastdata.fields import JSON, Image as ImageField, Int, NDArray, Schema

    schema = Schema.of({"image": ImageField(), "label": Int("int64"), "meta": JSON(), "vec": NDArray("float32", (4,))})
    samples = []
    for i in range(n):
        buf = io.BytesIO()
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(buf, "JPEG")
        samples.append({"image": buf.getvalue(), "label": i, "meta": {"i": i, "tags": ["a"] * i},
                        "vec": np.arange(4, dtype=np.float32) + i})
    fastdata.write(samples, str(dst), schema, progress=False, workers=1)
    return str(dst)


def copy_store(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return str(dst)


# -- re-signing --------------------------------------------------------------------------------

def file_xxh(path: str) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while block := fh.read(4 << 20):
            h.update(block)
    return h.hexdigest()


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def load_manifest(store: str) -> dict:
    with open(os.path.join(store, MANIFEST), "rb") as fh:
        return json.loads(fh.read())


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):  # missing, or a name with a NUL
        return False


def resign(store: str, body: dict | None = None, *, splice: tuple[str, bytes] | None = None) -> dict:
    """Make every checksum of ``store`` agree with its files again and write the manifest.

    Each shard entry's ``bytes``/``xxh`` are those of its file (left as they are when the file is
    missing or not a regular file: a FIFO cannot be hashed), the ``store_index`` entry those of
    ``index.fdi``, and the body checksum that of the (possibly hostile) body; nothing is
    validated. ``body`` defaults to the manifest on disk. ``splice = (placeholder, raw_json)``:
    the string value ``placeholder`` in the body is replaced by ``raw_json`` in the written bytes
    (a 48 MiB JSON bomb is never built as Python objects here). Returns the body."""
    body = load_manifest(store) if body is None else body
    body.pop("checksum", None)
    for shard in body.get("shards", []):
        path = os.path.join(store, str(shard.get("name", "")))
        if isinstance(shard, dict) and _regular(path):
            shard["bytes"] = os.path.getsize(path)
            shard["xxh"] = file_xxh(path)
    fdi = os.path.join(store, STORE_INDEX)
    if isinstance(body.get("store_index"), dict) and _regular(fdi):
        with open(fdi, "rb") as fh:
            data = fh.read()
        body["store_index"] = {"name": STORE_INDEX, "bytes": len(data), "xxh": xxhash.xxh3_64_hexdigest(data)}

    def spliced(raw: bytes) -> bytes:
        if splice is None:
            return raw
        marker = json.dumps(splice[0]).encode()
        assert raw.count(marker) == 1, "the splice placeholder must occur once"
        return raw.replace(marker, splice[1])

    digest = xxhash.xxh3_64_hexdigest(spliced(canonical(body)))
    full = dict(body, checksum=digest)
    data = spliced(canonical(full))
    path = os.path.join(store, MANIFEST)
    if _regular(path) or not os.path.lexists(path):
        with open(path, "wb") as fh:
            fh.write(data)
    return full


def index_entries(store: str) -> dict:
    """``index.fdi`` decoded (msgpack, raw arrays as bytes)."""
    with open(os.path.join(store, STORE_INDEX), "rb") as fh:
        return msgpack.unpackb(fh.read(), raw=False)


def patch_store_index(store: str, shard: str, arrays: dict[str, np.ndarray]) -> None:
    """Replace some of shard ``shard``'s arrays in ``index.fdi`` (as the tampered shard now holds them)."""
    body = index_entries(store)
    for entry in body["shards"]:
        if entry["name"] == shard:
            for key, arr in arrays.items():
                little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
                entry["arrays"][key] = [little.dtype.str, list(little.shape), little.tobytes()]
    with open(os.path.join(store, STORE_INDEX), "wb") as fh:
        fh.write(msgpack.packb(body, use_bin_type=True))


def first_shard(store: str) -> str:
    return os.path.join(store, load_manifest(store)["shards"][0]["name"])


# -- HDF5 surgery ------------------------------------------------------------------------------

def h5_read(path: str, name: str) -> np.ndarray:
    import h5py

    with h5py.File(path, "r", locking=False) as f:
        return f[name][()]


def h5_replace(path: str, name: str, make: Callable[[Any, str], None]) -> None:
    """Delete dataset ``name`` of the HDF5 file ``path`` and let ``make(file, name)`` put something
    (a dataset, a link...) in its place."""
    import h5py

    with h5py.File(path, "r+", locking=False) as f:
        del f[name]
        make(f, name)


def h5_dataset(data: np.ndarray) -> Callable[[Any, str], None]:
    """``make`` for :func:`h5_replace`: a plain contiguous dataset (the controls)."""
    return lambda f, name: f.create_dataset(name, data=data)


def h5_data_ranges(path: str) -> list[tuple[int, int]]:
    """``(offset, end)`` file ranges of every contiguous dataset's raw data (what is not structure)."""
    import h5py

    out = []

    def visit(_name, obj):
        if isinstance(obj, h5py.Dataset):
            off = obj.id.get_offset()
            if off is not None:
                out.append((off, off + obj.id.get_storage_size()))

    with h5py.File(path, "r", locking=False) as f:
        f.visititems(visit)
    return out


# -- LMDB surgery ------------------------------------------------------------------------------
# MDB_meta (lmdb.h, 64-bit): after the 16-byte page header: mm_magic u32, mm_version u32,
# mm_address u64, mm_mapsize u64, mm_dbs[2] (free, main) of MDB_db {md_pad u32 (the free DB's holds
# the page size), md_flags u16, md_depth u16, md_branch_pages, md_leaf_pages, md_overflow_pages,
# md_entries, md_root: u64}, mm_last_pg u64, mm_txnid u64.
META_FIELDS = {"magic": (16, "<I"), "version": (20, "<I"), "mapsize": (32, "<Q"), "psize": (40, "<I"),
               "free_root": (80, "<Q"), "main_depth": (94, "<H"), "main_entries": (120, "<Q"),
               "main_root": (128, "<Q"), "last_pg": (136, "<Q"), "txnid": (144, "<Q")}
#: where the meta fields end (what a structural fuzz of a meta page flips within)
META_END = 152
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01
PAGE_HEADER = 16


def lmdb_meta(path: str) -> list[dict[str, int]]:
    """Both meta pages' fields (page size 4096 assumed for the second: lmdb's default)."""
    with open(path, "rb") as fh:
        data = fh.read(8192)
    return [{k: struct.unpack_from(fmt, data, page * 4096 + off)[0] for k, (off, fmt) in META_FIELDS.items()}
            for page in (0, 1)]


def lmdb_set_meta(path: str, **fields: int) -> None:
    """Set meta fields on both meta pages (whichever LMDB picks, it sees them)."""
    with open(path, "r+b") as fh:
        for page in (0, 1):
            for key, value in fields.items():
                off, fmt = META_FIELDS[key]
                fh.seek(page * 4096 + off)
                fh.write(struct.pack(fmt, value))


def lmdb_pages(path: str, psize: int = 4096):
    """``(pgno, flags, page bytes)`` of every page that is not an overflow continuation."""
    with open(path, "rb") as fh:
        data = fh.read()
    pgno = 2
    while pgno * psize < len(data):
        page = data[pgno * psize:(pgno + 1) * psize]
        flags = struct.unpack_from("<H", page, 10)[0]
        yield pgno, flags, page
        pgno += struct.unpack_from("<I", page, 12)[0] if flags & P_OVERFLOW else 1


def lmdb_bigdata_node(path: str, key: bytes | None, psize: int = 4096) -> tuple[int, int, int]:
    """``(file offset of the node, its data size, overflow pgno)`` of the leaf node holding ``key``
    (None: the first found) as an overflow (F_BIGDATA) value."""
    for pgno, flags, page in lmdb_pages(path, psize):
        if not flags & P_LEAF:
            continue
        lower = struct.unpack_from("<H", page, 12)[0]
        for k in range((lower - PAGE_HEADER) // 2):
            ptr = struct.unpack_from("<H", page, PAGE_HEADER + 2 * k)[0]
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", page, ptr)
            if nflags & F_BIGDATA and (key is None or page[ptr + 8:ptr + 8 + ksize] == key):
                over = struct.unpack_from("<Q", page, ptr + 8 + ksize)[0]
                return pgno * psize + ptr, lo | hi << 16, over
    raise LookupError(f"{path}: no overflow value for key {key!r}")


def lmdb_set_node_size(path: str, node_offset: int, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(node_offset)
        fh.write(struct.pack("<HH", size & 0xFFFF, size >> 16))


def lmdb_put(path: str, puts: dict[tuple[bytes, bytes], bytes], map_size: int = 256 << 20) -> None:
    """Write ``{(db name, key): value}`` into the LMDB shard ``path`` (with lmdb itself)."""
    import lmdb

    env = lmdb.open(path, subdir=False, lock=False, max_dbs=4, map_size=map_size)
    try:
        dbs = {name: env.open_db(name, create=False) for name in {db for db, _ in puts}}
        with env.begin(write=True) as txn:
            for (db, key), value in puts.items():
                txn.put(key, value, db=dbs[db])
    finally:
        env.close()


def lmdb_get(path: str, db: bytes, key: bytes) -> bytes:
    import lmdb

    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin(db=env.open_db(db, create=False)) as txn:
            value = txn.get(key)
            assert value is not None, key
            return bytes(value)
    finally:
        env.close()


def flip_bytes(path: str, offsets: list[int], rng: random.Random) -> None:
    """XOR a random non-zero byte into ``path`` at each of ``offsets``."""
    with open(path, "r+b") as fh:
        for off in offsets:
            fh.seek(off)
            old = fh.read(1)
            fh.seek(off)
            fh.write(bytes([old[0] ^ rng.randrange(1, 256)]))


# -- backend-generic index and record surgery (the two backends' layouts, docs/FORMAT.md) --------

def index_array(backend: str, shard: str, name: str, dtype: str) -> np.ndarray:
    """Index array ``name`` (``labels``, ``fields/label``...) of a shard, read with h5py/lmdb directly."""
    if backend == "hdf5":
        return np.asarray(h5_read(shard, name), dtype=dtype)
    if backend == "lmdb":
        return np.frombuffer(lmdb_get(shard, b"index", name.encode()), dtype=dtype).copy()
    raise NotImplementedError(f"no index surgery for backend {backend!r}")


def set_index_arrays(store: str, backend: str, shard: str, arrays: dict[str, np.ndarray]) -> None:
    """Overwrite index arrays in the shard file and in ``index.fdi`` (re-sign afterwards)."""
    little = {k: np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("<")) for k, v in arrays.items()}
    if backend == "hdf5":
        for name, arr in little.items():
            h5_replace(shard, name, h5_dataset(arr))
    elif backend == "lmdb":
        lmdb_put(shard, {(b"index", name.encode()): arr.tobytes() for name, arr in little.items()})
    else:
        raise NotImplementedError(f"no index surgery for backend {backend!r}")
    if os.path.exists(os.path.join(store, STORE_INDEX)):
        patch_store_index(store, os.path.basename(shard), little)


def _payload_name(shard: str) -> str:
    import h5py

    with h5py.File(shard, "r", locking=False) as f:
        return "records" if "records" in f else "images"


def lmdb_record(shard: str, i: int) -> bytes:
    """Record ``i`` of an LMDB shard: its ``records`` value, followed (layout version 3) by its tail
    parts where its head fills its pages exactly (``fastdata/format/backends/lmdb/spec.py``)."""
    import lmdb

    from fastdata.format.backends.lmdb import spec

    env = lmdb.open(shard, subdir=False, readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            head = txn.get(spec.encode_key(i), db=env.open_db(spec.RECORDS_DB, txn=txn, create=False))
            assert head is not None, (shard, i)
            try:
                tails = env.open_db(spec.TAILS_DB, txn=txn, create=False)
            except lmdb.NotFoundError:
                return bytes(head)
            parts = [bytes(head)]
            if spec.fills_pages(len(head), env.stat()["psize"]):
                while (part := txn.get(spec.tail_key(i, len(parts) - 1), db=tails)) is not None:
                    parts.append(bytes(part))
            return b"".join(parts)
    finally:
        env.close()


def lmdb_replace_record(shard: str, i: int, data: bytes) -> None:
    """Put ``data`` whole as record ``i`` of the LMDB shard (its ``records`` value), its tail parts
    (if any) deleted. The index is left alone."""
    import lmdb

    from fastdata.format.backends.lmdb import spec

    env = lmdb.open(shard, subdir=False, lock=False, max_dbs=4, map_size=max(256 << 20, 4 * os.path.getsize(shard)))
    try:
        with env.begin(write=True) as txn:
            txn.put(spec.encode_key(i), data, db=env.open_db(spec.RECORDS_DB, txn=txn, create=False))
            try:
                tails = env.open_db(spec.TAILS_DB, txn=txn, create=False)
            except lmdb.NotFoundError:
                return
            for part in range(spec.MAX_TAIL_PARTS):
                txn.delete(spec.tail_key(i, part), db=tails)
    finally:
        env.close()


def stored_item(backend: str, shard: str, i: int) -> bytes:
    """Record ``i``'s stored bytes: the LMDB record (value and tail), or its slice of the HDF5
    ``images``/``records``."""
    if backend == "lmdb":
        return lmdb_record(shard, i)
    if backend == "hdf5":
        offsets = h5_read(shard, "offsets")
        return h5_read(shard, _payload_name(shard))[offsets[i]:offsets[i + 1]].tobytes()
    raise NotImplementedError(f"no record surgery for backend {backend!r}")


def replace_item(store: str, backend: str, shard: str, i: int, data: bytes, checksummed: bytes | None = None,
                 **index: int) -> None:
    """Put ``data`` as record ``i``'s stored bytes (LMDB value / HDF5 payload slice) and make the
    index agree: ``checksums[i]`` = xxh3 of ``checksummed`` (default ``data``), ``nbytes[i]`` =
    ``len(checksummed)``, plus any ``index`` value (``widths=...``), and the manifest's ``image_bytes`` of
    the shard by the record's change of size (the manifest re-signed for that alone); the caller
    re-signs the rest."""
    from fastdata.format.record import INDEX_DTYPES

    covered = data if checksummed is None else checksummed
    if backend == "lmdb":
        lmdb_replace_record(shard, i, data)
    elif backend == "hdf5":
        name = _payload_name(shard)
        payload, offsets = h5_read(shard, name), h5_read(shard, "offsets").astype(np.int64)
        new = np.concatenate([payload[:offsets[i]], np.frombuffer(data, np.uint8), payload[offsets[i + 1]:]])
        offsets[i + 1:] += len(data) - (offsets[i + 1] - offsets[i])
        h5_replace(shard, name, h5_dataset(new))
        h5_replace(shard, "offsets", h5_dataset(offsets))
    else:
        raise NotImplementedError(f"no record surgery for backend {backend!r}")
    arrays = {}
    values = {"checksums": xxhash.xxh3_64_intdigest(covered), "nbytes": len(covered), **index}
    for name, value in values.items():
        arr = index_array(backend, shard, name, INDEX_DTYPES.get(name, "<i8"))
        grown = int(value) - int(arr[i]) if name == "nbytes" else 0
        arr[i] = value
        arrays[name] = arr
    set_index_arrays(store, backend, shard, arrays)
    # the manifest's image_bytes of the shard (the sum of its records' sizes) follows, as the
    # writer would have written it; the manifest's own checksum with it (the shards' and the index
    # file's are the caller's to re-sign, or to leave stale)
    body = load_manifest(store)
    for entry in body["shards"]:
        if entry["name"] == os.path.basename(shard) and grown:
            entry["image_bytes"] += grown
            body.pop("checksum", None)
            body["checksum"] = xxhash.xxh3_64_hexdigest(canonical(body))
            with open(os.path.join(store, MANIFEST), "wb") as fh:
                fh.write(canonical(body))


# -- msgpack bombs ---------------------------------------------------------------------------

def empty_lists_msgpack(n: int) -> bytes:
    """msgpack of a list of ``n`` empty lists: 1 byte each on disk, ~70 bytes each decoded."""
    return b"\xdd" + struct.pack(">I", n) + b"\x90" * n


def repack_map(obj: dict, raw_values: dict[str, bytes]) -> bytes:
    """msgpack of the map ``obj`` (key order kept) with the values of ``raw_values`` spliced in raw."""
    packer = msgpack.Packer(use_bin_type=True)
    out = [packer.pack_map_header(len(obj))]
    for key, value in obj.items():
        out.append(packer.pack(key))
        out.append(raw_values[key] if key in raw_values else packer.pack(value))
    return b"".join(out)


def empty_lists_json(n: int) -> bytes:
    return b"[" + b"[]," * (n - 1) + b"[]]"


# -- a loopback HTTP server (read-only stores, redirects) ---------------------------------------

class LoopbackServer:
    """An HTTP server on 127.0.0.1 (a free port) answering with ``handler`` (a
    ``BaseHTTPRequestHandler`` class), one thread per request, served from a daemon thread."""

    def __init__(self, handler) -> None:
        import http.server

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        # polled every 50 ms: shutdown() waits for the loop's next poll, 0.5 s by default (at every test's end)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HTTPStoreServer(LoopbackServer):
    """Serves the folder ``root`` over http://127.0.0.1 with Range support; ``redirect_to``
    (a base URL) makes every GET/HEAD answer 302 to the same path there."""

    def __init__(self, root: str, redirect_to: str | None = None):
        import http.server

        root_dir, target = root, redirect_to

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=root_dir, **kw)

            def log_message(self, *a):
                pass

            def send_head(self):
                if target is not None:
                    self.send_response(302)
                    self.send_header("Location", target.rstrip("/") + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                rng = self.headers.get("Range")
                path = self.translate_path(self.path)
                if not rng or not os.path.isfile(path):
                    return super().send_head()
                size = os.path.getsize(path)
                first, _, last = rng.removeprefix("bytes=").partition("-")
                start = int(first) if first else max(0, size - int(last))
                end = min(int(last), size - 1) if first and last else size - 1
                fh = open(path, "rb")  # noqa: SIM115 - the base class closes what send_head returns
                fh.seek(start)
                import io
                data = fh.read(end - start + 1)
                fh.close()
                self.send_response(206)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                return io.BytesIO(data)

        super().__init__(Handler)


# -- the operations a harness child runs -------------------------------------------------------

def _feed(h, value) -> None:
    """Hash anything a dataset returns (tuples, dicts, arrays, tensors, PIL images, scalars)."""
    import torch
    from PIL import Image

    if isinstance(value, (tuple, list)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _feed(h, value[k])
    elif isinstance(value, torch.Tensor):
        _feed(h, value.numpy())
    elif isinstance(value, np.ndarray):
        h.update(repr((value.shape, value.dtype.str)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Image.Image):
        h.update(repr((value.size, value.mode)).encode())
        h.update(value.tobytes())
    else:
        h.update(repr(value).encode("utf-8", "backslashreplace"))


def _seen(ds) -> tuple[list[str], list]:
    relpaths = []
    for i in range(min(len(ds), 16)):
        rel = getattr(ds, "relpath", None)
        if rel is not None:
            relpaths.append(str(rel(i)))
    targets = getattr(ds, "targets", None)
    return relpaths, [] if targets is None else [int(t) for t in list(targets)[:64]]


def op_open(store: str, output: str = "numpy", **kwargs) -> dict:
    """``open_dataset`` and read every sample (and its relpath, the targets, the classes)."""
    import fastdata

    ds = fastdata.open_dataset(store, output=output, **kwargs)
    h = xxhash.xxh3_64()
    for i in range(len(ds)):
        _feed(h, ds[i])
    relpaths, targets = _seen(ds)
    return {"outcome": "ok", "n": len(ds), "digest": h.hexdigest(), "relpaths": relpaths, "targets": targets,
            "classes": list(getattr(ds, "classes", []) or [])}


def op_batch(store: str, indices=(0, 1), output: str = "tensor") -> dict:
    """A DataLoader's batch fetch: ``ds.__getitems__(indices)``."""
    import fastdata

    ds = fastdata.open_dataset(store, output=output)
    h = xxhash.xxh3_64()
    _feed(h, list(ds.__getitems__(list(indices))))
    return {"outcome": "ok", "digest": h.hexdigest()}


def op_verify(store: str, decode: bool = False) -> dict:
    """``fastdata.verify``: damage reported counts as a typed error (it never raises for damage)."""
    import fastdata

    report = fastdata.verify(store, decode=decode)
    if not report.ok:
        return {"outcome": "typed_error", "type": f"VerifyReport[{report.status}]", "message": report.summary()}
    return {"outcome": "ok", "message": report.summary()}


def op_info(store: str) -> dict:
    import fastdata

    return {"outcome": "ok", "info": json.dumps(fastdata.info(store), default=str)[:2000]}


def _outside_state(paths: list[str]) -> dict:
    out = {}
    for p in paths:
        try:
            out[p] = file_xxh(p) if os.path.isfile(p) else ("dir:" + ",".join(sorted(os.listdir(p))))
        except OSError as err:
            out[p] = f"gone ({err.strerror})"
    return out


def op_convert(src: str, dst: str, watch: list[str], kind: str = "convert", **kwargs) -> dict:
    """Convert into ``dst``; ``watch``: paths outside it whose content must not change."""
    import fastdata

    before = _outside_state(watch)
    error = None
    try:
        if kind == "coco":
            fastdata.convert_coco(src, kwargs.pop("image_dir"), dst, progress=False, workers=1, **kwargs)
        else:
            fastdata.convert(src, dst, progress=False, workers=1, **kwargs)
    except Exception as err:  # noqa: BLE001 - classified below, after the outside check
        error = err
    after = _outside_state(watch)
    if before != after:
        return {"outcome": "clobbered", "message": f"outside paths changed: {before} -> {after}",
                "error": repr(error)}
    if error is not None:
        raise error
    return {"outcome": "ok"}


def _read_pairs(ds) -> list:
    """``(image shape, label)`` of every sample of an ImageFolder-like dataset."""
    out = []
    for i in range(len(ds)):
        img, label = ds[i]
        out.append([list(np.asarray(img).shape), int(label)])
    return out


def op_rewrite(store: str, new_src: str, mode: str, rewrite: bool = True) -> dict:
    """Open ``store``, rewrite it (``convert(new_src, store, overwrite=True)``), read it again.

    ``mode``: ``"after"`` (opened, nothing read, rewritten, read), ``"reopened"`` (read all,
    rewritten, read all again) or ``"fork"`` (one sample read, rewritten, read in a forked child,
    as a DataLoader worker would). Returns the pairs read for the caller to judge."""
    import fastdata

    ds = fastdata.open_dataset(store, output="numpy")
    before = _read_pairs(ds) if mode == "reopened" else (ds[0] and [])
    if rewrite:  # by another process, as in real life (and its writer's memory is not this reader's);
        # workers=0: that process writes itself (a pool of its own only added its start-up)
        subprocess.run([sys.executable, "-c", "import sys, fastdata; fastdata.convert(sys.argv[1], sys.argv[2], "
                        "overwrite=True, progress=False, workers=0)", new_src, store], check=True, timeout=120,
                       capture_output=True)
    if mode != "fork":
        return {"outcome": "ok", "before": before, "pairs": _read_pairs(ds)}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "worker"
        os.close(r)
        try:
            result = {"outcome": "ok", "pairs": _read_pairs(ds)}
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            result = _classify(err)
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"outcome": "signal", "message": "the forked reader died"}


def op_baseline(store: str) -> dict:
    return op_open(store)


OPS: dict[str, Callable[..., dict]] = {"open": op_open, "batch": op_batch, "verify": op_verify, "info": op_info,
                                       "convert": op_convert, "rewrite": op_rewrite, "baseline": op_baseline}


# -- the harness --------------------------------------------------------------------------------

def _vm_peak() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def _classify(err: BaseException) -> dict:
    from fastdata.errors import FastdataError

    if isinstance(err, MemoryError):
        outcome = "memory"
    elif isinstance(err, FastdataError):
        outcome = "typed_error"
    else:
        outcome = "untyped_error"
    return {"outcome": outcome, "type": type(err).__name__, "message": str(err)[:1000]}


def _child(request: dict, result_fd: int, log_path: str) -> None:
    """In the forked child: bound memory, run the operation, write one JSON result."""
    import resource

    os.setpgid(0, 0)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = vm_size() + request["growth"] if request.get("growth") else request.get("limit")
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = time.monotonic()
    try:
        op = OPS.get(request["op"]) or getattr(_CASES, request["op"])
        result = op(**request["args"])
    except BaseException as err:  # noqa: BLE001 - every failure is an outcome
        result = _classify(err)
    result["elapsed"] = round(time.monotonic() - start, 3)
    result["vm_peak"] = _vm_peak()
    blob = json.dumps(result, default=str)
    if result["outcome"] == "ok" and (CANARY in blob or CANARY_FILE_TEXT.strip() in blob):
        result["outcome"] = "leak"
        result["message"] = "bytes from outside the store appeared in what was read"
        blob = json.dumps(result, default=str)
    os.write(result_fd, blob.encode())
    os._exit(0)


#: the module of a harness's own cases (``Harness(cases=...)``), loaded in the zygote
_CASES: ModuleType | None = None


def _load_cases(path: str, workdir: str) -> ModuleType:
    """Import the test module at ``path`` in the zygote, under a name of its own, and run its
    ``zygote_setup(workdir)`` (imports and a warm-up, inherited by every child) if it has one."""
    spec = importlib.util.spec_from_file_location(f"hostile_cases_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "zygote_setup"):
        module.zygote_setup(workdir)
    return module


def zygote_main(cases: str | None = None, workdir: str | None = None) -> None:
    """The zygote: import everything once, then per request line fork a child and answer one line.
    ``cases``: the path of a test module whose ``case_*`` functions run beside :data:`OPS`."""
    global _CASES
    import h5py  # noqa: F401 - imported once here, inherited by every child
    import lmdb  # noqa: F401
    import torch  # noqa: F401

    import fastdata
    import fastdata.reader.open  # noqa: F401
    import fastdata.tools.verify  # noqa: F401
    import fastdata.writer.api  # noqa: F401

    fastdata.open_dataset  # noqa: B018 - resolve the lazy names before forking
    out = sys.stdout
    sys.stdout = sys.stderr
    if cases is not None:
        _CASES = _load_cases(cases, workdir or ".")
    out.write(json.dumps({"ready": True, "vm_size": _vm_peak()}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        r, w = os.pipe()
        log_path = request["log"]
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(request, w, log_path)
        os.close(w)
        data, status = wait_for_child(pid, r, request.get("timeout", TIMEOUT), group=True)
        try:  # reap the child's own children (a converter's workers), if any were left
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if status is None:
            result = {"outcome": "timeout", "message": f"still running after {request.get('timeout', TIMEOUT)} s"}
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            result = {"outcome": "signal", "signal": signal.Signals(sig).name, "rc": -sig}
        elif data:
            result = json.loads(data)
        else:
            result = {"outcome": "untyped_error", "message": f"no result (exit status {os.WEXITSTATUS(status)})"}
        try:
            with open(log_path, errors="replace") as fh:
                result["log_tail"] = fh.read()[-1500:]
        except OSError:
            pass
        out.write(json.dumps(result) + "\n")
        out.flush()


class Harness:
    """One zygote process; :meth:`run` runs one operation in a fresh fork of it.

    ``cases``: the path of a test module (``__file__``) whose ``case_*`` functions :meth:`run` may
    name beside :data:`OPS`; the zygote imports it once and calls its ``zygote_setup(workdir)``, if
    any, before the first fork."""

    def __init__(self, workdir: str | os.PathLike, env: dict[str, str] | None = None,
                 cases: str | os.PathLike | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {CANARY_ENV: CANARY, **os.environ, **(env or {})}  # first: /proc/self/environ's first bytes hold it
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
        code = "import sys; from helpers.hostile import zygote_main; zygote_main(*sys.argv[1:])"
        argv = [str(cases), str(self.workdir)] if cases is not None else []
        self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        ready = json.loads(self.proc.stdout.readline())
        assert ready.get("ready"), ready
        self.baseline = 0
        self.limit = 0
        self._n = 0

    def calibrate(self, stores: list[str]) -> None:
        """The baseline: the peak address space of a child opening and reading sound stores."""
        peaks = []
        for s in stores:
            result = self.run("baseline", store=s, limit=0)
            assert result["outcome"] == "ok", result
            peaks.append(result["vm_peak"])
        self.baseline = max(peaks)
        self.limit = self.baseline + MEMORY_GROWTH

    def run(self, op: str, *, timeout: float = TIMEOUT, limit: int | None = None, growth: int | None = None,
            **args) -> dict:
        """Run ``OPS[op](**args)`` (or the cases module's ``op``) in a fresh child; the result dict
        has ``outcome`` and, where it applies, ``type``, ``message``, ``elapsed`` (s), ``vm_peak``
        and ``growth`` (bytes above the baseline). The child's address space is bounded by
        ``limit`` (bytes; default: the calibrated one, 0: none) or, given ``growth``, by the
        zygote's own size + ``growth``. Path arguments are passed as strings."""
        self._n += 1
        args = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in args.items()}
        request = {"op": op, "args": args, "timeout": timeout, "limit": self.limit if limit is None else limit,
                   "growth": growth, "log": str(self.workdir / f"case-{self._n}.log")}
        started = time.monotonic()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the harness zygote died"
        result = json.loads(line)
        result.setdefault("elapsed", round(time.monotonic() - started, 3))
        if result.get("vm_peak") and self.baseline:
            result["growth"] = result["vm_peak"] - self.baseline
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_cli(args: list[str], *, limit: int = 0, timeout: float = TIMEOUT) -> dict:
    """``python -m fastdata ARGS`` under the same bounds: ``rc``, ``stdout``, ``stderr``, ``outcome``
    (``signal``/``timeout``/``exit``) and ``elapsed``."""
    import resource

    def bound():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = dict(os.environ, **{CANARY_ENV: CANARY})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fastdata", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=bound, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        outcome = "signal" if proc.returncode < 0 or proc.returncode in (128 + 7, 128 + 11) else "exit"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        outcome = "timeout"
    return {"outcome": outcome, "rc": proc.returncode, "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace"), "elapsed": round(time.monotonic() - started, 3)}


def describe(result: dict) -> str:
    """One line for an assertion message: the outcome, the error, memory growth and time."""
    growth = result.get("growth")
    parts = [result.get("outcome", "?")]
    if result.get("type") or result.get("signal"):
        parts.append(str(result.get("type") or result.get("signal")))
    if result.get("message"):
        parts.append(str(result["message"])[:300])
    if growth is not None:
        parts.append(f"growth {growth / 2**20:.0f} MiB")
    parts.append(f"{result.get('elapsed', 0):.2f} s")
    if result.get("outcome") in ("untyped_error", "memory") and result.get("log_tail"):
        parts.append("log: " + result["log_tail"][-300:])
    return " | ".join(parts)


def expect(result: dict, mode: str, *names: str) -> None:
    """Judge one harness result. ``control``: the read succeeded. ``attack``: a typed error,
    costing well under the memory bound, whose message names one of ``names`` (if any)."""
    if mode == "control":
        assert result["outcome"] == "ok", f"control failed: {describe(result)}"
        return
    assert result["outcome"] == "typed_error", describe(result)
    assert result.get("growth", 0) < MEMORY_GROWTH // 2, f"typed, but only after costing {describe(result)}"
    if names:
        assert any(n in result.get("message", "") for n in names), \
            f"the error does not name the store or shard {names}: {describe(result)}"
