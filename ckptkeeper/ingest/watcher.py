"""Turn filesystem events under the hot tier into per-run catalog reconciles.

Events are only hints. Each one is mapped to the run it belongs to (the first ``run_depth`` path
components under the hot root) and the run is reconciled from what is on disk — the catalog never
trusts an event's content, so a lost, duplicated or reordered event costs latency, never
correctness. That is also why startup does a full reconcile: whatever happened while the daemon
was down is found by looking, not by replaying.

Scheduling, per run, on ONE worker thread (reconciles of one run must not interleave, and hashing
is disk-bound anyway):

- a write to ``<run>/.ckptkeeper/commits.jsonl`` — the hook's word that a checkpoint is complete —
  reconciles the run immediately (commit -> visible in the index is the latency users feel);
- other writes coalesce: the run is reconciled once it has been quiet for ``quiet`` seconds, or
  ``max_wait`` after the first unprocessed event while a long write keeps it busy;
- a checkpoint whose framework marker is present but that was written less than
  ``settle_seconds`` ago stays ``writing`` (docs/design.md, "Completeness"); the worker re-reconciles the run at
  ``last_write + settle_seconds`` so it turns complete without needing another event;
- the hook's heartbeat, ``run.json`` temp files and our own ``*.ckptkeeper-tmp*`` staging are
  ignored: they change every few seconds or are written by us, and must never cause work storms.
  Run liveness is refreshed by every other write and by the daemon's periodic rescan; missing a
  heartbeat only keeps a run "active" longer, which is the safe direction for a deletion tool.

Trust, and what it saves: after a full reconcile, an inotify watcher that has lost nothing
(no queue overflow, no failed reconcile, observer alive) can vouch for the index — every change
under a run either raised an event that queued the run, or happened before a reconcile that was
scheduled after it. :meth:`Watcher.sync` (the daemon's pre-pass reconcile) then reconciles only the
runs with queued work plus the runs whose state the clock may have changed, instead of re-walking
and re-parsing every checkpoint (10k checkpoints: ~2 CPU-s per walk). Which runs those are, the
catalog records per run when it reconciles it (:meth:`Catalog.state_due`): a run with a pid or a
heartbeat (heartbeats raise no events) can change at any moment and is re-derived on every pass; a
run without the hook turns stale exactly ``failed_after`` after its newest write — a write raises
an event — so it is re-read only once that time has come (10k hookless checkpoints: ~1.1 CPU-s a
pass saved). The hook arriving in such a run (a ``.ckptkeeper/`` directory created) queues it. Anything that breaks the chain — an overflow, a
reconcile error, polling (mtime-granular snapshots), a dead observer, a missing root — marks the
watcher untrusted and the next sync is a full reconcile. What events cannot show at all (e.g. a
change of only an mtime, IN_ATTRIB is filtered) is found by the daemon's periodic ``rescan`` job,
which always reconciles everything: that bounds how long a missed change can go unseen.

Observer choice: inotify by default; a polling observer when ``daemon.polling`` is set (NFS and
Lustre deliver no inotify events for writes made on other nodes), or as a fallback when the kernel's
inotify limits are exhausted — loudly, because a silently unwatched directory is the one failure
mode that costs real latency. ``watchdog`` is imported lazily: only the daemon needs it.
"""

from __future__ import annotations

import errno
import heapq
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkeeper.ingest.events import EventKind, classify_path, hook_dir_created
from ckptkeeper.ingest.observer import HotObserver
from ckptkeeper.ingest.observer import count_inotify_watches as _count_inotify_watches
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.ingest.report import ReconcileReport

__all__ = ["FULL_RESCAN", "EventKind", "Watcher", "WatcherStats", "classify_path"]

log = get_logger("ckptkeeper.ingest.watcher")


FULL_RESCAN = "*"
"""Pseudo run key: reconcile the whole hot tier (events above run depth, lost inotify events)."""

DEFAULT_QUIET = 0.2
DEFAULT_MAX_WAIT = 2.0
SETTLE_MARGIN = 0.05
"""Re-check a settling checkpoint this long after it should have settled (mtime granularity)."""
RETRY_DELAYS = (1.0, 5.0, 30.0)
"""Back-off for a reconcile that raised (e.g. the index was busy); then wait for the next event."""


@dataclass
class WatcherStats:
    events: int = 0
    ignored: int = 0
    reconciles: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    full_rescans: int = 0
    """Walks of the whole hot tier (startup, rescan job, untrusted syncs, queued full rescans)."""

    def reconcile_count(self, run: str | None = None) -> int:
        return self.reconciles.get(run, 0) if run is not None else sum(self.reconciles.values())


@dataclass
class _Pending:
    first_event: float | None = None
    last_event: float | None = None
    urgent: bool = False
    settle_at: float | None = None
    retry_at: float | None = None
    attempts: int = 0

    def due(self, quiet: float, max_wait: float) -> float | None:
        times = []
        if self.urgent:
            times.append(0.0)
        if self.last_event is not None and self.first_event is not None:
            times.append(min(self.last_event + quiet, self.first_event + max_wait))
        if self.settle_at is not None:
            times.append(self.settle_at)
        if self.retry_at is not None:
            times.append(self.retry_at)
        return min(times) if times else None


class Watcher(HotObserver):
    """Watches the hot tier and keeps the index in step with it (see the module docstring).

    ``reconcile_lock`` serialises every reconcile of the hot tier in this process (the worker's and
    the daemon's rescan job): two reconciles of one run that interleave can write an older view
    over a newer one.
    """

    def __init__(
        self,
        catalog: Catalog,
        *,
        quiet: float = DEFAULT_QUIET,
        max_wait: float = DEFAULT_MAX_WAIT,
        on_reconciled: Callable[[str, ReconcileReport], None] | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
        reconcile_lock: threading.Lock | None = None,
        observer_factory: Callable[[bool], Any] | None = None,
        on_deferred: Callable[[Catalog, ReconcileReport], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.on_deferred = on_deferred
        """Called, with ``reconcile_lock`` held, after a reconcile of the hot tier that left new
        checkpoints unhashed in ``catalog.deferred`` (``Catalog(defer_new=True)``): the daemon
        hashes each in place or holds it for the pass that moves it. Without it they are hashed
        in place at once."""
        self.quiet = quiet
        self.max_wait = max_wait
        self.on_reconciled = on_reconciled
        self.on_error = on_error
        self.reconcile_lock = reconcile_lock or threading.Lock()
        self._observer_factory = observer_factory or self._default_observer
        # Watch the resolved path: watchdog adds the root with IN_DONT_FOLLOW, so a hot root that
        # is a symlink (/nvme/checkpoints -> /mnt/nvme0/ckpt) would otherwise watch the link itself.
        # Run names are relative, so they are the same under either spelling of the root.
        self.root = os.path.realpath(catalog.hot_root)
        self.run_depth = catalog.settings.run_depth
        self.polling = False
        self.fallback_reason: str | None = None
        self.stats = WatcherStats()
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._stopping = False
        self._observer: Any = None
        self._worker: threading.Thread | None = None
        self._overflow_handler = None
        self._busy = False
        self.last_sync_full = False
        """Whether the last :meth:`sync` had to walk the whole hot tier (the daemon logs it)."""
        self._full_needed = True
        """Set until a full reconcile starts, and again by anything that may have lost a change."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, initial_reconcile: bool = True) -> None:
        """Start observing, then (optionally) reconcile everything once.

        The observer starts first, so nothing written during the initial reconcile is missed: its
        events queue up and re-reconcile the affected runs afterwards.
        """
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "hot tier root is not a directory", self.root)
        self._stopping = False
        self._start_observer()
        self._worker = threading.Thread(target=self._work, name="ckptkeeper-watcher", daemon=True)
        self._worker.start()
        if initial_reconcile:
            try:
                report = self.reconcile_all()
            except BaseException:
                self.stop()
                raise
            log.info(
                "initial reconcile done",
                runs=report.runs,
                new=report.new,
                rewritten=report.new_versions,
                unchanged=report.unchanged,
                removed=report.removed,
                partial=report.partial,
                tiers_failed=report.tiers_failed or None,
            )

    def stop(self) -> None:
        """Stop and join the observer and the worker. Pending reconciles are dropped on purpose:
        the next start reconciles everything anyway."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._stop_observer()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
        self._worker = None

    def is_alive(self) -> bool:
        """Observer and worker threads both running (the daemon's watchdog ping depends on it)."""
        observer_ok = self._observer is not None and self._observer.is_alive()
        emitters_ok = observer_ok and all(e.is_alive() for e in getattr(self._observer, "emitters", ()))
        return bool(emitters_ok and self._worker is not None and self._worker.is_alive())

    @property
    def idle(self) -> bool:
        """No reconcile running and none due within ``max_wait`` (tests wait for this)."""
        with self._cond:
            if self._busy:
                return False
            now = time.monotonic()
            for p in self._pending.values():
                due = p.due(self.quiet, self.max_wait)
                if due is not None and due <= now + self.max_wait:
                    return False
            return True

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle:
                return True
            time.sleep(0.02)
        return self.idle

    # -- requests --------------------------------------------------------------------------

    def request(self, run: str, *, urgent: bool = False) -> None:
        """Ask for a reconcile of ``run`` (``FULL_RESCAN`` for the whole hot tier)."""
        now = time.monotonic()
        with self._cond:
            p = self._pending.get(run)
            if p is None:
                p = self._pending[run] = _Pending()
            if urgent:
                p.urgent = True
            else:
                if p.first_event is None:
                    p.first_event = now
                p.last_event = now
            self._cond.notify()

    def request_full(self) -> None:
        self.request(FULL_RESCAN)

    def mark_untrusted(self, reason: str) -> None:
        """Something may have changed the hot tier unseen: the next :meth:`sync` reconciles all."""
        if not self._full_needed:
            log.info("hot tier index no longer vouched for; next sync is a full reconcile", reason=reason)
        self._full_needed = True

    @property
    def trusted(self) -> bool:
        """The index matches the hot tier up to the runs queued here (see the module docstring)."""
        return not (self._full_needed or self.polling or not self.is_alive() or not os.path.isdir(self.root))

    def reconcile_all(self, *, slower_tiers: bool = True) -> ReconcileReport:
        """The daemon's rescan: the hot tier under the reconcile lock, slower tiers outside it.

        Listing object storage can take long; holding the lock for it would stall commit indexing,
        and tier reconciles never touch hot-tier locations, so they need no exclusion from us.
        """
        since = self.catalog.clock()  # the clock of the files settling is judged by
        with self.reconcile_lock:
            report = self._reconcile_hot_full()
            self._settle_deferred(report)
        if report.partial:
            self._schedule_settle_checks(None, since)
        if slower_tiers:
            report.merge(self._reconcile_slower_tiers())
        return report

    def sync(self, *, slower_tiers: bool = True) -> ReconcileReport:
        """Bring the index up to date before a prune pass, as cheaply as the watcher can vouch for.

        Trusted (see :attr:`trusted`): reconcile the runs with queued work (events not yet
        debounced, settle checks, retries) and every hot run whose state the clock may have changed
        since it was last reconciled (:meth:`Catalog.state_due`: a run without the hook only once
        ``failed_after`` has passed since its newest write; one with a pid or a heartbeat on every
        pass, since a writer that died sends no event). Otherwise, or when a
        whole-tree rescan is queued: :meth:`reconcile_all`. Runs reconciled here stay queued, so
        the worker still reconciles them (and reports new checkpoints) when they come due.
        """
        from ckptkeeper.core.model import RunState

        with self._cond:
            queued = set(self._pending)
        self.last_sync_full = FULL_RESCAN in queued or not self.trusted
        if self.last_sync_full:
            return self.reconcile_all(slower_tiers=slower_tiers)
        from ckptkeeper.ingest.report import ReconcileReport

        report = ReconcileReport()
        since = self.catalog.clock()  # the clock of the files settling is judged by
        with self.reconcile_lock:
            now = self.catalog.clock()
            live = {
                row.name
                for row in self.catalog.index.runs()
                if row.on_hot
                and row.state not in (RunState.FINISHED, RunState.FAILED)
                and self.catalog.state_due(row.name) <= now
            }
            settling = []
            for run in sorted(queued | live):
                run_report = self.catalog.reconcile_run(run)
                report.merge(run_report)
                if run_report.partial:
                    settling.append(run)
            self._settle_deferred(report)
        for run in settling:
            self._schedule_settle_checks(run, since)
        if slower_tiers:
            report.merge(self._reconcile_slower_tiers())
        return report

    def _reconcile_hot_full(self) -> ReconcileReport:
        """Caller holds ``reconcile_lock``. Trust is restored from the START of the walk: a change
        made during it raises an event of its own (or is seen by the walk)."""
        self._full_needed = False
        self.stats.full_rescans += 1
        try:
            return self.catalog.reconcile_hot()
        except BaseException:
            self._full_needed = True
            raise

    def _settle_deferred(self, report: ReconcileReport) -> None:
        """Caller holds ``reconcile_lock``: what becomes of the checkpoints the catalog deferred
        (:attr:`on_deferred`; hashed in place without it)."""
        if not self.catalog.deferred:
            return
        try:
            if self.on_deferred is not None:
                self.on_deferred(self.catalog, report)
                return
            pending = list(self.catalog.deferred)
            self.catalog.deferred.clear()
            for d in pending:
                self.catalog.record_deferred(d, None, report=report)
        except BaseException:
            # Some may be unrecorded now, and no event will bring them back: look at everything.
            self.mark_untrusted("recording new checkpoints failed")
            raise

    def _reconcile_slower_tiers(self) -> ReconcileReport:
        from ckptkeeper.ingest.report import ReconcileReport

        report = ReconcileReport()
        for tier in self.catalog.settings.tiers[1:]:
            report.merge(self.catalog.reconcile_tier(tier.name))
        return report

    # -- observer (ckptkeeper.ingest.observer) ----------------------------------------------

    def _unwatched_directories(self) -> int:
        """Directories under the root minus inotify watches we hold (0 when it cannot be told).

        watchdog silently skips subdirectories it could not watch (only the root's failure
        raises), so the watch limit is checked here: compare the directory count with the watches
        listed in ``/proc/self/fdinfo`` for our inotify descriptors.
        """
        watches = _count_inotify_watches()
        if watches is None:
            return 0
        dirs = 0
        for _dirpath, _dirnames, _filenames in os.walk(self.root, followlinks=False):
            dirs += 1
            if dirs > watches + 16:
                break
        # Slack: directories created or removed between watchdog's walk and ours.
        return dirs - watches if dirs > watches + 8 else 0

    # -- events (observer thread) ----------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        self.stats.events += 1
        if event.event_type in ("opened", "closed_no_write", "attrib"):
            self.stats.ignored += 1
            return
        paths = [event.src_path]
        dest = getattr(event, "dest_path", "")
        if dest:
            paths.append(dest)
        handled = False
        for raw in paths:
            path = os.fsdecode(raw)
            kind, run = classify_path(self.root, path, self.run_depth)
            if kind is EventKind.IGNORE:
                hooked = hook_dir_created(self.root, path, self.run_depth, event)
                if hooked is not None:
                    self.request(hooked)  # its heartbeats will raise no events: re-derive from now on
                    handled = True
                continue
            if kind is EventKind.TREE:
                if event.is_directory and event.event_type in ("created", "deleted", "moved"):
                    self.request(FULL_RESCAN)
                    handled = True
                continue
            assert run is not None
            if event.event_type == "modified" and event.is_directory:
                # A directory's own mtime change mirrors a create/delete we are told about anyway.
                continue
            self.request(run, urgent=kind is EventKind.COMMIT)
            handled = True
        if not handled:
            self.stats.ignored += 1

    # -- worker ----------------------------------------------------------------------------

    def _next_due(self) -> tuple[float | None, list[str]]:
        """(earliest due time, runs due now — commits first). Caller holds ``_cond``."""
        now = time.monotonic()
        due_now: list[tuple[int, float, str]] = []
        earliest: float | None = None
        for run, p in self._pending.items():
            due = p.due(self.quiet, self.max_wait)
            if due is None:
                continue
            if due <= now:
                heapq.heappush(due_now, (0 if p.urgent else 1, due, run))
            elif earliest is None or due < earliest:
                earliest = due
        return earliest, [heapq.heappop(due_now)[2] for _ in range(len(due_now))]

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    earliest, runs = self._next_due()
                    if runs:
                        break
                    timeout = None if earliest is None else max(0.0, earliest - time.monotonic())
                    self._cond.wait(timeout)
                run = runs[0]
                p = self._pending[run]
                # Clear what this reconcile will cover; a settle check that is not yet due stays.
                now = time.monotonic()
                p.first_event = p.last_event = None
                p.urgent = False
                if p.settle_at is not None and p.settle_at <= now:
                    p.settle_at = None
                if p.retry_at is not None and p.retry_at <= now:
                    p.retry_at = None
                self._busy = True
            try:
                self._reconcile(run)
            finally:
                with self._cond:
                    self._busy = False
                    left = self._pending.get(run)
                    if left is not None and left.due(self.quiet, self.max_wait) is None:
                        del self._pending[run]

    def _reconcile(self, run: str) -> None:
        try:
            with self.reconcile_lock:
                if self._stopping:
                    return
                started, since = time.monotonic(), self.catalog.clock()
                report = self._reconcile_hot_full() if run == FULL_RESCAN else self.catalog.reconcile_run(run)
                self._settle_deferred(report)
            self.stats.reconciles[run] = self.stats.reconciles.get(run, 0) + 1
        except Exception as exc:
            self.stats.errors += 1
            # Retries give up eventually and drop the run: until a full reconcile, it is unknown.
            self.mark_untrusted(f"reconcile of {run} failed: {exc!r}")
            self._retry_later(run, exc)
            if self.on_error is not None:
                self.on_error(run, exc)
            return
        with self._cond:
            p = self._pending.get(run)
            if p is not None:
                p.attempts = 0
        elapsed = time.monotonic() - started
        if run == FULL_RESCAN or report.new or report.new_versions or report.removed or elapsed > 1.0:
            log.info(
                "reconciled",
                run=run,
                new=report.new,
                rewritten=report.new_versions,
                removed=report.removed,
                partial=report.partial,
                seconds=round(elapsed, 3),
            )
        if report.partial:
            self._schedule_settle_checks(None if run == FULL_RESCAN else run, since)
        if self.on_reconciled is not None:
            try:
                self.on_reconciled(run, report)
            except Exception:
                log.exception("on_reconciled callback failed", run=run)

    def _retry_later(self, run: str, exc: BaseException) -> None:
        with self._cond:
            p = self._pending.setdefault(run, _Pending())
            p.attempts += 1
            if p.attempts <= len(RETRY_DELAYS):
                delay = RETRY_DELAYS[p.attempts - 1]
                p.retry_at = time.monotonic() + delay
                log.warning(
                    "reconcile failed, retrying", run=run, error=repr(exc), retry_in=delay, attempt=p.attempts
                )
            else:
                p.attempts = 0
                log.error(
                    "reconcile keeps failing; waiting for the next event or rescan", run=run, error=repr(exc)
                )

    def _schedule_settle_checks(self, run: str | None, since: float) -> None:
        """Re-reconcile runs with ``writing`` checkpoints once they could have settled.

        A checkpoint with its framework marker becomes complete only after ``settle_seconds``
        without writes, and nothing will send an event when that time has passed. ``since`` is the
        wall time the reconcile started: a checkpoint that was already past its settle time then
        is incomplete for another reason (no marker), and re-checking it would only spin. Both are the
        hot filesystem's time (``catalog.clock``), as the file times are.
        """
        settle = self.catalog.settings.daemon.settle_seconds
        # The hot filesystem's clock, which stamped last_write: this node's may be days off it.
        wall_now, mono_now = self.catalog.clock(), time.monotonic()
        try:
            rows = self.catalog.index.checkpoints(run)
        except Exception:
            log.exception("cannot read writing checkpoints for settle checks", run=run)
            return
        soonest: dict[str, float] = {}
        for row in rows:
            if row.state.value != "writing":
                continue
            settles_at = row.last_write + settle  # by mtime and ctime (Catalog._written)
            if settles_at <= since:
                continue  # had settled when the catalog looked: settling is not what keeps it incomplete
            soonest[row.run] = min(soonest.get(row.run, settles_at), settles_at)
        if not soonest:
            return
        with self._cond:
            for r, settles_at in soonest.items():
                at = mono_now + max(0.0, settles_at - wall_now) + SETTLE_MARGIN
                p = self._pending.setdefault(r, _Pending())
                if p.settle_at is None or at < p.settle_at:
                    p.settle_at = at
            self._cond.notify()

    def pending_runs(self) -> Iterable[str]:
        with self._cond:
            return list(self._pending)
