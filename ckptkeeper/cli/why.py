"""``why RUN STEP``: one checkpoint's story in plain words (docs/history.md)."""

from __future__ import annotations

import click

from ckptkeeper.cli.context import EXIT_USAGE, Context, emit_json, fail, out_width, pass_ctx
from ckptkeeper.util.fmt import wrap_text


@click.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@click.option("--node", default=None, help="Another node's checkpoint (the fleet records in shared tiers).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def why(app: Context, run: str, step: int, node: str | None, as_json: bool) -> None:
    """Where a checkpoint's copies are and what keeps them, what the next pass does with it, and
    if it is gone: when, by which rule and node, and whether undelete can bring it back."""
    from ckptkeeper.actions.why import NothingKnown
    from ckptkeeper.actions.why import why as tell

    with app.index() as ix:
        try:
            story = tell(app.settings, ix, run, step, node=node)
        except NothingKnown as exc:
            fail(str(exc), EXIT_USAGE)
    if as_json:
        emit_json(story.to_dict())
        return
    width = out_width()
    click.echo(f"{run}@{step} on {story.node}: {story.state}")
    for line in story.lines:
        click.echo(wrap_text(line, width))
    for note in story.notes:
        click.echo(wrap_text(f"note: {note}", width))


COMMANDS = (why,)
