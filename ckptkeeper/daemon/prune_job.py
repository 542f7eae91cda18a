"""The daemon's ``retention`` and ``reap`` jobs: one prune pass, as the daemon runs it.

A mixin of :class:`ckptkeeper.daemon.service.Daemon`, kept in its own module so the service stays
readable. The order of a pass is the point:

1. the shared filesystem tiers' leases first (:func:`ckptkeeper.actions.sharedfs.take_shared`),
   so a pass right after a takeover catalogs only after the previous holder stopped;
2. then the catalog, synced here under the watcher's reconcile lock (a full walk while deletes are
   held after an index rebuild);
3. then :func:`ckptkeeper.actions.prune.run_prune` without a walk of its own (``rescan=False``);
4. then a re-check of exactly what the executor touched, and pin objects stored in the tiers.

Like the service, it imports the actions only inside the job (see the service's module doc).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ckptkeeper.actions.errors import EXIT_OK, Locked
from ckptkeeper.config import Settings
from ckptkeeper.hook.protocol import STAGING_MARK
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


def _run_of(path: str | None, run_depth: int) -> str | None:
    """The run a hot-tier path (relative to the root) lies in; None above run depth or in a
    hidden/staging directory that no reconcile treats as a run."""
    parts = (path or "").split("/")
    if len(parts) <= run_depth or any(p in ("", ".", "..") for p in parts):
        return None
    if any(p.startswith(".") or STAGING_MARK in p for p in parts[:run_depth]):
        return None
    return "/".join(parts[:run_depth])


class PruneJob:
    """The prune job of the daemon; :class:`~ckptkeeper.daemon.service.Daemon` provides the
    attributes declared here (read at the moment each step uses them, as a reload may swap them)."""

    settings: Settings
    index: Index | None
    watcher: Watcher | None
    metrics: Metrics | None
    stopping: threading.Event

    def _prune(self, job: str, kinds: tuple[str, ...]) -> str | None:
        from ckptkeeper.actions.pins import store_missing_pins
        from ckptkeeper.actions.prune import run_prune
        from ckptkeeper.actions.sharedfs import take_shared

        if self.watcher is None or self.index is None:
            return "the hot tier is not being watched (see the watcher errors above)"
        # Shared filesystem tiers: the lease first, then the catalog (as the CLI's pass does), so a
        # pass right after a takeover never plans from what the previous holder changed since.
        shared = take_shared(self.settings)
        # Reconcile here, under the watcher's reconcile lock, rather than inside run_prune where it
        # could interleave with a watcher reconcile of the same run (hence rescan=False). A sync, not
        # a full walk, while the watcher vouches for the index (Watcher.sync): re-parsing 10k
        # unchanged checkpoints every pass was most of an idle daemon's CPU.
        if self._deletes_held():
            synced = self.watcher.reconcile_all()  # a rebuilt index waits on full listings of every tier
            hot_reconcile = "full"
        else:
            synced = self.watcher.sync()
            hot_reconcile = "full" if self.watcher.last_sync_full else "runs"
        try:
            outcome = run_prune(
                self.settings,
                self.index,
                kinds=kinds,
                rescan=False,
                lock_timeout=EXECUTOR_LOCK_WAIT,
                stop=self.stopping,
                shared=shared,
            )
        except Locked as exc:
            # Our executor never started; the other process's changes raise events of their own.
            log.info("prune skipped: another process holds the executor lock", job=job, detail=str(exc))
            return f"skipped: {exc}"
        except Exception:
            # Failed part-way: which paths it touched is unknown, so walk everything.
            self.watcher.request_full()
            raise
        self._resync_after(outcome)
        try:
            store_missing_pins(self.settings, self.index, self.watcher.catalog.tier_pins)
        except Exception:  # best effort, retried next pass; the prune itself is done
            log.exception("cannot store pin objects in the tiers", job=job)
        if self.metrics is not None:
            self.metrics.record_outcome(outcome)
        log.info(
            "prune done",
            job=job,
            exit_code=outcome.exit_code,
            actions=len(outcome.plan.actions),
            failed=len(outcome.failed),
            reclaimed_bytes=outcome.reclaimed_bytes,
            hot_reconcile=hot_reconcile,
            reconciled_runs=synced.runs,
        )
        for line in outcome.failed:
            log.error("prune action failed", job=job, detail=line)
        if outcome.exit_code == EXIT_OK:
            return None
        if outcome.failed:
            return f"{len(outcome.failed)} action(s) failed; first: {outcome.failed[0]}"
        if outcome.held:
            return "policy held: " + "; ".join(t.describe() for t in outcome.held.values())
        if outcome.plan.refused:
            return f"refused by a guard: {outcome.plan.refused}"
        return f"prune exited with code {outcome.exit_code}"

    def _deletes_held(self) -> bool:
        from ckptkeeper.actions.index import read_hold

        try:
            return read_hold(self.settings) is not None
        except Exception:
            return True  # cannot tell: the full reconcile is the safe choice

    def _resync_after(self, outcome: PruneOutcome) -> None:
        """Re-check what the executor touched, and only that: each run whose hot copies it changed
        (queued on the watcher, which also hears the deletes), and each slower tier it wrote to.

        The executor records its own moves in the index; this catches what it could not know (a
        half-done step, a tier that changed under it). run_prune does no walk of its own for us
        (``rescan=False``). Recovered journal steps, or a hot-tier action that maps to no run,
        fall back to reconciling every tier.
        """
        assert self.watcher is not None
        result = outcome.result
        if result is None:
            return
        hot = self.settings.hot.name
        actions = [*result.done, *(a for a, _ in result.failed)]
        runs: set[str] = set()
        full = bool(result.recovered)
        for a in actions:
            if hot not in (a.tier, a.to_tier):
                continue
            run = a.run if a.run is not None else _run_of(a.path, self.watcher.run_depth)
            if run is None:
                full = True
            else:
                runs.add(run)
        if full:
            self.watcher.request_full()
        else:
            for run in sorted(runs):
                self.watcher.request(run)
        slower = {t for a in actions for t in (a.tier, a.to_tier) if t is not None and t != hot}
        for tier in self.settings.tiers[1:]:
            if full or tier.name in slower:
                self.watcher.catalog.reconcile_tier(tier.name)
