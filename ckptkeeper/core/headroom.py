"""Headroom for the next save: how many bytes the active runs' next checkpoints will need in the
hot tier, so the planner can make room before a save fails for lack of space.

Only the first (hot) tier needs the room: active runs write there. Only ACTIVE runs need it: a
run that ended (finished, failed, stale) will not save again, and a run known only from slower
tiers is recorded as finished by the catalog.

**The prediction rule** (:func:`predict_next_save`), per active run, from its checkpoints in step
order:

* the run's last :data:`WINDOW` (3) complete checkpoints: the largest of them, plus the growth
  trend when they grow — when the newest is larger than the oldest of the window, the average
  growth per save, ``ceil((newest - oldest) / (n - 1))``, is added once (a run whose optimizer
  state or shards grow keeps growing by about that much per save);
* no complete checkpoint yet: the largest incomplete one (a save being written, or one cut short)
  if any, a lower bound of what the first save needs;
* nothing at all: 0 (nothing is known about the run's saves yet).

A save in progress is already counted in the tier's usage and is counted again in full here: the
rule errs towards room (a demotion too many moves a checkpoint one tier down; a save too many fails
the training job).

Cost: a walk back from each active run's newest checkpoint, usually :data:`WINDOW` steps; the
planner calls it on the per-run grouping it already has, so O(active runs x 3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptkeeper.core.model import CheckpointState, RunState
from ckptkeeper.util.fmt import human_bytes

__all__ = ["WINDOW", "Headroom", "describe_need", "next_saves", "predict_next_save"]

WINDOW = 3
"""How many of a run's newest complete checkpoints the prediction reads."""

_COMPLETE = CheckpointState.COMPLETE
_ACTIVE = RunState.ACTIVE


class _Sized(Protocol):
    """What the prediction reads of a checkpoint: a core ``Checkpoint`` or an index row alike."""

    @property
    def state(self) -> CheckpointState: ...

    @property
    def bytes(self) -> int: ...


class _RunLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def state(self) -> RunState: ...


_NONE: Sequence[_Sized] = ()


def predict_next_save(checkpoints: Sequence[_Sized]) -> int:
    """Bytes the run's next save will need, from its checkpoints in step order (see the module doc)."""
    newest_first: list[int] = []
    partial = 0
    for c in reversed(checkpoints):
        if c.state is _COMPLETE:
            newest_first.append(c.bytes)
            if len(newest_first) == WINDOW:
                break
        elif not newest_first and c.bytes > partial:
            partial = c.bytes
    if not newest_first:
        return max(0, partial)
    predicted = max(newest_first)
    newest, oldest = newest_first[0], newest_first[-1]
    if newest > oldest:
        steps = len(newest_first) - 1
        predicted += -(-(newest - oldest) // steps)  # ceil: round towards room
    return predicted


def next_saves(runs: Iterable[_RunLike], checkpoints_of: Callable[[str], Sequence[_Sized]]) -> dict[str, int]:
    """Active run -> predicted bytes of its next save (0: nothing known yet), by run name."""
    active = sorted(r.name for r in runs if r.state is _ACTIVE)
    return {name: predict_next_save(checkpoints_of(name)) for name in active}


def describe_need(needed: int, free: float, runs: int) -> str:
    """``next saves of 2 active runs need 38.0 GiB; 12.0 GiB free`` (what reasons and notes say)."""
    what = "next save of 1 active run needs" if runs == 1 else f"next saves of {runs} active runs need"
    return f"{what} {human_bytes(needed)}; {human_bytes(max(0.0, free))} free"


@dataclass(frozen=True, slots=True)
class Headroom:
    """The hot tier's free space against its active runs' next saves (``status``, metrics)."""

    tier: str
    free_bytes: int
    runs: Mapping[str, int]
    """Active run -> predicted bytes of its next save (0: nothing known yet)."""
    enabled: bool = True
    """The tier's ``headroom`` key: whether prune / the daemon make this room."""

    @property
    def needed_bytes(self) -> int:
        return sum(self.runs.values())

    @property
    def ok(self) -> bool:
        return self.free_bytes >= self.needed_bytes

    def describe(self) -> str:
        return describe_need(self.needed_bytes, self.free_bytes, sum(1 for b in self.runs.values() if b))

    @classmethod
    def of(
        cls,
        tier: str,
        free_bytes: int,
        runs: Iterable[_RunLike],
        checkpoints: Iterable[tuple[str, int, _Sized]],
        *,
        enabled: bool = True,
    ) -> Headroom:
        """From ``(run, step, checkpoint)`` triples in any order (e.g. index rows)."""
        by_run: dict[str, list[tuple[int, _Sized]]] = {}
        for run, step, c in checkpoints:
            by_run.setdefault(run, []).append((step, c))

        def of_run(name: str) -> Sequence[_Sized]:
            rows = by_run.get(name)
            if not rows:
                return _NONE
            rows.sort(key=lambda sc: sc[0])
            return [c for _, c in rows]

        return cls(tier, free_bytes, next_saves(runs, of_run), enabled)
