"""Per-item claims: exactly one fleet lease holder deletes each gone node's item (DESIGN §10).

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
of ``lease_ttl`` without claims). Claims stay in the bucket (one small object per item deleted):
the next claim of the same item (a node that came back, wrote that path again and went silent
again) is older than ``stale_after`` by then and taken over.
"""

from __future__ import annotations

import hashlib
import json
import os

from ckptkeeper.storage import S3TierStorage

__all__ = ["CLAIMS_DIR", "claim", "marker_item", "upload_item"]

CLAIMS_DIR = "claims"


def upload_item(upload_id: str) -> str:
    """The claim item of a multipart upload (upload ids may hold any character)."""
    return "uploads/" + hashlib.sha256(upload_id.encode()).hexdigest()[:40]


def marker_item(path: str) -> str:
    """The claim item of a staging marker (its name, kept out of the claim's key: nothing that
    looks for staging markers by name must ever take a claim for one)."""
    return "markers/" + hashlib.sha256(path.encode()).hexdigest()[:40]


def claim(tier: S3TierStorage, me: str, node: str, item: str, now: float, stale_after: float) -> bool:
    """Claim ``item`` of gone ``node`` for this holder: True if this process may delete it now (it
    created the claim, or took over a stale one); False if another holder claimed it."""
    name = f"{CLAIMS_DIR}/{node}/{item}"
    body = json.dumps({"holder": me, "pid": os.getpid(), "at": now, "item": item}).encode()
    if tier.put_fleet_object(name, body, if_none_match=True) is not None:
        return True
    got = tier.get_fleet_object(name)
    if got is None:  # released in between: try once more, conditionally
        return tier.put_fleet_object(name, body, if_none_match=True) is not None
    old, etag = got
    try:
        at = float(json.loads(old)["at"])
    except (ValueError, TypeError, KeyError, RecursionError):
        at = float("-inf")  # unreadable: nobody can prove they hold it
    if now - at <= stale_after:
        return False
    return tier.put_fleet_object(name, body, if_match=etag) is not None
