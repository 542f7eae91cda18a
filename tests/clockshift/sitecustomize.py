"""A node whose clock is off (tests of docs/design.md, "Cluster reality": one clock for cross-node time).

On a child's ``PYTHONPATH`` (ahead of everything), with ``CKPT_TEST_CLOCK_OFFSET`` = seconds,
this shifts the process's wall clock — ``time.time``, ``time.time_ns`` and ``datetime.now`` — as
a machine whose clock is that far off would see it. File mtimes (set by the kernel) and the S3
server's clock (another process) stay real: exactly what a skewed node meets in a cluster.
"""

from __future__ import annotations

import os

_OFFSET = float(os.environ.get("CKPT_TEST_CLOCK_OFFSET") or 0)

if _OFFSET:
    import datetime as _datetime
    import time as _time

    _real_time, _real_time_ns = _time.time, _time.time_ns

    def _time_shifted() -> float:
        return _real_time() + _OFFSET

    def _time_ns_shifted() -> int:
        return _real_time_ns() + int(_OFFSET * 1e9)

    _time.time = _time_shifted
    _time.time_ns = _time_ns_shifted

    class _ShiftedDatetime(_datetime.datetime):
        @classmethod
        def now(cls, tz: _datetime.tzinfo | None = None) -> _datetime.datetime:  # type: ignore[override]
            return _datetime.datetime.fromtimestamp(_time_shifted(), tz)

    _datetime.datetime = _ShiftedDatetime  # type: ignore[misc]
