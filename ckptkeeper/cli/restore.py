"""Commands that read checkpoints back: ``restore`` and ``verify``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptkeeper.cli.context import EXIT_ACTION_FAILED, EXIT_OK, EXIT_USAGE, Context, fail, pass_ctx


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
@click.option(
    "--step",
    type=_StepType(),
    default="latest",
    show_default=True,
    help="A step number, latest (the newest verified checkpoint) or best (see --metric).",
)
@click.option(
    "--to", "to", type=click.Path(file_okay=False), required=True, help="Directory to restore into."
)
@click.option("--metric", default=None, help="With --step best: the metric that ranks checkpoints.")
@click.option(
    "--mode",
    type=click.Choice(["min", "max"]),
    default=None,
    help="With --step best: lower (min, the default) or higher (max) --metric is better.",
)
@click.option(
    "--node",
    default=None,
    help="Restore another node's run of this name from the shared tiers (needed when several hold one).",
)
@click.option(
    "--part",
    type=click.IntRange(min=0),
    default=None,
    help="A checkpoint spanning nodes: fetch only part K (from 0) instead of every part.",
)
@click.option("--json", "as_json", is_flag=True, help="Print where it went as JSON.")
@click.option(
    "--no-daemon",
    is_flag=True,
    help="Run the restore in this process even when this node's daemon could serve it.",
)
@pass_ctx
def restore(
    app: Context,
    run: str,
    step: str | int,
    to: str,
    metric: str | None,
    mode: str | None,
    node: str | None,
    part: int | None,
    as_json: bool,
    no_daemon: bool,
) -> None:
    """Materialise a checkpoint from whichever tier holds it, verified.

    --step best without --metric takes the framework's own record of its best checkpoint (HF
    best_model_checkpoint, Lightning best_model_path), else the first tier's `metric`. On a
    terminal, stderr shows bytes, rate and ETA while it copies. A checkpoint spanning nodes is
    gathered whole from the shared tiers (every part), or only --part K. When this node's daemon
    runs the same config, it does the work (no start-up cost here); else, or with --no-daemon, this
    process does.
    """
    from ckptkeeper.cli.progress import terminal_progress

    bar = terminal_progress()
    label = f"restore {run}@{step}"

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.update(label, done, total)

    if (metric is not None or mode is not None) and step != "best":
        fail("--metric and --mode only apply to --step best", EXIT_USAGE)
    if not no_daemon:
        from ckptkeeper.daemon.client import absolute

        args = {"run": run, "step": step, "to": absolute(to), "metric": metric, "mode": mode}
        args |= {"node": node, "part": part}
        served = by_daemon(app, "restore", args, progress if bar is not None else None, to)
        if served is not None:
            _print_restored(served, run, as_json)
            return
    from ckptkeeper.actions.restore import restore_to  # storage, fsspec: not for --help

    settings = app.settings_to_read()
    with app.index() as ix:
        try:
            restored = restore_to(
                settings,
                ix,
                run,
                step,
                Path(to),
                progress=progress,
                metric=metric,
                mode=mode,
                node=node,
                part=part,
            )
        except LookupError as exc:
            fail(str(exc), EXIT_ACTION_FAILED)
    _print_restored(restored.to_json(), run, as_json)


def _print_restored(doc: dict[str, Any], run: str, as_json: bool) -> None:
    from ckptkeeper.cli.standalone import print_restored

    print_restored(doc, run, as_json, echo=click.echo)


def by_daemon(
    app: Context,
    op: str,
    args: dict[str, Any],
    progress: Callable[[int, int], None] | None,
    to: str | None = None,
) -> dict[str, Any] | None:
    """The result document of ``op`` run by this node's daemon (a failure exits as it would
    here); None: no daemon served it, run it here. ``to``: restore's ``--to`` as given."""
    if "to" in args and args["to"] is None:
        return None
    from ckptkeeper.daemon.client import as_given, call

    served = call(app.config_path, op, args, progress=progress)
    if served is None:
        return None
    if served.exit != EXIT_OK or served.doc is None:
        message = served.message or "the daemon failed without a reason"
        fail(as_given(message, to), served.exit or EXIT_ACTION_FAILED)
    doc = served.doc
    if to is not None and doc.get("from_tier") is not None and isinstance(doc.get("path"), str):
        # The hot copy returned in place (from_tier null) is named by the hot tier, not by --to.
        doc = {**doc, "path": as_given(doc["path"], to)}
    return doc


@click.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
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
