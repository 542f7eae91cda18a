"""The watcher's filesystem observer: inotify, or polling when configured or when inotify's limits
are exhausted (see :mod:`ckptkeeper.ingest.watcher`, "Observer choice").

Starting, falling back, stopping and the inotify overflow handler live here; what to do with an
event (classify, queue, reconcile) stays in the watcher. ``watchdog`` is imported lazily: only the
daemon needs it.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.ingest.catalog import Catalog

__all__ = ["HotObserver", "count_inotify_watches"]

log = get_logger("ckptkeeper.ingest.watcher")
"""The watcher's logger: observer lines belong to the watcher's story (and keep their name)."""


class _InotifyOverflow(logging.Handler):
    """watchdog rebuilds its watches after an inotify queue overflow but events are lost: rescan."""

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self._on_overflow = on_overflow

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self._on_overflow()


class HotObserver:
    """Observer steps of the :class:`~ckptkeeper.ingest.watcher.Watcher`; the watcher provides
    the attributes and methods declared here."""

    catalog: Catalog
    root: str
    polling: bool
    fallback_reason: str | None
    _observer: Any
    _observer_factory: Callable[[bool], Any]
    _overflow_handler: _InotifyOverflow | None

    def mark_untrusted(self, reason: str) -> None:
        raise NotImplementedError

    def request_full(self) -> None:
        raise NotImplementedError

    def _on_event(self, event: Any) -> None:
        raise NotImplementedError

    def _unwatched_directories(self) -> int:
        raise NotImplementedError

    @staticmethod
    def _default_observer(polling: bool) -> Any:
        if polling:
            from watchdog.observers.polling import PollingObserver

            return PollingObserver
        from watchdog.observers.inotify import InotifyObserver

        return InotifyObserver

    def _event_filter(self, polling: bool) -> list[Any] | None:
        if polling:
            return None  # the polling emitter reports changes as "modified"; keep everything
        from watchdog.events import (
            DirCreatedEvent,
            DirDeletedEvent,
            DirMovedEvent,
            FileClosedEvent,
            FileCreatedEvent,
            FileDeletedEvent,
            FileModifiedEvent,
            FileMovedEvent,
        )

        # FileModifiedEvent (IN_MODIFY) is needed because the hook appends to commits.jsonl on a
        # descriptor it keeps open: no IN_CLOSE_WRITE follows a commit. The kernel coalesces
        # consecutive identical IN_MODIFY events, which keeps big checkpoint writes affordable.
        # No opened / closed-no-write events: our own hashing reads would feed back into work.
        return [
            FileCreatedEvent,
            DirCreatedEvent,
            FileDeletedEvent,
            DirDeletedEvent,
            FileMovedEvent,
            DirMovedEvent,
            FileClosedEvent,
            FileModifiedEvent,
        ]

    def _start_observer(self) -> None:
        settings = self.catalog.settings.daemon
        polling = settings.polling
        if not polling:
            try:
                self._observer = self._make_observer(polling=False)
                self._observer.start()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EMFILE):
                    self._discard_observer()
                    raise
                self._discard_observer()
                self._fall_back(
                    f"{exc.strerror or exc} (raise fs.inotify.max_user_watches / max_user_instances, "
                    "or set daemon.polling = true)"
                )
                polling = True
            else:
                missing = self._unwatched_directories()
                if missing:
                    self._stop_observer()
                    self._fall_back(
                        f"inotify watch limit reached: {missing} directories under {self.root} could not be "
                        "watched (raise fs.inotify.max_user_watches, or set daemon.polling = true)"
                    )
                    polling = True
        if polling:
            self._observer = self._make_observer(polling=True)
            self._observer.start()
        self.polling = polling
        if not polling:
            self._overflow_handler = _InotifyOverflow(self._on_overflow)
            logging.getLogger("watchdog.observers.inotify").addHandler(self._overflow_handler)
        log.info(
            "watching hot tier",
            root=self.root,
            observer="polling" if polling else "inotify",
            polling_interval=settings.polling_interval if polling else None,
        )

    def _on_overflow(self) -> None:
        self.mark_untrusted("inotify queue overflow")
        self.request_full()

    def _make_observer(self, *, polling: bool) -> Any:
        cls = self._observer_factory(polling)
        # The polling observer's timeout is its polling interval; inotify's is only a read timeout.
        observer = cls(timeout=self.catalog.settings.daemon.polling_interval) if polling else cls()
        observer.schedule(_Handler(self), self.root, recursive=True, event_filter=self._event_filter(polling))
        return observer

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.error("inotify unavailable, falling back to the polling observer", reason=reason, root=self.root)

    def _discard_observer(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            # A never-started InotifyObserver already runs its inotify reader thread: stop it.
            try:
                observer.stop()
            except Exception:
                log.debug("observer cleanup failed", exc_info=True)
            if observer.is_alive():
                observer.join()

    def _stop_observer(self) -> None:
        if self._overflow_handler is not None:
            logging.getLogger("watchdog.observers.inotify").removeHandler(self._overflow_handler)
            self._overflow_handler = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            if observer.is_alive():
                observer.join()


class _Handler:
    """Minimal watchdog handler: the observer thread only classifies and enqueues."""

    def __init__(self, watcher: HotObserver) -> None:
        self._watcher = watcher

    def dispatch(self, event: Any) -> None:
        try:
            self._watcher._on_event(event)
        except Exception:  # never let one odd path kill the observer thread
            log.exception("watcher event handling failed", path=str(getattr(event, "src_path", "")))


def count_inotify_watches() -> int | None:
    """Inotify watches held by this process, from ``/proc/self/fdinfo`` (None if unknowable)."""
    fdinfo = Path("/proc/self/fdinfo")
    total = 0
    found = False
    try:
        entries = list(fdinfo.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry.name}")
        except OSError:
            continue
        if target != "anon_inode:inotify":
            continue
        try:
            text = entry.read_text()
        except OSError:
            continue
        found = True
        total += sum(1 for line in text.splitlines() if line.startswith("inotify wd:"))
    return total if found else None
