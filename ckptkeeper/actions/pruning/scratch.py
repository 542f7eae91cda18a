"""Participant: the scratch a preflight killed mid-run left on the tiers (with the executor lock
held, no preflight of this node is running: it is dead)."""

from __future__ import annotations

from ckptkeeper.actions.preflight import sweep_scratch
from ckptkeeper.actions.pruning.state import Participant, PassState


class ScratchSweep(Participant):
    def recover(self, state: PassState) -> None:
        if not state.dry_run:
            sweep_scratch(state.settings)
