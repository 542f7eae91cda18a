"""A shared hot (or warm) filesystem — Lustre, NFS, Weka — seen by several nodes (docs/design.md, "Many nodes", the
second topology): exactly one keeper acts on it at a time, the holder of its lease; the others
only catalog it (``ls``, ``status``, ``restore`` work everywhere).

The lease is a :class:`~ckptkeeper.fleet.lease.Lease` named ``leases/<tier>-<id>`` (``<id>``: the
tier's ``shared_id``, else a hash of its path), kept in the shared bucket when a shared ``s3://``
tier is configured (its conditional writes are what S3 guarantees best), else in the filesystem
itself (:class:`~ckptkeeper.storage.local_fleet.LocalFleetObjects`: link/rename, atomic on NFS and
Lustre). Node heartbeats of the shared filesystem are files in it, ``<root>/.ckptkeeper/nodes/``.

The decisions here are pure: which actions a node that does not hold the lease must drop, the note
it shows (whether a heartbeat proves a second keeper uses this node's name:
:func:`ckptkeeper.fleet.nodes.name_clash`, for every shared tier).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection
from pathlib import Path

from ckptkeeper.core.model import Action, Plan, Snapshot
from ckptkeeper.fleet.lease import LeaseInfo
from ckptkeeper.util.fmt import human_age

__all__ = ["catalog_only_note", "lease_name", "owned_by_the_tier", "touches", "without_tiers"]


def lease_name(tier: str, root: Path, shared_id: str | None) -> str:
    """The lease object of a shared filesystem tier: every node mounting it must compute the same
    one (set ``shared_id`` where nodes mount it at different paths)."""
    if shared_id:
        return f"leases/{shared_id}"
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return f"leases/{tier}-{digest}"


def touches(action: Action, tiers: Collection[str]) -> bool:
    """Does the action read from, write to or delete in one of ``tiers``?"""
    return action.tier in tiers or action.to_tier in tiers


def without_tiers(plan: Plan, tiers: Collection[str], notes: list[str]) -> tuple[Plan, int]:
    """The plan minus every action on ``tiers`` (another node holds their lease: it acts there),
    with ``notes`` added; and how many were dropped."""
    kept = tuple(a for a in plan.actions if not touches(a, tiers))
    dropped = len(plan.actions) - len(kept)
    reclaim = {t: b for t, b in plan.reclaim_bytes.items() if t not in tiers}
    return dataclasses.replace(
        plan, actions=kept, reclaim_bytes=reclaim, notes=(*plan.notes, *notes)
    ), dropped


def catalog_only_note(tier: str, lease: LeaseInfo, now: float) -> str:
    """What a node that does not hold the lease says (``prune``, text and JSON notes)."""
    return (
        f"{tier} is shared: {lease.node} holds the lease (expires in {human_age(max(0.0, lease.expires - now))}); "
        "this node only catalogs"
    )


def owned_by_the_tier(snapshot: Snapshot, tiers: Collection[str]) -> Snapshot:
    """On a shared filesystem tier a copy belongs to the tier — to whichever keeper holds its lease —
    not to the node that wrote or first indexed it: forget the owner of copies and litter there, so
    the holder's rules apply to all of them (and the lease, not ownership, keeps the others out)."""
    if not tiers:
        return snapshot
    foreign = {k: v for k, v in snapshot.foreign.items() if k[2] not in tiers}
    artifacts = tuple(
        dataclasses.replace(a, node="") if a.tier in tiers and a.node else a for a in snapshot.artifacts
    )
    return dataclasses.replace(snapshot, foreign=foreign, artifacts=artifacts)
