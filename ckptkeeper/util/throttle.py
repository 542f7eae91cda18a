"""A token bucket: keeps a reader or a copy under a byte rate without busy-waiting.

The one home of the concept: the scrub's ``scrub_rate`` and every tier's ``max_rate``
(:mod:`ckptkeeper.storage.ratelimit`) use it. It reads a clock and sleeps; both are injected, so
tests assert the sleeps it asks for instead of measuring time, and the daemon passes a sleep that
wakes on SIGTERM (``stop.wait``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Stopped(Exception):
    """The stop event was set while throttling: the caller ends its pass between chunks."""


class TokenBucket:
    """``consume(n)`` after reading ``n`` bytes; sleeps whenever the reader runs ahead of ``rate``.

    The bucket holds at most ``burst`` bytes (one second's worth by default) and starts full, so
    a short read is never delayed and a long one settles at ``rate``.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
        stop: threading.Event | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        self.capacity = float(burst if burst is not None else rate)
        self.tokens = self.capacity
        self._clock = clock
        self._sleep = sleep
        self._stop = stop
        self._last = clock()
        self._lock = threading.Lock()
        self.slept = 0.0
        """Seconds of sleep asked for so far."""
        self.consumed = 0
        """Bytes taken so far."""

    def consume(self, n: int) -> float:
        """Take ``n`` bytes' worth; sleep until the debt is paid. Returns the seconds asked to sleep.

        Raises :class:`Stopped` when the stop event is set (checked before and after sleeping).
        Safe to share between threads: each caller takes its bytes (and the debt of those before
        it) under a lock and sleeps outside it, so together they keep to ``rate``."""
        if self._stop is not None and self._stop.is_set():
            raise Stopped
        with self._lock:
            now = self._clock()
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
            self._last = now
            self.tokens -= n
            self.consumed += n
            if self.tokens >= 0:
                return 0.0
            wait = -self.tokens / self.rate
            self.slept += wait
        self._sleep(wait)
        if self._stop is not None and self._stop.is_set():
            raise Stopped
        return wait
