"""The entry point: a ``restore`` the node's daemon serves, without loading click or the commands.

With a daemon up, ``ckptkeeper restore`` is a thin client (:mod:`ckptkeeper.daemon.client`) and
its own start-up is most of what it costs: the interpreter, then click and the command group
(about a third of the client's CPU). This module reads the usual command lines itself,
``[--config FILE] restore RUN [--step N|latest|best] --to DIR [--json]``, asks the daemon, and
prints what the click command prints when it is served (the same text, stream and exit code).

Anything else goes to the full command line (:mod:`ckptkeeper.cli.app`) untouched: another
command or option, a value click would refuse or read differently, a terminal on stderr (the
progress line is drawn there), or a daemon that does not serve the restore; in that last case
with ``--no-daemon`` added, so that it is not asked twice and the restore runs in this process
(without click too when the config was validated before: :mod:`ckptkeeper.cli.standalone`).
Standard library only, like the thin client.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

from ckptkeeper.cli.exiting import exit_now

__all__ = ["run", "serve"]

_MAX_STEP = 2**63 - 1
_EXIT_OK, _EXIT_ACTION_FAILED = 0, 1


def run() -> None:
    """The ``ckptkeeper`` console script and ``python -m ckptkeeper.cli``."""
    argv = sys.argv[1:]
    try:
        outcome = serve(argv)
    except KeyboardInterrupt:  # as click ends a command on Ctrl-C (the daemon has cleaned up)
        _echo("", err=True)
        _echo("Aborted!", err=True)
        sys.exit(_EXIT_ACTION_FAILED)
    if isinstance(outcome, int):
        exit_now(outcome)
    if outcome is not argv:  # no daemon served it: the restore runs here, without click if it can
        from ckptkeeper.cli import standalone

        standalone.attempt(outcome, _parse)
    from ckptkeeper.cli.app import main

    if outcome is argv:
        main()
    else:
        main(args=outcome)


def serve(argv: list[str]) -> int | list[str]:
    """The exit code of a restore the daemon served (its output printed), else the command line
    for the full CLI: ``argv`` itself, or ``argv`` plus ``--no-daemon`` once the daemon was asked."""
    parsed = _parse(argv)
    if parsed is None or sys.stderr.isatty():
        return argv
    config, run_name, step, to, as_json = parsed
    from ckptkeeper.daemon.client import absolute, as_given, call

    target = absolute(to)
    if target is None:
        return argv

    args = {"run": run_name, "step": step, "to": target, "metric": None, "mode": None}
    served = call(config, "restore", args | {"node": None, "part": None})
    if served is None:
        return [*argv, "--no-daemon"]
    if served.exit != _EXIT_OK or served.doc is None:
        _echo(f"ckptkeeper: {as_given(served.message or 'the daemon failed without a reason', to)}", err=True)
        return served.exit or _EXIT_ACTION_FAILED
    doc: dict[str, Any] = served.doc
    if doc.get("from_tier") is not None and isinstance(doc.get("path"), str):
        # The hot copy returned in place (from_tier null) is named by the hot tier, not by --to.
        doc = {**doc, "path": as_given(doc["path"], to)}
    for skipped in doc.get("skipped") or ():
        _echo(
            f"ckptkeeper: warning: {run_name}@{skipped['step']} has no verified copy left ({skipped['error']}); "
            f"restored the previous checkpoint, {run_name}@{doc['step']}",
            err=True,
        )
    if as_json:
        import json

        _echo(json.dumps(doc, indent=2, sort_keys=False))
    else:
        _echo(str(doc["path"]))
    return _EXIT_OK


def _parse(argv: list[str]) -> tuple[str | None, str, str | int, str, bool] | None:
    """(config, run, step, to, --json) of a plain restore command line; None for anything else
    (left to click, which parses it, or explains what is wrong with it)."""
    config: str | None = None
    i = 0
    while i < len(argv) and argv[i] != "restore":
        name, value, i = _option(argv, i)
        if name != "--config" or config is not None or not value or os.path.isdir(value):
            return None  # click refuses a directory (dir_okay=False)
        config = value
    if i == len(argv):
        return None
    i += 1
    run_name: str | None = None
    values: dict[str, str] = {}
    as_json = False
    while i < len(argv):
        token = argv[i]
        if token == "--json" and not as_json:
            as_json, i = True, i + 1
        elif token.startswith("-"):
            name, value, i = _option(argv, i)
            if name not in ("--step", "--to") or name in values or not value or value.startswith("-"):
                return None
            values[name] = value
        elif run_name is None and token:
            run_name, i = token, i + 1
        else:
            return None
    step = _step(values.get("--step", "latest"))
    to = values.get("--to")
    if run_name is None or step is None or to is None or _is_file(to):
        return None
    return config, run_name, step, to, as_json


def _option(argv: list[str], i: int) -> tuple[str, str | None, int]:
    """(name, value, next index) of the long option at ``argv[i]``, ``--name=value`` or
    ``--name value``; the value is None when there is none."""
    name, eq, value = argv[i].partition("=")
    if eq:
        return name, value, i + 1
    if i + 1 < len(argv):
        return name, argv[i + 1], i + 2
    return name, None, i + 1


def _step(value: str) -> str | int | None:
    if value in ("latest", "best"):
        return value
    if value.isascii() and value.isdigit() and int(value) <= _MAX_STEP:
        return int(value)
    return None


def _is_file(path: str) -> bool:
    """``--to`` names a regular file (click refuses it: ``file_okay=False``)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _echo(text: str, *, err: bool = False) -> None:
    """As ``click.echo``: one line, ANSI styles dropped when the stream is not a terminal."""
    stream = sys.stderr if err else sys.stdout
    if "\x1b" in text and not stream.isatty():
        import re

        text = re.sub(r"\033\[[;?0-9]*[a-zA-Z]", "", text)
    stream.write(text + "\n")
    stream.flush()
