"""`ckptkeeper scan` + `ls --json` over a hot root holding every layout, complete and partial.

Runs the CLI as a user does (a subprocess with a config file), so the whole path — config,
layouts, hashing, index, JSON output — is exercised.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from layout_fixtures import make_campaign, make_hf


def backdate(root: Path, seconds: float) -> None:
    """Age a tree so framework markers are past settle_seconds (as on a node after training)."""
    when = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)


class Hot:
    def __init__(self, tmp: Path, settle: str = "30s") -> None:
        self.root = tmp / "hot"
        self.root.mkdir()
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": settle, "trust_mtimes": True},
            tiers=[local_tier("hot", self.root)],
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    def ls(self) -> dict[str, Any]:
        result = self.cli("ls", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def states(self) -> dict[tuple[str, int], str]:
        return {(r["name"], c["step"]): c["state"] for r in self.ls()["runs"] for c in r["checkpoints"]}


@pytest.fixture
def hot(tmp_path: Path) -> Hot:
    return Hot(tmp_path)


def test_scan_then_ls_reports_every_layout_step_and_state(hot: Hot) -> None:
    expected = make_campaign(hot.root)
    backdate(hot.root, 120)
    result = hot.cli("scan")
    assert result.returncode == 0, result.stderr
    doc = hot.ls()
    got = {(r["name"], c["step"]): c["state"] for r in doc["runs"] for c in r["checkpoints"]}
    assert got == {k: ("complete" if v else "writing") for k, v in expected.items()}
    layouts = {c["layout"] for r in doc["runs"] for c in r["checkpoints"]}
    assert layouts >= {"hf", "torch", "dcp", "deepspeed", "megatron", "nemo", "orbax", "safetensors"}
    for run in doc["runs"]:
        assert set(run) >= {"name", "state", "checkpoints"}
        for c in run["checkpoints"]:
            assert set(c) >= {"step", "state", "layout", "tiers", "bytes", "metrics", "pinned"}
            assert isinstance(c["step"], int)
            assert c["tiers"] == (["hot"] if c["state"] == "complete" else [])
            assert c["bytes"] > 0
    hf = next(r for r in doc["runs"] if r["name"] == "hf")
    assert hf["checkpoints"][0]["metrics"]["eval_loss"] == pytest.approx(1.5)


def test_fresh_marker_is_writing_until_settled(tmp_path: Path) -> None:
    hot = Hot(tmp_path, settle="1h")
    make_hf(hot.root / "run", 10, complete=True)
    assert hot.cli("scan").returncode == 0
    assert hot.states() == {("run", 10): "writing"}
    backdate(hot.root, 2 * 3600)
    assert hot.cli("scan").returncode == 0
    assert hot.states() == {("run", 10): "complete"}


def test_scan_is_idempotent_rewrite_is_new_version_delete_loses_location(hot: Hot) -> None:
    make_hf(hot.root / "run", 10, complete=True)
    make_hf(hot.root / "run", 20, complete=True)
    backdate(hot.root, 120)
    assert hot.cli("scan").returncode == 0
    first = hot.ls()
    again = hot.cli("scan", "--json")
    assert json.loads(again.stdout)["unchanged"] == 2 and json.loads(again.stdout)["new"] == 0
    assert hot.ls()["runs"][0]["checkpoints"] == first["runs"][0]["checkpoints"]

    versions = {c["step"]: c["version"] for c in first["runs"][0]["checkpoints"]}
    target = hot.root / "run" / "checkpoint-20"
    blob = next(p for p in target.rglob("*") if p.is_file() and p.name != "trainer_state.json")
    blob.write_bytes(os.urandom(blob.stat().st_size + 10))
    backdate(hot.root, 120)
    report = json.loads(hot.cli("scan", "--json").stdout)
    assert report["new_versions"] == 1
    now = {c["step"]: c["version"] for c in hot.ls()["runs"][0]["checkpoints"]}
    assert now[10] == versions[10] and now[20] != versions[20]

    shutil.rmtree(hot.root / "run" / "checkpoint-10")
    report = json.loads(hot.cli("scan", "--json").stdout)
    assert report["removed"] == 1
    assert [c["step"] for c in hot.ls()["runs"][0]["checkpoints"]] == [20]


def test_ls_human_table_and_unknown_run(hot: Hot) -> None:
    make_hf(hot.root / "run", 10, complete=True, eval_loss=0.25)
    backdate(hot.root, 120)
    hot.cli("scan")
    out = hot.cli("ls").stdout
    assert "STEP" in out and "checkpoint-10" in out and "eval_loss=0.25" in out
    missing = hot.cli("ls", "nope")
    assert missing.returncode == 2 and "no run named 'nope'" in missing.stderr


def test_status_json_shape(hot: Hot) -> None:
    make_hf(hot.root / "run", 10, complete=True)
    backdate(hot.root, 120)
    hot.cli("scan")
    doc = json.loads(hot.cli("status", "--json").stdout)
    (tier,) = doc["tiers"]
    assert tier["name"] == "hot" and tier["ok"] is True and tier["checkpoints"] == 1
    assert tier["usage"]["total_bytes"] > 0
    assert doc["checkpoints"] == {"complete": 1}
    assert doc["reclaimed"]["total_bytes"] == 0


def test_pin_and_unpin(hot: Hot) -> None:
    make_hf(hot.root / "run", 10, complete=True)
    backdate(hot.root, 120)
    hot.cli("scan")
    assert hot.cli("pin", "run", "10").returncode == 0
    assert hot.ls()["runs"][0]["checkpoints"][0]["pinned"] is True
    assert hot.cli("unpin", "run", "10").returncode == 0
    assert hot.ls()["runs"][0]["checkpoints"][0]["pinned"] is False
    bad = hot.cli("pin", "run", "99")
    assert bad.returncode == 2 and "no checkpoint run@99" in bad.stderr


def test_symlinked_run_dir_is_not_followed(hot: Hot, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    make_hf(elsewhere, 10, complete=True)
    (hot.root / "sneaky").symlink_to(elsewhere)
    backdate(tmp_path, 120)
    assert hot.cli("scan").returncode == 0
    assert hot.ls()["runs"] == []
