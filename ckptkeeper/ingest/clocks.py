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
this node's clock and the offset the last real reading found, recorded beside the index
(``<index>.clocks.json``), never earlier than the filesystem's time of that reading; without a
record (no real pass yet), or when the probe fails, it judges by this node's clock and says so
(:attr:`FileClocks.notes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.core.preflight import SKEW_WARN_SECONDS
from ckptkeeper.storage.base import StorageError
from ckptkeeper.storage.fs_clock import Reading, filesystem_now, plausible
from ckptkeeper.util.fmt import human_age
from ckptkeeper.util.logs import get_logger

__all__ = ["RECORD_SUFFIX", "FileClocks", "record_path"]

RECORD_SUFFIX = ".clocks.json"
"""Beside the index: each local tier's last clock reading by a real pass (a dry run's estimate)."""
_MAX_RECORD = 1 << 16

log = get_logger("ckptkeeper.ingest.clocks")

_WARNED: set[tuple[Path, bool]] = set()
"""(root, dry run) whose skew or fallback this process has logged already (a daemon logs once)."""
_KEPT: dict[tuple[Path, str], Reading] = {}
"""(record file, tier) -> the reading last written there by this process."""
_KEPT_LOCK = threading.Lock()


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
        self.record = record_path(settings)
        self._seen: dict[str, Reading] = {}
        self._kept: dict[str, Reading | None] = {}
        """A dry run's: the reading the last real pass kept, per tier (read once)."""
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
                now, reading = filesystem_now(root)
            except StorageError as exc:
                self._say(tier, root, f"{tier}: {exc}; file ages there are judged by this node's clock")
                return time.time()
            if self._seen.get(tier) is not reading:  # once per pass: its note
                self._seen[tier] = reading
                self._check_skew(tier, root, reading)
                with _KEPT_LOCK:
                    fresh = _KEPT.get((self.record, tier)) is not reading
                    _KEPT[(self.record, tier)] = reading
                if fresh:  # once per sample: the record
                    _record(self.record, tier, root, reading)
            return now
        if tier not in self._kept:
            self._kept[tier] = _last_reading(self.record, tier, root)
        got = self._kept[tier]
        node_now = time.time()
        if got is None:
            self._say(
                tier,
                root,
                f"{tier}: no reading of the filesystem's clock yet (a dry run writes none); "
                "file ages there are judged by this node's clock",
                level="debug",  # the plan's note says it; a log line would be noise
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


def record_path(settings: Settings) -> Path:
    """``<index>.clocks.json``: this node's own state, beside its index (never in a tier)."""
    index = Path(settings.index)
    return index.with_name(index.name + RECORD_SUFFIX)


def _read(path: Path) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            body = f.read(_MAX_RECORD + 1)
        doc = json.loads(body) if len(body) <= _MAX_RECORD else None
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _record(path: Path, tier: str, root: Path, reading: Reading) -> None:
    """Keep ``reading`` for a later dry run (best effort: without it, a dry run says so)."""
    doc = _read(path)
    doc[tier] = {"root": str(root), "filesystem": reading.filesystem, "node": reading.node}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(doc, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.debug("cannot keep the filesystem clock reading", path=str(path), error=str(exc))
        with contextlib.suppress(OSError):
            tmp.unlink()


def _last_reading(path: Path, tier: str, root: Path) -> Reading | None:
    """The reading a real pass kept for ``tier`` at ``root``; None when there is none, it was of
    another root, or it is not one (malformed, implausible times)."""
    got = _read(path).get(tier)
    if not isinstance(got, dict) or got.get("root") != str(root):
        return None
    try:
        reading = Reading(float(got["filesystem"]), float(got["node"]))
    except (KeyError, TypeError, ValueError):
        return None
    if not (plausible(reading.filesystem) and plausible(reading.node)):
        return None
    return reading
