"""The plan and restrict phases: the planner over the catalog, then each participant's say."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.actions.status import tier_usage
from ckptkeeper.core import planner
from ckptkeeper.core.model import ActionKind, Checkpoint, CheckpointState, Plan, Snapshot, TierSpec, TierUsage
from ckptkeeper.fleet.sharedfs import owned_by_the_tier
from ckptkeeper.util.gc import gc_paused

__all__ = ["one_per_step", "plan_phase", "restrict_phase"]


def one_per_step(snapshot: Snapshot) -> tuple[Snapshot, list[str]]:
    """The planner keys checkpoints by (run, step), the catalog by (run, name): Lightning's
    ``-v1`` files and NeMo's ``-last`` copies share a step with another checkpoint. The planner
    gets one per (run, step) — complete before incomplete, then the newest written, then the
    name — and the others are left exactly where they are: never moved, deleted or reaped.
    """
    groups: dict[tuple[str, int], list[Checkpoint]] = {}
    for c in snapshot.checkpoints:
        groups.setdefault(c.key, []).append(c)
    if all(len(g) == 1 for g in groups.values()):
        return snapshot, []
    keep: list[Checkpoint] = []
    notes: list[str] = []
    for (run, step), group in groups.items():
        group.sort(key=lambda c: (c.state is CheckpointState.COMPLETE, c.last_write, c.created_at, c.name))
        keep.append(group[-1])
        if len(group) > 1:
            others = ", ".join(c.name for c in group[:-1])
            notes.append(
                f"{run}@{step}: {len(group)} checkpoints share this step; planning {group[-1].name}, "
                f"leaving {others} untouched"
            )
    return dataclasses.replace(snapshot, checkpoints=tuple(keep)), sorted(notes)


def plan_phase(state: PassState, participants: Sequence[Participant]) -> Plan:
    """The planner's plan of this node's catalog as of ``state.observed``, as the participants
    amend it; a reap-only pass (the daemon's reap job) keeps only the reaps."""
    settings = state.settings
    usage = tier_usage(settings)
    # The snapshot allocates a few objects per checkpoint and the plan millions for a big
    # catalog, none in cycles: one pause over both (100k hookless checkpoints: 1.17 -> 0.88 CPU-s).
    with gc_paused():
        snapshot, shared_steps = one_per_step(
            state.index.snapshot([t.name for t in settings.tiers], node=settings.node)
        )
        state.snapshot = owned_by_the_tier(
            snapshot, {t.name for t in settings.tiers if t.shared and t.is_local}
        )
        state.replan = functools.partial(_plan, state, settings.tier_specs(), usage)
        plan = state.replan(state.snapshot)
    for p in participants:
        plan = p.plan(state, plan)
    if shared_steps:
        plan = dataclasses.replace(plan, notes=(*plan.notes, *shared_steps))
    if "retention" not in state.kinds:
        # Reap-only: retention actions wait for their own job.
        reaps = tuple(a for a in plan.actions if a.action in (ActionKind.REAP, ActionKind.PURGE))
        plan = dataclasses.replace(plan, actions=reaps)
    return plan


def _plan(
    state: PassState, specs: Sequence[TierSpec], usage: Mapping[str, TierUsage | None], snapshot: Snapshot
) -> Plan:
    """The planner over ``snapshot``, with this pass's policy and clock."""
    settings = state.settings
    with gc_paused():
        return planner.plan(
            snapshot,
            specs,
            usage,
            state.observed,
            reaper=settings.reaper.to_policy() if "reap" in state.kinds else None,
            max_delete=settings.max_delete,
            force=state.force,
            run=state.run,
            file_now=state.observed_on,
        )


def restrict_phase(state: PassState, participants: Sequence[Participant], plan: Plan) -> Plan:
    for p in participants:
        plan = p.restrict(state, plan)
    return plan
