"""Reconcile the slower tiers with the index, from the manifests stored beside each copy.

Every copy in a slower tier carries its manifest, so the index can always be rebuilt from the tiers
alone: a listing records each copy (damaged ones as damaged, never as locations), drops the locations
a tier no longer holds, and reads back the pins stored in the tier. A tier that cannot be listed is
unknown, never empty. Split from ``catalog`` (which walks the hot tier) to keep each module readable;
the catalog is the only caller.
"""

from __future__ import annotations

from ckptkeeper.config import Settings
from ckptkeeper.core.model import MANIFEST_SUFFIX, CheckpointState, Manifest, RunState, TrashEntry
from ckptkeeper.core.preflight import is_scratch_run
from ckptkeeper.index import DAMAGED, SCRUB_PROBLEM, CheckpointRow, Index, Quarantined
from ckptkeeper.ingest.report import HOSTILE, ReconcileReport
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.ingest.tiers")


class SlowerTiers:
    """Applies the slower tiers' listings to the index; the catalog holds one."""

    def __init__(self, settings: Settings, index: Index) -> None:
        self.settings = settings
        self.index = index
        self.tier_pins: dict[str, set[tuple[str, str]]] = {}
        """Pin objects each slower tier held at its last successful listing (for ``pins``)."""
        self.own_copies: dict[str, int] = {}
        """Copies each slower tier held at its last listing whose manifest names this node: they
        prove this node had an index before (a missing one was lost, not never made)."""

    def reconcile_tier(self, tier_name: str) -> ReconcileReport:
        """Sync locations of one slower tier from the manifests stored beside its copies.

        A failed listing marks the tier unknown and keeps every location the index had: a tier we
        cannot read is never taken for an empty one.
        """
        with self.index.reconcile_lock:
            return self._reconcile_tier(tier_name)

    def _reconcile_tier(self, tier_name: str) -> ReconcileReport:
        from ckptkeeper.storage import DAMAGED_COPY, TierStorage, TierUnavailable

        report = ReconcileReport()
        tier = next(t for t in self.settings.tiers if t.name == tier_name)
        try:
            storage = TierStorage(tier.to_spec())
            listing, pins = storage.list_manifests_and_pins()
            uploads = storage.list_multipart_uploads()
            staging = storage.list_staging()
            trash = storage.list_trash()
        except TierUnavailable as exc:
            log.warning(
                "tier listing failed; treating it as unknown (no deletes depend on it)",
                tier=tier_name,
                error=str(exc),
            )
            self.index.set_tier_status(tier_name, False, str(exc))
            report.tiers_failed[tier_name] = str(exc)
            return report
        known = self.index.locations_in_tier(tier_name)
        listed: set[tuple[str, str]] = set()
        held: list[Quarantined] = []

        def quarantine(rel: str, why: str) -> None:
            log.warning("manifest in tier quarantined, copy ignored", tier=tier_name, path=rel, error=why)
            where = rel + MANIFEST_SUFFIX
            held.append(Quarantined(tier_name, where, "manifest", why, run=rel.split("/", 1)[0]))
            report.corrupt += 1

        # A dead preflight's scratch copy is no proof this node had an index (it is swept, not kept).
        self.own_copies[tier_name] = sum(
            1
            for _, m, _ in listing
            if m is not None and m.node == self.settings.node and not is_scratch_run(m.run)
        )
        names: dict[str, set[str]] = {}
        for _, m, _ in listing:
            if m is not None:
                names.setdefault(m.run, set()).add(m.name)
        with self.index.transaction():
            for rel, manifest, error in listing:
                if is_scratch_run(rel) or (manifest is not None and is_scratch_run(manifest.run)):
                    continue  # a preflight's scratch: never a user run (preflight/prune sweep it)
                if manifest is None:
                    quarantine(rel, error or "unreadable")
                    continue
                outer = _outer_copy(manifest, names)
                if outer is not None:
                    # A checkpoint is atomic: a copy of a path inside another checkpoint (cataloged
                    # on its own by a version that took step-3/shard-0.bin for a checkpoint) is never
                    # managed, so never expired through a path that deletes the outer copy's files.
                    quarantine(
                        rel, f"lies inside checkpoint {outer!r}: never managed on its own, never deleted"
                    )
                    continue
                if error is not None:
                    # A manifest over missing or changed data is no copy: recorded as damaged (so
                    # the planner copies it again and `ls`/`verify` say so), never as a location.
                    log.warning("damaged copy in tier: not counted", tier=tier_name, path=rel, error=error)
                    report.damaged[f"{tier_name}:{rel}"] = error
                try:
                    with self.index.savepoint():
                        self._apply_manifest(
                            tier_name, manifest, known, report, error and error.removeprefix(DAMAGED_COPY)
                        )
                except HOSTILE as exc:
                    quarantine(rel, f"could not be cataloged: {type(exc).__name__}: {str(exc)[:500]}")
                    continue
                listed.add((manifest.run, manifest.name))
            for key, (cid, _version) in known.items():
                if key not in listed:
                    self.index.remove_location(cid, tier_name)
                    report.removed += 1
            self.index.prune_orphans()
            self.index.replace_artifacts(
                tier_name, [a for a in (*staging, *uploads) if not is_scratch_run(a.path)]
            )
            self.index.replace_quarantine(tier_name, held, kinds=["manifest"])
            report.quarantined += record_trash(self.index, tier_name, trash)
            # Pins live in the tiers too (docs/design.md, "Many nodes"): one stored here and missing from the index
            # (a lost or rebuilt index, another node's pin) is a pin. Never unpins.
            restored = self.index.pin_by_name(sorted(pins))
            if restored:
                log.warning("pins read back from the tier", tier=tier_name, pins=restored)
            self.tier_pins[tier_name] = pins
            self.index.set_tier_status(tier_name, True)
        report.quarantined += len(held)
        return report

    def _apply_manifest(
        self,
        tier_name: str,
        manifest: Manifest,
        known: dict[tuple[str, str], tuple[int, str]],
        report: ReconcileReport,
        error: str | None = None,
    ) -> None:
        """Record one copy a slower tier holds, from its (validated) manifest; ``error``: its data
        does not match the manifest (the copy is marked damaged, never a location)."""
        key = (manifest.run, manifest.name)
        row = self.index.checkpoint(*key)
        if row is None or (row.version is None and row.state is not CheckpointState.WRITING):
            cid = self.index.upsert_checkpoint(
                run=manifest.run,
                name=manifest.name,
                step=manifest.step,
                layout=manifest.layout,
                state=CheckpointState.COMPLETE,
                created_at=manifest.created_at,
                last_write=manifest.created_at,
                bytes=manifest.total_bytes,
                metrics=manifest.metrics,
                committed=False,
                version=manifest.digest,
                manifest_json=manifest.to_json(),
                problem=None,
                part=manifest.part,
            )
            report.new += 1
            if self.index.run(manifest.run) is None:
                mark_off_hot(self.index, manifest.run, manifest.created_at, None)
        else:
            cid = row.id
            if error is None and known.get(key, (0, ""))[1] == manifest.digest:
                report.unchanged += 1
        # the copy's owner (docs/design.md, "Many nodes") is recorded damaged or not: a damaged copy another node
        # wrote is still that node's, never this node's to delete
        if error is None and _scrub_found_bad(known.get(key), manifest, row):
            # A listing checks sizes; the scrub re-hashed the bytes and found them wrong. Only a
            # re-hash that finds the copy whole or a new copy written over it clears that mark.
            return
        if error is not None:
            self.index.mark_damaged(cid, tier_name, error, node=manifest.node)
        else:
            self.index.set_location(
                cid, tier_name, manifest.digest, node=manifest.node, stored_bytes=manifest.stored_bytes
            )


def _outer_copy(manifest: Manifest, names: dict[str, set[str]]) -> str | None:
    """The checkpoint of the same run (``names``: run -> names listed) that ``manifest``'s copy
    lies inside, or None."""
    parts = manifest.name.split("/")
    run_names = names.get(manifest.run, set())
    return next((o for i in range(1, len(parts)) if (o := "/".join(parts[:i])) in run_names), None)


def _scrub_found_bad(known: tuple[int, str] | None, manifest: Manifest, row: CheckpointRow | None) -> bool:
    """Does the index hold a scrub's verdict "bad bytes" on this very version of the copy?"""
    return (
        known is not None
        and known[1].startswith(DAMAGED + SCRUB_PROBLEM)
        and row is not None
        and row.version == manifest.digest
    )


def record_trash(
    index: Index, tier: str, listing: list[tuple[str, Manifest | None, float, str | None]]
) -> int:
    """Record what a listing of ``tier``'s trash found (docs/undo-window.md); an entry that holds no
    whole copy is quarantined with why (never purged or undeleted by guess). Returns how many."""
    entries: list[tuple[TrashEntry, Manifest]] = []
    held: list[Quarantined] = []
    for path, manifest, deleted_at, error in listing:
        if manifest is None:
            log.warning("trash entry quarantined", tier=tier, path=path, error=error)
            held.append(Quarantined(tier, path, "trash", error or "unreadable"))
            continue
        entries.append((TrashEntry.of(tier, path, manifest, deleted_at), manifest))
    with index.transaction():
        index.replace_trash(tier, entries)
        index.replace_quarantine(tier, held, kinds=["trash"])
    return len(held)


def mark_off_hot(index: Index, run: str, last_seen: float, parent: tuple[str, int] | None) -> None:
    """Record a run known only from slower tiers (its hot dir gone, or never on this node).

    Such a run has no writer on this node. It may belong to another node sharing the cold tier, so
    it is never treated as failed or stale here."""
    index.upsert_run(
        run,
        state=RunState.FINISHED,
        state_reason="not on this node's hot tier",
        last_seen=last_seen,
        parent=parent,
        on_hot=False,
    )
