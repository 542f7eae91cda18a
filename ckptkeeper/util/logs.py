"""structlog, configured once: a console renderer for people, JSON lines for journald and machines.

Log lines go to stderr (systemd and a terminal) or, with ``log_stream = "stdout"``, to stdout (a
container, whose runtime collects stdout as the pod's log); the commands' own output (tables,
``--json``) and error messages stay where they were."""

from __future__ import annotations

import json as _json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any

# structlog (and the rich/pygments it may pull in) is imported where it is used: the S3 tier
# registers its credentials here, and an upload or restore logs through the stdlib only.

_configured = False
_secrets: tuple[str, ...] = ()
"""Values no log line may contain (S3 credentials), longest first."""
_pattern: re.Pattern[str] | None = None
"""One regex for all of them (see :func:`_compile`)."""

WHOLE_TOKEN_BELOW = 16
"""Secrets shorter than this are redacted only as whole tokens. A real key is long and random
(AWS: 20-character ids, 40-character secrets) and is redacted wherever it appears; a short one
(``demo``, ``minio``) is also a common word, and replacing it inside ``demo-checkpoints`` blanked a
bucket name while protecting nothing."""
_TOKEN_CHARS = "A-Za-z0-9_\\-"
_secrets_lock = threading.Lock()
_factory_installed = False
_pending: tuple[int, bool, bool, Any] | None = None
"""A configuration recorded before structlog was imported: (level, json, journal, stream)."""
_pending_lock = threading.Lock()


def _structlog() -> Any:
    """structlog, imported without rich unless the process already has it.

    structlog pulls in rich (and pygments) when installed, only to draw exceptions in its console
    renderer: 40 ms of CPU and 5 MiB on every ``ckptkeeper`` command, which logs plain lines
    (bench/prune_e2e.py). A process that imported rich itself keeps structlog's use of it."""
    if "structlog" in sys.modules:
        return sys.modules["structlog"]
    hide = "rich" not in sys.modules
    if hide:
        sys.modules["rich"] = None  # type: ignore[assignment]  # import rich -> ImportError
    try:
        import structlog
    finally:
        if hide and sys.modules.get("rich", 0) is None:
            del sys.modules["rich"]
    return structlog


LOG_STREAMS = ("stderr", "stdout")
"""Where log lines may go (the ``log_stream`` setting)."""


def configure(level: str = "info", *, json: bool | None = None, stream: str = "stderr") -> None:
    """Idempotent. ``json=None`` picks JSON unless the stream is a terminal (systemd captures stderr,
    a container runtime stdout).

    Until the process has imported structlog, the configuration is only recorded: it is applied
    when the first line is logged (:class:`_Deferred`). A command that logs nothing (a restore that
    succeeds) never imports structlog, ~0.2 G instructions of a ~1.3 G instruction process."""
    global _configured, _pending
    out = sys.stdout if stream == "stdout" else sys.stderr
    if json is None:
        json = not out.isatty()
    numeric = getattr(logging, level.upper(), logging.INFO)
    chosen = (numeric, json, json and stream_is_journal(out), out)
    with _pending_lock:
        if "structlog" in sys.modules:
            _pending = None
            _apply(_structlog(), *chosen)
        else:
            _pending = chosen
        _configured = True


def _apply(structlog: Any, numeric: int, json: bool, journal: bool, out: Any) -> None:
    renderer: Any = _Redacting(
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
        journal=journal,
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if json else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None) -> Any:
    if not _configured:
        configure()
    if "structlog" not in sys.modules:
        return _Deferred(name)
    return _structlog_logger(name)


def _structlog_logger(name: str | None) -> Any:
    """structlog's logger for ``name``, the recorded configuration applied first if still pending."""
    global _pending
    structlog = _structlog()
    with _pending_lock:
        if _pending is not None:
            chosen, _pending = _pending, None
            _apply(structlog, *chosen)
    return structlog.get_logger(name) if name else structlog.get_logger()


class _Deferred:
    """A logger that imports structlog (and applies the recorded configuration) when first used."""

    __slots__ = ("_logger", "_name")

    def __init__(self, name: str | None) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, attr: str) -> Any:
        logger = self._logger
        if logger is None:
            logger = self._logger = _structlog_logger(self._name)
        return getattr(logger, attr)


def register_secrets(values: Iterable[str]) -> None:
    """Never log these values (credentials): they are replaced by ``***`` in our own log lines and
    in every stdlib log record of any library — botocore's and s3fs's debug output included, which
    prints request headers (the access key id sits in ``Authorization``, a session token in
    ``X-Amz-Security-Token``). Process-wide on purpose: a handler configured by anyone, at any
    level, only ever sees redacted records."""
    global _secrets, _factory_installed, _pattern
    new = {v for v in values if isinstance(v, str) and len(v) >= 4}
    new |= {_json.dumps(v)[1:-1] for v in new}  # as it appears inside a JSON log line
    with _secrets_lock:
        if new <= set(_secrets):
            return
        _secrets = tuple(sorted(set(_secrets) | new, key=len, reverse=True))
        _pattern = _compile(_secrets)
        if not _factory_installed:
            previous = logging.getLogRecordFactory()

            def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = previous(*args, **kwargs)
                if _secrets:
                    try:
                        message = record.getMessage()
                    except Exception:  # a malformed record is the logging module's problem
                        return record
                    clean = redact(message)
                    if clean != message:
                        record.msg, record.args = clean, ()
                return record

            logging.setLogRecordFactory(factory)
            _factory_installed = True


def _compile(secrets: tuple[str, ...]) -> re.Pattern[str]:
    """Longest first, so a secret that contains another is replaced whole."""
    parts = []
    for secret in secrets:
        escaped = re.escape(secret)
        if len(secret) < WHOLE_TOKEN_BELOW:
            escaped = f"(?<![{_TOKEN_CHARS}]){escaped}(?![{_TOKEN_CHARS}])"
        parts.append(escaped)
    return re.compile("|".join(parts))


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``***`` (short ones as whole tokens)."""
    pattern = _pattern
    return pattern.sub("***", text) if pattern is not None else text


SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}
"""structlog level -> syslog priority, the ``<N>`` prefix journald reads (SyslogLevelPrefix=yes)."""


def stderr_is_journal() -> bool:
    """Whether stderr is connected to journald (see :func:`stream_is_journal`)."""
    return stream_is_journal(sys.stderr)


def stream_is_journal(stream: Any) -> bool:
    """Whether ``stream`` is connected to journald: systemd sets ``$JOURNAL_STREAM`` to the stream's
    ``device:inode``, and only a match counts (a child whose stderr was redirected inherits the
    variable but not the stream)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class _Redacting:
    """Wraps the final structlog renderer: what reaches the log stream/journald has no registered secret.

    With ``journal``, each line starts with its syslog priority (``<4>{"event": ...}``): journald
    strips the prefix and stores the line at that level (``journalctl -p warning`` then works),
    instead of every line at the stream's default, info."""

    def __init__(self, renderer: Any, *, journal: bool = False) -> None:
        self.renderer = renderer
        self.journal = journal

    def __call__(self, logger: Any, method: str, event_dict: Any) -> Any:
        level = str(event_dict.get("level", method)) if self.journal else ""
        out = self.renderer(logger, method, event_dict)
        if _secrets and isinstance(out, str):
            out = redact(out)
        if self.journal and isinstance(out, str):
            out = f"<{SYSLOG_PRIORITY.get(level, 6)}>{out}"
        return out
