"""The optional preflight gate of the Slurm Prolog, on a real Slurm (``tests/slurm_cluster.py``).

With ``CKPTKEEPER_PREFLIGHT=drain``, a node whose quick preflight fails a check (here n1: its hot
tier is asked to keep a million 1 GiB checkpoints) refuses the job the only way a Prolog can: the
Prolog fails, Slurm drains the node and requeues the job; the job then runs on a node whose
preflight passes. Skipped where the Slurm programs are not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from builders import local_tier, write_config
from slurm_cluster import missing_binaries, slurm_cluster

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    bool(missing_binaries()),
    reason=f"Slurm is not installed (missing {', '.join(missing_binaries())}; bash .ci/slurm.sh installs it)",
)


def test_a_failing_preflight_drains_the_node_and_the_job_runs_elsewhere(tmp_path: Path) -> None:
    for node, keep in (("n1", 1_000_000), ("n2", 2)):
        (tmp_path / node / "hot").mkdir(parents=True)
        write_config(
            tmp_path / node / "config.toml",
            index=tmp_path / node / "index.db",
            node=node,
            tiers=[local_tier("hot", tmp_path / node / "hot", keep_last=keep)],
        )
    env_file = tmp_path / "ckptkeeper.env"
    env_file.write_text(
        f"PYTHONPATH={REPO}\n"
        f"CKPTKEEPER='{sys.executable} -m ckptkeeper.cli'\n"
        f"CKPTKEEPER_CONFIG={tmp_path}/$SLURMD_NODENAME/config.toml\n"
        "CKPTKEEPER_PREFLIGHT=drain\n"
        f"CKPTKEEPER_HOOK_LOG={tmp_path}/hooks-stderr.log\n"
    )
    deploy = REPO / "deploy" / "slurm"
    with slurm_cluster(
        tmp_path / "slurm", prolog=deploy / "prolog", epilog=deploy / "epilog", env_file=env_file
    ) as cluster:
        ran = tmp_path / "ran-on"
        job = cluster.sbatch(f'#!/bin/sh\necho "$SLURMD_NODENAME" > {ran}\n', "-w", "n1")
        cluster.wait_hooks(job, "prolog", 1)
        assert cluster.hook_exits(job)[0][:3] == ("prolog", job, "n1")
        assert cluster.hook_exits(job)[0][3] != 0  # the Prolog refused the job
        start = [json.loads(line) for line in (tmp_path / "n1" / "jobs.jsonl").read_text().splitlines()][-1]
        assert (start["event"], start["job"]) == ("start", job)
        assert start["preflight"]["refused"] is True
        assert start["preflight"]["failed"][0].startswith("hot_capacity: needs 1000000 kept")
        # Slurm's answer to a failing Prolog: the node is drained, the job requeued (held).
        drained = cluster.wait_node_state("n1", "drain", "drng")
        assert "Prolog" in drained or "prolog" in drained, drained
        info = cluster.wait(job, "PENDING")
        assert int(info["Restarts"]) >= 1, info
        cluster.run("scontrol", "update", f"JobId={job}", "ReqNodeList=n2")
        cluster.run("scontrol", "release", job)
        cluster.wait(job, "COMPLETED")
        assert ran.read_text().strip() == "n2"
        assert [code for kind, _, node, code in cluster.hook_exits(job) if node == "n2"] == [0, 0]
