"""The planner's view of the index: one consistent read of everything it decides from.

Read in bulk and fast (the daemon loads one per retention pass; bench/planning.py measures it). The
functions take the raw sqlite connection: the caller holds the index lock and the read transaction
(``Index.snapshot``), so every part comes from the same state of the index.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping

from ckptkeeper.core.model import Checkpoint
from ckptkeeper.index.rows import DAMAGED, SNAPSHOT_COLUMNS, TierStatus, snapshot_checkpoints


def read_checkpoints(db: sqlite3.Connection) -> tuple[Checkpoint, ...]:
    """Every checkpoint as the planner sees it (verified tiers only), sorted by (run, step, name)."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for cid, tier, version in db.execute("SELECT checkpoint_id, tier, version FROM locations"):
        by_id.setdefault(cid, []).append((tier, version))
    columns = SNAPSHOT_COLUMNS
    if not any(r[1] == "part" for r in db.execute("PRAGMA table_info(checkpoints)")):
        columns = columns.replace(", part", ", NULL AS part")  # a read-only index not yet migrated
    rows = db.execute(f"SELECT {columns} FROM checkpoints ORDER BY run, step, name")
    return snapshot_checkpoints(rows, by_id)


def foreign_copies(db: sqlite3.Connection, node: str) -> dict[tuple[str, int, str], str]:
    """(run, step, tier) -> owner of every copy another node wrote: verified, or marked damaged
    (a damaged copy is still its owner's; never this node's to delete or replace)."""
    rows = db.execute(
        """SELECT c.run, c.step, l.tier, l.node FROM locations l JOIN checkpoints c ON c.id = l.checkpoint_id
           WHERE l.node != '' AND l.node != ?
             AND (l.version = c.version OR substr(l.version, 1, ?) = ?)""",
        (node, len(DAMAGED), DAMAGED),
    )
    return {(run, step, tier): owner for run, step, tier, owner in rows}


def unknown_tiers(tier_names: Iterable[str], statuses: Mapping[str, TierStatus]) -> frozenset[str]:
    """Tiers whose last listing failed, or that were never listed: the planner must not read their
    absence of copies as "empty"."""
    unknown = set()
    for name in tier_names:
        status = statuses.get(name)
        if status is None or not status.ok:
            unknown.add(name)
    return frozenset(unknown)
