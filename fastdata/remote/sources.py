"""Inputs of a conversion that live where a URL says (``s3://``, ``gs://``, ``az://``, ``https://``).

The writer's remote sources (:mod:`fastdata.writer.sources.remote`) ask three things of a source
URL, all here, through the same :class:`~fastdata.remote.location.RemoteLocation` (fsspec and
``storage_options``, retries with backoff) the remote stores use:

* :func:`list_objects`: every object under a prefix with its size and ETag, as compact arrays
  (one ``bytes`` name, 8 bytes of size and 8 of ETag per object). On ``s3://`` the listing is
  read page by page (``ListObjectsV2``, 1,000 keys a page) straight into those arrays: no page
  and no per-object dict outlives its page. Other schemes go through fsspec's ``find``.
* :func:`stat_objects`: size and ETag of named objects (the rows of a list file), a bounded
  number of requests at a time.
* :func:`read_text`: a small object (a list file) whole.

Reading an input object checks it against its listing
(:meth:`~fastdata.remote.location.RemoteLocation.read_object`): an object changed or deleted
since it was listed is a :class:`~fastdata.remote.location.SourceChangedError` naming it.

Errors that the user must fix (a bucket or prefix that does not exist, missing or refused
credentials) are one :class:`~fastdata.errors.SourceError` line naming the URL and what to do;
they are not retried.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdata.errors import FastdataError, SourceError
from fastdata.remote.location import etag_key, RemoteLocation, RemoteSizeError, SourceChangedError

#: requests :func:`stat_objects` keeps in flight
STAT_CONCURRENCY = 32
#: the largest list file read (its rows are parsed in memory)
MAX_LIST_BYTES = 1 << 30
#: botocore's and the servers' names of errors of missing or refused credentials: not retried
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "InvalidAccessKeyId",
                      "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
                      "CredentialRetrievalError", "ClientAuthenticationError", "DefaultCredentialsError")


@dataclass
class ObjectListing:
    """Objects under a prefix: ``names`` relative to it (UTF-8 ``bytes``, ``/``-separated), in the
    server's order; ``sizes`` (int64) and ``etags`` (uint64, :func:`~fastdata.remote.location.etag_key`;
    0 where the server gives none)."""

    names: list[bytes]
    sizes: np.ndarray
    etags: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


class _Growing:
    """An int array appended to in place (doubling), so a listing of n objects holds n values, not
    n Python ints."""

    def __init__(self, dtype) -> None:
        self.data, self.n = np.empty(1024, dtype=dtype), 0

    def append(self, value: int) -> None:
        if self.n == len(self.data):
            self.data = np.resize(self.data, 2 * len(self.data))
        self.data[self.n] = value
        self.n += 1

    def array(self) -> np.ndarray:
        return self.data[:self.n].copy()


def _credential_problem(err: BaseException) -> BaseException | None:
    """The credential error behind ``err`` (botocore's or a server's refusal), if that is what it is."""
    cur: BaseException | None = err
    for _ in range(16):
        if cur is None:
            return None
        code = getattr(cur, "response", {}) or {}
        code = code.get("Error", {}).get("Code") if isinstance(code, dict) else None
        if isinstance(cur, PermissionError) or type(cur).__name__ in _CREDENTIAL_ERRORS or code in _CREDENTIAL_ERRORS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def credential_error(url: str, err: BaseException) -> SourceError:
    """The one-line error for credentials that are missing or refused at ``url``."""
    return SourceError(f"{url}: the credentials were refused or are missing ({type(err).__name__}: {err}); set them "
                       "where the SDK reads them (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                       "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*) or pass storage_options (key=, secret=, "
                       "profile=, token=), then rerun")


def _guarded(url: str, fn):
    """``fn`` with a credential failure turned into :func:`credential_error` (raised at once, not retried)."""
    def run():
        try:
            return fn()
        except FastdataError:
            raise
        except Exception as err:  # noqa: BLE001 - fsspec backends raise many types
            problem = _credential_problem(err)
            if problem is not None:
                raise credential_error(url, problem) from None
            raise
    return run


def list_objects(loc: RemoteLocation) -> ObjectListing:
    """Every object under ``loc``'s prefix (its "folder"), with sizes and ETags.

    Raises:
        SourceError: a bucket or prefix that does not exist or holds nothing, refused or missing
            credentials, or an ``https://`` URL (HTTP servers cannot be listed: give a list file
            whose rows name the objects).
        RemoteStoreError: the server could not be reached or answered errors (after retries).
    """
    if loc.read_only:
        raise SourceError(f"{loc.url}: an {loc.scheme}:// folder cannot be listed (HTTP has no listing); give a "
                          ".csv/.tsv list of path,label rows whose paths are URLs or relative to the list's URL")
    fs = loc.filesystem()
    base = loc.url.split("://", 1)[1]

    def listed() -> ObjectListing:
        names: list[bytes] = []
        sizes, etags = _Growing(np.int64), _Growing(np.uint64)
        root = base.rstrip("/") + "/"

        def add(path: str, size, etag) -> None:
            if not path.startswith(root) or path.endswith("/"):
                return  # (a "folder" placeholder object some tools make, or a key outside the prefix)
            names.append(path[len(root):].encode())
            sizes.append(int(size or 0))
            etags.append(etag_key(etag))
        direct = None
        if loc.scheme in ("s3", "s3a") and hasattr(fs, "_iterdir"):
            from fastdata.remote.direct import direct_s3

            direct = direct_s3(fs, max(loc.timeouts()))
        if direct is not None:  # signed pages through urllib3: a fraction of botocore's CPU per key
            bucket, key, _ = fs.split_path(base)
            for entry in direct.list_objects(bucket, (key.rstrip("/") + "/") if key else ""):
                if entry is None:  # a page this path cannot read: list through s3fs, from the start
                    names.clear()
                    sizes, etags = _Growing(np.int64), _Growing(np.uint64)
                    break
                add(f"{bucket}/{entry[0]}", entry[1], entry[2])
            else:
                return ObjectListing(names, sizes.array(), etags.array())
        if loc.scheme in ("s3", "s3a") and hasattr(fs, "_iterdir"):
            from fsspec.asyn import sync

            bucket, key, _ = fs.split_path(base)

            async def pages() -> None:
                # one ListObjectsV2 page at a time, each entry kept as three array values
                async for entry in fs._iterdir(bucket, delimiter="", prefix=(key.rstrip("/") + "/") if key else ""):
                    if entry.get("type") != "directory":
                        add(entry["name"], entry.get("size"), entry.get("ETag"))
            sync(fs.loop, pages)
        else:
            for path, info in fs.find(base, detail=True).items():
                add(path, info.get("size"), info.get("ETag") or info.get("etag"))
        return ObjectListing(names, sizes.array(), etags.array())
    fs.invalidate_cache()
    try:
        found = loc.call(f"listing {loc.url}", _guarded(loc.url, listed))
    except FileNotFoundError:
        found = ObjectListing([], np.zeros(0, np.int64), np.zeros(0, np.uint64))
    finally:
        fs.invalidate_cache()  # (s3fs would keep the whole listing in its directory cache)
    if not len(found):
        _explain_empty(loc)
    return found


def first_listing_page(loc: RemoteLocation, *, max_keys: int = 1000) -> list[str] | None:
    """One listing page under ``loc``'s prefix, to tell what kind of source it holds (tar shards,
    NIfTI volumes, images): up to ``max_keys`` object names relative to the prefix, at any depth
    (``a.tar``, ``cls/img.jpg``), in the server's order; elsewhere than S3, up to three levels
    deep. One request on ``s3://``: every kind is told from the same page. None where it cannot
    be listed (an ``https://`` URL, a missing prefix, refused credentials: the source that lists
    it in full says why)."""
    if loc.read_only:
        return None
    try:
        fs = loc.filesystem()
        base = loc.url.split("://", 1)[1].rstrip("/")
        if loc.scheme in ("s3", "s3a") and hasattr(fs, "call_s3"):
            bucket, key, _ = fs.split_path(base)
            prefix = (key.rstrip("/") + "/") if key else ""
            page = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=max_keys)
            names = [c["Key"][len(prefix):] for c in page.get("Contents", [])]
        else:
            root = base + "/"
            names = [p[len(root):] for p in fs.find(base, maxdepth=3) if p.startswith(root)][:max_keys]
        return [n for n in names if n and not n.endswith("/")]  # (not a "folder" placeholder object)
    except Exception:  # noqa: BLE001 - not listable here: the source that lists it in full reports why
        return None


def _explain_empty(loc: RemoteLocation) -> None:
    """Raise the error for a prefix that lists nothing: its bucket is missing, or the prefix is empty."""
    fs = loc.filesystem()
    bucket = loc.url.split("://", 1)[1].split("/", 1)[0]

    def bucket_exists() -> bool:
        try:
            return bool(fs.exists(bucket))
        except FileNotFoundError:
            return False
    exists = loc.call(f"looking up the bucket of {loc.url}", _guarded(loc.url, bucket_exists))
    if not exists:
        raise SourceError(f"{loc.url}: the bucket {bucket!r} does not exist (or these credentials cannot see it); "
                          "check the URL, the endpoint (AWS_ENDPOINT_URL or storage_options endpoint_url) and the "
                          "credentials")
    raise SourceError(f"{loc.url}: no objects under this prefix; check the URL (keys are case-sensitive)")


def stat_objects(urls: Sequence[str], storage_options: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Sizes (int64, -1 for an object that does not exist) and ETags (uint64) of the objects at
    ``urls``, :data:`STAT_CONCURRENCY` requests at a time, each with :meth:`RemoteLocation.call`'s retries.

    Raises:
        SourceError: refused or missing credentials.
        RemoteStoreError: the server could not be reached (after retries).
    """
    sizes = np.full(len(urls), -1, dtype=np.int64)
    etags = np.zeros(len(urls), dtype=np.uint64)

    def one(i: int) -> None:
        parent, _, name = urls[i].rpartition("/")
        loc = RemoteLocation(parent, storage_options)
        fs = loc.filesystem()

        def info():
            try:
                return fs.info(loc.child(name) if loc.read_only else loc.child(name).split("://", 1)[1])
            except FileNotFoundError:
                return None
        found = loc.call(f"looking up {urls[i]}", _guarded(urls[i], info))
        if found is not None and found.get("type", "file") == "file":
            size = found.get("size")
            sizes[i] = -2 if size is None else int(size)  # -2: exists, size unknown (an HTTP server without it)
            etags[i] = etag_key(found.get("ETag") or found.get("etag"))
    if urls:  # the filesystem made once, here, not by every thread at once
        RemoteLocation(urls[0].rpartition("/")[0], storage_options).filesystem()
    with cf.ThreadPoolExecutor(max_workers=max(1, min(STAT_CONCURRENCY, len(urls)))) as pool:
        for done in pool.map(one, range(len(urls))):
            del done
    return sizes, etags


def read_text(url: str, storage_options: Mapping[str, Any]) -> bytes:
    """The bytes of the (list) file at ``url``, at most :data:`MAX_LIST_BYTES`.

    Raises:
        SourceError: it does not exist, or credentials fail.
    """
    parent, _, name = url.rpartition("/")
    loc = RemoteLocation(parent, storage_options)
    try:
        return _guarded(url, lambda: loc.read_bytes(name, limit=MAX_LIST_BYTES))()  # (read_bytes retries)
    except FileNotFoundError:
        raise SourceError(f"list file not found: {url}") from None
    except SourceError:
        raise
    except FastdataError as err:
        if _credential_problem(err) is not None:
            raise credential_error(url, err) from None
        raise


def join_url(base: str, path: str) -> str:
    """``path`` (a URL, or a path relative to the folder URL ``base``) as a URL; ``..`` and ``.``
    segments are resolved, as a local path relative to a list file's folder would be."""
    if "://" in path:
        return path
    if path.startswith("/"):
        raise SourceError(f"{path}: an absolute local path in a list file at {base}/; rows of a remote list name "
                          "URLs or paths relative to the list's folder")
    scheme, _, rest = base.partition("://")
    joined = os.path.normpath(f"{rest}/{path}").replace(os.sep, "/")
    return f"{scheme}://{joined}"


class ObjectReader(io.RawIOBase):
    """One input object of a conversion as a read-only, seekable file, read in ranged GETs
    (:meth:`~fastdata.remote.location.RemoteLocation.read_range`: retries, timeouts) of at least
    ``block`` bytes, each reply checked against the object's listed ``size`` and ``etag`` (s3 and
    http(s): an object replaced or deleted since it was listed raises
    :class:`~fastdata.remote.location.SourceChangedError` naming it, at whatever block it is found).

    What it holds is bounded: one block of read-ahead (a read of more than ``block`` bytes is
    one GET of exactly those bytes, handed over without a copy kept). Reading a file front to
    back (a tar by a worker) sends ``size / block`` GETs; seeking over bytes never read skips
    them (tarfile's walk over headers reads a block at each member larger than ``block``).
    ``stop``: no read-ahead past this offset (a worker's task ends there). Nothing is opened
    until the first read: it may be made in one process and read in another.
    """

    def __init__(self, url: str, size: int, etag: int, storage_options: Mapping[str, Any], block: int = 4 << 20,
                 stop: int | None = None):
        super().__init__()
        parent, _, self._name = url.rpartition("/")
        self._loc = RemoteLocation(parent, storage_options)
        self.url, self.size, self.etag, self.block = url, size, etag, max(1, block)
        #: read-ahead never goes past this offset (a task's last byte: no GET asks for bytes past it)
        self.stop = size if stop is None else min(size, stop)
        self._pos = 0
        self._buf, self._buf_start = b"", 0
        #: GETs sent and bytes they returned (what a test bounds)
        self.requests = self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.url}: seek to {base + offset} (before the start)")
        self._pos = base + offset
        return self._pos

    def _get(self, start: int, end: int) -> bytes:
        try:
            data = self._loc.read_range(self._name, start, end, etag=self.etag, size=self.size)
        except FileNotFoundError:
            raise SourceChangedError(f"{self.url}: the object was deleted after it was listed; nothing was "
                                     "published: rerun the conversion (the listing is taken again)") from None
        except RemoteSizeError as err:
            raise SourceChangedError(f"{self.url}: the object changed after it was listed ({err}); nothing was "
                                     "published: rerun the conversion once the input stops changing") from None
        except FastdataError:
            raise
        except Exception as err:  # noqa: BLE001 - fsspec backends raise many types
            problem = _credential_problem(err)
            if problem is not None:
                raise credential_error(self.url, problem) from None
            raise
        self.requests += 1
        self.bytes_read += len(data)
        return data

    def read(self, n: int | None = -1) -> bytes:
        left = self.size - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        start = self._pos
        offset = start - self._buf_start
        if 0 <= offset and offset + n <= len(self._buf):
            data = self._buf[offset:offset + n]
        elif n > self.block:  # a large member: one GET of it, nothing kept behind
            self._buf, self._buf_start = b"", 0
            data = self._get(start, start + n)
        else:
            self._buf = b""  # (the old block goes before the new one comes)
            end = min(self.size, start + self.block)
            end = max(start + n, min(end, self.stop))
            self._buf, self._buf_start = self._get(start, end), start
            data = self._buf[:n]
        self._pos = start + len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._buf = b""
        super().close()
