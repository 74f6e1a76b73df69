"""A fault-injecting HTTP proxy in front of the real S3 server (test infrastructure).

Each client request is read whole (head and ``Content-Length`` body), matched against
the armed :class:`Fault` rules, and either forwarded to the server on a connection of
its own (``Connection: close``; the answer is relayed until the server closes) or
answered by the proxy itself:

- ``"500"`` / ``"503"``: an S3 error document (``InternalError`` / ``SlowDown``);
- ``"403"``: ``AccessDenied`` (a part the store refuses);
- ``"reset"``: the connection is reset (RST) once the request was read, before any
  answer: to the client, a network failure in the middle of a part's request;
- ``"stall"``: the request is read and never answered (the connection stays open for
  :attr:`FaultProxy.stall_s` seconds, then closes), as a store that hangs;
- ``"cut"``: the request is forwarded, and the answer relayed for its first
  :attr:`FaultProxy.cut_bytes` bytes (status line and headers included); then the
  connection closes: to the client, a body shorter than its ``Content-Length``.

A rule fires on its ``nth`` matching request (1-based) and the ``count - 1`` after it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}


@dataclass
class Fault:
    """Fail matching requests: ``method`` (None: any), ``query`` a substring of the
    query string (e.g. ``"partNumber="``, ``"uploads"``), ``action`` as in the module
    docstring; fires on the ``nth`` match and ``count - 1`` more (``count=0``: all)."""

    action: str
    method: Optional[str] = None
    query: Optional[str] = None
    nth: int = 1
    count: int = 1
    #: a substring of the request's path (e.g. ``"/e.pt"``); None: any
    path: Optional[str] = None
    seen: int = 0
    fired: int = 0
    #: Called (on the proxy's thread) each time the fault fires, before it acts.
    hook: Optional[Callable[[], None]] = None

    def matches(self, method: str, target: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        parts = urlsplit(target)
        if self.query is not None and self.query not in parts.query:
            return False
        if self.path is not None and self.path not in parts.path:
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        if self.count and self.fired >= self.count:
            return False
        self.fired += 1
        return True


@dataclass
class FaultProxy:
    """Listens on 127.0.0.1 (:attr:`endpoint`) and forwards to ``upstream`` (host, port)."""

    upstream: tuple[str, int]
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: The headers of each request in :attr:`requests` (names lowercased).
    headers: list[dict[str, str]] = field(default_factory=list)
    #: How long a ``"stall"`` holds the connection without answering.
    stall_s: float = 30.0
    #: How many bytes of the answer a ``"cut"`` relays.
    cut_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="faultproxy").start()

    def arm(self, *faults: Fault) -> None:
        with self._lock:
            self.faults = list(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults = []
            self.requests = []
            self.headers = []

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                req = _read_request(conn)
                if req is None:
                    return
                head, body, method, target, headers = req
                with self._lock:
                    self.requests.append((method, target))
                    self.headers.append(headers)
                    fault = next((f for f in self.faults if f.matches(method, target)), None)
                if fault is None:
                    _forward(conn, self.upstream, head, body)
                    return  # the server closed: so do we (the client reconnects)
                if fault.hook is not None:
                    fault.hook()
                if fault.action == "stall":
                    time.sleep(self.stall_s)
                    return
                if fault.action == "cut":
                    _forward(conn, self.upstream, head, body, limit=self.cut_bytes)
                    return
                if fault.action == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                status, reason, code, msg = _ERRORS[fault.action]
                doc = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
                       f"<RequestId>faultproxy</RequestId></Error>").encode()
                conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                             f"Content-Length: {len(doc)}\r\nConnection: close\r\n\r\n".encode() + doc)
                return
        except OSError:
            return
        finally:
            conn.close()


def _read_request(conn: socket.socket) -> Optional[tuple[bytes, bytes, str, str, dict[str, str]]]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = conn.recv(min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    kept = [ln for ln in lines if not ln.lower().startswith("connection:")]
    new_head = ("\r\n".join(kept) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
    return new_head, bytes(body), method, target, headers


def _forward(conn: socket.socket, upstream: tuple[str, int], head: bytes, body: bytes,
             limit: Optional[int] = None) -> None:
    sent = 0
    with socket.create_connection(upstream) as up:
        up.sendall(head + body)
        while limit is None or sent < limit:
            chunk = up.recv(1 << 20)
            if not chunk:
                return
            if limit is not None:
                chunk = chunk[:limit - sent]
            conn.sendall(chunk)
            sent += len(chunk)
