"""Participant: checkpoints spanning nodes (:mod:`ckptkeeper.actions.versions`). A version
pinned on any node pins this node's part of it (planned again with it pinned); a part goes, or
expires, only as the whole version allows."""

from __future__ import annotations

import dataclasses

from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.actions.versions import keep_whole_versions, version_pins
from ckptkeeper.core.model import Plan
from ckptkeeper.core.versions import pin_parts, version_pin_reasons


class VersionParts(Participant):
    def plan(self, state: PassState, plan: Plan) -> Plan:
        assert state.snapshot is not None and state.replan is not None
        pins, notes = version_pins(state.settings, plan, state.snapshot)
        if pins:
            checkpoints, why = pin_parts(state.snapshot.checkpoints, pins)
            if why:
                state.snapshot = dataclasses.replace(state.snapshot, checkpoints=checkpoints)
                plan = state.replan(state.snapshot)
                plan = dataclasses.replace(plan, keep=version_pin_reasons(plan.keep, why))
        return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan

    def restrict(self, state: PassState, plan: Plan) -> Plan:
        if "retention" not in state.kinds:
            return plan  # a reap-only pass deletes no part
        assert state.snapshot is not None
        return keep_whole_versions(state.settings, plan, state.snapshot)
