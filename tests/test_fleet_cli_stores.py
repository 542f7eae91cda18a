"""The README's fleet commands, through the real CLI, on both real S3 servers (issue #14: "every
README command for the fleet works on SeaweedFS as on moto").

Two nodes share one ``shared`` cold tier and each writes a run named ``exp`` at the same step with
its own bytes; then, from each node's CLI: ``prune`` (concurrently), ``verify``, ``ls``,
``fleet --json``, ``restore --node``, ``pin``/``unpin`` (pin objects in the node's own prefix),
``status --json``, and an expiry that deletes only the node's own copy. Then the two newer fleet
features on each server: adoption of a gone node's copies by the lease holder (helpers of
``test_fleet_adopt.py``) and a shared hot directory whose lease is in the bucket (helpers of
``test_fleet_sharedfs.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from builders import fleet_node, hf_checkpoint, run_cli, start_cli

from ckptkeeper.core.model import MANIFEST_SUFFIX

PIN = ".ckptkeeper-pin.json"


def _node(base: Path, name: str, store: tuple[str, dict[str, Any]], *, cold_keep: int = 5) -> Path:
    bucket, options = store
    creds = {k: v for k, v in options.items() if k != "endpoint_url"}
    return fleet_node(
        base, name, bucket, options["endpoint_url"], cold_keep_last=cold_keep, storage_options=creds
    )


def _keys(store: tuple[str, dict[str, Any]]) -> set[str]:
    import boto3

    bucket, options = store
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys


def test_the_readme_fleet_commands_on_each_store(tmp_path: Path, store: tuple[str, dict[str, Any]]) -> None:
    payload = {"node-a": os.urandom(200_000), "node-b": os.urandom(200_000)}
    config = {name: _node(tmp_path, name, store) for name in payload}
    for name, data in payload.items():
        hf_checkpoint(tmp_path / name / "hot" / "exp", 100, data)

    procs = {name: start_cli(cfg, "prune", "--json") for name, cfg in config.items()}  # at the same moment
    for name, p in procs.items():
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, f"{name}: {out}{err}"
        doc = json.loads(out)
        assert doc["result"]["failed"] == [] and doc["result"]["done"] >= 1, out
        assert any(a["action"] == "copy" and a["to_tier"] == "cold" for a in doc["actions"]), out
    keys = _keys(store)
    assert {k for k in keys if k.endswith(MANIFEST_SUFFIX)} == {
        f"ckpt/{name}/exp/checkpoint-100{MANIFEST_SUFFIX}" for name in payload
    }

    for cfg in config.values():
        verify = run_cli(cfg, "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        listed = json.loads(run_cli(cfg, "ls", "--json").stdout)
        (run,) = listed["runs"]
        assert [(c["step"], sorted(c["tiers"])) for c in run["checkpoints"]] == [(100, ["cold", "hot"])]

    fleet = run_cli(config["node-a"], "fleet", "--json")
    assert fleet.returncode == 0, fleet.stderr
    (tier,) = json.loads(fleet.stdout)["tiers"]
    assert {n["node"]: n["checkpoints_held"] for n in tier["nodes"]} == {"node-a": 1, "node-b": 1}

    # restore by node: node A fetches node B's run of the same name, byte-identical
    dest = tmp_path / "from-b"
    restored = run_cli(config["node-a"], "restore", "exp", "--node", "node-b", "--to", str(dest), "--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["step"] == 100
    assert (dest / "checkpoint-100" / "model.bin").read_bytes() == payload["node-b"]

    # pin objects go under the pinning node's own prefix, and unpin removes them
    pinned = run_cli(config["node-a"], "pin", "exp", "100", "--json")
    assert pinned.returncode == 0 and json.loads(pinned.stdout)["pinned"] is True, pinned.stderr
    assert f"ckpt/node-a/exp/checkpoint-100{PIN}" in _keys(store)
    unpinned = run_cli(config["node-a"], "unpin", "exp", "100", "--json")
    assert unpinned.returncode == 0 and json.loads(unpinned.stdout)["pinned"] is False, unpinned.stderr
    assert not any(k.endswith(PIN) for k in _keys(store))

    status = run_cli(config["node-b"], "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["checkpoints"] == {"complete": 1}

    # node A's cold keep_last=1 expires its own step 100 once step 200 is there; node B's copy of
    # exp@100 (same run name, same step) is not A's to delete and stays, whole
    config["node-a"] = _node(tmp_path, "node-a", store, cold_keep=1)
    hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", 200, os.urandom(1000))
    expired = run_cli(config["node-a"], "prune", "--json")
    assert expired.returncode == 0, expired.stdout + expired.stderr
    keys = _keys(store)
    assert f"ckpt/node-a/exp/checkpoint-100{MANIFEST_SUFFIX}" not in keys
    assert f"ckpt/node-a/exp/checkpoint-200{MANIFEST_SUFFIX}" in keys
    assert f"ckpt/node-b/exp/checkpoint-100{MANIFEST_SUFFIX}" in keys
    assert run_cli(config["node-b"], "verify").returncode == 0


def _client(store: tuple[str, dict[str, Any]]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=store[1]["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def test_the_lease_holder_adopts_a_gone_nodes_copies_on_each_store(
    tmp_path: Path, store: tuple[str, dict[str, Any]]
) -> None:
    """README "Many nodes, one bucket": adoption and its claims (conditional creates) on each server."""
    from test_fleet_adopt import (
        _adopted_events,
        _copies_of,
        _node_a_with_cold_copies,
        _objects,
        _wait_until_gone,
    )
    from test_fleet_adopt import _node as adopt_node

    bucket, endpoint = store[0], store[1]["endpoint_url"]
    client = _client(store)
    _node_a_with_cold_copies(tmp_path, bucket, endpoint)  # steps 1-5 in cold, 2 pinned, all kept
    b = adopt_node(tmp_path, "node-b", bucket, endpoint, cold_keep=2)
    assert _copies_of(_objects(client, bucket), "node-a") == [1, 2, 3, 4, 5]
    _wait_until_gone()

    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    (did,) = json.loads(done.stdout)["adopted"]
    assert did["node"] == "node-a" and did["tier"] == "cold", did
    assert did["deleted"] == ["exp/checkpoint-1", "exp/checkpoint-3"] and did["stopped"] is None, did
    assert did["claimed_by_another_holder"] == [] and did["errors"] == [], did
    assert [e["path"] for e in _adopted_events(done.stderr)] == did["deleted"]
    after = _objects(client, bucket)
    assert _copies_of(after, "node-a") == [2, 4, 5]  # pinned, and the newest 2
    assert not [
        k for k in after if k.startswith(("ckpt/node-a/exp/checkpoint-1", "ckpt/node-a/exp/checkpoint-3"))
    ]
    for step in (2, 4, 5):  # kept copies: the bytes node A wrote
        body = client.get_object(Bucket=bucket, Key=f"ckpt/node-a/exp/checkpoint-{step}/model.bin")["Body"]
        assert body.read() == f"a-{step}".encode() * 1000
    assert "ckpt/.ckptkeeper/adopted/node-a.json" in after
    # each adopted copy was claimed before its delete; the pass's own sweep may already have removed
    # a claim that aged past orphan_after (2 s) by its end, and says how many it removed
    claims = "ckpt/.ckptkeeper/claims/node-a/"
    present = {k[len(claims) :] for k in after if k.startswith(claims)}
    assert present <= {"exp/checkpoint-1", "exp/checkpoint-3"}, present
    assert len(present) + did["claims_removed"] == 2, (present, did)

    again = run_cli(b, "prune", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(x["deleted"] == [] for x in json.loads(again.stdout)["adopted"])
    assert _adopted_events(again.stderr) == []
    assert _copies_of(_objects(client, bucket), "node-a") == [2, 4, 5]


def test_a_shared_hot_dir_with_its_lease_in_the_bucket_on_each_store(
    tmp_path: Path, store: tuple[str, dict[str, Any]]
) -> None:
    """README "A shared hot filesystem": two nodes on one hot dir, the lease in the shared bucket;
    exactly one acts, the other only catalogs, both exit 0."""
    from test_fleet_sharedfs import _cold_bytes, _hot_steps, _manifests, _payloads
    from test_fleet_sharedfs import _node as sharedfs_node

    bucket, endpoint = store[0], store[1]["endpoint_url"]
    client = _client(store)
    hot = tmp_path / "shared-hot"
    payloads = _payloads(hot)
    configs = {
        n: sharedfs_node(tmp_path, n, hot, bucket=bucket, endpoint=endpoint) for n in ("node-a", "node-b")
    }

    procs = {n: start_cli(c, "prune", "--json") for n, c in configs.items()}  # at the same moment
    docs = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (n, out, err)
        docs[n] = json.loads(out)
    actors = [n for n, d in docs.items() if d["result"]["done"]]
    assert len(actors) == 1, {n: (d["result"], d["notes"]) for n, d in docs.items()}
    (holder,) = actors
    (other,) = set(configs) - {holder}
    assert docs[holder]["result"]["failed"] == [], docs[holder]
    assert docs[other]["actions"] == []
    note = next(x for x in docs[other]["notes"] if x.startswith("hot is shared:"))
    assert note.startswith(f"hot is shared: {holder} holds the lease (expires in "), note
    assert note.endswith("); this node only catalogs"), note

    manifests = _manifests(client, bucket)  # each checkpoint copied once, by the holder, whole
    assert sorted(m["step"] for m in manifests.values()) == sorted(payloads)
    assert {m["node"] for m in manifests.values()} == {holder}
    for key, m in manifests.items():
        assert _cold_bytes(client, bucket, key) == payloads[m["step"]]
    assert _hot_steps(hot) == ["checkpoint-400"]
    # the lease is in the bucket (this store enforces conditional writes), not in the filesystem
    assert [k for k in _keys(store) if k.startswith("ckpt/.ckptkeeper/leases/hot-")], _keys(store)
    assert not (hot / ".ckptkeeper" / "leases").exists() or not any(
        (hot / ".ckptkeeper" / "leases").iterdir()
    )
