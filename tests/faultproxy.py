"""A small fault-injecting HTTP/1.1 proxy for S3 tests: it sits between s3fs and the moto server.

Listens on 127.0.0.1 only, forwards each request to the upstream endpoint unchanged (the Host
header too, so SigV4 signatures stay valid) and, for a seeded fraction of requests, injects one of:

* ``slowdown``      — answer ``503 SlowDown`` (S3's throttling reply) without forwarding;
* ``reset_before``  — reset the connection (RST) before forwarding: the request never happened;
* ``reset_after``   — forward, then reset instead of answering: the request DID happen, the client
  cannot know (the ambiguous case: a lost CreateMultipartUpload or manifest PUT reply);
* ``truncate``      — forward, send the headers and half the body, then reset;
* ``latency``       — sleep a little (bounded) before forwarding;
* ``denied``        — answer ``403 AccessDenied`` (not retried by anyone; only used through rules);
* ``not_implemented`` — answer ``501 NotImplemented``, as a store lacking a feature does (only
  through rules);
* ``hold``          — never answer (a black-holed request): hold the connection until the client
  gives up or the proxy stops (only through rules).

Whether a request is faulted depends only on (seed, method, target, how many times that exact
request was seen), not on the interleaving of concurrent requests, so a seed reproduces a run.
Everything is bounded: at most ``max_faults`` faults, ``max_latency`` seconds of sleep per request,
``timeout`` seconds per socket operation. ``rules`` forces a fault for matching requests (a listing
that always fails, a partial listing) whatever the rate.

Every injected fault is recorded in :attr:`FaultProxy.faults`; :meth:`stop` closes every socket and
joins every thread it started (the suite's thread-leak guard checks).
"""

from __future__ import annotations

import hashlib
import http.client
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

KINDS = ("slowdown", "reset_before", "reset_after", "truncate", "latency")

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "content-length",
}

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>"
)
NOT_IMPLEMENTED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented.</Message>"
    b"<RequestId>faultproxy</RequestId></Error>"
)
DENIED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message><RequestId>faultproxy</RequestId></Error>"
)


_CANNED = {
    "slowdown": (503, "Slow Down", SLOWDOWN_BODY),
    "denied": (403, "Forbidden", DENIED_BODY),
    "not_implemented": (501, "Not Implemented", NOT_IMPLEMENTED_BODY),
}
"""Faults answered by the proxy itself: status, reason, body."""


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    """Path and query, as sent (``/bucket/key?partNumber=1&uploadId=…``)."""
    headers: tuple[tuple[str, str], ...]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""

    @property
    def is_listing(self) -> bool:
        """ListObjectsV2 / ListMultipartUploads / ListParts: the requests a delete decision reads."""
        return self.method == "GET" and bool(re.search(r"(^|&)(list-type=2|uploads|uploadId=)", self.query))


@dataclass(frozen=True)
class Fault:
    kind: str
    method: str
    target: str
    at: float = field(default_factory=time.monotonic)


Rule = Callable[[Request], "str | Callable[[bytes], bytes] | None"]
"""Forced behaviour for a request: a fault kind, or a function rewriting the upstream response
body (e.g. to make a listing look truncated), or None to fall back to the random faults."""


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.2,
        seed: int = 0,
        kinds: tuple[str, ...] = KINDS,
        max_faults: int | None = 10_000,
        max_latency: float = 0.25,
        timeout: float = 60.0,
        rules: list[Rule] | None = None,
        drop_headers: tuple[str, ...] = (),
    ) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname in ("127.0.0.1", "localhost"), "the proxy only fronts a local server"
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.rate = rate
        self.seed = seed
        self.kinds = kinds
        self.max_faults = max_faults
        self.max_latency = max_latency
        self.timeout = timeout
        self.rules = list(rules or [])
        self.drop_headers = frozenset(h.lower() for h in drop_headers)
        """Request headers never forwarded (``If-None-Match``: a store that ignores conditional writes)."""
        self.faults: list[Fault] = []
        self.requests = 0
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self.url = ""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        thread = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self.url

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(timeout=10)
        if self._listener is not None:
            self._listener.close()
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"fault proxy threads did not stop: {alive}"

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No random faults inside the block (rules still apply)."""
        rate, self.rate = self.rate, 0.0
        try:
            yield
        finally:
            self.rate = rate

    def fault_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    # -- connection handling -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self.timeout)
            with self._lock:
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name=f"faultproxy-conn-{len(self._conns)}", daemon=True
                )
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        upstream: http.client.HTTPConnection | None = None
        reader = conn.makefile("rb")
        try:
            while not self._stopping.is_set():
                request, body = _read_request(reader, conn)
                if request is None:
                    return
                if upstream is None:
                    upstream = http.client.HTTPConnection(
                        self.upstream_host, self.upstream_port, timeout=self.timeout
                    )
                action = self._decide(request)
                if action == "hold":
                    self._stopping.wait(self.timeout)
                    _reset(conn)
                    return
                if action in _CANNED:
                    status, reason, body_out = _CANNED[action]
                    head_only = request.method == "HEAD"  # a HEAD reply carries no body
                    _send_response(
                        conn,
                        status,
                        reason,
                        [("Content-Type", "application/xml")],
                        b"" if head_only else body_out,
                        declared=len(body_out) if head_only else None,
                    )
                    continue
                if action == "reset_before":
                    _reset(conn)
                    return
                if action == "latency":
                    time.sleep(self._latency(request))
                if self.drop_headers:
                    request = Request(
                        request.method,
                        request.target,
                        tuple((k, v) for k, v in request.headers if k.lower() not in self.drop_headers),
                    )
                status, reason, headers, data = _forward(upstream, request, body)
                if callable(action):
                    data = action(data)
                if action in ("reset_after",) or (
                    action == "truncate" and (request.method == "HEAD" or len(data) < 2)
                ):
                    _reset(conn)
                    return
                if action == "truncate":
                    _send_response(
                        conn, status, reason, headers, data, declared=len(data), cut=len(data) // 2
                    )
                    _reset(conn)
                    return
                declared = None
                if request.method == "HEAD":
                    declared = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                _send_response(conn, status, reason, headers, data, declared=declared)
        except (OSError, http.client.HTTPException, ValueError):
            return
        finally:
            if upstream is not None:
                upstream.close()
            reader.close()
            with suppress(OSError):
                conn.close()
            with self._lock:
                self._conns.discard(conn)

    def _decide(self, request: Request) -> str | Callable[[bytes], bytes] | None:
        with self._lock:
            self.requests += 1
            key = (request.method, request.target)
            nth = self._seen.get(key, 0)
            self._seen[key] = nth + 1
            for rule in self.rules:
                forced = rule(request)
                if forced is not None:
                    if isinstance(forced, str):
                        self.faults.append(Fault(forced, request.method, request.target))
                    return forced
            if self.rate <= 0 or (self.max_faults is not None and len(self.faults) >= self.max_faults):
                return None
            digest = hashlib.sha256(
                f"{self.seed}\0{request.method}\0{request.target}\0{nth}".encode()
            ).digest()
            rng = random.Random(digest)
            if rng.random() >= self.rate:
                return None
            kind = rng.choice(self.kinds)
            self.faults.append(Fault(kind, request.method, request.target))
            return kind

    def _latency(self, request: Request) -> float:
        rng = random.Random(f"{self.seed}:{request.target}:latency")
        return rng.uniform(0.01, self.max_latency)


def _read_request(reader: object, conn: socket.socket) -> tuple[Request | None, bytes]:
    rd = reader  # a BufferedReader over the socket
    line = rd.readline(65537)  # type: ignore[attr-defined]
    if not line:
        return None, b""
    try:
        method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    except ValueError:
        return None, b""
    headers: list[tuple[str, str]] = []
    while True:
        h = rd.readline(65537)  # type: ignore[attr-defined]
        if not h or h in (b"\r\n", b"\n"):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = b""
    if "chunked" in lower.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size_line = rd.readline(65537)  # type: ignore[attr-defined]
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while rd.readline(65537) not in (b"\r\n", b"\n", b""):  # type: ignore[attr-defined]
                    pass
                break
            chunks.append(_read_exact(rd, size))
            rd.readline(65537)  # type: ignore[attr-defined]
        body = b"".join(chunks)
    elif "content-length" in lower:
        body = _read_exact(rd, int(lower["content-length"]))
    return Request(method, target, tuple(headers)), body


def _read_exact(rd: object, n: int) -> bytes:
    data = rd.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise ValueError("client closed mid-body")
    return bytes(data)


def _forward(
    upstream: http.client.HTTPConnection, request: Request, body: bytes
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    for attempt in range(2):
        try:
            upstream.putrequest(request.method, request.target, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers:
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            if body or request.method in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            resp = upstream.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders()]
            if resp.will_close:
                upstream.close()
            return resp.status, resp.reason, headers, data
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            # a kept-alive upstream connection the server closed meanwhile: reconnect once
            upstream.close()
            if attempt:
                raise
    raise AssertionError("unreachable")


def _send_response(
    conn: socket.socket,
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    data: bytes,
    *,
    declared: int | None = None,
    cut: int | None = None,
) -> None:
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
    lines.append(f"Content-Length: {len(data) if declared is None else declared}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    conn.sendall(head + (data if cut is None else data[:cut]))


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), the way a crashed load balancer or a dropped NAT entry does."""
    with suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
