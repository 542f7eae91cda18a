"""The catalog phase, the one phase the caller chooses: how the index is brought up to date before
the plan, and again after the executor.

* :class:`FullReconcile` (``ckptkeeper prune``): every tier reconciled; afterwards again, once
  something was done (cheap: unchanged checkpoints are not rehashed).
* :class:`WatcherSync` (the daemon): the runs the watcher queued, under its reconcile lock, so no
  reconcile of the same run interleaves (a full walk while deletes are frozen after an index
  rebuild), then the new checkpoints the watcher held for their move, copied while hashed
  (:mod:`.watched`); afterwards exactly what the executor touched.
* :class:`NoCatalog`: the caller keeps the index current itself.

The index's flushes: what a reconcile writes is re-derived from the tiers by the next one, so
``ckptkeeper prune`` commits it without an fsync each (``Index.deferred_flush``; ``kill -9`` loses
none of it). Nothing irreversible waits on it: every step of the executor begins with a durable
journal entry, which flushes every earlier commit with it (the write-ahead log is sequential), and
the close of the index flushes the rest. An idle pass went from 7 flushes to SQLite's own 4: the
header of a new log and its directory at the first commit, the log and the database at the close.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkeeper.actions.index import read_freeze
from ckptkeeper.actions.pruning import hot_once, watched
from ckptkeeper.actions.pruning.state import PassState
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.ingest.catalog import Catalog

if TYPE_CHECKING:
    from ckptkeeper.executor import ExecResult, Progress
    from ckptkeeper.ingest.watcher import Watcher

__all__ = ["CatalogStep", "FullReconcile", "NoCatalog", "WatcherSync"]


class CatalogStep:
    """How a pass catalogs; this base catalogs nothing (:class:`NoCatalog`)."""

    def catalog(self, state: PassState) -> None:
        """Bring ``state.index`` up to date; set ``state.catalog``, ``report`` and ``damaged``."""

    def after_execute(self, state: PassState, result: ExecResult) -> None:
        """Make the index reflect what the executor did (it records its own moves; this catches
        what it could not know: a half-done step, a tier that changed under it)."""


class NoCatalog(CatalogStep):
    pass


class FullReconcile(CatalogStep):
    def __init__(self, progress: Progress | None = None) -> None:
        self.progress = progress
        """Shown while a new checkpoint is copied as it is hashed (:mod:`.hot_once`)."""

    def catalog(self, state: PassState) -> None:
        defer = hot_once.applies(state)  # new checkpoints moved this pass: hashed while copied
        clock = state.file_clocks().hot  # read only in a dry run
        state.catalog = Catalog(state.settings, state.index, defer_new=defer, clock=clock)
        with state.index.deferred_flush():  # see "The index's flushes" below
            state.report = state.catalog.reconcile()
        if defer:
            hot_once.resolve(state, state.catalog, state.report, progress=self.progress)
        state.damaged = state.report.damaged

    def after_execute(self, state: PassState, result: ExecResult) -> None:
        if result.done or result.failed:
            with state.index.deferred_flush():
                Catalog(state.settings, state.index, clock=state.file_clocks().hot).reconcile()


def _run_of(path: str | None, run_depth: int) -> str | None:
    """The run a hot-tier path (relative to the root) lies in; None above run depth or in a
    hidden/staging directory that no reconcile treats as a run."""
    parts = (path or "").split("/")
    if len(parts) <= run_depth or any(p in ("", ".", "..") for p in parts):
        return None
    if any(p.startswith(".") or STAGING_MARK in p for p in parts[:run_depth]):
        return None
    return "/".join(parts[:run_depth])


class WatcherSync(CatalogStep):
    """The daemon's catalog: as cheap as the watcher can vouch for (:meth:`Watcher.sync`):
    re-parsing 10k unchanged checkpoints every pass was most of an idle daemon's CPU."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.hot_reconcile = "none"
        """``full`` or ``runs``: how the hot tier was reconciled (for the log)."""
        self.runs = 0
        """Runs the sync reconciled (for the log)."""

    def catalog(self, state: PassState) -> None:
        if _deletes_frozen(state):
            report = self.watcher.reconcile_all()  # a rebuilt index waits on full listings of every tier
            self.hot_reconcile = "full"
        else:
            report = self.watcher.sync()
            self.hot_reconcile = "full" if self.watcher.last_sync_full else "runs"
        self.runs = report.runs
        with self.watcher.reconcile_lock:
            held = watched.take_held(self.watcher.catalog)
        watched.resolve_held(state, held, report, self.watcher.request)
        state.catalog, state.report = self.watcher.catalog, report

    def after_execute(self, state: PassState, result: ExecResult) -> None:
        """Re-check what the executor touched, and only that: each run whose hot copies it changed
        (queued on the watcher, which also hears the deletes), and each slower tier it wrote to.
        Recovered journal steps, or a hot-tier action that maps to no run, fall back to
        reconciling every tier."""
        hot = state.settings.hot.name
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
        for tier in state.settings.tiers[1:]:
            if full or tier.name in slower:
                self.watcher.catalog.reconcile_tier(tier.name)


def _deletes_frozen(state: PassState) -> bool:
    try:
        return read_freeze(state.settings) is not None
    except Exception:
        return True  # cannot tell: the full reconcile is the safe choice
