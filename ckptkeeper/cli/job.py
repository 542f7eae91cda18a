"""``job start`` / ``job end`` (scheduler hooks) and ``prefetch`` (job scripts).

``job start`` and ``job end`` are called by a Slurm Prolog/Epilog as root: they ALWAYS exit 0
(a failing hook drains the node), whatever went wrong — it is logged and recorded in the node's
job log for ``status``. Their quick part runs in the hook; the node's pass for the job's runs runs
detached (``job pass``, hidden), the pre-stage under ``--prestage-timeout``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.cli.context import (
    EXIT_ACTION_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    Context,
    emit_json,
    fail,
    pass_ctx,
)

if TYPE_CHECKING:
    from ckptkeeper.actions.job import JobReport
    from ckptkeeper.config import Settings


@click.group()
def job() -> None:
    """Scheduler job boundaries on this node (Slurm Prolog/Epilog: docs/slurm.md)."""


def _settings(app: Context) -> Settings:
    from ckptkeeper.config import load_settings
    from ckptkeeper.util import logs

    settings = load_settings(app.config_path)
    logs.configure(settings.log_level)
    return settings


def _event(scheduler: str) -> Any:
    from ckptkeeper.core.jobs import slurm_event

    if scheduler != "slurm":
        raise ValueError(f"unknown scheduler {scheduler!r}")
    event = slurm_event(os.environ)
    if event is None:
        raise ValueError("not in a Slurm Prolog/Epilog: SLURM_JOB_ID is not set")
    return event


def _finish(app: Context, report: JobReport, started: float, as_json: bool, settings: Any) -> None:
    from ckptkeeper.actions.job import record

    report.seconds = time.monotonic() - started
    doc = report.to_json()
    if settings is not None:
        record(settings, doc)
    if as_json:
        emit_json(doc)
    else:
        for run in report.runs:
            click.echo(f"{run['run']}: {run['action']}: {run['reason']}")
        for err in report.errors:
            click.echo(f"ckptkeeper: warning: {err}", err=True)


_SCHEDULER = click.option(
    "--scheduler",
    type=click.Choice(["slurm"]),
    default="slurm",
    show_default=True,
    help="Whose hook this is.",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")


@job.command("end")
@_SCHEDULER
@_JSON
@click.option("--no-pass", is_flag=True, help="Mark the runs only; leave the pass to the daemon's schedule.")
@click.option(
    "--push-timeout",
    type=click.FloatRange(min=0),
    default=15.0,
    show_default=True,
    help="A requeued job: seconds to wait for its runs' copies to the shared tiers (its next start waits for this hook).",
)
@pass_ctx
def job_end(app: Context, scheduler: str, as_json: bool, no_pass: bool, push_timeout: float) -> None:
    """The job ended on this node (Epilog): its runs learn it now, the node's pass runs for them.

    Every run the job tracked (its hook recorded the job id) that did not say finished ends as
    failed, with the job's outcome as reason (exit code, signal, time limit, cancelled); a requeued
    job's runs are interrupted, not failed, and nothing they need is reaped. Always exits 0.
    """
    started = time.monotonic()
    from ckptkeeper.actions.job import JobReport

    report = JobReport("end", None, None)
    settings = None
    try:
        from ckptkeeper.actions.job import ask_controller, end_job, spawn_followup

        settings = _settings(app)
        event = _event(scheduler)
        report.job, report.node = event.job, event.node
        ctl, problem = ask_controller(event.job)
        if problem:
            report.errors.append(problem)
        ended_at = time.time()
        _, reap, interrupted = end_job(settings, event, ctl, report)
        if (reap or interrupted) and not no_pass:
            wait = push_timeout if interrupted else 0.0
            report.followup, code = spawn_followup(
                app.config_path, event.job, ended_at, reap, interrupted, wait=wait
            )
            if interrupted and code is None:
                report.errors.append(f"the pass for the requeued runs still runs after {push_timeout:g}s")
    except BaseException as exc:  # a hook must exit 0: recorded, then exit 0
        report.errors.append(f"{type(exc).__name__}: {exc}")
    _finish(app, report, started, as_json, settings)
    sys.exit(EXIT_OK)


@job.command("start")
@_SCHEDULER
@_JSON
@click.option(
    "--prestage-timeout",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Seconds the pre-stage of the runs the job resumes may take before the job starts anyway.",
)
@click.option(
    "--preflight",
    "gate",
    type=click.Choice(["off", "check", "drain"]),
    default="off",
    show_default=True,
    help="Run `preflight --quick` first: `check` records its result; `drain` also refuses the job "
    "on a failing check (exit 3: the shipped Prolog then fails, so Slurm DRAINS THIS NODE and requeues the job).",
)
@click.option(
    "--preflight-timeout",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds the preflight may take; one cut short refuses nothing.",
)
@pass_ctx
def job_start(
    app: Context, scheduler: str, as_json: bool, prestage_timeout: float, gate: str, preflight_timeout: float
) -> None:
    """The job starts on this node (Prolog): pre-stage what it resumes into the hot tier.

    A restarted job (requeued), or one that declares the run it resumes
    (``--comment=ckptkeeper:resume=RUN``), finds the latest verified checkpoint of that run (this
    node's part, for a checkpoint spanning nodes) in the hot tier before its first step. Bounded
    by --prestage-timeout. Exits 0, except with ``--preflight drain`` when a check failed (3).
    """
    started = time.monotonic()
    from ckptkeeper.actions.job import JobReport

    report = JobReport("start", None, None)
    settings = None
    refused = False
    try:
        from ckptkeeper.actions.job import ask_controller, resumes, runs_of_job

        settings = _settings(app)
        event = _event(scheduler)
        report.job, report.node, report.restarts = event.job, event.node, event.restarts
        if gate != "off":
            report.preflight = _preflight(app, gate, preflight_timeout, report)
            refused = bool(report.preflight.get("refused"))
        if refused:
            raise _Refused
        ctl, problem = ask_controller(event.job)
        if problem:
            report.errors.append(problem)
        wanted = resumes(event, ctl)
        if event.restarts > 0:
            wanted += [r.name for r in runs_of_job(settings, event) if r.name not in wanted]
        part = _node_part(event, ctl)
        deadline = started + prestage_timeout
        for run in wanted:
            report.prestaged.append(_prestage(app, run, part, deadline, report))
    except _Refused:
        pass
    except BaseException as exc:  # a hook must exit 0
        report.errors.append(f"{type(exc).__name__}: {exc}")
    report.runs = [
        {"run": str(p.get("run", "")), "action": "prestage", "reason": str(p.get("error") or "ok")}
        for p in report.prestaged
    ]
    _finish(app, report, started, as_json, settings)
    sys.exit(EXIT_REFUSED if refused else EXIT_OK)


class _Refused(Exception):
    """The preflight gate refused the job: nothing else is done."""


_PREFLIGHT_EXIT = {0: "pass", 5: "warn", 6: "fail"}


def _preflight(app: Context, gate: str, timeout: float, report: JobReport) -> dict[str, Any]:
    """``ckptkeeper preflight --quick`` in a child process, killed after ``timeout`` seconds.
    Only its own verdict "fail" (exit 6) refuses, and only with ``gate == "drain"``: one that
    could not run (locked, cut short, unreadable) is recorded as an error."""
    args = [sys.executable, "-m", "ckptkeeper.cli"]
    if app.config_path:
        args += ["--config", app.config_path]
    args += ["preflight", "--quick", "--json"]
    doc: dict[str, Any] = {"mode": gate, "status": None, "exit": None, "failed": [], "refused": False}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # its SIGTERM handler removes the scratch
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        report.errors.append(f"preflight cut at {timeout:g}s: nothing refused")
        return doc
    doc["exit"] = proc.returncode
    doc["status"] = _PREFLIGHT_EXIT.get(proc.returncode)
    if doc["status"] is None:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        report.errors.append(f"preflight did not run: {why[0]}; nothing refused")
        return doc
    try:
        checks = json.loads(out).get("checks", [])
    except (ValueError, AttributeError):
        checks = []
    doc["failed"] = [
        f"{c.get('name')}: {c.get('detail')}"
        for c in checks
        if isinstance(c, dict) and c.get("status") == "fail"
    ]
    if doc["status"] == "fail":
        report.errors.append(
            "preflight failed: " + ("; ".join(doc["failed"]) or "see `ckptkeeper preflight`")
        )
        doc["refused"] = gate == "drain"
    return doc


def _node_part(event: Any, ctl: dict[str, str] | None) -> int | None:
    """This node's index in the job's node list (``SLURM_NODEID``), for a job spanning nodes."""
    if not event.nodes or event.nodes < 2 or not ctl or not event.node:
        return None
    from ckptkeeper.actions.job import scontrol_path

    exe = scontrol_path()
    if exe is None or not ctl.get("NodeList"):
        return None
    try:
        done = subprocess.run(
            [exe, "show", "hostnames", ctl["NodeList"]],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.split()
    return names.index(event.node) if event.node in names else None


def _prestage(app: Context, run: str, part: int | None, deadline: float, report: JobReport) -> dict[str, Any]:
    """``ckptkeeper prefetch RUN`` in a child process, killed at ``deadline``."""
    args = [sys.executable, "-m", "ckptkeeper.cli"]
    if app.config_path:
        args += ["--config", app.config_path]
    args += ["prefetch", run, "--json"]
    if part is not None:
        args += ["--part", str(part)]
    left = deadline - time.monotonic()
    if left <= 0:
        report.errors.append(f"{run}: no time left to pre-stage")
        return {"run": run, "error": "no time left"}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        report.errors.append(f"{run}: pre-stage cut at the deadline")
        return {"run": run, "error": "timed out"}
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        report.errors.append(f"{run}: pre-stage failed: {why[0]}")
        return {"run": run, "error": why[0]}
    try:
        doc = json.loads(out)
    except ValueError:
        return {"run": run, "error": "unreadable prefetch output"}
    return doc if isinstance(doc, dict) else {"run": run, "error": "unreadable prefetch output"}


@job.command("pass", hidden=True)
@click.option("--job", "job_id", required=True)
@click.option("--ended", type=float, required=True)
@click.option("--reap", multiple=True)
@click.option("--push", multiple=True)
@pass_ctx
def job_pass(app: Context, job_id: str, ended: float, reap: tuple[str, ...], push: tuple[str, ...]) -> None:
    """The node's pass for a job's runs, started detached by ``job end``."""
    from ckptkeeper.actions.job import job_pass as run_pass
    from ckptkeeper.actions.job import record

    started = time.monotonic()
    doc: dict[str, Any] = {"event": "pass", "job": job_id, "errors": []}
    settings = None
    try:
        settings = _settings(app)
        with app.index(rebuild=True) as ix:
            doc = run_pass(settings, ix, job=job_id, ended_at=ended, reap=reap, push=push)
    except BaseException as exc:  # recorded in the job log
        doc["errors"].append(f"{type(exc).__name__}: {exc}")
    doc["seconds"] = round(time.monotonic() - started, 3)
    doc["time"] = time.time()
    if settings is not None:
        record(settings, doc)
    sys.exit(EXIT_OK if not doc["errors"] else EXIT_ACTION_FAILED)


@click.command()
@click.argument("run")
@click.option("--step", default="latest", show_default=True, help="A step number or 'latest'.")
@click.option(
    "--part", type=click.IntRange(min=0), default=None, help="Only part K of a checkpoint spanning nodes."
)
@click.option("--json", "as_json", is_flag=True, help="Print what was fetched as JSON.")
@click.option(
    "--no-daemon",
    is_flag=True,
    help="Fetch in this process even when this node's daemon could do it.",
)
@pass_ctx
def prefetch(app: Context, run: str, step: str, part: int | None, as_json: bool, no_daemon: bool) -> None:
    """Bring RUN's latest verified checkpoint into this node's hot tier (for schedulers without
    hooks: ``srun --ntasks-per-node=1 ckptkeeper prefetch RUN`` before training). This node's
    daemon does the work when it runs the same config, unless --no-daemon."""
    wanted: str | int = step
    if step != "latest":
        try:
            wanted = int(step)
        except ValueError:
            fail(f"--step must be a number or 'latest', not {step!r}")
    doc = None
    if not no_daemon and (wanted == "latest" or int(wanted) >= 0):
        from ckptkeeper.cli.restore import by_daemon

        doc = by_daemon(app, "prefetch", {"run": run, "step": wanted, "part": part}, None)
    if doc is None:
        from ckptkeeper.actions.prefetch import prefetch as do_prefetch

        with app.index(rebuild=True) as ix:  # it writes: a node without an index gets one
            try:
                doc = do_prefetch(app.settings, ix, run, step=wanted, part=part).to_json()
            except LookupError as exc:
                fail(str(exc), EXIT_ACTION_FAILED)
    if as_json:
        emit_json(doc)
    else:
        where = "already in the hot tier" if doc["from_tier"] is None else f"from {doc['from_tier']}"
        click.echo(f"{run}@{doc['step']}: {doc['path']} ({where}, {doc['seconds']:.1f}s)")


COMMANDS = [job, prefetch]
