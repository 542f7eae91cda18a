"""File ages by the clock that stamped the files (docs/many-nodes-clocks.md, "File ages").

Real ``ckptkeeper`` processes whose wall clock is off (``tests/clockshift``: ``time.time`` shifted
by ``CKPT_TEST_CLOCK_OFFSET``) while the kernel dates the files, as an NFS, Lustre or Weka server
dates them for a node whose NTP broke. A run's staleness, a partial checkpoint's or a temp file's
age and settling are judged by the filesystem's clock: a node 3 days ahead reaps nothing written
just now, a node 3 days behind still reaps what is truly dead and settles what is truly settled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import hf_checkpoint, local_tier, write_config

CLOCKSHIFT = Path(__file__).parent / "clockshift"
DAY = 86400.0


def run_skewed(config: Path, offset: float, *args: str) -> subprocess.CompletedProcess[str]:
    """``ckptkeeper --config CONFIG ARGS`` in a process whose clock runs ``offset`` seconds off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CLOCKSHIFT), env.get("PYTHONPATH", "")) if p)
    env["CKPT_TEST_CLOCK_OFFSET"] = repr(offset)
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )


def prune_json(config: Path, offset: float, *args: str) -> dict[str, Any]:
    done = run_skewed(config, offset, "prune", "--json", *args)
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def node(base: Path, *, settle: str = "1s", hot_keep_last: int = 10, failed_after: str = "1h") -> Path:
    """One node: a hot and a warm directory on this machine, a reaper with short thresholds."""
    (base / "hot").mkdir(parents=True, exist_ok=True)
    (base / "warm").mkdir(parents=True, exist_ok=True)
    return write_config(
        base / "config.toml",
        index=base / "index.db",
        daemon={"settle_seconds": settle, "trust_mtimes": True, "metrics_addr": ""},
        tiers=[
            local_tier("hot", base / "hot", keep_last=hot_keep_last),
            local_tier("warm", base / "warm", keep_last=10),
        ],
        reaper={"failed_after": failed_after, "partial_after": "10m", "keep_last_of_failed": 1},
    )


def files(root: Path) -> list[str]:
    """Every file under ``root`` that is not ckptkeeper's own (hidden) state."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def a_run(run_dir: Path, *, age: float) -> None:
    """Three complete HF checkpoints and an interrupted save (``tmp-checkpoint-4``), every file
    written ``age`` seconds ago by the kernel's clock."""
    for step in (1, 2, 3):
        hf_checkpoint(run_dir, step, f"{run_dir.name}-{step}".encode() * 100, age=0)
    tmp = run_dir / "tmp-checkpoint-4"
    tmp.mkdir()
    (tmp / "model.bin").write_bytes(b"half a save")
    when = time.time() - age
    for p in [*run_dir.rglob("*"), run_dir]:
        os.utime(p, (when, when))


def reaps(doc: dict[str, Any]) -> list[str]:
    return sorted(a["path"] for a in doc["actions"] if a["action"] == "reap")


def test_a_node_whose_clock_runs_ahead_reaps_nothing_written_just_now(tmp_path: Path) -> None:
    """By a clock 3 days ahead, a run written a minute ago has shown no sign of life for 3 days
    (``failed_after`` 1 h) and its interrupted save is 3 days old (``partial_after`` 10 min): the
    old code reaped checkpoints 1 and 2 and the temp dir. By the filesystem's clock they are a
    minute old: nothing is reaped, and the pass says whose clock is off."""
    cfg = node(tmp_path)
    a_run(tmp_path / "hot" / "exp", age=60)
    before = files(tmp_path / "hot")

    doc = prune_json(cfg, 3 * DAY)
    assert reaps(doc) == [], doc["actions"]
    assert files(tmp_path / "hot") == before
    assert (
        "hot: this node's clock is 3d ahead of the filesystem's; file ages there are judged by the filesystem's clock (fix NTP: chrony/timesyncd)"
        in doc["notes"]
    )

    dry = prune_json(cfg, 3 * DAY, "--dry-run")  # by the reading the real pass kept
    assert reaps(dry) == [], dry["actions"]
    assert files(tmp_path / "hot") == before


def test_a_node_whose_clock_runs_behind_still_reaps_a_dead_run(tmp_path: Path) -> None:
    """A run silent for 2 days by the filesystem's clock is stale; by a node clock 3 days behind
    it was written a day in the future, and the old code never reaped it. A run written a minute
    ago beside it stays whole."""
    cfg = node(tmp_path)
    a_run(tmp_path / "hot" / "dead", age=2 * DAY)
    a_run(tmp_path / "hot" / "live", age=60)
    live = [f for f in files(tmp_path / "hot") if f.startswith("live/")]

    doc = prune_json(cfg, -3 * DAY)
    assert reaps(doc) == ["dead/checkpoint-1", "dead/checkpoint-2", "dead/tmp-checkpoint-4"], doc["actions"]
    assert (
        "hot: this node's clock is 3d behind the filesystem's; file ages there are judged by the filesystem's clock (fix NTP: chrony/timesyncd)"
        in doc["notes"]
    )
    left = files(tmp_path / "hot")
    assert [f for f in left if f.startswith("dead/")] == [
        "dead/checkpoint-3/model.bin",
        "dead/checkpoint-3/trainer_state.json",
    ]
    assert [f for f in left if f.startswith("live/")] == live


def test_a_node_whose_clock_runs_ahead_settles_nothing_written_just_now(tmp_path: Path) -> None:
    """``settle_seconds`` 10 min: by a clock 3 days ahead, checkpoints written a minute ago
    looked settled, and the old code moved checkpoint 1 to warm while it might still be written."""
    cfg = node(tmp_path, settle="10m", hot_keep_last=1, failed_after="30d")
    for step in (1, 2):
        hf_checkpoint(tmp_path / "hot" / "exp", step, b"weights" * 100, age=60)
    doc = prune_json(cfg, 3 * DAY)
    assert doc["actions"] == [], doc["actions"]
    assert files(tmp_path / "warm") == []
    assert "exp/checkpoint-1/model.bin" in files(tmp_path / "hot")


def test_a_node_whose_clock_runs_behind_settles_what_is_settled(tmp_path: Path) -> None:
    """By a clock 3 days behind, checkpoints written 2 hours ago were written in the future: the
    old code never took them for settled, and nothing ever moved to warm."""
    cfg = node(tmp_path, settle="10m", hot_keep_last=1, failed_after="30d")
    for step in (1, 2):
        hf_checkpoint(tmp_path / "hot" / "exp", step, b"weights" * 100, age=2 * 3600)
    doc = prune_json(cfg, -3 * DAY)
    assert reaps(doc) == [], doc["actions"]
    assert "exp/checkpoint-1/model.bin" in files(tmp_path / "warm")
    assert "exp/checkpoint-1/model.bin" not in files(tmp_path / "hot")


def test_a_dry_run_writes_no_probe_and_says_which_clock_it_used(tmp_path: Path) -> None:
    """A dry run writes nothing, not even a probe: before any real pass it judges by this node's
    clock and says so; after one, by the offset that pass measured (read from beside the index)."""
    cfg = node(tmp_path)
    a_run(tmp_path / "hot" / "dead", age=2 * DAY)
    hidden = sorted(p.name for p in (tmp_path / "hot").iterdir() if p.name.startswith("."))

    dry = prune_json(cfg, -3 * DAY, "--dry-run")
    assert reaps(dry) == [], dry["actions"]  # a day in the future, by this node's clock
    assert (
        "hot: no reading of the filesystem's clock yet (a dry run writes none); file ages there "
        "are judged by this node's clock"
    ) in dry["notes"]
    assert sorted(p.name for p in (tmp_path / "hot").iterdir() if p.name.startswith(".")) == hidden
    assert not (tmp_path / "index.db.clocks.json").exists()

    prune_json(cfg, -3 * DAY, "--run", "elsewhere")  # a real pass that acts on no run of ours
    dry = prune_json(cfg, -3 * DAY, "--dry-run")
    assert reaps(dry) == ["dead/checkpoint-1", "dead/checkpoint-2", "dead/tmp-checkpoint-4"]
    assert not [n for n in dry["notes"] if "no reading" in n], dry["notes"]


def test_a_clock_reading_leaves_nothing_behind_and_never_creates_a_root(tmp_path: Path) -> None:
    from ckptkeeper.storage import StorageError
    from ckptkeeper.storage.fs_clock import filesystem_now

    root = tmp_path / "root"
    root.mkdir()
    now, reading = filesystem_now(root)
    assert abs(now - time.time()) < 60 and reading.filesystem <= now
    assert list(root.iterdir()) == []
    with pytest.raises(StorageError, match="reading the filesystem's clock"):
        filesystem_now(tmp_path / "gone")
    assert not (tmp_path / "gone").exists()


def test_a_filesystem_without_a_plausible_clock_is_judged_by_this_nodes_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that dates a file touched now to 1970 has no clock to judge by."""
    from ckptkeeper.config import load_settings
    from ckptkeeper.ingest.clocks import FileClocks
    from ckptkeeper.storage import fs_clock

    real_utime = os.utime
    monkeypatch.setattr(fs_clock.os, "utime", lambda path: real_utime(path, (0, 0)))
    clocks = FileClocks(load_settings(node(tmp_path)), write=True)
    assert abs(clocks.now("hot") - time.time()) < 60
    (note,) = [n for n in clocks.notes if n.startswith("hot:")]
    assert "gives files the time 0.0: no usable clock" in note, note
    assert note.endswith("file ages there are judged by this node's clock")


def test_the_reaper_judges_each_file_by_its_tiers_clock() -> None:
    """Pure: ``plan_reaps(file_now=...)``. A temp file in warm is judged by warm's clock, a
    partial checkpoint in hot by hot's; a tier without a clock of its own by ``now``."""
    from builders import checkpoint, snapshot, tier

    from ckptkeeper.core.model import Artifact, CheckpointState, ReaperPolicy
    from ckptkeeper.core.reaper import plan_reaps

    now, hour = 1_700_000_000.0, 3600.0
    policy = ReaperPolicy(failed_after=2 * hour, partial_after=hour, keep_last_of_failed=1)
    snap = snapshot(
        checkpoint(
            "r", 5, state=CheckpointState.WRITING, last_write=now - 2 * hour, created_at=now - 2 * hour
        ),
        artifacts=(
            Artifact("warm", "r/x.tmp", "tmp-file", 5, now - 2 * hour, run="r"),
            Artifact("cold", "r/y.tmp", "tmp-file", 5, now - 2 * hour, run="r"),
        ),
    )
    tiers = [tier("hot"), tier("warm"), tier("cold")]

    def reaped(file_now: dict[str, float] | None) -> list[str]:
        return sorted(f"{a.tier}:{a.path}" for a in plan_reaps(snap, tiers, policy, now, file_now).actions)

    everything = ["cold:r/y.tmp", "hot:r/checkpoint-5", "warm:r/x.tmp"]
    assert reaped(None) == everything
    behind = now - 2 * hour  # a filesystem whose clock says these were written just now
    assert reaped({"hot": behind, "warm": behind}) == ["cold:r/y.tmp"]
    assert reaped({"hot": behind}) == ["cold:r/y.tmp", "warm:r/x.tmp"]
