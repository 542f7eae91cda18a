"""What the framework callbacks share: their constructor, one-time warnings and class building.

Stdlib and :mod:`ckptkeeper.hook` only, like the callbacks themselves: importing it imports no
framework.
"""

from __future__ import annotations

import logging
import os
import warnings

from ckptkeeper.hook import DEFAULT_HEARTBEAT_INTERVAL, ParentSpec


def describe_exception(exc: BaseException) -> str:
    """``"<Type>: message"`` (or just the type): the failure reason a run is marked with."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class CallbackBase:
    """Options every ``KeeperCallback`` takes: the run dir override and what goes to
    :func:`ckptkeeper.track_run`. A framework's callback class comes after this in the MRO, so
    ``super().__init__()`` reaches it."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        parent: ParentSpec = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    ) -> None:
        super().__init__()
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.name = name
        self.parent = parent
        self.heartbeat_interval = heartbeat_interval
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        """A misconfiguration is said once per callback, as a log line and a Python warning."""
        if key in self._warned:
            return
        self._warned.add(key)
        logging.getLogger(type(self).__module__).warning("%s", message)
        warnings.warn(message, UserWarning, stacklevel=3)


def build_callback_class(mixin: type, bases: tuple[type, ...], module: str) -> type:
    """``KeeperCallback``: the mixin over the framework's callback base(s), built on first access
    so that importing the integration module never imports the framework."""
    cls = type("KeeperCallback", (mixin, *bases), {"__module__": module})
    cls.__qualname__ = "KeeperCallback"
    cls.__doc__ = mixin.__doc__
    return cls
