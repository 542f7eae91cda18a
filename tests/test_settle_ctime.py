"""Settling uses ctime as well as mtime.

A checkpoint copied into hot with ``cp -a`` / ``rsync -a`` keeps its old mtimes, so by mtime it
looked settled mid-copy and a prune moved it half-done. ``utime`` cannot set ctime back: a tree
counts as settled only once neither changed for ``settle_seconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from builders import local_tier, write_config
from layout_fixtures import make_hf

from ckptkeeper.config import settings_from_mapping
from ckptkeeper.index import Index
from ckptkeeper.ingest.catalog import Catalog
from ckptkeeper.ingest.watcher import Watcher


def old_tree(src: Path, steps: tuple[int, ...]) -> Path:
    """A run written a day ago somewhere else (another node, a backup)."""
    for step in steps:
        make_hf(src / "r", step)
    when = time.time() - 86400
    for p in [*(src / "r").rglob("*"), src / "r"]:
        os.utime(p, (when, when), follow_symlinks=False)
    return src / "r"


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def node_config(tmp: Path, name: str, hot: Path, **daemon: Any) -> Path:
    warm = tmp / f"warm-{name}"
    warm.mkdir()
    return write_config(
        tmp / f"{name}.toml",
        index=tmp / f"{name}.db",
        daemon={"settle_seconds": "1h", "metrics_addr": "", **daemon},
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=5)],
    )


def test_cp_a_copy_with_old_mtimes_is_not_settled_and_not_moved(tmp_path: Path) -> None:
    src = old_tree(tmp_path / "src", (1, 2))
    hot = tmp_path / "hot"
    hot.mkdir()
    subprocess.run(["cp", "-a", str(src), str(hot)], check=True)
    assert (hot / "r" / "checkpoint-1" / "trainer_state.json").stat().st_mtime < time.time() - 3600
    config = node_config(tmp_path, "ctime", hot)

    result = cli(config, "prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in (hot / "r").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert not (tmp_path / "warm-ctime" / "r").exists()  # nothing moved half-copied
    listing = json.loads(cli(config, "ls", "--json").stdout)
    states = {c["step"]: c["state"] for r in listing["runs"] for c in r["checkpoints"]}
    assert states == {1: "writing", 2: "writing"}

    # The same tree judged by mtimes alone (the old rule): settled, and its run abandoned a day
    # ago, so checkpoint-1 would be reaped (or moved) while the copy may still be running.
    trusting = node_config(tmp_path, "mtime", hot, trust_mtimes=True)
    dry = json.loads(cli(trusting, "prune", "--dry-run", "--json").stdout)
    assert any(a["step"] == 1 and a["action"] in ("copy", "reap", "delete") for a in dry["actions"]), dry


def test_watcher_settles_a_cp_a_copy_by_its_ctime_without_another_event(tmp_path: Path) -> None:
    """The watcher re-checks a settling checkpoint when it should have settled; by mtime a ``cp -a``
    copy "settled" a day ago, so no re-check was scheduled and it stayed ``writing``."""
    src = old_tree(tmp_path / "src", (1,))
    hot = tmp_path / "hot"
    hot.mkdir()
    settle = 3.0
    settings = settings_from_mapping(
        {
            "index": str(tmp_path / "index.db"),
            "daemon": {"settle_seconds": settle, "metrics_addr": ""},
            "tiers": [{"name": "hot", "url": str(hot)}],
        }
    )
    index = Index(settings.index)
    watcher = Watcher(Catalog(settings, index))
    try:
        watcher.start(initial_reconcile=True)
        started = time.time()
        subprocess.run(["cp", "-a", str(src), str(hot)], check=True)

        def state() -> str | None:
            row = index.checkpoint("r", "checkpoint-1")
            return None if row is None else row.state.value

        deadline = time.monotonic() + 30
        seen = set()
        while time.monotonic() < deadline and state() != "complete":
            seen.add(state())
            time.sleep(0.05)
        completed = time.time()
        assert state() == "complete"  # settled on its own: the re-check was scheduled by ctime
        assert "writing" in seen
        # never before its ctime (>= the start of the copy) was settle_seconds old
        assert completed >= started + settle
    finally:
        watcher.stop()
        index.close()


def test_a_cp_a_copy_once_settled_by_ctime_is_moved(tmp_path: Path) -> None:
    """Once settled, a ``cp -a`` copy is moved like any other checkpoint. The catalog records when
    it was written by mtime and ctime, and the executor's last look before a copy or delete (has it
    been written to since it was cataloged?) must judge the same way: judged by mtime alone, every
    hot checkpoint whose ctime is past its mtime (``cp -a``, a framework's write-then-rename) looked
    written to since, and was skipped at every prune, so hot never drained."""
    src = old_tree(tmp_path / "src", (1, 2))
    hot = tmp_path / "hot"
    hot.mkdir()
    subprocess.run(["cp", "-a", str(src), str(hot)], check=True)
    config = node_config(tmp_path, "ctime", hot, settle_seconds="1s")
    changed = max(p.lstat().st_ctime for p in [*(hot / "r").rglob("*"), hot / "r"])
    while time.time() < changed + 1.5:  # settled by ctime: utime cannot back-date it
        time.sleep(0.1)

    result = cli(config, "prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped:" not in result.stdout and "0 skipped" in result.stdout, result.stdout
    assert sorted(p.name for p in (hot / "r").iterdir()) == ["checkpoint-2"]
    assert (tmp_path / "warm-ctime" / "r" / "checkpoint-1" / "trainer_state.json").is_file()
