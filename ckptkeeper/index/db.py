"""The index: runs, checkpoints and their locations here; the rest of its queries in its mixins.

Every SQL statement ckptkeeper runs is in this package: :class:`Index` gathers ``connection`` (open,
migrate, transactions), ``artifacts`` (artifacts, quarantine, tier status), ``journal`` (the
executor's journal, reclaimed counters, job runs), ``scrub`` (what the scrub job re-hashes and
records) and ``snapshot`` (the planner's bulk read).

SQLite in WAL mode with ``synchronous=FULL``: the index and the executor's journal must survive
``kill -9`` and power loss, because the journal is what lets a restart finish or undo a move.
Readers (``ls``, the metrics endpoint) never block the daemon's writer in WAL mode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence

from ckptkeeper.core.model import CheckpointState, NodePart, RunState, Snapshot
from ckptkeeper.index.artifacts import ArtifactsMixin
from ckptkeeper.index.connection import IndexReplaced
from ckptkeeper.index.history import HistoryMixin
from ckptkeeper.index.journal import JournalMixin
from ckptkeeper.index.rows import DAMAGED, CheckpointRow, RunRow, checkpoint_row, run_row
from ckptkeeper.index.scrub import ScrubMixin
from ckptkeeper.index.snapshot import foreign_copies, read_checkpoints, unknown_tiers
from ckptkeeper.index.trash import TrashMixin

__all__ = ["Index", "IndexReplaced"]


class Index(ArtifactsMixin, JournalMixin, ScrubMixin, TrashMixin, HistoryMixin):
    """A connection to the catalog. Thread-safe by serialising access (one writer anyway).

    Opening, migrating and transactions come from :class:`~ckptkeeper.index.connection.Connection`
    (the base of both mixins); the queries are split by concept, one module each.
    """

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
        part: NodePart | None = None,
    ) -> int:
        """Insert or update by (run, name); keeps ``pinned`` and locations. Returns the row id."""
        row = self._exec(
            """INSERT INTO checkpoints (run, name, step, layout, state, created_at, last_write, bytes, metrics,
                                        committed, version, manifest, problem, part)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (run, name) DO UPDATE SET step = excluded.step, layout = excluded.layout,
                 state = excluded.state, last_write = excluded.last_write, bytes = excluded.bytes,
                 metrics = excluded.metrics, committed = excluded.committed, version = excluded.version,
                 manifest = excluded.manifest, problem = excluded.problem, part = excluded.part,
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
                None if part is None else part.to_json(),
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
        scrubbed_at: float | None = None,
        stored_bytes: int | None = None,
    ) -> None:
        """Record a verified copy; ``node`` is the node its manifest names ('' = this node).

        ``stored_bytes``: what the tier holds for it (less than its bytes when compressed); None
        keeps what is recorded for this very version (unknown to the caller).

        ``scrubbed_at``: when its bytes were hashed against the manifest (a copy just written and
        hashed, a scrub); None keeps the time already recorded for this very version (a listing
        sees sizes only) and records "never" for a new one, which the scrub job reads first."""
        self._exec(
            """INSERT INTO locations (checkpoint_id, tier, version, verified_at, node, scrubbed_at, stored_bytes)
               VALUES (?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (checkpoint_id, tier) DO UPDATE SET version = excluded.version,
                 verified_at = excluded.verified_at, node = excluded.node,
                 scrubbed_at = CASE WHEN locations.version = excluded.version
                                    THEN COALESCE(excluded.scrubbed_at, locations.scrubbed_at)
                                    ELSE excluded.scrubbed_at END,
                 stored_bytes = CASE WHEN locations.version = excluded.version
                                    THEN COALESCE(excluded.stored_bytes, locations.stored_bytes)
                                    ELSE excluded.stored_bytes END""",
            (
                checkpoint_id,
                tier,
                version,
                time.time() if verified_at is None else verified_at,
                node,
                scrubbed_at,
                stored_bytes,
            ),
        )

    def mark_damaged(self, checkpoint_id: int, tier: str, problem: str, *, node: str | None = None) -> None:
        """Record that the copy in ``tier`` is damaged (see :data:`~ckptkeeper.index.rows.DAMAGED`).

        The copy keeps its owner: ``node`` when the manifest was just read, else the node already
        recorded (a damaged copy another node wrote is still that node's: docs/design.md, "Many nodes").
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

    def location_owner(self, checkpoint_id: int, tier: str) -> str | None:
        """The node whose manifest the copy in ``tier`` names ('' = this node); None: no copy."""
        row = self._exec(
            "SELECT node FROM locations WHERE checkpoint_id = ? AND tier = ?", (checkpoint_id, tier)
        ).fetchone()
        return None if row is None else str(row[0])

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

    def stored_bytes(self) -> dict[tuple[int, str], int]:
        """(checkpoint id, tier) -> bytes the tier holds, for the verified copies a tier stores
        compressed (docs/compression.md); every other copy holds its checkpoint's bytes."""
        rows = self._exec(
            """SELECT l.checkpoint_id, l.tier, l.stored_bytes FROM locations l
               JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.version = c.version AND l.stored_bytes IS NOT NULL AND l.stored_bytes != c.bytes"""
        ).fetchall()
        return {(int(r[0]), str(r[1])): int(r[2]) for r in rows}

    def stored_history(self) -> dict[str, tuple[int, int, int]]:
        """Tier -> (copies, raw bytes, stored bytes) of its copies whose stored bytes a copy
        recorded (compressed copies, files it left raw included): what that tier achieved, the
        basis of ``prune --dry-run``'s estimate (:func:`ckptkeeper.core.cost.stored_ratios`)."""
        rows = self._exec(
            """SELECT l.tier, COUNT(*), SUM(c.bytes), SUM(l.stored_bytes) FROM locations l
               JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.version = c.version AND l.stored_bytes IS NOT NULL
               GROUP BY l.tier"""
        ).fetchall()
        return {str(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}

    def stored_copies(self) -> dict[tuple[str, str], int]:
        """(tier, ``<run>/<name>``) -> stored bytes of each copy a tier stores compressed (as
        :meth:`stored_bytes`, keyed as a plan's actions name a copy)."""
        rows = self._exec(
            """SELECT l.tier, c.run, c.name, l.stored_bytes FROM locations l
               JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.version = c.version AND l.stored_bytes IS NOT NULL AND l.stored_bytes != c.bytes"""
        ).fetchall()
        return {(str(r[0]), f"{r[1]}/{r[2]}"): int(r[3]) for r in rows}

    def tier_holdings(self, tier: str, node: str = "") -> tuple[int, int, float | None]:
        """(runs, checkpoints, newest ``created_at``) with a verified copy in ``tier`` written by this
        node (location node '' or ``node``): what a node heartbeat reports (docs/design.md, "Many nodes")."""
        row = self._exec(
            """SELECT COUNT(DISTINCT c.run), COUNT(*), MAX(c.created_at) FROM locations l
               JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.tier = ? AND l.version = c.version AND (l.node = '' OR l.node = ?)""",
            (tier, node),
        ).fetchone()
        return int(row[0] or 0), int(row[1] or 0), None if row[2] is None else float(row[2])

    def other_writers(self, tier: str, node: str) -> dict[str, list[str]]:
        """Node -> paths (``run/name``, sorted) of the copies in ``tier`` whose manifest names a node
        other than ``node`` (whatever their version): who else writes this tier."""
        rows = self._exec(
            """SELECT l.node, c.run || '/' || c.name FROM locations l JOIN checkpoints c ON c.id = l.checkpoint_id
               WHERE l.tier = ? AND l.node != '' AND l.node != ? ORDER BY l.node, c.run, c.step, c.name""",
            (tier, node),
        ).fetchall()
        out: dict[str, list[str]] = {}
        for writer, path in rows:
            out.setdefault(writer, []).append(path)
        return out

    def prune_orphans(self) -> int:
        """Drop checkpoints with no location that are not in the hot tier's working set (gone everywhere)."""
        cur = self._exec(
            """DELETE FROM checkpoints WHERE state = 'complete'
               AND NOT EXISTS (SELECT 1 FROM locations l WHERE l.checkpoint_id = checkpoints.id)"""
        )
        return cur.rowcount

    # -- snapshot for the planner ----------------------------------------------------------

    def snapshot(self, tier_names: Sequence[str] | None = None, *, node: str | None = None) -> Snapshot:
        """A consistent view for the planner (one read transaction).

        A tier whose last listing failed, or that was never listed, is unknown: the planner must
        not read its absence of copies as "empty". With ``node`` (this node's name), copies whose
        manifest names another node are reported in ``Snapshot.foreign`` (docs/design.md, "Many nodes").
        """
        with self._lock:
            self._db.execute("BEGIN")
            try:
                runs = tuple(r.to_model() for r in self.runs())
                checkpoints = read_checkpoints(self._db)
                artifacts = tuple(self.artifacts())
                statuses = self.tier_statuses()
                foreign = foreign_copies(self._db, node) if node else {}
                trash = tuple(entry for entry, _ in self.trash())
            finally:
                self._db.execute("COMMIT")
        return Snapshot(
            runs=runs,
            checkpoints=checkpoints,
            artifacts=artifacts,
            unknown_tiers=unknown_tiers(tier_names or (), statuses),
            foreign=foreign,
            node=node or "",
            trash=trash,
        )
