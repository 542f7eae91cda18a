"""The planner's inputs, run by run: checkpoints grouped per run and sorted by step, and what
protects some of them whatever the rules say (docs/design.md, "Retention": pinned, the newest complete checkpoint
of every run, the parent of an active run)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import compress, groupby, islice, pairwise
from operator import attrgetter, lt
from typing import NamedTuple

from ckptkeeper.core.model import Checkpoint, CheckpointState, RunState, Snapshot
from ckptkeeper.core.retention import RunHistory

__all__ = [
    "NEWEST",
    "PINNED",
    "Protections",
    "RunCheckpoints",
    "group_by_run",
    "protection",
    "protections",
]

PINNED = "pinned"
NEWEST = "newest complete checkpoint of run"

_COMPLETE = CheckpointState.COMPLETE
_by_step = attrgetter("step")
_run_of = attrgetter("run")
_state_of = attrgetter("state")
_pinned = attrgetter("pinned")

Protections = dict[str, dict[int, list[str]]]
"""run -> step -> why the checkpoint is protected."""


class RunCheckpoints(NamedTuple):
    """One run's checkpoints sorted by step, with what several passes need to know about all of
    them, read in one go while they are in the CPU cache (at 1M checkpoints each pass over the
    catalog costs a cache miss per checkpoint)."""

    checkpoints: list[Checkpoint]
    steps: list[int]
    incomplete: list[Checkpoint]
    """The ones not complete (writing, corrupt), in step order."""
    pinned: list[Checkpoint]

    @classmethod
    def of(cls, run: str, cps: list[Checkpoint]) -> RunCheckpoints:
        """From one run's checkpoints in any order; raises ValueError if a step appears twice."""
        steps = list(map(_by_step, cps))
        if not all(map(lt, steps, islice(steps, 1, None))):  # not sorted, or a duplicate
            cps.sort(key=_by_step)
            steps.sort()
            dup = next((s for s, t in pairwise(steps) if s == t), None)
            if dup is not None:
                raise ValueError(f"duplicate checkpoint {run}@{dup} in snapshot")
        complete = list(map(_state_of, cps)).count(_COMPLETE)
        incomplete = [c for c in cps if c.state is not _COMPLETE] if complete != len(cps) else []
        return cls(cps, steps, incomplete, list(compress(cps, map(_pinned, cps))))

    def without(self, steps: set[int] | None) -> RunCheckpoints:
        """The same run minus ``steps`` (reaped)."""
        if not steps:
            return self
        keep = [step not in steps for step in self.steps]
        return RunCheckpoints(
            list(compress(self.checkpoints, keep)),
            list(compress(self.steps, keep)),
            [c for c in self.incomplete if c.step not in steps],
            [c for c in self.pinned if c.step not in steps],
        )

    def newest_complete(self) -> Checkpoint | None:
        if not self.incomplete:
            return self.checkpoints[-1] if self.checkpoints else None
        return next((c for c in reversed(self.checkpoints) if c.state is _COMPLETE), None)

    def complete(self) -> RunHistory:
        if not self.incomplete:
            return RunHistory(self.checkpoints, self.steps)
        return RunHistory([c for c in self.checkpoints if c.state is _COMPLETE])


def group_by_run(checkpoints: Sequence[Checkpoint]) -> dict[str, RunCheckpoints]:
    """Checkpoints per run, runs by name and each run by step, so input order never matters.

    Taken a block of consecutive checkpoints of one run at a time, so input already in (run, step)
    order, as ``Index.snapshot()`` gives it, costs a few C-level passes per block and no sort.
    """
    grouped: dict[str, list[Checkpoint]] = {}
    for name, block in groupby(checkpoints, key=_run_of):
        cps = grouped.get(name)
        if cps is None:
            grouped[name] = list(block)
        else:
            cps.extend(block)
    return {name: RunCheckpoints.of(name, grouped[name]) for name in sorted(grouped)}


def protections(snapshot: Snapshot, by_run: Mapping[str, RunCheckpoints]) -> Protections:
    """Why checkpoints are protected: pinned, newest complete of the run, parent of an active run."""
    protect: Protections = defaultdict(dict)
    for r in sorted(snapshot.runs, key=attrgetter("name")):
        if r.state is RunState.ACTIVE and r.parent is not None:
            parent_run, parent_step = r.parent
            protect[parent_run].setdefault(parent_step, []).append(f"parent of active run {r.name}")
    for name, checkpoints in by_run.items():
        newest = checkpoints.newest_complete()
        if newest is not None:
            protect[name].setdefault(newest.step, []).insert(0, NEWEST)
        for c in checkpoints.pinned:
            protect[name].setdefault(c.step, []).insert(0, PINNED)
    return dict(protect)


def protection(protections: Protections, run: str | None, step: int | None) -> list[str] | None:
    """Why ``run@step`` is protected, or None."""
    if run is None or step is None:
        return None
    return protections.get(run, {}).get(step)
