"""The planner shows the reaper only what its verdicts depend on (a 20x speed-up at 1M checkpoints,
bench/planning.py); the reap decision must be exactly the one the full snapshot gives."""

from __future__ import annotations

import itertools

from ckptkeeper.core.model import (
    Artifact,
    Checkpoint,
    CheckpointState,
    ReaperPolicy,
    Run,
    RunState,
    Snapshot,
    TierPolicy,
    TierSpec,
)
from ckptkeeper.core.reaper import plan_reaps
from ckptkeeper.core.reaps import reaper_view
from ckptkeeper.core.runs import group_by_run

NOW = 1_800_000_000.0
TIERS = [TierSpec("hot", "/hot", TierPolicy(keep_last=2)), TierSpec("warm", "/warm", TierPolicy())]


def _snapshot() -> Snapshot:
    runs = []
    cps = []
    states = [RunState.ACTIVE, RunState.FINISHED, RunState.FAILED, RunState.STALE]
    for r, (state, age) in enumerate(itertools.product(states, (600.0, 3 * 86400.0))):
        name = f"run{r}"
        runs.append(Run(name, state, NOW - age))
        for i in range(6):
            cstate = [CheckpointState.COMPLETE] * 4 + [CheckpointState.WRITING, CheckpointState.CORRUPT]
            cps.append(
                Checkpoint(
                    name,
                    (i + 1) * 100,
                    f"ckpt-{(i + 1) * 100}",
                    "hf",
                    cstate[(i + r) % 6],
                    NOW - age - (6 - i) * 3600,
                    bytes=10,
                    pinned=(i == 1 and r % 3 == 0),
                    tiers=frozenset({"hot"} if i % 2 else {"hot", "warm"}),
                    last_write=NOW - age - (6 - i) * 3600,
                )
            )
    cps.append(
        Checkpoint(
            "ghost", 100, "ckpt-100", "hf", CheckpointState.COMPLETE, NOW - 9e4, tiers=frozenset({"hot"})
        )
    )
    artifacts = (
        Artifact("hot", "run0/ckpt-300/tmp.part", "tmp-file", 5, NOW - 9e4, run="run0"),  # inside a live one
        Artifact("hot", "run1/ckpt-200/x.tmp", "tmp-file", 5, NOW - 9e4, run="run1"),
        Artifact("hot", "run5/ckpt-100/.metadata.tmp", "metadata-tmp", 5, NOW - 9e4, run="run5"),
        Artifact("hot", "run2/orphan.tmp", "tmp-file", 5, NOW - 9e4, run="run2"),
    )
    return Snapshot(runs=tuple(runs), checkpoints=tuple(cps), artifacts=artifacts)


def test_reaper_view_gives_the_same_decision() -> None:
    snap = _snapshot()
    view = reaper_view(snap, group_by_run(snap.checkpoints))
    assert len(view.checkpoints) < len(snap.checkpoints)
    assert plan_reaps(view, TIERS, ReaperPolicy(), NOW) == plan_reaps(snap, TIERS, ReaperPolicy(), NOW)
