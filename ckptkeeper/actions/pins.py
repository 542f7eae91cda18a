"""``pin`` / ``unpin``: in the index, and as pin objects in every slower tier (docs/design.md, "Many nodes").

The index alone is not a safe home for a pin: deleting it (``rm index.db*``) or losing it to
corruption used to lose every pin, and the next prune expired what the user protected. A pin
object beside the checkpoint's manifest (``<run>/<name>.ckptkeeper-pin.json``) in every slower
tier — written whether or not the tier holds a copy yet, so a later move keeps it — is read back
by every reconcile of that tier (``Catalog.reconcile_tier``), and by the rebuild of a lost index.

Order, so that no failure leaves a checkpoint less protected than the user asked:

* ``pin``: the index first — it protects at once, even from a prune already running (the
  executor re-reads pins before each delete) — then the tiers. A tier that cannot be written
  leaves the pin in the index and the command exits 1 naming the tier; a crash in between is
  repaired by the next prune (:func:`store_missing_pins`);
* ``unpin``: the tiers first; the index is unpinned only once every pin object is gone, since a
  pin object left in a tier would pin the checkpoint again at the next reconcile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.actions.index import write_index_record
from ckptkeeper.config import Settings
from ckptkeeper.index import Index
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.pins")


@dataclass
class PinOutcome:
    run: str
    step: int
    pinned: bool
    """What was asked: pin (True) or unpin."""
    names: list[str]
    """Checkpoint names of ``run`` at ``step`` (empty: no such checkpoint in the index)."""
    changed: int = 0
    """Index rows whose pin changed."""
    failed: dict[str, str] = field(default_factory=dict)
    """tier -> why its pin object could not be written / removed."""

    def to_dict(self) -> dict[str, Any]:
        """``pin --json`` / ``unpin --json``: what is true now, failure or not (an unpin that could
        not remove every pin object leaves the checkpoint pinned: a pin object left in a tier would
        pin it again)."""
        return {
            "run": self.run,
            "step": self.step,
            "pinned": self.pinned or bool(self.failed),
            "checkpoints": self.changed,
            "failed": dict(sorted(self.failed.items())),
        }


def set_pin(settings: Settings, index: Index, run: str, step: int, pinned: bool) -> PinOutcome:
    """Pin or unpin every checkpoint of ``run`` at ``step``, in the tiers and in the index."""
    from ckptkeeper.storage import StorageError, TierStorage

    names = sorted({row.name for row in index.checkpoints_at_step(run, step)})
    outcome = PinOutcome(run, step, pinned, names=names)
    if not names:
        return outcome
    if pinned:
        outcome.changed = index.set_pinned(run, step, True)
    node = settings.node
    for tier in settings.tiers[1:]:
        try:
            storage = TierStorage(tier.to_spec())
            for name in names:
                if pinned:
                    storage.write_pin(run, name, step, node)
                else:
                    storage.remove_pin(run, name)
        except (StorageError, OSError) as exc:
            outcome.failed[tier.name] = str(exc)
            log.error(
                "pin object not " + ("written" if pinned else "removed"),
                tier=tier.name,
                run=run,
                step=step,
                error=str(exc),
            )
    if any(t.shared for t in settings.tiers[1:]):
        from ckptkeeper.actions.versions import pin_version  # only for shared tiers

        # A part's pin holds every node's part of the version (docs/spanning-nodes.md).
        for tier_name, error in pin_version(settings, index.checkpoints_at_step(run, step), pinned).items():
            outcome.failed.setdefault(tier_name, error)
    if not pinned and not outcome.failed:
        outcome.changed = index.set_pinned(run, step, False)
    write_index_record(settings, index)
    return outcome


def store_missing_pins(settings: Settings, index: Index, tier_pins: dict[str, set[tuple[str, str]]]) -> int:
    """Write the pin objects a listed tier lacks for checkpoints pinned in the index (pins made
    before pins lived in the tiers, or a tier added since). Best effort: a failure is logged and
    retried at the next pass. Returns how many objects were written."""
    from ckptkeeper.storage import StorageError, TierStorage

    pinned = index.pinned_names()
    if not pinned:
        return 0
    steps = {(c.run, c.name): c.step for c in index.checkpoints() if c.pinned}
    node = settings.node
    written = 0
    for tier in settings.tiers[1:]:
        listed = tier_pins.get(tier.name)
        if listed is None:
            continue  # not listed this pass: unknown, not missing
        missing = sorted(pinned - listed)
        if not missing:
            continue
        try:
            storage = TierStorage(tier.to_spec())
            for run, name in missing:
                storage.write_pin(run, name, steps.get((run, name), 0), node)
                listed.add((run, name))
                written += 1
        except (StorageError, OSError) as exc:
            log.warning("cannot store pin objects; retried next pass", tier=tier.name, error=str(exc))
    if written:
        log.info("pin objects stored in the tiers", count=written)
    return written
