"""``fleet`` and the fleet's part of every prune pass (docs/design.md, "Many nodes"), for tiers with ``shared = true``.

Before a pass acts (:func:`before_pass`): the name-clash check (another keeper wrote this node's
heartbeat within ``fleet.orphan_after``, by the store's clock: :class:`NodeClash`, exit 2 naming
``node``), then this node's heartbeat object, so a node back from a long silence is not gone to a
lease holder adopting its copies while this pass runs (one GET and one PUT).

Every cross-node judgement here is made by the store's clock (docs/design.md, "Cluster reality"):
``now`` is :meth:`~ckptkeeper.storage.s3_fleet.FleetObjects.store_now`, compared with the
``LastModified`` of heartbeats, claims, markers and adoption records; never ``time.time()``.

After a pass (:func:`after_pass`): the heartbeat again; then, if the store enforces
conditional writes (probed once per process: create twice, the second must get 412), the lease;
the holder cleans the litter of nodes gone for ``fleet.orphan_after`` and releases the lease.
Without conditional writes there is no lease and no fleet-wide delete, with one warning.
"""

from __future__ import annotations

import time
from typing import Any

from ckptkeeper.actions.versions import sync_records
from ckptkeeper.config import Settings
from ckptkeeper.core.preflight import check_clock_skew
from ckptkeeper.fleet.adopt import Adoption, clean_and_adopt, due, gone_beats, preview
from ckptkeeper.fleet.lease import Lease, probe_conditional_writes, read_lease
from ckptkeeper.fleet.nodes import (
    NodeClash,
    fleet_view,
    keeper_id,
    name_clash,
    read_beat,
    read_beats,
    write_beat,
)
from ckptkeeper.fleet.view import shared_tiers
from ckptkeeper.index import Index
from ckptkeeper.storage import S3TierStorage, StorageError, TierStorage
from ckptkeeper.storage.s3_fleet import FLEET_DIR, ConditionalWritesUnsupported
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.fleet")

_CONDITIONAL: dict[str, bool] = {}
"""Store (bucket URL) -> whether it enforces conditional writes; probed once per process."""

NO_CONDITIONAL_WRITES = (
    "the store does not enforce conditional writes (a second If-None-Match: * create was not refused): "
    "no fleet lease, so no fleet-wide deletes (other nodes' litter stays); each node still prunes its own copies"
)


def _tiers(settings: Settings) -> list[S3TierStorage]:
    return shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers[1:]])


_LEASES: dict[tuple[str, str], Lease] = {}
"""(store, node) -> this process's lease handle, kept across passes: after its own release the
next acquire is one conditional PUT instead of a read and a PUT (:meth:`Lease.acquire`)."""


def _lease(tier: S3TierStorage, settings: Settings) -> Lease:
    key = (f"{tier.bucket}/{tier.root_prefix}", settings.node)
    lease = _LEASES.get(key)
    if lease is None:
        lease = _LEASES[key] = Lease(tier, settings.node, settings.fleet.lease_ttl)
    lease.tier, lease.ttl = tier, settings.fleet.lease_ttl  # a reload may change the TTL or the client
    return lease


def conditional_writes(tier: S3TierStorage, node: str) -> bool:
    key = f"{tier.bucket}/{tier.root_prefix}"
    if key not in _CONDITIONAL:
        _CONDITIONAL[key] = probe_conditional_writes(tier, node)
        if not _CONDITIONAL[key]:
            log.warning(NO_CONDITIONAL_WRITES, tier=tier.name)
    return _CONDITIONAL[key]


def _keeper(settings: Settings) -> str:
    return keeper_id(settings.index)


def check_names(settings: Settings) -> None:
    """Raise :class:`NodeClash` when another keeper (another machine, or another index) wrote this
    node's heartbeat in a shared bucket within ``fleet.orphan_after`` by the store's clock: two
    keepers with one ``node`` name would each take the other's copies for its own and delete them.
    A store that cannot be read is only warned about (the pass's own steps fail on it anyway)."""
    me = _keeper(settings)
    for tier in _tiers(settings):
        try:
            beat = read_beat(tier, f"{settings.node}.json")
            if beat is None:
                continue
            clash = name_clash(beat, me, tier.name, tier.store_now(), settings.fleet.orphan_after)
        except StorageError as exc:
            log.warning("cannot read this node's heartbeat", tier=tier.name, error=str(exc))
            continue
        if clash is not None:
            log.error(clash, tier=tier.name)
            raise NodeClash(clash)


def before_pass(settings: Settings, index: Index, *, now: float | None = None) -> list[str]:
    """Write (refresh) this node's heartbeat in every shared tier before the pass does anything.

    A node silent for ``orphan_after`` is gone, and the lease holder adopts its copies, reading
    its heartbeat again before each delete. Written only at the end of a pass, the heartbeat of a
    node back after a long silence stays old for its whole first pass: its copies could be adopted
    under it. Written here too, the holder's next read sees the node back and stops. The name clash
    is checked first, on the heartbeat as the last pass left it (raises :class:`NodeClash`).
    Returns notes; never raises for a store problem (the pass goes on)."""
    check_names(settings)
    notes: list[str] = []
    for tier in _tiers(settings):
        try:
            runs, ckpts, newest = index.tier_holdings(tier.name, settings.node)
            write_beat(
                tier,
                settings.node,
                runs_held=runs,
                checkpoints_held=ckpts,
                newest_verified=newest,
                now=now,
                keeper=_keeper(settings),
            )
        except StorageError as exc:
            log.warning("cannot write this node's heartbeat before the pass", tier=tier.name, error=str(exc))
            notes.append(f"{tier.name}: cannot write this node's heartbeat before the pass: {exc}")
    return notes


def after_pass(
    settings: Settings,
    index: Index,
    *,
    now: float | None = None,
    adopted: list[Adoption] | None = None,
    force: bool = False,
) -> list[str]:
    """Heartbeat, lease, fleet cleanup and adoption for every shared tier; returns notes (never
    raises for a store problem: the node's own pass is done and stays done). What the lease holder
    adopted is appended to ``adopted``, when given; ``force`` lifts ``max_delete`` for it too.
    ``now``: the store's clock (tests); else read from the store."""
    adopted = [] if adopted is None else adopted
    notes: list[str] = []
    for tier in _tiers(settings):
        try:
            runs, ckpts, newest = index.tier_holdings(tier.name, settings.node)
            # the name clash was checked by before_pass, on the heartbeat the last pass left
            write_beat(
                tier,
                settings.node,
                runs_held=runs,
                checkpoints_held=ckpts,
                newest_verified=newest,
                keeper=_keeper(settings),
            )
            t = tier.store_now() if now is None else now
            notes += sync_records(settings, index, [tier])  # parts of versions spanning nodes
            if not conditional_writes(tier, settings.node):
                notes.append(f"{tier.name}: {NO_CONDITIONAL_WRITES}")
                continue
            gone = gone_beats(tier, settings.node, t, settings.fleet.orphan_after)
            if not due(tier, [b.node for b in gone], t, settings.fleet.orphan_after):
                continue  # nobody gone, or every gone node was looked at less than orphan_after ago
            lease = _lease(tier, settings)
            if not lease.acquire():
                continue  # another node holds it: cleaning and adoption are its job
            try:
                notes += clean_and_adopt(
                    settings, tier, lease, gone, t, adopted, force=force
                )  # due checked again
            finally:
                lease.release()
        except ConditionalWritesUnsupported as exc:  # it stopped honouring them since the probe
            _CONDITIONAL[f"{tier.bucket}/{tier.root_prefix}"] = False
            log.warning(NO_CONDITIONAL_WRITES, tier=tier.name, error=str(exc))
            notes.append(f"{tier.name}: {NO_CONDITIONAL_WRITES}")
        except StorageError as exc:
            log.warning(
                "fleet step failed; the node's own pass is unaffected", tier=tier.name, error=str(exc)
            )
            notes.append(f"{tier.name}: fleet step failed: {exc}")
    return notes


def preview_adoption(
    settings: Settings, *, now: float | None = None, force: bool = False
) -> tuple[list[Adoption], list[str]]:
    """``prune --dry-run``: what this node, as lease holder, would adopt now (reads only). A node
    name clash is a config error here too (:class:`NodeClash`)."""
    check_names(settings)
    out: list[Adoption] = []
    notes: list[str] = []
    for tier in _tiers(settings):
        try:
            t = tier.store_now() if now is None else now
            got, said = preview(
                tier,
                settings.node,
                t,
                settings.fleet.orphan_after,
                settings.fleet.heartbeat_ttl,
                max_delete=settings.max_delete,
                force=force,
            )
        except StorageError as exc:
            notes.append(f"{tier.name}: fleet adoption not planned: {exc}")
            continue
        out += got
        notes += said
    return out, notes


def clock_skew_warnings(settings: Settings) -> tuple[str, ...]:
    """``status``: this node's clock against each shared bucket's (as ``preflight`` measures it,
    same thresholds). Cross-node judgements never use this node's clock, but its own rules
    (``keep_within``, the reaper's ages) do. Cheap: one small request per shared bucket at most."""
    out: list[str] = []
    for tier in _tiers(settings):
        try:
            skew = tier.store_now() - time.time()
        except StorageError:
            continue  # the tier's own status says why
        check = check_clock_skew(tier.name, skew)
        if check.status != "pass":
            out.append(f"{tier.name}: {check.detail} (fleet decisions use the store's clock)")
    return tuple(out)


def fleet_status(settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """The ``fleet --json`` document: per shared tier, every node seen and the lease (ages by the
    store's clock)."""
    out: dict[str, Any] = {"node": settings.node, "tiers": []}
    for tier in _tiers(settings):
        beats, bad = read_beats(tier)
        lease, _etag = read_lease(tier)
        t = tier.store_now() if now is None else now
        dirs = [d for d in tier.top_level_dirs() if d != FLEET_DIR]
        known = {b.node for b in beats}
        view = fleet_view(beats, [], lease, t, settings.fleet.orphan_after)
        view["tier"] = tier.name
        view["unreadable_heartbeats"] = bad
        view["prefixes_without_heartbeat"] = [d for d in dirs if d not in known]
        out["tiers"].append(view)
    return out
