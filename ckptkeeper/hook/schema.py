"""The one schema of everything ckptkeeper reads: the bounds of every field, in one place.

Every byte read from a run dir, a manifest or a tier is untrusted (another node, a bug, an attacker;
docs/design.md, safety invariant 9). Each reader — the hook protocol's (``run.json``, ``commits.jsonl``, ``heartbeat``),
the manifest parser of the core, the layout recognizers' markers — checks each field it keeps with
the functions below, so a step of ``1e400`` or ``10**30``, a size of ``2**70`` or a NaN time is a
:class:`SchemaError` naming the field, never an ``OverflowError`` or an SQLite ``IntegrityError``
deep inside a catalog pass.

Standard library only and free of I/O: training processes import the hook, and the core (which is
pure) builds its manifest schema on these functions.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from ckptkeeper.hook.parts import JobPart

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
"""SQLite INTEGER is a signed 64-bit integer: anything larger cannot even be stored."""
MAX_STEP: Final = INT64_MAX
MAX_BYTES: Final = INT64_MAX
"""A file size, and the total of a checkpoint's sizes."""
MAX_PID: Final = 2**22
"""Linux's PID_MAX_LIMIT; no kernel hands out a larger pid."""
MAX_TIME: Final = 32503680000.0
"""3000-01-01T00:00:00Z: a POSIX time past it is not one any clock wrote (and breaks datetime)."""
MAX_INTERVAL: Final = 366 * 86400.0
"""Longest heartbeat interval anyone means (one year)."""
MAX_TEXT: Final = 4096
"""Characters of any string field (names, hosts, reasons, paths, hashes)."""
MAX_FILES: Final = 10_000_000
"""Entries of a manifest's file list."""
MAX_METRICS: Final = 4096
"""Keys of a metrics object."""
MAX_ERRORS: Final = 100
"""Problems a reader reports per document; the rest are counted, not listed (a 1 GB garbage file
must not become a billion log lines)."""
_FLOAT_MAX: Final = sys.float_info.max


class SchemaError(ValueError):
    """A field of an untrusted document is out of bounds or of the wrong type; ``str()`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


def describe(value: Any, limit: int = 60) -> str:
    """A short, safe rendering of a hostile value (a 5000-digit int has no ``repr`` at all)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 64:
            return f"an integer of {value.bit_length()} bits"
        return repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "…")
    return f"a {type(value).__name__}"


def kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def integer(value: Any, field: str, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An int (never a bool, never a float) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(field, f"{describe(value)} is not an integer")
    if not lo <= value <= hi:
        raise SchemaError(field, f"{describe(value)} is out of range [{lo}, {hi}]")
    return value


def step(value: Any, field: str = "step") -> int:
    """A training step: 0 ≤ step ≤ 2**63-1 (it must fit SQLite INTEGER)."""
    return integer(value, field, lo=0, hi=MAX_STEP)


def size(value: Any, field: str = "size") -> int:
    """A size in bytes: 0 ≤ size ≤ 2**63-1."""
    return integer(value, field, lo=0, hi=MAX_BYTES)


def number(value: Any, field: str, *, lo: float = -_FLOAT_MAX, hi: float = _FLOAT_MAX) -> float:
    """A finite number (int or float, never a bool) within ``[lo, hi]``, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(field, f"{describe(value)} is not a number")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range
        raise SchemaError(field, f"{describe(value)} is not a finite number") from None
    if not math.isfinite(as_float):
        raise SchemaError(field, f"{describe(value)} is not a finite number")
    if not lo <= as_float <= hi:
        raise SchemaError(field, f"{describe(value)} is out of range [{lo}, {hi}]")
    return as_float


def timestamp(value: Any, field: str) -> float:
    """A POSIX time between 1970 and the year 3000."""
    return number(value, field, lo=0.0, hi=MAX_TIME)


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise SchemaError(field, f"{describe(value)} is not a boolean")
    return value


def text(value: Any, field: str, *, max_len: int = MAX_TEXT, empty: bool = True) -> str:
    """A string of at most ``max_len`` characters, without NUL, encodable as UTF-8 (SQLite text)."""
    if not isinstance(value, str):
        raise SchemaError(field, f"{describe(value)} is not a string")
    if not value and not empty:
        raise SchemaError(field, "empty")
    if len(value) > max_len:
        raise SchemaError(field, f"longer than {max_len} characters")
    if "\0" in value:
        raise SchemaError(field, f"{describe(value)} contains NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(field, f"{describe(value)} is not valid Unicode") from None
    return value


def rel_path(value: Any, field: str, *, empty: bool = False) -> str:
    """A ``/``-separated relative path: not absolute, no ``.``/``..``/empty component, no NUL."""
    path = text(value, field, empty=empty)
    if not path:
        return path
    if path.startswith(("/", "\\")):
        raise SchemaError(field, f"{describe(path)} is absolute")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise SchemaError(field, f"{describe(path)} has an empty, '.' or '..' component")
    return path


def array(value: Any, field: str, *, max_len: int) -> list[Any]:
    if not isinstance(value, list):
        raise SchemaError(field, f"{describe(value)} is not a list")
    if len(value) > max_len:
        raise SchemaError(field, f"more than {max_len} entries")
    return value


def mapping(value: Any, field: str, *, max_len: int = MAX_TEXT) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(field, f"{describe(value)} is not an object")
    if len(value) > max_len:
        raise SchemaError(field, f"more than {max_len} keys")
    return value


def metrics(value: Any, field: str = "metrics") -> tuple[dict[str, float], list[str]]:
    """Finite numeric metrics of an object, and the names of the entries dropped (not numbers,
    out of range, bad keys). ``None`` is no metrics; anything but an object is a SchemaError."""
    if value is None:
        return {}, []
    doc = mapping(value, field, max_len=MAX_METRICS)
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for key, raw in doc.items():
        try:
            name = text(key, f"{field} key", max_len=256, empty=False)
            kept[name] = number(raw, f"{field}.{name}")
        except SchemaError:
            dropped.append(describe(key, 40) if isinstance(key, str) else "?")
    return kept, dropped


def numeric_items(items: Iterable[tuple[Any, Any]]) -> tuple[dict[str, float], list[str]]:
    """Like :func:`metrics` for framework markers, which mix numbers with other values: entries
    that are not numbers at all (strings, lists, bools) are ignored silently; numbers that are not
    finite (NaN loss of a diverged run, ``1e400``) are dropped silently; only integers beyond the
    float range — which no framework writes — are reported as dropped."""
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for key, raw in items:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not isinstance(key, str):
            continue
        try:
            name = text(key, "metric", max_len=256, empty=False)
        except SchemaError:
            continue
        if isinstance(raw, int) and abs(raw) > 2**1023:
            dropped.append(describe(name, 40))
            continue
        if math.isfinite(raw):
            kept[name] = float(raw)
    return kept, dropped


def job_part(value: Any, field: str = "job") -> JobPart:
    """A node's part of a multi-node job (``run.json``'s ``job``): ``{"id": str | null, "part",
    "parts"}`` with 2 <= parts <= 10**6 and 0 <= part < parts."""
    from ckptkeeper.hook.parts import MAX_PARTS, JobPart

    doc = mapping(value, field, max_len=16)
    raw_id = doc.get("id")
    job = None if raw_id is None else text(raw_id, f"{field}.id", max_len=255, empty=False)
    parts = integer(doc.get("parts"), f"{field}.parts", lo=2, hi=MAX_PARTS)
    part = integer(doc.get("part"), f"{field}.part", lo=0, hi=parts - 1)
    return JobPart(job=job, part=part, parts=parts)


def parse_json(data: bytes | str, what: str) -> Any:
    """Decode and parse one JSON document; every failure (not UTF-8, bad JSON, a nesting bomb, an
    integer literal of more digits than Python converts) is a SchemaError naming ``what``."""
    try:
        text_ = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise SchemaError(what, "not UTF-8") from None
    try:
        return json.loads(text_)
    except RecursionError:
        raise SchemaError(what, "JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int literals beyond sys.get_int_max_str_digits()
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:120]
        raise SchemaError(what, f"not valid JSON ({message})") from None


def capped(errors: list[str], limit: int = MAX_ERRORS) -> list[str]:
    """The first ``limit`` problems, and one line counting the rest."""
    if len(errors) <= limit:
        return errors
    return [*errors[:limit], f"… and {len(errors) - limit} more"]
