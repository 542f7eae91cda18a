"""``scrub``: re-hash a slice of the slower tiers' copies against their manifests.

One pass, the same for ``ckptkeeper scrub`` and the daemon's ``scrub`` job: pick the copies
verified longest ago within a byte budget (:func:`ckptkeeper.core.scrub.select_for_scrub`), read
each whole under a token bucket (``daemon.scrub_rate``), and record the outcome in the index.

A copy whose bytes do not match its manifest, or whose files are missing, is marked damaged — the
one mechanism every damaged copy goes through (``ls`` shows it, ``status`` counts it, restore and
``latest()`` skip it, no delete leans on it, and the next prune copies it again from a good copy).
Nothing is deleted here. A bad copy that is the checkpoint's only one stays where it is and is
reported on every pass (exit 1, a ``status`` warning) until someone fixes or removes it; a bad
copy another node wrote is reported, and left to that node (docs/design.md, "Many nodes").

Runs beside prunes without the executor lock: an outcome is recorded only if the location is
still the one that was read (see :mod:`ckptkeeper.index.scrub`), so a copy the executor rewrote or
removed meanwhile keeps what the executor recorded. A tier that cannot be read is unknown, never
bad: its copies are reported as not checked and stay as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptkeeper.config import Settings
from ckptkeeper.core.scrub import ScrubCandidate, ScrubSelection, pass_budget, select_for_scrub
from ckptkeeper.index import CheckpointRow, Index
from ckptkeeper.storage import StorageError, TierStorage
from ckptkeeper.util.logs import get_logger
from ckptkeeper.util.throttle import Stopped, TokenBucket

log = get_logger("ckptkeeper.actions.scrub")


class ScrubUsage(ValueError):
    """A ``--tier`` that is not a slower tier of the config (usage error, exit 2)."""


@dataclass(frozen=True, slots=True)
class BadCopy:
    run: str
    step: int
    name: str
    tier: str
    problem: str
    owner: str | None
    """The node that wrote it when it is not this node (None: ours)."""
    next: str
    """What happens to it: copied again from a good copy, left to its owner, or kept (no good copy)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "name": self.name,
            "tier": self.tier,
            "problem": self.problem,
            "owner": self.owner,
            "next": self.next,
        }


@dataclass
class ScrubReport:
    budget: int
    tiers: tuple[str, ...]
    checked: list[dict[str, Any]] = field(default_factory=list)
    """One entry per copy re-hashed: run, step, tier, bytes, ok, reason (why it was next)."""
    bytes: int = 0
    """Bytes actually read."""
    bad: list[BadCopy] = field(default_factory=list)
    """Copies this pass found bad (marked damaged)."""
    repaired: int = 0
    """Copies marked damaged before that this pass found whole again (recorded as copies)."""
    errors: list[str] = field(default_factory=list)
    """Copies that could not be checked (tier unreadable): unknown, not bad."""
    deferred: int = 0
    deferred_bytes: int = 0
    no_good_copy: list[dict[str, Any]] = field(default_factory=list)
    """Checkpoints (any pass) whose every copy is damaged: kept, never deleted; need a human."""
    stopped: bool = False
    slept_seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if (self.bad or self.no_good_copy or self.errors) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tiers": list(self.tiers),
            "budget_bytes": self.budget,
            "scrubbed_bytes": self.bytes,
            "checked": self.checked,
            "bad": [b.to_dict() for b in self.bad],
            "repaired": self.repaired,
            "errors": self.errors,
            "deferred": {"copies": self.deferred, "bytes": self.deferred_bytes},
            "no_good_copy": self.no_good_copy,
            "stopped": self.stopped,
            "throttled_seconds": round(self.slept_seconds, 3),
            "exit_code": self.exit_code,
        }


def scrub_tiers(settings: Settings, tier: str | None = None) -> tuple[str, ...]:
    """The tiers a pass covers: every slower tier, or the one named (raises :class:`ScrubUsage`)."""
    slower = tuple(t.name for t in settings.tiers[1:])
    if tier is None:
        return slower
    if tier == settings.hot.name:
        raise ScrubUsage(f"--tier {tier}: the hot tier is hashed when it is cataloged, not scrubbed")
    if tier not in slower:
        raise ScrubUsage(f"--tier {tier}: no such tier (slower tiers: {', '.join(slower) or 'none'})")
    return (tier,)


def run_scrub(
    settings: Settings,
    index: Index,
    *,
    tier: str | None = None,
    budget: int | None = None,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] | None = None,
    storages: Mapping[str, TierStorage] | None = None,
) -> ScrubReport:
    """One scrub pass. ``budget`` defaults to what a scheduled pass reads
    (:func:`~ckptkeeper.core.scrub.pass_budget`); the rate is ``daemon.scrub_rate``. ``sleep``
    defaults to ``stop.wait`` (a SIGTERM ends the pass between chunks) or ``time.sleep``."""
    tiers = scrub_tiers(settings, tier)
    d = settings.daemon
    if budget is None:
        budget = pass_budget(d.scrub_rate, d.scrub_interval)
    selection = select_for_scrub(
        index.scrub_locations(tiers), budget, time.time(), [t.name for t in settings.tiers]
    )
    report = ScrubReport(
        budget=budget, tiers=tiers, deferred=selection.deferred, deferred_bytes=selection.deferred_bytes
    )
    if sleep is None:
        sleep = stop.wait if stop is not None else time.sleep
    bucket = TokenBucket(d.scrub_rate, clock=clock, sleep=sleep, stop=stop)
    specs = {t.name: t for t in settings.tiers}
    opened: dict[str, TierStorage] = dict(storages or {})
    totals: dict[str, list[int]] = {}
    try:
        _scrub_selection(settings, index, selection, report, bucket, specs, opened, totals)
    finally:
        report.slept_seconds = bucket.slept
        with index.transaction():
            for name, (nbytes, copies, bad) in totals.items():
                index.add_scrub_totals(name, nbytes, copies, bad)
    report.no_good_copy = no_good_copy(index)
    for b in report.bad:
        log.error("scrub: bad copy", run=b.run, step=b.step, tier=b.tier, problem=b.problem, next=b.next)
    log.info(
        "scrub pass done",
        tiers=list(tiers),
        copies=len(report.checked),
        bytes=report.bytes,
        bad=len(report.bad),
        errors=len(report.errors),
        deferred=report.deferred,
        no_good_copy=len(report.no_good_copy),
    )
    return report


def _scrub_selection(
    settings: Settings,
    index: Index,
    selection: ScrubSelection,
    report: ScrubReport,
    bucket: TokenBucket,
    specs: Mapping[str, Any],
    opened: dict[str, TierStorage],
    totals: dict[str, list[int]],
) -> None:
    for i, pick in enumerate(selection.picks):
        c = pick.candidate
        row = index.checkpoint(c.run, c.name)
        manifest = row.manifest() if row is not None else None
        if row is None or manifest is None or row.version is None:
            continue  # gone since the selection (expired, rewritten): nothing to check
        storage = opened.get(c.tier)
        if storage is None:
            storage = opened[c.tier] = TierStorage(specs[c.tier].to_spec())
        read = 0

        def on_bytes(n: int) -> None:
            nonlocal read
            read += n
            bucket.consume(n)

        try:
            problems = storage.verify(manifest, deep=True, on_bytes=on_bytes)
        except Stopped:
            report.bytes += read
            report.stopped = True
            report.deferred += len(selection.picks) - i
            return
        except StorageError as exc:
            report.bytes += read
            report.errors.append(f"{c.tier}:{c.run}/{c.name}: not checked: {exc}")
            log.warning("scrub: copy could not be checked (unknown, not bad)", tier=c.tier, error=str(exc))
            continue
        report.bytes += read
        t = totals.setdefault(c.tier, [0, 0, 0])
        t[0] += read
        t[1] += 1
        report.checked.append(
            {
                "run": c.run,
                "step": c.step,
                "tier": c.tier,
                "bytes": read,
                "ok": not problems,
                "reason": pick.reason,
            }
        )
        if not problems:
            if index.record_scrubbed(c, row.version) and c.damaged:
                report.repaired += 1
                log.warning(
                    "scrub: copy marked damaged is whole again", tier=c.tier, path=f"{c.run}/{c.name}"
                )
            continue
        problem = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        if index.record_scrub_bad(c, problem):
            t[2] += 1
            report.bad.append(_bad_copy(settings, c, row, problem))


def _bad_copy(settings: Settings, c: ScrubCandidate, row: CheckpointRow, problem: str) -> BadCopy:
    owner = c.node if c.node and c.node != settings.node else None
    good = [t.name for t in settings.tiers if t.name in row.verified_tiers and t.name != c.tier]
    if owner is not None:
        nxt = f"owned by node {owner}: reported, not replaced or deleted by this node"
    elif good:
        nxt = f"copied again from {good[0]} by the next prune"
    else:
        nxt = (
            "no good copy left: kept (never deleted); restore it from elsewhere. It is this node's last "
            "copy of that checkpoint: removing it loses whatever of it is still readable"
        )
    return BadCopy(c.run, c.step, c.name, c.tier, problem, owner, nxt)


def no_good_copy(index: Index) -> list[dict[str, Any]]:
    """Complete checkpoints whose copies are all marked damaged (the planner cannot see them, so
    nothing deletes them; nothing can repair them either): reported until a human acts."""
    return [
        {"run": run, "step": step, "name": name, "damaged": damaged}
        for run, step, name, damaged in index.without_good_copy()
    ]
