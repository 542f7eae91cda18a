"""Retention rules of DESIGN §3: one tiny object per rule, composed by union.

Each rule looks at the checkpoints of **one run**, sorted by step, and says which of them it keeps
and why (a human string that ``prune --dry-run`` prints verbatim, as restic's ``forget`` does).
Rules know nothing about tiers, disks or protections; the planner decides what a selection means.

Shared conventions, so every rule behaves the same way:

* Only ``complete`` checkpoints count. A partial or corrupt checkpoint neither is selected nor takes
  a slot (``keep_last 2`` keeps the two newest *complete* ones); the planner protects those anyway.
* "Newest" means the highest step: steps order numerically, never by name or mtime (DESIGN §2).
  Time only enters through ``created_at`` for ``keep_within`` and the calendar buckets.
* Selections are keyed by step (the input is one run) and map to the rule's reason.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from ckptkeeper.model import Checkpoint, CheckpointState, TierPolicy

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
    "describe",
    "format_duration",
    "keeps_nothing",
    "rules_for",
    "select_union",
]

_COMPLETE = CheckpointState.COMPLETE


class Rule(Protocol):
    """A retention rule: which checkpoints of one run it keeps, and why."""

    @property
    def reason(self) -> str:
        """Why a selected checkpoint is kept, e.g. ``"last 2"``; also describes the rule itself."""
        ...

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        """Map step -> reason for the checkpoints kept; input is one run sorted by step."""
        ...


def format_duration(seconds: float) -> str:
    """Compact human duration as written in config files: ``7d``, ``1d12h``, ``90s`` → ``1m30s``."""
    if seconds < 0 or not math.isfinite(seconds):
        return f"{seconds}s"
    whole = int(seconds)
    frac = seconds - whole
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    if whole or frac or not parts:
        parts.append(f"{whole + frac:g}s")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class KeepAll:
    """What a tier without rules does: keep everything (DESIGN §3 "No rule = keep all")."""

    @property
    def reason(self) -> str:
        return "no rules: keep all"

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        reason = self.reason
        return {c.step: reason for c in checkpoints if c.state is _COMPLETE}


@dataclass(frozen=True, slots=True)
class KeepLast:
    """The ``n`` newest complete checkpoints (by step)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_last must be >= 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"last {self.n}"

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        # Walk from the newest end and stop early: O(n) only in the number kept (plus partials).
        out: dict[int, str] = {}
        if self.n == 0:
            return out
        reason = self.reason
        for c in reversed(checkpoints):
            if c.state is _COMPLETE:
                out[c.step] = reason
                if len(out) >= self.n:
                    break
        return out


@dataclass(frozen=True, slots=True)
class KeepBest:
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

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        if self.n == 0:
            return {}
        sign = 1.0 if self.mode == "min" else -1.0
        metric = self.metric
        scored: list[tuple[float, int]] = []
        for c in checkpoints:
            if c.state is not _COMPLETE:
                continue
            value = c.metrics.get(metric)
            if value is None:
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                continue
            if math.isnan(v):
                continue
            scored.append((sign * v, -c.step))
        reason = self.reason
        return {-neg_step: reason for _, neg_step in heapq.nsmallest(self.n, scored)}


@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Complete checkpoints whose step is a multiple of ``n`` (milestones such as every 10k steps)."""

    n: int

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"keep_every must be > 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"every {self.n} steps"

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        n = self.n
        reason = self.reason
        return {c.step: reason for c in checkpoints if c.step % n == 0 and c.state is _COMPLETE}


@dataclass(frozen=True, slots=True)
class KeepWithin:
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

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        cutoff = self.now - self.seconds
        reason = self.reason
        return {c.step: reason for c in checkpoints if c.created_at >= cutoff and c.state is _COMPLETE}


def _hour(ts: float) -> int:
    return math.floor(ts / 3600)


def _day(ts: float) -> int:
    return math.floor(ts / 86400)


def _iso_week(ts: float) -> int:
    # Monday-based weeks in UTC, like ISO 8601 / restic's ISOWeek: 1970-01-01 was a Thursday,
    # so shifting by 3 days puts every Monday on a multiple of 7.
    return math.floor((_day(ts) + 3) / 7)


def _month(ts: float) -> int:
    try:
        d = datetime.fromtimestamp(ts, UTC)
    except (OverflowError, OSError, ValueError):
        return _day(ts) // 31  # absurd timestamps still land in some deterministic bucket
    return d.year * 12 + d.month - 1


@dataclass(frozen=True, slots=True)
class _KeepCalendar:
    """The newest complete checkpoint (highest step) of each of the ``n`` most recent UTC buckets.

    Buckets are computed from ``created_at``; the representative of a bucket is its highest step, so
    the result does not depend on clocks being monotonic across a resumed run. Unlike restic/borg we
    do not additionally keep the oldest checkpoint when fewer than ``n`` buckets exist: the run's
    other rules (and the planner's newest-checkpoint protection) already cover short histories.
    """

    n: int
    kind: str
    bucket: Callable[[float], int]

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_{self.kind} must be >= 0, got {self.n}")

    @property
    def reason(self) -> str:
        return f"{self.kind} snapshot"

    def select(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        if self.n == 0:
            return {}
        bucket = self.bucket
        newest: dict[int, int] = {}
        for c in reversed(checkpoints):  # highest step first: the first one seen wins its bucket
            if c.state is _COMPLETE:
                newest.setdefault(bucket(c.created_at), c.step)
        reason = self.reason
        recent = heapq.nlargest(self.n, newest)
        return {newest[b]: reason for b in recent}


# Calendar rules share one implementation; these factories read like the other rule classes.
def KeepHourly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "hourly", _hour)


def KeepDaily(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "daily", _day)


def KeepWeekly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "weekly", _iso_week)


def KeepMonthly(n: int) -> _KeepCalendar:
    return _KeepCalendar(n, "monthly", _month)


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
    """Union of the rules' selections: step -> every reason that kept it, in rule order.

    Equal reason tuples are shared (there are only as many distinct ones as rule combinations), so
    a million kept checkpoints do not cost a million small tuples.
    """
    out: dict[int, tuple[str, ...]] = {}
    interned: dict[tuple[str, ...], tuple[str, ...]] = {}
    for rule in rules:
        for step, reason in rule.select(checkpoints).items():
            prev = out.get(step)
            reasons = (reason,) if prev is None else (*prev, reason)
            out[step] = interned.setdefault(reasons, reasons)
    return out


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
