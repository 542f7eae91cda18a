"""The undo window (README "Undo window"): expiries and reaps move a copy into the tier's trash,
``undelete`` brings it back byte-identical, the bytes are freed for real when the window ends or at
once under watermark pressure, and a ``kill -9`` at any instant of a move aside loses nothing.

Real parts: local directories, a moto S3 server over HTTP, the CLI (and, where a test needs a clock
past the window, the prune action with its ``now``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner

from ckptkeeper.actions.prune import run_prune
from ckptkeeper.cli import main
from ckptkeeper.config import load_settings
from ckptkeeper.core.model import ActionKind
from ckptkeeper.hook.protocol import TRASH_DIR
from ckptkeeper.index import Index

DAY = 86400.0
REAPER = {"failed_after": "30d", "partial_after": "30d"}


def write_ckpt(run_dir: Path, step: int, when: float) -> None:
    """A Hugging Face Trainer checkpoint (complete: ``trainer_state.json``), written ``when``."""
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(40_000 + step * 4)
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
    )
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(12_000))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``root``."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


class Node:
    """A node with a hot tier (and optionally more) and a CLI to drive it."""

    def __init__(self, tmp: Path, tiers: list[dict[str, Any]], steps: list[int]) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir(exist_ok=True)
        self.index = tmp / "index.db"
        self.config = tmp / "config.toml"
        self.tiers = tiers
        self.write_config()
        self.run_dir = self.hot / "r"
        self.originals: dict[int, dict[str, str]] = {}
        self.add(steps)

    def write_config(self, **hot_extra: Any) -> None:
        tiers = [{**self.tiers[0], **hot_extra}, *self.tiers[1:]]
        write_config(
            self.config,
            index=self.index,
            daemon={"settle_seconds": "1s", "trust_mtimes": True, "textfile": self.tmp / "metrics.prom"},
            reaper=REAPER,
            tiers=tiers,
        )

    def add(self, steps: list[int]) -> None:
        now = time.time()
        for step in steps:
            write_ckpt(self.run_dir, step, now - 3600 + step / 100)
            self.originals[step] = digest(self.run_dir / f"checkpoint-{step}")

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    def cli_json(self, *args: str) -> tuple[int, Any]:
        result = CliRunner().invoke(
            main, ["--config", str(self.config), *args, "--json"], catch_exceptions=False
        )
        return result.exit_code, json.loads(result.stdout)

    def steps_in_ls(self) -> dict[int, list[str]]:
        code, doc = self.cli_json("ls")
        assert code == 0, doc
        assert all(not r["name"].startswith(".") for r in doc["runs"]), doc  # the trash is never a run
        return {c["step"]: c["tiers"] for r in doc["runs"] for c in r["checkpoints"]}

    def trash_entries(self, root: Path) -> dict[int, Path]:
        """step -> the checkpoint's directory inside ``root``'s trash."""
        out = {}
        for p in sorted((root / TRASH_DIR).glob("*/r/checkpoint-*")):
            if p.is_dir():
                out[int(p.name.split("-")[1])] = p
        return out

    def prune_at(self, when: float, *, dry_run: bool = False) -> Any:
        settings = load_settings(str(self.config))
        with Index(self.index) as ix:
            return run_prune(settings, ix, dry_run=dry_run, now=lambda: when)


def hot_only(tmp: Path, **extra: Any) -> Node:
    """hot keeps the newest checkpoint; 100 and 200 expire (into the trash with a window)."""
    return Node(tmp, [local_tier("hot", tmp / "hot", keep_last=1, **extra)], [100, 200, 300])


# -- local tier ------------------------------------------------------------------------------


def test_expiry_goes_to_trash_and_undelete_is_byte_identical(tmp_path: Path) -> None:
    node = hot_only(tmp_path, undo_window="24h")
    code, plan = node.cli_json("prune", "--dry-run")
    assert code == 0, plan
    moves = [a for a in plan["actions"] if a["action"] == "delete"]
    assert {a["step"] for a in moves} == {100, 200}
    assert all(a["to_trash"] and "to trash for 1d" in a["reason"] for a in moves), moves
    assert plan["reclaim_bytes"]["hot"] == 0  # a move aside frees nothing yet
    assert not (node.hot / TRASH_DIR).exists()  # the dry run touched nothing

    code, out = node.cli_json("prune")
    assert code == 0, out
    assert out["result"]["reclaimed_bytes"].get("hot", 0) == 0
    assert not (node.run_dir / "checkpoint-100").exists()
    trashed = node.trash_entries(node.hot)
    assert set(trashed) == {100, 200}
    assert digest(trashed[100]) == node.originals[100]  # moved, not rewritten
    assert (trashed[100].parent / "checkpoint-100.ckptkeeper-manifest.json").is_file()  # self-describing
    assert node.steps_in_ls() == {300: ["hot"]}

    code, deleted = node.cli_json("ls", "--deleted")
    assert code == 0
    rows = {d["step"]: d for d in deleted["deleted"]}
    assert set(rows) == {100, 200}
    for d in rows.values():
        assert d["run"] == "r" and d["tier"] == "hot" and d["bytes"] > 40_000
        assert d["expires_at"] == pytest.approx(d["deleted_at"] + DAY)
        assert abs(d["deleted_at"] - time.time()) < 600
    code, text = node.cli("ls", "--deleted")
    assert code == 0 and "PURGED AFTER" in text and "r" in text

    code, doc = node.cli_json("undelete", "r", "100")
    assert code == 0, doc
    assert doc["tier"] == "hot" and doc["step"] == 100 and doc["path"] == "r/checkpoint-100"
    assert digest(node.run_dir / "checkpoint-100") == node.originals[100]
    assert node.steps_in_ls()[100] == ["hot"]
    assert set(node.trash_entries(node.hot)) == {200}
    code, deleted = node.cli_json("ls", "--deleted")
    assert [d["step"] for d in deleted["deleted"]] == [200]

    code, text = node.cli("undelete", "r", "100")
    assert code == 1 and "nothing to undelete" in text, text


def test_undelete_refuses_over_a_live_copy(tmp_path: Path) -> None:
    node = hot_only(tmp_path, undo_window="24h")
    assert node.cli("prune")[0] == 0
    # the same checkpoint written again at its place (a re-run of the job saved it anew)
    write_ckpt(node.run_dir, 200, time.time() - 3600)
    assert node.cli("scan")[0] == 0
    code, text = node.cli("undelete", "r", "200")
    assert code == 1 and "live copy" in text, text
    assert set(node.trash_entries(node.hot)) == {100, 200}  # nothing lost either way
    code, text = node.cli("undelete", "r", "200", "--tier", "nope")
    assert code == 1 and "no tier named" in text


def test_window_end_purges_and_frees_the_bytes(tmp_path: Path) -> None:
    node = hot_only(tmp_path, undo_window="24h")
    assert node.cli("prune")[0] == 0
    trash = node.hot / TRASH_DIR
    held = tree_bytes(trash)
    assert held > 80_000
    code, status = node.cli_json("status")
    before = status["reclaimed"]["total_bytes"]
    assert status["trash"]["hot"]["entries"] == 2 and status["trash"]["hot"]["bytes"] > 80_000

    # a day later, not yet: nothing purged
    early = node.prune_at(time.time() + DAY - 600)
    assert not [a for a in early.plan.actions if a.action is ActionKind.PURGE]
    assert tree_bytes(trash) == held

    # a dry run past the window lists the purges and touches nothing
    snapshot = digest(trash)
    dry = node.prune_at(time.time() + DAY + 600, dry_run=True)
    purges = [a for a in dry.plan.actions if a.action is ActionKind.PURGE]
    assert {a.step for a in purges} == {100, 200}
    assert all(a.reason == "undo window 1d ended" for a in purges), purges
    assert dry.plan.reclaim_bytes["hot"] == sum(a.bytes for a in purges)
    assert digest(trash) == snapshot

    done = node.prune_at(time.time() + DAY + 600)
    assert done.exit_code == 0
    assert tree_bytes(trash) == 0 and not node.trash_entries(node.hot)
    freed = done.result.reclaimed_bytes["hot"]
    assert freed == sum(a.bytes for a in purges) and held - 8192 <= freed < held  # manifests not counted
    code, status = node.cli_json("status")
    assert status["reclaimed"]["total_bytes"] - before == freed
    assert status["reclaimed"]["by_reason"]["undo-window-ended"]["bytes"] == freed
    assert status["trash"] == {}
    # the metric reads the same counters: after a (no-op) CLI prune writes the textfile, it agrees
    assert node.cli("prune")[0] == 0
    metric = [
        float(line.rsplit(" ", 1)[1])
        for line in (tmp_path / "metrics.prom").read_text().splitlines()
        if line.startswith("ckptkeeper_reclaimed_bytes_total{")
    ]
    assert int(sum(metric)) == status["reclaimed"]["total_bytes"]
    assert (
        f'ckptkeeper_reclaimed_bytes_total{{reason="undo-window-ended"}} {float(freed)}'
        in (tmp_path / "metrics.prom").read_text()
    )
    assert node.cli_json("ls", "--deleted")[1] == {"deleted": []}
    code, text = node.cli("undelete", "r", "100")
    assert code == 1 and "window passed" in text


def test_watermark_pressure_purges_the_trash_first(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(
        tmp_path,
        [local_tier("hot", tmp_path / "hot", keep_last=1, undo_window="7d"), local_tier("warm", warm)],
        [100, 200, 300],
    )
    node.tiers[1] = local_tier("warm", warm, keep_last=0)  # warm keeps nothing: 100, 200 expire
    node.write_config()
    assert node.cli("prune")[0] == 0
    assert set(node.trash_entries(node.hot)) == {100, 200}

    # two more saves; warm now keeps the last 3 (300 and 400 move down); and any real disk is above
    # 1 %: hot is under pressure
    node.add([400, 500])
    node.tiers[1] = local_tier("warm", warm, keep_last=3)
    node.write_config(high_watermark=0.01, low_watermark=0.005)
    code, plan = node.cli_json("prune", "--dry-run")
    kinds = [a["action"] for a in plan["actions"]]
    purges = [a for a in plan["actions"] if a["action"] == "purge"]
    assert {a["step"] for a in purges} == {100, 200}, plan
    assert all(a["reason"] == "hot above high watermark 1%: trash freed at once" for a in purges)
    assert kinds.index("copy") > max(i for i, k in enumerate(kinds) if k == "purge")  # before demotions
    assert set(node.trash_entries(node.hot)) == {100, 200}  # dry run

    code, out = node.cli_json("prune")
    assert code == 0, out
    assert not node.trash_entries(node.hot)
    assert out["result"]["reclaimed_bytes"]["hot"] >= sum(a["bytes"] for a in purges)


def test_bad_undo_window_names_the_key(tmp_path: Path) -> None:
    node = hot_only(tmp_path, undo_window="soon")
    code, text = node.cli("ls")
    assert code == 2
    assert "tiers[0].undo_window" in text, text


def test_without_undo_window_deletes_at_once(tmp_path: Path) -> None:
    node = hot_only(tmp_path)
    code, out = node.cli_json("prune")
    assert code == 0
    assert not (node.hot / TRASH_DIR).exists()
    assert out["result"]["reclaimed_bytes"]["hot"] > 80_000
    assert node.cli_json("ls", "--deleted")[1] == {"deleted": []}


# -- kill -9 during a move aside -------------------------------------------------------------


@pytest.mark.parametrize("crash_after", [1, 2, 3, 4])
def test_kill_during_move_aside_loses_nothing(tmp_path: Path, crash_after: int) -> None:
    node = hot_only(tmp_path, undo_window="24h")
    assert node.cli("scan")[0] == 0
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune"],
        env={**os.environ, "CKPTKEEPER_TEST_CRASH_AFTER": str(crash_after)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    # right after the kill: each expired checkpoint is whole at its place or in the trash
    trashed = node.trash_entries(node.hot)
    for step in (100, 200):
        place = node.run_dir / f"checkpoint-{step}"
        where = place if place.exists() else trashed[step]
        assert digest(where) == node.originals[step]
    # the restart finishes or undoes the step, then the plan carries on
    code, out = node.cli_json("prune")
    assert code == 0, out
    assert set(node.trash_entries(node.hot)) == {100, 200}
    leftovers = [p for p in (node.hot / TRASH_DIR).rglob("*") if ".ckptkeeper-tmp-" in p.name]
    assert not leftovers
    code, deleted = node.cli_json("ls", "--deleted")
    assert sorted(d["step"] for d in deleted["deleted"]) == [100, 200]
    for step in (100, 200):
        assert node.cli("undelete", "r", str(step))[0] == 0
        assert digest(node.run_dir / f"checkpoint-{step}") == node.originals[step]
    assert not node.trash_entries(node.hot)


# -- S3 --------------------------------------------------------------------------------------


def s3_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_s3_undelete_is_byte_identical_and_window_end_purges(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any
) -> None:
    node = Node(
        tmp_path,
        [
            local_tier("hot", tmp_path / "hot", keep_last=1),
            s3_tier("cold", s3_bucket, s3_server, keep_last=2, undo_window="24h"),
        ],
        [100, 200, 300],
    )
    assert node.cli("prune")[0] == 0  # 200 moves to cold; 100 expires from hot (no window there)
    node.add([400])
    assert node.cli("prune")[0] == 0  # 300 moves to cold; 200 expires from cold: into its trash
    node.add([500])
    code, out = node.cli_json("prune")  # 400 moves to cold; 300 expires from cold: into its trash
    assert code == 0, out
    trash_prefix = f"ckpt/{TRASH_DIR}/"
    keys = s3_keys(s3_client, s3_bucket, trash_prefix)
    assert any(k.endswith("r/checkpoint-200.ckptkeeper-manifest.json") for k in keys), keys
    assert any(k.endswith("r/checkpoint-300.ckptkeeper-manifest.json") for k in keys), keys
    assert not s3_keys(s3_client, s3_bucket, "ckpt/r/checkpoint-300")
    code, deleted = node.cli_json("ls", "--deleted")
    assert {(d["step"], d["tier"]) for d in deleted["deleted"]} == {(200, "cold"), (300, "cold")}

    code, doc = node.cli_json("undelete", "r", "300", "--tier", "cold")
    assert code == 0, doc
    assert node.steps_in_ls()[300] == ["cold"]
    restored = tmp_path / "restored"
    code, text = node.cli("restore", "r", "--step", "300", "--to", str(restored))
    assert code == 0, text
    assert digest(restored / "checkpoint-300") == node.originals[300]
    assert not any("checkpoint-300" in k for k in s3_keys(s3_client, s3_bucket, trash_prefix))

    # two days on: 300 expires again (into the trash), 200's window has ended: purged for good
    later = time.time() + 2 * DAY
    done = node.prune_at(later)
    assert done.exit_code == 0, done.failed
    purged = [a for a in done.result.done if a.action is ActionKind.PURGE]
    assert [a.step for a in purged] == [200]
    assert done.result.reclaimed_bytes["cold"] == purged[0].bytes > 40_000
    keys = s3_keys(s3_client, s3_bucket, trash_prefix)
    assert not any("checkpoint-200" in k for k in keys) and any("checkpoint-300" in k for k in keys)
    done = node.prune_at(later + 2 * DAY)
    assert not s3_keys(s3_client, s3_bucket, trash_prefix)
    assert [a.step for a in done.result.done if a.action is ActionKind.PURGE] == [300]


def test_trash_is_never_a_run_and_a_rebuilt_index_finds_it(tmp_path: Path) -> None:
    from ckptkeeper.ingest.events import EventKind, classify_path

    node = hot_only(tmp_path, undo_window="24h")
    assert node.cli("prune")[0] == 0
    event = str(node.trash_entries(node.hot)[100] / "model.safetensors")
    assert classify_path(str(node.hot), event, 1) == (EventKind.IGNORE, None)
    # the index is lost: the trash describes itself, a rebuilt index finds both entries again
    for p in tmp_path.glob("index.db*"):
        p.unlink()
    code, _ = node.cli("scan")
    assert code == 0
    assert set(node.steps_in_ls()) == {300}
    code, deleted = node.cli_json("ls", "--deleted")
    assert sorted(d["step"] for d in deleted["deleted"]) == [100, 200]
    assert node.cli("undelete", "r", "200")[0] == 0
    assert digest(node.run_dir / "checkpoint-200") == node.originals[200]


def test_slower_local_tier_trash_keeps_the_manifest_and_verifies(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(
        tmp_path,
        [
            local_tier("hot", tmp_path / "hot", keep_last=1),
            local_tier("warm", warm, keep_last=2, undo_window="1h"),
        ],
        [100, 200, 300],
    )
    assert node.cli("prune")[0] == 0  # 200 moves to warm
    node.add([400])
    assert node.cli("prune")[0] == 0  # 300 moves to warm; 200 expires from warm: into its trash
    assert not (warm / "r" / "checkpoint-200").exists()
    assert not (warm / "r" / "checkpoint-200.ckptkeeper-manifest.json").exists()
    trashed = node.trash_entries(warm)
    assert set(trashed) == {200} and digest(trashed[200]) == node.originals[200]
    code, doc = node.cli_json("undelete", "r", "200")
    assert code == 0 and doc["tier"] == "warm", doc
    assert digest(warm / "r" / "checkpoint-200") == node.originals[200]
    assert (warm / "r" / "checkpoint-200.ckptkeeper-manifest.json").is_file()
    assert node.steps_in_ls()[200] == ["warm"]
    code, text = node.cli("verify", "r")
    assert code == 0, text
    assert not node.trash_entries(warm)


def test_reaps_of_a_failed_run_go_to_trash(tmp_path: Path) -> None:
    import ckptkeeper

    node = Node(tmp_path, [local_tier("hot", tmp_path / "hot", keep_last=5, undo_window="24h")], [])
    run = ckptkeeper.track_run(node.run_dir)
    with run:
        node.add([100, 200, 300])
        for step in (100, 200, 300):
            run.commit(node.run_dir / f"checkpoint-{step}", step=step)
        run.fail("loss diverged")
    code, plan = node.cli_json("prune", "--dry-run")
    reaps = [a for a in plan["actions"] if a["action"] == "reap"]
    assert {a["step"] for a in reaps} == {100, 200}, plan
    assert all(a["to_trash"] for a in reaps)
    code, out = node.cli_json("prune")
    assert code == 0, out
    assert set(node.trash_entries(node.hot)) == {100, 200}
    assert node.cli("undelete", "r", "100")[0] == 0
    assert digest(node.run_dir / "checkpoint-100") == node.originals[100]


@pytest.mark.parametrize("crash_after", [1, 2])
def test_s3_kill_during_move_aside_loses_nothing(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any, crash_after: int
) -> None:
    cold = s3_tier("cold", s3_bucket, s3_server, keep_last=2, undo_window="24h")
    node = Node(tmp_path, [local_tier("hot", tmp_path / "hot", keep_last=1), cold], [100, 200, 300])
    assert node.cli("prune")[0] == 0  # 200 moves to cold
    node.tiers[1] = {**cold, "keep_last": 1}  # now cold keeps only 300 (in hot): 200 expires from cold
    node.write_config()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune"],
        env={**os.environ, "CKPTKEEPER_TEST_CRASH_AFTER": str(crash_after)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    code, out = node.cli_json("prune")
    assert code == 0, out
    assert not s3_keys(s3_client, s3_bucket, "ckpt/r/checkpoint-200")
    assert not [k for k in s3_keys(s3_client, s3_bucket, "ckpt/") if ".ckptkeeper-tmp-" in k]
    code, deleted = node.cli_json("ls", "--deleted")
    assert [(d["step"], d["tier"]) for d in deleted["deleted"]] == [(200, "cold")]
    assert node.cli("undelete", "r", "200")[0] == 0
    restored = tmp_path / "restored"
    assert node.cli("restore", "r", "--step", "200", "--to", str(restored))[0] == 0
    assert digest(restored / "checkpoint-200") == node.originals[200]


@pytest.mark.parametrize("copied", ["some", "all"])
def test_s3_kill_between_the_server_side_copies_and_the_manifest_loses_nothing(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any, copied: str
) -> None:
    """The S3 move aside copies every data key into the entry, then writes the entry's manifest
    (its commit point), then deletes the originals. A kill -9 after some or all of the copies but
    before the manifest leaves an entry without a manifest beside an intact original: the next
    prune must remove that half entry, keep the original, and move it aside again, whole."""
    import sqlite3

    cold = s3_tier("cold", s3_bucket, s3_server, keep_last=2, undo_window="24h")
    node = Node(tmp_path, [local_tier("hot", tmp_path / "hot", keep_last=1), cold], [100, 200, 300])
    assert node.cli("prune")[0] == 0  # 200 moves to cold
    node.tiers[1] = {**cold, "keep_last": 1}  # 200 now expires from cold, into its trash
    node.write_config()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune"],
        env={**os.environ, "CKPTKEEPER_TEST_CRASH_AFTER": "1"},  # killed once the move aside is journaled
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    with sqlite3.connect(node.index) as db:
        rows = db.execute("SELECT phase, detail FROM journal WHERE done = 0").fetchall()
    assert [phase for phase, _ in rows] == ["moving aside"]
    entry = json.loads(rows[0][1])["entry"]
    # What the killed process would have left: server-side copies of the data keys into the entry,
    # no manifest there (the manifest PUT comes after every copy).
    original = [k for k in s3_keys(s3_client, s3_bucket, "ckpt/r/checkpoint-200") if not k.endswith(".json")]
    data = [k for k in original if "/checkpoint-200/" in k]
    assert len(data) >= 2, original
    for key in data if copied == "all" else data[: len(data) // 2]:
        dest = f"ckpt/{entry}/r/" + key[len("ckpt/r/") :]
        s3_client.copy_object(Bucket=s3_bucket, Key=dest, CopySource={"Bucket": s3_bucket, "Key": key})

    code, out = node.cli_json("prune")
    assert code == 0, out
    assert not s3_keys(s3_client, s3_bucket, f"ckpt/{entry}/"), "the half entry must be removed"
    assert not s3_keys(s3_client, s3_bucket, "ckpt/r/checkpoint-200")  # moved aside again, whole
    code, deleted = node.cli_json("ls", "--deleted")
    assert [(d["step"], d["tier"]) for d in deleted["deleted"]] == [(200, "cold")]
    assert node.cli("undelete", "r", "200")[0] == 0
    restored = tmp_path / "restored"
    assert node.cli("restore", "r", "--step", "200", "--to", str(restored))[0] == 0
    assert digest(restored / "checkpoint-200") == node.originals[200]


def test_undelete_refuses_beside_a_newer_version_written_since(tmp_path: Path) -> None:
    """The run wrote step 200 again after its old copy expired into warm's trash, and the new one
    moved on to cold. Bringing the old one back put two versions of one checkpoint side by side
    (exit 0), after which every prune failed; now it is refused, and nothing changes."""
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    warm.mkdir()
    cold.mkdir()
    tiers = [
        local_tier("hot", tmp_path / "hot", keep_last=1),
        local_tier("warm", warm, keep_last=2, undo_window="1h"),
        local_tier("cold", cold, keep_every=400),
    ]
    node = Node(tmp_path, tiers, [100, 200, 300])
    assert node.cli("prune")[0] == 0  # 200 to warm
    node.add([400])
    assert node.cli("prune")[0] == 0  # 200 expires from warm: into its trash
    assert set(node.trash_entries(warm)) == {200}
    old = node.originals[200]
    node.add([200])  # written again (a job re-run from step 100): a new version at the same place
    node.tiers[2] = local_tier("cold", cold, keep_every=200)  # ... that cold keeps
    node.write_config()
    code, out = node.cli("prune")
    assert code == 0, out
    assert digest(cold / "r" / "checkpoint-200") == node.originals[200] != old

    code, text = node.cli("undelete", "r", "200")
    assert code == 1, text
    assert "r@200 was written again since this copy was deleted" in text
    assert "another version of r/checkpoint-200 is in cold" in text
    assert "stays in the trash of warm" in text
    assert digest(node.trash_entries(warm)[200]) == old  # nothing lost, nothing moved
    assert not (warm / "r" / "checkpoint-200").exists()
    assert digest(cold / "r" / "checkpoint-200") == node.originals[200]
    code, out = node.cli("prune")
    assert code == 0, out


def test_undelete_refuses_while_hot_holds_a_newer_version(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(
        tmp_path,
        [
            local_tier("hot", tmp_path / "hot", keep_last=1),
            local_tier("warm", warm, keep_last=2, undo_window="1h"),
        ],
        [100, 200, 300],
    )
    assert node.cli("prune")[0] == 0
    node.add([400])
    assert node.cli("prune")[0] == 0
    node.add([200])
    assert node.cli("scan")[0] == 0
    code, text = node.cli("undelete", "r", "200")
    assert code == 1 and "another version of r/checkpoint-200 is in hot" in text, text
    assert set(node.trash_entries(warm)) == {200}


def test_no_message_advises_removing_a_copy() -> None:
    """ "… delete it first", followed, deleted the only copy of a version: no message says to
    remove a copy by hand (they say whose copy it is and what removing it loses instead)."""
    import re

    root = Path(__file__).resolve().parents[1] / "ckptkeeper"
    advice = re.compile(r"delete it first|(delete|remove) (it|them) by hand|rm -r", re.IGNORECASE)
    found = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if advice.search(line)
    ]
    assert found == []


def test_only_another_version_blocks_undelete(tmp_path: Path) -> None:
    """A copy of the trashed version itself elsewhere (whole, or found damaged) is no newer
    version: undelete may bring a whole one back beside it. Another version blocks it."""
    from builders import index_checkpoint, manifest

    from ckptkeeper.actions.undo import UndeleteRefused, refuse_beside_newer
    from ckptkeeper.core.model import CheckpointState, FileEntry, TrashEntry

    old = manifest("r", 200, [FileEntry("model.bin", 10, "a" * 16)])
    new = manifest("r", 200, [FileEntry("model.bin", 11, "b" * 16)])
    entry = TrashEntry("warm", ".ckptkeeper-trash/x", "r", 200, "checkpoint-200", 10, 0.0)
    with Index(tmp_path / "i.db") as ix:
        cid = index_checkpoint(ix, "r", 200, version=old.digest)
        ix.set_location(cid, "cold", old.digest)
        ix.mark_damaged(cid, "cold", "data missing")
        refuse_beside_newer(ix, entry, old, 3600.0)  # the same version, damaged: no refusal
        ix.upsert_checkpoint(
            run="r",
            name="checkpoint-200",
            step=200,
            layout="hf",
            state=CheckpointState.COMPLETE,
            created_at=0.0,
            last_write=0.0,
            bytes=11,
            metrics={},
            committed=False,
            version=new.digest,
            manifest_json=None,
            problem=None,
        )
        ix.set_location(cid, "hot", new.digest)
        with pytest.raises(UndeleteRefused, match=f"hot \\(version {new.digest[:12]}\\)"):
            refuse_beside_newer(ix, entry, old, 3600.0)
