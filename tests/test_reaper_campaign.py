"""The reaper on a realistic campaign (issue 4): every wasted byte reclaimed and reported, nothing
a user needs touched.

The node: a finished run with a stray ``tmp-checkpoint-*``; a failed run (marked by the hook) with
a partial checkpoint; a crashed run with no hook (torch DCP layout, a partial without
``.metadata``, an Orbax tmp dir, symlinks pointing outside the root); a live run whose writer is
still appending; an abandoned multipart upload in the cold S3 tier.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.hook.protocol import INDEX_RECORD_PREFIX

HOUR = 3600.0


def age(path: Path, when: float) -> None:
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        os.utime(p, (when, when), follow_symlinks=False)


def hf_checkpoint(run: Path, step: int, when: float) -> Path:
    ckpt = run / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "pytorch_model.bin").write_bytes(os.urandom(20_000 + step))
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"global_step": step, "log_history": [{"step": step, "loss": 1.0}]})
    )
    age(ckpt, when)
    return ckpt


def dcp_checkpoint(run: Path, step: int, when: float, *, complete: bool = True) -> Path:
    ckpt = run / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(30_000))
    (ckpt / "__1_0.distcp").write_bytes(os.urandom(30_000))
    (ckpt / (".metadata" if complete else ".metadata.tmp")).write_bytes(os.urandom(1_000))
    age(ckpt, when)
    return ckpt


def hook_state(run: Path, state: str, *, pid: int | None = None) -> None:
    control = run / ".ckptkeeper"
    control.mkdir(parents=True, exist_ok=True)
    import socket

    (control / "run.json").write_text(
        json.dumps(
            {
                "version": 1,
                "name": run.name,
                "state": state,
                "host": socket.gethostname(),
                "pid": pid,
                "started": time.time() - 10 * HOUR,
                "ended": None if state == "active" else time.time() - 3 * HOUR,
                "reason": "RuntimeError: NCCL timeout" if state == "failed" else None,
                "parent": None,
            }
        )
    )
    (control / "heartbeat").touch()


def regular_bytes(root: Path, *, excluding: Path | None = None) -> int:
    """Bytes of the regular files under ``root``, in one walk that skips ``excluding`` (measuring
    the live run in a second walk raced its writer: it grew 1024 bytes between the two walks) and
    ckptkeeper's own index record in the root (written by the first real prune: not waste)."""
    return sum(
        p.lstat().st_size
        for p in root.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and (excluding is None or excluding not in p.parents)
        and not (p.parent == root and p.name.startswith(INDEX_RECORD_PREFIX))
    )


def snapshot_files(root: Path) -> dict[str, tuple[int, float]]:
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


class Campaign:
    def __init__(self, tmp: Path, endpoint: str, bucket: str, client: Any) -> None:
        now = time.time()
        self.hot = tmp / "hot"
        self.outside = tmp / "outside"
        self.outside.mkdir()
        (self.outside / "precious.bin").write_bytes(os.urandom(50_000))
        self.expected_reaps: set[str] = set()

        finished = self.hot / "finished-run"
        for i, step in enumerate((100, 200, 300)):
            hf_checkpoint(finished, step, now - (10 - i) * HOUR)
        stray = finished / "tmp-checkpoint-400"
        stray.mkdir()
        (stray / "pytorch_model.bin").write_bytes(os.urandom(25_000))
        age(stray, now - 6 * HOUR)
        hook_state(finished, "finished")
        self.expected_reaps.add("finished-run/tmp-checkpoint-400")

        failed = self.hot / "failed-run"
        for i, step in enumerate((100, 200, 300)):
            hf_checkpoint(failed, step, now - (9 - i) * HOUR)
        partial = failed / "checkpoint-400"
        partial.mkdir()
        (partial / "pytorch_model.bin").write_bytes(os.urandom(12_000))  # no trainer_state.json
        age(partial, now - 5 * HOUR)
        hook_state(failed, "failed")
        self.expected_reaps |= {
            "failed-run/checkpoint-100",
            "failed-run/checkpoint-200",
            "failed-run/checkpoint-400",
        }

        crashed = self.hot / "crashed-run"
        doomed = dcp_checkpoint(crashed, 100, now - 9 * HOUR)
        (doomed / "escape").symlink_to(self.outside)  # a planted link: removing it must not follow it
        age(doomed, now - 9 * HOUR)
        dcp_checkpoint(crashed, 200, now - 8 * HOUR)
        dcp_checkpoint(crashed, 300, now - 7 * HOUR, complete=False)
        orbax_tmp = crashed / "400.orbax-checkpoint-tmp-1700000000"
        (orbax_tmp / "default").mkdir(parents=True)
        (orbax_tmp / "default" / "array").write_bytes(os.urandom(15_000))
        age(orbax_tmp, now - 7 * HOUR)
        (crashed / "outside-link").symlink_to(self.outside / "precious.bin")
        os.utime(crashed, (now - 7 * HOUR, now - 7 * HOUR))
        self.expected_reaps |= {
            "crashed-run/step_100",
            "crashed-run/step_300",
            "crashed-run/400.orbax-checkpoint-tmp-1700000000",
        }

        self.live = self.hot / "live-run"
        for i, step in enumerate((100, 200)):
            hf_checkpoint(self.live, step, now - (2 - i) * 60)
        hook_state(self.live, "active", pid=os.getpid())
        self.growing = self.live / "checkpoint-300" / "pytorch_model.bin"
        self.growing.parent.mkdir()
        self.growing.write_bytes(b"")

        # An abandoned multipart upload under the cold tier's prefix (and one outside it).
        client.create_multipart_upload(Bucket=bucket, Key="ckpt/failed-run/checkpoint-400/pytorch_model.bin")
        client.create_multipart_upload(Bucket=bucket, Key="other-team/upload.bin")
        self.client = client
        self.bucket = bucket

        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot), s3_tier("cold", bucket, endpoint)],
            reaper={"failed_after": "2h", "partial_after": "3s", "keep_last_of_failed": 1},
        )

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.output


@pytest.fixture
def campaign(tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any) -> Iterator[Campaign]:
    c = Campaign(tmp_path, s3_server, s3_bucket, s3_client)
    stop = threading.Event()

    def writer() -> None:  # the live trainer, still appending to its next checkpoint
        with c.growing.open("ab") as f:
            while not stop.is_set():
                f.write(os.urandom(1024))
                f.flush()
                time.sleep(0.05)

    thread = threading.Thread(target=writer, name="live-writer")
    thread.start()
    time.sleep(3.5)  # the multipart upload is now older than partial_after
    try:
        yield c
    finally:
        stop.set()
        thread.join()


def test_campaign_reaps_exactly_the_waste_and_reports_the_bytes(campaign: Campaign) -> None:
    c = campaign
    outside_before = snapshot_files(c.outside)
    code, out = c.cli("prune", "--dry-run", "--json")
    assert code == 0, out
    plan = json.loads(out)
    reaps = [a for a in plan["actions"] if a["action"] == "reap"]
    assert [a for a in plan["actions"] if a["action"] != "reap"] == []
    hot_reaps = {a["path"] for a in reaps if a["tier"] == "hot"}
    assert hot_reaps == c.expected_reaps
    uploads = [a for a in reaps if a["tier"] == "cold"]
    assert len(uploads) == 1 and uploads[0]["path"] == "failed-run/checkpoint-400/pytorch_model.bin"
    for a in reaps:
        assert a["reason"] and a["bytes"] >= 0
    summary = plan["reap_summary"]
    assert set(summary["by_run"]) >= {"finished-run", "failed-run", "crashed-run"}
    assert "live-run" not in summary["by_run"]
    assert summary["total"] == sum(a["bytes"] for a in reaps)
    reported_hot = sum(a["bytes"] for a in reaps if a["tier"] == "hot")

    live_before = {k: v for k, v in snapshot_files(c.live).items() if "checkpoint-300" not in k}
    before = regular_bytes(c.hot, excluding=c.live)
    code, out = c.cli("prune")
    assert code == 0, out
    after = regular_bytes(c.hot, excluding=c.live)
    assert before - after == reported_hot

    # Nothing outside the root, nothing of the live run, no newest checkpoint was touched.
    assert snapshot_files(c.outside) == outside_before
    assert {k: v for k, v in snapshot_files(c.live).items() if "checkpoint-300" not in k} == live_before
    assert (c.live / "checkpoint-300").is_dir()
    assert (c.hot / "crashed-run" / "step_200" / ".metadata").is_file()
    assert (c.hot / "failed-run" / "checkpoint-300" / "trainer_state.json").is_file()
    assert sorted(p.name for p in (c.hot / "finished-run").iterdir() if not p.name.startswith(".")) == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    ]
    assert (c.hot / "crashed-run" / "outside-link").is_symlink()
    assert not (c.hot / "crashed-run" / "step_100").exists()

    # The abandoned upload under our prefix is aborted; another team's upload is left alone.
    keys = [u["Key"] for u in c.client.list_multipart_uploads(Bucket=c.bucket).get("Uploads", [])]
    assert keys == ["other-team/upload.bin"]

    # The headline number is kept in the index and shown by status.
    code, out = c.cli("status", "--json")
    assert code == 0
    status = json.loads(out)
    assert status["reclaimed"]["total_bytes"] >= reported_hot

    # A second pass finds nothing more to reap.
    code, out = c.cli("prune", "--dry-run", "--json")
    assert [a for a in json.loads(out)["actions"] if a["action"] == "reap"] == []
