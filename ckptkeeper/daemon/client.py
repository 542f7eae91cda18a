"""The CLI's thin client of the daemon's restore socket (:mod:`.restore_server`).

``restore`` and ``prefetch`` ask the node's daemon first: when one runs this very config, as this
user, it does the work in its warm process and this one only prints the result. When none answers
within :data:`CONNECT_TIMEOUT` (none running, a stale socket, another config, another user, busy),
:func:`call` returns None and the command runs here as it always did.

Standard library only (and :mod:`.wire`): this module is all a restore served by the daemon imports
beyond click.
"""

# No ``from __future__ import annotations``: the named tuple's field types are then objects, not
# strings that typing compiles one by one.

import os
import stat
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

try:  # the C module ``socket`` wraps: without the enum classes it builds at import
    import _socket
except ImportError:  # pragma: no cover - an interpreter without it
    import socket as _socket  # type: ignore[no-redef]

from ckptkeeper import __version__
from ckptkeeper.daemon.wire import (
    PROTOCOL,
    LineReader,
    addressable,
    config_identity,
    encode,
    index_of,
    peer_credentials,
    process_umask,
    socket_path,
)

__all__ = ["CONNECT_TIMEOUT", "Served", "absolute", "as_given", "call"]

CONNECT_TIMEOUT = 2.0
"""Seconds to connect and hear the daemon accept or decline; past it the command runs here."""
SILENCE_TIMEOUT = 120.0
"""Seconds without a line from a daemon serving us (it sends one every 10 s) before giving up."""
CANCEL_WAIT = 30.0
"""On Ctrl-C: seconds to wait for the daemon to have removed what it had started."""


class Served(NamedTuple):
    """The daemon's answer: the command's exit code and its result document or error message."""

    exit: int
    doc: dict[str, Any] | None
    message: str | None


def call(
    config_path: str | None,
    op: str,
    args: dict[str, Any],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Served | None:
    """Run ``op`` with ``args`` in the daemon; None when no daemon served it (run it here)."""
    identity = config_identity(config_path)
    if identity is None:
        return None
    index = index_of(identity[1])
    if index is None:
        return None
    path = socket_path(index)
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return None
    request = {
        "v": PROTOCOL,
        "op": op,
        "version": __version__,
        "config": identity[0],
        "umask": process_umask(),
        "progress": progress is not None,
        "args": args,
    }
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        reader = LineReader(sock)
        try:
            _connect(sock, path)
            if peer_credentials(sock)[1] != os.getuid():
                return None
            sock.sendall(encode(request))
            first = reader.read()
        except (OSError, ValueError):
            return None
        if first is None or first.get("event") != "accepted":
            return None
        sock.settimeout(SILENCE_TIMEOUT)
        return _follow(sock, reader, progress)
    finally:
        sock.close()


def _connect(sock: _socket.socket, path: str) -> None:
    address, fd = addressable(path)
    try:
        sock.connect(address)
    finally:
        if fd is not None:
            os.close(fd)


def _follow(
    sock: _socket.socket, reader: LineReader, progress: Callable[[int, int], None] | None
) -> Served | None:
    try:
        while True:
            try:
                msg = reader.read()
            except TimeoutError:
                return Served(1, None, f"the daemon stopped answering for {SILENCE_TIMEOUT:g}s")
            except (OSError, ValueError):
                msg = None
            if msg is None:
                _note("the daemon ended before finishing; running it here")
                return None
            event = msg.get("event")
            if event == "progress" and progress is not None:
                done, total = msg.get("done"), msg.get("total")
                if isinstance(done, int) and isinstance(total, int):
                    progress(done, total)
            elif event == "result":
                if msg.get("retry"):
                    _note(f"{msg.get('message') or 'the daemon gave the command back'}; running it here")
                    return None
                code, doc, message = msg.get("exit"), msg.get("doc"), msg.get("message")
                if not isinstance(code, int) or not (doc is None or isinstance(doc, dict)):
                    return Served(1, None, "the daemon sent an unreadable result")
                return Served(code, doc, message if isinstance(message, str) else None)
    except KeyboardInterrupt:
        _cancel(sock, reader)
        raise


def _cancel(sock: _socket.socket, reader: LineReader) -> None:
    """Tell the daemon to stop (end of our stream) and wait until it has removed its staging."""
    try:
        sock.shutdown(_socket.SHUT_WR)
        sock.settimeout(CANCEL_WAIT)
        while reader.read() is not None:
            pass
    except (OSError, ValueError):
        pass


def _note(text: str) -> None:
    print(f"ckptkeeper: {text}", file=sys.stderr)


def absolute(to: str) -> str | None:
    """``to`` as the daemon must see it: joined to our working directory (not normalised: the
    kernel resolves ``..`` and symlinks for the daemon exactly as it would for us)."""
    if os.path.isabs(to):
        return to
    try:
        return os.path.join(os.getcwd(), to)
    except OSError:
        return None  # no working directory: not expressible, run here


def as_given(text: str, to: str | None) -> str:
    """The daemon restored into ``to`` made absolute: name paths under it as a restore run here
    does, under ``to`` as given (relative stays relative)."""
    if to is None or os.path.isabs(to):
        return text
    from pathlib import Path

    base = str(Path(os.path.join(os.getcwd(), to)))
    given = str(Path(to) / "_")[:-1]  # "out/" for "out", "" for "." (as Path(to) / name reads)
    return text.replace(base + os.sep, given)
