"""Participant: what unavailable tiers held back of the policy (exit 4), and its record for
``status`` and the metrics between passes (``<index>.policy-held``)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping

from ckptkeeper.actions.held import TierUnavailable, policy_held_path, read_policy_held
from ckptkeeper.actions.pruning.planning import one_per_step
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.config import Settings
from ckptkeeper.core.model import ActionKind, CheckpointState, Plan, Snapshot
from ckptkeeper.index import TierStatus
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.prune")


class PolicyHeld(Participant):
    def restrict(self, state: PassState, plan: Plan) -> Plan:
        state.held = _held(state, plan)
        return plan

    def after(self, state: PassState) -> list[str]:
        if state.dry_run:
            return []
        if "retention" in state.kinds and state.run is None and not state.stopped:
            try:
                record_policy_held(state.settings, state.held)
            except OSError as exc:  # advisory: status loses it, the exit code still says it
                log.warning("cannot record the held policy for status", error=str(exc))
        for tier in state.held.values():
            log.warning(
                "policy held: tier unavailable",
                tier=tier.tier,
                checkpoints=tier.checkpoints,
                error=tier.error,
            )
        return []


def _held(state: PassState, plan: Plan) -> dict[str, TierUnavailable]:
    """What unavailable tiers held back (cheap when every tier is available: no second snapshot)."""
    names = [t.name for t in state.settings.tiers]
    statuses = state.index.tier_statuses()
    if all(statuses.get(n) is not None and statuses[n].ok for n in names):
        return {}
    snapshot, _ = one_per_step(state.index.snapshot(names))
    if state.run is not None:
        run = state.run
        snapshot = dataclasses.replace(
            snapshot, checkpoints=tuple(c for c in snapshot.checkpoints if c.run == run)
        )
    return held_by_tiers(plan, snapshot, statuses)


def held_by_tiers(
    plan: Plan, snapshot: Snapshot, statuses: Mapping[str, TierStatus]
) -> dict[str, TierUnavailable]:
    """Unavailable tiers that held back part of ``plan``, with how many checkpoints each held.

    A complete checkpoint is held when, once the plan's copies and deletes are done, its copies
    would still not be where the plan keeps it, and an unknown tier is involved (it holds a copy,
    or the plan keeps it there): a copy to that tier waits, or a delete that depends on it (a move,
    an expiry) does not happen. Computed from the plan and the snapshot it was made from, so the
    planner needs no extra output; only called when some tier is unknown.
    """
    unknown = snapshot.unknown_tiers
    if not unknown:
        return {}
    kept: dict[tuple[str, int], set[str]] = {}
    for keep in plan.keep:
        kept.setdefault((keep.run, keep.step), set()).add(keep.tier)
    added: dict[tuple[str | None, int | None], set[str]] = {}
    removed: dict[tuple[str | None, int | None], set[str]] = {}
    for action in plan.actions:
        key = (action.run, action.step)
        if action.action is ActionKind.COPY and action.to_tier:
            added.setdefault(key, set()).add(action.to_tier)
        elif action.tier:
            removed.setdefault(key, set()).add(action.tier)
    counts: dict[str, int] = {}
    for c in snapshot.checkpoints:
        if c.state is not CheckpointState.COMPLETE:
            continue
        key = (c.run, c.step)
        wanted = kept.get(key, set())
        blocking = (set(c.tiers) | wanted) & unknown
        if not blocking:
            continue
        after = (set(c.tiers) | added.get(key, set())) - removed.get(key, set())
        if after != wanted:
            for tier in blocking:
                counts[tier] = counts.get(tier, 0) + 1
    out: dict[str, TierUnavailable] = {}
    for tier, n in sorted(counts.items()):
        st = statuses.get(tier)
        out[tier] = TierUnavailable(tier, (st.error if st is not None else None) or "never listed", n)
    return out


def record_policy_held(
    settings: Settings, held: Mapping[str, TierUnavailable], *, now: float | None = None
) -> None:
    """Write (atomically) or clear the record of what the last pass held."""
    path = policy_held_path(settings)
    if not held:
        path.unlink(missing_ok=True)
        return
    previous = read_policy_held(settings)
    at = time.time() if now is None else now
    doc = {
        "tiers": {
            t.tier: {
                "error": t.error,
                "checkpoints": t.checkpoints,
                "since": previous[t.tier].since if t.tier in previous else at,
            }
            for t in held.values()
        },
        "at": at,
    }
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
