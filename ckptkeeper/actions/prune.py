"""``prune``: reconcile, plan retention and reaping, and (unless a dry run) carry the plan out.

Dry-run travels down as a value: a dry run reconciles into an in-memory copy of the index, so it
sees what is on disk now while changing nothing on disk, in object storage or in the index.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.deadlines import bounded_pass
from ckptkeeper.actions.errors import (
    EXIT_ACTION_FAILED,
    EXIT_OK,
    EXIT_POLICY_HELD,
    EXIT_REFUSED,
    IndexUnusable,
)
from ckptkeeper.actions.held import TierHeld, held_by_tiers, record_policy_held
from ckptkeeper.actions.index import (
    after_held_pass,
    apply_hold,
    executor_lock,
    hold_after_loss,
    read_hold,
    write_index_record,
)
from ckptkeeper.actions.pins import store_missing_pins
from ckptkeeper.actions.preflight import sweep_scratch
from ckptkeeper.actions.sharedfs import SharedFs, open_shared
from ckptkeeper.actions.status import tier_usage
from ckptkeeper.actions.tier_sharing import refuse_unshared_writers
from ckptkeeper.config import Settings
from ckptkeeper.core import planner
from ckptkeeper.core.model import ActionKind, Checkpoint, CheckpointState, Plan, Snapshot
from ckptkeeper.core.versions import pin_parts, version_pin_reasons
from ckptkeeper.executor import ExecResult, Executor, Progress
from ckptkeeper.fleet.sharedfs import owned_by_the_tier
from ckptkeeper.index import Index, IndexReplaced
from ckptkeeper.ingest.catalog import Catalog
from ckptkeeper.util.gc import gc_paused
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.prune")

KINDS = ("retention", "reap")


def one_per_step(snapshot: Snapshot) -> tuple[Snapshot, list[str]]:
    """The planner keys checkpoints by (run, step), the catalog by (run, name): Lightning's
    ``-v1`` files and NeMo's ``-last`` copies share a step with another checkpoint. The planner
    gets one per (run, step) — complete before incomplete, then the newest written, then the
    name — and the others are left exactly where they are: never moved, deleted or reaped.
    """
    groups: dict[tuple[str, int], list[Checkpoint]] = {}
    for c in snapshot.checkpoints:
        groups.setdefault(c.key, []).append(c)
    if all(len(g) == 1 for g in groups.values()):
        return snapshot, []
    keep: list[Checkpoint] = []
    notes: list[str] = []
    for (run, step), group in groups.items():
        group.sort(key=lambda c: (c.state is CheckpointState.COMPLETE, c.last_write, c.created_at, c.name))
        keep.append(group[-1])
        if len(group) > 1:
            others = ", ".join(c.name for c in group[:-1])
            notes.append(
                f"{run}@{step}: {len(group)} checkpoints share this step; planning {group[-1].name}, "
                f"leaving {others} untouched"
            )
    return dataclasses.replace(snapshot, checkpoints=tuple(keep)), sorted(notes)


@dataclass
class PruneOutcome:
    """What one prune pass planned and did; ``result`` is None for a dry run."""

    plan: Plan
    result: ExecResult | None
    exit_code: int
    failed: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0
    dry_run: bool = False
    held: dict[str, TierHeld] = field(default_factory=dict)
    """Unavailable tiers that held back part of the policy (exit :data:`EXIT_POLICY_HELD`)."""
    damaged: dict[str, str] = field(default_factory=dict)
    """``tier:path`` -> problem, for each copy the reconcile found damaged (copied again)."""
    adopted: list[Any] = field(default_factory=list)
    """:class:`ckptkeeper.fleet.adopt.Adoption` per gone node whose copies this node, as the fleet
    lease holder, adopted (or, in a dry run, would adopt) in a shared tier."""


def make_plan(
    settings: Settings,
    index: Index,
    *,
    now: float | None = None,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
) -> Plan:
    specs = settings.tier_specs()
    # The snapshot allocates a few objects per checkpoint and the plan millions for a big catalog,
    # none in cycles: one pause over both (100k hookless checkpoints: make_plan 1.17 -> 0.88 CPU-s).
    usage = tier_usage(settings)
    with gc_paused():
        snapshot, shared_steps = one_per_step(index.snapshot([t.name for t in specs], node=settings.node))
        snapshot = owned_by_the_tier(snapshot, {t.name for t in settings.tiers if t.shared and t.is_local})

        def plan_of(snap: Snapshot) -> Plan:
            return planner.plan(
                snap,
                specs,
                usage,
                time.time() if now is None else now,
                reaper=settings.reaper.to_policy() if "reap" in kinds else None,
                max_delete=settings.max_delete,
                force=force,
                run=run,
            )

        result = plan_of(snapshot)
    if any(t.shared for t in settings.tiers):
        from ckptkeeper.actions.versions import version_pins  # only for shared tiers

        # A version pinned on any node pins this node's part of it: plan again with it pinned.
        pins, pin_notes = version_pins(settings, result, snapshot)
        if pins:
            checkpoints, why = pin_parts(snapshot.checkpoints, pins)
            if why:
                snapshot = dataclasses.replace(snapshot, checkpoints=checkpoints)
                with gc_paused():
                    result = plan_of(snapshot)
                result = dataclasses.replace(result, keep=version_pin_reasons(result.keep, why))
        if pin_notes:
            result = dataclasses.replace(result, notes=(*result.notes, *pin_notes))
    if shared_steps:
        result = dataclasses.replace(result, notes=(*result.notes, *shared_steps))
    if "retention" not in kinds:
        # Reap-only pass (the daemon's reap job): retention actions wait for their own job.
        result = Plan(
            actions=tuple(a for a in result.actions if a.action in (ActionKind.REAP, ActionKind.PURGE)),
            keep=result.keep,
            reclaim_bytes=result.reclaim_bytes,
            refused=result.refused,
            notes=result.notes,
        )
    elif any(t.shared for t in settings.tiers):
        from ckptkeeper.actions.versions import hold_parts_in_plan  # only for shared tiers

        # A node's part goes (or expires) only as the whole version allows.
        result = hold_parts_in_plan(settings, result, snapshot)
    return result


@bounded_pass  # request_timeout and pass_timeout (actions/deadlines.py)
def run_prune(
    settings: Settings,
    index: Index,
    *,
    dry_run: bool = False,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
    rescan: bool = True,
    lock_timeout: float = 5.0,
    stop: threading.Event | None = None,
    progress: Progress | None = None,
    now: Callable[[], float] = time.time,
    on_plan: Callable[[Plan], None] | None = None,
    shared: SharedFs | None = None,
) -> PruneOutcome:
    """Reconcile, plan and (unless ``dry_run``) execute. Raises Locked if another executor runs.

    ``on_plan`` sees the final plan before the first byte moves (the CLI prints it then, so a
    long copy is never a silent wait).

    ``shared``: the shared filesystem tiers' leases, already taken by the caller (the daemon, see
    :func:`~ckptkeeper.actions.sharedfs.take_shared`) before it cataloged; None: this pass opens and takes them itself."""
    names = [t.name for t in settings.tiers]
    damaged: dict[str, str] = {}
    # A shared filesystem tier: only its lease holder acts on it.
    taken = shared is not None and not dry_run
    if not taken:
        shared = open_shared(settings, probe=not dry_run)
        if shared is not None:
            shared.check_identity(now())  # NodeClash: a config error, before anything is done
    if dry_run:
        lost: dict[str, Any] | None = None
        with index.in_memory_copy() as scratch:
            observed = now()  # see below: the plan's clock is when the scan started looking
            if rescan:
                catalog = Catalog(settings, scratch)
                report = catalog.reconcile()
                damaged = report.damaged
                lost = hold_after_loss(settings, catalog, report)
            refuse_unshared_writers(settings, scratch)  # TierNotShared: a config error, before planning
            plan = make_plan(settings, scratch, now=observed, force=force, run=run, kinds=kinds)
            if shared is not None:
                shared.acquire(dry_run=True, now=observed)
                plan = shared.restrict(plan)
            held = _held(plan, scratch, names, run)
        # A missing index is rebuilt by the real run with deletes held: the dry run shows that hold.
        hold = read_hold(settings) or lost
        if hold is not None:
            plan = apply_hold(plan, hold, force)
        adopted: list[Any] = []
        if any(t.shared for t in settings.tiers):  # as the real pass: after_pass, whatever the run
            from ckptkeeper.actions.fleet import preview_adoption  # only for shared tiers

            adopted, said = preview_adoption(settings, force=force)  # by the store's clock
            plan = dataclasses.replace(plan, notes=(*plan.notes, *said))
        code = _exit_code([], held, plan)
        return PruneOutcome(
            plan=plan, result=None, exit_code=code, dry_run=True, held=held, damaged=damaged, adopted=adopted
        )

    adopted = []
    with executor_lock(settings, lock_timeout):
        beat_notes: list[str] = []
        if any(t.shared and not t.is_local for t in settings.tiers):
            from ckptkeeper.actions.fleet import before_pass  # only for shared tiers

            # Before anything acts (recovery included): a node back from a long silence is not
            # gone while this pass runs, so no lease holder adopts its copies under it.
            beat_notes = before_pass(settings, index)
        executor = Executor(
            index,
            settings.tier_specs(),
            stop=stop,
            progress=progress,
            partial_after=settings.reaper.partial_after,
            clock=now,
            trust_mtimes=settings.daemon.trust_mtimes,
            guard=None if shared is None else shared.guard,
        )
        recovered = executor.recover()
        # A preflight killed mid-run left its scratch on the tiers; with the lock held it is dead.
        sweep_scratch(settings)
        if shared is not None and not taken:
            shared.acquire(dry_run=False, now=now())
        # The plan judges ages (quiet for partial_after, failed_after, keep_within) at the moment the
        # scan began, not when it ended: a write seen during a long scan is at most that old, so a
        # save still being appended to never looks quiet because the scan itself took a while (it
        # did, under load: a live partial was planned as "no write for 8s" while written every 50 ms).
        observed = now()
        if rescan:
            catalog = Catalog(settings, index)
            damaged = catalog.reconcile().damaged
            store_missing_pins(settings, index, catalog.tier_pins)
        refuse_unshared_writers(settings, index)  # TierNotShared: a config error, before planning
        plan = make_plan(settings, index, now=observed, force=force, run=run, kinds=kinds)
        if shared is not None:
            plan = shared.restrict(plan)
        held = _held(plan, index, names, run)
        hold = read_hold(settings)
        if hold is not None:
            plan = apply_hold(plan, hold, force)
        try:
            # The plan was made from this connection's file: if the path now names another file
            # (or none), its pins and its journal are not what we planned from.
            index.check_identity()
        except IndexReplaced as exc:
            raise IndexUnusable(
                f"{exc}: nothing was done; run the command again (a lost index is rebuilt from the "
                "tiers with deletes held)"
            ) from exc
        if on_plan is not None:
            # After the identity check: a plan that will not run is never shown as if it would.
            on_plan(plan)
        result = executor.apply(plan)
        result.recovered = recovered + result.recovered
        if rescan and (result.done or result.failed):
            # Make the index reflect what the tiers now hold (cheap: unchanged checkpoints are not rehashed).
            # Without ``rescan`` the caller reconciles what the pass touched (the daemon: by run).
            Catalog(settings, index).reconcile()
        if hold is not None and not result.stopped:
            after_held_pass(settings, index, hold, kinds, force)
        write_index_record(settings, index)
        if shared is not None:
            plan = dataclasses.replace(plan, notes=(*plan.notes, *shared.after_pass(index, now())))
        if not result.stopped and any(t.shared and not t.is_local for t in settings.tiers):
            from ckptkeeper.actions.fleet import after_pass  # only for shared tiers

            fleet_notes = after_pass(settings, index, adopted=adopted, force=force)
            plan = dataclasses.replace(plan, notes=(*plan.notes, *fleet_notes))
        if beat_notes:
            plan = dataclasses.replace(plan, notes=(*plan.notes, *beat_notes))
        # history participant: the lease holder's adopted deletes, and the bounds of the history
        from ckptkeeper.actions.history import after_pass as history_after_pass

        history_after_pass(settings, index, adopted)
        if "retention" in kinds and run is None and not result.stopped:
            try:
                record_policy_held(settings, held)
            except OSError as exc:  # advisory: status loses it, the exit code still says it
                log.warning("cannot record the held policy for status", error=str(exc))
    for tier in held.values():
        log.warning(
            "policy held: tier unavailable", tier=tier.tier, checkpoints=tier.checkpoints, error=tier.error
        )
    failed = [
        f"{a.action.value} {a.path} ({a.tier}{' -> ' + a.to_tier if a.to_tier else ''}): {err}"
        for a, err in result.failed
    ]
    return PruneOutcome(
        plan=plan,
        result=result,
        exit_code=_exit_code(failed, held, plan),
        failed=failed,
        reclaimed_bytes=sum(result.reclaimed_bytes.values()),
        held=held,
        damaged=damaged,
        adopted=adopted,
    )


def _held(plan: Plan, index: Index, names: list[str], run: str | None) -> dict[str, TierHeld]:
    """What unavailable tiers held back (cheap when every tier is available: no second snapshot)."""
    statuses = index.tier_statuses()
    if all(statuses.get(n) is not None and statuses[n].ok for n in names):
        return {}
    snapshot, _ = one_per_step(index.snapshot(names))
    if run is not None:
        snapshot = dataclasses.replace(
            snapshot, checkpoints=tuple(c for c in snapshot.checkpoints if c.run == run)
        )
    return held_by_tiers(plan, snapshot, statuses)


def _exit_code(failed: Sequence[str], held: dict[str, TierHeld], plan: Plan) -> int:
    """The worst of: an action failed (1), an unavailable tier held the policy back (4), a guard
    refused (3); else 0."""
    if failed:
        return EXIT_ACTION_FAILED
    if held:
        return EXIT_POLICY_HELD
    return EXIT_REFUSED if plan.refused else EXIT_OK
