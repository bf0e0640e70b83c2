"""An HTTP reverse proxy that counts what passes: put it between a client and the S3 test server
(point ``endpoint_url`` at ``proxy.endpoint``) and every request is forwarded to the server as it
came (method, path, headers, body), its reply sent back unchanged, and each one recorded: method,
path, ``Range`` header (Azure's ``x-ms-range`` where it has none), reply status and body bytes.
So a test or a benchmark counts the requests and bytes a real server served, at the HTTP level,
whatever client library made them.

SeaweedFS checks no signatures in the tests (no identities are configured), so requests signed for
the proxy's host are served.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from dataclasses import dataclass

#: headers that belong to one connection, not to the request or reply (RFC 9110, 7.6.1)
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class Seen:
    """One request that passed: what was asked, and how many body bytes the server sent back."""

    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    #: the request's User-Agent header ("" when it sent none)
    agent: str = ""


class CountingProxy:
    """``CountingProxy(upstream).start()``; ``requests`` lists what passed; ``stop()`` ends it."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def gets(self, path_part: str = "") -> list[Seen]:
        """The GET requests whose path holds ``path_part``."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and path_part in r.path]

    def start(self) -> CountingProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                    with proxy._lock:  # (before the client has its reply: it may count at once)
                        proxy.requests.append(Seen(self.command, urllib.parse.unquote(self.path),
                                                   self.headers.get("Range") or self.headers.get("x-ms-range"),
                                                   reply.status,
                                                   0 if self.command == "HEAD" else len(data),
                                                   self.headers.get("User-Agent") or ""))
                    self.send_response(reply.status, reply.reason)
                    # a HEAD reply's Content-Length is the object's (its body is empty): passed on as it came
                    head = self.command == "HEAD"
                    for k, v in reply.getheaders():
                        if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                            self.send_header(k, v)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
