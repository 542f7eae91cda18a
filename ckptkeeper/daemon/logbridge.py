"""Route the standard library's logging (APScheduler, watchdog) and Python warnings through
structlog, so journald gets one JSON format from the whole daemon."""

from __future__ import annotations

import logging
import warnings

from ckptkeeper.util.logs import get_logger

__all__ = ["bridge_stdlib_logging"]


class _StdlibBridge(logging.Handler):
    """Route stdlib logging (APScheduler, watchdog) through structlog, so journald gets one format."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            logger = get_logger(record.name)
            method = getattr(logger, record.levelname.lower(), logger.warning)
            if record.exc_info:
                method(record.getMessage(), exc_info=record.exc_info)
            else:
                method(record.getMessage())
        except Exception:  # logging must never raise into the code that logs
            self.handleError(record)


def bridge_stdlib_logging() -> logging.Handler:
    """Install the bridge on the root logger; the caller removes the returned handler on exit."""
    handler = _StdlibBridge(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)  # Python warnings become JSON log lines too
    # watchdog warns when its recursive registration races a `mkdir -p` under the hot tier; the watch
    # is re-registered and nothing is lost, so it is noise in the journal.
    warnings.filterwarnings("ignore", message="Callback with id", category=RuntimeWarning)
    # "Running job ..." / "Added job ..." every interval is noise in the journal.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    return handler
