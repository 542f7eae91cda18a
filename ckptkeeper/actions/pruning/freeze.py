"""Participant: the delete freeze after an index loss (``<index>.deletes-held``, written by the
rebuild in :mod:`ckptkeeper.actions.index`): applied to every plan, advanced or released after
each pass; and the index record in the hot root, this node's proof that it had an index."""

from __future__ import annotations

from typing import Any

from ckptkeeper.actions.index import (
    after_held_pass,
    apply_hold,
    hold_after_loss,
    read_hold,
    write_index_record,
)
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.core.model import Plan


class IndexLossFreeze(Participant):
    def __init__(self) -> None:
        self.lost: dict[str, Any] | None = None
        self.hold: dict[str, Any] | None = None

    def catalog(self, state: PassState) -> None:
        # A missing index is rebuilt by the real run with deletes frozen: the dry run shows that.
        if state.dry_run and state.catalog is not None and state.report is not None:
            self.lost = hold_after_loss(state.settings, state.catalog, state.report)

    def freeze(self, state: PassState, plan: Plan) -> Plan:
        self.hold = read_hold(state.settings) or self.lost
        return plan if self.hold is None else apply_hold(plan, self.hold, state.force)

    def after(self, state: PassState) -> list[str]:
        if state.dry_run:
            return []
        if self.hold is not None and not state.stopped:
            after_held_pass(state.settings, state.index, self.hold, state.kinds, state.force)
        write_index_record(state.settings, state.index)
        return []
