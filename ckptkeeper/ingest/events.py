"""What a filesystem event under the hot root means: the run it belongs to and how urgently to
reconcile it (``classify_path``). Pure string work — no I/O, no watchdog — so the watcher's rules
are unit-tested with plain paths; the scheduling that acts on the verdict lives in ``watcher``.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Any

from ckptkeeper.hook.protocol import COMMITS_FILE, RUN_FILE, STAGING_MARK, STATE_DIR

__all__ = ["EventKind", "classify_path", "hook_dir_created"]


class EventKind(Enum):
    IGNORE = "ignore"
    WRITE = "write"
    """Checkpoint data changed: debounce."""
    COMMIT = "commit"
    """The hook appended to commits.jsonl: reconcile now."""
    RUN_STATE = "run_state"
    """run.json replaced (finished/failed): debounce."""
    TREE = "tree"
    """Something changed above run depth (a team directory, a moved-in tree): full hot reconcile."""


def classify_path(root: str, path: str, run_depth: int) -> tuple[EventKind, str | None]:
    """Map an event path to (what it means, run name). Pure: the unit tests feed it strings."""
    prefix = root if root.endswith(os.sep) else root + os.sep
    if not path.startswith(prefix) or len(path) == len(prefix):
        return EventKind.IGNORE, None
    parts = path[len(prefix) :].split(os.sep)
    # Same rules as Catalog.iter_run_dirs: hidden and staging entries are never runs.
    for part in parts[:run_depth]:
        if part.startswith(".") or STAGING_MARK in part:
            return EventKind.IGNORE, None
    if len(parts) < run_depth:
        return EventKind.TREE, None
    run = "/".join(parts[:run_depth])
    rest = parts[run_depth:]
    if STATE_DIR in rest:
        # The hook's dir, at the run dir or below it (a callback whose checkpoint dir is nested).
        at = rest.index(STATE_DIR)
        name = rest[at + 1] if len(rest) == at + 2 else None
        if name == COMMITS_FILE:
            return EventKind.COMMIT, run
        if name == RUN_FILE:
            return EventKind.RUN_STATE, run
        return EventKind.IGNORE, None  # heartbeat, run.json.<pid>.tmp, anything else of the hook's
    if any(STAGING_MARK in part for part in rest):
        return EventKind.IGNORE, None
    return EventKind.WRITE, run


def hook_dir_created(root: str, path: str, run_depth: int, event: Any) -> str | None:
    """The run in which a hook state directory (``.ckptkeeper/``) was just created or moved in, else
    None. The watcher ignores everything inside that directory but run.json and commits.jsonl, and
    the heartbeat the hook starts writing there raises no work: a run that was cataloged without
    the hook must be re-read once, so that from then on its state is re-derived on every pass."""
    if not getattr(event, "is_directory", False) or event.event_type not in ("created", "moved"):
        return None
    if os.path.basename(path.rstrip(os.sep)) != STATE_DIR:
        return None
    kind, run = classify_path(root, os.path.dirname(path.rstrip(os.sep)), run_depth)
    if kind in (EventKind.WRITE, EventKind.RUN_STATE, EventKind.COMMIT):
        return run
    return None
