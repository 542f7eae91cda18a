"""The fleet lease (docs/design.md, "Many nodes"): one object, ``<root>/.ckptkeeper/lease``, written only with
conditional PUTs, so at most one node holds it at any time without a server of ours.

* created with ``If-None-Match: *`` (the second of two racing creators gets 412);
* renewed, taken over when expired, and released with ``If-Match: <etag>`` of the version read
  (a node that lost a race gets 412 and does not hold it);
* its body says who holds it (node, pid), for how long (``ttl``) and until when (``expires``).

Time is the store's (docs/design.md, "Cluster reality"): a reader judges a lease by when the
store wrote it (its ``LastModified``) plus its ``ttl``, against the store's clock now
(:meth:`store_now`), never by the holder's clock. A holder whose clock runs 2 h ahead and dies
blocks the others for one ``ttl``, not for 2 h; one whose clock runs behind is not taken over early.

The holder alone does fleet-wide deletes (other nodes' abandoned staging markers and uploads),
re-checking the lease right before each batch. A store that does not enforce conditional writes
(:func:`probe_conditional_writes`) gets no lease and no fleet-wide deletes, with one warning.

The decision is pure (:func:`decide`); :class:`Lease` is the I/O around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from ckptkeeper.storage import S3TierStorage, StorageError
from ckptkeeper.storage.s3_fleet import ConditionalWritesUnsupported

__all__ = [
    "LEASE",
    "FleetStore",
    "Lease",
    "LeaseInfo",
    "Step",
    "decide",
    "probe_conditional_writes",
    "read_lease",
]

LEASE = "lease"


class FleetStore(Protocol):
    """Where fleet objects live, with conditional writes: a shared bucket
    (:class:`~ckptkeeper.storage.s3_fleet.FleetObjects`) or a shared filesystem
    (:class:`~ckptkeeper.storage.local_fleet.LocalFleetObjects`)."""

    name: str

    def get_fleet_object(self, name: str) -> tuple[bytes, str] | None: ...

    def put_fleet_object(
        self, name: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str | None: ...

    def get_fleet_object_dated(self, name: str) -> tuple[bytes, str, float] | None: ...

    def list_fleet_objects(self, sub: str) -> list[tuple[str, float]]: ...

    def store_now(self) -> float: ...


_PROBE_DIR = "probe"


@dataclass(frozen=True)
class LeaseInfo:
    """What a lease object says (untrusted: a malformed one is treated as expired). ``expires``
    0 is a released lease."""

    node: str
    pid: int
    acquired: float
    expires: float
    ttl: float | None = None

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "node": self.node,
            "pid": self.pid,
            "acquired": self.acquired,
            "expires": self.expires,
        }
        if self.ttl is not None:
            doc["ttl"] = self.ttl
        return json.dumps(doc).encode()

    @classmethod
    def parse(cls, body: bytes) -> LeaseInfo | None:
        try:
            doc: Any = json.loads(body)
            ttl = doc.get("ttl")
            return cls(
                str(doc["node"]),
                int(doc["pid"]),
                float(doc["acquired"]),
                float(doc["expires"]),
                None if ttl is None else float(ttl),
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def by_store(self, written: float) -> LeaseInfo:
        """This lease with ``expires`` in the store's clock: written (``LastModified``) + ``ttl``.
        A released lease stays released; one without a ``ttl`` (an older writer) keeps its own."""
        if self.expires <= 0 or self.ttl is None or not 0 < self.ttl < 1e9:
            return self
        return dataclasses.replace(self, expires=written + self.ttl)


class Step(StrEnum):
    CREATE = "create"
    """No lease object: create it (If-None-Match: *)."""
    RENEW = "renew"
    """We hold it: extend (If-Match)."""
    TAKE_OVER = "take-over"
    """Another node's lease expired (or is unreadable): replace it (If-Match)."""
    WAIT = "wait"
    """Another node holds a live lease."""


def decide(current: LeaseInfo | None, exists: bool, me: str, now: float) -> Step:
    """What to do about the lease, from what it says now (pure)."""
    if not exists:
        return Step.CREATE
    if current is None:
        return Step.TAKE_OVER  # unreadable: nobody can prove they hold it
    if current.node == me:
        return Step.RENEW
    if current.expires <= now:
        return Step.TAKE_OVER
    return Step.WAIT


def read_lease(tier: FleetStore, name: str = LEASE) -> tuple[LeaseInfo | None, str | None]:
    """(what the lease says, its etag); (None, None) when there is none. Its ``expires`` is in the
    store's clock (:meth:`LeaseInfo.by_store`)."""
    got = tier.get_fleet_object_dated(name)
    if got is None:
        return None, None
    body, etag, written = got
    info = LeaseInfo.parse(body)
    return (None if info is None else info.by_store(written)), etag


class Lease:
    """This node's handle on the fleet lease of one shared tier (``name``: the fleet lease, or the
    lease electing the acting keeper of a shared filesystem tier, ``leases/<tier>-<id>``)."""

    def __init__(
        self,
        tier: FleetStore,
        node: str,
        ttl: float,
        *,
        clock: Callable[[], float] | None = None,
        name: str = LEASE,
    ) -> None:
        self.tier = tier
        self.name = name
        self.node = node
        self.ttl = ttl
        self._clock = clock
        self.etag: str | None = None
        self.info: LeaseInfo | None = None
        self.released: str | None = None
        """ETag of the released lease this handle wrote last; while the object still has it, the
        next :meth:`acquire` skips the read (see there)."""

    def clock(self) -> float:
        """The store's clock (:meth:`FleetStore.store_now`), unless a test gave one."""
        return self._clock() if self._clock is not None else self.tier.store_now()

    @property
    def held(self) -> bool:
        """Held, by what we last wrote, with some margin left (a tenth of the TTL)."""
        return self.info is not None and self.info.expires - self.ttl / 10 > self.clock()

    def acquire(self) -> bool:
        """Take or renew the lease; False when another node holds a live one or won a race.

        After our own :meth:`release` (a daemon keeps one handle per tier across passes) the first
        try is one PUT with ``If-Match`` on the etag of that release: it succeeds only if the
        object still holds exactly what we wrote, a lease of this node expired at 0, which
        :func:`decide` would let us renew; the read would have told nothing more. Any other
        outcome (412: someone wrote it since; an error) falls back to read + decide + conditional
        PUT. Acquire + release: 3 requests → 2."""
        if self.released is not None:
            now = self.clock()
            released, self.released = self.released, None
            info = LeaseInfo(self.node, os.getpid(), now, now + self.ttl, self.ttl)
            try:
                new = self.tier.put_fleet_object(self.name, info.to_json(), if_match=released)
            except StorageError:
                new = None  # e.g. the object was deleted: the full path below decides
            if new is not None:
                self.etag, self.info = new, info
                return True
        current, etag = read_lease(self.tier, self.name)
        now = self.clock()  # after the read: its answer set the store's clock (no extra request)
        step = decide(current, etag is not None, self.node, now)
        if step is Step.WAIT:
            self.etag, self.info = None, None
            return False
        acquired = current.acquired if step is Step.RENEW and current is not None else now
        info = LeaseInfo(self.node, os.getpid(), acquired, now + self.ttl, self.ttl)
        if step is Step.CREATE:
            new = self.tier.put_fleet_object(self.name, info.to_json(), if_none_match=True)
        else:
            new = self.tier.put_fleet_object(self.name, info.to_json(), if_match=etag)
        if new is None:  # another node got there first
            self.etag, self.info = None, None
            return False
        self.etag, self.info = new, info
        return True

    def renew(self) -> bool:
        """Extend the lease we hold, only if nobody has written it since we did (If-Match on our
        own etag). False when it is not ours any more: it expired and another node took it over
        (released or not since) — work planned under the old lease is stale and must stop, or two
        holders clean the same litter. :meth:`acquire` would take a released lease back."""
        if self.etag is None or self.info is None:
            return False
        now = self.clock()
        info = LeaseInfo(self.node, os.getpid(), self.info.acquired, now + self.ttl, self.ttl)
        new = self.tier.put_fleet_object(self.name, info.to_json(), if_match=self.etag)
        if new is None:
            self.etag, self.info = None, None
            return False
        self.etag, self.info = new, info
        return True

    def release(self) -> None:
        """Expire our lease now (If-Match: only if it is still ours), so another node need not
        wait out the TTL. Best effort: an unreleased lease simply expires."""
        if self.etag is None or self.info is None:
            return
        gone = LeaseInfo(self.node, os.getpid(), self.info.acquired, 0.0)
        released = None
        with contextlib.suppress(StorageError):
            released = self.tier.put_fleet_object(self.name, gone.to_json(), if_match=self.etag)
        self.etag, self.info, self.released = None, None, released or None


def probe_conditional_writes(tier: S3TierStorage, node: str) -> bool:
    """Does the store enforce ``If-None-Match: *``? Create one probe object twice: the second
    must be refused (412). Without it, two nodes could both "create" the lease. A store answering
    501 (``NotImplemented``) to a conditional PUT does not support them: False, not an error."""
    name = f"{_PROBE_DIR}/{node}-{secrets.token_hex(4)}"
    try:
        first = tier.put_fleet_object(name, b"{}", if_none_match=True)
    except ConditionalWritesUnsupported:
        return False
    try:
        second = tier.put_fleet_object(name, b"{}", if_none_match=True)
    except ConditionalWritesUnsupported:
        return False
    finally:
        with contextlib.suppress(StorageError):
            tier.delete_fleet_object(name)
    return first is not None and second is None
