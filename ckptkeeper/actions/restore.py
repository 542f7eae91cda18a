"""Resume helpers for training scripts: ``ckptkeeper.restore`` and ``ckptkeeper.latest``.

A resume script runs as the training user, who may only read the daemon's index: the index is
opened read-only when it is not writable, and the hot run directory is re-recognised on the spot
when it can be written, so a checkpoint saved a second ago is found even if no daemon is running.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptkeeper.config import Settings, load_settings
from ckptkeeper.index import Index


def _open(config: str | os.PathLike[str] | Settings | None, run: str) -> tuple[Settings, Index]:
    settings = config if isinstance(config, Settings) else load_settings(config)
    path = Path(settings.index)
    writable = os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK)
    index = Index(path, readonly=not writable)
    if writable:
        from ckptkeeper.ingest.catalog import Catalog

        if (settings.hot.local_path / run).is_dir():
            Catalog(settings, index).reconcile_run(run)
    return settings, index


def restore(
    run: str,
    step: str | int = "latest",
    to: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | Settings | None = None,
) -> Path:
    """Local path of a verified checkpoint of ``run``: ``"latest"``, ``"best"`` or a step number.

    ``to`` defaults to the run's directory in the hot tier: when the checkpoint is still there, that
    copy is returned as is; otherwise it is fetched (verified) from the fastest tier holding it.
    Raises LookupError when the run has no such checkpoint anywhere.
    """
    from ckptkeeper.actions import prune as operations

    settings, index = _open(config, run)
    try:
        target = Path(to) if to is not None else settings.hot.local_path / run
        return operations.restore(settings, index, run, step, target)
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
