"""What one prune pass planned and did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.errors import EXIT_ACTION_FAILED, EXIT_OK, EXIT_POLICY_HELD, EXIT_REFUSED
from ckptkeeper.actions.held import TierUnavailable
from ckptkeeper.core.model import Plan
from ckptkeeper.executor import ExecResult

__all__ = ["PruneOutcome", "exit_code"]


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


def exit_code(failed: Sequence[str], held: dict[str, TierUnavailable], plan: Plan) -> int:
    """The worst of: an action failed (1), an unavailable tier held the policy back (4), a guard
    refused (3); else 0."""
    if failed:
        return EXIT_ACTION_FAILED
    if held:
        return EXIT_POLICY_HELD
    return EXIT_REFUSED if plan.refused else EXIT_OK
