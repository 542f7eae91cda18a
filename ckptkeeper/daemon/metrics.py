"""Prometheus metrics, computed from the index at scrape time.

Gauges (how many checkpoints and bytes each tier holds, how old its newest verified checkpoint is —
the recovery point —, whether its last listing worked, when each job last succeeded) are read from
the index when Prometheus scrapes, not maintained by hand: the index already is the state, so there
is no second copy to drift. Reclaimed bytes come from the index's cumulative ``reclaimed`` table, so
that counter survives daemon restarts. Only actions and errors are in-process counters, fed by
:meth:`Metrics.record_outcome` / :meth:`Metrics.record_error`.

Label values come from small fixed sets (tier names from the config, action kinds, job names, a
closed list of reclaim reasons): no step or path labels, which would grow without bound; run labels
only where the runs are bounded by what one node holds (per-run cost, the active runs' next saves).

The daemon's endpoint also answers ``/healthz`` (alive: a liveness probe) and ``/readyz`` (the first
catalog sync is done: a readiness probe) with ``200 ok`` or ``503`` and the reason, for Kubernetes.

``prometheus_client`` is imported inside functions: only the daemon and ``prune`` with
``daemon.textfile`` set pay for it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkeeper import __version__
from ckptkeeper.actions.status import StatusSummary, summarize
from ckptkeeper.config import Settings, parse_addr
from ckptkeeper.core.model import ActionKind, CheckpointState, RunState
from ckptkeeper.index import Index
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.actions.prune import PruneOutcome

__all__ = [
    "ERROR_KINDS",
    "JOBS",
    "RECLAIM_REASONS",
    "IndexCollector",
    "Metrics",
    "MetricsServer",
    "Probe",
    "write_prune_textfile",
]

log = get_logger("ckptkeeper.daemon.metrics")

JOBS = ("retention", "reap", "rescan", "scrub", "prune")
"""Job names with a ``job_last_success`` series (``prune`` is the one-shot CLI)."""

ERROR_KINDS = ("action", "job", "reconcile", "tier")
"""``ckptkeeper_errors_total{kind}``: a failed plan action, a failed scheduled job, a failed watcher
reconcile, a tier listing that failed."""


def _reclaim_reasons() -> tuple[str, ...]:
    from ckptkeeper.core import trash
    from ckptkeeper.core.reaper import ARTIFACT_KINDS, RULE_FAILED_RUN, RULE_PARTIAL, RULE_STALE_RUN

    return (
        "expired",
        "moved",
        RULE_FAILED_RUN,
        RULE_STALE_RUN,
        RULE_PARTIAL,
        "reap",
        *ARTIFACT_KINDS,
        trash.ENDED,
        trash.PRESSURE,
        trash.OFF,
    )


RECLAIM_REASONS = _reclaim_reasons()
"""Reasons the executor records bytes under; anything else is reported as ``other``."""


def _reason_label(reason: str) -> str:
    return reason if reason in RECLAIM_REASONS else "other"


def _cost_metrics(summary: StatusSummary) -> Iterator[Any]:
    """Storage cost per tier and per run (none when no tier is priced)."""
    from prometheus_client.core import GaugeMetricFamily

    if not summary.cost_per_month:
        return
    tier_cost = GaugeMetricFamily(
        "ckptkeeper_tier_cost_per_month",
        "Monthly storage cost of the tier's verified copies (cost_per_gib_month x GiB)",
        labels=["tier"],
    )
    for name, value in summary.cost_per_month.items():
        tier_cost.add_metric([name], value)
    run_cost = GaugeMetricFamily(
        "ckptkeeper_run_cost_per_month",
        "Monthly storage cost of a run's copies in a tier",
        labels=["run", "tier"],
    )
    for run, tiers in summary.run_cost_per_month.items():
        for name, value in tiers.items():
            run_cost.add_metric([run, name], value)
    yield from (tier_cost, run_cost)


def _reclaimed_metrics(summary: StatusSummary) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    # Every known reason has a series from the start (0 until something is freed for it), so
    # `increase()` and alerts see the first bytes instead of a series appearing out of nowhere.
    by_reason: dict[str, int] = dict.fromkeys(RECLAIM_REASONS, 0)
    for reason, (nbytes, _n) in summary.reclaimed.items():
        label = _reason_label(reason)
        by_reason[label] = by_reason.get(label, 0) + nbytes
    fam = CounterMetricFamily(
        "ckptkeeper_reclaimed_bytes", "Bytes reclaimed since the index was created", labels=["reason"]
    )
    for reason, nbytes in sorted(by_reason.items()):
        fam.add_metric([reason], nbytes)
    yield fam


class IndexCollector:
    """A ``prometheus_client`` collector that reads the index on each scrape.

    ``open_index`` yields an :class:`~ckptkeeper.index.Index`; the daemon passes one that opens a
    short-lived read-only connection, so a scrape never waits behind the writer's lock (WAL readers
    do not block writers) and never touches the daemon's own connection. The numbers are the ones
    ``ckptkeeper status`` shows: both come from :func:`ckptkeeper.actions.status.summarize`.
    """

    def __init__(
        self,
        open_index: Callable[[], AbstractContextManager[Index]],
        settings: Settings,
        *,
        counters: Callable[[], tuple[dict[str, int], dict[str, int]]] | None = None,
        extra: Callable[[], Iterable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._open_index = open_index
        self._settings = settings
        self._counters = counters
        self._extra = extra
        self._clock = clock

    def set_settings(self, settings: Settings) -> None:
        """Config reload: the tier list may have changed."""
        self._settings = settings

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
                summary = summarize(self._settings, ix, now=self._clock())
        except Exception as exc:  # a scrape must answer even when the index is unreadable
            log.warning("metrics: cannot read the index", error=str(exc))
            up.add_metric([], 0)
            yield up
            yield from self._extra() if self._extra is not None else ()
            return
        up.add_metric([], 1)
        yield up
        yield from _summary_metrics(summary)
        yield from _watermark_metrics(self._settings)
        yield from self._extra() if self._extra is not None else ()


def _summary_metrics(summary: StatusSummary) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

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
    for tier in summary.tiers:
        count.add_metric([tier.name], tier.checkpoints)
        size.add_metric([tier.name], tier.bytes)
        newest = summary.newest_age(tier)
        if newest is not None:
            age.add_metric([tier.name], newest)
        tier_up.add_metric([tier.name], 1 if tier.ok else 0)
        if tier.usage is not None:
            used.add_metric([tier.name], tier.usage.fraction)
    held = GaugeMetricFamily(
        "ckptkeeper_policy_held",
        "Checkpoints whose copies or deletes the last retention pass held because the tier was unavailable",
        labels=["tier"],
    )
    damaged = GaugeMetricFamily(
        "ckptkeeper_damaged_copies",
        "Copies found not matching their manifest (files missing or of another size); copied again",
    )
    damaged.add_metric([], summary.damaged)
    for tier in summary.tiers:
        h = summary.policy_held.get(tier.name)
        held.add_metric([tier.name], h.checkpoints if h is not None else 0)
    yield from (count, size, age, tier_up, used, held, damaged)
    yield from _scrub_metrics(summary)
    yield from _cost_metrics(summary)

    states = GaugeMetricFamily(
        "ckptkeeper_checkpoints_by_state", "Cataloged checkpoints by state", labels=["state"]
    )
    for st in CheckpointState:
        states.add_metric([st.value], summary.checkpoints.get(st.value, 0))
    yield states
    run_states = GaugeMetricFamily("ckptkeeper_runs", "Runs by state", labels=["state"])
    for rs in RunState:
        run_states.add_metric([rs.value], summary.runs.get(rs.value, 0))
    yield run_states

    yield from _reclaimed_metrics(summary)

    last = GaugeMetricFamily(
        "ckptkeeper_job_last_success_timestamp_seconds",
        "When the job last finished without error",
        labels=["job"],
    )
    for job in sorted(summary.jobs.values(), key=lambda j: j.job):
        if job.job in JOBS and job.last_success is not None:
            last.add_metric([job.job], job.last_success)
    yield last

    quarantined = GaugeMetricFamily(
        "ckptkeeper_quarantined",
        "Documents (manifests, run.json, commit logs, heartbeats, markers) that failed the schema and are "
        "ignored, by tier and kind; `ckptkeeper status` lists them with their reasons",
        labels=["tier", "kind"],
    )
    for (tier_name, kind), n in sorted(Counter((q.tier, q.kind) for q in summary.quarantined).items()):
        quarantined.add_metric([tier_name, kind], n)
    yield quarantined
    pending = GaugeMetricFamily(
        "ckptkeeper_journal_open_entries", "Interrupted executor steps waiting to be finished or undone"
    )
    pending.add_metric([], summary.journal_open)
    yield pending
    if summary.headroom is not None:
        # One series per active run only (runs end): bounded like the runs on one node's hot disk.
        saves = GaugeMetricFamily(
            "ckptkeeper_next_save_bytes",
            "Predicted bytes of an active run's next save in the hot tier (0: not known yet)",
            labels=["run"],
        )
        for run, nbytes in summary.headroom.runs.items():
            saves.add_metric([run], nbytes)
        room = GaugeMetricFamily(
            "ckptkeeper_headroom_bytes",
            "Hot tier free bytes minus what the active runs' next saves need (negative: a save may fail)",
            labels=["tier"],
        )
        room.add_metric([summary.headroom.tier], summary.headroom.free_bytes - summary.headroom.needed_bytes)
        yield from (saves, room)


def _watermark_metrics(settings: Settings) -> Iterator[Any]:
    """The configured watermarks, so dashboards and alerts compare ``ckptkeeper_tier_used_ratio``
    with each tier's own threshold (a series only for tiers that set one)."""
    from prometheus_client.core import GaugeMetricFamily

    high = GaugeMetricFamily(
        "ckptkeeper_tier_high_watermark_ratio",
        "The tier's high_watermark: above this usage it demotes the checkpoints it keeps",
        labels=["tier"],
    )
    low = GaugeMetricFamily(
        "ckptkeeper_tier_low_watermark_ratio",
        "The tier's low_watermark: the usage demotion brings it down to",
        labels=["tier"],
    )
    for tier in settings.tiers:
        if tier.high_watermark is not None and tier.low_watermark is not None:
            high.add_metric([tier.name], tier.high_watermark)
            low.add_metric([tier.name], tier.low_watermark)
    yield from (high, low)


def _scrub_metrics(summary: StatusSummary) -> Iterator[Any]:
    """The scrub's cumulative totals (kept in the index: they survive restarts, and a manual
    ``ckptkeeper scrub`` counts too), per slower tier."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    scrubbed = CounterMetricFamily(
        "ckptkeeper_scrub_bytes", "Bytes of slower-tier copies re-hashed by scrubs", labels=["tier"]
    )
    copies = CounterMetricFamily(
        "ckptkeeper_scrub_copies", "Slower-tier copies re-hashed by scrubs", labels=["tier"]
    )
    bad = CounterMetricFamily(
        "ckptkeeper_scrub_bad_copies",
        "Copies scrubs found not matching their manifest (marked damaged, copied again)",
        labels=["tier"],
    )
    for tier in summary.tiers[1:]:
        b, n, nbad = summary.scrub.get(tier.name, (0, 0, 0))
        scrubbed.add_metric([tier.name], b)
        copies.add_metric([tier.name], n)
        bad.add_metric([tier.name], nbad)
    oldest = GaugeMetricFamily(
        "ckptkeeper_scrub_oldest_check_timestamp_seconds",
        "When the least recently hashed good copy of the tier was last hashed (0: some copy never was)",
        labels=["tier"],
    )
    for tier_name, when in sorted(summary.scrub_oldest.items()):
        oldest.add_metric([tier_name], when or 0.0)
    lost = GaugeMetricFamily(
        "ckptkeeper_checkpoints_without_good_copy",
        "Checkpoints whose every copy is damaged (kept, never deleted; need a human)",
    )
    lost.add_metric([], len(summary.no_good_copy))
    yield from (scrubbed, copies, bad, oldest, lost)


Probe = Callable[[], str | None]
"""A health check behind ``/healthz`` or ``/readyz``: None when fine, else why not (the 503 body)."""


def _probe_app(metrics_app: Any, probes: Mapping[str, Probe]) -> Any:
    """A WSGI app: each probe's path answers ``200 ok`` or ``503 <reason>`` (plain text); every other
    path is prometheus_client's app (``/metrics``, as before)."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics_app(environ, start_response)
        try:
            problem = probe()
        except Exception as exc:  # a probe that raises is a failing probe, not a dead server
            problem = f"{type(exc).__name__}: {exc}"
        body = ("ok" if problem is None else problem).encode("utf-8", "replace") + b"\n"
        status = "200 OK" if problem is None else "503 Service Unavailable"
        start_response(
            status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return app


def _serve_wsgi(host: str, port: int, app: Any) -> tuple[Any, threading.Thread]:
    """A threaded WSGI server (stdlib) on ``host:port`` that logs no request lines."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # the stdlib logs every request
            pass

    httpd = make_server(host, port, app, Server, handler_class=QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="ckptkeeper-metrics", daemon=True)
    thread.start()
    return httpd, thread


class MetricsServer:
    """The ``/metrics`` (and probes) HTTP endpoint; :meth:`stop` joins its thread (tests check for leaks)."""

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
        settings: Settings,
        *,
        extra: Callable[[], Iterable[Any]] | None = None,
        probes: Mapping[str, Probe] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector

        self.index_path = Path(settings.index)
        self.probes = dict(probes or {})
        """Path -> health check served beside ``/metrics`` (the daemon's ``/healthz``, ``/readyz``)."""
        self._lock = threading.Lock()
        self._actions = {k.value: 0 for k in ActionKind}
        self._errors = dict.fromkeys(ERROR_KINDS, 0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = IndexCollector(self._readonly_index, settings, counters=self._counters, extra=extra)
        self.registry.register(self.collector)
        # process_cpu_seconds_total, process_resident_memory_bytes, open fds, start time (/proc/self).
        ProcessCollector(registry=self.registry)

    @contextmanager
    def _readonly_index(self) -> Iterator[Index]:
        ix = Index(self.index_path, readonly=True)
        try:
            yield ix
        finally:
            ix.close()

    def _counters(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self._actions), dict(self._errors)

    def record_outcome(self, outcome: PruneOutcome) -> None:
        """Count what a prune pass did: actions carried out by kind, failed actions."""
        if outcome.result is None:  # a dry run
            return
        with self._lock:
            for action in outcome.result.done:
                self._actions[action.action.value] += 1
            self._errors["action"] += len(outcome.failed)

    def record_error(self, kind: str) -> None:
        with self._lock:
            key = kind if kind in self._errors else "job"
            self._errors[key] += 1

    def serve(self, addr: str) -> MetricsServer | None:
        """Serve ``/metrics`` and the probes on ``host:port`` (None when ``addr`` is empty); raises
        OSError on bind."""
        from prometheus_client import make_wsgi_app

        parsed = parse_addr(addr)
        if parsed is None:
            return None
        host, port = parsed
        httpd, thread = _serve_wsgi(host, port, _probe_app(make_wsgi_app(self.registry), self.probes))
        return MetricsServer(httpd, thread, host, httpd.server_port)


def write_prune_textfile(
    settings: Settings, index: Index, outcome: PruneOutcome, *, path: str | None = None
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
    done = outcome.result.done if outcome.result is not None else []

    def prune_gauges() -> Iterator[Any]:
        g = GaugeMetricFamily(
            "ckptkeeper_prune_last_run_timestamp_seconds", "When the last one-shot prune finished"
        )
        g.add_metric([], now)
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_exit_code", "Exit code of the last one-shot prune")
        g.add_metric([], outcome.exit_code)
        yield g
        g = GaugeMetricFamily(
            "ckptkeeper_prune_last_actions", "Actions carried out by the last prune", labels=["kind"]
        )
        for kind in ActionKind:
            g.add_metric([kind.value], sum(1 for a in done if a.action is kind))
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_failed_actions", "Actions that failed in the last prune")
        g.add_metric([], len(outcome.failed))
        yield g
        g = GaugeMetricFamily("ckptkeeper_prune_last_reclaimed_bytes", "Bytes the last prune reclaimed")
        g.add_metric([], outcome.reclaimed_bytes)
        yield g

    registry = CollectorRegistry(auto_describe=False)
    registry.register(IndexCollector(lambda: nullcontext(index), settings, extra=prune_gauges))
    target_path = Path(target)
    target_path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(target_path), registry)
    return target_path
