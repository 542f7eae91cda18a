"""What the policy could not do because a tier was unavailable, kept between passes for ``status``
and the metrics.

A tier whose listing failed is unknown, never empty: copies to it and deletes that depend on it
are held (the planner's keep reasons say ``held: …`` / ``waiting: …`` where they can). ``prune`` then exits
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
from ckptkeeper.core.model import ActionKind, CheckpointState, Plan, Snapshot
from ckptkeeper.index import TierStatus

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


def held_by_tiers(
    plan: Plan, snapshot: Snapshot, statuses: Mapping[str, TierStatus]
) -> dict[str, TierUnavailable]:
    """Unavailable tiers that held back part of ``plan``, with how many checkpoints each held.

    A complete checkpoint is held when, once the plan's copies and deletes are done, its copies
    would still not be where the plan keeps it, and an unknown tier is involved (it holds a copy,
    or the plan keeps it there): a copy to that tier waits, or a delete that depends on it (a move,
    an expiry) does not happen. Computed from the plan and the snapshot it was made from, so the
    planner needs no extra output; only called when some tier is unknown.
    """
    unknown = snapshot.unknown_tiers
    if not unknown:
        return {}
    kept: dict[tuple[str, int], set[str]] = {}
    for keep in plan.keep:
        kept.setdefault((keep.run, keep.step), set()).add(keep.tier)
    added: dict[tuple[str | None, int | None], set[str]] = {}
    removed: dict[tuple[str | None, int | None], set[str]] = {}
    for action in plan.actions:
        key = (action.run, action.step)
        if action.action is ActionKind.COPY and action.to_tier:
            added.setdefault(key, set()).add(action.to_tier)
        elif action.tier:
            removed.setdefault(key, set()).add(action.tier)
    counts: dict[str, int] = {}
    for c in snapshot.checkpoints:
        if c.state is not CheckpointState.COMPLETE:
            continue
        key = (c.run, c.step)
        wanted = kept.get(key, set())
        blocking = (set(c.tiers) | wanted) & unknown
        if not blocking:
            continue
        after = (set(c.tiers) | added.get(key, set())) - removed.get(key, set())
        if after != wanted:
            for tier in blocking:
                counts[tier] = counts.get(tier, 0) + 1
    out: dict[str, TierUnavailable] = {}
    for tier, n in sorted(counts.items()):
        st = statuses.get(tier)
        out[tier] = TierUnavailable(tier, (st.error if st is not None else None) or "never listed", n)
    return out


def policy_held_path(settings: Settings) -> Path:
    index = Path(settings.index)
    return index.with_name(index.name + HELD_POLICY_SUFFIX)


def record_policy_held(
    settings: Settings, held: Mapping[str, TierUnavailable], *, now: float | None = None
) -> None:
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
