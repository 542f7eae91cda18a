"""Ownership (docs/design.md, "Many nodes"): a node's own rules never delete a copy another node wrote.

The planner part is pure (``Snapshot.foreign`` in, keeps with "owned by node B: not ours" out); the
end-to-end part runs two real node processes — each with its own config, hot dir, index and
``node`` — against one moto bucket, and counts copies from the bucket's own listing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from builders import checkpoint, fleet_node, hf_checkpoint, index_checkpoint, run_cli, snapshot, tier

from ckptkeeper.core import planner
from ckptkeeper.core.model import MANIFEST_SUFFIX, ActionKind
from ckptkeeper.core.ownership import not_ours
from ckptkeeper.index import Index

NOW = 1_800_000_000.0
TIERS = [tier("hot", keep_last=1), tier("cold", "s3://b/c", keep_last=1)]


def test_planner_keeps_foreign_copies_with_the_owner_as_reason() -> None:
    ckpts = [
        checkpoint("exp", s, created_at=NOW - 1000 + s, version=f"v{s}", tiers={"cold"}) for s in (1, 2, 3)
    ]
    snap = snapshot(*ckpts, implicit_runs=None)
    own = planner.plan(snap, TIERS, {}, NOW)
    assert {(a.action, a.step) for a in own.actions} == {(ActionKind.DELETE, 1), (ActionKind.DELETE, 2)}

    foreign = {("exp", 1, "cold"): "node-a", ("exp", 2, "cold"): "node-a"}
    theirs = planner.plan(_with(snap, foreign), TIERS, {}, NOW)
    assert theirs.actions == ()
    reasons = {(k.step, k.tier): k.reasons for k in theirs.keep}
    assert reasons[(1, "cold")] == (not_ours("node-a"),) == ("owned by node node-a: not ours",)
    assert reasons[(2, "cold")] == (not_ours("node-a"),)
    assert [(k.run, k.step) for k in theirs.keep] == sorted((k.run, k.step) for k in theirs.keep)
    assert theirs.reclaim_bytes["cold"] == 0


def test_only_the_foreign_copy_is_spared() -> None:
    """A checkpoint with our copy in one tier and another node's in another: ours still goes."""
    tiers = [tier("hot", keep_last=1), tier("warm", "/w", keep_last=1), tier("cold", "s3://b/c", keep_last=1)]
    ckpts = [
        checkpoint("exp", 1, created_at=NOW - 10, version="v1", tiers={"warm", "cold"}),
        checkpoint("exp", 2, created_at=NOW - 5, version="v2", tiers={"hot"}),
    ]
    result = planner.plan(_with(snapshot(*ckpts), {("exp", 1, "cold"): "node-a"}), tiers, {}, NOW)
    assert [(a.action, a.step, a.tier) for a in result.actions] == [(ActionKind.DELETE, 1, "warm")]
    assert ("exp", 1, "cold", (not_ours("node-a"),)) in result.keep


def _with(snap: Any, foreign: dict[tuple[str, int, str], str]) -> Any:
    import dataclasses

    return dataclasses.replace(snap, foreign=foreign)


def test_index_snapshot_reports_copies_other_nodes_wrote(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        for step, owner in ((1, "node-a"), (2, "node-b"), (3, "")):
            cid = index_checkpoint(ix, "exp", step)
            ix.set_location(cid, "cold", f"v{step}", node=owner)
        ix.set_tier_status("cold", True)
        assert ix.snapshot(["cold"], node="node-b").foreign == {("exp", 1, "cold"): "node-a"}
        assert ix.snapshot(["cold"]).foreign == {}


def test_damaged_copy_of_another_node_stays_its_own(tmp_path: Path) -> None:
    """A copy found damaged (version ``damaged: …``, issue #13) keeps its owner: marked by a
    listing (owner from its manifest) or by a survivor re-check (owner already recorded), it is
    still reported foreign, so this node's plan never deletes it."""
    with Index(tmp_path / "i.db") as ix:
        cids = {}
        for step in (1, 2, 3):
            cids[step] = index_checkpoint(ix, "exp", step)
        ix.set_location(cids[1], "cold", "v1", node="node-a")
        ix.mark_damaged(cids[1], "cold", "data missing")  # survivor re-check: owner unchanged
        ix.mark_damaged(cids[2], "cold", "size differs", node="node-a")  # a listing: from the manifest
        ix.set_location(cids[3], "cold", "v3", node="node-b")
        ix.mark_damaged(cids[3], "cold", "gone")  # our own damaged copy stays ours
        ix.set_tier_status("cold", True)
        assert ix.checkpoint("exp", "checkpoint-1").damaged == {"cold": "data missing"}  # type: ignore[union-attr]
        assert ix.snapshot(["cold"], node="node-b").foreign == {
            ("exp", 1, "cold"): "node-a",
            ("exp", 2, "cold"): "node-a",
        }


# --------------------------------------------------------------------------------------------
# two real nodes, one bucket


def _write_checkpoints(run_dir: Path, steps: list[int]) -> None:
    """HF-style checkpoints, old enough to have settled."""
    for step in steps:
        hf_checkpoint(run_dir, step, os.urandom(4096 + step))


def _manifests(client: Any, bucket: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(MANIFEST_SUFFIX)]
    return sorted(keys)


def _owners(client: Any, bucket: str) -> dict[str, str]:
    return {
        k: json.loads(client.get_object(Bucket=bucket, Key=k)["Body"].read())["node"]
        for k in _manifests(client, bucket)
    }


def test_node_b_policy_never_deletes_node_a_copies(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """In a shared tier (one sharing by mistake is refused: ``test_fleet_half_config.py``)."""
    a = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, cold_keep_last=None)
    b = fleet_node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep_last=1)
    _write_checkpoints(tmp_path / "node-a" / "hot" / "exp-a", [100, 200, 300])
    _write_checkpoints(tmp_path / "node-b" / "hot" / "exp-b", [100, 200, 300])

    done = run_cli(a, "prune", "--json")
    assert done.returncode == 0, done.stderr
    a_copies = {k for k, owner in _owners(s3_client, s3_bucket).items() if owner == "node-a"}
    assert len(a_copies) == 3, _owners(s3_client, s3_bucket)

    dry = run_cli(b, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert not [x for x in plan["actions"] if x["run"] == "exp-a"]

    for _ in range(2):  # copy, then expire what B's own keep_last=1 does not keep
        done = run_cli(b, "prune", "--json")
        assert done.returncode == 0, done.stderr
    owners = _owners(s3_client, s3_bucket)
    assert {k for k, o in owners.items() if o == "node-a"} == a_copies  # counted from the bucket
    assert len([k for k, o in owners.items() if o == "node-b"]) == 1  # B's own rule did apply to B
    verify = run_cli(a, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
