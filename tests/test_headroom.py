"""Headroom for the next save (issue 19): the prediction rule, the planner's early demotions, and an
end-to-end prune on a real hot + warm pair whose hot disk is a small budget.

The planner cases are values in, plan out (the planner is pure). The end-to-end test drives real
files through the real CLI; only the size of the hot filesystem is made up (a budget just above
what the checkpoints hold, as tests/test_watermark_e2e.py does), since a test cannot mount a small
disk: ``shutil.disk_usage`` of the hot root answers with that budget, the real usage code
(``actions.status.tier_usage``) reads it, and both ``prune`` and ``status`` go through it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from builders import checkpoint, local_tier, run, snapshot, tier, write_config
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import ckptkeeper
from ckptkeeper.cli import main
from ckptkeeper.core import planner
from ckptkeeper.core.headroom import Headroom, predict_next_save
from ckptkeeper.core.model import ActionKind, Checkpoint, CheckpointState, Plan, RunState, TierUsage
from tests.test_tiering_e2e import tree_digest, write_hf_checkpoint
from tests.test_watermark_e2e import _hot_bytes, fake_hot_disk

T0 = 1_709_510_400.0
COMPLETE = CheckpointState.COMPLETE
WRITING = CheckpointState.WRITING
CORRUPT = CheckpointState.CORRUPT

# --------------------------------------------------------------------------- the prediction rule

PREDICTIONS = [
    # (sizes and states in step order, predicted bytes of the next save, why)
    ([], 0, "nothing known yet"),
    ([(100, COMPLETE)], 100, "one save: its size"),
    ([(100, COMPLETE)] * 3, 100, "steady: the size"),
    ([(100, COMPLETE), (120, COMPLETE), (140, COMPLETE)], 160, "growing 20 per save: 140 + 20"),
    ([(100, COMPLETE), (200, COMPLETE), (150, COMPLETE)], 225, "max 200 + ceil((150 - 100) / 2)"),
    ([(100, COMPLETE), (101, COMPLETE), (102, COMPLETE)], 103, "growth per save rounds up"),
    ([(100, COMPLETE), (105, COMPLETE)], 110, "two saves: growth of the one step"),
    ([(300, COMPLETE), (200, COMPLETE), (100, COMPLETE)], 300, "shrinking: the largest, no trend"),
    ([(900, COMPLETE), (10, COMPLETE), (12, COMPLETE), (14, COMPLETE)], 16, "only the last 3 count"),
    ([(100, COMPLETE), (50, WRITING), (100, COMPLETE)], 100, "incomplete ones between are skipped"),
    ([(100, COMPLETE), (400, WRITING)], 100, "a save in progress does not replace the history"),
    ([(70, WRITING)], 70, "no complete one yet: the save being written"),
    ([(30, CORRUPT), (70, WRITING)], 70, "no complete one yet: the largest incomplete"),
    ([(0, WRITING)], 0, "an empty partial: nothing known"),
]


@pytest.mark.parametrize(("sizes", "expected", "why"), PREDICTIONS, ids=[p[2] for p in PREDICTIONS])
def test_prediction_rule(sizes: list[tuple[int, CheckpointState]], expected: int, why: str) -> None:
    cps = [checkpoint("r", (i + 1) * 100, state=s, nbytes=b) for i, (b, s) in enumerate(sizes)]
    assert predict_next_save(cps) == expected, why


def test_only_active_runs_are_predicted_and_status_headroom_sums_them() -> None:
    rows = [
        ("live", 200, checkpoint("live", 200, nbytes=50)),
        ("live", 100, checkpoint("live", 100, nbytes=40)),  # any order: sorted by step
        ("done", 100, checkpoint("done", 100, nbytes=999)),
        ("new", 1, checkpoint("new", 1, state=WRITING, nbytes=7)),
    ]
    runs = [
        run("live", RunState.ACTIVE),
        run("done"),
        run("new", RunState.ACTIVE),
        run("quiet", RunState.ACTIVE),
    ]
    h = Headroom.of("hot", 100, runs, rows)
    assert dict(h.runs) == {"live": 60, "new": 7, "quiet": 0}  # 50 + growth 10; the partial; unknown
    assert (h.needed_bytes, h.ok) == (67, True)
    assert h.describe() == "next saves of 2 active runs need 67 B; 100 B free"
    assert not Headroom.of("hot", 66, runs, rows).ok


# --------------------------------------------------------------------------- the planner

TIERS = [tier("hot", headroom=True), tier("warm")]
"""Hot keeps everything by its rules (no rules) and sets no watermark: only headroom moves things."""


def ck(run_name: str, step: int, nbytes: int = 100, **kw: Any) -> Checkpoint:
    kw.setdefault("tiers", ["hot"])
    return checkpoint(run_name, step, created_at=T0 + step, nbytes=nbytes, version=f"v{run_name}{step}", **kw)


def node(live_state: RunState = RunState.ACTIVE) -> tuple[list[Checkpoint], list[Any]]:
    """An ended run (oldest checkpoints), a pinned one, a parent, and a live run saving 100 bytes."""
    cps = [
        ck("done", 1),
        ck("done", 2),
        ck("done", 3),  # newest of an ended run
        ck("pinned", 0, pinned=True),  # the oldest of all, but pinned
        ck("parent", 4),  # the live run resumed from it
        ck("live", 10),
        ck("live", 11),  # newest of the live run
        ck("live", 12, state=WRITING, nbytes=30),  # a save in progress
    ]
    runs = [
        run("done", RunState.FINISHED),
        run("pinned", RunState.FINISHED),
        run("parent", RunState.FINISHED),
        run("live", live_state, parent=("parent", 4)),
    ]
    return cps, runs


def plan_at(
    used: int, *, total: int = 1000, tiers: list[Any] = TIERS, live: RunState = RunState.ACTIVE
) -> Plan:
    cps, runs = node(live)
    return planner.plan(
        snapshot(*cps, runs=runs), tiers, {"hot": TierUsage(total, used), "warm": None}, T0 + 100
    )


def demoted(p: Plan) -> list[tuple[str | None, int | None, str]]:
    return [(a.run, a.step, a.rule) for a in p.actions if a.action is ActionKind.COPY]


# free bytes -> what moves: the live run's next save needs 100 bytes (its last complete saves:
# 100, 100). Oldest unprotected first: done@1, done@2, live@10; then the ended run's newest, done@3.
EARLY = [
    (100, []),  # free == needed: nothing moves
    (400, []),
    (99, [("done", 1, "headroom")]),
    (1, [("done", 1, "headroom")]),
    (0, [("done", 1, "headroom")]),
]


@pytest.mark.parametrize(("free", "moves"), EARLY)
def test_demotes_early_only_when_free_is_below_the_next_save(free: int, moves: list[Any]) -> None:
    p = plan_at(1000 - free)
    assert demoted(p) == moves
    deletes = [(a.run, a.step, a.tier, a.rule) for a in p.actions if a.action is ActionKind.DELETE]
    assert deletes == [(r, s, "hot", "moved") for r, s, _ in moves]
    assert p.notes == ()


def test_the_reason_says_why_and_how_much() -> None:
    p = plan_at(950)
    copy = next(a for a in p.actions if a.action is ActionKind.COPY)
    assert copy.reason == "demote: headroom: next save of 1 active run needs 100 B; 50 B free"
    keep = {(k.run, k.step): k for k in p.keep}
    assert keep[("done", 1)].tier == "warm"
    assert "demoted: hot short of headroom for active runs' next saves" in keep[("done", 1)].reasons


def full_disk_plan(live10: int, live11: int) -> Plan:
    """The node of :func:`node` on a disk with nothing free, the live run's saves resized."""
    cps, runs = node()
    sized = {10: live10, 11: live11}
    cps = [
        ck("live", c.step, nbytes=sized[c.step]) if c.run == "live" and c.step in sized else c for c in cps
    ]
    used = sum(c.bytes for c in cps)
    return planner.plan(
        snapshot(*cps, runs=runs), TIERS, {"hot": TierUsage(used, used), "warm": None}, T0 + 100
    )


def test_demotes_oldest_first_then_ended_runs_newest_and_never_what_is_protected() -> None:
    # Needs 250 (saves of 250, 250): done@1 (100), done@2 (200), live@10 (450): the ended run's
    # newest stays, being enough without it.
    p = full_disk_plan(250, 250)
    assert demoted(p) == [("done", 1, "headroom"), ("done", 2, "headroom"), ("live", 10, "headroom")]
    assert p.notes == ()

    # Needs 3900 (saves of 100, 2000: 2000 + growth 1900): every unprotected one (300) and then the
    # ended run's newest, as a move, and it is still short: the plan says so.
    p = full_disk_plan(100, 2000)
    assert demoted(p) == [
        ("done", 1, "headroom"),
        ("done", 2, "headroom"),
        ("done", 3, "headroom"),
        ("live", 10, "headroom"),
    ]
    ended = next(a for a in p.actions if (a.run, a.step, a.action) == ("done", 3, ActionKind.COPY))
    assert ended.reason == (
        "demote: headroom: next save of 1 active run needs 3.8 KiB; 0 B free: "
        "newest checkpoint of ended run, moved not deleted"
    )
    assert p.notes == (
        "hot short of headroom: next save of 1 active run needs 3.8 KiB; 0 B free; still 3.4 KiB short "
        "after demoting every checkpoint it may (pinned ones, active runs' newest and parents of active "
        "runs stay): the next save may fail for lack of space",
    )
    never = {("pinned", 0), ("parent", 4), ("live", 11), ("live", 12)}
    assert never.isdisjoint((a.run, a.step) for a in p.actions)


def test_ended_runs_need_no_headroom() -> None:
    p = plan_at(1000, live=RunState.FINISHED)  # a full disk, but nobody will save again
    assert p.actions == ()


def test_off_means_only_the_watermarks_act() -> None:
    off = [tier("hot", headroom=False), tier("warm")]
    assert plan_at(1000, tiers=off).actions == ()
    # and the core default is off: a policy built in code plans as before
    assert plan_at(1000, tiers=[tier("hot"), tier("warm")]).actions == ()


def test_headroom_continues_after_the_watermark() -> None:
    # 90 % high, 88 % low on 1000 bytes at 950: the watermark demotes to 880 (done@1: 850 used,
    # 150 free); the next save needs 100: nothing more.
    wm = [tier("hot", headroom=True, high_watermark=0.9, low_watermark=0.88), tier("warm")]
    assert demoted(plan_at(950, tiers=wm)) == [("done", 1, "watermark")]
    # A 250-byte save: after the watermark's done@1 (150 free), headroom moves done@2 (250 free).
    cps, runs = node()
    cps = [c if c.run != "live" or c.state is not COMPLETE else ck("live", c.step, nbytes=250) for c in cps]
    p = planner.plan(snapshot(*cps, runs=runs), wm, {"hot": TierUsage(1000, 950), "warm": None}, T0 + 100)
    assert demoted(p) == [("done", 1, "watermark"), ("done", 2, "headroom")]
    headroom = next(a for a in p.actions if (a.run, a.step) == ("done", 2))
    assert headroom.reason == "demote: headroom: next save of 1 active run needs 250 B; 150 B free"


def test_the_last_tier_or_an_unknown_next_tier_gets_a_note() -> None:
    cps, runs = node()
    alone = planner.plan(
        snapshot(*cps, runs=runs), [tier("hot", headroom=True)], {"hot": TierUsage(1000, 1000)}, T0
    )
    assert alone.actions == ()
    assert alone.notes == (
        "hot short of headroom (next save of 1 active run needs 100 B; 0 B free) but it is the last tier: "
        "nothing to demote to",
    )
    unknown = planner.plan(
        snapshot(*cps, runs=runs, unknown=["warm"]), TIERS, {"hot": TierUsage(1000, 1000)}, T0
    )
    assert [a for a in unknown.actions if a.action is ActionKind.COPY] == []
    assert any("warm is unknown: no demotion" in n for n in unknown.notes)


def test_free_bytes_are_what_a_writer_can_write() -> None:
    # ext4 reserves blocks for root: 100 bytes unused, but only 50 writable by the training job.
    cps, runs = node()
    usage = {"hot": TierUsage(1000, 900, free_bytes=50), "warm": None}
    p = planner.plan(snapshot(*cps, runs=runs), TIERS, usage, T0 + 100)
    assert demoted(p) == [("done", 1, "headroom")]


# --------------------------------------------------------------------------- a property

RUNS = ("a", "b", "c", "d")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Checkpoint], list[Any], int, int]:
    cps: list[Checkpoint] = []
    runs = []
    for name in draw(st.lists(st.sampled_from(RUNS), min_size=1, max_size=4, unique=True)):
        state = draw(st.sampled_from(list(RunState)))
        runs.append(run(name, state))
        for step in sorted(draw(st.sets(st.integers(1, 12), max_size=6))):
            cps.append(
                checkpoint(
                    name,
                    step,
                    state=draw(st.sampled_from([COMPLETE, COMPLETE, COMPLETE, WRITING, CORRUPT])),
                    created_at=T0 + draw(st.integers(0, 50)),
                    nbytes=draw(st.integers(0, 300)),
                    pinned=draw(st.integers(0, 9)) == 0,
                    version=f"v-{name}-{step}",
                    tiers=["hot"] if draw(st.integers(0, 5)) else ["hot", "warm"],
                )
            )
    if runs and draw(st.booleans()):  # an active run resumed from another run's checkpoint
        parent = draw(st.sampled_from(cps)) if cps else None
        if parent is not None:
            runs[0] = run(runs[0].name, RunState.ACTIVE, parent=(parent.run, parent.step))
    used = sum(c.bytes for c in cps if "hot" in c.tiers)
    total = used + draw(st.integers(0, 600))
    free = draw(st.integers(0, total - used))
    return cps, runs, total, free


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([None, 0.5, 0.95]))
def test_property_room_is_made_or_the_plan_says_so(scenario: Any, high: float | None) -> None:
    cps, runs, total, free = scenario
    hot = tier("hot", headroom=True, high_watermark=high, low_watermark=None if high is None else high - 0.1)
    tiers = [hot, tier("warm", keep_last=100)]
    usage = {"hot": TierUsage(total, total - free, free_bytes=free), "warm": None}
    snap = snapshot(*cps, runs=runs)
    p = planner.plan(snap, tiers, usage, T0 + 100, max_delete=10**6)
    by_run: dict[str, list[Checkpoint]] = {}
    for c in sorted(cps, key=lambda c: c.step):
        by_run.setdefault(c.run, []).append(c)
    needed = sum(predict_next_save(by_run.get(r.name, [])) for r in runs if r.state is RunState.ACTIVE)
    freed = sum(a.bytes for a in p.actions if a.action is not ActionKind.COPY and a.tier == "hot")
    moved_by_headroom = [a for a in p.actions if a.rule == "headroom"]

    # Early demotions happen only when the room is short, and each says why.
    if free >= needed:
        assert moved_by_headroom == []
    for a in moved_by_headroom:
        assert a.reason.startswith("demote: headroom: next save")
        assert a.tier == "hot" and a.to_tier == "warm"
    # Room is made, or the plan says it could not be.
    if free + freed < needed:
        assert any("short of headroom" in n for n in p.notes), p.notes
    # Never moved or deleted from hot: pinned, incomplete, an active run's newest, an active run's parent.
    protected = {(c.run, c.step) for c in cps if c.pinned or c.state is not COMPLETE}
    for r in runs:
        if r.state is RunState.ACTIVE:
            complete = [c for c in by_run.get(r.name, []) if c.state is COMPLETE]
            if complete:
                protected.add((complete[-1].run, complete[-1].step))
            if r.parent is not None:
                protected.add(r.parent)
    touched = {(a.run, a.step) for a in p.actions if a.action is not ActionKind.COPY and a.tier == "hot"}
    assert protected.isdisjoint(touched)
    # Turning headroom off leaves only the watermark's plan, which never says "headroom".
    off = planner.plan(
        snap,
        [
            tier("hot", high_watermark=hot.policy.high_watermark, low_watermark=hot.policy.low_watermark),
            tiers[1],
        ],
        usage,
        T0 + 100,
        max_delete=10**6,
    )
    assert all(a.rule != "headroom" for a in off.actions)
    if free >= needed:
        assert off.actions == p.actions


# --------------------------------------------------------------------------- end to end


CKPT_STEPS = (100, 200, 300)


def test_prune_makes_room_for_the_live_runs_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    config = tmp_path / "config.toml"
    write_config(
        config,
        index=tmp_path / "index.db",
        # the checkpoints are back-dated to order them by age; metrics written after each prune
        daemon={"trust_mtimes": True, "textfile": str(tmp_path / "ckptkeeper.prom")},
        # No high_watermark: headroom alone (on by default for the hot tier) demotes.
        tiers=[local_tier("hot", hot, keep_last=3), local_tier("warm", warm, keep_last=5)],
    )

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    def cli_json(*args: str) -> Any:
        code, out = cli(*args, "--json")
        assert code == 0, out
        return json.loads(out)

    long_ago = time.time() - 3 * 86400
    done = ckptkeeper.track_run(hot / "done")
    for step in (100, 200):
        write_hf_checkpoint(hot / "done", step, long_ago + step)
        done.commit(hot / "done" / f"checkpoint-{step}", step)
    done.finish()
    live = ckptkeeper.track_run(hot / "live")  # still training: this process is alive
    try:
        for step in CKPT_STEPS:  # each save 400 bytes larger than the one before
            write_hf_checkpoint(hot / "live", step, long_ago + 3600 + step)
            live.commit(hot / "live" / f"checkpoint-{step}", step)
        sizes = [_hot_bytes(hot / "live" / f"checkpoint-{s}") for s in CKPT_STEPS]
        assert sizes[0] < sizes[1] < sizes[2]
        predicted = sizes[2] + -(-(sizes[2] - sizes[0]) // 2)  # the largest + the growth per save
        code, out = cli("scan")  # first: it may write its own small records in the hot root
        assert code == 0, out
        used = _hot_bytes(hot)
        budget = used + predicted // 2  # half the next save fits: it would fail
        fake_hot_disk(monkeypatch, hot, budget)
        oldest = tree_digest(hot / "done" / "checkpoint-100")

        before = cli_json("status")["headroom"]
        assert before == {
            "tier": "hot",
            "free_bytes": budget - used,
            "needed_bytes": predicted,
            "runs": {"live": predicted},
            "ok": False,
            "enabled": True,
        }
        code, text = cli("status")
        assert code == 0, text
        assert "next save of run live needs" in text
        assert "WARNING headroom: next save of 1 active run needs" in text

        dry = cli_json("prune", "--dry-run")
        assert [(a["run"], a["step"], a["action"], a["rule"]) for a in dry["actions"]] == [
            ("done", 100, "copy", "headroom"),
            ("done", 100, "delete", "moved"),
        ]
        assert dry["actions"][0]["reason"].startswith("demote: headroom: next save of 1 active run needs ")

        code, out = cli("prune")
        assert code == 0, out
        assert not (hot / "done" / "checkpoint-100").exists()
        assert tree_digest(warm / "done" / "checkpoint-100") == oldest  # moved, byte-identical
        for step in CKPT_STEPS:
            assert (hot / "live" / f"checkpoint-{step}").exists()
        after = cli_json("status")["headroom"]
        assert after["ok"] is True
        assert after["free_bytes"] == budget - _hot_bytes(hot) >= predicted
        # The metrics read the same summary: the next save, and the room left after it.
        metrics = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families((tmp_path / "ckptkeeper.prom").read_text())
            for sample in family.samples
        }
        assert metrics[("ckptkeeper_next_save_bytes", (("run", "live"),))] == predicted
        assert metrics[("ckptkeeper_headroom_bytes", (("tier", "hot"),))] == after["free_bytes"] - predicted
        code, text = cli("status")
        assert "WARNING headroom" not in text
        assert cli_json("prune", "--dry-run")["actions"] == []  # settled
    finally:
        live.finish()
    # The run ended: it needs no room any more.
    code, out = cli("scan")
    assert code == 0, out
    assert cli_json("status")["headroom"]["runs"] == {}


# --------------------------------------------------------------------------- config


def test_config_key_is_on_for_hot_by_default_and_refused_elsewhere(tmp_path: Path) -> None:
    from ckptkeeper.config import ConfigError, settings_from_mapping

    hot, warm = {"name": "hot", "url": str(tmp_path / "hot")}, {"name": "warm", "url": str(tmp_path / "w")}
    specs = settings_from_mapping({"tiers": [hot, warm]}).tier_specs()
    assert specs[0].policy.headroom is True
    off = settings_from_mapping({"tiers": [{**hot, "headroom": False}, warm]}).tier_specs()
    assert off[0].policy.headroom is False
    with pytest.raises(
        ConfigError, match=r"tiers\[1\]\.headroom: headroom applies to the first \(hot\) tier only"
    ):
        settings_from_mapping({"tiers": [hot, {**warm, "headroom": True}]})
