"""A ``ckptkeeper daemon`` for a bench to time restores it serves, and the proof that it did.

The daemon runs the bench's own config file with the bench's environment, so a plain
``ckptkeeper restore`` with that config is served on its socket (docs/daemon-restore.md).
:func:`served_restores` counts, from the daemon's log, the restores it served with exit 0 into a
given destination: a bench compares that count with the restores it timed and fails when they
differ, rather than timing the command running alone.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench._harness import read_proc_cpu_seconds

__all__ = ["Daemon", "running_daemon", "served_restores"]


class Daemon:
    """A running daemon: its pid, its log, and its CPU-seconds so far (all its threads)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def cpu(self) -> float:
        return read_proc_cpu_seconds(self.proc.pid)


@contextlib.contextmanager
def running_daemon(config: Path, env: dict[str, str], log: Path) -> Iterator[Daemon]:
    """``ckptkeeper --config CONFIG daemon`` until its log says ready; SIGTERM-ed (and waited for,
    so its log is complete) on exit."""
    argv = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "daemon"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while b'"ready"' not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield Daemon(proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_restores(log: Path, to: Path) -> int:
    """Restores into ``to`` the daemon's log says it served, with exit 0."""
    count = 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(doc, dict)
            and doc.get("event") == "restore socket: served"
            and doc.get("op") == "restore"
            and doc.get("exit") == 0
            and not doc.get("cancelled")
            and doc.get("to") == str(to)
        ):
            count += 1
    return count
