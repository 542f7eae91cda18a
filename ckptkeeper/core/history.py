"""What happened to checkpoints: one :class:`HistoryEvent` per executed action (pure data).

The executor records an event for every action it carried out or that failed (the index keeps
them for ``history.keep``, at most ``history.max_rows``); the fleet lease holder writes the events
of its adopted deletes and litter cleanups into the shared tier, so the node that owned the copies
can read who deleted them and why (docs/design.md, "Many nodes"). ``history`` and ``why`` read
both. Events are built from plan actions, so their fields are the plan's: what ``prune --json``
printed is what ``history --json`` shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptkeeper.core.model import Action

__all__ = ["ACTION_EVENT", "ADOPTED", "CLEANUP", "DONE", "FAILED", "UNDELETE", "HistoryEvent"]

ACTION_EVENT = "checkpoint action done"
"""The log event of every action carried out (fields ``action``, ``run``, ``step``, ``tier``,
``to_tier``, ``path``, ``bytes``, ``rule``, ``reason``, ``node``, ``duration_s``): JSON lines under
systemd (with the journald priority prefix), text on a terminal."""

DONE = "done"
FAILED = "failed"
"""Outcomes of an event (a failed one carries its error in ``error``)."""

UNDELETE = "undelete"
ADOPTED = "adopted-delete"
CLEANUP = "fleet-cleanup"
"""Event actions that are no plan action: an undelete, a lease holder's delete of a gone node's
copy, and its cleanup of a gone node's litter (staging markers, uploads)."""

_MAX_TEXT = 2000


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    return "" if value is None else str(value).replace("\0", "")[:limit]


def _opt_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError("time: not a finite number")
    return float(value)


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One executed action: when, what, where, why, how it ended, and which node did it."""

    at: float
    action: str
    """``copy``, ``delete``, ``reap``, ``purge``, ``undelete``, ``adopted-delete``, ``fleet-cleanup``."""
    run: str | None
    step: int | None
    tier: str | None
    to_tier: str | None = None
    path: str | None = None
    bytes: int = 0
    rule: str = ""
    reason: str = ""
    outcome: str = DONE
    node: str = ""
    """The node that carried it out."""
    duration: float = 0.0
    owner: str = ""
    """The node whose copy it was, when another node acted (an adoption); "" = ``node``'s own."""
    error: str = ""
    trash: str = ""
    """The trash entry a move aside put the copy into (``undo_window``); "" = none."""
    source: str = "index"
    """Where the event was read from: ``index`` (this node's journal of actions), ``trash`` (a
    trash entry in a tier: the index that recorded its reason was lost), ``fleet`` (a record the
    fleet lease holder left in a shared tier)."""

    @classmethod
    def of(
        cls,
        action: Action,
        at: float,
        *,
        node: str,
        outcome: str = DONE,
        duration: float = 0.0,
        error: str = "",
        trash: str = "",
    ) -> HistoryEvent:
        """The event of a plan action carried out (or failed) at ``at``."""
        return cls(
            at=at,
            action=action.action.value,
            run=action.run,
            step=action.step,
            tier=action.tier,
            to_tier=action.to_tier,
            path=action.path,
            bytes=action.bytes,
            rule=action.rule,
            reason=action.reason,
            outcome=outcome,
            node=node,
            duration=round(duration, 6),
            error=_text(error),
            trash=trash,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.at,
            "action": self.action,
            "run": self.run,
            "step": self.step,
            "tier": self.tier,
            "to_tier": self.to_tier,
            "path": self.path,
            "bytes": self.bytes,
            "rule": self.rule,
            "reason": self.reason,
            "outcome": self.outcome,
            "error": self.error or None,
            "node": self.node,
            "owner": self.owner or None,
            "duration": self.duration,
            "trash": self.trash or None,
            "source": self.source,
        }

    def log_fields(self) -> dict[str, Any]:
        """The fields of its :data:`ACTION_EVENT` log line."""
        doc = {
            "action": self.action,
            "run": self.run,
            "step": self.step,
            "tier": self.tier,
            "to_tier": self.to_tier,
            "path": self.path,
            "bytes": self.bytes,
            "rule": self.rule,
            "reason": self.reason,
            "node": self.node,
            "duration_s": round(self.duration, 3),
        }
        if self.trash:
            doc["trash"] = self.trash
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str) -> HistoryEvent:
        """Parse an event read back from a tier (untrusted): bad fields raise ValueError."""
        if not isinstance(doc, Mapping):
            raise ValueError("event: not an object")
        size = doc.get("bytes")
        return cls(
            at=_time(doc.get("time")),
            action=_text(doc.get("action"), 64),
            run=None if doc.get("run") is None else _text(doc.get("run"), 1024),
            step=_opt_int(doc.get("step")),
            tier=None if doc.get("tier") is None else _text(doc.get("tier"), 256),
            to_tier=None if doc.get("to_tier") is None else _text(doc.get("to_tier"), 256),
            path=None if doc.get("path") is None else _text(doc.get("path"), 4096),
            bytes=_opt_int(size) or 0,
            rule=_text(doc.get("rule"), 128),
            reason=_text(doc.get("reason")),
            outcome=_text(doc.get("outcome") or DONE, 32),
            error=_text(doc.get("error")),
            node=_text(doc.get("node"), 256),
            owner=_text(doc.get("owner"), 256),
            duration=_time(doc.get("duration") or 0.0),
            trash=_text(doc.get("trash"), 256),
            source=source,
        )

    def with_source(self, source: str) -> HistoryEvent:
        return replace(self, source=source)

    def matches(self, run: str | None, step: int | None, since: float | None) -> bool:
        return (
            (run is None or self.run == run)
            and (step is None or self.step == step)
            and (since is None or self.at >= since)
        )
