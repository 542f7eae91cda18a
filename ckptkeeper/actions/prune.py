"""``prune``: reconcile, plan retention and reaping, and (unless a dry run) carry the plan out.

One pass with fixed phases (:class:`ckptkeeper.actions.pruning.runner.PrunePass`), the same for
``ckptkeeper prune``, ``prune --dry-run`` and the daemon's scheduled jobs. Dry-run travels down as
a value: a dry run reconciles into an in-memory copy of the index, so it sees what is on disk now
while changing nothing on disk, in object storage or in the index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from ckptkeeper.actions.deadlines import bounded_pass
from ckptkeeper.actions.pruning import participants as chosen
from ckptkeeper.actions.pruning.catalog import CatalogStep, FullReconcile, NoCatalog
from ckptkeeper.actions.pruning.outcome import PruneOutcome
from ckptkeeper.actions.pruning.planning import one_per_step, plan_phase, restrict_phase
from ckptkeeper.actions.pruning.runner import PrunePass
from ckptkeeper.actions.pruning.state import PassState
from ckptkeeper.config import Settings
from ckptkeeper.core.model import Plan
from ckptkeeper.executor import Progress
from ckptkeeper.index import Index
from ckptkeeper.ingest.clocks import FileClocks

__all__ = ["KINDS", "PruneOutcome", "make_plan", "one_per_step", "run_prune"]

KINDS = ("retention", "reap")


def make_plan(
    settings: Settings,
    index: Index,
    *,
    now: float | None = None,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
) -> Plan:
    """The plan a pass would make from ``index`` as it stands (plan and restrict phases, without
    the shared filesystem leases a pass takes first, nor the freeze)."""
    state = PassState(
        settings,
        index,
        force=force,
        run=run,
        kinds=tuple(kinds),
        observed=time.time() if now is None else now,
    )
    if now is None:  # file ages by the filesystems' clocks, read only (docs/many-nodes-clocks.md)
        state.observed_on = dict(FileClocks(settings, write=False).now_all())
    participants = chosen.participants_for(settings)
    return restrict_phase(state, participants, plan_phase(state, participants))


@bounded_pass  # request_timeout and pass_timeout (actions/deadlines.py)
def run_prune(
    settings: Settings,
    index: Index,
    *,
    dry_run: bool = False,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
    rescan: bool = True,
    catalog: CatalogStep | None = None,
    lock_timeout: float = 5.0,
    stop: threading.Event | None = None,
    progress: Progress | None = None,
    now: Callable[[], float] = time.time,
    on_plan: Callable[[Plan], None] | None = None,
) -> PruneOutcome:
    """One prune pass. Raises Locked if another executor runs.

    ``catalog``: how the index is brought up to date (default: a full reconcile, or none without
    ``rescan``). ``on_plan`` sees the final plan before the first byte moves (the CLI prints it
    then, so a long copy is never a silent wait)."""
    if catalog is None:
        catalog = FullReconcile(progress) if rescan else NoCatalog()
    state = PassState(
        settings, index, dry_run=dry_run, force=force, run=run, kinds=tuple(kinds), clock=now, stop=stop
    )
    return PrunePass(state, catalog, lock_timeout=lock_timeout, progress=progress, on_plan=on_plan).run()
