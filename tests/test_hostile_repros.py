"""The exact reproductions of issue #13 items 2 and 3, through the real CLI (subprocesses) and the
real daemon, against a moto S3 bucket: hostile documents are quarantined with a reason, and
retention goes on everywhere else.

Before the fix each of these died with a traceback (``OverflowError``, SQLite ``IntegrityError``)
in ``scan`` and ``prune``, and the daemon exited 1 at start, so hot was never pruned again.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from builders import FAST_DAEMON, local_tier, s3_tier, write_config

from ckptkeeper.core.model import MANIFEST_SUFFIX

HOSTILE_MANIFEST_FIELDS = {
    "step-1e400": ('"step": 7', '"step": 1e400'),
    "step-10e30": ('"step": 7', f'"step": {10**30}'),
    "size-2e70": ('"size": 3', f'"size": {2**70}'),
    "size-1e400": ('"size": 3', '"size": 1e400'),
    "created-nan": ('"created_at": 1700000000.0', '"created_at": NaN'),
}


def hostile_manifests(s3_client: Any, bucket: str) -> list[str]:
    """One copy per reproduction of item 2 under ``ckpt/evil-<case>/checkpoint-7``; their keys."""
    keys = []
    for case, (good, bad) in HOSTILE_MANIFEST_FIELDS.items():
        run = f"evil-{case}"
        doc = {
            "version": 1,
            "run": run,
            "step": 7,
            "name": "checkpoint-7",
            "layout": "hf",
            "is_dir": True,
            "created_at": 1700000000.0,
            "node": "other-node",
            "metrics": {},
            "files": [{"path": "model.bin", "size": 3, "hash": "0" * 32}],
        }
        text = json.dumps(doc)
        assert good in text, (good, text)
        s3_client.put_object(Bucket=bucket, Key=f"ckpt/{run}/checkpoint-7/model.bin", Body=b"abc")
        key = f"ckpt/{run}/checkpoint-7{MANIFEST_SUFFIX}"
        s3_client.put_object(Bucket=bucket, Key=key, Body=text.replace(good, bad).encode())
        keys.append(key)
    return keys


def hf(run: Path, step: int) -> Path:
    """A small, complete Hugging Face Trainer checkpoint."""
    ckpt = run / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(800)
    header = json.dumps({"w": {"dtype": "F32", "shape": [200], "data_offsets": [0, 800]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(300))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return ckpt


def keys_of(s3_client: Any, bucket: str) -> set[str]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def age(root: Path, seconds: float = 600.0) -> None:
    when = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (*dirnames, *filenames):
            os.utime(os.path.join(dirpath, n), (when, when), follow_symlinks=False)


def hot_steps(hot: Path, run: str) -> set[int]:
    """Steps of the HF checkpoints in hot; a delete's staging name (``checkpoint-2.ckptkeeper-tmp-…``,
    there for an instant while the daemon prunes) is not a checkpoint (it once failed this poll)."""
    return {
        int(p.name.split("-")[1]) for p in (hot / run).glob("checkpoint-*") if p.name.split("-")[1].isdigit()
    }


def test_hostile_manifests_in_a_shared_bucket_are_quarantined_and_hot_is_still_pruned(
    tmp_path: Path, s3_server: str, s3_client: Any, s3_bucket: str
) -> None:
    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        hf(hot / "r", step)
    age(hot)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "metrics_addr": "", "trust_mtimes": True},
        tiers=[local_tier("hot", hot, keep_last=1), s3_tier("cold", s3_bucket, s3_server, keep_last=5)],
    )
    evil = hostile_manifests(s3_client, s3_bucket)
    for args in (("scan",), ("prune",), ("ls", "--json"), ("status", "--json"), ("scan",)):
        result = cli(config, *args)
        assert result.returncode == 0, (args, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    assert hot_steps(hot, "r") == {3}  # retention ran: 1 and 2 moved to cold
    keys = keys_of(s3_client, s3_bucket)
    assert set(evil) <= keys  # never deleted: not ours to judge
    assert {f"ckpt/r/checkpoint-{s}{MANIFEST_SUFFIX}" for s in (1, 2)} <= keys
    status = json.loads(cli(config, "status", "--json").stdout)
    reasons = {q["path"]: q["reason"] for q in status["quarantined"] if q["kind"] == "manifest"}
    assert set(reasons) == {k.removeprefix("ckpt/") for k in evil}, status["quarantined"]
    for case, field in (
        ("step-1e400", "step"),
        ("step-10e30", "step"),
        ("size-2e70", "size"),
        ("size-1e400", "size"),
        ("created-nan", "created_at"),
    ):
        assert field in reasons[f"evil-{case}/checkpoint-7{MANIFEST_SUFFIX}"], reasons
    text = cli(config, "ls").stdout
    assert "quarantined manifest cold:evil-step-1e400/checkpoint-7" in text, text
    assert "quarantined: 5 document(s)" in cli(config, "status").stdout


def test_out_of_range_run_json_is_quarantined_and_other_runs_are_pruned(tmp_path: Path) -> None:
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    warm.mkdir()
    for run in ("good", "bad"):
        for step in (1, 2, 3):
            hf(hot / run, step)
    (hot / "bad" / ".ckptkeeper").mkdir()
    (hot / "bad" / ".ckptkeeper" / "run.json").write_text(
        f'{{"version": 1, "state": "active", "host": "elsewhere", "pid": {2**70}, "started": 1.7e9, '
        f'"parent": {{"run": "good", "step": {10**30}}}}}'
    )
    age(hot)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "metrics_addr": "", "trust_mtimes": True},
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=5)],
    )
    for args in (("scan",), ("prune",), ("ls", "--json"), ("status", "--json")):
        result = cli(config, *args)
        assert result.returncode == 0, (args, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    assert hot_steps(hot, "good") == {3} and hot_steps(hot, "bad") == {3}  # both runs pruned
    assert {p.name for p in (warm / "bad").iterdir() if p.is_dir()} == {"checkpoint-1", "checkpoint-2"}
    listing = json.loads(cli(config, "ls", "--json", "bad").stdout)
    (run,) = listing["runs"]
    assert run["parent"] is None  # the out-of-range parent is not believed
    (q,) = run["quarantined"]
    assert q["kind"] == "run.json" and "pid" in q["reason"] and "step" in q["reason"], q


def test_daemon_starts_and_keeps_pruning_hot_despite_a_hostile_manifest_in_the_bucket(
    tmp_path: Path, s3_server: str, s3_client: Any, s3_bucket: str
) -> None:
    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        hf(hot / "r", step)
    age(hot)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        # Retention every second; no reap job contending for the executor and S3 sessions.
        daemon={**FAST_DAEMON, "reap_interval": "1h"},
        tiers=[local_tier("hot", hot, keep_last=1), s3_tier("cold", s3_bucket, s3_server, keep_last=5)],
    )
    evil = hostile_manifests(s3_client, s3_bucket)
    log_path = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "NOTIFY_SOCKET"))}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "daemon"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_for(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"daemon exited {proc.returncode}: " + log_path.read_text()[-3000:]
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"{what}: " + log_path.read_text()[-3000:])

    try:
        wait_for(lambda: hot_steps(hot, "r") == {3}, "hot never pruned to its newest checkpoint")
        hf(hot / "r", 4)  # a new checkpoint while it runs: the next passes prune again
        age(hot / "r" / "checkpoint-4", 5.0)
        wait_for(lambda: hot_steps(hot, "r") == {4}, "hot not pruned again after a new checkpoint")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "manifest in tier quarantined" in text
    keys = keys_of(s3_client, s3_bucket)
    assert set(evil) <= keys
    assert {f"ckpt/r/checkpoint-{s}{MANIFEST_SUFFIX}" for s in (1, 2, 3)} <= keys
    status = json.loads(cli(config, "status", "--json").stdout)
    assert len([q for q in status["quarantined"] if q["kind"] == "manifest"]) == len(evil)
