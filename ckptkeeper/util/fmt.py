"""Presentation helpers: sizes, durations and ages, aligned tables (the one place each is formatted)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as df -h and restic print)."""
    if n < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(n, 1024)), 5)
    return f"{n / 1024**exp:.1f} {'KMGTP'[exp - 1]}iB"


_UNITS = (("d", 86400), ("h", 3600), ("m", 60))


def format_duration(seconds: float) -> str:
    """Exact, as written in config files (``config.parse_duration`` reads it back): ``7d``,
    ``1d12h``, ``90`` -> ``1m30s``, ``1.5`` -> ``1.5s``. For intervals and policy windows."""
    if seconds < 0 or not math.isfinite(seconds):
        return f"{seconds}s"
    whole = int(seconds)
    frac = seconds - whole
    parts = []
    for unit, size in _UNITS:
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    if whole or frac or not parts:
        parts.append(f"{whole + frac:g}s")
    return "".join(parts)


def human_age(seconds: float) -> str:
    """How long ago, as people skim it (restic-like): ``45s``, ``1m30s``, ``3h12m``, ``2d5h``, ``1d``.

    A thin wrapper of :func:`format_duration`: the age is rounded down to its two most significant
    units first, because an age in a status line or a reason needs no more ("3h12m7s" is noise),
    while a configured interval must print exactly. Negative ages (an mtime from a host whose clock
    runs ahead) print as ``0s``.
    """
    s = max(0, int(seconds))
    sizes = [size for _, size in _UNITS] + [1]
    for i, size in enumerate(sizes[:-1]):
        if s >= size:
            return format_duration(s - s % sizes[i + 1])
    return format_duration(s)


def format_metrics(metrics: Mapping[str, float], limit: int = 3) -> str:
    items = sorted(metrics.items())[:limit]
    return " ".join(f"{k}={v:.4g}" for k, v in items)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Aligned columns; ``right`` holds indexes of right-aligned (numeric) columns."""
    cells = [[str(h) for h in headers], *[[("" if c is None else str(c)) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
