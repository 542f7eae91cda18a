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
(:attr:`FileClocks.notes`). ``status`` reads the same record (:func:`kept_readings`) to warn of a
clock far off, with the pass's threshold and words (:func:`skew_note`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.core.preflight import SKEW_WARN_SECONDS
from ckptkeeper.storage.base import StorageError
from ckptkeeper.storage.fs_clock import Reading, filesystem_now, plausible
from ckptkeeper.util.fmt import human_age
from ckptkeeper.util.logs import get_logger

__all__ = ["RECORD_SUFFIX", "FileClocks", "KeptReadings", "kept_readings", "record_path", "skew_note"]

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
        note = skew_note(tier, reading.skew)
        if note is not None:
            self._say(tier, root, note, node_clock=reading.node, filesystem_clock=reading.filesystem)

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
        return _load(path) or {}
    except ValueError:
        return {}


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
        return _reading_of(got)
    except ValueError:
        return None


def skew_note(tier: str, skew: float, *, read_ago: float | None = None) -> str | None:
    """What to say of this node's clock running ``skew`` seconds off ``tier``'s filesystem's
    (positive: ahead); None within :data:`SKEW_WARN_SECONDS`, the one threshold of the pass and
    ``status``. ``read_ago``: the reading is the one a pass kept, taken that long ago."""
    if abs(skew) <= SKEW_WARN_SECONDS:
        return None
    off = f"{human_age(round(abs(skew)))} {'ahead of' if skew > 0 else 'behind'} the filesystem's"
    if read_ago is not None:
        off = f"was {off} when a prune pass last read it, {human_age(round(read_ago))} ago"
    else:
        off = f"is {off}"
    return (
        f"{tier}: this node's clock {off}; file ages there are judged by the filesystem's clock "
        "(fix NTP: chrony/timesyncd)"
    )


@dataclass(frozen=True, slots=True)
class KeptReadings:
    """``<index>.clocks.json`` as ``status`` reads it: never written, no probe touched."""

    path: Path
    readings: Mapping[str, Reading]
    """Local tier -> the last real pass's reading of its filesystem's clock (at its root now)."""
    error: str | None = None
    """Why the record, or a tier's reading in it, cannot be used (one line)."""


def kept_readings(settings: Settings) -> KeptReadings | None:
    """The readings the last real passes kept, per local tier; None when there is no record (no
    real pass yet). Never raises on what the file holds: an unreadable one is :attr:`KeptReadings.error`."""
    path = record_path(settings)
    try:
        doc = _load(path)
    except ValueError as exc:
        return KeptReadings(path, {}, f"cannot read {path}: {exc}")
    if doc is None:
        return None
    readings: dict[str, Reading] = {}
    bad: list[str] = []
    for tier in settings.tiers:
        got = doc.get(tier.name) if tier.is_local else None
        if got is None or (isinstance(got, dict) and got.get("root") != str(tier.local_path)):
            continue  # no reading, or one of the root the tier had before
        try:
            readings[tier.name] = _reading_of(got)
        except ValueError as exc:
            bad.append(f"{tier.name}: {exc}")
    return KeptReadings(path, readings, f"{path}: unreadable reading of {'; '.join(bad)}" if bad else None)


def _load(path: Path) -> dict[str, object] | None:
    """The record; None when there is none. Raises ValueError saying why it is unreadable."""
    try:
        with open(path, "rb") as f:
            body = f.read(_MAX_RECORD + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from exc
    if len(body) > _MAX_RECORD:
        raise ValueError(f"larger than {_MAX_RECORD} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ValueError(f"not JSON ({str(exc)[:200]})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object but {type(doc).__name__}")
    return doc


def _reading_of(got: object) -> Reading:
    """One tier's kept reading; raises ValueError when it is not one (malformed, implausible)."""
    if not isinstance(got, dict):
        raise ValueError(f"not an object but {type(got).__name__}")
    try:
        reading = Reading(float(got["filesystem"]), float(got["node"]))
    except KeyError as exc:
        raise ValueError(f"no {exc}") from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError("times that are not numbers") from exc
    if not (plausible(reading.filesystem) and plausible(reading.node)):
        raise ValueError("implausible times")
    return reading
