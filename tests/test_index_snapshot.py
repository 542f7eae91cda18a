"""``Index.snapshot()`` builds checkpoints straight from SQL (no manifests read, bench/planning.py):
it must give exactly what ``CheckpointRow.to_model()`` gives."""

from __future__ import annotations

from pathlib import Path

from ckptkeeper.core.model import CheckpointState, RunState
from ckptkeeper.index import Index


def test_snapshot_checkpoints_match_the_row_models(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.db")
    try:
        index.upsert_run("r", state=RunState.ACTIVE, last_seen=5.0)
        states = [CheckpointState.COMPLETE, CheckpointState.WRITING, CheckpointState.CORRUPT]
        for i in range(9):
            cid = index.upsert_checkpoint(
                run="r" if i % 2 else "q",
                name=f"checkpoint-{i}",
                step=i * 10,
                layout="hf",
                state=states[i % 3],
                created_at=100.0 + i,
                last_write=200.0 + i,
                bytes=i * 1000,
                metrics={"eval_loss": 1.0 / (i + 1)} if i % 4 else {},
                committed=bool(i % 2),
                version=f"v{i}" if i % 3 != 1 else None,
                manifest_json='{"big": "manifest"}' if i % 3 != 1 else None,
                problem=None,
            )
            if i % 3 == 0:
                index.set_location(cid, "hot", f"v{i}")
                index.set_location(cid, "cold", "old-version" if i == 3 else f"v{i}")
            if i == 6:
                index.set_pinned("q", 60, True)
        expected = tuple(c.to_model() for c in index.checkpoints())
        assert index.snapshot(["hot", "cold"]).checkpoints == expected
        assert [c.tiers for c in expected if c.step == 30] == [frozenset({"hot"})]
    finally:
        index.close()
