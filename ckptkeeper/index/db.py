"""The index's queries: every SQL statement ckptkeeper runs is in this module.

SQLite in WAL mode with ``synchronous=FULL``: the index and the executor's journal must survive
``kill -9`` and power loss, because the journal is what lets a restart finish or undo a move.
Readers (``ls``, the metrics endpoint) never block the daemon's writer in WAL mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptkeeper.core.model import (
    Artifact,
    Checkpoint,
    CheckpointState,
    RunState,
    Snapshot,
)
from ckptkeeper.index.rows import (
    DAMAGED,
    CheckpointRow,
    JobRun,
    JournalEntry,
    Quarantined,
    RunRow,
    TierStatus,
    checkpoint_row,
    run_row,
)
from ckptkeeper.index.schema import BUSY_TIMEOUT_MS, MIGRATIONS, SCHEMA_VERSION, IndexCorrupt


class IndexReplaced(Exception):
    """The index file at the configured path is gone or is another file than the one this
    connection opened (``rm index.db*``, a restore from backup): its writes would land in a
    deleted file that nobody reads, and its reads miss what others wrote (pins). The caller
    reopens the path and rebuilds with deletes held (``actions.index.reopen_after_loss``)."""


_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class _Result:
    """A finished statement: its rows, fetched while the index lock was held."""

    __slots__ = ("_rows", "lastrowid", "rowcount")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        try:
            self._rows: list[Any] = cursor.fetchall()
            self.rowcount = cursor.rowcount
            self.lastrowid = cursor.lastrowid
        finally:
            cursor.close()

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return self._rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


class Index:
    """A connection to the catalog. Thread-safe by serialising access (one writer anyway)."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self.reconcile_lock = threading.RLock()
        """Serialises catalog reconciles that share this connection (watcher vs scheduled jobs)."""
        self._identity: tuple[int, int] | None = None
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"file:{self.path}?mode=ro" if readonly else f"file:{self.path}"
        self._db = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._migrate()
        self._identity = self._file_identity()
        """(st_dev, st_ino) of the file this connection opened; None: not a file (``:memory:``),
        or not known yet (migrations run before it is taken)."""

    # -- identity --------------------------------------------------------------------------

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def identity_problem(self) -> str | None:
        """Why the file at ``path`` is not the one this connection uses (None: it is).

        One ``stat``: cheap enough before every pass and every write.
        """
        if self._identity is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"index {self.path} was deleted while open"
        except OSError as exc:
            return f"index {self.path} cannot be checked: {exc.strerror or exc}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"index {self.path} was replaced by another file while open"
        return None

    def check_identity(self) -> None:
        """Raise :class:`IndexReplaced` unless the path still names this connection's file."""
        problem = self.identity_problem()
        if problem is not None:
            raise IndexReplaced(problem)

    def reopen(self) -> None:
        """Close this connection and open the file now at ``path`` (created if missing), in place:
        the watcher, the catalog and the jobs keep their reference to this object."""
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            fresh = Index(self.path)
            self._db = fresh._db
            self._identity = fresh._identity

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def quick_check(self) -> None:
        """Raise IndexCorrupt unless SQLite's quick_check passes."""
        try:
            rows = self._db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            raise IndexCorrupt(str(exc)) from exc
        result = [r[0] for r in rows]
        if result != ["ok"]:
            raise IndexCorrupt("; ".join(result[:5]))

    def _migrate(self) -> None:
        if self._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            # Up to date (every open but the first): no write transaction, so `ls`, `status` and
            # `pin` never queue behind the daemon's writer (busy_timeout) just to open the index.
            return
        with self.transaction():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"index {self.path} has schema version {version}, newer than this ckptkeeper ({SCHEMA_VERSION})"
                )
            for i in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[i].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {i + 1}")

    @contextmanager
    def in_memory_copy(self) -> Iterator[Index]:
        """A private in-memory clone: dry runs reconcile and plan in it, leaving this index untouched."""
        mem = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        with self._lock:
            self._db.backup(mem)
        clone = Index.__new__(Index)
        clone.path = self.path
        clone._lock = threading.RLock()
        clone.reconcile_lock = threading.RLock()
        clone._db = mem
        clone._identity = None
        mem.row_factory = sqlite3.Row
        mem.execute("PRAGMA foreign_keys = ON")
        try:
            yield clone
        finally:
            mem.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic unit; nested use joins the outer transaction."""
        with self._lock:
            if self._db.in_transaction:
                yield
                return
            self.check_identity()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except BaseException:
                # A COMMIT that failed leaves the transaction open on this shared connection: every
                # later write of every thread would silently join it and never be committed.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested atomic unit inside a transaction: on an exception only its own writes are undone
        (one bad document must not leave half its rows behind, nor roll back everyone else's)."""
        with self._lock:
            if not self._db.in_transaction:
                with self.transaction():
                    yield
                return
            self._db.execute("SAVEPOINT one_document")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK TO one_document")
                self._db.execute("RELEASE one_document")
                raise
            self._db.execute("RELEASE one_document")

    def _exec(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> _Result:
        """Run one statement and fetch all it returns while holding the lock.

        The daemon's threads share this connection: a cursor still being read outside the lock is
        a statement in progress, and another thread's COMMIT then fails ("cannot commit transaction
        - SQL statements in progress").
        """
        with self._lock:
            if not self._db.in_transaction and sql.lstrip()[:7].upper().startswith(_WRITES):
                self.check_identity()  # a write into a deleted or replaced file is lost
            return _Result(self._db.execute(sql, params))

    # -- runs ------------------------------------------------------------------------------

    def upsert_run(
        self,
        name: str,
        *,
        state: RunState,
        state_reason: str = "",
        last_seen: float = 0.0,
        parent: tuple[str, int] | None = None,
        host: str = "",
        pid: int | None = None,
        on_hot: bool = True,
    ) -> None:
        self._exec(
            """INSERT INTO runs (name, state, state_reason, last_seen, parent_run, parent_step, host, pid, on_hot, updated_at)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (name) DO UPDATE SET state = excluded.state, state_reason = excluded.state_reason,
                 last_seen = excluded.last_seen, parent_run = excluded.parent_run,
                 parent_step = excluded.parent_step, host = excluded.host, pid = excluded.pid,
                 on_hot = excluded.on_hot, updated_at = excluded.updated_at""",
            (
                name,
                state.value,
                state_reason,
                last_seen,
                parent[0] if parent else None,
                parent[1] if parent else None,
                host,
                pid,
                int(on_hot),
                time.time(),
            ),
        )

    def runs(self) -> list[RunRow]:
        rows = self._exec("SELECT * FROM runs ORDER BY name").fetchall()
        return [run_row(r) for r in rows]

    def run(self, name: str) -> RunRow | None:
        row = self._exec("SELECT * FROM runs WHERE name = ?", (name,)).fetchone()
        return run_row(row) if row else None

    def delete_run(self, name: str) -> None:
        self._exec("DELETE FROM runs WHERE name = ?", (name,))

    # -- checkpoints -----------------------------------------------------------------------

    def upsert_checkpoint(
        self,
        *,
        run: str,
        name: str,
        step: int,
        layout: str,
        state: CheckpointState,
        created_at: float,
        last_write: float,
        bytes: int,
        metrics: Mapping[str, float],
        committed: bool,
        version: str | None,
        manifest_json: str | None,
        problem: str | None,
    ) -> int:
        """Insert or update by (run, name); keeps ``pinned`` and locations. Returns the row id."""
        row = self._exec(
            """INSERT INTO checkpoints (run, name, step, layout, state, created_at, last_write, bytes, metrics,
                                        committed, version, manifest, problem)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (run, name) DO UPDATE SET step = excluded.step, layout = excluded.layout,
                 state = excluded.state, last_write = excluded.last_write, bytes = excluded.bytes,
                 metrics = excluded.metrics, committed = excluded.committed, version = excluded.version,
                 manifest = excluded.manifest, problem = excluded.problem,
                 created_at = CASE WHEN checkpoints.version IS excluded.version THEN checkpoints.created_at
                                   ELSE excluded.created_at END
               RETURNING id""",
            (
                run,
                name,
                step,
                layout,
                state.value,
                created_at,
                last_write,
                bytes,
                json.dumps(dict(metrics), sort_keys=True),
                int(committed),
                version,
                manifest_json,
                problem,
            ),
        ).fetchone()
        return int(row[0])

    def checkpoints(self, run: str | None = None) -> list[CheckpointRow]:
        if run is None:
            rows = self._exec("SELECT * FROM checkpoints ORDER BY run, step, name").fetchall()
            locs = self._exec("SELECT checkpoint_id, tier, version FROM locations").fetchall()
        else:
            rows = self._exec(
                "SELECT * FROM checkpoints WHERE run = ? ORDER BY step, name", (run,)
            ).fetchall()
            locs = self._exec(
                """SELECT l.checkpoint_id, l.tier, l.version FROM locations l
                   JOIN checkpoints c ON c.id = l.checkpoint_id WHERE c.run = ?""",
                (run,),
            ).fetchall()
        by_id: dict[int, dict[str, str]] = {}
        for loc in locs:
            by_id.setdefault(loc[0], {})[loc[1]] = loc[2]
        return [checkpoint_row(r, by_id.get(r["id"], {})) for r in rows]

    def count_verified(self, tier: str) -> int:
        """Complete checkpoints with their current version in ``tier`` (status lines: no rows built)."""
        row = self._exec(
            """SELECT count(*) FROM checkpoints c JOIN locations l ON l.checkpoint_id = c.id
               WHERE c.state = 'complete' AND l.tier = ? AND l.version = c.version""",
            (tier,),
        ).fetchone()
        return int(row[0])

    def checkpoint(self, run: str, name: str) -> CheckpointRow | None:
        row = self._exec("SELECT * FROM checkpoints WHERE run = ? AND name = ?", (run, name)).fetchone()
        if row is None:
            return None
        locs = self._exec(
            "SELECT tier, version FROM locations WHERE checkpoint_id = ?", (row["id"],)
        ).fetchall()
        return checkpoint_row(row, {loc[0]: loc[1] for loc in locs})

    def checkpoints_at_step(self, run: str, step: int) -> list[CheckpointRow]:
        return [c for c in self.checkpoints(run) if c.step == step]

    def delete_checkpoint(self, checkpoint_id: int) -> None:
        self._exec("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))

    def set_state(self, checkpoint_id: int, state: CheckpointState, problem: str | None = None) -> None:
        self._exec(
            "UPDATE checkpoints SET state = ?, problem = ? WHERE id = ?",
            (state.value, problem, checkpoint_id),
        )

    def set_pinned(self, run: str, step: int, pinned: bool) -> int:
        """Pin/unpin every checkpoint of ``run`` at ``step``; returns how many rows changed."""
        cur = self._exec(
            "UPDATE checkpoints SET pinned = ? WHERE run = ? AND step = ?", (int(pinned), run, step)
        )
        return cur.rowcount

    def pin_by_name(self, keys: Iterable[tuple[str, str]]) -> int:
        """Pin the checkpoints ``(run, name)`` that exist and are not pinned yet (pins read back
        from the tiers; never unpins). Returns how many rows changed."""
        changed = 0
        with self.transaction():
            for run, name in keys:
                changed += self._exec(
                    "UPDATE checkpoints SET pinned = 1 WHERE run = ? AND name = ? AND pinned = 0", (run, name)
                ).rowcount
        return changed

    def pinned_names(self) -> set[tuple[str, str]]:
        """(run, name) of every pinned checkpoint."""
        return {(r[0], r[1]) for r in self._exec("SELECT run, name FROM checkpoints WHERE pinned = 1")}

    # -- locations -------------------------------------------------------------------------

    def set_location(
        self,
        checkpoint_id: int,
        tier: str,
        version: str,
        verified_at: float | None = None,
        *,
        node: str = "",
    ) -> None:
        """Record a verified copy; ``node`` is the node its manifest names ('' = this node)."""
        self._exec(
            """INSERT INTO locations (checkpoint_id, tier, version, verified_at, node) VALUES (?, ?, ?, ?, ?)
               ON CONFLICT (checkpoint_id, tier) DO UPDATE SET version = excluded.version,
                 verified_at = excluded.verified_at, node = excluded.node""",
            (checkpoint_id, tier, version, time.time() if verified_at is None else verified_at, node),
        )

    def mark_damaged(self, checkpoint_id: int, tier: str, problem: str, *, node: str | None = None) -> None:
        """Record that the copy in ``tier`` is damaged (see :data:`~ckptkeeper.index.rows.DAMAGED`).

        The copy keeps its owner: ``node`` when the manifest was just read, else the node already
        recorded (a damaged copy another node wrote is still that node's: DESIGN §10).
        """
        self._exec(
            """INSERT INTO locations (checkpoint_id, tier, version, verified_at, node) VALUES (?, ?, ?, ?, ?)
               ON CONFLICT (checkpoint_id, tier) DO UPDATE SET version = excluded.version,
                 verified_at = excluded.verified_at,
                 node = CASE WHEN ? THEN excluded.node ELSE locations.node END""",
            (
                checkpoint_id,
                tier,
                DAMAGED + " ".join(problem.split())[:500],
                time.time(),
                node or "",
                node is not None,
            ),
        )

    def remove_location(self, checkpoint_id: int, tier: str) -> None:
        self._exec("DELETE FROM locations WHERE checkpoint_id = ? AND tier = ?", (checkpoint_id, tier))

    def locations_in_tier(self, tier: str) -> dict[tuple[str, str], tuple[int, str]]:
        """(run, name) -> (checkpoint id, version) for every location recorded in ``tier``."""
        rows = self._exec(
            """SELECT c.run, c.name, c.id, l.version FROM locations l JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.tier = ?""",
            (tier,),
        ).fetchall()
        return {(r[0], r[1]): (r[2], r[3]) for r in rows}

    def tier_holdings(self, tier: str, node: str = "") -> tuple[int, int, float | None]:
        """(runs, checkpoints, newest ``created_at``) with a verified copy in ``tier`` written by this
        node (location node '' or ``node``): what a node heartbeat reports (DESIGN §10)."""
        row = self._exec(
            """SELECT COUNT(DISTINCT c.run), COUNT(*), MAX(c.created_at) FROM locations l
               JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.tier = ? AND l.version = c.version AND (l.node = '' OR l.node = ?)""",
            (tier, node),
        ).fetchone()
        return int(row[0] or 0), int(row[1] or 0), None if row[2] is None else float(row[2])

    def prune_orphans(self) -> int:
        """Drop checkpoints with no location that are not in the hot tier's working set (gone everywhere)."""
        cur = self._exec(
            """DELETE FROM checkpoints WHERE state = 'complete'
               AND NOT EXISTS (SELECT 1 FROM locations l WHERE l.checkpoint_id = checkpoints.id)"""
        )
        return cur.rowcount

    # -- artifacts & tier status -----------------------------------------------------------

    def replace_artifacts(
        self,
        tier: str,
        artifacts: Iterable[Artifact],
        *,
        kinds: Sequence[str] | None = None,
        run: str | None = None,
    ) -> None:
        """Replace the artifacts of ``tier``, optionally only those of some kinds or of one run."""
        where, params = "tier = ?", [tier]
        if kinds is not None:
            where += f" AND kind IN ({','.join('?' * len(kinds))})"
            params.extend(kinds)
        if run is not None:
            where += " AND run = ?"
            params.append(run)
        with self.transaction():
            self._exec(f"DELETE FROM artifacts WHERE {where}", params)
            for a in artifacts:
                self._exec(
                    """INSERT OR REPLACE INTO artifacts (tier, path, kind, bytes, last_write, run, upload_id, node)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                    (a.tier, a.path, a.kind, a.bytes, a.last_write, a.run, a.upload_id or "", a.node),
                )

    def remove_artifact(self, tier: str, path: str, upload_id: str | None = None) -> None:
        self._exec(
            "DELETE FROM artifacts WHERE tier = ? AND path = ? AND upload_id = ?",
            (tier, path, upload_id or ""),
        )

    def artifacts(self) -> list[Artifact]:
        rows = self._exec("SELECT * FROM artifacts ORDER BY tier, path").fetchall()
        return [
            Artifact(
                tier=r["tier"],
                path=r["path"],
                kind=r["kind"],
                bytes=r["bytes"],
                last_write=r["last_write"],
                run=r["run"],
                upload_id=r["upload_id"] or None,
                # a read-only index not yet migrated has no node column (sqlite3.Row: `in` tests values)
                node=r["node"] if "node" in r.keys() else "",  # noqa: SIM118
            )
            for r in rows
        ]

    def replace_quarantine(
        self,
        tier: str,
        entries: Iterable[Quarantined],
        *,
        run: str | None = None,
        kinds: Sequence[str] | None = None,
    ) -> None:
        """Replace what is quarantined in ``tier`` (optionally only for one run, or some kinds):
        entries still present keep their ``first_seen``, the rest are forgotten (fixed or gone)."""
        where, params = "tier = ?", [tier]
        if run is not None:
            where += " AND run = ?"
            params.append(run)
        if kinds is not None:
            where += f" AND kind IN ({','.join('?' * len(kinds))})"
            params.extend(kinds)
        now = time.time()
        with self.transaction():
            first = {
                (r["path"], r["kind"]): r["first_seen"]
                for r in self._exec(f"SELECT path, kind, first_seen FROM quarantine WHERE {where}", params)
            }
            self._exec(f"DELETE FROM quarantine WHERE {where}", params)
            for q in entries:
                path, reason = _safe_text(q.path, 4096), _safe_text(q.reason, 2000)
                self._exec(
                    """INSERT OR REPLACE INTO quarantine (tier, path, kind, run, reason, first_seen, last_seen)
                       VALUES (?, ?, ?, ?, ?, ?, ?)""",
                    (
                        tier,
                        path,
                        q.kind,
                        None if q.run is None else _safe_text(q.run, 4096),
                        reason,
                        first.get((path, q.kind), now),
                        now,
                    ),
                )

    def quarantined(self) -> list[Quarantined]:
        rows = self._exec("SELECT * FROM quarantine ORDER BY tier, path, kind").fetchall()
        return [
            Quarantined(
                tier=r["tier"],
                path=r["path"],
                kind=r["kind"],
                reason=r["reason"],
                run=r["run"],
                first_seen=r["first_seen"],
                last_seen=r["last_seen"],
            )
            for r in rows
        ]

    def set_tier_status(self, tier: str, ok: bool, error: str | None = None) -> None:
        self._exec(
            """INSERT INTO tier_status (tier, ok, error, checked_at) VALUES (?, ?, ?, ?)
               ON CONFLICT (tier) DO UPDATE SET ok = excluded.ok, error = excluded.error,
                 checked_at = excluded.checked_at""",
            (tier, int(ok), error, time.time()),
        )

    def tier_statuses(self) -> dict[str, TierStatus]:
        rows = self._exec("SELECT * FROM tier_status").fetchall()
        return {r["tier"]: TierStatus(r["tier"], bool(r["ok"]), r["error"], r["checked_at"]) for r in rows}

    # -- snapshot for the planner ----------------------------------------------------------

    def snapshot(self, tier_names: Sequence[str] | None = None, *, node: str | None = None) -> Snapshot:
        """A consistent view for the planner (one read transaction).

        A tier whose last listing failed, or that was never listed, is unknown: the planner must
        not read its absence of copies as "empty". With ``node`` (this node's name), copies whose
        manifest names another node are reported in ``Snapshot.foreign`` (DESIGN §10).
        """
        with self._lock:
            self._db.execute("BEGIN")
            try:
                runs = tuple(r.to_model() for r in self.runs())
                checkpoints = self._snapshot_checkpoints()
                artifacts = tuple(self.artifacts())
                statuses = self.tier_statuses()
                foreign = self._foreign_copies(node) if node else {}
            finally:
                self._db.execute("COMMIT")
        unknown = set()
        for name in tier_names or ():
            status = statuses.get(name)
            if status is None or not status.ok:
                unknown.add(name)
        return Snapshot(
            runs=runs,
            checkpoints=checkpoints,
            artifacts=artifacts,
            unknown_tiers=frozenset(unknown),
            foreign=foreign,
            node=node or "",
        )

    def _foreign_copies(self, node: str) -> dict[tuple[str, int, str], str]:
        """(run, step, tier) -> owner of every copy another node wrote: verified, or marked damaged
        (a damaged copy is still its owner's; never this node's to delete or replace)."""
        rows = self._db.execute(
            """SELECT c.run, c.step, l.tier, l.node FROM locations l JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.node != '' AND l.node != ?
                 AND (l.version = c.version OR substr(l.version, 1, ?) = ?)""",
            (node, len(DAMAGED), DAMAGED),
        )
        return {(run, step, tier): owner for run, step, tier, owner in rows}

    def _snapshot_checkpoints(self) -> tuple[Checkpoint, ...]:
        """``CheckpointRow.to_model()`` of every row, without reading the manifests (the bulk of a
        row) or building the intermediate rows: 100k checkpoints 4 s -> ~1 s (bench/planning.py)."""
        by_id: dict[int, list[tuple[str, str]]] = {}
        for cid, tier, version in self._db.execute("SELECT checkpoint_id, tier, version FROM locations"):
            by_id.setdefault(cid, []).append((tier, version))
        shared: dict[frozenset[str], frozenset[str]] = {}
        nowhere: frozenset[str] = frozenset()
        states = {s.value: s for s in CheckpointState}
        loads = json.loads
        rows = self._db.execute(
            """SELECT id, run, name, step, layout, state, created_at, last_write, bytes, metrics, pinned,
                      committed, version FROM checkpoints ORDER BY run, step, name"""
        )
        out = []
        for (
            cid,
            run,
            name,
            step,
            layout,
            state,
            created,
            last_write,
            nbytes,
            metrics,
            pinned,
            committed,
            version,
        ) in rows:
            tiers = nowhere
            locations = by_id.get(cid)
            if locations:
                verified = frozenset(t for t, v in locations if v == version)
                if not verified and any(v.startswith(DAMAGED) for _, v in locations):
                    # Its only copies are damaged: nothing the planner can keep, move or count as
                    # a run's newest (that protection belongs to a checkpoint that exists).
                    continue
                tiers = shared.setdefault(verified, verified)  # a handful of distinct sets
            out.append(
                Checkpoint(
                    run=run,
                    step=step,
                    name=name,
                    layout=layout,
                    state=states[state],
                    created_at=created,
                    bytes=nbytes,
                    metrics=loads(metrics),
                    pinned=bool(pinned),
                    version=version,
                    tiers=tiers,
                    last_write=last_write,
                    committed=bool(committed),
                )
            )
        return tuple(out)

    # -- journal ---------------------------------------------------------------------------

    def journal_begin(
        self, action: Mapping[str, Any], phase: str = "start", detail: Mapping[str, Any] | None = None
    ) -> int:
        now = time.time()
        row = self._exec(
            "INSERT INTO journal (action, phase, detail, started_at, updated_at) VALUES (?, ?, ?, ?, ?) RETURNING id",
            (json.dumps(dict(action), sort_keys=True), phase, json.dumps(dict(detail or {})), now, now),
        ).fetchone()
        return int(row[0])

    def journal_phase(self, entry_id: int, phase: str, detail: Mapping[str, Any] | None = None) -> None:
        if detail is None:
            self._exec(
                "UPDATE journal SET phase = ?, updated_at = ? WHERE id = ?", (phase, time.time(), entry_id)
            )
        else:
            self._exec(
                "UPDATE journal SET phase = ?, detail = ?, updated_at = ? WHERE id = ?",
                (phase, json.dumps(dict(detail)), time.time(), entry_id),
            )

    def journal_done(self, entry_id: int, phase: str = "done") -> None:
        self._exec(
            "UPDATE journal SET phase = ?, done = 1, updated_at = ? WHERE id = ?",
            (phase, time.time(), entry_id),
        )

    def journal_open(self) -> list[JournalEntry]:
        rows = self._exec("SELECT * FROM journal WHERE done = 0 ORDER BY id").fetchall()
        return [
            JournalEntry(
                r["id"], json.loads(r["action"]), r["phase"], json.loads(r["detail"]), r["started_at"]
            )
            for r in rows
        ]

    def journal_trim(self, keep: int = 10_000) -> None:
        self._exec("DELETE FROM journal WHERE done = 1 AND id <= (SELECT MAX(id) FROM journal) - ?", (keep,))

    # -- statistics ------------------------------------------------------------------------

    def add_reclaimed(self, reason: str, nbytes: int, count: int = 1) -> None:
        self._exec(
            """INSERT INTO reclaimed (reason, bytes, count) VALUES (?, ?, ?)
               ON CONFLICT (reason) DO UPDATE SET bytes = bytes + excluded.bytes, count = count + excluded.count""",
            (reason, nbytes, count),
        )

    def reclaimed(self) -> dict[str, tuple[int, int]]:
        """reason -> (bytes, count), cumulative since the index was created."""
        return {
            r[0]: (r[1], r[2]) for r in self._exec("SELECT reason, bytes, count FROM reclaimed").fetchall()
        }

    def job_started(self, job: str) -> None:
        self._exec(
            """INSERT INTO job_runs (job, last_start) VALUES (?, ?)
               ON CONFLICT (job) DO UPDATE SET last_start = excluded.last_start""",
            (job, time.time()),
        )

    def job_finished(self, job: str, error: str | None = None) -> None:
        now = time.time()
        if error is None:
            self._exec(
                """INSERT INTO job_runs (job, last_success) VALUES (?, ?)
                   ON CONFLICT (job) DO UPDATE SET last_success = excluded.last_success""",
                (job, now),
            )
        else:
            self._exec(
                """INSERT INTO job_runs (job, last_error, last_error_at) VALUES (?, ?, ?)
                   ON CONFLICT (job) DO UPDATE SET last_error = excluded.last_error,
                     last_error_at = excluded.last_error_at""",
                (job, error, now),
            )

    def job_runs(self) -> dict[str, JobRun]:
        rows = self._exec("SELECT * FROM job_runs").fetchall()
        return {
            r["job"]: JobRun(
                r["job"], r["last_start"], r["last_success"], r["last_error"], r["last_error_at"]
            )
            for r in rows
        }


def _safe_text(value: str, limit: int) -> str:
    """Hostile text made storable: non-UTF-8 bytes escaped, NULs shown, length bounded."""
    text = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")
    return text if len(text) <= limit else text[:limit] + "…"
