"""A class-folder tree of DICOM files at a URL kept with some of their tags (``convert
s3://bucket/dicom/ dst``, ``dicom_tags=[...]``): the remote twin of
:class:`~fastdata.writer.sources.dicom.DicomFolderInput`.

The prefix is listed and ordered as an image folder at a URL is
(:func:`~fastdata.writer.sources.remote.scan_remote_folder`: ImageFolder's classes and order);
each file is fetched whole into memory by the worker that encodes it (pydicom reads the tags
from those bytes, which are then stored as they are), checked against its listed ETag and size
(a changed or deleted file stops the run naming it). **Bound:** a worker holds one DICOM file
at a time beside the records of its task. The record keeps the file's URL as its source path
(a local conversion keeps the file's path); every field equals the local store's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import xxhash

from fastdata.remote.location import RemoteLocation
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.dicom import DicomFolderInput, DicomSamples, read_tags
from fastdata.writer.sources.folder import SourceScan
from fastdata.writer.sources.python import MapInput, SourcedBytes
from fastdata.writer.sources.remote import ReadsURLs, scan_remote_folder

__all__ = ["RemoteDicomFolderInput", "RemoteDicomSamples"]


class RemoteDicomSamples(DicomSamples):
    """:class:`~fastdata.writer.sources.dicom.DicomSamples` of files at URLs: ``samples[i]``
    fetches file ``i`` (ETag and size checked) and gives its bytes with the URL as their source."""

    def __init__(self, scan: SourceScan, tags: list[str], storage_options: Mapping[str, Any]):
        super().__init__(scan, tags)
        self.storage_options = dict(storage_options)

    def __getitem__(self, i: int) -> dict[str, Any]:
        scan = self.scan
        assert scan.etags is not None, "a remote scan lists ETags"
        name = scan.relpaths[i].decode()
        loc = RemoteLocation(scan.root, self.storage_options)
        data = SourcedBytes(loc.read_object(name, int(scan.sizes[i]), int(scan.etags[i])))
        data.source = loc.child(name).encode()
        return {"image": data, "label": int(scan.labels[i]), **read_tags(data, self.tags)}


class RemoteDicomFolderInput(ReadsURLs, DicomFolderInput):
    """A DICOM class-folder tree at a URL with ``tags`` kept as fields (see the module docstring)."""

    def __init__(self, src: str, tags, image_mode: str | None = None, *,
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__(src, tags, image_mode)
        self.src = src.rstrip("/")
        self.read_at(self.src, storage_options)


    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        found = self.folder = scan_remote_folder(self.src, self.storage_options)
        self.warnings.extend(f"{path}: {problem}" for path, problem in found.walk_problems)
        options = RemoteLocation(self.src, self.storage_options).worker_storage_options()
        self.samples = RemoteDicomSamples(found, self.tags, options)
        self.metadata = {"dicom_tags": list(self.tags)}
        return MapInput.plan(self, run, dst)

    def fingerprint(self, run: RunOptions) -> str:
        """:meth:`DicomFolderInput.fingerprint` with each file's ETag."""
        found = self._folder()
        assert found.etags is not None
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        h.update(found.etags.astype("<u8").tobytes())
        return h.hexdigest()
