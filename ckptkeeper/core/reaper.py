"""The reaper (docs/design.md, "Reaper"): what failed, stale and interrupted work leaves behind.

Two pure functions and a reporting helper; no I/O and no clock (``now`` is an argument), so every
decision is reproducible from a :class:`~ckptkeeper.core.model.Snapshot` and testable with plain values:

- :func:`derive_run_state` turns facts the catalog gathered (hook file, pid, heartbeat, mtimes)
  into a :class:`~ckptkeeper.core.model.RunState` plus a human reason.
- :func:`run_state_changes_at` says when the clock alone can next change that verdict, so the
  daemon re-derives a run's state when its time comes instead of on every pass.
- :func:`plan_reaps` decides which checkpoints and temp artifacts are waste and returns REAP
  actions, the keys it reaped (the retention planner leaves those alone) and why it spared others.
- :func:`summarize_reclaim` totals reclaimed bytes per rule and per run — the headline users want.

Safety first (docs/design.md, "Retention", §8): pinned checkpoints, the newest complete checkpoint of every run and
the parent of an active run are never reaped; nothing that was written to within
``partial_after`` is reaped (invariant 3: a checkpoint being written is never reaped); no action
ever targets a tier whose listing failed, a tier that is not configured, or a path that could
escape the tier root.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ckptkeeper.core.model import (
    Action,
    ActionKind,
    Artifact,
    Checkpoint,
    CheckpointState,
    ReaperPolicy,
    Run,
    RunState,
    Snapshot,
    TierSpec,
)
from ckptkeeper.util.fmt import human_age

__all__ = [
    "ARTIFACT_KINDS",
    "NO_RUN",
    "RULE_FAILED_RUN",
    "RULE_PARTIAL",
    "RULE_STALE_RUN",
    "ReapDecision",
    "ReclaimSummary",
    "RunFacts",
    "derive_run_state",
    "plan_reaps",
    "run_state_changes_at",
    "summarize_reclaim",
]

RULE_FAILED_RUN = "failed-run"
RULE_STALE_RUN = "stale-run"
RULE_PARTIAL = "partial"
"""Rule ids of checkpoint reaps; artifact reaps use the artifact kind as their rule id."""

MULTIPART_UPLOAD = "multipart-upload"

ARTIFACT_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "orbax-tmp": "interrupted Orbax save",
        "safetensors-tmp": "interrupted safetensors atomic write",
        "tmp-checkpoint": "abandoned tmp-checkpoint staging dir",
        "metadata-tmp": "DCP .metadata.tmp never renamed",
        "nemo-unfinished": "NeMo -unfinished leftover",
        "tmp-file": "temporary file",
        "ckptkeeper-staging": "interrupted ckptkeeper copy",
        MULTIPART_UPLOAD: "abandoned multipart upload",
    }
)
"""Artifact kinds the reaper knows, with the phrase used in reasons.

Only these are reaped: an unknown kind means the catalog found something we have no rule for, and
a deletion tool must not guess. The catalog should use these ids for :attr:`Artifact.kind`.
"""

DETACHED_KINDS: frozenset[str] = frozenset(
    {"orbax-tmp", "safetensors-tmp", "tmp-checkpoint", "tmp-file", "ckptkeeper-staging"}
)
"""Artifact kinds the catalog keeps out of a framework checkpoint's files (and so its manifest): one
of these inside a kept checkpoint is reaped on its own without touching what the manifest lists.
Not inside a checkpoint the hook committed: there every regular file is in the manifest."""

NO_RUN = "(no run)"
"""Key of :attr:`ReclaimSummary.by_run` for artifacts that belong to no run."""

_HOOK_FINISHED = "finished"
_HOOK_FAILED = "failed"
_HOOK_ACTIVE = "active"


def _older_than(t: float, threshold: float, now: float) -> bool:
    """Strictly older: at exactly the threshold we still wait one more cycle (deletion is final)."""
    return now - t > threshold


# --------------------------------------------------------------------------------------------
# Run state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the catalog observed about one run; gathering these is I/O, judging them is not."""

    hook_state: str | None
    """``active`` | ``finished`` | ``failed`` from ``<run>/.ckptkeeper/run.json``; None without it."""
    host: str | None
    """Host that wrote run.json."""
    pid: int | None
    pid_alive: bool | None
    """None when the pid is on another host or unknown (the catalog checks only local pids)."""
    heartbeat: float | None
    """mtime of ``<run>/.ckptkeeper/heartbeat``."""
    newest_write: float
    """Newest mtime anywhere under the run dir, ``.ckptkeeper/`` excluded."""


def derive_run_state(
    facts: RunFacts, *, this_host: str, now: float, failed_after: float
) -> tuple[RunState, str]:
    """Decide a run's state and say why.

    The hook's ``finished``/``failed`` is authoritative: the training process said so itself.
    Otherwise (hook says ``active``, says something unknown, or there is no hook) the run is
    ``stale`` only when *every* sign of life is absent — no live pid on this host, no heartbeat
    within ``failed_after``, no write under the run within ``failed_after`` — and ``active`` as
    soon as one is present. Any doubt resolves to ``active`` because a stale verdict lets the
    reaper delete the run's checkpoints.

    A pid is only checkable on the host that wrote it: for another host's pid ``pid_alive`` is
    ignored (a local process with the same number proves nothing) and the heartbeat and writes
    decide. Pid reuse after a crash is the catalog's concern; here a live pid means alive.
    """
    if facts.hook_state == _HOOK_FINISHED:
        return RunState.FINISHED, "hook marked run finished"
    if facts.hook_state == _HOOK_FAILED:
        return RunState.FAILED, "hook marked run failed"

    if facts.hook_state is None:
        prefix = "no hook"
    elif facts.hook_state == _HOOK_ACTIVE:
        prefix = "hook says active"
    else:
        prefix = f"hook state {facts.hook_state!r} not understood"

    local = facts.host is None or facts.host == this_host
    where = "this host" if local else facts.host
    if facts.pid is not None and local and facts.pid_alive:
        return RunState.ACTIVE, f"{prefix}; writer pid {facts.pid} alive on {where}"
    if facts.heartbeat is not None and not _older_than(facts.heartbeat, failed_after, now):
        return RunState.ACTIVE, f"{prefix}; heartbeat {human_age(now - facts.heartbeat)} ago"
    if not _older_than(facts.newest_write, failed_after, now):
        return RunState.ACTIVE, f"{prefix}; last write {human_age(now - facts.newest_write)} ago"

    gone: list[str] = [prefix]
    if facts.pid is not None:
        if not local:
            gone.append(f"pid {facts.pid} on {facts.host} (not checkable here)")
        elif facts.pid_alive is False:
            gone.append(f"pid {facts.pid} not running on {where}")
        else:
            gone.append(f"pid {facts.pid} liveness unknown")
    if facts.heartbeat is None:
        gone.append("no heartbeat")
    else:
        gone.append(f"no heartbeat for {human_age(now - facts.heartbeat)}")
    gone.append(f"no write for {human_age(now - facts.newest_write)}")
    return RunState.STALE, "; ".join(gone)


def run_state_changes_at(facts: RunFacts, *, now: float, failed_after: float) -> float | None:
    """The earliest time at which :func:`derive_run_state` can give another verdict on these same
    facts, the clock being the only thing that moves; ``None``: never (only new facts change it).

    Why: a run without the hook is ``active`` until ``newest_write + failed_after`` and ``stale``
    after, so re-reading its directory on every pass to find that out is wasted work — writes under
    the run raise events of their own. Anything the catalog can only learn by looking again is
    returned as ``now`` (re-derive on every pass): a pid's liveness, a heartbeat (written without
    events), any hook state other than finished/failed. The hook's ``finished``/``failed`` never
    changes with the clock. At exactly ``newest_write + failed_after`` the run is still active
    (:func:`_older_than` is strict), so a caller re-derives when ``now >= `` the returned time and
    asks again.
    """
    if facts.hook_state in (_HOOK_FINISHED, _HOOK_FAILED):
        return None
    if facts.hook_state is not None or facts.pid is not None or facts.heartbeat is not None:
        return now
    if _older_than(facts.newest_write, failed_after, now):
        return None  # stale until someone writes under the run
    return facts.newest_write + failed_after


# --------------------------------------------------------------------------------------------
# Reap planning
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReapDecision:
    """Outcome of :func:`plan_reaps`.

    ``reaped`` holds every checkpoint the reaper judged waste, including those whose actions wait
    for an unknown tier: the retention planner must plan nothing for them (no copy of waste, no
    delete racing the reap). ``keep_reasons`` explains checkpoints a reaper rule looked at and
    spared — every checkpoint of a failed/stale run and every non-complete checkpoint that was not
    reaped; complete checkpoints of live runs are retention's business and have no entry.
    """

    actions: tuple[Action, ...]
    reaped: frozenset[tuple[str, int]]
    keep_reasons: Mapping[tuple[str, int], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class _Reap:
    rule: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Spare:
    reasons: tuple[str, ...]


def _is_safe_relpath(path: str) -> bool:
    """Only plain relative paths: a reap must never address anything outside its tier root (§8.4)."""
    if not path or path.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in path.rstrip("/").split("/"))


def _ancestors(path: str) -> list[str]:
    """``a/b/c`` → ``["a", "a/b", "a/b/c"]``: the path and every directory holding it."""
    parts = path.rstrip("/").split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _steps_text(steps: Sequence[int]) -> str:
    label = "step" if len(steps) == 1 else "steps"
    return f"{label} {', '.join(str(s) for s in steps)}"


class _Judge:
    """Per-snapshot facts every checkpoint verdict needs, computed once (O(n log n) overall)."""

    def __init__(self, snapshot: Snapshot, policy: ReaperPolicy, now: float) -> None:
        self.policy = policy
        self.now = now
        """The hot tier's clock: checkpoints' and runs' write times are its files' mtimes."""
        self.keep_n = max(0, policy.keep_last_of_failed)
        self.runs: dict[str, Run] = {r.name: r for r in snapshot.runs}

        complete_steps: dict[str, list[int]] = defaultdict(list)
        for c in snapshot.checkpoints:
            if c.state is CheckpointState.COMPLETE:
                complete_steps[c.run].append(c.step)
        self.complete_desc: dict[str, list[int]] = {
            run: sorted(set(steps), reverse=True) for run, steps in complete_steps.items()
        }
        self.complete_rank: dict[tuple[str, int], int] = {
            (run, step): rank for run, steps in self.complete_desc.items() for rank, step in enumerate(steps)
        }

        self.active_children: dict[tuple[str, int], list[str]] = defaultdict(list)
        for r in snapshot.runs:
            if r.state is RunState.ACTIVE and r.parent is not None:
                self.active_children[r.parent].append(r.name)

    def run_state(self, run: str) -> RunState:
        """A checkpoint whose run the index does not know is treated as active: only the
        age-based rules, which hold for every run, may touch it."""
        known = self.runs.get(run)
        return known.state if known is not None else RunState.ACTIVE

    def dead_label(self, run: str) -> str:
        known = self.runs[run]
        if known.state is RunState.FAILED:
            return "failed run"
        return f"stale run (no sign of life for {human_age(self.now - known.last_seen)})"

    def verdict(self, c: Checkpoint) -> _Reap | _Spare | None:
        """Reap, spare (with reasons) or not the reaper's business (None)."""
        state = self.run_state(c.run)
        dead = state in (RunState.FAILED, RunState.STALE)
        run_word = {RunState.FAILED: "failed run", RunState.STALE: "stale run"}.get(state, "run")
        complete = self.complete_desc.get(c.run, [])

        reasons: list[str] = []
        if c.pinned:
            reasons.append("pinned")
        if c.state is CheckpointState.COMPLETE and complete and complete[0] == c.step:
            reasons.append(f"newest complete of {run_word}")
        reasons.extend(
            f"parent of active run {child}" for child in sorted(self.active_children.get(c.key, ()))
        )

        if c.state is CheckpointState.COMPLETE:
            if not dead:
                return None
            rank = self.complete_rank[c.key]
            if 0 < rank < self.keep_n:
                reasons.append(f"within newest {self.keep_n} complete of {run_word}")
            if reasons:
                return _Spare(tuple(reasons))
            # The newest complete is kept even with keep_last_of_failed=0 (protection), so say so.
            kept = complete[: max(self.keep_n, 1)]
            rule = RULE_FAILED_RUN if state is RunState.FAILED else RULE_STALE_RUN
            reason = f"{self.dead_label(c.run)}: keeping newest {len(kept)} complete ({_steps_text(kept)})"
            return _Reap(rule, reason)

        # Not complete: writing or corrupt.
        if c.state is CheckpointState.WRITING and c.committed:
            # The hook committed it and the catalog has not verified it yet: it may become the
            # newest complete checkpoint, possibly the only one a failed run leaves.
            reasons.append("committed by hook, awaiting verification")
        elif c.state is CheckpointState.CORRUPT and c.committed:
            # The training loop said it was complete and a layout check disagrees. Either may be
            # wrong (a truncated write, or a recognizer that misreads a new framework version);
            # deleting on our word alone could destroy the run's only good state.
            reasons.append("committed by hook but judged corrupt: left for a human (ckptkeeper ls, verify)")
        if c.part is not None and c.part.marker_elsewhere and c.state is CheckpointState.WRITING:
            # One node's share of a checkpoint spanning nodes lacks the marker rank 0 writes on
            # another node: "partial" here, yet the other nodes' parts are useless without it.
            reasons.append(c.part.note)
        last = max(c.last_write, c.created_at)
        if not _older_than(last, self.policy.partial_after, self.now):
            # Also for failed runs: a fresh partial may be an async save still finishing or a
            # checkpoint the catalog has not settled yet (invariant 3 outranks speed).
            reasons.append(
                f"{c.state.value}: last write {human_age(self.now - last)} ago, "
                f"within partial_after {human_age(self.policy.partial_after)}"
            )
        if reasons:
            return _Spare(tuple(reasons))

        quiet = human_age(self.now - last)
        if dead:
            rule = RULE_FAILED_RUN if state is RunState.FAILED else RULE_STALE_RUN
            what = "partial" if c.state is CheckpointState.WRITING else "corrupt"
            return _Reap(rule, f"{self.dead_label(c.run)}: {what} checkpoint, no write for {quiet}")
        if c.state is CheckpointState.WRITING:
            return _Reap(RULE_PARTIAL, f"partial: no completion marker, no write for {quiet}")
        return _Reap(RULE_PARTIAL, f"corrupt: unusable checkpoint, no write for {quiet}")


def _reap_tiers(c: Checkpoint, hot: str | None) -> set[str]:
    """Where a reaped checkpoint's bytes live.

    Complete: every tier with a verified copy. Writing: the hot tier only — training writes there,
    and a verified copy elsewhere belongs to an earlier version we must not destroy. Corrupt: the
    tiers recorded for it, else hot (a corrupt checkpoint usually has no verified copy at all).
    """
    if c.state is CheckpointState.COMPLETE:
        return set(c.tiers)
    hot_only = {hot} if hot is not None else set()
    if c.state is CheckpointState.WRITING:
        return hot_only
    return set(c.tiers) or hot_only


def plan_reaps(
    snapshot: Snapshot,
    tiers: Sequence[TierSpec],
    policy: ReaperPolicy,
    now: float,
    file_now: Mapping[str, float] | None = None,
) -> ReapDecision:
    """Plan the reaping of waste (docs/design.md, "Reaper") as REAP actions; pure and deterministic.

    Checkpoints:

    - failed and stale runs keep their newest ``keep_last_of_failed`` complete checkpoints; their
      other complete checkpoints are reaped in every tier holding a verified copy (rule
      ``failed-run``/``stale-run``), and so are their partial/corrupt ones once quiet;
    - in any run, a partial (writing, not committed by the hook) or corrupt checkpoint with no
      write for ``partial_after`` is reaped from the hot tier (rule ``partial``).

    Never reaped: pinned checkpoints, the newest complete checkpoint of any run (even with
    ``keep_last_of_failed = 0``), the parent of an active run, a node's part of a checkpoint
    spanning nodes that lacks only the marker another node holds (``Checkpoint.part``,
    ``marker_elsewhere``), anything written to within
    ``partial_after`` — the last is stricter than "for an active run" on purpose: a failed run's
    fresh partial may still be an async save finishing or a checkpoint not yet settled.

    Artifacts of a known kind (:data:`ARTIFACT_KINDS`) are reaped once older than
    ``partial_after``; multipart uploads carry their ``upload_id`` (skipped without one: nothing
    to abort). An artifact at or inside a checkpoint that is not reaped is left alone (deleting a
    file inside a kept checkpoint would break its manifest) unless its kind is one the catalog keeps
    out of manifests (:data:`DETACHED_KINDS`: a framework temp left inside a checkpoint dir) and the
    checkpoint is not one the hook committed (there every regular file is in the manifest; only our
    own staging names are reaped), and one inside a checkpoint reaped in
    the same tier is already covered; multipart uploads are exempt from both, since aborting one
    never touches a committed object.

    No action targets a tier in ``snapshot.unknown_tiers`` or a tier not in ``tiers``.
    Actions are sorted by (run, step, tier, path).

    ``file_now``: the time now by the clock of each tier's filesystem, since a file's age is
    judged by the clock that stamped it (docs/many-nodes-clocks.md, "File ages"): checkpoints' by
    the hot tier's, an artifact's by its tier's. A tier missing there is judged by ``now``.
    """
    order = {t.name: i for i, t in enumerate(tiers)}
    hot = tiers[0].name if tiers else None
    actionable = {name for name in order if name not in snapshot.unknown_tiers}
    clocks = file_now or {}
    judge = _Judge(snapshot, policy, clocks.get(hot, now) if hot is not None else now)

    actions: list[Action] = []
    reaped: set[tuple[str, int]] = set()
    keep_reasons: dict[tuple[str, int], tuple[str, ...]] = {}
    spared_paths: set[str] = set()
    committed_paths: set[str] = set()
    covered: set[tuple[str, str]] = set()

    for c in sorted(snapshot.checkpoints, key=lambda c: c.key):
        verdict = judge.verdict(c)
        if isinstance(verdict, _Reap) and not _is_safe_relpath(c.rel_path):
            verdict = _Spare((f"path {c.rel_path!r} is not a plain relative path: never reaped",))
        if isinstance(verdict, _Reap):
            reaped.add(c.key)
            for tier in sorted(_reap_tiers(c, hot) & actionable, key=order.__getitem__):
                covered.add((tier, c.rel_path.rstrip("/")))
                actions.append(
                    Action(
                        action=ActionKind.REAP,
                        reason=verdict.reason,
                        run=c.run,
                        step=c.step,
                        tier=tier,
                        path=c.rel_path,
                        bytes=c.bytes,
                        rule=verdict.rule,
                    )
                )
            continue
        spared_paths.add(c.rel_path.rstrip("/"))
        if c.committed:
            committed_paths.add(c.rel_path.rstrip("/"))
        if isinstance(verdict, _Spare):
            keep_reasons[c.key] = verdict.reasons

    for a in _distinct_artifacts(snapshot.artifacts):
        action = _artifact_action(
            a, actionable, (spared_paths, committed_paths), covered, policy, clocks.get(a.tier, now)
        )
        if action is not None:
            actions.append(action)

    actions.sort(key=lambda a: (a.run or "", -1 if a.step is None else a.step, a.tier or "", a.path or ""))
    return ReapDecision(
        actions=tuple(actions),
        reaped=frozenset(reaped),
        keep_reasons=dict(sorted(keep_reasons.items())),
    )


def _artifact_identity(a: Artifact) -> tuple[str, str, str | None]:
    """One object on disk per (tier, path); one upload per (tier, key, upload id)."""
    return (a.tier, a.path, a.upload_id if a.kind == MULTIPART_UPLOAD else None)


def _distinct_artifacts(artifacts: Iterable[Artifact]) -> list[Artifact]:
    """One record per identity, the most recently written one.

    Two records of one path (say, listed before and after a write) must not let the older record
    reap what the newer one shows is still being written; sorting makes the pick independent of
    the catalog's listing order.
    """
    freshest: dict[tuple[str, str, str | None], Artifact] = {}
    for a in sorted(
        artifacts,
        key=lambda a: (-a.last_write, a.tier, a.path, a.upload_id or "", a.kind, a.run or "", a.bytes),
    ):
        freshest.setdefault(_artifact_identity(a), a)
    return list(freshest.values())


def _artifact_action(
    a: Artifact,
    actionable: set[str],
    spared: tuple[set[str], set[str]],
    covered: set[tuple[str, str]],
    policy: ReaperPolicy,
    now: float,
) -> Action | None:
    """The REAP action for one artifact, or None when it must (or need) not be reaped.

    ``spared``: the paths of the checkpoints kept, and of those among them the hook committed.
    """
    spared_paths, committed_paths = spared
    description = ARTIFACT_KINDS.get(a.kind)
    if description is None or a.tier not in actionable or not _is_safe_relpath(a.path):
        return None
    if not _older_than(a.last_write, policy.partial_after, now):
        return None
    quiet = human_age(now - a.last_write)
    if a.kind == MULTIPART_UPLOAD:
        if not a.upload_id:
            return None
        reason = f"{a.kind}: {description} {a.upload_id}, no part for {quiet}"
    else:
        ancestors = _ancestors(a.path)
        if any(p in spared_paths for p in ancestors) and (
            a.kind not in DETACHED_KINDS or ancestors[-1] in spared_paths
        ):
            return None
        if a.kind != "ckptkeeper-staging" and any(p in committed_paths for p in ancestors):
            return None  # in a checkpoint the hook committed, a temp-like name is one of its files
        if any((a.tier, p) in covered for p in ancestors):
            return None
        reason = f"{a.kind}: {description}, no write for {quiet}"
    return Action(
        action=ActionKind.REAP,
        reason=reason,
        run=a.run,
        tier=a.tier,
        path=a.path,
        bytes=a.bytes,
        rule=a.kind,
        upload_id=a.upload_id if a.kind == MULTIPART_UPLOAD else None,
    )


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReclaimSummary:
    """Bytes won back by reaping, per rule id and per run (docs/design.md, "Reaper": the headline number)."""

    by_reason: dict[str, int]
    """Rule id → bytes, largest first."""
    by_run: dict[str, int]
    """Run → bytes, largest first; artifacts without a run under :data:`NO_RUN`."""
    total: int
    count: int = 0
    """Number of reap actions summed."""


def _largest_first(totals: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize_reclaim(actions: Iterable[Action]) -> ReclaimSummary:
    """Sum the bytes of REAP actions; copies and retention deletes are ignored.

    Retention deletes are left out on purpose: a demotion frees the hot tier but not storage
    overall, and the reaper's report is about waste removed, not about tiering.
    """
    by_reason: dict[str, int] = defaultdict(int)
    by_run: dict[str, int] = defaultdict(int)
    total = count = 0
    for a in actions:
        if a.action is not ActionKind.REAP:
            continue
        by_reason[a.rule or "reap"] += a.bytes
        by_run[a.run if a.run is not None else NO_RUN] += a.bytes
        total += a.bytes
        count += 1
    return ReclaimSummary(
        by_reason=_largest_first(by_reason), by_run=_largest_first(by_run), total=total, count=count
    )
