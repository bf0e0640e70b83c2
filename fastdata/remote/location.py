"""A store URL and the filesystem that serves it (fsspec), with retries.

fsspec is the filesystem layer the ecosystem already uses (pandas, dask, Hugging Face
datasets): ``s3://`` through s3fs, ``gs://`` through gcsfs, ``az://`` through adlfs,
``https://`` through its HTTP implementation. Credentials and endpoints come from where
users already put them: the standard environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ...), the SDKs' config
files, and ``storage_options`` (passed to the fsspec filesystem as keyword arguments).

Filesystem objects hold event loops, sockets and threads: a :class:`RemoteLocation` holds
none, only the URL and options, and makes its filesystem on first use in each process
(a forked DataLoader worker never uses its parent's).
"""

from __future__ import annotations

import errno
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from fastdata.errors import FastdataError, RemoteStoreError

#: schemes that are read-only (no listing, no writes)
READ_ONLY_SCHEMES = ("http", "https")
_EXTRA_FOR = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
              "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}
_FS: dict[tuple, Any] = {}
#: errors of the local disk a download writes to: raised at once (the cache names its directory)
_LOCAL_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_CREDENTIAL_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")
T = TypeVar("T")
BLOCK = 8 << 20


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` (the CLI's ``--storage-option``) as a dict; a value that parses
    as JSON (numbers, true/false, objects) takes that type, anything else stays a string."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r}: expected key=value (e.g. endpoint_url=http://host:9000)")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


class RemoteSizeError(RemoteStoreError):
    """An object turned out longer or shorter than the size it was read with as its limit (a manifest's
    declared size): the store changed or was damaged remotely, or its server is hostile."""


class RedirectRefusedError(RemoteStoreError):
    """An http(s) server answered a redirect to another origin, which is not followed unless the
    storage option ``allow_redirects`` is True."""


#: storage option of http(s) stores: True follows redirects to any origin (scheme, host, port);
#: absent, only redirects within the store URL's own origin are followed
ALLOW_REDIRECTS = "allow_redirects"


def _origin(url) -> tuple[str, str, int | None]:
    return (url.scheme.lower(), (url.host or "").lower(), url.port)


async def _refuse_cross_origin(session, context, params) -> None:
    """aiohttp ``on_request_redirect`` hook: raise before a redirect to another origin is followed."""
    from yarl import URL

    location = params.response.headers.get("Location", "")
    target = params.url.join(URL(location)) if location else params.url
    if _origin(target) != _origin(params.url):
        raise RedirectRefusedError(
            f"{params.url}: the server redirects to {target.with_query(None)}, another origin; fastdata does not "
            f"follow a store's reads elsewhere unless told to: pass storage_options={{'{ALLOW_REDIRECTS}': True}} "
            f"(--storage-option {ALLOW_REDIRECTS}=true) if that server is trusted")


async def _same_origin_client(**kwargs):
    """fsspec ``get_client`` for http(s) stores: an aiohttp session that refuses cross-origin redirects."""
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_refuse_cross_origin)
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or []), trace]
    return aiohttp.ClientSession(**kwargs)


def _refused_redirect(err: BaseException) -> RedirectRefusedError | None:
    """The :class:`RedirectRefusedError` behind ``err`` (fsspec wraps it as a missing file), if any."""
    seen = 0
    cur: BaseException | None = err
    while cur is not None and seen < 16:
        if isinstance(cur, RedirectRefusedError):
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def _retries() -> int:
    return max(0, int(os.environ.get("FASTDATA_REMOTE_RETRIES", "4")))


def _credential_env() -> tuple[tuple[str, str], ...]:
    """The environment variables the filesystem libraries read endpoints and credentials from."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CREDENTIAL_ENV_PREFIXES)))


def _backoff(attempt: int) -> None:
    """Sleep before retry ``attempt + 1``: 0.25 s doubling up to 8 s, jittered by +-50 %."""
    time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + random.random()))


def _is_permanent(err: BaseException) -> bool:
    return isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                            FastdataError, ValueError, TypeError))


@dataclass(frozen=True)
class RemoteLocation:
    """A store (or any prefix) at ``url`` with fsspec ``storage_options``; safe to pickle."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    @property
    def read_only(self) -> bool:
        return self.scheme in READ_ONLY_SCHEMES

    def child(self, name: str) -> str:
        """URL of ``name`` inside this location."""
        return f"{self.url}/{name}"

    def filesystem(self):
        """This process's fsspec filesystem for the URL (made on first use, per process)."""
        # the environment is part of the key: endpoints and credentials often come from it
        key = (os.getpid(), self.scheme, json.dumps(self.storage_options, sort_keys=True, default=str),
               _credential_env())
        fs = _FS.get(key)
        if fs is None:
            options = dict(self.storage_options)
            if self.read_only and options.get(ALLOW_REDIRECTS) is not True and "get_client" not in options:
                options.pop(ALLOW_REDIRECTS, None)  # not given, or false: same-origin redirects only
                options["get_client"] = _same_origin_client
            try:
                import fsspec
                fs = fsspec.filesystem(self.scheme, skip_instance_cache=True, **options)
            except ImportError as err:
                extra = _EXTRA_FOR.get(self.scheme, "an fsspec implementation")
                raise RemoteStoreError(
                    f"{self.url}: reading {self.scheme}:// needs {extra} ({err}); install it with "
                    f"pip install 'fastdata[remote]' (s3fs) or pip install {extra}") from None
            except ValueError as err:  # fsspec: unknown protocol
                raise RemoteStoreError(f"{self.url}: no filesystem for {self.scheme}:// ({err})") from None
            _FS[key] = fs
        return fs

    def _path(self, name: str | None) -> str:
        url = self.url if name is None else self.child(name)
        return url if self.read_only else url.split("://", 1)[1]

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries and exponential backoff on transient errors (a dropped
        connection, a server restart); a missing object or a refused permission fails at once.
        Raises :class:`RemoteStoreError` naming ``what`` when every attempt failed."""
        attempts = _retries() + 1
        for attempt in range(attempts):
            try:
                return fn()
            except FileNotFoundError as err:
                refused = _refused_redirect(err)
                if refused is not None:
                    raise refused from None
                if self.read_only:
                    self._check_http_server()
                raise
            except Exception as err:  # noqa: BLE001 - fsspec backends raise many types
                refused = _refused_redirect(err)
                if refused is not None:
                    raise refused from None
                if isinstance(err, OSError) and err.errno in _LOCAL_DISK_FULL:
                    raise  # the local disk, not the network: retrying cannot help (the cache names it)
                if _is_permanent(err) or attempt == attempts - 1:
                    if isinstance(err, FastdataError):
                        raise
                    raise RemoteStoreError(f"{what}: {type(err).__name__}: {err} "
                                           f"(after {attempt + 1} attempt{'s' if attempt else ''}); check the "
                                           "endpoint, credentials and network, then rerun") from err
                _backoff(attempt)
        raise AssertionError("unreachable")

    def _check_http_server(self) -> None:
        """fsspec's HTTP filesystem reports a server it cannot reach as a missing file: tell
        "no server" (RemoteStoreError) from "no such object" with one request of our own."""
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(urllib.request.Request(self.url + "/", method="HEAD"), timeout=10).close()
        except urllib.error.HTTPError:
            return  # the server answered: the object is what is missing
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise RemoteStoreError(f"{self.url}: cannot reach the server ({reason}); check the URL and the "
                                   "network, then rerun") from None

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """Whole object ``name`` (FileNotFoundError when there is none).

        ``limit``: read at most ``limit + 1`` bytes, in blocks, and raise :class:`RemoteSizeError`
        when there are more, whatever size the server claims. An http(s) object is read as a
        stream, so a server that ignores ranges or sends a compressed body (``Content-Encoding``:
        aiohttp decodes it as it arrives) is counted after decoding and cut off at the limit."""
        fs = self.filesystem()
        path = self._path(name)

        def read() -> bytes:
            if limit is None:
                with fs.open(path, "rb", block_size=BLOCK) as fh:
                    return fh.read()
            # block_size=0: http(s) as one streamed GET (no range requests whose bodies fsspec reads whole)
            with fs.open(path, "rb", **({"block_size": 0} if self.read_only else {"block_size": BLOCK})) as fh:
                chunks, total = [], 0
                while total <= limit:
                    block = fh.read(min(BLOCK, limit + 1 - total))
                    if not block:
                        break
                    chunks.append(block)
                    total += len(block)
            if total > limit:
                raise RemoteSizeError(f"{self.child(name)}: larger than the {limit:,} bytes it may be (the manifest's "
                                      "size, or the limit of its kind); refusing to read on")
            return b"".join(chunks)
        return self.call(f"reading {self.child(name)}", read)

    def size(self, name: str) -> int | None:
        """Size of object ``name``, or None when there is none."""
        fs = self.filesystem()
        path = self._path(name)

        def info() -> int | None:
            try:
                return int(fs.info(path)["size"])
            except FileNotFoundError:
                return None
        return self.call(f"looking up {self.child(name)}", info)

    def download(self, name: str, out_path: str, expected_size: int) -> str:
        """Stream object ``name`` into ``out_path`` (overwritten); returns the xxh3-64 hex digest of
        what was written. At most ``expected_size`` bytes are written and one more read, whatever
        size the server claims; a short or long object raises :class:`RemoteSizeError`."""
        fs = self.filesystem()
        path = self._path(name)

        def fetch() -> str:
            h = xxhash.xxh3_64()
            written = 0
            longer = False
            with fs.open(path, "rb", block_size=BLOCK) as src, open(out_path, "r+b" if os.path.exists(out_path)
                                                                    else "wb") as dst:
                while True:
                    block = src.read(min(BLOCK, expected_size + 1 - written))
                    if not block:
                        break
                    if written + len(block) > expected_size:
                        longer = True
                        block = block[:expected_size - written]
                    dst.write(block)
                    h.update(block)
                    written += len(block)
                    if longer:
                        break
                dst.truncate(written)
                dst.flush()
                os.fsync(dst.fileno())
            if longer or written != expected_size:
                got = f"more than {expected_size}" if longer else str(written)
                raise RemoteSizeError(f"{self.child(name)}: downloaded {got} bytes, the manifest says "
                                      f"{expected_size}: the store was changed or damaged remotely")
            return h.hexdigest()
        return self.call(f"downloading {self.child(name)}", fetch)

    def upload(self, local_path: str, name: str) -> None:
        """Copy ``local_path`` to object ``name`` (multipart for big files, by the filesystem)."""
        self._writable()
        fs = self.filesystem()
        path = self._path(name)
        self.call(f"uploading {local_path} to {self.child(name)}", lambda: fs.put_file(local_path, path))

    def copy_from(self, source: RemoteLocation, name: str, new_name: str) -> None:
        """Object ``new_name`` := ``source``'s object ``name``, copied by the server (S3 ``CopyObject``,
        multipart for large objects: no byte passes through this machine). Both locations must be on
        the same filesystem (scheme and storage options)."""
        self._writable()
        if (source.scheme, dict(source.storage_options)) != (self.scheme, dict(self.storage_options)):
            raise ValueError(f"{source.url} and {self.url} are not on one server: a server-side copy needs both")
        fs = self.filesystem()
        src, dst = source._path(name), self._path(new_name)
        self.call(f"copying {source.child(name)} to {self.child(new_name)}", lambda: fs.copy(src, dst))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Object ``name`` := ``data`` (one PUT)."""
        self._writable()
        fs = self.filesystem()
        path = self._path(name)
        self.call(f"writing {self.child(name)}", lambda: fs.pipe_file(path, data))

    def listing(self, prefix: str | None = None) -> dict[str, int]:
        """Names (relative to this location) and sizes of the objects under it, or under ``prefix``."""
        self._writable("list")
        fs = self.filesystem()
        base = self._path(prefix)

        def ls() -> dict[str, int]:
            try:
                found = fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
            root = self._path(None).rstrip("/") + "/"
            return {p[len(root):]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(root)}
        fs.invalidate_cache()
        try:
            return self.call(f"listing {self.url if prefix is None else self.child(prefix)}", ls)
        finally:
            # s3fs keeps the listing: a later read of an object written since would see "missing"
            fs.invalidate_cache()

    def remove(self, names: list[str]) -> None:
        """Delete objects ``names`` (missing ones are fine)."""
        self._writable()
        fs = self.filesystem()
        paths = [self._path(n) for n in names]
        if paths:
            self.call(f"deleting {len(paths)} objects under {self.url}", lambda: fs.rm(paths))

    def _writable(self, verb: str = "write") -> None:
        if self.read_only:
            raise RemoteStoreError(f"{self.url}: {self.scheme}:// stores are read-only (cannot {verb}); "
                                   "write to s3://, gs://, az:// or a local path")
