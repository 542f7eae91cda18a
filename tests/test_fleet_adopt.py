"""Adoption of a gone node's copies (docs/design.md, "Many nodes", issue #14): the fleet lease holder applies the
shared tier's rules to the runs a node silent for ``fleet.orphan_after`` left in that tier.

The decision is pure (:func:`ckptkeeper.core.adoption.plan_adoption`); the rest runs real node
processes (their own config, hot dir, index and ``node``) against one moto bucket, and counts
copies from the bucket's own listing and deletes from the nodes' log lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import fleet_node, hf_checkpoint, run_cli, start_cli

from ckptkeeper.core.adoption import plan_adoption
from ckptkeeper.core.model import MANIFEST_SUFFIX, FileEntry, Manifest, NodePart, TierPolicy, TierSpec
from ckptkeeper.fleet.adopt import ADOPTED_EVENT, adopt, plan_node
from ckptkeeper.fleet.lease import Lease
from ckptkeeper.fleet.nodes import NodeBeat, read_beat
from ckptkeeper.storage import TierStorage

NOW = 1_800_000_000.0
COLD = TierSpec("cold", "s3://b/ckpt", TierPolicy(keep_last=2), shared=True)
ORPHAN_AFTER = 2.0


def _m(step: int, *, node: str = "node-a", run: str = "exp", part: NodePart | None = None) -> Manifest:
    files = (FileEntry("model.bin", 100, f"h{step}"),)
    return Manifest(
        run, step, f"checkpoint-{step}", "hf", True, files, created_at=NOW - 1e4 + step, node=node, part=part
    )


def _copies(
    *manifests: Manifest, damaged: tuple[int, ...] = ()
) -> list[tuple[str, Manifest | None, str | None]]:
    return [
        (f"{m.run}/{m.name}", m, "damaged copy: model.bin missing" if m.step in damaged else None)
        for m in manifests
    ]


# -- the decision (pure) -----------------------------------------------------------------------


def test_the_tier_rules_expire_a_gone_nodes_copies_with_a_reason() -> None:
    plan = plan_adoption("node-a", 8 * 86400 + 60, _copies(*map(_m, (1, 2, 3, 4, 5))), set(), COLD, NOW)
    assert [(a.action.value, a.step, a.path) for a in plan.actions] == [
        ("delete", 1, "exp/checkpoint-1"),
        ("delete", 2, "exp/checkpoint-2"),
        ("delete", 3, "exp/checkpoint-3"),
    ]
    assert {a.reason for a in plan.actions} == {
        "adopted from node-a (silent 8d): not kept by cold's rules (last 2)"
    }
    assert {k.step: k.reasons for k in plan.keep} == {
        4: ("last 2",),
        5: ("last 2", "newest complete checkpoint of run"),
    }
    assert plan.reclaim_bytes == {"cold": 300} and plan.refused is None


def test_pins_the_last_good_copy_parts_and_other_nodes_copies_are_kept() -> None:
    part = NodePart("hook", job="j1", index=1, count=2)
    manifests = [_m(1), _m(2), _m(3, node="node-c"), _m(4, part=part), _m(5), _m(6), _m(7)]
    plan = plan_adoption(
        "node-a", 3600, _copies(*manifests, damaged=(7,)), {("exp", "checkpoint-1")}, COLD, NOW
    )
    assert [a.step for a in plan.actions] == [2]  # keep_last=2 over the good ones: 5, 6
    reasons = {k.step: k.reasons for k in plan.keep}
    assert reasons[1] == ("pinned",)
    assert reasons[3] == ("owned by node node-c: not ours",)
    assert reasons[4] == ("part 1 of 2 of job j1: parts expire together",)
    assert "newest complete checkpoint of run" in reasons[6]  # the last good one: 7 is damaged
    assert reasons[7] == ("incomplete: never touched",)


def test_an_adoption_over_max_delete_is_refused_whole() -> None:
    plan = plan_adoption("node-a", 3600, _copies(*map(_m, range(1, 8))), set(), COLD, NOW, max_delete=3)
    assert plan.actions == () and plan.refused is not None and "max_delete=3" in plan.refused
    forced = plan_adoption(
        "node-a", 3600, _copies(*map(_m, range(1, 8))), set(), COLD, NOW, max_delete=3, force=True
    )
    assert len(forced.actions) == 5


# -- real nodes against one bucket --------------------------------------------------------------


def _node(tmp_path: Path, name: str, bucket: str, endpoint: str, *, cold_keep: int | None) -> Path:
    cfg = fleet_node(tmp_path, name, bucket, endpoint, cold_keep_last=cold_keep)
    cfg.write_text(cfg.read_text() + f'\n[fleet]\norphan_after = "{ORPHAN_AFTER:.0f}s"\nlease_ttl = "30s"\n')
    return cfg


def _node_a_with_cold_copies(tmp_path: Path, bucket: str, endpoint: str) -> Path:
    """Node A keeps every cold copy (its own policy): 5 steps of ``exp`` in cold, step 2 pinned."""
    a = _node(tmp_path, "node-a", bucket, endpoint, cold_keep=None)
    for step in range(1, 6):
        hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 1000)
    done = run_cli(a, "prune")
    assert done.returncode == 0, done.stderr
    pinned = run_cli(a, "pin", "exp", "2")
    assert pinned.returncode == 0, pinned.stderr
    done = run_cli(a, "prune")  # the pin object goes to the tier with this pass
    assert done.returncode == 0, done.stderr
    return a


def _objects(client: Any, bucket: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def _copies_of(objects: dict[str, str], node: str) -> list[int]:
    pre = f"ckpt/{node}/exp/checkpoint-"
    return sorted(
        int(k[len(pre) : -len(MANIFEST_SUFFIX)])
        for k in objects
        if k.startswith(pre) and k.endswith(MANIFEST_SUFFIX)
    )


def _wait_until_gone(seconds: float = ORPHAN_AFTER) -> None:
    """Node A is silent from now on: its heartbeat object (dated by the store) ages past orphan_after."""
    time.sleep(seconds + 0.5)


def _adopted_events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == ADOPTED_EVENT:
            out.append(doc)
    return out


def test_the_lease_holder_adopts_a_gone_nodes_copies(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    before = _objects(s3_client, s3_bucket)
    assert _copies_of(before, "node-a") == [1, 2, 3, 4, 5]
    assert any(k.endswith("node-a/exp/checkpoint-2.ckptkeeper-pin.json") for k in before)
    _wait_until_gone()

    dry = run_cli(b, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    (shown,) = json.loads(dry.stdout)["adopted"]
    assert shown["node"] == "node-a" and shown["tier"] == "cold" and shown["deleted"] == []
    assert [(x["step"], x["path"]) for x in shown["actions"]] == [
        (1, "exp/checkpoint-1"),
        (3, "exp/checkpoint-3"),
    ]
    assert all(x["reason"].startswith("adopted from node-a (silent ") for x in shown["actions"])
    assert all(x["reason"].endswith("not kept by cold's rules (last 2)") for x in shown["actions"])
    assert {k["step"]: k["reasons"] for k in shown["keep"]}[2] == ["pinned"]
    assert _objects(s3_client, s3_bucket).keys() >= before.keys()  # the dry run changed nothing
    text = run_cli(b, "prune", "--dry-run")
    assert "adopted from node-a (tier cold, silent" in text.stdout and "would delete 2 copies" in text.stdout

    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stderr
    (did,) = json.loads(done.stdout)["adopted"]
    assert did["deleted"] == ["exp/checkpoint-1", "exp/checkpoint-3"] and did["stopped"] is None
    assert [e["path"] for e in _adopted_events(done.stderr)] == ["exp/checkpoint-1", "exp/checkpoint-3"]
    after = _objects(s3_client, s3_bucket)
    assert _copies_of(after, "node-a") == [2, 4, 5]  # pinned, and keep_last=2 (the newest among them)
    for key, etag in before.items():  # every key of a kept copy is still there, unchanged
        if key.startswith("ckpt/node-a/exp/checkpoint-") and not key.startswith(
            ("ckpt/node-a/exp/checkpoint-1", "ckpt/node-a/exp/checkpoint-3")
        ):
            assert after.get(key) == etag, key
    assert not [
        k for k in after if k.startswith(("ckpt/node-a/exp/checkpoint-1", "ckpt/node-a/exp/checkpoint-3"))
    ]
    assert "ckpt/.ckptkeeper/adopted/node-a.json" in after

    again = run_cli(b, "prune", "--json")  # looked at again (or not yet due): nothing more to delete
    assert again.returncode == 0, again.stderr
    assert all(x["deleted"] == [] for x in json.loads(again.stdout)["adopted"])
    assert _adopted_events(again.stderr) == []
    restored = run_cli(b, "restore", "exp", "--node", "node-a", "--to", str(tmp_path / "out"))
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "out" / "checkpoint-5" / "model.bin").read_bytes() == b"a-5" * 1000


def test_two_nodes_racing_for_the_lease_adopt_each_copy_once(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    nodes = [_node(tmp_path, n, s3_bucket, s3_reset, cold_keep=2) for n in ("node-b", "node-c", "node-d")]
    _wait_until_gone()
    procs = [start_cli(cfg, "prune", "--json") for cfg in nodes]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    events = [e["path"] for _, err in outs for e in _adopted_events(err)]
    assert sorted(events) == ["exp/checkpoint-1", "exp/checkpoint-3"]  # each once, by one of them
    deleted = [d for out, _ in outs for a in json.loads(out)["adopted"] for d in a["deleted"]]
    assert sorted(deleted) == sorted(events)
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [2, 4, 5]


def test_a_node_that_comes_back_is_not_adopted(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    a = _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    _wait_until_gone()
    dry = run_cli(b, "prune", "--dry-run", "--json")
    assert [x["node"] for x in json.loads(dry.stdout)["adopted"]] == ["node-a"]  # gone: B would adopt
    back = run_cli(a, "prune")  # node A comes back: its heartbeat is fresh again
    assert back.returncode == 0, back.stderr
    # B's own pass must not outlast orphan_after (2 s is too short for a pass on a loaded box)
    b.write_text(b.read_text().replace(f'orphan_after = "{ORPHAN_AFTER:.0f}s"', 'orphan_after = "60s"'))
    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["adopted"] == [] and _adopted_events(done.stderr) == []
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [1, 2, 3, 4, 5]


def test_no_adoption_planned_by_a_node_that_does_not_hold_the_lease(
    tmp_path: Path, s3_bucket: str, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    _wait_until_gone()
    holder = Lease(_shared(s3_bucket, s3_storage_options, "node-x"), "node-x", 300)
    assert holder.acquire()
    dry = run_cli(b, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["adopted"] == []
    assert "cold: node-a gone: the lease holder node-x adopts their copies" in doc["notes"]


def _beat(tier: Any) -> NodeBeat:
    """Node A's heartbeat as the store holds it (its etag and ``LastModified``: what a holder judges)."""
    beat = read_beat(tier, "node-a.json")
    assert beat is not None
    return beat


def _shared(bucket: str, options: dict[str, Any], node: str) -> Any:
    return TierStorage(
        TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(keep_last=2), options, node=node, shared=True)
    )


def test_a_holder_stalled_past_its_lease_mid_adoption_reports_and_stops(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    """The window no lease closes on S3 (deletes carry no fencing token): the holder renewed, then
    was stalled past lease_ttl inside the delete. It says so (``late``) and stops there; the rest
    is left for the next holder."""
    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    later = time.time() + 3600
    ticks = iter([later, later])  # acquire, renew; every later reading is past the TTL
    tier = _shared(s3_bucket, s3_storage_options, "node-b")
    lease = Lease(tier, "node-b", 60, clock=lambda: next(ticks, later + 61))
    assert lease.acquire()
    adoption = plan_node(tier, _beat(tier), later, max_delete=100)
    assert [a.step for a in adoption.plan.actions] == [1, 3]
    adopt(tier, lease, adoption, 3600.0, later)
    assert adoption.deleted == ["exp/checkpoint-1"] == adoption.late and adoption.lost_lease
    assert adoption.stopped == "the fleet lease expired during a delete"
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [2, 3, 4, 5]


@pytest.mark.parametrize("fresh", [True, False])
def test_adoption_stops_when_the_node_comes_back_mid_way(
    fresh: bool,
    tmp_path: Path,
    s3_bucket: str,
    s3_client: Any,
    s3_reset: str,
    s3_storage_options: dict[str, Any],
) -> None:
    """The gone node's heartbeat is read again before each delete: one that came back (its
    heartbeat written again, whatever time it says) owns its copies again; one that did not stays
    gone."""
    from ckptkeeper.fleet.nodes import write_beat

    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    later = time.time() + 3600
    tier = _shared(s3_bucket, s3_storage_options, "node-b")
    lease = Lease(tier, "node-b", 600, clock=lambda: later)
    assert lease.acquire()
    adoption = plan_node(tier, _beat(tier), later, max_delete=100)
    if fresh:  # by a clock an hour behind the store's: rewritten all the same
        write_beat(tier, "node-a", runs_held=1, checkpoints_held=5, newest_verified=None, now=later - 7200)
    adopt(tier, lease, adoption, 3600.0, later)
    if fresh:
        assert (
            adoption.deleted == [] and adoption.stopped is not None and "node-a came back" in adoption.stopped
        )
        assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [1, 2, 3, 4, 5]
    else:
        assert adoption.deleted == ["exp/checkpoint-1", "exp/checkpoint-3"] and adoption.complete


def test_a_copy_claimed_by_another_holder_is_left_to_it(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    """The window the lease cannot close (a holder stalled between its renewal and its delete,
    the lease taken over meanwhile): the stalled holder had claimed the copy, so the node that
    took over skips it — one deleter per copy, whoever stalled where. A claim older than
    ``stale_after`` (a claimant that died before its delete) is taken over."""
    from ckptkeeper.fleet.claims import claim

    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    later = time.time() + 60  # the store's clock a minute after the claims below
    stalled = _shared(s3_bucket, s3_storage_options, "node-x")
    assert claim(stalled, "node-x", "node-a", "exp/checkpoint-1", later, 3600.0)  # then it stalls
    assert not claim(stalled, "node-y", "node-a", "exp/checkpoint-1", later, 3600.0)  # one claimant

    tier = _shared(s3_bucket, s3_storage_options, "node-b")
    lease = Lease(tier, "node-b", 600, clock=lambda: later)
    assert lease.acquire()
    adoption = plan_node(tier, _beat(tier), later, max_delete=100)
    adopt(tier, lease, adoption, 3600.0, later)
    assert adoption.deleted == ["exp/checkpoint-3"] and adoption.claimed == ["exp/checkpoint-1"]
    assert adoption.to_dict()["claimed_by_another_holder"] == ["exp/checkpoint-1"]
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [1, 2, 4, 5]  # node-x's to delete

    # node-x never came back: once its claim is older than stale_after, the next holder takes it over
    much_later = later + 3601
    adoption = plan_node(tier, _beat(tier), much_later, max_delete=100)
    assert lease.acquire()
    adopt(tier, lease, adoption, 3600.0, much_later)
    assert adoption.deleted == ["exp/checkpoint-1"] and adoption.claimed == []
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [2, 4, 5]


def test_a_node_back_mid_pass_is_not_adopted(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """Node A, silent past orphan_after, starts a pass (killed in its first action, so that pass
    never reaches its end). It wrote its heartbeat before acting: the lease holder B sees A back
    and adopts nothing. (Heartbeats written only at the end of a pass left A looking gone for
    its whole first pass back, and B deleted copies 1 and 3 under it.)"""
    a = _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    silence = 8.0  # A's pass start and B's pass must fall within it on a loaded box
    for cfg in (a, b):
        cfg.write_text(
            cfg.read_text().replace(
                f'orphan_after = "{ORPHAN_AFTER:.0f}s"', f'orphan_after = "{silence:.0f}s"'
            )
        )
    before = _objects(s3_client, s3_bucket)
    _wait_until_gone(silence)
    hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", 6, b"a-6" * 1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    env["CKPTKEEPER_TEST_CRASH_AFTER"] = "1"  # SIGKILL at the pass's first crash point
    back = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(a), "prune"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert back.returncode == -signal.SIGKILL, back.stderr
    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["adopted"] == [] and _adopted_events(done.stderr) == []
    after = _objects(s3_client, s3_bucket)
    assert _copies_of(after, "node-a") == [1, 2, 3, 4, 5]
    assert {k: after[k] for k in before if k.startswith("ckpt/node-a/exp/")} == {
        k: v for k, v in before.items() if k.startswith("ckpt/node-a/exp/")
    }


def test_the_holder_removes_stale_claims_of_gone_items_only(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    """Claims are not kept forever: at its next look at a gone node, once they are older than
    orphan_after, the lease holder removes the claims of items that are gone (the copies it
    adopted, markers and uploads cleaned); a stale claim whose copy still exists stays (that copy
    can still be deleted: the claim is what makes it deleted once)."""
    from ckptkeeper.config import load_settings
    from ckptkeeper.fleet.adopt import clean_and_adopt, gone_beats
    from ckptkeeper.fleet.claims import marker_item

    _node_a_with_cold_copies(tmp_path, s3_bucket, s3_reset)
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    _wait_until_gone()
    done = run_cli(b, "prune", "--json")  # B adopts 1 and 3, claiming each first
    assert done.returncode == 0, done.stderr
    assert sorted(e["path"] for e in _adopted_events(done.stderr)) == ["exp/checkpoint-1", "exp/checkpoint-3"]
    claims = "ckpt/.ckptkeeper/claims/node-a/"

    def claimed() -> list[str]:
        return sorted(k[len(claims) :] for k in _objects(s3_client, s3_bucket) if k.startswith(claims))

    # (that pass's own sweep kept them while younger than orphan_after: the holder swept them later)
    tier = _shared(s3_bucket, s3_storage_options, "node-b")
    # a claimant that died before its delete (copy 4 is still there) and a cleaned marker's claim
    for item in ("exp/checkpoint-4", marker_item("exp/checkpoint-9")):
        tier.put_fleet_object(f"claims/node-a/{item}", b'{"holder": "node-x", "at": 0}')

    settings = load_settings(str(b))
    later = time.time() + 3600  # past orphan_after, and the node is due a look again
    lease = Lease(tier, "node-b", 600, clock=lambda: later)
    assert lease.acquire()
    adopted: list[Any] = []
    clean_and_adopt(settings, tier, lease, gone_beats(tier, "node-b", later, ORPHAN_AFTER), later, adopted)
    assert claimed() == ["exp/checkpoint-4"]  # copy 4 is still there: its claim stays
    (adoption,) = adopted
    assert adoption.complete and adoption.deleted == []
    assert sorted(adoption.claims_removed) == sorted(
        ["exp/checkpoint-1", "exp/checkpoint-3", marker_item("exp/checkpoint-9")]
    )
    assert adoption.to_dict()["claims_removed"] == 3
    assert _copies_of(_objects(s3_client, s3_bucket), "node-a") == [2, 4, 5]
