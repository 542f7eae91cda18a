"""What the scrub job reads and records: every slower-tier copy with the time its bytes
were last re-hashed, the outcome of each re-hash, and the cumulative totals behind the metrics.

A bad copy is recorded the way every damaged copy is (:data:`~ckptkeeper.index.rows.DAMAGED` in the
location's version), so it stops counting everywhere at once: the planner copies it again, restore
and ``latest()`` skip it, no delete leans on it. The outcome is written only if the location is
still the one that was read (same version, same ``scrubbed_at``): a copy the executor rewrote or
deleted while the scrub read it is left to what the executor recorded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ckptkeeper.core.scrub import ScrubCandidate
from ckptkeeper.index.connection import Connection
from ckptkeeper.index.rows import DAMAGED

SCRUB_PROBLEM = "scrub: "
"""Start of the problem recorded for a copy the scrub found bad (``damaged: scrub: …``). A listing
checks sizes only, so it cannot clear such a mark (a flipped byte keeps its size): only a re-hash
that finds the copy whole again or a new copy written over it does."""


class ScrubMixin(Connection):
    """Scrub queries of :class:`~ckptkeeper.index.Index`."""

    def scrub_locations(self, tiers: Sequence[str]) -> list[ScrubCandidate]:
        """Every copy in ``tiers`` of a complete checkpoint: verified ones and damaged ones (a damaged
        copy found whole again is recorded as a copy again). Copies of an older version are not
        this checkpoint's copies and are left out."""
        if not tiers:
            return []
        marks = ",".join("?" * len(tiers))
        rows = self._exec(
            f"""SELECT c.id, c.run, c.name, c.step, c.bytes, l.tier, l.version, l.node, l.scrubbed_at
                FROM locations l JOIN checkpoints c ON c.id = l.checkpoint_id
                WHERE l.tier IN ({marks}) AND c.state = 'complete' AND c.version IS NOT NULL
                  AND (l.version = c.version OR substr(l.version, 1, ?) = ?)""",
            (*tiers, len(DAMAGED), DAMAGED),
        ).fetchall()
        return [
            ScrubCandidate(
                checkpoint_id=r[0],
                run=r[1],
                name=r[2],
                step=r[3],
                bytes=r[4],
                tier=r[5],
                location_version=r[6],
                node=r[7],
                scrubbed_at=r[8],
            )
            for r in rows
        ]

    def record_scrubbed(self, loc: ScrubCandidate, version: str, when: float | None = None) -> bool:
        """The copy ``loc`` re-hashed whole: it is a copy of ``version``, verified at ``when``.
        False (nothing written) if the location changed since it was read."""
        return self._record_scrub(loc, version, when)

    def record_scrub_bad(self, loc: ScrubCandidate, problem: str, when: float | None = None) -> bool:
        """The copy ``loc`` does not match its manifest: mark it damaged (its owner kept). False
        (nothing written) if the location changed since it was read."""
        return self._record_scrub(loc, DAMAGED + SCRUB_PROBLEM + " ".join(problem.split())[:500], when)

    def _record_scrub(self, loc: ScrubCandidate, outcome: str, when: float | None) -> bool:
        """Write a scrub's ``outcome`` (the version hashed, or the damage found) into ``loc``'s
        ``version`` with the time it was checked, guarded by the version and check time read with
        ``loc``: a copy moved, rewritten or checked by another pass meanwhile keeps what it says."""
        cur = self._exec(
            """UPDATE locations SET version = ?, scrubbed_at = ?
               WHERE checkpoint_id = ? AND tier = ? AND version = ? AND scrubbed_at IS ?""",
            (
                outcome,
                time.time() if when is None else when,
                loc.checkpoint_id,
                loc.tier,
                loc.location_version,
                loc.scrubbed_at,
            ),
        )
        return cur.rowcount > 0

    def add_scrub_totals(self, tier: str, nbytes: int, copies: int, bad: int) -> None:
        self._exec(
            """INSERT INTO scrub_totals (tier, bytes, copies, bad) VALUES (?, ?, ?, ?)
               ON CONFLICT (tier) DO UPDATE SET bytes = bytes + excluded.bytes,
                 copies = copies + excluded.copies, bad = bad + excluded.bad""",
            (tier, nbytes, copies, bad),
        )

    def scrub_totals(self) -> dict[str, tuple[int, int, int]]:
        """tier -> (bytes re-hashed, copies checked, bad copies found), cumulative since the index
        was created; empty on a read-only index an older version left (not migrated yet)."""
        if self.schema_version < 4:
            return {}
        rows = self._exec("SELECT tier, bytes, copies, bad FROM scrub_totals").fetchall()
        return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}

    def oldest_scrub(self, tiers: Sequence[str]) -> dict[str, float | None]:
        """tier -> the oldest ``scrubbed_at`` of its verified copies (None: some copy never was)."""
        if not tiers or self.schema_version < 4:
            return {}
        marks = ",".join("?" * len(tiers))
        rows = self._exec(
            f"""SELECT l.tier, MIN(COALESCE(l.scrubbed_at, 0)) FROM locations l
                JOIN checkpoints c ON c.id = l.checkpoint_id
                WHERE l.tier IN ({marks}) AND l.version = c.version GROUP BY l.tier""",
            tuple(tiers),
        ).fetchall()
        return {r[0]: (float(r[1]) or None) for r in rows}

    def without_good_copy(self) -> list[tuple[str, int, str, dict[str, str]]]:
        """(run, step, name, {tier: problem}) of every complete checkpoint whose copies are all
        marked damaged: the planner cannot see it (nothing deletes it), nothing can repair it."""
        rows = self._exec(
            """SELECT c.run, c.step, c.name, l.tier, l.version FROM checkpoints c
               JOIN locations l ON l.checkpoint_id = c.id
               WHERE c.state = 'complete' AND substr(l.version, 1, ?) = ?
                 AND NOT EXISTS (SELECT 1 FROM locations g WHERE g.checkpoint_id = c.id
                                 AND g.version = c.version)
               ORDER BY c.run, c.step, c.name, l.tier""",
            (len(DAMAGED), DAMAGED),
        ).fetchall()
        out: dict[tuple[str, int, str], dict[str, str]] = {}
        for run, step, name, tier, version in rows:
            out.setdefault((run, step, name), {})[tier] = version.removeprefix(DAMAGED)
        return [(run, step, name, damaged) for (run, step, name), damaged in out.items()]
