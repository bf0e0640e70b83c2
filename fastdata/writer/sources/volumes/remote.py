"""A folder of NIfTI volumes at a URL (``s3://bucket/scans/``: ``.nii``/``.nii.gz`` objects, class
subfolders giving labels as locally): the remote twin of
:class:`~fastdata.writer.sources.volumes.input.VolumeInput` for folders, converting to the records
a local copy of the folder gives.

nibabel reads a volume with seeks (a ``.nii`` slab by slab) or decompresses it whole (a
``.nii.gz``), so a volume is not streamed: the worker that converts it copies the object into a
**spool file** of its own (:data:`SPOOL_BLOCK` bytes at a time through a
:class:`~fastdata.remote.sources.ObjectReader`, every reply checked against the listed ETag and
size), reads it there exactly as a local file, and deletes it when the sample is written. **Bound:**
a worker holds the files of one sample on local disk (its volume and label volume: their sizes),
in the system's temporary folder (``TMPDIR``), and one block in memory beyond what the local
reader holds; with ``w`` workers, at most ``w`` samples' files at once (plus the converter's
probes of up to five samples while planning, one at a time).

Planning reads each volume's header from its first :data:`HEADER_BYTES` bytes (one ranged GET;
a header whose extensions run past them leaves the volume out of the layout, which its worker
then rejects or converts as locally). The fingerprint holds each object's key, size and ETag.
Lists and Decathlon ``dataset.json`` files at a URL are not read (their rows name local files):
convert a folder, or a local copy.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from fastdata.errors import SourceError
from fastdata.remote.location import RemoteLocation
from fastdata.remote.sources import first_listing_page, list_objects, ObjectReader
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.remote import ReadsURLs
from fastdata.writer.sources.volumes.common import OpenedSample
from fastdata.writer.sources.volumes.input import VolumeInput
from fastdata.writer.sources.volumes.nifti import nifti_header, require_nibabel, VolumeLayout, VolumeSamples
from fastdata.writer.sources.volumes.scan import FileScan, is_nifti, NIFTI_SUFFIXES

__all__ = ["HEADER_BYTES", "SPOOL_BLOCK", "RemoteVolumeInput", "RemoteVolumeSamples", "holds_volumes",
           "scan_remote_volumes", "spool"]

#: the first bytes of a volume read while planning (its header and extensions)
HEADER_BYTES = 1 << 20
#: bytes copied into a spool file at a time
SPOOL_BLOCK = 8 << 20
SPOOL_PREFIX = "fastdata-spool-"


def spool(url: str, size: int, etag: int, storage_options: Mapping[str, Any], limit: int | None = None) -> str:
    """The object at ``url`` (listed with ``size`` bytes and ETag ``etag``), or its first ``limit``
    bytes, copied into a new temporary file named like it (nibabel tells ``.nii.gz`` by the name);
    the caller deletes it.

    Raises:
        SourceChangedError: the object changed or was deleted since it was listed.
    """
    suffix = ".nii.gz" if url.lower().endswith(".gz") else posixpath.splitext(url)[1]
    fd, path = tempfile.mkstemp(prefix=SPOOL_PREFIX, suffix=suffix)
    end = size if limit is None else min(size, limit)
    reader = ObjectReader(url, size, etag, storage_options, SPOOL_BLOCK, stop=end)
    try:
        with os.fdopen(fd, "wb") as out:
            while reader.tell() < end:
                out.write(reader.read(min(SPOOL_BLOCK, end - reader.tell())))
    except BaseException:
        os.unlink(path)
        raise
    finally:
        reader.close()
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
        problems.append((url, "the folder holds a dataset.json: a Decathlon task pairs each image with its label "
                              "volume, which a URL source does not read; convert a local copy of SRC/dataset.json"))
    scan = FileScan(root=url, paths=[f"{url}/{names[i]}".encode() for i in order],
                    relpaths=[names[i].encode() for i in order], classes=classes, labels=labels, problems=problems)
    keep = np.asarray(order, dtype=np.int64)
    return scan, listing.sizes[keep], listing.etags[keep]


class RemoteVolumeSamples(VolumeSamples):
    """:class:`~fastdata.writer.sources.volumes.nifti.VolumeSamples` of volumes at URLs: ``open(i)``
    copies the volume into a spool file (:func:`spool`), deleted when the sample is closed.
    Holds URLs, sizes, ETags and storage options only (it travels to the workers)."""

    def __init__(self, scan: FileScan, layout: VolumeLayout, sizes: np.ndarray, etags: np.ndarray,
                 storage_options: Mapping[str, Any]):
        super().__init__(scan, layout)
        self.sizes, self.etags, self.storage_options = sizes, etags, dict(storage_options)

    def open(self, i: int) -> OpenedSample:
        opened = OpenedSample()
        try:
            path = spool(os.fsdecode(self.scan.paths[i]), int(self.sizes[i]), int(self.etags[i]),
                         self.storage_options)
            opened.closers.append(lambda: os.unlink(path))
            return self.open_files(i, os.fsencode(path), None, opened)
        except BaseException:
            opened.close()
            raise

    def input_bytes(self, i: int) -> int:
        return int(self.sizes[i])


class RemoteVolumeInput(ReadsURLs, VolumeInput):
    """A NIfTI folder at a URL (see the module docstring)."""

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None, *,
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, chunks, codec)
        self.read_at(src, storage_options)
        self.sizes = np.zeros(0, np.int64)
        self.etags = np.zeros(0, np.uint64)


    def _scan_source(self) -> FileScan:
        require_nibabel()
        scan, self.sizes, self.etags = scan_remote_volumes(self.src, self.storage_options)
        return scan

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples, Any]:
        from fastdata.writer.sources.volumes.nifti import volume_layout, volume_schema

        where = {path: k for k, path in enumerate(scan.paths)}

        def header(path: bytes, name: str):
            k = where[path]
            size = int(self.sizes[k])
            local = spool(os.fsdecode(path), size, int(self.etags[k]), self.storage_options, HEADER_BYTES)
            try:
                return nifti_header(os.fsencode(local), name, held=size)
            finally:
                os.unlink(local)
        layout = volume_layout(scan, self.chunks_given, header)
        schema = volume_schema(scan, layout, self.codec)
        self.notes = [f"image: {layout.dtype.name} {layout.ndim}-D volumes, raw stored values (physical value = "
                      "image * scl_slope + scl_inter)"]
        options = RemoteLocation(self.src, self.storage_options).worker_storage_options()
        return RemoteVolumeSamples(scan, layout, self.sizes, self.etags, options), schema

    def fingerprint(self, run: RunOptions) -> str:
        """The local fingerprint's options and schema with each object's key, size and ETag (remote
        objects have no modification time)."""
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        h.update(self.sizes.astype("<i8").tobytes())
        h.update(self.etags.astype("<u8").tobytes())
        return h.hexdigest()


def holds_volumes(src: str, storage_options: Mapping[str, Any]) -> bool:
    """Whether the prefix URL ``src`` is a NIfTI folder, as a local folder is told: of the first
    objects listed (one page, up to 100 keys), NIfTI files are at least half of the NIfTI and
    image files. A prefix that cannot be listed is not one (the image-folder source says why)."""
    from fastdata.common.extensions import has_image_extension

    page = first_listing_page(RemoteLocation(src, storage_options), max_keys=100, folders=False)
    if page is None:
        return False
    names = page[0]
    volumes = sum(is_nifti(n) for n in names)
    images = sum(has_image_extension(n) and not is_nifti(n) for n in names)
    return volumes > 0 and volumes >= images
