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
import inspect
import io
import json
import os
import random
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from fastdata.errors import FastdataError, RemoteStoreError
from fastdata.remote.direct import MIN_PROGRESS_BYTES  # (defined there: its libcurl GETs follow it too)

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
    """``["key=value", ...]`` (as a command line gives them) as a dict; a value that parses
    as JSON (numbers, true/false, objects) takes that type, anything else stays a string."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"storage_options entry {pair!r}: expected key=value (e.g. endpoint_url=http://host:9000)")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


#: schemes that name the same service (one fsspec implementation, one namespace of buckets)
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs"}


def url_identity(url: str) -> tuple[str, ...]:
    """``url`` as ``(scheme, bucket, key segment, ...)``: the same object prefix for every spelling
    of it that a server or fsspec treats as one, so that two URLs are compared by what they name.

    Case-insensitive parts are lowered (the scheme; bucket, container and host names, which object
    stores keep lowercase); aliases of one service meet (``s3a`` is ``s3``, ``gcs`` is ``gs``);
    empty and ``.`` segments are dropped and ``..`` removes the segment before it (HTTP servers
    clean paths so; a store never holds such keys). Key segments keep their case and their
    percent-escapes (object keys are case-sensitive and not URL-decoded by fsspec).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not a URL (scheme://bucket/key)")
    scheme = scheme.lower()
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    bucket, _, key = rest.partition("/")
    segments: list[str] = []
    for part in key.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if segments:
                segments.pop()
            continue
        segments.append(part)
    return (scheme, bucket.lower(), *segments)


class RemoteSizeError(RemoteStoreError):
    """An object turned out longer or shorter than the size it was read with as its limit (a manifest's
    declared size): the store changed or was damaged remotely, or its server is hostile."""


class RedirectError(RemoteStoreError):
    """An http(s) server's redirects were not followed (base of the two kinds below)."""


class RedirectRefusedError(RedirectError):
    """An http(s) server answered a redirect to another origin, which is not followed unless the
    storage option ``allow_redirects`` is True."""


class RedirectLoopError(RedirectError):
    """An http(s) server's redirects come back to a URL already visited, or go on past
    :data:`MAX_REDIRECTS` hops."""


class RemoteTimeoutError(RemoteStoreError):
    """A remote object's reply stalled: no connection within the connect timeout, or fewer than
    :data:`MIN_PROGRESS_BYTES` bytes within a read timeout (a server trickling its reply)."""


#: most redirects one request follows (within its origin)
MAX_REDIRECTS = 10
#: defaults of the timeouts of every remote request (seconds); ``$FASTDATA_REMOTE_CONNECT_TIMEOUT`` /
#: ``$FASTDATA_REMOTE_READ_TIMEOUT``, or the storage options below, override them
DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_READ_TIMEOUT_S = 30.0
#: storage options (fastdata's own, not passed to fsspec) setting the two timeouts for one store
CONNECT_TIMEOUT_OPTION = "fastdata_connect_timeout"
READ_TIMEOUT_OPTION = "fastdata_read_timeout"
#: a stalled request is tried again only while the time since the first attempt is under this many
#: read timeouts (then the error is raised; other transient errors keep their retries)
STALL_RETRY_WINDOW = 3


def _timeout_setting(options: Mapping[str, Any], option: str, env: str, default: float) -> float:
    value = options.get(option)
    source = f"storage option {option}"
    if value is None:
        value, source = os.environ.get(env) or default, f"${env}"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {value!r} is not a number of seconds") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{source}: {value!r} must be a positive number of seconds")
    return seconds


#: storage option of http(s) stores: True follows redirects to any origin (scheme, host, port);
#: absent, only redirects within the store URL's own origin are followed
ALLOW_REDIRECTS = "allow_redirects"


def _origin(url) -> tuple[str, str, int | None]:
    return (url.scheme.lower(), (url.host or "").lower(), url.port)


async def _refuse_cross_origin(session, context, params) -> None:
    """aiohttp ``on_request_redirect`` hook: raise before a redirect to another origin is followed,
    and before one that comes back to a URL this request already visited (a loop)."""
    from yarl import URL

    location = params.response.headers.get("Location", "")
    target = params.url.join(URL(location)) if location else params.url
    seen = getattr(context, "fastdata_seen", None)
    if seen is None:
        seen = context.fastdata_seen = []
        seen.append(str(params.url))
    if str(target) in seen or len(seen) > MAX_REDIRECTS:
        raise RedirectLoopError(f"{seen[0]}: the server's redirects loop ({' -> '.join(seen[-4:])} -> {target}); "
                                "fix the server or the URL")
    seen.append(str(target))
    if _origin(target) != _origin(params.url):
        raise RedirectRefusedError(
            f"{params.url}: the server redirects to {target.with_query(None)}, another origin; fastdata does not "
            f"follow a store's reads elsewhere unless told to: set {ALLOW_REDIRECTS}=true in storage_options "
            "if that server is trusted")


async def _same_origin_client(**kwargs):
    """fsspec ``get_client`` for http(s) stores: an aiohttp session that refuses cross-origin redirects."""
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_refuse_cross_origin)
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or []), trace]
    return aiohttp.ClientSession(**kwargs)


def _causes(err: BaseException):
    """``err`` and what it wraps (``__cause__``, else ``__context__``), at most 16 deep."""
    cur: BaseException | None = err
    for _ in range(16):
        if cur is None:
            return
        yield cur
        cur = cur.__cause__ or cur.__context__


def _refused_redirect(err: BaseException) -> RedirectError | None:
    """The :class:`RedirectError` behind ``err`` (fsspec wraps it as a missing file), if any; aiohttp's
    own ``TooManyRedirects`` as a :class:`RedirectLoopError`."""
    for cur in _causes(err):
        if isinstance(cur, RedirectError):
            return cur
        if type(cur).__name__ == "TooManyRedirects":
            info = getattr(cur, "request_info", None)
            return RedirectLoopError(f"{getattr(info, 'real_url', '?')}: the server's redirects go on past "
                                     f"{MAX_REDIRECTS} hops (a redirect loop)")
    return None


def _timed_out(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) is a timeout of a request (asyncio's, aiohttp's, botocore's,
    the socket's)."""
    return any(isinstance(cur, (TimeoutError, RemoteTimeoutError)) or "Timeout" in type(cur).__name__
               for cur in _causes(err))


def _retries() -> int:
    return max(0, int(os.environ.get("FASTDATA_REMOTE_RETRIES", "4")))


def _credential_env() -> tuple[tuple[str, str], ...]:
    """The environment variables the filesystem libraries read endpoints and credentials from."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CREDENTIAL_ENV_PREFIXES)))


def backoff(attempt: int) -> None:
    """Sleep before retry ``attempt + 1`` of :meth:`RemoteLocation.call`: 0.25 s doubling up to
    8 s, jittered by +-50 %.

    A module-level hook: :meth:`RemoteLocation.call` looks it up at each retry, so a caller may
    replace it (a test records the retries instead of sleeping through them) without touching
    the retry loop itself.
    """
    time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + random.random()))


def _is_permanent(err: BaseException) -> bool:
    return isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                            FastdataError, ValueError, TypeError))


#: schemes whose fsspec filesystem streams one GET (``open_async``: s3fs, fsspec's HTTP)
_STREAMED_SCHEMES = ("s3", "s3a", "http", "https")


class _StreamedRead:
    """A file object reading one object as one streamed GET (fsspec's ``open_async``), each read
    bounded in time.

    A read returns the bytes that have arrived (up to those asked for), so the caller's progress
    check (:meth:`RemoteLocation._progress`) sees a trickling body between reads, not after a whole
    block. The first read, which waits for the reply's headers, must end within the connect and
    read timeouts together; each later one within the read timeout (a server that trickles its
    headers, or sends nothing, is cut off there: the read is cancelled, closing the connection).
    """

    def __init__(self, fs, path: str, connect_timeout: float, read_timeout: float):
        self._fs, self._path = fs, path
        self._first_timeout, self._read_timeout = connect_timeout + read_timeout, read_timeout
        self._file: Any = None

    def _run(self, make_coro, seconds: float):
        import asyncio

        from fsspec.asyn import sync

        async def bounded():
            return await asyncio.wait_for(make_coro(), seconds)
        return sync(self._fs.loop, bounded)

    def read(self, n: int = -1) -> bytes:
        if self._file is None:
            async def first() -> bytes:
                self._file = await self._fs.open_async(self._path, "rb")
                return await self._file.read(n)
            return self._run(first, self._first_timeout)
        return self._run(lambda: self._file.read(n), self._read_timeout)

    def close(self) -> None:
        file, self._file = self._file, None
        if file is None:
            return
        closing = getattr(file, "close", None)
        body = getattr(file, "r", None)
        try:
            if body is not None and hasattr(body, "close"):
                body.close()  # the response (s3: aiobotocore's body; http: aiohttp's response)
            if closing is not None and inspect.iscoroutinefunction(closing):
                self._run(closing, self._read_timeout)
        except Exception:  # noqa: BLE001 - closing a reply already failed or done: nothing to keep
            pass

    def __enter__(self) -> _StreamedRead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _read_at_most(read, limit: int) -> bytes:
    """A reply's body through ``read(n)`` (up to ``n`` bytes a call, ``b""`` at its end), at most
    ``limit + 1`` bytes of it (one more than wanted tells a longer reply)."""
    parts: list[bytes] = []
    total = 0
    while total <= limit:
        block = await read(limit + 1 - total)
        if not block:
            break
        parts.append(block)
        total += len(block)
    return b"".join(parts)


def _changed_since_listed(url: str, etag: int, size: int, reply_etag: object, content_range: object) -> None:
    """Raise :class:`SourceChangedError` when a ranged reply's ETag or total size (the ``/TOTAL`` of
    its ``Content-Range``) is not the listing's (``etag`` 0, ``size`` -1: not compared)."""
    now = etag_key(reply_etag)
    total = str(content_range or "").rpartition("/")[2]
    why = (["its ETag differs"] if etag and now and now != etag else []) + (
        [f"{int(total):,} bytes, listed as {size:,}"] if size >= 0 and total.isdigit() and int(total) != size else [])
    if why:
        raise SourceChangedError(f"{url}: the object changed after it was listed ({'; '.join(why)}); nothing was "
                                 "published: rerun the conversion once the input stops changing")


async def _s3_range(fs, path: str, start: int, end: int, url: str, etag: int = 0, size: int = -1) -> bytes:
    """One ranged ``GetObject`` through s3fs (its own call, with its error translation: a missing
    key is FileNotFoundError), the body read only when the reply is the range asked for (and,
    given ``etag``/``size``, of the object listed so: :func:`_changed_since_listed`)."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    try:
        reply = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
    except OSError as err:  # s3fs's InvalidRange (416): the object ends before the range begins
        if err.errno == errno.EINVAL and "range" in str(err).lower():
            raise RemoteSizeError(f"{url}: a read of bytes {start:,}-{end - 1:,} was refused: {err} (the object is "
                                  "shorter than the store's index says)") from None
        raise
    body = reply["Body"]
    try:
        length = reply.get("ContentLength")
        if "ContentRange" not in reply or (length is not None and length != end - start):
            raise RemoteSizeError(f"{url}: a read of bytes {start:,}-{end - 1:,} was answered with "
                                  f"{'the whole object' if 'ContentRange' not in reply else f'{length:,} bytes'} "
                                  "(the server ignores ranges, or the object is shorter than the store's index says)")
        _changed_since_listed(url, etag, size, reply.get("ETag"), reply.get("ContentRange"))
        return await _read_at_most(body.read, end - start)
    finally:
        body.close()


async def _http_range(fs, url: str, start: int, end: int, etag: int = 0, size: int = -1) -> bytes:
    """One ranged GET through fsspec's HTTP filesystem's session (its redirect rules and timeouts);
    a reply that is not ``206 Partial Content`` is refused before its body is read."""
    session = await fs.set_session()
    kwargs = dict(fs.kwargs)
    headers = dict(kwargs.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    async with session.get(fs.encode_url(url), headers=headers, **kwargs) as reply:
        fs._raise_not_found_for_status(reply, url)
        if reply.status != 206:
            raise RemoteStoreError(f"{url}: the server does not answer range requests (HTTP {reply.status} to a "
                                   "ranged GET); read this store with cache='shards'")
        _changed_since_listed(url, etag, size, reply.headers.get("ETag"), reply.headers.get("Content-Range"))
        return await _read_at_most(reply.content.read, end - start)


class SourceChangedError(RemoteStoreError):
    """An input object of a conversion was changed or deleted after it was listed: its ETag or size
    when read differs from the listing's (the store would mix two versions of the input)."""


def etag_key(etag: object) -> int:
    """An object's ETag as a nonzero 64-bit integer (xxh3-64 of its text, quotes stripped), or 0
    when there is none: compared, never shown, so a listing keeps 8 bytes per object for it."""
    if not etag:
        return 0
    return xxhash.xxh3_64_intdigest(str(etag).strip('"').encode()) or 1


def object_md5(info: Mapping[str, Any]) -> bytes | None:
    """The MD5 digest of an object's content as its filesystem's ``info`` reports it, or None where
    it reports none: gcsfs's ``md5Hash`` (base64; a composite object has none), adlfs's
    ``content_settings.content_md5`` (Azure sets it for a blob put in one request, not for one
    committed from blocks). An S3 ETag is not read here: it is an MD5 only for some uploads."""
    import base64
    import binascii

    digest = info.get("md5Hash")
    if isinstance(digest, str) and digest:
        try:
            raw = base64.b64decode(digest, validate=True)
        except (binascii.Error, ValueError):
            return None
        return raw if len(raw) == 16 else None
    # (azure's ContentSettings: a dict-like object, not a Mapping)
    lookup = getattr(info.get("content_settings"), "get", None)
    md5 = lookup("content_md5") if lookup is not None else None
    if isinstance(md5, (bytes, bytearray)) and len(md5) == 16:
        return bytes(md5)
    return None


async def _s3_get_checked(fs, path: str, size: int, etag: int, url: str) -> bytes:
    """One ``GetObject`` through s3fs whose reply's ETag and length must be the listing's (``etag``
    0: not compared); the body is read only then, at most ``size + 1`` bytes of it."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    reply = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
    body = reply["Body"]
    try:
        length = reply.get("ContentLength")
        now = etag_key(reply.get("ETag"))
        why = ([] if not (etag and now and now != etag) else ["its ETag differs"]) + (
            [] if length is None or int(length) == size else [f"{int(length):,} bytes, listed as {size:,}"])
        if why:
            raise SourceChangedError(f"{url}: the object changed after it was listed ({'; '.join(why)}); nothing was "
                                     "published: rerun the conversion once the input stops changing")
        return await _read_at_most(body.read, size)
    finally:
        body.close()


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
               _credential_env(), self.timeouts())
        fs = _FS.get(key)
        if fs is None:
            options = dict(self.storage_options)
            connect, read = self.timeouts()
            options.pop(CONNECT_TIMEOUT_OPTION, None)
            options.pop(READ_TIMEOUT_OPTION, None)
            if self.read_only and options.get(ALLOW_REDIRECTS) is not True and "get_client" not in options:
                options.pop(ALLOW_REDIRECTS, None)  # not given, or false: same-origin redirects only
                options["get_client"] = _same_origin_client
            if self.read_only:
                client = dict(options.get("client_kwargs") or {})
                if "timeout" not in client:  # the user's own aiohttp.ClientTimeout wins
                    import aiohttp
                    client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
                options["client_kwargs"] = client
            elif self.scheme in ("s3", "s3a"):
                config = dict(options.get("config_kwargs") or {})
                config.setdefault("connect_timeout", connect)
                config.setdefault("read_timeout", read)
                options["config_kwargs"] = config
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

    def timeouts(self) -> tuple[float, float]:
        """(connect, read) timeouts in seconds of this location's requests: the storage options
        ``fastdata_connect_timeout`` / ``fastdata_read_timeout``, else ``$FASTDATA_REMOTE_CONNECT_TIMEOUT`` /
        ``$FASTDATA_REMOTE_READ_TIMEOUT``, else 15 s / 30 s."""
        return (_timeout_setting(self.storage_options, CONNECT_TIMEOUT_OPTION, "FASTDATA_REMOTE_CONNECT_TIMEOUT",
                                 DEFAULT_CONNECT_TIMEOUT_S),
                _timeout_setting(self.storage_options, READ_TIMEOUT_OPTION, "FASTDATA_REMOTE_READ_TIMEOUT",
                                 DEFAULT_READ_TIMEOUT_S))

    def _progress(self, what: str) -> Callable[[int, bool], None]:
        """A check to call after each block read of one reply (its length, and whether it was the
        end): raises :class:`RemoteTimeoutError` when a read timeout passed with fewer than
        :data:`MIN_PROGRESS_BYTES` bytes (a trickling server; a silent one trips the socket timeout)."""
        read_timeout = self.timeouts()[1]
        window = [time.monotonic(), 0]

        def check(n: int, end: bool) -> None:
            window[1] += n
            now = time.monotonic()
            if end or now - window[0] < read_timeout:
                return
            if window[1] < MIN_PROGRESS_BYTES:
                raise RemoteTimeoutError(f"{what}: the server sent {window[1]:,} bytes in {now - window[0]:.1f} s, "
                                         f"fewer than {MIN_PROGRESS_BYTES:,} within the read timeout of "
                                         f"{read_timeout:g} s (set by ${'FASTDATA_REMOTE_READ_TIMEOUT'} or the storage "
                                         f"option {READ_TIMEOUT_OPTION}); the server or the network stalls")
            window[0], window[1] = now, 0
        return check

    def _path(self, name: str | None) -> str:
        url = self.url if name is None else self.child(name)
        return url if self.read_only else url.split("://", 1)[1]

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries and exponential backoff on transient errors (a dropped
        connection, a server restart); a missing object or a refused permission fails at once.
        Raises :class:`RemoteStoreError` naming ``what`` when every attempt failed."""
        attempts = _retries() + 1
        started = time.monotonic()
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - fsspec backends raise many types
                refused = _refused_redirect(err)
                if refused is not None:
                    raise refused from None
                if isinstance(err, FileNotFoundError) and not _timed_out(err):
                    if self.read_only:
                        self._check_http_server()
                    raise
                if isinstance(err, OSError) and err.errno in _LOCAL_DISK_FULL:
                    raise  # the local disk, not the network: retrying cannot help (the cache names it)
                stalled = _timed_out(err)
                if stalled and (attempt == attempts - 1 or self._stalled_too_long(started)):
                    if isinstance(err, RemoteTimeoutError):
                        raise
                    connect, read = self.timeouts()
                    raise RemoteTimeoutError(
                        f"{what}: the server did not answer within the timeouts (connect {connect:g} s, read "
                        f"{read:g} s; $FASTDATA_REMOTE_CONNECT_TIMEOUT / $FASTDATA_REMOTE_READ_TIMEOUT) after "
                        f"{attempt + 1} attempt{'s' if attempt else ''} in {time.monotonic() - started:.1f} s "
                        f"({type(err).__name__}: {err})") from err
                if not stalled and (_is_permanent(err) or attempt == attempts - 1):
                    if isinstance(err, FastdataError):
                        raise
                    if self.read_only and not isinstance(err, FileNotFoundError):
                        self._check_http_server()  # "cannot reach the server", when that is what failed
                    raise RemoteStoreError(f"{what}: {type(err).__name__}: {err} "
                                           f"(after {attempt + 1} attempt{'s' if attempt else ''}); check the "
                                           "endpoint, credentials and network, then rerun") from err
                backoff(attempt)
        raise AssertionError("unreachable")

    def _stalled_too_long(self, started: float) -> bool:
        """After a stalled attempt: no new attempt once :data:`STALL_RETRY_WINDOW` read timeouts passed."""
        return time.monotonic() - started >= STALL_RETRY_WINDOW * self.timeouts()[1]

    def _check_http_server(self) -> None:
        """fsspec's HTTP filesystem reports a server it cannot reach as a missing file: tell
        "no server" (RemoteStoreError) from "no such object" with one request of our own, which
        follows redirects only as the store's reads do (never to another origin, unless the storage
        option ``allow_redirects`` is True; a loop is a :class:`RedirectLoopError`) and has the
        store's connect timeout."""
        import urllib.error
        import urllib.request

        from yarl import URL

        allow_any = self.storage_options.get(ALLOW_REDIRECTS) is True

        class Redirects(urllib.request.HTTPRedirectHandler):
            max_redirections = MAX_REDIRECTS

            def redirect_request(self, req, fp, code, msg, headers, newurl):
                here, there = URL(req.full_url), URL(req.full_url).join(URL(newurl))
                if not allow_any and _origin(there) != _origin(here):
                    raise RedirectRefusedError(
                        f"{here}: the server redirects to {there.with_query(None)}, another origin; fastdata does "
                        f"not follow a store's reads elsewhere unless told to: set {ALLOW_REDIRECTS}=true in "
                        "storage_options if that server is trusted")
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        opener = urllib.request.build_opener(Redirects)
        try:
            opener.open(urllib.request.Request(self.url + "/", method="HEAD"), timeout=self.timeouts()[0]).close()
        except urllib.error.HTTPError as err:
            if 300 <= err.code < 400:  # urllib's loop detection (or a redirect with no Location)
                raise RedirectLoopError(f"{self.url}/: the server's redirects loop or lead nowhere ({err.code} "
                                        f"{err.reason}); fix the server or the URL") from None
            return  # the server answered: the object is what is missing
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError) or isinstance(err, TimeoutError):
                raise RemoteTimeoutError(f"{self.url}: the server did not answer within the connect timeout "
                                         f"({self.timeouts()[0]:g} s)") from None
            raise RemoteStoreError(f"{self.url}: cannot reach the server ({reason}); check the URL and the "
                                   "network, then rerun") from None

    def _open_read(self, fs, path: str):
        """``path`` open for one pass from its start, as one streamed GET where the filesystem can
        stream (s3 and http(s): :class:`_StreamedRead`, each read returning what has arrived, so a
        stalled reply is noticed between reads however large the blocks asked for), in blocks
        otherwise (each block a ranged request whose body the filesystem reads whole)."""
        if hasattr(fs, "open_async") and hasattr(fs, "loop") and self.scheme in _STREAMED_SCHEMES:
            return _StreamedRead(fs, path, *self.timeouts())
        return fs.open(path, "rb", block_size=0 if self.read_only else BLOCK)

    def read_bytes(self, name: str, limit: int | None = None, *, etag: int = 0) -> bytes:
        """Whole object ``name`` (FileNotFoundError when there is none).

        ``limit``: read at most ``limit + 1`` bytes, in blocks, and raise :class:`RemoteSizeError`
        when there are more, whatever size the server claims. An http(s) object is read as a
        stream, so a server that ignores ranges or sends a compressed body (``Content-Encoding``:
        aiohttp decodes it as it arrives) is counted after decoding and cut off at the limit.
        A reply that stalls (see :meth:`timeouts`) raises :class:`RemoteTimeoutError`.

        ``etag`` (:func:`etag_key`; 0: not compared): on the schemes read in blocks (``gs://``,
        ``az://``), the ETag the object must have. Their fsspec file asks for the object's details
        when it opens, before the first block: another ETag there raises :class:`SourceChangedError`
        (no request of its own; the details are taken from the server, not a cached listing).
        Streamed schemes (s3, http(s)) check ETags in their own replies (:meth:`read_object`)."""
        fs = self.filesystem()
        path = self._path(name)
        what = f"reading {self.child(name)}"
        streamed = self.scheme in _STREAMED_SCHEMES

        def read() -> bytes:
            progress = self._progress(what)
            # one buffer, grown in place: getvalue() hands it over without a copy (a 1.5 GiB index.fdi
            # is held once, not as blocks plus their join)
            out, total = io.BytesIO(), 0
            if etag and not streamed:
                fs.invalidate_cache(path)  # the details the file fetches: the object's now, not a listing's
            with self._open_read(fs, path) as fh:
                if etag and not streamed:
                    details = getattr(fh, "details", None) or {}
                    now = etag_key(details.get("ETag") or details.get("etag"))
                    if now and now != etag:
                        raise SourceChangedError(f"{self.child(name)}: the object changed after it was listed (its "
                                                 "ETag differs); nothing was published: rerun the conversion once "
                                                 "the input stops changing")
                while limit is None or total <= limit:
                    want = BLOCK if limit is None else min(BLOCK, limit + 1 - total)
                    block = fh.read(want)
                    progress(len(block), not block)
                    if not block:
                        break
                    out.write(block)
                    total += len(block)
                    del block
            if limit is not None and total > limit:
                raise RemoteSizeError(f"{self.child(name)}: larger than the {limit:,} bytes it may be (the manifest's "
                                      "size, or the limit of its kind); refusing to read on")
            return out.getvalue()
        return self.call(what, read)

    def read_range(self, name: str, start: int, end: int, *, etag: int = 0, size: int = -1) -> bytes:
        """Bytes ``start`` to ``end`` (excluded) of object ``name``, as one ranged GET, with retries
        and backoff on transient errors (:meth:`call`).

        At most ``end - start`` bytes are read (and one more, to tell a longer reply) whatever the
        server sends: a reply of another length (an object shorter than the range; a server that
        ignores ``Range`` and answers the whole object) raises :class:`RemoteSizeError` without
        reading on. s3 and http(s) replies are read so, in pieces; other schemes go through the
        filesystem's own ``cat_file(path, start, end)`` (gcsfs, adlfs: the cloud SDKs, which ask
        for the range) and are checked after. The request must end within the connect and read
        timeouts together (:meth:`timeouts`).

        ``etag`` (:func:`etag_key`) and ``size``: the object as it was listed (an input of a
        conversion); an s3 or http(s) reply with another ETag or total size raises
        :class:`SourceChangedError` before its body is read (other schemes: not compared)."""
        want = end - start
        if want <= 0:
            return b""
        fs = self.filesystem()
        path = self._path(name)
        what = f"reading bytes {start:,}-{end - 1:,} of {self.child(name)}"

        def read() -> bytes:
            if self.scheme in ("s3", "s3a") and hasattr(fs, "_call_s3"):
                data = self._bounded(fs, _s3_range(fs, path, start, end, self.child(name), etag, size))
            elif self.read_only and hasattr(fs, "set_session"):
                data = self._bounded(fs, _http_range(fs, path, start, end, etag, size))
            else:
                data = fs.cat_file(path, start=start, end=end)
            if len(data) != want:
                got = f"more than {want:,}" if len(data) > want else f"{len(data):,}"
                raise RemoteSizeError(f"{self.child(name)}: a read of bytes {start:,}-{end - 1:,} gave {got} bytes, "
                                      f"not {want:,}: the object is shorter than the store's index says, or the "
                                      "server does not answer range requests")
            return data
        return self.call(what, read)

    def _bounded(self, fs, coro) -> bytes:
        """Run ``coro`` on ``fs``'s event loop, within the connect and read timeouts together."""
        import asyncio

        from fsspec.asyn import sync

        async def bounded() -> bytes:
            return await asyncio.wait_for(coro, sum(self.timeouts()))
        return sync(fs.loop, bounded)

    def read_object(self, name: str, size: int, etag: int = 0) -> bytes:
        """Input object ``name`` of a conversion, which was listed with ``size`` bytes and ETag
        ``etag`` (:func:`etag_key`; 0: unknown), with retries on transient errors (:meth:`call`).

        s3: one GET whose reply must carry the listed ETag and length before its body is read;
        other schemes: the object read up to ``size + 1`` bytes, its ETag compared where its
        filesystem reads in blocks (gs, az: :meth:`read_bytes`). At most ``size + 1`` bytes are
        read whatever the server sends.

        Raises:
            SourceChangedError: the object is gone, or its ETag or size is not the listing's.
        """
        fs = self.filesystem()
        path = self._path(name)
        url = self.child(name)

        def read() -> bytes:
            if self.scheme in ("s3", "s3a") and hasattr(fs, "_call_s3"):
                data = self._bounded(fs, _s3_get_checked(fs, path, size, etag, url))
            else:
                data = self.read_bytes(name, limit=size if size >= 0 else None, etag=etag)
            if size >= 0 and len(data) != size:
                raise SourceChangedError(f"{url}: the object changed after it was listed ({len(data):,} bytes read, "
                                         f"listed as {size:,}); nothing was published: rerun the conversion once "
                                         "the input stops changing")
            return data
        try:
            return self.call(f"reading {url}", read)
        except RemoteSizeError as err:  # read_bytes: longer than listed
            raise SourceChangedError(f"{url}: the object changed after it was listed ({err}); nothing was "
                                     "published: rerun the conversion once the input stops changing") from None
        except FileNotFoundError:
            raise SourceChangedError(f"{url}: the object was deleted after it was listed; nothing was published: "
                                     "rerun the conversion (the listing is taken again)") from None

    def worker_storage_options(self) -> dict[str, Any]:
        """``storage_options`` for this location in a worker process, with what this process resolved
        from its environment made explicit: on ``s3://``, the credentials (key, secret, session
        token) and an endpoint set by ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``. A worker pool's
        processes may have been started before the environment was set (a forkserver outlives a
        conversion), so they cannot be trusted to see it. Options that name credentials themselves
        (``key``, ``secret``, ``profile``, ``anon``) are kept as given. Held in memory and handed to
        this process's own workers; never written anywhere."""
        options = dict(self.storage_options)
        if self.scheme not in ("s3", "s3a"):
            return options
        client_kwargs = dict(options.get("client_kwargs") or {})
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and not options.get("endpoint_url") and not client_kwargs.get("endpoint_url"):
            options["endpoint_url"] = endpoint
        if any(options.get(k) for k in ("key", "secret", "profile", "anon")):
            return options
        try:
            from fsspec.asyn import sync

            from fastdata.remote.direct import freeze

            fs = self.filesystem()
            credentials = sync(fs.loop, fs.set_session)._request_signer._credentials
            frozen = freeze(fs, credentials) if credentials is not None else None
        except Exception:  # noqa: BLE001 - none resolved here: the workers resolve their own, as before
            return options
        if frozen is not None and frozen.access_key:
            options.update(key=frozen.access_key, secret=frozen.secret_key)
            if frozen.token:
                options["token"] = frozen.token
        return options

    def direct_spec(self) -> dict[str, Any] | None:
        """What :meth:`object_reader` in another process needs to send plain signed GETs without
        a botocore client of its own (:meth:`fastdata.remote.direct.DirectS3.spec`: endpoint, region,
        the current credentials), or None where they go through s3fs. Held in memory and handed
        to this process's own workers; never written anywhere."""
        if self.scheme not in ("s3", "s3a"):
            return None
        fs = self.filesystem()
        if not hasattr(fs, "_call_s3"):
            return None
        from fastdata.remote.direct import direct_s3

        direct = direct_s3(fs, max(self.timeouts()))
        return None if direct is None else direct.spec()

    def _direct(self, direct_spec: dict[str, Any] | None):
        """The :class:`~fastdata.remote.direct.DirectS3` of this location's GETs (``direct_spec``:
        :meth:`direct_spec` of the process that listed the objects), or None where they go through
        s3fs."""
        if self.scheme not in ("s3", "s3a"):
            return None
        from fastdata.remote.direct import direct_from_spec, direct_s3

        if direct_spec is not None:
            return direct_from_spec(direct_spec)
        fs = self.filesystem()
        return direct_s3(fs, max(self.timeouts())) if hasattr(fs, "_call_s3") else None

    def _bucket_key(self, name: str) -> tuple[str, str]:
        """The bucket of this location and the key of object ``name`` in it."""
        bucket, _, prefix = self.url.split("://", 1)[1].partition("/")
        prefix = prefix.strip("/")
        return bucket, f"{prefix}/{name}" if prefix else name

    def _direct_reply(self, name: str, size: int, etag: int, got: tuple[str | None, int, bytes | None]) -> bytes:
        """The body of a plain GET's reply ``got`` (``(ETag, length, body)``) of object ``name``,
        listed with ``size`` bytes and ETag ``etag``.

        Raises:
            SourceChangedError: its ETag or length is not the listing's.
        """
        reply_etag, length, data = got
        now = etag_key(reply_etag)
        why = (["its ETag differs"] if etag and now and now != etag else []) + (
            [f"{length:,} bytes, listed as {size:,}"] if length != size else [])
        if why or data is None:
            raise SourceChangedError(f"{self.child(name)}: the object changed after it was listed "
                                     f"({'; '.join(why)}); nothing was published: rerun the conversion "
                                     "once the input stops changing")
        return data

    def object_reader(self, direct_spec: dict[str, Any] | None = None) -> Callable[[str, int, int], bytes]:
        """:meth:`read_object` for many objects under this location. On ``s3://`` against an
        S3-compatible endpoint each object is first asked for with a plain signed GET
        (:mod:`fastdata.remote.direct`, a fraction of botocore's CPU per request; ``direct_spec``:
        :meth:`direct_spec` of the process that listed the objects, so that no client is made
        here unless a GET falls back), and read through :meth:`read_object` whenever that cannot
        answer."""
        direct = self._direct(direct_spec)

        def read(name: str, size: int, etag: int = 0) -> bytes:
            if direct is not None and size >= 0:
                bucket, key = self._bucket_key(name)
                got = direct.get(bucket, key, size)
                if got is not None:
                    return self._direct_reply(name, size, etag, got)
            return self.read_object(name, size, etag)
        return read

    def batch_reader(self, direct_spec: dict[str, Any] | None = None
                     ) -> Callable[[Sequence[str], Sequence[int], Sequence[int]], Generator[bytes, None, None]] | None:
        """:meth:`object_reader` for a batch of objects fetched side by side by libcurl
        (:meth:`~fastdata.remote.direct.DirectS3.get_many`): ``read(names, sizes, etags)`` yields
        each object's bytes in order, fetching the next ones meanwhile; an object libcurl cannot
        answer for, or of unknown size (negative), is read through :meth:`read_object`. None where
        that path is not taken (not ``s3://`` against an S3-compatible endpoint, or no pycurl):
        read the objects one by one with :meth:`object_reader`.

        Raises (from the iterator):
            SourceChangedError: an object's ETag or length is not the listing's, or it is gone.
        """
        from fastdata.remote.direct import has_curl

        direct = self._direct(direct_spec) if has_curl() else None
        if direct is None:
            return None

        def read(names: Sequence[str], sizes: Sequence[int], etags: Sequence[int]) -> Generator[bytes, None, None]:
            bucket = self._bucket_key("")[0]
            replies = direct.get_many(bucket, [(self._bucket_key(name)[1], size)
                                               for name, size in zip(names, sizes, strict=True) if size >= 0])
            try:
                for name, size, etag in zip(names, sizes, etags, strict=True):
                    got = next(replies) if size >= 0 else None
                    yield self.read_object(name, size, etag) if got is None else \
                        self._direct_reply(name, size, etag, got)
            finally:
                replies.close()
        return read

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
            progress = self._progress(f"downloading {self.child(name)}")
            with self._open_read(fs, path) as src, open(out_path, "r+b" if os.path.exists(out_path) else "wb") as dst:
                while True:
                    block = src.read(min(BLOCK, expected_size + 1 - written))
                    progress(len(block), not block)
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
