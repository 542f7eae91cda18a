"""A filesystem's clock (docs/design.md, "Cluster reality": one clock for cross-node time).

On a local disk a file's mtime is this node's clock; on NFS, Lustre or Weka the *server* stamps
it. A node that judges a file's age by its own clock compares two clocks: one running 3 days
ahead took fresh runs for dead ones and reaped them. Here is the clock that stamps the files: the
mtime the filesystem gives a probe file touched now (``os.utime`` with no times: on NFS the server
sets it), sampled once and then extrapolated with this process's monotonic clock (re-sampled
after :data:`RESAMPLE_AFTER`), so a reading costs no I/O.

The probe is a hidden file right under the root (``.ckptkeeper-tmp-clock-<host>-<pid>``), removed
at once; one a crash leaves behind carries the staging mark, so the reaper clears it.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import StorageError

__all__ = ["RESAMPLE_AFTER", "Reading", "filesystem_now", "plausible"]

RESAMPLE_AFTER = 3600.0
"""Seconds (monotonic) a sample is extrapolated before the filesystem is asked again."""

EARLIEST = 946684800.0
"""2000-01-01: a filesystem whose "now" is earlier has no usable clock (no times, a reset RTC)."""
LATEST = 32503680000.0
"""3000-01-01 (the hook schema's ``MAX_TIME``): later is no clock either."""


@dataclass(frozen=True)
class Reading:
    """One sample: the filesystem's time and this node's at the same moment."""

    filesystem: float
    node: float

    @property
    def skew(self) -> float:
        """This node's clock minus the filesystem's (positive: the node runs ahead)."""
        return self.node - self.filesystem


_SAMPLES: dict[Path, tuple[Reading, float]] = {}
"""Root -> (its reading, this process's monotonic clock then)."""
_LOCK = threading.Lock()


def plausible(t: float) -> bool:
    """A time a filesystem clock can say: finite, between 2000 and 3000."""
    return math.isfinite(t) and EARLIEST <= t <= LATEST


def _probe(root: Path) -> Reading:
    """Touch a probe right under ``root`` and read its mtime back. Never creates ``root`` (a tier
    whose root is gone is not brought back by a clock reading), nor any directory."""
    probe = root / f"{STAGING_MARK}clock-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    try:
        node = time.time()
        with open(probe, "wb"):
            pass
        try:
            os.utime(probe)  # times=None: set by the filesystem, to its "now" (the server's on NFS)
            stamped = os.stat(probe).st_mtime
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as exc:
        raise StorageError(f"reading the filesystem's clock at {root}: {exc}") from exc
    if not plausible(stamped):
        raise StorageError(f"the filesystem at {root} gives files the time {stamped!r}: no usable clock")
    return Reading(stamped, node)


def filesystem_now(root: Path) -> tuple[float, Reading]:
    """The filesystem's time now at ``root``, and the sample it was extrapolated from (fresh:
    ``reading.filesystem`` is the time now). Raises :class:`StorageError` when the filesystem
    cannot be probed or gives an implausible time."""
    key = Path(root)
    with _LOCK:
        got = _SAMPLES.get(key)
    mono = time.monotonic()
    if got is None or mono - got[1] > RESAMPLE_AFTER:
        got = (_probe(key), time.monotonic())
        with _LOCK:
            _SAMPLES[key] = got
        mono = got[1]
    reading, at = got
    return reading.filesystem + (mono - at), reading
