"""``verify``: re-hash every verified copy of the cataloged checkpoints against its manifest."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptkeeper.config import Settings
from ckptkeeper.index import Index
from ckptkeeper.storage import StorageError, TierStorage


@dataclass(frozen=True, slots=True)
class Mismatch:
    run: str
    step: int
    tier: str
    problem: str


@dataclass
class VerifyReport:
    checked: int = 0
    """Copies re-hashed."""
    problems: list[Mismatch] = field(default_factory=list)


def verify(settings: Settings, index: Index, run: str | None = None) -> VerifyReport:
    """Re-hash the copies of ``run`` (every run when None), fastest tier first; copies the index
    marks damaged are checked too (and are a problem until a scan or a copy repairs them).

    A tier that cannot be read is a problem of each copy in it, not an exception: the other
    tiers are still checked.
    """
    order = [t.name for t in settings.tiers]
    storages = {t.name: TierStorage(t.to_spec(), hot=i == 0) for i, t in enumerate(settings.tiers)}
    report = VerifyReport()
    for row in index.checkpoints(run):
        manifest = row.manifest()
        if manifest is None:
            continue
        damaged = row.damaged
        for tier in sorted((row.verified_tiers | damaged.keys()) & storages.keys(), key=order.index):
            report.checked += 1
            try:
                found = storages[tier].verify(manifest)
            except StorageError as exc:
                found = [f"cannot verify: {exc}"]
            if tier in damaged and not found:
                # whole again (put back by hand?): the next scan records it as a copy again
                found = [f"marked damaged ({damaged[tier]}) but whole now; `ckptkeeper scrub` records it"]
            report.problems.extend(Mismatch(row.run, row.step, tier, p) for p in found)
    return report
