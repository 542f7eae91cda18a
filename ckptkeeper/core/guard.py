"""Step 7 of a plan: guards against a plan that looks like a mistake (docs/design.md, "Retention")."""

from __future__ import annotations

from collections.abc import Sequence

from ckptkeeper.core.model import Action
from ckptkeeper.core.retention import Rule, keeps_nothing

__all__ = ["guard"]


def guard(
    deletes: Sequence[Action],
    reap_actions: Sequence[Action],
    rules: Sequence[Sequence[Rule]],
    max_delete: int,
    force: bool,
) -> str | None:
    """Refuse the destructive part of a plan that looks like a mistake (exit code 3 in the CLI).

    Counted for ``max_delete``: checkpoints deleted from their last location (expired) plus reaped
    things (a checkpoint reaped in several tiers counts once). Moves don't count: a moved
    checkpoint still exists. The empty-policy trap: when every tier's rules can never keep anything
    (all counts 0), each run would shrink to its protected checkpoints; that is almost certainly a
    config slip, so it is refused even when under ``max_delete``.
    """
    if force:
        return None
    expired = {(a.run, a.step) for a in deletes if a.rule == "expired"}
    if not expired and not reap_actions:
        return None
    if expired and rules and all(keeps_nothing(r) for r in rules):
        return (
            f"empty policy: no tier's rules can keep any checkpoint, would expire {len(expired)}; use --force"
        )
    reaped = {(a.run, a.step) if a.step is not None else (a.tier, a.path) for a in reap_actions}
    count = len(expired) + len(reaped)
    if count > max_delete:
        return f"would delete {count} checkpoints (max_delete={max_delete}); use --force"
    return None
