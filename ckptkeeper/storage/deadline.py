"""Bounded requests and bounded passes (docs/design.md, "Cluster reality": everything bounded).

Every request to an object store gets at most ``request_timeout`` seconds, retries included; a
prune pass gets at most ``pass_timeout`` in all. A request that hits either deadline is cancelled
(its connection closed) and fails with a :class:`~ckptkeeper.storage.base.StorageError` naming it;
the pass records it (:attr:`Bound.hung`), sets its stop event (the executor stops between two
actions, the journal intact) and ends with exit 1 naming the request. The next pass starts afresh.

One pass at a time per process (the executor lock): the bound is process-wide, so requests made
from worker threads are bounded too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptkeeper.util.fmt import format_duration

__all__ = [
    "DEFAULT_PASS_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "Bound",
    "bound",
    "configure",
    "hung",
    "remaining",
]

DEFAULT_REQUEST_TIMEOUT = 300.0
DEFAULT_PASS_TIMEOUT = 12 * 3600.0


@dataclass
class Bound:
    """One pass's deadlines and what hit them."""

    request_timeout: float
    pass_deadline: float | None = None
    """``time.monotonic()`` at which the pass must stop; None outside a pass."""
    hung: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


_LOCK = threading.Lock()
_DEFAULT = Bound(DEFAULT_REQUEST_TIMEOUT)
_CURRENT: Bound = _DEFAULT


def configure(request_timeout: float) -> None:
    """The per-request deadline outside a pass (``ls``, ``restore``, ``scan`` …): the setting."""
    _DEFAULT.request_timeout = request_timeout


@contextlib.contextmanager
def bound(request_timeout: float, pass_timeout: float) -> Iterator[Bound]:
    """Deadlines for one pass: every request within it, and the whole of it."""
    global _CURRENT
    b = Bound(request_timeout, time.monotonic() + pass_timeout)
    with _LOCK:
        previous, _CURRENT = _CURRENT, b
    try:
        yield b
    finally:
        with _LOCK:
            _CURRENT = previous


def remaining(what: str, tier: str) -> float:
    """Seconds the request ``what`` may take: ``request_timeout``, or less near the pass's end.
    Raises :class:`TimeoutError` (naming it) when the pass's deadline has passed already."""
    b = _CURRENT
    left = b.request_timeout
    if b.pass_deadline is not None:
        until_end = b.pass_deadline - time.monotonic()
        if until_end <= 0:
            raise TimeoutError(hung(tier, what, 0.0, whole_pass=True))
        left = min(left, until_end)
    return max(left, 0.001)


def hung(tier: str, what: str, waited: float, *, whole_pass: bool = False) -> str:
    """Record that ``what`` hit a deadline (stopping the pass); the message naming it."""
    b = _CURRENT
    if whole_pass or (b.pass_deadline is not None and b.pass_deadline - time.monotonic() <= 0):
        msg = f"tier {tier!r}: {what}: the pass reached pass_timeout; stopped"
    else:
        msg = f"tier {tier!r}: {what}: no answer within request_timeout ({format_duration(waited)}); the request hung"
    with _LOCK:
        if msg not in b.hung:
            b.hung.append(msg)
    b.stop.set()
    return msg
