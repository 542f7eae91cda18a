"""What one prune pass planned and did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.errors import EXIT_ACTION_FAILED, EXIT_OK, EXIT_POLICY_HELD, EXIT_REFUSED
from ckptkeeper.actions.held import TierUnavailable
from ckptkeeper.core import cost
from ckptkeeper.core.model import ActionKind, Plan
from ckptkeeper.core.reaper import summarize_reclaim
from ckptkeeper.executor import ExecResult

__all__ = ["PruneOutcome", "cost_basis", "exit_code"]


def cost_basis(settings: Any, index: Any) -> cost.StoredBasis:
    """What ``index`` says of stored bytes (docs/compression.md): per tier with ``compression``
    on, what its past copies stored per raw byte; per copy stored compressed, the bytes it takes."""
    compressing = [t.name for t in settings.tiers[1:] if getattr(t, "compression", "none") != "none"]
    ratios = cost.stored_ratios(index.stored_history(), compressing) if compressing else {}
    return cost.StoredBasis(ratios, index.stored_copies())


@dataclass
class PruneOutcome:
    """What one prune pass planned and did; ``result`` is None for a dry run."""

    plan: Plan
    result: ExecResult | None
    exit_code: int
    failed: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0
    dry_run: bool = False
    held: dict[str, TierUnavailable] = field(default_factory=dict)
    """Unavailable tiers that held back part of the policy (exit :data:`EXIT_POLICY_HELD`)."""
    damaged: dict[str, str] = field(default_factory=dict)
    """``tier:path`` -> problem, for each copy the reconcile found damaged (copied again)."""
    adopted: list[Any] = field(default_factory=list)
    """:class:`ckptkeeper.fleet.adopt.Adoption` per gone node whose copies this node, as the fleet
    lease holder, adopted (or, in a dry run, would adopt) in a shared tier."""
    prices: dict[str, float | None] = field(default_factory=dict)
    """Tier -> ``cost_per_gib_month`` (None: not priced), for :meth:`cost_change`."""
    dedup: dict[str, Any] = field(default_factory=dict)
    """Dedup tiers: bytes uploaded vs referenced by this pass's copies, content collected."""
    basis: cost.StoredBasis = field(default_factory=cost.StoredBasis)
    """What the index said of stored bytes before the plan ran (:func:`cost_basis`)."""

    def cost_change(self) -> dict[str, float]:
        """Tier -> change of the monthly storage bill if the plan is carried out (priced tiers
        only; copies into a compressing tier at their estimated stored bytes)."""
        return cost.plan_change(self.plan.actions, self.prices, self.basis)

    def stored_estimate(self) -> dict[str, Any] | None:
        """``prune --json``'s ``stored_estimate``: per compressing tier the plan copies into,
        raw bytes and the stored bytes its past copies suggest (None: no such tier)."""
        ratios = self.basis.ratios
        est = cost.copies_estimate(self.plan.actions, ratios)
        if not est:
            return None
        return {
            t: {
                "copy_bytes": raw,
                "estimated_stored_bytes": stored,
                "stored_per_raw": round(ratios[t].ratio, 4),
                "from_copies": ratios[t].copies,
            }
            for t, (raw, stored) in est.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """``prune --json``: the plan, and what was done (``result``, absent from a dry run)."""
        doc = self.plan.to_dict()
        summary = summarize_reclaim(
            [a for a in self.plan.actions if a.action is ActionKind.REAP and not a.trash]
        )
        doc["reap_summary"] = {
            "by_reason": summary.by_reason,
            "by_run": summary.by_run,
            "total": summary.total,
        }
        doc["dry_run"] = self.dry_run
        doc["policy_held"] = {
            t.tier: {"error": t.error, "checkpoints": t.checkpoints} for t in self.held.values()
        }
        doc["damaged"] = self.damaged
        doc["adopted"] = [a.to_dict() for a in self.adopted]
        if self.dedup:
            doc["dedup"] = self.dedup
        change = self.cost_change()
        doc["stored_estimate"] = self.stored_estimate()
        doc["cost_saving_per_month"] = (
            {"tiers": {t: round(-c, 4) for t, c in change.items()}, "total": round(-sum(change.values()), 4)}
            if change
            else None
        )
        if self.result is not None:
            r = self.result
            doc["result"] = {
                "done": len(r.done),
                "failed": self.failed,
                "skipped": [{"action": a.to_dict(), "reason": why} for a, why in r.skipped],
                "reclaimed_bytes": r.reclaimed_bytes,
                "recovered": r.recovered,
                "compressed": [{"action": a.to_dict(), **stats} for a, stats in r.compressed],
            }
        return doc


def exit_code(failed: Sequence[str], held: dict[str, TierUnavailable], plan: Plan) -> int:
    """The worst of: an action failed (1), an unavailable tier held the policy back (4), a guard
    refused (3); else 0."""
    if failed:
        return EXIT_ACTION_FAILED
    if held:
        return EXIT_POLICY_HELD
    return EXIT_REFUSED if plan.refused else EXIT_OK
