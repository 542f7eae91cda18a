"""Lineage: a run resumed from another run's checkpoint protects that parent while it is active."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from builders import local_tier, write_config
from click.testing import CliRunner

import ckptkeeper
from ckptkeeper.cli import main


def test_parent_of_an_active_run_survives_retention_until_the_child_ends(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    config = tmp_path / "config.toml"
    write_config(config, index=tmp_path / "index.db", tiers=[local_tier("hot", hot, keep_last=1)])

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    base = hot / "base"
    base.mkdir(parents=True)
    with ckptkeeper.track_run(base, heartbeat_interval=0.1) as run:
        for step in (100, 200, 300):
            path = base / f"step-{step}.pt"
            path.write_bytes(os.urandom(1000))
            run.commit(path, step=step)

    child_dir = hot / "finetune"
    child_dir.mkdir()
    child = ckptkeeper.track_run(child_dir, parent=("base", 100), heartbeat_interval=0.1)
    try:
        code, out = cli("prune", "--dry-run", "--json")
        assert code == 0, out
        plan = json.loads(out)
        deleted = {(a["run"], a["step"]) for a in plan["actions"] if a["action"] == "delete"}
        assert deleted == {("base", 200)}
        keep = {(k["run"], k["step"]): k["reasons"] for k in plan["keep"]}
        assert any("parent of active run finetune" in r for r in keep[("base", 100)])
        assert cli("scan")[0] == 0
        code, out = cli("ls", "--json")
        runs = {r["name"]: r for r in json.loads(out)["runs"]}
        assert runs["finetune"]["parent"] == {"run": "base", "step": 100}
    finally:
        child.finish()
    time.sleep(0.05)
    code, out = cli("prune", "--dry-run", "--json")
    deleted = {(a["run"], a["step"]) for a in json.loads(out)["actions"] if a["action"] == "delete"}
    assert deleted == {("base", 100), ("base", 200)}
