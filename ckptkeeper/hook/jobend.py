"""``run.json`` rewritten by ``ckptkeeper job end``: the scheduler's word on a run whose job ended.

The hook cannot say a run failed when its process is SIGKILLed, cancelled or out of time; the
scheduler's Epilog can. It records the job's end (``job_end``) and, for a failure, the state and
reason the hook would have written. Same atomic replace as the hook, same owner as before (the
Epilog runs as root, the run belongs to the job's user). Standard library only, like the hook.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from ckptkeeper.hook.protocol import ACTIVE, FAILED, JOB_END, RUN_FILE, STATE_DIR, StrPath
from ckptkeeper.hook.writer import _atomic_write

__all__ = ["record_job_end"]

_MAX_RUN_FILE = 1 << 20


def record_job_end(
    hook_dir: StrPath,
    job_end: Mapping[str, Any],
    *,
    fail_reason: str | None = None,
    note_reason: str | None = None,
    expect_state: str | None = None,
) -> bool:
    """Write ``job_end`` into ``<hook_dir>/.ckptkeeper/run.json``; with ``fail_reason``, an active
    run becomes failed with that reason (``ended`` set now); with ``note_reason``, a run already
    ended keeps its state and takes that reason. Nothing is written (False) when the file is
    unreadable, not an object, or its state is no longer ``expect_state`` (the writer spoke
    meanwhile: its word wins)."""
    path = os.path.join(os.fspath(hook_dir), STATE_DIR, RUN_FILE)
    try:
        st = os.lstat(path)
        with open(path, "rb") as f:
            raw = f.read(_MAX_RUN_FILE + 1)
        doc = json.loads(raw) if len(raw) <= _MAX_RUN_FILE else None
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or (expect_state is not None and doc.get("state") != expect_state):
        return False
    doc[JOB_END] = dict(job_end)
    if fail_reason is not None and doc.get("state") == ACTIVE:
        doc["state"] = FAILED
        doc["reason"] = fail_reason
        doc["ended"] = time.time()
    elif note_reason is not None:
        doc["reason"] = note_reason
    _atomic_write(path, json.dumps(doc, indent=1).encode() + b"\n")
    with contextlib.suppress(OSError):  # the job's user keeps their run.json
        os.chown(path, st.st_uid, st.st_gid)
        os.chmod(path, st.st_mode & 0o7777)
    return True
