"""The planner: index snapshot + tier policies + usage + ``now`` -> :class:`Plan` (docs/design.md, "Retention").

One pure function, :func:`plan`, in the spirit of restic's ``ApplyPolicy``: no I/O, no clock, the
same input always gives the same plan (whatever the order of the input), and every action and
every kept checkpoint carries the human reasons ``prune --dry-run`` prints.

How a plan is made, in order:

1. **Reaps** (optional): :func:`ckptkeeper.core.reaper.plan_reaps` decides what failed/stale runs and
   partial writes leave behind. Reaped checkpoints leave retention entirely. Reaps of a checkpoint
   the planner protects (pinned, newest complete of its run, parent of an active run) or in an
   unknown tier are dropped: the planner, not the reaper, owns those guarantees.
2. **Keep-sets**: per tier and per run, the union of the tier's rules (:mod:`ckptkeeper.core.retention`)
   over the run's complete checkpoints.
3. **Residency**: a checkpoint resides in the fastest tier whose keep-set holds it, plus a copy in
   every slower ``replicate`` tier whose keep-set holds it. Deliberate choice: the planner never
   *promotes* — a checkpoint whose fastest verified copy is already slower than its rule tier stays
   where it is (kept there, with a reason saying so). Promotion would thrash with watermarks (demote
   at 90 %, promote back at 70 %, …) and would refill the hot disk after an index rebuilt from the
   cold tier; bringing a checkpoint back is ``restore``'s job.
4. **Protections** (pinned, newest complete of the run, parent of an active run): kept whatever the
   rules say; a protected checkpoint no rule places stays in every tier it currently is in.
   Incomplete checkpoints (writing, corrupt) are never moved or deleted here at all.
5. **Watermarks and headroom**: tier by tier, fastest first, when a tier's usage (now, or projected after this
   plan) exceeds ``high_watermark``, its unprotected residents are demoted to the next tier, oldest
   first (``created_at``, then step, then run), until the projected usage is at most
   ``low_watermark`` (``high_watermark`` if unset). If that is not enough, the newest checkpoints
   of runs that ended follow, oldest first (moved, never deleted: see
   :func:`ckptkeeper.core.watermarks.watermarks`).
   Demotions cascade: the next tier treats them as its own residents. The projection is exactly
   the bytes this plan copies in minus the bytes it deletes or reaps, so executing the plan lands
   where the planner said. Headroom (first tier, ``headroom`` on): when its free space after this
   plan would not hold the next save of every active run (:mod:`ckptkeeper.core.headroom`), the
   same two rounds demote until it would, before the high watermark and without one.
6. **Actions** from desired vs actual: copies to desired tiers lacking a verified copy, from the
   fastest known tier holding one; deletes from tiers holding a copy that is not desired there.
6b. **Ownership** (docs/design.md, "Many nodes"): a delete or reap of a copy another node wrote
   (``Snapshot.foreign``) becomes a keep, "owned by node B: not ours" (:mod:`ckptkeeper.core.ownership`);
   a staging marker or upload another node wrote is not reaped (only the fleet lease holder cleans it).
7. **Guards**: ``max_delete`` and the empty-policy trap drop every delete and reap and set
   ``Plan.refused``; copies stay (they only add safety).

Unknown tiers (listing failed, ``Snapshot.unknown_tiers``) are never read as empty:

* no action ever names an unknown tier, as source, destination or delete target;
* a checkpoint that the index places in an unknown tier, or whose desired tiers include one, is
  *held*: it is deleted nowhere this round (its copy there may be gone; a move there cannot be
  verified), though copies to known desired tiers still happen since they only add safety;
* a checkpoint that expires is deleted from known tiers only if the index places no copy in an
  unknown tier. Retention itself reads the index, not listings, so an unknown tier cannot make a
  checkpoint look expired; the only way it could hide a copy is a copy the index never recorded,
  which a later ``scan`` re-catalogs and the next plan expires again.

Tier names in ``Checkpoint.tiers`` that are not configured any more are ignored: never a source,
never a target, never deleted from (the planner has no URL for them).

5b. **Undo window** (:mod:`ckptkeeper.core.trash`): in a tier with ``undo_window`` expiries and
   reaps of complete checkpoints move the copy into the tier's trash (``Action.trash``; they free
   nothing this pass); trash entries whose window ended, or in a tier above its high watermark,
   are purged (``ActionKind.PURGE``), and the projection counts those bytes as freed before any
   live checkpoint is demoted.

Output order, so plans diff cleanly and the executor can simply walk them: purges (they only free
space, copies into the same tier may need it), copies, then deletes, then reaps; each by (run, step, tier position, destination position). Keeps by (run, step, tier
position). Cost is O(n log n) in the number of checkpoints (the per-run sort, skipped for input
already in (run, step) order); everything else is a constant amount of work per checkpoint and
tier, and the output is produced already in order.

How it stays fast at a million checkpoints (bench/planning.py): most of a large catalog is
*plain*, already exactly where the rules want it, with nothing else to say (no protection, no
reaper verdict, no unknown tier, not resident in a tier with watermarks). Steps 2-4 work run by
run on columns (steps, creation times, a metric) read with C-level passes, and a plain checkpoint's
keeps come from a cache keyed by its placement (the tiers it is in, why each keep-set holds it):
no per-checkpoint planner state, nothing for steps 5-6 to look at
(:class:`ckptkeeper.core.placement.Placer`). The rest become items
(:class:`ckptkeeper.core.placement.Item`) that watermarks and the action pass finish; their keeps
are spliced back in order. Every keep reason, plain or not, comes from one builder,
:func:`ckptkeeper.core.keep_reasons.keep_reasons`.

One module per step: :mod:`~ckptkeeper.core.runs` (inputs, protections), :mod:`~ckptkeeper.core.reaps`
(1), :mod:`~ckptkeeper.core.placement` (2-4), :mod:`~ckptkeeper.core.watermarks` (5),
:mod:`~ckptkeeper.core.emit` and :mod:`~ckptkeeper.core.keep_reasons` (6), :mod:`~ckptkeeper.core.guard`
(7). The planner allocates a few objects per checkpoint and none in cycles; a caller planning a
big catalog may pause the cyclic GC around the call (:func:`ckptkeeper.util.gc.gc_paused`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptkeeper.core.emit import EXPIRED, emit
from ckptkeeper.core.guard import guard
from ckptkeeper.core.headroom import next_saves
from ckptkeeper.core.keep_reasons import INCOMPLETE, KeepReasons
from ckptkeeper.core.model import (
    ActionKind,
    Keep,
    Keeps,
    Plan,
    ReaperPolicy,
    RunState,
    Snapshot,
    TierSpec,
    TierUsage,
)
from ckptkeeper.core.ownership import without_foreign, without_others_litter
from ckptkeeper.core.placement import Placer
from ckptkeeper.core.reaps import reaps
from ckptkeeper.core.retention import rules_for
from ckptkeeper.core.runs import NEWEST, PINNED, group_by_run, protections
from ckptkeeper.core.trash import purges, to_trash, trash_plan
from ckptkeeper.core.watermarks import watched_tiers, watermarks

__all__ = [
    "EXPIRED",
    "INCOMPLETE",
    "NEWEST",
    "PINNED",
    "plan",
]


def plan(
    snapshot: Snapshot,
    tiers: Sequence[TierSpec],
    usage: Mapping[str, TierUsage | None],
    now: float,
    *,
    reaper: ReaperPolicy | None = None,
    max_delete: int = 100,
    force: bool = False,
    run: str | None = None,
    file_now: Mapping[str, float] | None = None,
) -> Plan:
    """Plan retention (and reaping, when ``reaper`` is given) for ``snapshot``; pure and deterministic.

    ``tiers`` are ordered fastest first. ``usage`` maps tier name to filesystem usage (None or
    missing: no watermark applies, e.g. object storage). ``run`` restricts the plan's actions and
    keep list to one run; watermarks are still computed over every run, since disks are shared.
    Raises ValueError for inconsistent input (duplicate tier names or checkpoints, ``keep_best``
    without a metric) rather than guess what to delete. ``file_now``: the time by each local
    tier's filesystem clock, which the reaper judges file ages by (missing: ``now``).
    """
    # Inputs: tier positions, rules per tier, checkpoints per run, protections.
    names = [t.name for t in tiers]
    pos = {name: i for i, name in enumerate(names)}
    if len(pos) != len(names):
        raise ValueError(f"duplicate tier names: {names}")
    unknown = frozenset(pos[n] for n in snapshot.unknown_tiers if n in pos)
    rules = [rules_for(t.policy, now) for t in tiers]
    notes: list[str] = []
    by_run = group_by_run(snapshot.checkpoints)
    protected = protections(snapshot, by_run)

    # 1. Reaps: reaped checkpoints leave retention.
    reaped = reaps(snapshot, by_run, tiers, reaper, now, protected, unknown, notes, file_now)

    # 2-4. Keep-sets, residency, protections: plain checkpoints' keeps are final here. The hot
    # tier is watched for headroom only when its free space now is short of the active runs' next
    # saves (O(active runs x 3) to predict, from the grouping above).
    saves = next_saves(snapshot.runs, lambda name: by_run[name].checkpoints if name in by_run else ())
    watched = watched_tiers(tiers, usage, unknown, saves)
    keep_reasons = KeepReasons(names)
    placer = Placer(tiers, pos, unknown, rules, protected, reaped.keep_reasons, watched, keep_reasons, run)
    for run_name, checkpoints in by_run.items():
        placer.place_run(run_name, checkpoints.without(reaped.reaped_steps.get(run_name)))

    # 5. Watermarks demote the oldest residents of tiers above their high watermark; trash
    # (undo_window) under pressure is purged first, and moves aside free nothing this pass.
    tp = trash_plan(tiers, watched)
    by_key = {c.key: c for c in snapshot.checkpoints} if tp.trash or tp.pressure else {}
    if by_key:
        reaped.actions = to_trash(reaped.actions, by_key, pos, tp, tiers)
    purge_actions = purges(snapshot.trash, tiers, pos, tp, unknown, now, snapshot.node, run)
    ended = frozenset(r.name for r in snapshot.runs if r.state is not RunState.ACTIVE)
    watermarks(
        placer.items, tiers, watched, unknown, [*reaped.actions, *purge_actions], pos, ended, notes, tp.trash
    )

    # 6. Actions from desired vs actual, and every keep with its reasons.
    copies, deletes, keep_parts = emit(
        placer.ready, placer.deferred, names, rules, unknown, reaped.keep_reasons, keep_reasons
    )
    reap_actions = reaped.actions if run is None else [a for a in reaped.actions if a.run == run]
    last = len(names)
    reap_actions.sort(
        key=lambda a: (
            a.run or "",
            a.step if a.step is not None else -1,
            pos.get(a.tier or "", last),
            a.path or "",
            a.upload_id or "",
        )
    )

    keeps: Sequence[Keep] = Keeps(keep_parts)  # built on first read: the daemon's pass never reads them

    # 6b. Ownership (docs/design.md, "Many nodes"): copies another node wrote are never deleted by our rules.
    if snapshot.foreign:
        deletes, reap_actions, keeps = without_foreign(deletes, reap_actions, keeps, snapshot.foreign, pos)
    if reap_actions and snapshot.node:
        reap_actions = without_others_litter(reap_actions, snapshot.artifacts, snapshot.node, notes)

    if by_key:
        deletes = to_trash(deletes, by_key, pos, tp, tiers)

    # 7. Guards: a plan that looks like a mistake keeps its copies only (purges wait too).
    refused = guard(deletes, reap_actions, rules, max_delete, force)
    actions = copies if refused is not None else [*purge_actions, *copies, *deletes, *reap_actions]
    reclaim = dict.fromkeys(names, 0)
    for a in actions:
        if a.action is not ActionKind.COPY and a.tier is not None and not a.trash:
            reclaim[a.tier] = reclaim.get(a.tier, 0) + a.bytes
    return Plan(
        actions=tuple(actions),
        keep=keeps if isinstance(keeps, Keeps) else tuple(keeps),
        reclaim_bytes=reclaim,
        refused=refused,
        notes=tuple(notes),
    )
