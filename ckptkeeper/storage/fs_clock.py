"""A filesystem's clock (docs/design.md, "Cluster reality": one clock for cross-node time).

On a local disk a file's mtime is this node's clock; on NFS, Lustre or Weka the *server* stamps
it. A node that judges a file's age by its own clock compares two clocks: one running 3 days
ahead took fresh runs for dead ones and reaped them. Here is the clock that stamps the files: the
mtime the filesystem gives a probe file touched now (``os.utime`` with no times: on NFS the server
sets it), sampled once and then extrapolated with this process's monotonic clock (re-sampled
after :data:`RESAMPLE_AFTER`), so a reading costs no I/O.

A sample with a ``record`` name leaves ``<root>/.ckptkeeper/clock/<record>.json`` behind: its
mtime is the filesystem's time of the sample and its body this node's time then. A dry run, which
writes nothing, reads that record (:func:`last_reading`) to estimate the filesystem's clock from
this node's own (docs/many-nodes-clocks.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import StorageError, _split_rel

__all__ = [
    "CLOCK_DIR",
    "RESAMPLE_AFTER",
    "Reading",
    "filesystem_now",
    "last_reading",
    "plausible",
]

CLOCK_DIR = ".ckptkeeper/clock"
"""Under a tier's root: hidden, never a run, never a copy."""

RESAMPLE_AFTER = 3600.0
"""Seconds (monotonic) a sample is extrapolated before the filesystem is asked again."""

EARLIEST = 946684800.0
"""2000-01-01: a filesystem whose "now" is earlier has no usable clock (no times, a reset RTC)."""
LATEST = 32503680000.0
"""3000-01-01 (the hook schema's ``MAX_TIME``): later is no clock either."""

_MAX_RECORD = 4096


@dataclass(frozen=True)
class Reading:
    """One sample: the filesystem's time and this node's at the same moment."""

    filesystem: float
    node: float

    @property
    def skew(self) -> float:
        """This node's clock minus the filesystem's (positive: the node runs ahead)."""
        return self.node - self.filesystem


_SAMPLES: dict[tuple[Path, str | None], tuple[Reading, float]] = {}
"""(root, record) -> (its reading, this process's monotonic clock then)."""
_LOCK = threading.Lock()


def plausible(t: float) -> bool:
    """A time a filesystem clock can say: finite, between 2000 and 3000."""
    return math.isfinite(t) and EARLIEST <= t <= LATEST


def _record_name(record: str) -> str:
    """``<record>.json``: one plain path component (a node name), never a way out of the root."""
    if len(_split_rel(record, "clock record name")) != 1 or record.startswith("."):
        raise StorageError(f"{record!r} cannot name a clock record")
    return f"{record}.json"


def _probe(root: Path, record: str | None) -> Reading:
    """Touch a probe under ``root/.ckptkeeper/clock/`` and read its mtime back. Never creates
    ``root`` itself (a tier whose root is gone is not brought back by a clock reading)."""
    final = None if record is None else _record_name(record)
    base = root / CLOCK_DIR
    tmp = base / f"{STAGING_MARK}{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    try:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        base.parent.mkdir(exist_ok=True)
        base.mkdir(exist_ok=True)
        node = time.time()
        with open(tmp, "wb") as f:
            f.write(json.dumps({"node_time": node, "host": socket.gethostname()}).encode())
        os.utime(tmp)  # times=None: set by the filesystem, to its "now" (the server's on NFS)
        stamped = os.stat(tmp).st_mtime
        if final is not None:
            os.replace(tmp, base / final)  # a rename keeps the mtime: the dry run's record
    except OSError as exc:
        raise StorageError(f"reading the filesystem's clock at {base}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if not plausible(stamped):
        raise StorageError(f"the filesystem at {root} gives files the time {stamped!r}: no usable clock")
    return Reading(stamped, node)


def filesystem_now(root: Path, *, record: str | None = None) -> tuple[float, Reading]:
    """The filesystem's time now at ``root`` and the sample it was extrapolated from. Raises
    :class:`StorageError` when the filesystem cannot be probed or gives an implausible time.
    ``record``: also leave the sample as ``<root>/.ckptkeeper/clock/<record>.json``."""
    key = (Path(root), record)
    with _LOCK:
        got = _SAMPLES.get(key)
    mono = time.monotonic()
    if got is None or mono - got[1] > RESAMPLE_AFTER:
        got = (_probe(Path(root), record), time.monotonic())
        with _LOCK:
            _SAMPLES[key] = got
        mono = got[1]
    reading, at = got
    return reading.filesystem + (mono - at), reading


def last_reading(root: Path, record: str) -> Reading | None:
    """The sample a real pass left as ``<root>/.ckptkeeper/clock/<record>.json`` (read only), or
    None when there is none or it is not one (unreadable, malformed, implausible times)."""
    try:
        path = root / CLOCK_DIR / _record_name(record)
        with open(path, "rb") as f:
            body = f.read(_MAX_RECORD + 1)
            stamped = os.fstat(f.fileno()).st_mtime
        node = float(json.loads(body)["node_time"]) if len(body) <= _MAX_RECORD else math.nan
    except (OSError, ValueError, KeyError, TypeError, StorageError):
        return None
    if not (plausible(stamped) and plausible(node)):
        return None
    return Reading(stamped, node)
