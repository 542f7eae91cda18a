"""Issue #13 item 1: a delete that leaves one copy fewer re-checks the surviving copy first.

The reproduction, through the real CLI in subprocesses: hot ``keep_last = 2``, a replicating
slower tier (S3 on moto, or a local warm directory); steps 1-3, ``prune``; the data of step 2's
replica is removed behind ckptkeeper's back (its manifest stays); step 4 is written and
``prune --force`` runs. Step 2 falls out of hot's ``keep_last``: before this fix its hot copy was
deleted as "moved" because the index recorded a copy in the slower tier, and ``restore`` failed.
Now the survivor is checked in storage first: the hot copy stays, the damaged location is marked
bad (``ls`` and ``verify`` say so), the prune exits non-zero naming it, and the next prune copies
it again, after which the hot copy goes and a restore is byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config

RUN = "r"


def write_checkpoint(run_dir: Path, step: int, when: float) -> None:
    """A small HF-layout checkpoint (two files, one nested), aged so it counts as settled."""
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(40_000 + 4 * step)
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
    ).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(12_000))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


class Node:
    def __init__(self, tmp: Path, slower: dict[str, Any], **daemon: Any) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir()
        self.run_dir = self.hot / RUN
        self.config = tmp / "config.toml"
        self.originals = tmp / "originals"
        self.slower = slower["name"]
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True, **daemon},
            tiers=[local_tier("hot", self.hot, keep_last=2), slower],
        )

    def write(self, *steps: int) -> None:
        now = time.time()
        for step in steps:
            write_checkpoint(self.run_dir, step, now - 3600 + step)
            shutil.copytree(self.run_dir / f"checkpoint-{step}", self.originals / f"checkpoint-{step}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def ls(self) -> dict[int, dict[str, Any]]:
        result = self.cli("ls", "--json")
        assert result.returncode == 0, result.stderr
        (run,) = json.loads(result.stdout)["runs"]
        return {c["step"]: c for c in run["checkpoints"]}

    def restore_matches(self, step: int) -> None:
        dest = self.tmp / "restore" / f"{step}-{time.monotonic_ns()}"
        result = self.cli("restore", RUN, "--step", str(step), "--to", str(dest))
        assert result.returncode == 0, result.stdout + result.stderr
        restored = dest / f"checkpoint-{step}"
        assert tree_digest(restored) == tree_digest(self.originals / f"checkpoint-{step}")


def _replicated(node: Node) -> None:
    """Steps 1-3 and a prune: 1 moved out of hot, 2 and 3 in hot with a replica."""
    node.write(1, 2, 3)
    first = node.cli("prune")
    assert first.returncode == 0, first.stdout + first.stderr
    placed = node.ls()
    assert placed[2]["tiers"] == ["hot", node.slower], placed


def _repaired(node: Node) -> None:
    """A plain prune copies step 2 again and only then drops its hot copy; byte-identical restores."""
    again = node.cli("prune")
    assert again.returncode == 0, again.stdout + again.stderr
    entry = node.ls()[2]
    assert entry["tiers"] == [node.slower] and entry["damaged"] == {}, entry
    assert not (node.run_dir / "checkpoint-2").exists()
    verify = node.cli("verify", RUN)
    assert verify.returncode == 0, verify.stdout
    node.restore_matches(2)
    node.restore_matches(4)


def _cli_repro(node: Node, damage: Any) -> None:
    """The issue's reproduction, every step a CLI subprocess: scan no longer calls the damaged
    replica "unchanged", ls and verify show it, and prune --force copies it again before the hot
    original goes (never "moved" onto a copy that is not there)."""
    _replicated(node)
    damage()
    node.write(4)
    scan = node.cli("scan")
    assert scan.returncode == 0, scan.stderr
    assert f"damaged copy {node.slower}:{RUN}/checkpoint-2 not counted" in scan.stderr, scan.stderr
    entry = node.ls()[2]
    assert entry["tiers"] == ["hot"], entry
    assert f"{RUN}/checkpoint-2" in entry["damaged"][node.slower], entry
    verify = node.cli("verify", RUN)
    assert verify.returncode == 1
    assert f"MISMATCH {RUN}@2 in {node.slower}" in verify.stdout, verify.stdout

    pruned = node.cli("prune", "--force", "--json")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    doc = json.loads(pruned.stdout)
    step2 = [(a["action"], a["tier"], a["to_tier"]) for a in doc["actions"] if a["step"] == 2]
    assert step2 == [("copy", "hot", node.slower), ("delete", "hot", None)], step2
    assert doc["result"]["failed"] == []
    assert f"{node.slower}:{RUN}/checkpoint-2" in doc["damaged"]
    _repaired(node)


def _stale_index_pass(node: Node, damage: Any) -> None:
    """The executor's own re-check: damage after the last listing, then a pass that plans from the
    index without listing again (the daemon's retention pass, ``rescan=False``). The delete that
    would leave only the damaged replica is refused, the hot original survives byte for byte, the
    replica is marked damaged (ls, verify), and the next prune copies it again."""
    from ckptkeeper.actions.prune import run_prune
    from ckptkeeper.config import load_settings
    from ckptkeeper.index import Index

    _replicated(node)
    node.write(4)
    assert node.cli("scan").returncode == 0
    damage()
    settings = load_settings(node.config)
    with Index(settings.index) as ix:
        outcome = run_prune(settings, ix, rescan=False, force=True)
    assert outcome.exit_code == 1, outcome
    (failure,) = outcome.failed
    assert failure.startswith(f"delete {RUN}/checkpoint-2 (hot)"), failure
    assert f"copy in {node.slower} is damaged" in failure and "not deleted" in failure, failure
    assert tree_digest(node.run_dir / "checkpoint-2") == tree_digest(node.originals / "checkpoint-2")
    entry = node.ls()[2]
    assert entry["tiers"] == ["hot"] and node.slower in entry["damaged"], entry
    listing = node.cli("ls", RUN)
    assert f"damaged copy of step 2 in {node.slower}" in listing.stdout, listing.stdout
    verify = node.cli("verify", RUN)
    assert verify.returncode == 1 and f"MISMATCH {RUN}@2 in {node.slower}" in verify.stdout
    node.restore_matches(2)
    _repaired(node)


def _s3_damage(s3_client: Any, bucket: str) -> Any:
    def damage() -> None:
        prefix = f"ckpt/{RUN}/checkpoint-2/"
        objs = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
        assert len(objs) == 3
        s3_client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in objs]})
        s3_client.head_object(Bucket=bucket, Key=f"ckpt/{RUN}/checkpoint-2.ckptkeeper-manifest.json")

    return damage


def _local_damage(warm: Path, how: str) -> Any:
    def damage() -> None:
        replica = warm / RUN / "checkpoint-2"
        victim = replica / "nested" / "optimizer.pt"
        if how == "files-gone":
            for p in sorted(replica.rglob("*"), reverse=True):
                if p.is_file():
                    p.unlink()
            assert replica.is_dir()
        elif how == "truncated":
            with open(victim, "r+b") as f:
                f.truncate(100)
        else:  # a file became a directory
            victim.unlink()
            victim.mkdir()
        assert (warm / RUN / "checkpoint-2.ckptkeeper-manifest.json").is_file()

    return damage


SCENARIOS = [_cli_repro, _stale_index_pass]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["cli", "stale-index"])
def test_s3_replica_without_its_objects_keeps_the_hot_original(
    scenario: Any, tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any
) -> None:
    node = Node(tmp_path, s3_tier("cold", s3_bucket, s3_server, replicate=True))
    scenario(node, _s3_damage(s3_client, s3_bucket))


@pytest.mark.parametrize(
    ("scenario", "how"),
    [
        (_cli_repro, "files-gone"),
        (_stale_index_pass, "files-gone"),
        (_stale_index_pass, "truncated"),
        (_stale_index_pass, "file-became-dir"),
    ],
    ids=["cli", "stale-index", "stale-index-truncated", "stale-index-file-became-dir"],
)
def test_local_replica_without_its_files_keeps_the_hot_original(
    scenario: Any, how: str, tmp_path: Path
) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm, replicate=True))
    scenario(node, _local_damage(warm, how))


def test_a_checkpoint_whose_only_copy_is_damaged_is_not_planned(tmp_path: Path) -> None:
    """It stays visible (ls: damaged) but the planner never sees it: it must not take the "newest
    complete checkpoint of the run" protection away from a checkpoint that exists."""
    from ckptkeeper.core.model import CheckpointState
    from ckptkeeper.index import Index

    with Index(tmp_path / "i.db") as ix:
        ids = {}
        for step in (1, 2):
            ids[step] = ix.upsert_checkpoint(
                run=RUN,
                name=f"checkpoint-{step}",
                step=step,
                layout="hf",
                state=CheckpointState.COMPLETE,
                created_at=float(step),
                last_write=float(step),
                bytes=10,
                metrics={},
                committed=False,
                version=f"v{step}",
                manifest_json=None,
                problem=None,
            )
        ix.set_location(ids[1], "hot", "v1")
        ix.set_location(ids[2], "cold", "v2")
        ix.mark_damaged(ids[2], "cold", "r/checkpoint-2/model.safetensors: missing")
        assert [c.step for c in ix.snapshot(["hot", "cold"]).checkpoints] == [1]
        row = ix.checkpoint(RUN, "checkpoint-2")
        assert row is not None and row.verified_tiers == frozenset()
        assert row.damaged == {"cold": "r/checkpoint-2/model.safetensors: missing"}
