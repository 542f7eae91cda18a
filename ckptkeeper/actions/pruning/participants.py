"""Which participants a pass has, chosen once from the config (the one place to add one)."""

from __future__ import annotations

from ckptkeeper.actions.pruning.clocks import FilesystemClocks
from ckptkeeper.actions.pruning.dedup import ContentCollection
from ckptkeeper.actions.pruning.fleet import FleetHeartbeat
from ckptkeeper.actions.pruning.freeze import IndexLossFreeze
from ckptkeeper.actions.pruning.held import PolicyHeld
from ckptkeeper.actions.pruning.history import HistoryRecord
from ckptkeeper.actions.pruning.lease import SharedFsLease
from ckptkeeper.actions.pruning.pins import PinObjects
from ckptkeeper.actions.pruning.scratch import ScratchSweep
from ckptkeeper.actions.pruning.sharing import UnsharedTiers
from ckptkeeper.actions.pruning.state import Participant
from ckptkeeper.actions.pruning.versions import VersionParts
from ckptkeeper.config import Settings

__all__ = ["participants_for"]


def participants_for(settings: Settings) -> list[Participant]:
    """The participants of every pass under ``settings``, in the order each phase runs them (a
    plain single-node setup gets no shared-tier participant: no I/O for them)."""
    buckets = any(t.shared and not t.is_local for t in settings.tiers)
    filesystems = any(t.shared and t.is_local for t in settings.tiers)
    out: list[Participant] = [IndexLossFreeze()]
    if any(not t.shared and not t.is_local for t in settings.tiers[1:]):
        out.append(UnsharedTiers())
    if buckets:
        out.append(VersionParts())
    if filesystems:
        out.append(SharedFsLease())
    if buckets:
        out.append(FleetHeartbeat())
    out += [ScratchSweep(), PolicyHeld()]
    if settings.tiers[1:]:
        out.append(PinObjects())
    if any(t.dedup for t in settings.tiers[1:]):
        out.append(ContentCollection())  # after PinObjects: its notes come with the pass's own
    out.append(HistoryRecord())  # after FleetHeartbeat: it records the adoptions that one made
    out.append(FilesystemClocks())  # last: its clocks are read closest to the pass's "observed"
    return out
