"""The prune pass: fixed phases, run identically by ``ckptkeeper prune``, ``prune --dry-run`` and
the daemon's scheduled jobs.

    lock -> before -> recover -> catalog -> plan -> restrict -> freeze -> execute -> after

The caller chooses only the catalog (:mod:`.catalog`); every other concern is a participant
(:mod:`.participants`), chosen once from the config. A dry run is the same phases on a private
in-memory copy of the index, without the executor lock, with an executor that does nothing: the
one place a dry run differs is :func:`_boundary`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ckptkeeper.actions.errors import IndexUnusable
from ckptkeeper.actions.index import executor_lock
from ckptkeeper.actions.pruning import participants as chosen
from ckptkeeper.actions.pruning.catalog import CatalogStep
from ckptkeeper.actions.pruning.outcome import PruneOutcome, cost_basis, exit_code
from ckptkeeper.actions.pruning.planning import plan_phase, restrict_phase
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.core.cost import StoredBasis
from ckptkeeper.core.model import Action, Plan
from ckptkeeper.executor import ExecResult, Executor, Progress
from ckptkeeper.index import IndexReplaced

__all__ = ["PrunePass"]


class _Executing:
    """The executor of a real pass: recovery, then the plan, checked against the index first."""

    def __init__(self, executor: Executor, on_plan: Callable[[Plan], None] | None) -> None:
        self.executor = executor
        self.on_plan = on_plan

    def recover(self) -> list[str]:
        return self.executor.recover()

    def execute(self, state: PassState, plan: Plan, recovered: list[str]) -> ExecResult:
        try:
            # The plan was made from this connection's file: if the path now names another file
            # (or none), its pins and its journal are not what we planned from.
            state.index.check_identity()
        except IndexReplaced as exc:
            raise IndexUnusable(
                f"{exc}: nothing was done; run the command again (a lost index is rebuilt from the "
                "tiers with deletes held)"
            ) from exc
        if self.on_plan is not None:
            # After the identity check: a plan that will not run is never shown as if it would.
            self.on_plan(plan)
        result = self.executor.apply(plan)
        result.recovered = recovered + result.recovered
        return result


class _DryRun:
    """The executor of a dry run: does nothing."""

    def recover(self) -> list[str]:
        return []

    def execute(self, state: PassState, plan: Plan, recovered: list[str]) -> None:
        return None


@contextmanager
def _boundary(
    state: PassState,
    guard: Callable[[Action], str | None] | None,
    *,
    lock_timeout: float,
    progress: Progress | None,
    on_plan: Callable[[Plan], None] | None,
) -> Iterator[_Executing | _DryRun]:
    """The lock phase, and the executor the pass gets: the one place a dry run differs."""
    if state.dry_run:
        with state.index.in_memory_copy() as scratch:
            state.index = scratch
            yield _DryRun()
        return
    with executor_lock(state.settings, lock_timeout):  # raises Locked
        settings = state.settings
        executor = Executor(
            state.index,
            settings.tier_specs(),
            stop=state.stop,
            progress=progress,
            partial_after=settings.reaper.partial_after,
            clock=state.clock,
            trust_mtimes=settings.daemon.trust_mtimes,
            guard=guard,
            hot_clock=state.file_clocks().hot,
        )
        yield _Executing(executor, on_plan)


class PrunePass:
    """One pass over ``state`` with ``participants`` (default: :func:`participants_for` of the
    config) and the caller's ``catalog``."""

    def __init__(
        self,
        state: PassState,
        catalog: CatalogStep,
        participants: Sequence[Participant] | None = None,
        *,
        lock_timeout: float = 5.0,
        progress: Progress | None = None,
        on_plan: Callable[[Plan], None] | None = None,
    ) -> None:
        self.state = state
        self.catalog = catalog
        self.participants = list(
            chosen.participants_for(state.settings) if participants is None else participants
        )
        self.lock_timeout = lock_timeout
        self.progress = progress
        self.on_plan = on_plan
        self.basis = StoredBasis()
        """What the index said of stored bytes before the plan ran (its cost, docs/compression.md)."""

    def run(self) -> PruneOutcome:
        """Raises Locked if another executor runs, NodeClash, IndexUnusable."""
        s, ps = self.state, self.participants
        with _boundary(
            s, self._guard(), lock_timeout=self.lock_timeout, progress=self.progress, on_plan=self.on_plan
        ) as executor:
            late = [note for p in ps for note in p.before(s)]
            recovered = executor.recover()
            for p in ps:
                p.recover(s)
            s.observed = s.clock()
            self.catalog.catalog(s)
            for p in ps:
                p.catalog(s)
            plan = restrict_phase(s, ps, plan_phase(s, ps))
            for p in ps:
                plan = p.freeze(s, plan)
            self.basis = cost_basis(s.settings, s.index)  # before the plan's own copies
            s.result = executor.execute(s, plan, recovered)
            if s.result is not None:
                self.catalog.after_execute(s, s.result)
            notes = [note for p in ps for note in p.after(s)] + late
        if notes:
            plan = dataclasses.replace(plan, notes=(*plan.notes, *notes))
        return self._outcome(plan)

    def _guard(self) -> Callable[[Action], str | None] | None:
        """The participants' guards as one: the first reason to stop wins."""
        guards = [p.guard for p in self.participants if type(p).guard is not Participant.guard]
        if not guards:
            return None

        def guard(action: Action) -> str | None:
            return next((why for why in (g(action) for g in guards) if why is not None), None)

        return guard

    def _outcome(self, plan: Plan) -> PruneOutcome:
        s, result = self.state, self.state.result
        prices = {t.name: t.cost_per_gib_month for t in s.settings.tiers}
        if result is None:
            return PruneOutcome(
                plan=plan,
                result=None,
                exit_code=exit_code([], s.held, plan),
                dry_run=True,
                held=s.held,
                damaged=s.damaged,
                adopted=s.adopted,
                prices=prices,
                dedup=s.dedup,
                basis=self.basis,
            )
        failed = [
            f"{a.action.value} {a.path} ({a.tier}{' -> ' + a.to_tier if a.to_tier else ''}): {err}"
            for a, err in result.failed
        ]
        return PruneOutcome(
            plan=plan,
            result=result,
            exit_code=exit_code(failed, s.held, plan),
            failed=failed,
            reclaimed_bytes=sum(result.reclaimed_bytes.values()),
            held=s.held,
            damaged=s.damaged,
            adopted=s.adopted,
            prices=prices,
            dedup=s.dedup,
            basis=self.basis,
        )
