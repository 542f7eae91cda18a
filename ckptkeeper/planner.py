"""The planner: index snapshot + tier policies + usage + ``now`` -> :class:`Plan` (DESIGN §3).

One pure function, :func:`plan`, in the spirit of restic's ``ApplyPolicy``: no I/O, no clock, the
same input always gives the same plan (whatever the order of the input), and every action and
every kept checkpoint carries the human reasons ``prune --dry-run`` prints.

How a plan is made, in order:

1. **Reaps** (optional): :func:`ckptkeeper.reaper.plan_reaps` decides what failed/stale runs and
   partial writes leave behind. Reaped checkpoints leave retention entirely. Reaps of a checkpoint
   the planner protects (pinned, newest complete of its run, parent of an active run) or in an
   unknown tier are dropped: the planner, not the reaper, owns those guarantees.
2. **Keep-sets**: per tier and per run, the union of the tier's rules (:mod:`ckptkeeper.retention`)
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
   ``low_watermark`` (``high_watermark`` if unset). Demotions cascade: the next tier treats them as
   its own residents. The projection is exactly the bytes this plan copies in minus the bytes it
   deletes or reaps, so executing the plan lands where the planner said.
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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from ckptkeeper.model import (
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
from ckptkeeper.reaper import plan_reaps
from ckptkeeper.retention import Rule, describe, keeps_nothing, rules_for, select_union

__all__ = [
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
_KIND_ORDER = {ActionKind.COPY: 0, ActionKind.DELETE: 1, ActionKind.REAP: 2}


@dataclass(frozen=True, slots=True)
class _Locs:
    """Where the index says a checkpoint is, resolved against the configured tiers (cached per set)."""

    known: tuple[int, ...]
    """Positions of configured, known tiers holding a verified copy, fastest first."""
    in_unknown: tuple[int, ...]
    """Positions of configured tiers holding a copy whose listing failed."""


class _Item:
    """Planner state for one complete, non-reaped checkpoint."""

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
        sels: list[list[str] | None],
        protect: list[str] | None,
    ) -> None:
        self.ckpt = ckpt
        self.locs = locs
        self.sels = sels
        """Per tier position: the reasons its keep-set holds this checkpoint, or None."""
        self.protect = protect
        self.rule_tier: int | None = next((i for i, s in enumerate(sels) if s is not None), None)
        """Fastest tier whose keep-set holds it (None: no rule keeps it)."""
        self.base: int | None = None
        """Residence before watermarks: the rule tier, or where it already is (never promoted)."""
        self.resident: int | None = None
        self.desired: set[int] = set()
        self.demoted: list[tuple[str, str]] = []
        """(keep reason, copy reason) per watermark demotion it went through."""
        self.hold = False


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
    names = [t.name for t in tiers]
    pos = {name: i for i, name in enumerate(names)}
    if len(pos) != len(names):
        raise ValueError(f"duplicate tier names: {names}")
    unknown = {pos[n] for n in snapshot.unknown_tiers if n in pos}
    rules = [rules_for(t.policy, now) for t in tiers]
    notes: list[str] = []

    by_run = _group_by_run(snapshot.checkpoints)
    protections = _protections(snapshot, by_run)

    reap_actions: list[Action] = []
    reaped: set[tuple[str, int]] = set()
    reap_keep: Mapping[tuple[str, int], tuple[str, ...]] = {}
    if reaper is not None:
        reap_actions, reaped, reap_keep = _reaps(snapshot, tiers, reaper, now, protections, unknown, notes)

    items, incomplete = _residency(by_run, pos, unknown, tiers, rules, protections, reaped)
    _watermarks(items, tiers, usage, unknown, reap_actions, pos, notes)
    actions = _actions(items, names, rules, unknown)
    keeps = _keeps(items, names, unknown, reap_keep)
    for c in incomplete:
        keeps.extend(_incomplete_keeps(c, names, pos, protections.get(c.key), reap_keep.get(c.key, ())))

    if run is not None:
        actions = [a for a in actions if a.run == run]
        reap_actions = [a for a in reap_actions if a.run == run]
        keeps = [k for k in keeps if k.run == run]

    refused = _guard(actions, reap_actions, rules, max_delete, force)
    if refused is not None:
        actions = [a for a in actions if a.action is ActionKind.COPY]
        reap_actions = []
    actions.extend(reap_actions)

    last = len(names)

    def action_order(a: Action) -> tuple[int, str, int, int, int, str]:
        return (
            _KIND_ORDER[a.action],
            a.run or "",
            a.step if a.step is not None else -1,
            pos.get(a.tier or "", last),
            pos.get(a.to_tier or "", last),
            a.path or "",
        )

    actions.sort(key=action_order)
    keeps.sort(key=lambda k: (k.run, k.step, pos.get(k.tier, last)))

    reclaim = dict.fromkeys(names, 0)
    for a in actions:
        if a.action is not ActionKind.COPY and a.tier is not None:
            reclaim[a.tier] = reclaim.get(a.tier, 0) + a.bytes
    return Plan(
        actions=tuple(actions),
        keep=tuple(keeps),
        reclaim_bytes=reclaim,
        refused=refused,
        notes=tuple(notes),
    )


def _group_by_run(checkpoints: Sequence[Checkpoint]) -> dict[str, list[Checkpoint]]:
    """Checkpoints per run, runs by name and each run by step, so input order never matters."""
    grouped: defaultdict[str, list[Checkpoint]] = defaultdict(list)
    for c in checkpoints:
        grouped[c.run].append(c)
    out: dict[str, list[Checkpoint]] = {}
    for name in sorted(grouped):
        cps = grouped[name]
        cps.sort(key=lambda c: c.step)
        for a, b in pairwise(cps):
            if a.step == b.step:
                raise ValueError(f"duplicate checkpoint {name}@{a.step} in snapshot")
        out[name] = cps
    return out


def _protections(
    snapshot: Snapshot, by_run: Mapping[str, list[Checkpoint]]
) -> dict[tuple[str, int], list[str]]:
    """Checkpoint key -> why it is protected (pinned, newest complete, parent of an active run)."""
    protect: dict[tuple[str, int], list[str]] = {}
    for run in sorted(snapshot.runs, key=lambda r: r.name):
        if run.state is RunState.ACTIVE and run.parent is not None:
            protect.setdefault(run.parent, []).append(f"parent of active run {run.name}")
    for name, cps in by_run.items():
        newest = next((c for c in reversed(cps) if c.state is _COMPLETE), None)
        if newest is not None:
            protect.setdefault((name, newest.step), []).insert(0, NEWEST)
        for c in cps:
            if c.pinned:
                protect.setdefault((name, c.step), []).insert(0, PINNED)
    return protect


def _reaps(
    snapshot: Snapshot,
    tiers: Sequence[TierSpec],
    policy: ReaperPolicy,
    now: float,
    protections: Mapping[tuple[str, int], list[str]],
    unknown: set[int],
    notes: list[str],
) -> tuple[list[Action], set[tuple[str, int]], Mapping[tuple[str, int], tuple[str, ...]]]:
    """Ask the reaper, then drop what the planner's own guarantees forbid."""
    decision = plan_reaps(snapshot, tiers, policy, now)
    unknown_names = {tiers[i].name for i in unknown}
    blocked: set[tuple[str, int]] = set()
    actions: list[Action] = []
    for a in decision.actions:
        if a.run is not None and a.step is not None and (a.run, a.step) in protections:
            blocked.add((a.run, a.step))
            continue
        if a.tier in unknown_names:
            continue
        actions.append(a)
    for run, step in sorted(blocked):
        why = ", ".join(protections[(run, step)])
        notes.append(f"not reaping {run}@{step}: {why}")
    return actions, set(decision.reaped) - blocked, decision.keep_reasons


def _residency(
    by_run: Mapping[str, list[Checkpoint]],
    pos: Mapping[str, int],
    unknown: set[int],
    tiers: Sequence[TierSpec],
    rules: Sequence[Sequence[Rule]],
    protections: Mapping[tuple[str, int], list[str]],
    reaped: set[tuple[str, int]],
) -> tuple[list[_Item], list[Checkpoint]]:
    """Keep-sets, residency and desired tiers before watermarks; also the incomplete checkpoints."""
    ntiers = len(tiers)
    replicate = [t.policy.replicate for t in tiers]
    loc_cache: dict[frozenset[str], _Locs] = {}
    items: list[_Item] = []
    incomplete: list[Checkpoint] = []
    for run_name, cps in by_run.items():
        complete = [c for c in cps if c.state is _COMPLETE and (not reaped or c.key not in reaped)]
        if len(complete) != len(cps):
            incomplete.extend(
                c for c in cps if c.state is not _COMPLETE and (not reaped or c.key not in reaped)
            )
        if not complete:
            continue
        selections = [select_union(r, complete) for r in rules]
        for c in complete:
            locs = loc_cache.get(c.tiers)
            if locs is None:
                locs = _resolve(c.tiers, pos, unknown)
                loc_cache[c.tiers] = locs
            step = c.step
            item = _Item(c, locs, [s.get(step) for s in selections], protections.get((run_name, step)))
            rule_tier = item.rule_tier
            if rule_tier is None:
                if item.protect is not None:
                    item.desired = set(locs.known)  # protected, no rule places it: stays put
            else:
                fastest = locs.known[0] if locs.known else rule_tier
                base = max(rule_tier, fastest)  # never promote
                item.base = item.resident = base
                item.desired = {base}
                for t in range(base + 1, ntiers):
                    if replicate[t] and item.sels[t] is not None:
                        item.desired.add(t)
            item.hold = bool(locs.in_unknown) or not unknown.isdisjoint(item.desired)
            items.append(item)
    return items, incomplete


def _resolve(tier_names: frozenset[str], pos: Mapping[str, int], unknown: set[int]) -> _Locs:
    configured = sorted(pos[n] for n in tier_names if n in pos)
    return _Locs(
        known=tuple(i for i in configured if i not in unknown),
        in_unknown=tuple(i for i in configured if i in unknown),
    )


def _incomplete_keeps(
    c: Checkpoint,
    names: Sequence[str],
    pos: Mapping[str, int],
    protect: list[str] | None,
    reaper_reasons: Sequence[str],
) -> list[Keep]:
    """Incomplete checkpoints stay wherever they are (the hot tier, where writes happen, if unlisted)."""
    where = sorted(pos[n] for n in c.tiers if n in pos) or ([0] if names else [])
    reasons = _unique((INCOMPLETE, *(protect or ()), *reaper_reasons))
    return [Keep(c.run, c.step, names[i], reasons) for i in where]


def _unique(reasons: Sequence[str]) -> tuple[str, ...]:
    """Reasons in first-seen order without repeats (the reaper and the planner both say "pinned")."""
    return tuple(dict.fromkeys(reasons))


def _watermarks(
    items: list[_Item],
    tiers: Sequence[TierSpec],
    usage: Mapping[str, TierUsage | None],
    unknown: set[int],
    reap_actions: Sequence[Action],
    pos: Mapping[str, int],
    notes: list[str],
) -> None:
    """Demote the oldest unprotected residents of tiers above their high watermark (in place)."""
    ntiers = len(tiers)
    watched: dict[int, tuple[TierUsage, float, float]] = {}
    for i, spec in enumerate(tiers):
        u = usage.get(spec.name)
        high = spec.policy.high_watermark
        if u is None or high is None or u.total_bytes <= 0 or i in unknown:
            continue
        low = spec.policy.low_watermark
        watched[i] = (u, high, min(low, high) if low is not None else high)
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
        b = item.ckpt.bytes
        known = item.locs.known
        for i in item.desired:
            if i in projected and i not in known and known:
                projected[i] += b
        if not item.hold:
            for i in known:
                if i in projected and i not in item.desired:
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
        keep_reason = f"demoted: {name} above high watermark {high:.0%}"
        copy_reason = f"{name} above high watermark {high:.0%} ({usage_text})"
        target = low * u.total_bytes
        candidates = [
            it for it in items if it.resident == i and it.protect is None and not it.hold and it.locs.known
        ]
        candidates.sort(key=lambda it: (it.ckpt.created_at, it.ckpt.step, it.ckpt.run))
        for it in candidates:
            if projected[i] <= target:
                break
            b = it.ckpt.bytes
            projected[i] -= b  # the copy into i is cancelled, or the copy in i gets deleted
            it.desired.discard(i)
            if i + 1 not in it.desired:
                it.desired.add(i + 1)
                if i + 1 in projected:
                    projected[i + 1] += b
            it.resident = i + 1
            it.demoted.append((keep_reason, copy_reason))
        if projected[i] > target:
            notes.append(
                f"{name} still above low watermark {low:.0%} after demoting every unprotected checkpoint"
            )


def _actions(
    items: Sequence[_Item], names: Sequence[str], rules: Sequence[Sequence[Rule]], unknown: set[int]
) -> list[Action]:
    """Copies where desired and absent, then deletes where present and not desired (DESIGN §3)."""
    described = [describe(r) for r in rules]
    actions: list[Action] = []
    for it in items:
        c = it.ckpt
        known = it.locs.known
        if not known:
            continue  # no verified copy we can read: nothing to copy from, nothing to delete
        source = known[0]
        for t in sorted(it.desired):
            if t in known or t in unknown:
                continue
            if t == it.resident:
                reason, rule = _demote_reason(it, t, names, described)
            else:
                sel = it.sels[t] or ()
                reason, rule = f"replicate to {names[t]} ({', '.join(sel)})", "replicate"
            actions.append(
                Action(
                    ActionKind.COPY,
                    reason,
                    run=c.run,
                    step=c.step,
                    tier=names[source],
                    to_tier=names[t],
                    path=c.rel_path,
                    bytes=c.bytes,
                    rule=rule,
                )
            )
        if it.hold:
            continue
        for t in known:
            if t in it.desired:
                continue
            if it.resident is None:
                reason, rule = EXPIRED, "expired"
            elif t < it.resident:
                reason, rule = f"moved to {names[it.resident]}", "moved"
            else:
                reason, rule = f"not kept in {names[t]}: resides in {names[it.resident]}", "redundant"
            actions.append(
                Action(
                    ActionKind.DELETE,
                    reason,
                    run=c.run,
                    step=c.step,
                    tier=names[t],
                    path=c.rel_path,
                    bytes=c.bytes,
                    rule=rule,
                )
            )
    return actions


def _demote_reason(it: _Item, target: int, names: Sequence[str], described: Sequence[str]) -> tuple[str, str]:
    """Why a checkpoint moves from its fastest copy down to ``target``, e.g.
    ``demote: not in hot keep-set (last 2), kept by warm (last 5)``."""
    source = it.locs.known[0]
    parts: list[str] = []
    rule_tier = it.rule_tier
    if rule_tier is not None and rule_tier > source:
        skipped = [f"not in {names[j]} keep-set ({described[j]})" for j in range(source, rule_tier)]
        parts.append(
            ", ".join([*skipped, f"kept by {names[rule_tier]} ({', '.join(it.sels[rule_tier] or ())})"])
        )
    parts.extend(copy_reason for _, copy_reason in it.demoted)
    rule = "watermark" if it.demoted else "demote"
    return "demote: " + "; ".join(parts), rule


def _keeps(
    items: Sequence[_Item],
    names: Sequence[str],
    unknown: set[int],
    reap_keep: Mapping[tuple[str, int], tuple[str, ...]],
) -> list[Keep]:
    """One Keep per (checkpoint, desired tier), plus the tiers a held checkpoint stays in."""
    keeps: list[Keep] = []
    for it in items:
        c = it.ckpt
        extra: tuple[str, ...] = tuple(it.protect or ()) + tuple(reap_keep.get(c.key, ()))
        for t in sorted(it.desired):
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
            reasons.extend(extra)
            keeps.append(Keep(c.run, c.step, names[t], _unique(reasons)))
        if it.hold:
            blocking = sorted(set(it.locs.in_unknown) | (it.desired & unknown))
            held = f"held: {', '.join(names[i] for i in blocking)} unknown (listing failed)"
            for t in it.locs.known:
                if t not in it.desired:
                    keeps.append(Keep(c.run, c.step, names[t], _unique((held, *extra))))
    return keeps


def _guard(
    actions: Sequence[Action],
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
    expired = {(a.run, a.step) for a in actions if a.action is ActionKind.DELETE and a.rule == "expired"}
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
