"""Per-item claims: exactly one fleet lease holder deletes each gone node's item (docs/design.md, "Many nodes").

The lease says who may delete; it cannot fence the delete itself (S3 deletes carry no token): a
holder stalled between its last renewal and its delete finishes that delete after another node
took the lease over — and that node, listing before the late delete landed, deletes the same
item too. A claim closes that window: right before deleting an item (an adopted copy, a staging
marker, an upload) the holder creates ``<root>/.ckptkeeper/claims/<node>/<item>`` with
``If-None-Match: *``. Only the creator deletes the item; a holder whose create gets 412 skips it.
Which holder stalled where no longer matters: the item is deleted by whoever claimed it, once.

A claimant that died between its claim and its delete would block the item forever, so a claim
older than ``stale_after`` (``fleet.orphan_after``) may be taken over, with ``If-Match`` on the
claim's etag (one taker wins). What is left: a claimant stalled for longer than ``stale_after``
*between its claim and its delete* deletes after the taker did (days by default, against minutes
of ``lease_ttl`` without claims).

Claims are removed by the lease holder (:func:`sweep`), once a claim is older than ``stale_after``
*and* its item is gone: then nobody can delete the item any more (the claimant did, or the item
went otherwise), and the claim guards nothing. A claim older than ``stale_after`` could be taken
over anyway, so removing it gives no holder a right it did not already have. Cost: one listing of
``claims/<node>/`` per complete look at a gone node (once per ``orphan_after``), and at most
``SWEEP_LIMIT`` deletes; the rest wait for the next look.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Set

from ckptkeeper.storage import S3TierStorage

__all__ = [
    "CLAIMS_DIR",
    "SWEEP_LIMIT",
    "claim",
    "marker_item",
    "stale_claims_of_gone_items",
    "sweep",
    "upload_item",
]

CLAIMS_DIR = "claims"
SWEEP_LIMIT = 200
"""Claims removed per gone node per look, at most (bounded work per pass)."""

_LITTER = ("markers/", "uploads/")


def upload_item(upload_id: str) -> str:
    """The claim item of a multipart upload (upload ids may hold any character)."""
    return "uploads/" + hashlib.sha256(upload_id.encode()).hexdigest()[:40]


def marker_item(path: str) -> str:
    """The claim item of a staging marker (its name, kept out of the claim's key: nothing that
    looks for staging markers by name must ever take a claim for one)."""
    return "markers/" + hashlib.sha256(path.encode()).hexdigest()[:40]


def claim(tier: S3TierStorage, me: str, node: str, item: str, now: float, stale_after: float) -> bool:
    """Claim ``item`` of gone ``node`` for this holder: True if this process may delete it now (it
    created the claim, or took over a stale one); False if another holder claimed it. Stale is
    judged by the store's clock (``now``) against when the store wrote the claim, never by the
    time a claimant wrote in it (its clock may be days off)."""
    name = f"{CLAIMS_DIR}/{node}/{item}"
    body = json.dumps({"holder": me, "pid": os.getpid(), "at": now, "item": item}).encode()
    if tier.put_fleet_object(name, body, if_none_match=True) is not None:
        return True
    got = tier.get_fleet_object_dated(name)
    if got is None:  # released in between: try once more, conditionally
        return tier.put_fleet_object(name, body, if_none_match=True) is not None
    _old, etag, written = got
    if now - written <= stale_after:
        return False
    return tier.put_fleet_object(name, body, if_match=etag) is not None


def stale_claims_of_gone_items(
    listed: list[tuple[str, float]], copies_left: Set[str], now: float, stale_after: float, limit: int
) -> list[str]:
    """The claims (item names) to remove, from one listing of a gone node's claims (pure).

    Only claims older than ``stale_after`` (store time) whose item is gone: for a copy, its path is
    not in ``copies_left`` (the node's copies as the holder's complete look left them); for a
    marker or an upload, always — the caller sweeps only after a complete cleanup of the node's
    litter, which listed every marker and upload of it: one still there had its claim taken over
    (fresh now) or is claimed fresh by another holder. At most ``limit``, oldest first."""
    out = [
        (mtime, name)
        for name, mtime in listed
        if now - mtime > stale_after and (name.startswith(_LITTER) or name not in copies_left)
    ]
    return [name for _mtime, name in sorted(out)[:limit]]


def sweep(
    tier: S3TierStorage,
    node: str,
    copies_left: Set[str],
    now: float,
    stale_after: float,
    *,
    limit: int = SWEEP_LIMIT,
) -> list[str]:
    """Remove ``node``'s claims whose item is gone and which are older than ``stale_after`` (one
    listing, at most ``limit`` deletes); returns the items whose claims were removed. Called by the
    lease holder right after a complete look at the gone ``node`` (its litter cleaned, its copies
    adopted with no error): ``copies_left`` is what that look left of its copies."""
    listed = tier.list_fleet_objects(f"{CLAIMS_DIR}/{node}")
    gone = stale_claims_of_gone_items(listed, copies_left, now, stale_after, limit)
    for item in gone:
        tier.delete_fleet_object(f"{CLAIMS_DIR}/{node}/{item}")
    return gone
