"""Reconcile what is on the tiers with the index.

The hot tier is walked (layouts recognise checkpoints, the hook's files say which are committed and
how the run is doing); slower tiers are listed through the manifests stored beside each copy, so
the index can always be rebuilt from the tiers alone. Hashing is the expensive part, so a
checkpoint whose size and newest mtime did not change keeps its manifest: ``scan`` is idempotent
and cheap when nothing changed.
"""

from __future__ import annotations

import math
import os
import socket
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.core.model import CheckpointState, FileEntry, Manifest, NodePart, RunState
from ckptkeeper.core.reaper import RunFacts, derive_run_state, run_state_changes_at
from ckptkeeper.hook import protocol, schema
from ckptkeeper.hook.protocol import STAGING_MARK, STATE_DIR
from ckptkeeper.index import CheckpointRow, Index, Quarantined
from ckptkeeper.ingest import hookfiles, layouts
from ckptkeeper.ingest.clocks import FileClocks
from ckptkeeper.ingest.deferred import Deferred, fingerprints
from ckptkeeper.ingest.report import HOSTILE, ReconcileReport
from ckptkeeper.ingest.tiers import SlowerTiers, mark_off_hot, record_trash
from ckptkeeper.util.hashing import hash_file
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.ingest.catalog")

MAX_STEP = schema.MAX_STEP
"""SQLite integers are 64-bit; a larger "step" is not a step anyone trains to."""


class Catalog:
    """Applies tier contents to the index. One instance per daemon / CLI invocation."""

    def __init__(
        self,
        settings: Settings,
        index: Index,
        *,
        clock: Callable[[], float] | None = None,
        storage_factory: Callable[[str], object] | None = None,
        defer_new: bool = False,
    ) -> None:
        self.settings = settings
        self.defer_new = defer_new
        """Leave new complete checkpoints unhashed and unrecorded (:attr:`deferred`): the caller
        hashes each while it moves it (one read of its bytes), or records it with
        :meth:`record_deferred` (hashed then). ``prune`` does (:mod:`ckptkeeper.actions.pruning.hot_once`)."""
        self.deferred: list[Deferred] = []
        self.index = index
        self.clock: Callable[[], float] = FileClocks(settings, write=True).hot if clock is None else clock
        """The hot tier's filesystem clock (:mod:`ckptkeeper.ingest.clocks`): settling and run and
        partial ages compare file times with it, never with this node's clock. A dry run passes a
        read-only one."""
        self.hot_root = settings.hot.local_path
        self.hostname = socket.gethostname()
        self._storage_factory = storage_factory
        self.tiers = SlowerTiers(settings, index)
        self._state_due: dict[str, float] = {}
        """Run -> when its recorded state can next change by the clock alone (``inf``: never), as
        of its last reconcile; a run missing here is unknown (see :meth:`state_due`)."""

    @property
    def tier_pins(self) -> dict[str, set[tuple[str, str]]]:
        """Pin objects each slower tier held at its last successful listing (for ``pins``)."""
        return self.tiers.tier_pins

    @property
    def own_copies(self) -> dict[str, int]:
        """Copies each slower tier held at its last listing whose manifest names this node: they
        prove this node had an index before (a missing one was lost, not never made)."""
        return self.tiers.own_copies

    # -- the hot tier ----------------------------------------------------------------------

    def state_due(self, run: str) -> float:
        """When the state recorded for ``run`` by this catalog's last reconcile of it can next be
        changed by the clock alone: ``inf`` never (finished/failed, or stale without the hook),
        ``-inf`` when this catalog has not reconciled the run (or its reconcile did not finish),
        the time it turns stale for a run without the hook, and the reconcile's own time for
        anything that can change unseen (a pid, a heartbeat, a ``.ckptkeeper/`` dir). The watcher
        re-derives a run's state only once its time has come: writes raise events of their own."""
        return self._state_due.get(run, -math.inf)

    def iter_run_dirs(self) -> Iterator[tuple[str, Path]]:
        """(run name, dir) for every directory ``run_depth`` levels under the hot root.

        Hidden entries and symlinks are skipped: a symlink could lead out of the tier root.
        """
        depth = self.settings.run_depth

        def walk(path: Path, rel: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
            try:
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError:
                return
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                if STATE_DIR in entry.name or STAGING_MARK in entry.name or _has_surrogates(entry.name):
                    continue
                sub = (*rel, entry.name)
                if len(sub) == depth:
                    yield "/".join(sub), Path(entry.path)
                else:
                    yield from walk(Path(entry.path), sub)

        yield from walk(self.hot_root, ())

    def reconcile_hot(self) -> ReconcileReport:
        report = ReconcileReport()
        hot = self.settings.hot.name
        if not self.hot_root.is_dir():
            self.index.set_tier_status(hot, False, f"hot root {self.hot_root} is not a directory")
            report.tiers_failed[hot] = f"hot root {self.hot_root} is not a directory"
            return report
        seen: set[str] = set()
        for run, run_dir in self.iter_run_dirs():
            seen.add(run)
            report.merge(self.reconcile_run(run, run_dir))
        for row in self.index.runs():
            if row.on_hot and row.name not in seen:
                self._run_gone_from_hot(row.name)
        report.merge(self.reconcile_hot_trash())
        self.index.set_tier_status(hot, True)
        return report

    def reconcile_hot_trash(self) -> ReconcileReport:
        """Record the hot tier's trash (``<hot>/.ckptkeeper-trash``, docs/undo-window.md): a hidden
        directory, so never a run; listed here only. A failed listing keeps what was recorded."""
        from ckptkeeper.storage import LocalTierStorage, TierUnavailable

        report = ReconcileReport()
        spec = self.settings.hot.to_spec()
        try:
            listing = LocalTierStorage(spec, hot=True).list_trash()
        except TierUnavailable as exc:
            log.warning("hot trash could not be listed; kept as recorded", error=str(exc))
            return report
        report.quarantined += record_trash(self.index, spec.name, listing)
        return report

    def reconcile_run(self, run: str, run_dir: Path | None = None) -> ReconcileReport:
        """Bring one run in line with its directory (the watcher calls this per changed run)."""
        # Two reconciles of one run (watcher + a prune job) must not interleave: the slower one
        # would write an older view over a newer one.
        with self.index.reconcile_lock:
            try:
                return self._reconcile_run(run, run_dir)
            except HOSTILE as exc:
                # One run's hostile files must not stop the pass over the others (nor the daemon).
                log.error(
                    "run could not be reconciled; quarantined", run=run, error=f"{type(exc).__name__}: {exc}"
                )
                reason = f"could not be cataloged: {type(exc).__name__}: {str(exc)[:500]}"
                self.index.replace_quarantine(
                    self.settings.hot.name,
                    [Quarantined(self.settings.hot.name, run, "run", reason, run=run)],
                    run=run,
                )
                return ReconcileReport(runs=1, quarantined=1)

    def _reconcile_run(self, run: str, run_dir: Path | None) -> ReconcileReport:
        run_dir = run_dir or self.hot_root / run
        report = ReconcileReport(runs=1)
        # Unknown until this reconcile has recorded the run: an early return or an error leaves
        # the run to be re-checked by every sync, the safe side.
        self._state_due.pop(run, None)
        try:
            st = os.lstat(run_dir)
        except FileNotFoundError:
            self._run_gone_from_hot(run)
            return report
        if not stat.S_ISDIR(st.st_mode):
            return report
        now = self.clock()
        try:
            scan = layouts.scan_run(run_dir, run)
        except OSError as exc:
            # An unlistable run is unknown, not empty: keep what the index knew.
            log.warning("cannot scan run directory; index left as it was", run=run, error=str(exc))
            return report
        commits, held = self._hook_commits(run, run_dir, scan)
        hot = self.settings.hot.name
        committed = {c.path: c for c in commits}
        hook = hookfiles.hook_state(run_dir, run, hot, scan)
        info = hook[0]
        candidates = hookfiles.with_commits(run_dir, run, scan.candidates, commits)

        existing = {row.name: row for row in self.index.checkpoints(run)}
        # The run dir's own mtime is not a write by the trainer (our deletes change it too).
        newest_write = max(
            [self._written(c) for c in candidates.values()] + [a.last_write for a in scan.artifacts],
            default=st.st_mtime,
        )
        managed, written = self._managed(run, candidates, committed, info, held)
        newest_write = max(newest_write, written)
        # Hash before taking the index's write lock: a big checkpoint takes minutes to read, and
        # a `pin` or `prune` in another process must not wait that long (busy timeout: 10 s).
        hashed: dict[str, Manifest | OSError] = {}
        deferred: set[str] = set()
        for cand, commit, part in managed:
            if self._state_of(cand, commit, now, part) is not CheckpointState.COMPLETE or _unchanged_in_hot(
                existing.get(cand.name), cand, hot, self._written(cand)
            ):
                continue
            known = existing.get(cand.name)
            later = (
                self._defer(run_dir, cand, commit, part, now)
                if known is None or known.version is None
                else None
            )
            if later is not None:
                self.deferred.append(later)
                deferred.add(cand.name)
            else:
                hashed[cand.name] = self._try_hash(run_dir, cand, commit, part)
        with self.index.transaction():
            for cand, commit, part in managed:
                if cand.name in deferred:
                    existing.pop(cand.name, None)  # never hashed (seen while written): not removed
                    continue  # recorded by record_deferred, hashed
                row = existing.pop(cand.name, None)
                self._apply_candidate(cand, commit, part, row, now, hashed.get(cand.name), report)
            self._forget_removed(run, existing, scan, report)
            # A temp name inside a hook-committed checkpoint is one of its files, never reaped alone.
            whole = hookfiles.committed_names(candidates, committed.keys())
            self.index.replace_artifacts(
                hot,
                [
                    a
                    for a in hookfiles.outside_commits(run, scan.artifacts, whole)
                    if not _has_surrogates(a.path)
                ],
                run=run,
            )
            run_held, due = self._update_run_state(run, newest_write, now, hook, hooked=bool(scan.hook_dirs))
            held.extend(run_held)
            self.index.replace_quarantine(hot, held, run=run)
        self._state_due[run] = due  # only once the state it describes is committed
        report.quarantined += len(held)
        return report

    def _hook_commits(
        self, run: str, run_dir: Path, scan: layouts.RunScan
    ) -> tuple[list[protocol.Commit], list[Quarantined]]:
        """The hook's commit lines of the run, and a quarantine entry per file with bad lines."""
        commits, commit_errors = hookfiles.read_hook_commits(run_dir, scan.hook_dirs)
        for _rel, errs in commit_errors:
            for err in errs:  # at most schema.MAX_ERRORS + 1 per file (read_commits caps them)
                log.warning("malformed hook commit line", run=run, error=err)
        held = [
            Quarantined(
                self.settings.hot.name,
                f"{run}/{hookfiles.hook_rel(rel, protocol.COMMITS_FILE)}",
                protocol.COMMITS_FILE,
                f"{len(errs)} line(s) ignored: " + "; ".join(errs[:5]),
                run=run,
            )
            for rel, errs in commit_errors
        ]
        return commits, held

    def _managed(
        self,
        run: str,
        candidates: dict[str, layouts.Candidate],
        committed: dict[str, protocol.Commit],
        info: protocol.RunInfo | None,
        held: list[Quarantined],
    ) -> tuple[list[tuple[layouts.Candidate, protocol.Commit | None, NodePart | None]], float]:
        """The candidates the catalog manages, each with its commit and node part (what it will not
        manage is added to ``held``, or logged), and the newest write among them."""
        hot = self.settings.hot.name
        newest_write = 0.0
        managed: list[tuple[layouts.Candidate, protocol.Commit | None, NodePart | None]] = []
        for name, cand in sorted(candidates.items()):
            if cand.step > MAX_STEP:
                log.warning("step out of range, ignored", run=run, name=name, step=schema.describe(cand.step))
                held.append(
                    Quarantined(
                        hot,
                        f"{run}/{name}",
                        "checkpoint",
                        f"step {schema.describe(cand.step)} is out of range [0, {MAX_STEP}]: never managed",
                        run=run,
                    )
                )
                continue
            newest_write = max(newest_write, self._written(cand))
            if _has_surrogates(name):
                # Non-UTF-8 bytes in the name: SQLite text cannot hold it. Never managed, so
                # never moved or reaped either.
                log.warning(
                    "checkpoint name is not UTF-8; ignored",
                    run=run,
                    name=name.encode("utf-8", "backslashreplace").decode(),
                )
                continue
            commit = committed.get(name) or next(
                (c for p, c in committed.items() if p.startswith(name + "/")), None
            )
            if cand.rejected:
                held.append(Quarantined(hot, f"{run}/{name}", "marker", "; ".join(cand.rejected), run=run))
            if commit is not None and cand.layout == "accelerate" and commit.step != cand.step:
                # checkpoint_N counts saves; the step the training script committed is the real one.
                cand = replace(cand, step=commit.step)
            managed.append((cand, commit, hookfiles.node_part(cand, commit, info)))
        return managed, newest_write

    def _forget_removed(
        self, run: str, existing: dict[str, CheckpointRow], scan: layouts.RunScan, report: ReconcileReport
    ) -> None:
        """Whatever the index knew in hot that is no longer there was removed (by us or by hand),
        unless part of the run could not be read: then absence proves nothing."""
        hot = self.settings.hot.name
        if scan.errors:
            log.warning(
                "parts of the run could not be read; nothing marked removed",
                run=run,
                errors=list(scan.errors)[:5],
            )
            return
        for row in existing.values():
            if hot in row.locations:
                self.index.remove_location(row.id, hot)
                report.removed += 1
            if row.state is not CheckpointState.COMPLETE or not (set(row.locations) - {hot}):
                self.index.delete_checkpoint(row.id)

    def _written(self, cand: layouts.Candidate) -> float:
        """When a checkpoint was last written, for settling and for partial and run ages: by mtime
        and ctime, because ``cp -a`` / ``rsync -a`` copy old mtimes (a copy in progress looked
        settled, or long abandoned, and was moved half-done or reaped); ``daemon.trust_mtimes``
        goes by mtimes alone."""
        if self.settings.daemon.trust_mtimes:
            return cand.last_write
        return max(cand.last_write, cand.changed_at)

    def _state_of(
        self,
        cand: layouts.Candidate,
        commit: protocol.Commit | None,
        now: float,
        part: NodePart | None = None,
    ) -> CheckpointState:
        """Settled means untouched for settle_seconds by mtime AND ctime (see _written). A node's
        part lacking only the marker rank 0 writes elsewhere is complete once settled when the
        hook said the run is a node's part (docs/spanning-nodes.md)."""
        changed = self._written(cand)
        settle = self.settings.daemon.settle_seconds
        if cand.corrupt and now - changed < settle:
            return CheckpointState.WRITING  # a marker caught mid-write looks malformed
        if cand.corrupt:
            return CheckpointState.CORRUPT
        complete = cand.complete or (cand.node_part is not None and part is not None and part.known)
        if commit is not None or (complete and now - changed >= settle):
            return CheckpointState.COMPLETE
        return CheckpointState.WRITING

    def _try_hash(
        self, run_dir: Path, cand: layouts.Candidate, commit: protocol.Commit | None, part: NodePart | None
    ) -> Manifest | OSError:
        metrics = {**dict(cand.metrics), **(dict(commit.metrics) if commit else {})}
        try:
            return self._hash_candidate(
                run_dir,
                cand,
                metrics,
                created_at=commit.time if commit else _sane_time(cand.last_write),
                part=part,
            )
        except OSError as exc:
            return exc

    def _defer(
        self,
        run_dir: Path,
        cand: layouts.Candidate,
        commit: protocol.Commit | None,
        part: NodePart | None,
        now: float,
    ) -> Deferred | None:
        """A new complete checkpoint left unhashed for now, with the fingerprint of each of its
        files; None (hash it now) unless deferring, or when a fingerprint cannot vouch for a file
        (not a regular file, or changed too recently: see :func:`fingerprint.settled`)."""
        if not self.defer_new:
            return None
        prints = fingerprints(run_dir / cand.name, cand.files, now=self.clock())
        if prints is None:
            return None
        metrics = {**dict(cand.metrics), **(dict(commit.metrics) if commit else {})}
        created_at = commit.time if commit else _sane_time(cand.last_write)
        return Deferred(run_dir, cand, commit, part, now, prints, metrics, created_at)

    def unhashed_manifest(self, d: Deferred) -> Manifest:
        """The manifest of a deferred checkpoint with a placeholder per hash: unique to its files'
        fingerprints, never stored anywhere but a dry run's scratch index (a plan's what-if) or
        handed to a copy that computes the real ones (``copy_from(fingerprints=...)``)."""
        entries = [
            FileEntry(path=rel, size=fp.size, hash=f"unhashed:{fp.dev}:{fp.ino}:{fp.ctime_ns}")
            for rel, fp in d.fingerprints.items()
        ]
        return self._manifest(d.cand, entries, d.metrics, created_at=d.created_at, part=d.part)

    def record_deferred(
        self, d: Deferred, manifest: Manifest | None, *, report: ReconcileReport
    ) -> int | None:
        """Record a deferred checkpoint: with ``manifest`` (hashed while it was copied, by the
        fingerprints the catalog took), or hashed now in place (``None``). Joins the caller's
        transaction; returns the checkpoint's row id (None if it could not be recorded)."""
        with self.index.reconcile_lock:
            hashed: Manifest | OSError = (
                manifest if manifest is not None else self._try_hash(d.run_dir, d.cand, d.commit, d.part)
            )
            with self.index.transaction():
                row = self.index.checkpoint(d.cand.run, d.cand.name)
                self._apply_candidate(d.cand, d.commit, d.part, row, d.now, hashed, report)
                recorded = self.index.checkpoint(d.cand.run, d.cand.name)
        return recorded.id if recorded is not None else None

    def _apply_candidate(
        self,
        cand: layouts.Candidate,
        commit: protocol.Commit | None,
        part: NodePart | None,
        row: CheckpointRow | None,
        now: float,
        hashed: Manifest | OSError | None,
        report: ReconcileReport,
    ) -> None:
        """Record one recognised checkpoint; ``hashed`` is its manifest when it is complete and
        changed (hashed before the transaction), or why reading it failed."""
        hot = self.settings.hot.name
        metrics = {**dict(cand.metrics), **(dict(commit.metrics) if commit else {})}
        state = self._state_of(cand, commit, now, part)
        if state is CheckpointState.WRITING and _unchanged_in_hot(row, cand, hot, self._written(cand)):
            # Recorded complete (a fetch verified it whole: ``prefetch``) and untouched since:
            # the settling time, by ctime, must not undo that.
            state = CheckpointState.COMPLETE
        report.parts += part is not None

        def record(
            state: CheckpointState,
            *,
            version: str | None = None,
            manifest: Manifest | None = None,
            problem: str | None = None,
        ) -> int:
            return self.index.upsert_checkpoint(
                run=cand.run,
                name=cand.name,
                step=cand.step,
                layout=cand.layout,
                state=state,
                created_at=manifest.created_at
                if manifest
                else (row.created_at if row else _sane_time(cand.last_write)),
                last_write=self._written(cand),
                bytes=manifest.total_bytes if manifest else cand.bytes,
                metrics=metrics,
                committed=commit is not None,
                version=manifest.digest if manifest else version,
                manifest_json=manifest.to_json()
                if manifest
                else (row.manifest_json if row and version else None),
                problem=problem,
                part=part,
            )

        if state is not CheckpointState.COMPLETE:
            report.partial += state is CheckpointState.WRITING
            report.corrupt += state is CheckpointState.CORRUPT
            settling = "settling: written less than settle_seconds ago" if cand.complete else None
            self.index.remove_location(record(state, problem=cand.problem or settling), hot)
            return
        if hashed is None:  # unchanged since it was hashed: nothing to read again
            assert row is not None and row.version is not None
            report.unchanged += 1
            old = row.manifest() if row.part != part else None
            if old is not None:  # the hook spoke after the bytes were hashed: the manifest says so too
                record(state, manifest=replace(old, part=part))
            elif dict(row.metrics) != metrics or row.committed != (commit is not None) or row.part != part:
                record(state, version=row.version)
            return
        if isinstance(hashed, OSError):
            log.warning(
                "cannot read checkpoint, marked corrupt", run=cand.run, name=cand.name, error=str(hashed)
            )
            self.index.remove_location(record(CheckpointState.CORRUPT, problem=f"unreadable: {hashed}"), hot)
            report.corrupt += 1
            return
        manifest = hashed
        report.hashed_bytes += manifest.total_bytes
        if row is None or row.version is None:
            report.new += 1
        elif row.version != manifest.digest:
            report.new_versions += 1
            log.info(
                "checkpoint rewritten: new version",
                run=cand.run,
                name=cand.name,
                old=row.version,
                new=manifest.digest,
            )
        self.index.set_location(record(state, manifest=manifest), hot, manifest.digest)

    def _hash_candidate(
        self,
        run_dir: Path,
        cand: layouts.Candidate,
        metrics: Mapping[str, float],
        *,
        created_at: float,
        part: NodePart | None = None,
    ) -> Manifest:
        base = run_dir / cand.name
        entries = []
        for rel in cand.files:
            size, digest = hash_file(base / rel if rel else base)
            entries.append(FileEntry(path=rel, size=size, hash=digest))
        return self._manifest(cand, entries, metrics, created_at=created_at, part=part)

    def _manifest(
        self,
        cand: layouts.Candidate,
        entries: list[FileEntry],
        metrics: Mapping[str, float],
        *,
        created_at: float,
        part: NodePart | None,
    ) -> Manifest:
        return Manifest(
            run=cand.run,
            step=cand.step,
            name=cand.name,
            layout=cand.layout,
            is_dir=cand.is_dir,
            files=tuple(entries),
            metrics=dict(metrics),
            created_at=created_at,
            node=self.settings.node,
            part=part,
        )

    def _update_run_state(
        self, run: str, newest_write: float, now: float, hook: hookfiles.HookState, *, hooked: bool
    ) -> tuple[list[Quarantined], float]:
        """Record the run's state from its hook files (every ``.ckptkeeper/`` in the run, read by
        :func:`hookfiles.hook_state`); return those that failed the schema, and when the clock
        alone can next change the state (see :meth:`state_due`). ``hooked``: the run holds a
        ``.ckptkeeper/`` directory."""
        info, heartbeat, warning, held = hook
        host = info.host if info and info.host else None
        pid = info.pid if info else None
        alive = info.writer_alive(hostname=self.hostname) if info else None
        facts = RunFacts(
            hook_state=info.state if info else None,
            host=host,
            pid=pid,
            pid_alive=alive,
            heartbeat=heartbeat,
            newest_write=newest_write,
        )
        failed_after = self.settings.reaper.failed_after
        state, reason = derive_run_state(facts, this_host=self.hostname, now=now, failed_after=failed_after)
        if state is RunState.FAILED and info is not None and info.reason:
            reason = f"{reason}: {info.reason[:500]}"  # the hook's or the scheduler's why (job end)
        elif (
            state is not RunState.FINISHED
            and info
            and info.job_end
            and info.job_end.get("outcome") == "requeued"
        ):
            reason = f"interrupted ({info.job_end.get('reason')}); {reason}"  # it resumes (docs/slurm.md)
        changes = run_state_changes_at(facts, now=now, failed_after=failed_after)
        if hooked and state not in (RunState.FINISHED, RunState.FAILED):
            changes = now  # a hook dir may gain a heartbeat without raising an event: every pass
        if warning:
            reason = f"{reason}; WARNING: {warning}"  # actions.status.WARNING_MARK
        last_seen = max(newest_write, heartbeat or 0.0)
        self.index.upsert_run(
            run,
            state=state,
            state_reason=reason,
            last_seen=last_seen,
            parent=self._parent_of(info),
            host=host or "",
            pid=pid,
            on_hot=True,
        )
        return held, math.inf if changes is None else changes

    def _parent_of(self, info: protocol.RunInfo | None) -> tuple[str, int] | None:
        """The parent (run, step) the hook recorded; when it also recorded the parent checkpoint's
        path inside the hot root, the run is named from that path (``run_depth`` components), which
        stays right when the hook dirs sit below the run dirs (``<run>/checkpoints/.ckptkeeper``), where
        the hook itself can only name the parent's checkpoint dir."""
        if info is None or info.parent is None:
            return None
        if info.parent_path:
            rel = os.path.relpath(os.path.realpath(info.parent_path), os.path.realpath(self.hot_root))
            parts = rel.split(os.sep)
            if rel != "." and parts[0] != ".." and len(parts) > self.settings.run_depth:
                return "/".join(parts[: self.settings.run_depth]), info.parent[1]
        return info.parent

    def _run_gone_from_hot(self, run: str) -> None:
        """The run directory disappeared: its hot copies are gone; copies elsewhere stay cataloged."""
        hot = self.settings.hot.name
        self._state_due.pop(run, None)
        with self.index.transaction():
            for row in self.index.checkpoints(run):
                self.index.remove_location(row.id, hot)
                if row.state is not CheckpointState.COMPLETE or not (set(row.locations) - {hot}):
                    self.index.delete_checkpoint(row.id)
            self.index.replace_artifacts(hot, [], run=run)
            self.index.replace_quarantine(hot, [], run=run)
            prev = self.index.run(run)
            if not self.index.checkpoints(run):
                self.index.delete_run(run)
            elif prev is not None:
                mark_off_hot(self.index, run, prev.last_seen, prev.parent)

    # -- slower tiers (``tiers``) -----------------------------------------------------------

    def reconcile_tier(self, tier_name: str) -> ReconcileReport:
        """Sync locations of one slower tier from the manifests stored beside its copies (a failed
        listing keeps every location the index had: see :meth:`SlowerTiers.reconcile_tier`)."""
        return self.tiers.reconcile_tier(tier_name)

    def reconcile(self, *, slower_tiers: bool = True) -> ReconcileReport:
        report = self.reconcile_hot()
        if slower_tiers:
            for tier in self.settings.tiers[1:]:
                report.merge(self.reconcile_tier(tier.name))
        return report


def _unchanged_in_hot(row: CheckpointRow | None, cand: layouts.Candidate, hot: str, written: float) -> bool:
    """The index holds a verified hot copy of exactly these bytes (same size and newest mtime):
    no need to read it again, which keeps ``scan`` idempotent and cheap."""
    return (
        row is not None
        and row.version is not None
        and row.manifest_json is not None
        and row.state is CheckpointState.COMPLETE
        and row.bytes == cand.bytes
        and row.last_write == written
        and row.locations.get(hot) == row.version
    )


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _sane_time(when: float) -> float:
    """A file's mtime as a creation time: any clock (``touch -d``, ``cp -a``) can set it to 1901 or
    2400, but a time the retention rules turn into a date must lie between 1970 and 3000."""
    return min(max(when, 0.0), schema.MAX_TIME)
