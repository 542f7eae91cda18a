"""Step 1 of a plan: the reaper's verdicts (:func:`ckptkeeper.core.reaper.plan_reaps`), minus what
the planner's own guarantees forbid. Reaped checkpoints leave retention entirely."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ckptkeeper.core.model import (
    Action,
    Checkpoint,
    CheckpointState,
    ReaperPolicy,
    RunState,
    Snapshot,
    TierSpec,
)
from ckptkeeper.core.reaper import plan_reaps
from ckptkeeper.core.runs import Protections, RunCheckpoints, protection

__all__ = ["Reaps", "reaper_view", "reaps"]

_COMPLETE = CheckpointState.COMPLETE

ReaperReasons = Mapping[tuple[str, int], tuple[str, ...]]
"""(run, step) -> why the reaper spared a checkpoint it looked at."""


class Reaps:
    """What the reaper decided, as the rest of the plan needs it."""

    __slots__ = ("actions", "keep_reasons", "reaped_steps")

    def __init__(
        self,
        actions: list[Action] | None = None,
        reaped: set[tuple[str, int]] | None = None,
        keep_reasons: ReaperReasons | None = None,
    ) -> None:
        self.actions: list[Action] = actions or []
        """REAP actions (protected checkpoints and unknown tiers dropped), not sorted yet."""
        self.keep_reasons: ReaperReasons = keep_reasons or {}
        steps: defaultdict[str, set[int]] = defaultdict(set)
        for run, step in reaped or ():
            steps[run].add(step)
        self.reaped_steps: Mapping[str, set[int]] = steps
        """run -> reaped steps: those leave retention."""


def reaps(
    snapshot: Snapshot,
    by_run: Mapping[str, RunCheckpoints],
    tiers: Sequence[TierSpec],
    policy: ReaperPolicy | None,
    now: float,
    protections: Protections,
    unknown: frozenset[int],
    notes: list[str],
    file_now: Mapping[str, float] | None = None,
) -> Reaps:
    """Ask the reaper (if ``policy`` is given), then drop what the planner's own guarantees forbid
    (defence in depth): reaps of a protected checkpoint or in an unknown tier. ``file_now``: each
    tier's filesystem clock (:func:`plan_reaps`)."""
    if policy is None:
        return Reaps()
    decision = plan_reaps(reaper_view(snapshot, by_run), tiers, policy, now, file_now)
    unknown_names = {tiers[i].name for i in unknown}
    blocked: dict[tuple[str, int], list[str]] = {}
    actions: list[Action] = []
    for a in decision.actions:
        why = protection(protections, a.run, a.step)
        if why is not None and a.run is not None and a.step is not None:
            blocked[(a.run, a.step)] = why
            continue
        if a.tier in unknown_names:
            continue
        actions.append(a)
    for (run, step), why in sorted(blocked.items()):
        notes.append(f"not reaping {run}@{step}: {', '.join(why)}")
    return Reaps(actions, set(decision.reaped) - blocked.keys(), decision.keep_reasons)


def reaper_view(snapshot: Snapshot, by_run: Mapping[str, RunCheckpoints]) -> Snapshot:
    """The part of the snapshot the reaper's verdicts depend on, the same decision at a fraction
    of the cost (1M checkpoints: 4 s -> 0.2 s, bench/planning.py).

    ``plan_reaps`` says nothing about a complete checkpoint of a live run (retention's business,
    see :class:`ckptkeeper.core.reaper.ReapDecision`); such a checkpoint only matters to it as a spared
    path an artifact may sit in. So it gets every checkpoint of failed and stale runs, every
    incomplete one, and the complete ones of live runs that hold an artifact, run by run
    (``plan_reaps`` sorts them by (run, step) anyway).
    """
    dead = {r.name for r in snapshot.runs if r.state is RunState.FAILED or r.state is RunState.STALE}
    holders: set[str] = set()
    for a in snapshot.artifacts:
        parts = a.path.rstrip("/").split("/")
        holders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    kept: list[Checkpoint] = []
    for name, checkpoints in by_run.items():
        if name in dead:
            kept.extend(checkpoints.checkpoints)
        elif holders:
            kept.extend(
                c
                for c in checkpoints.checkpoints
                if c.state is not _COMPLETE or c.rel_path.rstrip("/") in holders
            )
        else:
            kept.extend(checkpoints.incomplete)
    if len(kept) == len(snapshot.checkpoints):
        return snapshot
    return replace(snapshot, checkpoints=tuple(kept))
