"""``prune``: plan retention and reaping, carry the plan out, and render both."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.actions.errors import IndexUnusable, Locked
from ckptkeeper.cli.context import (
    EXIT_ACTION_FAILED,
    EXIT_LOCKED,
    EXIT_USAGE,
    Context,
    fail,
    out_width,
    pass_ctx,
)
from ckptkeeper.util.fmt import format_duration, human_bytes, table, wrap_text

if TYPE_CHECKING:
    from ckptkeeper.actions.prune import PruneOutcome
    from ckptkeeper.config import Settings
    from ckptkeeper.core.cost import StoredBasis, StoredRatio
    from ckptkeeper.core.model import Action, Plan
    from ckptkeeper.index import Index


def _policy_summary(settings: Settings) -> str:
    parts = []
    for t in settings.tiers:
        rules = []
        for key in (
            "keep_last",
            "keep_best",
            "keep_every",
            "keep_hourly",
            "keep_daily",
            "keep_weekly",
            "keep_monthly",
        ):
            value = getattr(t, key)
            if value is not None:
                label = key.removeprefix("keep_")
                if key == "keep_best":
                    label = f"best by {t.metric} ({t.mode})"
                rules.append(f"{label} {value}")
        if t.keep_within is not None:
            rules.append(f"within {format_duration(t.keep_within)}")
        if t.replicate:
            rules.append("replicate")
        if t.high_watermark:
            rules.append(f"watermarks {t.high_watermark:.0%}/{t.low_watermark:.0%}")
        parts.append(f"{t.name}: {', '.join(rules) or 'keep all'}")
    return "; ".join(parts)


def _render_plan(plan: Plan, settings: Settings, *, dry_run: bool, basis: StoredBasis | None = None) -> None:
    from ckptkeeper.core.reaper import summarize_reclaim  # with the planner: not for --help

    width = out_width()
    click.echo(wrap_text(f"policy  {_policy_summary(settings)}", width, indent="        "))
    keep_by_run: dict[str, list[Any]] = {}
    for k in plan.keep:
        keep_by_run.setdefault(k.run, []).append(k)
    act_by_run: dict[str, list[Any]] = {}
    for a in plan.actions:
        act_by_run.setdefault(a.run or "(no run)", []).append(a)
    for run in sorted(set(keep_by_run) | set(act_by_run)):
        click.echo(f"\nrun {run}")
        keeps = sorted(keep_by_run.get(run, []), key=lambda k: (k.step, k.tier))
        if keeps:
            click.echo(f"keep {len(keeps)} checkpoint copies:")
            click.echo(
                table(
                    ["STEP", "TIER", "REASONS"],
                    [(k.step, k.tier, "; ".join(k.reasons)) for k in keeps],
                    right=(0,),
                    width=width,
                )
            )
        acts = act_by_run.get(run, [])
        if acts:
            verb = "would" if dry_run else "will"
            click.echo(f"{verb} carry out {len(acts)} actions:")
            rows = [
                (
                    a.action.value,
                    a.step if a.step is not None else "-",
                    a.tier or "-",
                    a.to_tier or "",
                    human_bytes(a.bytes),
                    a.path or "",
                    a.reason,
                )
                for a in acts
            ]
            click.echo(
                table(
                    ["ACTION", "STEP", "TIER", "TO", "SIZE", "PATH", "REASON"],
                    rows,
                    right=(1, 4),
                    width=width,
                )
            )
    click.echo()
    reclaim = {t: b for t, b in plan.reclaim_bytes.items() if b}
    total = sum(reclaim.values())
    verb = "would reclaim" if dry_run else "reclaiming"
    per_tier = ", ".join(f"{t} {human_bytes(b)}" for t, b in reclaim.items()) or "nothing"
    click.echo(f"{verb} {human_bytes(total)}: {per_tier}")
    estimates = _render_estimate(plan, basis.ratios if basis else {}, dry_run=dry_run)
    change = _cost_change(plan, settings, basis)
    if change:
        net = sum(change.values())
        word = "saves" if net <= 0 else "adds"
        per = ", ".join(f"{t} {c:+.2f}" for t, c in change.items())
        est = "; copies at their estimated stored bytes" if estimates else ""
        click.echo(f"this plan {word} {abs(net):.2f} per month in storage ({per}{est})")
    reaps = [a for a in plan.actions if a.action.value == "reap" and not a.trash]
    if reaps:
        summary = summarize_reclaim(reaps)
        by_reason = ", ".join(f"{r} {human_bytes(b)}" for r, b in summary.by_reason.items())
        click.echo(wrap_text(f"reaped by reason: {by_reason}", width))
        by_run = ", ".join(f"{r} {human_bytes(b)}" for r, b in summary.by_run.items())
        click.echo(wrap_text(f"reaped by run: {by_run}", width))
    for note in plan.notes:
        click.echo(wrap_text(f"note: {note}", width))
    if plan.refused:
        click.echo(f"refused: {plan.refused}", err=True)


def _render_estimate(plan: Plan, ratios: Mapping[str, StoredRatio], *, dry_run: bool) -> bool:
    """Per compressing tier the plan copies into: raw bytes and what its past copies suggest it
    will store (labelled an estimate); whether any line was printed."""
    from ckptkeeper.core import cost

    est = cost.copies_estimate(plan.actions, ratios)
    verb = "would copy" if dry_run else "copying"
    for tier, (raw, stored) in est.items():
        r = ratios[tier]
        click.echo(
            f"{verb} {human_bytes(raw)} into {tier}, stored as ~{human_bytes(stored)} (estimate: "
            f"{100.0 * r.ratio:.1f} % of raw, as its {r.copies} compressed "
            f"{'copy' if r.copies == 1 else 'copies'} stored)"
        )
    return bool(est)


def _cost_change(plan: Plan, settings: Settings, basis: StoredBasis | None = None) -> dict[str, float]:
    """Tier -> change of the monthly storage bill if the plan is carried out (priced tiers only)."""
    from ckptkeeper.core import cost

    return cost.plan_change(plan.actions, {t.name: t.cost_per_gib_month for t in settings.tiers}, basis)


def _progress_printer() -> Callable[[Action, int, int], None] | None:
    """Bytes, rate and ETA of each copy, only on a terminal (journald gets one log line per action)."""
    from ckptkeeper.cli.progress import terminal_progress

    bar = terminal_progress()
    if bar is None:
        return None

    def show(action: Action, done: int, total: int) -> None:
        bar.update(f"{action.action.value} {action.path} {action.tier}->{action.to_tier}", done, total)

    return show


@click.command()
@click.option("--dry-run", "-n", is_flag=True, help="Show what would be done; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable plan (and result).")
@click.option("--run", "run", default=None, help="Only act on this run.")
@click.option("--force", is_flag=True, help="Override the max_delete guard.")
@click.option(
    "--lock-timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for another executor."
)
@pass_ctx
def prune(
    app: Context, dry_run: bool, as_json: bool, run: str | None, force: bool, lock_timeout: float
) -> None:
    """Plan retention and reaping; without --dry-run, carry the plan out."""
    # The planner, executor and storage: imported here, not for --help.
    from ckptkeeper.actions.prune import run_prune
    from ckptkeeper.actions.sharedfs import NodeClash

    settings = app.settings
    printed: list[Plan] = []

    def print_plan(plan: Plan) -> None:
        """Before any copy starts: the plan is what a user reads while the bytes move."""
        from ckptkeeper.actions.pruning.outcome import cost_basis

        _render_plan(plan, settings, dry_run=False, basis=cost_basis(settings, ix))
        sys.stdout.flush()
        printed.append(plan)

    with app.index(rebuild=not dry_run) as ix:
        try:
            outcome = run_prune(
                settings,
                ix,
                dry_run=dry_run,
                force=force,
                run=run,
                lock_timeout=lock_timeout,
                progress=None if as_json else _progress_printer(),
                on_plan=None if as_json else print_plan,
            )
        except Locked as exc:
            fail(f"{exc}; try again later", EXIT_LOCKED)
        except NodeClash as exc:
            fail(str(exc), EXIT_USAGE)
        except IndexUnusable as exc:
            fail(str(exc), EXIT_ACTION_FAILED)
        if settings.daemon.textfile and not dry_run:
            _write_textfile(settings, ix, outcome)
    if as_json:
        click.echo(json.dumps(outcome.to_dict(), indent=2))
    else:
        if not printed:
            _render_plan(outcome.plan, settings, dry_run=dry_run, basis=outcome.basis)
        _render_outcome(outcome, dry_run=dry_run)
    sys.exit(outcome.exit_code)


def _render_outcome(outcome: PruneOutcome, *, dry_run: bool) -> None:
    """What was done (after the plan, printed before the first byte moved)."""
    if outcome.result is not None:
        r = outcome.result
        for note in r.recovered:
            click.echo(f"recovered: {note}")
        per_tier = ", ".join(f"{t} {human_bytes(b)}" for t, b in r.reclaimed_bytes.items() if b)
        click.echo(
            f"done: {len(r.done)} actions, {len(r.failed)} failed, {len(r.skipped)} skipped; "
            f"reclaimed {human_bytes(outcome.reclaimed_bytes)}" + (f" ({per_tier})" if per_tier else "")
        )
        if r.compressed:
            raw = sum(s["raw_bytes"] for _, s in r.compressed)
            stored = sum(s["stored_bytes"] for _, s in r.compressed)
            cpu = sum(s["compress_cpu_seconds"] for _, s in r.compressed)
            click.echo(
                f"compressed: {len(r.compressed)} copies, {human_bytes(raw)} stored as {human_bytes(stored)} "
                f"({100.0 * stored / max(1, raw):.1f} %), {cpu:.1f} CPU-s"
            )
        for line in outcome.failed:
            click.echo(f"failed: {line}", err=True)
        for a, why in r.skipped:
            click.echo(f"skipped: {a.action.value} {a.path} ({a.tier}): {why}")
    _render_adopted(outcome, dry_run=dry_run)
    for where, problem in sorted(outcome.damaged.items()):
        click.echo(f"damaged copy {where} not counted, copied again: {problem}", err=True)
    for t in outcome.held.values():
        click.echo(f"policy held: {t.describe()}", err=True)


def _render_adopted(outcome: PruneOutcome, *, dry_run: bool) -> None:
    """The fleet lease holder's adoption of gone nodes' copies (docs/many-nodes.md)."""
    width = out_width()
    for a in outcome.adopted:
        verb = "would delete" if dry_run else "deleted"
        done = len(a.plan.actions) if dry_run else len(a.deleted)
        click.echo(
            f"\nadopted from {a.node} (tier {a.tier}, silent {format_duration(round(a.silent_for))}): "
            f"{verb} {done} copies, keep {len(a.plan.keep)}"
        )
        rows = [
            ("delete", x.run or "", x.step if x.step is not None else "-", human_bytes(x.bytes), x.reason)
            for x in a.plan.actions
            if dry_run or (x.path or "") in a.deleted
        ]
        rows += [("keep", k.run, k.step, "", "; ".join(k.reasons)) for k in a.plan.keep]
        if rows:
            click.echo(table(["ACTION", "RUN", "STEP", "SIZE", "REASON"], rows, right=(2, 3), width=width))
        for line in ([f"refused: {a.plan.refused}"] if a.plan.refused else []) + a.errors:
            click.echo(f"adoption of {a.node}: {line}", err=True)
        if a.stopped:
            click.echo(f"adoption of {a.node} stopped: {a.stopped}")


def _write_textfile(settings: Settings, index: Index, outcome: PruneOutcome) -> None:
    from ckptkeeper.daemon.metrics import write_prune_textfile  # prometheus_client: only when configured

    try:
        write_prune_textfile(settings, index, outcome)
    except OSError as exc:
        click.echo(f"ckptkeeper: cannot write metrics textfile {settings.daemon.textfile}: {exc}", err=True)


COMMANDS = (prune,)
