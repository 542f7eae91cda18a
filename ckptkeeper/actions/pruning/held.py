"""Participant: what unavailable tiers held back of the policy (exit 4), and its record for
``status`` and the metrics between passes (``<index>.policy-held``)."""

from __future__ import annotations

import dataclasses

from ckptkeeper.actions.held import TierUnavailable, held_by_tiers, record_policy_held
from ckptkeeper.actions.pruning.planning import one_per_step
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.core.model import Plan
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
