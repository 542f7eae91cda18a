"""``ls --deleted`` and ``undelete``: what the undo window can bring back, and bringing it back.

A tier with ``undo_window`` moves expired and reaped copies into its trash (docs/undo-window.md);
the planner purges them when the window ends or the tier is above its high watermark. These
actions read the trash the last listing recorded (every prune and scan lists it) and, for
``undelete``, take the executor lock, so a prune never purges an entry while it comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptkeeper.actions.index import executor_lock
from ckptkeeper.config import Settings
from ckptkeeper.core.model import CheckpointState, Manifest, TrashEntry
from ckptkeeper.index import DAMAGED, Index
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.undo")


class NothingToUndelete(Exception):
    """No trash entry of that checkpoint (never trashed, or purged when its window ended)."""


class UndeleteRefused(Exception):
    """A live copy occupies the place, or the trashed copy is not what its manifest says."""


def deleted(settings: Settings, index: Index, run: str | None = None) -> list[dict[str, Any]]:
    """What ``undelete`` can bring back, newest deletion first: one dict per trash entry this node
    owns (``ls --deleted --json``). ``expires_at`` is when the planner purges it (deleted_at +
    the tier's ``undo_window``; the next prune when the tier has none any more, shown as
    ``deleted_at``); pressure on the tier's disk can purge it sooner."""
    windows = {t.name: t.undo_window for t in settings.tiers}
    out = []
    for e, _manifest in index.trash(run):
        if e.node and settings.node and e.node != settings.node:
            continue  # another node's (docs/design.md, "Many nodes"): not ours to bring back
        window = windows.get(e.tier)
        out.append(
            {
                "run": e.run,
                "step": e.step,
                "name": e.name,
                "tier": e.tier,
                "bytes": e.bytes,
                "deleted_at": e.deleted_at,
                "expires_at": e.deleted_at + window if window is not None else e.deleted_at,
                "entry": e.path,
                "node": e.node or settings.node,
            }
        )
    return out


@dataclass
class Undeleted:
    entry: TrashEntry

    def to_dict(self) -> dict[str, Any]:
        e = self.entry
        return {
            "run": e.run,
            "step": e.step,
            "name": e.name,
            "tier": e.tier,
            "path": e.rel_path,
            "bytes": e.bytes,
            "deleted_at": e.deleted_at,
        }


def refuse_beside_newer(index: Index, entry: TrashEntry, manifest: Manifest, window: float | None) -> None:
    """Raise :class:`UndeleteRefused` when the run wrote this checkpoint again since it was
    deleted: a copy of another version of it in any tier (or a save of it in progress).

    Brought back, the old version would sit beside the new one under one name: the next prune
    could no longer copy the new version to the tier holding the old one, on every pass."""
    for row in index.checkpoints_at_step(entry.run, entry.step):
        if row.name != entry.name:
            continue  # another file at the same step (``-v1``): no key of it is the entry's
        # a damaged copy records its problem, not its version: it is of the row's current version
        versions = {t: row.version if v.startswith(DAMAGED) else v for t, v in row.locations.items()}
        others = {t: v or "unknown" for t, v in versions.items() if v != manifest.digest}
        writing = row.state is CheckpointState.WRITING and row.version != manifest.digest
        if not others and not writing:
            continue
        where = (
            ", ".join(f"{t} (version {v[:12]})" for t, v in sorted(others.items()))
            or "the hot tier (a save in progress)"
        )
        until = (
            f" until {time.strftime('%Y-%m-%d %H:%M', time.localtime(entry.deleted_at + window))}"
            if window is not None
            else ""
        )
        raise UndeleteRefused(
            f"{entry.run}@{entry.step} was written again since this copy was deleted: another version of "
            f"{entry.rel_path} is in {where}. Bringing back the deleted one (version {manifest.digest[:12]}) "
            "would put two versions of one checkpoint side by side, and no later prune could move the newer "
            f"one. Nothing was changed: the deleted version stays in the trash of {entry.tier} "
            f"(entry {entry.path}){until}; to keep it too, copy it out of that entry to another place"
        )


def undelete(
    settings: Settings, index: Index, run: str, step: int, tier: str | None = None, lock_timeout: float = 5.0
) -> Undeleted:
    """Bring ``run@step`` back from the trash of ``tier`` (default: the fastest tier whose trash
    holds it, its newest entry there), checked against its manifest, then re-catalog that tier.

    Raises :class:`NothingToUndelete`, :class:`UndeleteRefused`, or ``Locked`` (another executor)."""
    from ckptkeeper.executor import Executor
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.storage import StorageError

    order = {t.name: i for i, t in enumerate(settings.tiers)}
    if tier is not None and tier not in order:
        raise NothingToUndelete(f"no tier named {tier!r} (tiers: {', '.join(order)})")
    with executor_lock(settings, lock_timeout):
        executor = Executor(index, settings.tier_specs())
        executor.recover()
        # the trash as it is now (a purge or another undelete since the last listing)
        catalog = Catalog(settings, index)
        for name in order if tier is None else [tier]:
            if name == settings.hot.name:
                catalog.reconcile_hot_trash()
            else:
                catalog.reconcile_tier(name)
        found = [
            (e, m)
            for e, m in index.trash(run, step)
            if (tier is None or e.tier == tier) and not (e.node and settings.node and e.node != settings.node)
        ]
        if not found:
            where = f"the trash of {tier}" if tier else "any tier's trash"
            raise NothingToUndelete(
                f"nothing to undelete: {run}@{step} is not in {where} (never moved aside, or its undo "
                "window passed and it was purged; `ckptkeeper ls --deleted` lists what can come back)"
            )
        found.sort(key=lambda t: (order.get(t[0].tier, len(order)), -t[0].deleted_at))
        entry, manifest = found[0]
        for row in index.checkpoints_at_step(run, step):
            if row.name == entry.name and entry.tier in row.locations:
                raise UndeleteRefused(
                    f"{run}@{step} already has a live copy in {entry.tier} ({entry.rel_path}): "
                    "not undeleting over it"
                )
        window = next((t.undo_window for t in settings.tiers if t.name == entry.tier), None)
        refuse_beside_newer(index, entry, manifest, window)
        try:
            executor.undelete_entry(entry, manifest)
        except StorageError as exc:
            raise UndeleteRefused(str(exc)) from exc
        log.info("undeleted", run=run, step=step, tier=entry.tier, entry=entry.path)
        if entry.tier == settings.hot.name:
            catalog.reconcile_run(entry.run)
        else:
            catalog.reconcile_tier(entry.tier)
    return Undeleted(entry)
