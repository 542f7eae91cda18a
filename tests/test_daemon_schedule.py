"""The daemon's schedule on a slow machine: a pass that cannot start on time runs late, it is never dropped.

Regression for ``test_faults_crash[007-daemon-time]`` failing under load (load average 4 to 7): with
one worker, a pass due while the other job ran waited in the worker's queue and was dropped when it
got there (APScheduler: "Run time of job … was missed by 3s", ``misfire_grace_time`` = the 1 s
interval); its next run time, due meanwhile, was refused because the dropped one still counted as
running ("maximum number of running instances"). Whenever retention passes outlasted a second, the
reap job never ran, and a restarted daemon never settled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from builders import FAST_DAEMON, local_tier, write_config

from ckptkeeper.actions.index import open_index
from ckptkeeper.config import load_settings
from ckptkeeper.daemon.service import Daemon


def test_a_pass_queued_behind_a_long_pass_runs_late_instead_of_being_dropped(tmp_path: Path) -> None:
    from apscheduler.events import EVENT_JOB_MISSED, EVENT_JOB_SUBMITTED, JobEvent

    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon=FAST_DAEMON,  # retention and reap every second
        tiers=[local_tier("hot", tmp_path / "hot", keep_last=1)],
    )
    settings = load_settings(str(config))
    daemon = Daemon(str(config), settings)
    daemon.index = open_index(settings)
    reap_submitted: list[datetime] = []
    missed: list[str] = []
    reap_ran = threading.Event()
    retention_runs = 0

    def slow_retention() -> None:
        """The first pass outlasts the grace the old schedule gave the reap pass queued behind it."""
        nonlocal retention_runs
        retention_runs += 1
        if retention_runs > 1:
            return
        deadline = time.monotonic() + 30
        while not reap_submitted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reap_submitted, "the reap pass was never submitted while retention ran"
        # Hold the only worker until that reap pass is 2 s late: longer than any 1 s interval's grace.
        while datetime.now(UTC) < reap_submitted[0] + timedelta(seconds=2):
            time.sleep(0.05)

    bodies: dict[str, Callable[[], None]] = {"retention": slow_retention, "reap": reap_ran.set}
    daemon._job_function = lambda job_id: bodies.get(job_id, lambda: None)  # type: ignore[method-assign]

    def listen(event: JobEvent) -> None:
        if event.code == EVENT_JOB_MISSED:
            missed.append(event.job_id)
        elif event.code == EVENT_JOB_SUBMITTED and event.job_id == "reap" and retention_runs == 1:
            reap_submitted.extend(getattr(event, "scheduled_run_times", []) or [datetime.now(UTC)])

    scheduler: Any = daemon._make_scheduler()
    # Retention first, with reap due while it runs (their first runs are both a second out).
    scheduler.modify_job("retention", next_run_time=datetime.now(UTC))
    scheduler.add_listener(listen, EVENT_JOB_SUBMITTED | EVENT_JOB_MISSED)
    scheduler.start()
    try:
        assert reap_ran.wait(30), f"the reap pass never ran (missed: {missed})"
        assert missed == [], f"passes dropped as missed: {missed}"
    finally:
        scheduler.shutdown(wait=True)
        daemon.index.close()
