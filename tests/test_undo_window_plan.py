"""The undo window in the pure planner (:mod:`ckptkeeper.core.trash`): values in, plan out."""

from __future__ import annotations

import dataclasses

from builders import checkpoint, run, snapshot, tier

from ckptkeeper.core import planner
from ckptkeeper.core.model import ActionKind, ReaperPolicy, RunState, TierUsage, TrashEntry

DAY = 86400.0
NOW = 1_800_000_000.0


def entry(
    step: int, deleted_at: float, *, tier_name: str = "hot", node: str = "", nbytes: int = 100
) -> TrashEntry:
    return TrashEntry(
        tier=tier_name,
        path=f".ckptkeeper-trash/{int(deleted_at * 1000)}-00000000000{step % 10}",
        run="r",
        step=step,
        name=f"checkpoint-{step}",
        bytes=nbytes,
        deleted_at=deleted_at,
        node=node,
    )


def ckpts(*steps: int) -> list:
    return [
        checkpoint("r", s, created_at=NOW - 1000 + s, nbytes=100, version=f"v{s}", tiers=["hot"])
        for s in steps
    ]


def test_expiries_and_reaps_of_complete_checkpoints_go_to_trash() -> None:
    tiers = [tier("hot", keep_last=1, undo_window=DAY)]
    failed = snapshot(*ckpts(100, 200, 300), runs=[run("r", RunState.FAILED, last_seen=NOW)])
    p = planner.plan(failed, tiers, {}, NOW, reaper=ReaperPolicy(keep_last_of_failed=1))
    destructive = [a for a in p.actions if a.action is not ActionKind.COPY]
    assert destructive and all(a.trash and "to trash for 1d" in a.reason for a in destructive), destructive
    assert p.reclaim_bytes["hot"] == 0
    assert all(a.to_dict()["to_trash"] for a in destructive)


def test_window_not_ended_keeps_the_entry_and_ended_purges_it() -> None:
    tiers = [tier("hot", keep_last=1, undo_window=DAY)]
    snap = dataclasses.replace(
        snapshot(*ckpts(300), implicit_runs=RunState.ACTIVE, last_seen=NOW),
        trash=(entry(100, NOW - DAY - 1), entry(200, NOW - 10)),
    )
    p = planner.plan(snap, tiers, {}, NOW)
    purges = [a for a in p.actions if a.action is ActionKind.PURGE]
    assert [(a.step, a.reason, a.rule) for a in purges] == [
        (100, "undo window 1d ended", "undo-window-ended")
    ]
    assert p.reclaim_bytes["hot"] == 100


def test_pressure_purges_everything_and_expiries_skip_the_trash() -> None:
    tiers = [tier("hot", keep_last=1, undo_window=7 * DAY, high_watermark=0.9, low_watermark=0.8)]
    snap = dataclasses.replace(
        snapshot(*ckpts(250, 300), implicit_runs=RunState.ACTIVE, last_seen=NOW),
        trash=(entry(100, NOW - 10), entry(200, NOW - 5)),
    )
    p = planner.plan(snap, tiers, {"hot": TierUsage(1000, 950)}, NOW)
    purges = [a for a in p.actions if a.action is ActionKind.PURGE]
    assert {a.step for a in purges} == {100, 200}
    assert all(a.reason == "hot above high watermark 90%: trash freed at once" for a in purges)
    (expiry,) = [a for a in p.actions if a.action is ActionKind.DELETE]
    assert expiry.step == 250 and not expiry.trash and "freed at once" in expiry.reason
    assert p.reclaim_bytes["hot"] == 300
    assert p.actions[0].action is ActionKind.PURGE


def test_other_nodes_entries_are_never_purged() -> None:
    tiers = [tier("hot", keep_last=1, undo_window=DAY)]
    snap = dataclasses.replace(
        snapshot(*ckpts(300), implicit_runs=RunState.ACTIVE, last_seen=NOW),
        trash=(entry(100, NOW - 9 * DAY, node="node-b"), entry(200, NOW - 9 * DAY, node="me")),
        node="me",
    )
    p = planner.plan(snap, tiers, {}, NOW)
    assert [a.step for a in p.actions if a.action is ActionKind.PURGE] == [200]


def test_tier_without_window_any_more_frees_its_trash() -> None:
    tiers = [tier("hot", keep_last=1)]
    snap = dataclasses.replace(
        snapshot(*ckpts(300), implicit_runs=RunState.ACTIVE, last_seen=NOW), trash=(entry(100, NOW - 10),)
    )
    (purge,) = [a for a in planner.plan(snap, tiers, {}, NOW).actions if a.action is ActionKind.PURGE]
    assert purge.rule == "undo-window-off" and "no undo_window" in purge.reason


def test_short_of_headroom_frees_the_trash_before_demoting_live_checkpoints() -> None:
    """No high watermark is crossed, but the active run's next save (100 B) does not fit in the
    50 B free: the trash goes first, and with it freed nothing live has to move."""
    tiers = [tier("hot", keep_last=2, undo_window=7 * DAY, headroom=True), tier("warm", keep_last=5)]
    snap = dataclasses.replace(
        snapshot(*ckpts(250, 300), implicit_runs=RunState.ACTIVE, last_seen=NOW),
        trash=(entry(100, NOW - 10), entry(200, NOW - 5)),
    )
    p = planner.plan(snap, tiers, {"hot": TierUsage(1000, 950)}, NOW)
    purges = [a for a in p.actions if a.action is ActionKind.PURGE]
    assert {a.step for a in purges} == {100, 200}
    assert all(
        a.reason == "hot short of room for the next saves of active runs: trash freed at once" for a in purges
    ), purges
    assert not [a for a in p.actions if a.action is ActionKind.COPY]  # 200 B freed: room enough
    assert p.reclaim_bytes["hot"] == 200
