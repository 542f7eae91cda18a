"""Scheduler jobs: what a job's start or end means for the runs it tracked (docs/design.md,
"Cluster reality": the scheduler is a source of truth).

Pure: a scheduler's hook environment and its controller's word on the job go in as values, a
:class:`JobEvent`, an :class:`Outcome` and per-run :class:`RunVerdict` come out. The Slurm
adapter reads what Slurm gives a Prolog/Epilog; another scheduler adds a reader that builds the
same :class:`JobEvent`.

What Slurm shows (22.05): Prolog and Epilog see ``SLURM_JOB_ID``, ``SLURM_JOB_USER``,
``SLURM_JOB_WORK_DIR``, ``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_RESTART_COUNT`` and
``SLURMD_NODENAME``; the Epilog also ``SLURM_JOB_EXIT_CODE`` (a wait status: 768 for ``exit 3``),
``SLURM_JOB_EXIT_CODE2`` (``3:0``) and ``SLURM_JOB_DERIVED_EC``. A cancel or a time limit looks
like success there (``0``, ``0:0``): only the controller (``scontrol show job``) tells them
(``JobState=CANCELLED`` / ``TIMEOUT``, ``Reason=TimeLimit``, ``ExitCode=0:15``). A job ended by a
requeue shows its ``SLURM_JOB_RESTART_COUNT`` already incremented in its Epilog, while its Prolog
saw the old value.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "JobEvent",
    "Outcome",
    "RunVerdict",
    "judge_run",
    "outcome",
    "parse_scontrol",
    "slurm_event",
]

OutcomeKind = Literal["completed", "failed", "cancelled", "timeout", "requeued", "node-fail", "unknown"]


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One scheduler hook call: a job starts or ends on this node."""

    scheduler: str
    job: str
    node: str | None
    nodes: int | None
    """How many nodes the job spans."""
    user: str | None = None
    work_dir: str | None = None
    restarts: int = 0
    """``SLURM_JOB_RESTART_COUNT``: how often the job was requeued (in an Epilog ended by a
    requeue, already counting that requeue)."""
    exit_status: int | None = None
    """The batch script's wait status (``SLURM_JOB_EXIT_CODE``), Epilog only."""
    exit_code2: str | None = None
    """``<code>:<signal>`` (``SLURM_JOB_EXIT_CODE2``), Epilog only."""
    derived: str | None = None
    """``<code>:<signal>`` of the worst step (``SLURM_JOB_DERIVED_EC``), Epilog only."""
    resume: str | None = None
    """The run this job declares it resumes (``CKPTKEEPER_RESUME`` in the job's environment
    reaches no hook: a ``--comment=ckptkeeper:resume=RUN`` does, read from the controller)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    text: str
    """What a person reads in the run's state reason: ``slurm job 12 on n1: exit code 3``."""

    @property
    def failed(self) -> bool:
        return self.kind not in ("completed", "requeued")


@dataclass(frozen=True, slots=True)
class RunVerdict:
    action: Literal["fail", "interrupt", "note", "leave"]
    """``fail``: mark the run failed now; ``interrupt``: it will resume (requeue), nothing it
    needs may go; ``note``: already ended by the hook, the job's outcome is added to its reason;
    ``leave``: finished, nothing to do."""
    reason: str


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    return int(text) if re.fullmatch(r"-?\d{1,10}", text) else None


def _text(value: str | None, limit: int = 255) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if not text or "\0" in text or len(text) > limit:
        return None
    return text


def slurm_event(env: Mapping[str, str]) -> JobEvent | None:
    """The job a Slurm Prolog/Epilog runs for, from its environment; None outside one."""
    job = _text(env.get("SLURM_JOB_ID"), 64)
    if job is None or not re.fullmatch(r"[0-9_]+", job):
        return None
    return JobEvent(
        scheduler="slurm",
        job=job,
        node=_text(env.get("SLURMD_NODENAME")),
        nodes=_int(env.get("SLURM_JOB_NUM_NODES")),
        user=_text(env.get("SLURM_JOB_USER")),
        work_dir=_text(env.get("SLURM_JOB_WORK_DIR"), 4096),
        restarts=max(0, _int(env.get("SLURM_JOB_RESTART_COUNT")) or 0),
        exit_status=_int(env.get("SLURM_JOB_EXIT_CODE")),
        exit_code2=_text(env.get("SLURM_JOB_EXIT_CODE2"), 32),
        derived=_text(env.get("SLURM_JOB_DERIVED_EC"), 32),
    )


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol -o show job`` (one line of ``Key=Value``) as a dict; later keys never
    overwrite earlier ones (``Comment=`` and ``Command=`` may hold spaces: cut at the next key)."""
    fields: dict[str, str] = {}
    for match in re.finditer(
        r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s[A-Za-z][A-Za-z0-9_:/]*=|$)", text
    ):
        fields.setdefault(match.group(1), match.group(2).strip())
    return fields


def resume_from_comment(ctl: Mapping[str, str]) -> str | None:
    """``--comment=ckptkeeper:resume=RUN`` on the job: the run it resumes."""
    match = re.search(r"ckptkeeper:resume=(\S+)", ctl.get("Comment", ""))
    return _text(match.group(1)) if match else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _pair(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    match = re.fullmatch(r"(\d+):(\d+)", value.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def _exit_words(event: JobEvent) -> tuple[int, int] | None:
    """(exit code, signal) of the batch script from the Epilog's environment: the wait status,
    else ``EXIT_CODE2``."""
    if event.exit_status is not None and event.exit_status >= 0:
        status = event.exit_status
        if status & 0x7F:
            return 0, status & 0x7F
        return (status >> 8) & 0xFF, 0
    return _pair(event.exit_code2)


def outcome(
    event: JobEvent, ctl: Mapping[str, str] | None, *, restarts_at_start: int | None = None
) -> Outcome:
    """How the job ended, from the Epilog's environment and the controller's fields (``ctl``:
    :func:`parse_scontrol`, None when it could not be asked).

    A requeue shows as a restart count above the one the job started with (``restarts_at_start``,
    recorded by the Prolog), or the controller's ``JobState=REQUEUED``/``PENDING``/``Requeue``
    reasons. A cancel and a time limit show only in the controller's word.
    """
    ctl = ctl or {}
    who = f"{event.scheduler} job {event.job}" + (f" on {event.node}" if event.node else "")
    state = ctl.get("JobState", "")
    reason = ctl.get("Reason", "")
    requeued = (restarts_at_start is not None and event.restarts > restarts_at_start) or state in (
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "PENDING",
    )
    if requeued:
        return Outcome("requeued", f"{who}: requeued (restart {event.restarts}), will resume")
    if state == "TIMEOUT" or reason == "TimeLimit":
        return Outcome("timeout", f"{who}: time limit reached")
    if state == "CANCELLED" or state.startswith("CANCELLED"):
        return Outcome("cancelled", f"{who}: cancelled")
    if state in ("NODE_FAIL", "BOOT_FAIL") or reason in ("NodeDown", "NodeFail"):
        return Outcome("node-fail", f"{who}: node failure")
    if state == "OUT_OF_MEMORY":
        return Outcome("failed", f"{who}: out of memory")
    words = _exit_words(event)
    told = _pair(ctl.get("ExitCode"))
    if words in (None, (0, 0)) and told is not None and told[1]:
        # scancel: the script's shell died of the signal Slurm sent, the environment says 0:0
        return Outcome("cancelled", f"{who}: cancelled ({_signal_name(told[1])})")
    if words is None:
        words = told
    derived = _pair(event.derived)
    if words is None:
        if state in ("FAILED", "DEADLINE", "PREEMPTED"):
            return Outcome("failed", f"{who}: {state.lower()}")
        return Outcome("unknown", f"{who}: ended (exit status unknown)")
    code, sig = words
    if sig:
        return Outcome("failed", f"{who}: killed by {_signal_name(sig)}")
    if code:
        return Outcome("failed", f"{who}: exit code {code}")
    if derived is not None and (derived[0] or derived[1]):
        what = f"signal {_signal_name(derived[1])}" if derived[1] else f"exit code {derived[0]}"
        return Outcome("failed", f"{who}: a job step failed ({what})")
    if state == "FAILED":
        return Outcome("failed", f"{who}: failed")
    return Outcome("completed", f"{who}: completed (exit code 0)")


def judge_run(run_state: str | None, run_reason: str | None, end: Outcome) -> RunVerdict:
    """What the job's end means for one run it tracked (``run_state``: what its ``run.json``
    says). A run that said ``finished`` is done; one the job leaves ``active`` ends now: failed,
    or interrupted when the job was requeued (it resumes, so nothing it needs may be reaped)."""
    if run_state == "finished":
        return RunVerdict("leave", "the run said finished")
    if end.kind == "requeued":
        return RunVerdict("interrupt", f"interrupted: {end.text}")
    if run_state == "failed":
        told = run_reason or "failed"
        return RunVerdict("note", told if end.text in told else f"{told} ({end.text})")
    if end.kind == "completed":
        return RunVerdict("fail", f"{end.text}, but the run never said finished")
    return RunVerdict("fail", end.text)
