"""The executor's journal, and the counters beside it: bytes reclaimed, scheduled jobs' last runs.

The journal is what lets a restart finish or undo a move after ``kill -9``: each action is begun,
advanced phase by phase and marked done in the index, durably (``synchronous=FULL``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ckptkeeper.index.connection import Connection
from ckptkeeper.index.rows import JobRun, JournalEntry, job_run_row, journal_entry_row


class JournalMixin(Connection):
    """Journal, reclaimed counters and job runs of :class:`Index`."""

    def journal_begin(
        self,
        action: Mapping[str, Any],
        phase: str = "start",
        detail: Mapping[str, Any] | None = None,
        *,
        durable: bool = True,
    ) -> int:
        """Record the intent of a step before it touches anything. ``durable=False``: committed
        (visible, survives ``kill -9``) but not yet flushed; the caller must :meth:`sync_wal`
        before the step's first irreversible change (the rename overlaps that flush with the
        manifest's)."""
        now = time.time()
        with self.transaction(durable=durable):
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
        return [journal_entry_row(r) for r in rows]

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
        return {r["job"]: job_run_row(r) for r in rows}
