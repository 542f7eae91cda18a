"""``scan``: reconcile the index with every tier now."""

from __future__ import annotations

import sys

import click

from ckptkeeper.cli.context import EXIT_ACTION_FAILED, Context, emit_json, pass_ctx
from ckptkeeper.util.fmt import human_bytes


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the reconcile report as JSON.")
@pass_ctx
def scan(app: Context, as_json: bool) -> None:
    """Reconcile the index with every tier now."""
    from ckptkeeper.ingest.catalog import Catalog  # layouts, fsspec: not for --help

    with app.index(rebuild=True) as ix:
        report = Catalog(app.settings, ix).reconcile()
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(
            f"scanned {report.runs} runs: {report.new} new, {report.new_versions} rewritten, "
            f"{report.unchanged} unchanged, {report.removed} removed, {report.partial} partial, "
            f"{report.corrupt} corrupt; hashed {human_bytes(report.hashed_bytes)}"
        )
        if report.quarantined:
            click.echo(
                f"{report.quarantined} document(s) quarantined (ignored, nothing deleted for them): "
                "see `ckptkeeper ls` / `ckptkeeper status`",
                err=True,
            )
        for tier, error in report.tiers_failed.items():
            click.echo(
                f"tier {tier} unavailable (treated as unknown, nothing deleted from it): {error}", err=True
            )
        for where, error in sorted(report.damaged.items()):
            click.echo(
                f"damaged copy {where} not counted (the next prune copies it again): {error}", err=True
            )
    if report.tiers_failed:
        sys.exit(EXIT_ACTION_FAILED)


COMMANDS = (scan,)
