"""The filesystem clocks of a pass (docs/many-nodes-clocks.md): file ages by the clock that
stamped the files, never this node's (:mod:`ckptkeeper.ingest.clocks`).

The catalog phase reads the hot tier's clock itself (:meth:`PassState.file_clocks`); this
participant takes every local tier's at the pass's ``observed`` moment, for the reaper, and says
in the plan's notes when this node's clock is far off a filesystem's or one could not be read.
"""

from __future__ import annotations

from ckptkeeper.actions.pruning.state import Participant, PassState

__all__ = ["FilesystemClocks"]


class FilesystemClocks(Participant):
    def recover(self, state: PassState) -> None:
        # The last hook before the pass takes ``observed`` (runner): as close to it as a
        # participant gets, and never later (an earlier "now" only makes files look younger).
        state.observed_on = dict(state.file_clocks().now_all())

    def after(self, state: PassState) -> list[str]:
        return list(state.file_clocks().notes)
