"""Advisory ``flock`` locks beside the index: one daemon per index, one executor at a time.

Two locks, because they protect different things (docs/design.md, safety invariant 8):

- ``<index>.daemon.lock`` is held for the daemon's whole life. A second daemon on the same index
  would double every watcher reconcile and every scheduled prune, so it refuses to start.
- ``<index>.executor.lock`` is held only while a plan is being carried out. A manual
  ``ckptkeeper prune`` and the daemon's retention/reap jobs then serialise instead of racing each
  other over the same checkpoints; whoever comes second waits briefly, then gives up (exit 11).

``flock`` locks belong to the open file description, so they vanish when the holder dies
(``kill -9`` included) — no stale-lock cleanup, and the lock files are never deleted (deleting a
lock file that someone else has open is the classic way to end up with two holders). The holder
writes its pid into the file so the refusal message can name it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

__all__ = [
    "DaemonLock",
    "ExecutorLock",
    "FileLock",
    "LockHeld",
    "daemon_lock_path",
    "executor_lock_path",
]

_RETRY_INTERVAL = 0.05


class LockHeld(Exception):
    """Another process holds the lock; ``pid`` is its pid when it could be read."""

    def __init__(self, path: Path, pid: int | None, what: str) -> None:
        self.path = path
        self.pid = pid
        holder = f" (pid {pid})" if pid else ""
        super().__init__(f"another ckptkeeper {what} holds {path}{holder}")


def daemon_lock_path(index_path: str | os.PathLike[str]) -> Path:
    index = Path(index_path)
    return index.with_name(index.name + ".daemon.lock")


def executor_lock_path(index_path: str | os.PathLike[str]) -> Path:
    index = Path(index_path)
    return index.with_name(index.name + ".executor.lock")


class FileLock:
    """An exclusive, non-blocking ``flock`` with a bounded wait.

    Not reentrant and not meant to be shared between threads: each holder opens its own file
    description, which is exactly what makes two holders in one process exclude each other too.
    """

    what = "process"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = 0.0) -> None:
        """Take the lock, retrying for up to ``timeout`` seconds; raise :class:`LockHeld` after."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            # No O_TRUNC: the current holder's pid must survive our failed attempt.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._lock_fd(fd, deadline)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            # The file was deleted or replaced (`rm index.db*`) after we opened it: a lock on it
            # excludes nobody who opens the path now. Lock the file the path names.
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _lock_fd(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LockHeld(self.path, _read_pid(fd), self.what) from None
                time.sleep(min(_RETRY_INTERVAL, remaining))

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # Clear the pid while still holding the lock, so nobody reads a dead holder's pid.
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def holder_pid(self) -> int | None:
        """Pid written by the current holder (None if unheld or unreadable); for messages only."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return _read_pid(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        if self._fd is None:
            self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, held={self.held})"


class DaemonLock(FileLock):
    """``<index>.daemon.lock``: held for the daemon's lifetime (single instance per index)."""

    what = "daemon"

    def __init__(self, index_path: str | os.PathLike[str]) -> None:
        super().__init__(daemon_lock_path(index_path))


class ExecutorLock(FileLock):
    """``<index>.executor.lock``: held around each prune / executor run (one executor at a time)."""

    what = "executor"

    def __init__(self, index_path: str | os.PathLike[str]) -> None:
        super().__init__(executor_lock_path(index_path))


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
