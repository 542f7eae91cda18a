"""Carry out a Plan: copy → verify → commit → delete, every step journaled in the index.

The planner decided *what*; this module only makes it happen safely:

* Each action is written to the journal before it touches anything, and marked done after the
  index reflects it. After ``kill -9`` at any instant, :meth:`Executor.recover` looks at every
  open entry and either finishes it (the copy was committed) or undoes it (staging removed); a
  source is never deleted by recovery.
* A delete runs only after the copies it depends on are verified and committed, and is re-checked
  against the index at execution time (pins and locations may have changed since planning): the
  executor refuses to delete the last verified copy of a checkpoint that is still wanted.
* A checkpoint or partial that was written to since planning is skipped, never moved or reaped.
* A failing tier fails its actions (logged with the cause) and leaves every checkpoint in place;
  the rest of the plan still runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkeeper.core.history import ACTION_EVENT, DONE, FAILED, HistoryEvent
from ckptkeeper.core.model import Action, ActionKind, Artifact, CheckpointState, Manifest, Plan, TierSpec
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.ingest import hookfiles, layouts
from ckptkeeper.storage import LocalTierStorage, StorageError, TierStorage, content
from ckptkeeper.undo import TrashSteps
from ckptkeeper.util.fingerprint import Fingerprint
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.executor")

CRASH_ENV = "CKPTKEEPER_TEST_CRASH_AFTER"
"""Test-only: SIGKILL this process at the K-th crash point (journal phases and copy progress)."""

Progress = Callable[[Action, int, int], None]
"""(action, bytes done, bytes total)."""


class _CrashPoints:
    """Counts crash points; kills the process with SIGKILL at the configured one (tests only).
    The count is the process's: a pass's executors (the catalog's hashing moves, then the plan's)
    pass their points in the order they run."""

    count = 0

    def __init__(self) -> None:
        raw = os.environ.get(CRASH_ENV)
        self.target = int(raw) if raw and raw.isdigit() else None

    def hit(self, where: str) -> None:
        if self.target is None:
            return
        _CrashPoints.count += 1
        if _CrashPoints.count >= self.target:
            log.warning("test crash point reached", where=where, count=self.count)
            os.kill(os.getpid(), signal.SIGKILL)


class SurvivorDamaged(StorageError):
    """A delete was refused: a copy it would leave as a survivor is not whole in storage."""


@dataclass
class ExecResult:
    done: list[Action] = field(default_factory=list)
    failed: list[tuple[Action, str]] = field(default_factory=list)
    skipped: list[tuple[Action, str]] = field(default_factory=list)
    reclaimed_bytes: dict[str, int] = field(default_factory=dict)
    """tier -> bytes actually freed."""
    recovered: list[str] = field(default_factory=list)
    stopped: bool = False
    compressed: list[tuple[Action, dict[str, Any]]] = field(default_factory=list)
    """Per copy into a compressing tier: raw and stored bytes, compression CPU (docs/compression.md)."""
    deduped: list[content.CopyStats] = field(default_factory=list)
    """Per copy into a dedup tier: bytes uploaded and bytes referenced instead (docs/dedup.md)."""

    @property
    def ok(self) -> bool:
        return not self.failed


class Executor(TrashSteps):
    def __init__(
        self,
        index: Index,
        tiers: Sequence[TierSpec],
        *,
        storages: Mapping[str, TierStorage] | None = None,
        stop: threading.Event | None = None,
        progress: Progress | None = None,
        partial_after: float = 3600.0,
        clock: Callable[[], float] = time.time,
        trust_mtimes: bool = False,
        guard: Callable[[Action], str | None] | None = None,
        hot_clock: Callable[[], float] | None = None,
    ) -> None:
        self.index = index
        self.hot_clock = clock if hot_clock is None else hot_clock
        """The hot tier's filesystem clock: "still being written" compares its files' mtimes with it."""
        self.guard = guard
        """Asked before each action: a reason to stop the pass there (a shared tier's lease lost)."""
        self.tiers = list(tiers)
        self.hot = self.tiers[0].name
        self._storages: dict[str, TierStorage] = dict(storages or {})
        self.stop = stop or threading.Event()
        self.progress = progress
        self.partial_after = partial_after
        self.clock = clock
        self.trust_mtimes = trust_mtimes
        """``daemon.trust_mtimes``: judge "written to since cataloged" as the catalog recorded it."""
        self._crash = _CrashPoints()
        self._reclaimed: dict[str, int] = {}
        self._compressed: list[tuple[Action, dict[str, Any]]] = []
        self._deduped: list[content.CopyStats] = []
        """tier -> bytes freed by the current :meth:`apply` (recorded with the index's total)."""

    def storage(self, tier: str) -> TierStorage:
        if tier not in self._storages:
            spec = next(t for t in self.tiers if t.name == tier)
            self._storages[tier] = TierStorage(spec, hot=tier == self.hot)
        return self._storages[tier]

    # -- recovery --------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Finish or undo every step a crash interrupted. Never deletes a source."""
        notes = []
        for entry in self.index.journal_open():
            action = entry.action
            kind = action.get("action")
            try:
                trash_note = self._recover_trash(action, entry.detail)
                if trash_note is not None:
                    note = trash_note
                elif kind == ActionKind.COPY.value:
                    note = self._recover_copy(action, entry.detail)
                elif kind in (ActionKind.DELETE.value, ActionKind.REAP.value):
                    note = self._recover_removal(action, entry.detail)
                else:
                    note = f"unknown journal action {kind!r}: dropped"
            except StorageError as exc:
                log.warning("recovery step failed; will retry next start", entry=entry.id, error=str(exc))
                notes.append(f"journal {entry.id}: recovery failed, retried next time: {exc}")
                continue
            self.index.journal_done(entry.id, "recovered")
            log.info("recovered interrupted step", entry=entry.id, action=kind, note=note)
            notes.append(f"journal {entry.id}: {note}")
        return notes

    def _recover_copy(self, action: Mapping[str, Any], detail: Mapping[str, Any]) -> str:
        rel, to_tier, version = action["path"], action["to_tier"], detail.get("version")
        dest = self.storage(to_tier)
        row = self._row_by_path(rel)
        manifest = dest.read_manifest(rel) if to_tier != self.hot else None
        if manifest is not None and version and manifest.digest == version:
            # Committed before the crash: record it. A rename-move also lost its source location.
            if row is not None:
                with self.index.transaction():
                    self.index.set_location(row.id, to_tier, version)
                    if detail.get("rename") and action.get("tier") and action["tier"] in row.locations:
                        # what the lost result of the rename recorded, the freed bytes included
                        # (in the index's total, not in this pass's result: an earlier pass freed them)
                        self.index.remove_location(row.id, action["tier"])
                        self.index.add_reclaimed("moved", row.bytes)
            # Killed between the commit and the cleanup: the S3 staging marker (and any upload a
            # lost reply left behind) would otherwise wait an hour for the reaper.
            self._discard_staging(dest, rel)
            return f"copy of {rel} to {to_tier} had committed; recorded"
        self._discard_staging(dest, rel)
        if detail.get("hashing") and manifest is not None:
            # copy_hashing: the version was computed by the copy, so it is not in the journal; the
            # committed copy is recorded by the tier's listing (the catalog reads its manifest).
            return f"copy of {rel} to {to_tier} had committed; recorded when {to_tier} is listed"
        if detail.get("rename"):
            self._discard_staging(self.storage(action["tier"]), rel)
        return f"copy of {rel} to {to_tier} had not committed; staging removed, source untouched"

    def _recover_removal(self, action: Mapping[str, Any], detail: Mapping[str, Any]) -> str:
        tier, rel = action["tier"], action["path"]
        storage = self.storage(tier)
        if action.get("upload_id"):
            # Abort is idempotent on the server side; the artifact row may already be gone.
            return "multipart abort interrupted; the reaper retries it on the next pass"
        if not detail.get("started"):
            return f"{action['action']} of {rel} in {tier} never started"
        # The removal had begun (data renamed to a tombstone): finish it, the copy is de-committed.
        freed = self._discard_staging(storage, rel)
        row = self._row_by_path(rel)
        if row is not None and action["action"] == ActionKind.DELETE.value:
            self.index.remove_location(row.id, tier)
        return f"{action['action']} of {rel} in {tier} finished ({freed} bytes)"

    def _discard_staging(self, storage: TierStorage, rel: str) -> int:
        freed = 0
        for art in storage.list_staging():
            base = art.path.split(STAGING_MARK, 1)[0]
            if base == rel or base.removesuffix(".ckptkeeper-manifest.json") == rel:
                freed += storage.discard_staging(art)
        return freed

    def _row_by_path(self, rel: str) -> CheckpointRow | None:
        for row in self.index.checkpoints(rel.split("/", 1)[0]):
            if f"{row.run}/{row.name}" == rel:
                return row
        # run_depth > 1: the run part holds slashes; fall back to a full scan.
        return next((r for r in self.index.checkpoints() if f"{r.run}/{r.name}" == rel), None)

    # -- apply -----------------------------------------------------------------------------

    def apply(self, plan: Plan) -> ExecResult:
        result = ExecResult()
        self._reclaimed = result.reclaimed_bytes
        self._compressed = result.compressed
        self._deduped = result.deduped
        result.recovered = self.recover()
        moves = self._local_moves(plan.actions)
        copied_ok: set[tuple[str, str]] = set()
        failed_keys: set[str] = set()
        for action in plan.actions:
            if self.stop.is_set() or (self.guard is not None and self.guard(action) is not None):
                result.stopped = True
                break
            path = action.path or ""
            if action.action is ActionKind.DELETE and path in failed_keys:
                result.skipped.append((action, "a copy it depends on failed"))
                continue
            if (
                action.action is ActionKind.DELETE
                and (path, action.tier) in moves
                and (path, action.tier) in copied_ok
            ):
                result.done.append(action)  # the rename already removed the source
                self._trace(action, time.monotonic())
                continue
            started = time.monotonic()
            try:
                skipped = self._apply_one(
                    action, rename=(path, action.tier) in moves and action.action is ActionKind.COPY
                )
            except (StorageError, OSError) as exc:
                log.error(
                    "action failed; data left in place",
                    action=action.action.value,
                    path=path,
                    tier=action.tier,
                    to_tier=action.to_tier,
                    error=str(exc),
                )
                result.failed.append((action, str(exc)))
                self._trace(action, started, error=str(exc))
                if action.action is ActionKind.COPY:
                    failed_keys.add(path)
                continue
            if skipped:
                log.info("action skipped", action=action.action.value, path=path, reason=skipped)
                result.skipped.append((action, skipped))
                if action.action is ActionKind.COPY:
                    failed_keys.add(path)
                continue
            result.done.append(action)
            self._trace(action, started)
            if action.action is ActionKind.COPY:
                copied_ok.add((path, action.tier or ""))
        return result

    def _trace(self, action: Action, started: float, *, error: str = "") -> None:
        """Every action carried out or failed leaves a trace (``history``, ``why``): a row in the
        index's history and, when done, one log event with its rule and reason (a failure is
        logged where it is caught)."""
        duration = time.monotonic() - started
        node = self.tiers[0].node
        trash = ""
        if action.trash and not error and action.run is not None and action.step is not None:
            entries = [e for e, _ in self.index.trash(action.run, action.step) if e.tier == action.tier]
            trash = entries[0].path if entries else ""
        event = HistoryEvent.of(
            action,
            self.clock(),
            node=node,
            outcome=FAILED if error else DONE,
            duration=duration,
            error=error,
            trash=trash,
        )
        try:
            self.index.add_history([event])
        except Exception as exc:  # the trace must never fail the action it records
            log.warning("cannot record the action in the history", error=str(exc))
        if not error:
            log.info(ACTION_EVENT, **event.log_fields())

    def _local_moves(self, actions: Sequence[Action]) -> set[tuple[str, str | None]]:
        """(path, source tier) pairs where a copy and a delete of the source form a same-fs move."""
        deletes = {(a.path, a.tier) for a in actions if a.action is ActionKind.DELETE}
        copies_from: dict[tuple[str | None, str | None], int] = {}
        for a in actions:
            if a.action is ActionKind.COPY:
                copies_from[(a.path, a.tier)] = copies_from.get((a.path, a.tier), 0) + 1
        moves: set[tuple[str, str | None]] = set()
        for a in actions:
            # Only a lone copy may become a rename: another copy (e.g. a replica to cold) still
            # needs to read the source.
            if (
                a.action is ActionKind.COPY
                and (a.path, a.tier) in deletes
                and copies_from[(a.path, a.tier)] == 1
                and a.tier
                and a.to_tier
            ):
                src, dst = self.storage(a.tier), self.storage(a.to_tier)
                if (
                    isinstance(src, LocalTierStorage)
                    and isinstance(dst, LocalTierStorage)
                    and dst.same_filesystem(src)
                    and not (src.spec.dedup or dst.spec.dedup)  # a dedup copy's bytes are not in its place
                    and dst.spec.compression == "none"  # a rename cannot compress (docs/compression.md)
                    and not (dst.hot and self._stored_encoded(src, a.path or ""))  # nor decompress
                ):
                    moves.add((a.path or "", a.tier))
        return moves

    def _stored_encoded(self, src: TierStorage, path: str) -> bool:
        """``src`` stores some file of checkpoint ``path`` compressed (unknown counts as yes: a copy
        decodes whatever it finds, a rename would put stored bytes where runs read plain files)."""
        row = self._row_by_path(path)
        manifest = row.manifest() if row is not None else None
        if manifest is None:
            return True
        try:
            return any(e.encoding for e in src._stored_form(manifest).files)
        except StorageError:
            return True

    def _apply_one(self, action: Action, *, rename: bool) -> str | None:
        """Run one action; return a reason if it was skipped, raise on failure."""
        if action.action is ActionKind.COPY:
            return self._copy(action, rename=rename)
        if action.action is ActionKind.DELETE:
            return self._delete(action)
        if action.action is ActionKind.PURGE:
            return self._purge(action)
        return self._reap(action)

    def _copy(self, action: Action, *, rename: bool) -> str | None:
        assert action.path and action.tier and action.to_tier
        row = self._row_by_path(action.path)
        if row is None or row.version is None or row.state is not CheckpointState.COMPLETE:
            return "checkpoint no longer complete in the index"
        if action.tier not in row.verified_tiers:
            return f"no verified copy in {action.tier} any more"
        manifest = row.manifest()
        if manifest is None:
            return "no manifest recorded"
        if action.tier == self.hot and self._changed_since_cataloged(row):
            return "written to since it was cataloged; it will be rescanned"
        # A copy the index marks damaged at the destination is replaced (the storage's own size
        # check cannot see bytes a scrub found wrong), unless another node wrote it: that one is
        # reported, never deleted or rewritten by this node (docs/design.md, "Many nodes").
        replace = action.to_tier in row.damaged
        if replace:
            owner = self.index.location_owner(row.id, action.to_tier) or ""
            if owner and owner != self.tiers[0].node:
                return f"the damaged copy in {action.to_tier} is owned by node {owner}: not ours to replace"
        src, dst = self.storage(action.tier), self.storage(action.to_tier)
        # A rename's intent is committed without its flush; the flush runs beside the manifest's
        # and both finish before anything is renamed (LocalTierStorage.rename_from).
        entry = self.index.journal_begin(
            action.to_dict(), "copying", {"version": row.version, "rename": rename}, durable=not rename
        )
        self._crash.hit("copy-journaled")
        stored: int | None = None  # a rename keeps the bytes as the source stored them
        if rename:
            assert isinstance(dst, LocalTierStorage) and isinstance(src, LocalTierStorage)
            # A rename moves the very inodes the catalog hashed; sizes are still checked, and a hot
            # source was just re-checked for writes (_changed_since_cataloged). Re-hashing would
            # read the whole checkpoint to move a directory entry (1 GiB: 5 ms -> 140 ms, bench/).
            dst.rename_from(
                src,
                manifest,
                rehash=False,
                replace_damaged=replace,
                before_rename=self.index.sync_wal,
                step=self._crash.hit,
            )
        else:
            total = manifest.total_bytes
            done = 0

            def on_bytes(n: int) -> None:
                nonlocal done
                done += n
                if self.progress:
                    self.progress(action, done, total)
                self._crash.hit("copy-progress")

            copied = dst.copy_from(src, manifest, progress=on_bytes, replace_damaged=replace)
            stats = copied.stats
            if copied.deduped is not None:
                self._deduped.append(copied.deduped)
            stored = (
                None if stats is None else stats.stored_bytes
            )  # None: as recorded (a listing corrects it)
            if stats is not None:
                self._compressed.append((action, stats.to_dict()))
                log.info("compressed copy", path=action.path, tier=action.to_tier, **stats.to_dict())
        self._crash.hit("copy-committed")
        # A rename's result is not flushed: after a power cut that loses it, recovery finds the
        # committed manifest at the destination and records the same (_recover_copy). Its flush
        # comes with the next durable commit. A copy's result is flushed: its source stays, and the
        # staging-free destination is only trusted once the index says so.
        with self.index.transaction(durable=not rename):
            # the bytes were hashed against the manifest as they were written: scrubbed now
            self.index.set_location(
                row.id, action.to_tier, row.version, scrubbed_at=time.time(), stored_bytes=stored
            )
            if rename:
                self.index.remove_location(row.id, action.tier)
                self._add_reclaimed(action.tier, "moved", row.bytes)
            self.index.journal_done(entry)
        self._crash.hit("copy-recorded")
        return None

    def copy_hashing(
        self,
        action: Action,
        manifest: Manifest,
        fingerprints: Mapping[str, Fingerprint],
        record: Callable[[Manifest], int | None],
    ) -> Manifest:
        """Copy a checkpoint the catalog has not hashed out of the hot tier, hashing it on the way
        (one read of its bytes; ``copy_from(fingerprints=...)``), then ``record`` it in the index
        with the manifest computed (it returns the row id) together with its new location.

        Journaled as any copy. Its version is not known when the journal entry is written, so a
        crash after the commit leaves a committed copy that recovery does not record: the next
        listing of the tier does (nothing is deleted on the strength of it before then).
        """
        assert action.action is ActionKind.COPY and action.tier == self.hot and action.to_tier
        started = time.monotonic()
        src, dst = self.storage(action.tier), self.storage(action.to_tier)
        # The intent is committed at once and flushed beside the copy, durable before the copy is
        # committed (copy_from's before_commit), as a rename's is beside its manifest: a power cut
        # before that leaves staging only, which recovery and list_staging clean.
        entry = self.index.journal_begin(
            action.to_dict(), "copying", {"version": None, "hashing": True}, durable=False
        )
        flush = _Beside(self.index.sync_wal)
        self._crash.hit("copy-journaled")
        total, done = manifest.total_bytes, 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            if self.progress:
                self.progress(action, done, total)
            self._crash.hit("copy-progress")

        try:
            try:
                hashed = dst.copy_from(
                    src, manifest, progress=on_bytes, fingerprints=fingerprints, before_commit=flush.wait
                ).manifest
            finally:
                flush.join()
        except BaseException as exc:
            self.index.journal_done(entry, "failed")
            self._trace(action, started, error=str(exc))
            raise
        self._crash.hit("copy-committed")
        # Not flushed: a power cut that loses it leaves the copy committed with its journal entry
        # open, which recovery treats as above (the listing records it); a delete of the source
        # begins with a durable journal entry, which flushes this commit first.
        with self.index.transaction(durable=False):
            row_id = record(hashed)
            if row_id is not None:
                self.index.set_location(row_id, action.to_tier, hashed.digest, scrubbed_at=time.time())
            self.index.journal_done(entry)
        self._crash.hit("copy-recorded")
        self._trace(action, started)
        return hashed

    def _delete(self, action: Action) -> str | None:
        assert action.path and action.tier
        row = self._row_by_path(action.path)
        if row is None or action.tier not in row.locations:
            return "already gone"
        expiring = action.rule == "expired"
        others = row.verified_tiers - {action.tier}
        if row.pinned:
            return "pinned since the plan was made"
        if not expiring and not others:
            # Invariant 1: never delete the last verified copy of a checkpoint that is still wanted.
            return "refusing: no other verified copy exists"
        if action.tier == self.hot and self._changed_since_cataloged(row):
            return "written to since it was cataloged"
        if not expiring:
            self._recheck_survivors(row, others)
        if action.trash and expiring:
            self._move_aside(action, row)  # undo_window: freed only when the trash is purged
        else:
            self._remove(action, row, reason="expired" if expiring else "moved")
        if not (set(row.locations) - {action.tier}):
            self.index.delete_checkpoint(row.id)
        return None

    def _recheck_survivors(self, row: CheckpointRow, survivors: frozenset[str]) -> None:
        """Check in storage, now, every other copy a delete leaves; raise if any is not whole.

        The index says where verified copies are; storage may disagree since (a replica's objects
        deleted behind our back, a warm disk that lost files). Each survivor's files are stat-ed
        (local) or HEAD-ed (S3, concurrently) against the manifest. A damaged one is marked so in
        the index, which makes the next plan copy it again, and the delete does not happen
        (:class:`SurvivorDamaged`). A survivor that cannot be checked fails the delete too.
        """
        manifest = row.manifest()
        if manifest is None:
            raise StorageError(f"{row.run}/{row.name}: no manifest recorded to re-check its copies against")
        order = [t.name for t in self.tiers]
        damaged: dict[str, list[str]] = {}
        for tier in sorted(survivors, key=order.index):
            problems = self.storage(tier).recheck(manifest)
            if problems:
                damaged[tier] = problems
        if not damaged:
            return
        with self.index.transaction():
            for tier, problems in damaged.items():
                self.index.mark_damaged(row.id, tier, "; ".join(problems))
        for tier, problems in damaged.items():
            log.error(
                "surviving copy is damaged; delete refused, the copy is made again next pass",
                path=f"{row.run}/{row.name}",
                tier=tier,
                problems=problems[:5],
            )
        raise SurvivorDamaged(
            "; ".join(
                f"copy in {tier} is damaged ({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})"
                for tier, problems in damaged.items()
            )
            + ": not deleted; marked damaged, copied again on the next pass"
        )

    def _reap(self, action: Action) -> str | None:
        assert action.tier and action.path
        storage = self.storage(action.tier)
        if action.upload_id:
            entry = self.index.journal_begin(action.to_dict(), "aborting")
            storage.abort_multipart(
                Artifact(
                    tier=action.tier,
                    path=action.path,
                    kind="multipart-upload",
                    bytes=action.bytes,
                    last_write=0.0,
                    upload_id=action.upload_id,
                )
            )
            with self.index.transaction():
                self.index.remove_artifact(action.tier, action.path, action.upload_id)
                self._add_reclaimed(action.tier, action.rule or "multipart-upload", action.bytes)
                self.index.journal_done(entry)
            return None
        row = self._row_by_path(action.path) if action.step is not None else None
        if row is not None:
            if row.pinned:
                return "pinned since the plan was made"
            if action.tier == self.hot and row.state is not CheckpointState.COMPLETE:
                newest = _newest_mtime(self._hot_path(action.path))
                if newest is not None and self.hot_clock() - newest < self.partial_after:
                    return "still being written"
        elif action.tier == self.hot:
            newest = _newest_mtime(self._hot_path(action.path))
            if (
                newest is not None
                and self.hot_clock() - newest < min(self.partial_after, 60.0)
                and action.rule != "ckptkeeper-staging"
            ):
                return "written to since the plan was made"
        if action.rule == "ckptkeeper-staging":
            entry = self.index.journal_begin(action.to_dict(), "reaping", {"started": True})
            freed = storage.discard_staging(
                Artifact(
                    tier=action.tier,
                    path=action.path,
                    kind="ckptkeeper-staging",
                    bytes=action.bytes,
                    last_write=0.0,
                )
            )
            with self.index.transaction():
                self.index.remove_artifact(action.tier, action.path)
                self._add_reclaimed(action.tier, action.rule, freed)
                self.index.journal_done(entry)
            return None
        if action.trash and row is not None and row.state is CheckpointState.COMPLETE:
            if action.tier == self.hot and self._changed_since_cataloged(row):
                return "written to since it was cataloged"  # its manifest would not describe it
            self._move_aside(action, row)  # undo_window: freed only when the trash is purged
        else:
            self._remove(action, row, reason=action.rule or "reap")
        if row is not None:
            remaining = set(row.locations) - {action.tier}
            if not remaining or row.state is not CheckpointState.COMPLETE:
                self.index.delete_checkpoint(row.id)
        else:
            self.index.remove_artifact(action.tier, action.path)
        return None

    def _remove(self, action: Action, row: CheckpointRow | None, *, reason: str) -> int:
        assert action.tier and action.path
        storage = self.storage(action.tier)
        entry = self.index.journal_begin(action.to_dict(), "removing", {"started": True})
        self._crash.hit("remove-journaled")
        freed = storage.delete(action.path)
        self._crash.hit("remove-done")
        # Not flushed (nothing irreversible waits on it): a power cut that loses it leaves the
        # journal entry open, and recovery finishes the removal (_recover_removal); the next
        # durable commit, or the close of the index, flushes it.
        with self.index.transaction(durable=False):
            if row is not None:
                self.index.remove_location(row.id, action.tier)
            self._add_reclaimed(action.tier, reason, freed or action.bytes)
            self.index.journal_done(entry)
        return freed

    def _add_reclaimed(self, tier: str, reason: str, nbytes: int) -> None:
        """Bytes freed in ``tier`` (docs/concepts.md, "Reclaimed bytes"): a demotion frees the faster tier
        (reason ``moved``) just as an expiry or a reap does. The index's cumulative total (status,
        metrics) and this pass's result (prune) are fed here only, with the same number."""
        self.index.add_reclaimed(reason, nbytes)
        self._reclaimed[tier] = self._reclaimed.get(tier, 0) + nbytes

    def _hot_path(self, rel: str) -> str:
        return os.path.join(self.tiers[0].url.removeprefix("file://"), rel)

    def _changed_since_cataloged(self, row: CheckpointRow) -> bool:
        """Re-recognise the hot copy the way the catalog did; any change in size or write time counts.

        The write time is the catalog's (``Catalog._written``): the later of mtime and ctime unless
        ``trust_mtimes``. Compared by mtime alone, a checkpoint whose ctime is past its mtime (a
        ``cp -a`` copy, a framework's write-then-rename) looked written to at every pass, and was
        never moved or deleted from hot."""
        run_dir = Path(self._hot_path(row.run))
        cand = layouts.recognize(run_dir / row.name, run_dir, row.run)
        if cand is not None and row.committed:  # every regular file is the hook's checkpoint's
            cand = hookfiles.whole_checkpoint(run_dir, cand)
        if cand is None:
            return _newest_mtime(str(run_dir / row.name)) != row.last_write
        written = cand.last_write if self.trust_mtimes else max(cand.last_write, cand.changed_at)
        return written != row.last_write or cand.bytes != row.bytes


class _Beside:
    """``fn`` running in a thread from now on; :meth:`wait` joins it and raises what it raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name="ckptkeeper-flush", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # raised by wait()
            self._errors.append(exc)

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> None:
        self._thread.join()
        if self._errors:
            raise self._errors[0]


def _newest_mtime(path: str) -> float | None:
    """Newest mtime under ``path`` without following symlinks; None if it is gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    newest = st.st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            for name in (*dirnames, *filenames):
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except OSError:
                    continue
    return newest
