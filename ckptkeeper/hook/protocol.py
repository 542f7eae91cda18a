"""The run-dir protocol: the file names, readers and writer liveness shared by every layer.

The hook writes these files from training processes; the watcher, the catalog and the layout
recognizers read them. Everything about ``<run_dir>/.ckptkeeper/`` and our staging names is defined
here, once. Standard library only: training scripts import it through the hook.

File protocol (version 1), all under ``<run_dir>/.ckptkeeper/``:

``run.json``
    ``{"version": 1, "name", "state": "active"|"finished"|"failed", "host", "pid", "started", "ended",
    "reason", "parent": {"run", "step"[, "path"]} | null, "heartbeat_interval"[, "job": {"id": str | null,
    "part", "parts"}]}``, replaced atomically (tmp + fsync + ``os.replace`` + directory fsync) on every
    state change. ``job`` is written only by a node of a multi-node job (:mod:`.parts`): its 0-based
    ``part`` of ``parts``; a run.json without it (every older writer) is a one-node run.
``commits.jsonl``
    Append-only, never rewritten by anyone. One line per commit:
    ``{"path": <relative to run_dir, "/"-separated>, "step": int, "metrics": {str: float}, "time": float
    [, "part": int, "parts": int]}`` (``part``/``parts``: the commit of one node's part of a checkpoint
    spanning nodes).
    Each line is one ``os.write`` on an ``O_APPEND`` descriptor under a threading lock *and* an exclusive
    ``flock``, so threads and processes never interleave even for lines bigger than ``PIPE_BUF``. A writer
    that finds the file not ending in a newline (someone crashed mid-write) starts with one, so a torn
    line never swallows the next good one.
``heartbeat``
    Empty file whose mtime a daemon thread refreshes every ``heartbeat_interval`` seconds.

Durability trade-off: commits are *not* fsynced by default. ``write()`` lands in the page cache, which
survives the training process dying; only a kernel crash or power loss can lose the newest lines, and
then the catalog still recognizes the checkpoint from the framework's own completion marker (docs/design.md, "Completeness").
A training step is worth more than that line, so ``commit()`` stays in the tens of microseconds; pass
``fsync_commits=True`` to ``track_run`` to trade that for durability. State changes of ``run.json`` are
rare and always fsynced.

The daemon side reads the same files with :func:`read_run_dir`, :func:`read_commits` and
:func:`heartbeat_mtime`; none of them raises on malformed content (a crash can leave anything behind).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ckptkeeper.hook import schema
from ckptkeeper.hook.parts import JobPart

PROTOCOL_VERSION = 1
STATE_DIR = ".ckptkeeper"
"""Directory inside a run dir holding the hook's files; never a checkpoint, never reaped."""
RUN_FILE = "run.json"
COMMITS_FILE = "commits.jsonl"
HEARTBEAT_FILE = "heartbeat"
SCHEDULER_JOB = "scheduler_job"
"""``run.json`` key: the scheduler job the writer ran in, ``{"scheduler", "id", "restarts"[, "node"]}``."""
JOB_END = "job_end"
"""``run.json`` key written by ``ckptkeeper job end``: ``{"scheduler", "id", "outcome", "reason",
"node", "time"}`` of the job that ended the run (or interrupted it: a requeue)."""
DEFAULT_HEARTBEAT_INTERVAL = 10.0

ACTIVE: Literal["active"] = "active"
FINISHED: Literal["finished"] = "finished"
FAILED: Literal["failed"] = "failed"
_STATES = frozenset({ACTIVE, FINISHED, FAILED})

STAGING_MARK = ".ckptkeeper-tmp-"
"""Infix of every name ckptkeeper stages a copy under (``<name>.ckptkeeper-tmp-<token>``, locally and
as S3 marker keys): what carries it is ours, in progress or interrupted, and never a checkpoint."""

INDEX_RECORD_PREFIX = ".ckptkeeper-index-"
"""``<hot root>/.ckptkeeper-index-<node>.json``: this node had an index, and what it pinned. A hot
root is never listed as a run when its name starts with a dot, so the record is never a checkpoint."""
TRASH_DIR = ".ckptkeeper-trash"
"""Directory (an S3 key prefix) at a tier's root (a shared tier: under the node's prefix) holding
copies moved aside by ``undo_window``: ``<TRASH_DIR>/<stamp>/<run>/<name>`` with its manifest beside
it. Hidden, so never a run, a checkpoint or a temp artifact; the planner purges it, ``undelete``
brings an entry back."""

StrPath: TypeAlias = "str | os.PathLike[str]"
ParentSpec: TypeAlias = "ParentRef | str | os.PathLike[str] | tuple[str, int] | Mapping[str, Any] | None"


# --------------------------------------------------------------------------------------------------
# Data read back by the daemon


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParentRef:
    """The checkpoint a run was resumed or forked from.

    ``run`` is the parent run's name as the hook could tell it: for ``"run:step"`` / ``(run, step)`` the
    caller's string; for a checkpoint *path*, the parent run dir relative to this run dir's parent (the
    sibling's directory name in the usual one-level layout). ``path`` (absolute, only for the path form) is
    the ground truth the catalog should map onto its hot root when ``run_depth`` > 1.
    """

    run: str
    step: int
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"run": self.run, "step": self.step}
        if self.path is not None:
            doc["path"] = self.path
        return doc


@dataclass(frozen=True, slots=True)
class Commit:
    """One line of ``commits.jsonl``: the hook's word that a checkpoint is complete on disk."""

    path: str
    """Relative to the run dir, ``/``-separated, symlinks resolved."""
    step: int
    metrics: Mapping[str, float]
    time: float
    line: int
    """1-based line number in ``commits.jsonl`` (for error messages and incremental readers)."""
    part: int | None = None
    """0-based part of a checkpoint spanning ``parts`` nodes this commit declares complete."""
    parts: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerJob:
    """``run.json``'s ``scheduler_job``: the job the writer ran in."""

    scheduler: str
    id: str
    restarts: int
    """The job's restart count when the run started (a requeue raises it)."""
    node: str | None = None


def _scheduler_job(raw: Any) -> SchedulerJob:
    if not isinstance(raw, dict):
        raise schema.SchemaError(SCHEDULER_JOB, "not an object")
    node = raw.get("node")
    return SchedulerJob(
        scheduler=schema.text(raw.get("scheduler"), f"{SCHEDULER_JOB}.scheduler", max_len=32, empty=False),
        id=schema.text(raw.get("id"), f"{SCHEDULER_JOB}.id", max_len=64, empty=False),
        restarts=schema.integer(raw.get("restarts", 0), f"{SCHEDULER_JOB}.restarts", lo=0, hi=1_000_000),
        node=None if node is None else schema.text(node, f"{SCHEDULER_JOB}.node", max_len=255),
    )


def _job_end(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise schema.SchemaError(JOB_END, "not an object")
    out: dict[str, Any] = {}
    for key in ("scheduler", "id", "outcome", "reason", "node"):
        if raw.get(key) is not None:
            out[key] = schema.text(raw[key], f"{JOB_END}.{key}", max_len=4096)
    if raw.get("time") is not None:
        out["time"] = schema.timestamp(raw["time"], f"{JOB_END}.time")
    return out


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What ``run.json`` says, parsed tolerantly: unreadable fields are ``None`` and ``error`` says why."""

    run_dir: str
    name: str | None
    state: str | None
    """``active``/``finished``/``failed`` as the writer last said; ``None`` when unreadable. The daemon
    derives ``stale`` itself (dead pid + old heartbeat), the hook never writes it."""
    host: str | None
    pid: int | None
    started: float | None
    ended: float | None
    reason: str | None
    parent: tuple[str, int] | None
    """``(run, step)`` resumed or forked from, the shape of ``model.Run.parent``."""
    parent_path: str | None
    """Absolute path of the parent checkpoint when the writer knew it (see :class:`ParentRef`)."""
    heartbeat_interval: float | None
    heartbeat: float | None
    """mtime of the heartbeat file (POSIX seconds), ``None`` when absent."""
    version: int | None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields this reader does not know (newer writers), kept rather than dropped."""
    job: JobPart | None = None
    """This node's part of a multi-node job, as the hook recorded it; None for a one-node run (or
    a ``job`` field that failed the schema: ``error`` says so)."""
    scheduler_job: SchedulerJob | None = None
    """The scheduler job the writer ran in (``scheduler_job``); None outside one."""
    job_end: Mapping[str, Any] | None = None
    """What ``ckptkeeper job end`` recorded of the job that ended (or interrupted) the run."""

    def writer_alive(self, *, hostname: str | None = None) -> bool | None:
        """Whether the process that wrote ``run.json`` still runs.

        ``None`` when it cannot be known from here (written on another host, or no pid): only the heartbeat
        can tell then. A pid that exists but started after the run did is a recycled pid, and a zombie is
        dead: both count as gone, so a crashed run cannot stay "active" forever.
        """
        if self.pid is None or self.host is None:
            return None
        if self.host != (hostname if hostname is not None else socket.gethostname()):
            return None
        return pid_alive(self.pid, self.started)


_KNOWN_RUN_KEYS = frozenset(
    {
        "version",
        "name",
        "state",
        "host",
        "pid",
        "started",
        "ended",
        "reason",
        "parent",
        "heartbeat_interval",
        "job",
        SCHEDULER_JOB,
        JOB_END,
    }
)


def _state_path(run_dir: StrPath, name: str) -> str:
    return os.path.join(os.fspath(run_dir), STATE_DIR, name)


def heartbeat_mtime(run_dir: StrPath) -> float | None:
    """mtime of ``<run_dir>/.ckptkeeper/heartbeat``, or ``None`` when there is none, it is unreadable,
    or its mtime is not a sane time (see :func:`read_heartbeat`)."""
    return read_heartbeat(run_dir)[0]


def read_heartbeat(run_dir: StrPath) -> tuple[float | None, str | None]:
    """(mtime, None) of the heartbeat file; (None, None) when there is none; (None, problem) when it is
    not a regular file or its mtime is outside 1970..3000 (a hostile or broken clock): such a
    heartbeat proves nothing and is reported, not used."""
    try:
        st = os.lstat(_state_path(run_dir, HEARTBEAT_FILE))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{HEARTBEAT_FILE}: cannot stat: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{HEARTBEAT_FILE}: not a regular file"
    try:
        return schema.timestamp(st.st_mtime, f"{HEARTBEAT_FILE} mtime"), None
    except schema.SchemaError as exc:
        return None, str(exc)


def read_run_dir(run_dir: StrPath) -> RunInfo | None:
    """Parse ``<run_dir>/.ckptkeeper/run.json``.

    Returns ``None`` when there is no ``run.json`` (not a hook-tracked run, or not yet: the hook creates
    ``.ckptkeeper/`` a moment before it). Anything else, however malformed, yields a :class:`RunInfo` whose
    ``error`` names the problems, so one bad file never stops a catalog pass.
    """
    path = _state_path(run_dir, RUN_FILE)
    errors: list[str] = []
    doc: Any = None
    parsed = False
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(f"cannot read {RUN_FILE}: {exc.strerror or exc}")
        raw = b""
    if raw:
        try:
            doc = schema.parse_json(raw, RUN_FILE)
            parsed = True
        except schema.SchemaError as exc:
            errors.append(str(exc))
    elif not errors:
        errors.append(f"{RUN_FILE} is empty")
    if parsed and not isinstance(doc, dict):
        errors.append(f"{RUN_FILE} is not a JSON object")
        doc = None
    d: dict[str, Any] = doc or {}

    def pick(key: str, check: Any, *, optional: bool = True, **bounds: Any) -> Any:
        """The field checked by the schema, or None (and the reason in ``errors``)."""
        value = d.get(key)
        if value is None:
            if not optional and doc is not None:
                errors.append(f"{key}: missing")
            return None
        try:
            return check(value, key, **bounds)
        except schema.SchemaError as exc:
            errors.append(str(exc))
            return None

    version = pick("version", schema.integer, optional=False)
    if version is not None and version != PROTOCOL_VERSION:
        errors.append(f"version: unsupported protocol version {version}")
    state = pick("state", schema.text, optional=False)
    if state is not None and state not in _STATES:
        errors.append(f"state: unknown state {schema.describe(state)}")
        state = None
    interval = pick("heartbeat_interval", schema.number, lo=0.0, hi=schema.MAX_INTERVAL)
    parent: ParentRef | None = None
    raw_parent = d.get("parent")
    if raw_parent is not None:
        try:
            parent = _parent_from_json(raw_parent)
        except (TypeError, ValueError) as exc:
            errors.append(f"parent: {exc}")
    job: JobPart | None = None
    if d.get("job") is not None:
        try:
            job = schema.job_part(d["job"])
        except schema.SchemaError as exc:
            errors.append(str(exc))
    sched: SchedulerJob | None = None
    ended_by: dict[str, Any] | None = None
    try:
        if d.get(SCHEDULER_JOB) is not None:
            sched = _scheduler_job(d[SCHEDULER_JOB])
        if d.get(JOB_END) is not None:
            ended_by = _job_end(d[JOB_END])
    except schema.SchemaError as exc:
        errors.append(str(exc))
    return RunInfo(
        run_dir=os.fspath(run_dir),
        name=pick("name", schema.text),
        state=state,
        host=pick("host", schema.text, max_len=255),
        pid=pick("pid", schema.integer, lo=1, hi=schema.MAX_PID),
        started=pick("started", schema.timestamp),
        ended=pick("ended", schema.timestamp),
        reason=pick("reason", schema.text),
        parent=None if parent is None else (parent.run, parent.step),
        parent_path=None if parent is None else parent.path,
        heartbeat_interval=interval,
        heartbeat=heartbeat_mtime(run_dir),
        version=version,
        error="; ".join(schema.capped(errors)) or None,
        extra={k: v for k, v in list(d.items())[: schema.MAX_METRICS] if k not in _KNOWN_RUN_KEYS},
        job=job,
        scheduler_job=sched,
        job_end=ended_by,
    )


def read_commits(run_dir: StrPath) -> tuple[list[Commit], list[str]]:
    """All well-formed commits of a run, in file order, and one message per line that was not.

    Never raises on content: a truncated last line (writer killed mid-append), non-UTF-8 bytes, NULs
    (zero-filled blocks after a power loss), bad JSON or bad fields are reported as
    ``"commits.jsonl:<line>: <problem>"`` and skipped. A missing file is simply no commits. The same path
    may be committed more than once (a resumed run re-saving a step); callers decide, the newest line wins
    by convention.

    Reads under a shared ``flock`` so a concurrent append is never seen half-done; a writer that holds the
    lock unreasonably long (stopped process) costs at most half a second, then the file is read anyway.
    """
    path = _state_path(run_dir, COMMITS_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [f"{COMMITS_FILE}: cannot open: {exc.strerror or exc}"]
    try:
        locked = _flock_with_timeout(fd, fcntl.LOCK_SH, timeout=0.5)
        try:
            chunks: list[bytes] = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        return [], [f"{COMMITS_FILE}: cannot read: {exc.strerror or exc}"]
    finally:
        os.close(fd)
    data = b"".join(chunks)
    commits: list[Commit] = []
    errors: list[str] = []
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, as every complete commit does
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        commit, problem = _parse_commit_line(line, number)
        if commit is not None:
            commits.append(commit)
        if problem is not None:
            errors.append(f"{COMMITS_FILE}:{number}: {problem}")
    if tail.strip(b" \t\r"):
        errors.append(
            f"{COMMITS_FILE}:{len(lines) + 1}: incomplete last line ({len(tail)} bytes, no newline; "
            "the writer probably died mid-append)"
        )
    return commits, schema.capped(errors)


def _parse_commit_line(line: bytes, number: int) -> tuple[Commit | None, str | None]:
    """One line → (commit, None), (commit, note about dropped metrics) or (None, problem)."""
    if b"\0" in line:
        return None, "contains NUL bytes (zero-filled block after a crash?)"
    try:
        doc = schema.parse_json(line, "")
    except schema.SchemaError as exc:
        return None, f"{exc.problem}: {_preview(line.decode('utf-8', 'replace'))}"
    if not isinstance(doc, dict):
        return None, f"not a JSON object: {_preview(line.decode('utf-8', 'replace'))}"
    try:
        rel = schema.rel_path(doc.get("path"), "path")
        if rel.split("/")[0] == STATE_DIR:
            raise schema.SchemaError("path", f"{schema.describe(rel)} is not a path inside the run dir")
        step = schema.step(doc.get("step"))
        when = schema.timestamp(doc.get("time"), "time")
        metrics, dropped = schema.metrics(doc.get("metrics"))
    except schema.SchemaError as exc:
        return None, str(exc)
    notes = [f"metrics {sorted(dropped)!r} dropped: not finite numbers"] if dropped else []
    part = parts = None
    if doc.get("part") is not None or doc.get("parts") is not None:
        try:
            found = schema.job_part({"id": None, "part": doc.get("part"), "parts": doc.get("parts")})
            part, parts = found.part, found.parts
        except schema.SchemaError as exc:
            notes.append(f"{exc}: part ignored")
    commit = Commit(path=rel, step=step, metrics=metrics, time=when, line=number, part=part, parts=parts)
    return commit, "; ".join(notes) or None


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _parent_from_json(raw: Any) -> ParentRef:
    if not isinstance(raw, dict):
        raise TypeError(f"expected an object, got {type(raw).__name__}")
    run = schema.text(raw.get("run"), "run", empty=False)
    step = schema.step(raw.get("step"))
    path = raw.get("path")
    if path is not None:
        path = schema.text(path, "path")
    return ParentRef(run=run, step=step, path=path)


def pid_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is the process that started at ``started`` (POSIX seconds) and still runs.

    The one liveness test of the project: a zombie is dead, and a pid whose process began after
    ``started`` is a recycled pid (the writer died and the kernel reused its number).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except (OSError, OverflowError):  # OverflowError: a pid no kernel has (an untrusted run.json)
        return False
    proc = _proc_stat(pid)
    if proc is None:
        return True  # no /proc (not Linux): trust kill(0)
    state, start_time = proc
    if state == "Z":
        return False
    # The writer recorded `started` after it began; a process that began later holds a recycled pid.
    return not (started is not None and start_time is not None and start_time > started + 2.0)


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    state = fields[0]
    try:
        ticks = int(fields[19])  # field 22 of proc(5): starttime, clock ticks after boot
        return state, _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return state, None


def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


def _flock_with_timeout(fd: int, operation: int, *, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        except OSError:
            return False  # filesystem without flock: read unlocked
