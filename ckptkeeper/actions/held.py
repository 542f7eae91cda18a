"""What the policy could not do because a tier was unavailable, kept between passes for ``status``
and the metrics.

A tier whose listing failed is unknown, never empty: copies to it and deletes that depend on it
are held (the planner says ``held: …`` / ``waiting: …`` in the keep reasons). ``prune`` then exits
:data:`~ckptkeeper.actions.errors.EXIT_POLICY_HELD`, and each non-dry pass records what it held in
``<index>.policy-held`` (removed by the first pass that holds nothing), so ``status`` and
``ckptkeeper_policy_held`` show it between passes, in the daemon as after a cron ``prune``. A file
beside the index, like ``.deletes-held``: no schema change, and readable by a read-only status.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.core.keep_reasons import blocked_by
from ckptkeeper.core.model import Plan
from ckptkeeper.index import Index

HELD_POLICY_SUFFIX = ".policy-held"


@dataclass(frozen=True, slots=True)
class TierHeld:
    tier: str
    error: str
    """Why the tier is unavailable (its last listing's error)."""
    checkpoints: int
    """Checkpoints whose copies or deletes wait on it."""
    since: float | None = None
    """When a pass first found it holding the policy (None: this pass)."""

    def describe(self) -> str:
        return f"{self.tier} unavailable ({self.error}); {self.checkpoints} checkpoint(s) wait on it"


def held_by_tiers(plan: Plan, index: Index, tier_names: list[str]) -> dict[str, TierHeld]:
    """Unavailable tiers that held back part of ``plan``, with how many checkpoints each held."""
    statuses = index.tier_statuses()
    keys: dict[str, set[tuple[str, int]]] = {}
    for keep in plan.keep:
        for reason in keep.reasons:
            for tier in blocked_by(reason):
                keys.setdefault(tier, set()).add((keep.run, keep.step))
    out: dict[str, TierHeld] = {}
    for tier in tier_names:
        if tier not in keys:
            continue
        st = statuses.get(tier)
        error = (st.error if st is not None else None) or "never listed"
        out[tier] = TierHeld(tier, error, len(keys[tier]))
    return out


def policy_held_path(settings: Settings) -> Path:
    index = Path(settings.index)
    return index.with_name(index.name + HELD_POLICY_SUFFIX)


def record_policy_held(settings: Settings, held: Mapping[str, TierHeld], *, now: float | None = None) -> None:
    """Write (atomically) or clear the record of what the last pass held."""
    path = policy_held_path(settings)
    if not held:
        path.unlink(missing_ok=True)
        return
    previous = read_policy_held(settings)
    at = time.time() if now is None else now
    doc = {
        "tiers": {
            t.tier: {
                "error": t.error,
                "checkpoints": t.checkpoints,
                "since": previous[t.tier].since if t.tier in previous else at,
            }
            for t in held.values()
        },
        "at": at,
    }
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def read_policy_held(settings: Settings) -> dict[str, TierHeld]:
    """What the last non-dry pass held, per tier ({} when nothing, or unreadable: it is advisory)."""
    try:
        doc = json.loads(policy_held_path(settings).read_text())
        tiers = doc["tiers"]
        return {
            str(name): TierHeld(
                str(name), str(t.get("error") or ""), int(t.get("checkpoints") or 0), float(t["since"])
            )
            for name, t in tiers.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
