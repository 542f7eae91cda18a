"""The executor's trash steps (``undo_window``, docs/undo-window.md): move aside, purge, undelete.

A mixin of :class:`ckptkeeper.executor.Executor`, kept in its own module so the executor stays
readable. Each step is journaled in the index before it touches storage, like every destructive
step, and :meth:`TrashSteps._recover_trash` finishes or undoes it after a ``kill -9`` at any
instant (the storage side of each step is ordered for that: :mod:`ckptkeeper.storage.trash`):

* **move aside** (an expiry or a reap in a tier with an undo window): finished when the copy is
  whole in its entry (what is left at the old place is removed, the location becomes a trash
  entry), else undone (the partial entry is removed; the copy stays where it was, the next plan
  decides again). Nothing is reclaimed: the bytes are still on the tier.
* **purge**: redone (it is idempotent), and its bytes counted as reclaimed once: the one place
  reclaimed bytes are recorded is :meth:`Executor._add_reclaimed`.
* **undelete**: finished when the copy is back in place (the entry's leftovers removed), else
  undone (what it started at the place is discarded; the entry stays in the trash).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ckptkeeper.core.history import ACTION_EVENT, HistoryEvent
from ckptkeeper.core.model import Action, Manifest, TrashEntry
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.storage import StorageError, TierStorage
from ckptkeeper.storage.trash import new_entry
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.executor")

UNDELETE = "undelete"
"""The journal's name for an undelete (not a plan action: the ``undelete`` command runs it)."""


class _Crash(Protocol):
    def hit(self, where: str) -> None: ...


class TrashSteps:
    """Trash steps of the executor; the executor provides the attributes declared here."""

    index: Index
    clock: Callable[[], float]
    _crash: _Crash

    def storage(self, tier: str) -> TierStorage:
        raise NotImplementedError

    def _add_reclaimed(self, tier: str, reason: str, nbytes: int) -> None:
        raise NotImplementedError

    def _discard_staging(self, storage: TierStorage, rel: str) -> int:
        raise NotImplementedError

    def _row_by_path(self, rel: str) -> CheckpointRow | None:
        raise NotImplementedError

    # -- move aside ------------------------------------------------------------------------

    def _move_aside(self, action: Action, row: CheckpointRow) -> None:
        """Move ``row``'s copy in ``action.tier`` into that tier's trash: nothing is reclaimed yet."""
        assert action.tier and action.path
        manifest = row.manifest()
        if manifest is None:
            raise StorageError(f"{action.path}: no manifest recorded; cannot move it aside")
        storage = self.storage(action.tier)
        if storage.node and not manifest.node:
            manifest = dataclasses.replace(manifest, node=storage.node)  # whose entry it is (§10)
        entry = new_entry(self.clock())
        journal = self.index.journal_begin(
            action.to_dict(),
            "moving aside",
            {"entry": entry, "manifest": manifest.to_json(), "started": True},
        )
        self._crash.hit("aside-journaled")
        storage.move_aside(manifest, entry)
        self._crash.hit("aside-moved")
        with self.index.transaction():
            self._record_aside(action.tier, entry, manifest, row)
            self.index.journal_done(journal)
        log.info("moved aside into the trash", tier=action.tier, path=action.path, entry=entry)

    def _record_aside(self, tier: str, entry: str, manifest: Manifest, row: CheckpointRow | None) -> None:
        from ckptkeeper.storage.trash import entry_time

        if row is not None:
            self.index.remove_location(row.id, tier)
        deleted_at = entry_time(entry) or self.clock()
        self.index.add_trash(TrashEntry.of(tier, entry, manifest, deleted_at), manifest)

    # -- purge -----------------------------------------------------------------------------

    def _purge(self, action: Action) -> str | None:
        assert action.tier and action.path
        recorded = {e.path for e, _ in self.index.trash(action.run, action.step) if e.tier == action.tier}
        if action.path not in recorded:
            return "no longer in the trash (undeleted or purged since the plan was made)"
        journal = self.index.journal_begin(action.to_dict(), "purging", {"started": True})
        self._crash.hit("purge-journaled")
        freed = self.storage(action.tier).purge_trash(action.path)
        self._crash.hit("purge-done")
        with self.index.transaction():
            self.index.remove_trash(action.tier, action.path)
            # the checkpoint's bytes, as the plan said (the entry's own manifest is not counted)
            self._add_reclaimed(action.tier, action.rule or "purge", min(freed, action.bytes) or action.bytes)
            self.index.journal_done(journal)
        return None

    # -- undelete --------------------------------------------------------------------------

    def undelete_entry(self, entry: TrashEntry, manifest: Manifest) -> None:
        """Bring ``entry`` back to its place (checked against ``manifest`` by the storage), journaled.
        The caller re-catalogs the tier afterwards; the location is not guessed here."""
        storage = self.storage(entry.tier)
        doc = {"action": UNDELETE, "tier": entry.tier, "path": entry.rel_path, "entry": entry.path}
        journal = self.index.journal_begin(doc, "undeleting", {"manifest": manifest.to_json()})
        self._crash.hit("undelete-journaled")
        storage.undelete(manifest, entry.path)
        self._crash.hit("undelete-done")
        event = HistoryEvent(
            self.clock(),
            UNDELETE,
            entry.run,
            entry.step,
            entry.tier,
            path=entry.rel_path,
            bytes=entry.bytes,
            rule=UNDELETE,
            reason=f"undeleted from the trash ({entry.path})",
            node=storage.node,
            trash=entry.path,
        )
        with self.index.transaction():
            self.index.remove_trash(entry.tier, entry.path)
            self.index.add_history([event])
            self.index.journal_done(journal)
        log.info(ACTION_EVENT, **event.log_fields())

    # -- recovery --------------------------------------------------------------------------

    def _recover_trash(self, action: Mapping[str, Any], detail: Mapping[str, Any]) -> str | None:
        """Finish or undo an interrupted trash step; None if the entry is no trash step."""
        kind = action.get("action")
        tier, rel = action.get("tier"), action.get("path")
        if not isinstance(tier, str) or not isinstance(rel, str):
            return None
        if kind == "purge":
            freed = self.storage(tier).purge_trash(rel)
            with self.index.transaction():
                self.index.remove_trash(tier, rel)
                self._add_reclaimed(
                    tier, str(action.get("rule") or "purge"), int(action.get("bytes") or freed)
                )
            return f"purge of {rel} in {tier} finished"
        entry = detail.get("entry") if kind != UNDELETE else action.get("entry")
        text = detail.get("manifest")
        if not isinstance(entry, str) or not isinstance(text, str):
            return None
        manifest = Manifest.from_json(text)
        storage = self.storage(tier)
        whole, here = storage.probe_aside(manifest, entry)
        if kind == UNDELETE:
            back = (here and not whole) if storage.hot else storage.read_manifest(rel) is not None
            if back:
                storage.purge_trash(entry)  # the copy is back; what is left of the entry goes
                self.index.remove_trash(tier, entry)
                return f"undelete of {rel} in {tier} had finished; trash entry removed"
            self._discard_staging(storage, rel)
            return f"undelete of {rel} in {tier} had not finished; it stays in the trash"
        if whole:
            storage.finish_aside(manifest)
            with self.index.transaction():
                self._record_aside(tier, entry, manifest, self._row_by_path(rel))
            return f"move aside of {rel} in {tier} finished (in the trash as {entry})"
        storage.purge_trash(entry)
        return f"move aside of {rel} in {tier} had not happened; the copy stays in place"
