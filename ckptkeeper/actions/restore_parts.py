"""Restore a checkpoint spanning nodes: all N parts gathered into one directory, or
one part (``--part K``), from the shared tiers.

Which copy is part k is what the version's part record says (:mod:`ckptkeeper.core.versions`):
a version is restored whole only when it is complete in a shared tier (every part's record points
at a present manifest of its digest). Each part is fetched verified against its own manifest, into
a staging directory beside the target; the parts' files are then put together (they are disjoint:
each node holds its ranks' shards; a file named by two parts is refused) and the whole directory
is renamed into place, so a failed restore leaves no half checkpoint at ``DIR/<name>``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.actions.progress import byte_progress
from ckptkeeper.core.model import Manifest
from ckptkeeper.core.versions import VersionStatus
from ckptkeeper.fleet.versions import read_version
from ckptkeeper.fleet.view import Copy, run_holders, shared_tiers
from ckptkeeper.storage import S3TierStorage, StorageError, TierStorage
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.restore_parts")

__all__ = ["PartsRestored", "is_spanning", "restore_parts"]


@dataclass(frozen=True)
class PartsRestored:
    path: Path
    step: int
    name: str
    tier: str
    bytes: int
    parts: tuple[tuple[int, str, int], ...]
    """(part index, node, bytes) of each part fetched."""
    count: int


def _is_part(m: Manifest) -> bool:
    p = m.part
    return p is not None and p.count is not None and p.count > 1 and p.index is not None


def is_spanning(copies: Mapping[str, Sequence[Copy]]) -> bool:
    """Whether the run's copies in the shared tiers are parts of a checkpoint spanning nodes."""
    return any(_is_part(c.manifest) for cs in copies.values() for c in cs)


def restore_parts(
    tiers: Sequence[TierStorage],
    run: str,
    step: str | int,
    to: Path,
    *,
    part: int | None = None,
    holders: Mapping[str, Sequence[Copy]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PartsRestored:
    """Fetch version ``run@step`` whole (or only ``part``) from the first shared tier where it (or
    that part) is verified; ``step`` is a number or ``latest`` (the newest such version)."""
    shared = shared_tiers(tiers)
    if not shared:
        raise LookupError("a checkpoint spanning nodes is restored from a tier with shared = true (config)")
    try:
        holders = run_holders(shared, run) if holders is None else holders
    except StorageError as exc:
        raise LookupError(f"cannot list the shared tiers: {exc}") from exc
    parts = [c for cs in holders.values() for c in cs if _is_part(c.manifest)]
    if not parts:
        raise LookupError(f"run {run!r} has no part of a checkpoint spanning nodes in the shared tiers")
    if step not in ("latest",) and not isinstance(step, int):
        try:
            step = int(step)
        except ValueError:
            raise LookupError(
                f"a checkpoint spanning nodes is restored by step number or latest, not {step!r}"
            ) from None
    steps = sorted({c.manifest.step for c in parts}, reverse=True) if step == "latest" else [int(step)]
    errors: list[str] = []
    for s in steps:
        found = _choose(shared, run, s, [c for c in parts if c.manifest.step == s], part, errors)
        if found is not None:
            return _fetch(found[0], found[1], to, part, progress)
    raise LookupError(
        f"no {'part ' + str(part) + ' of a ' if part is not None else ''}version of {run}"
        f"{'@' + str(step) if step != 'latest' else ''} complete in the shared tiers: " + "; ".join(errors)
    )


def _choose(
    shared: Sequence[S3TierStorage],
    run: str,
    step: int,
    copies: list[Copy],
    part: int | None,
    errors: list[str],
) -> tuple[VersionStatus, list[Copy]] | None:
    """The copies to fetch for ``run@step``: as the version's records in the first tier where it is
    complete (or where ``part`` is verified) name them."""
    if not copies:
        errors.append(f"step {step}: no part of it in the shared tiers")
        return None
    jobs = sorted(
        {(c.manifest.part.job or "", c.manifest.part.count or 0) for c in copies if c.manifest.part}
    )
    if len(jobs) > 1:
        errors.append(f"step {step}: parts of several jobs ({', '.join(j for j, _ in jobs)})")
        return None
    job = copies[0].manifest.part.job if copies[0].manifest.part else None
    count = jobs[0][1]
    if part is not None and not 0 <= part < count:
        errors.append(f"step {step}: has parts 0-{count - 1}, not {part}")
        return None
    for tier in shared:
        try:
            status = read_version(tier, (job, run, step), count)
        except StorageError as exc:
            errors.append(f"{tier.name}: {exc}")
            continue
        wanted = range(count) if part is None else [part]
        nodes = status.nodes or {}
        missing = [k for k in wanted if k not in nodes]
        if missing:
            errors.append(
                f"step {step} in {tier.name}: {status.label} parts verified (missing part "
                f"{', '.join(map(str, missing))})" + "".join(f"; {p}" for p in status.problems)
            )
            continue
        chosen = []
        for k in wanted:
            copy = next(
                (
                    c
                    for c in copies
                    if c.tier == tier.name
                    and c.node == nodes[k]
                    and c.manifest.part is not None
                    and c.manifest.part.index == k
                ),
                None,
            )
            if copy is None:
                break
            chosen.append(copy)
        else:
            return status, chosen
        errors.append(f"step {step} in {tier.name}: a recorded part's copy is no longer listed")
    return None


def _fetch(
    status: VersionStatus,
    copies: list[Copy],
    to: Path,
    part: int | None,
    progress: Callable[[int, int], None] | None,
) -> PartsRestored:
    total = sum(c.manifest.total_bytes for c in copies)
    on_bytes = byte_progress(total, progress)  # one count over all parts
    first = copies[0]
    name = first.manifest.name
    fetched = tuple(
        (
            c.manifest.part.index if c.manifest.part and c.manifest.part.index is not None else 0,
            c.node,
            c.manifest.total_bytes,
        )
        for c in copies
    )
    if part is not None:
        try:
            path = first.storage.fetch(first.manifest, to, progress=on_bytes)
        except StorageError as exc:
            raise LookupError(f"could not restore part {part} of {status.run}@{status.step}: {exc}") from exc
        return PartsRestored(path, status.step, name, first.tier, total, fetched, status.count)
    to.mkdir(parents=True, exist_ok=True)
    final = to / name
    if final.exists() or final.is_symlink():
        raise LookupError(f"{final} already exists: restore refuses to overwrite")
    stage = to / f".{Path(name).name}.ckptkeeper-parts-{uuid.uuid4().hex[:8]}"
    try:
        merged = stage / "whole"
        merged.mkdir(parents=True)
        for c in copies:
            if not c.manifest.is_dir:
                raise LookupError(f"part of {status.run}@{status.step} on node {c.node} is not a directory")
            idx = c.manifest.part.index if c.manifest.part else 0
            try:
                got = c.storage.fetch(c.manifest, stage / f"part-{idx}", progress=on_bytes)
            except StorageError as exc:
                raise LookupError(
                    f"could not restore part {idx} of {status.run}@{status.step} from node {c.node}: {exc}"
                ) from exc
            for f in c.manifest.files:
                dst = merged / f.path
                if dst.exists() or dst.is_symlink():
                    raise LookupError(f"{f.path} is in two parts of {status.run}@{status.step}: not restored")
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(got / f.path, dst)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(merged, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("restored a version spanning nodes", run=status.run, step=status.step, parts=status.count)
    return PartsRestored(final, status.step, name, first.tier, total, fetched, status.count)
