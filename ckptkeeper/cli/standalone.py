"""``ckptkeeper restore ... --no-daemon`` in this process, without loading click or the commands.

A standalone restore (no daemon: a laptop, a node whose service is down, the first restore of a
fresh job) pays its process's start-up on top of the transfer. With the config's validated values
remembered (:mod:`ckptkeeper.config_cache`), what is left of that start-up is mostly imports, and
click with the command group was a fifth of them (bench/restore_s3.py). This module runs the plain
command line, ``[--config FILE] restore RUN [--step N|latest|best] --to DIR [--json] --no-daemon``
(as :mod:`ckptkeeper.cli.served` reads it), itself: the same restore, the same text on the same
streams, the same exit codes as the click command.

Anything else goes to click untouched: another command or option, a terminal on stderr (the
progress line), and a config whose values are not remembered (validating it loads pydantic, and
its errors are reported there).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckptkeeper.actions.errors import EXIT_ACTION_FAILED, EXIT_LOCKED, EXIT_OK, IndexUnusable, Locked
from ckptkeeper.cli.exiting import exit_now

if TYPE_CHECKING:
    from ckptkeeper.config import Settings
    from ckptkeeper.index import Index

__all__ = ["IndexOpenFailed", "attempt", "configure", "opened_index", "print_restored", "run"]

NO_DAEMON = "--no-daemon"
_VALUE_OPTIONS = ("--config", "--step", "--to")


Parsed = tuple[str | None, str, str | int, str, bool]
"""(config, run, step, to, --json) of a plain restore command line."""


def run(argv: list[str], parse: Callable[[list[str]], Parsed | None]) -> int | None:
    """The exit code of the restore ``argv`` asks for, run here; None: not one this module runs
    (nothing was done, nothing printed: give ``argv`` to click). ``parse``: the thin client's
    reading of a plain restore command line (``ckptkeeper.cli.served``), which it also runs."""
    rest = _without_no_daemon(argv)
    if rest is None or sys.stderr.isatty():
        return None
    parsed = parse(rest)
    if parsed is None:
        return None
    config, run_name, step, to, as_json = parsed
    from ckptkeeper.config_cache import load_view

    view = load_view(config)
    if view is None:
        return None
    settings = cast("Settings", view)  # every value and method of Settings a restore reads
    configure(settings)
    from ckptkeeper.actions.restore import restore_to

    try:
        with opened_index(settings) as ix:
            restored = restore_to(settings, ix, run_name, step, Path(to), progress=_no_progress)
    except IndexOpenFailed as exc:
        return _fail(str(exc), exc.code)
    except LookupError as exc:
        return _fail(str(exc), EXIT_ACTION_FAILED)
    print_restored(restored.to_json(), run_name, as_json)
    return EXIT_OK


def attempt(argv: list[str], parse: Callable[[list[str]], Parsed | None]) -> None:
    """Run the restore ``argv`` asks for here and end the process, when :func:`run` can; return
    (nothing done) when it cannot. The console script's way in, with ``--no-daemon`` given or
    added once the daemon did not serve the restore."""
    try:
        code = run(argv, parse)
    except KeyboardInterrupt:  # as click ends a command on Ctrl-C
        print("\nAborted!", file=sys.stderr, flush=True)
        sys.exit(EXIT_ACTION_FAILED)
    if code is not None:
        exit_now(code)


def _without_no_daemon(argv: list[str]) -> list[str] | None:
    """``argv`` less its one ``--no-daemon`` flag after ``restore``; None without exactly one."""
    if argv.count(NO_DAEMON) != 1 or "restore" not in argv:
        return None
    at = argv.index(NO_DAEMON)
    if at < argv.index("restore") or argv[at - 1] in _VALUE_OPTIONS:
        return None
    return argv[:at] + argv[at + 1 :]


def _no_progress(done: int, total: int) -> None:
    """No terminal on stderr: no progress line (as the click command)."""


def _fail(message: str, code: int) -> int:
    _echo(f"ckptkeeper: {message}", err=True)
    return code


def _echo(text: str, *, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def configure(settings: Settings) -> None:
    """What every command does with its config first: the log level, the requests' deadline."""
    from ckptkeeper.storage import deadline
    from ckptkeeper.util import logs

    logs.configure(settings.log_level)
    deadline.configure(settings.request_timeout)  # every command's requests, not only a pass's


class IndexOpenFailed(Exception):
    """The index could not be opened: ``str()`` is the message, ``code`` the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def opened_index(settings: Settings, *, rebuild: bool = False) -> Iterator[Index]:
    """The index of ``settings``, closed after; ``rebuild`` (scan, prune): check it and rebuild a
    corrupt one from the tiers. Raises :class:`IndexOpenFailed` when it cannot be opened."""
    # Imported here (sqlite, the catalog and its layouts): not for --help.
    from ckptkeeper.actions.index import open_index

    try:
        ix = open_index(settings, check=rebuild, rebuild=rebuild)
    except IndexUnusable as exc:
        raise IndexOpenFailed(str(exc), EXIT_ACTION_FAILED) from None
    except Locked as exc:
        raise IndexOpenFailed(f"{exc}; try again later", EXIT_LOCKED) from None
    except Exception as exc:  # sqlite3 errors carry the reason; the path is what users need
        raise IndexOpenFailed(f"cannot open index {settings.index}: {exc}", EXIT_ACTION_FAILED) from None
    try:
        yield ix
    finally:
        ix.close()


def print_restored(doc: dict[str, Any], run: str, as_json: bool, echo: Callable[..., None] = _echo) -> None:
    """What ``restore`` prints: a warning per newer checkpoint skipped, then where it went."""
    for skipped in doc["skipped"]:
        echo(
            f"ckptkeeper: warning: {run}@{skipped['step']} has no verified copy left ({skipped['error']}); "
            f"restored the previous checkpoint, {run}@{doc['step']}",
            err=True,
        )
    if as_json:
        echo(json.dumps(doc, indent=2, sort_keys=False))
    else:
        echo(doc["path"])
