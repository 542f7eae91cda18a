"""Planner and retention rules: unit tests plus table-driven golden cases (restic style).

Golden cases live in ``tests/golden/planner/*.json``, one file per case: the input (``now``, tiers,
usage, snapshot, options), a hand-written ``expect`` block and the machine-written ``golden`` block
(a readable summary plus the full ``Plan.to_dict()``). Regenerate the golden blocks with::

    CKPTKEEPER_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_planner.py

Regeneration never touches ``expect``, and ``expect`` is asserted in both modes: a regression in the
facts a human wrote down cannot be blessed by regenerating.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import builders
import pytest

from ckptkeeper.core import planner
from ckptkeeper.core.model import (
    Action,
    ActionKind,
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
from ckptkeeper.core.retention import (
    KeepAll,
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepHourly,
    KeepLast,
    KeepMonthly,
    KeepWeekly,
    KeepWithin,
    describe,
    format_duration,
    keeps_nothing,
    rules_for,
    select_union,
)

GOLDEN_DIR = Path(__file__).parent / "golden" / "planner"
UPDATE_GOLDEN = os.environ.get("CKPTKEEPER_UPDATE_GOLDEN") == "1"
T0 = 1_709_510_400.0  # 2024-03-04T00:00:00Z, a Monday
_POLICY_FIELDS = set(TierPolicy.__dataclass_fields__)


# --------------------------------------------------------------------------- helpers


def ckpt(
    step: int,
    *,
    run: str = "a",
    created_at: float | None = None,
    tiers: Sequence[str] = ("hot",),
    nbytes: int = 100,
    **fields: Any,
) -> Checkpoint:
    """``builders.checkpoint`` on this module's clock (one step every 36 s from T0) and defaults."""
    at = T0 + step * 36 if created_at is None else created_at
    return builders.checkpoint(run, step, created_at=at, tiers=tiers, nbytes=nbytes, **fields)


def tier(name: str, **policy: Any) -> TierSpec:
    return builders.tier(name, **policy)


def snap(*cps: Checkpoint, runs: Sequence[Run] = (), unknown: Sequence[str] = ()) -> Snapshot:
    return builders.snapshot(*cps, runs=runs, unknown=unknown, implicit_runs=RunState.FINISHED, last_seen=T0)


def summarize(p: Plan, tier_order: Sequence[str]) -> dict[str, Any]:
    """The plan at a glance: what a reviewer reads in a golden diff."""
    kept: dict[str, list[str]] = {t: [] for t in tier_order}
    for k in p.keep:
        kept.setdefault(k.tier, []).append(f"{k.run}@{k.step}")
    return {
        "kept": {t: v for t, v in kept.items() if v},
        "expired": sorted(
            {f"{a.run}@{a.step}" for a in p.actions if a.rule == "expired"},
            key=lambda s: (s.split("@")[0], int(s.split("@")[1])),
        ),
        "copies": [
            f"{a.run}@{a.step} {a.tier}->{a.to_tier}" for a in p.actions if a.action is ActionKind.COPY
        ],
        "deletes": [f"{a.run}@{a.step} {a.tier}" for a in p.actions if a.action is ActionKind.DELETE],
        "reaps": [f"{a.run}@{a.step} {a.tier} {a.path}" for a in p.actions if a.action is ActionKind.REAP],
        "reclaim_bytes": dict(p.reclaim_bytes),
        "refused": p.refused,
        "notes": list(p.notes),
    }


def keys(actions: Sequence[Action], kind: ActionKind) -> list[tuple[str | None, int | None, str | None]]:
    return [(a.run, a.step, a.tier) for a in actions if a.action is kind]


# --------------------------------------------------------------------------- golden cases


def dump_case(doc: Mapping[str, Any]) -> str:
    """Stable, diff-friendly JSON: one checkpoint / action / keep per line."""

    def dump(value: Any, indent: int) -> str:
        pad = " " * indent
        if (
            isinstance(value, dict)
            and value
            and any(isinstance(v, dict | list) and v for v in value.values())
        ):
            inner = [f"{pad}  {json.dumps(k)}: {dump(v, indent + 2)}" for k, v in value.items()]
            return "{\n" + ",\n".join(inner) + "\n" + pad + "}"
        if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
            inner = [f"{pad}  {json.dumps(v, ensure_ascii=False)}" for v in value]
            return "[\n" + ",\n".join(inner) + "\n" + pad + "]"
        return json.dumps(value, ensure_ascii=False)

    return dump(doc, 0) + "\n"


def load_case(doc: Mapping[str, Any]) -> tuple[Snapshot, list[TierSpec], dict[str, TierUsage | None]]:
    tiers = []
    for t in doc["tiers"]:
        policy = {k: v for k, v in t.items() if k in _POLICY_FIELDS}
        tiers.append(TierSpec(name=t["name"], url=t["url"], policy=TierPolicy(**policy)))
    usage = {name: TierUsage(**u) if u is not None else None for name, u in doc.get("usage", {}).items()}
    s = doc["snapshot"]
    runs = tuple(
        Run(
            name=r["name"],
            state=RunState(r.get("state", "finished")),
            last_seen=float(r.get("last_seen", 0.0)),
            parent=(str(r["parent"][0]), int(r["parent"][1])) if r.get("parent") else None,
        )
        for r in s["runs"]
    )
    cps = tuple(
        Checkpoint(
            run=c["run"],
            step=c["step"],
            name=c.get("name", f"checkpoint-{c['step']}"),
            layout=c.get("layout", "hf"),
            state=CheckpointState(c.get("state", "complete")),
            created_at=float(c["created_at"]),
            last_write=float(c.get("last_write", c["created_at"])),
            bytes=int(c.get("bytes", 0)),
            metrics=c.get("metrics", {}),
            pinned=bool(c.get("pinned", False)),
            tiers=frozenset(c.get("tiers", ())),
        )
        for c in s["checkpoints"]
    )
    artifacts = tuple(Artifact(**a) for a in s.get("artifacts", ()))
    snapshot = Snapshot(
        runs=runs, checkpoints=cps, artifacts=artifacts, unknown_tiers=frozenset(s.get("unknown_tiers", ()))
    )
    return snapshot, tiers, usage


def plan_options(doc: Mapping[str, Any]) -> dict[str, Any]:
    options = dict(doc.get("options", {}))
    if "reaper" in options:
        options["reaper"] = ReaperPolicy(**options["reaper"])
    return options


GOLDEN_CASES = sorted(GOLDEN_DIR.glob("*.json"))


def test_golden_cases_exist() -> None:
    assert len(GOLDEN_CASES) >= 14, GOLDEN_CASES


@pytest.mark.parametrize("path", GOLDEN_CASES, ids=[p.stem for p in GOLDEN_CASES])
def test_golden(path: Path) -> None:
    doc = json.loads(path.read_text())
    snapshot, tiers, usage = load_case(doc)
    p = planner.plan(snapshot, tiers, usage, doc["now"], **plan_options(doc))
    summary = summarize(p, [t.name for t in tiers])
    actual = {"summary": summary, "plan": json.loads(json.dumps(p.to_dict()))}

    for key, want in doc["expect"].items():  # hand-written facts: checked in both modes
        assert summary[key] == want, f"{path.name}: expect.{key}"

    if UPDATE_GOLDEN:
        path.write_text(dump_case({**doc, "golden": actual}))
        return
    assert "golden" in doc, f"{path.name} has no golden block; run with CKPTKEEPER_UPDATE_GOLDEN=1"
    assert actual == doc["golden"], (
        f"{path.name} differs; rerun with CKPTKEEPER_UPDATE_GOLDEN=1 and review the diff"
    )


# --------------------------------------------------------------------------- retention rules


def test_format_duration() -> None:
    assert format_duration(7 * 86400) == "7d"
    assert format_duration(86400 + 12 * 3600) == "1d12h"
    assert format_duration(90) == "1m30s"
    assert format_duration(0) == "0s"
    assert format_duration(1.5) == "1.5s"


def test_rule_reasons_read_like_restic() -> None:
    rules = rules_for(
        TierPolicy(
            keep_last=2,
            keep_best=1,
            metric="eval_loss",
            mode="min",
            keep_every=400,
            keep_within=7 * 86400,
            keep_hourly=1,
            keep_daily=1,
            keep_weekly=1,
            keep_monthly=1,
        ),
        now=T0,
    )
    assert [r.reason for r in rules] == [
        "last 2",
        "best 1 by eval_loss (min)",
        "every 400 steps",
        "within 7d",
        "hourly snapshot",
        "daily snapshot",
        "weekly snapshot",
        "monthly snapshot",
    ]
    assert [r.reason for r in rules_for(TierPolicy(), now=T0)] == ["no rules: keep all"]
    assert describe(rules_for(TierPolicy(keep_last=2, keep_every=10), T0)) == "last 2, every 10 steps"


def test_rules_for_rejects_keep_best_without_metric() -> None:
    with pytest.raises(ValueError, match="metric"):
        rules_for(TierPolicy(keep_best=1), now=T0)
    with pytest.raises(ValueError, match="mode"):
        KeepBest(1, "loss", "median")
    with pytest.raises(ValueError):
        KeepEvery(0)


def test_only_complete_checkpoints_count() -> None:
    cps = [
        ckpt(100),
        ckpt(200),
        ckpt(300, state=CheckpointState.CORRUPT, metrics={"loss": 0.0}),
        ckpt(400, state=CheckpointState.WRITING),
    ]
    assert KeepLast(2).select(cps) == {100: "last 2", 200: "last 2"}
    assert KeepBest(1, "loss").select(cps) == {}
    assert KeepEvery(100).select(cps).keys() == {100, 200}
    assert KeepAll().select(cps).keys() == {100, 200}
    assert KeepWithin(10**9, T0).select(cps).keys() == {100, 200}
    assert KeepDaily(5).select(cps).keys() == {200}


def test_keep_best_ignores_missing_and_nan_and_prefers_newer_on_ties() -> None:
    cps = [
        ckpt(100, metrics={"loss": 1.0}),
        ckpt(200, metrics={}),
        ckpt(300, metrics={"loss": float("nan")}),
        ckpt(400, metrics={"loss": 1.0}),
        ckpt(500, metrics={"loss": 3.0}),
    ]
    assert set(KeepBest(1, "loss", "min").select(cps)) == {400}
    assert set(KeepBest(2, "loss", "min").select(cps)) == {100, 400}
    assert set(KeepBest(1, "loss", "max").select(cps)) == {500}
    assert set(KeepBest(10, "loss").select(cps)) == {100, 400, 500}


def test_keep_last_zero_and_within_anchor_on_now() -> None:
    cps = [ckpt(100, created_at=T0 - 3 * 86400), ckpt(200, created_at=T0 - 3600)]
    assert KeepLast(0).select(cps) == {}
    assert set(KeepWithin(86400, now=T0).select(cps)) == {200}
    # Anchored on now, not on the newest checkpoint (restic's choice): an old run keeps nothing.
    assert KeepWithin(86400, now=T0 + 30 * 86400).select(cps) == {}


def test_calendar_buckets_are_utc_and_pick_highest_step() -> None:
    # Sunday 23:30 and Monday 00:30 UTC straddle a day and an ISO-week boundary.
    sun = T0 - 1800
    mon = T0 + 1800
    cps = [ckpt(10, created_at=sun - 7200), ckpt(20, created_at=sun), ckpt(30, created_at=mon)]
    assert set(KeepDaily(2).select(cps)) == {20, 30}
    assert set(KeepWeekly(2).select(cps)) == {20, 30}
    assert set(KeepHourly(3).select(cps)) == {10, 20, 30}
    assert set(KeepMonthly(1).select(cps)) == {30}
    # A resumed run whose clock went backwards: the bucket's newest *step* represents it.
    skew = [ckpt(100, created_at=mon + 60), ckpt(200, created_at=mon)]
    assert set(KeepDaily(1).select(skew)) == {200}


def test_select_union_collects_every_reason() -> None:
    cps = [ckpt(s) for s in (100, 200, 300, 400)]
    got = select_union([KeepLast(1), KeepEvery(200)], cps)
    assert got == {400: ("last 1", "every 200 steps"), 200: ("every 200 steps",)}


def test_keeps_nothing() -> None:
    assert keeps_nothing(rules_for(TierPolicy(keep_last=0, keep_daily=0), T0))
    assert not keeps_nothing(rules_for(TierPolicy(keep_last=0, keep_every=5), T0))
    assert not keeps_nothing(rules_for(TierPolicy(), T0))


# --------------------------------------------------------------------------- planner


HOT_WARM_COLD = [
    tier("hot", keep_last=2, keep_best=1, metric="eval_loss", mode="min"),
    tier("warm", keep_last=5),
    tier("cold", keep_every=400),
]


def worked_example() -> Snapshot:
    return snap(
        *(ckpt(s, metrics={"eval_loss": 0.5 if s == 300 else 1.0 + s / 1000}) for s in range(100, 1300, 100))
    )


def test_worked_example_reasons_and_order() -> None:
    p = planner.plan(worked_example(), HOT_WARM_COLD, {}, T0)
    kinds = [a.action for a in p.actions]
    assert kinds == sorted(kinds, key=[ActionKind.COPY, ActionKind.DELETE, ActionKind.REAP].index)
    by = {(a.action, a.step, a.tier, a.to_tier): a for a in p.actions}
    assert by[(ActionKind.COPY, 800, "hot", "warm")].reason == (
        "demote: not in hot keep-set (last 2, best 1 by eval_loss (min)), kept by warm (last 5)"
    )
    assert by[(ActionKind.COPY, 400, "hot", "cold")].reason == (
        "demote: not in hot keep-set (last 2, best 1 by eval_loss (min)), not in warm keep-set (last 5), "
        "kept by cold (every 400 steps)"
    )
    assert by[(ActionKind.DELETE, 100, "hot", None)].reason == "expired: no tier keeps it"
    assert by[(ActionKind.DELETE, 800, "hot", None)].reason == "moved to warm"
    keep = {(k.step, k.tier): k.reasons for k in p.keep}
    assert keep[(1200, "hot")] == ("last 2", "newest complete checkpoint of run")
    assert keep[(300, "hot")] == ("best 1 by eval_loss (min)",)
    assert p.reclaim_bytes == {"hot": 900, "warm": 0, "cold": 0}
    assert p.refused is None


def test_plan_is_independent_of_input_order() -> None:
    s = worked_example()
    shuffled = list(s.checkpoints)
    random.Random(7).shuffle(shuffled)
    assert planner.plan(s, HOT_WARM_COLD, {}, T0) == planner.plan(
        replace(s, checkpoints=tuple(shuffled)), HOT_WARM_COLD, {}, T0
    )


def test_replicate_reason() -> None:
    tiers = [tier("hot", keep_last=1), tier("cold", keep_last=1, replicate=True)]
    p = planner.plan(snap(ckpt(100)), tiers, {}, T0)
    (a,) = p.actions
    assert (a.action, a.tier, a.to_tier, a.reason, a.rule) == (
        ActionKind.COPY,
        "hot",
        "cold",
        "replicate to cold (last 1)",
        "replicate",
    )
    assert {(k.tier, k.reasons) for k in p.keep} == {
        ("hot", ("last 1", "newest complete checkpoint of run")),
        ("cold", ("last 1", "replicate", "newest complete checkpoint of run")),
    }


def test_redundant_copy_in_slower_tier_is_deleted_once_resident_copy_exists() -> None:
    tiers = [tier("hot", keep_last=1), tier("cold", keep_every=1000)]
    p = planner.plan(snap(ckpt(100, tiers=("hot", "cold")), ckpt(200)), tiers, {}, T0)
    assert keys(p.actions, ActionKind.DELETE) == [("a", 100, "hot"), ("a", 100, "cold")]
    p = planner.plan(snap(ckpt(100, tiers=("hot", "cold")), ckpt(200, tiers=("hot", "cold"))), tiers, {}, T0)
    (a,) = [a for a in p.actions if a.step == 200]
    assert (a.tier, a.reason, a.rule) == ("cold", "not kept in cold: resides in hot", "redundant")


def test_watermark_reason_and_projection_counts_expiries() -> None:
    tiers = [tier("hot", keep_last=3, high_watermark=0.8, low_watermark=0.5), tier("warm")]
    cps = [ckpt(s) for s in (100, 200, 300, 400, 500)]
    # 100 and 200 expire anyway (500 bytes -> 300 of 500 used is still > 50%): demote 300 only.
    p = planner.plan(snap(*cps), tiers, {"hot": TierUsage(500, 500)}, T0)
    copies = [a for a in p.actions if a.action is ActionKind.COPY]
    assert [(a.step, a.reason, a.rule) for a in copies] == [
        (100, "demote: not in hot keep-set (last 3), kept by warm (no rules: keep all)", "demote"),
        (200, "demote: not in hot keep-set (last 3), kept by warm (no rules: keep all)", "demote"),
        (300, "demote: hot above high watermark 80% (usage 100%)", "watermark"),
    ]
    keep = {(k.step, k.tier): k.reasons for k in p.keep}
    assert keep[(300, "warm")] == ("no rules: keep all", "demoted: hot above high watermark 80%")
    # Expiries alone bring it under: nothing demoted.
    p = planner.plan(
        snap(*cps),
        [tier("hot", keep_last=3, high_watermark=0.8, low_watermark=0.5)],
        {"hot": TierUsage(500, 500)},
        T0,
    )
    assert keys(p.actions, ActionKind.COPY) == []


def test_watermark_triggered_by_projected_usage() -> None:
    # hot is at 60 % now, but copies into it... cannot happen (no promotion); warm receives moves.
    tiers = [tier("hot", keep_last=1), tier("warm", high_watermark=0.5, low_watermark=0.3), tier("cold")]
    cps = [ckpt(s) for s in (100, 200, 300, 400)]
    p = planner.plan(snap(*cps), tiers, {"warm": TierUsage(1000, 400)}, T0)
    # warm: 400 + 300 incoming = 700 > 500 -> demote oldest until <= 300: all three go to cold.
    assert keys(p.actions, ActionKind.COPY) == [("a", 100, "hot"), ("a", 200, "hot"), ("a", 300, "hot")]
    assert {a.to_tier for a in p.actions if a.action is ActionKind.COPY} == {"cold"}
    assert "projected 70%" in p.actions[0].reason
    assert p.notes == (
        "warm still above low watermark 30% after demoting every checkpoint it may"
        " (pinned ones, active runs' newest and parents of active runs stay)",
    )


def test_watermark_pressure_moves_newest_of_ended_runs_after_every_unprotected_one() -> None:
    """A node that ran many jobs: their newest checkpoints alone fill hot. Unprotected ones go
    first; then the newest of ended runs, oldest first, as moves (still kept in warm); pinned
    checkpoints, the newest of an active run and the parent of an active run never move."""
    tiers = [tier("hot", keep_last=2, high_watermark=0.8, low_watermark=0.5), tier("warm")]
    cps = [
        ckpt(100, run="done-old", created_at=T0 + 1),
        ckpt(200, run="done-old", created_at=T0 + 2),  # newest of a finished run, oldest such
        ckpt(100, run="failed", created_at=T0 + 3),  # newest of a failed run
        ckpt(100, run="done-new", created_at=T0 + 4),  # newest of a finished run, younger
        ckpt(100, run="pinned", created_at=T0 + 0, pinned=True),  # oldest of all, but pinned
        ckpt(100, run="parent", created_at=T0 + 0.5),  # resumed from by the active run
        ckpt(100, run="live", created_at=T0 + 0.2),  # newest of an active run
    ]
    runs = [
        Run("done-old", RunState.FINISHED, T0),
        Run("failed", RunState.FAILED, T0),
        Run("done-new", RunState.FINISHED, T0),
        Run("pinned", RunState.FINISHED, T0),
        Run("parent", RunState.FINISHED, T0),
        Run("live", RunState.ACTIVE, T0, parent=("parent", 100)),
    ]
    # 700 of 800 bytes used (87.5 %): must get to 400. done-old@100 is the only unprotected
    # checkpoint (600 left), then done-old@200 (500) and failed@100 (400): done-new stays.
    p = planner.plan(snap(*cps, runs=runs), tiers, {"hot": TierUsage(800, 700)}, T0 + 10)
    copies = [(a.run, a.step, a.tier, a.to_tier, a.rule) for a in p.actions if a.action is ActionKind.COPY]
    assert copies == [
        ("done-old", 100, "hot", "warm", "watermark"),
        ("done-old", 200, "hot", "warm", "watermark"),
        ("failed", 100, "hot", "warm", "watermark"),
    ]
    deletes = [(a.run, a.step, a.tier, a.reason, a.rule) for a in p.actions if a.action is ActionKind.DELETE]
    assert deletes == [
        ("done-old", 100, "hot", "moved to warm", "moved"),
        ("done-old", 200, "hot", "moved to warm", "moved"),
        ("failed", 100, "hot", "moved to warm", "moved"),
    ]
    moved_protected = next(
        a for a in p.actions if (a.run, a.step, a.action) == ("failed", 100, ActionKind.COPY)
    )
    assert moved_protected.reason == (
        "demote: hot above high watermark 80% (usage 88%): newest checkpoint of ended run, moved not deleted"
    )
    keep = {(k.run, k.step): (k.tier, k.reasons) for k in p.keep}
    assert keep[("failed", 100)] == (
        "warm",
        ("no rules: keep all", "demoted: hot above high watermark 80%", planner.NEWEST),
    )
    for stays in ("done-new", "pinned", "parent", "live"):
        assert keep[(stays, 100)][0] == "hot", stays
    assert p.notes == ()
    assert p.refused is None  # moves are not deletions: max_delete does not count them

    # Not enough even so: everything that may move has moved, and the operator is told why.
    p = planner.plan(snap(*cps, runs=runs), tiers, {"hot": TierUsage(1000, 990)}, T0 + 10)
    moved = {(a.run, a.step) for a in p.actions if a.action is ActionKind.COPY}
    assert moved == {("done-old", 100), ("done-old", 200), ("failed", 100), ("done-new", 100)}
    assert p.notes == (
        "hot still above low watermark 50% after demoting every checkpoint it may"
        " (pinned ones, active runs' newest and parents of active runs stay)",
    )


def test_watermark_pressure_moves_a_protected_checkpoint_no_rule_places() -> None:
    """The newest of an ended run that hot's rules do not keep (it only stays as protected) still
    leaves under pressure, as a move: a copy in warm, then the delete from hot."""
    tiers = [tier("hot", keep_every=1000, high_watermark=0.5), tier("warm", keep_every=1000)]
    p = planner.plan(snap(ckpt(100)), tiers, {"hot": TierUsage(100, 100)}, T0)
    assert [(a.action, a.tier, a.to_tier, a.reason) for a in p.actions] == [
        (
            ActionKind.COPY,
            "hot",
            "warm",
            "demote: hot above high watermark 50% (usage 100%): newest checkpoint of ended run, moved not deleted",
        ),
        (ActionKind.DELETE, "hot", None, "moved to warm"),
    ]


def test_watermark_never_demotes_into_unknown_tier() -> None:
    tiers = [tier("hot", high_watermark=0.5), tier("warm")]
    p = planner.plan(snap(ckpt(100), ckpt(200)), tiers, {"hot": TierUsage(100, 90)}, T0)
    assert keys(p.actions, ActionKind.COPY) == [("a", 100, "hot")]
    p = planner.plan(snap(ckpt(100), ckpt(200), unknown=["warm"]), tiers, {"hot": TierUsage(100, 90)}, T0)
    assert p.actions == ()
    assert p.notes == ("hot above high watermark 50% but warm is unknown: no demotion",)


def test_watermark_skips_held_checkpoints() -> None:
    # 100 is the oldest, but it also sits in cold, whose listing failed: it cannot leave hot this
    # round, so demoting it would free nothing. The next oldest goes instead.
    tiers = [tier("hot", high_watermark=0.5, low_watermark=0.4), tier("warm"), tier("cold", keep_every=1000)]
    cps = [ckpt(100, tiers=("hot", "cold")), ckpt(200), ckpt(300)]
    live = [Run("a", RunState.ACTIVE, T0)]  # its newest, 300, stays under pressure too
    p = planner.plan(snap(*cps, runs=live, unknown=["cold"]), tiers, {"hot": TierUsage(1000, 550)}, T0)
    assert keys(p.actions, ActionKind.COPY) == [("a", 200, "hot")]
    assert keys(p.actions, ActionKind.DELETE) == [("a", 200, "hot")]


def test_unknown_tier_is_never_touched_and_blocks_deletes() -> None:
    tiers = [tier("hot", keep_last=1), tier("cold", keep_every=200)]
    cps = [ckpt(100, tiers=("hot", "cold")), ckpt(200), ckpt(300), ckpt(400)]
    p = planner.plan(snap(*cps, unknown=["cold"]), tiers, {}, T0)
    assert all("cold" not in (a.tier, a.to_tier) for a in p.actions)
    assert keys(p.actions, ActionKind.DELETE) == [("a", 300, "hot")]
    held = {(k.step, k.tier): k.reasons for k in p.keep}
    assert held[(100, "hot")] == ("held: cold unknown (listing failed)",)
    assert held[(200, "hot")] == ("held: cold unknown (listing failed)",)
    # Only in an unknown tier: no source to copy from, nothing planned at all.
    p = planner.plan(snap(ckpt(100, tiers=("cold",)), ckpt(200), unknown=["cold"]), tiers, {}, T0)
    assert p.actions == ()


def test_unconfigured_tier_names_are_ignored() -> None:
    tiers = [tier("hot", keep_last=1)]
    p = planner.plan(snap(ckpt(100, tiers=("hot", "gone")), ckpt(200)), tiers, {}, T0)
    assert keys(p.actions, ActionKind.DELETE) == [("a", 100, "hot")]


def test_protected_without_any_copy_plans_nothing() -> None:
    p = planner.plan(snap(ckpt(100, tiers=())), [tier("hot", keep_last=0)], {}, T0)
    assert p.actions == ()


def test_max_delete_counts_expiries_not_moves() -> None:
    tiers = [tier("hot", keep_last=1), tier("warm", keep_last=4)]
    cps = [ckpt(s) for s in (100, 200, 300, 400, 500)]
    p = planner.plan(snap(*cps), tiers, {}, T0, max_delete=1)  # 3 moves + 1 expiry
    assert p.refused is None
    assert len(keys(p.actions, ActionKind.DELETE)) == 4
    p = planner.plan(snap(*cps), tiers, {}, T0, max_delete=0)
    assert p.refused == "would delete 1 checkpoints (max_delete=0); use --force"
    assert keys(p.actions, ActionKind.DELETE) == []
    assert len(keys(p.actions, ActionKind.COPY)) == 3
    assert p.reclaim_bytes == {"hot": 0, "warm": 0}


def test_empty_policy_can_be_forced() -> None:
    tiers = [tier("hot", keep_last=0)]
    p = planner.plan(snap(ckpt(100), ckpt(200)), tiers, {}, T0, force=True)
    assert p.refused is None
    assert keys(p.actions, ActionKind.DELETE) == [("a", 100, "hot")]


def test_planner_vetoes_reaps_of_protected_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reaper already spares pinned checkpoints; the planner checks again (defence in depth).
    from ckptkeeper.core.reaper import ReapDecision

    def reckless(
        snapshot: Snapshot, tiers: Any, policy: Any, now: float, file_now: Any = None
    ) -> ReapDecision:
        reaps = tuple(
            Action(
                ActionKind.REAP, "oops", run=c.run, step=c.step, tier="hot", path=c.rel_path, bytes=c.bytes
            )
            for c in snapshot.checkpoints
        )
        return ReapDecision(reaps, frozenset(c.key for c in snapshot.checkpoints), {})

    from ckptkeeper.core import reaps as core_reaps

    monkeypatch.setattr(core_reaps, "plan_reaps", reckless)
    cps = (ckpt(100, pinned=True), ckpt(200), ckpt(300))
    # A failed run: the planner only shows the reaper what it may judge (not live complete ones).
    p = planner.plan(
        snap(*cps, runs=[Run("a", RunState.FAILED, T0)]), [tier("hot")], {}, T0, reaper=ReaperPolicy()
    )
    assert keys(p.actions, ActionKind.REAP) == [("a", 200, "hot")]
    assert p.notes == ("not reaping a@100: pinned", "not reaping a@300: newest complete checkpoint of run")
    assert {k.step for k in p.keep} == {100, 300}


def test_reaps_count_for_max_delete_and_reclaim() -> None:
    runs = [Run("dead", RunState.FAILED, T0)]
    cps = [ckpt(s, run="dead") for s in (100, 200, 300)]
    policy = ReaperPolicy(keep_last_of_failed=1)
    p = planner.plan(snap(*cps, runs=runs), [tier("hot")], {}, T0 + 86400, reaper=policy)
    assert keys(p.actions, ActionKind.REAP) == [("dead", 100, "hot"), ("dead", 200, "hot")]
    assert p.reclaim_bytes == {"hot": 200}
    p = planner.plan(snap(*cps, runs=runs), [tier("hot")], {}, T0 + 86400, reaper=policy, max_delete=1)
    assert p.refused == "would delete 2 checkpoints (max_delete=1); use --force"
    assert p.actions == ()


def test_duplicate_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate checkpoint"):
        planner.plan(snap(ckpt(100), ckpt(100)), [tier("hot")], {}, T0)
    with pytest.raises(ValueError, match="duplicate tier"):
        planner.plan(snap(ckpt(100)), [tier("hot"), tier("hot")], {}, T0)


def test_empty_snapshot_and_no_tiers() -> None:
    assert planner.plan(snap(), [tier("hot")], {}, T0) == Plan((), (), {"hot": 0})
    assert planner.plan(snap(ckpt(100)), [], {}, T0).actions == ()


def test_plan_to_dict_matches_design_json_shape() -> None:
    p = planner.plan(worked_example(), HOT_WARM_COLD, {}, T0)
    doc = json.loads(json.dumps(p.to_dict()))
    assert set(doc) >= {"actions", "keep", "reclaim_bytes"}
    assert set(doc["actions"][0]) >= {"action", "run", "step", "tier", "to_tier", "path", "bytes", "reason"}
    assert doc["actions"][0]["path"] == "a/checkpoint-400"
    assert set(doc["keep"][0]) == {"run", "step", "tier", "reasons"}


def test_planning_leaves_the_gc_alone() -> None:
    """GC tuning is the caller's business (ckptkeeper.util.gc.gc_paused, tests/test_util_gc.py):
    plan() neither enables, disables, freezes nor thaws anything."""
    import gc

    tiers = [tier("hot", keep_last=1), tier("warm")]
    cps = snap(ckpt(100), ckpt(200))
    keepsake = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        planner.plan(cps, tiers, {}, T0)
        assert gc.get_freeze_count() > frozen // 2  # not thawed (a freed frozen object may leave)
        assert gc.isenabled()
        gc.disable()
        planner.plan(cps, tiers, {}, T0)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    assert keepsake
