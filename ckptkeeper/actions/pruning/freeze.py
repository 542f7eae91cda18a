"""Participant: the delete freeze after an index loss (a
:class:`~ckptkeeper.actions.index.DeleteFreeze`, written by the rebuild): applied to every plan,
advanced or released after each pass; and the index record in the hot root, this node's proof
that it had an index."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckptkeeper.actions.index import (
    DeleteFreeze,
    deletes_held_path,
    freeze_after_loss,
    read_freeze,
    write_freeze,
    write_index_record,
)
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.config import Settings
from ckptkeeper.core.model import ActionKind, Plan
from ckptkeeper.index import Index
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.index")


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


def apply_freeze(plan: Plan, freeze: DeleteFreeze, force: bool) -> Plan:
    """After a rebuild: the first pass only copies (copies add safety); later passes also move
    (a move deletes a source only once its new copy is verified), but while the pins are unknown
    nothing that destroys a last copy — an expiry, a reap — runs until ``--force``."""
    if not freeze.first_pass_done:
        kept = tuple(a for a in plan.actions if a.action is ActionKind.COPY)
        why = f"deletes held for the first pass after the index was rebuilt: {freeze.reason}"
    elif not freeze.pins_salvaged and not force:
        kept = tuple(
            a
            for a in plan.actions
            if a.action is ActionKind.COPY or (a.action is ActionKind.DELETE and a.rule != "expired")
        )
        why = (
            "expiries and reaps held: the index was rebuilt without its pins; re-pin what must be kept, "
            "then run `ckptkeeper prune --force`"
        )
    else:
        return plan
    if len(kept) == len(plan.actions):
        return dataclasses.replace(plan, notes=(*plan.notes, why))
    log.warning("destructive actions held", held=len(plan.actions) - len(kept), reason=why)
    return dataclasses.replace(
        plan,
        actions=kept,
        refused=f"{plan.refused}; {why}" if plan.refused else why,
        reclaim_bytes=dict.fromkeys(plan.reclaim_bytes, 0),
    )


def advance_freeze(
    settings: Settings, index: Index, freeze: DeleteFreeze, kinds: Sequence[str], force: bool
) -> None:
    """Advance the freeze: the first pass with retention that listed every tier ends phase one."""
    if not freeze.first_pass_done:
        statuses = index.tier_statuses()
        failing = [t.name for t in settings.tiers if not (statuses.get(t.name) and statuses[t.name].ok)]
        if "retention" not in kinds or failing:
            if failing:
                log.warning("deletes stay held: tiers not listed since the rebuild", tiers=failing)
            return
        # Every slower tier has now been listed, pin objects included: the pins are known again.
        if freeze.pins_salvaged or len(settings.tiers) > 1:
            deletes_held_path(settings).unlink(missing_ok=True)
            log.warning(
                "every tier reconciled since the index was rebuilt: deletes resume from the next pass"
            )
        else:
            write_freeze(settings, dataclasses.replace(freeze, first_pass_done=True))
            log.error(
                "every tier reconciled since the index was rebuilt; moves resume, expiries and reaps stay "
                "held until `ckptkeeper prune --force` (the pins were lost with the index)"
            )
    elif force:
        deletes_held_path(settings).unlink(missing_ok=True)
        log.warning("expiries and reaps released by --force")
