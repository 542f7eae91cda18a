"""The store's clock (docs/design.md, "Cluster reality": one clock for cross-node time).

Nodes' clocks may disagree by days; the store's (an S3 endpoint's, a shared filesystem server's)
is one clock every node reads. Every S3 response carries it (the HTTP ``Date`` header, to the
second); :class:`StoreClock` keeps the last one seen and extrapolates it with this process's
monotonic clock, so ``now()`` costs no request. Cross-node judgements (a node gone, a lease or a
claim expired, an adoption due) compare the store's ``LastModified`` of an object with this
clock, never with ``time.time()``.
"""

from __future__ import annotations

import threading
import time
from email.utils import parsedate_to_datetime

__all__ = ["StoreClock", "parse_http_date"]


def parse_http_date(value: str) -> float | None:
    """Seconds since the epoch of an RFC 1123 date (``Fri, 04 Dec 2026 23:22:12 GMT``), or None."""
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


class StoreClock:
    """The last ``Date`` a store sent, and when (this process's monotonic clock) it came."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: str | None = None
        self._at = 0.0
        self._parsed: tuple[str, float] | None = None

    def note(self, date: str | None) -> None:
        """Record a response's ``Date`` header (cheap: parsed only when asked for)."""
        if date:
            with self._lock:
                self._raw, self._at = date, time.monotonic()

    def now(self) -> float | None:
        """The store's time now (its last ``Date`` + the time elapsed here since), or None when
        no response was seen yet. ``Date`` is truncated to the second: this is at most 1 s behind,
        which delays a judgement, never hastens one."""
        with self._lock:
            raw, at = self._raw, self._at
            if raw is None:
                return None
            if self._parsed is None or self._parsed[0] != raw:
                value = parse_http_date(raw)
                if value is None:
                    return None
                self._parsed = (raw, value)
            return self._parsed[1] + (time.monotonic() - at)


_CLOCKS: dict[str, StoreClock] = {}
_CLOCKS_LOCK = threading.Lock()


def clock_for(endpoint: str) -> StoreClock:
    """The one clock of ``endpoint`` in this process (every tier on one store shares it)."""
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(endpoint)
        if clock is None:
            clock = _CLOCKS[endpoint] = StoreClock()
        return clock
