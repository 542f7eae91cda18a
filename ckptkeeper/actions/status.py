"""``status``: one summary of what this node holds and does, for ``status``, ``status --json`` and
the Prometheus metrics alike.

:func:`summarize` reads the index once (plus each local tier's filesystem usage and the
deletes-held file) and returns plain values; the callers only render them. ``now`` is passed in.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.held import TierUnavailable, read_policy_held
from ckptkeeper.actions.index import deletes_held
from ckptkeeper.config import Settings
from ckptkeeper.core import cost
from ckptkeeper.core.headroom import Headroom
from ckptkeeper.core.model import CheckpointState, TierSpec, TierUsage
from ckptkeeper.index import CheckpointRow, Index, JobRun, Quarantined, RunRow

WARNING_MARK = "WARNING: "
"""What the catalog puts before a warning in a run's ``state_reason`` (``ingest.catalog``)."""


@dataclass(frozen=True, slots=True)
class TierSummary:
    name: str
    url: str
    ok: bool | None
    """The tier's last listing worked; None: never listed."""
    error: str | None
    checked_at: float | None
    usage: TierUsage | None
    """Filesystem usage of a local tier; None for object stores or when it cannot be read."""
    checkpoints: int
    """Complete checkpoints with a verified copy in the tier."""
    bytes: int
    newest_checkpoint_at: float | None
    """Creation time of the newest of those (the tier's recovery point)."""
    stored_bytes: int | None = None
    """Bytes the tier holds for them: a dedup tier's content store (one listing of it; docs/dedup.md),
    or a tier storing some compressed (docs/compression.md); None: as many as ``bytes`` (or unknown)."""
    dedup: bool = False


@dataclass(frozen=True, slots=True)
class FsClock:
    """A local tier's filesystem clock as the last real prune pass read it (docs/many-nodes-clocks.md)."""

    tier: str
    skew: float
    """This node's clock minus the filesystem's, seconds (positive: the node runs ahead)."""
    read_at: float
    """This node's clock when the pass read it."""
    warning: str | None
    """Set when the skew is past the pass's threshold."""


@dataclass(frozen=True, slots=True)
class FsClocks:
    """``<index>.clocks.json``, read only: no probe, nothing written."""

    tiers: tuple[FsClock, ...]
    error: str | None
    """The record, or a tier's reading in it, is unreadable (one line; the next real pass rewrites it)."""


@dataclass(frozen=True, slots=True)
class StatusSummary:
    now: float
    tiers: tuple[TierSummary, ...]
    runs: Mapping[str, int]
    """Runs by state value (states with none are absent)."""
    checkpoints: Mapping[str, int]
    """Cataloged checkpoints by state value (states with none are absent)."""
    pinned: int
    reclaimed: Mapping[str, tuple[int, int]]
    """reason -> (bytes, count), cumulative since the index was created."""
    jobs: Mapping[str, JobRun]
    journal_open: int
    """Interrupted executor steps the next prune (or daemon start) finishes or undoes."""
    deletes_held: str | None
    cost_per_month: Mapping[str, float] = field(default_factory=dict)
    """Tier -> monthly storage cost of its verified copies (tiers with ``cost_per_gib_month`` only)."""
    run_cost_per_month: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Run -> tier -> monthly storage cost, from the same copies as ``cost_per_month``."""
    warnings: tuple[str, ...] = ()
    """``"<run>: <why>"`` for runs the catalog flagged (a hook that should be there and is not)."""
    policy_held: Mapping[str, TierUnavailable] = field(default_factory=dict)
    """Unavailable tiers that held back the last retention pass (copies to them, deletes that
    depend on them), per tier."""
    damaged: int = 0
    """Copies the index marks damaged (found not matching their manifest; copied again)."""
    quarantined: tuple[Quarantined, ...] = ()
    """Documents that failed the schema (ignored, never a reason to delete), with their reasons."""
    scrub: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    """Tier -> (bytes re-hashed, copies checked, bad copies found) by scrubs, cumulative."""
    scrub_oldest: Mapping[str, float | None] = field(default_factory=dict)
    """Slower tier -> when its least recently hashed good copy was last hashed (None: some copy
    never was): how stale the tier's verification is, the figure to alert on."""
    no_good_copy: tuple[tuple[str, int, str, Mapping[str, str]], ...] = ()
    """(run, step, name, {tier: problem}) of checkpoints whose every copy is damaged."""
    headroom: Headroom | None = None
    """The hot tier's free space against its active runs' next saves; None when its usage cannot
    be read."""
    trash: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Tier -> (bytes, entries) waiting in its trash (``undo_window``): not reclaimed yet."""
    fs_clocks: FsClocks | None = None
    """Each local tier's filesystem clock against this node's, as the last real pass read it;
    None: no reading kept (no real pass yet)."""

    @property
    def clock_warnings(self) -> tuple[str, ...]:
        """``"<tier>: <why>"`` for each local tier whose filesystem clock is far off this node's."""
        return tuple(c.warning for c in self.fs_clocks.tiers if c.warning) if self.fs_clocks else ()

    @property
    def reclaimed_bytes(self) -> int:
        return sum(b for b, _ in self.reclaimed.values())

    def newest_age(self, tier: TierSummary) -> float | None:
        """Seconds since the tier's newest checkpoint was made (never negative)."""
        if tier.newest_checkpoint_at is None:
            return None
        return max(0.0, self.now - tier.newest_checkpoint_at)

    def to_dict(self) -> dict[str, Any]:
        """``status --json`` (without ``shared_fs``, which :func:`shared_fs_rows` adds)."""
        return {
            "tiers": [self._tier_doc(t) for t in self.tiers],
            "runs": dict(self.runs),
            "checkpoints": dict(self.checkpoints),
            "pinned": self.pinned,
            "reclaimed": {
                "total_bytes": self.reclaimed_bytes,
                "by_reason": {k: {"bytes": b, "count": n} for k, (b, n) in sorted(self.reclaimed.items())},
            },
            "trash": {t: {"bytes": b, "entries": n} for t, (b, n) in sorted(self.trash.items())},
            "jobs": {
                j.job: {
                    "last_start": j.last_start,
                    "last_success": j.last_success,
                    "last_error": j.last_error,
                }
                for j in self.jobs.values()
            },
            "pending": {"journal": self.journal_open},
            "deletes_held": self.deletes_held,
            "warnings": [*self.warnings, *self.clock_warnings],
            "policy_held": {
                t.tier: {"error": t.error, "checkpoints": t.checkpoints, "since": t.since}
                for t in self.policy_held.values()
            },
            "damaged_copies": self.damaged,
            "scrub": self._scrub_doc(),
            "quarantined": [q.to_dict() for q in self.quarantined],
            "cost_per_month": self._cost_doc(),
            "headroom": self._headroom_doc(),
            "filesystem_clocks": self._fs_clocks_doc(),
        }

    def _fs_clocks_doc(self) -> dict[str, Any] | None:
        """The kept clock readings (None: none kept yet; a tier without one is absent)."""
        c = self.fs_clocks
        if c is None:
            return None
        return {
            "tiers": {
                t.tier: {
                    "skew_seconds": round(t.skew, 3),
                    "read_at": t.read_at,
                    "age_seconds": round(max(0.0, self.now - t.read_at), 1),
                    "warning": t.warning,
                }
                for t in c.tiers
            },
            "error": c.error,
        }

    def _tier_doc(self, t: TierSummary) -> dict[str, Any]:
        age = self.newest_age(t)
        return {
            "name": t.name,
            "url": t.url,
            "ok": t.ok,
            "error": t.error,
            "checked_at": t.checked_at,
            "usage": {
                "total_bytes": t.usage.total_bytes,
                "used_bytes": t.usage.used_bytes,
                "fraction": round(t.usage.fraction, 4),
            }
            if t.usage
            else None,
            "checkpoints": t.checkpoints,
            "bytes": t.bytes,
            "stored_bytes": t.bytes if t.stored_bytes is None else t.stored_bytes,
            "saving_bytes": 0 if t.stored_bytes is None else t.bytes - t.stored_bytes,
            "newest_checkpoint_age_seconds": None if age is None else round(age, 1),
            "dedup": {"stored_bytes": t.stored_bytes, "referenced_bytes": t.bytes} if t.dedup else None,
        }

    def _scrub_doc(self) -> dict[str, Any]:
        return {
            "tiers": {
                t: {"bytes": b, "copies": n, "bad": bad, "oldest_check": self.scrub_oldest.get(t)}
                for t, (b, n, bad) in sorted(self.scrub.items())
            },
            "oldest_check": {t: self.scrub_oldest.get(t) for t in sorted(self.scrub_oldest)},
            "no_good_copy": [
                {"run": run, "step": step, "name": name, "damaged": dict(d)}
                for run, step, name, d in self.no_good_copy
            ],
        }

    def _headroom_doc(self) -> dict[str, Any] | None:
        """The hot tier's free space against its active runs' next saves (None: usage unreadable)."""
        h = self.headroom
        if h is None:
            return None
        return {
            "tier": h.tier,
            "free_bytes": h.free_bytes,
            "needed_bytes": h.needed_bytes,
            "runs": dict(h.runs),
            "ok": h.ok,
            "enabled": h.enabled,
        }

    def _cost_doc(self) -> dict[str, Any] | None:
        """Storage cost per tier and per run (None: no tier has ``cost_per_gib_month``)."""
        if not self.cost_per_month:
            return None
        return {
            "tiers": dict(self.cost_per_month),
            "total": round(sum(self.cost_per_month.values()), 4),
            "runs": {
                run: {**tiers, "total": round(sum(tiers.values()), 4)}
                for run, tiers in self.run_cost_per_month.items()
            },
        }


def tier_usage(settings: Settings) -> dict[str, TierUsage | None]:
    """Filesystem usage per local tier (status, watermarks); object stores have none."""
    out: dict[str, TierUsage | None] = {}
    for tier in settings.tiers:
        if not tier.is_local:
            out[tier.name] = None
            continue
        try:
            du = shutil.disk_usage(tier.local_path)
        except OSError:
            out[tier.name] = None
            continue
        out[tier.name] = TierUsage(total_bytes=du.total, used_bytes=du.used, free_bytes=du.free)
    return out


def summarize(settings: Settings, index: Index, *, now: float | None = None) -> StatusSummary:
    """Tiers with usage, counts per state, pending work, reclaimed bytes, last job runs."""
    checkpoints = index.checkpoints()
    runs = index.runs()
    statuses = index.tier_statuses()
    reclaimed = index.reclaimed()
    jobs = index.job_runs()
    journal = index.journal_open()
    quarantined = tuple(index.quarantined())
    usage = tier_usage(settings)
    lost = index.without_good_copy()
    stored = index.stored_bytes()
    tiers = []
    for t in settings.tiers:
        held = [c for c in checkpoints if c.state is CheckpointState.COMPLETE and t.name in c.verified_tiers]
        st = statuses.get(t.name)
        tiers.append(
            TierSummary(
                name=t.name,
                url=t.url,
                ok=st.ok if st else None,
                error=st.error if st else "never listed",
                checked_at=st.checked_at if st else None,
                usage=usage.get(t.name),
                checkpoints=len(held),
                bytes=sum(c.bytes for c in held),
                newest_checkpoint_at=max((c.created_at for c in held), default=None),
                stored_bytes=(
                    _content_bytes(t.to_spec())
                    if t.dedup
                    else sum(stored.get((c.id, t.name), c.bytes) for c in held)
                    if any((c.id, t.name) in stored for c in held)
                    else None
                ),
                dedup=t.dedup,
            )
        )
    now = time.time() if now is None else now
    try:
        held_text = deletes_held(settings)
    except OSError as exc:  # a status must answer; the hold is then unknown, not absent
        held_text = f"unknown: cannot read the hold file: {exc}"
    return StatusSummary(
        now=now,
        tiers=tuple(tiers),
        runs=dict(Counter(r.state.value for r in runs)),
        checkpoints=dict(Counter(c.state.value for c in checkpoints)),
        pinned=sum(1 for c in checkpoints if c.pinned),
        reclaimed=reclaimed,
        jobs=jobs,
        journal_open=len(journal),
        deletes_held=held_text,
        warnings=tuple(
            f"{r.name}: {r.state_reason.split(WARNING_MARK, 1)[1]}"
            for r in runs
            if r.state_reason and WARNING_MARK in r.state_reason
        )
        + tuple(
            f"{run}: step {step} ({name}) has no good copy left: "
            + "; ".join(f"{t}: {p}" for t, p in sorted(damaged.items()))
            + " (kept, never deleted; restore it from elsewhere: these damaged copies are this node's "
            "last of that checkpoint, and removing them loses whatever of it is still readable)"
            for run, step, name, damaged in lost
        )
        + _unknown_parts(checkpoints)
        + _clock_skew(settings),
        policy_held=read_policy_held(settings),
        scrub=index.scrub_totals(),
        scrub_oldest=index.oldest_scrub([t.name for t in settings.tiers[1:]]),
        no_good_copy=tuple(lost),
        damaged=sum(len(c.damaged) for c in checkpoints),
        quarantined=quarantined,
        headroom=_headroom(settings, usage, runs, checkpoints),
        trash=_trash(index),
        fs_clocks=_fs_clocks(settings, now),
        **_costs(settings, checkpoints, tiers, stored),
    )


def _content_bytes(spec: TierSpec) -> int | None:
    """Bytes in this node's content store of a dedup tier (one listing), None if unknown."""
    from ckptkeeper.storage import StorageError, TierStorage, content_gc

    try:
        return sum(o.size for o in content_gc.list_content(TierStorage(spec)))
    except StorageError:
        return None


def _clock_skew(settings: Settings) -> tuple[str, ...]:
    """This node's clock against each shared bucket's: one small request per shared bucket."""
    if not any(t.shared and not t.is_local for t in settings.tiers):
        return ()
    from ckptkeeper.actions.fleet import clock_skew_warnings  # only for shared buckets

    return clock_skew_warnings(settings)


def _fs_clocks(settings: Settings, now: float) -> FsClocks | None:
    """The offsets the last real passes kept beside the index (read only: status never probes)."""
    from ckptkeeper.ingest.clocks import kept_readings, skew_note

    kept = kept_readings(settings)
    if kept is None:
        return None
    return FsClocks(
        tiers=tuple(
            FsClock(tier, r.skew, r.node, skew_note(tier, r.skew, read_ago=max(0.0, now - r.node)))
            for tier, r in kept.readings.items()
        ),
        error=kept.error,
    )


def _headroom(
    settings: Settings,
    usage: Mapping[str, TierUsage | None],
    runs: list[RunRow],
    checkpoints: list[CheckpointRow],
) -> Headroom | None:
    """The same prediction the planner makes (:mod:`ckptkeeper.core.headroom`), from the index rows."""
    hot = settings.hot
    u = usage.get(hot.name)
    if u is None:
        return None
    return Headroom.of(
        hot.name,
        u.free,
        runs,
        ((c.run, c.step, c) for c in checkpoints),
        enabled=hot.headroom is not False,
    )


def _trash(index: Index) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for e, _ in index.trash():
        b, n = out.get(e.tier, (0, 0))
        out[e.tier] = (b + e.bytes, n + 1)
    return out


def _costs(
    settings: Settings,
    checkpoints: list[CheckpointRow],
    tiers: list[TierSummary],
    stored_bytes: Mapping[tuple[int, str], int] | None = None,
) -> dict[str, Any]:
    """Storage cost per tier and per run, from the very copies the tier rows count."""
    prices = {t.name: t.cost_per_gib_month for t in settings.tiers}
    if all(p is None for p in prices.values()):
        return {}
    stored = stored_bytes or {}
    copies = [
        (c.run, tier, stored.get((c.id, tier), c.bytes))  # a compressed copy costs what it stores
        for c in checkpoints
        if c.state is CheckpointState.COMPLETE
        for tier in c.verified_tiers
    ]
    return {
        "cost_per_month": cost.by_tier(
            {t.name: t.bytes if t.stored_bytes is None else t.stored_bytes for t in tiers}, prices
        ),
        "run_cost_per_month": cost.by_run(copies, prices),
    }


def _unknown_parts(checkpoints: Iterable[CheckpointRow]) -> tuple[str, ...]:
    """One warning per run holding node-local parts no hook vouches for: they are kept forever
    (docs/spanning-nodes.md), so an operator must hear of them."""
    steps: dict[str, list[int]] = {}
    for c in checkpoints:
        if c.part is not None and not c.part.known and c.state is not CheckpointState.COMPLETE:
            steps.setdefault(c.run, []).append(c.step)
    return tuple(
        f"{run}: {len(found)} node-local part(s) of a multi-node checkpoint (steps "
        f"{', '.join(map(str, sorted(found)[:5]))}{', …' if len(found) > 5 else ''}) kept, never reaped: "
        "no hook says which job they belong to (track_run on every rank). They are this node's share of "
        "those checkpoints: without them no node can restore them whole, so remove them only once the job "
        "and its checkpoints are no longer needed"
        for run, found in sorted(steps.items())
    )


def shared_fs_rows(settings: Settings) -> list[dict[str, Any]] | None:
    """``status``'s ``shared_fs``: each shared filesystem tier's heartbeats and lease (None when
    there is none; a read error is a row)."""
    if not any(t.shared and t.is_local for t in settings.tiers):
        return None
    from ckptkeeper.actions.sharedfs import shared_fs_status  # only for shared tiers
    from ckptkeeper.storage import StorageError

    try:
        return shared_fs_status(settings)
    except StorageError as exc:
        return [
            {"tier": t.name, "error": str(exc), "nodes": [], "lease": None}
            for t in settings.tiers
            if t.shared and t.is_local
        ]
