"""NIfTI volumes at URLs: a folder (``s3://bucket/scans/``: ``.nii``/``.nii.gz`` objects, class
subfolders giving labels as locally), a CSV/TSV/JSONL volume list or a Decathlon ``dataset.json``
at a URL (paths relative to its folder URL, ``..`` resolved, or URLs), or a local volume list
whose rows name URLs: the remote twin of :class:`~fastdata.writer.sources.volumes.input.VolumeInput`,
converting to the records a local copy of the files gives.

nibabel reads a volume with seeks (a ``.nii`` slab by slab) or decompresses it whole (a
``.nii.gz``), so a volume is not streamed: the worker that converts it copies the object into a
**spool file** of its own (:data:`SPOOL_BLOCK` bytes at a time through a
:class:`~fastdata.remote.sources.ObjectReader`, every reply checked against the listed ETag and
size), reads it there exactly as a local file, and deletes it when the sample is written. **Bound:**
a worker holds the files of one sample on local disk (its volume and label volume: their sizes),
in the system's temporary folder (``TMPDIR``), and one block in memory beyond what the local
reader holds; with ``w`` workers, at most ``w`` samples' files at once (plus the converter's
probes of up to five samples while planning, one at a time). A temporary folder that cannot take
a volume (full, a quota, a file size limit, not writable) stops the run with one line naming the
object and the folder (:func:`spool`).

Planning reads each volume's header from its first :data:`HEADER_BYTES` bytes (one ranged GET;
a header whose extensions run past them leaves the volume out of the layout, which its worker
then rejects or converts as locally). A list's rows are looked up (size, ETag) as an image
list's are (:func:`~fastdata.remote.sources.stat_objects`): a row whose object does not exist is
rejected when converted, as a local list's missing file is. The fingerprint holds each object's
key, size and ETag, and a list's bytes.
"""

from __future__ import annotations

import errno
import os
import posixpath
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from fastdata.errors import ConversionError, RejectedInputError, SourceError
from fastdata.remote.location import RemoteLocation, RemoteSizeError
from fastdata.remote.sources import list_objects, ObjectReader, read_text, stat_objects
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.folder import is_url
from fastdata.writer.sources.remote import FILESYSTEM_MODULES, ReadsURLs
from fastdata.writer.sources.volumes.common import named, OpenedSample
from fastdata.writer.sources.volumes.input import VolumeInput
from fastdata.writer.sources.volumes.nifti import nifti_header, require_nibabel, VolumeLayout, VolumeSamples
from fastdata.writer.sources.volumes.scan import (
    FileScan,
    is_nifti,
    is_volume_list_text,
    LIST_SUFFIXES,
    NIFTI_SUFFIXES,
    scan_decathlon,
    scan_volume_list,
)

__all__ = ["HEADER_BYTES", "SPOOL_BLOCK", "ObjectStats", "RemoteVolumeInput", "RemoteVolumeSamples", "holds_volumes",
           "is_remote_volume_list", "scan_remote_volumes", "spool", "stat_files"]

#: the first bytes of a volume read while planning (its header and extensions)
HEADER_BYTES = 1 << 20
#: bytes copied into a spool file at a time
SPOOL_BLOCK = 8 << 20
SPOOL_PREFIX = "fastdata-spool-"


def _spool_failed(url: str, folder: str, size: int, err: OSError) -> ConversionError:
    """The one-line error for a temporary folder that cannot take the copy of ``url``."""
    code = errno.errorcode.get(err.errno or 0, "")
    return ConversionError(
        f"{url}: cannot copy {size:,} bytes of the volume into the temporary folder {folder}: "
        f"{err.strerror or err}{f' ({code})' if code else ''}. Each worker copies the volume it converts (and its "
        "label volume) there and deletes it once written; free space there, or set TMPDIR to a folder with room "
        "for one sample's volumes per worker, then rerun the conversion (resume keeps the shards already written)")


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` written to the file descriptor ``fd`` (unbuffered: a full disk or a file size
    limit is an OSError here, not at a later flush)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def spool(url: str, size: int, etag: int, storage_options: Mapping[str, Any], limit: int | None = None) -> str:
    """The object at ``url`` (listed with ``size`` bytes and ETag ``etag``), or its first ``limit``
    bytes, copied into a new temporary file named like it (nibabel tells ``.nii.gz`` by the name);
    the caller deletes it.

    Raises:
        SourceChangedError: the object changed or was deleted since it was listed.
        ConversionError: the temporary folder cannot take the copy (full, a quota or file size
            limit, not writable), naming the object and the folder; nothing of the copy is left.
    """
    suffix = ".nii.gz" if url.lower().endswith(".gz") else posixpath.splitext(url)[1]
    folder = tempfile.gettempdir()
    end = size if limit is None else min(size, limit)
    try:
        fd, path = tempfile.mkstemp(prefix=SPOOL_PREFIX, suffix=suffix)
    except OSError as err:
        raise _spool_failed(url, folder, end, err) from None
    reader = ObjectReader(url, size, etag, storage_options, SPOOL_BLOCK, stop=end)
    try:
        while reader.tell() < end:
            block = reader.read(min(SPOOL_BLOCK, end - reader.tell()))
            try:
                _write_all(fd, block)
            except OSError as err:
                raise _spool_failed(url, folder, end, err) from None
            del block
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    finally:
        reader.close()
    os.close(fd)
    return path


def scan_remote_volumes(url: str, storage_options: Mapping[str, Any]) -> tuple[FileScan, np.ndarray, np.ndarray]:
    """The NIfTI objects of the prefix ``url`` as :func:`~fastdata.writer.sources.volumes.scan.scan_file_folder`
    finds a local folder's (first-level "folders" holding volumes are classes, searched
    recursively, in its sorted walk order; without any, the volumes directly under the prefix),
    with each one's size and ETag.

    Raises:
        SourceError: no volume under the prefix, a missing bucket, failing credentials.
    """
    url = url.rstrip("/")
    listing = list_objects(RemoteLocation(url, storage_options))
    names = [n.decode() for n in listing.names]
    volumes = [i for i, n in enumerate(names) if is_nifti(n)]
    classes = sorted({names[i].split("/", 1)[0] for i in volumes if "/" in names[i]})
    problems: list[tuple[str, str]] = []
    top = sorted((names[i], i) for i in volumes if "/" not in names[i])
    if classes:
        index = {c: k for k, c in enumerate(classes)}
        chosen = sorted((index[names[i].split("/", 1)[0]], posixpath.dirname(names[i]), posixpath.basename(names[i]),
                         i) for i in volumes if "/" in names[i])
        order = [i for *_, i in chosen]
        labels: list[int] | None = [c for c, *_ in chosen]
        if top:
            problems.append((url, f"{len(top)} NIfTI file(s) directly in the folder are not in a class folder "
                                  f"({', '.join(n for n, _ in top[:5])}{' ...' if len(top) > 5 else ''}): skipped, "
                                  "as ImageFolder does"))
    else:
        order, labels = [i for _, i in top], None
    if not order:
        raise SourceError(f"{url}: no NIfTI files found ({', '.join(NIFTI_SUFFIXES)}, any case) under the prefix "
                          "or in its class folders")
    if "dataset.json" in names:
        problems.append((url, "the folder holds a dataset.json: convert SRC/dataset.json to pair each image with "
                              "its label volume (a Decathlon task)"))
    scan = FileScan(root=url, paths=[f"{url}/{names[i]}".encode() for i in order],
                    relpaths=[names[i].encode() for i in order], classes=classes, labels=labels, problems=problems)
    keep = np.asarray(order, dtype=np.int64)
    return scan, listing.sizes[keep], listing.etags[keep]


def _check_found(url: str, size: int, name: str) -> None:
    """Reject a volume whose object was missing when looked up (size -1), or whose server gave no
    size (-2: an HTTP server without Content-Length; a copy is checked against its size)."""
    if size == -1:
        raise RejectedInputError(f"{named(name)}file not found (no object at {url})")
    if size < 0:
        raise RejectedInputError(f"{named(name)}the server gives no size for {url} (no Content-Length), which "
                                 "copying a volume needs; serve it with one, or convert a local copy")


@dataclass
class ObjectStats:
    """Size (-1: no such object) and ETag of each file of a scan: its volumes, and its label volumes
    (None without). A local path's ETag is 0 (a local list may name URLs and local files)."""

    sizes: np.ndarray
    etags: np.ndarray
    label_sizes: np.ndarray | None = None
    label_etags: np.ndarray | None = None

    def of(self, i: int, label: bool = False) -> tuple[int, int]:
        """``(size, etag)`` of sample ``i``'s volume (its label volume with ``label``)."""
        sizes, etags = (self.label_sizes, self.label_etags) if label else (self.sizes, self.etags)
        assert sizes is not None and etags is not None, "a scan with label volumes is stat'ed with them"
        return int(sizes[i]), int(etags[i])

    def hash_into(self, h: Any) -> None:
        for values in (self.sizes, self.etags, self.label_sizes, self.label_etags):
            if values is not None:
                h.update(np.ascontiguousarray(values).astype("<u8" if values.dtype == np.uint64 else "<i8").tobytes())


def stat_files(paths: list[bytes], storage_options: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Sizes (-1: missing) and ETags of ``paths``: URLs looked up on their servers
    (:func:`~fastdata.remote.sources.stat_objects`), local paths with ``os.stat`` (ETag 0)."""
    sizes = np.full(len(paths), -1, dtype=np.int64)
    etags = np.zeros(len(paths), dtype=np.uint64)
    remote = [k for k, p in enumerate(paths) if is_url(os.fsdecode(p))]
    if remote:
        found, tags = stat_objects([os.fsdecode(paths[k]) for k in remote], storage_options)
        sizes[remote], etags[remote] = found, tags
    for k, p in enumerate(paths):
        if not is_url(os.fsdecode(p)):
            try:
                sizes[k] = os.stat(p).st_size
            except OSError:
                pass
    return sizes, etags


class RemoteVolumeSamples(VolumeSamples):
    """:class:`~fastdata.writer.sources.volumes.nifti.VolumeSamples` of volumes at URLs: ``open(i)``
    copies the sample's volume and label volume into spool files (:func:`spool`), deleted when the
    sample is closed (a local path of a list is read where it is). Holds URLs, sizes, ETags and
    storage options only (it travels to the workers)."""

    def __init__(self, scan: FileScan, layout: VolumeLayout, stats: ObjectStats, storage_options: Mapping[str, Any]):
        super().__init__(scan, layout)
        self.stats, self.storage_options = stats, dict(storage_options)

    def _local(self, path: bytes, size: int, etag: int, name: str, opened: OpenedSample) -> bytes:
        """A local path holding the file ``path``: a spool file (removed by ``opened``) for a URL."""
        url = os.fsdecode(path)
        if not is_url(url):
            return path
        _check_found(url, size, name)
        local = spool(url, size, etag, self.storage_options)
        opened.closers.append(lambda: os.unlink(local))
        return os.fsencode(local)

    def open(self, i: int) -> OpenedSample:
        scan, opened = self.scan, OpenedSample()
        try:
            path = self._local(scan.paths[i], *self.stats.of(i), "", opened)
            label = None
            if scan.label_paths is not None and scan.label_relpaths is not None:
                label = self._local(scan.label_paths[i], *self.stats.of(i, label=True),
                                    f"label {os.fsdecode(scan.label_relpaths[i])}", opened)
            return self.open_files(i, path, label, opened)
        except BaseException:
            opened.close()
            raise

    def input_bytes(self, i: int) -> int:
        total = max(0, self.stats.of(i)[0])
        if self.stats.label_sizes is not None:
            total += max(0, self.stats.of(i, label=True)[0])
        return total


def _is_list(src: str) -> bool:
    return src.rstrip("/").lower().endswith((*LIST_SUFFIXES, ".json"))


class RemoteVolumeInput(ReadsURLs, VolumeInput):
    """NIfTI volumes at URLs: a folder, a volume list or ``dataset.json`` at a URL, or a local
    volume list naming URLs (see the module docstring)."""

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None, *,
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, chunks, codec)
        self.read_at(src, storage_options, recorded=None if is_url(src) else os.path.abspath(src))
        self.stats = ObjectStats(np.zeros(0, np.int64), np.zeros(0, np.uint64))
        #: xxh3-128 of a list's bytes ("" for a folder)
        self.list_digest = ""

    def _scan_source(self) -> FileScan:
        require_nibabel()
        src = self.src
        if not _is_list(src):
            scan, sizes, etags = scan_remote_volumes(src, self.storage_options)
            self.stats = ObjectStats(sizes, etags)
            return scan
        if is_url(src):
            data = read_text(src, self.storage_options)
        else:  # (a local list naming URLs)
            try:
                with open(src, "rb") as fh:
                    data = fh.read()
            except OSError as err:
                raise SourceError(f"cannot read list file {src}: {err.strerror}") from None
        self.list_digest = xxhash.xxh3_128_hexdigest(data)
        scan = (scan_decathlon if src.lower().endswith(".json") else scan_volume_list)(src, data)
        del data
        urls = [os.fsdecode(p) for p in scan.paths + (scan.label_paths or []) if is_url(os.fsdecode(p))]
        self.worker_modules = tuple(dict.fromkeys(m for u in urls[:1000]
                                                  for m in FILESYSTEM_MODULES.get(u.split("://", 1)[0].lower(), ())))
        sizes, etags = stat_files(scan.paths, self.storage_options)
        self.stats = ObjectStats(sizes, etags)
        if scan.label_paths is not None:
            self.stats.label_sizes, self.stats.label_etags = stat_files(scan.label_paths, self.storage_options)
        return scan

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples, Any]:
        from fastdata.writer.sources.volumes.nifti import volume_layout, volume_schema

        where = {path: (k, False) for k, path in enumerate(scan.paths)}
        where.update({path: (k, True) for k, path in enumerate(scan.label_paths or [])})

        def header(path: bytes, name: str):
            if not is_url(os.fsdecode(path)):
                return nifti_header(path, name)
            size, etag = self.stats.of(*where[path])
            _check_found(os.fsdecode(path), size, name)
            local = spool(os.fsdecode(path), size, etag, self.storage_options, HEADER_BYTES)
            try:
                return nifti_header(os.fsencode(local), name, held=size)
            finally:
                os.unlink(local)
        layout = volume_layout(scan, self.chunks_given, header)
        schema = volume_schema(scan, layout, self.codec)
        self.notes = [f"image: {layout.dtype.name} {layout.ndim}-D volumes, raw stored values (physical value = "
                      "image * scl_slope + scl_inter)"]
        if layout.label_dtype is not None:
            self.notes.append(f"label: {layout.label_dtype.name} {layout.label_ndim}-D label volumes")
        options = RemoteLocation(self._location(scan), self.storage_options).worker_storage_options()
        return RemoteVolumeSamples(scan, layout, self.stats, options), schema

    def _location(self, scan: FileScan) -> str:
        """A URL of the source whose location resolves the workers' credentials: the source's, else
        (a local list) its first URL's folder."""
        if is_url(self.src):
            return self.src.rstrip("/")
        first = next(os.fsdecode(p) for p in scan.paths + (scan.label_paths or []) if is_url(os.fsdecode(p)))
        return first.rsplit("/", 1)[0]

    def fingerprint(self, run: RunOptions) -> str:
        """The local fingerprint's options and schema with each object's key, size and ETag (remote
        objects have no modification time), and a list's bytes."""
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        self.stats.hash_into(h)
        h.update(self.list_digest.encode())
        return h.hexdigest()


#: the first bytes of a list at a URL read to tell a volume list from an image list
LIST_HEAD_BYTES = 64 << 10


def is_remote_volume_list(url: str, storage_options: Mapping[str, Any]) -> bool:
    """Whether the CSV/TSV/JSONL list at ``url`` names NIfTI volumes (its first row's image column
    names a ``.nii``/``.nii.gz`` file, as a local list is told), read from its first
    :data:`LIST_HEAD_BYTES` bytes (one GET; a longer list, a second ranged GET of them). False for
    any other URL, and for a list that cannot be read (the list source reading it in full says why)."""
    if not url.lower().endswith(LIST_SUFFIXES):
        return False
    parent, _, name = url.rpartition("/")
    loc = RemoteLocation(parent, storage_options)
    try:
        try:
            head = loc.read_bytes(name, limit=LIST_HEAD_BYTES)
        except RemoteSizeError:  # (longer: its first bytes are enough)
            head = loc.read_range(name, 0, LIST_HEAD_BYTES)
    except Exception:  # noqa: BLE001 - missing, refused, unreachable: the list's own scan reports it
        return False
    return is_volume_list_text(url, head)


def holds_volumes(names: list[str] | None) -> bool:
    """Whether a prefix whose first listing page (:func:`~fastdata.remote.sources.first_listing_page`:
    keys relative to it, at any depth) is ``names`` is a NIfTI folder, as a local folder is told:
    of its first 100 NIfTI or image files, NIfTI files are at least half. None (a prefix that cannot
    be listed) is not one (the image-folder source says why)."""
    from fastdata.common.extensions import has_image_extension

    if names is None:
        return False
    kinds = [is_nifti(n) for n in names if is_nifti(n) or has_image_extension(n)][:100]
    volumes = sum(kinds)
    return volumes > 0 and volumes >= len(kinds) - volumes
