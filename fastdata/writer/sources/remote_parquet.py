"""Parquet files at a URL (a ``.parquet`` object, a folder/prefix holding them, a glob such as
``s3://bucket/data/train-*.parquet``; a Hugging Face dataset folder's ``data/``): the remote twin of
:class:`~fastdata.writer.sources.parquet.input.ParquetInput`, converting to the store a local copy
of the files gives.

* **which files**: as :func:`~fastdata.writer.sources.parquet.detect.parquet_files` picks them
  locally (a folder's ``.parquet`` objects directly inside it, sorted; a glob's matches; several
  Hub splits in one folder refused), each with its size and ETag;
* **footers**: read by the converter through fsspec (pyarrow reads the footer's byte ranges, not
  the file); ``features`` from the schema metadata, else a ``dataset_info.json`` or ``README.md``
  beside the files or one folder up (each read bounded, as locally, and parsed by the local code);
* **rows**: each worker opens the file of its chunk itself (:class:`RemoteParquetRows`) and streams
  its row group a page at a time, as for a local file: memory stays a chunk's rows and fsspec's
  read-ahead block (:data:`BLOCK_SIZE`). The file must still have its planned ETag and size when a
  worker opens it (a changed one stops the run naming it, nothing published). On ``s3://`` s3fs
  sends each later ranged read with ``If-Match`` on that ETag, so a server that honours it fails a
  read of a file rewritten while a worker holds it open (not tested against the test server).

Image columns must hold their bytes: an image named by a path inside a remote Parquet file is
rejected (it would name a file on the converter's disk). The fingerprint is the local one with
each file's ETag in place of its modification time.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from fastdata.errors import SourceError
from fastdata.remote.location import etag_key, RemoteLocation, SourceChangedError
from fastdata.remote.sources import list_objects, stat_objects
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.parquet.columns import make_layout
from fastdata.writer.sources.parquet.detect import split_of
from fastdata.writer.sources.parquet.files import (
    column_minimum,
    footer_entry,
    hf_features,
    MAX_CARD_BYTES,
    MAX_SIDECAR_BYTES,
    null_counts,
    ParquetFileInfo,
)
from fastdata.writer.sources.parquet.input import ParquetInput, ParquetRows
from fastdata.writer.sources.remote import ReadsURLs

#: fsspec's read-ahead block for a Parquet file (pyarrow asks for column chunks a page at a time)
BLOCK_SIZE = 4 << 20


def _is_parquet(name: str) -> bool:
    return name.lower().endswith(".parquet")


def remote_parquet_files(src: str, storage_options: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """``(URL, size, ETag key)`` of each Parquet file ``src`` names, sorted as locally.

    Raises:
        SourceError: nothing matches, a glob matches a file that is not ``.parquet``, a folder holds
            several Hub splits, or the bucket/credentials fail (one line each).
    """
    src = src.rstrip("/")
    scheme, _, rest = src.partition("://")
    last = rest.rsplit("/", 1)[-1]
    if any(c in last for c in "*?["):
        parent = src.rsplit("/", 1)[0]
        listing = list_objects(RemoteLocation(parent, storage_options))
        found = sorted((n.decode(), int(s), int(e)) for n, s, e in zip(listing.names, listing.sizes, listing.etags,
                                                                         strict=True)
                       if b"/" not in n and fnmatch.fnmatchcase(n.decode(), last))
        if not found:
            raise SourceError(f"no file matches {src}")
        other = next((n for n, _, _ in found if not _is_parquet(n)), None)
        if other is not None:
            raise SourceError(f"{src} matches {parent}/{other}, which is not a .parquet file")
        return [(f"{parent}/{n}", s, e) for n, s, e in found]
    if _is_parquet(last):
        sizes, etags = stat_objects([src], storage_options)
        if sizes[0] == -1:
            raise SourceError(f"Parquet file not found: {src}")
        return [(src, int(sizes[0]), int(etags[0]))]
    listing = list_objects(RemoteLocation(src, storage_options))
    found = sorted((n.decode(), int(s), int(e)) for n, s, e in zip(listing.names, listing.sizes, listing.etags,
                                                                     strict=True)
                   if b"/" not in n and _is_parquet(n.decode()))
    if not found:
        raise SourceError(f"{src}: no .parquet objects directly under this prefix (give the folder holding them, a "
                          "file or a glob such as data/train-*.parquet)")
    splits = sorted({s for s in (split_of(n) for n, _, _ in found) if s is not None})
    if len(splits) > 1:
        raise SourceError(f"{src} holds the files of several splits ({', '.join(splits)}): convert one split per "
                          f"store, e.g. '{src}/{splits[0]}-*.parquet'")
    return [(f"{src}/{n}", s, e) for n, s, e in found]


def open_remote_parquet(url: str, size: int, etag: int, storage_options: Mapping[str, Any]):
    """``(pq.ParquetFile, the fsspec file)`` of the object at ``url``, which must still have ``size``
    bytes and ETag ``etag`` (0: not compared).

    Raises:
        SourceChangedError: it changed or was deleted since it was listed.
        SourceError: it is not a readable Parquet file.
    """
    loc = RemoteLocation(url.rsplit("/", 1)[0], storage_options)
    fs = loc.filesystem()
    path = url.split("://", 1)[1] if not loc.read_only else url

    def opened():
        try:
            fs.invalidate_cache(path)
            return fs.open(path, "rb", block_size=BLOCK_SIZE, cache_type="readahead")
        except FileNotFoundError:
            return None
    fh = loc.call(f"opening {url}", opened)
    if fh is None:
        raise SourceChangedError(f"{url}: the object was deleted after it was listed; nothing was published: rerun "
                                 "the conversion once the input stops changing")
    details = getattr(fh, "details", None) or {}
    now_etag = etag_key(details.get("ETag") or details.get("etag"))
    if fh.size != size or (etag and now_etag and now_etag != etag):
        fh.close()
        raise SourceChangedError(f"{url}: the object changed after it was listed ({fh.size:,} bytes, listed as "
                                 f"{size:,}{'' if now_etag == etag else '; another ETag'}); nothing was published: "
                                 "rerun the conversion once the input stops changing")
    try:
        return pq.ParquetFile(fh, buffer_size=1 << 20, pre_buffer=False), fh
    except (pa.ArrowException, OSError, ValueError) as err:
        fh.close()
        raise SourceError(f"{url}: not a readable Parquet file ({type(err).__name__}: {err})") from None


class RemoteParquetRows(ParquetRows):
    """:class:`~fastdata.writer.sources.parquet.input.ParquetRows` of files at URLs: a worker opens
    each through fsspec, checked against its planned ETag and size (:func:`open_remote_parquet`).
    Holds URLs and options only: nothing open travels to a worker."""

    def __init__(self, files: list[ParquetFileInfo], layout, names: list[str], etags: list[int],
                 storage_options: Mapping[str, Any]):
        super().__init__(files, layout, names)
        self.etags, self.storage_options = etags, dict(storage_options)

    def open_file(self, file_index: int) -> pq.ParquetFile:
        info = self.files[file_index]
        parquet, _ = open_remote_parquet(info.path, info.size, self.etags[file_index], self.storage_options)
        return parquet


def _read_footers(files: list[tuple[str, int, int]], storage_options: Mapping[str, Any]):
    """:func:`~fastdata.writer.sources.parquet.files.read_footers` of remote files."""
    infos, metas = [], []
    schema: pa.Schema | None = None
    total = 0
    for url, size, etag in files:
        parquet, fh = open_remote_parquet(url, size, etag, storage_options)
        try:
            meta = parquet.metadata
            file_schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as err:
            raise SourceError(f"{url}: not a readable Parquet file ({type(err).__name__}: {err})") from None
        finally:
            fh.close()
        info, schema, total = footer_entry(url, size, 0, meta, file_schema, schema, files[0][0], total)
        infos.append(info)
        metas.append(meta)
    assert schema is not None, "remote_parquet_files never gives an empty list"
    return infos, schema, metas


def _read_start(loc: RemoteLocation, name: str, limit: int) -> bytes:
    """The first ``limit`` bytes of object ``name`` at ``loc`` (one ranged read, retried)."""
    fs = loc.filesystem()

    def read() -> bytes:
        return bytes(fs.cat_file(loc.child(name).split("://", 1)[1] if not loc.read_only else loc.child(name),
                                 start=0, end=limit))
    return loc.call(f"reading {loc.child(name)}", read)


def _remote_features(schema: pa.Schema, first_url: str, storage_options: Mapping[str, Any],
                     warnings: list[str]) -> tuple[dict[str, Any] | None, str]:
    """:func:`~fastdata.writer.sources.parquet.files.hf_features` for files at URLs: the sidecars
    (``dataset_info.json``, ``README.md`` beside the first file or one folder up) fetched, bounded,
    into a temporary copy of those two folders and parsed by the local code."""
    folder = first_url.rsplit("/", 1)[0]
    parent = folder.rsplit("/", 1)[0] if folder.count("/") > 3 else None
    wanted = [(where, name) for where in (folder, parent) if where for name in ("dataset_info.json", "README.md")]
    sizes, _ = stat_objects([f"{w}/{n}" for w, n in wanted], storage_options)
    tmp = tempfile.mkdtemp(prefix="fastdata-parquet-")
    try:
        local_folder = os.path.join(tmp, "parent", "folder")
        os.makedirs(local_folder)
        for (where, name), size in zip(wanted, sizes.tolist(), strict=True):
            if size == -1:
                continue
            target = os.path.join(local_folder if where == folder else os.path.dirname(local_folder), name)
            loc = RemoteLocation(where, storage_options)
            if name == "README.md":  # (the front matter must end within its first MAX_CARD_BYTES, as locally)
                data = _read_start(loc, name, MAX_CARD_BYTES)
            elif size > MAX_SIDECAR_BYTES:
                raise SourceError(f"{where}/{name}: {size:,} bytes, more than the {MAX_SIDECAR_BYTES:,} a "
                                  "dataset_info.json may have")
            else:
                data = loc.read_bytes(name, limit=MAX_SIDECAR_BYTES)
            with open(target, "wb") as fh:
                fh.write(data)
        notes: list[str] = []
        features, found = hf_features(schema, [os.path.join(local_folder, "x.parquet")], notes)
        rename = [(local_folder, folder)] + ([(os.path.dirname(local_folder), parent)] if parent else [])

        def named(text: str) -> str:
            for local, url in rename:
                text = text.replace(local, url)
            return text
        warnings.extend(named(n) for n in notes)
        return features, named(found)
    except SourceError as err:
        raise SourceError(named_error(str(err), tmp, folder, parent)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def named_error(text: str, tmp: str, folder: str, parent: str | None) -> str:
    """``text`` with the temporary copy's paths replaced by the sidecars' URLs."""
    text = text.replace(os.path.join(tmp, "parent", "folder"), folder)
    return text.replace(os.path.join(tmp, "parent"), parent or folder)


class RemoteParquetInput(ReadsURLs, ParquetInput):
    """Parquet files at a URL (see the module docstring): the store their local copy gives, but for
    the manifest's ``source``."""

    def __init__(self, src: str, image_columns: tuple[str, ...] = (), *,
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, [], image_columns)
        self.read_at(src, storage_options)
        self.etags: list[int] = []


    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        files = remote_parquet_files(self.src, self.storage_options)
        self.paths = [url for url, _, _ in files]
        self.etags = [etag for _, _, etag in files]
        infos, schema, metas = _read_footers(files, self.storage_options)
        features, found = _remote_features(schema, self.paths[0], self.storage_options, self.warnings)
        where = self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (and {len(self.paths) - 1} more)"

        def first_value(column: str) -> Any:
            parquet, fh = open_remote_parquet(infos[0].path, infos[0].size, self.etags[0], self.storage_options)
            try:
                for g, rows in enumerate(infos[0].row_groups):
                    if rows:
                        return parquet.read_row_group(g, columns=[column]).column(0)[0].as_py()
                return None
            finally:
                fh.close()
        layout = make_layout(schema, features, self.image_columns, null_counts(schema, metas), first_value, where,
                             lambda column: column_minimum(infos, metas, column))
        paths_named = [c.name for c in layout.columns if c.role == "image" and c.image_form == "path"]
        if paths_named:
            raise SourceError(f"{where}: column(s) {', '.join(paths_named)} name image files by path; from a URL "
                              "fastdata stores images whose bytes are in the Parquet files only: convert a local "
                              "copy with the images beside it")
        self._set_layout(layout, self.recorded_source, found or "the Parquet files")
        names = [url.rsplit("/", 1)[-1] for url in self.paths]
        # the workers get the credentials and endpoint this process resolved (their pool may have
        # started before the environment named them)
        worker_options = RemoteLocation(self.paths[0].rsplit("/", 1)[0], self.storage_options).worker_storage_options()
        self.rows = RemoteParquetRows(infos, layout, names, self.etags, worker_options)
        return self._plan_units(run, infos, names)

    def fingerprint(self, run: RunOptions) -> str:
        """:meth:`ParquetInput.fingerprint` with each file's ETag (remote files have no modification time)."""
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        h.update(json.dumps(self.etags).encode())
        return h.hexdigest()


def is_parquet_url(src: str) -> bool:
    """Whether the URL ``src`` names Parquet files by its name alone (a ``.parquet`` file, or a glob
    ending in ``.parquet``); a folder is told by :class:`~fastdata.writer.sources.public.Parquet`."""
    return _is_parquet(posixpath.basename(src.rstrip("/")))
