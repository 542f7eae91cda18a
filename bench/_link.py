"""A bandwidth-limited TCP link for benches: a relay on 127.0.0.1 in front of an S3 endpoint whose
every byte, each direction, passes one token bucket at a stated rate (a network link, full duplex,
shared by all connections), so the store behind it, not the client, is the bound.

The relay copies bytes unchanged (the Host header too: SigV4 signatures stay valid). Pacing is a
virtual clock per direction: a chunk of ``n`` bytes may leave ``n / rate`` seconds after the one
before it on that direction, with a burst of :data:`BURST` bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import suppress
from types import TracebackType
from urllib.parse import urlsplit

CHUNK = 64 * 1024
BURST = 256 * 1024
"""Bytes a direction may send ahead of its rate after an idle spell (a socket buffer's worth)."""


class _Bucket:
    """One direction's pacing: :meth:`take` blocks until ``n`` more bytes fit the rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(self.free_at, now - BURST / self.rate)
            self.free_at = start + n / self.rate
            wait = self.free_at - BURST / self.rate - now
        if wait > 0:
            time.sleep(wait)


class Link:
    """``with Link("http://127.0.0.1:8333", 25 * 2**20) as endpoint:`` — ``endpoint`` reaches the
    upstream through the link. Threads and sockets end with the ``with`` block."""

    def __init__(self, upstream: str, rate: float) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.up = _Bucket(rate)
        self.down = _Bucket(rate)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.stopping = False

    def __enter__(self) -> str:
        t = threading.Thread(target=self._accept, name="link-accept", daemon=True)
        t.start()
        self.threads.append(t)
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stopping = True
        self.listener.close()
        for s in list(self.sockets):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self.threads:
            t.join(timeout=10)

    def _accept(self) -> None:
        while not self.stopping:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sockets.append(s)
            for src, dst, bucket in ((client, server, self.up), (server, client, self.down)):
                t = threading.Thread(target=self._pump, args=(src, dst, bucket), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: _Bucket) -> None:
        try:
            while data := src.recv(CHUNK):
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
