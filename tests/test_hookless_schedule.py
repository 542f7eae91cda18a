"""Runs written without the hook: their state is re-derived when the clock says it changes, not on
every daemon pass (issue 17).

A hookless run is ``active`` until ``failed_after`` past its newest write and ``stale`` after; the
catalog records that time per run and the watcher's pre-pass sync re-reads a run only once it has
come. Real inotify, a real Catalog and Index, real files; only the catalog's clock is injected, and
the cost is counted through a seam (directory listings and layout scans), never timed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from layout_fixtures import make_hf  # tests/ is on sys.path (pytest prepend mode)

from ckptkeeper.actions.prune import run_prune
from ckptkeeper.config import Settings, settings_from_mapping
from ckptkeeper.core.reaper import RunFacts, derive_run_state, run_state_changes_at
from ckptkeeper.index import Index
from ckptkeeper.ingest import layouts
from ckptkeeper.ingest.catalog import Catalog
from ckptkeeper.ingest.watcher import Watcher

FAILED_AFTER = 3600.0
HOST = "node-a"

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")


# -- the pure rule ----------------------------------------------------------------------------------


def facts(**kw: Any) -> RunFacts:
    base: dict[str, Any] = {
        "hook_state": None,
        "host": None,
        "pid": None,
        "pid_alive": None,
        "heartbeat": None,
        "newest_write": 1000.0,
    }
    return RunFacts(**{**base, **kw})


def test_a_hookless_run_changes_state_exactly_when_the_rule_says() -> None:
    f = facts()
    due = run_state_changes_at(f, now=1000.0 + 10, failed_after=FAILED_AFTER)
    assert due == 1000.0 + FAILED_AFTER
    # The verdict is the same at every moment before the returned time, and at it (strictly older)...
    for now in (1000.0, 1000.0 + 10, due - 1, due):
        assert derive_run_state(f, this_host=HOST, now=now, failed_after=FAILED_AFTER)[0].value == "active"
    # ... and differs right after it, from when on the clock never changes it again.
    after = math.nextafter(due, math.inf)
    assert derive_run_state(f, this_host=HOST, now=after, failed_after=FAILED_AFTER)[0].value == "stale"
    assert run_state_changes_at(f, now=after, failed_after=FAILED_AFTER) is None


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"hook_state": "finished"}, None),
        ({"hook_state": "failed"}, None),
        ({"hook_state": "active"}, "now"),  # run.json says active: pid / heartbeat decide, unseen
        ({"pid": 42, "pid_alive": True}, "now"),  # a process can die without an event
        ({"heartbeat": 990.0}, "now"),  # heartbeats raise no events
        ({"hook_state": "weird"}, "now"),
    ],
)
def test_anything_that_changes_unseen_is_rederived_every_pass(
    kw: dict[str, Any], expected: str | None
) -> None:
    got = run_state_changes_at(facts(**kw), now=5000.0, failed_after=FAILED_AFTER)
    assert got == (5000.0 if expected == "now" else None)


# -- the catalog and watcher keep the schedule ------------------------------------------------------


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.hot = tmp_path / "hot"
        self.warm = tmp_path / "warm"
        self.hot.mkdir()
        self.warm.mkdir()
        self.settings: Settings = settings_from_mapping(
            {
                "index": str(tmp_path / "index.db"),
                "max_delete": 100000,
                "daemon": {"settle_seconds": 1.0, "trust_mtimes": True, "metrics_addr": ""},
                "reaper": {"failed_after": FAILED_AFTER},
                "tiers": [{"name": "hot", "url": str(self.hot)}, {"name": "warm", "url": str(self.warm)}],
            }
        )
        self.index = Index(self.settings.index)
        self.now = time.time()
        self.catalog = Catalog(self.settings, self.index, clock=lambda: self.now)

    def run_state(self, run: str) -> str:
        row = self.index.run(run)
        assert row is not None, run
        return row.state.value


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.index.close()


def hookless_run(env: Env, run: str, steps: tuple[int, ...], written: float) -> float:
    """HF checkpoints without ``.ckptkeeper/``, every file and dir last written at ``written``."""
    for step in steps:
        make_hf(env.hot / run, step)
    for p in [*(env.hot / run).rglob("*"), env.hot / run]:
        os.utime(p, (written, written))
    return written


def count_reads(env: Env, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """From here on, record each layout scan of a run and each directory listed under the hot root."""
    seen: dict[str, list[str]] = {"scans": [], "listings": []}
    real_scan, real_scandir = layouts.scan_run, os.scandir
    hot = str(env.hot)

    def scan_run(run_dir: Path, run: str) -> Any:
        seen["scans"].append(run)
        return real_scan(run_dir, run)

    def scandir(path: Any = ".") -> Any:
        if isinstance(path, str | os.PathLike) and os.fspath(path).startswith(hot):
            seen["listings"].append(os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(layouts, "scan_run", scan_run)
    monkeypatch.setattr(os, "scandir", scandir)
    return seen


def started(env: Env) -> Watcher:
    w = Watcher(env.catalog)
    w.start(initial_reconcile=True)
    assert w.wait_idle(5.0)
    assert w.trusted
    return w


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_hookless_run_turns_stale_exactly_when_its_clock_says(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = hookless_run(env, "quiet", (100, 200), env.now - 600)
    w = started(env)
    try:
        due = written + FAILED_AFTER
        assert env.run_state("quiet") == "active"
        assert env.catalog.state_due("quiet") == due
        reads = count_reads(env, monkeypatch)

        env.now = due - 1  # an hour of passes: nothing to re-derive, nothing re-read
        w.sync()
        assert not w.last_sync_full
        assert reads["scans"] == [] and env.run_state("quiet") == "active"

        env.now = due  # its time has come: re-read; at exactly failed_after it is still active
        w.sync()
        assert reads["scans"] == ["quiet"] and env.run_state("quiet") == "active"

        env.now = due + 1  # one second later it is stale — planned on by the same pass
        w.sync()
        assert reads["scans"] == ["quiet", "quiet"] and env.run_state("quiet") == "stale"
        assert env.catalog.state_due("quiet") == math.inf

        env.now = due + 86400  # stale stays stale with the clock alone: never re-read
        w.sync()
        assert reads["scans"] == ["quiet", "quiet"]

        # A write under the run raises an event: the next pass sees it active again.
        new = make_hf(env.hot / "quiet", 300)
        for p in [*new.rglob("*"), new]:
            os.utime(p, (env.now - 10, env.now - 10))  # written "now" by the injected clock
        assert wait_for(lambda: "quiet" in w.pending_runs() or w.stats.reconcile_count("quiet") > 0, 5.0)
        w.sync()
        assert env.run_state("quiet") == "active"
    finally:
        w.stop()


def test_steady_state_pass_over_unchanged_hookless_runs_reads_none_of_them(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = [f"run-{i}" for i in range(6)]
    for i, run in enumerate(runs):
        # Half active (written 10 min ago), half stale (written 2 days ago): both clock-dependent.
        hookless_run(env, run, (100, 200, 300), env.now - (600 if i % 2 else 2 * 86400))
    w = started(env)
    try:
        states = {run: env.run_state(run) for run in runs}
        assert sorted(states.values()) == ["active"] * 3 + ["stale"] * 3
        # The first reap pass reaps the stale runs down to their newest checkpoint (and queues them).
        for kinds in (("retention",), ("reap",)):
            w.sync()
            run_prune(env.settings, env.index, kinds=kinds, rescan=False, now=lambda: env.now)
        assert wait_for(lambda: not w.pending_runs() and w.idle, 5.0)
        w.sync()
        reads = count_reads(env, monkeypatch)
        env.now += 60  # the next passes, a minute later: nothing written, no state due
        for kinds in (("retention",), ("reap",), ("retention",)):
            synced = w.sync()
            outcome = run_prune(env.settings, env.index, kinds=kinds, rescan=False, now=lambda: env.now)
            assert not outcome.plan.actions
            assert synced.runs == 0 and not w.last_sync_full
        assert reads["scans"] == []
        # The root itself is listed once a pass (sweep_scratch looks for a dead preflight's scratch
        # there); no run directory is.
        assert set(reads["listings"]) <= {str(env.hot)}, reads["listings"][:5]
        assert {run: env.run_state(run) for run in runs} == states
        assert all(len(env.index.checkpoints(run)) == (3 if states[run] == "active" else 1) for run in runs)
    finally:
        w.stop()


def test_the_hook_arriving_in_a_hookless_run_is_seen_without_a_full_walk(env: Env) -> None:
    hookless_run(env, "resumed", (100,), env.now - 2 * 86400)
    w = started(env)
    try:
        assert env.run_state("resumed") == "stale"
        assert env.catalog.state_due("resumed") == math.inf
        # The hook creates its directory (an event the watcher otherwise ignores), then heartbeats:
        # heartbeats raise nothing, so from now on the run must be re-derived on every pass.
        before = w.stats.reconcile_count("resumed")
        (env.hot / "resumed" / ".ckptkeeper").mkdir()
        assert wait_for(
            lambda: "resumed" in w.pending_runs() or w.stats.reconcile_count("resumed") > before, 5.0
        )
        w.sync()
        assert env.catalog.state_due("resumed") == env.now
        (env.hot / "resumed" / ".ckptkeeper" / "heartbeat").write_text("")
        os.utime(env.hot / "resumed" / ".ckptkeeper" / "heartbeat", (env.now, env.now))
        w.sync()
        assert not w.last_sync_full
        assert env.run_state("resumed") == "active"
    finally:
        w.stop()


def test_a_touch_only_change_to_a_stale_hookless_run_is_seen_at_the_hourly_rescan(env: Env) -> None:
    """README (issue 17, the price): attribute-only events are filtered, so a stale hookless run
    whose files are only touched stays stale until the next whole-tree rescan (the daemon's hourly
    ``rescan`` job), which then sees the new mtime and the run as active again."""
    hookless_run(env, "touched", (100, 200), env.now - 2 * 86400)
    w = started(env)
    try:
        assert env.run_state("touched") == "stale"
        newest = env.hot / "touched" / "checkpoint-200" / "trainer_state.json"
        assert newest.is_file()
        os.utime(newest, (env.now - 5, env.now - 5))  # a touch: no data written, no event kept
        assert w.wait_idle(5.0)
        w.sync()
        assert not w.last_sync_full and env.run_state("touched") == "stale"
        w.request_full()  # what the hourly rescan job queues
        w.sync()
        assert w.last_sync_full and env.run_state("touched") == "active"
        assert env.catalog.state_due("touched") == env.now - 5 + FAILED_AFTER
    finally:
        w.stop()
