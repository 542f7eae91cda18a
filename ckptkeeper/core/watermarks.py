"""Step 5 of a plan: watermarks and headroom (docs/design.md, "Retention").

Tier by tier, fastest first, when a tier's usage (now, or projected after this plan) exceeds
``high_watermark``, its unprotected residents are demoted to the next tier, oldest first
(``created_at``, then step, then run), until the projected usage is at most ``low_watermark``
(``high_watermark`` if unset). If that is not enough, the newest checkpoints of runs that ended
follow, oldest first (moved, never deleted: see :func:`watermarks`). Demotions cascade: the next
tier treats them as its own residents. The projection is exactly the bytes this plan copies in
minus the bytes it deletes or reaps, so executing the plan lands where the planner said.

**Headroom** (the first tier only, its ``headroom`` policy on): when the hot tier's free space
after this plan would not hold the next save of every active run
(:func:`ckptkeeper.core.headroom.predict_next_save`), the same two rounds demote until it would,
whether or not the tier is above its high watermark, and whether or not it sets one: a tier with
known usage and no ``high_watermark`` is watched for headroom alone. Each such demotion's reason
says so (``headroom: next saves of 2 active runs need 38.0 GiB; 12.0 GiB free``); a plan that
cannot make enough room says so in its notes. The hot tier is never copied into (the planner does
not promote), so its projection only falls: a tier whose free space holds the next saves already
is not watched for headroom at all, and its plain checkpoints stay on the planner's fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ckptkeeper.core.headroom import describe_need
from ckptkeeper.core.model import Action, TierSpec, TierUsage
from ckptkeeper.core.placement import Item
from ckptkeeper.core.runs import NEWEST
from ckptkeeper.util.fmt import human_bytes

__all__ = ["HEADROOM", "Watch", "Watched", "demote_oldest", "watched_tiers", "watermarks"]

HEADROOM = "headroom"
"""What a headroom demotion's copy reason starts with (and its rule id)."""

_NEWEST_ONLY = [NEWEST]
"""The protection of a checkpoint that is only protected as the newest of its run."""

_STAYS = "pinned ones, active runs' newest and parents of active runs stay"


class Watch(NamedTuple):
    """Why a tier is watched: its usage, its watermarks (None: none set) and the bytes its active
    runs' next saves need when its free space does not hold them (0: no headroom to make)."""

    usage: TierUsage
    high: float | None
    low: float | None
    needed: int = 0
    saving_runs: int = 0
    """Active runs whose next save needs room (a prediction above 0)."""


Watched = dict[int, Watch]
"""Tiers whose watermarks or headroom apply: position -> :class:`Watch`."""


def watched_tiers(
    tiers: Sequence[TierSpec],
    usage: Mapping[str, TierUsage | None],
    unknown: frozenset[int],
    next_saves: Mapping[str, int] | None = None,
) -> Watched:
    """Tiers whose watermarks apply, and the first tier when its headroom is short.

    ``next_saves`` maps each active run to its predicted next save; the first tier is watched for
    headroom when its ``headroom`` policy is on and its free space now is below their sum.
    """
    watched: Watched = {}
    needed = sum(next_saves.values()) if next_saves else 0
    for i, spec in enumerate(tiers):
        u = usage.get(spec.name)
        if u is None or u.total_bytes <= 0 or i in unknown:
            continue
        short = i == 0 and spec.policy.headroom and needed > 0 and u.free < needed
        high = spec.policy.high_watermark
        if high is None and not short:
            continue
        low = spec.policy.low_watermark
        if high is not None:
            low = min(low, high) if low is not None else high
        if short and next_saves:
            watched[i] = Watch(u, high, low, needed, sum(1 for b in next_saves.values() if b > 0))
        else:
            watched[i] = Watch(u, high, low)
    return watched


def watermarks(
    items: Sequence[Item],
    tiers: Sequence[TierSpec],
    watched: Mapping[int, Watch],
    unknown: frozenset[int],
    reap_actions: Sequence[Action],
    pos: Mapping[str, int],
    ended: frozenset[str],
    notes: list[str],
    trash: frozenset[int] = frozenset(),
) -> None:
    """Demote the oldest residents of tiers above their high watermark, or short of headroom for
    the next saves (in place).

    Two rounds per tier. First the unprotected residents, oldest first. If that is not enough,
    the newest checkpoints of runs that ended (finished, failed, stale), oldest first: protection
    means "never deleted", and a demotion is copy, verify, then delete from this tier only, so the
    checkpoint is still kept; without this round a node that ran many jobs fills its hot tier with
    their last checkpoints (bench/campaign.py: 98 % of the budget after a week). What stays put
    even under pressure: pinned checkpoints (the executor refuses to delete a pinned copy anyway),
    the newest checkpoint of an active run (it resumes from it) and the parent of an active run.
    The watermark goes first; headroom then demotes further only if the room is still short.

    ``trash``: tiers whose expiries move the copy into the tier's own trash (``undo_window``):
    they free nothing this pass, so the projection keeps their bytes (as it keeps a reap marked
    ``Action.trash``); ``reap_actions`` also holds the trash purges, which do free theirs.
    """
    if not watched:
        return

    # Projected bytes per watched tier once this plan is carried out: exactly the copies in minus
    # the deletes and reaps the action pass will emit, so the simulation and the executor agree.
    projected = {i: float(w.usage.used_bytes) for i, w in watched.items()}
    for a in reap_actions:
        reaped_in = pos.get(a.tier or "")
        if reaped_in is not None and reaped_in in projected and not a.trash:
            projected[reaped_in] -= a.bytes
    for item in items:
        known = item.locs.known_set
        desired = item.desired
        if desired == known:
            continue
        b = item.ckpt.bytes
        if known:
            for i in desired - known:
                if i in projected:
                    projected[i] += b
        if not item.hold:
            for i in known - desired:
                if i in projected and (item.resident is not None or i not in trash):
                    projected[i] -= b

    for i in sorted(watched):
        w = watched[i]
        # Headroom is measured after the watermark's demotions: they may have made the room.
        if w.high is not None:
            _relieve(i, _watermark(i, w, tiers, projected), items, tiers, unknown, projected, ended, notes)
        if w.needed:
            _relieve(i, _headroom(i, w, tiers, projected), items, tiers, unknown, projected, ended, notes)


class _Pressure(NamedTuple):
    """Why a tier must shed checkpoints now, and down to where."""

    why: str
    """The pressure in words (the note when there is nowhere to demote to)."""
    target: float
    """Projected bytes of the tier at which the pressure is gone: the walk's stop condition."""
    demotion: tuple[str, str]
    """Each demotion's (rule, reason)."""
    still: Callable[[float], str]
    """The note when every checkpoint the tier may demote is gone and the projection (the
    argument) is still above ``target``."""


def _watermark(i: int, w: Watch, tiers: Sequence[TierSpec], projected: dict[int, float]) -> _Pressure | None:
    """Tier ``i`` above its high watermark (now or projected): demote down to its low watermark."""
    u, high = w.usage, w.high
    low = w.low if w.low is not None else high
    assert high is not None and low is not None
    name = tiers[i].name
    now_fraction = u.fraction
    if now_fraction <= high and projected[i] <= high * u.total_bytes:
        return None
    if now_fraction > high:
        usage_text = f"usage {now_fraction:.0%}"
    else:
        usage_text = f"projected {projected[i] / u.total_bytes:.0%}"
    still = f"{name} still above low watermark {low:.0%} after demoting every checkpoint it may ({_STAYS})"
    return _Pressure(
        why=f"{name} above high watermark {high:.0%}",
        target=low * u.total_bytes,
        demotion=(
            f"demoted: {name} above high watermark {high:.0%}",
            f"{name} above high watermark {high:.0%} ({usage_text})",
        ),
        still=lambda _projected: still,
    )


def _headroom(i: int, w: Watch, tiers: Sequence[TierSpec], projected: dict[int, float]) -> _Pressure | None:
    """Tier ``i``'s free space after this plan below ``w.needed``: demote until it holds it."""
    u = w.usage
    name = tiers[i].name
    free_after = u.free - (projected[i] - u.used_bytes)
    if free_after >= w.needed:
        return None
    need = describe_need(w.needed, free_after, w.saving_runs)
    target = u.used_bytes + u.free - w.needed  # projected usage at which free_after == needed
    return _Pressure(
        why=f"{name} short of headroom ({need})",
        target=target,
        demotion=(f"demoted: {name} short of headroom for active runs' next saves", f"{HEADROOM}: {need}"),
        still=lambda now: (
            f"{name} short of headroom: {need}; still {human_bytes(max(0.0, now - target))} short after "
            f"demoting every checkpoint it may ({_STAYS}): the next save may fail for lack of space"
        ),
    )


def _relieve(
    i: int,
    pressure: _Pressure | None,
    items: Sequence[Item],
    tiers: Sequence[TierSpec],
    unknown: frozenset[int],
    projected: dict[int, float],
    ended: frozenset[str],
    notes: list[str],
) -> None:
    """Demote from tier ``i`` until ``pressure`` is gone (both rounds of :func:`_demote`); a note
    when there is nowhere to demote to, or when what the tier may demote is not enough."""
    if pressure is None or _nowhere_to_go(i, tiers, unknown, pressure.why, notes):
        return
    if not _demote(i, items, projected, pressure.target, pressure.demotion, ended):
        notes.append(pressure.still(projected[i]))


def _nowhere_to_go(
    i: int, tiers: Sequence[TierSpec], unknown: frozenset[int], why: str, notes: list[str]
) -> bool:
    """True (with a note) when tier ``i`` has no next tier to demote to, or that tier is unknown."""
    if i + 1 >= len(tiers):
        notes.append(f"{why} but it is the last tier: nothing to demote to")
        return True
    if i + 1 in unknown:
        notes.append(f"{why} but {tiers[i + 1].name} is unknown: no demotion")
        return True
    return False


def _demote(
    i: int,
    items: Sequence[Item],
    projected: dict[int, float],
    target: float,
    demotion: tuple[str, str],
    ended: frozenset[str],
) -> bool:
    """Both rounds for tier ``i`` down to ``target`` projected bytes; False if still above it."""
    # Held checkpoints cannot leave (no delete this round) and one without a readable copy
    # cannot be copied: demoting either would free nothing.
    if projected[i] <= target:
        return True
    movable = [it for it in items if it.resident == i and not it.hold and it.locs.known]
    unprotected = [it for it in movable if it.protect is None]
    demote_oldest(unprotected, i, projected, target, demotion)
    if projected[i] > target:
        # A protected checkpoint no rule places has no residence but stays where it is.
        ended_newest = [
            it
            for it in items
            if it.protect == _NEWEST_ONLY
            and it.ckpt.run in ended
            and (it.resident == i or (it.resident is None and i in it.desired))
            and not it.hold
            and it.locs.known
        ]
        pressure = (demotion[0], f"{demotion[1]}: newest checkpoint of ended run, moved not deleted")
        demote_oldest(ended_newest, i, projected, target, pressure)
    return projected[i] <= target


def demote_oldest(
    candidates: list[Item],
    tier: int,
    projected: dict[int, float],
    target: float,
    demotion: tuple[str, str],
) -> None:
    """Move ``candidates`` residing in ``tier`` one tier down, oldest first, until it is at most
    ``target`` bytes; ``projected`` follows each move so the next tier sees what it receives."""
    candidates.sort(key=lambda it: (it.ckpt.created_at, it.ckpt.step, it.ckpt.run))
    below = tier + 1
    for it in candidates:
        if projected[tier] <= target:
            return
        b = it.ckpt.bytes
        projected[tier] -= b  # the copy into tier is cancelled, or the copy in tier gets deleted
        if below not in it.desired and below in projected:
            projected[below] += b
        it.desired = (it.desired - {tier}) | {below}
        it.resident = below
        it.demoted = (*it.demoted, demotion)
