"""Node heartbeats (docs/design.md, "Many nodes"): ``<root>/.ckptkeeper/nodes/<node>.json`` per node of a shared
tier, rewritten after each pass: last pass, version, runs held, the newest verified copy in the
tier (for the RPO), so ``ckptkeeper fleet`` shows every node without listing every node's copies.

:func:`fleet_view` is pure: heartbeats + lease + ``now`` -> the rows ``ckptkeeper fleet`` prints.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptkeeper import __version__
from ckptkeeper.fleet.lease import FleetStore, LeaseInfo
from ckptkeeper.util.host import machine_name

__all__ = [
    "NODES_DIR",
    "NodeBeat",
    "NodeClash",
    "fleet_view",
    "name_clash",
    "read_beat",
    "read_beats",
    "write_beat",
]

NODES_DIR = "nodes"
_MAX_BEAT_BYTES = 1 << 20


class NodeClash(Exception):
    """Two keepers use one ``node`` name on one shared tier (a config error: exit 2)."""


@dataclass(frozen=True)
class NodeBeat:
    """One node's heartbeat object (untrusted when read: bad fields make it unreadable)."""

    node: str
    last_pass: float
    version: str = ""
    pid: int = 0
    runs_held: int = 0
    checkpoints_held: int = 0
    newest_verified: float | None = None
    """``created_at`` of the newest checkpoint this node holds a verified copy of in the tier."""
    host: str = ""
    """The machine that wrote it: two machines writing one node's heartbeat share a ``node`` name."""
    keeper: str = ""
    """``host:index`` of the keeper that wrote it: two keepers with one ``node`` name on one
    shared tier, even on one machine, is a config error (docs/design.md, "Many nodes")."""
    stored_at: float | None = field(default=None, compare=False)
    """When the store wrote it (its ``LastModified``, the store's clock); not in the body."""
    etag: str = field(default="", compare=False)
    """The object's etag when read; not in the body."""

    def to_json(self) -> bytes:
        doc = asdict(self)
        del doc["stored_at"], doc["etag"]
        return json.dumps(doc, sort_keys=True).encode()

    def silent_for(self, store_now: float) -> float:
        """How long the store has not seen this heartbeat rewritten (its clock only); 0 when the
        beat was not read from a store (then nothing judges it gone)."""
        return 0.0 if self.stored_at is None else max(0.0, store_now - self.stored_at)

    @classmethod
    def parse(cls, body: bytes) -> NodeBeat | None:
        if len(body) > _MAX_BEAT_BYTES:
            return None
        try:
            doc: Any = json.loads(body)
            newest = doc.get("newest_verified")
            return cls(
                node=str(doc["node"]),
                last_pass=float(doc["last_pass"]),
                version=str(doc.get("version") or ""),
                pid=int(doc.get("pid") or 0),
                runs_held=int(doc.get("runs_held") or 0),
                checkpoints_held=int(doc.get("checkpoints_held") or 0),
                newest_verified=None if newest is None else float(newest),
                host=str(doc.get("host") or ""),
                keeper=str(doc.get("keeper") or ""),
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None


def write_beat(
    tier: FleetStore,
    node: str,
    *,
    runs_held: int,
    checkpoints_held: int,
    newest_verified: float | None,
    now: float | None = None,
    keeper: str = "",
) -> NodeBeat:
    beat = NodeBeat(
        node=node,
        last_pass=time.time() if now is None else now,
        version=__version__,
        pid=os.getpid(),
        runs_held=runs_held,
        checkpoints_held=checkpoints_held,
        newest_verified=newest_verified,
        host=machine_name(),
        keeper=keeper,
    )
    tier.put_fleet_object(f"{NODES_DIR}/{node}.json", beat.to_json())
    return beat


def keeper_id(index: str) -> str:
    """Who a keeper is, beyond its ``node`` name: its machine and its index (two keepers on one
    machine with one name but two indexes clash too)."""
    return f"{machine_name()}:{Path(index).expanduser().absolute()}"


def name_clash(
    previous: NodeBeat | None, keeper: str, tier: str, store_now: float, orphan_after: float
) -> str | None:
    """Another keeper (another machine, or another index on this one) wrote this node's heartbeat
    within ``orphan_after`` by the store's clock: two keepers use one ``node`` name, a config error
    (docs/design.md, "Many nodes"): their copies share keys, and each would delete the other's.
    The message, naming ``node``, or None (pure). A heartbeat of an older version names no keeper:
    its host stands for it."""
    if previous is None:
        return None
    theirs = previous.keeper or previous.host
    mine = keeper if previous.keeper else keeper.split(":", 1)[0]
    if not theirs or theirs == mine:
        return None
    if previous.stored_at is None or store_now - previous.stored_at > orphan_after:
        return None  # the name moved here long ago
    return (
        f"node: node name {previous.node!r} is also used by another keeper on shared tier {tier!r} "
        f"({theirs}, heartbeat {max(0.0, store_now - previous.stored_at):.0f}s ago by the store's clock); "
        "give every node its own `node` (if that keeper is gone for good, wait fleet.orphan_after "
        f"or delete {tier}/.ckptkeeper/{NODES_DIR}/{previous.node}.json)"
    )


def read_beat(tier: FleetStore, name: str) -> NodeBeat | None:
    """The heartbeat object ``nodes/<name>`` (None: gone, unreadable, or naming another node),
    with when the store wrote it and its etag."""
    got = tier.get_fleet_object_dated(f"{NODES_DIR}/{name}")
    beat = NodeBeat.parse(got[0]) if got is not None else None
    if got is None or beat is None or f"{beat.node}.json" != name:
        return None
    return replace(beat, stored_at=got[2], etag=got[1])


def read_beats(tier: FleetStore) -> tuple[list[NodeBeat], list[str]]:
    """Every node's heartbeat (one listing + one small GET each) and the names of unreadable ones."""
    beats: list[NodeBeat] = []
    bad: list[str] = []
    for name, _mtime in tier.list_fleet_objects(NODES_DIR):
        if not name.endswith(".json") or "/" in name:
            continue
        beat = read_beat(tier, name)
        if beat is None:
            bad.append(name)
        else:
            beats.append(beat)
    return beats, bad


def fleet_view(
    beats: Sequence[NodeBeat],
    prefixes: Sequence[str],
    lease: LeaseInfo | None,
    now: float,
    orphan_after: float,
) -> dict[str, Any]:
    """The ``fleet --json`` document: every node seen (by heartbeat or by its key prefix), its
    last pass, RPO (age of its newest verified copy), runs held, whether it is gone (silent for
    ``orphan_after``); and the lease holder with its expiry. ``now`` is the store's clock: ages
    are measured from when the store wrote each heartbeat where known (its own clock), else from
    what the heartbeat says."""
    by_node = {b.node: b for b in beats}
    nodes = []
    for name in sorted(set(by_node) | set(prefixes)):
        b = by_node.get(name)
        age = None if b is None else max(0.0, now - (b.last_pass if b.stored_at is None else b.stored_at))
        nodes.append(
            {
                "node": name,
                "last_pass": None if b is None else b.last_pass,
                "last_pass_age": age,
                "rpo_seconds": None
                if b is None or b.newest_verified is None or age is None
                else max(0.0, age + b.last_pass - b.newest_verified),  # its clock minus its clock
                "runs_held": None if b is None else b.runs_held,
                "checkpoints_held": None if b is None else b.checkpoints_held,
                "version": None if b is None else b.version,
                "gone": None if age is None else age > orphan_after,
            }
        )
    holder = None
    if lease is not None:
        holder = {
            "node": lease.node,
            "pid": lease.pid,
            "expires": lease.expires,
            "expires_in": lease.expires - now,
            "live": lease.expires > now,
        }
    return {"nodes": nodes, "lease": holder}
