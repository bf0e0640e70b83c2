"""Plain signed GETs of S3 objects, for a conversion's inputs: botocore's request pipeline (event
hooks, serialisers, the response parser) costs about 2.5 ms of CPU per GET, twice the decoding
of an ImageNet-like JPEG it feeds; a GET signed here (SigV4, the day's key cached) and sent on a
kept-alive connection of this thread, its reply parsed only as far as a ``200`` with a length,
costs a fraction of that (measured against SeaweedFS on this project's test machine; see the
remote guide).

Only the common, unsurprising case takes this path; everything else returns None and the caller
reads through s3fs (:meth:`~fastdata.remote.location.RemoteLocation.read_object`), which has the
retries and the error translation:

* an S3-compatible endpoint set by ``AWS_ENDPOINT_URL`` or the storage options (MinIO, SeaweedFS,
  Ceph, R2, ...) addressed path-style; AWS's own endpoints (virtual-hosted buckets, region
  redirects) always go through botocore;
* no proxy configured (``HTTP(S)_PROXY`` or botocore's ``proxies``);
* credentials as botocore resolved them for the filesystem (refreshed through it; session tokens
  included), signed by :func:`sigv4_headers` (what botocore's ``S3SigV4Auth`` signs: a test
  compares them), or unsigned when the filesystem is anonymous;
* a ``200`` reply with a ``Content-Length`` and no transfer or content encoding: any other
  reply, and any error of the connection, falls back (a kept-alive connection the server closed
  is tried once more afresh first).

The caller compares a reply's ETag and length with the listing's (a changed object is an error
there too). Connections are per thread and per process (made on first use: never inherited).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any

_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
#: frozen credentials are taken again after this many seconds (refreshable ones renew themselves)
CREDENTIALS_TTL_S = 60.0
#: SHA-256 of an empty body: a GET's payload hash, as botocore signs it
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
#: the most bytes of a reply's status line and headers read
MAX_HEADER_BYTES = 64 << 10
#: the longest listing page read (1,000 keys of up to 1,024 bytes, with their XML)
MAX_LISTING_PAGE_BYTES = 8 << 20


def canonical_query(params: dict[str, str]) -> str:
    """``params`` as SigV4's canonical query string (names sorted, names and values URI-encoded),
    which is also how the request sends them."""
    def enc(text: str) -> str:
        return urllib.parse.quote(text, safe="-_.~")
    return "&".join(f"{enc(k)}={enc(v)}" for k, v in sorted(params.items()))


def sigv4_headers(method: str, host: str, path: str, region: str, access_key: str, secret_key: str,
                  token: str | None, amz_date: str, key_cache: dict | None = None, query: str = "") -> dict[str, str]:
    """AWS Signature Version 4 headers of a bodiless S3 request for ``path`` (already URI-encoded,
    as sent; S3 does not normalise it) on ``host`` (``name[:port]`` as in the Host header), at
    ``amz_date`` (``YYYYMMDDTHHMMSSZ``): what botocore's ``S3SigV4Auth`` adds (a test compares
    them). ``key_cache`` keeps the day's signing key (four HMACs) between requests; ``query``: the
    canonical query string (:func:`canonical_query`)."""
    day = amz_date[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    if token:
        headers["x-amz-security-token"] = token
    names = sorted(headers)
    canonical = "\n".join([method, path, query, *(f"{n}:{headers[n]}" for n in names), "", ";".join(names),
                           EMPTY_SHA256])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    cache_key = (day, region, secret_key)
    key = key_cache.get(cache_key) if key_cache is not None else None
    if key is None:
        key = ("AWS4" + secret_key).encode()
        for part in (day, region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        if key_cache is not None:
            key_cache.clear()
            key_cache[cache_key] = key
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {"X-Amz-Date": amz_date, "X-Amz-Content-SHA256": EMPTY_SHA256,
           "Authorization": f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, "
                            f"Signature={signature}"}
    if token:
        out["X-Amz-Security-Token"] = token
    return out


class _Fallback(Exception):
    """Internal: this reply is not one the plain path reads (the caller goes through s3fs)."""


class DirectS3:
    """What a signed GET needs of one s3fs filesystem: its endpoint, region and credentials."""

    def __init__(self, fs, endpoint: str, region: str, credentials, timeout: float):
        self.fs = fs
        parts = urllib.parse.urlsplit(endpoint)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.secure else 80)
        self.host_header = parts.netloc.rsplit("@", 1)[-1]
        self.base_path = parts.path.rstrip("/")
        self.region = region
        self.credentials = credentials  # None: anonymous (unsigned requests)
        self.timeout = timeout
        self._frozen: Any = None
        self._frozen_at = 0.0
        self._keys: dict = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ssl = ssl.create_default_context() if self.secure else None

    def _auth(self, path: str, query: str = "") -> dict[str, str]:
        if self.credentials is None:
            return {}
        with self._lock:
            if self.fs is not None and (self._frozen is None
                                        or time.monotonic() - self._frozen_at > CREDENTIALS_TTL_S):
                from fsspec.asyn import sync

                frozen = self.credentials.get_frozen_credentials()
                if hasattr(frozen, "__await__"):  # aiobotocore's credentials are refreshed on its loop
                    pending = frozen

                    async def thaw():
                        return await pending
                    frozen = sync(self.fs.loop, thaw)
                self._frozen, self._frozen_at = frozen, time.monotonic()
            frozen = self._frozen
            return sigv4_headers("GET", self.host_header, path, self.region, frozen.access_key, frozen.secret_key,
                                 frozen.token, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), self._keys, query)

    def spec(self) -> dict[str, Any]:
        """What a worker process needs to send the same GETs without a botocore client of its own
        (making one costs a worker about a second of CPU): the endpoint, region and the credentials
        as they are now (temporary ones may expire during a long run: a refused GET then falls back
        to s3fs, which refreshes them)."""
        frozen = None
        if self.credentials is not None:
            self._auth("/")  # (freezes the current credentials)
            frozen = self._frozen
        return {"endpoint": f"{'https' if self.secure else 'http'}://{self.host_header}{self.base_path}",
                "region": self.region, "timeout": self.timeout,
                "credentials": None if frozen is None else (frozen.access_key, frozen.secret_key, frozen.token)}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> DirectS3:
        """A :class:`DirectS3` of :meth:`spec` (with its fixed credentials), in this process."""
        direct = cls(None, spec["endpoint"], spec["region"], spec["credentials"], spec["timeout"])
        if spec["credentials"] is not None:
            from collections import namedtuple

            direct._frozen = namedtuple("Frozen", "access_key secret_key token")(*spec["credentials"])
        return direct

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
            self._local.sock = sock
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _exchange(self, path: str, size: int | None, query: str = "") -> tuple[dict[str, str], bytes]:
        """Send the GET, read a ``200`` reply of a declared length (its body only when that is
        ``size``; None: any length up to :data:`MAX_LISTING_PAGE_BYTES`); raise :class:`_Fallback`
        for anything else."""
        sock = self._socket()
        target = f"{path}?{query}" if query else path
        lines = [f"GET {target} HTTP/1.1", f"Host: {self.host_header}", "Accept-Encoding: identity"]
        lines += [f"{k}: {v}" for k, v in self._auth(path, query).items()]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            part = sock.recv(65536)
            if not part or len(buf) > MAX_HEADER_BYTES:
                raise _Fallback
            buf += part
        head, _, body = buf.partition(b"\r\n\r\n")
        status, *header_lines = head.decode("latin-1").split("\r\n")
        if status.split(" ", 2)[1:2] != ["200"]:
            raise _Fallback
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers or "transfer-encoding" in headers or "content-encoding" in headers:
            raise _Fallback
        length = int(headers["content-length"])
        if size is None and length > MAX_LISTING_PAGE_BYTES:
            raise _Fallback
        if length == size or size is None:  # (otherwise the caller raises before the body is read)
            chunks = [body]
            have = len(body)
            while have < length:
                part = sock.recv(min(1 << 20, length - have))
                if not part:
                    raise _Fallback
                chunks.append(part)
                have += len(part)
            body = b"".join(chunks)
            if have > length:
                raise _Fallback
        if headers.get("connection", "").lower() == "close" or (size is not None and length != size):
            self._drop()
        return headers, body

    def list_objects(self, bucket: str, prefix: str):
        """``(key, size, ETag)`` of every object of ``bucket`` under ``prefix``, page by page
        (ListObjectsV2, keys URL-encoded by the server and decoded here as botocore decodes them:
        unquote_plus), or None as soon as a page
        cannot be read this way (the caller lists through s3fs from the start)."""
        import xml.etree.ElementTree as ET

        path = f"{self.base_path}/{urllib.parse.quote(bucket)}"
        token: str | None = None
        while True:
            params = {"list-type": "2", "prefix": prefix, "encoding-type": "url", "max-keys": "1000"}
            if token:
                params["continuation-token"] = token
            for attempt in range(2):
                reused = getattr(self._local, "sock", None) is not None
                try:
                    _, body = self._exchange(path, None, canonical_query(params))
                    page = ET.fromstring(body)
                    break
                except (_Fallback, OSError, ValueError, IndexError, ET.ParseError):
                    self._drop()
                    if not reused or attempt:
                        yield None
                        return
            ns = page.tag[:page.tag.index("}") + 1] if page.tag.startswith("{") else ""
            for item in page.iter(f"{ns}Contents"):
                key = item.findtext(f"{ns}Key")
                if key is None:
                    yield None
                    return
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
        path = f"{self.base_path}/{urllib.parse.quote(bucket)}/{urllib.parse.quote(key, safe='/~')}"
        for attempt in range(2):
            reused = getattr(self._local, "sock", None) is not None
            try:
                headers, data = self._exchange(path, size)
                length = int(headers["content-length"])
                return headers.get("etag"), length, data if length == size else None
            except (_Fallback, OSError, ValueError, IndexError):
                self._drop()
                if not reused or attempt:  # (a kept-alive connection the server closed: once more, afresh)
                    return None
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
        import botocore  # type: ignore[import-untyped]
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
