"""A prune pass within its deadlines (docs/design.md, "Cluster reality": everything bounded).

:func:`bounded_pass` wraps the pass: every store request in it gets at most ``request_timeout``
and the pass ``pass_timeout`` in all (:mod:`ckptkeeper.storage.deadline`). A request that hits
one stops the pass cleanly — the executor's stop event is set, so it stops between two actions
with its journal intact — and the pass ends with exit 1, each hung request named in its
failures. Nothing carries over: the next pass starts with fresh deadlines.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ckptkeeper.actions.errors import EXIT_ACTION_FAILED
from ckptkeeper.config import Settings
from ckptkeeper.storage import deadline
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.deadlines")

__all__ = ["bounded_pass"]

F = TypeVar("F", bound=Callable[..., Any])


def bounded_pass(run: F) -> F:
    """Decorate ``run_prune(settings, index, ..., stop=None)`` returning a ``PruneOutcome``."""

    @functools.wraps(run)
    def bounded(settings: Settings, *args: Any, **kwargs: Any) -> Any:
        deadline.configure(settings.request_timeout)
        with deadline.bound(settings.request_timeout, settings.pass_timeout) as b:
            if kwargs.get("stop") is None:
                kwargs["stop"] = b.stop  # a hung request stops the executor between two actions
            outcome = run(settings, *args, **kwargs)
        if b.hung:
            for line in b.hung:
                log.error("pass stopped: a request hit its deadline", request=line)
            outcome.failed[:0] = b.hung
            outcome.exit_code = EXIT_ACTION_FAILED
        return outcome

    return bounded  # type: ignore[return-value]
