"""``ckptkeeper job start|end`` in a Slurm-like hook environment, without Slurm: what the Epilog's
variables and the controller's word mean, and that a hook always exits 0 quickly, whatever it is
given. The same commands under a real Slurm: ``tests/test_slurm_jobs.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import local_tier, s3_tier, write_config

from ckptkeeper.core.jobs import JobEvent, judge_run, outcome, parse_scontrol, slurm_event

REPO = Path(__file__).resolve().parent.parent


def _event(**env: str) -> JobEvent:
    base = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "1"}
    event = slurm_event({**base, **env})
    assert event is not None
    return event


@pytest.mark.parametrize(
    ("env", "ctl", "kind", "text"),
    [
        (
            {"SLURM_JOB_EXIT_CODE": "0", "SLURM_JOB_EXIT_CODE2": "0:0"},
            {"ExitCode": "0:0"},
            "completed",
            "completed (exit code 0)",
        ),
        ({"SLURM_JOB_EXIT_CODE": "768", "SLURM_JOB_EXIT_CODE2": "3:0"}, {}, "failed", "exit code 3"),
        ({"SLURM_JOB_EXIT_CODE": "9", "SLURM_JOB_EXIT_CODE2": "0:9"}, {}, "failed", "killed by SIGKILL"),
        # scancel: the Epilog's variables say 0:0, the controller's ExitCode the signal
        (
            {"SLURM_JOB_EXIT_CODE": "0"},
            {"JobState": "COMPLETING", "ExitCode": "0:15"},
            "cancelled",
            "cancelled (SIGTERM)",
        ),
        (
            {"SLURM_JOB_EXIT_CODE": "0"},
            {"Reason": "TimeLimit", "ExitCode": "0:15"},
            "timeout",
            "time limit reached",
        ),
        (
            {"SLURM_JOB_EXIT_CODE": "0", "SLURM_JOB_DERIVED_EC": "1:0"},
            {},
            "failed",
            "a job step failed (exit code 1)",
        ),
        ({}, None, "unknown", "ended (exit status unknown)"),
    ],
)
def test_outcome_from_the_epilog_and_the_controller(
    env: dict[str, str], ctl: dict[str, str] | None, kind: str, text: str
) -> None:
    end = outcome(_event(**env), ctl)
    assert (end.kind, end.text) == (kind, f"slurm job 42 on n1: {text}")


def test_a_restart_count_above_the_starts_is_a_requeue() -> None:
    end = outcome(_event(SLURM_JOB_RESTART_COUNT="1", SLURM_JOB_EXIT_CODE="0"), {}, restarts_at_start=0)
    assert end.kind == "requeued"
    assert judge_run("active", None, end).action == "interrupt"
    assert outcome(_event(SLURM_JOB_RESTART_COUNT="1"), {}, restarts_at_start=1).kind != "requeued"


def test_what_the_end_means_for_each_run() -> None:
    failed = outcome(_event(SLURM_JOB_EXIT_CODE="768"), {})
    assert judge_run("finished", None, failed).action == "leave"
    assert judge_run("active", None, failed).reason == "slurm job 42 on n1: exit code 3"
    note = judge_run("failed", "SystemExit: 3", failed)
    assert (note.action, note.reason) == ("note", "SystemExit: 3 (slurm job 42 on n1: exit code 3)")
    ok = outcome(_event(SLURM_JOB_EXIT_CODE="0"), {})
    assert judge_run("active", None, ok).reason.endswith("but the run never said finished")


def test_scontrol_line_with_spaces_in_values() -> None:
    fields = parse_scontrol("JobId=7 JobName=x JobState=TIMEOUT Reason=TimeLimit Comment=a b c ExitCode=0:15")
    assert fields["JobState"] == "TIMEOUT"
    assert fields["Comment"] == "a b c"
    assert fields["ExitCode"] == "0:15"


def _hook(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A hook's environment: no PATH, HOME or USER, only what Slurm and the defaults file give."""
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", *args],
        env={"PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _node(tmp_path: Path) -> Path:
    (tmp_path / "hot").mkdir()
    return write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        node="n1",
        tiers=[local_tier("hot", tmp_path / "hot", keep_last=1)],
        reaper={"partial_after": "1h", "failed_after": "2h", "keep_last_of_failed": 1},
    )


@pytest.mark.parametrize("command", ["start", "end"])
def test_hooks_exit_0_whatever_goes_wrong(tmp_path: Path, command: str) -> None:
    config = _node(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("tiers = 3\n")
    bad.chmod(0o600)
    for args, env in (
        (["--config", str(config), "job", command], {}),  # not in a job
        (["--config", str(bad), "job", command], {"SLURM_JOB_ID": "5"}),  # a bad config
        (["--config", str(tmp_path / "none.toml"), "job", command], {"SLURM_JOB_ID": "5"}),
        (["--config", str(config), "job", command], {"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "n1"}),
    ):
        done = _hook(args, env)
        assert done.returncode == 0, (args, env, done.stderr)


def test_job_end_fails_the_jobs_active_run_and_reaps_it(tmp_path: Path) -> None:
    config = _node(tmp_path)
    run = tmp_path / "hot" / "r"
    trainer = (
        "import os, signal, ckptkeeper\n"
        f"t = ckptkeeper.track_run({str(run)!r})\n"
        "for s in (1, 2):\n"
        f"    p = os.path.join({str(run)!r}, f'ckpt-{{s}}.bin'); open(p, 'wb').write(b'x' * 100)\n"
        "    t.commit(p, step=s)\n"
        f"open(os.path.join({str(run)!r}, 'ckpt-3.bin.tmp'), 'wb').write(b'y')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1"}
    subprocess.run(
        [sys.executable, "-c", trainer], env={**os.environ, "PYTHONPATH": str(REPO), **env}, check=False
    )
    doc = json.loads((run / ".ckptkeeper" / "run.json").read_text())
    assert doc["state"] == "active"
    assert doc["scheduler_job"] == {"scheduler": "slurm", "id": "77", "restarts": 0, "node": "n1"}

    done = _hook(
        ["--config", str(config), "job", "end", "--json"],
        {**env, "SLURM_JOB_EXIT_CODE": "9", "SLURM_JOB_EXIT_CODE2": "0:9", "SLURM_JOB_RESTART_COUNT": "0"},
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["runs"] == [
        {"run": "r", "action": "fail", "reason": "slurm job 77 on n1: killed by SIGKILL"}
    ]
    doc = json.loads((run / ".ckptkeeper" / "run.json").read_text())
    assert (doc["state"], doc["reason"]) == ("failed", "slurm job 77 on n1: killed by SIGKILL")
    assert doc["job_end"]["outcome"] == "failed"
    # The detached pass: wait for its line in the job log (it writes one when done).
    log = tmp_path / "jobs.jsonl"
    _wait_gone(report["followup_pid"])
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["end", "pass"]
    assert lines[1]["errors"] == []
    assert sorted(p.name for p in run.iterdir()) == [".ckptkeeper", "ckpt-2.bin"]

    ls = json.loads(_hook(["--config", str(config), "ls", "--json"], {}).stdout)
    (shown,) = ls["runs"]
    assert shown["state"] == "failed"
    assert shown["state_reason"] == "hook marked run failed: slurm job 77 on n1: killed by SIGKILL"
    assert shown["job"] == {
        "scheduler": "slurm",
        "id": "77",
        "node": "n1",
        "outcome": "failed",
        "reason": "slurm job 77 on n1: killed by SIGKILL",
    }
    status = json.loads(_hook(["--config", str(config), "status", "--json"], {}).stdout)
    assert status["scheduler_jobs"]["calls"] == 2
    # No controller here to ask (a real Slurm answers: tests/test_slurm_jobs.py): counted, not fatal.
    assert status["scheduler_jobs"]["with_errors"] == 1
    assert status["scheduler_jobs"]["last_error"].startswith("end 77: scontrol")
    assert status["scheduler_jobs"]["last_end"]["outcome"] == "failed"


def _wait_gone(pid: int) -> None:
    """Until the detached pass (not our child) has exited: its pidfd becomes readable."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], 120)
        assert ready, f"the pass {pid} still runs"
    finally:
        os.close(fd)


def test_prefetch_brings_the_latest_verified_checkpoint_back_to_hot(tmp_path: Path) -> None:
    (tmp_path / "hot").mkdir()
    (tmp_path / "warm").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        node="n1",
        tiers=[
            local_tier("hot", tmp_path / "hot", keep_last=2),
            local_tier("warm", tmp_path / "warm", keep_last=5, replicate=True),
        ],
    )
    run = tmp_path / "hot" / "r"
    trainer = (
        "import os, ckptkeeper\n"
        f"with ckptkeeper.track_run({str(run)!r}) as t:\n"
        "    for s in (1, 2):\n"
        f"        p = os.path.join({str(run)!r}, f'ckpt-{{s}}.bin'); open(p, 'wb').write(bytes([s]) * 100)\n"
        "        t.commit(p, step=s)\n"
    )
    subprocess.run([sys.executable, "-c", trainer], env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert _hook(["--config", str(config), "prune"], {}).returncode == 0
    for p in run.glob("ckpt-*.bin"):  # the node's NVMe lost them (or the job lands on another node)
        p.unlink()
    done = _hook(["--config", str(config), "prefetch", "r", "--json"], {})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["step"], got["from_tier"]) == (2, "warm")
    assert (run / "ckpt-2.bin").read_bytes() == bytes([2]) * 100
    again = json.loads(_hook(["--config", str(config), "prefetch", "r", "--json"], {}).stdout)
    assert again["from_tier"] is None  # already in hot: nothing copied
    missing = _hook(["--config", str(config), "prefetch", "nope"], {})
    assert missing.returncode == 1
    assert "nope" in missing.stderr


@pytest.mark.parametrize("indexed", [True, False], ids=["node-with-index", "node-without-index"])
def test_a_prestaged_copy_on_another_node_is_what_the_jobs_latest_finds(
    tmp_path: Path, s3_server: str, indexed: bool
) -> None:
    """The job lands on a node that never held the run: the Prolog's pre-stage fetches it from the
    shared cold tier, and the training script's ``latest()`` right after (well within the default
    settle_seconds, by ctime) finds that local copy, not nothing."""
    import boto3

    bucket = f"prestage-{int(indexed)}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    configs = {}
    for node in ("train", "resume"):
        (tmp_path / node / "hot").mkdir(parents=True)
        configs[node] = write_config(
            tmp_path / node / "config.toml",
            index=tmp_path / node / "index.db",
            node=node,
            tiers=[
                local_tier("hot", tmp_path / node / "hot", keep_last=2),
                s3_tier("cold", bucket, s3_server, replicate=True, keep_last=5) | {"shared": True},
            ],
        )
    run = tmp_path / "train" / "hot" / "r"
    trainer = (
        "import os, ckptkeeper\n"
        f"with ckptkeeper.track_run({str(run)!r}) as t:\n"
        "    for s in (1, 2):\n"
        f"        p = os.path.join({str(run)!r}, f'ckpt-{{s}}.bin'); open(p, 'wb').write(bytes([s]) * 100)\n"
        "        t.commit(p, step=s)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", trainer], env=env, check=True)
    assert _hook(["--config", str(configs["train"]), "prune"], env).returncode == 0
    if indexed:  # a node in service: its daemon built its index
        assert _hook(["--config", str(configs["resume"]), "scan"], env).returncode == 0
    done = _hook(["--config", str(configs["resume"]), "prefetch", "r", "--json"], env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    local = tmp_path / "resume" / "hot" / "r" / "ckpt-2.bin"
    assert (got["step"], got["from_tier"], got["path"]) == (2, "cold", str(local))
    script = "import ckptkeeper; print(ckptkeeper.latest('r'))"
    for _ in range(2):  # and again: a call's own look at the run dir keeps it found
        found = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, "CKPTKEEPER_CONFIG": str(configs["resume"])},
            capture_output=True,
            text=True,
            check=True,
        )
        assert found.stdout.strip() == str(local), found.stderr
    assert local.read_bytes() == bytes([2]) * 100


@pytest.mark.parametrize(
    ("gate", "keep_last", "prolog_exit", "status", "refused"),
    [
        ("off", 1_000_000, 0, None, None),
        ("check", 1_000_000, 0, "fail", False),
        ("drain", 1_000_000, 1, "fail", True),
        ("drain", 2, 0, "warn", False),  # warnings (no slower tier) never refuse
    ],
)
def test_the_prolog_fails_only_when_told_to_drain_on_a_failing_preflight(
    tmp_path: Path, gate: str, keep_last: int, prolog_exit: int, status: str | None, refused: bool | None
) -> None:
    """The shipped Prolog with ``CKPTKEEPER_PREFLIGHT``: a hot tier asked to keep a million 1 GiB
    checkpoints fails the quick preflight's capacity check."""
    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        node="n1",
        tiers=[local_tier("hot", tmp_path / "hot", keep_last=keep_last)],
    )
    defaults = tmp_path / "ckptkeeper.defaults"
    defaults.write_text(
        f"PYTHONPATH={REPO}\nCKPTKEEPER='{sys.executable} -m ckptkeeper.cli'\n"
        f"CKPTKEEPER_CONFIG={config}\nCKPTKEEPER_PREFLIGHT={gate}\n"
        f"CKPTKEEPER_HOOK_LOG={tmp_path / 'hook.log'}\n"
    )
    env = {
        "CKPTKEEPER_DEFAULTS": str(defaults),
        "SLURM_JOB_ID": "77",
        "SLURMD_NODENAME": "n1",
        "SLURM_JOB_NUM_NODES": "1",
    }
    done = subprocess.run(
        ["/bin/sh", str(REPO / "deploy" / "slurm" / "prolog")], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == prolog_exit, (tmp_path / "hook.log").read_text()
    log = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    start = log[-1]
    assert (start["event"], start["job"]) == ("start", "77")
    if gate == "off":
        assert start["preflight"] is None
        return
    assert (start["preflight"]["status"], start["preflight"]["refused"]) == (status, refused)
    if status == "fail":
        assert [f.split(":")[0] for f in start["preflight"]["failed"]] == ["hot_capacity"]
        assert start["errors"][0].startswith("preflight failed: hot_capacity: needs 1000000 kept")
