"""What checkpoints cost: storage per tier and per run, and what a plan saves, per month.

Pure arithmetic over bytes and the optional per-tier ``cost_per_gib_month`` (in whatever currency
the user prices in). ``status``, ``status --json``, the metrics and ``prune --dry-run`` all call
these functions, so their figures agree by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ckptkeeper.core.model import Action, ActionKind

GIB = float(1 << 30)


def monthly(nbytes: int, price_per_gib_month: float) -> float:
    """The monthly cost of ``nbytes`` at a price per GiB-month, rounded to 1/10000 (stable JSON)."""
    return round(nbytes / GIB * price_per_gib_month, 4)


def by_tier(bytes_by_tier: Mapping[str, int], prices: Mapping[str, float | None]) -> dict[str, float]:
    """Tier -> monthly cost, for priced tiers only."""
    return {t: monthly(b, p) for t, b in bytes_by_tier.items() if (p := prices.get(t)) is not None}


def by_run(
    copies: Iterable[tuple[str, str, int]], prices: Mapping[str, float | None]
) -> dict[str, dict[str, float]]:
    """``(run, tier, bytes)`` per stored copy -> run -> tier -> monthly cost (priced tiers only).

    Bytes are summed per (run, tier) before pricing, so a tier's runs add up to the tier's cost
    up to the rounding of each figure.
    """
    sums: dict[tuple[str, str], int] = {}
    for run, tier, nbytes in copies:
        if prices.get(tier) is not None:
            sums[(run, tier)] = sums.get((run, tier), 0) + nbytes
    out: dict[str, dict[str, float]] = {}
    for (run, tier), nbytes in sorted(sums.items()):
        price = prices[tier]
        assert price is not None
        out.setdefault(run, {})[tier] = monthly(nbytes, price)
    return out


@dataclass(frozen=True)
class StoredRatio:
    """What a compressing tier's past copies stored per raw byte: the basis of the estimate of
    what the plan's copies into it will store (docs/compression.md)."""

    copies: int
    raw_bytes: int
    stored_bytes: int

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes

    def estimate(self, raw: int) -> int:
        """Stored bytes expected of ``raw`` bytes copied into the tier."""
        return round(raw * self.ratio)


def stored_ratios(
    history: Mapping[str, tuple[int, int, int]], compressing: Iterable[str]
) -> dict[str, StoredRatio]:
    """Tier -> :class:`StoredRatio`, for the ``compressing`` tiers with a history: ``history`` is
    tier -> (copies, raw bytes, stored bytes) of the copies whose stored bytes were recorded. A
    tier without one is left out: its copies are counted at raw bytes."""
    out = {}
    for tier in compressing:
        copies, raw, stored = history.get(tier, (0, 0, 0))
        if copies > 0 and raw > 0:
            out[tier] = StoredRatio(copies, raw, stored)
    return out


@dataclass(frozen=True)
class StoredBasis:
    """What the index says of stored bytes, for pricing a plan (docs/compression.md)."""

    ratios: Mapping[str, StoredRatio] = field(default_factory=dict)
    """Compressing tier -> what its past copies stored per raw byte: prices copies into it."""
    copies: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """``(tier, path)`` -> bytes an existing copy takes there, where less than its raw bytes
    (stored compressed): prices its delete."""


def copies_estimate(
    actions: Iterable[Action], ratios: Mapping[str, StoredRatio]
) -> dict[str, tuple[int, int]]:
    """Tier -> (raw bytes, estimated stored bytes) of the plan's copies into each tier of
    ``ratios``."""
    raw: dict[str, int] = {}
    for a in actions:
        if a.action is ActionKind.COPY and a.to_tier is not None and a.to_tier in ratios:
            raw[a.to_tier] = raw.get(a.to_tier, 0) + a.bytes
    return {t: (b, ratios[t].estimate(b)) for t, b in sorted(raw.items())}


def plan_change(
    actions: Iterable[Action],
    prices: Mapping[str, float | None],
    basis: StoredBasis | None = None,
) -> dict[str, float]:
    """Tier -> change of the monthly bill if the plan is carried out (negative: a saving).

    A copy adds its bytes to its destination tier (into a compressing tier of ``basis``: the
    stored bytes its past copies suggest, an estimate); a delete or a reap of stored bytes
    removes them from its tier (a copy stored compressed: the bytes it takes; a multipart upload
    being aborted counts too: stores bill for its parts). A move into the trash (``undo_window``)
    saves nothing until the purge of that entry, which does.
    """
    delta: dict[str, int] = {}
    basis = basis or StoredBasis()
    for a in actions:
        if a.action is ActionKind.COPY and a.to_tier:
            r = basis.ratios.get(a.to_tier)
            delta[a.to_tier] = delta.get(a.to_tier, 0) + (a.bytes if r is None else r.estimate(a.bytes))
        elif a.action in (ActionKind.DELETE, ActionKind.REAP, ActionKind.PURGE) and a.tier and not a.trash:
            held = basis.copies.get((a.tier, a.path or ""), a.bytes)
            delta[a.tier] = delta.get(a.tier, 0) - held
    return {t: monthly(b, p) for t, b in sorted(delta.items()) if (p := prices.get(t)) is not None}
