"""The ``history`` table: one row per executed action (``history`` and ``why``).

Written by the executor as each action ends, without a flush of its own (the next durable commit of
the pass flushes it: the WAL is sequential); bounded by age and rows with two range deletes
(:meth:`HistoryMixin.prune_history`). A corrupt index's rows are salvaged into the rebuilt one
(:func:`salvage_history`) when the damaged file still reads.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

from ckptkeeper.core.history import HistoryEvent
from ckptkeeper.index.connection import Connection

__all__ = ["HistoryMixin", "salvage_history"]

_COLUMNS = (
    "at",
    "action",
    "run",
    "step",
    "tier",
    "to_tier",
    "path",
    "bytes",
    "rule",
    "reason",
    "outcome",
    "error",
    "node",
    "owner",
    "duration",
    "trash",
)
PRUNE_CHUNK = 20_000
"""Rows :meth:`HistoryMixin.prune_history` drops at most per bound and call."""

_INSERT = f"INSERT INTO history ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


def _values(e: HistoryEvent) -> tuple[object, ...]:
    return (
        e.at,
        e.action,
        e.run,
        e.step,
        e.tier,
        e.to_tier,
        e.path,
        e.bytes,
        e.rule,
        e.reason,
        e.outcome,
        e.error,
        e.node,
        e.owner,
        e.duration,
        e.trash,
    )


def _event(r: Sequence[object]) -> HistoryEvent:
    (
        at,
        action,
        run,
        step,
        tier,
        to_tier,
        path,
        nbytes,
        rule,
        reason,
        outcome,
        error,
        node,
        owner,
        dur,
        trash,
    ) = r
    return HistoryEvent(
        at=float(at),  # type: ignore[arg-type]
        action=str(action),
        run=None if run is None else str(run),
        step=None if step is None else int(step),  # type: ignore[call-overload]
        tier=None if tier is None else str(tier),
        to_tier=None if to_tier is None else str(to_tier),
        path=None if path is None else str(path),
        bytes=int(nbytes or 0),  # type: ignore[call-overload]
        rule=str(rule),
        reason=str(reason),
        outcome=str(outcome),
        error=str(error),
        node=str(node),
        owner=str(owner),
        duration=float(dur or 0.0),  # type: ignore[arg-type]
        trash=str(trash),
    )


class HistoryMixin(Connection):
    """The ``history`` table of :class:`~ckptkeeper.index.Index`."""

    def add_history(self, events: Iterable[HistoryEvent], *, durable: bool = False) -> None:
        """Record events. Not flushed by default: losing the last ones to a power cut loses no
        checkpoint, and the pass's next durable commit flushes them (the WAL is sequential)."""
        rows = [_values(e) for e in events]
        if not rows:
            return
        with self.transaction(durable=durable), self._lock:
            self._db.executemany(_INSERT, rows)

    def history(
        self,
        run: str | None = None,
        step: int | None = None,
        since: float | None = None,
        *,
        limit: int | None = None,
    ) -> list[HistoryEvent]:
        """Events, oldest first (the newest ``limit`` when given). An index opened read-only
        before its migration has no history table: nothing happened then."""
        where, params = [], list[object]()
        if run is not None:
            where.append("run = ?")
            params.append(run)
            if step is not None:
                where.append("step = ?")
                params.append(step)
        elif step is not None:
            where.append("step = ?")
            params.append(step)
        if since is not None:
            where.append("at >= ?")
            params.append(since)
        sql = f"SELECT {', '.join(_COLUMNS)} FROM history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        try:
            rows = self._exec(sql, params).fetchall()
        except sqlite3.OperationalError:
            return []
        return [_event(r) for r in reversed(rows)]

    def listed_at(self, checkpoint_id: int) -> dict[str, float]:
        """tier -> when the copy there was last seen (verified) by a listing or a copy of this node:
        an event of another node later than that removed it since (``why``)."""
        rows = self._exec(
            "SELECT tier, verified_at FROM locations WHERE checkpoint_id = ?", (checkpoint_id,)
        ).fetchall()
        return {str(r[0]): float(r[1]) for r in rows}

    def history_count(self) -> int:
        try:
            return int(self._exec("SELECT COUNT(*) FROM history").fetchone()[0])
        except sqlite3.OperationalError:
            return 0

    def prune_history(self, before: float, max_rows: int, *, chunk: int = PRUNE_CHUNK) -> int:
        """Drop events older than ``before`` and all but the newest ``max_rows``, at most ``chunk``
        rows for each bound per call (a pass's cost stays bounded after ``history.max_rows`` is
        lowered: the rest goes with the next passes); how many went. Range deletes on the
        primary key: ids follow time, so the oldest go first."""
        with self.transaction(durable=False):
            gone = self._exec(
                """DELETE FROM history WHERE id IN
                   (SELECT id FROM history WHERE at < ? ORDER BY id LIMIT ?)""",
                (before, chunk),
            ).rowcount
            gone += self._exec(
                """DELETE FROM history WHERE id <= MIN(
                     (SELECT MAX(id) FROM history) - ?, (SELECT MIN(id) FROM history) + ? - 1)""",
                (max(0, max_rows), chunk),
            ).rowcount
        return max(0, gone)


def salvage_history(path: str | Path) -> list[HistoryEvent]:
    """The events of a damaged (moved aside) index, read-only; [] when they do not read."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            rows = con.execute(f"SELECT {', '.join(_COLUMNS)} FROM history ORDER BY id").fetchall()
        finally:
            con.close()
        return [_event(r) for r in rows]
    except (sqlite3.Error, ValueError, TypeError):
        return []
