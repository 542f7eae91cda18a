"""``kill -9`` at every crash point of the same-filesystem move (issue 17).

The rename path overlaps its flushes: the journal intent is committed without its flush, which
runs beside the manifest's (both finish before anything is renamed); the two directories are
flushed together; the result is committed without a flush (recovery re-derives it from the
committed manifest at the destination). Each state a crash can leave gets a kill -9 here:

* ``copy-journaled``: intent committed, nothing written;
* ``rename-staged``: intent flushed, the manifest flushed under a staging name;
* ``rename-manifest``: the manifest in place, the checkpoint not yet renamed (an orphan manifest);
* ``rename-done``: the checkpoint renamed, the directories not yet flushed;
* ``copy-committed``: renamed and flushed, no result in the index — also the state a power cut
  leaves when it loses the unflushed result;
* ``copy-recorded``: the result committed.

Right after the kill every checkpoint is whole (byte-compared) in exactly one tier; a second
``prune`` finishes the move: the same tiers, bytes, index and "moved" total as an uninterrupted
prune, no open journal entry, no staging names or orphan manifests.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config

from ckptkeeper.core.model import MANIFEST_SUFFIX
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.index import Index

STEPS = (100, 200, 300)
MOVED = {100, 200}
"""keep_last = 1 in hot: the two older checkpoints move to warm (same filesystem: renames)."""

TRACE = textwrap.dedent(
    """
    import json, os, sys
    import ckptkeeper.executor as _ex
    _hit = _ex._CrashPoints.hit
    _out = open(os.environ["CKPT_TRACE"], "a", buffering=1)
    def hit(self, where):
        _out.write(json.dumps(where) + "\\n")
        _hit(self, where)
    _ex._CrashPoints.hit = hit
    from ckptkeeper.cli import main
    sys.exit(main())
    """
)


def _write_checkpoint(run_dir: Path, step: int, when: float) -> None:
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(32 * 1024 + step)
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}})
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(8 * 1024))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class RenameNode:
    """Hot and warm in one directory tree (one filesystem), an index, a CLI in a subprocess."""

    def __init__(self, tmp: Path) -> None:
        self.hot, self.warm, self.index = tmp / "hot", tmp / "warm", tmp / "index.db"
        self.hot.mkdir()
        self.warm.mkdir()
        self.config = write_config(
            tmp / "config.toml",
            index=self.index,
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot, keep_last=1), local_tier("warm", self.warm, keep_last=10)],
        )
        run = self.hot / "run-a"
        now = time.time()
        for i, step in enumerate(STEPS):
            _write_checkpoint(run, step, now - 3600 + i)
        self.originals = {step: _digest(run / f"checkpoint-{step}") for step in STEPS}
        self.trace = tmp / "trace.jsonl"

    def prune(
        self, *, crash_after: int | None = None, trace: bool = False
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env.pop("CKPTKEEPER_TEST_CRASH_AFTER", None)
        if crash_after is not None:
            env["CKPTKEEPER_TEST_CRASH_AFTER"] = str(crash_after)
        head = ["-c", TRACE] if trace else ["-m", "ckptkeeper.cli"]
        if trace:
            env["CKPT_TRACE"] = str(self.trace)
        return subprocess.run(
            [sys.executable, *head, "--config", str(self.config), "prune"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    def where(self) -> dict[int, list[str]]:
        """step -> tiers holding a whole, byte-identical copy (committed name, not staging)."""
        out: dict[int, list[str]] = {}
        for step in STEPS:
            for tier, root in (("hot", self.hot), ("warm", self.warm)):
                ckpt = root / "run-a" / f"checkpoint-{step}"
                if ckpt.is_dir() and _digest(ckpt) == self.originals[step]:
                    out.setdefault(step, []).append(tier)
        return out

    def litter(self) -> list[str]:
        """Staging names and orphan manifests anywhere in either tier."""
        out = []
        for root in (self.hot, self.warm):
            for p in root.rglob("*"):
                orphan = (
                    p.name.endswith(MANIFEST_SUFFIX)
                    and not p.with_name(p.name.removesuffix(MANIFEST_SUFFIX)).is_dir()
                )
                if STAGING_MARK in p.name or orphan:
                    out.append(str(p))
        return out

    def state(self) -> dict[str, Any]:
        """What the index says: locations per step, open journal entries, the "moved" total."""
        index = Index(self.index)
        try:
            locations = {
                row.step: sorted(row.verified_tiers)
                for row in index.checkpoints("run-a")
                if row.step is not None
            }
            return {
                "locations": locations,
                "open": [e.id for e in index.journal_open()],
                "moved": index.reclaimed().get("moved"),
            }
        finally:
            index.close()


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, Any]]:
    """Every crash point an uninterrupted prune passes, in order, and the index it leaves."""
    node = RenameNode(tmp_path_factory.mktemp("calibration"))
    done = node.prune(trace=True)
    assert done.returncode == 0, done.stdout + done.stderr
    points = [json.loads(line) for line in node.trace.read_text().splitlines()]
    assert node.where() == {100: ["warm"], 200: ["warm"], 300: ["hot"]}
    return points, node.state()


POINTS = (
    "copy-journaled",
    "rename-staged",
    "rename-manifest",
    "rename-done",
    "copy-committed",
    "copy-recorded",
)


@pytest.mark.parametrize("occurrence", [0, 1], ids=["first-move", "second-move"])
@pytest.mark.parametrize("point", POINTS)
def test_kill_at_rename_crash_point_loses_nothing(
    tmp_path: Path, calibration: tuple[list[str], dict[str, Any]], point: str, occurrence: int
) -> None:
    points, clean = calibration
    positions = [k for k, where in enumerate(points, start=1) if where == point]
    assert len(positions) == len(MOVED), (point, points)  # one per rename
    node = RenameNode(tmp_path)

    crashed = node.prune(crash_after=positions[occurrence])
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    # Nothing lost: each checkpoint whole in exactly one tier (a rename never leaves two).
    after_kill = node.where()
    assert sorted(after_kill) == list(STEPS), after_kill
    assert all(len(tiers) == 1 for tiers in after_kill.values()), after_kill

    again = node.prune()
    assert again.returncode == 0, again.stdout + again.stderr
    assert node.where() == {100: ["warm"], 200: ["warm"], 300: ["hot"]}
    assert node.litter() == []
    state = node.state()
    assert state["open"] == []
    assert state["locations"] == clean["locations"] == {100: ["warm"], 200: ["warm"], 300: ["hot"]}
    assert state["moved"] == clean["moved"]  # freed bytes counted once, lost result or not


def test_an_unflushed_commit_survives_kill_9(tmp_path: Path) -> None:
    """``transaction(durable=False)`` commits at once (only its flush is deferred): a process
    killed right after it leaves the row for the next opener, which is what lets the rename skip
    the flush of its result and defer its intent's."""
    db = tmp_path / "index.db"
    Index(db).close()
    script = textwrap.dedent(
        f"""
        import os, signal
        from ckptkeeper.index import Index
        index = Index({str(db)!r})
        with index.transaction(durable=False):
            index.add_reclaimed("moved", 123)
        entry = index.journal_begin({{"action": "copy"}}, "copying", durable=False)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    index = Index(db)
    try:
        assert index.reclaimed()["moved"] == (123, 1)
        assert [e.action for e in index.journal_open()] == [{"action": "copy"}]
        index.sync_wal()  # flushes what is there; nothing to assert but that it works on a live WAL
    finally:
        index.close()
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
