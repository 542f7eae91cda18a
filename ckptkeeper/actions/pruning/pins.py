"""Participant: pin objects in the slower tiers for every checkpoint pinned in the index (pins
made before pins lived in the tiers, or a tier added since), in the tiers this pass listed."""

from __future__ import annotations

from ckptkeeper.actions.pins import store_missing_pins
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.prune")


class PinObjects(Participant):
    def after(self, state: PassState) -> list[str]:
        if state.dry_run or state.catalog is None:
            return []
        try:
            store_missing_pins(state.settings, state.index, state.catalog.tier_pins)
        except Exception:  # best effort, retried next pass; the prune itself is done
            log.exception("cannot store pin objects in the tiers")
        return []
