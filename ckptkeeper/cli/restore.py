"""Commands that read checkpoints back: ``restore`` and ``verify``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ckptkeeper.cli.context import EXIT_ACTION_FAILED, EXIT_OK, Context, fail, pass_ctx


class _StepType(click.ParamType):
    name = "N|latest|best"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str | int:
        if value in ("latest", "best"):
            return str(value)
        try:
            step = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a step number, 'latest' or 'best'", param, ctx)
        if step < 0:
            self.fail("a step is a non-negative number", param, ctx)
        return step


@click.command()
@click.argument("run")
@click.option("--step", type=_StepType(), default="latest", show_default=True)
@click.option(
    "--to", "to", type=click.Path(file_okay=False), required=True, help="Directory to restore into."
)
@click.option(
    "--node",
    default=None,
    help="Restore another node's run of this name from the shared tiers (needed when several hold one).",
)
@pass_ctx
def restore(app: Context, run: str, step: str | int, to: str, node: str | None) -> None:
    """Materialise a checkpoint from whichever tier holds it, verified."""
    from ckptkeeper.actions.restore import restore_checkpoint  # storage, fsspec: not for --help

    with app.index() as ix:
        try:
            path = restore_checkpoint(app.settings, ix, run, step, Path(to), node=node)
        except LookupError as exc:
            fail(str(exc), EXIT_ACTION_FAILED)
    click.echo(str(path))


@click.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def verify(app: Context, run: str | None, as_json: bool) -> None:
    """Re-hash every copy against its manifest; exit 1 on any mismatch."""
    from ckptkeeper.actions.verify import verify as verify_copies  # storage, fsspec: not for --help

    with app.index() as ix:
        report = verify_copies(app.settings, ix, run)
    if as_json:
        problems = [
            {"run": p.run, "step": p.step, "tier": p.tier, "problem": p.problem} for p in report.problems
        ]
        click.echo(json.dumps({"checked": report.checked, "problems": problems}, indent=2))
    else:
        for p in report.problems:
            click.echo(f"MISMATCH {p.run}@{p.step} in {p.tier}: {p.problem}")
        click.echo(f"verified {report.checked} copies: {len(report.problems)} problems")
    sys.exit(EXIT_ACTION_FAILED if report.problems else EXIT_OK)


COMMANDS = (restore, verify)
