"""Prometheus metrics, computed from the index at scrape time.

Gauges (how many checkpoints and bytes each tier holds, how old its newest verified checkpoint is —
the recovery point —, whether its last listing worked, when each job last succeeded) are read from
the index when Prometheus scrapes, not maintained by hand: the index already is the state, so there
is no second copy to drift. Reclaimed bytes come from the index's cumulative ``reclaimed`` table, so
that counter survives daemon restarts. Only actions and errors are in-process counters, fed by
:meth:`Metrics.record_outcome` / :meth:`Metrics.record_error`.

Label values come from small fixed sets (tier names from the config, action kinds, job names, a
closed list of reclaim reasons): no run, step or path labels, which would grow without bound.

``prometheus_client`` is imported inside functions: only the daemon and ``prune`` with
``daemon.textfile`` set pay for it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkeeper import __version__
from ckptkeeper.config import parse_addr
from ckptkeeper.core.model import ActionKind, CheckpointState, RunState
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.config import Settings
    from ckptkeeper.index import Index

__all__ = [
    "ERROR_KINDS",
    "JOBS",
    "RECLAIM_REASONS",
    "IndexCollector",
    "Metrics",
    "MetricsServer",
    "write_prune_textfile",
]

log = get_logger("ckptkeeper.daemon.metrics")

JOBS = ("retention", "reap", "rescan", "prune")
"""Job names with a ``job_last_success`` series (``prune`` is the one-shot CLI)."""

ERROR_KINDS = ("action", "job", "reconcile", "tier")
"""``ckptkeeper_errors_total{kind}``: a failed plan action, a failed scheduled job, a failed watcher
reconcile, a tier listing that failed."""


def _reclaim_reasons() -> tuple[str, ...]:
    from ckptkeeper.core.reaper import ARTIFACT_KINDS, RULE_FAILED_RUN, RULE_PARTIAL, RULE_STALE_RUN

    return ("expired", "moved", RULE_FAILED_RUN, RULE_STALE_RUN, RULE_PARTIAL, "reap", *ARTIFACT_KINDS)


RECLAIM_REASONS = _reclaim_reasons()
"""Reasons the executor records bytes under; anything else is reported as ``other``."""


def _reason_label(reason: str) -> str:
    return reason if reason in RECLAIM_REASONS else "other"


class IndexCollector:
    """A ``prometheus_client`` collector that reads the index on each scrape.

    ``open_index`` yields an :class:`~ckptkeeper.index.Index`; the daemon passes one that opens a
    short-lived read-only connection, so a scrape never waits behind the writer's lock (WAL readers
    do not block writers) and never touches the daemon's own connection.
    """

    def __init__(
        self,
        open_index: Callable[[], AbstractContextManager[Index]],
        tiers: Sequence[tuple[str, Path | None]],
        *,
        counters: Callable[[], tuple[dict[str, int], dict[str, int]]] | None = None,
        extra: Callable[[], Iterable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._open_index = open_index
        self._tiers = list(tiers)
        self._counters = counters
        self._extra = extra
        self._clock = clock

    def set_tiers(self, tiers: Sequence[tuple[str, Path | None]]) -> None:
        """Config reload: the tier list may have changed."""
        self._tiers = list(tiers)

    def describe(self) -> list[Any]:
        # Unchecked registration: the series depend on the config and on what the index holds.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        build = InfoMetricFamily("ckptkeeper_build", "ckptkeeper version running")
        build.add_metric([], {"version": __version__})
        yield build

        if self._counters is not None:
            actions, errors = self._counters()
            fam = CounterMetricFamily(
                "ckptkeeper_actions", "Plan actions carried out by this daemon", labels=["kind"]
            )
            for kind, n in sorted(actions.items()):
                fam.add_metric([kind], n)
            yield fam
            fam = CounterMetricFamily(
                "ckptkeeper_errors", "Errors by kind (action, job, reconcile, tier)", labels=["kind"]
            )
            for kind, n in sorted(errors.items()):
                fam.add_metric([kind], n)
            yield fam

        up = GaugeMetricFamily("ckptkeeper_index_up", "1 if the index could be read for this scrape")
        try:
            with self._open_index() as ix:
                checkpoints = ix.checkpoints()
                runs = ix.runs()
                statuses = ix.tier_statuses()
                reclaimed = ix.reclaimed()
                jobs = ix.job_runs()
                journal = ix.journal_open()
        except Exception as exc:  # a scrape must answer even when the index is unreadable
            log.warning("metrics: cannot read the index", error=str(exc))
            up.add_metric([], 0)
            yield up
            yield from self._extra() if self._extra is not None else ()
            return
        up.add_metric([], 1)
        yield up
        now = self._clock()

        count = GaugeMetricFamily(
            "ckptkeeper_checkpoints", "Complete checkpoints with a verified copy in the tier", labels=["tier"]
        )
        size = GaugeMetricFamily(
            "ckptkeeper_bytes", "Bytes of the verified checkpoint copies in the tier", labels=["tier"]
        )
        age = GaugeMetricFamily(
            "ckptkeeper_newest_checkpoint_age_seconds",
            "Age of the newest verified checkpoint in the tier (recovery point)",
            labels=["tier"],
        )
        tier_up = GaugeMetricFamily(
            "ckptkeeper_tier_up", "1 if the tier's last listing succeeded", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "ckptkeeper_tier_used_ratio", "Filesystem usage of a local tier (0..1)", labels=["tier"]
        )
        for name, local_path in self._tiers:
            held = [
                c for c in checkpoints if c.state is CheckpointState.COMPLETE and name in c.verified_tiers
            ]
            count.add_metric([name], len(held))
            size.add_metric([name], sum(c.bytes for c in held))
            if held:
                age.add_metric([name], max(0.0, now - max(c.created_at for c in held)))
            status = statuses.get(name)
            tier_up.add_metric([name], 1 if status is not None and status.ok else 0)
            if local_path is not None:
                try:
                    du = shutil.disk_usage(local_path)
                except OSError:
                    pass
                else:
                    used.add_metric([name], du.used / du.total if du.total else 0.0)
        yield from (count, size, age, tier_up, used)

        states = GaugeMetricFamily(
            "ckptkeeper_checkpoints_by_state", "Cataloged checkpoints by state", labels=["state"]
        )
        for st in CheckpointState:
            states.add_metric([st.value], sum(1 for c in checkpoints if c.state is st))
        yield states
        run_states = GaugeMetricFamily("ckptkeeper_runs", "Runs by state", labels=["state"])
        for rs in RunState:
            run_states.add_metric([rs.value], sum(1 for r in runs if r.state is rs))
        yield run_states

        by_reason: dict[str, int] = {}
        for reason, (nbytes, _n) in reclaimed.items():
            label = _reason_label(reason)
            by_reason[label] = by_reason.get(label, 0) + nbytes
        fam = CounterMetricFamily(
            "ckptkeeper_reclaimed_bytes", "Bytes reclaimed since the index was created", labels=["reason"]
        )
        for reason, nbytes in sorted(by_reason.items()):
            fam.add_metric([reason], nbytes)
        yield fam

        last = GaugeMetricFamily(
            "ckptkeeper_job_last_success_timestamp_seconds",
            "When the job last finished without error",
            labels=["job"],
        )
        for job in sorted(jobs.values(), key=lambda j: j.job):
            if job.job in JOBS and job.last_success is not None:
                last.add_metric([job.job], job.last_success)
        yield last

        pending = GaugeMetricFamily(
            "ckptkeeper_journal_open_entries", "Interrupted executor steps waiting to be finished or undone"
        )
        pending.add_metric([], len(journal))
        yield pending
        yield from self._extra() if self._extra is not None else ()


class MetricsServer:
    """The ``/metrics`` HTTP endpoint; :meth:`stop` joins its thread (tests check for leaks)."""

    def __init__(self, httpd: Any, thread: threading.Thread, host: str, port: int) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port = port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class Metrics:
    """The daemon's registry: the index collector plus action / error counters."""

    def __init__(
        self,
        index_path: str | os.PathLike[str],
        tiers: Sequence[tuple[str, Path | None]],
        *,
        extra: Callable[[], Iterable[Any]] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry

        self.index_path = Path(index_path)
        self._lock = threading.Lock()
        self._actions = {k.value: 0 for k in ActionKind}
        self._errors = dict.fromkeys(ERROR_KINDS, 0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = IndexCollector(self._readonly_index, tiers, counters=self._counters, extra=extra)
        self.registry.register(self.collector)

    @classmethod
    def for_settings(cls, settings: Settings, *, extra: Callable[[], Iterable[Any]] | None = None) -> Metrics:
        return cls(settings.index, _tier_paths(settings), extra=extra)

    @contextmanager
    def _readonly_index(self) -> Iterator[Index]:
        from ckptkeeper.index import Index

        ix = Index(self.index_path, readonly=True)
        try:
            yield ix
        finally:
            ix.close()

    def _counters(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self._actions), dict(self._errors)

    def record_outcome(self, outcome: Any) -> None:
        """Count what a ``run_prune`` outcome did: actions carried out by kind, failed actions."""
        if getattr(outcome, "dry_run", False):
            return
        result = getattr(outcome, "result", None)
        done = list(getattr(result, "done", ()) or ())
        failed = len(getattr(outcome, "failed", ()) or ())
        with self._lock:
            for action in done:
                kind = getattr(getattr(action, "action", None), "value", None)
                if kind in self._actions:
                    self._actions[kind] += 1
            self._errors["action"] += failed

    def record_error(self, kind: str) -> None:
        with self._lock:
            key = kind if kind in self._errors else "job"
            self._errors[key] += 1

    def serve(self, addr: str) -> MetricsServer | None:
        """Serve ``/metrics`` on ``host:port`` (None when ``addr`` is empty); raises OSError on bind."""
        from prometheus_client import start_http_server

        parsed = parse_addr(addr)
        if parsed is None:
            return None
        host, port = parsed
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        thread.name = "ckptkeeper-metrics"
        return MetricsServer(httpd, thread, host, httpd.server_port)


def _tier_paths(settings: Settings) -> list[tuple[str, Path | None]]:
    return [(t.name, t.local_path if t.is_local else None) for t in settings.tiers]


def write_prune_textfile(
    settings: Settings, index: Index, outcome: Any, *, path: str | None = None
) -> Path | None:
    """Write metrics for node_exporter's textfile collector after a one-shot ``prune``.

    Writes to ``path`` or ``daemon.textfile`` (nothing if neither is set) atomically: a temp file
    in the same directory renamed over the target, so the collector never reads half a file. Besides
    the index-derived series, the last prune is described by ``ckptkeeper_prune_last_*`` gauges —
    one-shot processes have no memory, so ``_total`` counters would reset on every run.
    """
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import GaugeMetricFamily

    target = path or settings.daemon.textfile
    if not target:
        return None
    now = time.time()
    result = getattr(outcome, "result", None)
    done = list(getattr(result, "done", ()) or ())
    failed = len(getattr(outcome, "failed", ()) or ())

    def prune_gauges() -> Iterator[Any]:
        g = GaugeMetricFamily(
            "ckptkeeper_prune_last_run_timestamp_seconds", "When the last one-shot prune finished"
        )
        g.add_metric([], now)
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_exit_code", "Exit code of the last one-shot prune")
        g.add_metric([], int(getattr(outcome, "exit_code", 0)))
        yield g
        g = GaugeMetricFamily(
            "ckptkeeper_prune_last_actions", "Actions carried out by the last prune", labels=["kind"]
        )
        for kind in ActionKind:
            g.add_metric([kind.value], sum(1 for a in done if getattr(a, "action", None) is kind))
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_failed_actions", "Actions that failed in the last prune")
        g.add_metric([], failed)
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_reclaimed_bytes", "Bytes the last prune reclaimed")
        g.add_metric([], int(getattr(outcome, "reclaimed_bytes", 0) or 0))
        yield g

    registry = CollectorRegistry(auto_describe=False)
    registry.register(IndexCollector(lambda: nullcontext(index), _tier_paths(settings), extra=prune_gauges))
    target_path = Path(target)
    target_path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(target_path), registry)
    return target_path
