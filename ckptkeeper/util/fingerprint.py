"""A file's fingerprint: what changes whenever its bytes may have (without reading them).

A move out of the hot tier hashes each file while it copies it (one read), instead of hashing
it when it is cataloged and again when it is copied. What vouches that the bytes copied are the
bytes the catalog saw is the fingerprint: size, mtime, ctime, inode and device, taken by the
catalog and compared before and after the copy. Every write, truncate, ``utime`` or rename onto
the name changes the ctime, which no user program can set back.

The one blind spot is a write within the same tick of the kernel's coarse clock as the last
change the catalog saw (the "racy clean" case of git's index): a fingerprint is only trusted
when its ctime lies clearly before the moment it was taken (:func:`settled`). Anything else is
hashed in place, as before.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

RACY_NS = 50_000_000
"""How far a ctime must lie before the moment its fingerprint is taken (50 ms: five ticks of the
coarsest kernel clock, ``HZ=100``)."""

RACY_COARSE_NS = 2_000_000_000
"""The same for a filesystem that stores whole seconds (FAT, some network filesystems)."""


class Fingerprint(NamedTuple):
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int


def of(st: os.stat_result) -> Fingerprint:
    return Fingerprint(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def take(path: str | os.PathLike[str]) -> Fingerprint:
    """The fingerprint of ``path`` (not following a final symlink); raises OSError."""
    return of(os.lstat(path))


def settled(fp: Fingerprint, taken_ns: int | None = None) -> bool:
    """Does any later change of the file change ``fp``? True when its ctime lies clearly before
    ``taken_ns`` (when it was taken; default now): a later write then gets a later ctime."""
    now = time.time_ns() if taken_ns is None else taken_ns
    margin = RACY_COARSE_NS if fp.ctime_ns % 1_000_000_000 == 0 else RACY_NS
    return fp.ctime_ns < now - margin
