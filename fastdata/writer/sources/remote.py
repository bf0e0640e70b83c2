"""An image folder or a ``path,label`` list at a URL (``s3://``, ``gs://``, ``az://``; ``https://``
lists), or a local list whose rows all name URLs, as a write source: the remote twin of
:mod:`fastdata.writer.sources.folder`.

The scan gives the same :class:`~fastdata.writer.sources.folder.SourceScan` a local scan gives, so
planning, the fingerprint, ``resume``, the reject report and the published store are the local
source's; only where the bytes come from differs:

* **listing**: :func:`fastdata.remote.sources.list_objects` (paged on ``s3://``), kept as the
  scan's arrays (one ``bytes`` key per object, sizes, ETags); a list file's rows are looked up
  with :func:`fastdata.remote.sources.stat_objects`;
* **order**: ImageFolder's: classes are the sorted first-level "folders" of the prefix, files
  sorted by (folder, name) within each class, as :func:`~fastdata.writer.sources.folder.scan_folder`
  walks a local tree, so a folder copied to a bucket converts to the same store;
* **reading**: each worker task fetches its inputs itself (:func:`ingest_remote_chunk`), a few
  GETs at a time, straight into memory: nothing is written to local disk but what a local
  conversion writes too. Each object must still have its listed ETag and size
  (:meth:`~fastdata.remote.location.RemoteLocation.read_object`): one that changed or was deleted
  stops the run with an error naming it, and nothing is published.

**Bounds.** The pipeline keeps at most ``max(2, 4 x workers)`` tasks of ``task_size`` inputs in
flight; an input is fetched only by the worker running its task, so at most that many tasks'
objects are fetched and not yet written to a shard (with the defaults and 8 workers: 32 tasks of
32 images). The listing holds about 16 bytes plus the key per object.

The fingerprint hashes each object's ETag beside its size (a local source hashes sizes: an
object rewritten at the same size is another input); ``resume`` compares it as for a local source.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import io
import json
import os
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import xxhash

from fastdata.common.extensions import has_image_extension
from fastdata.errors import SourceError
from fastdata.format.backends.base import StorageSpec
from fastdata.remote.location import RemoteLocation
from fastdata.remote.sources import join_url, list_objects, read_text, stat_objects
from fastdata.writer.ingest import ingest, MAX_INPUT_BYTES, Rejected, spill
from fastdata.format.manifest import target_field
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource
from fastdata.writer.plan import plan_shards, ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.base import record_run
from fastdata.writer.sources.folder import (
    FolderInput,
    FolderSource,
    is_url,
    list_labels,
    parse_rows,
    refuse_mixed_rows,
    SourceScan,
    SPLIT_NAMES,
)
from fastdata.writer.sources.table.input import TableInput

#: the fsspec implementation each scheme's workers import (preloaded by the pool's forkserver)
FILESYSTEM_MODULES = {"s3": ("s3fs",), "s3a": ("s3fs",), "gs": ("gcsfs",), "gcs": ("gcsfs",), "az": ("adlfs",),
                      "abfs": ("adlfs",), "abfss": ("adlfs",), "http": ("fsspec.implementations.http",),
                      "https": ("fsspec.implementations.http",)}
#: GETs one worker keeps in flight while fetching its task's inputs
FETCH_CONCURRENCY = 8
def _imagefolder_key(name: bytes) -> tuple[bytes, bytes]:
    """ImageFolder's order of a file below a class folder: by its folder's path, then its name
    (``sorted(os.walk(...))`` compares the walked folders' paths as strings)."""
    folder, _, base = name.rpartition(b"/")
    return folder, base


def scan_remote_folder(url: str, storage_options: Mapping[str, Any]) -> SourceScan:
    """Scan an ImageFolder-layout prefix: ``url/<class>/.../<image>``.

    Raises:
        SourceError: nothing under the prefix, a bucket that does not exist, failing
            credentials, or no image object in any class folder.
    """
    url = url.rstrip("/")
    listing = list_objects(RemoteLocation(url, storage_options))
    classes = sorted({name.split(b"/", 1)[0].decode() for name in listing.names if b"/" in name})
    if not classes:
        raise SourceError(f"{url}: no class folders found (expected {url}/<class>/<image files>)")
    class_to_idx = {c: i for i, c in enumerate(classes)}
    # (index, class, key) sorted as ImageFolder walks; the indices reorder the arrays
    keep = [(class_to_idx[name.split(b"/", 1)[0].decode()], _imagefolder_key(name.split(b"/", 1)[1]), i)
            for i, name in enumerate(listing.names) if b"/" in name and has_image_extension(name.decode())]
    keep.sort()
    order = np.fromiter((i for _, _, i in keep), dtype=np.int64, count=len(keep))
    labels = np.fromiter((c for c, _, _ in keep), dtype=np.int64, count=len(keep))
    del keep
    names = [listing.names[i] for i in order]
    if not names:
        raise SourceError(f"{url}: no image files found in its {len(classes)} class folder(s) (searched for "
                          "the image extensions ImageFolder takes, any case)")
    counts = np.bincount(labels, minlength=len(classes))
    empty = [c for c, n in zip(classes, counts, strict=True) if not n]
    problems: list[tuple[str, str]] = []
    if empty:
        problems.append((url, f"{len(empty)} class folder(s) hold no image file: {', '.join(empty[:20])}"
                              f"{' ...' if len(empty) > 20 else ''}; kept as classes with 0 samples, as "
                              "ImageFolder(allow_empty=True) does"))
    splits = [c for c in classes if c.lower() in SPLIT_NAMES]
    if splits and (len(splits) >= 2 or len(splits) == len(classes)):
        problems.append((url, f"class folder(s) named like dataset splits ({', '.join(splits)}): the classes "
                              f"should be the folders inside one split; did you mean {url}/{splits[0]}?"))
    return SourceScan(root=url, classes=classes, paths=names, relpaths=names, labels=labels,
                      sizes=listing.sizes[order], etags=listing.etags[order],
                      hidden_classes=[c for c in classes if c.startswith(".")], walk_problems=problems)


def listed_relpath(path: str) -> str:
    """What the store records as the relative path of a list row naming ``path``: a URL as
    written (``posixpath.normpath`` would fold its ``//``), else the path normalized."""
    return path if is_url(path) else posixpath.normpath(path)


#: the suffixes of the local list files whose rows may name URLs
URL_LIST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")


def first_listed_path(list_file: str) -> str | None:
    """The image path of the first row of the local list file ``list_file``: the first column of a
    ``path,label`` CSV/TSV (the ``path`` column of one with a header naming it), a JSONL row's
    ``path`` key. None when there is none, or the file cannot be read (its scan says why)."""
    try:
        with open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            if list_file.lower().endswith((".jsonl", ".ndjson")):
                for line in fh:
                    if line.strip():
                        row = json.loads(line)
                        path = row.get("path") if isinstance(row, dict) else None
                        return path.strip() if isinstance(path, str) else None
                return None
            column = 0
            reader = csv.reader(fh, delimiter="\t" if list_file.lower().endswith(".tsv") else ",")
            for row in reader:
                cells = [c.strip() for c in row]
                if not cells or not any(cells):
                    continue
                if reader.line_num == 1 and "path" in (c.lower() for c in cells):  # (a header)
                    column = [c.lower() for c in cells].index("path")
                    continue
                return cells[column] if column < len(cells) else None
    except (OSError, ValueError, RecursionError, csv.Error):
        return None
    return None


def list_names_urls(list_file: str) -> bool:
    """Whether ``list_file`` is a local list (CSV/TSV/JSONL) whose first row names a URL: its rows
    are then read from their servers (:class:`RemoteFolderInput`, :class:`RemoteTableInput`), each
    of them a URL (:func:`refuse_mixed_rows`)."""
    if is_url(list_file) or not list_file.lower().endswith(URL_LIST_SUFFIXES) or not os.path.isfile(list_file):
        return False
    first = first_listed_path(list_file)
    return first is not None and is_url(first)


def _list_bytes(src: str, storage_options: Mapping[str, Any]) -> bytes:
    """The bytes of the list file ``src``: a URL (at most :data:`fastdata.remote.sources.MAX_LIST_BYTES`),
    or a local file.

    Raises:
        SourceError: it does not exist or cannot be read.
    """
    if is_url(src):
        return read_text(src, storage_options)
    try:
        with open(src, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise SourceError(f"list file not found: {src}") from None
    except OSError as err:
        raise SourceError(f"cannot read list file {src}: {err.strerror}") from None


def scan_remote_list(src: str, storage_options: Mapping[str, Any]) -> SourceScan:
    """Scan a ``path,label`` CSV/TSV list at the URL ``src`` (rows name URLs, or keys relative to
    the list's folder, ``..`` resolved), or a local list whose rows all name URLs; labels as
    :func:`~fastdata.writer.sources.folder.scan_list` reads them. A row whose object does not exist
    is kept, and rejected when read (as a local list's missing file is). The relative path
    recorded for a URL row is the URL as written.

    Raises:
        SourceError: as :func:`~fastdata.writer.sources.folder.scan_list`, or a local list with a
            row naming a local path (:func:`refuse_mixed_rows`).
    """
    src = src if is_url(src) else os.path.abspath(src)
    text = _list_bytes(src, storage_options).decode("utf-8-sig", errors="surrogateescape")
    rows = parse_rows(src, io.StringIO(text, newline=""))
    del text
    if not rows:
        raise SourceError(f"{src}: the list names no image files (expected rows of path,label)")
    classes, labels = list_labels(src, rows)
    if is_url(src):
        base = src.rsplit("/", 1)[0]
        urls = [join_url(base, path) for path, _, _ in rows]
    else:  # (a local list naming URLs: its rows are never joined to its folder)
        refuse_mixed_rows(src, (path for path, _, _ in rows), (line for _, _, line in rows))
        urls = [path for path, _, _ in rows]
        base = urls[0].rsplit("/", 1)[0]  # (whose location resolves the workers' credentials)
    sizes, etags = stat_objects(urls, storage_options)
    return SourceScan(root=base, classes=classes, paths=[u.encode() for u in urls],
                      relpaths=[listed_relpath(p).encode() for p, _, _ in rows], labels=labels,
                      sizes=sizes, etags=etags, is_list=True)


def url_modules(urls: Iterable[str]) -> tuple[str, ...]:
    """The filesystem modules the workers import to read ``urls`` (:data:`FILESYSTEM_MODULES`)."""
    return tuple(dict.fromkeys(m for u in urls for m in FILESYSTEM_MODULES.get(u.split("://", 1)[0].lower(), ())))


def fetch_inputs(urls: list[bytes], sizes: list[int], etags: list[int], storage_options: Mapping[str, Any],
                 direct_spec: dict[str, Any] | None = None) -> Iterator[bytes | str]:
    """The bytes of each input at ``urls``, in order (a rejection reason instead for one that
    cannot be stored: missing at listing time, too large), fetched :data:`FETCH_CONCURRENCY` GETs at
    a time ahead of the one yielded: the caller ingests an input while the next ones arrive. Inputs
    of one bucket that libcurl can fetch are fetched side by side by it on this thread
    (:meth:`~fastdata.remote.location.RemoteLocation.batch_reader`); others by this process's
    fetch threads. ``direct_spec``: the converter's plain-GET settings for ``s3://`` (see
    :meth:`~fastdata.remote.location.RemoteLocation.direct_spec`).

    Raises:
        SourceChangedError: an object changed or was deleted since it was listed.
        RemoteStoreError: the server could not be reached (after retries).
    """
    def rejection(i: int) -> str | None:
        if sizes[i] == -1:
            return "file not found (a wrong path in the list, or deleted or moved after the scan)"
        if sizes[i] > MAX_INPUT_BYTES:
            return f"object of {sizes[i]} bytes exceeds the {MAX_INPUT_BYTES} byte limit for one image"
        return None

    def split(url: bytes) -> tuple[str, str]:  # (scheme://bucket, the object's name below it)
        scheme, _, rest = url.decode().partition("://")
        bucket, _, name = rest.partition("/")
        return f"{scheme}://{bucket}", name

    wanted = [i for i in range(len(urls)) if rejection(i) is None]
    located = [split(urls[i]) for i in wanted]
    roots = {root for root, _ in located}
    batch = RemoteLocation(roots.pop(), storage_options).batch_reader(direct_spec) if len(roots) == 1 else None
    if batch is not None:
        fetched = batch([name for _, name in located], [max(sizes[i], -1) for i in wanted], [etags[i] for i in wanted])
        try:
            for i in range(len(urls)):
                reason = rejection(i)
                yield reason if reason is not None else next(fetched)
        finally:
            fetched.close()  # (what has not arrived is dropped)
        return

    readers: dict[str, Callable[[str, int, int], bytes]] = {}  # per bucket (or host): its filesystem looked up once
    for root, _ in located:  # made here, not by each fetch thread at once
        if root not in readers:
            readers[root] = RemoteLocation(root, storage_options).object_reader(direct_spec)

    def one(i: int) -> bytes | str:
        reason = rejection(i)
        if reason is not None:
            return reason
        root, name = split(urls[i])
        return readers[root](name, max(sizes[i], -1), etags[i])
    futures: list[cf.Future | None] = [_fetch_pool().submit(one, i) for i in range(len(urls))]
    try:
        for k, future in enumerate(futures):
            assert future is not None
            yield future.result()
            futures[k] = None  # (its bytes go once the caller is done with them)
    finally:  # (a task stopped early: what has not started is not fetched)
        for future in futures:
            if future is not None:
                future.cancel()


_FETCH_POOLS: dict[int, cf.ThreadPoolExecutor] = {}
_FETCH_POOLS_LOCK = threading.Lock()


def _fetch_pool() -> cf.ThreadPoolExecutor:
    """This process's :data:`FETCH_CONCURRENCY` fetch threads, made on first use (never inherited
    across a fork) and kept for its later tasks: starting eight threads for every task of 32 inputs
    cost a worker about a tenth of its time."""
    pid = os.getpid()
    with _FETCH_POOLS_LOCK:
        pool = _FETCH_POOLS.get(pid)
        if pool is None:
            pool = _FETCH_POOLS[pid] = cf.ThreadPoolExecutor(FETCH_CONCURRENCY, thread_name_prefix="fastdata-fetch")
        return pool


def ingest_remote_chunk(urls: list[bytes], relpaths: list[bytes], labels: list[int], storage: StorageSpec,
                        keep_raw: list[bool] | None, sizes: list[int], etags: list[int],
                        storage_options: Mapping[str, Any], direct_spec: dict[str, Any] | None = None,
                        spill_dir: str | None = None):
    """Worker entry point of a remote source: fetch a task's inputs
    (:func:`fetch_inputs`) and ingest each as :func:`fastdata.writer.ingest.ingest_chunk` ingests
    a local file. Returns ``(items, input bytes)``, spilled with ``spill_dir``."""
    out: list = []
    read_bytes = 0
    choices = keep_raw if keep_raw is not None else [None] * len(urls)
    fetched = fetch_inputs(urls, sizes, etags, storage_options, direct_spec)
    for url, rel, label, raw, data in zip(urls, relpaths, labels, choices, fetched, strict=True):
        if isinstance(data, str):
            out.append(data)
            continue
        read_bytes += len(data)
        try:
            out.append(ingest(url, rel, label, storage, data, raw))
        except Rejected as reason:
            out.append(str(reason))
        except MemoryError:
            out.append("out of memory while decoding (image too large for this machine)")
        del data
    if spill_dir is not None:
        return spill(out, spill_dir), read_bytes
    return out, read_bytes


class ReadsURLs:
    """What every input that reads its objects at URLs shares (mixed in before its local twin):
    ``reads_urls``, its storage options (its own, else the write's), the name recorded in the
    manifest, and the filesystem modules its workers import."""

    reads_urls: bool = True
    worker_modules: tuple[str, ...] = ()
    storage_options: dict[str, Any]
    recorded_source: str

    def read_at(self, url: str, storage_options: Mapping[str, Any] | None, recorded: str | None = None) -> None:
        """Note the URL scheme's worker modules, ``storage_options`` and the source recorded in the
        manifest (``recorded``, default ``url``)."""
        self.recorded_source = url if recorded is None else recorded
        self.storage_options = dict(storage_options or {})
        self.worker_modules = tuple(FILESYSTEM_MODULES.get(url.split("://", 1)[0].lower(), ()))

    def use_storage_options(self, options: Mapping[str, Any] | None) -> None:
        """The write's ``storage_options`` for the input's URLs, unless the input was given its own."""
        if options and not self.storage_options:
            self.storage_options = dict(options)



class RemoteFolderSource(FolderSource):
    """The inputs of a remote scan, fetched and ingested in the workers (:func:`ingest_remote_chunk`)."""

    worker = staticmethod(ingest_remote_chunk)  # type: ignore[assignment]  # (its own arguments: its chunks)

    def __init__(self, scan: SourceScan, storage: StorageSpec, chunk_size: int, storage_options: Mapping[str, Any]):
        super().__init__(scan, storage, chunk_size)
        root = RemoteLocation(scan.root, dict(storage_options))
        # what the workers use when a GET falls back to s3fs (or always, off S3-compatible
        # endpoints): the credentials this process resolved, since their pool may predate them
        self.storage_options = root.worker_storage_options()
        # the converter's plain-GET settings (endpoint, credentials): workers then make no S3 client
        # of their own unless a GET falls back (about a second of CPU each); in memory only
        self.direct_spec = root.direct_spec()
        self._root = scan.root.encode() + b"/"

    def _url(self, i: int) -> bytes:
        # a folder scan keeps keys only (relative to the root); a list scan keeps each row's URL
        return self.scan.paths[i] if self.scan.is_list else self._root + self.scan.paths[i]

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        scan = self.scan
        assert scan.etags is not None, "a remote scan lists ETags"
        for plan in plans or []:
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                raw = scan.raw[a:b].tolist() if scan.raw is not None else None
                yield Chunk(plan, a, b, b == plan.stop,
                            ([self._url(i) for i in range(a, b)], scan.relpaths[a:b], scan.labels[a:b].tolist(),
                             self.storage, raw, scan.sizes[a:b].tolist(), scan.etags[a:b].tolist(),
                             self.storage_options, self.direct_spec))

    def describe(self, start: int, stop: int) -> str:
        return f"{self._url(start).decode()} .. {self._url(stop - 1).decode()}"

    def input_path(self, i: int) -> str:
        return self._url(i).decode()

    def runs_in_main_first(self, chunk: Chunk) -> bool:
        return False  # (the bytes are not here: a worker fetches them)


class RemoteFolderInput(ReadsURLs, FolderInput):
    """An ImageFolder prefix or a ``path,label`` list at a URL, or a local ``path,label`` list whose
    rows name URLs (see the module docstring), with the storage options of
    :class:`~fastdata.writer.sources.folder.FolderInput` except ``raw_budget`` (which reads every
    image's header while planning)."""

    def __init__(self, src: str, *, storage_options: Mapping[str, Any] | None = None, **keywords: Any):
        if keywords.get("raw_budget") is not None:
            raise ValueError(f"{src}: raw_budget reads every image's header while planning, which a remote source "
                             "would download twice; use raw_fraction, or convert a local copy")
        super().__init__(src, **keywords)
        self.src = src.rstrip("/") if not src.lower().endswith((".csv", ".tsv")) else src
        if is_url(src):
            self.read_at(src, storage_options, recorded=self.src)
        else:  # (a local list naming URLs: its first row's scheme tells the workers' modules)
            self.read_at(src, storage_options, recorded=os.path.abspath(src))
            self.worker_modules = url_modules([first_listed_path(src) or ""])


    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        if self.src.lower().endswith((".csv", ".tsv")):
            self.scan = scan_remote_list(self.src, self.storage_options)
        else:
            self.scan = scan_remote_folder(self.src, self.storage_options)
        return self._plan_scanned(run, dst)

    def chunks(self, run: RunOptions, chunk_size: int) -> RemoteFolderSource:
        return RemoteFolderSource(self._scan(), run.storage, chunk_size, self.storage_options)



# --------------------------------------------------------------------------- lists with fields (tables)


def _list_copy(url: str, storage_options: Mapping[str, Any]) -> tuple[str, str]:
    """The list file at ``url`` copied into a new local temporary folder under its own name (what
    the table reader parses; at most :data:`fastdata.remote.sources.MAX_LIST_BYTES`), and the
    xxh3-128 of its bytes; the caller removes the folder."""
    import tempfile

    import xxhash

    data = read_text(url, storage_options)
    folder = tempfile.mkdtemp(prefix="fastdata-list-")
    path = os.path.join(folder, url.rstrip("/").rsplit("/", 1)[-1])
    with open(path, "wb") as fh:
        fh.write(data)
    return path, xxhash.xxh3_128_hexdigest(data)


def scan_remote_table(src: str, storage_options: Mapping[str, Any], schema: Any = None):
    """A JSONL or CSV/TSV list with fields at the URL ``src`` (rows naming URLs or keys relative to
    the list's folder), or a local one whose rows all name URLs, as the table reader parses it, with
    each image's URL, size and ETag looked up.

    Returns:
        tuple[TableSource, list[bytes], np.ndarray, str]: the table (its ``list_file`` the URL or
        the local path, sizes and missing images from the object store), each row's image URL, the
        ETags, and the digest of the list file's bytes.

    Raises:
        SourceError: as :func:`~fastdata.writer.sources.table.reader.scan_table`, a list with a
            second image field (its paths are read from local files only), or a local list with a
            row naming a local path.
    """
    import dataclasses
    import shutil

    from fastdata.writer.sources.table.reader import MAX_ROW_ERRORS, scan_table

    if is_url(src):
        local, digest = _list_copy(src, storage_options)
        try:
            table = scan_table(local, schema, mixed_urls=True)
        finally:
            shutil.rmtree(os.path.dirname(local), ignore_errors=True)
        base = src.rsplit("/", 1)[0]
    else:  # (a local list naming URLs: scan_table refuses one naming a local path too)
        src = os.path.abspath(src)
        digest = xxhash.xxh3_128_hexdigest(_list_bytes(src, storage_options))
        table = scan_table(src, schema)
        base = ""
    images = list(table.schema.image_fields())
    if images != ["image"]:
        raise SourceError(f"{src}: a list read from a URL has one image field (its path column); the fields "
                          f"{', '.join(n for n in images if n != 'image')} name image files too: convert a local copy")
    urls = [join_url(base, os.fsdecode(rel)) if base else os.fsdecode(rel) for rel in table.relpaths]
    if not base:
        base = urls[0].rsplit("/", 1)[0] if urls else src  # (whose location resolves the workers' credentials)
    sizes, etags = stat_objects(urls, storage_options)
    missing = np.flatnonzero(sizes == -1).astype(np.int64)
    problems = [(urls[i], f"{src}:{int(table.lines[i])}: image file not found") for i in missing[:MAX_ROW_ERRORS]]
    if len(missing) > MAX_ROW_ERRORS:
        problems.append((src, f"... and {len(missing) - MAX_ROW_ERRORS} more missing image files"))
    table = dataclasses.replace(table, list_file=src, root=base, sizes=sizes, missing=missing, problems=problems)
    return table, [u.encode() for u in urls], etags, digest


#: the list of this worker process (set by the pool initializer :func:`set_remote_table`)
_REMOTE_TABLE: Any = None


def set_remote_table(table: Any) -> None:
    """Worker initializer: keep the remote list for :func:`encode_remote_table_chunk` (None: let it go)."""
    global _REMOTE_TABLE
    _REMOTE_TABLE = table


def encode_remote_table_chunk(schema, start: int, stop: int, urls: list[bytes], sizes: list[int], etags: list[int],
                              storage_options: Mapping[str, Any], direct_spec: dict[str, Any] | None,
                              spill_dir: str | None = None):
    """Worker entry point of a remote list with fields: rows ``start .. stop-1``, their images
    fetched (:func:`fetch_inputs`) and each row encoded as a local list's row is
    (:func:`fastdata.writer.sources.table.input.encode_table_row`), or the reason it is rejected."""
    from fastdata.errors import RejectedInputError
    from fastdata.writer.sources.table.input import encode_table_row

    table = _REMOTE_TABLE
    assert table is not None, "encode_remote_table_chunk runs in workers started with set_remote_table"
    results: list = []
    nbytes = 0
    name = table.list_file.rsplit("/", 1)[-1]
    fetched = fetch_inputs(urls, sizes, etags, storage_options, direct_spec)
    for i, data in zip(range(start, stop), fetched, strict=True):
        line = f"{name}:{int(table.lines[i])}"
        if isinstance(data, str):
            results.append(f"{data} ({line})")
            continue
        nbytes += len(data)
        row = table.row(i)
        row["image"] = data
        try:
            results.append(encode_table_row(schema, row, i, table.relpaths[i]))
        except RejectedInputError as err:
            results.append(f"{err} ({line})")
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class RemoteTableChunks(ChunkSource):
    """The pipeline's feed for a remote list with fields: row ranges with their image URLs, the
    list itself given once to each worker (:func:`set_remote_table`)."""

    worker = staticmethod(encode_remote_table_chunk)

    def __init__(self, table: Any, urls: list[bytes], etags: np.ndarray, chunk_size: int,
                 storage_options: Mapping[str, Any]):
        self.table, self.urls, self.etags, self.chunk_size = table, urls, etags, chunk_size
        self.storage_options = dict(storage_options)
        self.direct_spec = RemoteLocation(table.root, self.storage_options).direct_spec()
        self.worker_init = (set_remote_table, (table,))

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop,
                            (self.table.schema, a, b, self.urls[a:b], self.table.sizes[a:b].tolist(),
                             self.etags[a:b].tolist(), self.storage_options, self.direct_spec))

    def describe(self, start: int, stop: int) -> str:
        return f"{self.table.list_file} lines {int(self.table.lines[start])} .. {int(self.table.lines[stop - 1])}"

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.table.relpaths[i])

    def input_path(self, i: int) -> str:
        return self.urls[i].decode()


class RemoteTableInput(ReadsURLs, TableInput):
    """A JSONL or CSV/TSV list with fields at a URL (rows naming URLs, or keys relative to the
    list's folder), or a local one whose rows name URLs, as a general store: the store a local copy
    of the list and its images gives. The fingerprint hashes the list's bytes and each image's size
    and ETag."""

    def __init__(self, src: str, schema=None, *, storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, schema)
        if is_url(src):
            self.read_at(src, storage_options)
        else:  # (a local list naming URLs: its first row's scheme tells the workers' modules)
            self.read_at(src, storage_options, recorded=os.path.abspath(src))
            self.worker_modules = url_modules([first_listed_path(src) or ""])
        self.urls: list[bytes] = []
        self.etags = np.zeros(0, np.uint64)
        self.list_digest = ""


    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        table, self.urls, self.etags, self.list_digest = scan_remote_table(self.src, self.storage_options,
                                                                           self.declared)
        self.table = table
        self.schema = table.schema
        self.target = target_field(table.schema, table.class_tables)
        sizes = table.sizes.clip(min=0) + 64  # (as a local list plans: image sizes plus a little)
        plans = plan_shards(sizes, run.shard_size.bytes)
        check_shard_count(plans, int(sizes.sum()), run.shard_size)
        return plans

    def fingerprint(self, run: RunOptions) -> str:
        table = self._table()
        h = xxhash.xxh3_128()
        h.update(json.dumps([run.backend, run.shard_size.bytes, table.schema.to_json(), table.class_tables,
                             self.list_digest]).encode())
        h.update(table.sizes.astype("<i8").tobytes())
        h.update(self.etags.astype("<u8").tobytes())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> RemoteTableChunks:  # type: ignore[override]
        return RemoteTableChunks(self._table(), self.urls, self.etags, chunk_size, self.storage_options)

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        record_run(dst, self.src, run, fingerprint)
