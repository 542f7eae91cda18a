"""What the framework callbacks share: their constructor, one-time warnings and class building.

Stdlib and :mod:`ckptkeeper.hook` only, like the callbacks themselves: importing it imports no
framework.
"""

from __future__ import annotations

import logging
import os
import warnings

from ckptkeeper.hook import DEFAULT_HEARTBEAT_INTERVAL, ParentSpec, TrackedRun
from ckptkeeper.hook.parts import JobPart, detect


def describe_exception(exc: BaseException) -> str:
    """``"<Type>: message"`` (or just the type): the failure reason a run is marked with."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class CallbackBase:
    """Options every ``KeeperCallback`` takes: the run dir override and what goes to
    :func:`ckptkeeper.track_run`. A framework's callback class comes after this in the MRO, so
    ``super().__init__()`` reaches it.

    ``job`` and ``parts`` are :func:`ckptkeeper.track_run`'s, for a job spanning nodes (docs/spanning-nodes.md): ``parts=1`` when the nodes save into one shared run dir, so that
    only global rank 0 writes, as on one node.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        parent: ParentSpec = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        job: str | None = None,
        parts: int | None = None,
    ) -> None:
        super().__init__()
        detect({}, job=job, parts=parts)  # a bad job or parts is the caller's error: say it now
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.name = name
        self.parent = parent
        self.heartbeat_interval = heartbeat_interval
        self.job = job
        self.parts = parts
        self._warned: set[str] = set()

    def _node_part(
        self,
        *,
        rank: int,
        local_rank: int,
        world: int | None = None,
        node: int | None = None,
        nodes: int | None = None,
    ) -> tuple[bool, JobPart | None]:
        """(does this process write, this node's part or None): the hook's rule
        (:func:`ckptkeeper.hook.parts.detect`) fed with what the framework knows of this process
        (its rank, local rank, world size, node index and node count where it has them), the
        environment for the rest. In a job spanning nodes each node's local rank 0 writes."""
        parts = self.parts if self.parts is not None else nodes
        part = node if node is not None and (parts is None or parts > 1) else None
        return detect(
            os.environ, job=self.job, part=part, parts=parts, rank=rank, local_rank=local_rank, world=world
        )

    def _track(self, run_dir: str, job_part: JobPart | None) -> TrackedRun:
        """The run this writer keeps: the part decided by :meth:`_node_part`, or one node's run."""
        return TrackedRun(
            run_dir,
            name=self.name,
            parent=self.parent,
            heartbeat_interval=self.heartbeat_interval,
            enabled=True,  # the framework's ranks decided already
            job=None if job_part is None else job_part.job,
            part=None if job_part is None else job_part.part,
            parts=1 if job_part is None else job_part.parts,
        )

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
