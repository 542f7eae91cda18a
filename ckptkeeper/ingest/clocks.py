"""Which clock judges a file's age: the clock of the filesystem that stamped it.

Every decision that compares a file time with "now" — a run's staleness (its newest write, its
heartbeat), settling (``settle_seconds``), a partial checkpoint's or a temp file's age
(``partial_after``), the executor's last "still being written" check — takes "now" from the
filesystem of the tier the file lies in (:func:`~ckptkeeper.storage.fs_clock.filesystem_now`),
never from this node's clock: on NFS, Lustre or Weka the server stamps mtimes, and a node whose
clock ran 3 days ahead reaped live runs (docs/many-nodes-clocks.md).

Local tiers only: an S3 tier's objects are judged by the store's own clock where it matters
(``store_now``), and the other ages by the pass's clock as before.

A dry run writes nothing, so it cannot touch a probe: it estimates each filesystem's clock from
this node's clock and the offset the last real pass recorded (``.ckptkeeper/clock/<node>.json``),
never earlier than that record; without a record (no real pass yet), or when the probe fails, it
judges by this node's clock and says so (:attr:`FileClocks.notes`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.core.preflight import SKEW_WARN_SECONDS
from ckptkeeper.storage.base import StorageError
from ckptkeeper.storage.fs_clock import Reading, filesystem_now, last_reading
from ckptkeeper.util.fmt import human_age
from ckptkeeper.util.logs import get_logger

__all__ = ["FileClocks"]

log = get_logger("ckptkeeper.ingest.clocks")

_WARNED: set[tuple[Path, bool]] = set()
"""(root, dry run) whose skew or fallback this process has logged already (a daemon logs once)."""


class FileClocks:
    """This node's reading of each local tier's filesystem clock, by tier name.

    ``write``: probe (a real pass, the daemon, a scan); otherwise read only (a dry run,
    ``why``). Lazy: a tier is probed when first asked, then extrapolated (no I/O)."""

    def __init__(self, settings: Settings, *, write: bool) -> None:
        self.write = write
        self.node = settings.node
        self.hot_name = settings.hot.name
        self.roots: dict[str, Path] = {t.name: t.local_path for t in settings.tiers if t.is_local}
        self.notes: list[str] = []
        """What a pass should say: a clock far off the filesystem's, a reading that failed."""
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def now(self, tier: str) -> float:
        """The time now by the clock of ``tier``'s filesystem (this node's clock for a tier that
        is not a local directory, or whose clock cannot be read: see :attr:`notes`)."""
        root = self.roots.get(tier)
        if root is None:
            return time.time()
        if self.write:
            try:
                now, reading = filesystem_now(root, record=self.node)
            except StorageError as exc:
                self._say(tier, root, f"{tier}: {exc}; file ages there are judged by this node's clock")
                return time.time()
            self._check_skew(tier, root, reading)
            return now
        got = last_reading(root, self.node)
        node_now = time.time()
        if got is None:
            self._say(
                tier,
                root,
                f"{tier}: no reading of the filesystem's clock yet (a dry run writes none); "
                "file ages there are judged by this node's clock",
                level="info",
            )
            return node_now
        self._check_skew(tier, root, got)
        # The offset the last real pass measured, applied to this node's clock now; the
        # filesystem's time never runs back behind what it stamped then.
        return max(got.filesystem, node_now - got.skew)

    def hot(self) -> float:
        """:meth:`now` of the hot tier (the catalog's clock)."""
        return self.now(self.hot_name)

    def now_all(self) -> Mapping[str, float]:
        """:meth:`now` of every local tier, taken together (a pass's "observed" moment)."""
        return {name: self.now(name) for name in self.roots}

    def _check_skew(self, tier: str, root: Path, reading: Reading) -> None:
        skew = reading.skew
        if abs(skew) <= SKEW_WARN_SECONDS:
            return
        way = "ahead of" if skew > 0 else "behind"
        self._say(
            tier,
            root,
            f"{tier}: this node's clock is {human_age(round(abs(skew)))} {way} the filesystem's; file ages "
            "there are judged by the filesystem's clock (fix NTP: chrony/timesyncd)",
            node_clock=reading.node,
            filesystem_clock=reading.filesystem,
        )

    def _say(self, tier: str, root: Path, note: str, *, level: str = "warning", **fields: float) -> None:
        with self._lock:
            if tier in self._said:
                return
            self._said.add(tier)
            self.notes.append(note)
            first = (root, self.write) not in _WARNED
            _WARNED.add((root, self.write))
        if first:
            getattr(log, level)(note, tier=tier, root=str(root), **fields)
