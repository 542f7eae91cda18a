"""What a config reload changed: the keys to log, and whether the hot-tier watch must restart."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ckptkeeper.config import Settings

__all__ = ["config_changes", "watch_keys_changed"]


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def config_changes(old: Settings, new: Settings) -> list[str]:
    """Key paths whose value differs (for the reload log line; values may hold secrets)."""
    a = dict(_flatten(old.model_dump()))
    b = dict(_flatten(new.model_dump()))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, object()) != b.get(k, object()))


def watch_keys_changed(old: Settings, new: Settings) -> bool:
    return (
        old.hot.url != new.hot.url
        or old.hot.name != new.hot.name
        or old.run_depth != new.run_depth
        or old.daemon.polling != new.daemon.polling
        or old.daemon.polling_interval != new.daemon.polling_interval
    )
