"""``restore``: materialise a verified checkpoint from the fastest tier holding it.

Also the resume helpers for training scripts, ``ckptkeeper.restore`` and ``ckptkeeper.latest``
(``ckptkeeper/__init__.py`` maps them here lazily). A resume script runs as the training user, who
may only read the daemon's index: the index is opened read-only when it is not writable, and the hot
run directory is re-recognised on the spot when it can be written, so a checkpoint saved a second
ago is found even if no daemon is running.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptkeeper.actions.progress import byte_progress
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.storage import StorageError, TierStorage
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.config import Settings  # pydantic: the CLI hands a restore a validated config

# The catalog and the layouts (ingest) are imported where used: `ckptkeeper restore` needs neither
# unless --step best reads a framework's record, or the Python API re-catalogs the hot run.

log = get_logger("ckptkeeper.actions.restore")

_T = TypeVar("_T")


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
        raise LookupError("use find_best for 'best'")
    try:
        wanted = int(step)
    except (TypeError, ValueError):
        raise LookupError(f"step must be a number, 'latest' or 'best', not {step!r}") from None
    matches = [r for r in rows if r.step == wanted]
    if not matches:
        raise LookupError(f"run {run!r} has no complete checkpoint at step {wanted}")
    return max(matches, key=lambda r: r.name)


BEST_OPTIONS = (
    "pass metric=... and mode='min'|'max' (CLI: --metric NAME --mode min|max), or set `metric` and "
    "`mode` on a tier"
)


def find_best(
    settings: Settings,
    index: Index,
    run: str,
    *,
    metric: str | None = None,
    mode: str | None = None,
) -> CheckpointRow:
    """The best complete checkpoint of ``run``, by the first source that can tell:

    1. ``metric`` / ``mode`` given by the caller (metrics come from the layouts and the hook's commits);
    2. the framework's own record of its best: HF ``best_model_checkpoint`` in ``trainer_state.json``,
       Lightning ``ModelCheckpoint``'s ``best_model_path`` in the newest ``.ckpt`` (read from the hot
       tier without unpickling);
    3. the first tier policy that names a metric.

    LookupError naming the options when none applies.
    """
    if mode is not None and mode not in ("min", "max"):
        raise LookupError(f"mode must be 'min' or 'max', not {mode!r}")
    rows = [r for r in index.checkpoints(run) if r.state.value == "complete" and r.verified_tiers]
    if not rows:
        raise LookupError(f"no complete checkpoint of run {run!r} with a verified copy in the index")
    if metric is None and mode is None:
        framework = _framework_best(settings, run, rows)
        if framework is not None:
            return framework
        tier = next((t for t in settings.tiers if t.metric), None)
        if tier is None or tier.metric is None:
            raise LookupError(
                f"cannot tell the best checkpoint of run {run!r}: no metric given, no framework record "
                f"of its best (HF best_model_checkpoint, Lightning best_model_path) and no tier names "
                f"a metric; {BEST_OPTIONS}"
            )
        metric, mode = tier.metric, tier.mode
    elif metric is None:
        raise LookupError(f"mode={mode!r} without a metric; {BEST_OPTIONS}")
    return best_by_metric(rows, lambda r: r.metrics, lambda r: r.step, run, metric, mode or "min")


def best_by_metric(
    items: Sequence[_T],
    metrics: Callable[[_T], Mapping[str, float]],
    step: Callable[[_T], int],
    run: str,
    metric: str,
    mode: str,
) -> _T:
    """The one ranking of "best": the lowest (``min``) or highest (``max``) ``metric``, the newer step
    on a tie. Index rows and another node's manifests are ranked alike, so ``--node`` never picks
    a different "best" than a local restore would from the same checkpoints."""
    scored = [item for item in items if metric in metrics(item)]
    if not scored:
        seen = sorted({k for item in items for k in metrics(item)})
        raise LookupError(
            f"no complete checkpoint of run {run!r} reports {metric!r} "
            f"(metrics reported: {', '.join(seen) or 'none'})"
        )
    sign = -1.0 if mode == "max" else 1.0
    return min(scored, key=lambda item: (sign * metrics(item)[metric], -step(item)))


def _framework_best(settings: Settings, run: str, rows: list[CheckpointRow]) -> CheckpointRow | None:
    """The checkpoint the training framework itself recorded as best, read from the newest
    checkpoint still in the hot tier that carries such a record; None when there is none."""
    run_dir = settings.hot.local_path / run
    by_name = {r.name: r for r in rows}
    for row in sorted(rows, key=lambda r: (r.step, r.name), reverse=True):
        recorded = _recorded_best(run_dir / row.name, row)
        if not recorded:
            continue
        base = os.path.dirname(row.name)
        # The record is an absolute or output-dir-relative path: match it by its name beside this one.
        name = os.path.basename(recorded.rstrip("/"))
        found = by_name.get(f"{base}/{name}" if base else name)
        if found is not None:
            return found
        log.warning("framework's best checkpoint is not cataloged complete", run=run, recorded=recorded)
        return None
    return None


def _recorded_best(path: Path, row: CheckpointRow) -> str | None:
    from ckptkeeper.ingest.layouts.base import MAX_MARKER_BYTES, torch_pickle_values
    from ckptkeeper.ingest.layouts.hf import TRAINER_STATE

    if row.layout == "hf":
        try:
            with open(path / TRAINER_STATE, "rb") as f:
                doc = json.loads(f.read(MAX_MARKER_BYTES))
        except (OSError, ValueError):
            return None
        best = doc.get("best_model_checkpoint") if isinstance(doc, dict) else None
        return best if isinstance(best, str) and best else None
    if row.name.endswith(".ckpt") and path.is_file():
        values = [v for v in torch_pickle_values(str(path), "best_model_path") if isinstance(v, str) and v]
        return values[0] if values else None
    return None


@dataclass(frozen=True, slots=True)
class Restored:
    """Where a restore put a checkpoint (``restore --json`` prints these fields)."""

    path: Path
    run: str
    step: int
    name: str
    tier: str | None
    """The tier it was read from; None when the hot copy was returned in place."""
    bytes: int
    skipped: tuple[tuple[int, str], ...] = ()
    """``latest`` only: newer checkpoints passed over, each with why no tier gave a verified copy."""
    parts: tuple[tuple[int, str, int], ...] | None = None
    """A checkpoint spanning nodes: (part index, node, bytes) of each part fetched;
    None for an ordinary checkpoint."""
    count: int | None = None
    """Its number of parts (all of them are in ``path`` unless ``--part`` chose one)."""

    def to_json(self) -> dict[str, Any]:
        """What ``restore --json`` prints (run locally or by the daemon alike)."""
        doc: dict[str, Any] = {
            "run": self.run,
            "step": self.step,
            "name": self.name,
            "path": str(self.path),
            "from_tier": self.tier,
            "bytes": self.bytes,
            "skipped": [{"step": s, "error": why} for s, why in self.skipped],
        }
        if self.parts is not None:  # a checkpoint spanning nodes: which parts, from which nodes
            doc["count"] = self.count
            doc["parts"] = [{"part": k, "node": n, "bytes": b} for k, n, b in self.parts]
        return doc


def _latest_candidates(index: Index, run: str) -> list[CheckpointRow]:
    """Every complete checkpoint with a verified copy, newest first (``latest`` and its fallbacks)."""
    newest = find_checkpoint(index, run, "latest")  # raises LookupError when there is none
    rows = [
        r for r in index.checkpoints(run) if r.state.value == "complete" and r.version and r.verified_tiers
    ]
    rows.sort(key=lambda r: (r.step, r.name), reverse=True)
    return [newest, *(r for r in rows if r.id != newest.id)]


def restore_to(
    settings: Settings,
    index: Index,
    run: str,
    step: str | int,
    to: Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    metric: str | None = None,
    mode: str | None = None,
    node: str | None = None,
    part: int | None = None,
    own_part: bool = False,
) -> Restored:
    """Materialise a verified copy from the fastest tier that holds it.

    A checkpoint spanning nodes is restored whole from the shared tiers, all its parts
    gathered into ``to/<name>`` (:mod:`ckptkeeper.actions.restore_parts`); ``part`` fetches only
    that part; ``own_part`` (the resume helpers, in place) keeps to this node's own part.

    ``progress(done, total)`` is called as bytes arrive (restarted from 0 if a tier fails and the
    next one is tried). When ``to`` is the run's own hot directory and the hot copy is intact, the
    hot copy itself is returned: restoring onto itself would be a no-op at best.

    ``latest`` is the newest checkpoint that *can* be restored verified: when every tier's copy of
    the newest fails (corrupt, cut short, unreadable), the previous one is tried, with a warning
    logged and the skipped steps returned in :attr:`Restored.skipped`. A step number or ``best``
    never silently becomes another checkpoint. ``metric`` / ``mode`` choose what ``best`` means
    (see :func:`find_best`).
    """
    if step != "best" and (metric is not None or mode is not None):
        raise LookupError("metric and mode only choose among checkpoints for step='best'")
    if part is not None or (not own_part and step != "best" and _spanning_here(settings, index, run, step)):
        return _restore_parts(settings, run, step, Path(to), part=part, progress=progress)
    if node is not None and node != settings.node:
        return _restore_from_fleet(
            settings, run, step, Path(to), node=node, progress=progress, metric=metric, mode=mode
        )
    try:
        if step == "latest":
            candidates = _latest_candidates(index, run)
        elif step == "best":
            candidates = [find_best(settings, index, run, metric=metric, mode=mode)]
        else:
            candidates = [find_checkpoint(index, run, step)]
    except LookupError:
        # A run this node's index does not hold may be another node's, in the shared tiers; on a
        # shared hot filesystem a run it holds may have been demoted by the lease holder.
        shared_fs = any(t.shared and t.is_local for t in settings.tiers)
        if not any(t.shared and not t.is_local for t in settings.tiers) or (
            index.checkpoints(run) and not shared_fs
        ):
            raise
        return _restore_from_fleet(
            settings, run, step, Path(to), node=node, progress=progress, metric=metric, mode=mode
        )
    skipped: list[tuple[int, str]] = []
    for i, row in enumerate(candidates):
        try:
            restored = _restore_row(settings, row, run, Path(to), progress)
        except LookupError as exc:
            if i + 1 == len(candidates):
                if skipped:
                    raise LookupError(
                        f"no checkpoint of run {run!r} could be restored verified; newest: "
                        + "; ".join(f"{s}: {why}" for s, why in skipped)
                        + f"; {row.step}: {exc}"
                    ) from None
                raise
            log.warning(
                "checkpoint could not be restored verified; falling back to the previous one",
                run=run,
                step=row.step,
                error=str(exc),
            )
            skipped.append((row.step, str(exc)))
            continue
        return dataclasses.replace(restored, skipped=tuple(skipped))
    raise LookupError(f"no complete checkpoint of run {run!r}")  # unreachable: candidates is never empty


def _restore_row(
    settings: Settings,
    row: CheckpointRow,
    run: str,
    target: Path,
    progress: Callable[[int, int], None] | None,
) -> Restored:
    manifest = row.manifest()
    if manifest is None:
        raise LookupError(f"{run}@{row.step} has no manifest in the index")
    total = manifest.total_bytes
    order = [t for t in settings.tiers if t.name in row.verified_tiers]
    hot = settings.hot
    if order and order[0].name == hot.name:
        in_place = hot.local_path / run
        if target.resolve() == in_place.resolve():
            storage = TierStorage(hot.to_spec(), hot=True)
            try:
                intact = not storage.verify(manifest, deep=False)
            except StorageError as exc:  # the run dir went since it was cataloged: the next tier
                log.warning("hot copy unreadable; restoring from the next tier", run=run, error=str(exc))
                intact = False
            if intact:
                return Restored(in_place / row.name, run, row.step, row.name, None, total)
    errors = []
    for tier in order:
        storage = TierStorage(tier.to_spec(), hot=tier.name == hot.name)
        try:
            path = storage.fetch(manifest, target, progress=byte_progress(total, progress))
        except StorageError as exc:
            log.warning("restore from tier failed, trying the next", tier=tier.name, error=str(exc))
            errors.append(f"{tier.name}: {exc}")
            continue
        _uniform_mtime(path, manifest.created_at or time.time())
        return Restored(path, run, row.step, row.name, tier.name, total)
    raise LookupError(f"could not restore {run}@{row.step}: " + "; ".join(errors or ["no tier holds it"]))


def restore_checkpoint(
    settings: Settings,
    index: Index,
    run: str,
    step: str | int,
    to: Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    metric: str | None = None,
    mode: str | None = None,
    node: str | None = None,
) -> Path:
    """:func:`restore_to`, returning only the restored checkpoint's path."""
    return restore_to(
        settings, index, run, step, to, progress=progress, metric=metric, mode=mode, node=node
    ).path


def _restore_from_fleet(
    settings: Settings,
    run: str,
    step: str | int,
    to: Path,
    *,
    node: str | None,
    progress: Callable[[int, int], None] | None,
    metric: str | None,
    mode: str | None,
) -> Restored:
    """Restore a run of any node from the shared tiers, by the rule of :func:`choose_holder`."""
    from ckptkeeper.fleet.view import choose_holder, run_holders, shared_tiers

    tiers = shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers[1:]])
    if not tiers:
        raise LookupError("--node needs a tier with shared = true (config)")
    try:
        holders = run_holders(tiers, run)
    except StorageError as exc:
        raise LookupError(f"cannot list the shared tiers: {exc}") from exc
    if node is None and step != "best":
        from ckptkeeper.actions.restore_parts import is_spanning

        if is_spanning(holders):
            return _restore_parts(settings, run, step, to, part=None, progress=progress, holders=holders)
    copies = choose_holder(holders, run, me=settings.node, node=node)
    if step == "latest":
        chosen = max(copies, key=lambda c: (c.manifest.step, c.manifest.name))
    elif step == "best":
        tier = next((t for t in settings.tiers if t.metric), None)
        if metric is None:
            if tier is None or tier.metric is None:
                raise LookupError(
                    "no tier names a metric (give --metric, or set `metric` on a tier, to use best)"
                )
            metric, mode = tier.metric, mode or tier.mode
        chosen = best_by_metric(
            copies, lambda c: c.manifest.metrics, lambda c: c.manifest.step, run, metric, mode or "min"
        )
    else:
        wanted = [c for c in copies if c.manifest.step == int(step)]
        if not wanted:
            raise LookupError(f"run {run!r} of node {copies[0].node} has no checkpoint at step {step}")
        chosen = max(wanted, key=lambda c: c.manifest.name)
    total = chosen.manifest.total_bytes
    try:
        path = chosen.storage.fetch(chosen.manifest, to, progress=byte_progress(total, progress))
    except StorageError as exc:
        raise LookupError(
            f"could not restore {run}@{chosen.manifest.step} from node {chosen.node}: {exc}"
        ) from exc
    _uniform_mtime(path, chosen.manifest.created_at or time.time())
    log.info(
        "restored from the fleet", run=run, step=chosen.manifest.step, node=chosen.node, tier=chosen.tier
    )
    return Restored(path, run, chosen.manifest.step, chosen.manifest.name, chosen.tier, total)


def _spanning_here(settings: Settings, index: Index, run: str, step: str | int) -> bool:
    """This node's own checkpoint ``run@step`` is a part of a checkpoint spanning nodes, and the
    shared tiers can give the whole version."""
    if not any(t.shared for t in settings.tiers):
        return False
    try:
        row = find_checkpoint(index, run, step)
    except LookupError:
        return False
    p = row.part
    return p is not None and p.count is not None and p.count > 1 and p.index is not None


def _restore_parts(
    settings: Settings,
    run: str,
    step: str | int,
    to: Path,
    *,
    part: int | None,
    progress: Callable[[int, int], None] | None,
    holders: Mapping[str, Sequence[Any]] | None = None,
) -> Restored:
    from ckptkeeper.actions.restore_parts import restore_parts  # only for shared tiers

    got = restore_parts(
        [TierStorage(t.to_spec()) for t in settings.tiers[1:]],
        run,
        step,
        to,
        part=part,
        holders=holders,
        progress=progress,
    )
    _uniform_mtime(got.path, time.time())
    return Restored(got.path, run, got.step, got.name, got.tier, got.bytes, parts=got.parts, count=got.count)


def _uniform_mtime(path: Path, when: float) -> None:
    """Give every restored file one mtime: layouts read "a shard newer than its marker" as a save
    in progress (torch DCP), and the copy order would otherwise decide that."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*filenames, *dirnames):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)


# -- the Python API -----------------------------------------------------------------------


def _open(config: str | os.PathLike[str] | Settings | None, run: str) -> tuple[Settings, Index]:
    from ckptkeeper.config import Settings, load_settings

    settings = config if isinstance(config, Settings) else load_settings(config)
    path = Path(settings.index)
    writable = os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK)
    index = Index(path, readonly=not writable)
    if writable and (settings.hot.local_path / run).is_dir():
        from ckptkeeper.ingest.catalog import Catalog  # the catalog and its layouts: only here

        Catalog(settings, index).reconcile_run(run)
    return settings, index


def restore(
    run: str,
    step: str | int = "latest",
    to: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | Settings | None = None,
    *,
    metric: str | None = None,
    mode: str | None = None,
    node: str | None = None,
    part: int | None = None,
) -> Path:
    """Local path of a verified checkpoint of ``run``: ``"latest"``, ``"best"`` or a step number.

    A checkpoint spanning nodes: with ``to`` given, all its parts gathered (from the shared tiers);
    without ``to`` (resume in place), this node's own part; ``part=K`` fetches only part K.

    ``"best"``: by ``metric`` (``mode`` ``"min"``, the default, or ``"max"``) when given; else the
    framework's own record (HF ``best_model_checkpoint``, Lightning ``best_model_path``); else the
    first tier that names a metric; else LookupError saying which options there are.
    ``node`` picks another node's run of that name from the shared tiers (docs/design.md, "Many nodes").

    ``to`` defaults to the run's directory in the hot tier: when the checkpoint is still there, that
    copy is returned as is; otherwise it is fetched (verified) from the fastest tier holding it.
    Raises LookupError when the run has no such checkpoint anywhere.
    """
    settings, index = _open(config, run)
    try:
        target = Path(to) if to is not None else settings.hot.local_path / run
        return restore_to(
            settings,
            index,
            run,
            step,
            target,
            metric=metric,
            mode=mode,
            node=node,
            part=part,
            own_part=to is None,
        ).path
    finally:
        index.close()


def latest(run: str, config: str | os.PathLike[str] | Settings | None = None) -> Path | None:
    """Path of the newest complete checkpoint of ``run`` for resuming, or None if it has none yet.

    Meant for ``trainer.fit(ckpt_path=ckptkeeper.latest("my-run"))``: a first attempt gets None
    and starts from scratch; a restarted one gets its last checkpoint back from whichever tier.
    """
    try:
        return restore(run, "latest", config=config)
    except LookupError:
        return None
