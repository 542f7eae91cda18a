"""Keep reasons (restic's ``KeepReason``): why a checkpoint stays in each tier it stays in.

One builder, :func:`keep_reasons`, for every checkpoint of a plan: plain ones placed by rules alone,
moved, replicated, demoted, protected, held and incomplete ones. The facts it reads form one
hashable :class:`KeepFacts`, so checkpoints with equal facts share one result (:class:`KeepReasons`
caches it): a million plain checkpoints have a handful of distinct facts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["INCOMPLETE", "REPLICATE", "KeepFacts", "KeepReasons", "TierReasons", "keep_reasons", "unique"]

INCOMPLETE = "incomplete: never touched"
REPLICATE = "replicate"

TierReasons = tuple[tuple[str, tuple[str, ...]], ...]
"""(tier name, reasons) of each keep of one checkpoint, in tier order."""


class KeepFacts(NamedTuple):
    """Everything a checkpoint's keep reasons depend on; tiers are positions, fastest first."""

    tiers: tuple[int, ...]
    """Every tier it is kept in, in order: desired ones and the ones a held checkpoint stays in."""
    sels: tuple[tuple[str, ...] | None, ...] = ()
    """Per tier: the reasons its keep-set holds the checkpoint (None: not in it)."""
    resident: int | None = None
    """Where it resides after watermarks (None: expired, or protected with no rule placing it)."""
    base: int | None = None
    """Where it resides before watermarks: the rule tier, or its fastest copy (never promoted)."""
    rule_tier: int | None = None
    """The fastest tier whose keep-set holds it."""
    demoted: tuple[str, ...] = ()
    """The keep reason of each watermark demotion it went through."""
    extra: tuple[str, ...] = ()
    """Said in every tier: protections, then the reaper's reasons."""
    held_in: tuple[int, ...] = ()
    """Tiers a held checkpoint stays in though not desired there (no delete this round)."""
    blocking: tuple[int, ...] = ()
    """The unknown tiers that hold it back (when ``held_in`` or held at all)."""
    waiting: tuple[int, ...] = ()
    """Desired tiers that are unknown this round and hold no copy of it."""
    incomplete: bool = False
    """Not complete (writing, corrupt): kept in ``tiers`` untouched, whatever the rules say."""


def keep_reasons(facts: KeepFacts, names: Sequence[str]) -> TierReasons:
    """(tier name, reasons) for each tier in ``facts.tiers``, reasons in first-seen order:

    * incomplete: ``incomplete: never touched``;
    * a tier a held checkpoint stays in: ``held: <unknown tiers> unknown (listing failed)``;
    * its residence: the residence's own rule reasons, then the demotions that brought it there,
      or, if it already sits slower than its rule tier, ``kept by <tier> (...); stays in <tier>:
      never promoted``;
    * a replica: the replica tier's rule reasons, then ``replicate``;
    * a desired tier that is unknown now and holds no copy: ``waiting: <tier> unknown ...``;

    each followed by ``facts.extra`` (protections and reaper reasons).
    """
    extra = facts.extra
    if facts.incomplete:
        reasons = unique((INCOMPLETE, *extra))
        return tuple((names[t], reasons) for t in facts.tiers)
    held = ""
    if facts.blocking:
        held = f"held: {', '.join(names[i] for i in facts.blocking)} unknown (listing failed)"
    sels, resident = facts.sels, facts.resident
    out: list[tuple[str, tuple[str, ...]]] = []
    for t in facts.tiers:
        if t in facts.held_in:
            out.append((names[t], unique((held, *extra))))
            continue
        why: list[str] = list(sels[t] or ())
        if t == resident:
            rule_tier = facts.rule_tier
            if t != facts.base:
                why.extend(facts.demoted)
            elif not why and rule_tier is not None and rule_tier != t:
                kept_by = ", ".join(sels[rule_tier] or ())
                why.append(f"kept by {names[rule_tier]} ({kept_by}); stays in {names[t]}: never promoted")
        elif resident is not None:
            why.append(REPLICATE)
        if t in facts.waiting:
            why.append(f"waiting: {names[t]} unknown (listing failed)")
        out.append((names[t], unique((*why, *extra))))
    return tuple(out)


class KeepReasons:
    """:func:`keep_reasons` for one plan's tiers, cached by facts (one instance per plan)."""

    __slots__ = ("_cache", "names")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = names
        self._cache: dict[KeepFacts, TierReasons] = {}

    def __call__(self, facts: KeepFacts) -> TierReasons:
        reasons = self._cache.get(facts)
        if reasons is None:
            reasons = self._cache[facts] = keep_reasons(facts, self.names)
        return reasons


def unique(reasons: Sequence[str]) -> tuple[str, ...]:
    """Reasons in first-seen order without repeats (the reaper and the planner both say "pinned")."""
    return tuple(dict.fromkeys(reasons))
