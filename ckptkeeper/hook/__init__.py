"""The training-loop side: the run-dir protocol (:mod:`.protocol`) and its writer, ``track_run``.

Standard library only, all the way down: ``import ckptkeeper; ckptkeeper.track_run`` loads this
package and nothing heavier. The daemon's layers read the same protocol through :mod:`.protocol`.
"""

from ckptkeeper.hook.protocol import (
    COMMITS_FILE,
    DEFAULT_HEARTBEAT_INTERVAL,
    HEARTBEAT_FILE,
    PROTOCOL_VERSION,
    RUN_FILE,
    STAGING_MARK,
    STATE_DIR,
    Commit,
    ParentRef,
    ParentSpec,
    RunInfo,
    heartbeat_mtime,
    pid_alive,
    read_commits,
    read_run_dir,
)
from ckptkeeper.hook.writer import TrackedRun, parent_ref, track_run

__all__ = [
    "COMMITS_FILE",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "HEARTBEAT_FILE",
    "PROTOCOL_VERSION",
    "RUN_FILE",
    "STAGING_MARK",
    "STATE_DIR",
    "Commit",
    "ParentRef",
    "ParentSpec",
    "RunInfo",
    "TrackedRun",
    "heartbeat_mtime",
    "parent_ref",
    "pid_alive",
    "read_commits",
    "read_run_dir",
    "track_run",
]
