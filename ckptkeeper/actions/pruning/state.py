"""What one prune pass carries from phase to phase, and the shape of a participant.

A pass runs fixed phases (see :mod:`.runner`): lock, before, recover, catalog, plan, restrict,
freeze, execute, after. A :class:`Participant` is one concern of the pass (a shared filesystem's
lease, the delete freeze after an index loss, ...): it overrides only the phases it cares about.
The hooks that shape the plan take it and return it; ``before`` and ``after`` return notes, which
the pass adds to the plan (the ``before`` notes last: the plan does not exist when they are made).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkeeper.config import Settings
from ckptkeeper.core.model import Action, Plan, Snapshot
from ckptkeeper.index import Index

if TYPE_CHECKING:
    from ckptkeeper.actions.held import TierUnavailable
    from ckptkeeper.executor import ExecResult
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.ingest.clocks import FileClocks
    from ckptkeeper.ingest.report import ReconcileReport

__all__ = ["PHASES", "Participant", "PassState"]

PHASES = ("lock", "before", "recover", "catalog", "plan", "restrict", "freeze", "execute", "after")
"""The phases of every pass, in order (``lock`` and ``execute`` belong to the pass alone)."""


@dataclass
class PassState:
    """One pass: its inputs, and what its phases found so far (read by the participants)."""

    settings: Settings
    index: Index
    """The index the pass plans from: a private in-memory copy in a dry run."""
    dry_run: bool = False
    force: bool = False
    run: str | None = None
    kinds: tuple[str, ...] = ("retention", "reap")
    clock: Callable[[], float] = time.time
    stop: threading.Event | None = None
    observed: float = 0.0
    """When the catalog began looking: the plan judges ages at this moment, not when the catalog
    ended (a write seen during a long catalog is at most that old)."""
    observed_on: dict[str, float] = field(default_factory=dict)
    """``observed`` by each local tier's filesystem clock: the reaper judges file ages by these
    (:mod:`.clocks`); a tier missing here is judged by ``observed``."""
    clocks: FileClocks | None = None
    """The local tiers' filesystem clocks (:meth:`file_clocks`)."""
    catalog: Catalog | None = None
    """The catalog the plan was made from (None: the caller cataloged nothing this pass)."""
    report: ReconcileReport | None = None
    damaged: dict[str, str] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    """What the planner saw (a participant that re-plans replaces it)."""
    replan: Callable[[Snapshot], Plan] | None = None
    """Plans ``snapshot`` again with this pass's policy and clock (the plan phase sets it)."""
    result: ExecResult | None = None
    """What the executor did (None: a dry run)."""
    held: dict[str, TierUnavailable] = field(default_factory=dict)
    adopted: list[Any] = field(default_factory=list)
    """:class:`ckptkeeper.fleet.adopt.Adoption` per gone node whose copies this node adopted (or,
    in a dry run, would adopt) in a shared tier."""
    dedup: dict[str, Any] = field(default_factory=dict)
    """What the dedup tiers' copies uploaded and referenced, and what their content collection
    found (:mod:`.dedup`); empty without a dedup tier."""

    def file_clocks(self) -> FileClocks:
        """The filesystem clocks of this pass, made on first use: probed in a real pass, read
        only in a dry run (:mod:`ckptkeeper.ingest.clocks`)."""
        if self.clocks is None:
            from ckptkeeper.ingest.clocks import FileClocks

            self.clocks = FileClocks(self.settings, write=not self.dry_run)
        return self.clocks

    @property
    def stopped(self) -> bool:
        return self.result is not None and self.result.stopped


class Participant:
    """One concern of the prune pass; every hook does nothing unless overridden."""

    def before(self, state: PassState) -> list[str]:
        """With the executor lock held, before anything acts (recovery included)."""
        return []

    def recover(self, state: PassState) -> None:
        """After the executor finished or undid the steps a crash interrupted."""

    def catalog(self, state: PassState) -> None:
        """After the catalog (``state.catalog`` / ``state.report``, when the caller cataloged)."""

    def plan(self, state: PassState, plan: Plan) -> Plan:
        """The planner's plan; may plan ``state.snapshot`` again (``state.replan``)."""
        return plan

    def restrict(self, state: PassState, plan: Plan) -> Plan:
        """Drop what this node may not do now (another node's lease, an incomplete version)."""
        return plan

    def freeze(self, state: PassState, plan: Plan) -> Plan:
        """Hold back what must not run at all this pass (deletes after an index loss)."""
        return plan

    def guard(self, action: Action) -> str | None:
        """Asked by the executor before each action: a reason to stop there, or None."""
        return None

    def after(self, state: PassState) -> list[str]:
        """After the executor (and the caller's re-catalog of what it touched)."""
        return []
