"""What the scrub job re-hashes next: pure, no I/O, ``now`` passed in.

The slower tiers' copies are re-hashed a little at a time, oldest verification first, so that over
successive passes every copy is covered and the one checked longest ago is always next. Hot copies
are not scrubbed: the catalog hashes them when it records them.

The rule for a pass with a byte budget B: copies in order of their last re-hash (never re-hashed
first, then oldest), whole copies only, taken while their sum stays within B; the pass stops at
the first copy that does not fit, so that copy leads the next pass. A pass always takes its first
copy, even one larger than B (else a copy bigger than the budget would never be checked): a pass
reads at most max(B, the size of its first copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptkeeper.util.fmt import human_age

SCRUB_SLICE_SECONDS = 1800.0
"""A scheduled pass reads for at most this long at ``scrub_rate``: its budget is rate x slice."""

DAMAGED_PREFIX = "damaged: "
"""How the index marks a damaged copy's version (``ckptkeeper.index.rows.DAMAGED`` is this)."""


@dataclass(frozen=True, slots=True)
class ScrubCandidate:
    """One slower-tier copy of a complete checkpoint, with when its bytes were last re-hashed."""

    checkpoint_id: int
    run: str
    name: str
    step: int
    bytes: int
    tier: str
    location_version: str
    """The location's version as the index stores it: the checkpoint's version, or ``damaged: …``."""
    node: str
    """The node its manifest names ('' = this node)."""
    scrubbed_at: float | None
    """None: never re-hashed since it was recorded."""

    @property
    def damaged(self) -> bool:
        return self.location_version.startswith(DAMAGED_PREFIX)


@dataclass(frozen=True, slots=True)
class ScrubPick:
    candidate: ScrubCandidate
    reason: str
    """Why it is next, e.g. ``never re-hashed`` or ``last re-hashed 3d ago``."""


@dataclass(frozen=True, slots=True)
class ScrubSelection:
    picks: tuple[ScrubPick, ...]
    budget: int
    bytes: int
    """Bytes the picks will read."""
    deferred: int
    """Copies left for later passes."""
    deferred_bytes: int


def pass_budget(rate: int, interval: float) -> int:
    """Bytes one scheduled pass may read: ``rate`` for the interval, at most :data:`SCRUB_SLICE_SECONDS`
    (a pass never outlasts its slice, however long the interval)."""
    seconds = min(interval, SCRUB_SLICE_SECONDS) if interval > 0 else SCRUB_SLICE_SECONDS
    return max(1, int(rate * seconds))


def scrub_order(candidates: Sequence[ScrubCandidate], tier_order: Sequence[str]) -> list[ScrubCandidate]:
    """Never re-hashed first, then the oldest re-hash; ties by tier (fastest first), run, step, name."""
    pos = {t: i for i, t in enumerate(tier_order)}
    return sorted(
        candidates,
        key=lambda c: (
            c.scrubbed_at is not None,
            c.scrubbed_at or 0.0,
            pos.get(c.tier, len(pos)),
            c.run,
            c.step,
            c.name,
        ),
    )


def select_for_scrub(
    candidates: Sequence[ScrubCandidate], budget: int, now: float, tier_order: Sequence[str] = ()
) -> ScrubSelection:
    """The copies one pass re-hashes (see the module docstring for the rule), each with its reason."""
    ordered = scrub_order(candidates, tier_order)
    picks: list[ScrubPick] = []
    total = 0
    for c in ordered:
        if picks and total + c.bytes > budget:
            break
        total += c.bytes
        if c.scrubbed_at is None:
            reason = "never re-hashed"
        else:
            reason = f"last re-hashed {human_age(max(0.0, now - c.scrubbed_at))} ago"
        if c.damaged:
            reason += "; marked damaged (whole again?)"
        picks.append(ScrubPick(c, reason))
    rest = ordered[len(picks) :]
    return ScrubSelection(
        picks=tuple(picks),
        budget=budget,
        bytes=total,
        deferred=len(rest),
        deferred_bytes=sum(c.bytes for c in rest),
    )
