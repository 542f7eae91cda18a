"""Presentation helpers shared by CLI commands: sizes, ages, aligned tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as df -h and restic print)."""
    if n < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(n, 1024)), 5)
    return f"{n / 1024**exp:.1f} {'KMGTP'[exp - 1]}iB"


def human_age(seconds: float) -> str:
    """7380 -> '2h3m': two units at most, as people read ages."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h}h" if h else f"{d}d"


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
