"""Ownership of copies (docs/design.md, "Many nodes"): a copy belongs to the node that wrote it.

A node's own rules (retention, expiry, reaping) delete only what it owns. In a tier several nodes
write, the index may hold copies another node wrote (an older single-node bucket layout shared by
two nodes, an index rebuilt from a bucket, a checkpoint copied by one node and cataloged by
another); those are read-only here: listed and restorable, never deleted by this node's rules.
The planner is given the facts (:attr:`Snapshot.foreign`: which copies another node wrote) and
turns each delete or reap of such a copy into a keep that says whose it is.

Pure: no I/O. Adopting an orphan (its owner silent for ``fleet.orphan_after``) is the lease
holder's business, not a node's own plan (:mod:`ckptkeeper.core.adoption`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptkeeper.core.model import Action, Artifact, Keep
from ckptkeeper.core.reaper import MULTIPART_UPLOAD

__all__ = ["not_ours", "without_foreign", "without_others_litter"]


def not_ours(owner: str) -> str:
    """The keep reason of a copy another node wrote (shown by ``prune --dry-run``)."""
    return f"owned by node {owner}: not ours"


def without_foreign(
    deletes: Sequence[Action],
    reaps: Sequence[Action],
    keeps: Sequence[Keep],
    foreign: Mapping[tuple[str, int, str], str],
    pos: Mapping[str, int],
) -> tuple[list[Action], list[Action], Sequence[Keep]]:
    """Drop every delete and reap of a copy in ``foreign`` ((run, step, tier) -> owning node) and
    keep that copy instead, with the owner as its reason; keeps stay in (run, step, tier position)
    order. Reaps of things that are not checkpoints (temp files, uploads) pass through."""
    if not foreign:
        return list(deletes), list(reaps), keeps
    extra: dict[tuple[str, int, str], str] = {}

    def owner_of(a: Action) -> str | None:
        if a.run is None or a.step is None or a.tier is None:
            return None
        return foreign.get((a.run, a.step, a.tier))

    kept_deletes: list[Action] = []
    for a in deletes:
        owner = owner_of(a)
        if owner is None:
            kept_deletes.append(a)
        else:
            extra[(a.run, a.step, a.tier)] = owner  # type: ignore[index]
    kept_reaps: list[Action] = []
    for a in reaps:
        owner = owner_of(a)
        if owner is None:
            kept_reaps.append(a)
        else:
            extra[(a.run, a.step, a.tier)] = owner  # type: ignore[index]
    if not extra:
        return kept_deletes, kept_reaps, keeps
    last = len(pos)
    out = list(keeps)
    out.extend(Keep(run, step, tier, (not_ours(owner),)) for (run, step, tier), owner in extra.items())
    out.sort(key=lambda k: (k.run, k.step, pos.get(k.tier, last)))
    return kept_deletes, kept_reaps, out


def without_others_litter(
    reaps: Sequence[Action], artifacts: Sequence[Artifact], me: str, notes: list[str]
) -> list[Action]:
    """Drop reaps of artifacts another node wrote — its staging markers and the uploads matched to
    them by upload id — each with a note: another node's copy in progress is not this node's to
    judge (its marker heartbeat says whether it is live; only the fleet lease holder cleans
    another node's litter, once that node is gone)."""
    by_id = {(a.tier, a.path, a.upload_id if a.kind == MULTIPART_UPLOAD else None): a for a in artifacts}
    out: list[Action] = []
    for r in reaps:
        a = by_id.get((r.tier or "", r.path or "", r.upload_id)) if r.step is None else None
        if a is not None and a.node and a.node != me:
            notes.append(
                f"{r.tier}:{r.path}: {a.kind} of node {a.node}: not ours (the fleet lease holder cleans it)"
            )
        else:
            out.append(r)
    return out
