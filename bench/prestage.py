"""A requeued job's checkpoint in local hot: the Prolog's pre-stage against restoring at start
(docs/slurm.md).

A run tracked with the hook saved one checkpoint of a realistic small size (a torch DCP
directory of 4 float32 tensors) on another node, and that node's pass copied it to a cold tier on a local moto S3 server.
The job is requeued onto a node whose hot tier holds nothing of it (its own index, the same shared
cold tier). Measured from the job's start (the Prolog is invoked) until the training script's
``ckptkeeper.latest(RUN)`` returns a path in the local hot tier:

- baseline: no Prolog; the script's ``latest()`` restores the checkpoint from cold itself.
- ckptkeeper: ``ckptkeeper job start`` as the Prolog runs it (the Slurm environment given to the
  command; a stub ``scontrol`` answers the job's ``--comment=ckptkeeper:resume=RUN``), then the
  script, whose ``latest()`` finds the pre-staged copy locally.

Both sides start the same script (a Python interpreter importing ckptkeeper), fetch the same bytes
from the same server, alternating A/B on a fresh node each time. A second row is the part of it the
training script itself waits (from its first line to ``latest()`` returning): what the job's own
time budget sees. No Slurm needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import Config, MiB, Row, alternate, median, python_env
from bench.s3_transfer import _AWS_ENV, moto_server

RUN = "resume-run"
STEP = 100
JOB = "4242"

_SAVE = """
import os, sys, torch, ckptkeeper
import torch.distributed.checkpoint as dcp
run_dir, files, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {"layer%d" % i: torch.randn(size // 4) for i in range(files)}
with ckptkeeper.track_run(run_dir) as run:
    path = os.path.join(run_dir, "step-%d" % {step})
    dcp.save(state, checkpoint_id=path, no_dist=True)
    run.commit(path, step={step})
""".replace("{step}", str(STEP))

_SCRIPT = """
import json, os, sys, time
t0 = time.time()
import ckptkeeper
found = ckptkeeper.latest(sys.argv[1])
print(json.dumps({"start": t0, "found": time.time(), "path": str(found)}))
"""


def _config(home: Path, node: str, url: str, bucket: str) -> Path:
    (home / "hot").mkdir(parents=True)
    path = home / "config.toml"
    path.write_text(
        f'index = "{home}/index.db"\nnode = "{node}"\n\n'
        f'[[tiers]]\nname = "hot"\nurl = "{home}/hot"\nkeep_last = 2\n\n'
        f'[[tiers]]\nname = "cold"\nurl = "s3://{bucket}/ckpt"\nreplicate = true\nshared = true\n'
        f'keep_last = 10\nstorage_options = {{ key = "testing", secret = "testing", endpoint_url = "{url}" }}\n'
    )
    path.chmod(0o600)
    return path


def _scontrol(where: Path) -> Path:
    """A stub ``scontrol`` on PATH: the job's fields as ``scontrol -o show job`` prints them."""
    where.mkdir(parents=True, exist_ok=True)
    stub = where / "scontrol"
    stub.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2 $3" = "-o show job" ]; then\n'
        f'  echo "JobId=$4 JobName=train JobState=RUNNING Comment=ckptkeeper:resume={RUN} NodeList=resume"\n'
        "  exit 0\nfi\nexit 1\n"
    )
    stub.chmod(0o755)
    return where


class _Resume:
    def __init__(self, root: Path, url: str, bucket: str, stub_dir: Path, size: int) -> None:
        self.root, self.url, self.bucket, self.stub_dir, self.size = root, url, bucket, stub_dir, size
        self.count = 0
        self.waits: dict[str, list[float]] = {"baseline": [], "ckptkeeper": []}

    def _node(self) -> Path:
        """A fresh node in service (its index exists: its daemon scanned it), untimed."""
        self.count += 1
        config = _config(self.root / f"resume-{self.count}", "resume", self.url, self.bucket)
        cli = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "scan"]
        subprocess.run(cli, env=python_env(), check=True, capture_output=True, timeout=600)
        return config

    def _script(self, config: Path, t0: float, side: str) -> float:
        env = {**python_env(), "CKPTKEEPER_CONFIG": str(config), "SLURM_JOB_ID": JOB}
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, RUN],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        doc = json.loads(done.stdout.strip().splitlines()[-1])
        expected = config.parent / "hot" / RUN / f"step-{STEP}"
        if doc["path"] != str(expected):
            raise RuntimeError(f"{side}: latest() gave {doc['path']}, not {expected}\n{done.stderr[-2000:]}")
        self.waits[side].append(doc["found"] - doc["start"])
        return float(doc["found"]) - t0

    def restore_at_start(self) -> float:
        config = self._node()
        t0 = time.time()
        return self._script(config, t0, "baseline")

    def prestage(self) -> float:
        config = self._node()
        env = {
            "PATH": f"{self.stub_dir}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": python_env()["PYTHONPATH"],
            **_AWS_ENV,
            "CKPTKEEPER_CONFIG": str(config),
            "SLURM_JOB_ID": JOB,
            "SLURMD_NODENAME": "resume",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_RESTART_COUNT": "1",
        }
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "job", "start", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        doc = json.loads(done.stdout)
        if doc["errors"] or [p.get("from_tier") for p in doc["prestaged"]] != ["cold"]:
            raise RuntimeError(f"pre-stage did not fetch from cold: {doc}")
        return self._script(config, t0, "ckptkeeper")


def _seed(root: Path, url: str, bucket: str, files: int, size: int) -> None:
    """The run's checkpoint, saved with the hook on node ``train`` and copied to cold by its pass."""
    config = _config(root / "train", "train", url, bucket)
    env = {**python_env(), "CKPTKEEPER_CONFIG": str(config), "SLURM_JOB_ID": JOB, "SLURMD_NODENAME": "train"}
    subprocess.run(
        [sys.executable, "-c", _SAVE, str(root / "train" / "hot" / RUN), str(files), str(size)],
        env=env,
        check=True,
        timeout=600,
    )
    cli = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config)]
    subprocess.run([*cli, "prune"], env=env, check=True, capture_output=True, timeout=600)
    ls: dict[str, Any] = json.loads(
        subprocess.run(
            [*cli, "ls", RUN, "--json"], env=env, check=True, capture_output=True, timeout=600
        ).stdout
    )
    tiers = {t for c in ls["runs"][0]["checkpoints"] for t in c.get("verified", c.get("tiers", []))}
    if "cold" not in tiers and "cold" not in json.dumps(ls):
        raise RuntimeError(f"the checkpoint did not reach cold: {ls}")


def run(cfg: Config) -> list[Row]:
    import boto3

    files = 4
    size = cfg.pick(64 * MiB, 16 * MiB, 1 * MiB)
    reps = cfg.pick(max(cfg.reps, 5), 3, 1)
    bucket = "prestage"
    with cfg.tempdir(cfg.disk_dir, "prestage") as root, moto_server(root) as url:
        boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        _seed(root, url, bucket, files, size)
        jobs = _Resume(root / "nodes", url, bucket, _scontrol(root / "bin"), size)
        base, ours = alternate(jobs.restore_at_start, jobs.prestage, reps, log=cfg.log)
    ratio = median(base) / median(ours)
    wait_b, wait_o = median(jobs.waits["baseline"]), median(jobs.waits["ckptkeeper"])
    return [
        Row(
            metric=f"requeued job's start → checkpoint in local hot ({files} x {size // MiB} MiB from cold)",
            baseline=median(base),
            ours=median(ours),
            unit="s",
            ratio=ratio,
            target="informational",
            ok=None,
            baseline_label="the script's latest() restores at start",
            note="Prolog `job start` pre-stage, then the script's latest() finds it locally; "
            "same bytes from the same local moto server",
            samples={"baseline": base, "ckptkeeper": ours},
        ),
        Row(
            metric="of which the training script itself waits (its first line → latest() returns)",
            baseline=wait_b,
            ours=wait_o,
            unit="s",
            ratio=wait_b / wait_o,
            target=">= 1.0x",
            ok=wait_b >= wait_o,
            baseline_label="restore inside the script",
            samples=jobs.waits,
        ),
    ]
