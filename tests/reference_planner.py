"""A slow, obviously-correct reference planner, straight from docs/design.md, "Retention" (and the README's notes on
unknown tiers and never promoting), for tests/test_planner_reference.py.

No caches, no fast paths, no incremental bookkeeping: each step is computed from its definition,
checkpoint by checkpoint, and the output is sorted explicitly at the end. The rules themselves
(``Rule.select``) and the reaper (``plan_reaps`` on the *full* snapshot) are taken as given: they
have their own property tests against plain definitions. Quadratic in places; for small catalogs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
from ckptkeeper.core.retention import describe, keeps_nothing, rules_for

PINNED = "pinned"
NEWEST = "newest complete checkpoint of run"
INCOMPLETE = "incomplete: never touched"
EXPIRED = "expired: no tier keeps it"


@dataclass
class Ref:
    """One complete, not reaped checkpoint as the reference sees it."""

    c: Checkpoint
    sels: list[tuple[str, ...] | None]  # per tier: why its keep-set holds it (rule order), or None
    protect: list[str]
    known: set[int]  # configured tiers with a listable copy
    in_unknown: set[int]  # configured tiers with a copy whose listing failed
    rule_tier: int | None = None
    base: int | None = None
    resident: int | None = None
    desired: set[int] = field(default_factory=set)
    demotions: list[tuple[str, str]] = field(default_factory=list)  # (keep reason, copy reason)


def reference_plan(
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
    names = [t.name for t in tiers]
    pos = {n: i for i, n in enumerate(names)}
    unknown = {pos[n] for n in snapshot.unknown_tiers if n in pos}
    rules = [rules_for(t.policy, now) for t in tiers]
    notes: list[str] = []

    # Protections: pinned; the newest complete checkpoint of every run; the parent of an active run.
    def protections_of(c: Checkpoint) -> list[str]:
        why = []
        if c.pinned:
            why.append(PINNED)
        complete = [d for d in snapshot.checkpoints if d.run == c.run and d.state is CheckpointState.COMPLETE]
        if complete and max(d.step for d in complete) == c.step and c.state is CheckpointState.COMPLETE:
            why.append(NEWEST)
        for r in sorted(snapshot.runs, key=lambda r: r.name):
            if r.state is RunState.ACTIVE and r.parent == (c.run, c.step):
                why.append(f"parent of active run {r.name}")
        return why

    # 1. Reaps, minus reaps of protected checkpoints and anything in an unknown tier.
    reap_actions: list[Action] = []
    reaped: set[tuple[str, int]] = set()
    reaper_reasons: Mapping[tuple[str, int], tuple[str, ...]] = {}
    if reaper is not None:
        decision = plan_reaps(snapshot, tiers, reaper, now)
        by_key = {c.key: c for c in snapshot.checkpoints}
        blocked = set()
        for a in decision.actions:
            if a.run is not None and a.step is not None and (a.run, a.step) in by_key:
                why = protections_of(by_key[(a.run, a.step)])
                if why:
                    blocked.add((a.run, a.step))
                    continue
            if a.tier is not None and a.tier in pos and pos[a.tier] in unknown:
                continue
            reap_actions.append(a)
        for key in sorted(blocked):
            notes.append(f"not reaping {key[0]}@{key[1]}: {', '.join(protections_of(by_key[key]))}")
        reaped = set(decision.reaped) - blocked
        reaper_reasons = decision.keep_reasons

    # 2-4. Keep-sets (union of each tier's rules over the run's complete, not reaped checkpoints),
    # the fastest tier wins, never promoted, replicate copies; protected ones no rule keeps stay put.
    live = [c for c in snapshot.checkpoints if c.key not in reaped]
    refs: list[Ref] = []
    for c in live:
        if c.state is not CheckpointState.COMPLETE:
            continue
        history = sorted(
            (d for d in live if d.run == c.run and d.state is CheckpointState.COMPLETE), key=lambda d: d.step
        )
        sels: list[tuple[str, ...] | None] = []
        for tier_rules in rules:
            why = tuple(rule.reason for rule in tier_rules if c.step in rule.select(history))
            sels.append(why or None)
        configured = {pos[n] for n in c.tiers if n in pos}
        it = Ref(c, sels, protections_of(c), configured - unknown, configured & unknown)
        it.rule_tier = next((t for t, s in enumerate(sels) if s is not None), None)
        if it.rule_tier is None:
            it.desired = set(it.known) if it.protect else set()
        else:
            it.base = max(it.rule_tier, min(it.known)) if it.known else it.rule_tier
            it.desired = {it.base} | {
                t for t in range(it.base + 1, len(tiers)) if tiers[t].policy.replicate and sels[t] is not None
            }
        it.resident = it.base
        refs.append(it)

    def held(it: Ref) -> bool:
        return bool(unknown) and (bool(it.in_unknown) or bool(it.desired & unknown))

    # 5. Watermarks, with the projected usage recomputed from scratch after every demotion.
    def projected(i: int, used: int) -> int:
        total = used
        for a in reap_actions:
            if a.tier == names[i]:
                total -= a.bytes
        for it in refs:
            if it.known and i in it.desired and i not in it.known:
                total += it.c.bytes
            if not held(it) and i in it.known and i not in it.desired:
                total -= it.c.bytes
        return total

    ended = {r.name for r in snapshot.runs if r.state is not RunState.ACTIVE}
    for i, spec in enumerate(tiers):
        u = usage.get(spec.name)
        high = spec.policy.high_watermark
        if u is None or high is None or u.total_bytes <= 0 or i in unknown:
            continue
        low = min(spec.policy.low_watermark, high) if spec.policy.low_watermark is not None else high
        if u.fraction <= high and projected(i, u.used_bytes) <= high * u.total_bytes:
            continue
        if i + 1 == len(tiers):
            notes.append(
                f"{spec.name} above high watermark {high:.0%} but it is the last tier: nothing to demote to"
            )
            continue
        if i + 1 in unknown:
            notes.append(
                f"{spec.name} above high watermark {high:.0%} but {names[i + 1]} is unknown: no demotion"
            )
            continue
        if u.fraction > high:
            usage_text = f"usage {u.fraction:.0%}"
        else:
            usage_text = f"projected {projected(i, u.used_bytes) / u.total_bytes:.0%}"
        keep_why = f"demoted: {spec.name} above high watermark {high:.0%}"
        copy_why = f"{spec.name} above high watermark {high:.0%} ({usage_text})"
        oldest_first = sorted(refs, key=lambda it: (it.c.created_at, it.c.step, it.c.run))
        rounds = [
            ([it for it in oldest_first if it.resident == i and not it.protect], copy_why),
            (
                [
                    it
                    for it in oldest_first
                    if it.protect == [NEWEST]
                    and it.c.run in ended
                    and (it.resident == i or (it.resident is None and i in it.desired))
                ],
                f"{copy_why}: newest checkpoint of ended run, moved not deleted",
            ),
        ]
        for candidates, why in rounds:
            for it in candidates:
                if projected(i, u.used_bytes) <= low * u.total_bytes:
                    break
                if held(it) or not it.known:
                    continue  # cannot leave this round, or cannot be copied: frees nothing
                it.desired = (it.desired - {i}) | {i + 1}
                it.resident = i + 1
                it.demotions.append((keep_why, why))
        if projected(i, u.used_bytes) > low * u.total_bytes:
            notes.append(
                f"{spec.name} still above low watermark {low:.0%} after demoting every checkpoint it may"
                " (pinned ones, active runs' newest and parents of active runs stay)"
            )

    # 6. Actions from desired vs actual; keeps with their reasons.
    copies: list[Action] = []
    deletes: list[Action] = []
    keeps: list[Keep] = []
    for it in refs:
        c = it.c
        source = min(it.known) if it.known else None
        for t in sorted(it.desired - it.known - unknown):
            if source is None:
                break
            if t == it.resident:
                parts = []
                if it.rule_tier is not None and it.rule_tier > source:
                    skipped = [
                        f"not in {names[j]} keep-set ({describe(rules[j])})"
                        for j in range(source, it.rule_tier)
                    ]
                    parts.append(
                        ", ".join(
                            [
                                *skipped,
                                f"kept by {names[it.rule_tier]} ({', '.join(it.sels[it.rule_tier] or ())})",
                            ]
                        )
                    )
                parts += [why for _, why in it.demotions]
                reason, rule = "demote: " + "; ".join(parts), "watermark" if it.demotions else "demote"
            else:
                reason, rule = f"replicate to {names[t]} ({', '.join(it.sels[t] or ())})", "replicate"
            copies.append(
                Action(
                    ActionKind.COPY, reason, c.run, c.step, names[source], names[t], c.rel_path, c.bytes, rule
                )
            )
        if not held(it):
            for t in sorted(it.known - it.desired):
                if it.resident is None:
                    reason, rule = EXPIRED, "expired"
                elif t < it.resident:
                    reason, rule = f"moved to {names[it.resident]}", "moved"
                else:
                    reason, rule = f"not kept in {names[t]}: resides in {names[it.resident]}", "redundant"
                deletes.append(
                    Action(
                        ActionKind.DELETE, reason, c.run, c.step, names[t], None, c.rel_path, c.bytes, rule
                    )
                )
        extra = [*it.protect, *reaper_reasons.get(c.key, ())]
        held_in = it.known - it.desired if held(it) else set()
        blocking = ", ".join(names[t] for t in sorted(it.in_unknown | (it.desired & unknown)))
        for t in sorted(it.desired | held_in):
            if t in held_in:
                why_kept = [f"held: {blocking} unknown (listing failed)"]
            else:
                why_kept = list(it.sels[t] or ())
                if t == it.resident and it.demotions:
                    why_kept += [keep for keep, _ in it.demotions]
                elif t == it.resident and not why_kept and it.rule_tier is not None:
                    kept_by = ", ".join(it.sels[it.rule_tier] or ())
                    why_kept.append(
                        f"kept by {names[it.rule_tier]} ({kept_by}); stays in {names[t]}: never promoted"
                    )
                elif t != it.resident and it.resident is not None:
                    why_kept.append("replicate")
                if t in unknown and t not in it.in_unknown:
                    why_kept.append(f"waiting: {names[t]} unknown (listing failed)")
            keeps.append(Keep(c.run, c.step, names[t], tuple(dict.fromkeys([*why_kept, *extra]))))
    for c in live:
        if c.state is not CheckpointState.COMPLETE:
            where = [n for n in names if n in c.tiers] or names[:1]
            why = [INCOMPLETE, *protections_of(c), *reaper_reasons.get(c.key, ())]
            keeps.extend(Keep(c.run, c.step, n, tuple(dict.fromkeys(why))) for n in where)

    if run is not None:
        copies = [a for a in copies if a.run == run]
        deletes = [a for a in deletes if a.run == run]
        reap_actions = [a for a in reap_actions if a.run == run]
        keeps = [k for k in keeps if k.run == run]

    def order(a: Action) -> tuple[object, ...]:
        return (
            a.run or "",
            a.step if a.step is not None else -1,
            pos.get(a.tier or "", len(names)),
            pos.get(a.to_tier or "", -1),
            a.path or "",
            a.upload_id or "",
        )

    copies.sort(key=order)
    deletes.sort(key=order)
    reap_actions.sort(key=order)
    keeps.sort(key=lambda k: (k.run, k.step, pos[k.tier]))

    # 7. Guards: too many deletes, or a policy that can keep nothing, delete nothing without force.
    refused = None
    expired = {(a.run, a.step) for a in deletes if a.rule == "expired"}
    gone = expired | {(a.run, a.step) if a.step is not None else (a.tier, a.path) for a in reap_actions}
    if not force and expired and all(keeps_nothing(r) for r in rules) and rules:
        refused = (
            f"empty policy: no tier's rules can keep any checkpoint, would expire {len(expired)}; use --force"
        )
    elif not force and len(gone) > max_delete:
        refused = f"would delete {len(gone)} checkpoints (max_delete={max_delete}); use --force"
    actions = copies if refused else [*copies, *deletes, *reap_actions]
    reclaim = dict.fromkeys(names, 0)
    for a in actions:
        if a.action is not ActionKind.COPY and a.tier is not None:
            reclaim[a.tier] = reclaim.get(a.tier, 0) + a.bytes
    return Plan(tuple(actions), tuple(keeps), reclaim, refused, tuple(notes))
