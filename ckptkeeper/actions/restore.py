"""``restore``: materialise a verified checkpoint from the fastest tier holding it.

Also the resume helpers for training scripts, ``ckptkeeper.restore`` and ``ckptkeeper.latest``
(``ckptkeeper/__init__.py`` maps them here lazily). A resume script runs as the training user, who
may only read the daemon's index: the index is opened read-only when it is not writable, and the hot
run directory is re-recognised on the spot when it can be written, so a checkpoint saved a second
ago is found even if no daemon is running.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ckptkeeper.config import Settings, load_settings
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.ingest.catalog import Catalog
from ckptkeeper.storage import StorageError, TierStorage
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.restore")


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


def restore_checkpoint(
    settings: Settings,
    index: Index,
    run: str,
    step: str | int,
    to: Path,
    *,
    progress: Callable[[int], None] | None = None,
    node: str | None = None,
) -> Path:
    """Materialise a verified copy from the fastest tier that holds it; returns its path.

    When ``to`` is the run's own hot directory and the hot copy is intact, the hot copy itself is
    returned: restoring onto itself would be a no-op at best. A run this node's index does not
    hold, or ``node`` naming another node, is looked up in the shared tiers (DESIGN §10,
    :mod:`ckptkeeper.fleet.view`).
    """
    if node is not None and node != settings.node:
        return _restore_from_fleet(settings, run, step, Path(to), node=node, progress=progress)
    try:
        row = find_best(settings, index, run) if step == "best" else find_checkpoint(index, run, step)
    except LookupError:
        if not any(t.shared for t in settings.tiers) or index.checkpoints(run):
            raise
        return _restore_from_fleet(settings, run, step, Path(to), node=node, progress=progress)
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


def _restore_from_fleet(
    settings: Settings,
    run: str,
    step: str | int,
    to: Path,
    *,
    node: str | None,
    progress: Callable[[int], None] | None,
) -> Path:
    """Restore a run of any node from the shared tiers, by the rule of :func:`choose_holder`."""
    from ckptkeeper.fleet.view import choose_holder, run_holders, shared_tiers

    tiers = shared_tiers([TierStorage(t.to_spec()) for t in settings.tiers[1:]])
    if not tiers:
        raise LookupError("--node needs a tier with shared = true (config)")
    try:
        holders = run_holders(tiers, run)
    except StorageError as exc:
        raise LookupError(f"cannot list the shared tiers: {exc}") from exc
    copies = choose_holder(holders, run, me=settings.node, node=node)
    if step == "latest":
        chosen = max(copies, key=lambda c: (c.manifest.step, c.manifest.name))
    elif step == "best":
        tier = next((t for t in settings.tiers if t.metric), None)
        if tier is None or tier.metric is None:
            raise LookupError("no tier names a metric (set `metric` and `mode` on a tier to use best)")
        metric, sign = tier.metric, (1.0 if tier.mode == "min" else -1.0)
        rated = [c for c in copies if metric in c.manifest.metrics]
        if not rated:
            raise LookupError(f"no checkpoint of run {run!r} reports {metric}")
        chosen = min(rated, key=lambda c: (sign * c.manifest.metrics[metric], -c.manifest.step))
    else:
        wanted = [c for c in copies if c.manifest.step == int(step)]
        if not wanted:
            raise LookupError(f"run {run!r} of node {copies[0].node} has no checkpoint at step {step}")
        chosen = max(wanted, key=lambda c: c.manifest.name)
    try:
        path = chosen.storage.fetch(chosen.manifest, to, progress=progress)
    except StorageError as exc:
        raise LookupError(
            f"could not restore {run}@{chosen.manifest.step} from node {chosen.node}: {exc}"
        ) from exc
    _uniform_mtime(path, chosen.manifest.created_at or time.time())
    log.info(
        "restored from the fleet", run=run, step=chosen.manifest.step, node=chosen.node, tier=chosen.tier
    )
    return path


def _uniform_mtime(path: Path, when: float) -> None:
    """Give every restored file one mtime: layouts read "a shard newer than its marker" as a save
    in progress (torch DCP), and the copy order would otherwise decide that."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*filenames, *dirnames):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)


# -- the Python API -----------------------------------------------------------------------


def _open(config: str | os.PathLike[str] | Settings | None, run: str) -> tuple[Settings, Index]:
    settings = config if isinstance(config, Settings) else load_settings(config)
    path = Path(settings.index)
    writable = os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK)
    index = Index(path, readonly=not writable)
    if writable and (settings.hot.local_path / run).is_dir():
        Catalog(settings, index).reconcile_run(run)
    return settings, index


def restore(
    run: str,
    step: str | int = "latest",
    to: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | Settings | None = None,
    node: str | None = None,
) -> Path:
    """Local path of a verified checkpoint of ``run``: ``"latest"``, ``"best"`` or a step number.

    ``node`` picks another node's run of that name from the shared tiers (DESIGN §10).

    ``to`` defaults to the run's directory in the hot tier: when the checkpoint is still there, that
    copy is returned as is; otherwise it is fetched (verified) from the fastest tier holding it.
    Raises LookupError when the run has no such checkpoint anywhere.
    """
    settings, index = _open(config, run)
    try:
        target = Path(to) if to is not None else settings.hot.local_path / run
        return restore_checkpoint(settings, index, run, step, target, node=node)
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
