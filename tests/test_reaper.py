"""Reaper: run-state truth table, reap planning golden cases, and safety properties (docs/design.md, "Reaper", §8).

Everything here is values in, values out: the reaper is pure, so no files and no clock.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from builders import checkpoint, tier
from builders import run as make_run
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkeeper.core.model import (
    Action,
    ActionKind,
    Artifact,
    Checkpoint,
    CheckpointState,
    ReaperPolicy,
    Run,
    RunState,
    Snapshot,
)
from ckptkeeper.core.reaper import (
    ARTIFACT_KINDS,
    DETACHED_KINDS,
    NO_RUN,
    ReapDecision,
    RunFacts,
    derive_run_state,
    plan_reaps,
    summarize_reclaim,
)
from ckptkeeper.util.fmt import human_age as format_age

NOW = 1_700_000_000.0
H = 3600.0
FAILED_AFTER = 2 * H
POLICY = ReaperPolicy(failed_after=FAILED_AFTER, partial_after=H, keep_last_of_failed=1)
TIERS = (
    tier("hot", "/nvme/ckpt", keep_last=2),
    tier("warm", "/mnt/warm", keep_last=5),
    tier("cold", "s3://bucket/ckpt", keep_every=400),
)
ME = "node-a"

COMPLETE = CheckpointState.COMPLETE
WRITING = CheckpointState.WRITING
CORRUPT = CheckpointState.CORRUPT


def ckpt(
    run: str,
    step: int,
    state: CheckpointState = COMPLETE,
    *,
    tiers: tuple[str, ...] = ("hot",),
    age: float = 10 * H,
    pinned: bool = False,
    committed: bool = False,
    nbytes: int = 1000,
) -> Checkpoint:
    """A checkpoint last written ``age`` seconds before NOW; partial ones have no verified copy."""
    return checkpoint(
        run,
        step,
        state=state,
        created_at=NOW - age - 60,
        last_write=NOW - age,
        nbytes=nbytes,
        pinned=pinned,
        tiers=tiers if state is COMPLETE else (),
        committed=committed,
    )


def run(name: str, state: RunState, *, parent: tuple[str, int] | None = None, idle: float = 3 * H) -> Run:
    return make_run(name, state, last_seen=NOW - idle, parent=parent)


def reap(snapshot: Snapshot, policy: ReaperPolicy = POLICY) -> ReapDecision:
    return plan_reaps(snapshot, TIERS, policy, NOW)


def targets(decision: ReapDecision) -> set[tuple[str | None, int | None, str | None]]:
    return {(a.run, a.step, a.tier) for a in decision.actions}


# --------------------------------------------------------------------------------------------
# format_age
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (45, "45s"),
        (90, "1m30s"),
        (600, "10m"),
        (3600, "1h"),
        (3 * 3600 + 12 * 60 + 7, "3h12m"),
        (2 * 86400 + 5 * 3600, "2d5h"),
        (86400 + 59, "1d"),
    ],
)
def test_format_age(seconds: float, text: str) -> None:
    assert format_age(seconds) == text


# --------------------------------------------------------------------------------------------
# derive_run_state truth table
# --------------------------------------------------------------------------------------------

OLD = NOW - 3 * H  # older than failed_after
FRESH = NOW - 60  # well within failed_after


def facts(
    hook: str | None = "active",
    *,
    host: str | None = ME,
    pid: int | None = 4242,
    alive: bool | None = False,
    heartbeat: float | None = OLD,
    write: float = OLD,
) -> RunFacts:
    return RunFacts(
        hook_state=hook, host=host, pid=pid, pid_alive=alive, heartbeat=heartbeat, newest_write=write
    )


@pytest.mark.parametrize(
    ("case", "run_facts", "state", "says"),
    [
        ("hook finished", facts("finished"), RunState.FINISHED, "finished"),
        ("hook finished, fresh writes", facts("finished", write=FRESH), RunState.FINISHED, "finished"),
        ("hook failed", facts("failed", alive=True), RunState.FAILED, "failed"),
        ("live pid, all else old", facts(alive=True), RunState.ACTIVE, "pid 4242 alive"),
        ("dead pid, old heartbeat, old writes", facts(), RunState.STALE, "pid 4242 not running"),
        ("dead pid, no heartbeat, old writes", facts(heartbeat=None), RunState.STALE, "no heartbeat"),
        ("dead pid, recent writes", facts(write=FRESH), RunState.ACTIVE, "last write 1m ago"),
        ("dead pid, fresh heartbeat", facts(heartbeat=FRESH), RunState.ACTIVE, "heartbeat 1m ago"),
        ("pid liveness unknown locally", facts(alive=None), RunState.STALE, "liveness unknown"),
        (
            "other host, old heartbeat + writes",
            facts(host="node-b", alive=None),
            RunState.STALE,
            "on node-b (not checkable here)",
        ),
        (
            "other host: a local pid check proves nothing",
            facts(host="node-b", alive=True),
            RunState.STALE,
            "not checkable here",
        ),
        (
            "other host, fresh heartbeat",
            facts(host="node-b", alive=None, heartbeat=FRESH),
            RunState.ACTIVE,
            "",
        ),
        ("other host, fresh writes", facts(host="node-b", alive=None, write=FRESH), RunState.ACTIVE, ""),
        (
            "no hook, old writes",
            facts(None, host=None, pid=None, alive=None, heartbeat=None),
            RunState.STALE,
            "",
        ),
        (
            "no hook, recent writes",
            facts(None, host=None, pid=None, alive=None, heartbeat=None, write=FRESH),
            RunState.ACTIVE,
            "no hook",
        ),
        ("unknown hook state counts as a claim of life", facts("paused", write=FRESH), RunState.ACTIVE, ""),
        ("unknown hook state, all old", facts("paused"), RunState.STALE, "not understood"),
        # Boundary: exactly failed_after old is not yet "older than" (deletion waits a cycle).
        ("write exactly failed_after ago", facts(write=NOW - FAILED_AFTER), RunState.ACTIVE, ""),
        ("future mtime (clock skew)", facts(write=NOW + 600), RunState.ACTIVE, "0s ago"),
    ],
)
def test_derive_run_state(case: str, run_facts: RunFacts, state: RunState, says: str) -> None:
    got, reason = derive_run_state(run_facts, this_host=ME, now=NOW, failed_after=FAILED_AFTER)
    assert got is state, (case, reason)
    assert says in reason
    assert reason


def test_stale_reason_names_every_missing_sign_of_life() -> None:
    _, reason = derive_run_state(facts(), this_host=ME, now=NOW, failed_after=FAILED_AFTER)
    assert (
        reason == "hook says active; pid 4242 not running on this host; no heartbeat for 3h; no write for 3h"
    )


# --------------------------------------------------------------------------------------------
# Failed and stale runs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "rule"), [(RunState.FAILED, "failed-run"), (RunState.STALE, "stale-run")])
def test_dead_run_keeps_newest_complete_and_reaps_the_rest(state: RunState, rule: str) -> None:
    snapshot = Snapshot(
        runs=(run("r", state),),
        checkpoints=(
            ckpt("r", 300, tiers=("hot", "warm")),
            ckpt("r", 600),
            ckpt("r", 900, tiers=("warm",)),
            ckpt("r", 1200, tiers=("hot", "cold")),
            ckpt("r", 1500, WRITING, age=2 * H),
        ),
    )
    d = reap(snapshot)
    assert targets(d) == {
        ("r", 300, "hot"),
        ("r", 300, "warm"),
        ("r", 600, "hot"),
        ("r", 900, "warm"),
        ("r", 1500, "hot"),  # partial: no verified copy, reaped where partials live
    }
    assert d.reaped == {("r", 300), ("r", 600), ("r", 900), ("r", 1500)}
    assert {a.rule for a in d.actions} == {rule}
    word = state.value
    assert d.keep_reasons == {("r", 1200): (f"newest complete of {word} run",)}
    by_step = {(a.step, a.tier): a for a in d.actions}
    assert by_step[(300, "warm")].path == "r/checkpoint-300"
    assert by_step[(300, "warm")].bytes == 1000
    assert "keeping newest 1 complete (step 1200)" in by_step[(600, "hot")].reason
    assert by_step[(1500, "hot")].reason.endswith("partial checkpoint, no write for 2h")
    if state is RunState.STALE:
        assert by_step[(600, "hot")].reason.startswith("stale run (no sign of life for 3h)")
    else:
        assert by_step[(600, "hot")].reason.startswith("failed run: ")


def test_keep_last_of_failed_keeps_several() -> None:
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),), checkpoints=tuple(ckpt("r", s) for s in (100, 200, 300, 400))
    )
    d = reap(snapshot, replace(POLICY, keep_last_of_failed=3))
    assert d.reaped == {("r", 100)}
    assert "keeping newest 3 complete (steps 400, 300, 200)" in d.actions[0].reason
    assert d.keep_reasons[("r", 300)] == ("within newest 3 complete of failed run",)
    assert d.keep_reasons[("r", 400)] == ("newest complete of failed run",)


def test_keep_last_of_failed_zero_still_keeps_newest_complete() -> None:
    """keep_last_of_failed=0 would leave a failed run with nothing to resume from; the newest
    complete checkpoint of every run is protected whatever the rules (docs/design.md, "Retention"), so it stays."""
    snapshot = Snapshot(runs=(run("r", RunState.FAILED),), checkpoints=(ckpt("r", 100), ckpt("r", 200)))
    d = reap(snapshot, replace(POLICY, keep_last_of_failed=0))
    assert d.reaped == {("r", 100)}
    assert ("r", 200) in d.keep_reasons
    assert "keeping newest 1 complete (step 200)" in d.actions[0].reason


def test_failed_run_without_complete_checkpoint_loses_only_quiet_partials() -> None:
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(ckpt("r", 100, WRITING, age=2 * H), ckpt("r", 200, CORRUPT, age=2 * H)),
    )
    d = reap(snapshot)
    assert d.reaped == {("r", 100), ("r", 200)}
    assert "corrupt checkpoint" in next(a.reason for a in d.actions if a.step == 200)


def test_failed_run_fresh_partial_is_spared() -> None:
    """Deliberately stricter than "every partial of a failed run": a partial written within
    partial_after may be an async save still finishing, or complete but not yet settled by the
    catalog. Invariant 3 (never reap what is being written) outranks reaping sooner."""
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(ckpt("r", 100), ckpt("r", 200, WRITING, age=300)),
    )
    d = reap(snapshot)
    assert d.actions == ()
    assert d.keep_reasons[("r", 200)] == ("writing: last write 5m ago, within partial_after 1h",)


def test_committed_but_unverified_checkpoint_is_never_partial() -> None:
    """The hook committed it; the catalog is still verifying. It may be the failed run's best."""
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(ckpt("r", 100), ckpt("r", 200, WRITING, age=5 * H, committed=True)),
    )
    d = reap(snapshot)
    assert d.actions == ()
    assert d.keep_reasons[("r", 200)] == ("committed by hook, awaiting verification",)


def test_committed_checkpoint_judged_corrupt_is_left_for_a_human() -> None:
    """The hook said complete, a layout check says corrupt: one of them is wrong, and deleting on
    the recognizer's word could destroy the failed run's only good checkpoint. Spared however old;
    an uncommitted corrupt one of the same age is reaped as before."""
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED), run("s", RunState.FINISHED)),
        checkpoints=(
            ckpt("r", 100, CORRUPT, age=30 * H, committed=True),
            ckpt("s", 100),
            ckpt("s", 200, CORRUPT, age=30 * H, committed=True),
            ckpt("s", 300, CORRUPT, age=30 * H),
        ),
    )
    d = reap(snapshot)
    assert [(a.run, a.step) for a in d.actions] == [("s", 300)]
    why = "committed by hook but judged corrupt: left for a human (ckptkeeper ls, verify)"
    assert d.keep_reasons[("r", 100)] == (why,)
    assert d.keep_reasons[("s", 200)] == (why,)


def test_finished_and_active_runs_keep_their_complete_checkpoints() -> None:
    snapshot = Snapshot(
        runs=(run("a", RunState.ACTIVE), run("f", RunState.FINISHED)),
        checkpoints=(ckpt("a", 1), ckpt("a", 2), ckpt("f", 1), ckpt("f", 2)),
    )
    d = reap(snapshot)
    assert d.actions == ()
    assert d.keep_reasons == {}  # retention's business, not the reaper's


# --------------------------------------------------------------------------------------------
# Protections
# --------------------------------------------------------------------------------------------


def test_pinned_is_never_reaped() -> None:
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(
            ckpt("r", 100, pinned=True),
            ckpt("r", 200),
            ckpt("r", 300, WRITING, pinned=True, age=9 * H),
            ckpt("r", 400),
        ),
    )
    d = reap(snapshot)
    assert d.reaped == {("r", 200)}
    assert d.keep_reasons[("r", 100)] == ("pinned",)
    assert d.keep_reasons[("r", 300)] == ("pinned",)


def test_parent_of_active_run_is_never_reaped() -> None:
    snapshot = Snapshot(
        runs=(
            run("base", RunState.FAILED),
            run("resumed", RunState.ACTIVE, parent=("base", 100)),
            run("done", RunState.FINISHED, parent=("base", 200)),  # not active: no protection
        ),
        checkpoints=(ckpt("base", 100), ckpt("base", 200), ckpt("base", 300)),
    )
    d = reap(snapshot)
    assert d.reaped == {("base", 200)}
    assert d.keep_reasons[("base", 100)] == ("parent of active run resumed",)


def test_unknown_tier_gets_no_action() -> None:
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(ckpt("r", 100, tiers=("hot", "cold")), ckpt("r", 200, tiers=("cold",)), ckpt("r", 300)),
        artifacts=(Artifact("cold", "r/x.tmp", "tmp-file", 5, NOW - 9 * H, run="r"),),
        unknown_tiers=frozenset({"cold"}),
    )
    d = reap(snapshot)
    assert targets(d) == {("r", 100, "hot")}
    # Still reaped as far as retention is concerned: it must plan no copy of waste; the cold
    # copies are reaped on a later cycle once cold lists again.
    assert d.reaped == {("r", 100), ("r", 200)}


def test_unconfigured_tier_and_unknown_hot_tier_get_no_action() -> None:
    snapshot = Snapshot(
        runs=(run("r", RunState.ACTIVE),),
        checkpoints=(ckpt("r", 1), ckpt("r", 2, WRITING, age=9 * H)),
        artifacts=(Artifact("elsewhere", "r/x.tmp", "tmp-file", 5, NOW - 9 * H),),
        unknown_tiers=frozenset({"hot"}),
    )
    assert reap(snapshot).actions == ()


# --------------------------------------------------------------------------------------------
# Partial checkpoints anywhere
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [RunState.ACTIVE, RunState.FINISHED])
def test_partial_of_live_run_reaped_only_when_quiet(state: RunState) -> None:
    snapshot = Snapshot(
        runs=(run("r", state),),
        checkpoints=(
            ckpt("r", 100),
            ckpt("r", 200, WRITING, age=2 * H),
            ckpt("r", 300, CORRUPT, age=90 * 60),
            ckpt("r", 400, WRITING, age=10 * 60),
            ckpt("r", 500, CORRUPT, age=H),  # exactly partial_after: not yet older
        ),
    )
    d = reap(snapshot)
    assert targets(d) == {("r", 200, "hot"), ("r", 300, "hot")}
    assert {a.rule for a in d.actions} == {"partial"}
    reasons = {a.step: a.reason for a in d.actions}
    assert reasons[200] == "partial: no completion marker, no write for 2h"
    assert reasons[300] == "corrupt: unusable checkpoint, no write for 1h30m"
    assert d.keep_reasons[("r", 400)] == ("writing: last write 10m ago, within partial_after 1h",)
    assert ("r", 500) in d.keep_reasons


def test_partial_of_unknown_run_follows_live_run_rules() -> None:
    snapshot = Snapshot(
        runs=(),
        checkpoints=(ckpt("ghost", 1), ckpt("ghost", 2), ckpt("ghost", 3, WRITING, age=2 * H)),
    )
    assert targets(reap(snapshot)) == {("ghost", 3, "hot")}


def test_writing_checkpoint_is_reaped_in_hot_only_even_with_recorded_tiers() -> None:
    """A rewrite of an existing step may still list the previous version's verified copies."""
    rewrite = replace(ckpt("r", 2, WRITING, age=2 * H), tiers=frozenset({"warm", "cold"}))
    d = reap(Snapshot(runs=(run("r", RunState.ACTIVE),), checkpoints=(ckpt("r", 1), rewrite)))
    assert targets(d) == {("r", 2, "hot")}


def test_corrupt_checkpoint_is_reaped_where_recorded() -> None:
    bad = replace(ckpt("r", 2, CORRUPT, age=2 * H), tiers=frozenset({"warm"}))
    d = reap(Snapshot(runs=(run("r", RunState.ACTIVE),), checkpoints=(ckpt("r", 1), bad)))
    assert targets(d) == {("r", 2, "warm")}


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------

ARTIFACT_PATHS = {
    "orbax-tmp": "r/1000.orbax-checkpoint-tmp-1699990000",
    "tmp-checkpoint": "r/tmp-checkpoint-1000",
    "metadata-tmp": "r/dcp-1000/.metadata.tmp",
    "nemo-unfinished": "r/megatron_gpt--step=1000-unfinished",
    "tmp-file": "r/model.safetensors.part",
    "safetensors-tmp": "r/checkpoint_0/.tmpd1FjiO",
    "ckptkeeper-staging": "r/checkpoint-900.ckptkeeper-staging-ab12",
    "multipart-upload": "r/checkpoint-900/model.safetensors",
}


@pytest.mark.parametrize("kind", sorted(ARTIFACT_KINDS))
@pytest.mark.parametrize("run_state", [RunState.ACTIVE, RunState.FAILED])
def test_artifact_reaped_by_age(kind: str, run_state: RunState) -> None:
    tier = "cold" if kind in ("multipart-upload", "ckptkeeper-staging") else "hot"
    upload_id = "upl-1" if kind == "multipart-upload" else None
    old = Artifact(tier, ARTIFACT_PATHS[kind], kind, 777, NOW - 2 * H, run="r", upload_id=upload_id)
    young = replace(old, path=old.path + "-2", last_write=NOW - 30 * 60)
    edge = replace(old, path=old.path + "-3", last_write=NOW - H)
    snapshot = Snapshot(runs=(run("r", run_state),), checkpoints=(), artifacts=(old, young, edge))
    d = reap(snapshot)
    assert len(d.actions) == 1
    action = d.actions[0]
    assert (action.action, action.tier, action.path, action.bytes, action.rule) == (
        ActionKind.REAP,
        tier,
        old.path,
        777,
        kind,
    )
    assert (action.run, action.step, action.to_tier) == ("r", None, None)
    assert action.upload_id == upload_id
    assert action.reason.startswith(f"{kind}: ") and action.reason.endswith("2h")
    assert d.reaped == frozenset()


def test_multipart_upload_carries_upload_id_and_is_skipped_without_one() -> None:
    upload = Artifact("cold", "r/ckpt-1/w.bin", "multipart-upload", 50, NOW - 5 * H, upload_id="2~abc")
    d = reap(Snapshot(runs=(), checkpoints=(), artifacts=(upload, replace(upload, upload_id=None))))
    assert [a.upload_id for a in d.actions] == ["2~abc"]
    assert "2~abc" in d.actions[0].reason
    assert d.actions[0].run is None


def test_duplicate_artifact_records_the_freshest_decides() -> None:
    """One path listed twice (before and after a write): the stale record must not reap it."""
    old = Artifact("hot", "r/x.tmp", "tmp-file", 5, NOW - 9 * H)
    fresh = replace(old, last_write=NOW - 60)
    for records in ((old, fresh), (fresh, old)):
        assert reap(Snapshot(runs=(), checkpoints=(), artifacts=records)).actions == ()
    assert len(reap(Snapshot(runs=(), checkpoints=(), artifacts=(old, old))).actions) == 1


def test_unknown_artifact_kind_is_never_reaped() -> None:
    odd = Artifact("hot", "r/whatever", "mystery", 50, NOW - 50 * H)
    assert reap(Snapshot(runs=(), checkpoints=(), artifacts=(odd,))).actions == ()


def test_artifact_inside_kept_checkpoint_is_left_alone() -> None:
    """Deleting a file inside a kept checkpoint would break its manifest."""
    inside = Artifact("hot", "r/checkpoint-100/.metadata.tmp", "metadata-tmp", 5, NOW - 9 * H, run="r")
    d = reap(Snapshot(runs=(run("r", RunState.ACTIVE),), checkpoints=(ckpt("r", 100),), artifacts=(inside,)))
    assert d.actions == ()


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("r/checkpoint-100/.tmpd1FjiO", "safetensors-tmp"),
        ("r/checkpoint-100/default.orbax-checkpoint-tmp", "orbax-tmp"),
        ("r/checkpoint-100/optimizer.pt.part", "tmp-file"),
    ],
)
def test_framework_temp_inside_kept_checkpoint_is_reaped_alone(path: str, kind: str) -> None:
    """The catalog keeps these out of the checkpoint's files: reaping one leaves the manifest whole."""
    inside = Artifact("hot", path, kind, 5, NOW - 9 * H, run="r")
    d = reap(Snapshot(runs=(run("r", RunState.ACTIVE),), checkpoints=(ckpt("r", 100),), artifacts=(inside,)))
    assert [(a.path, a.rule, a.step) for a in d.actions] == [(path, kind, None)]


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("r/checkpoint-100/.tmpd1FjiO", "safetensors-tmp"),
        ("r/checkpoint-100/sub/default.orbax-checkpoint-tmp", "orbax-tmp"),
        ("r/checkpoint-100/model.part", "tmp-file"),
    ],
)
def test_temp_names_inside_a_kept_committed_checkpoint_are_never_reaped(path: str, kind: str) -> None:
    """The hook committed it: every regular file under it is in its manifest, whatever its name
    (an artifact row recorded before that rule included); only our own staging names go."""
    inside = Artifact("hot", path, kind, 5, NOW - 9 * H, run="r")
    staging = Artifact("hot", "r/checkpoint-100/x.ckptkeeper-tmp-ab12", "ckptkeeper-staging", 5, NOW - 9 * H)
    d = reap(
        Snapshot(
            runs=(run("r", RunState.ACTIVE),),
            checkpoints=(ckpt("r", 100, committed=True),),
            artifacts=(inside, staging),
        )
    )
    assert [a.path for a in d.actions] == [staging.path]


def test_framework_temp_kind_at_a_kept_checkpoint_path_is_never_reaped() -> None:
    """A path the hook committed is a checkpoint, whatever its name looks like."""
    at = Artifact("hot", "r/checkpoint-100", "tmp-file", 5, NOW - 9 * H, run="r")
    d = reap(Snapshot(runs=(run("r", RunState.ACTIVE),), checkpoints=(ckpt("r", 100),), artifacts=(at,)))
    assert d.actions == ()


def test_artifact_inside_reaped_checkpoint_is_covered_by_its_reap() -> None:
    inside = Artifact("hot", "r/checkpoint-100/x.tmp", "tmp-file", 5, NOW - 9 * H, run="r")
    upload = Artifact("hot", "r/checkpoint-100/y", "multipart-upload", 5, NOW - 9 * H, upload_id="u")
    snapshot = Snapshot(
        runs=(run("r", RunState.FAILED),),
        checkpoints=(ckpt("r", 100), ckpt("r", 200)),
        artifacts=(inside, upload),
    )
    d = reap(snapshot)
    # The checkpoint dir reap removes the temp file; an upload is not an object, so abort it.
    assert [(a.step, a.rule) for a in d.actions] == [(None, "multipart-upload"), (100, "failed-run")]


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "/abs/x.tmp", "r/../../x.tmp", "r//x.tmp", "", "r/./x.tmp"]
)
def test_paths_escaping_the_tier_root_are_never_reaped(path: str) -> None:
    bad = Artifact("hot", path, "tmp-file", 5, NOW - 9 * H)
    assert reap(Snapshot(runs=(), checkpoints=(), artifacts=(bad,))).actions == ()


def test_checkpoint_with_unsafe_name_is_spared() -> None:
    evil = replace(ckpt("r", 100), name="../../other")
    d = reap(Snapshot(runs=(run("r", RunState.FAILED),), checkpoints=(evil, ckpt("r", 200))))
    assert d.actions == ()
    assert "not a plain relative path" in d.keep_reasons[("r", 100)][0]


# --------------------------------------------------------------------------------------------
# Output shape, ordering, summary
# --------------------------------------------------------------------------------------------


def test_reap_action_json_shape() -> None:
    d = reap(Snapshot(runs=(run("r", RunState.FAILED),), checkpoints=(ckpt("r", 1), ckpt("r", 2))))
    doc = json.loads(json.dumps([a.to_dict() for a in d.actions]))
    assert doc == [
        {
            "action": "reap",
            "run": "r",
            "step": 1,
            "tier": "hot",
            "to_tier": None,
            "path": "r/checkpoint-1",
            "bytes": 1000,
            "reason": "failed run: keeping newest 1 complete (step 2)",
            "rule": "failed-run",
        }
    ]


def test_actions_are_sorted_by_run_step_tier_path() -> None:
    snapshot = Snapshot(
        runs=(run("b", RunState.FAILED), run("a", RunState.STALE)),
        checkpoints=(
            ckpt("b", 20, tiers=("warm", "hot", "cold")),
            ckpt("b", 3),
            ckpt("b", 100),
            ckpt("a", 5),
            ckpt("a", 6),
        ),
        artifacts=(
            Artifact("hot", "z.tmp", "tmp-file", 1, NOW - 9 * H),
            Artifact("hot", "a/q.tmp", "tmp-file", 1, NOW - 9 * H, run="a"),
        ),
    )
    keys = [(a.run, a.step, a.tier, a.path) for a in reap(snapshot).actions]
    assert keys == [
        (None, None, "hot", "z.tmp"),
        ("a", None, "hot", "a/q.tmp"),
        ("a", 5, "hot", "a/checkpoint-5"),
        ("b", 3, "hot", "b/checkpoint-3"),
        ("b", 20, "cold", "b/checkpoint-20"),
        ("b", 20, "hot", "b/checkpoint-20"),
        ("b", 20, "warm", "b/checkpoint-20"),
    ]


def test_summarize_reclaim() -> None:
    actions = [
        Action(ActionKind.REAP, "x", run="r1", step=1, tier="hot", bytes=100, rule="failed-run"),
        Action(ActionKind.REAP, "x", run="r1", step=2, tier="warm", bytes=50, rule="failed-run"),
        Action(ActionKind.REAP, "x", run="r2", step=9, tier="hot", bytes=30, rule="partial"),
        Action(ActionKind.REAP, "x", tier="cold", bytes=400, rule="multipart-upload", upload_id="u"),
        Action(ActionKind.DELETE, "x", run="r1", step=3, tier="hot", bytes=10_000, rule="expired"),
        Action(ActionKind.COPY, "x", run="r1", step=3, tier="hot", to_tier="warm", bytes=10_000),
    ]
    s = summarize_reclaim(actions)
    assert s.total == 580
    assert s.count == 4
    assert list(s.by_reason.items()) == [("multipart-upload", 400), ("failed-run", 150), ("partial", 30)]
    assert list(s.by_run.items()) == [(NO_RUN, 400), ("r1", 150), ("r2", 30)]
    assert summarize_reclaim([]).total == 0


# --------------------------------------------------------------------------------------------
# Properties (docs/design.md, "Safety invariants"): protections hold on arbitrary snapshots; output is deterministic
# --------------------------------------------------------------------------------------------

RUN_NAMES = ("r0", "r1", "r2", "r3")
TIER_NAMES = tuple(t.name for t in TIERS)
ARTIFACT_LEAVES = st.sampled_from(["x.tmp", "step-100/y.tmp", "step-200", "z"])
CKPT_STATES = st.sampled_from(list(CheckpointState))
RUN_STATES = st.sampled_from(list(RunState))
TIER_SETS = st.frozensets(st.sampled_from(TIER_NAMES))
STEP_SETS = st.sets(st.integers(0, 30), max_size=6)
SIZES = st.integers(0, 10**9)
ARTIFACT_TIERS = st.sampled_from((*TIER_NAMES, "other"))
ARTIFACT_RUNS = st.sampled_from((*RUN_NAMES, None))
ARTIFACT_KIND_NAMES = st.sampled_from([*ARTIFACT_KINDS, "mystery"])
RUN_PREFIXES = st.sampled_from(RUN_NAMES)
UPLOAD_IDS = st.sampled_from(("u1", None))
AGES = st.sampled_from([0.0, 60.0, H - 1, H, H + 1, 2 * H, 3 * H, 50 * H])


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    checkpoints = []
    for name in RUN_NAMES:
        for step in draw(STEP_SETS):
            state = draw(CKPT_STATES)
            checkpoints.append(
                checkpoint(
                    name,
                    step * 100,
                    state=state,
                    name=f"step-{step * 100}",
                    layout="orbax",
                    created_at=NOW - 60 * H,
                    nbytes=draw(SIZES),
                    pinned=draw(st.booleans()),
                    tiers=draw(TIER_SETS),
                    last_write=NOW - draw(AGES),
                    committed=draw(st.booleans()),
                )
            )
    keys = [c.key for c in checkpoints]
    runs = []
    for name in draw(st.sets(RUN_PREFIXES)):  # some runs unknown to the index
        parent: tuple[str, int] | None = None
        if draw(st.booleans()) and len(keys) > 0:
            parent = draw(st.sampled_from(keys))
        runs.append(make_run(name, draw(RUN_STATES), last_seen=NOW - draw(AGES), parent=parent))
    if draw(st.integers(0, 4)) and len(keys) > 0:
        # A resumed run with no checkpoint of its own yet: the case parent protection exists for.
        runs.append(make_run("resumed", RunState.ACTIVE, last_seen=NOW, parent=draw(st.sampled_from(keys))))
    artifacts = [
        Artifact(
            tier=draw(ARTIFACT_TIERS),
            path=f"{draw(RUN_PREFIXES)}/{draw(ARTIFACT_LEAVES)}",
            kind=draw(ARTIFACT_KIND_NAMES),
            bytes=draw(st.integers(0, 10**6)),
            last_write=NOW - draw(AGES),
            run=draw(ARTIFACT_RUNS),
            upload_id=draw(UPLOAD_IDS),
        )
        for _ in range(draw(st.integers(0, 4)))
    ]
    return Snapshot(
        runs=tuple(runs),
        checkpoints=tuple(checkpoints),
        artifacts=tuple(artifacts),
        unknown_tiers=frozenset(draw(st.sets(st.sampled_from(TIER_NAMES), max_size=2))),
    )


@settings(max_examples=200, deadline=None)
@given(snapshots(), st.integers(0, 3))
def test_property_protections_hold(snapshot: Snapshot, keep_n: int) -> None:
    policy = replace(POLICY, keep_last_of_failed=keep_n)
    d = reap(snapshot, policy)
    by_key = {c.key: c for c in snapshot.checkpoints}
    state = {r.name: r.state for r in snapshot.runs}
    newest: dict[str, int] = {}
    for c in snapshot.checkpoints:
        if c.state is COMPLETE and c.step > newest.get(c.run, -1):
            newest[c.run] = c.step
    active_parents = {r.parent for r in snapshot.runs if r.state is RunState.ACTIVE and r.parent}

    for key in d.reaped:
        c = by_key[key]
        assert not c.pinned
        assert newest.get(c.run) != c.step or c.state is not COMPLETE
        assert key not in active_parents
        assert key not in d.keep_reasons
        if c.state is not COMPLETE:
            # Invariant 3: nothing recently written, nothing the hook committed, is reaped.
            assert NOW - max(c.last_write, c.created_at) > policy.partial_after
            assert not c.committed
        else:
            # Complete checkpoints are reaped only in failed/stale runs, beyond the newest N.
            assert state.get(c.run) in (RunState.FAILED, RunState.STALE)
            ranked = sorted(
                (k.step for k in by_key.values() if k.run == c.run and k.state is COMPLETE), reverse=True
            )
            assert ranked.index(c.step) >= max(keep_n, 1)

    for a in d.actions:
        assert a.action is ActionKind.REAP and a.to_tier is None and a.reason and a.rule
        assert a.tier in TIER_NAMES and a.tier not in snapshot.unknown_tiers
        if a.step is not None:
            assert (a.run, a.step) in d.reaped
            c = by_key[(a.run, a.step)]  # type: ignore[index]
            assert a.path == c.rel_path and a.bytes == c.bytes
            if c.state is WRITING:
                assert a.tier == "hot"  # never a verified copy of an earlier version elsewhere
            else:
                assert a.tier in c.tiers or (a.tier == "hot" and c.state is CORRUPT and not c.tiers)
        else:
            assert a.rule in ARTIFACT_KINDS
            # Several records of one path: the freshest decides (never the stale listing).
            same = [x for x in snapshot.artifacts if (x.tier, x.path) == (a.tier, a.path)]
            if a.rule == "multipart-upload":
                same = [x for x in same if x.kind == a.rule and x.upload_id == a.upload_id]
            else:
                same = [x for x in same if x.kind != "multipart-upload"]
            artifact = max(same, key=lambda x: x.last_write)
            assert NOW - artifact.last_write > policy.partial_after
            assert (a.upload_id is not None) == (a.rule == "multipart-upload")
            if a.rule != "multipart-upload":  # a file inside a kept checkpoint is part of it
                assert a.path and not any(
                    a.path == c.rel_path
                    or (a.path.startswith(c.rel_path + "/") and a.rule not in DETACHED_KINDS)
                    for c in snapshot.checkpoints
                    if c.key not in d.reaped
                )


@settings(max_examples=100, deadline=None)
@given(snapshots(), st.randoms(use_true_random=False))
def test_property_deterministic_and_order_independent(snapshot: Snapshot, rnd: random.Random) -> None:
    first = reap(snapshot)
    shuffled = Snapshot(
        runs=tuple(rnd.sample(snapshot.runs, len(snapshot.runs))),
        checkpoints=tuple(rnd.sample(snapshot.checkpoints, len(snapshot.checkpoints))),
        artifacts=tuple(rnd.sample(snapshot.artifacts, len(snapshot.artifacts))),
        unknown_tiers=snapshot.unknown_tiers,
    )
    second = reap(shuffled)
    assert first.actions == second.actions
    assert first.reaped == second.reaped
    assert list(first.keep_reasons.items()) == list(second.keep_reasons.items())
    keys = [
        (a.run or "", -1 if a.step is None else a.step, a.tier or "", a.path or "") for a in first.actions
    ]
    assert keys == sorted(keys)
    assert summarize_reclaim(first.actions).total == sum(a.bytes for a in first.actions)
