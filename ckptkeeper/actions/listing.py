"""``ls``: the runs of the catalog and their checkpoints, with each part's version in the shared
tiers (for a checkpoint spanning nodes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.job import last_job
from ckptkeeper.config import Settings
from ckptkeeper.core.model import NodePart
from ckptkeeper.index import CheckpointRow, Index, Quarantined, RunRow

__all__ = ["Listing", "list_catalog"]


@dataclass(frozen=True)
class Listing:
    runs: list[RunRow]
    checkpoints: list[CheckpointRow]
    quarantined: list[Quarantined]
    versions: dict[tuple[str, int, str], Any]
    """(run, step, tier) -> :class:`~ckptkeeper.core.versions.VersionStatus` of this node's parts."""
    tier_order: dict[str, int]
    jobs: dict[str, dict[str, Any] | None]
    """Run -> its last scheduler job (``ls --json``'s ``job``, docs/slurm.md; null: none known)."""
    stored: dict[tuple[int, str], int] = field(default_factory=dict)
    """(checkpoint id, tier) -> bytes the tier holds for a copy it stores compressed."""

    @property
    def empty(self) -> bool:
        return not self.runs and not self.checkpoints

    def to_dict(self) -> dict[str, Any]:
        """``ls --json``."""
        return {"runs": self.run_docs(), "quarantined": [q.to_dict() for q in self.quarantined]}

    def run_docs(self) -> list[dict[str, Any]]:
        by_run: dict[str, list[CheckpointRow]] = {}
        for c in self.checkpoints:
            by_run.setdefault(c.run, []).append(c)
        return [
            {
                "name": r.name,
                "state": r.state.value,
                "state_reason": r.state_reason,
                "last_seen": r.last_seen,
                "parent": {"run": r.parent[0], "step": r.parent[1]} if r.parent else None,
                "job": self.jobs.get(r.name),
                "checkpoints": [
                    self._checkpoint_doc(c)
                    for c in sorted(by_run.get(r.name, []), key=lambda c: (c.step, c.name))
                ],
                "quarantined": [q.to_dict() for q in self.quarantined if q.run == r.name],
            }
            for r in self.runs
        ]

    def _checkpoint_doc(self, c: CheckpointRow) -> dict[str, Any]:
        return {
            "step": c.step,
            "name": c.name,
            "state": c.state.value,
            "layout": c.layout,
            "tiers": sorted(c.verified_tiers, key=lambda t: self.tier_order.get(t, 99)),
            "bytes": c.bytes,
            "stored_bytes": {  # per tier holding a copy: less than bytes where compressed
                t: self.stored.get((c.id, t), c.bytes)
                for t in sorted(c.verified_tiers, key=lambda t: self.tier_order.get(t, 99))
            },
            "metrics": dict(c.metrics),
            "pinned": c.pinned,
            "version": c.version,
            "created_at": c.created_at,
            "problem": c.problem,
            "damaged": c.damaged,
            "part": _part_doc(c.part),
            "versions": {
                t: {**v.to_doc(), "parts": v.label}
                for (vr, vs, t), v in self.versions.items()
                if (vr, vs) == (c.run, c.step)
            },
        }


def list_catalog(settings: Settings, index: Index, run: str | None = None) -> Listing:
    """Every run (or ``run`` alone) with its checkpoints and quarantined documents."""
    runs = [r for r in index.runs() if run is None or r.name == run]
    checkpoints = index.checkpoints(run)
    quarantined = [q for q in index.quarantined() if run is None or q.run == run]
    return Listing(
        runs=runs,
        checkpoints=checkpoints,
        quarantined=quarantined,
        versions=_versions(settings, checkpoints),
        tier_order={t.name: i for i, t in enumerate(settings.tiers)},
        jobs={r.name: last_job(settings, r.name) for r in runs if r.on_hot},
        stored=index.stored_bytes(),
    )


def _part_doc(part: NodePart | None) -> dict[str, Any] | None:
    """``ls --json``'s ``part`` of a checkpoint: null for a whole checkpoint."""
    if part is None:
        return None
    return {
        "index": part.index,
        "count": part.count,
        "job": part.job,
        "known": part.known,
        "marker_elsewhere": part.marker_elsewhere,
        "note": part.note,
    }


def _versions(settings: Settings, rows: Sequence[CheckpointRow]) -> dict[tuple[str, int, str], Any]:
    """Each of this node's parts' version in the shared tiers it is in: one listing
    of part records per run and tier, plus each record's manifest."""
    if not any(t.shared for t in settings.tiers):
        return {}
    parts = [
        (c.run, c.step, c.part.job, c.part.count, c.verified_tiers)
        for c in rows
        if c.part is not None and c.part.count is not None and c.part.count > 1 and c.part.index is not None
    ]
    if not parts:
        return {}
    from ckptkeeper.actions.versions import part_versions  # storage, fsspec: only for shared tiers

    return part_versions(settings, parts)
