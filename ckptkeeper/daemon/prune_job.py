"""The daemon's ``retention`` and ``reap`` jobs: the prune pass
(:func:`ckptkeeper.actions.prune.run_prune`), with the watcher's catalog.

A mixin of :class:`ckptkeeper.daemon.service.Daemon`, kept in its own module so the service stays
readable. The pass is the CLI's, phase for phase; the daemon chooses only its catalog
(:class:`~ckptkeeper.actions.pruning.catalog.WatcherSync`): a sync under the watcher's reconcile
lock (a full walk while deletes are frozen after an index rebuild), the new checkpoints the watcher
held for their move copied while hashed (:mod:`ckptkeeper.actions.pruning.watched`), and
afterwards a re-check of exactly what the executor touched. A pass that cannot run (another
process holds the executor lock) hashes the held checkpoints in place: none waits for a later one.

Like the service, it imports the actions only inside the job (see the service's module doc).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ckptkeeper.actions.errors import EXIT_OK, Locked
from ckptkeeper.config import Settings
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.actions.prune import PruneOutcome
    from ckptkeeper.daemon.metrics import Metrics
    from ckptkeeper.index import Index
    from ckptkeeper.ingest.watcher import Watcher

__all__ = ["EXECUTOR_LOCK_WAIT", "PruneJob"]

log = get_logger("ckptkeeper.daemon.service")  # the service's logger: its log lines are unchanged

EXECUTOR_LOCK_WAIT = 2.0
"""A manual prune holds the executor lock: skip this round rather than queue behind it."""
HELD_FOLLOW_UPS = 3
"""Passes run at once after one during which the watcher held new checkpoints for their move."""


class PruneJob:
    """The prune job of the daemon; :class:`~ckptkeeper.daemon.service.Daemon` provides the
    attributes declared here (read at the moment each step uses them, as a reload may swap them)."""

    settings: Settings
    index: Index | None
    watcher: Watcher | None
    metrics: Metrics | None
    stopping: threading.Event
    _passing: threading.local

    def _prune(self, job: str, kinds: tuple[str, ...]) -> str | None:
        """One pass; again while the watcher held checkpoints for their move during it (the
        retention job's prompt for them is refused while it runs), at most ``HELD_FOLLOW_UPS``
        times, then they are hashed in place: a held checkpoint never waits for an interval."""
        error = self._one_pass(job, kinds)
        for _ in range(HELD_FOLLOW_UPS):
            if self.stopping.is_set() or self.watcher is None or not self.watcher.catalog.deferred:
                return error
            log.info("checkpoints held while the pass ran: another pass moves them", job=job)
            error = self._one_pass(job, kinds)
        if not self.stopping.is_set():
            self._record_held_in_place()
        return error

    def _one_pass(self, job: str, kinds: tuple[str, ...]) -> str | None:
        from ckptkeeper.actions.prune import run_prune
        from ckptkeeper.actions.pruning.catalog import WatcherSync

        if self.watcher is None or self.index is None:
            return "the hot tier is not being watched (see the watcher errors above)"
        catalog = WatcherSync(self.watcher)
        self._passing.active = True
        try:
            outcome = run_prune(
                self.settings,
                self.index,
                kinds=kinds,
                catalog=catalog,
                lock_timeout=EXECUTOR_LOCK_WAIT,
                stop=self.stopping,
            )
        except Locked as exc:
            # Our executor never started; the other process's changes raise events of their own.
            log.info("prune skipped: another process holds the executor lock", job=job, detail=str(exc))
            self._record_held_in_place()
            return f"skipped: {exc}"
        except Exception:
            # Failed part-way: which paths it touched is unknown, so walk everything.
            self.watcher.request_full()
            raise
        finally:
            self._passing.active = False
        if self.metrics is not None:
            self.metrics.record_outcome(outcome)
        log.info(
            "prune done",
            job=job,
            exit_code=outcome.exit_code,
            actions=len(outcome.plan.actions),
            failed=len(outcome.failed),
            reclaimed_bytes=outcome.reclaimed_bytes,
            hot_reconcile=catalog.hot_reconcile,
            reconciled_runs=catalog.runs,
        )
        for line in outcome.failed:
            log.error("prune action failed", job=job, detail=line)
        return _job_error(outcome)

    def _record_held_in_place(self) -> None:
        """The checkpoints the watcher held for this pass's moves, hashed in place instead."""
        from ckptkeeper.actions.pruning import watched
        from ckptkeeper.ingest.report import ReconcileReport

        watcher, index = self.watcher, self.index
        if watcher is None or index is None:
            return
        with watcher.reconcile_lock:
            held = watched.take_held(watcher.catalog)
            if held:
                log.info("held checkpoints hashed in place: no pass can move them now", count=len(held))
                watched.record_in_place(
                    index, watcher.catalog.settings, held, ReconcileReport(), watcher.request
                )


def _job_error(outcome: PruneOutcome) -> str | None:
    """The job's error for the scheduler's record (None: the pass succeeded)."""
    if outcome.exit_code == EXIT_OK:
        return None
    if outcome.failed:
        return f"{len(outcome.failed)} action(s) failed; first: {outcome.failed[0]}"
    if outcome.held:
        return "policy held: " + "; ".join(t.describe() for t in outcome.held.values())
    if outcome.plan.refused:
        return f"refused by a guard: {outcome.plan.refused}"
    return f"prune exited with code {outcome.exit_code}"
