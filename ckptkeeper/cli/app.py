"""The ``ckptkeeper`` command group: the global options, and the commands of the other modules.

Each command module imports :mod:`ckptkeeper.cli.context` and nothing heavier at load time (the
config, index, planner, storage and daemon are imported inside the commands), so ``ckptkeeper
--help`` stays fast.
"""

from __future__ import annotations

import click

from ckptkeeper import __version__
from ckptkeeper.cli import (
    daemon,
    demo,
    fleet,
    history,
    job,
    ls,
    pin,
    preflight,
    prune,
    restore,
    scan,
    scrub,
    status,
    undo,
    why,
)
from ckptkeeper.cli.context import Context


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Config file (default: $CKPTKEEPER_CONFIG, else /etc/ckptkeeper/config.toml).",
)
@click.version_option(__version__, prog_name="ckptkeeper")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """Catalog, tier and reap ML training checkpoints on this node."""
    ctx.obj = Context(config_path)


for _module in (
    scan,
    ls,
    status,
    pin,
    prune,
    history,
    why,
    preflight,
    restore,
    scrub,
    undo,
    fleet,
    daemon,
    demo,
    job,
):
    for _command in _module.COMMANDS:
        main.add_command(_command)
