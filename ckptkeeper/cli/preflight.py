"""``preflight``: will this node sustain this job's checkpoints? Measure, check, render."""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.actions.errors import Locked
from ckptkeeper.cli.context import EXIT_LOCKED, EXIT_USAGE, Context, emit_json, fail, pass_ctx
from ckptkeeper.util.fmt import format_duration, human_bytes, table

if TYPE_CHECKING:
    from ckptkeeper.actions.preflight import PreflightReport


def _parse_size(_ctx: Any, _param: Any, value: str | None) -> int | None:
    if value is None:
        return None
    from ckptkeeper.core.preflight import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _parse_duration(_ctx: Any, _param: Any, value: str | None) -> float | None:
    if value is None:
        return None
    from ckptkeeper.config import parse_duration

    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if seconds <= 0:
        raise click.BadParameter("must be more than 0 seconds")
    return seconds


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if value < 120 else format_duration(round(value))


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{human_bytes(value)}/s"


def _render(report: PreflightReport) -> None:
    click.echo(
        f"preflight  save {human_bytes(report.size)} every {format_duration(report.every)}; "
        f"synthetic saves of {human_bytes(report.sample_bytes)} x {max(1, len(report.rounds))}"
    )
    click.echo("")
    t = report.throughput
    click.echo(
        table(
            ["hot write", "hot -> warm", "upload to cold", "restore", "RPO"],
            [
                [
                    _rate(t["hot_write"]),
                    _rate(t["warm_move"]),
                    _rate(t["cold_upload"]),
                    _rate(t["restore"]),
                    _seconds(report.rpo_seconds),
                ]
            ],
        )
    )
    click.echo("")
    click.echo(
        table(["check", "status", "detail"], [[c.name, c.status.upper(), c.detail] for c in report.checks])
    )
    click.echo("")
    verdict = {"pass": "sustainable", "warn": "sustainable, with warnings", "fail": "NOT sustainable"}
    click.echo(f"result  {verdict[report.status]} (exit {report.exit_code})")


@click.command()
@click.option(
    "--size",
    callback=_parse_size,
    default=None,
    help="Bytes per save, e.g. 40GiB (default: the newest run's newest save).",
)
@click.option(
    "--every",
    callback=_parse_duration,
    default=None,
    help="Save interval, e.g. 30m (default: the newest run's history, else 30m).",
)
@click.option(
    "--duration",
    callback=_parse_duration,
    default=None,
    help="Repeat the pipeline for this long and watch throughput over time.",
)
@click.option(
    "--quick", is_flag=True, help="One small synthetic save (64 MiB at most); rates are extrapolated."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option(
    "--lock-timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for another executor."
)
@pass_ctx
def preflight(
    app: Context,
    size: int | None,
    every: float | None,
    duration: float | None,
    quick: bool,
    as_json: bool,
    lock_timeout: float,
) -> None:
    """Will this node sustain this job's checkpoints? Exit 0 all pass, 5 warnings, 6 a failure."""
    if quick and duration is not None:
        fail("--quick and --duration exclude each other", EXIT_USAGE)
    from ckptkeeper.actions.preflight import run_preflight  # the executor and storage: not for --help

    # SIGTERM unwinds like Ctrl-C, so the scratch is removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = app.settings
    with app.index() as ix:
        try:
            report = run_preflight(
                settings,
                ix,
                size=size,
                every=every,
                duration=duration,
                quick=quick,
                lock_timeout=lock_timeout,
            )
        except Locked as exc:
            fail(f"{exc}; try again later", EXIT_LOCKED)
    if as_json:
        emit_json(report.to_dict())
    else:
        _render(report)
    sys.exit(report.exit_code)


COMMANDS = (preflight,)
