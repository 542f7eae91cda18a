"""Mount points under a tier root, read from the kernel's mount table (docs/design.md, safety invariant 4).

``st_dev`` checks stop a walk at another filesystem, but a bind mount of a directory of the *same*
filesystem (``mount --bind outside/data hot/run/ckpt/nested``) has the same ``st_dev`` as its
parent: only the mount table tells. Walks skip every mount point below a tier root (not listed,
not copied, not hashed), and a delete refuses a path that is, lies under or contains one.

Linux only (``/proc/self/mountinfo``); where it cannot be read the table is empty and only the
``st_dev`` checks remain.
"""

from __future__ import annotations

import os
import re
import select
import threading

__all__ = ["MOUNTINFO", "mount_points", "mounts_crossed", "mounts_under"]

MOUNTINFO = "/proc/self/mountinfo"
"""The table read by default; unit tests point it at a fake one."""

_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def _parse(data: bytes) -> frozenset[str]:
    out: set[str] = set()
    for line in data.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4 and fields[4].startswith(b"/"):
            out.add(os.path.normpath(_unescape(fields[4])))
    return frozenset(out)


class _Cached:
    """The process's own table, re-read only after the kernel says it changed.

    Generating mountinfo costs ~0.2 ms, too much for every checkpoint of a 10k-checkpoint walk;
    an open mountinfo is pollable (``POLLPRI`` after any mount or unmount, cleared by reading it
    again), so a poll with timeout 0 tells exactly when the cached copy went stale.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._poll: select.poll | None = None
        self._table: frozenset[str] | None = None

    def _read(self, fd: int) -> bytes:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)

    def get(self) -> frozenset[str]:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():  # a forked child has its own table
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                try:
                    self._fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    return frozenset()
                self._pid = os.getpid()
                self._poll = select.poll()
                self._poll.register(self._fd, select.POLLPRI | select.POLLERR)
                self._table = None
            assert self._poll is not None
            if self._table is None or self._poll.poll(0):
                try:
                    self._table = _parse(self._read(self._fd))
                except OSError:
                    return frozenset()
            return self._table


_CACHED = _Cached()


def mount_points(table: str | None = None) -> frozenset[str]:
    """Every mount point (field 5 of mountinfo) of this process's mount namespace."""
    path = table or MOUNTINFO
    if path == "/proc/self/mountinfo":
        return _CACHED.get()
    try:
        with open(path, "rb") as f:
            return _parse(f.read())
    except OSError:
        return frozenset()


def mounts_under(root: str | os.PathLike[str], table: str | None = None) -> frozenset[str]:
    """Mount points strictly below ``root``, as '/'-separated paths relative to it."""
    real = os.path.realpath(root)
    prefix = real.rstrip("/") + "/"
    return frozenset(m[len(prefix) :] for m in mount_points(table) if m.startswith(prefix))


def mounts_crossed(root: str | os.PathLike[str], rel: str, table: str | None = None) -> list[str]:
    """Mount points (relative to ``root``) that acting on ``root/rel`` would cross: ``rel`` itself,
    a directory on the way to it, or anything inside it. Empty when none."""
    parts = rel.split("/")
    ancestors = {"/".join(parts[: i + 1]) for i in range(len(parts))}
    return sorted(
        m for m in mounts_under(root, table) if m in ancestors or m.startswith(rel.rstrip("/") + "/")
    )
