"""The pure side of versions spanning nodes (:mod:`ckptkeeper.core.versions`): what a part record
may say, when a version is complete, and which deletes of a node's part a plan may keep."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from builders import checkpoint

from ckptkeeper.core.model import Action, ActionKind, Keep, NodePart
from ckptkeeper.core.versions import (
    PartRecord,
    VersionStatus,
    hold_parts,
    pin_name,
    pin_parts,
    pinned_by,
    record_name,
    version_pin_reasons,
    version_status,
)

KEY = ("job-7", "run", 100)


def rec(index: int, *, node: str | None = None, count: int = 2, digest: str = "d") -> PartRecord:
    node = node or f"node{index}"
    return PartRecord(
        "job-7", "run", 100, index, count, node, f"{node}/run/step-100", f"{digest}{index}", 1.0
    )


def test_a_record_round_trips_and_sits_at_its_own_key() -> None:
    r = rec(1)
    assert r.name == "versions/j-job-7/run/100/part-1.json"
    assert PartRecord.from_json(r.to_json(), r.name) == r
    assert record_name("a/b", "run", 5, 0) == "versions/j-a%2Fb/run/5/part-0.json"
    assert record_name(None, "run", 5, 0) == "versions/none/run/5/part-0.json"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"kind": "x"}, "not a part record"),
        ({"part": 2}, "part"),
        ({"parts": 1}, "parts"),
        ({"node": "a/b"}, "not a node name"),
        ({"manifest": "other/run/step-100"}, "is not under node1/run/"),
        ({"manifest": "../x"}, "manifest"),
        ({"step": -1}, "step"),
        ({"step": 200}, "describes"),
        ({"digest": ""}, "digest"),
        ({"written_at": float("nan")}, "written_at"),
    ],
)
def test_a_bad_record_is_refused_with_its_reason(change: dict[str, object], error: str) -> None:
    r = rec(1)
    doc = {**json.loads(r.to_json()), **change}
    with pytest.raises(ValueError, match=error):
        PartRecord.from_json(json.dumps(doc).encode(), r.name)
    with pytest.raises(ValueError):
        PartRecord.from_json(b"\xff not json", r.name)
    with pytest.raises(ValueError, match="larger"):
        PartRecord.from_json(b" " * 5000, r.name)


def test_complete_only_when_every_part_points_at_its_verified_manifest() -> None:
    r0, r1 = rec(0), rec(1)
    manifests = {r0.manifest: r0.digest, r1.manifest: r1.digest}
    both = [(r0.name, r0, None), (r1.name, r1, None)]
    s = version_status(KEY, 2, both, manifests)
    assert s.complete and s.label == "2/2" and s.problems == () and s.nodes == {0: "node0", 1: "node1"}

    s = version_status(KEY, 2, both[:1], manifests)
    assert not s.complete and s.label == "1/2"
    s = version_status(KEY, 2, both, {r0.manifest: r0.digest})  # node 1's manifest gone
    assert s.label == "1/2" and s.problems == (f"{r1.name}: no readable manifest at {r1.manifest}",)
    s = version_status(KEY, 2, both, {**manifests, r1.manifest: "other"})
    assert s.label == "1/2" and "another version (digest differs)" in s.problems[0]
    s = version_status(KEY, 3, both, manifests)
    assert s.label == "0/3" and all("says 2 parts" in p for p in s.problems)
    bad = [(r0.name, r0, None), ("versions/j-job-7/run/100/part-1.json", None, "bad record: part: 9")]
    s = version_status(KEY, 2, bad, manifests)
    assert s.label == "1/2" and s.problems == ("versions/j-job-7/run/100/part-1.json: bad record: part: 9",)
    # Same records in any order: the same answer on every node.
    assert version_status(KEY, 2, both[::-1], manifests) == version_status(KEY, 2, both, manifests)


def part(k: int, n: int = 2) -> NodePart:
    return NodePart(note="hook", job="job-7", index=k, count=n, marker_elsewhere=k > 0)


def delete(step: int, tier: str, rule: str) -> Action:
    return Action(ActionKind.DELETE, rule, "run", step, tier, None, f"run/step-{step}", 10, rule)


def status(step: int, have: tuple[int, ...]) -> VersionStatus:
    return VersionStatus("job-7", "run", step, 2, have)


POS = {"hot": 0, "cold": 1}


def test_a_hot_part_waits_for_the_whole_version_in_the_shared_tier() -> None:
    ckpts = {
        ("run", s): replace(checkpoint("run", s, tiers=("hot", "cold")), part=part(0)) for s in (100, 200)
    }
    deletes = [delete(100, "hot", "moved")]
    left, keeps, notes = hold_parts(
        deletes, [], ckpts, {("run", 100, "cold"): status(100, (0,))}, ["cold"], POS
    )
    assert left == [] and list(keeps) == [
        Keep("run", 100, "hot", ("part 0 of 2: version incomplete in cold (1/2 parts)",))
    ]
    assert notes == ["run@100: part 0 of 2: version incomplete in cold (1/2 parts)"]
    left, keeps, _ = hold_parts(
        deletes, [], ckpts, {("run", 100, "cold"): status(100, (0, 1))}, ["cold"], POS
    )
    assert left == deletes and list(keeps) == []
    # Not in cold at all yet (the copy is in this very plan): held too.
    only_hot = {k: replace(c, tiers=frozenset({"hot"})) for k, c in ckpts.items()}
    left, keeps, _ = hold_parts(deletes, [], only_hot, {}, ["cold"], POS)
    assert left == [] and keeps[0].reasons == (
        "part 0 of 2: version incomplete in cold (this part not recorded there yet)",
    )
    # A shared tier's own copy going (the part resides faster) is not a hot part let go.
    from_cold = [delete(100, "cold", "redundant")]
    assert hold_parts(from_cold, [], ckpts, {}, ["cold"], POS)[0] == from_cold
    # No shared tier: nothing changes (a single node's own tiers, as before).
    assert hold_parts(deletes, [], ckpts, {}, [], POS)[0] == deletes
    # A whole checkpoint is never held.
    whole = {k: replace(c, part=None) for k, c in ckpts.items()}
    assert hold_parts(deletes, [], whole, {}, ["cold"], POS)[0] == deletes


def test_an_expiry_waits_while_a_newer_version_is_incomplete() -> None:
    ckpts = {
        ("run", s): replace(checkpoint("run", s, tiers=("cold",)), part=part(1)) for s in (100, 200, 300)
    }
    deletes = [delete(100, "cold", "expired")]
    versions = {("run", 200, "cold"): status(200, (0, 1)), ("run", 300, "cold"): status(300, (1,))}
    left, keeps, _ = hold_parts(deletes, [], ckpts, versions, ["cold"], POS)
    assert left == [] and keeps[0].reasons == (
        "part 1 of 2: expiry waits: newer version step 300 incomplete in cold (1/2 parts)",
    )
    versions[("run", 300, "cold")] = status(300, (0, 1))
    assert hold_parts(deletes, [], ckpts, versions, ["cold"], POS)[0] == deletes


def test_a_version_pin_is_its_key_and_pins_only_parts_not_pinned_here() -> None:
    name = pin_name("job-7", "run", 100, "node0")
    assert name == "versions/j-job-7/run/100/pin-node0.json"
    assert pinned_by(name.rsplit("/", 1)[-1]) == "node0"
    for leaf in ("part-0.json", "pin-.json", "pin-.hidden.json", "pin-node0.txt", "x/pin-a.json"):
        assert pinned_by(leaf) is None, leaf
    mine = replace(checkpoint("run", 100, tiers=("cold",)), part=part(1))
    here = replace(checkpoint("run", 200, tiers=("cold",), pinned=True), part=part(1))
    whole = checkpoint("run", 300, tiers=("cold",))
    other = replace(checkpoint("run", 400, tiers=("cold",)), part=part(1))
    pins = {("run", 100): ["node0", "node2", "node0"], ("run", 200): ["node0"], ("run", 300): ["node0"]}
    out, why = pin_parts([mine, here, whole, other], pins)
    assert [c.pinned for c in out] == [True, True, False, False]
    assert why == {("run", 100): "pinned on node0, node2 (version pin)"}
    keeps = [Keep("run", 100, "cold", ("pinned", "x")), Keep("run", 200, "cold", ("pinned",))]
    assert version_pin_reasons(keeps, why) == (
        Keep("run", 100, "cold", ("pinned on node0, node2 (version pin)", "x")),
        Keep("run", 200, "cold", ("pinned",)),
    )
