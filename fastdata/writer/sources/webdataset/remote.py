"""WebDataset tar shards at a URL (``s3://bucket/shards/`` holding ``.tar`` objects, one ``.tar``
URL, a brace pattern ``s3://bucket/train-{000000..000099}.tar`` or a glob): the remote twin of
:class:`~fastdata.writer.sources.webdataset.input.TarInput`, converting to the store a local copy
of the same tars gives (same samples, fields, records and shard checksums).

**Why ranged reads, not one streamed GET per tar.** The plan (how many samples, which shard each
goes to, what ``resume`` skips) is made before any worker runs, from the tar headers, as for a
local tar; a task is then a run of consecutive samples of one tar, read by the worker that
encodes it. So a tar is read twice over HTTP, in two different ways, neither holding it whole:

* **planning** (the converter): tarfile walks the headers through an
  :class:`~fastdata.remote.sources.ObjectReader` of :data:`SCAN_BLOCK` bytes: small members come
  with the header blocks (the walk streams the tar), a member larger than the block is seeked
  over (not downloaded); :data:`SCAN_CONCURRENCY` tars are walked at once;
* **reading** (each worker task): the task's samples are contiguous in the tar, read front to
  back through a reader of :data:`READ_BLOCK` bytes: one GET per block (a member larger than
  the block: one GET of exactly it).

A tar read in one GET by one worker would need its sample count before the plan, which a tar
does not hold anywhere but in its headers.

**Bounds.** A worker holds one read-ahead block (:data:`READ_BLOCK`, 4 MiB) plus the task's
encoded samples (as for a local tar: ``task_size`` samples); the converter's walk holds one
:data:`SCAN_BLOCK` per tar walked at once. No tar is written to local disk. Tested
(tests/remote/test_remote_tars_volumes.py): a 24 MiB tar of 1 MiB members converts in process
(``task_size=2``) with no reply over 4 MiB and a peak of traced memory within 4 MiB of the same
conversion from the local file (measured 8.6 MB against 8.5 MB); workers reading the tar in one
GET peak above the tar's size (the control).

**Changes.** Each tar's size and ETag are listed once; every ranged reply (planning and
reading) must carry that ETag and total size, else the run stops with a
:class:`~fastdata.remote.location.SourceChangedError` naming the tar (nothing published; on
``gs://``/``az://`` the reply is not compared: the filesystem's ranged read gives no ETag).
The fingerprint holds each tar's URL, size and ETag (a local one: its modification time).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from typing import Any

from fastdata.errors import SourceError
from fastdata.remote.location import RemoteLocation
from fastdata.remote.sources import list_objects, ObjectReader, stat_objects
from fastdata.writer.ingest import spill
from fastdata.writer.pipeline import Chunk
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.remote import ReadsURLs
from fastdata.writer.sources.webdataset.input import encode_samples, TarChunks, TarInput
from fastdata.writer.sources.webdataset.names import COMPRESSED_SUFFIXES, expand_braces, TAR_SUFFIX
from fastdata.writer.sources.webdataset.scan import TarLayout, TarScan

__all__ = ["READ_BLOCK", "SCAN_BLOCK", "RemoteTarInput", "encode_remote_tar_chunk", "is_tar_url",
           "remote_tar_files"]

#: bytes a planning walk over the headers reads at a time (a larger member is seeked over)
SCAN_BLOCK = 1 << 20
#: bytes a worker reads ahead in its task's tar (one GET each)
READ_BLOCK = 4 << 20
#: tars whose headers the converter walks at once while planning (each holds one SCAN_BLOCK)
SCAN_CONCURRENCY = 8


def _compressed(name: str) -> str | None:
    lower = name.lower()
    return next((s for s in COMPRESSED_SUFFIXES if lower.endswith(s)), None)


def is_tar_url(src: str) -> bool:
    """Whether the URL ``src`` names tar shards by its name alone (a ``.tar`` object, a brace
    pattern or glob of them, or a compressed tar, which is then refused with its command)."""
    candidates = expand_braces(src)
    return any(c.lower().endswith(TAR_SUFFIX) or _compressed(c) for c in candidates)


def remote_tar_files(src: str, storage_options: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """``(URL, size, ETag key)`` of each tar ``src`` names: a ``.tar`` URL, a brace pattern, a glob
    (its last segment), or a prefix whose objects directly under it include ``.tar`` objects
    (sorted by name, as a local folder's).

    Raises:
        SourceError: a compressed tar (with the command that decompresses it), a named tar that
            does not exist, a glob or prefix with no tar, a missing bucket or refused credentials.
    """
    if not is_tar_url(src):  # a prefix
        listing = list_objects(RemoteLocation(src, storage_options))
        base = src.rstrip("/")
        found = sorted((n.decode(), int(s), int(e)) for n, s, e in zip(listing.names, listing.sizes, listing.etags,
                                                                         strict=True)
                       if b"/" not in n and n.lower().endswith(TAR_SUFFIX.encode()))
        if not found:
            raise SourceError(f"{src}: no .tar objects directly under this prefix")
        return [(f"{base}/{n}", s, e) for n, s, e in found]
    out: list[tuple[str, int, int]] = []
    named: list[str] = []
    for candidate in expand_braces(src):
        parent, _, last = candidate.rpartition("/")
        if any(c in last for c in "*?["):
            listing = list_objects(RemoteLocation(parent, storage_options))
            matches = sorted((n.decode(), int(s), int(e)) for n, s, e in zip(listing.names, listing.sizes,
                                                                               listing.etags, strict=True)
                             if b"/" not in n and fnmatch.fnmatchcase(n.decode(), last))
            if not matches:
                raise SourceError(f"no file matches {candidate}")
            out.extend((f"{parent}/{n}", s, e) for n, s, e in matches)
        else:
            named.append(candidate)
    for url in [u for u, _, _ in out] + named:
        suffix = _compressed(url)
        if suffix:
            raise SourceError(f"{url}: a compressed tar cannot be read by offset; decompress it first "
                              f"({COMPRESSED_SUFFIXES[suffix]}) and upload the .tar")
    if named:
        sizes, etags = stat_objects(named, storage_options)
        missing = [u for u, s in zip(named, sizes, strict=True) if s == -1]
        if missing:
            raise SourceError(f"{missing[0]} does not exist" + (
                f" ({len(missing)} of the {len(named)} files named are missing)" if len(missing) > 1 else ""))
        unsized = [u for u, s in zip(named, sizes, strict=True) if s < 0]
        if unsized:
            raise SourceError(f"{unsized[0]}: the server does not say the object's size; a tar is read by offset")
        out.extend((u, int(s), int(e)) for u, s, e in zip(named, sizes, etags, strict=True))
    return out


def encode_remote_tar_chunk(layout: TarLayout, url: str, size: int, etag: int, name: str, samples: list,
                            start: int, storage_options: Mapping[str, Any], spill_dir: str | None):
    """Worker entry point: ``samples`` (consecutive samples of the tar at ``url``, store samples
    ``start ..``) read front to back through an :class:`~fastdata.remote.sources.ObjectReader`
    of :data:`READ_BLOCK` bytes, as records or rejection reasons
    (:func:`~fastdata.writer.sources.webdataset.input.encode_samples`)."""
    results: list = []
    nbytes = 0
    if samples:
        stop = max(offset + n for _, _, members in samples for _, offset, n in members) if any(
            members for _, _, members in samples) else 0
        reader = ObjectReader(url, size, etag, storage_options, READ_BLOCK, stop=stop)

        def read(offset: int, n: int) -> bytes:
            reader.seek(offset)
            data = reader.read(n)
            if len(data) != n:  # (the listed size holds it: only a server's short reply gets here)
                raise SourceError(f"{url}: the object ends {n - len(data):,} bytes short of a member at byte "
                                  f"{offset:,}")
            return data
        try:
            results, nbytes = encode_samples(layout, read, name, samples)
        finally:
            reader.close()
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class RemoteTarChunks(TarChunks):
    """:class:`~fastdata.writer.sources.webdataset.input.TarChunks` of tars at URLs: each task names
    its tar's URL, size and ETag (nothing open travels to a worker)."""

    worker = staticmethod(encode_remote_tar_chunk)  # type: ignore[assignment]  # (its own arguments)

    def __init__(self, scan: TarScan, layout: TarLayout, chunk_size: int, etags: list[int],
                 storage_options: Mapping[str, Any]):
        super().__init__(scan, layout, chunk_size)
        self.etags, self.storage_options = etags, dict(storage_options)

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        index = {url: t for t, url in enumerate(self.scan.files)}
        for chunk in super().chunks(plans):
            layout, url, size, name, samples, start = chunk.args
            etag = self.etags[index[url]] if url else 0
            yield Chunk(chunk.plan, chunk.start, chunk.stop, chunk.last,
                        (layout, url, size, etag, name, samples, start, self.storage_options))

    def runs_in_main_first(self, chunk: Chunk) -> bool:
        return False  # (the bytes are not here: a worker fetches them)


class RemoteTarInput(ReadsURLs, TarInput):
    """WebDataset tar shards at a URL (see the module docstring): the store their local copy
    gives, but for the manifest's ``source``."""

    def __init__(self, src: str, *, storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, [])
        self.read_at(src, storage_options)
        self.etags: list[int] = []


    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        files = remote_tar_files(self.src, self.storage_options)
        self.paths = [url for url, _, _ in files]
        self.etags = [etag for _, _, etag in files]
        options = self.storage_options
        listed = {url: (size, etag) for url, size, etag in files}

        def opener(t: int, url: str):
            size, etag = listed[url]
            return ObjectReader(url, size, etag, options, SCAN_BLOCK), (size, etag)
        # (TarInput.plan scans self.paths as local files); the walks of several tars at once
        self.scan = TarScan(self.paths, opener, concurrency=SCAN_CONCURRENCY)
        return self._plan_scanned(run)

    def chunks(self, run: RunOptions, chunk_size: int) -> RemoteTarChunks:
        scan, layout = self._scanned()
        # the workers get the credentials and endpoint this process resolved (their pool may have
        # started before the environment named them)
        options = RemoteLocation(self.paths[0].rsplit("/", 1)[0], self.storage_options).worker_storage_options()
        return RemoteTarChunks(scan, layout, chunk_size, self.etags, options)



def holds_tars(names: list[str] | None) -> bool:
    """Whether a prefix whose first listing page (:func:`~fastdata.remote.sources.first_listing_page`:
    keys relative to it, at any depth) is ``names`` is a folder of tar shards, as a local folder is
    told: ``.tar`` objects directly under it and no "subfolder". None (a prefix that cannot be
    listed) is not one (the image-folder source then says why)."""
    if names is None or any("/" in n for n in names):
        return False
    return any(n.lower().endswith(TAR_SUFFIX) for n in names)
