"""CLI commands that drive the planner and executor: prune, restore, verify, daemon, demo."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach the commands of this module to the ``ckptkeeper`` group."""
