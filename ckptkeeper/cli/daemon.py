"""The ``daemon`` command."""

from __future__ import annotations

import sys

import click

from ckptkeeper.cli.context import Context, pass_ctx


@click.command()
@pass_ctx
def daemon(app: Context) -> None:
    """Watch the hot tier and run retention, reaping and rescans until SIGTERM.

    Meant for systemd (Type=notify: READY, STATUS, WATCHDOG, STOPPING) or a Kubernetes DaemonSet
    (/healthz and /readyz beside /metrics); SIGHUP reloads the config (a bad one is logged and the
    running config kept). One daemon per index.
    """
    settings = app.settings  # exits 2 with one line per problem on a bad config
    from ckptkeeper.util import logs

    logs.configure(settings.log_level, stream=settings.daemon.log_stream)
    from ckptkeeper.daemon.service import run_daemon  # watchdog, apscheduler: not for --help

    sys.exit(run_daemon(app.config_path, settings))


COMMANDS = (daemon,)
