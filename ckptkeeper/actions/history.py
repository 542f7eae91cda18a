"""``history``: what happened to checkpoints, each action with its time, rule, reason and outcome.

Three sources, merged by time (each event says which it came from):

* ``index``: the rows the executor wrote for every action this node carried out or that failed
  (:mod:`ckptkeeper.index.history`), and the fleet lease holder's adopted deletes;
* ``trash``: copies in a tier's trash (``undo_window``) without a row, when the index that
  recorded why was lost and rebuilt from the tiers: the trash still tells when;
* ``fleet``: the records lease holders left in the shared tiers about this node's copies
  (:mod:`ckptkeeper.fleet.history`), so the owner learns who deleted what and why.

:func:`after_pass` is the prune pass's part: the lease holder's adopted deletes go into its own
history, and events past ``history.keep`` or beyond ``history.max_rows`` are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.history import HistoryEvent
from ckptkeeper.index import Index
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.history")

__all__ = ["HistoryView", "after_pass", "read_history", "trash_events"]


@dataclass
class HistoryView:
    """The events of one node's checkpoints (oldest first), and notes (a tier not read)."""

    node: str
    events: list[HistoryEvent]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "events": [e.to_dict() for e in self.events], "notes": list(self.notes)}


def trash_events(settings: Settings, index: Index, run: str | None, step: int | None) -> list[HistoryEvent]:
    """One event per trash entry of this node with no index row naming it: the index that knew
    why was lost (rebuilt from the tiers); the entry itself still says when and where."""
    entries = index.trash(run, step)
    if not entries:
        return []
    known = {e.trash for e in index.history(run, step) if e.trash}
    out = []
    for entry, _manifest in entries:
        if entry.path in known or (entry.node and settings.node and entry.node != settings.node):
            continue
        out.append(
            HistoryEvent(
                entry.deleted_at,
                "delete",
                entry.run,
                entry.step,
                entry.tier,
                path=entry.rel_path,
                bytes=entry.bytes,
                reason=f"moved aside into the trash of {entry.tier} (why was "
                "recorded in an index since lost; the trash entry tells when)",
                node=entry.node or settings.node,
                trash=entry.path,
                source="trash",
            )
        )
    return out


def fleet_events(
    settings: Settings, owner: str, run: str | None, step: int | None, since: float | None
) -> tuple[list[HistoryEvent], list[str]]:
    """What lease holders recorded about ``owner``'s copies in the shared object-store tiers."""
    if not any(t.shared and not t.is_local for t in settings.tiers[1:]):
        return [], []
    from ckptkeeper.fleet.history import safe_read_records
    from ckptkeeper.fleet.view import shared_tiers
    from ckptkeeper.storage import TierStorage

    events: list[HistoryEvent] = []
    notes: list[str] = []
    for tier in shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers[1:]]):
        got, note = safe_read_records(tier, owner)
        events += [e for e in got if e.matches(run, step, since)]
        if note:
            notes.append(f"{tier.name}: {note}")
    return events, notes


def read_history(
    settings: Settings,
    index: Index,
    run: str | None = None,
    step: int | None = None,
    since: float | None = None,
    *,
    node: str | None = None,
) -> HistoryView:
    """The history of this node (default): every action it carried out, its copies in a trash
    with no recorded event, and what lease holders recorded about its copies. With ``node``,
    another node's checkpoints: its records in the shared tiers, and what this node did to its
    copies as lease holder. Optionally of one run (and step) and since a time."""
    owner = node or settings.node
    own = owner == settings.node
    rows = index.history(run, step, since)
    # this node's own view: everything it did (its adopted deletes of gone nodes' copies too)
    events = rows if own else [e for e in rows if e.owner == owner]
    if own:
        events += [e for e in trash_events(settings, index, run, step) if e.matches(run, step, since)]
    remote, notes = fleet_events(settings, owner, run, step, since)
    # A record this node left as lease holder repeats an event of its own index. Matched without
    # the time: the record is dated by the store's clock, the index by this node's, and the two may
    # be hours apart (a path adopted twice by this node is shown once while its index has it).
    seen = {(e.action, e.tier, e.path, e.node) for e in events}
    events += [e for e in remote if (e.action, e.tier, e.path, e.node) not in seen]
    events.sort(key=lambda e: e.at)
    return HistoryView(owner, events, notes)


def after_pass(settings: Settings, index: Index, adopted: Sequence[Any], *, now: float | None = None) -> None:
    """The prune pass's history part (after the executor and the fleet step): record the deletes
    this node made as fleet lease holder (``adopted``: :class:`ckptkeeper.fleet.adopt.Adoption`),
    then drop events older than ``history.keep`` and all but the newest ``history.max_rows``."""
    t = time.time() if now is None else now
    try:
        if adopted:
            from ckptkeeper.fleet.history import gone_node_events

            events: list[HistoryEvent] = []
            for a in adopted:
                done = set(a.deleted)
                deleted = [x for x in a.plan.actions if (x.path or "") in done]
                events += gone_node_events(settings.node, a.tier, a.node, a.silent_for, t, deleted=deleted)
            index.add_history(events)
        gone = index.prune_history(t - settings.history.keep, settings.history.max_rows)
    except Exception as exc:  # the history is advisory: never fail the pass for it
        log.warning("history not recorded or pruned", error=str(exc))
        return
    if gone:
        log.debug("old history events dropped", events=gone)
