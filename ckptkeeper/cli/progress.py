"""Progress of long copies on a terminal: bytes done of total, rate and ETA on one redrawn line.

Only when stderr is a terminal: under systemd, in a pipe or in a test capturing output there is
nothing to redraw, and the journal already gets one log line per action. Lines are cut to the
terminal's width, so a long checkpoint path never wraps a line that ``\\r`` must overwrite.

click and the standard library only: imported by ``restore`` and ``prune``, never by ``--help``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

import click

from ckptkeeper.util.fmt import human_bytes

REDRAW_SECONDS = 0.2
"""At most five redraws a second; the first and the last update always draw."""


def format_eta(seconds: float) -> str:
    """``7s``, ``2m05s``, ``1h02m``: short enough for the end of a progress line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(label: str, done: int, total: int, rate: float, elapsed: float, width: int = 100) -> str:
    """``LABEL: 256.0 MiB/1.0 GiB (25%) 410.2 MiB/s ETA 2s`` (``in 3s`` once done), the label
    shortened from the left to fit ``width``. ``rate`` is in bytes per second."""
    pct = done / total * 100 if total else 100.0
    if done >= total:
        eta = f"in {format_eta(elapsed)}"
    elif rate > 0:
        eta = f"ETA {format_eta((total - done) / rate)}"
    else:
        eta = "ETA ?"
    tail = f": {human_bytes(done)}/{human_bytes(total)} ({pct:.0f}%) {human_bytes(int(rate))}/s {eta}"
    room = max(10, width - len(tail))
    if len(label) > room:
        label = "…" + label[-(room - 1) :]
    return label + tail


class ByteProgress:
    """One redrawn line per item (a restore, a prune action): call ``update(label, done, total)``
    as bytes arrive; a new label starts a new line and a new rate.

    The rate is measured from the item's first update (bytes already moved then are not counted
    in it); the second update always draws, so even a short copy shows one line with a real rate
    and ETA before its summary line."""

    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self._label: str | None = None
        self._t0 = 0.0
        self._d0 = 0
        self._updates = 0
        self._last_draw = 0.0
        self._open = False

    def update(self, label: str, done: int, total: int) -> None:
        now = self.clock()
        if label != self._label:
            self._end_line()
            self._label, self._t0, self._d0, self._updates = label, now, done, 0
            self._last_draw = now
        self._updates += 1
        finished = done >= total
        if not finished and self._updates != 2 and now - self._last_draw < REDRAW_SECONDS:
            return
        self._last_draw = now
        width = shutil.get_terminal_size((100, 24)).columns - 1
        elapsed = now - self._t0
        rate = (done - self._d0) / elapsed if elapsed > 0 else 0.0
        line = progress_line(label, done, total, rate, elapsed, width)
        click.echo(f"\r\x1b[K{line}", file=self.stream, nl=False)
        self._open = True
        if finished:
            self._end_line()
            self._label = None

    def _end_line(self) -> None:
        if self._open:
            click.echo("", file=self.stream)
            self._open = False


def terminal_progress() -> ByteProgress | None:
    """A progress line on stderr when it is a terminal; None otherwise (clean output for pipes)."""
    if not sys.stderr.isatty():
        return None
    return ByteProgress(sys.stderr)
