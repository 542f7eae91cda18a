"""A hot tier filled by the last checkpoints of jobs that ended: `prune` moves them to warm.

The checkpoints are real files driven through the real CLI; only the size of the hot filesystem is
made up (a budget just above what the checkpoints hold), since a test cannot mount a small disk.
Protected checkpoints move only once nothing unprotected is left, and only as moves: copy, verify,
delete from hot. The newest checkpoint of the run still training stays in hot.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner

import ckptkeeper
from ckptkeeper.cli import main
from tests.test_tiering_e2e import tree_digest, write_hf_checkpoint

CKPT = "checkpoint-100"


def _hot_bytes(hot: Path) -> int:
    return sum(p.stat().st_size for p in hot.rglob("*") if p.is_file() and ".ckptkeeper" not in p.parts)


class Node:
    def __init__(self, tmp: Path) -> None:
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.hot.mkdir()
        self.warm.mkdir()
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"trust_mtimes": True},  # the tests back-date checkpoints to order them by age
            tiers=[
                local_tier("hot", self.hot, keep_last=2, high_watermark=0.85, low_watermark=0.50),
                local_tier("warm", self.warm, keep_last=5),
            ],
        )

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    def cli_json(self, *args: str) -> tuple[int, Any]:
        code, out = self.cli(*args, "--json")
        assert code == 0, out
        return code, json.loads(out)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def fake_hot_disk(monkeypatch: pytest.MonkeyPatch, hot: Path, total: int) -> None:
    """``shutil.disk_usage`` of the hot tier: a disk of ``total`` bytes holding what is in it."""
    real: Callable[[Any], Any] = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        if Path(path).resolve() == hot.resolve():
            used = _hot_bytes(hot)
            return shutil._ntuple_diskusage(total, used, total - used)  # type: ignore[attr-defined]
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_newest_checkpoints_of_ended_runs_move_to_warm_under_pressure(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_ago = time.time() - 3 * 86400
    for i, name in enumerate(("old-finished", "mid-failed", "new-finished")):
        run = ckptkeeper.track_run(node.hot / name)
        write_hf_checkpoint(node.hot / name, 100, long_ago + i * 3600)
        run.commit(node.hot / name / "checkpoint-100", 100)
        if name.endswith("failed"):
            run.fail("CUDA error")
        else:
            run.finish()
    live = ckptkeeper.track_run(node.hot / "live")  # still training: this process is alive
    try:
        write_hf_checkpoint(node.hot / "live", 100, long_ago - 3600)  # the oldest of all
        live.commit(node.hot / "live" / "checkpoint-100", 100)
        before = {
            n: tree_digest(node.hot / n / CKPT)
            for n in ("old-finished", "mid-failed", "new-finished", "live")
        }
        per_run = _hot_bytes(node.hot / "live")
        # Four equal checkpoints fill 4/4.2 = 95 % of hot; under 50 % means two must leave.
        fake_hot_disk(monkeypatch, node.hot, int(per_run * 4.2))

        code, out = node.cli("scan")
        assert code == 0, out
        code, plan = node.cli_json("prune", "--dry-run")
        moves = [(a["run"], a["action"], a["rule"]) for a in plan["actions"]]
        assert moves == [
            ("mid-failed", "copy", "watermark"),
            ("old-finished", "copy", "watermark"),
            ("mid-failed", "delete", "moved"),
            ("old-finished", "delete", "moved"),
        ]
        assert all("newest checkpoint of ended run" in a["reason"] for a in plan["actions"][:2])
        assert plan["refused"] is None

        code, out = node.cli("prune")
        assert code == 0, out
        for name in ("old-finished", "mid-failed"):
            assert not (node.hot / name / "checkpoint-100").exists(), name
            assert tree_digest(node.warm / name / CKPT) == before[name], name  # byte-identical in warm
        for name in ("new-finished", "live"):
            assert tree_digest(node.hot / name / CKPT) == before[name], name
        code, listing = node.cli_json("ls")
        tiers = {r["name"]: [c["tiers"] for c in r["checkpoints"]] for r in listing["runs"]}
        assert tiers == {
            "old-finished": [["warm"]],
            "mid-failed": [["warm"]],
            "new-finished": [["hot"]],
            "live": [["hot"]],
        }
        code, again = node.cli_json("prune", "--dry-run")
        assert again["actions"] == []  # settled: nothing is promoted back or moved again

        restored = node.hot.parent / "restored"
        code, out = node.cli("restore", "old-finished", "--step", "100", "--to", str(restored))
        assert code == 0, out
        assert tree_digest(restored / CKPT) == before["old-finished"]
    finally:
        live.finish()
