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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from builders import local_tier, s3_tier, write_config

from ckptkeeper.core.model import MANIFEST_SUFFIX

PIN = ".ckptkeeper-pin.json"


def _node(base: Path, name: str, store: tuple[str, dict[str, Any]], *, cold_keep: int = 5) -> Path:
    bucket, options = store
    home = base / name
    (home / "hot").mkdir(parents=True, exist_ok=True)
    creds = {k: v for k, v in options.items() if k != "endpoint_url"}
    cold = s3_tier("cold", bucket, options["endpoint_url"], storage_options=creds, keep_last=cold_keep, replicate=True)
    cold["shared"] = True
    return write_config(
        home / "config.toml",
        index=home / "index.db",
        node=name,
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},  # back-dated mtimes
        tiers=[local_tier("hot", home / "hot", keep_last=1), cold],
    )


def _checkpoint(hot: Path, step: int, payload: bytes) -> None:
    ckpt = hot / "exp" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(payload)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    when = time.time() - 3600 + step
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def _start(config: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.Popen(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = _start(config, *args)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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
        _checkpoint(tmp_path / name / "hot", 100, data)

    procs = {name: _start(cfg, "prune", "--json") for name, cfg in config.items()}  # at the same moment
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
        verify = _cli(cfg, "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        listed = json.loads(_cli(cfg, "ls", "--json").stdout)
        (run,) = listed["runs"]
        assert [(c["step"], sorted(c["tiers"])) for c in run["checkpoints"]] == [(100, ["cold", "hot"])]

    fleet = _cli(config["node-a"], "fleet", "--json")
    assert fleet.returncode == 0, fleet.stderr
    (tier,) = json.loads(fleet.stdout)["tiers"]
    assert {n["node"]: n["checkpoints_held"] for n in tier["nodes"]} == {"node-a": 1, "node-b": 1}

    # restore by node: node A fetches node B's run of the same name, byte-identical
    dest = tmp_path / "from-b"
    restored = _cli(config["node-a"], "restore", "exp", "--node", "node-b", "--to", str(dest), "--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["step"] == 100
    assert (dest / "checkpoint-100" / "model.bin").read_bytes() == payload["node-b"]

    # pin objects go under the pinning node's own prefix, and unpin removes them
    pinned = _cli(config["node-a"], "pin", "exp", "100", "--json")
    assert pinned.returncode == 0 and json.loads(pinned.stdout)["pinned"] is True, pinned.stderr
    assert f"ckpt/node-a/exp/checkpoint-100{PIN}" in _keys(store)
    unpinned = _cli(config["node-a"], "unpin", "exp", "100", "--json")
    assert unpinned.returncode == 0 and json.loads(unpinned.stdout)["pinned"] is False, unpinned.stderr
    assert not any(k.endswith(PIN) for k in _keys(store))

    status = _cli(config["node-b"], "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["checkpoints"] == {"complete": 1}

    # node A's cold keep_last=1 expires its own step 100 once step 200 is there; node B's copy of
    # exp@100 (same run name, same step) is not A's to delete and stays, whole
    config["node-a"] = _node(tmp_path, "node-a", store, cold_keep=1)
    _checkpoint(tmp_path / "node-a" / "hot", 200, os.urandom(1000))
    expired = _cli(config["node-a"], "prune", "--json")
    assert expired.returncode == 0, expired.stdout + expired.stderr
    keys = _keys(store)
    assert f"ckpt/node-a/exp/checkpoint-100{MANIFEST_SUFFIX}" not in keys
    assert f"ckpt/node-a/exp/checkpoint-200{MANIFEST_SUFFIX}" in keys
    assert f"ckpt/node-b/exp/checkpoint-100{MANIFEST_SUFFIX}" in keys
    assert _cli(config["node-b"], "verify").returncode == 0
