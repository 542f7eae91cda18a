"""A real single-host Slurm with two simulated nodes, for tests that run real ``sbatch`` jobs.

Debian's Slurm (``apt-get install slurmctld slurmd slurm-client``; ``.ci/slurm.sh``) is built
with ``MULTIPLE_SLURMD``: one ``slurmctld`` and one ``slurmd -N nX`` per node, all on 127.0.0.1
with their own ports, spool, pid and log files (``%n``), no munge (``auth/none``), no cgroups
(``proctrack/linuxproc``, ``task/none``). Everything lives in one temporary directory and is
stopped (the processes this module started, by pid) when the cluster is.

Prolog and Epilog are wrappers written here that run the given scripts (``deploy/slurm/``) and
record each one's exit status in ``hooks.log``: a test asserts they all exited 0 (a non-zero
Prolog or Epilog drains the node in production).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin")


def missing_binaries() -> list[str]:
    """The Slurm programs not found (in PATH or the usual sbin dirs); empty when all are there."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))
    if found is None:
        raise FileNotFoundError(name)
    return found


def _free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports above it (bound and released: a race
    with another program is possible but the cluster then fails loudly at start)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65000:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range for slurm")


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    hooks_log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        return env

    def run(self, *args: str, check: bool = True, timeout: float = 20) -> str:
        done = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{shlex.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: Path | str, *options: str, env: Mapping[str, str] | None = None) -> str:
        """Submit ``script`` (a path, or the text of a batch script); the job id."""
        if not isinstance(script, Path):
            path = self.root / f"job-{time.monotonic_ns()}.sh"
            path.write_text(script)
            path.chmod(0o755)
            script = path
        args = ["sbatch", "--parsable", f"--chdir={self.root}", *options, str(script)]
        merged = {**self.env, **(env or {})}
        done = subprocess.run(args, env=merged, capture_output=True, text=True, timeout=20, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once the job is purged)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, *states: str, timeout: float = 120) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` and its Epilog has run on every node it
        ran on (not COMPLETING); the job's ``scontrol`` fields then."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state = info.get("JobState", "")
            if state in states and not self._completing(job_id):
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {info}\n{self.logs()}")

    def wait_running(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """Poll until the job runs (its Prolog done: ``PrologFlags=Alloc`` runs it at allocation)."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") == "RUNNING":
                return info
            if info.get("JobState") in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} not running: {info}\n{self.logs()}")

    def _completing(self, job_id: str) -> bool:
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False)
        return "COMPLETING" in out

    def hook_exits(self, job_id: str | None = None) -> list[tuple[str, str, str, int]]:
        """(hook, job, node, exit status) of each Prolog/Epilog run so far."""
        rows = []
        if self.hooks_log.exists():
            for line in self.hooks_log.read_text().splitlines():
                kind, job, node, code = line.split()
                if job_id is None or job == job_id:
                    rows.append((kind, job, node, int(code)))
        return rows

    def wait_hooks(self, job_id: str, kind: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for k, *_ in self.hook_exits(job_id) if k == kind) >= count:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{count} {kind} of job {job_id} did not run: {self.hook_exits(job_id)}")

    def wait_node_state(self, node: str, *states: str, timeout: float = 60) -> str:
        """Poll until ``sinfo`` shows ``node`` in one of ``states``; its ``%t %E`` line then.

        A hook's exit is in ``hooks.log`` before slurmd has told slurmctld about it, so a node's
        state after a failing Prolog has to be waited for, not read once."""
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.run("sinfo", "-h", "-n", node, "-o", "%t %E", check=False).strip()
            if line and line.split()[0] in states:
                return line
            time.sleep(0.1)
        raise TimeoutError(f"node {node} not in {states} after {timeout}s: {line!r}\n{self.logs()}")

    def drained(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return [line for line in out.splitlines() if re.search(r"drain|drng|drng|down", line)]

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(
                f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
            )
        return "\n".join(parts)

    def start(self) -> None:
        log = self.root / "log"
        ctld = subprocess.Popen(
            [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)],
            env=self.env,
            stdout=(log / "slurmctld.out").open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(ctld)
        deadline = time.monotonic() + 30
        while self.run("scontrol", "ping", check=False).find("UP") < 0:
            if ctld.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"slurmctld did not start\n{self.logs()}")
            time.sleep(0.1)
        for node in NODES:
            self.procs.append(
                subprocess.Popen(
                    [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                    env=self.env,
                    stdout=(log / f"slurmd-{node}.out").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        while True:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            if sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"]) == len(NODES):
                return
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError(f"slurm nodes did not come up: {out}\n{self.logs()}")
            time.sleep(0.1)

    def stop(self) -> None:
        # Jobs first, so their processes (run by slurmd) end before the daemons do.
        self.run("scancel", "--full", "-u", os.environ.get("USER", "root"), check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_leftover_steps()

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes of this cluster outlive a killed slurmd: end them by pid."""
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                cmd = (pid_dir / "cmdline").read_bytes()
                environ = (pid_dir / "environ").read_bytes()
            except OSError:
                continue
            if b"slurmstepd" in cmd and f"SLURM_CONF={self.conf}".encode() in environ:
                with suppress(OSError):
                    os.kill(int(pid_dir.name), signal.SIGKILL)


def _wrapper(root: Path, kind: str, script: Path | None, env_file: Path | None) -> Path:
    path = root / kind
    lines = ["#!/bin/sh"]
    if env_file is not None:
        lines.append(f"CKPTKEEPER_DEFAULTS={shlex.quote(str(env_file))}; export CKPTKEEPER_DEFAULTS")
    lines += [
        shlex.quote(str(script)) if script is not None else "true",
        "rc=$?",
        f'echo "{kind} $SLURM_JOB_ID $SLURMD_NODENAME $rc" >> {shlex.quote(str(root / "hooks.log"))}',
        "exit $rc",
    ]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def write_conf(
    root: Path,
    *,
    prolog: Path | None,
    epilog: Path | None,
    env_file: Path | None,
    cpus: int = 4,
) -> Path:
    host = socket.gethostname()
    base = _free_ports(1 + len(NODES))
    for sub in ("log", "state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    first, last = base + 1, base + len(NODES)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=ckpttest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={base}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "AuthInfo=cred_expire=10",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "ReturnToService=2",
                "SlurmdParameters=config_overrides",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool/%n",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd-%n.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd-%n.log",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "MinJobAge=300",
                "KillWait=2",
                "InactiveLimit=0",
                "OverTimeLimit=0",
                "MessageTimeout=5",
                "PrologFlags=Alloc",
                "JobRequeue=1",
                f"Prolog={_wrapper(root, 'prolog', prolog, env_file)}",
                f"Epilog={_wrapper(root, 'epilog', epilog, env_file)}",
                f"NodeName=n[1-{len(NODES)}] NodeHostname={host} NodeAddr=127.0.0.1 "
                f"Port=[{first}-{last}] CPUs={cpus} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                "",
            ]
        )
    )
    return conf


@contextmanager
def slurm_cluster(
    root: Path,
    *,
    prolog: Path | None = None,
    epilog: Path | None = None,
    env_file: Path | None = None,
) -> Iterator[SlurmCluster]:
    """A running two-node cluster in ``root``; stopped, its processes gone, on exit."""
    root.mkdir(parents=True, exist_ok=True)
    conf = write_conf(root, prolog=prolog, epilog=epilog, env_file=env_file)
    cluster = SlurmCluster(root=root, conf=conf, hooks_log=root / "hooks.log")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
