"""Participant: this node's part in the fleet of a shared bucket (:mod:`ckptkeeper.actions.fleet`).

Before anything acts (recovery included), its heartbeat: a node back from a long silence is not
gone while this pass runs, so no lease holder adopts its copies under it. After the pass, the
heartbeat again, its part records, and (as the fleet lease holder) the cleanup and adoption of
gone nodes' copies; a dry run shows the adoption it would make.
"""

from __future__ import annotations

from ckptkeeper.actions.fleet import after_pass, before_pass, preview_adoption
from ckptkeeper.actions.pruning.state import Participant, PassState


class FleetHeartbeat(Participant):
    def before(self, state: PassState) -> list[str]:
        return [] if state.dry_run else before_pass(state.settings, state.index)

    def after(self, state: PassState) -> list[str]:
        if state.dry_run:
            adopted, notes = preview_adoption(state.settings, force=state.force)  # by the store's clock
            state.adopted = adopted
            return notes
        if state.stopped:
            return []
        return after_pass(state.settings, state.index, adopted=state.adopted, force=state.force)
