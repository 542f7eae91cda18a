"""The planner: index snapshot + tier policies + usage + ``now`` -> :class:`Plan` (DESIGN §3).

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
5. **Watermarks**: tier by tier, fastest first, when a tier's usage (now, or projected after this
   plan) exceeds ``high_watermark``, its unprotected residents are demoted to the next tier, oldest
   first (``created_at``, then step, then run), until the projected usage is at most
   ``low_watermark`` (``high_watermark`` if unset). If that is not enough, the newest checkpoints
   of runs that ended follow, oldest first (moved, never deleted: see :func:`_watermarks`).
   Demotions cascade: the next tier treats them as its own residents. The projection is exactly
   the bytes this plan copies in minus the bytes it deletes or reaps, so executing the plan lands
   where the planner said.
6. **Actions** from desired vs actual: copies to desired tiers lacking a verified copy, from the
   fastest known tier holding one; deletes from tiers holding a copy that is not desired there.
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

Output order, so plans diff cleanly and the executor can simply walk them: copies, then deletes,
then reaps; each by (run, step, tier position, destination position). Keeps by (run, step, tier
position). Cost is O(n log n) in the number of checkpoints (the per-run sort, skipped for input
already in (run, step) order); everything else is a constant amount of work per checkpoint and
tier, and the output is produced already in order.

How it stays fast at a million checkpoints (bench/planning.py): most of a large catalog is
*plain*, already exactly where the rules want it, with nothing else to say (no protection, no
reaper verdict, no unknown tier, not resident in a tier with watermarks). Steps 2-4 work run by
run on columns (steps, creation times, a metric) read with C-level passes, and a plain checkpoint's
keeps come from a cache keyed by its placement (the tiers it is in, why each keep-set holds it):
no per-checkpoint planner state, nothing for steps 5-6 to look at (:class:`_Placer`). The rest
become items (:class:`_Item`) that watermarks and the action pass finish; their keeps are spliced
back in order.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import compress, groupby, islice, pairwise, repeat
from operator import attrgetter, eq, lt, not_
from typing import NamedTuple, cast

from ckptkeeper.core.model import (
    Action,
    ActionKind,
    Checkpoint,
    CheckpointState,
    Keep,
    Plan,
    ReaperPolicy,
    RunState,
    Snapshot,
    TierSpec,
    TierUsage,
)
from ckptkeeper.core.reaper import plan_reaps
from ckptkeeper.core.retention import Rule, RuleSet, RunHistory, describe, keeps_nothing, rules_for

__all__ = [
    "EXPIRED",
    "INCOMPLETE",
    "NEWEST",
    "PINNED",
    "plan",
]

PINNED = "pinned"
NEWEST = "newest complete checkpoint of run"
INCOMPLETE = "incomplete: never touched"
EXPIRED = "expired: no tier keeps it"

_COMPLETE = CheckpointState.COMPLETE
_COPY = ActionKind.COPY
_DELETE = ActionKind.DELETE
_by_step = attrgetter("step")
_run_of = attrgetter("run")
_state_of = attrgetter("state")
_pinned = attrgetter("pinned")
_NEWEST_ONLY = [NEWEST]
"""The protection of a checkpoint that is only protected as the newest of its run."""

Protections = dict[str, dict[int, list[str]]]
"""run -> step -> why the checkpoint is protected."""


@dataclass(frozen=True, slots=True, eq=False)
class _Locs:
    """Where the index says a checkpoint is, resolved against the configured tiers.

    One instance per tier set (the placer's cache), so identity is equality: compared and hashed
    by identity, cheap as a part of cache keys.
    """

    known: tuple[int, ...]
    """Positions of configured, known tiers holding a verified copy, fastest first."""
    known_set: frozenset[int]
    in_unknown: tuple[int, ...]
    """Positions of configured tiers holding a copy whose listing failed."""


class _Item:
    """Planner state for one checkpoint of the snapshot that retention decides about."""

    __slots__ = (
        "base",
        "ckpt",
        "demoted",
        "desired",
        "hold",
        "locs",
        "protect",
        "resident",
        "rule_tier",
        "sels",
    )

    def __init__(
        self,
        ckpt: Checkpoint,
        locs: _Locs,
        sels: Sequence[tuple[str, ...] | None],
        protect: list[str] | None,
        rule_tier: int | None,
        base: int | None,
        desired: frozenset[int],
        hold: bool,
    ) -> None:
        self.ckpt = ckpt
        self.locs = locs
        self.sels = sels
        """Per tier position: the reasons its keep-set holds this checkpoint, or None."""
        self.protect = protect
        self.rule_tier = rule_tier
        """Fastest tier whose keep-set holds it (None: no rule keeps it)."""
        self.base = base
        """Residence before watermarks: the rule tier, or where it already is (never promoted)."""
        self.resident = base
        """Residence after watermarks (None: expired, or protected with no rule placing it)."""
        self.desired = desired
        """Tiers it should be in once the plan is carried out (replaced, never mutated: shared)."""
        self.hold = hold
        """True when no delete may touch it this round (an unknown tier is involved)."""
        self.demoted: tuple[tuple[str, str], ...] = ()
        """(keep reason, copy reason) per watermark demotion it went through."""


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
) -> Plan:
    """Plan retention (and reaping, when ``reaper`` is given) for ``snapshot``; pure and deterministic.

    ``tiers`` are ordered fastest first. ``usage`` maps tier name to filesystem usage (None or
    missing: no watermark applies, e.g. object storage). ``run`` restricts the plan's actions and
    keep list to one run; watermarks are still computed over every run, since disks are shared.
    Raises ValueError for inconsistent input (duplicate tier names or checkpoints, ``keep_best``
    without a metric) rather than guess what to delete.
    """
    with _gc_paused():
        return _plan(snapshot, tiers, usage, now, reaper, max_delete, force, run)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning, then restore the caller's setting.

    A plan allocates a few objects per checkpoint (millions for a big catalog), none of them in
    reference cycles; every allocation burst would otherwise trigger full collections that rescan
    the whole catalog again and again (about a third of the time at 1M checkpoints).

    What survives is the plan: over a million long-lived records (1M checkpoints), no garbage
    cycles. Left in the young generation, the first allocation after ``gc.enable()`` would scan
    them all just to promote them (0.3 s at 1M), and a later middle-generation collection again.
    ``freeze()`` then ``unfreeze()`` moves every tracked object straight to the oldest generation
    (two list splices, no scan), where a full collection still visits them as it visits the
    catalog. Young objects of the caller age with them: a garbage cycle among those waits for the
    next full collection instead of the next young one. Skipped when the process keeps objects
    frozen itself (e.g. before forking workers): ``unfreeze()`` would release those too.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _plan(
    snapshot: Snapshot,
    tiers: Sequence[TierSpec],
    usage: Mapping[str, TierUsage | None],
    now: float,
    reaper: ReaperPolicy | None,
    max_delete: int,
    force: bool,
    run: str | None,
) -> Plan:
    names = [t.name for t in tiers]
    pos = {name: i for i, name in enumerate(names)}
    if len(pos) != len(names):
        raise ValueError(f"duplicate tier names: {names}")
    unknown = frozenset(pos[n] for n in snapshot.unknown_tiers if n in pos)
    rules = [rules_for(t.policy, now) for t in tiers]
    notes: list[str] = []

    by_run = _group_by_run(snapshot.checkpoints)
    protections = _protections(snapshot, by_run)

    reap_actions: list[Action] = []
    reaped: set[tuple[str, int]] = set()
    reap_keep: Mapping[tuple[str, int], tuple[str, ...]] = {}
    if reaper is not None:
        reap_actions, reaped, reap_keep = _reaps(
            snapshot, by_run, tiers, reaper, now, protections, unknown, notes
        )

    watched = _watched(tiers, usage, unknown)
    placer = _Placer(tiers, pos, unknown, rules, protections, reap_keep, watched, run)
    reaped_steps = _reaped_by_run(reaped)
    for run_name, checkpoints in by_run.items():
        placer.place_run(run_name, checkpoints.without(reaped_steps.get(run_name)))
    ended = frozenset(r.name for r in snapshot.runs if r.state is not RunState.ACTIVE)
    _watermarks(placer.items, tiers, watched, unknown, reap_actions, pos, ended, notes)
    copies, deletes, keeps = _emit(placer.ready, placer.deferred, names, rules, unknown, reap_keep)

    if run is not None:
        reap_actions = [a for a in reap_actions if a.run == run]
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

    refused = _guard(deletes, reap_actions, rules, max_delete, force)
    actions = copies if refused is not None else [*copies, *deletes, *reap_actions]
    reclaim = dict.fromkeys(names, 0)
    for a in actions:
        if a.action is not _COPY and a.tier is not None:
            reclaim[a.tier] = reclaim.get(a.tier, 0) + a.bytes
    return Plan(
        actions=tuple(actions),
        keep=tuple(keeps),
        reclaim_bytes=reclaim,
        refused=refused,
        notes=tuple(notes),
    )


class _RunCheckpoints(NamedTuple):
    """One run's checkpoints sorted by step, with what several passes need to know about all of
    them, read in one go while they are in the CPU cache (at 1M checkpoints each pass over the
    catalog costs a cache miss per checkpoint)."""

    checkpoints: list[Checkpoint]
    steps: list[int]
    incomplete: list[Checkpoint]
    """The ones not complete (writing, corrupt), in step order."""
    pinned: list[Checkpoint]

    @classmethod
    def of(cls, run: str, cps: list[Checkpoint]) -> _RunCheckpoints:
        """From one run's checkpoints in any order; raises ValueError if a step appears twice."""
        steps = list(map(_by_step, cps))
        if not all(map(lt, steps, islice(steps, 1, None))):  # not sorted, or a duplicate
            cps.sort(key=_by_step)
            steps.sort()
            dup = next((s for s, t in pairwise(steps) if s == t), None)
            if dup is not None:
                raise ValueError(f"duplicate checkpoint {run}@{dup} in snapshot")
        complete = list(map(_state_of, cps)).count(_COMPLETE)
        incomplete = [c for c in cps if c.state is not _COMPLETE] if complete != len(cps) else []
        return cls(cps, steps, incomplete, list(compress(cps, map(_pinned, cps))))

    def without(self, steps: set[int] | None) -> _RunCheckpoints:
        """The same run minus ``steps`` (reaped)."""
        if not steps:
            return self
        keep = [step not in steps for step in self.steps]
        return _RunCheckpoints(
            list(compress(self.checkpoints, keep)),
            list(compress(self.steps, keep)),
            [c for c in self.incomplete if c.step not in steps],
            [c for c in self.pinned if c.step not in steps],
        )

    def newest_complete(self) -> Checkpoint | None:
        if not self.incomplete:
            return self.checkpoints[-1] if self.checkpoints else None
        return next((c for c in reversed(self.checkpoints) if c.state is _COMPLETE), None)

    def complete(self) -> RunHistory:
        if not self.incomplete:
            return RunHistory(self.checkpoints, self.steps)
        return RunHistory([c for c in self.checkpoints if c.state is _COMPLETE])


def _group_by_run(checkpoints: Sequence[Checkpoint]) -> dict[str, _RunCheckpoints]:
    """Checkpoints per run, runs by name and each run by step, so input order never matters.

    Taken a block of consecutive checkpoints of one run at a time, so input already in (run, step)
    order, as ``Index.snapshot()`` gives it, costs a few C-level passes per block and no sort.
    """
    grouped: dict[str, list[Checkpoint]] = {}
    for name, block in groupby(checkpoints, key=_run_of):
        cps = grouped.get(name)
        if cps is None:
            grouped[name] = list(block)
        else:
            cps.extend(block)
    return {name: _RunCheckpoints.of(name, grouped[name]) for name in sorted(grouped)}


def _protections(snapshot: Snapshot, by_run: Mapping[str, _RunCheckpoints]) -> Protections:
    """Why checkpoints are protected: pinned, newest complete of the run, parent of an active run."""
    protect: Protections = defaultdict(dict)
    for r in sorted(snapshot.runs, key=attrgetter("name")):
        if r.state is RunState.ACTIVE and r.parent is not None:
            parent_run, parent_step = r.parent
            protect[parent_run].setdefault(parent_step, []).append(f"parent of active run {r.name}")
    for name, checkpoints in by_run.items():
        newest = checkpoints.newest_complete()
        if newest is not None:
            protect[name].setdefault(newest.step, []).insert(0, NEWEST)
        for c in checkpoints.pinned:
            protect[name].setdefault(c.step, []).insert(0, PINNED)
    return dict(protect)


def _protection(protections: Protections, run: str | None, step: int | None) -> list[str] | None:
    if run is None or step is None:
        return None
    return protections.get(run, {}).get(step)


def _reaps(
    snapshot: Snapshot,
    by_run: Mapping[str, _RunCheckpoints],
    tiers: Sequence[TierSpec],
    policy: ReaperPolicy,
    now: float,
    protections: Protections,
    unknown: frozenset[int],
    notes: list[str],
) -> tuple[list[Action], set[tuple[str, int]], Mapping[tuple[str, int], tuple[str, ...]]]:
    """Ask the reaper, then drop what the planner's own guarantees forbid (defence in depth)."""
    decision = plan_reaps(_reaper_view(snapshot, by_run), tiers, policy, now)
    unknown_names = {tiers[i].name for i in unknown}
    blocked: dict[tuple[str, int], list[str]] = {}
    actions: list[Action] = []
    for a in decision.actions:
        why = _protection(protections, a.run, a.step)
        if why is not None and a.run is not None and a.step is not None:
            blocked[(a.run, a.step)] = why
            continue
        if a.tier in unknown_names:
            continue
        actions.append(a)
    for (run, step), why in sorted(blocked.items()):
        notes.append(f"not reaping {run}@{step}: {', '.join(why)}")
    return actions, set(decision.reaped) - blocked.keys(), decision.keep_reasons


def _reaper_view(snapshot: Snapshot, by_run: Mapping[str, _RunCheckpoints]) -> Snapshot:
    """The part of the snapshot the reaper's verdicts depend on, the same decision at a fraction
    of the cost (1M checkpoints: 4 s -> 0.2 s, bench/planning.py).

    ``plan_reaps`` says nothing about a complete checkpoint of a live run (retention's business,
    see :class:`ckptkeeper.core.reaper.ReapDecision`); such a checkpoint only matters to it as a spared
    path an artifact may sit in. So it gets every checkpoint of failed and stale runs, every
    incomplete one, and the complete ones of live runs that hold an artifact, run by run
    (``plan_reaps`` sorts them by (run, step) anyway).
    """
    dead = {r.name for r in snapshot.runs if r.state is RunState.FAILED or r.state is RunState.STALE}
    holders: set[str] = set()
    for a in snapshot.artifacts:
        parts = a.path.rstrip("/").split("/")
        holders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    kept: list[Checkpoint] = []
    for name, checkpoints in by_run.items():
        if name in dead:
            kept.extend(checkpoints.checkpoints)
        elif holders:
            kept.extend(
                c
                for c in checkpoints.checkpoints
                if c.state is not _COMPLETE or c.rel_path.rstrip("/") in holders
            )
        else:
            kept.extend(checkpoints.incomplete)
    if len(kept) == len(snapshot.checkpoints):
        return snapshot
    return replace(snapshot, checkpoints=tuple(kept))


def _reaped_by_run(reaped: set[tuple[str, int]]) -> dict[str, set[int]]:
    steps: defaultdict[str, set[int]] = defaultdict(set)
    for run, step in reaped:
        steps[run].add(step)
    return steps


_NOWHERE: frozenset[int] = frozenset()
_NO_PROTECTION: dict[int, list[str]] = {}
_NOT_PLAIN: tuple[tuple[str, tuple[str, ...]], ...] = ()
_UNSEEN = -1
"""Template id of a placement not cached yet."""
_tiers_of = attrgetter("tiers")
_new_keep = tuple.__new__
"""``Keep(...)`` without the Python-level ``__new__`` of a named tuple (1.4M keeps at 1M: -0.3 s)."""


class _Placer:
    """Keep-sets, residency and desired tiers before watermarks (steps 2-4), run by run.

    Most checkpoints of a large catalog are *plain*: already exactly where the rules want them,
    with nothing else to say. Their keeps are final at once (:meth:`_plain_keeps`) and go straight
    to ``ready``; every other checkpoint becomes an :class:`_Item` that watermarks and
    :func:`_emit` finish, its keeps spliced into ``ready`` at the position noted in ``deferred``.
    Incomplete checkpoints are kept where they are (:func:`_incomplete_keeps`), nothing else.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        pos: Mapping[str, int],
        unknown: frozenset[int],
        rules: Sequence[Sequence[Rule]],
        protections: Protections,
        reap_keep: Mapping[tuple[str, int], tuple[str, ...]],
        watched: Mapping[int, object],
        only_run: str | None,
    ) -> None:
        self.names = [t.name for t in tiers]
        self.pos = pos
        self.unknown = unknown
        self._interned: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.rule_sets = [RuleSet(r, self._interned) for r in rules]
        self.protections = protections
        self.reap_keep = reap_keep
        self.reap_kept: defaultdict[str, set[int]] = defaultdict(set)
        for run, step in reap_keep:
            self.reap_kept[run].add(step)
        self.watched = frozenset(watched)
        self.only_run = only_run
        self.replicas = [t for t in range(len(tiers)) if tiers[t].policy.replicate]

        self.items: list[_Item] = []
        """Checkpoints that need planner state, in (run, step) order."""
        self.ready: list[Keep] = []
        """Keeps decided at placement, in output order (only the runs the plan reports)."""
        self.deferred: list[tuple[int, _Item]] = []
        """(position in ``ready``, item): where each reported item's keeps belong."""

        # Caches, all small: as many entries as distinct tier sets, reason tuples or placements.
        self._loc_cache: dict[frozenset[str], _Locs] = {}
        self._singles = [frozenset({t}) for t in range(len(tiers))]
        self._with_replica: dict[tuple[frozenset[int], int], frozenset[int]] = {}
        self._plain: dict[_Placement, int] = {}
        """Placement -> template id of its plain keeps (0: not plain); templates by id below."""
        self._keeps: list[tuple[tuple[str, tuple[str, ...]], ...]] = [_NOT_PLAIN]

    def place_run(self, run: str, checkpoints: _RunCheckpoints) -> None:
        """Place one run's checkpoints (reaped ones gone), in step order.

        A checkpoint's placement is the tiers it is in plus the reasons each tier's keep-set
        holds it for (None: not in it). Plain keeps are cached per placement as a template id
        (0: not plain), looked up for the whole run with C-level passes: the placement tuples are
        built by ``zip``, hashed by ``dict.get`` and dropped at once. Only the few *slow*
        checkpoints (not plain, or protected or reaper-kept: their keeps say more) take the
        per-checkpoint Python path; the plain ones between them become keeps in one
        :meth:`_ready_plain` per stretch, so ``ready`` comes out in the same step order.
        """
        cps, steps = checkpoints.checkpoints, checkpoints.steps
        history = checkpoints.complete()
        selections = [rules.select(history) for rules in self.rule_sets]
        plain = self._plain
        placements = zip(map(_tiers_of, cps), *[map(sel.get, steps) for sel in selections], strict=False)
        ids = list(map(plain.get, placements, repeat(_UNSEEN)))
        if _UNSEEN in ids:  # placements not seen yet: a few per plan
            for i in compress(range(len(ids)), map(eq, ids, repeat(_UNSEEN))):
                ids[i] = self._template(_placement(cps[i], selections))
        slow = set(compress(range(len(ids)), map(not_, ids)))
        protected = self.protections.get(run, _NO_PROTECTION)
        for step in protected.keys() | self.reap_kept.get(run, set()):
            i = bisect_left(steps, step)
            if i < len(steps) and steps[i] == step:
                slow.add(i)
        report = self.only_run is None or run == self.only_run
        start = 0
        for i in sorted(slow):
            if report and start < i:
                self._ready_plain(run, steps[start:i], ids[start:i])
            start = i + 1
            c = cps[i]
            if c.state is not _COMPLETE:
                if report:
                    self.ready.extend(self._incomplete(c))
                continue
            sels = tuple([sel.get(c.step) for sel in selections])
            item = self._item(c, sels, protected.get(c.step))
            self.items.append(item)
            if report:
                self.deferred.append((len(self.ready), item))
        if report and start < len(ids):
            self._ready_plain(run, steps[start:], ids[start:])

    def _ready_plain(self, run: str, steps: list[int], ids: list[int]) -> None:
        """Append the keeps of plain checkpoints ``steps`` with template ``ids``, in order: one
        ``Keep(run, step, tier, reasons)`` per (tier, reasons) of the template."""
        keep = self.ready.append
        for step, template in zip(steps, ids, strict=True):
            for tier, reasons in self._keeps[template]:
                keep(_new_keep(Keep, (run, step, tier, reasons)))

    def _template(self, placement: _Placement) -> int:
        """The template id of ``placement`` (cached): 0 if not plain, else the index in
        ``_keeps`` of the (tier, reasons) of its keeps (:meth:`_plain_keeps`)."""
        template = self._plain.get(placement, _UNSEEN)
        if template == _UNSEEN:
            where = cast(frozenset[str], placement[0])
            keeps = self._plain_keeps(where, cast(tuple[tuple[str, ...] | None, ...], placement[1:]))
            template = 0
            if keeps:
                template = len(self._keeps)
                self._keeps.append(keeps)
            self._plain[placement] = template
        return template

    def _incomplete(self, c: Checkpoint) -> list[Keep]:
        why = (*(_protection(self.protections, c.run, c.step) or ()), *self.reap_keep.get(c.key, ()))
        return _incomplete_keeps(c, self.names, why)

    def _plain_keeps(
        self, held_in: frozenset[str], sels: tuple[tuple[str, ...] | None, ...]
    ) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(tier, reasons) of each keep of a checkpoint placed like this, if it is plain; else ().

        Plain (for a complete checkpoint nobody protects and the reaper says nothing about): no
        tier is unknown this round, a rule places it in a tier without watermarks, and it already
        is in exactly its desired tiers. Then it resides in its rule tier (a copy in a faster tier
        would not be desired, so it is never-promoted only if it is not plain), :func:`_watermarks`
        never moves it (it moves residents of watched tiers, and counts only checkpoints whose
        desired tiers differ from where they are), and :func:`_emit` has no copy or delete for it
        and would give exactly these keeps.
        """
        if self.unknown:
            return _NOT_PLAIN
        rule_tier = _fastest(sels)
        if rule_tier is None or rule_tier in self.watched:
            return _NOT_PLAIN
        desired = self._desired(rule_tier, sels)
        if desired != self._locs(held_in).known_set:
            return _NOT_PLAIN
        return tuple(
            (self.names[t], (sels[t] or ()) if t == rule_tier else self._replicated(sels[t] or ()))
            for t in sorted(desired)
        )

    def _replicated(self, reasons: tuple[str, ...]) -> tuple[str, ...]:
        """Keep reasons of a replica: the replica tier's own, then ``replicate``."""
        with_replicate = (*reasons, "replicate")
        return self._interned.setdefault(with_replicate, with_replicate)

    def _item(
        self, c: Checkpoint, sels: tuple[tuple[str, ...] | None, ...], protect: list[str] | None
    ) -> _Item:
        locs = self._locs(c.tiers)
        rule_tier = _fastest(sels)
        base = None
        if rule_tier is None:
            # Expired, or protected with no rule placing it: then it stays where it is.
            desired = locs.known_set if protect is not None else _NOWHERE
        else:
            base = rule_tier
            if locs.known and locs.known[0] > base:
                base = locs.known[0]  # never promote
            desired = self._desired(base, sels)
        unknown = self.unknown
        hold = bool(unknown) and (bool(locs.in_unknown) or not unknown.isdisjoint(desired))
        return _Item(c, locs, sels, protect, rule_tier, base, desired, hold)

    def _desired(self, base: int, sels: tuple[tuple[str, ...] | None, ...]) -> frozenset[int]:
        """``base`` plus every slower replicate tier whose keep-set holds it (shared sets)."""
        desired = self._singles[base]
        for t in self.replicas:
            if t > base and sels[t] is not None:
                key = (desired, t)
                desired = self._with_replica.get(key) or self._with_replica.setdefault(key, desired | {t})
        return desired

    def _locs(self, tier_names: frozenset[str]) -> _Locs:
        locs = self._loc_cache.get(tier_names)
        if locs is None:
            locs = self._loc_cache[tier_names] = _resolve(tier_names, self.pos, self.unknown)
        return locs


_Placement = tuple[object, ...]
"""Where a checkpoint is (its tier names) followed by, per tier, why that tier's keep-set holds it
(None: not in it); flat, so one tuple per checkpoint is built and hashed."""


def _placement(c: Checkpoint, selections: Sequence[Mapping[int, tuple[str, ...]]]) -> _Placement:
    """The placement of one checkpoint, as :meth:`_Placer.place_run` builds it in bulk."""
    return (c.tiers, *[sel.get(c.step) for sel in selections])


def _fastest(sels: Sequence[tuple[str, ...] | None]) -> int | None:
    """The rule tier: the fastest tier whose keep-set holds the checkpoint."""
    for t, sel in enumerate(sels):
        if sel is not None:
            return t
    return None


def _resolve(tier_names: frozenset[str], pos: Mapping[str, int], unknown: frozenset[int]) -> _Locs:
    configured = sorted(pos[n] for n in tier_names if n in pos)
    known = tuple(i for i in configured if i not in unknown)
    return _Locs(known, frozenset(known), tuple(i for i in configured if i in unknown))


def _unique(reasons: Sequence[str]) -> tuple[str, ...]:
    """Reasons in first-seen order without repeats (the reaper and the planner both say "pinned")."""
    return tuple(dict.fromkeys(reasons))


def _watched(
    tiers: Sequence[TierSpec], usage: Mapping[str, TierUsage | None], unknown: frozenset[int]
) -> dict[int, tuple[TierUsage, float, float]]:
    """Tiers whose watermarks apply: position -> (usage, high, low)."""
    watched: dict[int, tuple[TierUsage, float, float]] = {}
    for i, spec in enumerate(tiers):
        u = usage.get(spec.name)
        high = spec.policy.high_watermark
        if u is None or high is None or u.total_bytes <= 0 or i in unknown:
            continue
        low = spec.policy.low_watermark
        watched[i] = (u, high, min(low, high) if low is not None else high)
    return watched


def _watermarks(
    items: Sequence[_Item],
    tiers: Sequence[TierSpec],
    watched: Mapping[int, tuple[TierUsage, float, float]],
    unknown: frozenset[int],
    reap_actions: Sequence[Action],
    pos: Mapping[str, int],
    ended: frozenset[str],
    notes: list[str],
) -> None:
    """Demote the oldest residents of tiers above their high watermark (in place).

    Two rounds per tier. First the unprotected residents, oldest first. If that is not enough,
    the newest checkpoints of runs that ended (finished, failed, stale), oldest first: protection
    means "never deleted", and a demotion is copy, verify, then delete from this tier only, so the
    checkpoint is still kept; without this round a node that ran many jobs fills its hot tier with
    their last checkpoints (bench/campaign.py: 98 % of the budget after a week). What stays put
    even under pressure: pinned checkpoints (the executor refuses to delete a pinned copy anyway),
    the newest checkpoint of an active run (it resumes from it) and the parent of an active run.
    """
    ntiers = len(tiers)
    if not watched:
        return

    # Projected bytes per watched tier once this plan is carried out: exactly the copies in minus
    # the deletes and reaps the action pass will emit, so the simulation and the executor agree.
    projected = {i: float(u.used_bytes) for i, (u, _, _) in watched.items()}
    for a in reap_actions:
        reaped_in = pos.get(a.tier or "")
        if reaped_in is not None and reaped_in in projected:
            projected[reaped_in] -= a.bytes
    for item in items:
        known = item.locs.known_set
        desired = item.desired
        if desired == known:
            continue
        b = item.ckpt.bytes
        if known:
            for i in desired - known:
                if i in projected:
                    projected[i] += b
        if not item.hold:
            for i in known - desired:
                if i in projected:
                    projected[i] -= b

    for i in sorted(watched):
        u, high, low = watched[i]
        name = tiers[i].name
        now_fraction = u.fraction
        if now_fraction <= high and projected[i] <= high * u.total_bytes:
            continue
        if i + 1 >= ntiers:
            notes.append(
                f"{name} above high watermark {high:.0%} but it is the last tier: nothing to demote to"
            )
            continue
        if i + 1 in unknown:
            notes.append(
                f"{name} above high watermark {high:.0%} but {tiers[i + 1].name} is unknown: no demotion"
            )
            continue
        if now_fraction > high:
            usage_text = f"usage {now_fraction:.0%}"
        else:
            usage_text = f"projected {projected[i] / u.total_bytes:.0%}"
        demotion = (
            f"demoted: {name} above high watermark {high:.0%}",
            f"{name} above high watermark {high:.0%} ({usage_text})",
        )
        target = low * u.total_bytes
        # Held checkpoints cannot leave (no delete this round) and one without a readable copy
        # cannot be copied: demoting either would free nothing.
        movable = [it for it in items if it.resident == i and not it.hold and it.locs.known]
        unprotected = [it for it in movable if it.protect is None]
        _demote_oldest(unprotected, i, projected, target, demotion)
        if projected[i] > target:
            # A protected checkpoint no rule places has no residence but stays where it is.
            ended_newest = [
                it
                for it in items
                if it.protect == _NEWEST_ONLY
                and it.ckpt.run in ended
                and (it.resident == i or (it.resident is None and i in it.desired))
                and not it.hold
                and it.locs.known
            ]
            pressure = (demotion[0], f"{demotion[1]}: newest checkpoint of ended run, moved not deleted")
            _demote_oldest(ended_newest, i, projected, target, pressure)
        if projected[i] > target:
            notes.append(
                f"{name} still above low watermark {low:.0%} after demoting every checkpoint it may"
                " (pinned ones, active runs' newest and parents of active runs stay)"
            )


def _demote_oldest(
    candidates: list[_Item],
    tier: int,
    projected: dict[int, float],
    target: float,
    demotion: tuple[str, str],
) -> None:
    """Move ``candidates`` residing in ``tier`` one tier down, oldest first, until it is at most
    ``target`` bytes; ``projected`` follows each move so the next tier sees what it receives."""
    candidates.sort(key=lambda it: (it.ckpt.created_at, it.ckpt.step, it.ckpt.run))
    below = tier + 1
    for it in candidates:
        if projected[tier] <= target:
            return
        b = it.ckpt.bytes
        projected[tier] -= b  # the copy into tier is cancelled, or the copy in tier gets deleted
        if below not in it.desired and below in projected:
            projected[below] += b
        it.desired = (it.desired - {tier}) | {below}
        it.resident = below
        it.demoted = (*it.demoted, demotion)


def _emit(
    ready: list[Keep],
    deferred: Sequence[tuple[int, _Item]],
    names: Sequence[str],
    rules: Sequence[Sequence[Rule]],
    unknown: frozenset[int],
    reap_keep: Mapping[tuple[str, int], tuple[str, ...]],
) -> tuple[list[Action], list[Action], list[Keep]]:
    """Copies, deletes and keeps from desired vs actual (DESIGN §3), each already in output order.

    Copies go where desired and absent, from the fastest known tier holding a verified copy; deletes
    where present and not desired, unless the checkpoint is held. Keeps: one per desired tier with
    every reason, plus the tiers a held checkpoint stays in; each item's between the ``ready``
    keeps placed before and after it.
    """
    if not deferred:
        return [], [], ready
    described = [describe(r) for r in rules]
    replica_reasons: dict[tuple[str, ...], tuple[str, ...]] = {}
    templates: dict[tuple[object, ...], tuple[tuple[str, tuple[str, ...]], ...]] = {}
    demote_reasons: dict[tuple[object, ...], tuple[str, str]] = {}
    copies: list[Action] = []
    deletes: list[Action] = []
    keeps: list[Keep] = []
    done = 0
    for at, it in deferred:
        keeps.extend(ready[done:at])
        done = at
        c = it.ckpt
        locs = it.locs
        desired = it.desired
        resident = it.resident
        known = locs.known
        if known and desired != locs.known_set:
            for t in sorted(desired - locs.known_set - unknown):
                if t == resident:
                    rule_tier = it.rule_tier
                    why = (
                        known[0],
                        rule_tier,
                        it.sels[rule_tier] if rule_tier is not None else None,
                        it.demoted,
                    )
                    cached = demote_reasons.get(why)
                    if cached is None:
                        cached = demote_reasons[why] = _demote_reason(it, names, described)
                    reason, rule = cached
                else:
                    reason, rule = f"replicate to {names[t]} ({', '.join(it.sels[t] or ())})", "replicate"
                copies.append(
                    Action(_COPY, reason, c.run, c.step, names[known[0]], names[t], c.rel_path, c.bytes, rule)
                )
            if not it.hold:
                for t in sorted(locs.known_set - desired):
                    if resident is None:
                        reason, rule = EXPIRED, "expired"
                    elif t < resident:
                        reason, rule = f"moved to {names[resident]}", "moved"
                    else:
                        reason, rule = f"not kept in {names[t]}: resides in {names[resident]}", "redundant"
                    deletes.append(
                        Action(_DELETE, reason, c.run, c.step, names[t], None, c.rel_path, c.bytes, rule)
                    )
        if (
            # Placed by rules alone, nothing else to say (like a plain checkpoint, but moving).
            # Rule reasons are distinct, so they need no de-duplication, and replica reasons are
            # shared tuples.
            resident is not None
            and resident == it.rule_tier
            and not it.protect
            and not it.demoted
            and not unknown
            and (not reap_keep or c.key not in reap_keep)
        ):
            sels = it.sels
            for t in sorted(desired) if len(desired) > 1 else desired:
                reasons = sels[t] or ()
                if t != resident:
                    reasons = replica_reasons.get(reasons) or replica_reasons.setdefault(
                        reasons, (*reasons, "replicate")
                    )
                keeps.append(Keep(c.run, c.step, names[t], reasons))
            continue
        reaper_reasons = reap_keep.get(c.key, ()) if reap_keep else ()
        key = _keeps_key(it, reaper_reasons)
        template = templates.get(key)
        if template is None:
            template = templates[key] = _keeps_of(it, names, unknown, reaper_reasons)
        for tier, reasons in template:
            keeps.append(_new_keep(Keep, (c.run, c.step, tier, reasons)))
    keeps.extend(ready[done:])
    return copies, deletes, keeps


def _demote_reason(it: _Item, names: Sequence[str], described: Sequence[str]) -> tuple[str, str]:
    """Why a checkpoint moves from its fastest copy down to where it resides, e.g.
    ``demote: not in hot keep-set (last 2), kept by warm (last 5)``. Reads only the fastest copy,
    the rule tier, its reasons and the demotions (what ``_emit`` caches it by)."""
    source = it.locs.known[0]
    parts: list[str] = []
    rule_tier = it.rule_tier
    if rule_tier is not None and rule_tier > source:
        skipped = [f"not in {names[j]} keep-set ({described[j]})" for j in range(source, rule_tier)]
        kept_by = f"kept by {names[rule_tier]} ({', '.join(it.sels[rule_tier] or ())})"
        parts.append(", ".join([*skipped, kept_by]))
    parts.extend(copy_reason for _, copy_reason in it.demoted)
    return "demote: " + "; ".join(parts), "watermark" if it.demoted else "demote"


def _keeps_of(
    it: _Item, names: Sequence[str], unknown: frozenset[int], reaper_reasons: tuple[str, ...]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(tier, reasons) of one Keep per desired tier, plus the tiers a held checkpoint stays in, in
    tier order. Reads only the fields :func:`_keeps_key` lists, so equal keys share a result."""
    extra = (*(it.protect or ()), *reaper_reasons)
    held_in: list[int] = []
    held = ""
    if it.hold:
        held_in = [t for t in it.locs.known if t not in it.desired]
        blocking = sorted(set(it.locs.in_unknown) | (it.desired & unknown))
        held = f"held: {', '.join(names[i] for i in blocking)} unknown (listing failed)"
    keeps: list[tuple[str, tuple[str, ...]]] = []
    for t in sorted((*it.desired, *held_in)):
        if t in held_in:
            keeps.append((names[t], _unique((held, *extra))))
            continue
        reasons: list[str] = list(it.sels[t] or ())
        if t == it.resident:
            if t != it.base:
                reasons.extend(keep_reason for keep_reason, _ in it.demoted)
            elif not reasons and it.rule_tier is not None and it.rule_tier != t:
                kept_by = ", ".join(it.sels[it.rule_tier] or ())
                reasons.append(
                    f"kept by {names[it.rule_tier]} ({kept_by}); stays in {names[t]}: never promoted"
                )
        elif it.resident is not None:
            reasons.append("replicate")
        if t in unknown and t not in it.locs.in_unknown:
            reasons.append(f"waiting: {names[t]} unknown (listing failed)")
        keeps.append((names[t], _unique((*reasons, *extra))))
    return tuple(keeps)


def _keeps_key(it: _Item, reaper_reasons: tuple[str, ...]) -> tuple[object, ...]:
    """Everything :func:`_keeps_of` reads about a checkpoint (the tier names and unknown tiers are
    the plan's): checkpoints that moved the same way share their keep reasons."""
    protect = tuple(it.protect) if it.protect is not None else None
    return (
        it.locs,
        it.desired,
        it.hold,
        it.sels,
        it.resident,
        it.base,
        it.rule_tier,
        it.demoted,
        protect,
        reaper_reasons,
    )


def _incomplete_keeps(c: Checkpoint, names: Sequence[str], why: tuple[str, ...]) -> list[Keep]:
    """Incomplete checkpoints stay wherever they are (the hot tier, where writes happen, if unlisted)."""
    where = [n for n in names if n in c.tiers] or list(names[:1])
    reasons = _unique((INCOMPLETE, *why))
    return [Keep(c.run, c.step, n, reasons) for n in where]


def _guard(
    deletes: Sequence[Action],
    reap_actions: Sequence[Action],
    rules: Sequence[Sequence[Rule]],
    max_delete: int,
    force: bool,
) -> str | None:
    """Refuse the destructive part of a plan that looks like a mistake (exit code 3 in the CLI).

    Counted for ``max_delete``: checkpoints deleted from their last location (expired) plus reaped
    things (a checkpoint reaped in several tiers counts once). Moves don't count: a moved
    checkpoint still exists. The empty-policy trap: when every tier's rules can never keep anything
    (all counts 0), each run would shrink to its protected checkpoints; that is almost certainly a
    config slip, so it is refused even when under ``max_delete``.
    """
    if force:
        return None
    expired = {(a.run, a.step) for a in deletes if a.rule == "expired"}
    if not expired and not reap_actions:
        return None
    if expired and rules and all(keeps_nothing(r) for r in rules):
        return (
            f"empty policy: no tier's rules can keep any checkpoint, would expire {len(expired)}; use --force"
        )
    reaped = {(a.run, a.step) if a.step is not None else (a.tier, a.path) for a in reap_actions}
    count = len(expired) + len(reaped)
    if count > max_delete:
        return f"would delete {count} checkpoints (max_delete={max_delete}); use --force"
    return None
