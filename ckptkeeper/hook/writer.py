"""Training-loop hook: ``track_run`` tells the node daemon which checkpoints are complete and whether
the run lives.

This module runs inside training processes, so it imports the standard library only (and nothing of
ckptkeeper but :mod:`ckptkeeper.hook.protocol`, which holds the file names and formats it writes): a
heavier module must never leak into ``import ckptkeeper``. It only ever does small local writes under
``<run_dir>/.ckptkeeper/``; a dead or absent daemon never stalls training.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import math
import operator
import os
import re
import socket
import stat
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from ckptkeeper.hook.parts import JobPart, detect, scheduler_job
from ckptkeeper.hook.protocol import (
    ACTIVE,
    COMMITS_FILE,
    DEFAULT_HEARTBEAT_INTERVAL,
    FAILED,
    FINISHED,
    HEARTBEAT_FILE,
    PROTOCOL_VERSION,
    RUN_FILE,
    SCHEDULER_JOB,
    STATE_DIR,
    ParentRef,
    ParentSpec,
    StrPath,
    read_commits,
)

__all__ = ["TrackedRun", "parent_ref", "track_run"]

_MAX_REASON = 4000
"""An exception message can be megabytes (a tensor repr); run.json must stay small."""

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Validation shared by the writer
# --------------------------------------------------------------------------------------------------


def _check_step(step: Any, what: str = "step") -> int:
    """Steps order checkpoints, so only exact integers pass: ``True``, ``1.5``, ``2.0`` and ``"3"`` do not."""
    if isinstance(step, bool):
        raise TypeError(f"{what} must be a non-negative int, got bool {step!r}")
    try:
        value = operator.index(step)  # int, numpy/torch integer scalars; never floats or strings
    except TypeError:
        raise TypeError(f"{what} must be a non-negative int, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value}")
    return value


def _check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if "\0" in value:
        raise ValueError(f"{what} must not contain NUL characters: {value!r}")
    return value


def _fspath(path: Any, what: str) -> str:
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} must be a str or os.PathLike path, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str path, got bytes")
    return _check_text(text, what)


_STEP_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"^checkpoint-(\d+)$",  # HF Trainer
        r"(?:^|[-_])step=(\d+)",  # Lightning default file name
        r"^global_step(\d+)$",  # DeepSpeed
        r"^iter_(\d+)$",  # Megatron
        r"^(\d+)$",  # Orbax step dirs
        r"^(?:ckpt|checkpoint|model|step|iter)[-_]?(\d+)(?:\.[A-Za-z0-9]+)?$",  # ckpt-100.pt, step_5.pth
    )
)


def _step_from_name(name: str) -> int | None:
    for pattern in _STEP_PATTERNS:
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


def _find_run_dir(checkpoint: str) -> str:
    """Nearest ancestor holding ``.ckptkeeper/run.json``; else the checkpoint's directory (the
    framework's checkpoint dir, which is what a run dir is by docs/design.md, "Contracts")."""
    parent = os.path.dirname(checkpoint)
    here = parent
    for _ in range(8):
        if os.path.isfile(os.path.join(here, STATE_DIR, RUN_FILE)):
            return here
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    return parent


def parent_ref(
    checkpoint: StrPath, *, step: int | None = None, relative_to: StrPath | None = None
) -> ParentRef:
    """Describe an existing checkpoint on disk as a :class:`ParentRef`.

    The step comes from ``step`` when given (a framework that just restored it knows best), else from
    the parent run's ``commits.jsonl``, else from well-known names (``checkpoint-500``, ``step=500``,
    ``global_step500``, ``iter_0000500``, ``500``, ``ckpt-500.pt``); otherwise ``ValueError``: a guessed
    step would point lineage at the wrong checkpoint. ``relative_to`` is the *child* run dir; the parent's
    ``run`` is named relative to its parent directory.
    """
    text = _fspath(checkpoint, "parent checkpoint")
    try:
        real = os.path.realpath(text, strict=True)
    except OSError:
        raise ValueError(f"parent checkpoint {text!r} does not exist") from None
    run_dir = _find_run_dir(real)
    rel = os.path.relpath(real, run_dir).replace(os.sep, "/")
    if step is not None:
        step = _check_step(step, "parent step")
    else:
        commits, _ = read_commits(run_dir)
        for commit in reversed(commits):
            if commit.path == rel:
                step = commit.step
                break
        else:
            step = _step_from_name(os.path.basename(real))
        if step is None:
            raise ValueError(
                f"cannot tell the step of parent checkpoint {text!r} (not committed, no step in its name); "
                "pass parent=(run, step) or parent='run:step'"
            )
    name = os.path.basename(run_dir)
    if relative_to is not None:
        base = os.path.dirname(os.path.realpath(os.fspath(relative_to)))
        candidate = os.path.relpath(run_dir, base)
        if not candidate.startswith(".."):
            name = candidate.replace(os.sep, "/")
    return ParentRef(run=name or "/", step=step, path=real)


def _normalize_parent(parent: ParentSpec, run_dir: str) -> ParentRef | None:
    """Accept ``"run:step"``, ``(run, step)``, a mapping, a ParentRef, or a path to a checkpoint on disk."""
    if parent is None or isinstance(parent, ParentRef):
        return parent
    if isinstance(parent, tuple | list):
        if len(parent) != 2:
            raise ValueError(f"parent tuple must be (run, step), got {parent!r}")
        return ParentRef(run=_check_text(parent[0], "parent run"), step=_check_step(parent[1], "parent step"))
    if isinstance(parent, Mapping):
        try:
            return ParentRef(
                run=_check_text(parent["run"], "parent run"), step=_check_step(parent["step"], "parent step")
            )
        except KeyError as exc:
            raise ValueError(f"parent mapping needs 'run' and 'step', missing {exc}") from None
    if isinstance(parent, os.PathLike):
        return parent_ref(parent, relative_to=run_dir)
    if isinstance(parent, str):
        text = _check_text(parent, "parent")
        if os.path.lexists(text):
            return parent_ref(text, relative_to=run_dir)
        match = re.fullmatch(r"(.+):(\d+)", text, flags=re.DOTALL)
        if match:
            return ParentRef(run=match.group(1), step=int(match.group(2)))
        if os.sep in text:
            raise ValueError(f"parent checkpoint {text!r} does not exist")
        raise ValueError(f"parent must be 'run:step', (run, step) or a checkpoint path, got {text!r}")
    raise TypeError(
        f"parent must be 'run:step', (run, step) or a checkpoint path, got {type(parent).__name__}"
    )


# --------------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------------

_LIVE_RUNS: weakref.WeakSet[TrackedRun] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    # A forked child inherits locks possibly held by threads that do not exist in it, and shares the
    # commits fd (and its flock) with the parent; give each run fresh ones so a child can still commit.
    for run in list(_LIVE_RUNS):
        run._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


class TrackedRun:
    """A run being written by this process; usually made by :func:`track_run` and used as a context manager.

    Thread-safe. ``commit()`` may be called from any thread (async checkpoint writers), and is valid in
    any state: a checkpoint saved *after* a failure (e.g. Lightning's save-on-exception) is still a
    checkpoint. The first terminal transition (``finish``/``fail``) wins; later ones are ignored.
    If the process exits while the run is still active, an ``atexit`` handler marks it failed, with the
    uncaught exception when there was one: a script that dies of an exception needs no ``with`` block.
    A run that is not ``enabled`` (a non-zero ``RANK``; in a multi-node job, a non-zero
    ``LOCAL_RANK``) accepts every call and writes nothing. In a multi-node job (:mod:`.parts`) the
    node's local rank 0 writes, and ``run.json`` and every commit name the job and this node's part.
    """

    def __init__(
        self,
        run_dir: StrPath,
        *,
        name: str | None = None,
        parent: ParentSpec = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        enabled: bool | None = None,
        fsync_commits: bool = False,
        job: str | None = None,
        part: int | None = None,
        parts: int | None = None,
    ) -> None:
        text = _fspath(run_dir, "run_dir")
        writes, job_part = detect(os.environ, job=job, part=part, parts=parts)
        self.scheduler_job: dict[str, Any] | None = scheduler_job(os.environ)
        """The scheduler job this process runs in (``job end`` finds the runs of a job by it)."""
        self.job_part: JobPart | None = job_part
        """This node's part of a multi-node job, or None (one node)."""
        self._part_fields: dict[str, int] = (
            {} if self.job_part is None else {"part": self.job_part.part, "parts": self.job_part.parts}
        )
        if (
            isinstance(heartbeat_interval, bool)
            or not isinstance(heartbeat_interval, int | float)
            or not math.isfinite(heartbeat_interval)
            or heartbeat_interval <= 0
        ):
            raise ValueError(
                f"heartbeat_interval must be a positive number of seconds, got {heartbeat_interval!r}"
            )
        self.enabled: bool = writes if enabled is None else bool(enabled)
        self.fsync_commits = fsync_commits
        self.heartbeat_interval = float(heartbeat_interval)
        self._root = os.path.realpath(text)
        self._root_prefix = self._root.rstrip("/") + "/"
        self.run_dir = Path(self._root)
        self.name: str = (
            _check_text(name, "name") if name is not None else (os.path.basename(self._root) or "/")
        )
        self.parent: ParentRef | None = _normalize_parent(parent, self._root) if self.enabled else None
        self._state_dir = os.path.join(self._root, STATE_DIR)
        self._state: str = ACTIVE
        self._reason: str | None = None
        self._started = time.time()
        self._ended: float | None = None
        self._pid = os.getpid()
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._fd_pid: int | None = None
        self._warned_metrics: set[str] = set()
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeat_failing = False
        if not self.enabled:
            return
        os.makedirs(self._state_dir, exist_ok=True)  # only now: a refused run leaves nothing behind
        self._write_run_json()
        self._open_commits()
        self._touch_heartbeat()
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"ckptkeeper-heartbeat:{self.name}", daemon=True
        )
        self._heartbeat_thread.start()
        _LIVE_RUNS.add(self)
        atexit.register(self._at_exit)

    # -- public API ---------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``active``, ``finished`` or ``failed``."""
        return self._state

    @property
    def reason(self) -> str | None:
        return self._reason

    def commit(self, path: StrPath, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Declare the checkpoint at ``path`` complete (call it *after* the save returned).

        ``path`` is resolved like ``open()`` does (relative to the working directory), symlinks included,
        and must exist strictly inside the run dir. ``step`` must be a non-negative integer. Metric values
        must be real numbers (``float()``-able: Python, numpy or 0-d torch scalars) — anything else is a
        bug and raises ``TypeError`` at the first commit — but NaN/inf are *dropped* with a warning: a
        diverged loss is a runtime fact that must not kill training, and a checkpoint without the metric
        is never "best" yet never punished either (docs/design.md, "Retention").

        Raises ``ValueError``/``TypeError`` on bad arguments and ``OSError`` if the line cannot be written
        (a full disk): the caller asked for a record and did not get one.
        """
        if not self.enabled:
            return
        rel = self._relative_checkpoint_path(path)
        step = _check_step(step)
        line = json.dumps(
            {
                "path": rel,
                "step": step,
                "metrics": self._clean_metrics(metrics),
                "time": time.time(),
                **self._part_fields,
            },
            separators=(",", ":"),
            allow_nan=False,
        )
        self._append((line + "\n").encode("ascii"))

    def finish(self) -> None:
        """Mark the run finished: training ended normally, retention may treat it as done."""
        self._end(FINISHED, None)

    def fail(self, reason: str) -> None:
        """Mark the run failed with a human-readable ``reason`` (the reaper then keeps only its newest
        complete checkpoints, docs/design.md, "Reaper")."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        self._end(FAILED, reason)

    def set_parent(self, parent: ParentSpec) -> None:
        """Record lineage learnt after the run started (a framework restores its checkpoint later)."""
        if not self.enabled:
            return
        ref = _normalize_parent(parent, self._root)
        with self._lock:
            self.parent = ref
            self._write_run_json()

    def __enter__(self) -> TrackedRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self._end(FINISHED, None, quiet=True)
        else:
            self._end(FAILED, _describe(exc), quiet=True)
        return False

    def __repr__(self) -> str:
        return f"TrackedRun({self._root!r}, name={self.name!r}, state={self._state!r})"

    # -- internals ----------------------------------------------------------------------------------

    def _relative_checkpoint_path(self, path: StrPath) -> str:
        text = _fspath(path, "checkpoint path")
        fast = self._fast_relative(text)
        if fast is not None:
            return fast
        try:
            real = os.path.realpath(text, strict=True)
        except OSError:
            raise ValueError(
                f"checkpoint path {text!r} does not exist (relative paths are resolved from the working "
                f"directory {os.getcwd()!r}, like open() does)"
            ) from None
        rel = os.path.relpath(real, self._root)
        parts = rel.split(os.sep)
        if rel == os.curdir or parts[0] == os.pardir or os.path.isabs(rel):
            raise ValueError(
                f"checkpoint path {text!r} resolves to {real!r}, "
                f"which is not inside the run dir {self._root!r}"
            )
        if parts[0] == STATE_DIR:
            raise ValueError(f"checkpoint path {text!r} is inside the hook's own {STATE_DIR}/ directory")
        return "/".join(parts)

    def _fast_relative(self, text: str) -> str | None:
        """The common case without ``realpath``'s per-component work: an absolute path spelled under the
        (already resolved) run dir, no ``.``/``..``/``//``, no symlink below the run dir. ``None`` sends
        everything else down the general path, which gives the same answer or the error."""
        prefix = self._root_prefix
        if not text.startswith(prefix):
            return None
        parts = text[len(prefix) :].split("/")
        if parts[0] == STATE_DIR or any(p in ("", ".", "..") for p in parts):
            return None
        current = self._root
        for part in parts:
            current = f"{current}/{part}"
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    return None
            except OSError:
                return None
        return "/".join(parts)

    def _clean_metrics(self, metrics: Mapping[str, Any] | None) -> dict[str, float]:
        if metrics is None:
            return {}
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of str to number, got {type(metrics).__name__}")
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            _check_text(key, "metric name")
            if isinstance(value, str | bytes | bool) or value is None:
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r}")
            try:
                number = float(value)
            except (TypeError, ValueError, RuntimeError):  # RuntimeError: a torch tensor of many elements
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None
            if math.isfinite(number):
                clean[key] = number
            elif key not in self._warned_metrics:
                self._warned_metrics.add(key)
                log.warning(
                    "ckptkeeper: metric %r is %r in run %s; dropping non-finite values",
                    key,
                    number,
                    self.name,
                )
        return clean

    def _open_commits(self) -> int:
        fd = os.open(
            os.path.join(self._state_dir, COMMITS_FILE),
            os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
            0o666,
        )
        self._fd, self._fd_pid = fd, os.getpid()
        return fd

    def _append(self, data: bytes) -> None:
        with self._lock:
            terminal = self._state != ACTIVE
            fd = self._fd if self._fd is not None and self._fd_pid == os.getpid() else self._open_commits()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    size = os.fstat(fd).st_size
                    if size and os.pread(fd, 1, size - 1) != b"\n":
                        data = b"\n" + data  # close a line torn by a crashed writer; it stays reported
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if self.fsync_commits:
                        os.fsync(fd)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                if terminal:  # late commit after finish/fail: nothing will close it later
                    os.close(fd)
                    self._fd = None

    def _end(self, state: str, reason: str | None, *, quiet: bool = False) -> None:
        if not self.enabled:
            self._state, self._reason = state, reason
            return
        if os.getpid() != self._pid:
            raise RuntimeError("a forked child cannot end the run its parent is tracking")
        with self._lock:
            if self._state != ACTIVE:
                return
            self._state = state
            self._reason = None if reason is None else reason[:_MAX_REASON]
            self._ended = time.time()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        self._stop_heartbeat()
        atexit.unregister(self._at_exit)
        try:
            with self._lock:
                self._write_run_json()
        except OSError as exc:
            if not quiet:
                raise
            # Inside __exit__ the training exception matters more than our bookkeeping.
            log.warning("ckptkeeper: could not record run %s as %s: %s", self.name, state, exc)

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._heartbeat_thread = None

    def _at_exit(self) -> None:
        if os.getpid() != self._pid or self._state != ACTIVE:
            return
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        reason = (
            _describe(exc) if exc is not None else "process exited while the run was active (no finish())"
        )
        self._end(FAILED, reason, quiet=True)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._fd is not None:
            # Shared with the parent, flock included (locks belong to the open file description):
            # the child gets its own on first use. Closing this copy leaves the parent's intact.
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._heartbeat_thread = None  # threads do not survive fork

    def _write_run_json(self) -> None:
        doc = {
            "version": PROTOCOL_VERSION,
            "name": self.name,
            "state": self._state,
            "host": self._host,
            "pid": self._pid,
            "started": self._started,
            "ended": self._ended,
            "reason": self._reason,
            "parent": None if self.parent is None else self.parent.to_json(),
            "heartbeat_interval": self.heartbeat_interval,
        }
        if self.job_part is not None:
            doc["job"] = self.job_part.to_json()
        if self.scheduler_job is not None:
            doc[SCHEDULER_JOB] = self.scheduler_job
        _atomic_write(os.path.join(self._state_dir, RUN_FILE), json.dumps(doc, indent=1).encode() + b"\n")

    def _touch_heartbeat(self) -> None:
        path = os.path.join(self._state_dir, HEARTBEAT_FILE)
        try:
            try:
                os.utime(path)
            except FileNotFoundError:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        except OSError as exc:
            # Never let liveness bookkeeping hurt training; say it once, keep trying.
            if not self._heartbeat_failing:
                log.warning("ckptkeeper: heartbeat of run %s failing: %s", self.name, exc)
            self._heartbeat_failing = True
        else:
            self._heartbeat_failing = False

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            self._touch_heartbeat()


def _describe(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError as exc:  # some filesystems refuse directory fsync; the rename already happened
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(dfd)


def track_run(
    run_dir: StrPath,
    *,
    name: str | None = None,
    parent: ParentSpec = None,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    enabled: bool | None = None,
    fsync_commits: bool = False,
    job: str | None = None,
    part: int | None = None,
    parts: int | None = None,
) -> TrackedRun:
    """Start tracking the run whose checkpoints live in ``run_dir`` (created if missing).

    ``name`` defaults to the directory's name (display only: the daemon identifies runs by path).
    ``parent`` is the checkpoint this run resumes or forks from: ``"run:step"``, ``(run, step)``, or a path
    to an existing checkpoint (its step read from the parent's commits or its name). ``enabled`` defaults to
    "this is rank 0" (``RANK`` unset or ``0``), so every rank of a distributed job may call this safely.
    Restarting a run in the same dir (a resume) marks it active again and keeps its earlier commits.

    Multi-node jobs saving to node-local disks: call it on every rank of every node, like above; the
    node's local rank 0 writes, recording the job (``job``, else ``TORCHELASTIC_RUN_ID`` /
    ``SLURM_JOB_ID``), this node's 0-based ``part`` (else ``GROUP_RANK`` / ``NODE_RANK`` /
    ``SLURM_NODEID``) and the number of ``parts`` (else ``WORLD_SIZE / LOCAL_WORLD_SIZE`` /
    ``SLURM_NNODES``), so this node's daemon keeps its share of each checkpoint as a complete part
    instead of reaping it as a partial save (docs/spanning-nodes.md). Nodes that all
    save into one shared run dir pass ``parts=1``: only global rank 0 writes then, as for one node.
    """
    return TrackedRun(
        run_dir,
        name=name,
        parent=parent,
        heartbeat_interval=heartbeat_interval,
        enabled=enabled,
        fsync_commits=fsync_commits,
        job=job,
        part=part,
        parts=parts,
    )
