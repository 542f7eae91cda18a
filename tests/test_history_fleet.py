"""Who deleted my copies, and why, across nodes (docs/history.md): the fleet lease holder's adopted
deletes leave a record in the shared tier that ``history`` and ``why`` read on the owner node or
any other; the record store is bounded and skips what it cannot trust.

Real parts: node processes with their own config, hot dir, index and ``node`` against one moto
bucket over HTTP, as in tests/test_fleet_adopt.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from builders import fleet_node, hf_checkpoint, run_cli

from ckptkeeper.core.history import ADOPTED, HistoryEvent
from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.fleet import history as fleet_history
from ckptkeeper.storage import TierStorage

ORPHAN_AFTER = 2.0


def _node(tmp_path: Path, name: str, bucket: str, endpoint: str, *, cold_keep: int | None) -> Path:
    cfg = fleet_node(tmp_path, name, bucket, endpoint, cold_keep_last=cold_keep)
    cfg.write_text(cfg.read_text() + f'\n[fleet]\norphan_after = "{ORPHAN_AFTER:.0f}s"\nlease_ttl = "30s"\n')
    return cfg


def _json(config: Path, *args: str) -> Any:
    done = run_cli(config, *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def _adopted_lines(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("action") == ADOPTED:
            out.append(doc)
    return out


def test_the_owner_and_any_node_learn_who_deleted_its_copies_and_why(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    a = _node(tmp_path, "node-a", s3_bucket, s3_reset, cold_keep=None)
    for step in range(1, 6):
        hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 1000)
    assert run_cli(a, "prune").returncode == 0  # every step replicated to cold, hot keeps step 5
    b = _node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep=2)
    c = _node(tmp_path, "node-c", s3_bucket, s3_reset, cold_keep=2)
    time.sleep(ORPHAN_AFTER + 0.5)  # node A is silent from now on: gone once its heartbeat is that old

    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stderr
    (adoption,) = json.loads(done.stdout)["adopted"]
    assert adoption["deleted"] == ["exp/checkpoint-1", "exp/checkpoint-2", "exp/checkpoint-3"]
    lines = _adopted_lines(done.stderr)
    assert [(x["path"], x["rule"], x["node"], x["gone"]) for x in lines] == [
        (f"exp/checkpoint-{s}", "adopted", "node-b", "node-a") for s in (1, 2, 3)
    ]
    keys = [
        o["Key"]
        for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/.ckptkeeper/history/").get(
            "Contents", []
        )
    ]
    assert len(keys) == 1 and keys[0].startswith("ckpt/.ckptkeeper/history/node-a/")
    assert keys[0].endswith("-node-b.json")

    # the lease holder's own history: what it deleted, whose it was
    mine = _json(b, "history", "--node", "node-a")["events"]
    assert [(e["action"], e["step"], e["node"], e["owner"]) for e in mine] == [
        (ADOPTED, s, "node-b", "node-a") for s in (1, 2, 3)
    ]

    # the owner, back: its index still lists the cold copy of step 1; the record says otherwise
    story = _json(a, "why", "exp", "1")
    assert story["state"] == "gone" and story["undelete"] is False
    gone = story["gone"]
    assert (gone["action"], gone["tier"], gone["node"], gone["owner"], gone["rule"], gone["source"]) == (
        ADOPTED,
        "cold",
        "node-b",
        "node-a",
        "adopted",
        "fleet",
    )
    assert gone["reason"].startswith("adopted from node-a (silent ")
    assert gone["reason"].endswith("not kept by cold's rules (last 2)")
    assert any("but node-b deleted it on" in n for n in story["notes"])
    text = " ".join(run_cli(a, "why", "exp", "1").stdout.split())
    assert "gone: adopted-delete in cold by node-b (fleet lease holder) on " in text
    assert "adopted from node-a (silent" in text
    kept = _json(a, "why", "exp", "5")
    assert kept["state"] == "present" and {x["tier"] for x in kept["copies"]} == {"hot", "cold"}
    owner_history = _json(a, "history", "exp")["events"]
    assert [(e["action"], e["step"], e["source"]) for e in owner_history if e["node"] == "node-b"] == [
        (ADOPTED, s, "fleet") for s in (1, 2, 3)
    ]

    # any node: node C never held a copy of it, and reads the same story from the record
    seen = _json(c, "why", "exp", "2", "--node", "node-a")
    assert seen["state"] == "gone" and seen["gone"]["node"] == "node-b" and seen["node"] == "node-a"
    assert [e["step"] for e in _json(c, "history", "--node", "node-a")["events"]] == [1, 2, 3]


def _tier(bucket: str, endpoint: str, node: str) -> Any:
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    return TierStorage(TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node=node, shared=True))


def test_the_record_store_is_bounded_and_skips_what_it_cannot_trust(
    s3_bucket: str, s3_reset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(s3_bucket, s3_reset, "node-b")
    monkeypatch.setattr(fleet_history, "MAX_RECORDS", 3)
    monkeypatch.setattr(fleet_history, "MAX_EVENTS", 2)
    t = time.time()
    for i in range(5):
        events = [HistoryEvent(t + i, ADOPTED, "exp", 10 * i + k, "cold", node="node-b") for k in range(3)]
        assert fleet_history.write_record(tier, "node-b", "node-a", events, t + i, keep=86400.0)
    records = tier.list_fleet_objects("history/node-a")
    assert len(records) == 3  # the newest three
    steps = [e.step for e in fleet_history.read_records(tier, "node-a")]
    assert steps == [20, 21, 30, 31, 40, 41]  # two events per record, the third left out
    # a hostile record (an event claiming another deleter) or garbage is skipped, never fatal (and
    # counts in the bound: the newest three names are read)
    forged = {
        "by": "node-b",
        "events": [{"time": t, "action": ADOPTED, "run": "exp", "step": 1, "node": "x"}],
    }
    tier.put_fleet_object("history/node-a/9999999999999999-node-b.json", json.dumps(forged).encode())
    tier.put_fleet_object("history/node-a/9999999999999998-node-b.json", b"\xff not json")
    assert [e.step for e in fleet_history.read_records(tier, "node-a")] == [40, 41]
    # records past history.keep (dated by the store) go with the next one written
    fleet_history.write_record(
        tier, "node-b", "node-a", [HistoryEvent(t, ADOPTED, "exp", 99, "cold")], t, keep=0.0
    )
    assert len(tier.list_fleet_objects("history/node-a")) <= 3


def test_a_gone_nodes_litter_cleanup_and_adoption_become_events_with_reasons() -> None:
    from ckptkeeper.core.history import CLEANUP
    from ckptkeeper.core.model import Action, ActionKind

    delete = Action(ActionKind.DELETE, "adopted from node-a (silent 8d): not kept", "exp", 3, "cold", None,
                    "exp/checkpoint-3", 300, "adopted")  # fmt: skip
    events = fleet_history.gone_node_events(
        "node-c", "cold", "node-a", 8 * 86400 + 5, 1000.0,
        discarded=["node-a/exp/checkpoint-9.ckptkeeper-staging"], aborted=["node-a/exp/checkpoint-9/model.bin"],
        deleted=[delete],
    )  # fmt: skip
    assert [(e.action, e.run, e.path, e.rule, e.node, e.owner) for e in events] == [
        (CLEANUP, "exp", "exp/checkpoint-9.ckptkeeper-staging", "gone-node-staging", "node-c", "node-a"),
        (CLEANUP, "exp", "exp/checkpoint-9/model.bin", "gone-node-upload", "node-c", "node-a"),
        (ADOPTED, "exp", "exp/checkpoint-3", "adopted", "node-c", "node-a"),
    ]
    assert events[0].reason == "node-a gone (silent 8d5s): its abandoned copy in progress discarded"
    assert events[2].reason == delete.reason and events[2].bytes == 300 and events[2].step == 3
    again = HistoryEvent.from_dict(json.loads(json.dumps(events[2].to_dict())), source="fleet")
    assert again == events[2].with_source("fleet")
