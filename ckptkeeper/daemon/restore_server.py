"""The daemon serves ``restore`` and ``prefetch`` of its own node's CLI on a local Unix socket.

A restore run by the CLI alone pays ~0.5 CPU-s of interpreter, pydantic, s3fs and catalog start-up
before its first byte; the daemon has paid it once. The CLI's thin client (:mod:`.client`) sends the
command's arguments here; a worker thread runs the same action the CLI would (the same index
opening, the same locks and fallbacks, the same checks of every byte) with the daemon's settings,
streams progress back and ends with the result the CLI prints.

Who may ask: only a process of the daemon's own user and group (``SO_PEERCRED``; the socket is
0600) with the daemon's umask, the daemon's ckptkeeper version and the very config the daemon runs
(its file's bytes and every ``CKPTKEEPER_*`` variable, :func:`.wire.config_identity`), restoring
into a directory that is the same for both (another mount namespace: :func:`_same_place`). Anything else is declined and the client runs the command itself.
A request is untrusted input (:func:`.wire.parse_request`); a bad one gets an error and the
connection closes; no request's failure reaches the daemon. A client that goes away (killed,
Ctrl-C) cancels its request: the fetch stops at its next chunk and removes its staging directory,
so nothing partial stays in the destination.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkeeper import __version__
from ckptkeeper.actions.errors import (
    EXIT_ACTION_FAILED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_USAGE,
    IndexUnusable,
    Locked,
)
from ckptkeeper.daemon.wire import (
    BadRequest,
    LineReader,
    Request,
    addressable,
    encode,
    parse_request,
    peer_credentials,
    process_umask,
)
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.config import Settings
    from ckptkeeper.index import Index

__all__ = ["RestoreServer"]

log = get_logger("ckptkeeper.daemon.restore_server")

MAX_ACTIVE = 4
"""Requests served at once; more are declined (their clients run the command themselves)."""
MAX_CONNECTIONS = 16
"""Connections open at once, handshakes included; more are closed unanswered."""
REQUEST_TIMEOUT = 5.0
"""Seconds a client has to send its request after connecting."""
PROGRESS_SECONDS = 0.2
HEARTBEAT_SECONDS = 10.0
"""A line at least this often while a request runs, so a client can tell a hung daemon."""


class Cancelled(BaseException):
    """The client went away, or the daemon is stopping: raised by the progress callback inside
    the fetch, which removes its staging directory and re-raises it (a BaseException: no tier
    fallback or older checkpoint is tried for it)."""


@dataclass(eq=False)
class _Job:
    """One accepted request, shared by its connection's thread and its worker thread."""

    request: Request
    cancel: threading.Event = field(default_factory=threading.Event)
    done: int = 0
    total: int = 0
    outcome: tuple[int, dict[str, Any] | None, str | None] | None = None
    cancelled: bool = False

    def progress(self, done: int, total: int) -> None:
        if self.cancel.is_set():
            raise Cancelled
        self.done, self.total = done, total


class RestoreServer:
    """Listens on ``path`` until :meth:`stop`; ``served(identity)`` gives the settings to serve a
    client whose config has ``identity``, None when the daemon runs another config."""

    def __init__(self, path: str, served: Callable[[str], Settings | None]) -> None:
        self.path = path
        self._served = served
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._jobs: set[_Job] = set()
        self._active = threading.BoundedSemaphore(MAX_ACTIVE)
        self._uid, self._gid = os.getuid(), os.getgid()
        self._umask = process_umask()
        self._mnt_ns = _mount_ns("self")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Bind (a stale socket of a dead daemon is replaced: the daemon lock says none is alive)
        and accept in a thread. OSError when the socket cannot be made."""
        self._listener = _bind_private(self.path)
        thread = threading.Thread(target=self._accept_loop, name="ckptkeeper-restore-socket", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        log.info("serving restore and prefetch", socket=self.path)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, cancel running requests (their clients run them again themselves) and
        wait for their workers to have cleaned up."""
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        with self._lock:
            for job in self._jobs:
                job.cancel.set()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("restore requests still running at stop", threads=alive)

    # -- connections -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        count = 0
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.1)  # EMFILE and the like: do not spin
                continue
            with self._lock:
                self._threads = {t for t in self._threads if t.is_alive()}
                if len(self._threads) > MAX_CONNECTIONS:
                    conn.close()  # the client sees the end of the stream and runs the command itself
                    continue
                count += 1
                thread = threading.Thread(
                    target=self._handle, args=(conn,), name=f"ckptkeeper-restore-{count}", daemon=True
                )
                self._threads.add(thread)
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve(conn)
        except OSError as exc:  # the client went away before its answer: nothing was started
            log.info("restore socket: client gone", error=str(exc))
        except Exception:  # one connection's failure never reaches the daemon
            log.exception("restore socket: connection failed")

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT)
        pid, uid, gid = peer_credentials(conn)
        if (uid, gid) != (self._uid, self._gid):
            log.warning("restore socket: refused another user", pid=pid, uid=uid, gid=gid)
            _send(conn, {"event": "error", "message": "refused: only the daemon's user and group"})
            return
        try:
            doc = LineReader(conn).read()
            if doc is None:
                return
            request = parse_request(doc)
        except (BadRequest, ValueError) as exc:
            log.warning("restore socket: bad request", pid=pid, error=str(exc)[:200])
            _send(conn, {"event": "error", "message": f"bad request: {exc}"[:1000]})
            return
        except TimeoutError:
            return
        settings, why = self._admit(request, pid)
        if settings is None:
            log.info("restore socket: declined", pid=pid, op=request.op, reason=why)
            _send(conn, {"event": "declined", "reason": why})
            return
        if not self._active.acquire(blocking=False):
            _send(conn, {"event": "declined", "reason": "busy"})
            return
        try:
            self._run(conn, request, settings, pid)
        finally:
            self._active.release()

    def _admit(self, request: Request, pid: int) -> tuple[Settings | None, str]:
        """The settings to serve ``request`` with, or None and why the client runs it itself."""
        if self._stopping.is_set():
            return None, "the daemon is stopping"
        if request.version != __version__:
            return None, f"the daemon runs ckptkeeper {__version__}"
        if request.umask is None or request.umask != self._umask:
            return None, "another umask than the daemon's"
        settings = self._served(request.config)
        if settings is None:
            return None, "the daemon runs another config"
        where = request.to if request.to is not None else str(settings.hot.local_path)
        if _mount_ns(str(pid)) != self._mnt_ns and not _same_place(pid, where):
            return None, "the destination is another directory in the daemon's mount namespace"
        return settings, ""

    def _run(self, conn: socket.socket, request: Request, settings: Settings, pid: int) -> None:
        job = _Job(request)
        with self._lock:
            self._jobs.add(job)
        if self._stopping.is_set():
            job.cancel.set()
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        started = time.monotonic()

        def work() -> None:
            try:
                job.outcome = _execute(settings, job)
            except Cancelled:
                job.cancelled = True
            except Exception as exc:  # reported to the client as the command's failure
                log.exception("restore socket: request failed", op=request.op, run=request.run)
                job.outcome = (EXIT_ACTION_FAILED, None, f"{type(exc).__name__}: {exc}")
            finally:
                with contextlib.suppress(OSError):
                    os.write(wake_w, b"x")

        worker = threading.Thread(target=work, name=f"{threading.current_thread().name}-worker", daemon=True)
        try:
            _send(conn, {"event": "accepted"})
            log.info("restore socket: serving", pid=pid, op=request.op, run=request.run, step=request.step)
            worker.start()
            self._follow(conn, job, wake_r)
        except OSError:
            job.cancel.set()  # the client is gone
        finally:
            if worker.is_alive():
                worker.join()
            os.close(wake_r)
            os.close(wake_w)
            with self._lock:
                self._jobs.discard(job)
        code = None if job.outcome is None else job.outcome[0]
        log.info(
            "restore socket: served",
            op=request.op,
            run=request.run,
            step=request.step,
            to=request.to,
            exit=code,
            cancelled=job.cancelled,
            seconds=round(time.monotonic() - started, 3),
        )

    def _follow(self, conn: socket.socket, job: _Job, wake: int) -> None:
        """Forward progress until the worker ends, then send its result; a client that goes away
        (or sends anything) cancels the job."""
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        poller.register(wake, select.POLLIN)
        conn.settimeout(HEARTBEAT_SECONDS)
        sent = (-1, -1)
        last = time.monotonic()
        gone = False
        interval = PROGRESS_SECONDS if job.request.progress else HEARTBEAT_SECONDS
        while True:
            events = dict(poller.poll(interval * 1000))
            if wake in events:
                break
            if gone:
                continue
            try:
                if conn.fileno() in events:
                    raise ConnectionResetError("the client closed its end")
                now = (job.done, job.total)
                if job.request.progress and now != sent and job.total:
                    _send(conn, {"event": "progress", "done": now[0], "total": now[1]})
                    sent, last = now, time.monotonic()
                elif time.monotonic() - last >= HEARTBEAT_SECONDS:
                    _send(conn, {"event": "tick"})
                    last = time.monotonic()
            except OSError:  # seen by poll, or by a send that lost the race with the client's close
                log.info(
                    "restore socket: client went away; cancelling", op=job.request.op, run=job.request.run
                )
                gone = True
                job.cancel.set()
                poller.unregister(conn.fileno())
        if gone:
            return
        if job.cancelled or job.outcome is None:
            # Cancelled by a stop of the daemon: the staging is gone, the client runs it itself.
            _send(conn, {"event": "result", "retry": True, "message": "the daemon is stopping"})
            return
        code, doc, message = job.outcome
        if job.request.progress and job.total and (job.done, job.total) != sent:
            _send(conn, {"event": "progress", "done": job.done, "total": job.total})
        _send(conn, {"event": "result", "exit": code, "doc": doc, "message": message})


def _send(conn: socket.socket, doc: dict[str, Any]) -> None:
    conn.sendall(encode(doc))


def _mount_ns(pid: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _same_place(pid: int, path: str) -> bool:
    """``path`` (or its nearest existing ancestor) is the same directory for the client ``pid``
    (seen through ``/proc/<pid>/root``) and for the daemon, and the daemon may write there.

    A daemon in a namespace of its own (systemd's ``ProtectSystem``, ``PrivateTmp``) sees its
    tier roots as everyone does, but not ``/tmp`` or a read-only ``/home``: a restore there would
    land elsewhere or fail, so the client runs it itself."""
    probe = os.path.normpath(path)
    while True:
        try:
            theirs = os.stat(f"/proc/{pid}/root{probe}")
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return False
            probe = parent
            continue
        except OSError:
            return False  # their view is not ours to see (hidepid, another user): no
        try:
            ours = os.stat(probe)
        except OSError:
            return False
        same = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
        return same and os.access(probe, os.W_OK)


def _bind_private(path: str) -> socket.socket:
    """A listening socket at ``path``, mode 0600 from the start: bound in a fresh 0700 directory
    beside it, chmod-ed, then renamed into place (no umask games in a threaded process)."""
    parent = os.path.dirname(path) or "."
    scratch = tempfile.mkdtemp(prefix=".ckptkeeper-sock-", dir=parent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        temp = os.path.join(scratch, "s")
        address, fd = addressable(temp)
        try:
            sock.bind(address)
        finally:
            if fd is not None:
                os.close(fd)
        os.chmod(temp, 0o600)
        os.replace(temp, path)
        sock.listen(MAX_CONNECTIONS)
    except BaseException:
        sock.close()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return sock


# -- the actions, as the CLI runs them -------------------------------------------------------


def _open_index(settings: Settings, *, rebuild: bool) -> Index | tuple[int, str]:
    """The index as ``cli.context.Context.index`` opens it, or (exit code, message) as it fails."""
    from ckptkeeper.actions.index import open_index

    try:
        return open_index(settings, check=rebuild, rebuild=rebuild)
    except IndexUnusable as exc:
        return EXIT_ACTION_FAILED, str(exc)
    except Locked as exc:
        return EXIT_LOCKED, f"{exc}; try again later"
    except Exception as exc:
        return EXIT_ACTION_FAILED, f"cannot open index {settings.index}: {exc}"


def _execute(settings: Settings, job: _Job) -> tuple[int, dict[str, Any] | None, str | None]:
    """Run one request: (exit code, the result document, the error message)."""
    request = job.request
    job.progress(0, 0)  # a client gone before we began: nothing is started
    opened = _open_index(settings, rebuild=request.op == "prefetch")
    if isinstance(opened, tuple):
        return opened[0], None, opened[1]
    try:
        if request.op == "restore":
            return _restore(settings, opened, job)
        return _prefetch(settings, opened, job)
    finally:
        opened.close()


def _restore(settings: Settings, index: Index, job: _Job) -> tuple[int, dict[str, Any] | None, str | None]:
    from ckptkeeper.actions.restore import restore_to

    r = job.request
    assert r.to is not None
    to = Path(r.to)
    if to.exists() and not to.is_dir():  # click.Path(file_okay=False), checked again here
        return EXIT_USAGE, None, f"--to {r.to}: not a directory"
    try:
        restored = restore_to(
            settings,
            index,
            r.run,
            r.step,
            to,
            progress=job.progress,
            metric=r.metric,
            mode=r.mode,
            node=r.node,
            part=r.part,
        )
    except LookupError as exc:
        return EXIT_ACTION_FAILED, None, str(exc)
    return EXIT_OK, restored.to_json(), None


def _prefetch(settings: Settings, index: Index, job: _Job) -> tuple[int, dict[str, Any] | None, str | None]:
    from ckptkeeper.actions.prefetch import prefetch

    r = job.request
    try:
        got = prefetch(settings, index, r.run, step=r.step, part=r.part, progress=job.progress)
    except LookupError as exc:
        return EXIT_ACTION_FAILED, None, str(exc)
    return EXIT_OK, got.to_json(), None
