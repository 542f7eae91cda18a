"""What a tier listing finds besides checkpoints: artifacts, quarantined documents, the listing's status.

Each listing replaces what the previous one recorded for its tier (or for one run or some kinds in
it), so ``ls``, ``status``, the metrics and the planner read what the tier holds now.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from ckptkeeper.core.model import Artifact
from ckptkeeper.index.connection import Connection
from ckptkeeper.index.rows import Quarantined, TierStatus, artifact_row, quarantined_row, tier_status_row


class ArtifactsMixin(Connection):
    """Artifacts (partial uploads, staging leftovers, ...), quarantine and tier status of :class:`Index`."""

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
        return [artifact_row(r) for r in rows]

    # -- quarantine ------------------------------------------------------------------------

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
        return [quarantined_row(r) for r in rows]

    # -- tier status -----------------------------------------------------------------------

    def set_tier_status(self, tier: str, ok: bool, error: str | None = None) -> None:
        self._exec(
            """INSERT INTO tier_status (tier, ok, error, checked_at) VALUES (?, ?, ?, ?)
               ON CONFLICT (tier) DO UPDATE SET ok = excluded.ok, error = excluded.error,
                 checked_at = excluded.checked_at""",
            (tier, int(ok), error, time.time()),
        )

    def tier_statuses(self) -> dict[str, TierStatus]:
        rows = self._exec("SELECT * FROM tier_status").fetchall()
        return {r["tier"]: tier_status_row(r) for r in rows}


def _safe_text(value: str, limit: int) -> str:
    """Hostile text made storable: non-UTF-8 bytes escaped, NULs shown, length bounded."""
    text = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")
    return text if len(text) <= limit else text[:limit] + "…"
