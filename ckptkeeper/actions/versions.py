"""Versions of checkpoints spanning nodes in the shared tiers: the I/O around
:mod:`ckptkeeper.core.versions`.

* :func:`sync_records` (after every pass, beside the heartbeat): for each of this node's parts
  verified in a shared tier, its part record exists; a record of this node whose copy is gone
  (expired, moved) is removed, so an expired step leaves no record behind.
* :func:`keep_whole_versions` (every plan, dry run included): reads the versions the plan's deletes
  of parts depend on and lets :func:`ckptkeeper.core.versions.hold_parts` decide.
* :func:`part_versions` (``ls``): the status of each of this node's parts in each shared tier.
* :func:`version_pins` (every plan that deletes or reaps a part): which of those versions a node
  pinned (``pin`` of a part writes a version pin, :func:`pin_version`), so every node keeps its
  part of a pinned version.

Store failures never fail a pass: a plan whose versions cannot be read holds every delete of a
part they would have allowed (the safe side), with a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ckptkeeper.config import Settings
from ckptkeeper.core.model import ActionKind, Checkpoint, Plan, Snapshot
from ckptkeeper.core.versions import PartRecord, VersionStatus, hold_parts, record_name
from ckptkeeper.fleet.versions import (
    delete_record,
    list_run_pins,
    list_run_records,
    read_versions,
    record_for,
    remove_version_pin,
    write_record,
    write_version_pin,
)
from ckptkeeper.fleet.view import shared_tiers
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.storage import S3TierStorage, StorageError, TierStorage
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.versions")

__all__ = ["keep_whole_versions", "part_versions", "pin_version", "sync_records", "version_pins"]


def _shared(settings: Settings) -> list[S3TierStorage]:
    return shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers[1:]])


def _is_part(part: object) -> bool:
    return (
        part is not None
        and getattr(part, "count", None) is not None
        and part.count >= 2  # type: ignore[attr-defined]
        and part.index is not None  # type: ignore[attr-defined]
    )


def sync_records(settings: Settings, index: Index, tiers: Sequence[S3TierStorage] | None = None) -> list[str]:
    """Make this node's part records match what it holds verified in each shared tier."""
    notes: list[str] = []
    tiers = _shared(settings) if tiers is None else tiers
    if not tiers:
        return notes
    rows = [r for r in index.checkpoints() if _is_part(r.part)]
    if not rows:
        return notes
    by_run: dict[tuple[str | None, str], list[CheckpointRow]] = {}
    for r in rows:
        assert r.part is not None
        by_run.setdefault((r.part.job, r.run), []).append(r)
    for tier in tiers:
        for (job, run), group in sorted(by_run.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            try:
                listed = list_run_records(tier, job, run)
                mine: dict[str, CheckpointRow] = {}
                for r in group:
                    assert r.part is not None and r.part.index is not None
                    owner = index.location_owner(r.id, tier.name) or settings.node
                    if tier.name in r.verified_tiers and owner == settings.node:
                        mine[record_name(job, run, r.step, r.part.index)] = r
                present = {n for names in listed.values() for n in names}
                for name, r in sorted(mine.items()):
                    if name in present:
                        continue
                    manifest = r.manifest()
                    record = None if manifest is None else record_for(manifest, settings.node)
                    if record is not None and record.name == name:
                        write_record(tier, record)
                        log.info("part record written", tier=tier.name, record=name)
                indexes = {r.part.index for r in group if r.part is not None}
                for name in sorted(present - set(mine)):
                    leaf = name.rsplit("/", 1)[-1]
                    if not any(leaf == f"part-{k}.json" for k in indexes):
                        continue  # another node's part
                    got = tier.get_fleet_object(name)
                    try:
                        theirs = got is None or PartRecord.from_json(got[0], name).node != settings.node
                    except ValueError:
                        theirs = True  # unreadable: whose it is cannot be told, so it is not ours to remove
                    if theirs:
                        continue  # another node's record of the same part index
                    delete_record(tier, name)
                    log.info("part record removed: this node's copy is gone", tier=tier.name, record=name)
            except StorageError as exc:
                log.warning("part records not synced", tier=tier.name, run=run, error=str(exc))
                notes.append(f"{tier.name}: part records of {run} not synced: {exc}")
    return notes


def _wanted(plan: Plan, snapshot: Snapshot, shared: Sequence[str]) -> dict[tuple[str, int], Checkpoint]:
    """The parts whose deletes the plan holds or not, by (run, step)."""
    by_key = {c.key: c for c in snapshot.checkpoints if _is_part(c.part)}
    out: dict[tuple[str, int], Checkpoint] = {}
    for a in plan.actions:
        if a.action is ActionKind.DELETE and a.run is not None and a.step is not None:
            c = by_key.get((a.run, a.step))
            if c is not None:
                out[c.key] = c
    return out


def keep_whole_versions(settings: Settings, plan: Plan, snapshot: Snapshot) -> Plan:
    """``plan`` with each part kept whose version is not complete enough for its delete (the shared
    tiers' versions decide): a node's part goes, or expires, only as the whole version allows."""
    tiers = _shared(settings)
    names = [t.name for t in tiers]
    if not tiers or plan.refused is not None:
        return plan
    wanted = _wanted(plan, snapshot, names)
    if not wanted:
        return plan
    by_key = {c.key: c for c in snapshot.checkpoints if _is_part(c.part)}
    copying = {
        (a.run, a.step, a.to_tier) for a in plan.actions if a.action is ActionKind.COPY and a.to_tier in names
    }
    # Steps to read per (job, run): the parts planned for deletion, and every newer step of the run
    # that is, or is about to be, in a shared tier (an expiry waits for those to be complete).
    versions: dict[tuple[str, int, str], VersionStatus] = {}
    notes: list[str] = []
    groups: dict[tuple[str | None, str], int] = {}
    for c in wanted.values():
        assert c.part is not None
        k = (c.part.job, c.run)
        groups[k] = min(groups.get(k, c.step), c.step)
    for tier in tiers:
        for (job, run), low in sorted(groups.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            counts: dict[int, int] = {}
            for c in by_key.values():
                assert c.part is not None and c.part.count is not None
                if c.run != run or c.part.job != job or c.step < low:
                    continue
                if c.key in wanted or tier.name in c.tiers or (c.run, c.step, tier.name) in copying:
                    counts[c.step] = c.part.count
            try:
                for step, status in read_versions(tier, job, run, counts).items():
                    versions[(run, step, tier.name)] = status
                    notes += [f"{tier.name}: {run}@{step}: part record ignored: {p}" for p in status.problems]
            except StorageError as exc:
                notes.append(f"{tier.name}: versions of {run} unreadable, its parts are held: {exc}")
                for step, count in counts.items():
                    versions[(run, step, tier.name)] = VersionStatus(job, run, step, count)
    pos = {t.name: i for i, t in enumerate(settings.tiers)}
    deletes = [a for a in plan.actions if a.action is ActionKind.DELETE]
    left, keeps, held_notes = hold_parts(deletes, plan.keep, by_key, versions, names, pos)
    if len(left) == len(deletes):
        return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan
    kept = set(map(id, left))
    actions = tuple(a for a in plan.actions if a.action is not ActionKind.DELETE or id(a) in kept)
    reclaim = dict(plan.reclaim_bytes)
    for a in deletes:
        if id(a) not in kept and a.tier is not None and not a.trash:
            reclaim[a.tier] = reclaim.get(a.tier, 0) - a.bytes
    return Plan(
        actions=actions,
        keep=tuple(keeps),
        reclaim_bytes=reclaim,
        refused=plan.refused,
        notes=(*plan.notes, *notes, *held_notes),
    )


def part_versions(
    settings: Settings, checkpoints: Iterable[tuple[str, int, str | None, int, frozenset[str]]]
) -> dict[tuple[str, int, str], VersionStatus]:
    """(run, step, tier) -> status, for ``(run, step, job, count, tiers)`` of this node's parts, in
    the shared tiers among ``tiers``; unreadable versions are left out (``ls`` shows no count)."""
    tiers = _shared(settings)
    groups: dict[tuple[str | None, str], dict[int, int]] = {}
    where: dict[tuple[str, int], frozenset[str]] = {}
    for run, step, job, count, in_tiers in checkpoints:
        groups.setdefault((job, run), {})[step] = count
        where[(run, step)] = in_tiers
    out: dict[tuple[str, int, str], VersionStatus] = {}
    for tier in tiers:
        for (job, run), counts in groups.items():
            counts = {s: n for s, n in counts.items() if tier.name in where[(run, s)]}
            if not counts:
                continue
            try:
                statuses = read_versions(tier, job, run, counts)
            except StorageError as exc:
                log.warning("versions unreadable", tier=tier.name, run=run, error=str(exc))
                continue
            for step, status in statuses.items():
                out[(run, step, tier.name)] = status
    return out


def version_pins(
    settings: Settings, plan: Plan, snapshot: Snapshot
) -> tuple[dict[tuple[str, int], list[str]], list[str]]:
    """(run, step) -> nodes that pinned the version, for each part ``plan`` deletes or reaps (one
    listing per (job, run) and shared tier; nothing read when the plan touches no part). A
    listing that fails pins those parts (the safe side), with a note."""
    tiers = _shared(settings)
    by_key = {c.key: c for c in snapshot.checkpoints if _is_part(c.part)}
    touched = {
        (a.run, a.step)
        for a in plan.actions
        if a.action in (ActionKind.DELETE, ActionKind.REAP) and a.run is not None and a.step is not None
    }
    groups: dict[tuple[str | None, str], set[int]] = {}
    for key in touched:
        c = by_key.get(key)
        if c is not None and c.part is not None:
            groups.setdefault((c.part.job, c.run), set()).add(c.step)
    pins: dict[tuple[str, int], list[str]] = {}
    notes: list[str] = []
    for tier in tiers:
        for (job, run), steps in sorted(groups.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            try:
                listed = list_run_pins(tier, job, run)
            except StorageError as exc:
                notes.append(f"{tier.name}: version pins of {run} unreadable, its parts are kept: {exc}")
                listed = {step: [f"? (pins unreadable in {tier.name})"] for step in steps}
            for step in sorted(steps & set(listed)):
                pins.setdefault((run, step), []).extend(listed[step])
    return pins, notes


def pin_version(settings: Settings, rows: Sequence[CheckpointRow], pinned: bool) -> dict[str, str]:
    """Write (or remove) this node's version pin of each part among ``rows`` in every shared tier;
    tier -> error for the tiers that failed."""
    failed: dict[str, str] = {}
    parts = [r for r in rows if _is_part(r.part)]
    if not parts:
        return failed
    for tier in _shared(settings):
        try:
            for r in parts:
                assert r.part is not None
                if pinned:
                    write_version_pin(tier, r.part.job, r.run, r.step, settings.node)
                else:
                    remove_version_pin(tier, r.part.job, r.run, r.step, settings.node)
        except StorageError as exc:
            failed[tier.name] = f"version pin not {'written' if pinned else 'removed'}: {exc}"
    return failed
