"""One clock for cross-node time (docs/design.md, "Cluster reality"; docs/many-nodes-clocks.md).

Real node processes whose wall clock is off (``tests/clockshift/sitecustomize.py`` shifts
``time.time`` and ``datetime.now`` by ``CKPT_TEST_CLOCK_OFFSET`` seconds) while file mtimes and
the S3 server's clock stay real, as on a cluster whose NTP broke on one machine. What is judged
across nodes (a node gone, a lease expired) must not move with that offset: the worst a wrong
clock may cause is a delay, never a delete.
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
from builders import fleet_node, hf_checkpoint, local_tier, run_cli, write_config

from ckptkeeper.core.model import MANIFEST_SUFFIX

CLOCKSHIFT = Path(__file__).parent / "clockshift"
HOUR = 3600.0
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


def test_the_clock_shift_is_real(tmp_path: Path) -> None:
    """The harness itself: the child's clock is off, the files it writes are dated by the kernel."""
    probe = "import time, os; open('f', 'w').close(); print(time.time() - os.stat('f').st_mtime)"
    env = {**os.environ, "PYTHONPATH": str(CLOCKSHIFT), "CKPT_TEST_CLOCK_OFFSET": "7200"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, check=True
    )
    assert 7190 < float(out.stdout) < 7210


def _keys(client: Any, bucket: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def _copies(keys: dict[str, str], node: str) -> list[str]:
    pre = f"ckpt/{node}/exp/"
    return sorted(
        k[len(pre) : -len(MANIFEST_SUFFIX)] for k in keys if k.startswith(pre) and k.endswith(MANIFEST_SUFFIX)
    )


@pytest.mark.parametrize(
    ("offset", "orphan_after"),
    [(2 * HOUR, "1h"), (8 * DAY, None)],
    ids=["holder-2h-ahead", "holder-8d-ahead-default-orphan-after"],
)
def test_a_holder_whose_clock_runs_ahead_never_adopts_a_live_node(
    offset: float, orphan_after: str | None, tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """Node A is alive (it has just passed); node B's clock runs ``offset`` ahead. Judged by B's
    clock, A's heartbeat is older than ``orphan_after``; by the store's, it was written just now."""
    a = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, cold_keep_last=None)
    for step in range(1, 6):
        hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 100)
    done = run_cli(a, "prune")
    assert done.returncode == 0, done.stderr
    before = _keys(s3_client, s3_bucket)
    assert _copies(before, "node-a") == [f"checkpoint-{s}" for s in range(1, 6)]

    b = fleet_node(tmp_path, "node-b", s3_bucket, s3_reset, cold_keep_last=2)
    if orphan_after is not None:
        b.write_text(b.read_text() + f'\n[fleet]\norphan_after = "{orphan_after}"\n')
    dry = run_skewed(b, offset, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["adopted"] == []
    real = run_skewed(b, offset, "prune", "--json")
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["adopted"] == []
    after = _keys(s3_client, s3_bucket)
    assert {k: v for k, v in after.items() if k.startswith("ckpt/node-a/")} == {
        k: v for k, v in before.items() if k.startswith("ckpt/node-a/")
    }
    fleet = run_skewed(b, offset, "fleet", "--json")
    assert fleet.returncode == 0, fleet.stderr
    (tier,) = json.loads(fleet.stdout)["tiers"]
    assert {n["node"]: n["gone"] for n in tier["nodes"]}["node-a"] is False


def _shared_hot_node(base: Path, name: str, hot: Path, lease_ttl: str) -> Path:
    """A keeper of the shared hot dir ``hot`` (its lease in the filesystem), with a warm tier of its own."""
    own = base / name
    (own / "warm").mkdir(parents=True, exist_ok=True)
    return write_config(
        own / "config.toml",
        index=own / "index.db",
        node=name,
        fleet={"lease_ttl": lease_ttl},
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": "", "retention_interval": "2s"},
        tiers=[
            local_tier("hot", hot, keep_last=1, shared=True),
            local_tier("warm", own / "warm", replicate=True),
        ],
    )


def _catalogs_only(doc: dict[str, Any]) -> bool:
    return any(n.startswith("hot is shared:") and n.endswith("this node only catalogs") for n in doc["notes"])


def test_a_dead_lease_holder_whose_clock_ran_ahead_blocks_others_for_one_ttl(tmp_path: Path) -> None:
    """Node A's clock runs 2 h ahead; it takes the shared hot dir's lease (TTL 5 s) and dies. Node
    B, its clock right, takes over once the filesystem has seen 5 s go by, not 2 h later."""
    hot = tmp_path / "shared-hot"
    for step in (100, 200):
        hf_checkpoint(hot / "exp", step, os.urandom(5000))
    a = _shared_hot_node(tmp_path, "node-a", hot, "5s")
    b = _shared_hot_node(tmp_path, "node-b", hot, "5s")
    first = run_skewed(a, 2 * HOUR, "prune", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["result"]["done"]  # A acted: it holds the lease (and "dies")
    hf_checkpoint(hot / "exp", 300, os.urandom(5000))
    time.sleep(6.0)  # the lease's TTL, as the filesystem's clock counts it
    second = run_cli(b, "prune", "--json")
    assert second.returncode == 0, second.stderr
    doc = json.loads(second.stdout)
    assert not _catalogs_only(doc), doc["notes"]
    assert doc["result"]["done"], doc  # B acts: 200 copied and gone from hot


def test_a_live_lease_holder_whose_clock_runs_behind_is_not_taken_over(tmp_path: Path) -> None:
    """Node A's clock runs 2 h behind; it holds the shared hot dir's lease (TTL 10 min). Node B,
    its clock right, must not think that lease expired 2 h ago: two keepers would act at once."""
    hot = tmp_path / "shared-hot"
    for step in (100, 200):
        hf_checkpoint(hot / "exp", step, os.urandom(5000))
    a = _shared_hot_node(tmp_path, "node-a", hot, "10m")
    b = _shared_hot_node(tmp_path, "node-b", hot, "10m")
    first = run_skewed(a, -2 * HOUR, "prune", "--json")
    assert first.returncode == 0, first.stderr
    hf_checkpoint(hot / "exp", 300, os.urandom(5000))
    second = run_cli(b, "prune", "--json")
    assert second.returncode == 0, second.stderr
    doc = json.loads(second.stdout)
    assert _catalogs_only(doc), doc["notes"]
    assert doc["actions"] == [] and not doc["result"]["done"]


def test_status_warns_of_a_clock_off_from_the_store(tmp_path: Path, s3_bucket: str, s3_reset: str) -> None:
    """``status`` measures this node's clock against the shared bucket's (as ``preflight`` does)."""
    cfg = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset)
    skewed = run_skewed(cfg, 2 * HOUR, "status", "--json")
    assert skewed.returncode == 0, skewed.stderr
    (warning,) = [w for w in json.loads(skewed.stdout)["warnings"] if w.startswith("cold: node clock")]
    assert warning.startswith("cold: node clock 720") and "s ahead of the store" in warning, warning
    fine = run_cli(cfg, "status", "--json")
    assert fine.returncode == 0, fine.stderr
    assert not [w for w in json.loads(fine.stdout)["warnings"] if "clock" in w]
