"""``history``: what happened to this node's checkpoints (docs/history.md)."""

from __future__ import annotations

import time

import click

from ckptkeeper.cli.context import EXIT_USAGE, Context, emit_json, fail, out_width, pass_ctx
from ckptkeeper.util.fmt import human_bytes, table


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@click.command()
@click.argument("run", required=False)
@click.option("--step", type=click.IntRange(min=0), default=None, help="Only this step of RUN.")
@click.option("--since", default=None, metavar="DURATION", help="Only events this recent, e.g. 7d, 12h.")
@click.option("--node", default=None, help="Another node's checkpoints (the fleet records in shared tiers).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def history(
    app: Context, run: str | None, step: int | None, since: str | None, node: str | None, as_json: bool
) -> None:
    """What happened to checkpoints: every action with its time, rule, reason and outcome."""
    from ckptkeeper.actions.history import read_history
    from ckptkeeper.config import parse_duration

    if step is not None and run is None:
        fail("--step needs a RUN", EXIT_USAGE)
    cutoff = None
    if since is not None:
        try:
            cutoff = time.time() - parse_duration(since)
        except ValueError as exc:
            fail(f"--since: {exc}", EXIT_USAGE)
    with app.index() as ix:
        view = read_history(app.settings, ix, run, step, cutoff, node=node)
    if as_json:
        emit_json(view.to_dict())
        return
    for note in view.notes:
        click.echo(f"note: {note}", err=True)
    if not view.events:
        click.echo(
            "no actions recorded" + (f" for {run}" if run else "") + (f"@{step}" if step is not None else "")
        )
        return
    rows = [
        [
            _when(e.at),
            e.action,
            e.run or "-",
            "-" if e.step is None else str(e.step),
            (e.tier or "-") + (f"->{e.to_tier}" if e.to_tier else ""),
            human_bytes(e.bytes),
            e.node + (f" (of {e.owner})" if e.owner else ""),
            e.outcome if not e.error else f"{e.outcome}: {e.error}",
            e.reason,
        ]
        for e in view.events
    ]
    headers = ["TIME", "ACTION", "RUN", "STEP", "TIER", "SIZE", "NODE", "OUTCOME", "REASON"]
    click.echo(table(headers, rows, right=(3, 5), width=out_width()))


COMMANDS = (history,)
