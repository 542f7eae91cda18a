"""Adopting a gone node's copies (docs/design.md, "Many nodes"): what the shared tier's rules expire among the copies
a node silent for ``fleet.orphan_after`` left in that tier.

Pure: the copies (what one listing of the node's prefix says: manifests, damage, pin objects), the
tier's policy and ``now`` in, a :class:`~ckptkeeper.core.model.Plan` out, every delete and keep
with its reason. The decision is the planner's own (:func:`ckptkeeper.core.planner.plan`), run on
a one-tier snapshot of the gone node's copies, so the shared tier's rules mean exactly what they
mean for a node's own copies, with the same protections and guards:

* a pinned copy (its pin object lives in the tier, beside the manifest) is kept;
* the newest complete, undamaged copy of every run (the last good one) is kept;
* a damaged copy (a manifest over missing or short data) is incomplete: never deleted here;
* ``max_delete`` and the empty-policy trap refuse the whole adoption, as they refuse a plan.

And, for adoption only:

* a copy whose manifest names another node than the one whose prefix holds it is kept (``owned
  by node C: not ours``): only the gone node's own copies are adopted;
* a copy that is one node's part of a checkpoint spanning nodes (its manifest names part k of N,
  N > 1) is kept: the parts of one version expire together, decided from a view of every part
 , never part by part by whoever adopts one node;
* two copies of one run at one step (two names) are kept, both: the planner keys by step;
* the tier's ``undo_window`` does not apply (the trash lives in the gone node's prefix, and no one
  would purge it): an adopted delete frees the copy for good, which is why it is only ever a copy
  the tier's own rules expire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Set

from ckptkeeper.core import planner
from ckptkeeper.core.model import (
    ActionKind,
    Checkpoint,
    CheckpointState,
    Keep,
    Manifest,
    Plan,
    Snapshot,
    TierSpec,
)
from ckptkeeper.core.retention import describe, rules_for
from ckptkeeper.util.fmt import format_duration

__all__ = ["ListedCopy", "adopted_reason", "plan_adoption"]

ListedCopy = tuple[str, Manifest | None, str | None]
"""``(path under the node's prefix, manifest or None when unreadable, damage or None)``: what
:meth:`~ckptkeeper.storage.S3TierStorage.list_manifests` returns."""


def adopted_reason(node: str, silent_for: float, why: str) -> str:
    """``adopted from node-a (silent 8d): <why>``: the prefix of every adopted action's reason."""
    unit = 3600 if silent_for >= 86400 else 60 if silent_for >= 3600 else 1  # 8d3h, not 8d3h12m7s
    return f"adopted from {node} (silent {format_duration(max(0, round(silent_for / unit) * unit))}): {why}"


def plan_adoption(
    node: str,
    silent_for: float,
    copies: Sequence[ListedCopy],
    pins: Set[tuple[str, str]],
    tier: TierSpec,
    now: float,
    *,
    max_delete: int = 100,
    force: bool = False,
) -> Plan:
    """The deletes the tier's rules make among ``node``'s ``copies`` (``pins``: (run, name) of its
    pin objects), and every copy kept with why. ``silent_for``: seconds since its last heartbeat."""
    spec = dataclasses.replace(
        tier, policy=dataclasses.replace(tier.policy, undo_window=None, headroom=False, replicate=False)
    )
    notes: list[str] = []
    held: list[Keep] = []
    by_key: dict[tuple[str, int], list[Manifest]] = {}
    damaged: set[tuple[str, str]] = set()
    for rel, manifest, damage in copies:
        if manifest is None:
            notes.append(f"{node}/{rel}: unreadable manifest, left alone ({damage})")
            continue
        by_key.setdefault((manifest.run, manifest.step), []).append(manifest)
        if damage:
            damaged.add((manifest.run, manifest.name))
    checkpoints: list[Checkpoint] = []
    foreign: dict[tuple[str, int, str], str] = {}
    for (run, step), group in sorted(by_key.items()):
        if len(group) > 1:
            names = ", ".join(sorted(m.name for m in group))
            held.append(
                Keep(run, step, tier.name, (f"{len(group)} copies share this step ({names}): left alone",))
            )
            continue
        (m,) = group
        part = m.part
        if part is not None and (part.count or 1) > 1:
            why = f"part {part.index} of {part.count} of job {part.job}: parts expire together"
            held.append(Keep(run, step, tier.name, (why,)))
            continue
        if m.node and m.node != node:
            foreign[(run, step, tier.name)] = m.node
        bad = (run, m.name) in damaged
        checkpoints.append(
            Checkpoint(
                run=run,
                step=step,
                name=m.name,
                layout=m.layout,
                state=CheckpointState.CORRUPT if bad else CheckpointState.COMPLETE,
                created_at=m.created_at,
                bytes=m.total_bytes,
                metrics=m.metrics,
                pinned=(run, m.name) in pins,
                version=m.digest,
                tiers=frozenset({tier.name}),
                committed=True,
            )
        )
    snapshot = Snapshot(runs=(), checkpoints=tuple(checkpoints), foreign=foreign, node=node)
    planned = planner.plan(snapshot, [spec], {}, now, max_delete=max_delete, force=force)
    rules = describe(rules_for(spec.policy, now))
    why = f"not kept by {tier.name}'s rules ({rules})"
    actions = tuple(
        a._replace(
            reason=adopted_reason(node, silent_for, why if a.rule == "expired" else a.reason),
            rule="adopted",
        )
        for a in planned.actions
        if a.action is ActionKind.DELETE
    )
    stray = [a for a in planned.actions if a.action is not ActionKind.DELETE]
    if stray:  # one tier, no reaper, no trash: nothing else can come out; never act on it
        notes.append(f"{len(stray)} non-delete actions of the adoption plan dropped")
    keeps = sorted([*planned.keep, *held], key=lambda k: (k.run, k.step))
    return Plan(
        actions=actions,
        keep=tuple(keeps),
        reclaim_bytes={tier.name: sum(a.bytes for a in actions)},
        refused=planned.refused,
        notes=(*planned.notes, *notes),
    )
