"""``status``: tiers with usage, counts, bytes reclaimed, last job runs, pending work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.cli.context import Context, emit_json, out_width, pass_ctx
from ckptkeeper.util.fmt import human_age, human_bytes, table, wrap_text

if TYPE_CHECKING:
    from ckptkeeper.actions.status import StatusSummary


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(app: Context, as_json: bool) -> None:
    """Tiers with usage, counts, bytes reclaimed, last job runs, pending work."""
    from ckptkeeper.actions.status import shared_fs_rows, summarize  # the index and config: not for --help

    with app.index() as ix:
        summary = summarize(app.settings, ix)
    shared = shared_fs_rows(app.settings)
    from ckptkeeper.actions.job import job_summary  # scheduler hooks on this node (docs/slurm.md)

    jobs = job_summary(app.settings)
    if as_json:
        doc = summary.to_dict()
        doc["scheduler_jobs"] = jobs
        if shared is not None:
            doc["shared_fs"] = shared
        emit_json(doc)
        return
    _render_status(summary)
    if jobs is not None:
        last = jobs["last_end"]
        click.echo(
            f"scheduler hooks: {jobs['calls']} calls, {jobs['with_errors']} with errors"
            + (f"; last job end: {last['reason']}" if last else "")
        )
    _render_shared(shared or [])


def _render_shared(shared: list[dict[str, Any]]) -> None:
    for t in shared:
        lease = t.get("lease")
        held = (
            f"{lease['node']} holds the lease (expires in {human_age(lease['expires_in'])})"
            if lease and lease["live"]
            else "nobody holds the lease"
        )
        nodes = ", ".join(f"{n['node']} ({human_age(n['last_pass_age'])} ago)" for n in t["nodes"])
        click.echo(f"shared tier {t['tier']}: {held}; keepers: {nodes or 'none yet'}")


def _render_status(s: StatusSummary) -> None:
    rows = []
    for t in s.tiers:
        u = t.usage
        disk = f"{human_bytes(u.used_bytes)}/{human_bytes(u.total_bytes)} ({u.fraction:.0%})" if u else "-"
        health = "ok" if t.ok else ("unknown" if t.ok is None else "FAILING")
        age = s.newest_age(t)
        newest = human_age(age) if age is not None else "-"
        rows.append((t.name, health, t.checkpoints, human_bytes(t.bytes), disk, newest, t.url))
    click.echo(
        table(
            ["TIER", "HEALTH", "CKPTS", "BYTES", "DISK", "NEWEST", "URL"],
            rows,
            right=(2, 3),
            width=out_width(),
        )
    )
    for t in s.tiers:
        if t.stored_bytes is not None:
            saving = 100.0 * (t.bytes - t.stored_bytes) / max(1, t.bytes)
            click.echo(
                f"compressed tier {t.name}: {human_bytes(t.bytes)} of checkpoints stored as "
                f"{human_bytes(t.stored_bytes)} (saves {saving:.1f} %)"
            )
    click.echo()
    for summary in s.tiers:
        if summary.dedup:
            stored = "unknown" if summary.stored_bytes is None else human_bytes(summary.stored_bytes)
            click.echo(
                f"dedup {summary.name}: {stored} stored for {human_bytes(summary.bytes)} of checkpoints"
            )
    click.echo("runs: " + (", ".join(f"{n} {st}" for st, n in sorted(s.runs.items())) or "none"))
    click.echo(
        "checkpoints: " + (", ".join(f"{n} {st}" for st, n in sorted(s.checkpoints.items())) or "none")
    )
    click.echo(f"reclaimed so far: {human_bytes(s.reclaimed_bytes)}")
    for reason, (b, n) in sorted(s.reclaimed.items()):
        click.echo(f"  {reason}: {human_bytes(b)} ({n} items)")
    for tier, (b, n) in sorted(s.trash.items()):
        click.echo(f"in the trash of {tier}: {human_bytes(b)} ({n} entries; `ckptkeeper ls --deleted`)")
    for j in sorted(s.jobs.values(), key=lambda j: j.job):
        ok = f"ok {human_age(s.now - j.last_success)} ago" if j.last_success else "never succeeded"
        err = (
            f"; last error {human_age(s.now - j.last_error_at)} ago: {j.last_error}"
            if j.last_error and j.last_error_at
            else ""
        )
        click.echo(f"job {j.job}: {ok}{err}")
    if s.journal_open:
        click.echo(
            f"pending: {s.journal_open} interrupted step(s) will be finished or undone by the next prune/daemon start"
        )
    if s.deletes_held:
        click.echo(f"deletes held: {s.deletes_held}")
    _render_headroom(s)
    for warning in s.warnings:
        click.echo(f"WARNING run {warning}")
    for warning in s.clock_warnings:
        click.echo(f"WARNING clock {warning}")
    if s.fs_clocks is not None and s.fs_clocks.error:
        click.echo(f"filesystem clocks: {s.fs_clocks.error} (the next prune pass writes it again)")
    for held in s.policy_held.values():
        since = f" for {human_age(s.now - held.since)}" if held.since is not None else ""
        click.echo(f"policy held{since}: {held.describe()}")
    if s.damaged:
        click.echo(f"damaged copies: {s.damaged} (see `ckptkeeper ls`; the next prune copies them again)")
    if s.scrub:
        click.echo(
            "scrubbed so far: "
            + ", ".join(
                f"{tier} {human_bytes(b)} in {n} copies ({bad} bad)"
                for tier, (b, n, bad) in sorted(s.scrub.items())
            )
        )
    if s.scrub_oldest:
        click.echo(
            "least recently verified copy: "
            + ", ".join(
                f"{tier} {'never hashed since it was cataloged' if when is None else human_age(s.now - when) + ' ago'}"
                for tier, when in sorted(s.scrub_oldest.items())
            )
        )
    if s.quarantined:
        click.echo(
            f"quarantined: {len(s.quarantined)} document(s) ignored (never trusted, never a reason to delete)"
        )
        for q in s.quarantined[:20]:
            click.echo(f"  {q.kind} {q.tier}:{q.path}: {q.reason}")
        if len(s.quarantined) > 20:
            click.echo(f"  … and {len(s.quarantined) - 20} more (ckptkeeper status --json)")
    if s.cost_per_month:
        click.echo(
            f"storage cost per month: {sum(s.cost_per_month.values()):.2f} ("
            + ", ".join(f"{t} {c:.2f}" for t, c in s.cost_per_month.items())
            + ")"
        )
        for run, tiers in sorted(s.run_cost_per_month.items()):
            click.echo(
                f"  run {run}: {sum(tiers.values()):.2f} ("
                + ", ".join(f"{t} {c:.2f}" for t, c in tiers.items())
                + ")"
            )


def _render_headroom(s: StatusSummary) -> None:
    """One line per active run, and a warning when the hot tier cannot hold their next saves."""
    h = s.headroom
    if h is None:
        return
    free = human_bytes(h.free_bytes)
    for run, nbytes in h.runs.items():
        if nbytes:
            click.echo(f"next save of run {run} needs {human_bytes(nbytes)}; {free} free in {h.tier}")
        else:
            click.echo(f"next save of run {run}: size not known yet (no checkpoint); {free} free in {h.tier}")
    if not h.ok:
        act = "prune demotes to make room; its notes say if it cannot" if h.enabled else "headroom = false"
        line = f"WARNING headroom: {h.describe()} in {h.tier}: a save may fail for lack of space ({act})"
        click.echo(wrap_text(line, out_width()))


COMMANDS = (status,)
