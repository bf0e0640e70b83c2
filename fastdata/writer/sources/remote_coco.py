"""A COCO annotation file (at a URL, or a local file) and its images relative to a folder URL
(``s3://``, ``gs://``, ``az://``; ``https://``): the remote twin of
:class:`~fastdata.writer.sources.coco.CocoInput`.

* **the annotation file** at a URL is read once, whole, by the converter (at most
  :data:`fastdata.remote.sources.MAX_LIST_BYTES`), into a local temporary file that
  :func:`~fastdata.writer.sources.coco.load_coco` parses as it parses a local one (and that is
  removed at once); a local one is parsed where it is: the index, its order, problems and
  refusals are the local ones;
* **the images** are looked up (size and ETag) in one paged listing of the image folder
  (:func:`~fastdata.remote.sources.list_objects`; ``https://``: one request per image) while
  planning, and each is fetched by the worker that encodes its sample, a few GETs at a time
  (:meth:`~fastdata.remote.location.RemoteLocation.read_object`, which checks the listed ETag and
  size: an image changed or deleted since the lookup stops the run naming it, nothing published).
  A missing image is rejected and reported, as a local missing file is; a ``file_name`` that leaves
  the image folder (an absolute path, ``..`` above it, a URL) is refused, as locally.

The fingerprint is the local one (sizes included) plus each image's ETag and the annotation file's
bytes, so ``resume`` refuses an annotation file or an image rewritten at the same size.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from fastdata.common.paths import remote_scheme
from fastdata.errors import RejectedInputError
from fastdata.remote.location import RemoteLocation
from fastdata.remote.sources import list_objects, read_text, stat_objects
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.coco import CocoIndex, CocoInput, CocoSamples, load_coco, MAX_LISTED_PROBLEMS
from fastdata.writer.sources.python import SourcedBytes
from fastdata.writer.sources.remote import fetch_inputs, ReadsURLs


def _inside(image_dir: str, file_name: str) -> str | None:
    """The key of ``file_name`` below ``image_dir`` (``..`` resolved), or None when it leaves it."""
    if "://" in file_name or file_name.startswith("/") or "\0" in file_name:
        return None
    key = posixpath.normpath(file_name)
    if key == "." or key.startswith("../") or key == "..":
        return None
    return key


def load_remote_coco(ann_url: str, image_url: str, storage_options: Mapping[str, Any]
                     ) -> tuple[CocoIndex, np.ndarray, str]:
    """The annotation file at ``ann_url`` (a URL, or a local path) parsed as
    :func:`~fastdata.writer.sources.coco.load_coco` parses a local one, its images looked up below
    ``image_url``.

    Returns:
        tuple[CocoIndex, np.ndarray, str]: the index (``ann_file`` and ``image_dir`` the URLs,
        ``sizes`` the objects' sizes, -1 when missing), each image's ETag (uint64), and the
        xxh3-128 of the annotation file's bytes.

    Raises:
        SourceError: the annotation file is missing, too large, not COCO (as locally), or the
            credentials fail.
    """
    if remote_scheme(ann_url) is None:  # a local annotation file: parsed where it is
        index = load_coco(ann_url, None)  # (its errors: a missing or unreadable file, as locally)
        with open(ann_url, "rb") as fh:
            digest = xxhash.xxh3_128_hexdigest(fh.read())
        problems = list(index.problems)
    else:
        data = read_text(ann_url, storage_options)
        digest = xxhash.xxh3_128_hexdigest(data)
        folder = tempfile.mkdtemp(prefix="fastdata-coco-")
        try:
            local = os.path.join(folder, ann_url.rstrip("/").rsplit("/", 1)[-1] or "annotations.json")
            with open(local, "wb") as fh:
                fh.write(data)
            del data
            index = load_coco(local, None)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        # the problems name the temporary copy: name the URL instead
        problems = [(where.replace(local, ann_url), why) for where, why in index.problems]
    image_url = image_url.rstrip("/")
    refused = dict(index.refused)
    keys: list[str | None] = []
    for i in range(len(index)):
        key = _inside(image_url, index.file_name(i))
        keys.append(key)
        if key is None:
            refused[i] = (f"file_name {index.file_name(i)!r} resolves outside the image folder {image_url} (an "
                          "absolute path, a URL or '..' leading out): only objects inside it are read; copy the "
                          "image into the folder")
    looked_up = [i for i, key in enumerate(keys) if key is not None]
    sizes = np.full(len(index), -1, dtype=np.int64)
    etags = np.zeros(len(index), dtype=np.uint64)
    loc = RemoteLocation(image_url, storage_options)
    if looked_up and not loc.read_only:
        # one paged listing of the folder (1,000 keys a request) instead of a HEAD per image
        listing = list_objects(loc)
        where = {name: k for k, name in enumerate(listing.names)}
        for i in looked_up:
            k = where.get(str(keys[i]).encode())
            if k is not None:
                sizes[i], etags[i] = listing.sizes[k], listing.etags[k]
        del where, listing
    elif looked_up:  # (https:// has no listing: each image looked up)
        found_sizes, found_etags = stat_objects([f"{image_url}/{keys[i]}" for i in looked_up], storage_options)
        sizes[looked_up], etags[looked_up] = found_sizes, found_etags
    missing = [i for i in looked_up if sizes[i] == -1]
    for i in missing[:MAX_LISTED_PROBLEMS]:
        problems.append((f"{image_url}/{index.file_name(i)}", "image file cannot be read (no such object)"))
    if len(missing) > MAX_LISTED_PROBLEMS:
        problems.append((image_url, f"... and {len(missing) - MAX_LISTED_PROBLEMS} more missing image files (the "
                                    f"first {MAX_LISTED_PROBLEMS} are listed)"))
    index = dataclasses.replace(index, ann_file=ann_url, image_dir=image_url, sizes=sizes, problems=problems,
                                refused=refused)
    return index, etags, digest


class RemoteCocoSamples(CocoSamples):
    """:class:`~fastdata.writer.sources.coco.CocoSamples` whose ``image`` is the object's bytes,
    fetched (ETag and size checked) where the sample is encoded: in a worker. Holds the URL and
    ``storage_options`` only; the filesystem is made in the process that reads."""

    def __init__(self, index: CocoIndex, etags: np.ndarray, storage_options: Mapping[str, Any],
                 direct_spec: dict[str, Any] | None):
        super().__init__(index)
        self.etags, self.storage_options, self.direct_spec = etags, dict(storage_options), direct_spec
        self._reader: Any = None
        self._fetched: tuple[int, int, Any] | None = None
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        # (no filesystem, socket or fetch thread travels to a worker)
        return {**self.__dict__, "_reader": None, "_fetched": None}

    def _url(self, i: int) -> str:
        return f"{self.index.image_dir}/{posixpath.normpath(self.index.file_name(i))}"

    def prefetch(self, start: int, stop: int) -> None:
        """Start fetching the images of samples ``start .. stop-1`` (a worker's task), a few GETs at
        a time ahead of the sample being encoded (:func:`~fastdata.writer.sources.remote.fetch_inputs`):
        :meth:`__getitem__` takes them in order. Refused and missing images are not fetched."""
        sizes = [int(self.index.sizes[i]) if i not in self.index.refused else -1 for i in range(start, stop)]
        urls = [self._url(i).encode() for i in range(start, stop)]
        self._fetched = (start, stop, fetch_inputs(urls, sizes, self.etags[start:stop].tolist(),
                                                   self.storage_options, self.direct_spec))
        self._next = start

    def _take(self, i: int, size: int) -> bytes | str:
        """Image ``i``'s bytes (or the reason it cannot be stored): from the prefetch when it is the
        next one there, else fetched now."""
        fetched = getattr(self, "_fetched", None)
        if fetched is not None and fetched[0] <= i < fetched[1] and i == self._next:
            self._next += 1
            data = next(fetched[2])
            if self._next == fetched[1]:
                self._fetched = None
            return data
        if self._reader is None:
            assert self.index.image_dir is not None, "a remote COCO index has its image folder URL"
            self._reader = RemoteLocation(self.index.image_dir, self.storage_options).object_reader(self.direct_spec)
        return self._reader(posixpath.normpath(self.index.file_name(i)), size if size >= 0 else -1,
                            int(self.etags[i]))

    def __getitem__(self, i: int) -> dict[str, Any]:
        size = int(self.index.sizes[i])
        if i in self.index.refused or size == -1:
            if self._fetched is not None and i == self._next:  # (its slot in the prefetch: a reason, no GET)
                self._take(i, size)
        sample = super().__getitem__(i)  # (raises RejectedInputError for a refused image)
        if size == -1:
            raise RejectedInputError(f"file not found: {sample['image']} (no such object)")
        data = self._take(i, size)
        if isinstance(data, str):
            raise RejectedInputError(f"{sample['image']}: {data}")
        key = posixpath.normpath(self.index.file_name(i))
        image = SourcedBytes(data)
        image.source = f"{self.index.image_dir}/{key}".encode()  # (the store's source path, as a local file's)
        sample["image"] = image
        return sample


class RemoteCocoInput(ReadsURLs, CocoInput):
    """A COCO annotation file (at a URL, or a local file) with its images below a folder URL (see
    the module docstring): the store the local copy of both converts to, but for
    ``metadata.coco``'s ``annotation_file`` and ``image_dir`` (the URLs, or the local file's path)."""

    def __init__(self, ann_url: str, image_url: str, *, storage_options: Mapping[str, Any] | None = None):
        local = remote_scheme(ann_url) is None
        super().__init__(os.path.abspath(ann_url) if local else ann_url, image_url)
        self.read_at(image_url, storage_options, recorded=os.path.abspath(ann_url) if local else ann_url)
        self.etags = np.zeros(0, np.uint64)
        self.digest = ""


    def _load(self) -> CocoIndex:
        index, self.etags, self.digest = load_remote_coco(str(self.ann_file), str(self.image_dir),
                                                          self.storage_options)
        return index

    def _samples(self, index: CocoIndex) -> CocoSamples:
        images = RemoteLocation(str(index.image_dir), self.storage_options)
        # the workers get the credentials this process resolved (their pool may predate them)
        return RemoteCocoSamples(index, self.etags, images.worker_storage_options(), images.direct_spec())

    def fingerprint(self, run: RunOptions) -> str:
        """:meth:`CocoInput.fingerprint` with every image's ETag and the annotation file's bytes."""
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        h.update(self.etags.astype("<u8").tobytes())
        h.update(self.digest.encode())
        return h.hexdigest()
