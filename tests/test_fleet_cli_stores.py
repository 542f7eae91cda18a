"""The README's fleet commands, through the real CLI, on both real S3 servers (issue #14: "every
README command for the fleet works on SeaweedFS as on moto").

Two nodes share one ``shared`` cold tier and each writes a run named ``exp`` at the same step with
its own bytes; then, from each node's CLI: ``prune`` (concurrently), ``verify``, ``ls``,
``fleet --json``, ``restore --node``, ``pin``/``unpin`` (pin objects in the node's own prefix),
``status --json``, and an expiry that deletes only the node's own copy.
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
    return fleet_node(base, name, bucket, options["endpoint_url"], cold_keep_last=cold_keep, storage_options=creds)


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
