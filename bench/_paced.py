"""A TCP relay in front of a local S3 server that paces every connection's answers to a fixed
rate, as a real object store serves each connection (S3 itself: on the order of 100 MB/s per
connection, whatever the client's bandwidth). Requests pass unchanged (Host too: signatures stay
valid); only the server-to-client direction is paced. Used by :mod:`bench.restore_paced`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

_BLOCK = 256 * 1024


@contextlib.contextmanager
def paced_relay(upstream: str, rate: float) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` relaying to ``upstream`` (``http://host:port``), each
    connection's answers at most ``rate`` bytes per second."""
    host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket, paced: bool) -> None:
        buf = bytearray(_BLOCK)
        due = time.monotonic()
        try:
            while not stop.is_set():
                n = src.recv_into(buf)
                if not n:
                    break
                if paced:
                    due = max(due, time.monotonic() - 0.05) + n / rate  # a 50 ms burst at most
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                dst.sendall(memoryview(buf)[:n])
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection((host, int(port)))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sockets.append(s)
            for src, dst, paced in ((client, server, False), (server, client, True)):
                t = threading.Thread(target=pump, args=(src, dst, paced), daemon=True)
                t.start()
                threads.append(t)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        acceptor.join(5)
        for t in threads:
            t.join(5)
