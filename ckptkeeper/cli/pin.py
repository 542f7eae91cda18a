"""``pin`` / ``unpin``: protect a checkpoint from retention and reaping, or release it."""

from __future__ import annotations

import click

from ckptkeeper.cli.context import EXIT_ACTION_FAILED, EXIT_USAGE, Context, emit_json, fail, pass_ctx


def _set_pin(app: Context, run: str, step: int, pinned: bool, as_json: bool) -> None:
    from ckptkeeper.actions.pins import set_pin  # storage backends: not for --help

    with app.index() as ix:
        outcome = set_pin(app.settings, ix, run, step, pinned)
    if not outcome.names:
        fail(f"no checkpoint {run}@{step} in the index (try `ckptkeeper ls {run}`)", EXIT_USAGE)
    if as_json:
        emit_json(outcome.to_dict())
    if outcome.failed and not pinned:
        _tier_errors(outcome.failed)
        fail(
            f"{run}@{step} stays pinned: its pin object could not be removed from "
            f"{', '.join(sorted(outcome.failed))} (it would pin it again); run `ckptkeeper unpin` again",
            EXIT_ACTION_FAILED,
        )
    if not as_json:
        click.echo(f"{'pin' if pinned else 'unpin'}ned {run}@{step}")
    if outcome.failed:
        _tier_errors(outcome.failed)
        fail(
            f"{run}@{step} is pinned in the index, but its pin object is missing from "
            f"{', '.join(sorted(outcome.failed))}: a lost index would lose this pin; run `ckptkeeper pin` again",
            EXIT_ACTION_FAILED,
        )


def _tier_errors(failed: dict[str, str]) -> None:
    for tier, error in sorted(failed.items()):
        click.echo(f"ckptkeeper: tier {tier}: {error}", err=True)


@click.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pin(app: Context, run: str, step: int, as_json: bool) -> None:
    """Protect a checkpoint from retention and reaping."""
    _set_pin(app, run, step, True, as_json)


@click.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def unpin(app: Context, run: str, step: int, as_json: bool) -> None:
    """Release a pinned checkpoint back to its tier policies."""
    _set_pin(app, run, step, False, as_json)


COMMANDS = (pin, unpin)
