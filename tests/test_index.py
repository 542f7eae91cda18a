"""The index: durable settings, migrations, locations/versions, journal, pins."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ckptkeeper.core.model import CheckpointState, RunState
from ckptkeeper.index import SCHEMA_VERSION, Index, IndexCorrupt


def add(ix: Index, name: str = "checkpoint-100", step: int = 100, version: str | None = "v1") -> int:
    return ix.upsert_checkpoint(
        run="r",
        name=name,
        step=step,
        layout="hf",
        state=CheckpointState.COMPLETE,
        created_at=1.0,
        last_write=1.0,
        bytes=10,
        metrics={"eval_loss": 1.5},
        committed=False,
        version=version,
        manifest_json=None,
        problem=None,
    )


def test_pragmas_and_schema_version(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        assert ix.schema_version == SCHEMA_VERSION
        assert ix._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert ix._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert ix._db.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
        ix.quick_check()


def test_reopen_keeps_data_and_does_not_remigrate(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        add(ix)
    with Index(tmp_path / "i.db") as ix:
        assert [c.name for c in ix.checkpoints()] == ["checkpoint-100"]


def test_newer_schema_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "i.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer than this ckptkeeper"):
        Index(tmp_path / "i.db")


def _index_at(path: Path, version: int) -> None:
    """An index file as an older ckptkeeper left it: migrations 1..``version`` applied, with rows
    in every table those migrations made (a checkpoint, two copies, an upload, a quarantine)."""
    from ckptkeeper.index.schema import MIGRATIONS

    db = sqlite3.connect(path)
    for i in range(version):
        db.executescript(MIGRATIONS[i])
    db.execute(
        """INSERT INTO checkpoints (id, run, name, step, layout, state, created_at, version)
           VALUES (7, 'r', 'checkpoint-100', 100, 'hf', 'complete', 1.0, 'v1')"""
    )
    db.execute(
        """INSERT INTO locations (checkpoint_id, tier, version, verified_at)
           VALUES (7, 'hot', 'v1', 2.0), (7, 'cold', 'damaged: gone', 3.0)"""
    )
    db.execute(
        """INSERT INTO artifacts (tier, path, kind, bytes, last_write, run, upload_id)
           VALUES ('cold', 'r/x.ckptkeeper-staging', 'staging', 5, 4.0, 'r', '')"""
    )
    if version >= 2:
        db.execute(
            "INSERT INTO quarantine VALUES ('hot', 'r/bad.json', 'manifest', 'r', 'too big', 5.0, 6.0)"
        )
    db.execute(f"PRAGMA user_version = {version}")
    db.commit()
    db.close()


@pytest.mark.parametrize("version", [1, 2, 3], ids=["release-1", "quarantine-2", "node-3"])
def test_older_index_upgrades_to_current_with_its_rows(tmp_path: Path, version: int) -> None:
    """Migration 2 is the quarantine table, 3 the copies' owning node (docs/design.md, "Many nodes"), 4 the scrub's
    last re-hash time per copy and its totals: an index at version 3 gets 4 only; one
    at 1 gets 2, 3 then 4. Rows survive; existing copies, damaged or not, are this node's ('': the
    single-node default), as they were before, and were never re-hashed (scrubbed first). 5 adds
    the trash table (undo window), empty after an upgrade. 6 adds a checkpoint's node part (issue
    #15): NULL, a whole checkpoint, for every row that was there. 7 adds the history of executed
    actions (``history``, ``why``), empty after an upgrade. 8 adds what a tier stores for a
    compressed copy (docs/compression.md): NULL, as many bytes as the checkpoint, for every copy."""
    assert SCHEMA_VERSION == 8
    path = tmp_path / "i.db"
    _index_at(path, version)
    with Index(path) as ix:
        assert ix.schema_version == 8
        assert ix.stored_bytes() == {}
        assert {r[0] for r in ix._db.execute("SELECT stored_bytes FROM locations")} == {None}
        assert ix.history() == [] and ix.history_count() == 0
        assert [
            tuple(r) for r in ix._db.execute("SELECT tier, scrubbed_at FROM locations ORDER BY tier")
        ] == [
            ("cold", None),
            ("hot", None),
        ]
        assert ix.scrub_totals() == {}
        ix.add_scrub_totals("cold", 10, 1, 0)
        assert ix.scrub_totals() == {"cold": (10, 1, 0)}
        # a listing keeps a copy's re-hash time; a new version of the copy starts as never re-hashed
        ix.set_location(7, "hot", "v1", scrubbed_at=50.0)
        ix.set_location(7, "hot", "v1")
        assert ix._db.execute("SELECT scrubbed_at FROM locations WHERE tier = 'hot'").fetchone()[0] == 50.0
        ix.set_location(7, "hot", "v2")
        assert ix._db.execute("SELECT scrubbed_at FROM locations WHERE tier = 'hot'").fetchone()[0] is None
        ix.set_location(7, "hot", "v1")
        assert ix.trash() == []
        row = ix.checkpoint("r", "checkpoint-100")
        assert row is not None and row.locations == {"hot": "v1", "cold": "damaged: gone"}
        assert row.damaged == {"cold": "gone"} and row.part is None
        assert [tuple(r) for r in ix._db.execute("SELECT tier, node FROM locations ORDER BY tier")] == [
            ("cold", ""),
            ("hot", ""),
        ]
        assert [(a.path, a.node) for a in ix.artifacts()] == [("r/x.ckptkeeper-staging", "")]
        quarantined = [tuple(r) for r in ix._db.execute("SELECT tier, path, reason FROM quarantine")]
        assert quarantined == ([("hot", "r/bad.json", "too big")] if version >= 2 else [])
        ix.set_tier_status("hot", True)
        ix.set_tier_status("cold", True)
        assert ix.snapshot(["hot", "cold"], node="me").foreign == {}
        # the new column is in use: a copy another node wrote is reported as its own
        ix.set_location(7, "cold", "v1", node="node-b")
        assert ix.snapshot(["hot", "cold"], node="me").foreign == {("r", 100, "cold"): "node-b"}
    with Index(path) as ix:  # reopened: not migrated again
        assert ix.schema_version == 8


def test_corrupt_file_detected(tmp_path: Path) -> None:
    path = tmp_path / "i.db"
    with Index(path) as ix:
        for i in range(200):
            add(ix, name=f"checkpoint-{i}", step=i)
    data = bytearray(path.read_bytes())
    for off in range(4096, len(data), 97):
        data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises((IndexCorrupt, sqlite3.DatabaseError)):
        Index(path).quick_check()


def test_locations_count_only_current_version(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        cid = add(ix)
        ix.set_location(cid, "hot", "v1")
        ix.set_location(cid, "warm", "v1")
        assert ix.checkpoints()[0].verified_tiers == {"hot", "warm"}
        add(ix, version="v2")  # rewritten in place: the warm copy holds the old content
        ix.set_location(cid, "hot", "v2")
        row = ix.checkpoints()[0]
        assert row.verified_tiers == {"hot"}
        assert row.locations["warm"] == "v1"


def test_pin_survives_rewrite(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        add(ix)
        assert ix.set_pinned("r", 100, True) == 1
        add(ix, version="v2")
        assert ix.checkpoints()[0].pinned
        assert ix.set_pinned("r", 999, True) == 0


def test_journal_lifecycle(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        j = ix.journal_begin({"action": "copy", "run": "r"}, detail={"staging": "x"})
        ix.journal_phase(j, "copied", {"staging": "x", "verified": True})
        (entry,) = ix.journal_open()
        assert entry.phase == "copied" and entry.detail["verified"] is True
        ix.journal_done(j)
        assert ix.journal_open() == []


def test_transaction_rolls_back(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        with pytest.raises(ZeroDivisionError), ix.transaction():
            add(ix)
            1 / 0  # noqa: B018
        assert ix.checkpoints() == []


def test_snapshot_marks_unlisted_and_failed_tiers_unknown(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        ix.upsert_run("r", state=RunState.ACTIVE)
        ix.set_tier_status("hot", True)
        ix.set_tier_status("cold", False, "503")
        snap = ix.snapshot(["hot", "warm", "cold"])
        assert snap.unknown_tiers == {"warm", "cold"}


def test_reclaimed_accumulates(tmp_path: Path) -> None:
    with Index(tmp_path / "i.db") as ix:
        ix.add_reclaimed("partial", 100)
        ix.add_reclaimed("partial", 50)
        ix.add_reclaimed("expired", 7)
        assert ix.reclaimed() == {"partial": (150, 2), "expired": (7, 1)}
