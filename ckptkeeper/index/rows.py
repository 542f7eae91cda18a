"""Typed rows the index returns, and their conversion from sqlite rows to core model objects."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptkeeper.core.model import Checkpoint, CheckpointState, Manifest, Run, RunState

DAMAGED = "damaged: "
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
    )
