"""Real Slurm jobs (two simulated nodes, ``tests/slurm_cluster.py``) whose trainer tracks a run
with the hook; the Prolog/Epilog of ``deploy/slurm/`` call ``ckptkeeper job start|end``.

Each test asserts what a user sees: the run's state and reason (``ckptkeeper ls --json``), what is
left on the node's disk, and that every Prolog and Epilog exited 0 (a failing one drains the node).
Skipped only where the Slurm programs are not installed (``.ci/slurm.sh`` installs them).
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from builders import fleet_node
from slurm_cluster import NODES, SlurmCluster, missing_binaries, slurm_cluster

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    bool(missing_binaries()),
    reason=f"Slurm is not installed (missing {', '.join(missing_binaries())}; bash .ci/slurm.sh installs it)",
)

TRAINER = """\
import os, signal, sys, time
from pathlib import Path
import ckptkeeper

base, run, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
node, job = os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
hot = base / "nodes" / node / "hot"
os.environ["CKPTKEEPER_CONFIG"] = str(base / "nodes" / node / "config.toml")  # this task's node
found = ckptkeeper.latest(run)  # before the first step: what a resuming script finds
(base / f"seen-{job}-{restart}").write_text(str(found or ""))
first = 1 if found is None else int(found.name.split("-")[1].split(".")[0]) + 1
with ckptkeeper.track_run(hot / run) as tracked:
    for step in range(first, first + 3):
        path = hot / run / f"ckpt-{step}.bin"
        path.write_bytes(os.urandom(4096))
        tracked.commit(path, step=step, metrics={"loss": 1.0 / step})
    if mode == "ok" or (mode == "requeue" and restart > 0):
        sys.exit(0)
    # what a save cut short leaves behind
    (hot / run / f"ckpt-{first + 3}.bin.tmp").write_bytes(b"x" * 1000)
    (hot / run / f"tmp-checkpoint-{first + 3}").mkdir()
    (hot / run / f"tmp-checkpoint-{first + 3}" / "shard").write_bytes(b"y" * 1000)
    if mode == "exit3":
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    (base / f"ready-{job}-{restart}").write_text("")
    while True:
        time.sleep(0.2)
"""


DCP_TRAINER = """\
import os, sys, time
from pathlib import Path

# One task per node (srun --ntasks-per-node=1): torch.distributed over gloo on 127.0.0.1, ranks
# from Slurm; each rank saves its shard of a tiny FSDP2 model with torch DCP into its own node's
# hot dir (rank 0 also writes .metadata) and commits it with the hook, as docs/spanning-nodes.md says.
base, run, mode, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
node, job = os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
hot = base / "nodes" / node / "hot"
os.environ["CKPTKEEPER_CONFIG"] = str(base / "nodes" / node / "config.toml")
os.environ.update(
    MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=os.environ["SLURM_PROCID"],
    WORLD_SIZE=os.environ["SLURM_NTASKS"], LOCAL_RANK=os.environ["SLURM_LOCALID"], OMP_NUM_THREADS="1",
)
import ckptkeeper

rank = int(os.environ["RANK"])
found = ckptkeeper.latest(run)  # before the first step: this node's part, found locally
seen = {"path": str(found or ""), "files": sorted(p.name for p in found.iterdir()) if found else []}
(base / f"seen-{job}-{restart}-{rank}").write_text(repr(seen))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first = 1 if found is None else int(found.name.split("-")[1]) + 1
with ckptkeeper.track_run(hot / run) as tracked:  # every rank, every node
    for step in range(first, first + 3):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        path = hot / run / f"step-{step}"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
        tracked.commit(path, step=step)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, base / f"full-{job}-{restart}.pt")  # what the last checkpoint holds
    dist.barrier()
    if mode == "dcp-requeue" and restart > 0:
        dist.destroy_process_group()
        sys.exit(0)
    (hot / run / f"step-{first + 3}.tmp").write_bytes(b"x" * 1000)  # a save cut short
    if mode == "dcp":
        sys.exit(3)
    (base / f"ready-{job}-{restart}-{rank}").write_text("")
    while True:
        time.sleep(0.2)
"""


@dataclass
class Fleet:
    cluster: SlurmCluster
    base: Path
    bucket: str
    time_limit_job: str = ""
    """Submitted when the cluster starts: Slurm's time limits have minutes' grain, checked every
    half minute, so this job runs while the other tests do (its test comes last)."""

    def hot(self, node: str) -> Path:
        return self.base / "nodes" / node / "hot"

    def config(self, node: str) -> Path:
        return self.base / "nodes" / node / "config.toml"

    def submit(
        self,
        run: str,
        mode: str,
        *options: str,
        launcher: str = "",
        trainer: str = "trainer.py",
        extra: str = "",
    ) -> str:
        script = (
            "#!/bin/sh\n"
            f"export PYTHONPATH={REPO}\n"
            f"exec {launcher}{sys.executable} {self.base / trainer} {self.base} {run} {mode} {extra}\n"
        )
        return self.cluster.sbatch(script, "-J", run, *options)

    def ls(self, node: str, run: str) -> dict[str, Any]:
        self.ckptkeeper(node, "scan")
        out = self.ckptkeeper(node, "ls", "--json")
        runs = {r["name"]: r for r in json.loads(out)["runs"]}
        return runs[run]

    def ckptkeeper(self, node: str, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config(node)), *args],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def job_log(self, node: str) -> list[dict[str, Any]]:
        path = self.base / "nodes" / node / "jobs.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_log(self, node: str, job: str, event: str, timeout: float = 90) -> dict[str, Any]:
        """The job log's ``event`` line of ``job`` on ``node`` (the detached pass writes one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for doc in self.job_log(node):
                if doc.get("job") == job and doc.get("event") == event:
                    return doc
            time.sleep(0.1)
        raise TimeoutError(f"no {event} of job {job} in {node}'s job log: {self.job_log(node)}")

    def wait_file(self, path: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} never appeared\n{self.cluster.logs()}")
            time.sleep(0.1)

    def assert_hooks_ok(self, job: str) -> None:
        exits = self.cluster.hook_exits(job)
        assert exits, f"no Prolog/Epilog ran for job {job}"
        assert all(code == 0 for *_, code in exits), exits
        assert not self.cluster.drained()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, s3_server: str) -> Iterator[Fleet]:
    import boto3

    base = tmp_path_factory.mktemp("slurm")
    bucket = "slurm-jobs"
    boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    reaper = {"partial_after": "1h", "failed_after": "2h", "keep_last_of_failed": 1}
    for node in NODES:
        fleet_node(base / "nodes", node, bucket, s3_server, hot_keep_last=1, cold_keep_last=10, reaper=reaper)
    (base / "trainer.py").write_text(TRAINER)
    (base / "dcp_trainer.py").write_text(DCP_TRAINER)
    env_file = base / "ckptkeeper.env"
    env_file.write_text(
        f"PYTHONPATH={REPO}\n"
        f"CKPTKEEPER='{sys.executable} -m ckptkeeper.cli'\n"
        f"CKPTKEEPER_CONFIG={base}/nodes/$SLURMD_NODENAME/config.toml\n"
        "CKPTKEEPER_PRESTAGE_TIMEOUT=60\n"
        f"CKPTKEEPER_HOOK_LOG={base}/hooks-stderr.log\n"
    )
    deploy = REPO / "deploy" / "slurm"
    with slurm_cluster(
        base / "slurm", prolog=deploy / "prolog", epilog=deploy / "epilog", env_file=env_file
    ) as cluster:
        fleet = Fleet(cluster, base, bucket)
        fleet.time_limit_job = fleet.submit("timeout-run", "wait", "-w", "n2", "--time=1")
        yield fleet


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.name != ".ckptkeeper"}


def test_success_leaves_a_finished_run_alone(fleet: Fleet) -> None:
    job = fleet.submit("ok-run", "ok", "-w", "n1")
    fleet.cluster.wait(job, "COMPLETED")
    fleet.cluster.wait_hooks(job, "epilog", 1)
    end = fleet.wait_log("n1", job, "end")
    assert end["outcome"] == "completed"
    assert end["runs"] == [{"run": "ok-run", "action": "leave", "reason": "the run said finished"}]
    assert end["followup_pid"] is None
    run = fleet.ls("n1", "ok-run")
    assert run["state"] == "finished"
    assert _names(fleet.hot("n1") / "ok-run") == {"ckpt-1.bin", "ckpt-2.bin", "ckpt-3.bin"}
    fleet.assert_hooks_ok(job)


def _assert_reaped(fleet: Fleet, node: str, run: str) -> None:
    """The failed run keeps its newest checkpoint; older ones, the temp file and dir are gone."""
    assert _names(fleet.hot(node) / run) == {"ckpt-3.bin"}


def test_exit_code_fails_the_run_and_reaps_now(fleet: Fleet) -> None:
    job = fleet.submit("exit3-run", "exit3", "-w", "n1")
    fleet.cluster.wait(job, "FAILED")
    end = fleet.wait_log("n1", job, "end")
    assert end["outcome"] == "failed"
    assert end["reason"] == f"slurm job {job} on n1: exit code 3"
    done = fleet.wait_log("n1", job, "pass")
    assert done["errors"] == [], done
    run = fleet.ls("n1", "exit3-run")
    assert run["state"] == "failed"
    assert f"slurm job {job} on n1: exit code 3" in run["state_reason"]
    _assert_reaped(fleet, "n1", "exit3-run")
    fleet.assert_hooks_ok(job)


def test_sigkilled_trainer_fails_the_run(fleet: Fleet) -> None:
    job = fleet.submit("kill-run", "kill", "-w", "n2")
    fleet.cluster.wait(job, "FAILED")
    fleet.wait_log("n2", job, "pass")
    run = fleet.ls("n2", "kill-run")
    assert run["state"] == "failed"
    assert f"slurm job {job} on n2: killed by SIGKILL" in run["state_reason"]
    _assert_reaped(fleet, "n2", "kill-run")
    fleet.assert_hooks_ok(job)


def test_scancel_fails_the_run_as_cancelled(fleet: Fleet) -> None:
    job = fleet.submit("cancel-run", "wait", "-w", "n1")
    fleet.wait_file(fleet.base / f"ready-{job}-0")
    fleet.cluster.run("scancel", job)
    fleet.cluster.wait(job, "CANCELLED")
    fleet.wait_log("n1", job, "pass")
    run = fleet.ls("n1", "cancel-run")
    assert run["state"] == "failed"
    assert f"slurm job {job} on n1: cancelled (SIGTERM)" in run["state_reason"]
    _assert_reaped(fleet, "n1", "cancel-run")
    fleet.assert_hooks_ok(job)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _submit_dcp(fleet: Fleet, run: str, mode: str, *options: str) -> str:
    """A 2-node job, one task per node (``srun``), saving a DCP checkpoint spanning both nodes."""
    return fleet.submit(
        run,
        mode,
        "-N",
        "2",
        *options,
        launcher="srun --ntasks-per-node=1 ",
        trainer="dcp_trainer.py",
        extra=str(_free_port()),
    )


PARTS = {"n1": (0, {".metadata", "__0_0.distcp"}), "n2": (1, {"__1_0.distcp"})}
"""Each node's share of a 2-rank DCP checkpoint: rank 0's node also holds the marker."""


def _assert_whole(fleet: Fleet, run: str, step: int, expected: Path, tmp: Path) -> None:
    """The two nodes' parts of ``step``, put together, are the checkpoint the job saved."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    whole = tmp / f"{run}-whole"
    for node in NODES:
        for shard in (fleet.hot(node) / run / f"step-{step}").iterdir():
            whole.mkdir(exist_ok=True)
            (whole / shard.name).write_bytes(shard.read_bytes())
    saved = torch.load(expected)
    state = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(state, checkpoint_id=str(whole), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in saved.items())


def test_dcp_checkpoint_spanning_two_nodes_fails_on_both(fleet: Fleet, tmp_path: Path) -> None:
    job = _submit_dcp(fleet, "span-run", "dcp")
    fleet.cluster.wait(job, "FAILED")
    for node in NODES:
        part, files = PARTS[node]
        fleet.wait_log(node, job, "pass")
        run = fleet.ls(node, "span-run")
        assert run["state"] == "failed"
        assert f"slurm job {job} on {node}: exit code 3" in run["state_reason"]
        assert run["job"]["outcome"] == "failed"
        # Each node keeps its own part of the newest checkpoint; older parts and the save cut
        # short are reaped (keep_last_of_failed = 1).
        assert _names(fleet.hot(node) / "span-run") == {"step-3"}
        assert _names(fleet.hot(node) / "span-run" / "step-3") == files
        newest = [c for c in run["checkpoints"] if c["step"] == 3]
        assert newest and newest[0]["layout"] == "dcp", newest
        assert newest[0]["part"]["index"] == part and newest[0]["part"]["count"] == 2, newest
        assert newest[0]["part"]["job"] == job
    _assert_whole(fleet, "span-run", 3, fleet.base / f"full-{job}-0.pt", tmp_path)
    fleet.assert_hooks_ok(job)
    assert {(k, n) for k, _, n, _ in fleet.cluster.hook_exits(job)} == {
        ("prolog", "n1"),
        ("prolog", "n2"),
        ("epilog", "n1"),
        ("epilog", "n2"),
    }


def test_requeued_dcp_job_prestages_each_nodes_own_part(fleet: Fleet, tmp_path: Path) -> None:
    job = _submit_dcp(fleet, "span-requeue", "dcp-requeue", "--requeue")
    for rank in (0, 1):
        fleet.wait_file(fleet.base / f"ready-{job}-0-{rank}", timeout=120)
    fleet.cluster.run("scontrol", "requeuehold", job)
    fleet.cluster.wait_hooks(job, "epilog", 2)
    for node in NODES:
        end = fleet.wait_log(node, job, "end")
        assert end["outcome"] == "requeued", end
        assert end["runs"] == [
            {"run": "span-requeue", "action": "interrupt", "reason": end["runs"][0]["reason"]}
        ]
        assert "step-3" in _names(fleet.hot(node) / "span-requeue")  # nothing it needs is reaped
    fleet.cluster.run("scontrol", "release", job)
    fleet.cluster.wait(job, "COMPLETED", timeout=180)
    for node in NODES:
        part, files = PARTS[node]
        # Before its first step, each rank found its own node's part in local hot.
        seen = ast.literal_eval((fleet.base / f"seen-{job}-1-{part}").read_text())
        assert seen == {"path": str(fleet.hot(node) / "span-requeue" / "step-3"), "files": sorted(files)}
        start = [d for d in fleet.job_log(node) if d.get("job") == job and d.get("event") == "start"]
        assert start[-1]["errors"] == [], start[-1]
        # Requeued onto the same nodes: each keeps its own part, already in hot (from_tier null).
        assert [(p["step"], p["from_tier"]) for p in start[-1]["prestaged"]] == [(3, None)], start[-1]
        assert fleet.ls(node, "span-requeue")["state"] == "finished"
        assert _names(fleet.hot(node) / "span-requeue") >= {"step-4", "step-5", "step-6"}
    _assert_whole(fleet, "span-requeue", 6, fleet.base / f"full-{job}-1.pt", tmp_path)
    fleet.assert_hooks_ok(job)


def test_requeued_job_resumes_on_the_other_node_from_local_hot(fleet: Fleet) -> None:
    job = fleet.submit("requeue-run", "requeue", "-w", "n1", "--requeue")
    fleet.wait_file(fleet.base / f"ready-{job}-0")
    fleet.cluster.run("scontrol", "requeuehold", job)
    fleet.cluster.wait_hooks(job, "epilog", 1)
    end = fleet.wait_log("n1", job, "end")
    assert end["outcome"] == "requeued"
    assert end["runs"][0]["action"] == "interrupt"
    # Interrupted, not failed: nothing the run needs is reaped (its temp litter waits for the
    # usual partial_after), and its checkpoints went to the shared tier before the Epilog ended.
    assert _names(fleet.hot("n1") / "requeue-run") >= {"ckpt-3.bin", "ckpt-4.bin.tmp", "tmp-checkpoint-4"}
    interrupted = fleet.ls("n1", "requeue-run")
    assert interrupted["state"] == "active"
    assert interrupted["state_reason"].startswith(
        f"interrupted (slurm job {job} on n1: requeued (restart 1), will resume)"
    )
    assert interrupted["job"]["outcome"] == "requeued"
    fleet.cluster.run("scontrol", "update", f"JobId={job}", "NodeList=n2")
    fleet.cluster.run("scontrol", "release", job)
    fleet.cluster.wait(job, "COMPLETED")
    seen = (fleet.base / f"seen-{job}-1").read_text()
    assert seen == str(fleet.hot("n2") / "requeue-run" / "ckpt-3.bin")  # found locally, before step 1
    start = [d for d in fleet.job_log("n2") if d.get("job") == job and d.get("event") == "start"]
    assert start and start[-1]["prestaged"][0]["from_tier"] == "cold", start
    assert fleet.ls("n2", "requeue-run")["state"] == "finished"
    assert _names(fleet.hot("n2") / "requeue-run") >= {"ckpt-4.bin", "ckpt-5.bin", "ckpt-6.bin"}
    fleet.assert_hooks_ok(job)


def test_time_limit_fails_the_run_as_timed_out(fleet: Fleet) -> None:
    job = fleet.time_limit_job
    fleet.cluster.wait(job, "TIMEOUT", timeout=180)
    fleet.wait_log("n2", job, "pass")
    run = fleet.ls("n2", "timeout-run")
    assert run["state"] == "failed"
    assert f"slurm job {job} on n2: time limit reached" in run["state_reason"]
    _assert_reaped(fleet, "n2", "timeout-run")
    fleet.assert_hooks_ok(job)
