"""``ckptkeeper daemon``: watch the hot tier, run retention / reaping / rescans on a schedule.

Threads, and why each exists:

- the watchdog observer (inotify or polling) and ONE watcher worker that reconciles changed runs
  (see :mod:`ckptkeeper.ingest.watcher`);
- APScheduler's ``BackgroundScheduler`` with a single worker thread: ``retention`` and ``reap``
  run the prune operation (:mod:`.prune_job`), ``rescan`` reconciles every tier. One worker
  because the jobs contend for the same executor lock and index anyway, and serial jobs are easier
  to reason about than a retention pass racing a reap pass. The ``scrub`` job (re-hashing
  slower-tier copies, rate-limited) has a worker of its own, so a long scrub never delays retention
  (:mod:`.schedule`);
- the Prometheus endpoint (with ``/healthz`` and ``/readyz`` for Kubernetes probes) and the
  systemd watchdog pinger;
- the restore socket (:mod:`.restore_server`): this node's ``restore`` and ``prefetch`` commands
  run here, a thread per request, instead of paying the start-up in each command;
- the main thread, which only handles signals: SIGTERM/SIGINT stop (the running job sees
  :attr:`Daemon.stopping` and finishes its current step), SIGHUP reloads the config.

Reconcile cost: the hot tier is walked in full at start, by the ``rescan`` job, on SIGHUP and
whenever the watcher stops vouching for its events (overflow, failed reconcile, polling); a
retention or reap pass in between syncs only the runs the watcher queued plus those whose state
the clock can change (:meth:`Watcher.sync`). The price: a change no event reports (an mtime-only
touch, a lost event nobody noticed) waits for the next full walk, at most ``rescan_interval``.

Hot bytes read once per move: when a slower tier is local on another filesystem, a new checkpoint
that a pass would copy out of hot at once is not hashed by the watcher but held, and the retention
pass started for it hashes it while copying it (:mod:`ckptkeeper.actions.pruning.watched`).

Single instance per index (``<index>.daemon.lock``); the executor lock inside ``run_prune``
serialises the daemon's jobs with a manual ``ckptkeeper prune``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

from ckptkeeper import __version__
from ckptkeeper.actions.errors import EXIT_ACTION_FAILED, EXIT_OK, EXIT_USAGE, Locked
from ckptkeeper.config import ConfigError, Settings, load_settings, parse_addr
from ckptkeeper.daemon.config_diff import config_changes, watch_keys_changed
from ckptkeeper.daemon.logbridge import bridge_stdlib_logging
from ckptkeeper.daemon.prune_job import PruneJob
from ckptkeeper.daemon.schedule import JOB_IDS, intervals, make_scheduler, reschedule
from ckptkeeper.daemon.sdnotify import WatchdogPinger, notify, watchdog_interval
from ckptkeeper.storage import s3_get
from ckptkeeper.util import logs
from ckptkeeper.util.fmt import format_duration, human_age
from ckptkeeper.util.lock import DaemonLock, LockHeld
from ckptkeeper.util.logs import get_logger

# The heavy imports (the actions, the catalog and watcher, apscheduler, prometheus_client) are made
# inside the methods that run after run() has installed the signal handlers: a SIGTERM that reaches
# a daemon still importing at start-up must stop it cleanly (exit 0, STOPPING=1), not kill it.
if TYPE_CHECKING:
    from ckptkeeper.daemon.metrics import Metrics, MetricsServer
    from ckptkeeper.daemon.restore_server import RestoreServer
    from ckptkeeper.index import Index
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.ingest.report import ReconcileReport
    from ckptkeeper.ingest.watcher import Watcher

__all__ = ["JOB_IDS", "Daemon", "run_daemon"]

log = get_logger("ckptkeeper.daemon.service")

PROMPT_RETENTION_DELAY = 2.0
"""New complete checkpoints within this window share one prompt retention pass."""
STATUS_INTERVAL = 30.0
WATCHER_RESTART_BACKOFF = 30.0
RESTORE_BUFFERS_IDLE = 60.0
"""Seconds without a restore after which the range buffers kept for the next one are given back."""


def _release_memory() -> None:
    """Give the heap a job's snapshot and plan used back to the OS: the daemon idles between jobs,
    and glibc keeps freed memory mapped otherwise (10k checkpoints: RSS 89 -> ~70 MiB, bench/)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


def _freeze_startup_heap() -> None:
    """What start-up built (imports, settings, the index, the scheduler) lives as long as the
    daemon: kept out of the cyclic GC's scans, so that a full collection, which may fall in the
    middle of a restore the daemon serves, visits only what came after (it took 60-200 ms in
    bench/restore_s3 before). Objects frozen are still freed when their last reference goes; the
    collection first clears start-up's cyclic garbage, which would never be collected after."""
    gc.collect()
    gc.freeze()


class Daemon(PruneJob):
    """One daemon process. :meth:`run` returns the exit code; the CLI passes it to ``sys.exit``."""

    def __init__(self, config_path: str | None, settings: Settings) -> None:
        self.config_path = config_path
        self.settings = settings
        self.stopping = threading.Event()
        """Set on SIGTERM/SIGINT; passed to ``run_prune`` so the executor stops between steps."""
        self._wake = threading.Event()
        self._reload_requested = False
        self._starting = True
        self.index: Index | None = None
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.watcher: Watcher | None = None
        self.scheduler: Any = None
        self.pinger: WatchdogPinger | None = None
        self._reconcile_lock = threading.Lock()
        self._passing = threading.local()
        """``active`` in the thread running a prune pass (:mod:`.prune_job`)."""
        self._last_watcher_restart = 0.0
        self.restore_server: RestoreServer | None = None
        self._served: tuple[str | None, Settings] = (_config_identity(config_path), settings)
        """(identity of the config file and environment, the settings built from them): the restore
        socket serves a client only when its config has the same identity."""

    # -- entry point -----------------------------------------------------------------------

    def run(self) -> int:
        bridge = bridge_stdlib_logging()
        lock = DaemonLock(self.settings.index)
        try:
            lock.acquire(timeout=0)
        except LockHeld as exc:
            print(f"ckptkeeper: {exc}", file=sys.stderr)
            log.error("refusing to start", reason=str(exc))
            return EXIT_ACTION_FAILED
        except OSError as exc:
            print(f"ckptkeeper: cannot take {lock.path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ACTION_FAILED
        from ckptkeeper.actions.sharedfs import NodeClash

        previous = self._install_signal_handlers()
        try:
            return self._run_locked()  # raises NodeClash: two keepers, one node name
        except NodeClash as exc:
            print(f"ckptkeeper: {exc}", file=sys.stderr)
            return EXIT_USAGE
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            lock.release()
            logging.getLogger().removeHandler(bridge)

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous  # embedded (tests): the caller drives stop()/reload() itself
        for sig, handler in (
            (signal.SIGTERM, self._on_stop_signal),
            (signal.SIGINT, self._on_stop_signal),
            (signal.SIGHUP, self._on_hup),
        ):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.request_reload()

    def stop(self) -> None:
        """Stop accepting work; safe from a signal handler (only sets events)."""
        self.stopping.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    # -- startup and main loop -------------------------------------------------------------

    def _run_locked(self) -> int:
        from ckptkeeper.actions.index import open_index
        from ckptkeeper.daemon.metrics import Metrics

        settings = self.settings
        try:
            parse_addr(settings.daemon.metrics_addr)
        except ValueError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        try:
            # Served before the index is opened: a first start (or a lost index) rebuilds it from
            # every tier, which takes a while, and a liveness probe must see a live daemon meanwhile
            # (scrapes read the index file on their own and report ckptkeeper_index_up 0 until then).
            self.metrics = Metrics(
                settings,
                extra=self._daemon_metrics,
                probes={"/healthz": self.liveness_problem, "/readyz": self.readiness_problem},
            )
            if not self._serve_metrics(settings.daemon.metrics_addr, fatal=True):
                return EXIT_ACTION_FAILED
            notify(f"STATUS=initial scan of {settings.hot.local_path}", env=None)
            self._start_pinger()  # a rebuild is part of the start: EXTEND_TIMEOUT_USEC covers it too
            # Two keepers, one node name: refuse to start, before anything is done. After the
            # probes are served: a slow first answer of a shared bucket is a live daemon starting.
            from ckptkeeper.actions.sharedfs import check_node_name

            check_node_name(settings, time.time())
            try:
                # A corrupt index is moved aside and rebuilt from the tiers, with deletes held until
                # every tier has been reconciled (actions.index.open_index).
                self.index = open_index(settings, check=True, rebuild=True)
            except Exception as exc:
                print(f"ckptkeeper: cannot open index {settings.index}: {exc}", file=sys.stderr)
                return EXIT_ACTION_FAILED
            log.info(
                "starting",
                version=__version__,
                pid=os.getpid(),
                config=self.config_path,
                index=settings.index,
                hot=str(settings.hot.local_path),
                intervals={k: format_duration(v) for k, v in intervals(settings).items()},
                metrics=self.metrics_server and f"{self.metrics_server.host}:{self.metrics_server.port}",
            )
            try:
                self.watcher = self._make_watcher(settings)
                self.watcher.start(initial_reconcile=True)
            except OSError as exc:
                print(f"ckptkeeper: cannot watch hot tier {settings.hot.local_path}: {exc}", file=sys.stderr)
                log.error("cannot watch the hot tier", root=str(settings.hot.local_path), error=str(exc))
                return EXIT_ACTION_FAILED
            if self.stopping.is_set():
                return EXIT_OK
            self.scheduler = self._make_scheduler()
            self.scheduler.start()
            self._starting = False
            self._serve_restores(settings)
            s3_get.keep_buffers()  # restore after restore (a job's pre-stage, a requeue) skips their first touch
            _freeze_startup_heap()
            notify("READY=1\n" + self._status_line())
            log.info("ready", observer="polling" if self.watcher.polling else "inotify")
            self._main_loop()
            return EXIT_OK
        finally:
            self._shutdown()

    def _main_loop(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.is_set():
            self._wake.wait(STATUS_INTERVAL)
            self._wake.clear()
            if self.stopping.is_set():
                break
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            self._check_health()
            s3_get.release_idle_buffers(RESTORE_BUFFERS_IDLE)
            if time.monotonic() - last_status >= STATUS_INTERVAL:
                notify(self._status_line())
                last_status = time.monotonic()

    def _shutdown(self) -> None:
        notify("STOPPING=1")
        log.info("stopping")
        self.stopping.set()
        self._stop_restore_server()
        if self.pinger is not None:
            self.pinger.stop()
        if self.scheduler is not None and self.scheduler.running:
            # wait=True: the running job sees `stopping` and ends after its current step.
            self.scheduler.shutdown(wait=True)
        if self.watcher is not None:
            self.watcher.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self.index is not None:
            self.index.close()
        log.info("stopped")

    # -- components ------------------------------------------------------------------------

    def _serve_metrics(self, addr: str, *, fatal: bool) -> bool:
        assert self.metrics is not None
        try:
            self.metrics_server = self.metrics.serve(addr)
        except OSError as exc:
            message = f"cannot serve metrics on {addr}: {exc.strerror or exc}"
            if fatal:
                print(f"ckptkeeper: {message} (daemon.metrics_addr; empty disables)", file=sys.stderr)
            log.error("cannot serve metrics", addr=addr, error=str(exc))
            return False
        return True

    def _serve_restores(self, settings: Settings) -> None:
        """Start the restore socket if the config asks for it; a socket that cannot be made is
        logged, and the commands run on their own as without a daemon."""
        if not settings.daemon.serve_restores or self.restore_server is not None:
            return
        from ckptkeeper.daemon.restore_server import RestoreServer
        from ckptkeeper.daemon.wire import socket_path

        server = RestoreServer(socket_path(settings.index), self.settings_for)
        try:
            server.start()
        except OSError as exc:
            log.error(
                "cannot serve restores; the commands run on their own", socket=server.path, error=str(exc)
            )
            return
        self.restore_server = server

    def _stop_restore_server(self) -> None:
        server, self.restore_server = self.restore_server, None
        if server is not None:
            server.stop()

    def settings_for(self, identity: str) -> Settings | None:
        """The running settings when ``identity`` is their config's (restore socket requests)."""
        current, settings = self._served
        return settings if current is not None and identity == current else None

    def _make_watcher(self, settings: Settings) -> Watcher:
        from ckptkeeper.ingest.watcher import Watcher

        return Watcher(
            self._catalog_for(settings),
            on_reconciled=self._on_reconciled,
            on_error=self._on_reconcile_error,
            reconcile_lock=self._reconcile_lock,
            on_deferred=self._on_deferred,
        )

    def _catalog_for(self, settings: Settings) -> Catalog:
        """The watcher's catalog: new checkpoints left unhashed when a move can hash them on the
        way (:mod:`ckptkeeper.actions.pruning.watched`), as ``prune``'s catalog does."""
        from ckptkeeper.actions.pruning import watched
        from ckptkeeper.ingest.catalog import Catalog

        assert self.index is not None
        return Catalog(settings, self.index, defer_new=watched.defers(settings, self.index))

    def _start_pinger(self) -> None:
        interval = watchdog_interval()
        if interval is None:
            return
        self.pinger = WatchdogPinger(interval, self._healthy, extra=self._startup_extension)
        self.pinger.start()

    def _healthy(self) -> bool:
        return self.liveness_problem() is None

    def liveness_problem(self) -> str | None:
        """Why the daemon is not working (None: it is): the systemd watchdog's condition, and
        ``/healthz`` for a Kubernetes liveness probe. Starting (the first scan runs in the main
        thread; EXTEND_TIMEOUT_USEC rides along) and stopping (the drain) count as alive."""
        if self._starting or self.stopping.is_set():
            return None
        watcher, scheduler = self.watcher, self.scheduler
        if watcher is None or not watcher.is_alive():
            return "the hot-tier watcher is not running"
        if scheduler is None or not scheduler.running:
            return "the job scheduler is not running"
        return None

    def readiness_problem(self) -> str | None:
        """``/readyz``: ready once the first catalog sync of every tier is done and the jobs are
        scheduled, until SIGTERM (a DaemonSet rollout waits for it before the next node)."""
        if self.stopping.is_set():
            return "stopping"
        if self._starting:
            return f"initial scan of {self.settings.hot.local_path} in progress"
        return self.liveness_problem()

    def _startup_extension(self) -> str | None:
        if not self._starting or self.pinger is None:
            return None
        # A first scan of a large hot tier hashes everything once; keep systemd's start timeout
        # from killing it half-way (progress is kept, but it would start over and over).
        return f"EXTEND_TIMEOUT_USEC={int(self.pinger.interval * 4 * 1_000_000)}"

    def _make_scheduler(self) -> Any:
        assert self.index is not None
        pending = len(self.index.journal_open())
        if pending:
            log.warning(
                "interrupted executor steps found; the first prune finishes or undoes them", steps=pending
            )
        # The first reconcile held new checkpoints for their move: the pass that moves them now.
        held = bool(self.watcher is not None and self.watcher.catalog.deferred)
        return make_scheduler(self.settings, pending, self._job_function, prompt=held)

    def _job_function(self, job_id: str) -> Callable[[], None]:
        body: Callable[[], str | None]
        if job_id == "rescan":
            body = self._rescan
        elif job_id == "scrub":
            body = self._scrub
        else:
            body = functools.partial(self._prune, job_id, (job_id,))
        return functools.partial(self._run_job, job_id, body)

    # -- jobs ------------------------------------------------------------------------------

    def _run_job(self, job: str, body: Callable[[], str | None]) -> None:
        """Record start/finish in the index; a job error is logged and counted, never raised."""
        if self.stopping.is_set() or self.index is None:
            return
        if not self._index_still_ours(job):
            return
        started, cpu_started = time.monotonic(), time.process_time()
        try:
            self.index.job_started(job)
        except Exception:
            log.exception("cannot record job start", job=job)
        try:
            error = body()
        except Exception as exc:
            log.exception("job failed", job=job)
            error = f"{type(exc).__name__}: {exc}"
        try:
            self.index.job_finished(job, error)
        except Exception:
            log.exception("cannot record job end", job=job)
        if error is not None and self.metrics is not None:
            self.metrics.record_error("job")
        log.info(
            "job finished",
            job=job,
            ok=error is None,
            error=error,
            seconds=round(time.monotonic() - started, 3),
            # The whole process's CPU (utime + stime of every thread) while the job ran: what a
            # pass costs a shared node, load-tolerant where wall time is not (bench/daemon_idle).
            cpu_seconds=round(time.process_time() - cpu_started, 3),
        )
        _release_memory()
        notify(self._status_line())

    def _index_still_ours(self, job: str) -> bool:
        """Before each pass: is the index file the one we opened (one ``stat``)? A deleted or
        replaced index is reopened and rebuilt from the tiers with deletes held; until then the
        daemon would go on planning from a deleted file that no ``pin`` reaches."""
        from ckptkeeper.actions.index import reopen_after_loss

        assert self.index is not None
        problem = self.index.identity_problem()
        if problem is None:
            return True
        try:
            with self._reconcile_lock:  # no watcher reconcile while the connection is swapped
                reopen_after_loss(self.settings, self.index, problem)
        except Locked as exc:
            log.warning("index lost; rebuild waits for the executor lock", job=job, detail=str(exc))
            return False
        except Exception:
            log.exception("index lost and could not be rebuilt; this pass is skipped", job=job)
            if self.metrics is not None:
                self.metrics.record_error("job")
            return False
        if self.watcher is not None:
            self.watcher.request_full()
        return True

    def _rescan(self) -> str | None:
        if self.watcher is None:
            return "the hot tier is not being watched (see the watcher errors above)"
        report = self.watcher.reconcile_all()
        if report.tiers_failed and self.metrics is not None:
            for _ in report.tiers_failed:
                self.metrics.record_error("tier")
        if report.tiers_failed:
            return "tier listing failed: " + "; ".join(
                f"{t}: {e}" for t, e in sorted(report.tiers_failed.items())
            )
        return None

    def _scrub(self) -> str | None:
        """One scrub pass (:func:`ckptkeeper.actions.scrub.run_scrub`); SIGTERM ends it between chunks."""
        from ckptkeeper.actions.scrub import run_scrub

        assert self.index is not None
        report = run_scrub(self.settings, self.index, stop=self.stopping)
        if self.metrics is not None:
            for _ in report.errors:
                self.metrics.record_error("tier")
        if not report.exit_code:
            return None
        parts = [f"{len(report.bad)} bad copies" if report.bad else ""]
        parts.append(f"{len(report.errors)} copies not checked" if report.errors else "")
        if report.no_good_copy:
            parts.append(f"{len(report.no_good_copy)} checkpoints without a good copy")
        first = report.bad[0] if report.bad else None
        detail = f"; first: {first.tier}:{first.run}@{first.step}: {first.problem}" if first else ""
        return ", ".join(p for p in parts if p) + detail

    # -- watcher callbacks (watcher worker thread) -----------------------------------------

    def _on_reconciled(self, run: str, report: ReconcileReport) -> None:
        if not (report.new or report.new_versions) or not self._prompt_policy():
            return
        self.prompt_retention()

    def _on_deferred(self, catalog: Catalog, report: ReconcileReport) -> None:
        """The watcher deferred new checkpoints (its reconcile lock held): each is hashed in place,
        or held for the pass that moves it, asked for now (unless this thread is that pass): a
        held checkpoint is not in the index until that pass has copied it."""
        from ckptkeeper.actions.pruning import watched

        if watched.triage(catalog.settings, catalog, report) and not getattr(self._passing, "active", False):
            self.prompt_retention(delay=0.0)

    def _on_reconcile_error(self, run: str, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.record_error("reconcile")

    def _prompt_policy(self) -> bool:
        """A new checkpoint needs a retention pass before the next interval when a slower tier
        replicates it (a node can die any minute) or the hot tier has watermarks (disk filling)."""
        tiers = self.settings.tiers
        return any(t.replicate for t in tiers[1:]) or tiers[0].high_watermark is not None

    def prompt_retention(self, delay: float = PROMPT_RETENTION_DELAY) -> bool:
        """Move the retention job's next run to within ``delay``; never later."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.running or self.stopping.is_set():
            return False
        from apscheduler.jobstores.base import JobLookupError

        target = datetime.now(UTC) + timedelta(seconds=delay)
        try:
            job = scheduler.get_job("retention")
            if job is None or (job.next_run_time is not None and job.next_run_time <= target):
                return False
            scheduler.modify_job("retention", next_run_time=target)
        except JobLookupError:
            return False
        log.info("new checkpoint: prompt retention pass scheduled", at=target.isoformat())
        return True

    # -- reload and health -----------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the config; on any problem keep running with the old one. True if applied."""
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            before = _config_identity(self.config_path)
            try:
                new = load_settings(self.config_path)
                parse_addr(new.daemon.metrics_addr)
            except ConfigError as exc:
                log.error("config reload failed; keeping the running config", problems=exc.problems)
                return False
            except ValueError as exc:
                log.error("config reload failed; keeping the running config", problems=[str(exc)])
                return False
            old = self.settings
            if new.index != old.index:
                log.error(
                    "config reload failed; keeping the running config",
                    problems=[f"index: changing the index path ({old.index} -> {new.index}) needs a restart"],
                )
                return False
            changes = config_changes(old, new)
            after = _config_identity(self.config_path)
            # An edit between the two reads: serve no client until the next reload.
            self._served = (before if before == after else None, new if changes else old)
            if self.watcher is not None:
                # SIGHUP doubles as "look again": the one way to force a full reconcile in place.
                self.watcher.request_full()
            if not changes:
                log.info("config reloaded: nothing changed")
                return True
            self.settings = new
            logs.configure(new.log_level, stream=new.daemon.log_stream)
            from ckptkeeper.storage import deadline

            deadline.configure(new.request_timeout)
            assert self.index is not None
            if watch_keys_changed(old, new) or self.watcher is None:
                self._restart_watcher(new)
            else:
                with self._reconcile_lock:
                    held = self.watcher.catalog.deferred
                    self.watcher.catalog = self._catalog_for(new)
                    self.watcher.catalog.deferred.extend(held)  # the same hot root: still held
            self._reschedule(old, new)
            if new.daemon.serve_restores != old.daemon.serve_restores:
                if new.daemon.serve_restores:
                    self._serve_restores(new)
                else:
                    self._stop_restore_server()
            if self.metrics is not None:
                self.metrics.collector.set_settings(new)
                if new.daemon.metrics_addr != old.daemon.metrics_addr:
                    if self.metrics_server is not None:
                        self.metrics_server.stop()
                        self.metrics_server = None
                    self._serve_metrics(new.daemon.metrics_addr, fatal=False)
            log.info("config reloaded", changed=changes)
            return True
        finally:
            notify("READY=1\n" + self._status_line())

    def _restart_watcher(self, settings: Settings) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        self._last_watcher_restart = time.monotonic()
        watcher = self._make_watcher(settings)
        try:
            watcher.start(initial_reconcile=True)
        except OSError as exc:
            log.error("cannot watch the hot tier", root=str(settings.hot.local_path), error=str(exc))
            return
        self.watcher = watcher

    def _reschedule(self, old: Settings, new: Settings) -> None:
        if self.scheduler is not None:
            reschedule(self.scheduler, old, new, self._job_function)

    def _check_health(self) -> None:
        if self.stopping.is_set():
            return
        if self.watcher is None or not self.watcher.is_alive():
            if time.monotonic() - self._last_watcher_restart < WATCHER_RESTART_BACKOFF:
                return
            log.error("watcher is not running; restarting it", root=str(self.settings.hot.local_path))
            self._restart_watcher(self.settings)
        if self.scheduler is not None and not self.scheduler.running:
            log.error("scheduler stopped unexpectedly; withholding watchdog pings so systemd restarts us")

    # -- status ----------------------------------------------------------------------------

    def _status_line(self) -> str:
        """``STATUS=watching /nvme: 42 checkpoints, last prune ok 3m ago``."""
        root = self.settings.hot.local_path
        if self.index is None:
            return f"STATUS=starting ({root})"
        try:
            # Counted in SQL: building 10k checkpoint rows every STATUS_INTERVAL was ~0.25 CPU-s.
            count = self.index.count_verified(self.settings.hot.name)
            jobs = self.index.job_runs()
        except Exception as exc:
            return f"STATUS=watching {root}: index unreadable ({exc})"
        now = time.time()
        prune_jobs = [j for j in jobs.values() if j.job in ("retention", "reap")]
        last_ok = max((j.last_success for j in prune_jobs if j.last_success), default=None)
        last_err = max((j.last_error_at for j in prune_jobs if j.last_error_at), default=None)
        if last_err is not None and (last_ok is None or last_err > last_ok):
            prune = f"last prune failed {human_age(now - last_err)} ago"
        elif last_ok is not None:
            prune = f"last prune ok {human_age(now - last_ok)} ago"
        else:
            prune = "no prune yet"
        mode = " (polling)" if self.watcher is not None and self.watcher.polling else ""
        return f"STATUS=watching {root}{mode}: {count} checkpoints, {prune}"

    def _daemon_metrics(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        watcher = self.watcher
        g = GaugeMetricFamily(
            "ckptkeeper_watcher_polling", "1 if the hot tier is polled instead of inotify-watched"
        )
        g.add_metric([], 1 if watcher is not None and watcher.polling else 0)
        yield g
        g = GaugeMetricFamily("ckptkeeper_watcher_up", "1 if the observer and the watcher worker are running")
        g.add_metric([], 1 if watcher is not None and watcher.is_alive() else 0)
        yield g


def _config_identity(config_path: str | None) -> str | None:
    from ckptkeeper.daemon.wire import config_identity

    identity = config_identity(config_path)
    return None if identity is None else identity[0]


def run_daemon(config_path: str | None, settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    return Daemon(config_path, settings).run()
