"""Plain signed GETs of S3 objects, for a conversion's inputs: botocore's full request pipeline
(event hooks, serialisers, the response parser) costs about 2.5 ms of CPU per GET, twice the
decoding of an ImageNet-like JPEG it feeds. Here each GET is signed by botocore's own SigV4 signer
(``S3SigV4Auth``) and sent by urllib3 (which botocore itself sends with) on a kept-alive connection
of a pool per process, its reply taken only when it is a plain ``200`` with a length: a fraction
of the CPU (see the remote guide). Nothing of HTTP or of the signature is implemented here.

Where pycurl is installed (the ``remote`` extra), a task's objects are fetched side by side by
libcurl (:meth:`DirectS3.get_many`): one multi handle per thread, its transfers signed by libcurl's
own SigV4 (``CURLOPT_AWS_SIGV4``) and run in C, so a GET costs a Python program about a fifth of
the CPU of the urllib3 path (0.12 against 0.55 ms measured here for a 63 KB object), and the
worker needs no fetch threads competing with its decoder for the GIL.

Only the common, unsurprising case takes this path; everything else returns None and the caller
reads through s3fs (:meth:`~fastdata.remote.location.RemoteLocation.read_object`), which has the
retries and the error translation. The listing pages of a source prefix go the same way
(:meth:`DirectS3.list_objects`), their XML read by ElementTree. The path is taken for:

* an S3-compatible endpoint set by ``AWS_ENDPOINT_URL`` or the storage options (MinIO, SeaweedFS,
  Ceph, R2, ...) addressed path-style; AWS's own endpoints (virtual-hosted buckets, region
  redirects) always go through botocore;
* no proxy configured (``HTTP(S)_PROXY`` or botocore's ``proxies``);
* credentials as botocore resolved them for the filesystem (refreshed through it; session tokens
  included), or unsigned requests when the filesystem is anonymous;
* a ``200`` reply with a ``Content-Length`` and no content encoding: any other reply, and any
  error of the connection (after one retry on a fresh connection), falls back.

The caller compares a reply's ETag and length with the listing's (a changed object is an error
there too). The pools are per process (made on first use: never inherited across a fork).
"""

from __future__ import annotations

import io
import math
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from fastdata._version import __version__

_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
#: frozen credentials are taken again after this many seconds (refreshable ones renew themselves)
CREDENTIALS_TTL_S = 60.0
#: kept-alive connections per process (the fetch threads of a worker: FETCH_CONCURRENCY)
POOL_CONNECTIONS = 8
#: keys asked for in one listing page (S3's most)
LISTING_PAGE_KEYS = 1000
#: the longest listing page read (1,000 keys of up to 1,024 bytes, with their XML)
MAX_LISTING_PAGE_BYTES = 8 << 20
#: a reply must deliver at least this many bytes (or its end) within each read timeout (the rule of
#: every remote read, :mod:`fastdata.remote.location`'s included, which imports it from here)
MIN_PROGRESS_BYTES = 64 << 10
#: bytes libcurl hands over per write callback (its default, 16 KiB, calls Python 4 times a JPEG)
CURL_BUFFER_BYTES = 256 << 10
#: what libcurl's GETs call themselves (urllib3's and botocore's name themselves too)
CURL_USER_AGENT = f"fastdata/{__version__} (libcurl)"


def freeze(fs, credentials) -> Any:
    """``credentials`` (of the s3fs filesystem ``fs``'s client) as they are now: access key, secret
    key and session token. aiobotocore's refreshable credentials are refreshed on the filesystem's
    event loop."""
    from fsspec.asyn import sync

    frozen = credentials.get_frozen_credentials()
    if hasattr(frozen, "__await__"):
        pending = frozen

        async def thaw():
            return await pending
        frozen = sync(fs.loop, thaw)
    return frozen


class DirectS3:
    """What a signed GET needs of one s3fs filesystem: its endpoint, region and credentials.

    Args:
        fs: the s3fs filesystem whose credentials are refreshed through it (None: ``credentials``
            are fixed, as :meth:`from_spec` makes them).
        endpoint: ``http(s)://host[:port][/base]``, the endpoint the filesystem's client uses.
        region: the signing region.
        credentials: botocore credentials (with ``get_frozen_credentials``), or None: unsigned.
        timeout: seconds to connect and between reads.
    """

    def __init__(self, fs, endpoint: str, region: str, credentials, timeout: float):
        self.fs = fs
        parts = urllib.parse.urlsplit(endpoint)
        self.origin = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"
        self.base_path = parts.path.rstrip("/")
        self.region = region
        self.credentials = credentials  # None: anonymous (unsigned requests)
        self.timeout = timeout
        self._frozen: Any = None
        self._frozen_at = 0.0
        self._lock = threading.Lock()
        self._pools: dict[int, Any] = {}

    def _frozen_credentials(self):
        """The credentials to sign with now (refreshed through the filesystem every
        :data:`CREDENTIALS_TTL_S` seconds; fixed ones as given)."""
        with self._lock:
            if self.fs is not None and (self._frozen is None
                                        or time.monotonic() - self._frozen_at > CREDENTIALS_TTL_S):
                self._frozen, self._frozen_at = freeze(self.fs, self.credentials), time.monotonic()
            return self._frozen

    def _headers(self, path: str) -> dict[str, str]:
        """The headers of a GET of ``path`` (already URI-encoded, as sent): botocore's SigV4
        signature of it, or none for an anonymous filesystem."""
        if self.credentials is None:
            return {}
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=self.origin + path)
        S3SigV4Auth(self._frozen_credentials(), "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def _pool(self):
        """This process's urllib3 connection pool to the endpoint (made on first use)."""
        pid = os.getpid()
        pool = self._pools.get(pid)
        if pool is None:
            import urllib3

            with self._lock:
                pool = self._pools.get(pid)
                if pool is None:
                    # one retry, on a connection error only (a kept-alive connection the server
                    # closed): any other trouble falls back to s3fs, which has the retry policy
                    pool = self._pools[pid] = urllib3.connection_from_url(
                        self.origin, maxsize=POOL_CONNECTIONS, block=False,
                        timeout=urllib3.Timeout(connect=self.timeout, read=self.timeout),
                        retries=urllib3.Retry(total=1, connect=1, read=0, status=0, other=0, redirect=0,
                                              raise_on_status=False, raise_on_redirect=False))
        return pool

    def spec(self) -> dict[str, Any]:
        """What a worker process needs to send the same GETs without a botocore client of its own
        (making one costs a worker about a second of CPU): the endpoint, region and the credentials
        as they are now (temporary ones may expire during a long run: a refused GET then falls back
        to s3fs, which refreshes them). Held in memory and handed to this process's own workers."""
        frozen = None if self.credentials is None else self._frozen_credentials()
        return {"endpoint": self.origin + self.base_path, "region": self.region, "timeout": self.timeout,
                "credentials": None if frozen is None else (frozen.access_key, frozen.secret_key, frozen.token)}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> DirectS3:
        """A :class:`DirectS3` of :meth:`spec` (with its fixed credentials), in this process."""
        direct = cls(None, spec["endpoint"], spec["region"], spec["credentials"], spec["timeout"])
        if spec["credentials"] is not None:
            from botocore.credentials import ReadOnlyCredentials

            direct._frozen = ReadOnlyCredentials(*spec["credentials"])
        return direct

    def list_objects(self, bucket: str, prefix: str) -> Iterator[tuple[str, int, str | None] | None]:
        """``(key, size, ETag)`` of every object of ``bucket`` under ``prefix``, one ListObjectsV2
        page (1,000 keys) at a time, the page's XML read by ElementTree (botocore's generic parser
        costs several times the CPU a key); a None is yielded, and the listing ends, as soon as a
        page cannot be read this way (the caller then lists through s3fs from the start)."""
        import urllib3
        import xml.etree.ElementTree as ET

        path = f"{self.base_path}/{urllib.parse.quote(bucket)}"
        token: str | None = None
        while True:
            params = {"list-type": "2", "prefix": prefix, "encoding-type": "url", "max-keys": str(LISTING_PAGE_KEYS)}
            if token:
                params["continuation-token"] = token
            target = f"{path}?{urllib.parse.urlencode(sorted(params.items()), quote_via=urllib.parse.quote)}"
            try:
                reply = self._pool().urlopen("GET", target, headers=self._headers(target), redirect=False,
                                             preload_content=True)
                if reply.status != 200 or len(reply.data) > MAX_LISTING_PAGE_BYTES:
                    yield None
                    return
                page = ET.fromstring(reply.data)
            except (urllib3.exceptions.HTTPError, OSError, ValueError, ET.ParseError):
                yield None
                return
            ns = page.tag[:page.tag.index("}") + 1] if page.tag.startswith("{") else ""
            for item in page.iter(f"{ns}Contents"):
                key = item.findtext(f"{ns}Key")
                if key is None:
                    yield None
                    return
                # (keys come URL-encoded, as asked: decoded as botocore decodes them)
                yield urllib.parse.unquote_plus(key), int(item.findtext(f"{ns}Size") or 0), item.findtext(f"{ns}ETag")
            if (page.findtext(f"{ns}IsTruncated") or "").lower() != "true":
                return
            token = page.findtext(f"{ns}NextContinuationToken")
            if not token:
                yield None
                return

    def get(self, bucket: str, key: str, size: int) -> tuple[str | None, int, bytes | None] | None:
        """Object ``key`` of ``bucket``, listed with ``size`` bytes: ``(ETag, length, body)`` of a
        ``200`` reply, the body None (not read) when the length is not ``size``; None when this
        path cannot answer (the caller reads through s3fs). The caller compares the ETag."""
        import urllib3

        path = f"{self.base_path}/{urllib.parse.quote(bucket)}/{urllib.parse.quote(key, safe='/~')}"
        try:
            reply = self._pool().urlopen("GET", path, headers=self._headers(path), preload_content=False,
                                         decode_content=False, redirect=False)
        except (urllib3.exceptions.HTTPError, OSError, ValueError):
            return None
        done = False
        try:
            length_text = reply.headers.get("content-length")
            if reply.status != 200 or length_text is None or reply.headers.get("content-encoding"):
                return None
            length = int(length_text)
            if length != size:  # (the caller raises: the object changed; its body is not read)
                return reply.headers.get("etag"), length, None
            body = reply.read()  # urllib3 checks that the body has the declared length
            done = len(body) == length
            return (reply.headers.get("etag"), length, body) if done else None
        except (urllib3.exceptions.HTTPError, OSError, ValueError):
            return None
        finally:
            if done:
                reply.release_conn()  # kept alive for the next GET
            else:
                reply.close()  # a reply not read to its end: its connection is not reused

    def get_many(self, bucket: str, wanted: Sequence[tuple[str, int]]
                 ) -> Generator[tuple[str | None, int, bytes | None] | None, None, None]:
        """:meth:`get` of each ``(key, listed size)`` of ``wanted``, yielded in order, fetched by
        libcurl :data:`POOL_CONNECTIONS` at a time ahead of the one yielded (the caller works on
        an object while the next ones arrive). Needs pycurl (:func:`has_curl`). Each result is
        what :meth:`get` returns: None where this path cannot answer (the caller reads that object
        through s3fs). Stopping the iteration early cancels what has not arrived."""
        return _CurlBatch(self, bucket, wanted).results()

    def curl_settings(self) -> list[tuple[int, Any]]:
        """libcurl options every GET of this endpoint has (set once on a reused handle): timeouts,
        no proxy, no redirect, the CA certificates, and libcurl's SigV4 signing (none: anonymous)."""
        import pycurl

        period = max(1, math.ceil(self.timeout))
        options: list[tuple[int, Any]] = [
            (pycurl.NOSIGNAL, 1), (pycurl.PROXY, ""), (pycurl.FOLLOWLOCATION, 0), (pycurl.USERAGENT, CURL_USER_AGENT),
            (pycurl.CONNECTTIMEOUT_MS, int(self.timeout * 1000)),
            # the read timeout's rule: a transfer that moves less than MIN_PROGRESS_BYTES in a period
            # (a trickle too, not only silence) is abandoned, and its object read through s3fs
            (pycurl.LOW_SPEED_LIMIT, max(1, math.ceil(MIN_PROGRESS_BYTES / period))), (pycurl.LOW_SPEED_TIME, period),
            (pycurl.BUFFERSIZE, CURL_BUFFER_BYTES)]
        if self.origin.startswith("https://"):
            # the certificates Python's ssl (and so urllib3) trusts, not those libcurl was built with
            paths = ssl.get_default_verify_paths()
            if paths.cafile:
                options.append((pycurl.CAINFO, paths.cafile))
            if paths.capath:
                options.append((pycurl.CAPATH, paths.capath))
        if self.credentials is not None:
            options.append((pycurl.AWS_SIGV4, f"aws:amz:{self.region}:s3"))
        return options

    def curl_credentials(self) -> list[tuple[int, Any]]:
        """libcurl options of the credentials to sign a GET with now (none when anonymous)."""
        import pycurl

        if self.credentials is None:
            return []
        frozen = self._frozen_credentials()
        return [(pycurl.USERNAME, frozen.access_key), (pycurl.PASSWORD, frozen.secret_key),
                (pycurl.HTTPHEADER, [f"x-amz-security-token: {frozen.token}"] if frozen.token else [])]


def has_curl() -> bool:
    """Whether pycurl imports here, with a libcurl that signs requests (``CURLOPT_AWS_SIGV4``, libcurl 7.75+)."""
    global _HAS_CURL
    if _HAS_CURL is None:
        try:
            import pycurl

            _HAS_CURL = hasattr(pycurl, "AWS_SIGV4") and pycurl.version_info()[2] >= 0x074B00
        except ImportError:
            _HAS_CURL = False
    return _HAS_CURL


_HAS_CURL: bool | None = None
_CURL = threading.local()


def _curl_multi() -> tuple[Any, list[Any]]:
    """This thread's libcurl multi handle, which keeps the connections alive between batches, and
    its idle easy handles (made on first use: never inherited across a fork)."""
    state = getattr(_CURL, "state", None)
    if state is None or state[0] != os.getpid():
        import pycurl

        state = _CURL.state = (os.getpid(), pycurl.CurlMulti(), [])
    return state[1], state[2]


class _CurlReply:
    """One transfer's reply: libcurl writes its header lines and body into two buffers (C calls,
    no Python callback per piece), read once the transfer is over. libcurl stops a body longer
    than ``size`` (``MAXFILESIZE_LARGE``)."""

    __slots__ = ("index", "size", "headers", "body")

    def __init__(self, index: int, size: int) -> None:
        self.index, self.size = index, size
        self.headers, self.body = io.BytesIO(), io.BytesIO()

    def result(self, status: int, failed: bool) -> tuple[str | None, int, bytes | None] | None:
        etag, length, encoded = None, None, False
        for line in self.headers.getvalue().splitlines():
            if line.startswith(b"HTTP/"):  # a status line: what came before was an interim reply
                etag, length, encoded = None, None, False
                continue
            name, sep, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"etag":
                etag = value.strip().decode("latin-1")
            elif name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
            elif name == b"content-encoding":
                encoded = True
        if status != 200 or length is None or encoded:
            return None
        if length != self.size:
            return etag, length, None  # (the caller raises: the object changed)
        body = self.body.getvalue()
        if failed or len(body) != self.size:
            return None
        return etag, length, body


class _CurlBatch:
    """The transfers of one :meth:`DirectS3.get_many` call on this thread's multi handle."""

    def __init__(self, direct: DirectS3, bucket: str, wanted: Sequence[tuple[str, int]]) -> None:
        self.direct, self.wanted = direct, wanted
        self.paths = [f"{direct.base_path}/{urllib.parse.quote(bucket)}/{urllib.parse.quote(key, safe='/~')}"
                      for key, _ in wanted]

    def results(self) -> Generator[tuple[str | None, int, bytes | None] | None, None, None]:
        import pycurl

        multi, idle = _curl_multi()
        active: dict[Any, _CurlReply] = {}
        done: dict[int, tuple[str | None, int, bytes | None] | None] = {}
        started = 0

        def start() -> None:
            nonlocal started
            handle = idle.pop() if idle else pycurl.Curl()
            if getattr(handle, "fastdata_settings", None) is not self.direct:  # (set once per endpoint)
                handle.reset()
                for option, value in self.direct.curl_settings():
                    handle.setopt(option, value)
                handle.fastdata_settings = self.direct
            reply = _CurlReply(started, self.wanted[started][1])
            for option, value in self.direct.curl_credentials():
                handle.setopt(option, value)
            handle.setopt(pycurl.URL, self.direct.origin + self.paths[started])
            handle.setopt(pycurl.MAXFILESIZE_LARGE, reply.size)
            handle.setopt(pycurl.HEADERFUNCTION, reply.headers.write)
            handle.setopt(pycurl.WRITEFUNCTION, reply.body.write)
            multi.add_handle(handle)
            active[handle] = reply
            started += 1

        def finish(handle, failed: bool) -> None:
            reply = active.pop(handle)
            multi.remove_handle(handle)
            done[reply.index] = reply.result(handle.getinfo(pycurl.RESPONSE_CODE), failed)
            handle.setopt(pycurl.WRITEFUNCTION, _discard)  # (the reply's buffers go with it)
            handle.setopt(pycurl.HEADERFUNCTION, _discard)
            idle.append(handle)

        def progress(wait: bool) -> None:
            while started < len(self.wanted) and len(active) < POOL_CONNECTIONS:
                start()
            if wait and active:
                # no longer than libcurl asks (its timers: a connection being set up has no socket yet)
                due_ms = multi.timeout()
                multi.select(0.1 if due_ms < 0 else min(0.1, due_ms / 1000))
            while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
                pass
            while True:
                queued, ok, failed = multi.info_read()
                for handle in ok:
                    finish(handle, False)
                for handle, _, _ in failed:
                    finish(handle, True)
                if not queued:
                    break

        try:
            for k in range(len(self.wanted)):
                progress(False)
                while k not in done:
                    progress(True)
                yield done.pop(k)
        finally:  # (stopped early: what has not arrived is dropped, its connection closed by libcurl)
            for handle in list(active):
                active.pop(handle)
                multi.remove_handle(handle)
                handle.close()


def _discard(data: bytes) -> None:
    return None


_DIRECT: dict[tuple, DirectS3 | None] = {}
_DIRECT_LOCK = threading.Lock()


def direct_from_spec(spec: dict[str, Any]) -> DirectS3:
    """This process's :class:`DirectS3` of ``spec`` (:meth:`DirectS3.spec`), made on first use."""
    key = (os.getpid(), repr(sorted(spec.items())))
    with _DIRECT_LOCK:
        found = _DIRECT.get(key)
        if found is None:
            found = _DIRECT[key] = DirectS3.from_spec(spec)
        return found


def direct_s3(fs, timeout: float) -> DirectS3 | None:
    """The :class:`DirectS3` of the s3fs filesystem ``fs`` in this process, or None when its
    requests must go through botocore (see the module docstring)."""
    key = (os.getpid(), id(fs))
    with _DIRECT_LOCK:
        if key in _DIRECT:
            return _DIRECT[key]
        _DIRECT[key] = found = _make(fs, timeout)
        return found


def _make(fs, timeout: float) -> DirectS3 | None:
    try:
        import botocore
        from fsspec.asyn import sync

        if any(os.environ.get(name) for name in _PROXY_ENV):
            return None
        client = sync(fs.loop, fs.set_session)
        meta = client.meta
        config = meta.config
        endpoint = meta.endpoint_url or ""
        host = urllib.parse.urlsplit(endpoint).hostname or ""
        style = (getattr(config, "s3", None) or {}).get("addressing_style")
        if (getattr(config, "proxies", None) or not endpoint.startswith(("http://", "https://"))
                or host.endswith(("amazonaws.com", "amazonaws.com.cn")) or style == "virtual"):
            return None
        unsigned = getattr(config, "signature_version", None) is botocore.UNSIGNED
        if not unsigned and getattr(config, "signature_version", None) not in (None, "s3v4", "v4"):
            return None  # (a signature version this path does not speak)
        credentials = None if unsigned else client._request_signer._credentials
        if credentials is None and not unsigned:
            return None  # (no credentials found: botocore's own request says so)
        return DirectS3(fs, endpoint, meta.region_name or "us-east-1", credentials, timeout)
    except Exception:  # noqa: BLE001 - any surprise: botocore's own path, which is always right
        return None
