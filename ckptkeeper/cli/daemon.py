"""The ``daemon`` command (kept apart so ``cli.py`` stays presentation-only and imports stay lazy).

It deliberately does not import :mod:`ckptkeeper.cli.main`: when run as ``python -m ckptkeeper.cli``
that module is ``__main__``, and importing it by name would build a second command group.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ckptkeeper.cli.app import Context


def register(group: click.Group) -> None:
    """Attach ``daemon`` to the ``ckptkeeper`` group."""

    @group.command()
    @click.pass_obj
    def daemon(app: Context) -> None:
        """Watch the hot tier and run retention, reaping and rescans until SIGTERM.

        Meant for systemd (Type=notify: READY, STATUS, WATCHDOG, STOPPING); SIGHUP reloads the
        config (a bad one is logged and the running config kept). One daemon per index.
        """
        settings = app.settings  # exits 2 with one line per problem on a bad config
        from ckptkeeper.daemon.service import run_daemon

        sys.exit(run_daemon(app.config_path, settings))
