"""Many nodes on one bucket cannot be half-configured (docs/configuration-safety.md).

Nodes that all point at one object-store tier without ``shared = true`` write the same keys: in a
job spanning nodes, the first node's part is stored as if it were the whole checkpoint (and deleted
from its hot tier) while every other node's copy fails on every pass. Before a pass plans, the
catalog has recorded which node wrote each copy the tier holds (the ``node`` of its manifest); a
copy another node wrote in a tier that is not shared means several nodes use it, and the pass is
refused: a config error naming ``tiers[i].shared`` (exit 2), before anything is done.

Not the default-to-shared alternative: ``shared = true`` moves new copies under ``<prefix>/<node>/``
and leaves every existing single-node bucket's copies outside any node's retention.
"""

from __future__ import annotations

from ckptkeeper.actions.sharedfs import NodeClash
from ckptkeeper.config import Settings
from ckptkeeper.index import Index

__all__ = ["TierNotShared", "refuse_unshared_writers"]


class TierNotShared(NodeClash):
    """Another node writes an object-store tier this node does not share: a config error (exit 2),
    handled wherever :class:`NodeClash` is."""


def refuse_unshared_writers(settings: Settings, index: Index) -> None:
    """Raise :class:`TierNotShared` when the index records copies another node wrote in an
    object-store tier that is not ``shared`` (one line per such tier)."""
    if any(t.shared and t.is_local for t in settings.tiers):
        return  # a shared filesystem's keepers take turns writing the slower tiers, under its lease
    problems = []
    for i, tier in enumerate(settings.tiers):
        if tier.shared or tier.is_local:
            continue
        writers = index.other_writers(tier.name, settings.node)
        if not writers:
            continue
        node, paths = next(iter(writers.items()))
        more = len(paths) - 1 + sum(len(p) for n, p in writers.items() if n != node)
        seen = ", ".join(sorted(writers)[:5]) + (", ..." if len(writers) > 5 else "")
        problems.append(
            f"tiers[{i}].shared: tier {tier.name!r} ({tier.url}) holds copies other nodes wrote "
            f"(node {seen}: {paths[0]}{f' and {more} more' if more else ''}), but this node, "
            f"{settings.node!r}, does not share it: nodes writing one bucket prefix without shared = true "
            "store only one node's part of each checkpoint spanning them. Set shared = true on this tier on "
            "every node (docs/configuration-safety.md); if those copies are this node's from before it was "
            f"renamed, set node = {node!r}. Nothing was done"
        )
    if problems:
        raise TierNotShared("\n".join(problems))
