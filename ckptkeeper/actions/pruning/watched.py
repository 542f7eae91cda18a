"""Hot bytes read once per move, on the daemon's watched hot tier (:mod:`.hot_once` is the how).

``ckptkeeper prune`` catalogs and moves in one pass. The daemon catalogs when its watcher sees a
checkpoint settle (or its hook commit) and moves in a later pass; hashing at the first and copying
at the second read every byte twice. So the watcher's catalog leaves new complete checkpoints
unhashed (``Catalog(defer_new=True)``, fingerprints taken) and, after each of its reconciles,
:func:`triage` asks the same what-if as ``prune`` (:func:`hot_once.copies_now`):

* a checkpoint no pass would copy out of hot now is hashed in place at once, as before (verify and
  scrub need its hashes; ``ls`` shows it as soon as before);
* one a pass would copy now is *held*: left unrecorded in ``catalog.deferred``, and the daemon
  asks for a retention pass at once. That pass's catalog phase (:func:`resolve_held`) gives it to
  :func:`hot_once.resolve`, which copies it hashing on the way and records it with both copies in
  one transaction (or hashes it in place when the copy is not made or fails).

Every pass resolves every held checkpoint before it plans (a reap pass too, and one that cannot
run records them in place: :func:`record_in_place`), so no plan ever sees the index without a
checkpoint the watcher found complete, and nothing unhashed reaches the index or a tier. A held
checkpoint is checked again before it is resolved: one recorded meanwhile (by a manual ``prune``)
is left alone; one whose files changed or went (a fingerprint moved) is dropped and its run
reconciled afresh. The price is visibility: a held checkpoint shows in ``ls`` once the pass that
copies it has done so (docs/operating.md), not when it settled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ckptkeeper.actions.pruning import hot_once
from ckptkeeper.actions.pruning.state import PassState
from ckptkeeper.config import Settings
from ckptkeeper.executor import Progress
from ckptkeeper.index import Index
from ckptkeeper.ingest.catalog import Catalog, Deferred
from ckptkeeper.ingest.deferred import fingerprints
from ckptkeeper.ingest.report import ReconcileReport
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.pruning.hot_once")

__all__ = ["defers", "record_in_place", "resolve_held", "take_held", "triage"]


def defers(settings: Settings, index: Index) -> bool:
    """Whether the watcher's catalog leaves new checkpoints unhashed: when ``prune``'s would."""
    return hot_once.applies(PassState(settings, index, kinds=("retention",)))


def _latest(pending: list[Deferred]) -> list[Deferred]:
    """One per checkpoint, the newest sighting (a run reconciled again re-defers its held ones)."""
    by_path: dict[str, Deferred] = {}
    for d in pending:
        by_path.pop(d.path, None)
        by_path[d.path] = d
    return list(by_path.values())


def triage(settings: Settings, catalog: Catalog, report: ReconcileReport) -> int:
    """After a reconcile of the watcher's catalog (its reconcile lock held): hash in place each
    deferred checkpoint no pass would copy out of hot now; hold the others in ``catalog.deferred``
    for the next pass. Returns how many are held."""
    pending = _latest(catalog.deferred)
    catalog.deferred.clear()
    if not pending:
        return 0
    state = PassState(settings, catalog.index, kinds=("retention",), clock=catalog.clock)
    state.observed = state.clock()
    copies: dict[str, object] = {}
    try:
        copies = dict(hot_once.copies_now(state, catalog, pending))
    except Exception as exc:  # costs a second read, nothing else
        log.warning("cannot tell which new checkpoints move; hashing them in place", error=str(exc))
    held = [d for d in pending if d.path in copies]
    catalog.deferred.extend(held)  # first: a record below that raises must not lose them
    for d in pending:
        if d.path not in copies:
            catalog.record_deferred(d, None, report=report)
    if held:
        log.info("new checkpoint held for its move: hashed while copied", paths=[d.path for d in held])
    return len(held)


def take_held(catalog: Catalog) -> list[Deferred]:
    """The held checkpoints, taken (the caller holds the watcher's reconcile lock)."""
    held = _latest(catalog.deferred)
    catalog.deferred.clear()
    return held


def _current(index: Index, held: list[Deferred], request: Callable[[str], None]) -> list[Deferred]:
    """Those of ``held`` still unrecorded with the files the watcher saw; the run of any other is
    reconciled afresh (``request``)."""
    out = []
    for d in held:
        row = index.checkpoint(d.cand.run, d.cand.name)
        if row is not None and row.version is not None:
            continue  # recorded meanwhile (a manual prune cataloged it): nothing to do
        if fingerprints(d.run_dir / d.cand.name, d.cand.files) != d.fingerprints:
            log.info("held checkpoint changed since it settled; cataloged afresh", path=d.path)
            request(d.cand.run)
            continue
        out.append(d)
    return out


def resolve_held(
    state: PassState,
    held: list[Deferred],
    report: ReconcileReport,
    request: Callable[[str], None],
    *,
    progress: Progress | None = None,
) -> None:
    """A pass's catalog phase: record every held checkpoint, copying the ones this pass moves
    while hashing them (:func:`hot_once.resolve`), hashing the others in place. A reap pass
    resolves them too, as retention would (a copy made early is a verified extra copy)."""
    held = _current(state.index, held, request)
    if not held:
        return
    catalog = Catalog(state.settings, state.index)
    catalog.deferred.extend(held)
    as_retention = dataclasses.replace(state, kinds=("retention",))
    if hot_once.applies(as_retention):
        hot_once.resolve(as_retention, catalog, report, progress=progress)
    else:
        record_in_place(state.index, state.settings, held, report, request)


def record_in_place(
    index: Index,
    settings: Settings,
    held: list[Deferred],
    report: ReconcileReport,
    request: Callable[[str], None],
) -> None:
    """Hash each held checkpoint in place and record it (a pass that cannot move them)."""
    catalog = Catalog(settings, index)
    for d in _current(index, held, request):
        catalog.record_deferred(d, None, report=report)
