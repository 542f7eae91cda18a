"""Hot bytes read once per move: a checkpoint that ``prune`` sees for the first time and moves out
of the hot tier in the same pass is hashed while it is copied, not read once to be hashed by the
catalog and again to be copied.

How (every step keeps a manifest's hashes exact; nothing unhashed reaches the index or a tier):

1. The catalog leaves new complete checkpoints unhashed and unrecorded, with a fingerprint of
   each file (:attr:`Catalog.defer_new`, :mod:`ckptkeeper.util.fingerprint`).
2. What-if: in a private in-memory copy of the index, those are recorded with placeholder hashes
   and the planner runs with this pass's policy and clock. The ones it copies out of the hot tier
   to one unshared tier, local on another filesystem (a plain copy: a same-filesystem move is a
   rename and reads nothing) or S3 (uploaded from the bytes read and hashed, docs/uploads.md),
   are the ones worth hashing on the way.
3. Each of those is copied by the executor (journaled), hashing every byte as it is copied and
   checking each file's fingerprint before its first byte is read and after the last, and again
   before the commit: a file changed since the catalog saw it fails the copy. The manifest
   committed beside the copy, and recorded in the index with both locations in one transaction,
   carries the hashes computed.
4. Every other deferred checkpoint (and one whose copy failed) is hashed in place, as before.

All of it happens in the catalog phase, so the plan that follows sees every checkpoint hashed,
those already copied included: it deletes their hot copies through the executor as any move's
(re-check of the survivor, journal), or keeps them. The what-if only decides which checkpoints
to hash on the way; a copy the real plan would not have made is a verified extra copy, never a
loss. Not used in a dry run, nor with a shared tier (its lease decides who copies).
"""

from __future__ import annotations

import contextlib
import functools
import os

from ckptkeeper.actions.pruning.planning import _plan, one_per_step
from ckptkeeper.actions.pruning.state import PassState
from ckptkeeper.actions.status import tier_usage
from ckptkeeper.core.model import Action, ActionKind, Plan
from ckptkeeper.executor import Executor, Progress
from ckptkeeper.ingest.catalog import Catalog, Deferred
from ckptkeeper.ingest.report import ReconcileReport
from ckptkeeper.storage import LocalTierStorage, StorageError, TierStorage
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.pruning.hot_once")

__all__ = ["applies", "copies_now", "resolve"]


def applies(state: PassState) -> bool:
    """Whether a pass defers hashing: a real pass, no shared tier, and a slower tier that can hash
    on the way: local on another filesystem than the hot tier (on the same one a move is a
    rename: nothing is read), or S3 (:func:`_hashes_on_the_way`)."""
    tiers = state.settings.tiers
    if state.dry_run or any(t.shared for t in tiers) or "retention" not in state.kinds:
        return False
    try:
        hot = os.stat(tiers[0].local_path).st_dev
    except OSError:
        return False
    for tier in tiers[1:]:
        if tier.dedup:  # a content store is keyed by hash: hashed first
            continue
        if not tier.is_local:
            if _s3_hashes_on_the_way(tier.compression):
                return True
            continue
        with contextlib.suppress(OSError):
            if os.stat(tier.local_path).st_dev != hot:
                return True
    return False


def _s3_hashes_on_the_way(compression: str) -> bool:
    """An S3 tier uploads the bytes it hashes (no second read of the file) unless it compresses:
    then what it sends is a spool of frames, and a file not worth compressing is read again."""
    return compression == "none"


def resolve(
    state: PassState, catalog: Catalog, report: ReconcileReport, *, progress: Progress | None = None
) -> None:
    """Record every checkpoint ``catalog`` deferred: hashed while moved when the plan moves it,
    hashed in place otherwise. Always records them all (a failure of one step falls back to
    hashing in place), so the plan sees every checkpoint the catalog found."""
    pending = list(catalog.deferred)
    catalog.deferred.clear()
    if not pending:
        return
    copies: dict[str, Action] = {}
    try:
        copies = _what_if_copies(state, catalog, pending)
    except Exception as exc:  # a what-if that fails costs a second read, nothing else
        log.warning("cannot tell which new checkpoints move; hashing them in place", error=str(exc))
    settings = state.settings
    executor = Executor(
        state.index, settings.tier_specs(), progress=progress, trust_mtimes=settings.daemon.trust_mtimes
    )
    for d in pending:
        action = copies.get(d.path)
        stopped = state.stop is not None and state.stop.is_set()
        if action is not None and not stopped:
            log.info("copying a new checkpoint while hashing it", path=d.path, to_tier=action.to_tier)
            try:
                # the reconcile lock first, as every reconcile takes it (the record joins the
                # executor's transaction and takes it again)
                with state.index.reconcile_lock:
                    executor.copy_hashing(
                        action,
                        catalog.unhashed_manifest(d),
                        d.fingerprints,
                        functools.partial(catalog.record_deferred, d, report=report),
                    )
                continue
            except (StorageError, OSError) as exc:
                log.warning(
                    "copy while hashing failed; hashed in place, the plan decides again",
                    path=d.path,
                    to_tier=action.to_tier,
                    error=str(exc),
                )
        catalog.record_deferred(d, None, report=report)


def copies_now(state: PassState, catalog: Catalog, pending: list[Deferred]) -> dict[str, Action]:
    """Which of ``pending`` a pass would copy out of the hot tier now, hashing on the way (the
    what-if of :func:`resolve`; the daemon's watcher asks it when a checkpoint settles)."""
    return _what_if_copies(state, catalog, pending)


def _what_if_copies(state: PassState, catalog: Catalog, pending: list[Deferred]) -> dict[str, Action]:
    """Deferred path -> the one copy out of the hot tier the planner would make of it now, when
    that copy can hash on the way (an unshared tier: local on another filesystem, or S3)."""
    settings = state.settings
    hot = settings.hot.name
    with state.index.in_memory_copy() as scratch:
        what_if, scratch_report = Catalog(settings, scratch), ReconcileReport()
        for d in pending:  # placeholders, in the scratch copy only
            what_if.record_deferred(d, catalog.unhashed_manifest(d), report=scratch_report)
        snapshot, _ = one_per_step(scratch.snapshot([t.name for t in settings.tiers], node=settings.node))
    plan: Plan = _plan(state, settings.tier_specs(), tier_usage(settings), snapshot)
    wanted = {d.path for d in pending}
    from_hot: dict[str, list[Action]] = {}
    for a in plan.actions:
        if a.action is ActionKind.COPY and a.tier == hot and a.path in wanted:
            from_hot.setdefault(a.path, []).append(a)
    executor = Executor(state.index, settings.tier_specs())
    src = executor.storage(hot)
    out: dict[str, Action] = {}
    for path, actions in from_hot.items():
        if len(actions) != 1 or actions[0].to_tier is None:
            continue  # another copy reads the hot bytes anyway: the catalog hashes them
        dst = executor.storage(actions[0].to_tier)
        if _hashes_on_the_way(src, dst):
            out[path] = actions[0]
    return out


def _hashes_on_the_way(src: TierStorage, dst: TierStorage) -> bool:
    """Can a copy from ``src`` (the hot tier) to ``dst`` hash each byte it reads on the way? Not
    into a dedup tier (keyed by hash), nor a shared one (its lease decides who copies)."""
    if not isinstance(src, LocalTierStorage) or dst.spec.dedup or dst.spec.shared:
        return False
    if isinstance(dst, LocalTierStorage):
        return not dst.same_filesystem(src)
    return not dst.is_local and _s3_hashes_on_the_way(dst.spec.compression)
