"""Fleet-wide cleanup by the lease holder (DESIGN §10): the staging markers and multipart uploads
of nodes that are gone — their heartbeat object is older than ``fleet.orphan_after`` — and whose
own marker heartbeat is older than ``fleet.heartbeat_ttl`` (never a live copy).

Only the lease holder does this, and it renews the lease (If-Match) before every delete, so two
nodes never clean the same litter: each orphan is cleaned exactly once. A node with no heartbeat
object at all is unknown, not gone (it may run an older version): its litter is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptkeeper.fleet.lease import Lease
from ckptkeeper.fleet.nodes import NodeBeat
from ckptkeeper.storage import S3TierStorage, StorageError

__all__ = ["CleanReport", "clean_gone_nodes", "gone_nodes"]


def gone_nodes(beats: Sequence[NodeBeat], me: str, now: float, orphan_after: float) -> list[str]:
    """Nodes whose heartbeat is older than ``orphan_after`` (pure); never this node."""
    return sorted(b.node for b in beats if b.node != me and now - b.last_pass > orphan_after)


@dataclass
class CleanReport:
    discarded: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    skipped_live: int = 0
    errors: list[str] = field(default_factory=list)
    lost_lease: bool = False


def clean_gone_nodes(
    tier: S3TierStorage, lease: Lease, nodes: Sequence[str], now: float, heartbeat_ttl: float
) -> CleanReport:
    """Discard gone nodes' abandoned staging markers (and their uncommitted data) and abort their
    uploads; stops as soon as the lease cannot be renewed."""
    report = CleanReport()
    for node in nodes:
        view = tier.adopt(node)
        try:
            staging = view.list_staging()
            uploads = view.list_multipart_uploads()
        except StorageError as exc:
            report.errors.append(f"{node}: {exc}")
            continue
        for artifact, dispose, done in (
            *((a, view.discard_staging, report.discarded) for a in staging),
            *((u, view.abort_multipart, report.aborted) for u in uploads),
        ):
            if now - artifact.last_write < heartbeat_ttl:
                report.skipped_live += 1
                continue
            if not lease.acquire():
                report.lost_lease = True
                return report
            try:
                dispose(artifact)
                done.append(f"{node}/{artifact.path}")
            except StorageError as exc:
                report.errors.append(f"{node}/{artifact.path}: {exc}")
    return report
