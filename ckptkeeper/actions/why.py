"""``why RUN STEP``: one checkpoint's story — where its copies are and which rule keeps each, what
the next pass will do with it and why, and, if it is gone, when, by which rule and node, and
whether ``undelete`` can still bring it back.

The next pass is a dry-run plan of this run made in an in-memory copy of the index (no tier is
walked: what the index knows now); the past is :func:`ckptkeeper.actions.history.read_history`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.history import read_history
from ckptkeeper.config import Settings
from ckptkeeper.core.history import ADOPTED, DONE, HistoryEvent
from ckptkeeper.core.model import ActionKind, Plan
from ckptkeeper.index import Index
from ckptkeeper.util.fmt import format_duration, human_bytes

__all__ = ["NothingKnown", "Story", "why"]

_GONE_ACTIONS = frozenset({ActionKind.DELETE.value, ActionKind.REAP.value, ActionKind.PURGE.value, ADOPTED})


class NothingKnown(Exception):
    """Neither the index, its history, a trash nor a fleet record knows this checkpoint."""


@dataclass
class Story:
    run: str
    step: int
    node: str
    copies: list[dict[str, Any]] = field(default_factory=list)
    next_pass: list[dict[str, Any]] = field(default_factory=list)
    trash: list[dict[str, Any]] = field(default_factory=list)
    events: list[HistoryEvent] = field(default_factory=list)
    gone: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        if self.copies:
            return "present"
        return "in-trash" if self.trash else "gone"

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "node": self.node,
            "state": self.state,
            "copies": self.copies,
            "next_pass": self.next_pass,
            "trash": self.trash,
            "gone": self.gone,
            "undelete": any(t["undeletable"] for t in self.trash),
            "events": [e.to_dict() for e in self.events],
            "story": self.lines,
            "notes": self.notes,
        }


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _copies(index: Index, run: str, step: int, node: str, own: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for row in index.checkpoints_at_step(run, step):
        damaged = row.damaged
        seen = index.listed_at(row.id)
        for tier in sorted(row.locations):
            owner = index.location_owner(row.id, tier) or ""
            if (owner and owner != node) if own else owner != node:
                continue
            out.append(
                {
                    "tier": tier,
                    "listed_at": seen.get(tier),
                    "name": row.name,
                    "bytes": row.bytes,
                    "verified": tier in row.verified_tiers,
                    "damaged": damaged.get(tier),
                    "pinned": row.pinned,
                    "kept_by": [],
                }
            )
    return out


def _plan(settings: Settings, index: Index, run: str) -> Plan:
    """The next pass's plan of ``run`` from what the index knows now (tiers not walked), with the
    hold a rebuilt index left applied, as the pass would."""
    from ckptkeeper.actions.index import read_freeze
    from ckptkeeper.actions.prune import make_plan
    from ckptkeeper.actions.pruning.freeze import apply_freeze

    with index.in_memory_copy() as scratch:
        plan = make_plan(settings, scratch, run=run)
    freeze = read_freeze(settings)
    return plan if freeze is None else apply_freeze(plan, freeze, force=False)


def why(settings: Settings, index: Index, run: str, step: int, *, node: str | None = None) -> Story:
    """The story of ``run@step`` on ``node`` (default: this node). Raises :class:`NothingKnown`."""
    owner = node or settings.node
    own = owner == settings.node
    story = Story(run, step, owner)
    story.copies = _copies(index, run, step, owner, own)
    view = read_history(settings, index, run, step, node=owner)
    # another node's copies of a run of the same name (adopted by this node) are not this story
    story.events = [e for e in view.events if e.owner == owner or (not e.owner and e.node in (owner, ""))]
    story.notes = view.notes
    story.copies = _drop_deleted_since(story.copies, story.events, story.notes)
    if own:
        plan = _plan(settings, index, run)
        by_tier = {c["tier"]: c for c in story.copies}
        for k in plan.keep:
            if k.step == step and k.tier in by_tier:
                by_tier[k.tier]["kept_by"] = list(k.reasons)
        story.next_pass = [
            {k: v for k, v in a.to_dict().items() if k != "path"}
            for a in plan.actions
            if a.run == run and a.step == step
        ]
        if plan.refused and story.next_pass:
            story.notes.append(f"the plan is refused: {plan.refused}")
        windows = {t.name: t.undo_window for t in settings.tiers}
        for entry, _m in index.trash(run, step):
            if entry.node and entry.node != owner:
                continue
            window = windows.get(entry.tier)
            until = entry.deleted_at + window if window is not None else entry.deleted_at
            story.trash.append(
                {
                    "tier": entry.tier,
                    "entry": entry.path,
                    "deleted_at": entry.deleted_at,
                    "purge_after": until,
                    "undeletable": True,
                }
            )
    else:
        story.notes.append(f"{owner}'s retention is its own: run `ckptkeeper why` there for its next pass")
    if not (story.copies or story.events or story.trash or index.checkpoints_at_step(run, step)):
        raise NothingKnown(
            f"nothing known about {run}@{step} on node {owner}: not in the index, no action recorded in "
            f"the last {format_duration(settings.history.keep)}, not in any trash"
        )
    if not story.copies:
        story.gone = _gone(story.events)
    story.lines = _tell(story, own)
    return story


def _drop_deleted_since(
    copies: list[dict[str, Any]], events: list[HistoryEvent], notes: list[str]
) -> list[dict[str, Any]]:
    """Copies another node deleted after this index last listed them (a lease holder's adoption,
    known from its record in the shared tier) are gone, whatever the index still says."""
    out = []
    for c in copies:
        later = [
            e
            for e in events
            if e.owner and e.tier == c["tier"] and e.outcome == DONE and e.action in _GONE_ACTIONS
            and e.at > (c["listed_at"] or 0.0)
        ]  # fmt: skip
        if not later:
            out.append(c)
            continue
        e = later[-1]
        notes.append(
            f"the index still lists a copy in {c['tier']} (last listed {_when(c['listed_at'] or 0.0)}), "
            f"but {e.node} deleted it on {_when(e.at)}: the next scan or prune drops it"
        )
    return out


def _gone(events: list[HistoryEvent]) -> dict[str, Any] | None:
    """The last destructive action done to the checkpoint, as the story's answer to "when, by
    which rule, by which node"."""
    done = [e for e in events if e.outcome == DONE and e.action in _GONE_ACTIONS]
    if not done:
        return None
    last = done[-1]
    return {
        "time": last.at,
        "action": last.action,
        "tier": last.tier,
        "rule": last.rule,
        "reason": last.reason,
        "node": last.node,
        "owner": last.owner or None,
        "source": last.source,
    }


def _event_line(e: HistoryEvent, me: str) -> str:
    who = e.node or "this node"
    if e.action == ADOPTED:
        who = f"{who} (fleet lease holder)"
    elif e.node == me:
        who = f"{who} (this node)"
    where = e.tier or ""
    if e.to_tier:
        where += f" -> {e.to_tier}"
    verb = {"copy": "copied", "delete": "deleted", "reap": "reaped", "purge": "purged"}.get(
        e.action, e.action
    )
    if e.trash and e.action in ("delete", "reap"):
        verb = "moved into the trash"
    head = f"{_when(e.at)}: {verb} in {where} by {who}" if where else f"{_when(e.at)}: {verb} by {who}"
    tail = f": {e.reason}" if e.reason else ""
    if e.outcome != DONE:
        tail += f" — FAILED: {e.error}"
    return head + tail


def _tell(story: Story, own: bool) -> list[str]:
    """The story in plain words (pure)."""
    me = story.node if own else ""
    lines: list[str] = []
    for c in story.copies:
        state = (
            "damaged: " + c["damaged"] if c["damaged"] else ("verified" if c["verified"] else "not verified")
        )
        kept = "; ".join(c["kept_by"]) or ("pinned" if c["pinned"] else "no rule keeps it")
        lines.append(f"copy in {c['tier']} ({human_bytes(c['bytes'])}, {state}): kept by {kept}")
    for a in story.next_pass:
        where = f"{a['tier']} -> {a['to_tier']}" if a.get("to_tier") else a["tier"]
        lines.append(f"next pass: {a['action']} in {where}: {a['reason']}")
    if own and story.copies and not story.next_pass:
        lines.append("next pass: nothing changes for it")
    for t in story.trash:
        lines.append(
            f"in the trash of {t['tier']} since {_when(t['deleted_at'])}: `ckptkeeper undelete "
            f"{story.run} {story.step} --tier {t['tier']}` brings it back until {_when(t['purge_after'])}"
        )
    if not story.copies and not story.trash:
        g = story.gone
        if g is None:
            lines.append("gone: no copy is known and no recorded action removed it")
        else:
            by = g["node"] + (" (fleet lease holder)" if g["action"] == ADOPTED else "")
            lines.append(f"gone: {g['action']} in {g['tier']} by {by} on {_when(g['time'])}: {g['reason']}")
            lines.append(
                "undelete cannot bring it back (purged from the trash)"
                if g["action"] == ActionKind.PURGE.value
                else "undelete cannot bring it back (it was never in a trash: no undo_window on that tier)"
            )
    lines += [f"history: {_event_line(e, me)}" for e in story.events]
    return lines
