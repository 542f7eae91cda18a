"""``job start`` / ``job end``: a scheduler's job boundaries, on this node (docs/slurm.md).

Called from a Slurm Prolog/Epilog (``deploy/slurm/``), as root, with no PATH, HOME or USER. A
failing hook drains the node, so nothing here raises to the caller: every problem is logged,
recorded in the node's job log (``jobs.jsonl`` beside the index) and counted, and the command
exits 0. The quick part runs in the hook (find the job's runs, tell them how the job ended); the
slow part — the node's prune pass for those runs, a pre-stage from slower tiers — runs in a
detached process (``job end``) or under a deadline (``job start``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.jobs import JobEvent, Outcome, judge_run, outcome, parse_scontrol, resume_from_comment
from ckptkeeper.hook import protocol
from ckptkeeper.hook.jobend import record_job_end
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.job")

JOBS_LOG = "jobs.jsonl"
"""One JSON line per hook call and per follow-up pass, beside the index: what ``status`` counts."""
_LOG_TAIL = 256 * 1024
_LOG_KEEP = 1 << 20
_SCONTROL_TIMEOUT = 2.0
_FIND_BUDGET = 1.0
"""Seconds the walk of the hot tier for a job's runs may take in a hook (a huge tier is cut)."""
_ADMIN_MARK = "ckptkeeper:resume="
SCONTROL_PATHS = ("/usr/bin/scontrol", "/usr/local/bin/scontrol", "/opt/slurm/bin/scontrol")


@dataclass(frozen=True, slots=True)
class JobRun:
    """A run the job tracked on this node: its name in the hot tier and the hook dir speaking."""

    name: str
    hook_dir: Path
    info: protocol.RunInfo


@dataclass
class JobReport:
    """What one hook call found and did (``job ... --json`` prints it; ``jobs.jsonl`` keeps it)."""

    event: str
    job: str | None
    node: str | None
    outcome: str | None = None
    reason: str | None = None
    runs: list[dict[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    followup: int | None = None
    """pid of the detached pass started for the runs (job end)."""
    prestaged: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    restarts: int | None = None
    """The job's restart count (job start: what ``job end`` compares to tell a requeue)."""
    preflight: dict[str, Any] | None = None
    """``job start --preflight``: the quick preflight's status, its failing checks, and whether
    the job was refused."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "job": self.job,
            "node": self.node,
            "outcome": self.outcome,
            "reason": self.reason,
            "runs": self.runs,
            "prestaged": self.prestaged,
            "followup_pid": self.followup,
            "errors": self.errors,
            "restarts": self.restarts,
            "preflight": self.preflight,
            "seconds": round(self.seconds, 3),
            "time": time.time(),
        }


# -- the node's job log ------------------------------------------------------------------------


def jobs_log(settings: Settings) -> Path:
    return Path(settings.index).parent / JOBS_LOG


def record(settings: Settings, doc: Mapping[str, Any]) -> None:
    """Append one line to the job log; a failure is logged, never raised (a hook must not fail)."""
    path = jobs_log(settings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size > _LOG_KEEP:  # bounded: the previous MiB stays as jobs.jsonl.1
                os.replace(path, path.with_name(JOBS_LOG + ".1"))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(doc, separators=(",", ":"), default=str) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot write the job log", path=str(path), error=str(exc))


def recent(settings: Settings) -> list[dict[str, Any]]:
    """The job log's last lines (at most its last 256 KiB), oldest first; bad lines skipped."""
    try:
        with open(jobs_log(settings), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > _LOG_TAIL:
        lines = lines[1:]
    out = []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


# -- the controller ----------------------------------------------------------------------------


def scontrol_path() -> str | None:
    import shutil

    found = shutil.which("scontrol")
    return found or next((p for p in SCONTROL_PATHS if os.access(p, os.X_OK)), None)


def ask_controller(job: str) -> tuple[dict[str, str] | None, str | None]:
    """``scontrol -o show job`` fields, or (None, why not): bounded, never raising."""
    exe = scontrol_path()
    if exe is None:
        return None, "scontrol not found"
    try:
        done = subprocess.run(
            [exe, "-o", "show", "job", job],
            capture_output=True,
            text=True,
            timeout=_SCONTROL_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"scontrol show job {job}: {exc}"
    if done.returncode != 0:
        return None, f"scontrol show job {job} exited {done.returncode}: {done.stderr.strip()[:200]}"
    return parse_scontrol(done.stdout.strip()), None


def _tell_controller_resume(job: str, runs: Sequence[str]) -> str | None:
    """A requeued job may start on another node: its Prolog learns which runs to pre-stage from
    the job's AdminComment (set by root only). None, or the problem."""
    exe = scontrol_path()
    if exe is None or not runs:
        return None
    value = _ADMIN_MARK + ",".join(runs)
    if len(value) > 1000 or any(c.isspace() or c == "," for r in runs for c in r):
        return "run names too long or with spaces/commas for the job's AdminComment: not pre-staged elsewhere"
    try:
        done = subprocess.run(
            [exe, "update", f"JobId={job}", f"AdminComment={value}"],
            capture_output=True,
            text=True,
            timeout=_SCONTROL_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol update AdminComment: {exc}"
    if done.returncode != 0:
        return f"scontrol update AdminComment exited {done.returncode}: {done.stderr.strip()[:200]}"
    return None


def resumes(event: JobEvent, ctl: Mapping[str, str] | None) -> list[str]:
    """The runs a starting job resumes: declared (``--comment=ckptkeeper:resume=RUN``), or
    recorded by the Epilog of its requeue (AdminComment)."""
    found: list[str] = []
    if event.resume:
        found.append(event.resume)
    if ctl:
        declared = resume_from_comment(ctl)
        if declared:
            found.extend(declared.split(","))
        match = re.search(re.escape(_ADMIN_MARK) + r"(\S+)", ctl.get("AdminComment", ""))
        if match:
            found.extend(match.group(1).split(","))
    return list(dict.fromkeys(r for r in found if r and ".." not in r.split("/")))


# -- the job's runs on this node ---------------------------------------------------------------


def _hook_dirs(run_dir: Path, depth: int = 2) -> list[Path]:
    """``run_dir`` and its subdirectories (down to ``depth``) holding a hook's ``run.json``."""
    found: list[Path] = []
    stack = [(run_dir, 0)]
    while stack:
        here, level = stack.pop()
        if (here / protocol.STATE_DIR / protocol.RUN_FILE).is_file():
            found.append(here)
        if level >= depth:
            continue
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), level + 1))
    return found


def _run_dirs(root: Path, depth: int, deadline: float) -> list[tuple[str, Path]]:
    level: list[tuple[str, Path]] = [("", root)]
    for _ in range(depth):
        nxt = []
        for name, here in level:
            try:
                entries = sorted(os.scandir(here), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                nxt.append((f"{name}/{entry.name}" if name else entry.name, Path(entry.path)))
            if time.monotonic() > deadline:
                break
        level = nxt
    return level


def runs_of_job(settings: Settings, event: JobEvent, *, budget: float = _FIND_BUDGET) -> list[JobRun]:
    """Every run in this node's hot tier whose hook recorded this job (``scheduler_job``, or the
    ``job`` of a node's part when the scheduler's id is the job's)."""
    deadline = time.monotonic() + budget
    found = []
    for name, run_dir in _run_dirs(settings.hot.local_path, settings.run_depth, deadline):
        if time.monotonic() > deadline:
            log.warning("hot tier walk cut short", job=event.job, budget=budget)
            break
        for hook_dir in _hook_dirs(run_dir):
            info = protocol.read_run_dir(hook_dir)
            if info is None:
                continue
            sched = info.scheduler_job
            mine = sched is not None and sched.scheduler == event.scheduler and sched.id == event.job
            if not mine and sched is None and info.job is not None and event.scheduler == "slurm":
                mine = info.job.job == event.job
            if mine:
                found.append(JobRun(name, hook_dir, info))
    return found


# -- job end -----------------------------------------------------------------------------------


def _started_restarts(settings: Settings, event: JobEvent, runs: Sequence[JobRun]) -> int | None:
    """The job's restart count when it started here: the Prolog's record, else its runs' word."""
    for doc in reversed(recent(settings)):
        if doc.get("event") == "start" and doc.get("job") == event.job and doc.get("node") == event.node:
            value = doc.get("restarts")
            if isinstance(value, int):
                return value
            break
    counts = [r.info.scheduler_job.restarts for r in runs if r.info.scheduler_job is not None]
    return min(counts) if counts else None


def end_job(
    settings: Settings,
    event: JobEvent,
    ctl: Mapping[str, str] | None,
    report: JobReport,
    *,
    hostname: str | None = None,
) -> tuple[Outcome, list[str], list[str]]:
    """Tell the job's runs how it ended; (outcome, runs to reap now, interrupted runs)."""
    runs = runs_of_job(settings, event)
    end = outcome(event, ctl, restarts_at_start=_started_restarts(settings, event, runs))
    report.outcome, report.reason = end.kind, end.text
    record_doc = {
        "scheduler": event.scheduler,
        "id": event.job,
        "outcome": end.kind,
        "reason": end.text,
        "node": event.node,
        "time": time.time(),
    }
    reap: list[str] = []
    interrupted: list[str] = []
    for run in runs:
        verdict = judge_run(run.info.state, run.info.reason, end)
        if verdict.action in ("fail", "note") and run.info.writer_alive(hostname=hostname):
            # A process outside the job's tracking still writes: its own word will come.
            verdict = type(verdict)("leave", f"writer pid {run.info.pid} still alive")
        ok = True
        if verdict.action == "fail":
            ok = record_job_end(run.hook_dir, record_doc, fail_reason=verdict.reason, expect_state="active")
        elif verdict.action == "note":
            ok = record_job_end(run.hook_dir, record_doc, note_reason=verdict.reason, expect_state="failed")
        elif verdict.action == "interrupt":
            ok = record_job_end(run.hook_dir, record_doc)
        if not ok:
            report.errors.append(f"{run.name}: run.json changed or unreadable; left as the hook said")
            verdict = type(verdict)("leave", "run.json changed meanwhile")
        report.runs.append({"run": run.name, "action": verdict.action, "reason": verdict.reason})
        if verdict.action in ("fail", "note") and run.name not in reap:
            reap.append(run.name)
        elif verdict.action == "interrupt" and run.name not in interrupted:
            interrupted.append(run.name)
    if interrupted:
        problem = _tell_controller_resume(event.job, interrupted)
        if problem:
            report.errors.append(problem)
    return end, reap, interrupted


def spawn_followup(
    config_path: str | None,
    job: str,
    ended_at: float,
    reap: Sequence[str],
    push: Sequence[str],
    *,
    wait: float = 0.0,
) -> tuple[int, int | None]:
    """Start ``ckptkeeper job pass`` detached from the hook (own session, no stdio) and wait for
    it at most ``wait`` seconds; (pid, exit status or None when still running: it goes on alone).

    A requeued job's Epilog waits (``push``): the job cannot start again, on any node, before its
    Epilog ends, so its runs' checkpoints are in the shared tiers when the next Prolog pre-stages."""
    args = [sys.executable, "-m", "ckptkeeper.cli"]
    if config_path:
        args += ["--config", config_path]
    args += ["job", "pass", "--job", job, "--ended", repr(ended_at)]
    args += [a for r in reap for a in ("--reap", r)]
    args += [a for r in push for a in ("--push", r)]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    if wait > 0:
        try:
            return proc.pid, proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    return proc.pid, None


def job_pass(
    settings: Settings,
    index: Any,
    *,
    job: str,
    ended_at: float,
    reap: Sequence[str],
    push: Sequence[str],
    now: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The node's prune pass for a job's runs, right after its end.

    Runs that ended as failed: retention and the reaper, where a partial checkpoint or temp file
    last written before the job's end counts as abandoned now (the job's processes are gone), not
    only after ``partial_after``; anything written since stays protected as usual. Interrupted
    runs (a requeue): retention only (copies to slower tiers per policy, so another node can
    resume them); nothing is reaped.
    """

    done: dict[str, Any] = {"event": "pass", "job": job, "runs": [], "errors": []}
    for name in reap:
        quiet = max(0.0, min(settings.reaper.partial_after, now() - ended_at))
        reaper = settings.reaper.model_copy(update={"partial_after": quiet})
        fast = settings.model_copy(update={"reaper": reaper})
        done["runs"].append(_one_pass(fast, index, name, ("retention", "reap"), done["errors"]))
    for name in push:
        done["runs"].append(_one_pass(settings, index, name, ("retention",), done["errors"]))
    return done


def _one_pass(
    settings: Settings, index: Any, run: str, kinds: tuple[str, ...], errors: list[str]
) -> dict[str, Any]:
    from ckptkeeper.actions.prune import run_prune

    try:
        result = run_prune(settings, index, run=run, kinds=kinds, lock_timeout=120.0)
    except Exception as exc:  # the hook's follow-up: recorded, never raised
        errors.append(f"{run}: {type(exc).__name__}: {exc}")
        return {"run": run, "exit": None}
    errors.extend(f"{run}: {f}" for f in result.failed)
    return {"run": run, "exit": result.exit_code, "reclaimed_bytes": result.reclaimed_bytes}


# -- what ls and status show -------------------------------------------------------------------


def last_job(settings: Settings, run: str) -> dict[str, Any] | None:
    """The scheduler job a run in the hot tier last ran in, and how it ended (``ls``: one small
    file read per run); None for a run without the hook or not in a job."""
    info = protocol.read_run_dir(settings.hot.local_path / run)
    if info is None or (info.scheduler_job is None and info.job_end is None):
        return None
    sched = info.scheduler_job
    end = info.job_end or {}
    same = sched is None or end.get("id") in (None, sched.id)
    return {
        "scheduler": sched.scheduler if sched else end.get("scheduler"),
        "id": sched.id if sched else end.get("id"),
        "node": sched.node if sched else end.get("node"),
        "outcome": end.get("outcome") if same else None,
        "reason": end.get("reason") if same else None,
    }


def job_summary(settings: Settings) -> dict[str, Any] | None:
    """``status``: the node's hook calls (from the job log's tail): how many, how many with
    errors, the last job end; None when no hook ever ran here."""
    docs = recent(settings)
    if not docs:
        return None
    ends = [d for d in docs if d.get("event") == "end"]
    last = ends[-1] if ends else None
    return {
        "calls": len(docs),
        "with_errors": sum(1 for d in docs if d.get("errors")),
        "last_end": None
        if last is None
        else {k: last.get(k) for k in ("job", "node", "outcome", "reason", "time")},
        "last_error": next(
            (f"{d.get('event')} {d.get('job')}: {d['errors'][0]}" for d in reversed(docs) if d.get("errors")),
            None,
        ),
    }
