"""Retention rules of docs/design.md, "Retention": one tiny object per rule, composed by union.

Each rule looks at the checkpoints of **one run**, sorted by step, and says which of them it keeps
and why (a human string that ``prune --dry-run`` prints verbatim, as restic's ``forget`` does).
Rules know nothing about tiers, disks or protections; the planner decides what a selection means.

Shared conventions, so every rule behaves the same way:

* Only ``complete`` checkpoints count. A partial or corrupt checkpoint neither is selected nor takes
  a slot (``keep_last 2`` keeps the two newest *complete* ones); the planner protects those anyway.
* "Newest" means the highest step: steps order numerically, never by name or mtime (docs/design.md, "Domain model").
  Time only enters through ``created_at`` for ``keep_within`` and the calendar buckets.
* Selections are keyed by step (the input is one run) and map to the rule's reason.

For the planner, which applies every tier's rules to every run of the catalog, rules also answer
from a :class:`RunHistory` (one run's complete checkpoints and the columns rules read: steps,
creation times, a metric, each read once per run and shared by every tier's rules) with just the
steps they keep, and a :class:`RuleSet` merges a tier's answers with set operations. A million
checkpoints then cost a few C-level passes per column rather than Python loops per rule.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import compress, islice, repeat
from operator import add, attrgetter, ge, le, truediv
from typing import Protocol, TypeGuard

from ckptkeeper.core.model import Checkpoint, CheckpointState, TierPolicy
from ckptkeeper.util.fmt import format_duration  # re-exported: the one duration formatter

__all__ = [
    "KeepAll",
    "KeepBest",
    "KeepDaily",
    "KeepEvery",
    "KeepHourly",
    "KeepLast",
    "KeepMonthly",
    "KeepWeekly",
    "KeepWithin",
    "Rule",
    "RuleSet",
    "RunHistory",
    "describe",
    "format_duration",
    "keeps_nothing",
    "rules_for",
    "select_union",
]

_COMPLETE = CheckpointState.COMPLETE
_step_of = attrgetter("step")
_created_at_of = attrgetter("created_at")
_metrics_of = attrgetter("metrics")


class RunHistory:
    """The complete checkpoints of one run, sorted by step, and the columns rules read.

    Built once per run and shared by every tier's rules: each column is read from the checkpoints
    once (and only if some rule needs it), with C-level ``map``s instead of a Python loop per rule.
    """

    __slots__ = ("_created_at", "_metrics", "_times_ordered", "checkpoints", "steps")

    def __init__(self, complete: Sequence[Checkpoint], steps: list[int] | None = None) -> None:
        """``complete``: one run's complete checkpoints sorted by step; ``steps``: their steps, if known."""
        self.checkpoints = complete
        self.steps: list[int] = list(map(_step_of, complete)) if steps is None else steps
        self._created_at: list[float] | None = None
        self._times_ordered: bool | None = None
        self._metrics: dict[str, list[object]] = {}

    @classmethod
    def of(cls, checkpoints: Iterable[Checkpoint]) -> RunHistory:
        """From one run's checkpoints sorted by step, whatever their state."""
        return cls([c for c in checkpoints if c.state is _COMPLETE])

    @property
    def created_at(self) -> list[float]:
        if self._created_at is None:
            self._created_at = list(map(_created_at_of, self.checkpoints))
        return self._created_at

    @property
    def times_ordered(self) -> bool:
        """True when ``created_at`` is finite and never decreases with the step (the usual run).

        Then every rule that asks a monotone question of the creation time (``>= cutoff``, which
        UTC hour, day or week) finds where the answer changes by bisection instead of asking each
        checkpoint, and gets the same answer: no NaN or infinity can hide among values between two
        finite bounds.
        """
        if self._times_ordered is None:
            t = self.created_at
            self._times_ordered = not t or (
                math.isfinite(t[0]) and math.isfinite(t[-1]) and all(map(le, t, islice(t, 1, None)))
            )
        return self._times_ordered

    def metric(self, name: str) -> list[object]:
        """The value of metric ``name`` per checkpoint (None where it is missing), as recorded."""
        values = self._metrics.get(name)
        if values is None:
            values = self._metrics[name] = [m.get(name) for m in map(_metrics_of, self.checkpoints)]
        return values


class Rule(Protocol):
    """A retention rule: which checkpoints of one run it keeps, and why."""

    @property
    def reason(self) -> str:
        """Why a selected checkpoint is kept, e.g. ``"last 2"``; also describes the rule itself."""
        ...

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        """Map step -> reason for the checkpoints kept; input is one run sorted by step."""
        ...

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        """The steps of the checkpoints kept (each once, in any order), from a :class:`RunHistory`."""
        ...


class _SelectsFromHistory:
    """``Rule.select`` for the rules below, which all implement ``kept_steps``."""

    __slots__ = ()

    @property
    def reason(self) -> str:
        raise NotImplementedError

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        return dict.fromkeys(self.kept_steps(RunHistory.of(checkpoints)), self.reason)

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class KeepAll(_SelectsFromHistory):
    """What a tier without rules does: keep everything (docs/design.md, "Retention" "No rule = keep all")."""

    @property
    def reason(self) -> str:
        return "no rules: keep all"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        return run.steps


@dataclass(frozen=True, slots=True)
class KeepLast(_SelectsFromHistory):
    """The ``n`` newest complete checkpoints (by step)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_last must be >= 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"last {self.n}"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        return run.steps[-self.n :] if self.n else ()


@dataclass(frozen=True, slots=True)
class KeepBest(_SelectsFromHistory):
    """The ``n`` best complete checkpoints by ``metric`` (``mode`` min or max).

    A checkpoint without the metric (or with NaN) is never "best" and does not take a slot: it is
    not ranked last either, so its fate is left to the other rules ("not punished"). Ties prefer the
    newer step, so the choice is deterministic.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_best must be >= 0, got {self.n}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    @property
    def reason(self) -> str:
        return f"best {self.n} by {self.metric} ({self.mode})"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        if self.n == 0:
            return ()
        values = run.metric(self.metric)
        if _plain_floats(values):
            # Fast path, same choice: the values are already the floats the general path would
            # compare, and walking newest first with a stable selection prefers the newer step on
            # ties exactly as its (value, -step) key does.
            newest_first = range(len(values) - 1, -1, -1)
            pick = heapq.nsmallest if self.mode == "min" else heapq.nlargest
            return list(map(run.steps.__getitem__, pick(self.n, newest_first, key=values.__getitem__)))
        sign = 1.0 if self.mode == "min" else -1.0
        scored: list[tuple[float, int]] = []
        for step, value in zip(run.steps, values, strict=True):
            if value is None:
                continue
            try:
                v = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                continue
            if math.isnan(v):
                continue
            scored.append((sign * v, -step))
        return [-neg_step for _, neg_step in heapq.nsmallest(self.n, scored)]


def _plain_floats(values: list[object]) -> TypeGuard[list[float]]:
    """True when every value is a float (not a subclass, not None) and none is NaN."""
    return set(map(type, values)) <= {float} and not any(map(math.isnan, values))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class KeepEvery(_SelectsFromHistory):
    """Complete checkpoints whose step is a multiple of ``n`` (milestones such as every 10k steps)."""

    n: int

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"keep_every must be > 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"every {self.n} steps"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        n = self.n
        return [step for step in run.steps if step % n == 0]


@dataclass(frozen=True, slots=True)
class KeepWithin(_SelectsFromHistory):
    """Complete checkpoints created at most ``seconds`` before ``now``.

    Unlike restic (which measures from the newest snapshot) the window is anchored at ``now``,
    passed in so the rule stays pure and testable.
    """

    seconds: float
    now: float

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError(f"keep_within must be >= 0, got {self.seconds}")

    @property
    def reason(self) -> str:
        return f"within {format_duration(self.seconds)}"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        cutoff = self.now - self.seconds
        if run.times_ordered and cutoff == cutoff:  # not NaN: then ">= cutoff" is monotone
            return run.steps[bisect_left(run.created_at, cutoff) :]
        recent = map(ge, run.created_at, repeat(cutoff))  # created_at >= cutoff
        return list(compress(run.steps, recent))


def _day(ts: float) -> int:
    return math.floor(ts / 86400)


def _hour(ts: float) -> int:
    return math.floor(ts / 3600)


def _iso_week(ts: float) -> int:
    return math.floor((math.floor(ts / 86400) + 3) / 7)


def _hours(times: Iterable[float]) -> Iterator[int]:
    return map(math.floor, map(truediv, times, repeat(3600)))


def _days(times: Iterable[float]) -> Iterator[int]:
    return map(math.floor, map(truediv, times, repeat(86400)))


def _iso_weeks(times: Iterable[float]) -> Iterator[int]:
    # Monday-based weeks in UTC, like ISO 8601 / restic's ISOWeek: 1970-01-01 was a Thursday,
    # so shifting by 3 days puts every Monday on a multiple of 7.
    return map(math.floor, map(truediv, map(add, _days(times), repeat(3)), repeat(7)))


def _month(ts: float) -> int:
    try:
        d = datetime.fromtimestamp(ts, UTC)
    except (OverflowError, OSError, ValueError):
        return _day(ts) // 31  # absurd timestamps still land in some deterministic bucket
    return d.year * 12 + d.month - 1


def _months(times: Iterable[float]) -> Iterator[int]:
    return map(_month, times)


@dataclass(frozen=True, slots=True)
class _KeepCalendar(_SelectsFromHistory):
    """The newest complete checkpoint (highest step) of each of the ``n`` most recent UTC buckets.

    Buckets are computed from ``created_at``; the representative of a bucket is its highest step, so
    the result does not depend on clocks being monotonic across a resumed run. Unlike restic/borg we
    do not additionally keep the oldest checkpoint when fewer than ``n`` buckets exist: the run's
    other rules (and the planner's newest-checkpoint protection) already cover short histories.
    """

    n: int
    kind: str
    buckets: Callable[[Iterable[float]], Iterator[int]]
    """Bucket of each creation time, in order."""

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_{self.kind} must be >= 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"{self.kind} snapshot"

    def kept_steps(self, run: RunHistory) -> Collection[int]:
        if self.n == 0:
            return ()
        bucket = _MONOTONE_BUCKET.get(self.buckets)
        if bucket is not None and run.times_ordered:
            return _newest_per_bucket(run, self.n, bucket)
        # Steps ascend, so a later (higher) step overwrites an earlier one of the same bucket.
        newest = dict(zip(self.buckets(run.created_at), run.steps, strict=True))
        return list(map(newest.__getitem__, heapq.nlargest(self.n, newest)))


_MONOTONE_BUCKET: dict[Callable[[Iterable[float]], Iterator[int]], Callable[[float], int]] = {
    _hours: _hour,
    _days: _day,
    _iso_weeks: _iso_week,
}
"""Bucketings that never decrease with time, and the bucket of one time, computed the same way.
Not months: absurd timestamps fall back to another bucketing (:func:`_month`)."""


def _newest_per_bucket(run: RunHistory, n: int, bucket: Callable[[float], int]) -> list[int]:
    """What ``_KeepCalendar.kept_steps`` returns, for ``run.times_ordered`` and a monotone ``bucket``.

    Buckets then never decrease with the step: the newest step of the newest bucket is the last,
    the newest of the bucket before is the one just before the first of that bucket (found by
    bisection), and so on, newest bucket first like ``heapq.nlargest``. Only a few buckets per run
    get computed instead of one per checkpoint.
    """
    times, steps = run.created_at, run.steps
    kept: list[int] = []
    end = len(times)
    while end and len(kept) < n:
        kept.append(steps[end - 1])
        end = bisect_left(times, bucket(times[end - 1]), 0, end - 1, key=bucket)
    return kept


# Calendar rules share one implementation; these factories read like the other rule classes.
def KeepHourly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "hourly", _hours)


def KeepDaily(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "daily", _days)


def KeepWeekly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "weekly", _iso_weeks)


def KeepMonthly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "monthly", _months)


def rules_for(policy: TierPolicy, now: float) -> list[Rule]:
    """The rules of one tier's policy, in a fixed order; no rule at all means keep everything.

    Raises ValueError for a policy the rules cannot honour (``keep_best`` without ``metric``):
    config validation should have caught it, and guessing here could delete the wrong thing.
    """
    rules: list[Rule] = []
    if policy.keep_last is not None:
        rules.append(KeepLast(policy.keep_last))
    if policy.keep_best is not None:
        if not policy.metric:
            raise ValueError("keep_best needs a metric")
        rules.append(KeepBest(policy.keep_best, policy.metric, policy.mode))
    if policy.keep_every is not None:
        rules.append(KeepEvery(policy.keep_every))
    if policy.keep_within is not None:
        rules.append(KeepWithin(policy.keep_within, now))
    if policy.keep_hourly is not None:
        rules.append(KeepHourly(policy.keep_hourly))
    if policy.keep_daily is not None:
        rules.append(KeepDaily(policy.keep_daily))
    if policy.keep_weekly is not None:
        rules.append(KeepWeekly(policy.keep_weekly))
    if policy.keep_monthly is not None:
        rules.append(KeepMonthly(policy.keep_monthly))
    if not rules:
        rules.append(KeepAll())
    return rules


def select_union(rules: Iterable[Rule], checkpoints: Sequence[Checkpoint]) -> dict[int, tuple[str, ...]]:
    """Union of the rules' selections: step -> every reason that kept it, in rule order."""
    return RuleSet(rules).select(RunHistory.of(checkpoints))


class RuleSet:
    """One tier's rules, applied run after run (what :func:`select_union` does, for many runs).

    Reasons are computed once, and equal reason tuples are shared through ``interned`` (pass one
    dict for a whole plan): there are only as many distinct ones as rule combinations, so a million
    kept checkpoints do not cost a million small tuples, and equal tuples are the same object.
    """

    def __init__(
        self, rules: Iterable[Rule], interned: dict[tuple[str, ...], tuple[str, ...]] | None = None
    ) -> None:
        self.rules = list(rules)
        self._interned = {} if interned is None else interned
        self._alone = [self._intern((rule.reason,)) for rule in self.rules]

    def select(self, run: RunHistory) -> dict[int, tuple[str, ...]]:
        """Step -> every reason that kept it, in rule order.

        Merged with set operations: a step only one rule keeps gets that rule's shared 1-tuple,
        and only steps several rules keep (a few per run) get a tuple built one by one.
        """
        out: dict[int, tuple[str, ...]] = {}
        for rule, alone in zip(self.rules, self._alone, strict=True):
            kept = rule.kept_steps(run)
            if not out:
                out = dict.fromkeys(kept, alone)
                continue
            both = {step: self._intern((*out[step], *alone)) for step in out.keys() & kept}
            out.update(dict.fromkeys(kept, alone))
            out.update(both)
        return out

    def _intern(self, reasons: tuple[str, ...]) -> tuple[str, ...]:
        return self._interned.setdefault(reasons, reasons)


def describe(rules: Iterable[Rule]) -> str:
    """One-line summary of a rule set, e.g. ``last 2, best 1 by eval_loss (min)``."""
    return ", ".join(rule.reason for rule in rules)


def keeps_nothing(rules: Iterable[Rule]) -> bool:
    """True when the rules can never select anything (every count is 0): an "empty policy" trap."""
    for rule in rules:
        if isinstance(rule, KeepAll | KeepEvery):
            return False
        if isinstance(rule, KeepWithin):
            if rule.seconds > 0:
                return False
            continue
        n = getattr(rule, "n", None)
        if n is None or n > 0:
            return False
    return True
