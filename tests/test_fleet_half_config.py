"""Many nodes on one bucket cannot be half-configured (docs/configuration-safety.md).

Two real node processes (own config, hot dir, index, ``node``) copy the README's single-node config:
one cold tier in one moto bucket, without ``shared = true``. Each holds its part of a checkpoint
spanning both. The first node's part went to cold as if it were the whole checkpoint; the second's
copy failed on every pass ("already holds a different version … delete it first"). Now the second
node's pass is refused before it does anything (exit 2 naming ``tiers[1].shared``), and so is any
node's that finds another node's copies in a tier it does not share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from builders import fleet_node, hf_checkpoint, run_cli

from ckptkeeper.core.model import MANIFEST_SUFFIX


def _manifests(client: Any, bucket: str) -> dict[str, str]:
    """Manifest key -> the node it names, from the bucket's own listing."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            if o["Key"].endswith(MANIFEST_SUFFIX):
                out[o["Key"]] = json.loads(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())[
                    "node"
                ]
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_nodes_on_one_unshared_bucket_are_refused(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    a = fleet_node(tmp_path, "node0", s3_bucket, s3_reset, shared=False)
    b = fleet_node(tmp_path, "node1", s3_bucket, s3_reset, shared=False)
    for node in ("node0", "node1"):  # each node's part of the job's checkpoints: same names, other bytes
        for step in (100, 200):
            hf_checkpoint(tmp_path / node / "hot" / "exp", step, os.urandom(5000 + step))
    b_hot = _tree(tmp_path / "node1" / "hot" / "exp")

    first = run_cli(a, "prune", "--json")
    assert first.returncode == 0, first.stderr
    assert set(_manifests(s3_client, s3_bucket).values()) == {"node0"}

    second = run_cli(b, "prune", "--json")
    assert second.returncode == 2, (second.returncode, second.stdout, second.stderr)
    assert "tiers[1].shared: tier 'cold'" in second.stderr, second.stderr
    assert "holds copies other nodes wrote (node node0: exp/checkpoint-100 and 1 more)" in second.stderr
    assert "Set shared = true on this tier on every node" in second.stderr
    assert "Traceback" not in second.stderr
    dry = run_cli(b, "prune", "--dry-run", "--json")
    assert dry.returncode == 2 and "tiers[1].shared" in dry.stderr, dry.stderr
    assert _tree(tmp_path / "node1" / "hot" / "exp") == b_hot  # nothing done on node1
    assert set(_manifests(s3_client, s3_bucket).values()) == {"node0"}

    again = run_cli(a, "prune", "--json")  # node0 sees only its own copies: nothing to refuse
    assert again.returncode == 0, again.stderr


def test_unshared_tier_holding_another_nodes_copies_is_refused_naming_both_ways_out(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """A node renamed (a container's new hostname) finds its own older copies under the old name:
    refused too, with the way back (``node`` = the old name) beside ``shared = true``; with
    ``shared = true`` the node works, and the old copies stay untouched."""
    old = fleet_node(tmp_path, "host-1", s3_bucket, s3_reset, shared=False)
    hf_checkpoint(tmp_path / "host-1" / "hot" / "exp", 100, os.urandom(5000))
    assert run_cli(old, "prune").returncode == 0
    before = _manifests(s3_client, s3_bucket)
    assert set(before.values()) == {"host-1"}

    renamed = fleet_node(tmp_path, "host-2", s3_bucket, s3_reset, shared=False)
    hf_checkpoint(tmp_path / "host-2" / "hot" / "exp", 200, os.urandom(5000))
    refused = run_cli(renamed, "prune")
    assert refused.returncode == 2, refused.stderr
    assert "set node = 'host-1'" in refused.stderr, refused.stderr

    upgraded = fleet_node(tmp_path, "host-2", s3_bucket, s3_reset, shared=True)
    done = run_cli(upgraded, "prune")
    assert done.returncode == 0, done.stderr
    after = _manifests(s3_client, s3_bucket)
    assert {k: v for k, v in after.items() if k in before} == before  # the old copies stay
    assert "host-2" in after.values()
