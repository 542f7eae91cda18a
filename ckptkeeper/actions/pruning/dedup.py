"""Participant: a dedup tier's content store (docs/dedup.md). After the executor, this node alone
collects its own content objects no manifest of the tier references any more (committed copies,
trash entries), once older than the tier's ``dedup_grace`` by the store's clock; and it reports
what the pass's copies uploaded and what they referenced instead."""

from __future__ import annotations

from typing import Any

from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.executor import _CrashPoints
from ckptkeeper.storage import StorageError, TierStorage, content_gc
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.prune")


class ContentCollection(Participant):
    def after(self, state: PassState) -> list[str]:
        copies = [] if state.result is None else state.result.deduped
        notes: list[str] = []
        tiers: dict[str, Any] = {}
        crash = _CrashPoints()  # the executor's crash points, counted apart (tests only)
        for spec in state.settings.tier_specs()[1:]:
            if not spec.dedup:
                continue
            mine = [c for c in copies if c.tier == spec.name]
            doc: dict[str, Any] = {
                "uploaded_bytes": sum(c.uploaded_bytes for c in mine),
                "deduped_bytes": sum(c.deduped_bytes for c in mine),
                "stored_bytes": sum(c.stored_bytes for c in mine),
                "collected": None,
            }
            try:
                got = content_gc.collect(
                    TierStorage(spec),
                    grace=spec.dedup_grace,
                    dry_run=state.dry_run,
                    before_remove=lambda _digest: crash.hit("content-remove"),
                )
            except StorageError as exc:  # unknown references: nothing collected, next pass retries
                log.warning("%s: content store not collected: %s", spec.name, exc)
                notes.append(f"dedup: content of tier {spec.name} not collected this pass: {exc}")
            else:
                doc["collected"] = got.to_dict()
                if got.removed:
                    verb = "would remove" if state.dry_run else "removed"
                    notes.append(
                        f"dedup: {verb} {got.removed} unreferenced content objects "
                        f"({got.removed_bytes} bytes) from tier {spec.name}"
                    )
            tiers[spec.name] = doc
        state.dedup = {"tiers": tiers, "copies": [c.to_dict() for c in copies]}
        return notes
