"""The hook's files (``.ckptkeeper/``), wherever in a run the callbacks put them.

A Lightning ``ModelCheckpoint(dirpath=<run>/checkpoints)`` writes its hook dir below the run dir,
and a run may have several (one per dirpath): the catalog reads them all as one run. A path the
hook committed that no layout recognises is cataloged from here too (:func:`committed_candidate`).
Split from ``catalog`` to keep that module readable; the catalog is the only caller.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import TypeAlias

from ckptkeeper.core import model
from ckptkeeper.core.model import NodePart
from ckptkeeper.hook import protocol
from ckptkeeper.hook.protocol import STAGING_MARK, STATE_DIR
from ckptkeeper.index import Quarantined
from ckptkeeper.ingest import layouts
from ckptkeeper.util.logs import get_logger
from ckptkeeper.util.mounts import mounts_under

log = get_logger("ckptkeeper.ingest.hookfiles")

_STATE_RANK = {protocol.ACTIVE: 3, protocol.FAILED: 2, protocol.FINISHED: 1}
_STAGING_KIND = "ckptkeeper-staging"
"""The artifact kind of our own interrupted copies (``layouts.temps``)."""
_HOOKED_LAYOUTS = frozenset({"hf", "torch"})
"""Layouts our framework callbacks commit (HF Trainer, Lightning): without a hook in such a run the
state is a guess from write times, and after ``failed_after`` a finished run reads as stale."""


def _hook_root(run_dir: Path, rel: str) -> Path:
    return run_dir / rel if rel else run_dir


def hook_rel(rel: str, name: str) -> str:
    """``<rel>/.ckptkeeper/<name>`` relative to the run dir (the quarantine's path, after the run)."""
    return f"{rel}/{STATE_DIR}/{name}" if rel else f"{STATE_DIR}/{name}"


def read_hook_commits(
    run_dir: Path, hook_dirs: tuple[str, ...]
) -> tuple[list[protocol.Commit], list[tuple[str, list[str]]]]:
    """Commits of every ``.ckptkeeper/`` in the run, paths made relative to the run dir, and the
    malformed lines per hook dir that had any (``(rel, problems)``: each file is quarantined on its
    own).

    A callback whose checkpoint dir is below the run dir (``ModelCheckpoint(dirpath=<run>/checkpoints)``)
    writes its hook files there, with paths relative to that dir: they still describe this run.
    """
    commits: list[protocol.Commit] = []
    errors: list[tuple[str, list[str]]] = []
    for rel in hook_dirs or ("",):
        found, errs = protocol.read_commits(_hook_root(run_dir, rel))
        commits.extend(replace(c, path=f"{rel}/{c.path}") if rel else c for c in found)
        if errs:
            errors.append((rel, [f"{rel}/{STATE_DIR}: {e}" if rel else e for e in errs]))
    return commits, errors


HookState: TypeAlias = tuple[protocol.RunInfo | None, float | None, str | None, list[Quarantined]]


def hook_state(run_dir: Path, run: str, hot: str, scan: layouts.RunScan) -> HookState:
    """(the run.json that speaks for the run, newest heartbeat, a warning or None, the hook files
    that failed the schema).

    Several hook dirs (one per ``ModelCheckpoint`` dirpath under the run): the liveliest state wins
    — active over failed over finished — so one callback still training keeps the run active. A
    run.json or heartbeat that fails the schema is quarantined with its reason, whichever dir it is in.
    """
    infos: list[protocol.RunInfo] = []
    heartbeats: list[float] = []
    held: list[Quarantined] = []
    for rel in scan.hook_dirs or ("",):
        root = _hook_root(run_dir, rel)
        info = protocol.read_run_dir(root)
        if info is not None:
            infos.append(info)
            if info.error:
                path = f"{run}/{hook_rel(rel, protocol.RUN_FILE)}"
                held.append(Quarantined(hot, path, protocol.RUN_FILE, info.error, run=run))
        beat, problem = protocol.read_heartbeat(root)
        if beat is not None:
            heartbeats.append(beat)
        if problem is not None:
            held.append(
                Quarantined(
                    hot,
                    f"{run}/{hook_rel(rel, protocol.HEARTBEAT_FILE)}",
                    protocol.HEARTBEAT_FILE,
                    f"{problem}: ignored as a sign of life",
                    run=run,
                )
            )
    info = max(infos, key=lambda i: (_STATE_RANK.get(i.state or "", 0), i.started or 0.0), default=None)
    return info, max(heartbeats, default=None), _hook_warning(scan, info), held


def _hook_warning(scan: layouts.RunScan, info: protocol.RunInfo | None) -> str | None:
    """Why the hook looks missing from a run that should have it, or None."""
    if scan.hook_dirs and (info is None or info.state is None):
        where = ", ".join(f"{r}/{protocol.STATE_DIR}" if r else protocol.STATE_DIR for r in scan.hook_dirs)
        return f"{where} has no readable run.json: run state is guessed from write times"
    if not scan.hook_dirs and any(
        c.layout in _HOOKED_LAYOUTS and (c.layout == "hf" or c.name.endswith(".ckpt"))
        for c in scan.candidates
    ):
        return (
            f"no {protocol.STATE_DIR}/ hook in this run of Lightning/HF checkpoints (KeeperCallback not "
            "installed, or it writes outside the run dir): its state is guessed from write times, and "
            "once no write for failed_after it counts as stale and is reaped down to one checkpoint"
        )
    return None


UNKNOWN_PART = "node-local part of a multi-node checkpoint? kept until the fleet knows"
"""The keep reason of a checkpoint that looks like one node's part but no hook says so."""


def node_part(
    cand: layouts.Candidate, commit: protocol.Commit | None, info: protocol.RunInfo | None
) -> NodePart | None:
    """Whether ``cand`` is this node's share of a checkpoint spanning nodes, and what is known.

    The hook's word first: a commit naming its part, else ``run.json``'s ``job`` (every checkpoint
    of such a run is this node's part). Without it, a checkpoint the layouts find lacking only the
    marker rank 0 writes, with rank 0's shards absent too (``Candidate.node_part``), is a part
    of an unknown job: kept, never reaped as partial (docs/spanning-nodes.md).
    """
    job = info.job if info is not None else None
    if commit is not None and commit.parts is not None and commit.part is not None:
        index, count = commit.part, commit.parts
    elif job is not None:
        index, count = job.part, job.parts
    elif cand.node_part is not None:
        return NodePart(note=f"{UNKNOWN_PART}: {cand.node_part}", marker_elsewhere=True)
    else:
        return None
    name = job.job if job is not None else None
    where = f"part {index} of {count}" + (f" of job {name}" if name else "")
    how = f": {cand.node_part}" if cand.node_part else ""
    return NodePart(
        note=f"{where} (hook){how}",
        job=name,
        index=index,
        count=count,
        marker_elsewhere=cand.node_part is not None,
    )


def with_commits(
    run_dir: Path, run: str, found: Iterable[layouts.Candidate], commits: Iterable[protocol.Commit]
) -> dict[str, layouts.Candidate]:
    """The run's checkpoints by name: what the layouts ``found`` and what the hook committed.

    A checkpoint is atomic: nothing inside one is a checkpoint of its own. The layouts never look
    inside a directory they recognise; a directory no layout recognises but the hook committed
    (``run.commit("<run>/step-3", step=3)``) was walked like any other, so its ``shard-0.bin`` or
    ``rank_0.pt`` came out as a checkpoint at step 0 that the reaper then deleted from inside the
    committed one. Here a candidate inside a committed path is dropped, and so is a commit inside
    a recognised checkpoint or inside another commit (it is part of that one, which it marks
    committed: see the catalog). A committed checkpoint directory lists every regular file under
    it, temp-like names included (:func:`whole_checkpoint`).
    """
    commits = list(commits)
    claimed = {c.path for c in commits}
    candidates = {c.name: c for c in found if not layouts.lies_inside(c.name, claimed)}
    for c in commits:
        if c.path in candidates or layouts.lies_inside(c.path, claimed | candidates.keys()):
            continue
        extra = committed_candidate(run_dir, run, c)
        if extra is not None:
            candidates[extra.name] = extra
    whole = committed_names(candidates, claimed)
    return {
        name: whole_checkpoint(run_dir, cand) if cand.layout != "committed" and name in whole else cand
        for name, cand in candidates.items()
    }


def committed_names(names: Iterable[str], claimed: AbstractSet[str]) -> set[str]:
    """Those of ``names`` the catalog records as committed: the hook committed the checkpoint
    itself or a path inside it (``claimed``: the committed paths, relative to the run dir)."""
    holding = {"/".join(parts[:i]) for parts in (p.split("/") for p in claimed) for i in range(1, len(parts))}
    return {n for n in names if n in claimed or n in holding}


def outside_commits(
    run: str, artifacts: Iterable[model.Artifact], committed: AbstractSet[str]
) -> list[model.Artifact]:
    """The run's temp artifacts but those inside a hook-committed checkpoint (``committed``: names
    relative to the run dir): there they are files of the checkpoint (:func:`whole_checkpoint`), never reaped
    on their own. Our own staging names stay artifacts: they are never the user's."""
    prefix = f"{run}/"
    return [
        a
        for a in artifacts
        if a.kind == _STAGING_KIND
        or not a.path.startswith(prefix)
        or not (a.path[len(prefix) :] in committed or layouts.lies_inside(a.path[len(prefix) :], committed))
    ]


def whole_checkpoint(run_dir: Path, cand: layouts.Candidate) -> layouts.Candidate:
    """A hook-committed checkpoint directory holds every regular file under it (the catalog, and the
    executor re-checking the hot copy before it lets it go, list it so).

    The user said the directory is complete, so a name that looks like a temp (``model.part``,
    ``weights.tmp``, a safetensors ``.tmpXXXXXX``) is only a guess: it is a file of the checkpoint
    — hashed, copied, restored — not an artifact to reap. Symlinks, special files, mount points
    and our own staging names (``protocol.STAGING_MARK``) are left out as everywhere else.
    """
    if not cand.is_dir:
        return cand
    try:
        files, total, newest, changed = _every_file(run_dir / cand.name)
    except FileNotFoundError:
        return cand
    return replace(
        cand,
        files=files,
        bytes=total,
        last_write=max(cand.last_write, newest),
        changed_at=max(cand.changed_at, changed),
        temps=tuple(t for t in cand.temps if t[1] == _STAGING_KIND),
    )


def committed_candidate(run_dir: Path, run: str, commit: protocol.Commit) -> layouts.Candidate | None:
    """A path the hook committed that no layout recognises is still a checkpoint: the user said so."""
    path = run_dir / commit.path
    found = layouts.recognize(path, run_dir, run)
    if found is not None:
        return found
    if _leaves_run_dir(run_dir, commit.path):
        # A symlinked directory on the way leads outside the tier: never cataloged, so never
        # read, copied or deleted through (it used to be hashed, then fail every prune).
        log.warning("committed path goes through a symlink; ignored", run=run, path=commit.path)
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return layouts.Candidate(
            run=run,
            step=commit.step,
            name=commit.path,
            layout="file",
            is_dir=False,
            complete=True,
            files=("",),
            last_write=st.st_mtime,
            changed_at=max(st.st_mtime, st.st_ctime),
            bytes=st.st_size,
            metrics={},
            problem=None,
        )
    if not stat.S_ISDIR(st.st_mode):
        return None
    files, total, newest, changed = _every_file(path)
    return layouts.Candidate(
        run=run,
        step=commit.step,
        name=commit.path,
        layout="committed",
        is_dir=True,
        complete=True,
        files=files,
        last_write=newest,
        changed_at=changed,
        bytes=total,
        metrics={},
        problem=None,
    )


def _every_file(path: Path) -> tuple[tuple[str, ...], int, float, float]:
    """(every regular file under the directory ``path`` relative to it, their total size, newest
    mtime, newest change — ctime included, see ``Candidate.changed_at``) without following links.
    Mount points are not ours (never walked); neither is anything carrying our staging mark (an
    interrupted copy of ours, reaped as such)."""
    st = os.lstat(path)
    files: list[str] = []
    total, newest, changed = 0, st.st_mtime, max(st.st_mtime, st.st_ctime)
    mounts = mounts_under(path)  # bind mounts share st_dev: only the mount table tells
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        base = os.path.relpath(dirpath, path).replace(os.sep, "/")
        dirnames[:] = [
            d
            for d in dirnames
            if STAGING_MARK not in d and (d if base == "." else f"{base}/{d}") not in mounts
        ]
        for fname in filenames:
            full = os.path.join(dirpath, fname)
            try:
                fst = os.lstat(full)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(fst.st_mode) and STAGING_MARK not in fname:
                files.append(os.path.relpath(full, path).replace(os.sep, "/"))
                total += fst.st_size
                newest = max(newest, fst.st_mtime)
                changed = max(changed, fst.st_mtime, fst.st_ctime)
        for dname in dirnames:
            try:
                dst = os.lstat(os.path.join(dirpath, dname))
            except FileNotFoundError:
                continue
            newest = max(newest, dst.st_mtime)
            changed = max(changed, dst.st_mtime, dst.st_ctime)
    return tuple(sorted(files)), total, newest, changed


def _leaves_run_dir(run_dir: Path, rel: str) -> bool:
    """True when a directory on the way to ``rel`` is a symlink (or not a directory at all)."""
    current = run_dir
    for part in rel.split("/")[:-1]:
        current = current / part
        try:
            if not stat.S_ISDIR(os.lstat(current).st_mode):
                return True
        except OSError:
            return True
    return False
