"""ckptkeeper: catalog, tier and reap ML training checkpoints.

The package root is what training scripts import, so it stays nearly empty: every public name is loaded
on first use (PEP 562). ``import ckptkeeper; ckptkeeper.track_run`` loads the standard library and
``ckptkeeper.hook`` only — never the daemon's dependencies (pydantic, fsspec, watchdog, …).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["TrackedRun", "__version__", "latest", "restore", "track_run"]

_LAZY: dict[str, str] = {
    "track_run": "ckptkeeper.hook",
    "TrackedRun": "ckptkeeper.hook",
    "restore": "ckptkeeper.actions.restore",
    "latest": "ckptkeeper.actions.restore",
}

if TYPE_CHECKING:
    from ckptkeeper.hook import TrackedRun, track_run


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkeeper' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
