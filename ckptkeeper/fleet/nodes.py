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
from dataclasses import asdict, dataclass
from typing import Any

from ckptkeeper import __version__
from ckptkeeper.fleet.lease import FleetStore, LeaseInfo
from ckptkeeper.util.host import machine_name

__all__ = ["NODES_DIR", "NodeBeat", "fleet_view", "read_beat", "read_beats", "write_beat"]

NODES_DIR = "nodes"
_MAX_BEAT_BYTES = 1 << 20


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
    """``host:index`` of the keeper that wrote it (shared filesystem tiers): two keepers with one
    ``node`` name on one shared tier, even on one machine, is a config error (docs/design.md, "Many nodes")."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

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


def name_clash(previous: NodeBeat | None, host: str, now: float, orphan_after: float) -> str | None:
    """Another machine wrote this node's heartbeat recently: two machines use one ``node`` name
    (docs/design.md, "Many nodes": a config error; their copies would share keys). The message, or None (pure)."""
    if previous is None or not previous.host or previous.host == host:
        return None
    if now - previous.last_pass > orphan_after:
        return None  # the node moved to this machine long ago
    return (
        f"node name {previous.node!r} is also used by host {previous.host!r} (heartbeat "
        f"{max(0.0, now - previous.last_pass):.0f}s ago): give every machine its own `node`"
    )


def read_beat(tier: FleetStore, name: str) -> NodeBeat | None:
    """The heartbeat object ``nodes/<name>`` (None: gone, unreadable, or naming another node)."""
    got = tier.get_fleet_object(f"{NODES_DIR}/{name}")
    beat = NodeBeat.parse(got[0]) if got is not None else None
    return beat if beat is not None and f"{beat.node}.json" == name else None


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
    ``orphan_after``); and the lease holder with its expiry."""
    by_node = {b.node: b for b in beats}
    nodes = []
    for name in sorted(set(by_node) | set(prefixes)):
        b = by_node.get(name)
        nodes.append(
            {
                "node": name,
                "last_pass": None if b is None else b.last_pass,
                "last_pass_age": None if b is None else max(0.0, now - b.last_pass),
                "rpo_seconds": None
                if b is None or b.newest_verified is None
                else max(0.0, now - b.newest_verified),
                "runs_held": None if b is None else b.runs_held,
                "checkpoints_held": None if b is None else b.checkpoints_held,
                "version": None if b is None else b.version,
                "gone": None if b is None else now - b.last_pass > orphan_after,
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
