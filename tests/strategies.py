"""Hypothesis strategies shared by the planner's property tests.

Each test module tunes the ranges to what it explores (the reference comparison wants small,
collision-rich catalogs; the invariant tests want wider ones), so the knobs are arguments, and the
shape of a random policy (each rule present about a third of the time) lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from ckptkeeper.core.model import TierPolicy

DAY = 86400.0
BUCKETS = ("keep_hourly", "keep_daily", "keep_weekly", "keep_monthly")


@st.composite
def tier_policies(
    draw: st.DrawFn,
    first: bool,
    *,
    keep_last_max: int = 4,
    keep_every: Sequence[int] = (100, 200, 300, 500),
    keep_within: Sequence[float] = (0.0, 3600.0, DAY, 7 * DAY),
    bucket_max: int = 3,
    high_watermarks: Sequence[float] = (0.5, 0.7, 0.9),
    low_fraction: float = 0.6,
    replicate_odds: int = 3,
) -> TierPolicy:
    """A random ``TierPolicy``; ``first``: the hottest tier (never replicates).

    ``replicate_odds``: a slower tier replicates one time in this many; the low watermark is absent,
    ``low_fraction`` of the high one, or equal to it.
    """
    maybe = st.integers(0, 2).map(lambda v: v == 0)  # each rule present about a third of the time
    kw: dict[str, object] = {}
    if draw(maybe):
        kw["keep_last"] = draw(st.integers(0, keep_last_max))
    if draw(maybe):
        kw["keep_best"] = draw(st.integers(0, 2))
        kw["metric"] = "loss"
        kw["mode"] = draw(st.sampled_from(["min", "max"]))
    if draw(maybe):
        kw["keep_every"] = draw(st.sampled_from(list(keep_every)))
    if draw(maybe):
        kw["keep_within"] = draw(st.sampled_from(list(keep_within)))
    if draw(maybe):
        kw[draw(st.sampled_from(BUCKETS))] = draw(st.integers(0, bucket_max))
    if not first and draw(st.integers(0, replicate_odds - 1)) == 0:
        kw["replicate"] = True
    if draw(st.booleans()):
        high = draw(st.sampled_from(list(high_watermarks)))
        kw["high_watermark"] = high
        kw["low_watermark"] = draw(st.sampled_from([None, high * low_fraction, high]))
    return TierPolicy(**kw)  # type: ignore[arg-type]
