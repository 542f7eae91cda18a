"""Participant: the history of executed actions (:mod:`ckptkeeper.actions.history`).

After the pass (and after the fleet participant, whose adoptions it reads): the deletes this node
made as the fleet lease holder become history events, and the history is trimmed to its bounds
(``history.keep``, ``history.max_rows``). The executor records its own actions as it runs them.
"""

from __future__ import annotations

from ckptkeeper.actions.history import after_pass
from ckptkeeper.actions.pruning.state import Participant, PassState


class HistoryRecord(Participant):
    def after(self, state: PassState) -> list[str]:
        if not state.dry_run:
            after_pass(state.settings, state.index, state.adopted)
        return []
