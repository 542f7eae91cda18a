"""``undelete`` and ``ls --deleted``: the undo window's commands (docs/undo-window.md)."""

from __future__ import annotations

import time

import click

from ckptkeeper.cli.context import (
    EXIT_ACTION_FAILED,
    EXIT_LOCKED,
    Context,
    emit_json,
    fail,
    pass_ctx,
)
from ckptkeeper.util.fmt import human_bytes, table


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def ls_deleted(app: Context, run: str | None, as_json: bool) -> None:
    """``ls --deleted``: what ``undelete`` can bring back, and until when."""
    from ckptkeeper.actions.undo import deleted

    with app.index() as ix:
        entries = deleted(app.settings, ix, run)
    if as_json:
        emit_json({"deleted": entries})
        return
    if not entries:
        click.echo("nothing in the trash (tiers without undo_window delete at once)")
        return
    rows = [
        [
            e["run"],
            str(e["step"]),
            e["tier"],
            human_bytes(e["bytes"]),
            _when(e["deleted_at"]),
            _when(e["expires_at"]),
        ]
        for e in entries
    ]
    click.echo(table(["RUN", "STEP", "TIER", "SIZE", "DELETED", "PURGED AFTER"], rows, right=[1, 3]))


@click.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@click.option(
    "--tier", default=None, help="Undelete from this tier's trash (default: the fastest holding it)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def undelete(app: Context, run: str, step: int, tier: str | None, as_json: bool) -> None:
    """Bring back a checkpoint an expiry or a reap moved into the trash (tiers with undo_window)."""
    from ckptkeeper.actions.errors import Locked
    from ckptkeeper.actions.undo import NothingToUndelete, UndeleteRefused
    from ckptkeeper.actions.undo import undelete as do_undelete

    with app.index() as ix:
        try:
            done = do_undelete(app.settings, ix, run, step, tier)
        except NothingToUndelete as exc:
            fail(str(exc), EXIT_ACTION_FAILED)
        except UndeleteRefused as exc:
            fail(f"undelete refused: {exc}", EXIT_ACTION_FAILED)
        except Locked as exc:
            fail(f"{exc}; try again later", EXIT_LOCKED)
    if as_json:
        emit_json(done.to_dict())
    else:
        e = done.entry
        click.echo(
            f"undeleted {run}@{step} in {e.tier}: {e.rel_path} ({human_bytes(e.bytes)}), checked against its manifest"
        )


COMMANDS = (undelete,)
