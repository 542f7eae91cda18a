"""Typed rows the index returns, and their conversion from sqlite rows to them and to core model objects.

The ``*_row`` helpers are the one place that knows which column of a table fills which field: the
query modules select ``*`` (or the named columns) and hand each sqlite row here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptkeeper.core.model import Artifact, Checkpoint, CheckpointState, Manifest, NodePart, Run, RunState
from ckptkeeper.core.scrub import DAMAGED_PREFIX

DAMAGED = DAMAGED_PREFIX
"""Prefix of a location's version when the copy was found damaged in storage (files missing, of
another size or type than its manifest says): ``damaged: <what was wrong>``. Never equal to a
checkpoint's version, so the copy counts nowhere (planner, restore, deletes of other copies) and the
planner copies it again; kept in the index (not dropped) so ``ls`` and ``verify`` can say so. The
next listing that finds the copy whole again, or a copy that repairs it, records its real version.
Stored in the version column rather than a new one: the locations table stays as it is."""


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A document that failed the schema: ignored (never trusted, never a reason to delete), and
    shown with its reason until it is fixed or removed."""

    tier: str
    path: str
    """Relative to the tier root (``<run>/.ckptkeeper/run.json``, ``<run>/<ckpt>.ckptkeeper-manifest.json``)."""
    kind: str
    """``manifest``, ``run.json``, ``commits.jsonl``, ``heartbeat``, ``marker`` or ``checkpoint``."""
    reason: str
    run: str | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "path": self.path,
            "kind": self.kind,
            "run": self.run,
            "reason": self.reason,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """A checkpoint as stored, with its locations (tier -> version)."""

    id: int
    run: str
    name: str
    step: int
    layout: str
    state: CheckpointState
    created_at: float
    last_write: float
    bytes: int
    metrics: Mapping[str, float]
    pinned: bool
    committed: bool
    version: str | None
    manifest_json: str | None
    problem: str | None
    locations: Mapping[str, str]
    part: NodePart | None = None
    """This node's share of a checkpoint spanning nodes; None for a whole checkpoint."""

    @property
    def verified_tiers(self) -> frozenset[str]:
        """Tiers holding a copy of the current version."""
        return frozenset(t for t, v in self.locations.items() if v == self.version)

    @property
    def damaged(self) -> dict[str, str]:
        """Tiers whose copy was found damaged -> what was wrong with it."""
        return {t: v.removeprefix(DAMAGED) for t, v in self.locations.items() if v.startswith(DAMAGED)}

    def manifest(self) -> Manifest | None:
        return Manifest.from_json(self.manifest_json) if self.manifest_json else None

    def to_model(self) -> Checkpoint:
        return Checkpoint(
            run=self.run,
            step=self.step,
            name=self.name,
            layout=self.layout,
            state=self.state,
            created_at=self.created_at,
            bytes=self.bytes,
            metrics=dict(self.metrics),
            pinned=self.pinned,
            version=self.version,
            tiers=self.verified_tiers,
            last_write=self.last_write,
            committed=self.committed,
            part=self.part,
        )


@dataclass(frozen=True, slots=True)
class RunRow:
    name: str
    state: RunState
    state_reason: str
    last_seen: float
    parent: tuple[str, int] | None
    host: str
    pid: int | None
    on_hot: bool

    def to_model(self) -> Run:
        return Run(
            name=self.name,
            state=self.state,
            last_seen=self.last_seen,
            parent=self.parent,
            host=self.host,
            pid=self.pid,
        )


@dataclass(frozen=True, slots=True)
class JournalEntry:
    id: int
    action: dict[str, Any]
    phase: str
    detail: dict[str, Any]
    started_at: float


@dataclass(frozen=True, slots=True)
class TierStatus:
    tier: str
    ok: bool
    error: str | None
    checked_at: float


@dataclass(frozen=True, slots=True)
class JobRun:
    job: str
    last_start: float | None
    last_success: float | None
    last_error: str | None
    last_error_at: float | None


def run_row(r: sqlite3.Row) -> RunRow:
    parent = (r["parent_run"], int(r["parent_step"])) if r["parent_run"] is not None else None
    return RunRow(
        name=r["name"],
        state=RunState(r["state"]),
        state_reason=r["state_reason"],
        last_seen=r["last_seen"],
        parent=parent,
        host=r["host"],
        pid=r["pid"],
        on_hot=bool(r["on_hot"]),
    )


def checkpoint_row(r: sqlite3.Row, locations: Mapping[str, str]) -> CheckpointRow:
    return CheckpointRow(
        id=r["id"],
        run=r["run"],
        name=r["name"],
        step=r["step"],
        layout=r["layout"],
        state=CheckpointState(r["state"]),
        created_at=r["created_at"],
        last_write=r["last_write"],
        bytes=r["bytes"],
        metrics=json.loads(r["metrics"]),
        pinned=bool(r["pinned"]),
        committed=bool(r["committed"]),
        version=r["version"],
        manifest_json=r["manifest"],
        problem=r["problem"],
        locations=dict(locations),
        part=NodePart.from_json(r["part"]) if "part" in r.keys() else None,  # noqa: SIM118
    )


def artifact_row(r: sqlite3.Row) -> Artifact:
    return Artifact(
        tier=r["tier"],
        path=r["path"],
        kind=r["kind"],
        bytes=r["bytes"],
        last_write=r["last_write"],
        run=r["run"],
        upload_id=r["upload_id"] or None,
        # a read-only index not yet migrated has no node column (sqlite3.Row: `in` tests values)
        node=r["node"] if "node" in r.keys() else "",  # noqa: SIM118
    )


def quarantined_row(r: sqlite3.Row) -> Quarantined:
    return Quarantined(
        tier=r["tier"],
        path=r["path"],
        kind=r["kind"],
        reason=r["reason"],
        run=r["run"],
        first_seen=r["first_seen"],
        last_seen=r["last_seen"],
    )


def tier_status_row(r: sqlite3.Row) -> TierStatus:
    return TierStatus(tier=r["tier"], ok=bool(r["ok"]), error=r["error"], checked_at=r["checked_at"])


def journal_entry_row(r: sqlite3.Row) -> JournalEntry:
    return JournalEntry(
        id=r["id"],
        action=json.loads(r["action"]),
        phase=r["phase"],
        detail=json.loads(r["detail"]),
        started_at=r["started_at"],
    )


def job_run_row(r: sqlite3.Row) -> JobRun:
    return JobRun(
        job=r["job"],
        last_start=r["last_start"],
        last_success=r["last_success"],
        last_error=r["last_error"],
        last_error_at=r["last_error_at"],
    )


SNAPSHOT_COLUMNS = "id, run, name, step, layout, state, created_at, last_write, bytes, metrics, pinned, committed, version, part"
"""The checkpoints columns :func:`snapshot_checkpoints` reads, in its order: no manifest (the bulk of
a row), which the planner never reads."""


def snapshot_checkpoints(
    rows: Iterable[Sequence[Any]], locations: Mapping[int, Sequence[tuple[str, str]]]
) -> tuple[Checkpoint, ...]:
    """``CheckpointRow.to_model()`` of every row of :data:`SNAPSHOT_COLUMNS`, without building the
    intermediate rows: 100k checkpoints 4 s -> ~1 s (bench/planning.py). One loop, no call per row.

    ``locations``: checkpoint id -> its (tier, version) pairs. A checkpoint whose only copies are
    damaged is left out: nothing the planner can keep, move or count as a run's newest (that
    protection belongs to a checkpoint that exists).
    """
    shared: dict[frozenset[str], frozenset[str]] = {}
    nowhere: frozenset[str] = frozenset()
    states = {s.value: s for s in CheckpointState}
    loads = json.loads
    out = []
    for (
        cid,
        run,
        name,
        step,
        layout,
        state,
        created,
        last_write,
        nbytes,
        metrics,
        pinned,
        committed,
        version,
        part,
    ) in rows:
        tiers = nowhere
        locs = locations.get(cid)
        if locs:
            verified = frozenset(t for t, v in locs if v == version)
            if not verified and any(v.startswith(DAMAGED) for _, v in locs):
                continue
            tiers = shared.setdefault(verified, verified)  # a handful of distinct sets
        out.append(
            Checkpoint(
                run=run,
                step=step,
                name=name,
                layout=layout,
                state=states[state],
                created_at=created,
                bytes=nbytes,
                metrics=loads(metrics),
                pinned=bool(pinned),
                version=version,
                tiers=tiers,
                last_write=last_write,
                committed=bool(committed),
                part=NodePart.from_json(part) if part else None,
            )
        )
    return tuple(out)
