"""Node identity (docs/design.md, "Many nodes"): the ``node`` key, and the node recorded in manifests and staging markers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import manifest_of, write_config

from ckptkeeper.config import load_settings
from ckptkeeper.core.model import MANIFEST_SUFFIX, TierPolicy, TierSpec
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage import LocalTierStorage, TierStorage, s3_transfer


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_node_defaults_to_the_hostname(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", index=tmp_path / "i.db", tiers=[{"name": "hot", "url": tmp_path}])
    settings = load_settings(cfg)
    assert settings.node == socket.gethostname()
    assert all(spec.node == settings.node for spec in settings.tier_specs())


@pytest.mark.parametrize(
    ("node", "tier_extra", "expected"),
    [
        ("a/b", {}, "node: Value error, invalid node name 'a/b'"),
        ("", {}, "node: Value error, invalid node name ''"),
        (".hidden", {}, "node: Value error, invalid node name '.hidden'"),
        ("..", {}, "node: Value error, invalid node name '..'"),
        ("n" * 254, {}, "node: Value error, invalid node name"),
        ("ok", {"shared_id": "x"}, "shared_id names a shared tier's lease: it needs shared = true"),
        ("ok", {"shared": True, "url": "memory://w"}, "only an s3:// or a local tier can be shared"),
    ],
)
def test_bad_node_or_shared_exits_2_naming_the_key(
    tmp_path: Path, node: str, tier_extra: dict[str, Any], expected: str
) -> None:
    cfg = write_config(
        tmp_path / "c.toml",
        index=tmp_path / "i.db",
        node=node,
        tiers=[
            {"name": "hot", "url": tmp_path / "hot"},
            {"name": "warm", "url": tmp_path / "w", **tier_extra},
        ],
    )
    result = run_cli("--config", str(cfg), "ls")
    assert result.returncode == 2, result.stderr
    assert expected.replace("Value error, ", "") in result.stderr
    assert "Traceback" not in result.stderr


def test_node_from_the_environment(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", index=tmp_path / "i.db", tiers=[{"name": "hot", "url": tmp_path}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    env["CKPTKEEPER_NODE"] = "bad name"
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(cfg), "ls"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert "node: invalid node name 'bad name'" in result.stderr


def _hot_checkpoint(root: Path) -> None:
    d = root / "run1" / "checkpoint-100"
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(os.urandom(5000))
    (d / "state.json").write_text("{}")


def test_copies_record_the_writing_node_in_their_manifest(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_storage_options: dict[str, Any]
) -> None:
    root = tmp_path / "hot"
    _hot_checkpoint(root)
    hot = LocalTierStorage(TierSpec("hot", str(root), TierPolicy(), node="node-a"), hot=True)
    cold = TierStorage(
        TierSpec("cold", f"s3://{s3_bucket}/ckpt", TierPolicy(), s3_storage_options, node="node-a")
    )
    # cataloged elsewhere (an index rebuilt from another node's manifest): the copy is still ours
    m = manifest_of(root, "run1", 100, node="node-z")
    cold.copy_from(hot, m)
    body = s3_client.get_object(Bucket=s3_bucket, Key=f"ckpt/run1/checkpoint-100{MANIFEST_SUFFIX}")[
        "Body"
    ].read()
    assert json.loads(body)["node"] == "node-a"
    stored = cold.read_manifest("run1/checkpoint-100")
    assert stored is not None and stored.node == "node-a" and stored.digest == m.digest


def test_staging_markers_name_the_node(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_storage_options: dict[str, Any]
) -> None:
    root = tmp_path / "hot"
    _hot_checkpoint(root)
    m = manifest_of(root, "run1", 100)
    cold = TierStorage(
        TierSpec("cold", f"s3://{s3_bucket}/ckpt", TierPolicy(), s3_storage_options, node="node-b")
    )
    sink = s3_transfer._S3Sink(cold, "run1/checkpoint-100", m, with_manifest=True)  # type: ignore[arg-type]
    try:
        keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
        (marker,) = [k for k in keys if STAGING_MARK in k]
        doc = json.loads(s3_client.get_object(Bucket=s3_bucket, Key=marker)["Body"].read())
        assert doc["node"] == "node-b"
        assert doc["heartbeat"] >= doc["started"]
    finally:
        sink.abort()
    assert not s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents")
