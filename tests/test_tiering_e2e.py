"""docs/design.md, "Retention"'s worked example end to end: hot and warm on local disk, cold on a moto S3 server.

Everything goes through the real CLI (`scan`, `prune`, `ls`, `restore`) and the real tiers; the
assertions are about what a user sees: files where they should be, byte-identical restores, exit
codes, JSON output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main

STEPS = list(range(100, 1300, 100))
BEST = 300
EXPECTED = {
    "hot": {300, 1100, 1200},
    "warm": {800, 900, 1000},
    "cold": {400},
}
EXPIRED = {100, 200, 500, 600, 700}


def write_hf_checkpoint(run_dir: Path, step: int, when: float) -> None:
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(48 * 1024 + step * 4)
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
    )
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(16 * 1024))
    loss = 0.5 if step == BEST else 2.0 - step / 10000
    history = [{"step": step, "eval_loss": loss}]
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def tree_digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def s3_listing(client: Any, bucket: str) -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"]] = hashlib.sha256(body).hexdigest()
    return out


def index_dump(db: Path) -> list[Any]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute(
            "SELECT run, name, step, state, version, pinned FROM checkpoints ORDER BY run, name"
        ).fetchall()
        rows += con.execute("SELECT checkpoint_id, tier, version FROM locations ORDER BY 1, 2").fetchall()
        return rows
    finally:
        con.close()


class Node:
    """A hot/warm/cold node and a CLI to drive it."""

    def __init__(
        self, tmp: Path, endpoint: str, bucket: str, *, replicate: bool = False, max_delete: int = 100
    ) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.hot.mkdir()
        self.warm.mkdir()
        self.bucket = bucket
        self.endpoint = endpoint
        self.index = tmp / "index.db"
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=self.index,
            max_delete=max_delete,
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[
                local_tier("hot", self.hot, keep_last=2, keep_best=1, metric="eval_loss", mode="min"),
                local_tier("warm", self.warm, keep_last=5),
                s3_tier("cold", bucket, endpoint, keep_every=400, replicate=replicate),
            ],
        )
        self.run_dir = self.hot / "gpt-run"
        now = time.time()
        for i, step in enumerate(STEPS):
            write_hf_checkpoint(self.run_dir, step, now - 3600 + i)
        self.originals = tmp / "originals"
        shutil.copytree(self.run_dir, self.originals)

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    def cli_json(self, *args: str) -> tuple[int, Any]:
        code, out = self.cli(*args, "--json")
        return code, json.loads(out)

    def subprocess_cli(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
        )

    def tiers_of(self) -> dict[int, list[str]]:
        code, doc = self.cli_json("ls")
        assert code == 0
        (run,) = doc["runs"]
        return {c["step"]: c["tiers"] for c in run["checkpoints"]}


@pytest.fixture
def node(tmp_path: Path, s3_server: str, s3_bucket: str) -> Node:
    return Node(tmp_path, s3_server, s3_bucket)


def test_worked_example_is_planned_as_documented(node: Node) -> None:
    code, plan = node.cli_json("prune", "--dry-run")
    assert code == 0, plan
    keep: dict[str, set[int]] = {}
    for k in plan["keep"]:
        keep.setdefault(k["tier"], set()).add(k["step"])
    assert keep == EXPECTED
    deletes = {
        a["step"] for a in plan["actions"] if a["action"] == "delete" and a["reason"].startswith("expired")
    }
    assert deletes == EXPIRED
    copies = {(a["step"], a["to_tier"]) for a in plan["actions"] if a["action"] == "copy"}
    assert copies == {(800, "warm"), (900, "warm"), (1000, "warm"), (400, "cold")}
    for action in plan["actions"]:
        assert action["reason"], action
        assert set(action) >= {"action", "run", "step", "tier", "to_tier", "path", "bytes", "reason"}
    for k in plan["keep"]:
        assert k["reasons"], k
    assert plan["reclaim_bytes"]["hot"] > 0


def test_dry_run_changes_nothing_anywhere(node: Node, s3_client: Any) -> None:
    assert node.cli("scan")[0] == 0
    before = (
        tree_digest(node.hot),
        tree_digest(node.warm),
        s3_listing(s3_client, node.bucket),
        index_dump(node.index),
    )
    code, out = node.cli("prune", "--dry-run")
    assert code == 0
    assert "would reclaim" in out and "expired: no tier keeps it" in out
    after = (
        tree_digest(node.hot),
        tree_digest(node.warm),
        s3_listing(s3_client, node.bucket),
        index_dump(node.index),
    )
    assert after == before


def test_execute_then_restore_every_kept_checkpoint_byte_identical(
    node: Node, s3_client: Any, tmp_path: Path
) -> None:
    code, out = node.cli("prune")
    assert code == 0, out
    tiers = node.tiers_of()
    assert {s for s, t in tiers.items() if t and t[0] == "hot"} == EXPECTED["hot"]
    assert {s for s, t in tiers.items() if t and t[0] == "warm"} == EXPECTED["warm"]
    assert {s for s, t in tiers.items() if t and t[0] == "cold"} == EXPECTED["cold"]
    assert not EXPIRED & set(tiers)
    # Files are where the user expects them: hot dirs, warm dirs + manifests, S3 objects + manifest.
    assert sorted(p.name for p in node.run_dir.iterdir() if not p.name.startswith(".")) == sorted(
        f"checkpoint-{s}" for s in EXPECTED["hot"]
    )
    warm_run = node.warm / "gpt-run"
    assert sorted(p.name for p in warm_run.iterdir() if p.is_dir()) == sorted(
        f"checkpoint-{s}" for s in EXPECTED["warm"]
    )
    assert all((warm_run / f"checkpoint-{s}.ckptkeeper-manifest.json").is_file() for s in EXPECTED["warm"])
    keys = set(s3_listing(s3_client, node.bucket))
    assert "ckpt/gpt-run/checkpoint-400.ckptkeeper-manifest.json" in keys
    assert "ckpt/gpt-run/checkpoint-400/model.safetensors" in keys
    assert not [k for k in keys if ".ckptkeeper-tmp" in k]
    # Restore each kept checkpoint from its tier: byte-identical to what training wrote.
    for tier, steps in EXPECTED.items():
        for step in steps:
            dest = tmp_path / "restore" / tier / str(step)
            code, out = node.cli("restore", "gpt-run", "--step", str(step), "--to", str(dest))
            assert code == 0, out
            restored = Path(out.strip().splitlines()[-1])
            assert restored == dest / f"checkpoint-{step}"
            assert tree_digest(restored) == tree_digest(node.originals / f"checkpoint-{step}")
    code, out = node.cli("restore", "gpt-run", "--step", "best", "--to", str(tmp_path / "best"))
    assert code == 0 and out.strip().endswith(f"checkpoint-{BEST}")
    # Re-planning after execution is a fixed point.
    code, plan = node.cli_json("prune", "--dry-run")
    assert code == 0 and plan["actions"] == []
    # verify re-hashes every copy in every tier.
    code, out = node.cli("verify")
    assert code == 0, out
    assert "verified 7 copies: 0 problems" in out


def test_replicate_copies_newest_to_cold_while_it_stays_hot(
    tmp_path: Path, s3_server: str, s3_bucket: str
) -> None:
    node = Node(tmp_path, s3_server, s3_bucket, replicate=True)
    assert node.cli("prune")[0] == 0
    tiers = node.tiers_of()
    assert tiers[1200] == ["hot", "cold"]
    assert tiers[800] == ["warm", "cold"]
    assert tiers[400] == ["cold"]


def test_max_delete_refuses_with_exit_3_and_deletes_nothing(
    tmp_path: Path, s3_server: str, s3_bucket: str
) -> None:
    node = Node(tmp_path, s3_server, s3_bucket, max_delete=2)
    before = tree_digest(node.hot)
    code, out = node.cli("prune")
    assert code == 3, out
    assert "max_delete" in out
    assert tree_digest(node.hot).keys() >= before.keys()
    code, out = node.cli("prune", "--force")
    assert code == 0, out
    assert not EXPIRED & set(node.tiers_of())


def test_verify_reports_a_corrupted_copy(node: Node) -> None:
    assert node.cli("prune")[0] == 0
    victim = node.warm / "gpt-run" / "checkpoint-900" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out = node.cli("verify", "gpt-run")
    assert code == 1
    assert "MISMATCH gpt-run@900 in warm" in out


def test_second_executor_exits_11(node: Node) -> None:
    from ckptkeeper.actions.index import executor_lock
    from ckptkeeper.config import load_settings

    with executor_lock(load_settings(node.config), timeout=1):
        result = node.subprocess_cli("prune", "--lock-timeout", "0.5")
    assert result.returncode == 11, result.stderr
    assert "holds" in result.stderr


def _staging_left(node: Node, s3_client: Any) -> list[str]:
    local = [str(p) for root in (node.hot, node.warm) for p in root.rglob("*") if ".ckptkeeper-tmp" in p.name]
    keys = [k for k in s3_listing(s3_client, node.bucket) if ".ckptkeeper-tmp" in k]
    uploads = s3_client.list_multipart_uploads(Bucket=node.bucket).get("Uploads", [])
    return local + keys + [u["Key"] for u in uploads]


# This plan passes ~27 crash points (journal phases, copy progress chunks, removals); the points
# below spread over copies to warm (rename on one filesystem), uploads to S3, expiries.
@pytest.mark.parametrize("crash_at", [1, 2, 3, 5, 8, 11, 14, 17, 20, 23, 26])
def test_sigkill_during_prune_loses_nothing(node: Node, s3_client: Any, crash_at: int) -> None:
    """SIGKILL `prune` at crash point K (journal phases and copy progress), restart, prune again."""
    crashed = node.subprocess_cli("prune", env={"CKPTKEEPER_TEST_CRASH_AFTER": str(crash_at)})
    assert crashed.returncode == -9, crashed.stderr
    again = node.subprocess_cli("prune")
    assert again.returncode == 0, again.stdout + again.stderr
    tiers = node.tiers_of()
    for tier, steps in EXPECTED.items():
        for step in steps:
            assert tiers.get(step) and tiers[step][0] == tier, (step, tiers.get(step))
    code, out = node.cli("verify")
    assert code == 0, out
    assert _staging_left(node, s3_client) == []
