"""What the policy could not do because a tier was unavailable, as the last pass recorded it
(:mod:`ckptkeeper.actions.pruning.held` computes and records it) for ``status`` and the metrics.

A tier whose listing failed is unknown, never empty: copies to it and deletes that depend on it
are held (the planner's keep reasons say ``held: …`` / ``waiting: …`` where they can). ``prune`` then exits
:data:`~ckptkeeper.actions.errors.EXIT_POLICY_HELD`, and each non-dry pass records what it held in
``<index>.policy-held`` (removed by the first pass that holds nothing), so ``status`` and
``ckptkeeper_policy_held`` show it between passes, in the daemon as after a cron ``prune``. A file
beside the index, like ``.deletes-held``: no schema change, and readable by a read-only status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.config import Settings

HELD_POLICY_SUFFIX = ".policy-held"


@dataclass(frozen=True, slots=True)
class TierUnavailable:
    """A tier whose listing failed (unknown, never empty), and how much of the policy waits on it."""

    tier: str
    error: str
    """Why the tier is unavailable (its last listing's error)."""
    checkpoints: int
    """Checkpoints whose copies or deletes wait on it."""
    since: float | None = None
    """When a pass first found it holding the policy (None: this pass)."""

    def describe(self) -> str:
        return f"{self.tier} unavailable ({self.error}); {self.checkpoints} checkpoint(s) wait on it"


def policy_held_path(settings: Settings) -> Path:
    index = Path(settings.index)
    return index.with_name(index.name + HELD_POLICY_SUFFIX)


def read_policy_held(settings: Settings) -> dict[str, TierUnavailable]:
    """What the last non-dry pass held, per tier ({} when nothing, or unreadable: it is advisory)."""
    try:
        doc = json.loads(policy_held_path(settings).read_text())
        tiers = doc["tiers"]
        return {
            str(name): TierUnavailable(
                str(name), str(t.get("error") or ""), int(t.get("checkpoints") or 0), float(t["since"])
            )
            for name, t in tiers.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
