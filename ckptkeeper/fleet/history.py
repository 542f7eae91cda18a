"""Cross-node delete records (docs/design.md, "Many nodes"): what the fleet lease holder deleted of a gone node.

The node that owned the copies has no other way to learn who deleted them and why: its index never
saw those deletes. After each gone node it cleaned and adopted, the lease holder writes one small
record ``<root>/.ckptkeeper/history/<owner>/<ms>-<holder>.json`` with the events
(:class:`~ckptkeeper.core.history.HistoryEvent`: ``adopted-delete`` and ``fleet-cleanup``, each
with its rule and reason). ``history`` and ``why`` on any node read the records of one owner (one
listing, then one GET per record). Bounded: at most :data:`MAX_EVENTS` events per record and
:data:`MAX_RECORDS` records per owner; records older than ``history.keep`` (dated by the store)
are deleted by the next holder that writes one for that owner.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from ckptkeeper.core.history import ADOPTED, CLEANUP, HistoryEvent
from ckptkeeper.core.model import Action
from ckptkeeper.storage import S3TierStorage, StorageError
from ckptkeeper.util.fmt import format_duration
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.fleet.history")

__all__ = ["HISTORY_DIR", "MAX_EVENTS", "MAX_RECORDS", "gone_node_events", "read_records", "write_record"]

HISTORY_DIR = "history"
MAX_EVENTS = 1000
"""Events per record; a bigger adoption keeps the first ones and says how many were left out."""
MAX_RECORDS = 200
"""Records kept per owner node (the newest); older ones go with the next record written."""
_MAX_RECORD_BYTES = 4 << 20


def gone_node_events(
    holder: str,
    tier: str,
    owner: str,
    silent_for: float,
    now: float,
    *,
    discarded: Sequence[str] = (),
    aborted: Sequence[str] = (),
    deleted: Sequence[Action] = (),
) -> list[HistoryEvent]:
    """The events of one gone node's cleanup (``discarded`` staging markers and ``aborted``
    uploads, as ``<owner>/<path>``) and adoption (the plan's ``deleted`` actions) by ``holder``."""
    gone = f"{owner} gone (silent {format_duration(round(silent_for))})"
    out: list[HistoryEvent] = []
    for items, rule, what in (
        (discarded, "gone-node-staging", "its abandoned copy in progress discarded"),
        (aborted, "gone-node-upload", "its abandoned multipart upload aborted"),
    ):
        for item in items:
            path = item.removeprefix(f"{owner}/")
            out.append(
                HistoryEvent(
                    now,
                    CLEANUP,
                    path.split("/", 1)[0],
                    None,
                    tier,
                    path=path,
                    rule=rule,
                    reason=f"{gone}: {what}",
                    node=holder,
                    owner=owner,
                )
            )
    for action in deleted:
        out.append(replace(HistoryEvent.of(action, now, node=holder), action=ADOPTED, owner=owner))
    return out


def write_record(
    tier: S3TierStorage,
    holder: str,
    owner: str,
    events: Sequence[HistoryEvent],
    now: float,
    keep: float,
) -> str | None:
    """Write one record of ``events`` (``holder`` acted on ``owner``'s copies); then expire the
    owner's records older than ``keep`` or beyond :data:`MAX_RECORDS`. Returns the record's name,
    None when there was nothing to record. Raises StorageError (the caller notes it)."""
    if not events:
        return None
    doc = {
        "version": 1,
        "by": holder,
        "owner": owner,
        "at": now,
        "events": [e.to_dict() for e in events[:MAX_EVENTS]],
        "left_out": max(0, len(events) - MAX_EVENTS),
    }
    name = f"{HISTORY_DIR}/{owner}/{int(now * 1000):016d}-{holder}.json"
    tier.put_fleet_object(name, json.dumps(doc, sort_keys=True).encode())
    _expire(tier, owner, keep)
    return name


def _expire(tier: S3TierStorage, owner: str, keep: float) -> None:
    listed = tier.list_fleet_objects(f"{HISTORY_DIR}/{owner}")
    newest = max((mtime for _, mtime in listed), default=0.0)  # the store's clock, not ours
    ordered = sorted(listed, key=lambda t: (t[1], t[0]), reverse=True)
    for i, (name, mtime) in enumerate(ordered):
        if i >= MAX_RECORDS or newest - mtime > keep:
            tier.delete_fleet_object(f"{HISTORY_DIR}/{owner}/{name}")


def read_records(tier: S3TierStorage, owner: str) -> list[HistoryEvent]:
    """Every event the lease holders recorded about ``owner``'s copies in ``tier``, oldest first.
    Records are untrusted: one that does not parse is skipped (and logged), never fatal."""
    events: list[HistoryEvent] = []
    listed = tier.list_fleet_objects(f"{HISTORY_DIR}/{owner}")
    for name, _mtime in sorted(listed)[-MAX_RECORDS:]:
        if "/" in name or not name.endswith(".json"):
            continue
        got = tier.get_fleet_object(f"{HISTORY_DIR}/{owner}/{name}")
        if got is None:
            continue  # expired since the listing
        body = got[0]
        try:
            if len(body) > _MAX_RECORD_BYTES:
                raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
            doc = json.loads(body)
            raw = doc.get("events") if isinstance(doc, dict) else None
            if not isinstance(raw, list):
                raise ValueError("no events")
            by = str(doc.get("by") or "")[:256]
            for item in raw[:MAX_EVENTS]:
                event = HistoryEvent.from_dict(item, source="fleet")
                if by and event.node != by:
                    raise ValueError(f"an event names node {event.node!r}, the record {by!r}")
                events.append(event)
        except (ValueError, TypeError, RecursionError) as exc:
            log.warning("fleet history record skipped: unreadable", record=name, owner=owner, error=str(exc))
    events.sort(key=lambda e: e.at)
    return events


def safe_read_records(tier: S3TierStorage, owner: str) -> tuple[list[HistoryEvent], str | None]:
    """:func:`read_records`, with a store failure returned as a note instead of raised."""
    try:
        return read_records(tier, owner), None
    except StorageError as exc:
        return [], f"fleet records of {owner} not read: {exc}"
