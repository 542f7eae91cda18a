"""Participant: the lease of each shared filesystem tier (:mod:`ckptkeeper.actions.sharedfs`):
only its holder acts on the tier.

Taken in ``before``, so before the catalog: a pass right after a takeover then catalogs only after
the previous holder stopped (it starts nothing more once its next renewal fails), and never plans
from what that holder changed since. A dry run only reads the leases.
"""

from __future__ import annotations

from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.actions.sharedfs import SharedFs, open_shared
from ckptkeeper.core.model import Action, Plan


class SharedFsLease(Participant):
    def __init__(self) -> None:
        self.shared: SharedFs | None = None

    def before(self, state: PassState) -> list[str]:
        self.shared = open_shared(state.settings, probe=not state.dry_run)
        if self.shared is not None:
            now = state.clock()
            self.shared.check_identity(now)  # NodeClash: a config error, before anything is done
            self.shared.acquire(dry_run=state.dry_run, now=now)
        return []

    def restrict(self, state: PassState, plan: Plan) -> Plan:
        return plan if self.shared is None else self.shared.restrict(plan)

    def guard(self, action: Action) -> str | None:
        return None if self.shared is None else self.shared.guard(action)

    def after(self, state: PassState) -> list[str]:
        if state.dry_run or self.shared is None:
            return []
        return self.shared.after_pass(state.index, state.clock())
