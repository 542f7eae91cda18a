"""``scrub``: re-hash a slice of the slower tiers' copies now (the daemon's ``scrub`` job, by hand)."""

from __future__ import annotations

import sys
from typing import Any

import click

from ckptkeeper.cli.context import EXIT_USAGE, Context, emit_json, fail, pass_ctx
from ckptkeeper.util.fmt import human_bytes


def _parse_budget(_ctx: Any, _param: Any, value: str | None) -> int | None:
    if value is None:
        return None
    from ckptkeeper.core.preflight import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option("--tier", default=None, help="Scrub this slower tier only (default: every slower tier).")
@click.option(
    "--budget",
    default=None,
    callback=_parse_budget,
    help="Bytes to re-hash in this pass, e.g. 10GiB (default: daemon.scrub_rate x min(interval, 30m)).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def scrub(app: Context, tier: str | None, budget: int | None, as_json: bool) -> None:
    """Re-hash the copies verified longest ago against their manifests; exit 1 on a bad copy.

    Reads at most daemon.scrub_rate bytes per second. A bad copy is marked damaged (`ls` shows it)
    and copied again from a good copy by the next prune; nothing is deleted.
    """
    from ckptkeeper.actions.scrub import ScrubUsage, run_scrub  # storage, fsspec: not for --help

    settings = app.settings
    with app.index() as ix:
        ix.job_started("scrub")
        try:
            report = run_scrub(settings, ix, tier=tier, budget=budget)
        except ScrubUsage as exc:
            ix.job_finished("scrub", str(exc))
            fail(str(exc), EXIT_USAGE)
        error = None
        if report.exit_code:
            error = f"{len(report.bad)} bad copies, {len(report.errors)} not checked, " + (
                f"{len(report.no_good_copy)} checkpoints without a good copy"
            )
        ix.job_finished("scrub", error)
    if as_json:
        emit_json(report.to_dict())
    else:
        for b in report.bad:
            click.echo(f"BAD {b.run}@{b.step} in {b.tier}: {b.problem} ({b.next})")
        for e in report.errors:
            click.echo(f"NOT CHECKED {e}")
        for lost in report.no_good_copy:
            where = ", ".join(f"{t}: {p}" for t, p in sorted(lost["damaged"].items()))
            click.echo(f"NO GOOD COPY {lost['run']}@{lost['step']}: {where} (kept, never deleted)")
        click.echo(
            f"scrubbed {len(report.checked)} copies, {human_bytes(report.bytes)} of a "
            f"{human_bytes(report.budget)} budget: {len(report.bad)} bad"
            + (f", {report.repaired} whole again" if report.repaired else "")
            + (
                f"; {report.deferred} copies ({human_bytes(report.deferred_bytes)}) left for later passes"
                if report.deferred
                else ""
            )
        )
    sys.exit(report.exit_code)


COMMANDS = (scrub,)
