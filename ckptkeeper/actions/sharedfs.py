"""The shell around :mod:`ckptkeeper.fleet.sharedfs`: a local tier with ``shared = true`` (one
Lustre/NFS/Weka filesystem several nodes mount), where only the holder of the tier's lease acts.

Each ``prune`` pass (the daemon's too), for each shared local tier:

1. at start, this node's heartbeat there must not be another keeper's (:class:`NodeClash`, exit 2
   naming ``node``);
2. a real pass takes or renews the lease (a dry run only reads it); if another node holds a live
   one, every action on that tier is dropped from the plan with the note
   ``hot is shared: node-b holds the lease (expires in 42s); this node only catalogs`` — the pass
   still succeeds (exit 0): the tier is being looked after, by that node;
3. the holder renews the lease (``If-Match`` on the version it wrote) before each action on the
   tier; one that lost it stops there (another node took over after it stalled past the TTL);
4. after the pass, the heartbeat ``<root>/.ckptkeeper/nodes/<node>.json``.

The holder keeps the lease between passes (renewing it each pass), so one keeper acts for as long as
it lives, and another takes over ``fleet.lease_ttl`` after it stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.model import Action, Plan
from ckptkeeper.fleet.lease import FleetStore, Lease, LeaseInfo, read_lease
from ckptkeeper.fleet.nodes import (
    NodeClash,
    fleet_view,
    keeper_id,
    name_clash,
    read_beat,
    read_beats,
    write_beat,
)
from ckptkeeper.fleet.sharedfs import catalog_only_note, lease_name, touches, without_tiers
from ckptkeeper.fleet.view import shared_tiers
from ckptkeeper.index import Index
from ckptkeeper.storage import S3TierStorage, StorageError, TierStorage
from ckptkeeper.storage.local_fleet import LocalFleetObjects
from ckptkeeper.storage.s3_fleet import ConditionalWritesUnsupported
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.sharedfs")

__all__ = ["NodeClash", "SharedFs", "check_node_name", "open_shared", "shared_fs_status", "take_shared"]


@dataclass
class _Tier:
    name: str
    fs: LocalFleetObjects
    """Heartbeats (and the lease, when no shared bucket holds it)."""
    store: FleetStore
    lease_name: str
    where: str
    """Where the lease lives, for messages: ``bucket <tier>`` or ``file <path>``."""
    lease: Lease | None = None
    acting: bool = False
    note: str | None = None
    """Why this node does not act on the tier this pass."""


def _keeper(settings: Settings) -> str:
    return keeper_id(settings.index)


def _tiers(settings: Settings, *, probe: bool = False) -> list[_Tier]:
    """The shared local tiers and where their leases live. With ``probe`` (a real pass), a bucket
    that does not enforce conditional writes (probed once per process, with one warning) cannot
    hold a lease: the filesystem holds it instead — every node of that bucket finds the same."""
    local = [t for t in settings.tiers if t.shared and t.is_local]
    if not local:
        return []
    buckets = shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers if t.shared and not t.is_local])
    if buckets and not _conditional(buckets[0], settings.node, probe):
        buckets = []
    out = []
    for t in local:
        fs = LocalFleetObjects(t.local_path, t.name)
        name = lease_name(t.name, t.local_path.expanduser().absolute(), t.shared_id)
        if buckets:
            store: FleetStore = buckets[0]
            where = f"bucket tier {buckets[0].name!r}"
        else:
            store, where = fs, f"file {fs.base / name}"
        out.append(_Tier(t.name, fs, store, name, where))
    return out


def _no_conditional_writes(t: _Tier, exc: StorageError) -> None:
    """A conditional PUT of the lease got 501: remember it for the process (every later pass, and
    the fleet lease, skip the bucket) and move this tier's lease to its filesystem."""
    from ckptkeeper.actions.fleet import _CONDITIONAL, NO_CONDITIONAL_WRITES

    bucket = t.store
    if isinstance(bucket, S3TierStorage):
        _CONDITIONAL[f"{bucket.bucket}/{bucket.root_prefix}"] = False
    log.warning(NO_CONDITIONAL_WRITES, tier=t.name, error=str(exc))
    t.store, t.where = t.fs, f"file {t.fs.base / t.lease_name}"


def _conditional(bucket: S3TierStorage, node: str, probe: bool) -> bool:
    from ckptkeeper.actions.fleet import _CONDITIONAL, conditional_writes

    if probe:
        try:
            return conditional_writes(bucket, node)
        except StorageError:
            return True  # unreachable now: taking the lease there fails too, and this node only catalogs
    return _CONDITIONAL.get(f"{bucket.bucket}/{bucket.root_prefix}", True)  # a dry run writes nothing


@dataclass
class SharedFs:
    """This pass's hold on the shared local tiers (see the module doc)."""

    settings: Settings
    tiers: list[_Tier]
    notes: list[str] = field(default_factory=list)

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tiers}

    def check_identity(self, now: float | None = None) -> None:
        """Raise :class:`NodeClash` when another keeper wrote this node's heartbeat recently (by
        the filesystem's clock: ``now`` is not used, kept for callers)."""
        me = _keeper(self.settings)
        for t in self.tiers:
            try:
                beat = read_beat(t.fs, f"{self.settings.node}.json")
                store_now = t.fs.store_now() if beat is not None else 0.0
            except StorageError as exc:
                log.warning("cannot read this node's heartbeat on a shared tier", tier=t.name, error=str(exc))
                continue
            clash = name_clash(beat, me, t.name, store_now, self.settings.fleet.orphan_after)
            if clash is not None:
                raise NodeClash(clash)

    def acquire(self, *, dry_run: bool, now: float) -> None:
        """Take or renew each tier's lease (a dry run only reads it). A real pass calls this before
        it catalogs: a new holder's plan then sees what the previous holder did up to its end."""
        for t in self.tiers:
            t.acting, t.note = False, None
            try:
                try:
                    mine, info, store_now = self._take(t, dry_run=dry_run)
                except ConditionalWritesUnsupported as exc:
                    # The bucket stopped honouring conditional writes: no lease can live there. Every
                    # node finds the same (its probe, or this answer) and falls back to the filesystem.
                    _no_conditional_writes(t, exc)
                    mine, info, store_now = self._take(t, dry_run=dry_run)
            except StorageError as exc:
                # No lease, no proof nobody else acts: this node only catalogs this pass.
                log.warning("shared tier lease unavailable: not acting on it", tier=t.name, error=str(exc))
                t.lease = None
                t.note = f"{t.name} is shared: its lease ({t.where}) is unavailable: {exc}; this node only catalogs"
                continue
            t.acting = mine
            if mine:
                continue
            t.lease = None
            if info is not None and info.expires > store_now:
                t.note = catalog_only_note(t.name, info, store_now)
            else:  # lost a race for it just now
                t.note = f"{t.name} is shared: another node took its lease just now; this node only catalogs"

    def _take(self, t: _Tier, *, dry_run: bool) -> tuple[bool, LeaseInfo | None, float]:
        """(this node holds or may take the lease, what the lease says when not, the store's clock)."""
        if dry_run:
            info, _etag = read_lease(t.store, t.lease_name)
            store_now = t.store.store_now()
            return (
                info is None or info.node == self.settings.node or info.expires <= store_now,
                info,
                store_now,
            )
        t.lease = Lease(t.store, self.settings.node, self.settings.fleet.lease_ttl, name=t.lease_name)
        if t.lease.acquire():
            return True, None, 0.0
        info = read_lease(t.store, t.lease_name)[0]
        return False, info, t.store.store_now()

    def restrict(self, plan: Plan) -> Plan:
        """Drop the actions on tiers this node does not hold the lease of, with the note why."""
        elsewhere = [t.name for t in self.tiers if not t.acting]
        if not elsewhere:
            return plan
        out, dropped = without_tiers(plan, elsewhere, [t.note for t in self.tiers if t.note])
        log.info(
            "shared tier held by another node: only cataloging", tiers=elsewhere, actions_dropped=dropped
        )
        return out

    def guard(self, action: Action) -> str | None:
        """Before each action (the executor asks): renew the lease of a shared tier it touches.
        A reason to stop when the lease is not ours any more, else None."""
        for t in self.tiers:
            if t.lease is None or not touches(action, {t.name}):
                continue
            try:
                ok = t.lease.renew()
            except StorageError as exc:
                ok = False
                log.warning("cannot renew the shared tier lease", tier=t.name, error=str(exc))
            if not ok:
                t.lease = None
                why = (
                    f"{t.name} is shared: this node lost its lease (stalled past fleet.lease_ttl, another "
                    f"node took it over); stopped before {action.action.value} {action.path}"
                )
                log.error("lost the shared tier lease: stopping", tier=t.name, action=action.action.value)
                self.notes.append(why)
                return why
        return None

    def after_pass(self, index: Index, now: float) -> list[str]:
        """This node's heartbeat on each shared local tier; notes (a store problem is only a note)."""
        notes = list(self.notes)
        for t in self.tiers:
            try:
                runs, ckpts, newest = index.tier_holdings(t.name, self.settings.node)
                write_beat(
                    t.fs,
                    self.settings.node,
                    runs_held=runs if t.acting else 0,
                    checkpoints_held=ckpts if t.acting else 0,
                    newest_verified=newest,
                    now=now,
                    keeper=_keeper(self.settings),
                )
            except (StorageError, OSError) as exc:
                notes.append(f"{t.name}: cannot write this node's heartbeat: {exc}")
        return notes


def open_shared(settings: Settings, *, probe: bool = False) -> SharedFs | None:
    """The shared local tiers of this config, or None (the usual single-node setup: no I/O).
    ``probe``: a real pass, which may probe the bucket's conditional writes."""
    tiers = _tiers(settings, probe=probe)
    return SharedFs(settings, tiers) if tiers else None


def check_node_name(settings: Settings, now: float) -> None:
    """At a keeper's start (the daemon's): refuse to run when another keeper wrote this node's
    heartbeat on a shared tier (a filesystem or a bucket) recently, before anything is done
    (raises :class:`NodeClash`: a config error, exit 2). No I/O without a shared tier."""
    shared = open_shared(settings)
    if shared is not None:
        shared.check_identity(now)
    if any(t.shared and not t.is_local for t in settings.tiers):
        from ckptkeeper.actions.fleet import check_names  # only for shared buckets

        check_names(settings)


def take_shared(settings: Settings, now: float | None = None) -> SharedFs | None:
    """For a caller that catalogs before :func:`~ckptkeeper.actions.prune.run_prune` (the daemon):
    check this keeper's identity and take or renew the shared filesystem tiers' leases *before*
    cataloging, as ``run_prune`` does for itself. A new holder's catalog then sees everything the
    previous holder did: once this node holds the lease the previous holder starts nothing more (its
    next renewal fails), so a plan made from a catalog taken afterwards never names a checkpoint it
    already moved. None: no shared local tier. Raises :class:`NodeClash`."""
    shared = open_shared(settings, probe=True)
    if shared is not None:
        t = time.time() if now is None else now
        shared.check_identity(t)
        shared.acquire(dry_run=False, now=t)
    return shared


def shared_fs_status(settings: Settings, *, now: float | None = None) -> list[dict[str, Any]]:
    """``fleet --json`` rows for the shared local tiers: nodes by heartbeat, and the lease."""
    out = []
    for t in _tiers(settings):
        beats, bad = read_beats(t.fs)
        lease, _etag = read_lease(t.store, t.lease_name)
        t_now = t.store.store_now() if now is None else now  # ages and expiry by the store's clock
        view = fleet_view(beats, [], lease, t_now, settings.fleet.orphan_after)
        view["tier"] = t.name
        view["unreadable_heartbeats"] = bad
        view["prefixes_without_heartbeat"] = []
        view["lease_at"] = t.where
        out.append(view)
    return out
