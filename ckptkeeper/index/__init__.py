"""The local catalog: the only package that speaks SQL.

SQLite in WAL mode with ``synchronous=FULL``: the index and the executor's journal must survive
``kill -9`` and power loss, because the journal is what lets a restart finish or undo a move.
``schema`` holds the migrations, ``rows`` the typed rows it returns and their conversion from
sqlite rows, ``connection`` the connection and its transactions, and the queries are split by
concept: ``db`` (:class:`Index`: runs, checkpoints, locations), ``artifacts`` (artifacts,
quarantine, tier status), ``journal`` (journal, reclaimed, job runs), ``snapshot`` (the planner's view), ``history``
(what happened to checkpoints: ``history`` and ``why``).
"""

from ckptkeeper.index.db import Index, IndexReplaced
from ckptkeeper.index.history import salvage_history
from ckptkeeper.index.rows import (
    DAMAGED,
    CheckpointRow,
    JobRun,
    JournalEntry,
    Quarantined,
    RunRow,
    TierStatus,
)
from ckptkeeper.index.schema import BUSY_TIMEOUT_MS, SCHEMA_VERSION, IndexCorrupt
from ckptkeeper.index.scrub import SCRUB_PROBLEM

__all__ = [
    "BUSY_TIMEOUT_MS",
    "DAMAGED",
    "SCHEMA_VERSION",
    "SCRUB_PROBLEM",
    "CheckpointRow",
    "Index",
    "IndexCorrupt",
    "IndexReplaced",
    "JobRun",
    "JournalEntry",
    "Quarantined",
    "RunRow",
    "TierStatus",
    "salvage_history",
]
