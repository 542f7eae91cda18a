"""``prefetch``: the latest verified checkpoint of a run (this node's part of one spanning nodes)
into this node's hot tier, so the job that resumes it finds it locally (``ckptkeeper.latest``).

Used by ``job start`` (a Slurm Prolog, under a deadline) and by job scripts on schedulers without
hooks (``srun --ntasks-per-node=1 ckptkeeper prefetch RUN``). Reuses :mod:`.restore`: a copy
already verified in hot is left as it is, else the fastest tier holding a verified copy gives it,
else another node's copy in a shared tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.actions.restore import find_checkpoint, restore_to
from ckptkeeper.config import Settings
from ckptkeeper.index import Index
from ckptkeeper.ingest.catalog import Catalog


@dataclass(frozen=True, slots=True)
class Prefetched:
    run: str
    step: int
    path: Path
    from_tier: str | None
    """None: it was already in the hot tier."""
    bytes: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "run": self.run,
            "step": self.step,
            "path": str(self.path),
            "from_tier": self.from_tier,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
        }


def prefetch(
    settings: Settings,
    index: Index,
    run: str,
    *,
    step: str | int = "latest",
    part: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Prefetched:
    """Bring ``run@step`` into ``<hot>/<run>``; LookupError when no tier has it verified.

    With ``part``: a node that still holds that part of the newest checkpoint, verified, in its
    hot tier (a 2-node job requeued onto the same nodes) keeps it; else part ``part`` is fetched
    from the shared tiers. ``progress(done, total)`` as in :func:`.restore.restore_to`."""
    started = time.monotonic()
    target = settings.hot.local_path / run
    if target.is_dir():
        Catalog(settings, index).reconcile_run(run)
        if part is not None and _own_part_in_hot(settings, index, run, step, part):
            part = None  # the in-place path below returns the hot copy itself
    fresh = not target.exists()
    got = restore_to(settings, index, run, step, target, part=part, own_part=part is None, progress=progress)
    if got.tier is not None:  # the copy is now a hot checkpoint of the run
        Catalog(_settled_now(settings) if fresh else settings, index).reconcile_run(run)
    return Prefetched(run, got.step, got.path, got.tier, got.bytes, time.monotonic() - started)


def _own_part_in_hot(settings: Settings, index: Index, run: str, step: str | int, part: int) -> bool:
    """The index's newest (or ``step``) checkpoint of ``run`` is part ``part`` with a verified hot copy."""
    try:
        row = find_checkpoint(index, run, step)
    except LookupError:
        return False
    return settings.hot.name in row.verified_tiers and row.part is not None and row.part.index == part


def _settled_now(settings: Settings) -> Settings:
    """``settings`` with no settling time, for the catalog of a run dir this prefetch created.

    Nothing of the run was on this node before: its dir holds only the copy just fetched, verified
    against its manifest and renamed into place whole, so no writer can be mid-save in it. Judged
    with the usual ``settle_seconds`` (by ctime, which a fetch cannot back-date) it would stay
    ``writing`` that long, and the job's ``ckptkeeper.latest()`` right after the Prolog would not
    find it (a second fetch refuses to overwrite it)."""
    daemon = settings.daemon.model_copy(update={"settle_seconds": 0.0})
    return settings.model_copy(update={"daemon": daemon})
