"""Step 6 of a plan: actions and keeps from desired vs actual (docs/design.md, "Retention").

Copies go where a checkpoint is desired and absent, from the fastest known tier holding a verified
copy; deletes where it is present and not desired, unless it is held (an unknown tier is involved).
Every copy and delete says why; keeps come from :mod:`ckptkeeper.core.keep_reasons`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptkeeper.core.keep_reasons import REPLICATE, KeepReasons
from ckptkeeper.core.model import Action, ActionKind, Keep
from ckptkeeper.core.placement import Item
from ckptkeeper.core.reaps import ReaperReasons
from ckptkeeper.core.retention import Rule, describe
from ckptkeeper.core.watermarks import HEADROOM

__all__ = ["EXPIRED", "emit"]

EXPIRED = "expired: no tier keeps it"

_COPY = ActionKind.COPY
_DELETE = ActionKind.DELETE
_new_keep = tuple.__new__


def emit(
    ready: list[Iterable[Keep]],
    deferred: Sequence[tuple[int, Item]],
    names: Sequence[str],
    rules: Sequence[Sequence[Rule]],
    unknown: frozenset[int],
    reaper_reasons: ReaperReasons,
    keep_reasons: KeepReasons,
) -> tuple[list[Action], list[Action], list[Iterable[Keep]]]:
    """Copies, deletes and keeps, each already in output order: (run, step, tier position,
    destination position); each deferred item's keeps between the ``ready`` parts placed before
    and after it. Keeps come back as parts (for :class:`ckptkeeper.core.model.Keeps`): the
    ``ready`` parts, still unevaluated, with a list of each item's keeps spliced in between."""
    if not deferred:
        return [], [], ready
    described = [describe(r) for r in rules]
    demote_reasons: dict[tuple[object, ...], tuple[str, str]] = {}
    copies: list[Action] = []
    deletes: list[Action] = []
    keeps: list[Iterable[Keep]] = []
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
                    reason, rule = f"replicate to {names[t]} ({', '.join(it.sels[t] or ())})", REPLICATE
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
        reasons = reaper_reasons.get(c.key, ()) if reaper_reasons else ()
        keeps.append(
            [
                _new_keep(Keep, (c.run, c.step, tier, why_kept))
                for tier, why_kept in keep_reasons(it.keep_facts(unknown, reasons))
            ]
        )
    keeps.extend(ready[done:])
    return copies, deletes, keeps


def _demote_reason(it: Item, names: Sequence[str], described: Sequence[str]) -> tuple[str, str]:
    """Why a checkpoint moves from its fastest copy down to where it resides, e.g.
    ``demote: not in hot keep-set (last 2), kept by warm (last 5)``. Reads only the fastest copy,
    the rule tier, its reasons and the demotions (what :func:`emit` caches it by)."""
    source = it.locs.known[0]
    parts: list[str] = []
    rule_tier = it.rule_tier
    if rule_tier is not None and rule_tier > source:
        skipped = [f"not in {names[j]} keep-set ({described[j]})" for j in range(source, rule_tier)]
        kept_by = f"kept by {names[rule_tier]} ({', '.join(it.sels[rule_tier] or ())})"
        parts.append(", ".join([*skipped, kept_by]))
    parts.extend(copy_reason for _, copy_reason in it.demoted)
    if not it.demoted:
        return "demote: " + "; ".join(parts), "demote"
    # The last demotion says what moved it this far: the watermark, or headroom for the next saves.
    rule = HEADROOM if it.demoted[-1][1].startswith(HEADROOM) else "watermark"
    return "demote: " + "; ".join(parts), rule
