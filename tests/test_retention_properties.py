"""Hypothesis: every retention rule keeps exactly what its plain definition says.

The rules answer from per-run columns with C-level passes and fast paths (``KeepBest`` on plain
floats, calendar buckets mapped over a column, ``RuleSet`` merging with set operations). The
oracles below are the definitions written the slow, obvious way, one checkpoint at a time; any
shortcut that changes a selection or the order of a checkpoint's reasons fails here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkeeper.core.model import Checkpoint, CheckpointState
from ckptkeeper.core.retention import (
    KeepAll,
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepHourly,
    KeepLast,
    KeepMonthly,
    KeepWeekly,
    KeepWithin,
    Rule,
    select_union,
)

T0 = 1_709_510_400.0
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

metric_values = st.one_of(
    st.floats(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.sampled_from(["1.5", "not a number", None]),
)


@st.composite
def runs(draw: st.DrawFn) -> list[Checkpoint]:
    """One run sorted by step: mixed states, metrics of every shape, clocks that may go backwards."""
    steps = sorted(draw(st.lists(st.integers(1, 60), max_size=25, unique=True)))
    floats_only = draw(st.booleans())  # half the runs take KeepBest's fast path
    out = []
    for step in steps:
        metrics: dict[str, object] = {}
        if floats_only:
            metrics["loss"] = draw(st.floats(0, 3, allow_nan=False))
        elif draw(st.booleans()):
            metrics["loss"] = draw(metric_values)
        out.append(
            Checkpoint(
                run="r",
                step=step * 100,
                name=f"checkpoint-{step * 100}",
                layout="hf",
                state=draw(st.sampled_from([CheckpointState.COMPLETE] * 5 + list(CheckpointState))),
                created_at=T0
                + draw(st.sampled_from([step * 1800.0, step * 40000.0, 0.0]))
                + draw(st.floats(-90000, 90000)),
                metrics=metrics,  # type: ignore[arg-type]
            )
        )
    return out


# --------------------------------------------------------------------------- oracles


def _complete(cps: Sequence[Checkpoint]) -> list[Checkpoint]:
    return [c for c in cps if c.state is CheckpointState.COMPLETE]


def oracle_last(n: int, cps: Sequence[Checkpoint]) -> set[int]:
    return {c.step for c in _complete(cps)[-n:]} if n else set()


def oracle_best(n: int, mode: str, cps: Sequence[Checkpoint]) -> set[int]:
    scored = []
    for c in _complete(cps):
        value = c.metrics.get("loss")
        try:
            v = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if not math.isnan(v):
            scored.append(((v if mode == "min" else -v), -c.step))
    return {-neg_step for _, neg_step in heapq.nsmallest(n, scored)}


def oracle_calendar(n: int, bucket: Callable[[float], int], cps: Sequence[Checkpoint]) -> set[int]:
    newest: dict[int, int] = {}
    for c in _complete(cps):
        newest[bucket(c.created_at)] = max(newest.get(bucket(c.created_at), c.step), c.step)
    return {newest[b] for b in sorted(newest, reverse=True)[:n]}


def _month(ts: float) -> int:
    d = datetime.fromtimestamp(ts, UTC)
    return d.year * 12 + d.month - 1


BUCKETS: dict[str, Callable[[float], int]] = {
    "hourly": lambda ts: math.floor(ts / 3600),
    "daily": lambda ts: math.floor(ts / 86400),
    "weekly": lambda ts: math.floor((math.floor(ts / 86400) + 3) / 7),
    "monthly": _month,
}
CALENDAR = {"hourly": KeepHourly, "daily": KeepDaily, "weekly": KeepWeekly, "monthly": KeepMonthly}


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(runs(), st.integers(0, 4), st.sampled_from([100, 200, 300, 700]), st.floats(0, 4e5))
def test_count_step_and_time_rules_match_their_definitions(
    cps: list[Checkpoint], n: int, every: int, within: float
) -> None:
    complete = _complete(cps)
    assert KeepLast(n).select(cps) == dict.fromkeys(oracle_last(n, cps), f"last {n}")
    assert KeepAll().select(cps).keys() == {c.step for c in complete}
    assert set(KeepEvery(every).select(cps)) == {c.step for c in complete if c.step % every == 0}
    now = T0 + 2e5
    assert set(KeepWithin(within, now).select(cps)) == {
        c.step for c in complete if c.created_at >= now - within
    }


@SETTINGS
@given(runs(), st.integers(0, 4), st.sampled_from(["min", "max"]))
def test_keep_best_matches_its_definition_on_every_kind_of_value(
    cps: list[Checkpoint], n: int, mode: str
) -> None:
    assert set(KeepBest(n, "loss", mode).select(cps)) == oracle_best(n, mode, cps)


@SETTINGS
@given(runs(), st.integers(0, 5), st.sampled_from(sorted(BUCKETS)))
def test_calendar_rules_match_their_definition(cps: list[Checkpoint], n: int, kind: str) -> None:
    assert set(CALENDAR[kind](n).select(cps)) == oracle_calendar(n, BUCKETS[kind], cps)


@SETTINGS
@given(runs(), st.lists(st.integers(0, 6), min_size=1, max_size=5))
def test_union_lists_every_reason_in_rule_order(cps: list[Checkpoint], picks: list[int]) -> None:
    menu: list[Rule] = [
        KeepLast(2),
        KeepBest(1, "loss"),
        KeepEvery(200),
        KeepWithin(86400, T0 + 1e5),
        KeepDaily(3),
        KeepHourly(2),
        KeepAll(),
    ]
    rules = [menu[i] for i in picks]
    expected: dict[int, tuple[str, ...]] = {}
    for rule in rules:
        for step in rule.select(cps):
            expected[step] = (*expected.get(step, ()), rule.reason)
    assert select_union(rules, cps) == expected


@st.composite
def ordered_runs(draw: st.DrawFn) -> list[Checkpoint]:
    """One run whose clock never goes backwards (the bisection fast path of time rules), with
    times often exactly on hour, day and week boundaries, before and after the epoch."""
    count = draw(st.integers(0, 25))
    base = draw(st.sampled_from([T0, 0.0, -86400.0 * 10, 345600.0]))  # 345600: a Monday 00:00
    gaps = draw(
        st.lists(
            st.one_of(
                st.sampled_from([0.0, 1.0, 3599.0, 3600.0, 86400.0, 86399.5, 604800.0]),
                st.floats(0, 3e5),
            ),
            min_size=count,
            max_size=count,
        )
    )
    out = []
    created = base
    for i, gap in enumerate(gaps):
        created += gap
        out.append(
            Checkpoint(
                run="r",
                step=(i + 1) * 100,
                name=f"checkpoint-{(i + 1) * 100}",
                layout="hf",
                state=draw(st.sampled_from([CheckpointState.COMPLETE] * 5 + list(CheckpointState))),
                created_at=created,
            )
        )
    return out


@SETTINGS
@given(ordered_runs(), st.integers(0, 5), st.sampled_from(sorted(BUCKETS)))
def test_calendar_rules_on_ordered_clocks_match_their_definition(
    cps: list[Checkpoint], n: int, kind: str
) -> None:
    assert set(CALENDAR[kind](n).select(cps)) == oracle_calendar(n, BUCKETS[kind], cps)


@SETTINGS
@given(
    ordered_runs(),
    st.one_of(st.floats(0, 1e6), st.sampled_from([0.0, 3600.0, 86400.0, math.inf])),
    st.sampled_from([T0, T0 + 86400.0, 0.0, 345600.0 + 3e5]),
)
def test_keep_within_on_ordered_clocks_matches_its_definition(
    cps: list[Checkpoint], within: float, now: float
) -> None:
    expected = {c.step for c in _complete(cps) if c.created_at >= now - within}
    assert set(KeepWithin(within, now).select(cps)) == expected
