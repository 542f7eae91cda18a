"""Step 5 of a plan: watermarks (DESIGN §3).

Tier by tier, fastest first, when a tier's usage (now, or projected after this plan) exceeds
``high_watermark``, its unprotected residents are demoted to the next tier, oldest first
(``created_at``, then step, then run), until the projected usage is at most ``low_watermark``
(``high_watermark`` if unset). If that is not enough, the newest checkpoints of runs that ended
follow, oldest first (moved, never deleted: see :func:`watermarks`). Demotions cascade: the next
tier treats them as its own residents. The projection is exactly the bytes this plan copies in
minus the bytes it deletes or reaps, so executing the plan lands where the planner said.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptkeeper.core.model import Action, TierSpec, TierUsage
from ckptkeeper.core.placement import Item
from ckptkeeper.core.runs import NEWEST

__all__ = ["Watched", "demote_oldest", "watched_tiers", "watermarks"]

_NEWEST_ONLY = [NEWEST]
"""The protection of a checkpoint that is only protected as the newest of its run."""

Watched = dict[int, tuple[TierUsage, float, float]]
"""Tiers whose watermarks apply: position -> (usage, high, low)."""


def watched_tiers(
    tiers: Sequence[TierSpec], usage: Mapping[str, TierUsage | None], unknown: frozenset[int]
) -> Watched:
    """Tiers whose watermarks apply: position -> (usage, high, low)."""
    watched: Watched = {}
    for i, spec in enumerate(tiers):
        u = usage.get(spec.name)
        high = spec.policy.high_watermark
        if u is None or high is None or u.total_bytes <= 0 or i in unknown:
            continue
        low = spec.policy.low_watermark
        watched[i] = (u, high, min(low, high) if low is not None else high)
    return watched


def watermarks(
    items: Sequence[Item],
    tiers: Sequence[TierSpec],
    watched: Mapping[int, tuple[TierUsage, float, float]],
    unknown: frozenset[int],
    reap_actions: Sequence[Action],
    pos: Mapping[str, int],
    ended: frozenset[str],
    notes: list[str],
    trash: frozenset[int] = frozenset(),
) -> None:
    """Demote the oldest residents of tiers above their high watermark (in place).

    Two rounds per tier. First the unprotected residents, oldest first. If that is not enough,
    the newest checkpoints of runs that ended (finished, failed, stale), oldest first: protection
    means "never deleted", and a demotion is copy, verify, then delete from this tier only, so the
    checkpoint is still kept; without this round a node that ran many jobs fills its hot tier with
    their last checkpoints (bench/campaign.py: 98 % of the budget after a week). What stays put
    even under pressure: pinned checkpoints (the executor refuses to delete a pinned copy anyway),
    the newest checkpoint of an active run (it resumes from it) and the parent of an active run.

    ``trash``: tiers whose expiries move the copy into the tier's own trash (``undo_window``):
    they free nothing this pass, so the projection keeps their bytes (as it keeps a reap marked
    ``Action.trash``); ``reap_actions`` also holds the trash purges, which do free theirs.
    """
    ntiers = len(tiers)
    if not watched:
        return

    # Projected bytes per watched tier once this plan is carried out: exactly the copies in minus
    # the deletes and reaps the action pass will emit, so the simulation and the executor agree.
    projected = {i: float(u.used_bytes) for i, (u, _, _) in watched.items()}
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
        u, high, low = watched[i]
        name = tiers[i].name
        now_fraction = u.fraction
        if now_fraction <= high and projected[i] <= high * u.total_bytes:
            continue
        if i + 1 >= ntiers:
            notes.append(
                f"{name} above high watermark {high:.0%} but it is the last tier: nothing to demote to"
            )
            continue
        if i + 1 in unknown:
            notes.append(
                f"{name} above high watermark {high:.0%} but {tiers[i + 1].name} is unknown: no demotion"
            )
            continue
        if now_fraction > high:
            usage_text = f"usage {now_fraction:.0%}"
        else:
            usage_text = f"projected {projected[i] / u.total_bytes:.0%}"
        demotion = (
            f"demoted: {name} above high watermark {high:.0%}",
            f"{name} above high watermark {high:.0%} ({usage_text})",
        )
        target = low * u.total_bytes
        # Held checkpoints cannot leave (no delete this round) and one without a readable copy
        # cannot be copied: demoting either would free nothing.
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
        if projected[i] > target:
            notes.append(
                f"{name} still above low watermark {low:.0%} after demoting every checkpoint it may"
                " (pinned ones, active runs' newest and parents of active runs stay)"
            )


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
