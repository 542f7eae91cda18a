"""Trash entries of the index: copies moved aside by ``undo_window`` (docs/undo-window.md).

Each tier listing replaces what the previous one recorded for its tier; the executor adds an entry
when it moves a copy aside and removes it when it purges or undeletes it. The trash in the tier is
the truth (every entry carries its manifest): a rebuilt index finds every entry again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from ckptkeeper.core.model import Manifest, TrashEntry
from ckptkeeper.index.connection import Connection


class TrashMixin(Connection):
    """The ``trash`` table of :class:`~ckptkeeper.index.Index`."""

    def add_trash(self, entry: TrashEntry, manifest: Manifest) -> None:
        self._exec(
            """INSERT OR REPLACE INTO trash (tier, path, run, step, name, bytes, deleted_at, node, manifest)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (
                entry.tier,
                entry.path,
                entry.run,
                entry.step,
                entry.name,
                entry.bytes,
                entry.deleted_at,
                entry.node,
                manifest.to_json(),
            ),
        )

    def replace_trash(self, tier: str, entries: Iterable[tuple[TrashEntry, Manifest]]) -> None:
        """What a listing of ``tier``'s trash found, replacing what was recorded for it."""
        with self.transaction():
            self._exec("DELETE FROM trash WHERE tier = ?", (tier,))
            for entry, manifest in entries:
                self.add_trash(entry, manifest)

    def remove_trash(self, tier: str, path: str) -> None:
        self._exec("DELETE FROM trash WHERE tier = ? AND path = ?", (tier, path))

    def trash(self, run: str | None = None, step: int | None = None) -> list[tuple[TrashEntry, Manifest]]:
        """Entries (newest deletion first), optionally of one run (and step). An index opened
        read-only before its migration has no trash table: nothing is in the trash then."""
        where, params = "", list[object]()
        if run is not None:
            where, params = " WHERE run = ?", [run, *params]
            if step is not None:
                where += " AND step = ?"
                params.append(step)
        try:
            rows = self._exec(
                f"SELECT * FROM trash{where} ORDER BY deleted_at DESC, tier, path", params
            ).fetchall()
        except sqlite3.OperationalError:
            return []
        out = []
        for r in rows:
            try:
                manifest = Manifest.from_json(r["manifest"])
            except ValueError:
                continue  # recorded from a validated manifest; never trusted blindly all the same
            entry = TrashEntry(
                tier=r["tier"],
                path=r["path"],
                run=r["run"],
                step=r["step"],
                name=r["name"],
                bytes=r["bytes"],
                deleted_at=r["deleted_at"],
                node=r["node"],
            )
            out.append((entry, manifest))
        return out
