"""Fleet-wide cleanup by the lease holder (docs/design.md, "Many nodes"): the staging markers and multipart uploads
of nodes that are gone — their heartbeat object is older than ``fleet.orphan_after`` — and whose
own marker heartbeat is older than ``fleet.heartbeat_ttl`` (never a live copy).

Only the lease holder does this, and it renews the lease (If-Match on the etag it wrote itself)
and claims the item (:mod:`ckptkeeper.fleet.claims`) before every delete, so two nodes never
clean the same litter: each orphan is cleaned exactly once, even by a holder stalled mid-delete. A holder whose lease expired and was taken over meanwhile (a stall past ``lease_ttl``) stops,
even if the other node has released it since: what it listed is stale. Uploads are listed after
the markers are discarded: a marker's discard aborts the uploads under its target, and an upload
already aborted is not reported again. A node with no heartbeat
object at all is unknown, not gone (it may run an older version): its litter is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptkeeper.core.model import Artifact
from ckptkeeper.fleet.claims import claim, marker_item, upload_item
from ckptkeeper.fleet.lease import Lease
from ckptkeeper.fleet.nodes import NodeBeat
from ckptkeeper.storage import S3TierStorage, StorageError
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.fleet.cleanup")

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
    claimed: list[str] = field(default_factory=list)
    """Items another holder had claimed (:mod:`ckptkeeper.fleet.claims`): its to delete, skipped."""
    late: list[str] = field(default_factory=list)
    """Items whose delete finished after our lease had expired (this process was stalled past
    ``lease_ttl`` mid-delete). S3 deletes carry no fencing token; the item's claim
    (:mod:`ckptkeeper.fleet.claims`) is what keeps another holder from cleaning it too."""


def clean_gone_nodes(
    tier: S3TierStorage,
    lease: Lease,
    nodes: Sequence[str],
    now: float,
    heartbeat_ttl: float,
    *,
    stale_after: float = 7 * 86400.0,
) -> CleanReport:
    """Discard gone nodes' abandoned staging markers (and their uncommitted data) and abort their
    uploads; stops as soon as the lease cannot be renewed. Each item is claimed first
    (:func:`ckptkeeper.fleet.claims.claim`; ``stale_after``: when a claim may be taken over)."""
    report = CleanReport()
    for node in nodes:
        view = tier.adopt(node)
        # Uploads are listed after the markers are discarded: a marker's discard aborts the uploads
        # under its checkpoint, and an upload listed before would be "aborted" (reported) twice.
        stages: tuple[
            tuple[Callable[[], list[Artifact]], Callable[[Artifact], object], list[str], str], ...
        ] = (
            (
                view.list_staging,
                view.discard_staging,
                report.discarded,
                "discarded a gone node's staging marker",
            ),
            (
                view.list_multipart_uploads,
                view.abort_multipart,
                report.aborted,
                "aborted a gone node's upload",
            ),
        )
        for list_items, dispose, done, what in stages:
            try:
                items = list_items()
            except StorageError as exc:
                report.errors.append(f"{node}: {exc}")
                break
            for item in items:
                if now - item.last_write < heartbeat_ttl:
                    report.skipped_live += 1
                    continue
                if not lease.renew():
                    report.lost_lease = True
                    return report
                name = upload_item(item.upload_id) if item.upload_id else marker_item(item.path)
                try:
                    if not claim(tier, lease.node, node, name, now, stale_after):
                        report.claimed.append(f"{node}/{item.path}")
                        continue
                except StorageError as exc:
                    report.errors.append(f"{node}/{item.path}: claiming it: {exc}")
                    continue
                try:
                    dispose(item)
                    done.append(f"{node}/{item.path}")
                    # one line per item, written the moment it is gone: who cleaned what survives a
                    # kill of this process before its pass reports (the fleet stress mode counts these)
                    ids = {"upload_id": item.upload_id} if item.upload_id else {}
                    log.info(f"fleet cleanup: {what}", gone=node, path=item.path, **ids, late=not lease.held)
                except StorageError as exc:
                    report.errors.append(f"{node}/{item.path}: {exc}")
                if _expired_during(lease, report, f"{node}/{item.path}"):
                    return report
    return report


def _expired_during(lease: Lease, report: CleanReport, item: str) -> bool:
    """Did our lease run out while we deleted ``item`` (by our clock)? Then stop: another node may
    hold it now, and this process's listing is stale."""
    if lease.held:
        return False
    log.warning(
        "fleet cleanup: the lease expired during a delete (this process was stalled); the item "
        "was claimed, so no other holder cleans it; stopping (what we listed is stale)",
        item=item,
    )
    report.late.append(item)
    report.lost_lease = True
    return True
