"""Participant: the delete freeze after an index loss (a
:class:`~ckptkeeper.actions.index.DeleteFreeze`, written by the rebuild): applied to every plan,
advanced or released after each pass; and the index record in the hot root, this node's proof
that it had an index."""

from __future__ import annotations

from ckptkeeper.actions.index import (
    DeleteFreeze,
    advance_freeze,
    apply_freeze,
    freeze_after_loss,
    read_freeze,
    write_index_record,
)
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.core.model import Plan


class IndexLossFreeze(Participant):
    def __init__(self) -> None:
        self.lost: DeleteFreeze | None = None
        self.frozen: DeleteFreeze | None = None

    def catalog(self, state: PassState) -> None:
        # A missing index is rebuilt by the real run with deletes frozen: the dry run shows that.
        if state.dry_run and state.catalog is not None and state.report is not None:
            self.lost = freeze_after_loss(state.settings, state.catalog, state.report)

    def freeze(self, state: PassState, plan: Plan) -> Plan:
        self.frozen = read_freeze(state.settings) or self.lost
        return plan if self.frozen is None else apply_freeze(plan, self.frozen, state.force)

    def after(self, state: PassState) -> list[str]:
        if state.dry_run:
            return []
        if self.frozen is not None and not state.stopped:
            advance_freeze(state.settings, state.index, self.frozen, state.kinds, state.force)
        write_index_record(state.settings, state.index)
        return []
