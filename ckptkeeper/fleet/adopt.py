"""Adoption of a gone node's copies by the fleet lease holder (docs/design.md, "Many nodes").

A node whose heartbeat is older than ``fleet.orphan_after`` is gone; its copies in a shared tier
would otherwise stay forever. The lease holder, after cleaning the node's litter
(:mod:`ckptkeeper.fleet.cleanup`), applies the shared tier's retention rules to the node's runs
there: one listing of the node's prefix (manifests and pin objects), the planner's decision
(:func:`ckptkeeper.core.adoption.plan_adoption`: pins and the newest good copy of every run kept,
a reason on every action), then the deletes, one by one:

* before each one the lease is renewed (If-Match on the etag the holder wrote itself); a holder
  that lost it stops at once (what it listed is stale);
* before each one the gone node's heartbeat is read again: a node that came back (its heartbeat
  rewritten since it was judged gone: another etag, or a later ``last_pass`` by its own clock)
  owns its copies again, and adoption of it stops;
* before each one the copy is claimed (:mod:`ckptkeeper.fleet.claims`: a conditional create of
  ``<root>/.ckptkeeper/claims/<node>/<path>``): only the claimant deletes it, so a holder stalled
  past its lease mid-delete and the node that took over never both delete one copy;
* each delete is logged the moment it is done (``fleet adoption: deleted a gone node's copy``,
  with ``gone``, ``path``, ``late``), so who deleted what survives a kill of this process (the
  fleet stress mode counts these lines: exactly once per copy).

Cost: a gone node's prefix is not listed every pass. After a complete adoption the holder writes
``<root>/.ckptkeeper/adopted/<node>.json``; the node is looked at again only once that record is
``fleet.orphan_after`` old (time-based rules such as ``keep_within`` expire more as time passes),
so a pass with gone nodes costs one listing of ``adopted/`` and, per gone node, at most one pair
of listings of its prefix per ``orphan_after``. A node with a live copy in progress (a staging
marker younger than ``fleet.heartbeat_ttl``) is not adopted, and no record is written: the next
pass looks again. Litter cleanup follows the same schedule.

Time (docs/design.md, "Cluster reality"): ``now`` everywhere here is the store's clock
(:meth:`~ckptkeeper.storage.s3_fleet.FleetObjects.store_now`), compared only with ``LastModified``
dates the store gave (heartbeats, adoption records, claims, markers). What a heartbeat *says*
(``last_pass``) is the gone node's own clock: it is compared only with that node's own dates — the
adoption's retention rules judge the node's copies at the node's own "now", its last ``last_pass``
plus the time the store has seen go by since. A holder's clock, however wrong, decides nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.adoption import plan_adoption
from ckptkeeper.core.history import ADOPTED
from ckptkeeper.core.model import MANIFEST_SUFFIX, Plan
from ckptkeeper.fleet.claims import claim, sweep
from ckptkeeper.fleet.cleanup import CleanReport, clean_gone_nodes
from ckptkeeper.fleet.history import gone_node_events, write_record
from ckptkeeper.fleet.lease import Lease, Step, decide, read_lease
from ckptkeeper.fleet.nodes import NODES_DIR, NodeBeat, read_beat
from ckptkeeper.storage import S3TierStorage, StorageError
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.fleet.adopt")

__all__ = [
    "ADOPTED_DIR",
    "ADOPTED_EVENT",
    "Adoption",
    "adopt",
    "adoption_notes",
    "came_back",
    "clean_and_adopt",
    "due",
    "gone",
    "gone_beats",
    "owner_now",
    "plan_node",
    "preview",
    "record",
]

ADOPTED_DIR = "adopted"
ADOPTED_EVENT = "fleet adoption: deleted a gone node's copy"


def gone(stored_at: float | None, store_now: float, orphan_after: float) -> bool:
    """Is a node gone: its heartbeat last written (``stored_at``, the store's ``LastModified``)
    more than ``orphan_after`` before the store's ``store_now``? Pure; one clock. A heartbeat whose
    date is unknown is never gone."""
    return stored_at is not None and store_now - stored_at > orphan_after


def owner_now(beat: NodeBeat, store_now: float) -> float:
    """The gone node's own clock now, as well as anyone can tell: what its last heartbeat said
    (``last_pass``, its clock) plus the time the store has seen pass since it wrote it. Its copies'
    ``created_at`` are in that clock too, so its rules judge them as the node itself would."""
    return beat.last_pass + beat.silent_for(store_now)


def gone_beats(tier: S3TierStorage, me: str, now: float, orphan_after: float) -> list[NodeBeat]:
    """Heartbeats of the nodes gone from ``tier``, by name: one listing; only heartbeats the store
    itself dates older than ``orphan_after`` (``now``: the store's clock) are read (a pass costs
    what this node owns, not one GET per node of the fleet), and kept only if the store still
    dates them that old when read."""
    stale = [
        name
        for name, mtime in tier.list_fleet_objects(NODES_DIR)
        if gone(mtime, now, orphan_after) and name.endswith(".json") and "/" not in name
    ]
    beats = [b for b in (read_beat(tier, name) for name in stale) if b is not None]
    return sorted(
        (b for b in beats if b.node != me and gone(b.stored_at, now, orphan_after)), key=lambda b: b.node
    )


def due(tier: S3TierStorage, gone: Sequence[str], now: float, every: float) -> list[str]:
    """The gone nodes to look at this pass: never adopted, or last adopted ``every`` ago or more
    (one listing of ``adopted/``, dated by the store)."""
    done = {
        name.removesuffix(".json"): mtime
        for name, mtime in tier.list_fleet_objects(ADOPTED_DIR)
        if name.endswith(".json") and "/" not in name
    }
    return [n for n in gone if n not in done or now - done[n] >= every]


@dataclass
class Adoption:
    """One gone node's copies in one tier: what the rules decided and what was done."""

    tier: str
    node: str
    silent_for: float
    plan: Plan
    deleted: list[str] = field(default_factory=list)
    """Paths (under the node's prefix) deleted, in order."""
    beat: NodeBeat | None = None
    """The heartbeat the node was judged gone by (a rewritten one means it came back)."""
    errors: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)
    """Deletes that finished after our lease had expired (a stall mid-delete). S3 deletes carry no
    fencing token; the copy's claim is what keeps another holder from deleting it too."""
    stopped: str | None = None
    """Why adoption stopped before the end of the plan (lease lost, the node came back)."""
    lost_lease: bool = False
    claimed: list[str] = field(default_factory=list)
    """Copies another holder had claimed (:mod:`ckptkeeper.fleet.claims`): its to delete, skipped."""
    listed: frozenset[str] = frozenset()
    """The node's copies (paths) in the listing the plan was made from."""
    claims_removed: list[str] = field(default_factory=list)
    """Claims removed after the look (:func:`ckptkeeper.fleet.claims.sweep`): stale, item gone."""

    @property
    def complete(self) -> bool:
        return self.stopped is None and not self.errors and self.plan.refused is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "node": self.node,
            "silent_for": round(self.silent_for, 1),
            "actions": [a.to_dict() for a in self.plan.actions],
            "keep": [k.to_dict() for k in self.plan.keep],
            "refused": self.plan.refused,
            "notes": list(self.plan.notes),
            "deleted": list(self.deleted),
            "errors": list(self.errors),
            "late": list(self.late),
            "claimed_by_another_holder": list(self.claimed),
            "claims_removed": len(self.claims_removed),
            "stopped": self.stopped,
        }


def plan_node(
    tier: S3TierStorage, beat: NodeBeat, now: float, *, max_delete: int, force: bool = False
) -> Adoption:
    """List the gone node's prefix (manifests and pins: one listing) and plan (pure). ``now``: the
    store's clock; the rules judge the copies at the node's own clock (:func:`owner_now`)."""
    copies, pins = tier.adopt(beat.node).list_manifests_and_pins()
    silent = beat.silent_for(now) if beat.stored_at is not None else max(0.0, now - beat.last_pass)
    at = owner_now(beat, now) if beat.stored_at is not None else now
    plan = plan_adoption(beat.node, silent, copies, pins, tier.spec, at, max_delete=max_delete, force=force)
    listed = frozenset(rel.removesuffix(MANIFEST_SUFFIX) for rel, _manifest, _damage in copies)
    return Adoption(tier.name, beat.node, silent, plan, listed=listed, beat=beat)


def came_back(judged: NodeBeat | None, current: NodeBeat | None) -> bool:
    """Was the heartbeat rewritten since the node was judged gone by ``judged``? Another etag, or
    a later ``last_pass`` (the node's clock against itself). Pure; no clock compared across nodes."""
    if current is None or judged is None:
        return False
    if judged.etag and current.etag and current.etag != judged.etag:
        return True
    return current.last_pass > judged.last_pass


def adopt(tier: S3TierStorage, lease: Lease, adoption: Adoption, orphan_after: float, now: float) -> None:
    """Carry out ``adoption``'s deletes under the lease, one by one; stops when the lease is lost
    or the node came back (its heartbeat, read again before each delete, was rewritten since it was
    judged gone: :func:`came_back`). ``now``: the store's clock. Errors are recorded, never raised (the next due pass retries)."""
    if adoption.plan.refused is not None:
        return
    view = tier.adopt(adoption.node)
    for action in adoption.plan.actions:
        path = action.path or ""
        try:
            beat = read_beat(tier, f"{adoption.node}.json")
        except StorageError as exc:
            adoption.errors.append(f"{adoption.node}: reading its heartbeat: {exc}")
            return
        if came_back(adoption.beat, beat):
            adoption.stopped = f"{adoption.node} came back (its heartbeat was written again)"
            return
        if not lease.renew():
            adoption.stopped, adoption.lost_lease = "the fleet lease was lost", True
            return
        started = time.monotonic()
        try:
            if not claim(tier, lease.node, adoption.node, path, now, orphan_after):
                adoption.claimed.append(path)  # another holder deletes it (it claimed it first)
                continue
            freed = view.delete(path, adopt=True)
        except StorageError as exc:
            adoption.errors.append(f"{adoption.node}/{path}: {exc}")
            continue
        adoption.deleted.append(path)
        late = not lease.held
        log.info(
            ADOPTED_EVENT,
            action=ADOPTED,
            gone=adoption.node,
            tier=tier.name,
            path=path,
            run=action.run,
            step=action.step,
            bytes=freed,
            rule=action.rule,
            reason=action.reason,
            node=lease.node,
            duration_s=round(time.monotonic() - started, 3),
            late=late,
        )
        if late:
            log.warning(
                "fleet adoption: the lease expired during a delete (this process was stalled); "
                "the copy was claimed, so no other holder deletes it; stopping (what we listed is stale)",
                item=f"{adoption.node}/{path}",
            )
            adoption.late.append(path)
            adoption.stopped, adoption.lost_lease = "the fleet lease expired during a delete", True
            return


def record(tier: S3TierStorage, adoption: Adoption, now: float) -> None:
    """``adopted/<node>.json``: the node was looked at completely; not again for ``orphan_after``."""
    doc = {
        "node": adoption.node,
        "at": now,
        "silent_for": adoption.silent_for,
        "deleted": len(adoption.deleted),
        "kept": len(adoption.plan.keep),
    }
    tier.put_fleet_object(f"{ADOPTED_DIR}/{adoption.node}.json", json.dumps(doc).encode())


def preview(
    tier: S3TierStorage,
    me: str,
    now: float,
    orphan_after: float,
    heartbeat_ttl: float,
    *,
    max_delete: int,
    force: bool = False,
) -> tuple[list[Adoption], list[str]]:
    """``prune --dry-run``: what this node would adopt in ``tier`` if its pass ran now, and notes.

    Reads only (no lease is taken, no probe written): nothing is planned unless this node holds
    the lease or could take it (none, expired, or its own); a live lease of another node means
    adoption is that node's job. Nodes not due (adopted less than ``orphan_after`` ago) are noted.
    """
    gone = gone_beats(tier, me, now, orphan_after)
    if not gone:
        return [], []
    current, etag = read_lease(tier)
    if decide(current, etag is not None, me, now) is Step.WAIT and current is not None:
        names = ", ".join(b.node for b in gone)
        return [], [f"{tier.name}: {names} gone: the lease holder {current.node} adopts their copies"]
    todo = set(due(tier, [b.node for b in gone], now, orphan_after))
    notes = [
        f"{tier.name}: {b.node} gone, adopted less than {orphan_after:.0f}s ago: not looked at this pass"
        for b in gone
        if b.node not in todo
    ]
    out: list[Adoption] = []
    for b in gone:
        if b.node not in todo:
            continue
        if any(now - a.last_write < heartbeat_ttl for a in tier.adopt(b.node).list_staging()):  # store times
            notes.append(f"{tier.name}: {b.node} gone, but a copy of it is in progress: not adopted")
            continue
        out.append(plan_node(tier, b, now, max_delete=max_delete, force=force))
    return out, notes


def clean_and_adopt(
    settings: Settings,
    tier: S3TierStorage,
    lease: Lease,
    gone: Sequence[NodeBeat],
    t: float,
    adopted: list[Adoption],
    *,
    force: bool = False,
) -> list[str]:
    """The lease holder's part: for each gone node due a look, its litter, then its copies; stops
    when the lease is lost. A node with a live copy in progress is not adopted (not gone after
    all); a refused or unfinished adoption writes no record, so the next pass looks again."""
    notes: list[str] = []
    todo = set(due(tier, [b.node for b in gone], t, settings.fleet.orphan_after))  # under the lease now
    for beat in gone:
        if beat.node not in todo:
            continue
        report = clean_gone_nodes(
            tier, lease, [beat.node], t, settings.fleet.heartbeat_ttl, stale_after=settings.fleet.orphan_after
        )
        for item in report.discarded:
            notes.append(f"{tier.name}: lease holder discarded {item} (node gone)")
        for item in report.aborted:
            notes.append(f"{tier.name}: lease holder aborted upload {item} (node gone)")
        notes += [f"{tier.name}: fleet cleanup: {e}" for e in report.errors]
        notes += [
            f"{tier.name}: fleet cleanup: {i} claimed by another holder: skipped" for i in report.claimed
        ]
        notes += [
            f"{tier.name}: fleet cleanup: the lease expired during the delete of {item} "
            "(this process was stalled); it was claimed: no other holder cleans it"
            for item in report.late
        ]
        if report.lost_lease:
            break
        if report.skipped_live or report.errors:
            continue  # a copy in progress: not gone after all; or the store failed: next pass
        try:
            adoption = plan_node(tier, beat, t, max_delete=settings.max_delete, force=force)
        except StorageError as exc:
            notes.append(f"{tier.name}: adoption of {beat.node}: {exc}")
            continue
        adopt(tier, lease, adoption, settings.fleet.orphan_after, t)
        adopted.append(adoption)
        notes += adoption_notes(adoption)
        notes += _leave_record(settings, tier, lease.node, beat, report, adoption, t)
        if adoption.lost_lease:
            break
        if adoption.complete:
            record(tier, adoption, t)
            notes += _sweep_claims(tier, lease, adoption, t, settings.fleet.orphan_after)
    return notes


def _leave_record(
    settings: Settings,
    tier: S3TierStorage,
    holder: str,
    beat: NodeBeat,
    report: CleanReport,
    adoption: Adoption,
    t: float,
) -> list[str]:
    """The record of what this holder did to ``beat.node``'s copies, for that node's ``history``
    and ``why`` (:mod:`ckptkeeper.fleet.history`); a note if it could not be written."""
    done = set(adoption.deleted)
    events = gone_node_events(
        holder,
        tier.name,
        beat.node,
        t - beat.last_pass,
        t,
        discarded=report.discarded,
        aborted=report.aborted,
        deleted=[a for a in adoption.plan.actions if (a.path or "") in done],
    )
    try:
        write_record(tier, holder, beat.node, events, t, settings.history.keep)
    except StorageError as exc:
        log.warning("cannot write the fleet history record", gone=beat.node, tier=tier.name, error=str(exc))
        return [f"{tier.name}: history record of {beat.node} not written: {exc}"]
    return []


def _sweep_claims(
    tier: S3TierStorage, lease: Lease, adoption: Adoption, t: float, stale_after: float
) -> list[str]:
    """After a complete look at a gone node (litter cleaned, adoption done): remove its claims that
    are stale and whose item is gone (:func:`ckptkeeper.fleet.claims.sweep`); notes."""
    if not lease.held:
        return []  # stalled past the lease: what we listed is stale; the next holder sweeps
    left = adoption.listed - set(adoption.deleted)
    try:
        adoption.claims_removed = sweep(tier, adoption.node, left, t, stale_after)
    except StorageError as exc:
        return [f"{tier.name}: claims of {adoption.node} not swept: {exc}"]
    if adoption.claims_removed:
        log.info(
            "fleet claims swept", gone=adoption.node, tier=tier.name, removed=len(adoption.claims_removed)
        )
    return []


def adoption_notes(adoption: Adoption) -> list[str]:
    """The ``prune`` notes of one adoption (its deletes, and why it stopped or was refused)."""
    where = f"{adoption.tier}: adoption of {adoption.node}"
    notes = [f"{where}: deleted {path}" for path in adoption.deleted]
    if adoption.plan.refused:
        notes.append(f"{where} refused: {adoption.plan.refused}")
    if adoption.stopped:
        notes.append(f"{where} stopped: {adoption.stopped}")
    notes += [f"{where}: {e}" for e in adoption.errors]
    notes += [f"{where}: {path} claimed by another holder: skipped" for path in adoption.claimed]
    notes += [
        f"{where}: the lease expired during the delete of {path} (this process was stalled); "
        "it was claimed: no other holder deletes it"
        for path in adoption.late
    ]
    return notes
