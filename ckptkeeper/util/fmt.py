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


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    right: Sequence[int] = (),
    width: int | None = None,
) -> str:
    """Aligned columns; ``right`` holds indexes of right-aligned (numeric) columns.

    With ``width``, no line is longer: the last column (a reason, a path, a URL: free text) is
    wrapped into the room the others leave, or — when that is under ``MIN_LAST_COLUMN`` — printed
    under its row, indented and wrapped to the full width."""
    cells = [[str(h) for h in headers], *[[("" if c is None else str(c)) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if width is None or lead + widths[-1] <= width:
        return "\n".join(_table_lines(cells, widths, right))
    room = width - lead
    if room >= MIN_LAST_COLUMN:
        lines = []
        for n, row in enumerate(cells):
            chunks = _wrap(row[-1], room)
            lines.append(_join_row([*row[:-1], chunks[0]], [*widths[:-1], room], right))
            lines += [" " * lead + more for more in chunks[1:]]
            if n == 0:
                lines.append("  ".join("-" * w for w in [*widths[:-1], min(room, widths[-1])]))
        return "\n".join(lines)
    # Too narrow for a column: each row's last cell goes under it.
    head = cells[0][:-1]
    lines = _table_lines([head, *[r[:-1] for r in cells[1:]]], widths[:-1], right)
    out = lines[:2]
    for row, line in zip(cells[1:], lines[2:], strict=True):
        out.append(line)
        out += ["    " + chunk for chunk in _wrap(row[-1], width - 4) if chunk]
    return "\n".join(out)


MIN_LAST_COLUMN = 32
"""Narrowest wrapped last column of a :func:`table`; below it the cell goes under its row."""


def _table_lines(cells: Sequence[Sequence[str]], widths: Sequence[int], right: Sequence[int]) -> list[str]:
    lines = []
    for n, row in enumerate(cells):
        lines.append(_join_row(row, widths, right))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _join_row(row: Sequence[str], widths: Sequence[int], right: Sequence[int]) -> str:
    parts = [
        c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
    ]
    return "  ".join(parts).rstrip()


def _wrap(text: str, width: int) -> list[str]:
    """Words to lines of at most ``width``; a word longer than that (a path) is broken."""
    import textwrap

    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def wrap_text(text: str, width: int | None, indent: str = "  ") -> str:
    """A prose line (a policy summary, a note) wrapped to ``width``, continuation lines indented."""
    if width is None or len(text) <= width:
        return text
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False))
