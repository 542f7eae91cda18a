"""User-visible operations shared by the CLI and the daemon (borgmatic's "actions" layer).

Each function wires the core together for one operation: reconcile, snapshot, plan, execute.
Dry-run travels down as a value: a dry run reconciles into an in-memory copy of the index, so it
sees what is on disk now while changing nothing on disk, in object storage or in the index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.model import ActionKind, Checkpoint, CheckpointState, Plan, Snapshot, TierUsage
from ckptkeeper.executor import ExecResult, Executor, Progress
from ckptkeeper.index import CheckpointRow, Index, IndexCorrupt
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.prune")

EXIT_OK = 0
EXIT_ACTION_FAILED = 1
EXIT_REFUSED = 3
EXIT_LOCKED = 11

KINDS = ("retention", "reap")


class Locked(Exception):
    """Another process holds the executor lock."""


class IndexUnusable(Exception):
    """The index is corrupt and was not rebuilt (the message says how to rebuild it)."""


# -- a corrupt index: detect, move aside, rebuild from the tiers, hold deletes ------------------

HELD_SUFFIX = ".deletes-held"


def deletes_held_path(settings: Settings) -> Path:
    index = Path(settings.index)
    return index.with_name(index.name + HELD_SUFFIX)


def read_hold(settings: Settings) -> dict[str, Any] | None:
    """The hold a rebuild left (``reason``, ``pins_salvaged``, ``first_pass_done``), or None."""
    try:
        text = deletes_held_path(settings).read_text()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            return doc
    except ValueError:
        pass
    # unreadable: the strictest hold
    return {"reason": text.strip() or "index rebuilt", "pins_salvaged": False, "first_pass_done": False}


def deletes_held(settings: Settings) -> str | None:
    """What is held and why (for ``status``), or None."""
    hold = read_hold(settings)
    if hold is None:
        return None
    if not hold.get("first_pass_done"):
        return f"every delete and reap, for one prune pass: {hold.get('reason')}"
    return (
        f"expiries and reaps (moves go on): {hold.get('reason')}; the index was rebuilt without its "
        "pins: re-pin what must be kept, then run `ckptkeeper prune --force`"
    )


def _write_hold(settings: Settings, doc: dict[str, Any]) -> None:
    held = deletes_held_path(settings)
    tmp = held.with_name(held.name + ".tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, held)


def _corruption(exc: BaseException) -> bool:
    """A damaged database, as opposed to one that is busy, missing or on a failing disk."""
    if isinstance(exc, IndexCorrupt):
        return True
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text or not isinstance(exc, sqlite3.OperationalError)


def open_index(settings: Settings, *, check: bool = False, rebuild: bool = False) -> Index:
    """Open the index; with ``check`` run SQLite's ``quick_check`` first.

    A corrupt index (unreadable, or failing the check) is moved aside as
    ``<index>.corrupt-<time>`` and, with ``rebuild``, rebuilt from the tiers: the hot tier is
    scanned and every slower tier listed through the manifests beside its copies. What only the
    index knew is lost with it — pins (salvaged from the damaged file when it still reads), the
    journal — so deletes are then held (``<index>.deletes-held``): the first prune after a rebuild
    copies but deletes and reaps nothing, and releases the hold once a reconcile listed every
    tier. Without ``rebuild`` a corrupt index raises :class:`IndexUnusable`.
    """
    ix: Index | None = None
    try:
        ix = Index(settings.index)
        if check:
            ix.quick_check()
        return ix
    except Exception as exc:
        if ix is not None:
            ix.close()
        if not _corruption(exc):
            raise
        problem = f"{type(exc).__name__}: {exc}"
    if not rebuild:
        raise IndexUnusable(
            f"index {settings.index} is corrupt ({problem}); `ckptkeeper scan` rebuilds it from the tiers"
        )
    with executor_lock(settings, timeout=60.0):
        return _rebuild(settings, problem)


def _rebuild(settings: Settings, problem: str) -> Index:
    from ckptkeeper.ingest.catalog import Catalog

    path = Path(settings.index)
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    reason = f"index rebuilt from the tiers at {time.strftime('%Y-%m-%d %H:%M:%S')} ({problem})"
    # The hold first: a crash in the middle of a rebuild must not leave a fresh index that deletes.
    hold = {"reason": reason, "pins_salvaged": False, "first_pass_done": False}
    _write_hold(settings, hold)
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            os.replace(src, Path(str(aside) + suffix))
    log.error(
        "index corrupt: moved aside, rebuilding from the tiers; deletes held until a full reconcile",
        index=str(path),
        moved_to=str(aside),
        problem=problem,
    )
    pins = _salvage_pins(aside)
    ix = Index(path)
    report = Catalog(settings, ix).reconcile()
    wanted = sorted(set(pins or ()))
    restored = sum(ix.set_pinned(run, step, True) > 0 for run, step in wanted)
    # Relaxed only once every pin is back in the index: a crash before this, or a pinned checkpoint
    # in a tier that could not be listed, keeps the strict hold.
    if pins is not None and restored == len(wanted):
        _write_hold(settings, {**hold, "pins_salvaged": True})
    log.warning(
        "index rebuilt from the tiers",
        checkpoints=len(ix.checkpoints()),
        tiers_failed=sorted(report.tiers_failed),
        pins_salvaged=None if pins is None else len(wanted),
        pins_restored=restored,
    )
    if pins is None or restored != len(wanted):
        log.error(
            "pins could not all be restored from the damaged index: expiries and reaps stay held; re-pin "
            "what must be kept (ckptkeeper pin), then run `ckptkeeper prune --force`",
            pins_restored=restored,
            pins_salvaged=None if pins is None else len(wanted),
        )
    return ix


def _salvage_pins(aside: Path) -> list[tuple[str, int]] | None:
    """Pins live only in the index: read them from the damaged file (None: it does not read)."""
    try:
        con = sqlite3.connect(f"file:{aside}?mode=ro", uri=True, timeout=1)
        try:
            rows = con.execute("SELECT run, step FROM checkpoints WHERE pinned = 1").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return [(str(r), int(s)) for r, s in rows]


def _apply_hold(plan: Plan, hold: dict[str, Any], force: bool) -> Plan:
    """After a rebuild: the first pass only copies (copies add safety); later passes also move
    (a move deletes a source only once its new copy is verified), but while the pins are unknown
    nothing that destroys a last copy — an expiry, a reap — runs until ``--force``."""
    if not hold.get("first_pass_done"):
        kept = tuple(a for a in plan.actions if a.action is ActionKind.COPY)
        why = f"deletes held for the first pass after the index was rebuilt: {hold.get('reason')}"
    elif not hold.get("pins_salvaged") and not force:
        kept = tuple(
            a
            for a in plan.actions
            if a.action is ActionKind.COPY or (a.action is ActionKind.DELETE and a.rule != "expired")
        )
        why = (
            "expiries and reaps held: the index was rebuilt without its pins; re-pin what must be kept, "
            "then run `ckptkeeper prune --force`"
        )
    else:
        return plan
    if len(kept) == len(plan.actions):
        return dataclasses.replace(plan, notes=(*plan.notes, why))
    log.warning("destructive actions held", held=len(plan.actions) - len(kept), reason=why)
    return dataclasses.replace(
        plan,
        actions=kept,
        refused=f"{plan.refused}; {why}" if plan.refused else why,
        reclaim_bytes=dict.fromkeys(plan.reclaim_bytes, 0),
    )


def _after_held_pass(
    settings: Settings, index: Index, hold: dict[str, Any], kinds: Sequence[str], force: bool
) -> None:
    """Advance the hold: the first pass with retention that listed every tier ends phase one."""
    if not hold.get("first_pass_done"):
        statuses = index.tier_statuses()
        failing = [t.name for t in settings.tiers if not (statuses.get(t.name) and statuses[t.name].ok)]
        if "retention" not in kinds or failing:
            if failing:
                log.warning("deletes stay held: tiers not listed since the rebuild", tiers=failing)
            return
        if hold.get("pins_salvaged"):
            deletes_held_path(settings).unlink(missing_ok=True)
            log.warning(
                "every tier reconciled since the index was rebuilt: deletes resume from the next pass"
            )
        else:
            _write_hold(settings, {**hold, "first_pass_done": True})
            log.error(
                "every tier reconciled since the index was rebuilt; moves resume, expiries and reaps stay "
                "held until `ckptkeeper prune --force` (the pins were lost with the index)"
            )
    elif force:
        deletes_held_path(settings).unlink(missing_ok=True)
        log.warning("expiries and reaps released by --force")


# -- one checkpoint per (run, step) for the planner --------------------------------------------


def one_per_step(snapshot: Snapshot) -> tuple[Snapshot, list[str]]:
    """The planner keys checkpoints by (run, step), the catalog by (run, name): Lightning's
    ``-v1`` files and NeMo's ``-last`` copies share a step with another checkpoint. The planner
    gets one per (run, step) — complete before incomplete, then the newest written, then the
    name — and the others are left exactly where they are: never moved, deleted or reaped.
    """
    groups: dict[tuple[str, int], list[Checkpoint]] = {}
    for c in snapshot.checkpoints:
        groups.setdefault(c.key, []).append(c)
    if all(len(g) == 1 for g in groups.values()):
        return snapshot, []
    keep: list[Checkpoint] = []
    notes: list[str] = []
    for (run, step), group in groups.items():
        group.sort(key=lambda c: (c.state is CheckpointState.COMPLETE, c.last_write, c.created_at, c.name))
        keep.append(group[-1])
        if len(group) > 1:
            others = ", ".join(c.name for c in group[:-1])
            notes.append(
                f"{run}@{step}: {len(group)} checkpoints share this step; planning {group[-1].name}, "
                f"leaving {others} untouched"
            )
    return dataclasses.replace(snapshot, checkpoints=tuple(keep)), sorted(notes)


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
    from ckptkeeper.core.planner import plan
    from ckptkeeper.util.gc import gc_paused

    specs = settings.tier_specs()
    snapshot, shared_steps = one_per_step(index.snapshot([t.name for t in specs]))
    with gc_paused():  # a plan allocates millions of objects for a big catalog, none in cycles
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
    if shared_steps:
        result = dataclasses.replace(result, notes=(*result.notes, *shared_steps))
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
    from ckptkeeper.util.lock import ExecutorLock, LockHeld

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
    from ckptkeeper.ingest.catalog import Catalog

    if dry_run:
        with index.in_memory_copy() as scratch:
            if rescan:
                Catalog(settings, scratch).reconcile()
            plan = make_plan(settings, scratch, now=now(), force=force, run=run, kinds=kinds)
        hold = read_hold(settings)
        if hold is not None:
            plan = _apply_hold(plan, hold, force)
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
        hold = read_hold(settings)
        if hold is not None:
            plan = _apply_hold(plan, hold, force)
        result = executor.apply(plan)
        result.recovered = recovered + result.recovered
        if rescan and (result.done or result.failed):
            # Make the index reflect what the tiers now hold (cheap: unchanged checkpoints are not rehashed).
            # Without ``rescan`` the caller reconciles what the pass touched (the daemon: by run).
            Catalog(settings, index).reconcile()
        if hold is not None and not result.stopped:
            _after_held_pass(settings, index, hold, kinds, force)
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
