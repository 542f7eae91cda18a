"""Collision-proof keys (docs/design.md, "Many nodes"): in a ``shared`` tier each node writes under ``<root>/<node>/``,
so two nodes with one run name never write the same keys; restore by run name works from any node
and asks for ``--node`` when several hold a run of that name; a losing writer deletes only its own
keys; copies of the single-node layout stay readable."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from builders import fleet_node, hf_checkpoint, manifest_of, run_cli, start_cli

from ckptkeeper.core.model import MANIFEST_SUFFIX, TierPolicy, TierSpec
from ckptkeeper.storage import LocalTierStorage, TierStorage, s3_transfer


def _keys(client: Any, bucket: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return sorted(keys)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_run_name_on_two_nodes_never_shares_a_key_and_restores_by_node(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    a = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, hot_keep_last=5)
    b = fleet_node(tmp_path, "node-b", s3_bucket, s3_reset, hot_keep_last=5)
    c = fleet_node(tmp_path, "node-c", s3_bucket, s3_reset, hot_keep_last=5)
    payload = {"node-a": os.urandom(300_000), "node-b": os.urandom(300_000)}
    for name, data in payload.items():
        hf_checkpoint(tmp_path / name / "hot" / "exp", 100, data)  # same run, same step, same moment
    procs = [start_cli(a, "prune", "--json"), start_cli(b, "prune", "--json")]
    for p in procs:
        _out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    keys = _keys(s3_client, s3_bucket)
    manifests = [k for k in keys if k.endswith(MANIFEST_SUFFIX)]
    assert manifests == [
        f"ckpt/node-a/exp/checkpoint-100{MANIFEST_SUFFIX}",
        f"ckpt/node-b/exp/checkpoint-100{MANIFEST_SUFFIX}",
    ]
    # data under each node's own prefix; the fleet's heartbeats under .ckptkeeper/
    assert all(k.startswith(("ckpt/node-a/", "ckpt/node-b/", "ckpt/.ckptkeeper/nodes/")) for k in keys), keys
    for cfg in (a, b):
        verify = run_cli(cfg, "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr

    # node C never held the run: by name alone it is ambiguous, and the error names the nodes
    amb = run_cli(c, "restore", "exp", "--to", str(tmp_path / "out"))
    assert amb.returncode == 1
    assert "held by several nodes: node-a, node-b" in amb.stderr and "--node" in amb.stderr
    assert not (tmp_path / "out").exists()
    for name in ("node-a", "node-b"):
        done = run_cli(c, "restore", "exp", "--node", name, "--to", str(tmp_path / name / "out"))
        assert done.returncode == 0, done.stderr
        restored = tmp_path / name / "out" / "checkpoint-100" / "model.bin"
        assert restored.read_bytes() == payload[name]
    # node A restores its own run by name: its own wins over B's
    own = run_cli(a, "restore", "exp", "--to", str(tmp_path / "own"))
    assert own.returncode == 0, own.stderr
    assert (tmp_path / "own" / "checkpoint-100" / "model.bin").read_bytes() == payload["node-a"]
    missing = run_cli(c, "restore", "exp", "--node", "node-z", "--to", str(tmp_path / "z"))
    assert missing.returncode == 1 and "node 'node-z' holds no copy of run 'exp'" in missing.stderr


def test_single_node_layout_stays_readable_after_sharing(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    old = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, hot_keep_last=5, shared=False)
    data = os.urandom(100_000)
    hf_checkpoint(tmp_path / "node-a" / "hot" / "legacy", 100, data)
    done = run_cli(old, "prune", "--json")
    assert done.returncode == 0, done.stderr
    assert f"ckpt/legacy/checkpoint-100{MANIFEST_SUFFIX}" in _keys(s3_client, s3_bucket)
    before = _keys(s3_client, s3_bucket)

    c = fleet_node(tmp_path, "node-c", s3_bucket, s3_reset, hot_keep_last=5)  # a node of the shared era
    done = run_cli(c, "restore", "legacy", "--to", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "checkpoint-100" / "model.bin").read_bytes() == data
    pruned = run_cli(c, "prune", "--json")  # C's own pass lists only its own prefix: the old copy stays
    assert pruned.returncode == 0, pruned.stderr
    assert [k for k in _keys(s3_client, s3_bucket) if "/.ckptkeeper/" not in k] == before


def test_a_losing_writer_deletes_only_its_own_keys(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_storage_options: dict[str, Any]
) -> None:
    """Two writers of one key (the single-node layout shared by mistake): the one that aborts
    leaves the other's object and upload alone."""
    root = tmp_path / "hot"
    hf_checkpoint(root / "exp", 100, os.urandom(50_000))
    m = manifest_of(root, "exp", 100)
    hot = LocalTierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True)
    cold = TierStorage(TierSpec("cold", f"s3://{s3_bucket}/ckpt", TierPolicy(), s3_storage_options))
    loser = s3_transfer._S3Sink(cold, "exp/checkpoint-100", m, with_manifest=True)  # type: ignore[arg-type]
    for entry in m.files:
        reader = hot._open_read("exp/checkpoint-100", entry.path)
        try:
            w = loser.open_file(entry, reader)
            w.write(reader.read(entry.size + 1))
            w.finish()
        finally:
            reader.close()
    loser.settle()  # its PUTs still in flight are answered: each of its objects is stored ...
    key = "ckpt/exp/checkpoint-100/model.bin"
    # ... and then another writer of the same key replaces one
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"the winner's bytes")
    other = s3_client.create_multipart_upload(Bucket=s3_bucket, Key="ckpt/exp/checkpoint-100/big.bin")
    loser.abort()
    assert s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == b"the winner's bytes"
    uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [other["UploadId"]]
    # what was only the loser's is gone
    assert "ckpt/exp/checkpoint-100/trainer_state.json" not in _keys(s3_client, s3_bucket)
