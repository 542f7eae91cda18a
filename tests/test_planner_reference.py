"""The planner against a slow, obviously-correct reference (tests/reference_planner.py).

``plan()`` is fast thanks to caches, plain-checkpoint templates, a reduced reaper view and
incremental watermark bookkeeping; the reference has none of them. On random small catalogs,
policies, usages, unknown tiers, reaper settings and ``now``, both must give the same plan: the
same actions (kind, run, step, tier, destination, then every field and reason), the same keep set
(run, step, tier, then the reasons), the same refusal, reclaim figures and notes.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import tier_policies

from ckptkeeper.core.model import (
    Artifact,
    Checkpoint,
    CheckpointState,
    Plan,
    ReaperPolicy,
    Run,
    RunState,
    Snapshot,
    TierPolicy,
    TierSpec,
    TierUsage,
)
from ckptkeeper.core.planner import plan
from tests.reference_planner import reference_plan

T0 = 1_709_510_400.0
HOUR = 3600.0
DAY = 86400.0
TIER_NAMES = ("hot", "warm", "cold")
RUN_NAMES = ("a", "b", "c")


def policies(first: bool) -> st.SearchStrategy[TierPolicy]:
    return tier_policies(
        first,
        keep_last_max=3,
        keep_every=(200, 300),
        keep_within=(0.0, HOUR, DAY),
        bucket_max=2,
        high_watermarks=(0.3, 0.5, 0.8),
        low_fraction=0.5,
        replicate_odds=2,
    )


@st.composite
def inputs(draw: st.DrawFn) -> dict[str, object]:
    ntiers = draw(st.sampled_from([2, 3, 1, 3]))
    names = TIER_NAMES[:ntiers]
    tiers = tuple(TierSpec(n, f"/t/{n}", draw(policies(i == 0))) for i, n in enumerate(names))
    # Few, coarse draws per checkpoint (2000 examples must stay quick). Where it is: mostly just hot
    # (where checkpoints are born), else any subset of the tiers and "gone" (no longer configured).
    where = [frozenset(n for b, n in enumerate((*names, "gone")) if mask >> b & 1) for mask in range(16)]
    location = st.integers(0, 15).map(lambda mask: where[mask] if mask < 12 else frozenset({names[0]}))
    states = [CheckpointState.COMPLETE] * 5 + [CheckpointState.WRITING, CheckpointState.CORRUPT]
    run_names = draw(st.lists(st.sampled_from(RUN_NAMES), min_size=1, max_size=3, unique=True))
    checkpoints: list[Checkpoint] = []
    for run in run_names:
        scale = draw(st.sampled_from([600.0, HOUR, DAY]))
        for step in draw(st.lists(st.integers(1, 8), max_size=5, unique=True)):
            odd = draw(st.integers(0, 15))  # rare traits, one draw: clock gone back, stale write, pinned
            created = T0 + step * scale - (2.5 * scale if odd < 4 else 0.0)  # watermarks go by time
            loss = draw(st.integers(-1, 5))
            checkpoints.append(
                Checkpoint(
                    run=run,
                    step=step * 100,
                    name=f"checkpoint-{step * 100}",
                    layout="hf",
                    state=states[draw(st.integers(0, 6))],
                    created_at=created,
                    bytes=draw(st.integers(1, 100)),
                    metrics={"loss": loss / 2} if loss >= 0 else {},
                    pinned=odd == 2,
                    tiers=draw(location),
                    last_write=created + (10 * DAY if odd == 3 else 0.0),
                )
            )
    if draw(st.booleans()):
        checkpoints.reverse()  # input order must not matter
    keys = [c.key for c in checkpoints]
    runs = []
    for run in run_names:
        others = [k for k in keys if k[0] != run]
        parent = draw(st.sampled_from(others)) if others and draw(st.booleans()) else None
        runs.append(Run(run, draw(st.sampled_from([RunState.ACTIVE, *RunState])), T0, parent=parent))
    artifacts = tuple(
        Artifact(
            draw(st.sampled_from(names)),
            f"{run}/tmp-{i}.part",
            "tmp-file",
            draw(st.integers(1, 50)),
            T0 + draw(st.sampled_from([0.0, 20 * DAY])),
            run=run,
        )
        for i, run in enumerate(draw(st.lists(st.sampled_from(run_names), max_size=2)))
    )
    unknown: frozenset[str] = frozenset()
    if draw(st.sampled_from([False, False, True])):
        unknown = frozenset({draw(st.sampled_from(names))})
    usage: dict[str, TierUsage | None] = {}
    for n in names:
        if draw(st.booleans()):
            total = draw(st.integers(100, 800))
            usage[n] = TierUsage(total, draw(st.integers(0, total) | st.integers(total // 2, total)))
        else:
            usage[n] = None
    if ntiers > 1 and draw(st.integers(0, 2)) == 0:
        # Pressure: the hot tier is above its high watermark, so demotions happen (oldest first).
        high = draw(st.sampled_from([0.3, 0.5]))
        hot = replace(
            tiers[0].policy, high_watermark=high, low_watermark=draw(st.sampled_from([None, high / 2]))
        )
        tiers = (replace(tiers[0], policy=hot), *tiers[1:])
        total = draw(st.integers(100, 400))
        usage[names[0]] = TierUsage(total, draw(st.integers(int(high * total) + 1, total)))
    reaper = None
    if draw(st.booleans()):
        reaper = ReaperPolicy(
            failed_after=draw(st.sampled_from([HOUR, 30 * DAY])),
            partial_after=draw(st.sampled_from([HOUR, 30 * DAY])),
            keep_last_of_failed=draw(st.integers(0, 2)),
        )
    return {
        "snapshot": Snapshot(tuple(runs), tuple(checkpoints), artifacts, unknown),
        "tiers": tiers,
        "usage": usage,
        "now": T0 + draw(st.sampled_from([0.0, 0.5 * DAY, 3 * DAY, 40 * DAY])),
        "reaper": reaper,
        "max_delete": draw(st.sampled_from([0, 3, 100])),
        "force": draw(st.booleans()),
        "run": draw(st.none() | st.sampled_from(run_names)),
    }


def _ids(p: Plan) -> list[tuple[object, ...]]:
    return [(a.action, a.run, a.step, a.tier, a.to_tier) for a in p.actions]


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs())
def test_plan_matches_the_reference_planner(kw: dict[str, object]) -> None:
    snapshot, tiers, usage, now = kw.pop("snapshot"), kw.pop("tiers"), kw.pop("usage"), kw.pop("now")
    real = plan(snapshot, tiers, usage, now, **kw)  # type: ignore[arg-type]
    ref = reference_plan(snapshot, tiers, usage, now, **kw)  # type: ignore[arg-type]
    # Coarse to fine, so a failure names the first thing that differs.
    assert _ids(real) == _ids(ref)
    assert [(k.run, k.step, k.tier) for k in real.keep] == [(k.run, k.step, k.tier) for k in ref.keep]
    assert real.refused == ref.refused
    assert real.actions == ref.actions
    assert real.keep == ref.keep
    assert real.reclaim_bytes == ref.reclaim_bytes
    assert real.notes == ref.notes
