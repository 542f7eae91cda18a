"""A lost index loses nothing (docs/design.md, safety invariant 10, §10; issue #13 items 4 and 5).

* Item 5: pin r@1, prune (warm holds it), delete the index, plain ``prune``: the pin used to live
  only in the index, and the next prune expired r@1 with exit 0. Pins are now also pin objects
  beside the manifest in every slower tier, read back by every listing, and a missing index on
  tiers holding this node's copies is rebuilt with deletes held for one pass, like a corrupt one.
* Item 4: with the daemon running, ``rm index.db*``, then ``scan`` and ``pin``: the daemon used to
  keep its connection to the deleted file and expired the pinned checkpoint within seconds. The
  index's identity (st_dev, st_ino) is now checked before each pass and each write; a deleted or
  replaced index is reopened and rebuilt with deletes held.

Everything goes through the real CLI / daemon in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import FAST_DAEMON, local_tier, write_config
from layout_fixtures import make_hf

from ckptkeeper.core.model import RunState
from ckptkeeper.index import Index, IndexReplaced

PIN = ".ckptkeeper-pin.json"


def settled(path: Path, age: float = 3600) -> Path:
    when = time.time() - age
    for p in [*path.rglob("*"), path]:
        os.utime(p, (when, when), follow_symlinks=False)
    return path


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.hot.mkdir()
        self.warm.mkdir()
        self.index = tmp / "state" / "index.db"
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=self.index,
            daemon=FAST_DAEMON,
            tiers=[local_tier("hot", self.hot, keep_last=1), local_tier("warm", self.warm, keep_last=2)],
        )

    def checkpoint(self, step: int) -> Path:
        return settled(make_hf(self.hot / "r", step), age=3600 - step)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    def ls(self) -> dict[int, dict[str, Any]]:
        result = self.cli("ls", "--json")
        assert result.returncode == 0, result.stderr
        return {c["step"]: c for r in json.loads(result.stdout)["runs"] for c in r["checkpoints"]}

    def lose_index(self) -> None:
        """``rm index.db*``: the database, its WAL, the lock files, the hold marker."""
        for p in self.index.parent.glob(self.index.name + "*"):
            p.unlink()


def test_pin_survives_a_deleted_index_and_the_first_prune_holds_deletes(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for step in (1, 2):
        node.checkpoint(step)
    first = node.cli("prune")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (node.warm / "r" / "checkpoint-1").is_dir()  # warm holds it
    pinned = node.cli("pin", "r", "1")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.strip() == "pinned r@1"
    assert (node.warm / "r" / f"checkpoint-1{PIN}").is_file()  # stored in the tier, not only the index

    node.lose_index()
    node.checkpoint(3)  # hot keeps r@3; r@2 moves to warm, whose keep_last=2 would expire r@1
    held = node.cli("prune")
    assert held.returncode == 3, held.stdout + held.stderr  # deletes held: the index was missing
    assert "deletes held" in held.stdout + held.stderr
    assert (node.warm / "r" / "checkpoint-1").is_dir()
    assert (node.hot / "r" / "checkpoint-2").is_dir()  # not moved: a move deletes its source
    assert node.ls()[1]["pinned"] is True  # read back from the pin object in warm

    applied = node.cli("prune")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (node.warm / "r" / "checkpoint-1").is_dir()  # pinned: kept
    assert (node.warm / "r" / "checkpoint-2").is_dir()  # the policy applies again
    assert not (node.hot / "r" / "checkpoint-2").exists()

    released = node.cli("unpin", "r", "1")
    assert released.returncode == 0, released.stderr
    assert not (node.warm / "r" / f"checkpoint-1{PIN}").exists()
    assert node.cli("prune").returncode == 0
    assert not (node.warm / "r" / "checkpoint-1").exists()  # unpinned: the policy expires it


def test_a_dry_run_after_a_lost_index_shows_the_hold_the_real_run_applies(tmp_path: Path) -> None:
    """`prune --dry-run` on a node whose index is gone used to plan from a stand-in index without
    the hold a real run writes first, so it promised deletes the real run would not do."""
    node = Node(tmp_path)
    for step in (1, 2):
        node.checkpoint(step)
    assert node.cli("prune").returncode == 0
    node.lose_index()
    node.checkpoint(3)

    dry = node.cli("prune", "--dry-run", "--json")
    assert dry.returncode == 3, dry.stdout + dry.stderr  # the hold refuses the deletes, as for real
    doc = json.loads(dry.stdout)
    assert "deletes held" in doc["refused"]
    assert "is missing" in doc["refused"]
    planned = {(a["action"], a["run"], a["step"], a["tier"]) for a in doc["actions"]}
    assert all(kind == "copy" for kind, *_ in planned), planned
    assert not node.index.exists()  # a dry run creates nothing
    assert not Path(str(node.index) + ".deletes-held").exists()

    real = node.cli("prune", "--json")
    assert real.returncode == 3, real.stdout + real.stderr
    done = {(a["action"], a["run"], a["step"], a["tier"]) for a in json.loads(real.stdout)["actions"]}
    assert done == planned  # what the dry run showed is what ran
    assert (node.hot / "r" / "checkpoint-2").is_dir() and (node.warm / "r" / "checkpoint-1").is_dir()


def test_a_first_start_on_fresh_tiers_holds_nothing_and_reads_only_commands_create_no_index(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    for step in (1, 2, 3):
        node.checkpoint(step)
    assert node.cli("ls", "--json").returncode == 0
    assert not node.index.exists()  # a read-only command never creates the index
    result = node.cli("prune")
    assert result.returncode == 0, result.stdout + result.stderr  # nothing was lost: nothing held
    assert (node.warm / "r" / "checkpoint-2").is_dir()  # moved at once: no pass was held
    assert not (node.hot / "r" / "checkpoint-1").exists()  # and expired at once
    assert not Path(str(node.index) + ".deletes-held").exists()


def test_identity_change_refuses_writes_and_reopen_follows_the_path(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    ix = Index(path)
    try:
        assert ix.identity_problem() is None
        ix.upsert_run("a", state=RunState.ACTIVE)
        for p in tmp_path.glob("index.db*"):
            p.unlink()
        assert "deleted" in (ix.identity_problem() or "")
        with pytest.raises(IndexReplaced):
            ix.delete_run("a")
        with pytest.raises(IndexReplaced), ix.transaction():
            pass
        other = Index(path)  # another process builds a new index at the path
        other.close()
        assert "replaced" in (ix.identity_problem() or "")
        ix.reopen()
        assert ix.identity_problem() is None
        assert ix.runs() == []  # the new file, not the deleted one
        ix.delete_run("a")  # writes go through again
    finally:
        ix.close()


def test_daemon_follows_a_deleted_index_and_keeps_the_pin_made_in_the_new_one(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for step in (1, 2):
        node.checkpoint(step)
    log = (tmp_path / "daemon.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "daemon"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not (node.warm / "r" / "checkpoint-1").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (node.warm / "r" / "checkpoint-1").is_dir(), (tmp_path / "daemon.log").read_text()[-3000:]

        node.lose_index()
        assert node.cli("scan").returncode == 0
        pinned = node.cli("pin", "r", "1")
        assert pinned.returncode == 0, pinned.stderr
        assert pinned.stdout.strip() == "pinned r@1"
        # Now the policy wants r@1 gone from warm (keep_last=2) once r@3 arrives.
        node.checkpoint(3)
        deadline = time.monotonic() + 60
        while not (node.warm / "r" / "checkpoint-2").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (node.warm / "r" / "checkpoint-2").is_dir(), (tmp_path / "daemon.log").read_text()[-3000:]
        # one more pass after the move, in which the stale daemon used to expire r@1
        passes = _passes(tmp_path)
        deadline = time.monotonic() + 30
        while _passes(tmp_path) < passes + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _passes(tmp_path) >= passes + 2
        assert (node.warm / "r" / "checkpoint-1").is_dir()  # pinned in the new index: kept
        assert node.ls()[1]["pinned"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert "index deleted or replaced while open" in text or "index rebuilt from the tiers" in text


def _passes(tmp: Path) -> int:
    count = 0
    for line in (tmp / "daemon.log").read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == "prune done" and doc.get("job") == "retention":
            count += 1
    return count


def test_a_lock_file_deleted_while_being_taken_is_not_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm index.db*`` also removes the lock files: a lock taken on the deleted file would exclude
    nobody who opens the path afterwards. The lock is on the file the path names when acquired."""
    import fcntl

    from ckptkeeper.util import lock as lock_module

    path = tmp_path / "index.db.executor.lock"
    real_flock = fcntl.flock
    calls = []

    def flock_then_rm(fd: int, op: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            path.unlink()  # between our open() and our flock(), someone runs `rm index.db*`
        real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", flock_then_rm)
    held = lock_module.ExecutorLock(tmp_path / "index.db")
    held.acquire(timeout=1)
    try:
        assert len(calls) == 2  # the first lock was on the deleted file: taken again on the new one
        monkeypatch.setattr(lock_module.fcntl, "flock", real_flock)
        other = lock_module.ExecutorLock(tmp_path / "index.db")
        with pytest.raises(lock_module.LockHeld):
            other.acquire(timeout=0)
    finally:
        held.release()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_pin_objects_round_trip_and_hostile_ones_are_ignored(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from builders import tier

    from ckptkeeper.storage import TierStorage

    if backend == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        client = request.getfixturevalue("s3_client")
        options = request.getfixturevalue("s3_storage_options")
        storage = TierStorage(tier("cold", f"s3://{bucket}/ckpt", storage_options=options))

        def plant(rel: str, body: bytes) -> None:
            client.put_object(Bucket=bucket, Key=f"ckpt/{rel}", Body=body)
    else:
        (tmp_path / "warm").mkdir()
        storage = TierStorage(tier("warm", str(tmp_path / "warm")))

        def plant(rel: str, body: bytes) -> None:
            (tmp_path / "warm" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "warm" / rel).write_bytes(body)

    storage.write_pin("team/run", "checkpoint-1", 1, "node-a")  # no copy here yet: still stored
    storage.write_pin("r", "sub/ckpt.pt", 7, "node-a")
    # hostile or foreign: another checkpoint's pin at this path, not JSON, a list, a nesting bomb
    plant(f"x/a{PIN}", json.dumps({"run": "y", "name": "b"}).encode())
    plant(f"x/c{PIN}", b"\xff not json")
    plant(f"x/d{PIN}", b"[1, 2]")
    plant(f"x/e{PIN}", b"[" * 100_000)
    assert storage.list_pins() == {("team/run", "checkpoint-1"), ("r", "sub/ckpt.pt")}
    storage.remove_pin("r", "sub/ckpt.pt")
    storage.remove_pin("r", "never-pinned")  # no error
    assert storage.list_pins() == {("team/run", "checkpoint-1")}
    assert storage.list_manifests() == []  # pin objects are not copies
    assert storage.list_staging() == []  # nor leftovers for the reaper


def test_a_hot_only_node_that_lost_its_index_keeps_its_pins(tmp_path: Path) -> None:
    """A node with only a hot tier has no pin objects and no copies in a slower tier: ``rm
    index.db*`` used to look like a first start, and the next prune expired the pinned checkpoint
    at once. The index record in the hot root proves an index existed and carries its pins."""
    hot = tmp_path / "hot"
    hot.mkdir()
    node = Node.__new__(Node)
    node.tmp, node.hot, node.warm = tmp_path, hot, tmp_path / "no-warm"
    node.index = tmp_path / "state" / "index.db"
    node.config = tmp_path / "config.toml"
    write_config(
        node.config, index=node.index, daemon=FAST_DAEMON, tiers=[local_tier("hot", hot, keep_last=1)]
    )
    for step in (1, 2):
        node.checkpoint(step)
    assert node.cli("scan").returncode == 0
    pinned = node.cli("pin", "r", "1")  # before any prune: a pin alone must leave the record
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    assert node.cli("prune").returncode == 0
    assert (hot / "r" / "checkpoint-1").is_dir() and (hot / "r" / "checkpoint-2").is_dir()
    records = [p.name for p in hot.iterdir() if p.name.startswith(".ckptkeeper-index-")]
    assert len(records) == 1, records
    assert [r["name"] for r in json.loads(node.cli("ls", "--json").stdout)["runs"]] == ["r"]  # not a run

    node.lose_index()
    node.checkpoint(3)  # keep_last=1 now wants only r@3; r@1 is pinned, r@2 expires
    dry = node.cli("prune", "--dry-run", "--json")
    assert dry.returncode == 3, dry.stdout + dry.stderr
    assert "is missing" in json.loads(dry.stdout)["refused"]
    held = node.cli("prune")
    assert held.returncode == 3, held.stdout + held.stderr  # the first pass after the loss deletes nothing
    assert all((hot / "r" / f"checkpoint-{s}").is_dir() for s in (1, 2, 3))
    assert node.ls()[1]["pinned"] is True  # carried over from the record

    applied = node.cli("prune")
    assert applied.returncode == 0, applied.stdout + applied.stderr  # pins known again: no --force needed
    assert (hot / "r" / "checkpoint-1").is_dir()  # pinned: kept
    assert not (hot / "r" / "checkpoint-2").exists()  # the policy applies again
    assert (hot / "r" / "checkpoint-3").is_dir()
