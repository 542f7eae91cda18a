"""What one reconcile pass found: shared by the hot tier's catalog (``catalog``) and the slower
tiers' listing (``tiers``), and what the watcher and the daemon add up and report."""

from __future__ import annotations

import dataclasses
import sqlite3
from dataclasses import dataclass, field
from typing import Any

HOSTILE = (
    ValueError,
    TypeError,
    OverflowError,
    UnicodeError,
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
)
"""What a document the schema let through could still raise on its way into the index. Caught per
document (never per pass) as a last line of defence: that document is quarantined, the others go on.
Never ``sqlite3.DatabaseError`` as such: a damaged index must reach the rebuild."""


@dataclass
class ReconcileReport:
    runs: int = 0
    new: int = 0
    new_versions: int = 0
    unchanged: int = 0
    removed: int = 0
    partial: int = 0
    corrupt: int = 0
    hashed_bytes: int = 0
    tiers_failed: dict[str, str] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)
    """``tier:path`` -> what is wrong, for each copy whose data does not match its manifest."""
    quarantined: int = 0
    parts: int = 0
    """Checkpoints that are one node's share of a checkpoint spanning nodes (complete or kept)."""

    def to_dict(self) -> dict[str, Any]:
        """``scan --json``: every field, in declaration order."""
        return dataclasses.asdict(self)

    def merge(self, other: ReconcileReport) -> None:
        for name in (
            "runs",
            "new",
            "new_versions",
            "unchanged",
            "removed",
            "partial",
            "corrupt",
            "hashed_bytes",
            "quarantined",
            "parts",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tiers_failed.update(other.tiers_failed)
        self.damaged.update(other.damaged)
