"""The undo window of a plan (docs/undo-window.md): which deletes go to a tier's trash, and when
the trash is purged for good.

Pure: the planner passes the tiers, the watched tiers' usage, the trash entries (``Snapshot.trash``)
and ``now``. A tier with ``undo_window`` sends expiries and reaps of complete checkpoints to its
trash (:func:`to_trash`); they free nothing until purged. A purge (``ActionKind.PURGE``) happens
when the entry's window has ended, when the tier has no window any more, or at once when the tier
is above its high watermark — and then the tier's new expiries skip the trash too: a disk under
pressure gets its space back in this pass, before any live checkpoint is demoted for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ckptkeeper.core.model import Action, ActionKind, Checkpoint, CheckpointState, TierSpec, TrashEntry
from ckptkeeper.core.watermarks import Watched
from ckptkeeper.util.fmt import format_duration

__all__ = ["ENDED", "OFF", "PRESSURE", "TrashPlan", "purges", "to_trash", "trash_plan"]

ENDED = "undo-window-ended"
PRESSURE = "trash-pressure"
OFF = "undo-window-off"
"""Rules of purge actions (``Action.rule``, the reclaimed counters' reasons)."""


class TrashPlan:
    """Per tier position: does a delete there go to trash, or is the tier under pressure (why)."""

    __slots__ = ("pressure", "trash")

    def __init__(self, trash: frozenset[int], pressure: Mapping[int, str]) -> None:
        self.trash = trash
        """Tiers whose expiries and reaps move the copy aside this pass."""
        self.pressure = pressure
        """Tiers with an undo window above their high watermark -> the reason text."""


def trash_plan(tiers: Sequence[TierSpec], watched: Watched) -> TrashPlan:
    """Which tiers trash their deletes this pass: those with an ``undo_window`` that are neither
    above their high watermark nor short of headroom for the next saves (usage now: the trash is
    on the tier's own disk, so it counts)."""
    pressure: dict[int, str] = {}
    trash: set[int] = set()
    for i, spec in enumerate(tiers):
        if spec.policy.undo_window is None:
            continue
        w = watched.get(i)
        if w is not None and w.high is not None and w.usage.fraction > w.high:
            pressure[i] = f"{spec.name} above high watermark {w.high:.0%}"
        elif w is not None and w.needed:
            # short of room for the active runs' next saves (headroom): a save must not fail
            # while the trash holds bytes nobody asked for yet
            pressure[i] = f"{spec.name} short of room for the next saves of active runs"
        else:
            trash.add(i)
    return TrashPlan(frozenset(trash), pressure)


def to_trash(
    actions: Iterable[Action],
    checkpoints: Mapping[tuple[str, int], Checkpoint],
    pos: Mapping[str, int],
    tp: TrashPlan,
    tiers: Sequence[TierSpec],
) -> list[Action]:
    """Mark expiries and reaps of complete checkpoints in trash tiers as moves aside (their reason
    says so and for how long); under pressure say the bytes are freed at once instead. Moves to a
    slower tier and redundant copies are deleted as before: the checkpoint still exists elsewhere.
    Partial checkpoints and temp artifacts are reaped as before: nothing worth undeleting."""
    out: list[Action] = []
    for a in actions:
        i = pos.get(a.tier or "")
        trashable = i is not None and (i in tp.trash or i in tp.pressure) and _trashable(a, checkpoints)
        if not trashable or i is None:
            out.append(a)
        elif i in tp.trash:
            window = tiers[i].policy.undo_window or 0.0
            out.append(a._replace(reason=f"{a.reason}; to trash for {format_duration(window)}", trash=True))
        else:
            out.append(a._replace(reason=f"{a.reason}; freed at once: {tp.pressure[i]}"))
    return out


def _trashable(a: Action, checkpoints: Mapping[tuple[str, int], Checkpoint]) -> bool:
    if a.action is ActionKind.DELETE:
        return a.rule == "expired"
    if a.action is not ActionKind.REAP or a.step is None or a.run is None or a.upload_id is not None:
        return False
    c = checkpoints.get((a.run, a.step))
    return (
        c is not None
        and c.state is CheckpointState.COMPLETE
        and c.version is not None
        and a.path == c.rel_path
    )


def purges(
    entries: Iterable[TrashEntry],
    tiers: Sequence[TierSpec],
    pos: Mapping[str, int],
    tp: TrashPlan,
    unknown: frozenset[int],
    now: float,
    node: str,
    run: str | None,
) -> list[Action]:
    """PURGE actions for trash entries whose time has come, each with why; in (tier position,
    deleted_at, path) order. Never one of another node's entries (docs/design.md, "Many nodes"), nor in a tier whose
    listing failed or that is not configured (no URL to act on)."""
    out: list[tuple[tuple[int, float, str], Action]] = []
    for e in entries:
        i = pos.get(e.tier)
        if i is None or i in unknown or (run is not None and e.run != run):
            continue
        if e.node and node and e.node != node:
            continue
        window = tiers[i].policy.undo_window
        if i in tp.pressure:
            reason, rule = f"{tp.pressure[i]}: trash freed at once", PRESSURE
        elif window is None:
            reason, rule = f"{e.tier} has no undo_window any more: trash freed", OFF
        elif now >= e.deleted_at + window:
            reason, rule = f"undo window {format_duration(window)} ended", ENDED
        else:
            continue
        action = Action(ActionKind.PURGE, reason, e.run, e.step, e.tier, None, e.path, e.bytes, rule)
        out.append(((i, e.deleted_at, e.path), action))
    out.sort(key=lambda t: t[0])
    return [a for _, a in out]
