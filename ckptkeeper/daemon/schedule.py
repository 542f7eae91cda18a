"""The daemon's schedule: which jobs run, how often, when first, and on which worker.

Two workers. ``retention``, ``reap`` and ``rescan`` share one (they contend for the same executor
lock and index anyway, and serial passes are easier to reason about than a retention pass racing
a reap pass). ``scrub`` has its own: a pass reads for up to half an hour at ``daemon.scrub_rate``,
and a full disk cannot wait that long for its retention pass. The scrub takes no executor lock (it
deletes nothing; see :mod:`ckptkeeper.actions.scrub`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.util.fmt import format_duration
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.daemon.service")

JOB_IDS = ("retention", "reap", "rescan", "scrub")
FIRST_RUN_DELAY = {"retention": 30.0, "reap": 60.0, "scrub": 300.0}
"""A restarted node gets a prune soon (a full disk cannot wait an interval); rescan just ran; a
scrub waits until the start-up work is done."""
OWN_WORKER = {"scrub": "scrub"}
"""Jobs that run on a worker of their own (APScheduler executor name)."""


def intervals(settings: Settings) -> dict[str, float]:
    """Job -> interval in seconds; a job turned off (``scrub_interval = 0``) is absent."""
    d = settings.daemon
    out = {"retention": d.retention_interval, "reap": d.reap_interval, "rescan": d.rescan_interval}
    if d.scrub_interval > 0:
        out["scrub"] = d.scrub_interval
    return out


def make_scheduler(
    settings: Settings, journal_pending: int, job_function: Callable[[str], Any], *, prompt: bool = False
) -> Any:
    """A started-later ``BackgroundScheduler`` with every job of :func:`intervals`; ``retention``
    runs at once when steps were interrupted or ``prompt`` (new checkpoints wait for their move)."""
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.jobstores.memory import MemoryJobStore
    from apscheduler.schedulers.background import BackgroundScheduler

    # misfire_grace_time=None: a run that starts late (waiting for the one worker behind the
    # other job, or a scheduler thread woken late on a loaded machine) still runs; coalesce
    # folds every run time missed meanwhile into that one. With a grace time, a pass queued
    # behind a pass longer than the grace was dropped on dequeue ("missed by 3s"), and its next
    # run time, due while it sat in the queue, was refused too ("maximum number of running
    # instances"): with 1 s intervals on a loaded machine one job could starve indefinitely.
    scheduler = BackgroundScheduler(
        timezone=UTC,
        jobstores={"default": MemoryJobStore()},
        executors={"default": ThreadPoolExecutor(max_workers=1), "scrub": ThreadPoolExecutor(max_workers=1)},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
    )
    now = datetime.now(UTC)
    for job_id, interval in intervals(settings).items():
        if job_id == "rescan":
            first = now + timedelta(seconds=interval)
        elif job_id == "retention" and (journal_pending or prompt):
            first = now
        else:
            first = now + timedelta(seconds=min(interval, FIRST_RUN_DELAY[job_id]))
        add_job(scheduler, job_id, interval, job_function, first)
    return scheduler


def add_job(
    scheduler: Any, job_id: str, interval: float, job_function: Callable[[str], Any], first: datetime | None
) -> None:
    scheduler.add_job(
        job_function(job_id),
        "interval",
        seconds=interval,
        id=job_id,
        name=job_id,
        next_run_time=first,
        executor=OWN_WORKER.get(job_id, "default"),
    )


def reschedule(scheduler: Any, old: Settings, new: Settings, job_function: Callable[[str], Any]) -> None:
    """Config reload: apply changed intervals; add or remove a job turned on or off."""
    before, after = intervals(old), intervals(new)
    for job_id in JOB_IDS:
        if before.get(job_id) == after.get(job_id):
            continue
        if job_id not in after:
            scheduler.remove_job(job_id)
            log.info("job turned off", job=job_id)
        elif job_id not in before:
            first = datetime.now(UTC) + timedelta(
                seconds=min(after[job_id], FIRST_RUN_DELAY.get(job_id, 0.0))
            )
            add_job(scheduler, job_id, after[job_id], job_function, first)
            log.info("job turned on", job=job_id, interval=format_duration(after[job_id]))
        else:
            scheduler.reschedule_job(job_id, trigger="interval", seconds=after[job_id])
            log.info("job rescheduled", job=job_id, interval=format_duration(after[job_id]))
