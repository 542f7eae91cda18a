"""Steps 2-4 of a plan: keep-sets, residency and desired tiers before watermarks, run by run.

* **Keep-sets**: per tier and per run, the union of the tier's rules
  (:mod:`ckptkeeper.core.retention`) over the run's complete checkpoints.
* **Residency**: a checkpoint resides in the fastest tier whose keep-set holds it (its *rule
  tier*), plus a copy in every slower ``replicate`` tier whose keep-set holds it. The planner never
  *promotes*: a checkpoint whose fastest verified copy is already slower than its rule tier stays
  where it is (promotion would thrash with watermarks and refill the hot disk after an index rebuilt
  from the cold tier; bringing a checkpoint back is ``restore``'s job).
* **Protections**: a protected checkpoint no rule places stays in every tier it currently is in.
  Incomplete checkpoints (writing, corrupt) are kept wherever they are, nothing else.
* **Unknown tiers**: a checkpoint that the index places in an unknown tier, or whose desired tiers
  include one, is *held*: deleted nowhere this round.

Most checkpoints of a large catalog are *plain*: complete, unprotected, nothing from the reaper,
no tier unknown, already exactly in their desired tiers, none of them watched by watermarks. Their
keeps are final at once, from a template cached by placement (the tiers a checkpoint is in plus
why each keep-set holds it), looked up for a whole run with C-level passes. Every other checkpoint
becomes an :class:`Item` that watermarks and the action pass finish.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, eq, not_
from typing import cast

from ckptkeeper.core.keep_reasons import KeepFacts, KeepReasons, TierReasons
from ckptkeeper.core.model import Checkpoint, CheckpointState, Keep, TierSpec
from ckptkeeper.core.reaps import ReaperReasons
from ckptkeeper.core.retention import Rule, RuleSet
from ckptkeeper.core.runs import Protections, RunCheckpoints, protection

__all__ = ["Item", "Locs", "Placer"]

_COMPLETE = CheckpointState.COMPLETE
_NOWHERE: frozenset[int] = frozenset()
_NO_PROTECTION: dict[int, list[str]] = {}
_NOT_PLAIN: TierReasons = ()
_UNSEEN = -1
"""Template id of a placement not cached yet."""
_tiers_of = attrgetter("tiers")
_new_keep = tuple.__new__
"""``Keep(...)`` without the Python-level ``__new__`` of a named tuple (1.4M keeps at 1M: -0.3 s)."""
_new_facts = tuple.__new__

Sels = tuple[tuple[str, ...] | None, ...]
"""Per tier position: the reasons its keep-set holds a checkpoint, or None."""


@dataclass(frozen=True, slots=True, eq=False)
class Locs:
    """Where the index says a checkpoint is, resolved against the configured tiers.

    One instance per tier set (the placer's cache), so identity is equality: compared and hashed
    by identity, cheap as a part of cache keys.
    """

    known: tuple[int, ...]
    """Positions of configured, known tiers holding a verified copy, fastest first."""
    known_set: frozenset[int]
    in_unknown: tuple[int, ...]
    """Positions of configured tiers holding a copy whose listing failed."""


class Item:
    """Planner state for one complete checkpoint that is not plain (it moves, is protected, the
    reaper spared it, a tier involved is watched or unknown)."""

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
        locs: Locs,
        sels: Sels,
        protect: list[str] | None,
        rule_tier: int | None,
        base: int | None,
        desired: frozenset[int],
        hold: bool,
    ) -> None:
        self.ckpt = ckpt
        self.locs = locs
        self.sels = sels
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

    def keep_facts(self, unknown: frozenset[int], reaper_reasons: tuple[str, ...]) -> KeepFacts:
        """What its keep reasons depend on, once watermarks are done."""
        desired = self.desired
        protect = self.protect
        extra = (*protect, *reaper_reasons) if protect else reaper_reasons
        demoted = tuple([keep for keep, _ in self.demoted]) if self.demoted else ()
        if not unknown:
            tiers = tuple(sorted(desired)) if len(desired) > 1 else tuple(desired)
            return _new_facts(  # KeepFacts(...) without the named tuple's Python-level __new__
                KeepFacts,
                (
                    tiers,
                    self.sels,
                    self.resident,
                    self.base,
                    self.rule_tier,
                    demoted,
                    extra,
                    (),
                    (),
                    (),
                    False,
                ),
            )
        locs = self.locs
        held_in: tuple[int, ...] = ()
        blocking: tuple[int, ...] = ()
        if self.hold:
            held_in = tuple(t for t in locs.known if t not in desired)
            blocking = tuple(sorted(set(locs.in_unknown) | (desired & unknown)))
        waiting = tuple(sorted((desired & unknown).difference(locs.in_unknown)))
        return KeepFacts(
            tuple(sorted((*desired, *held_in))),
            self.sels,
            self.resident,
            self.base,
            self.rule_tier,
            demoted,
            extra,
            held_in,
            blocking,
            waiting,
        )


class Placer:
    """Keep-sets, residency and desired tiers before watermarks, run by run (:meth:`place_run`).

    Plain checkpoints' keeps go straight to ``ready``; every other complete checkpoint becomes an
    :class:`Item` in ``items``, its keeps to be spliced into ``ready`` at the position noted in
    ``deferred``. Incomplete checkpoints are kept where they are.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        pos: Mapping[str, int],
        unknown: frozenset[int],
        rules: Sequence[Sequence[Rule]],
        protections: Protections,
        reaper_reasons: ReaperReasons,
        watched: Mapping[int, object],
        keep_reasons: KeepReasons,
        only_run: str | None,
    ) -> None:
        self.names = [t.name for t in tiers]
        self.pos = pos
        self.unknown = unknown
        self._interned: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.rule_sets = [RuleSet(r, self._interned) for r in rules]
        self.protections = protections
        self.reaper_reasons = reaper_reasons
        self.reaper_kept: defaultdict[str, set[int]] = defaultdict(set)
        for run, step in reaper_reasons:
            self.reaper_kept[run].add(step)
        self.watched = frozenset(watched)
        self.keep_reasons = keep_reasons
        self.only_run = only_run
        self.replicas = [t for t in range(len(tiers)) if tiers[t].policy.replicate]

        self.items: list[Item] = []
        """Checkpoints that need planner state, in (run, step) order."""
        self.ready: list[Iterable[Keep]] = []
        """Keeps decided at placement, in output order (only the runs the plan reports), as parts:
        an unevaluated iterator per stretch of plain checkpoints, a list per other checkpoint."""
        self.deferred: list[tuple[int, Item]] = []
        """(position in ``ready``, item): where each reported item's keeps belong."""

        # Caches, all small: as many entries as distinct tier sets, reason tuples or placements.
        self._loc_cache: dict[frozenset[str], Locs] = {}
        self._singles = [frozenset({t}) for t in range(len(tiers))]
        self._with_replica: dict[tuple[frozenset[int], int], frozenset[int]] = {}
        self._plain: dict[_Placement, int] = {}
        """Placement -> template id of its plain keeps (0: not plain); templates by id below."""
        self._counts: list[int] = [0]
        """Per template id: how many keeps (0: not plain); the templates' tiers and reasons below,
        as columns for :meth:`_ready_plain`."""
        self._tier_cols: list[tuple[str, ...]] = [()]
        self._reason_cols: list[tuple[tuple[str, ...], ...]] = [()]

    def place_run(self, run: str, checkpoints: RunCheckpoints) -> None:
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
        for step in protected.keys() | self.reaper_kept.get(run, set()):
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
                    self._ready_incomplete(c)
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
        ``Keep(run, step, tier, reasons)`` per (tier, reasons) of the template.

        Built as four columns zipped into keeps, all C-level passes (no Python frame per keep):
        each step repeated as many times as its template has keeps, the templates' tiers and
        reasons flattened. Most of a big plan's keeps come from here (1M checkpoints: ~1.4M keeps).
        """
        per_template = self._counts.__getitem__
        step_column = chain.from_iterable(map(repeat, steps, map(per_template, ids)))
        tier_column = chain.from_iterable(map(self._tier_cols.__getitem__, ids))
        reason_column = chain.from_iterable(map(self._reason_cols.__getitem__, ids))
        self.ready.append(
            map(_new_keep, repeat(Keep), zip(repeat(run), step_column, tier_column, reason_column))
        )

    def _ready_incomplete(self, c: Checkpoint) -> None:
        """Incomplete checkpoints stay wherever they are (the hot tier, where writes happen, if
        unlisted), with their protections and the reaper's reasons."""
        where = (
            tuple(t for t, name in enumerate(self.names) if name in c.tiers)
            or tuple(range(len(self.names)))[:1]
        )
        why = (*(protection(self.protections, c.run, c.step) or ()), *self.reaper_reasons.get(c.key, ()))
        self.ready.append(
            [
                Keep(c.run, c.step, tier, reasons)
                for tier, reasons in self.keep_reasons(KeepFacts(where, extra=why, incomplete=True))
            ]
        )

    def _template(self, placement: _Placement) -> int:
        """The template id of ``placement`` (cached): 0 if not plain, else the index in
        the template columns of the (tier, reasons) of its keeps (:meth:`_plain_keeps`)."""
        template = self._plain.get(placement, _UNSEEN)
        if template == _UNSEEN:
            where = cast(frozenset[str], placement[0])
            keeps = self._plain_keeps(where, cast(Sels, placement[1:]))
            template = 0
            if keeps:
                template = len(self._counts)
                self._counts.append(len(keeps))
                self._tier_cols.append(tuple(tier for tier, _ in keeps))
                self._reason_cols.append(tuple(reasons for _, reasons in keeps))
            self._plain[placement] = template
        return template

    def _plain_keeps(self, held_in: frozenset[str], sels: Sels) -> TierReasons:
        """(tier, reasons) of each keep of a checkpoint placed like this, if it is plain; else ().

        Plain (for a complete checkpoint nobody protects and the reaper says nothing about): no
        tier is unknown this round, a rule places it in a tier without watermarks, and it already
        is in exactly its desired tiers. Then it resides in its rule tier (a copy in a faster tier
        would not be desired, so it is never-promoted only if it is not plain), watermarks never
        move it (they move residents of watched tiers, and count only checkpoints whose desired
        tiers differ from where they are), and the action pass has no copy or delete for it: its
        keeps are the ones an :class:`Item` placed the same way would get.
        """
        if self.unknown:
            return _NOT_PLAIN
        rule_tier = fastest(sels)
        if rule_tier is None or rule_tier in self.watched:
            return _NOT_PLAIN
        desired = self._desired(rule_tier, sels)
        if desired != self._locs(held_in).known_set:
            return _NOT_PLAIN
        return self.keep_reasons(KeepFacts(tuple(sorted(desired)), sels, rule_tier, rule_tier, rule_tier))

    def _item(self, c: Checkpoint, sels: Sels, protect: list[str] | None) -> Item:
        locs = self._locs(c.tiers)
        rule_tier = fastest(sels)
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
        return Item(c, locs, sels, protect, rule_tier, base, desired, hold)

    def _desired(self, base: int, sels: Sels) -> frozenset[int]:
        """``base`` plus every slower replicate tier whose keep-set holds it (shared sets)."""
        desired = self._singles[base]
        for t in self.replicas:
            if t > base and sels[t] is not None:
                key = (desired, t)
                desired = self._with_replica.get(key) or self._with_replica.setdefault(key, desired | {t})
        return desired

    def _locs(self, tier_names: frozenset[str]) -> Locs:
        locs = self._loc_cache.get(tier_names)
        if locs is None:
            locs = self._loc_cache[tier_names] = _resolve(tier_names, self.pos, self.unknown)
        return locs


_Placement = tuple[object, ...]
"""Where a checkpoint is (its tier names) followed by, per tier, why that tier's keep-set holds it
(None: not in it); flat, so one tuple per checkpoint is built and hashed."""


def _placement(c: Checkpoint, selections: Sequence[Mapping[int, tuple[str, ...]]]) -> _Placement:
    """The placement of one checkpoint, as :meth:`Placer.place_run` builds it in bulk."""
    return (c.tiers, *[sel.get(c.step) for sel in selections])


def fastest(sels: Sequence[tuple[str, ...] | None]) -> int | None:
    """The rule tier: the fastest tier whose keep-set holds the checkpoint."""
    for t, sel in enumerate(sels):
        if sel is not None:
            return t
    return None


def _resolve(tier_names: frozenset[str], pos: Mapping[str, int], unknown: frozenset[int]) -> Locs:
    configured = sorted(pos[n] for n in tier_names if n in pos)
    known = tuple(i for i in configured if i not in unknown)
    return Locs(known, frozenset(known), tuple(i for i in configured if i in unknown))
