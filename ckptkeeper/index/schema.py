"""The index's SQL schema and its migrations.

Kept apart from the queries so a reviewer sees every shipped migration in one place: each entry
migrates version i to i+1, and a shipped one is never edited.
"""

from __future__ import annotations

BUSY_TIMEOUT_MS = 10_000


class IndexCorrupt(Exception):
    """The database failed its integrity check; the caller rebuilds it from the tiers."""


# Each entry migrates from version i to i+1. Never edit a shipped migration: append a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE runs (
        name TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        state_reason TEXT NOT NULL DEFAULT '',
        last_seen REAL NOT NULL DEFAULT 0,
        parent_run TEXT,
        parent_step INTEGER,
        host TEXT NOT NULL DEFAULT '',
        pid INTEGER,
        on_hot INTEGER NOT NULL DEFAULT 1,
        updated_at REAL NOT NULL DEFAULT 0
    );
    CREATE TABLE checkpoints (
        id INTEGER PRIMARY KEY,
        run TEXT NOT NULL,
        name TEXT NOT NULL,
        step INTEGER NOT NULL,
        layout TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        last_write REAL NOT NULL DEFAULT 0,
        bytes INTEGER NOT NULL DEFAULT 0,
        metrics TEXT NOT NULL DEFAULT '{}',
        pinned INTEGER NOT NULL DEFAULT 0,
        committed INTEGER NOT NULL DEFAULT 0,
        version TEXT,
        manifest TEXT,
        problem TEXT,
        UNIQUE (run, name)
    );
    CREATE INDEX checkpoints_run_step ON checkpoints (run, step);
    CREATE TABLE locations (
        checkpoint_id INTEGER NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
        tier TEXT NOT NULL,
        version TEXT NOT NULL,
        verified_at REAL NOT NULL,
        PRIMARY KEY (checkpoint_id, tier)
    );
    CREATE TABLE artifacts (
        tier TEXT NOT NULL,
        path TEXT NOT NULL,
        kind TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        last_write REAL NOT NULL,
        run TEXT,
        upload_id TEXT,
        PRIMARY KEY (tier, path, upload_id)
    );
    CREATE TABLE tier_status (
        tier TEXT PRIMARY KEY,
        ok INTEGER NOT NULL,
        error TEXT,
        checked_at REAL NOT NULL
    );
    CREATE TABLE journal (
        id INTEGER PRIMARY KEY,
        action TEXT NOT NULL,
        phase TEXT NOT NULL,
        detail TEXT NOT NULL DEFAULT '{}',
        started_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        done INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX journal_open ON journal (done);
    CREATE TABLE reclaimed (
        reason TEXT PRIMARY KEY,
        bytes INTEGER NOT NULL DEFAULT 0,
        count INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE job_runs (
        job TEXT PRIMARY KEY,
        last_start REAL,
        last_success REAL,
        last_error TEXT,
        last_error_at REAL
    );
    """,
    # 1 -> 2: documents that failed the schema (hostile or broken manifests, run.json, commit lines,
    # heartbeats, framework markers), with the reason, for `ls`, `status` and the metrics.
    """
    CREATE TABLE quarantine (
        tier TEXT NOT NULL,
        path TEXT NOT NULL,
        kind TEXT NOT NULL,
        run TEXT,
        reason TEXT NOT NULL,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        PRIMARY KEY (tier, path, kind)
    );
    CREATE INDEX quarantine_run ON quarantine (tier, run);
    """,
    # 2 -> 3: the node that wrote each copy (its manifest's ``node``; '' = this node or unknown),
    # so the planner never lets this node's rules delete another node's copy (docs/design.md, "Many nodes").
    """
    ALTER TABLE locations ADD COLUMN node TEXT NOT NULL DEFAULT '';
    ALTER TABLE artifacts ADD COLUMN node TEXT NOT NULL DEFAULT '';
    """,
    # 3 -> 4: the scrub job. ``scrubbed_at``: when the copy's bytes were last re-hashed
    # against its manifest (or written and hashed by a copy); NULL = never since it was recorded, so
    # such copies are scrubbed first. ``scrub_totals``: cumulative bytes re-hashed and bad copies
    # found per tier, the counters ``ckptkeeper_scrub_*_total`` (they survive daemon restarts).
    """
    ALTER TABLE locations ADD COLUMN scrubbed_at REAL;
    CREATE TABLE scrub_totals (
        tier TEXT PRIMARY KEY,
        bytes INTEGER NOT NULL DEFAULT 0,
        copies INTEGER NOT NULL DEFAULT 0,
        bad INTEGER NOT NULL DEFAULT 0
    );
    """,
    # 4 -> 5: copies moved aside into a tier's trash by ``undo_window`` (docs/undo-window.md),
    # as the last listing of each tier found them (the trash itself is the truth: each entry
    # carries its manifest, so this table is rebuilt from the tiers like the rest).
    """
    CREATE TABLE trash (
        tier TEXT NOT NULL,
        path TEXT NOT NULL,
        run TEXT NOT NULL,
        step INTEGER NOT NULL,
        name TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        deleted_at REAL NOT NULL,
        node TEXT NOT NULL DEFAULT '',
        manifest TEXT NOT NULL,
        PRIMARY KEY (tier, path)
    );
    CREATE INDEX trash_run_step ON trash (run, step);
    """,
    # 5 -> 6: a node's share of a checkpoint spanning nodes: JSON of
    # ``core.model.NodePart`` (``{"note", "job", "index", "count"}``), NULL for a whole checkpoint.
    """
    ALTER TABLE checkpoints ADD COLUMN part TEXT;
    """,
    # 6 -> 7: what happened to checkpoints (``history`` and ``why``): one row per executed action,
    # kept for ``history.keep`` and at most ``history.max_rows`` rows (pruned by ``at`` and by id,
    # both indexed: a prune is two range deletes).
    """
    CREATE TABLE history (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        action TEXT NOT NULL,
        run TEXT,
        step INTEGER,
        tier TEXT,
        to_tier TEXT,
        path TEXT,
        bytes INTEGER NOT NULL DEFAULT 0,
        rule TEXT NOT NULL DEFAULT '',
        reason TEXT NOT NULL DEFAULT '',
        outcome TEXT NOT NULL,
        error TEXT NOT NULL DEFAULT '',
        node TEXT NOT NULL DEFAULT '',
        owner TEXT NOT NULL DEFAULT '',
        duration REAL NOT NULL DEFAULT 0,
        trash TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX history_run_step ON history (run, step);
    CREATE INDEX history_at ON history (at);
    """,
    # 7 -> 8: bytes a tier holds for a copy it stores compressed (docs/compression.md); NULL: as
    # many as the checkpoint's raw bytes.
    """
    ALTER TABLE locations ADD COLUMN stored_bytes INTEGER;
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)
