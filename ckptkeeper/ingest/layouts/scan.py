"""The walk of a run directory: recognizers in precedence order, temp artifacts, and the public
entry points ``scan_run`` and ``recognize`` (see the package docstring for the rules).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ckptkeeper.core import model
from ckptkeeper.hook.protocol import STATE_DIR
from ckptkeeper.ingest.layouts.accelerate import _Accelerate
from ckptkeeper.ingest.layouts.base import (
    Candidate,
    RunScan,
    _Dir,
    _Node,
    _Recognizer,
    _Unreadable,
    _Verdict,
    has_step_keyword,
    parse_step,
)
from ckptkeeper.ingest.layouts.dcp import _Dcp
from ckptkeeper.ingest.layouts.deepspeed import DS_LATEST, _DeepSpeed
from ckptkeeper.ingest.layouts.hf import _Hf
from ckptkeeper.ingest.layouts.megatron import MEGATRON_TRACKER, _Megatron
from ckptkeeper.ingest.layouts.nemo import NEMO_UNFINISHED, _NeMo
from ckptkeeper.ingest.layouts.orbax import _Orbax
from ckptkeeper.ingest.layouts.safetensors import _Safetensors
from ckptkeeper.ingest.layouts.temps import dir_kind, file_kind
from ckptkeeper.ingest.layouts.torch import _File, _Torch
from ckptkeeper.util.mounts import mounts_under

RECOGNIZERS: Final[tuple[_Recognizer, ...]] = (
    _Hf(),
    _Accelerate(),
    _Megatron(),
    _DeepSpeed(),
    _NeMo(),
    _Orbax(),
    _Dcp(),
    _Safetensors(),
    _Torch(),
    _File(),
)
"""Precedence order, most specific first (see the package docstring in ``__init__``)."""

LAYOUTS: Final = tuple(r.layout for r in RECOGNIZERS)
_NEMO = _NeMo()


def is_shared_marker(path: Path | str) -> bool:
    """True for marker files that decide the completeness of *sibling* checkpoints.

    ``recognize`` maps a path to the checkpoint containing it; an event on DeepSpeed's ``latest``,
    Megatron's tracker or a NeMo ``-unfinished`` marker changes the verdict of checkpoints beside
    it, so the watcher should rescan the run (``scan_run``) instead.
    """
    name = os.path.basename(os.fsdecode(path))
    return name in (DS_LATEST, MEGATRON_TRACKER) or name.endswith(NEMO_UNFINISHED)


# --------------------------------------------------------------------------------------------------
# Classification of one directory entry, shared by scan_run and recognize


@dataclass(frozen=True, slots=True)
class _Art:
    kind: str


_Outcome = Candidate | _Art | Literal["skip", "descend"]


def _artifact_kind(node: _Node) -> str | None:
    if stat.S_ISDIR(node.st.st_mode):
        return dir_kind(node.name)
    if stat.S_ISREG(node.st.st_mode):
        return file_kind(node.name, in_candidate=False)
    return None


def _classify(node: _Node, run: str) -> _Outcome:
    mode = node.st.st_mode
    if stat.S_ISLNK(mode):
        return "skip"  # never followed: a link may lead out of the tier (docs/design.md, safety invariant 4)
    kind = _artifact_kind(node)
    if kind is not None:
        return _Art(kind)
    if stat.S_ISDIR(mode):
        if node.name in (STATE_DIR, "non_persistent") or node.st.st_dev != node.parent.dev:
            return "skip"
        return _candidate(node, run) or "descend"
    if not stat.S_ISREG(mode):
        return "skip"
    cand = _candidate(node, run)
    if cand is not None:
        return cand
    if node.name.endswith(NEMO_UNFINISHED):
        return _Art("nemo-unfinished") if _NEMO.orphan(node.parent, node.name) else "skip"
    return "skip"


def _candidate(node: _Node, run: str) -> Candidate | None:
    claiming = [r for r in RECOGNIZERS if r.claims(node)]
    if not claiming:
        return None
    step = claiming[0].step(node)
    if step is None and node.is_dir:
        node.children.claimed_by = claiming[0].layout
    if step is None or step < 0 or _part_of_dir(node, claiming[0].layout, step):
        return None
    problems: list[str] = []
    corrupt = False
    metrics: dict[str, float] = {}
    rejected: list[str] = []
    parts: list[str] = []
    unexplained = False
    for recognizer in reversed(claiming):  # higher precedence last: its metrics win on a clash
        verdict = _safe_check(recognizer, node)
        if verdict.part is not None:
            parts[:0] = [verdict.part]
        elif verdict.problems:
            unexplained = True
        problems[:0] = verdict.problems
        corrupt = corrupt or verdict.corrupt
        metrics.update(verdict.metrics)
        rejected[:0] = verdict.rejected
    temps: list[tuple[str, str, int, float]] = []
    if node.is_dir:
        try:
            files, total, newest, changed = _tree(
                node.path, node.parent.dev, _mounts_inside(node), temps=temps
            )
        except FileNotFoundError:
            return None
    else:
        files, total, newest, changed = ("",), node.st.st_size, node.st.st_mtime, _changed(node.st)
    return Candidate(
        run=run,
        step=step,
        name=node.rel,
        layout=claiming[0].layout,
        is_dir=node.is_dir,
        complete=not problems and not corrupt,
        files=files,
        last_write=newest,
        changed_at=changed,
        bytes=total,
        metrics=metrics,
        problem="; ".join(problems) or None,
        corrupt=corrupt,
        temps=tuple(sorted(temps)),
        rejected=tuple(rejected),
        node_part=parts[0] if parts and problems and not unexplained and not corrupt else None,
    )


_SINGLE_FILE_LAYOUTS: Final = frozenset({"torch", "file"})


def _part_of_dir(node: _Node, layout: str, step: int) -> bool:
    """A file a save wrote into its own directory, not a checkpoint of its own.

    Inside a directory below the run dir whose name carries a step (``step-3/``, no layout
    claims it) or that a layout claims without a step (``final/`` holding ``model.safetensors``),
    a file whose number is no spelled-out step (``shard-0.bin``, ``rank_0.pt``, ``model-00001.bin``)
    or is the directory's own step (``step-3/model_step3.pt``) is one part of that save: cataloged
    alone, it was a checkpoint at step 0 that the reaper deleted, breaking the save. Without the
    hook nothing says when such a directory is complete, so it is not managed at all (never moved,
    never reaped); the hook's commit of the directory makes it one checkpoint. Files with a step
    of their own (``seed_1/epoch=0-step=40.ckpt``) and files directly in the run dir still count.
    """
    directory = node.parent
    if layout not in _SINGLE_FILE_LAYOUTS or not node.is_file or directory.is_root:
        return False
    dir_step = parse_step(os.path.basename(directory.path))
    if step == dir_step:
        return True
    numbered = not has_step_keyword(os.path.splitext(node.name)[0])
    return numbered and (dir_step is not None or directory.claimed_by is not None)


def _safe_check(recognizer: _Recognizer, node: _Node) -> _Verdict:
    """A marker that vanishes between listing and reading is "not there yet/anymore", not a crash."""
    try:
        return recognizer.check(node)
    except FileNotFoundError as exc:
        return _Verdict(problems=(f"{os.path.basename(exc.filename or '?')} vanished while checked",))
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink where a marker should be
            return _Verdict(problems=(f"{os.path.basename(exc.filename or '?')} is a symlink",))
        raise _Unreadable(f"{node.rel}: {exc.strerror or exc}") from exc


def _changed(st: os.stat_result) -> float:
    """When a path last changed: the later of mtime and ctime. ``cp -a`` and ``rsync -a`` set old
    mtimes on what they copy, so mtime alone calls a tree settled while it is still being copied;
    ctime cannot be set back (``utime`` itself moves it to now)."""
    return max(st.st_mtime, st.st_ctime)


def _mounts_inside(node: _Node) -> frozenset[str]:
    """Mount points under ``node`` (relative to it), from the mount table the run's root read."""
    directory: _Dir | None = node.parent
    while directory is not None and not directory.is_root:
        directory = directory.parent
    if directory is None or not directory.mounts:
        return frozenset()
    prefix = node.rel + "/"
    return frozenset(m[len(prefix) :] for m in directory.mounts if m.startswith(prefix))


def _tree(
    root: str,
    dev: int,
    mounts: frozenset[str] = frozenset(),
    *,
    temps: list[tuple[str, str, int, float]] | None = None,
) -> tuple[tuple[str, ...], int, float, float]:
    """(regular files relative to root, their total size, newest mtime, newest change — ctime
    included, see :func:`_changed`) without following links.

    Neither another filesystem (``st_dev``) nor a mount point of this one (``mounts``: paths
    relative to ``root``, a bind mount shares ``st_dev``) is entered: not listed, so never copied
    or hashed.

    With ``temps`` (a list to fill), the framework temp artifacts inside (``temps.file_kind`` /
    ``dir_kind``) are not files of the checkpoint: they are appended as (relative path, kind,
    bytes, newest mtime) instead — reaped on their own, never copied or hashed. Their writes still
    count towards the newest mtime and change: a temp being written means a save in progress.
    """
    top = os.lstat(root)
    newest, changed = top.st_mtime, _changed(top)
    files: list[str] = []
    total = 0
    stack = [(root, "")]
    while stack:
        path, prefix = stack.pop()
        try:
            it = os.scandir(path)
        except FileNotFoundError:
            if path == root:
                raise
            continue
        except OSError as exc:
            raise _Unreadable(f"{path}: {exc.strerror or exc}") from exc
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode) and (st.st_dev != dev or f"{prefix}{entry.name}" in mounts):
                    continue  # another filesystem or a mount point: not ours, its times are not our writes
                newest = max(newest, st.st_mtime)
                changed = max(changed, st.st_ctime, st.st_mtime)
                if stat.S_ISDIR(st.st_mode):
                    kind = dir_kind(entry.name) if temps is not None else None
                    if kind is not None and temps is not None:
                        inner = f"{prefix}{entry.name}/"
                        try:
                            _, size, when, when_changed = _tree(
                                entry.path,
                                dev,
                                frozenset(m[len(inner) :] for m in mounts if m.startswith(inner)),
                            )
                        except FileNotFoundError:
                            continue  # the save finished (renamed) or was cleaned up meanwhile
                        newest = max(newest, when)
                        changed = max(changed, when_changed)
                        temps.append((prefix + entry.name, kind, size, when))
                        continue
                    stack.append((entry.path, f"{prefix}{entry.name}/"))
                elif stat.S_ISREG(st.st_mode):
                    kind = file_kind(entry.name, in_candidate=True) if temps is not None else None
                    if kind is not None and temps is not None:
                        temps.append((prefix + entry.name, kind, st.st_size, st.st_mtime))
                        continue
                    files.append(prefix + entry.name)
                    total += st.st_size
    return tuple(sorted(files)), total, newest, changed


def _dir_bytes(path: str, st: os.stat_result) -> tuple[int, float]:
    """(bytes, newest mtime) of an artifact: a file, or a directory tree (lstat, same filesystem)."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, st.st_mtime
    try:
        _, total, newest, _changed_at = _tree(path, st.st_dev)
    except FileNotFoundError:
        return 0, st.st_mtime
    return total, newest


# --------------------------------------------------------------------------------------------------
# Public entry points


def _root(run_dir: Path | str) -> _Dir:
    """The run dir, listed now: a run dir that cannot be listed raises, it never reads as empty."""
    path = os.path.abspath(os.fsdecode(run_dir))
    st = os.lstat(path)  # missing run dir: FileNotFoundError, for the caller to decide
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, "run dir is not a directory (symlinks are not followed)", path
        )
    root = _Dir(path, None, dev=st.st_dev, is_root=True)
    root.mounts = mounts_under(path)
    try:
        with os.scandir(path):
            pass
        _ = root.entries
    except _Unreadable as exc:
        raise PermissionError(errno.EACCES, str(exc), path) from exc
    return root


def scan_run(run_dir: Path, run: str) -> RunScan:
    """Every checkpoint candidate and temp artifact under one run directory of the hot tier.

    Raises OSError when the run directory itself cannot be listed (an unknown run is not an empty
    one); unreadable subtrees are reported in ``RunScan.errors`` and the rest is still scanned.
    """
    root = _root(run_dir)
    candidates: list[Candidate] = []
    artifacts: list[model.Artifact] = []
    errors: list[str] = []
    hooks: list[str] = []
    stack: list[tuple[_Dir, str]] = [(root, "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            entries = sorted(directory.entries.items())
        except _Unreadable as exc:
            errors.append(f"{prefix.rstrip('/') or '.'}: {exc}")
            continue
        for name, st in entries:
            if name == STATE_DIR and stat.S_ISDIR(st.st_mode) and st.st_dev == directory.dev:
                hooks.append(prefix.rstrip("/"))
            node = _Node(directory, name, st, prefix + name)
            if node.rel in root.mounts:
                continue  # a mount point (bind mounts included) is never walked, copied or deleted
            try:
                outcome = _classify(node, run)
                if isinstance(outcome, _Art):
                    size, newest = _dir_bytes(node.path, st)
            except _Unreadable as exc:
                errors.append(f"{node.rel}: {exc}")
                continue
            if isinstance(outcome, Candidate):
                candidates.append(outcome)
                artifacts.extend(
                    model.Artifact(
                        tier="hot",
                        path=f"{run}/{node.rel}/{rel}",
                        kind=kind,
                        bytes=size,
                        last_write=when,
                        run=run,
                    )
                    for rel, kind, size, when in outcome.temps
                )
            elif isinstance(outcome, _Art):
                artifacts.append(
                    model.Artifact(
                        tier="hot",
                        path=f"{run}/{node.rel}",
                        kind=outcome.kind,
                        bytes=size,
                        last_write=newest,
                        run=run,
                    )
                )
            elif outcome == "descend" and node.rel not in root.mounts:  # bind mounts are not walked
                stack.append((node.children, f"{node.rel}/"))
    candidates.sort(key=lambda c: (c.step, c.name))
    artifacts.sort(key=lambda a: a.path)
    return RunScan(
        candidates=tuple(candidates),
        artifacts=tuple(artifacts),
        errors=tuple(errors),
        hook_dirs=tuple(sorted(hooks)),
    )


def recognize(path: Path, run_dir: Path, run: str) -> Candidate | None:
    """The checkpoint that ``path`` is or lies inside, exactly as ``scan_run`` would report it.

    For a single watcher event: ``<run>/checkpoint-100/trainer_state.json`` gives the
    ``checkpoint-100`` candidate. None when the path is not (inside) a checkpoint, is or lies under
    something ``scan_run`` skips (symlink, ``.ckptkeeper/``, temp artifact), is outside ``run_dir``
    or no longer exists. Raises OSError when something on the way exists but cannot be read.
    Events on shared markers (``is_shared_marker``) concern sibling checkpoints: rescan the run.
    """
    try:
        directory = _root(run_dir)
    except FileNotFoundError:
        return None
    directory_root = directory
    rel = os.path.relpath(os.path.abspath(os.fsdecode(path)), directory.path)
    if rel == "." or rel == ".." or rel.startswith(".." + os.sep) or os.path.isabs(rel):
        return None
    parts = rel.split(os.sep)
    try:
        for depth, name in enumerate(parts):
            try:
                st = os.lstat(os.path.join(directory.path, name))
            except (FileNotFoundError, NotADirectoryError):
                return None
            node = _Node(directory, name, st, "/".join(parts[: depth + 1]))
            if node.rel in directory_root.mounts:
                return None
            outcome = _classify(node, run)
            if isinstance(outcome, Candidate):
                return outcome
            if outcome != "descend" or node.rel in directory_root.mounts:
                return None
            directory = node.children
    except _Unreadable as exc:
        raise OSError(errno.EIO, str(exc)) from exc
    return None
