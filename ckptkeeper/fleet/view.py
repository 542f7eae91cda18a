"""Who holds a run in the shared tiers: the read side of docs/design.md, "Many nodes".

In a ``shared`` tier every node writes under ``<root>/<node>/``; copies written before the tier was
shared (the single-node layout, ``<root>/<run>/``) stay readable at the root. ``restore`` by run
name from any node asks :func:`run_holders`, then picks with :func:`choose_holder`: this node's
own run first; else the only node holding it; else it refuses and lists the nodes (``--node``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptkeeper.core.model import Manifest
from ckptkeeper.storage import S3TierStorage, TierStorage
from ckptkeeper.storage.s3_fleet import FLEET_DIR

__all__ = ["Copy", "choose_holder", "run_holders", "shared_tiers"]

OLD_LAYOUT = "(single-node layout)"
"""How a copy at the root of a shared tier, written before it was shared, is labelled."""


@dataclass(frozen=True)
class Copy:
    """One committed copy of a checkpoint somewhere in the fleet, and the view that reads it."""

    node: str
    """The node whose prefix holds it (for the old layout: the node its manifest names)."""
    tier: str
    manifest: Manifest
    storage: TierStorage


def shared_tiers(storages: Sequence[TierStorage]) -> list[S3TierStorage]:
    return [t for t in storages if isinstance(t, S3TierStorage) and t.spec.shared]


def run_holders(tiers: Sequence[S3TierStorage], run: str) -> dict[str, list[Copy]]:
    """node -> copies of ``run`` in ``tiers``: one delimited listing of each root, one listing per
    node prefix; old-layout copies at the root are grouped by the node their manifest names."""
    out: dict[str, list[Copy]] = {}
    for tier in tiers:
        for name in tier.top_level_dirs():
            if name == FLEET_DIR:
                continue
            view = tier.view(name)
            for m in view.run_manifests(run):
                out.setdefault(name, []).append(Copy(name, tier.name, m, view))
        old = tier.view(None)
        for m in old.run_manifests(run):
            node = m.node or OLD_LAYOUT
            out.setdefault(node, []).append(Copy(node, tier.name, m, old))
    return out


def choose_holder(holders: Mapping[str, list[Copy]], run: str, *, me: str, node: str | None) -> list[Copy]:
    """The copies to restore ``run`` from (a documented rule, never a mix of two nodes' runs):
    ``node`` if given; else this node's own; else the only node holding it. Raises LookupError
    naming the nodes when several other nodes hold a run of that name."""
    if node is not None:
        if node not in holders:
            seen = ", ".join(sorted(holders)) or "none"
            raise LookupError(f"node {node!r} holds no copy of run {run!r} (nodes holding it: {seen})")
        return holders[node]
    if me in holders:
        return holders[me]
    if not holders:
        raise LookupError(f"no node holds a copy of run {run!r} in the shared tiers")
    if len(holders) > 1:
        raise LookupError(
            f"run {run!r} is held by several nodes: {', '.join(sorted(holders))}; "
            "choose one with --node (their runs are different runs that share a name)"
        )
    return next(iter(holders.values()))
