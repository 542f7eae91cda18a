"""User-visible operations shared by the CLI and the daemon (borgmatic's "actions" layer).

Each function wires the core together for one operation: reconcile, snapshot, plan, execute.
Dry-run travels down as a value: a dry run reconciles into an in-memory copy of the index, so it
sees what is on disk now while changing nothing on disk, in object storage or in the index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ckptkeeper.config import Settings
from ckptkeeper.executor import ExecResult, Executor, Progress
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.logs import get_logger
from ckptkeeper.model import ActionKind, Plan, TierUsage

log = get_logger("ckptkeeper.operations")

EXIT_OK = 0
EXIT_ACTION_FAILED = 1
EXIT_REFUSED = 3
EXIT_LOCKED = 11

KINDS = ("retention", "reap")


class Locked(Exception):
    """Another process holds the executor lock."""


@dataclass
class PruneOutcome:
    plan: Plan
    result: ExecResult | None
    exit_code: int
    failed: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0
    dry_run: bool = False


def tier_usage(settings: Settings) -> dict[str, TierUsage | None]:
    """Filesystem usage per local tier (watermarks); object stores have none."""
    import shutil

    out: dict[str, TierUsage | None] = {}
    for tier in settings.tiers:
        if not tier.is_local:
            out[tier.name] = None
            continue
        try:
            du = shutil.disk_usage(tier.local_path)
        except OSError:
            out[tier.name] = None
            continue
        out[tier.name] = TierUsage(total_bytes=du.total, used_bytes=du.used)
    return out


def make_plan(
    settings: Settings,
    index: Index,
    *,
    now: float | None = None,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
) -> Plan:
    from ckptkeeper.planner import plan

    specs = settings.tier_specs()
    snapshot = index.snapshot([t.name for t in specs])
    result = plan(
        snapshot,
        specs,
        tier_usage(settings),
        time.time() if now is None else now,
        reaper=settings.reaper.to_policy() if "reap" in kinds else None,
        max_delete=settings.max_delete,
        force=force,
        run=run,
    )
    if "retention" not in kinds:
        # Reap-only pass (the daemon's reap job): retention actions wait for their own job.
        result = Plan(
            actions=tuple(a for a in result.actions if a.action is ActionKind.REAP),
            keep=result.keep,
            reclaim_bytes=result.reclaim_bytes,
            refused=result.refused,
            notes=result.notes,
        )
    return result


@contextmanager
def executor_lock(settings: Settings, timeout: float) -> Iterator[None]:
    """One executor per index (flock); waits up to ``timeout`` seconds, then raises Locked."""
    from ckptkeeper.lock import ExecutorLock, LockHeld

    lock = ExecutorLock(settings.index)
    try:
        lock.acquire(timeout)
    except LockHeld as exc:
        raise Locked(str(exc)) from None
    try:
        yield
    finally:
        lock.release()


def run_prune(
    settings: Settings,
    index: Index,
    *,
    dry_run: bool = False,
    force: bool = False,
    run: str | None = None,
    kinds: Sequence[str] = KINDS,
    rescan: bool = True,
    lock_timeout: float = 5.0,
    stop: threading.Event | None = None,
    progress: Progress | None = None,
    now: Callable[[], float] = time.time,
) -> PruneOutcome:
    """Reconcile, plan and (unless ``dry_run``) execute. Raises Locked if another executor runs."""
    from ckptkeeper.catalog import Catalog

    if dry_run:
        with index.in_memory_copy() as scratch:
            if rescan:
                Catalog(settings, scratch).reconcile()
            plan = make_plan(settings, scratch, now=now(), force=force, run=run, kinds=kinds)
        code = EXIT_REFUSED if plan.refused else EXIT_OK
        return PruneOutcome(plan=plan, result=None, exit_code=code, dry_run=True)

    with executor_lock(settings, lock_timeout):
        executor = Executor(
            index,
            settings.tier_specs(),
            stop=stop,
            progress=progress,
            partial_after=settings.reaper.partial_after,
            clock=now,
        )
        recovered = executor.recover()
        if rescan:
            Catalog(settings, index).reconcile()
        plan = make_plan(settings, index, now=now(), force=force, run=run, kinds=kinds)
        result = executor.apply(plan)
        result.recovered = recovered + result.recovered
        if result.done or result.failed:
            # Make the index reflect what the tiers now hold (cheap: unchanged checkpoints are not rehashed).
            Catalog(settings, index).reconcile()
    failed = [
        f"{a.action.value} {a.path} ({a.tier}{' -> ' + a.to_tier if a.to_tier else ''}): {err}"
        for a, err in result.failed
    ]
    code = EXIT_ACTION_FAILED if failed else (EXIT_REFUSED if plan.refused else EXIT_OK)
    return PruneOutcome(
        plan=plan,
        result=result,
        exit_code=code,
        failed=failed,
        reclaimed_bytes=sum(result.reclaimed_bytes.values()),
    )


def find_checkpoint(index: Index, run: str, step: str | int) -> CheckpointRow:
    """Resolve ``latest`` / ``best`` / a step number to one complete cataloged checkpoint."""
    rows = [
        r for r in index.checkpoints(run) if r.state.value == "complete" and r.version and r.verified_tiers
    ]
    if not rows:
        raise LookupError(f"no complete checkpoint of run {run!r} with a verified copy in the index")
    if step == "latest":
        return max(rows, key=lambda r: (r.step, r.name))
    if step == "best":
        raise LookupError("use find_best with the tier policy's metric")
    try:
        wanted = int(step)
    except (TypeError, ValueError):
        raise LookupError(f"step must be a number, 'latest' or 'best', not {step!r}") from None
    matches = [r for r in rows if r.step == wanted]
    if not matches:
        raise LookupError(f"run {run!r} has no complete checkpoint at step {wanted}")
    return max(matches, key=lambda r: r.name)


def find_best(settings: Settings, index: Index, run: str) -> CheckpointRow:
    """The best checkpoint by the first tier policy that names a metric."""
    tier = next((t for t in settings.tiers if t.metric), None)
    if tier is None or tier.metric is None:
        raise LookupError("no tier names a metric (set `metric` and `mode` on a tier to use best)")
    metric, mode = tier.metric, tier.mode
    rows = [
        r
        for r in index.checkpoints(run)
        if r.state.value == "complete" and r.verified_tiers and metric in r.metrics
    ]
    if not rows:
        raise LookupError(f"no complete checkpoint of run {run!r} reports {metric}")
    key = (
        (lambda r: (r.metrics[metric], -r.step))
        if mode == "min"
        else (lambda r: (-r.metrics[metric], -r.step))
    )
    return min(rows, key=key)


def restore(
    settings: Settings,
    index: Index,
    run: str,
    step: str | int,
    to: Path,
    *,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Materialise a verified copy from the fastest tier that holds it; returns its path.

    When ``to`` is the run's own hot directory and the hot copy is intact, the hot copy itself is
    returned: restoring onto itself would be a no-op at best.
    """
    from ckptkeeper.storage import StorageError, TierStorage

    row = find_best(settings, index, run) if step == "best" else find_checkpoint(index, run, step)
    manifest = row.manifest()
    if manifest is None:
        raise LookupError(f"{run}@{row.step} has no manifest in the index")
    order = [t for t in settings.tiers if t.name in row.verified_tiers]
    hot = settings.hot
    target = Path(to)
    if order and order[0].name == hot.name:
        in_place = hot.local_path / run
        if target.resolve() == in_place.resolve():
            storage = TierStorage(hot.to_spec(), hot=True)
            if not storage.verify(manifest, deep=False):
                return in_place / row.name
    errors = []
    for tier in order:
        storage = TierStorage(tier.to_spec(), hot=tier.name == hot.name)
        try:
            path = storage.fetch(manifest, target, progress=progress)
        except StorageError as exc:
            log.warning("restore from tier failed, trying the next", tier=tier.name, error=str(exc))
            errors.append(f"{tier.name}: {exc}")
            continue
        _uniform_mtime(path, manifest.created_at or time.time())
        return path
    raise LookupError(f"could not restore {run}@{row.step}: " + "; ".join(errors or ["no tier holds it"]))


def _uniform_mtime(path: Path, when: float) -> None:
    """Give every restored file one mtime: layouts read "a shard newer than its marker" as a save
    in progress (torch DCP), and the copy order would otherwise decide that."""
    import os

    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*filenames, *dirnames):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)
