"""Commands that read and annotate the catalog: ``scan``, ``ls``, ``status``, ``pin``, ``unpin``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.cli.context import (
    EXIT_ACTION_FAILED,
    EXIT_USAGE,
    Context,
    emit_json,
    fail,
    out_width,
    pass_ctx,
)
from ckptkeeper.util.fmt import format_metrics, human_age, human_bytes, table, wrap_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ckptkeeper.actions.status import StatusSummary
    from ckptkeeper.config import Settings
    from ckptkeeper.core.model import NodePart


ACCELERATE_STEP_NOTE = (
    "note: accelerate checkpoint_N: N counts saves (metric accelerate_save); STEP is the step the "
    "hook committed, else the step accelerate recorded in random_states_0.pkl (its accumulate() "
    "counter), else N when accelerate recorded 0"
)


# -- scan ---------------------------------------------------------------------------------


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the reconcile report as JSON.")
@pass_ctx
def scan(app: Context, as_json: bool) -> None:
    """Reconcile the index with every tier now."""
    from ckptkeeper.ingest.catalog import Catalog  # layouts, fsspec: not for --help

    with app.index(rebuild=True) as ix:
        report = Catalog(app.settings, ix).reconcile()
    doc = {
        "runs": report.runs,
        "new": report.new,
        "new_versions": report.new_versions,
        "unchanged": report.unchanged,
        "removed": report.removed,
        "partial": report.partial,
        "corrupt": report.corrupt,
        "hashed_bytes": report.hashed_bytes,
        "tiers_failed": report.tiers_failed,
        "damaged": report.damaged,
        "quarantined": report.quarantined,
        "parts": report.parts,
    }
    if as_json:
        emit_json(doc)
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


# -- ls -----------------------------------------------------------------------------------


def _tier_order(settings: Settings) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(settings.tiers)}


def _part_doc(part: NodePart | None) -> dict[str, Any] | None:
    """``ls --json``'s ``part`` of a checkpoint: null for a whole checkpoint."""
    if part is None:
        return None
    return {
        "index": part.index,
        "count": part.count,
        "job": part.job,
        "known": part.known,
        "marker_elsewhere": part.marker_elsewhere,
        "note": part.note,
    }


def _layout_text(layout: str, part: dict[str, Any] | None) -> str:
    """``dcp part 1/2`` (part 1 of 2, numbered from 0 like GROUP_RANK); ``dcp part?`` when only
    the files' shape says so."""
    if part is None:
        return layout
    return f"{layout} part {part['index']}/{part['count']}" if part["known"] else f"{layout} part?"


def _versions(settings: Settings, rows: Sequence[Any]) -> dict[tuple[str, int, str], Any]:
    """Each of this node's parts' version in the shared tiers it is in: one listing
    of part records per run and tier, plus each record's manifest."""
    if not any(t.shared for t in settings.tiers):
        return {}
    parts = [
        (c.run, c.step, c.part.job, c.part.count, c.verified_tiers)
        for c in rows
        if c.part is not None and c.part.count is not None and c.part.count > 1 and c.part.index is not None
    ]
    if not parts:
        return {}
    from ckptkeeper.actions.versions import part_versions  # storage, fsspec: only for shared tiers

    return part_versions(settings, parts)


def _tier_text(tier: str, version: dict[str, Any] | None) -> str:
    """``cold`` or, for a part of a version spanning nodes, ``cold(parts 1/2)``."""
    return tier if version is None else f"{tier}(parts {version['parts']})"


@click.command(name="ls")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--deleted", is_flag=True, help="List what `undelete` can bring back (undo_window).")
@pass_ctx
def ls_cmd(app: Context, run: str | None, as_json: bool, deleted: bool) -> None:
    """List runs and their checkpoints: step, state, tiers, size, metrics, pin."""
    if deleted:
        from ckptkeeper.cli.undo import ls_deleted

        ls_deleted(app, run, as_json)
        return
    order = _tier_order(app.settings)
    with app.index() as ix:
        runs = [r for r in ix.runs() if run is None or r.name == run]
        checkpoints = ix.checkpoints(run)
        quarantined = [q for q in ix.quarantined() if run is None or q.run == run]
    if run is not None and not runs and not checkpoints:
        fail(f"no run named {run!r} in the index (try `ckptkeeper scan`)", EXIT_USAGE)
    by_run: dict[str, list[Any]] = {}
    for c in checkpoints:
        by_run.setdefault(c.run, []).append(c)
    versions = _versions(app.settings, checkpoints)
    from ckptkeeper.actions.job import last_job  # the run's last scheduler job (docs/slurm.md)

    doc_runs: list[dict[str, Any]] = []
    for r in runs:
        doc_runs.append(
            {
                "name": r.name,
                "state": r.state.value,
                "state_reason": r.state_reason,
                "last_seen": r.last_seen,
                "parent": {"run": r.parent[0], "step": r.parent[1]} if r.parent else None,
                "job": last_job(app.settings, r.name) if r.on_hot else None,
                "checkpoints": [
                    {
                        "step": c.step,
                        "name": c.name,
                        "state": c.state.value,
                        "layout": c.layout,
                        "tiers": sorted(c.verified_tiers, key=lambda t: order.get(t, 99)),
                        "bytes": c.bytes,
                        "metrics": dict(c.metrics),
                        "pinned": c.pinned,
                        "version": c.version,
                        "created_at": c.created_at,
                        "problem": c.problem,
                        "damaged": c.damaged,
                        "part": _part_doc(c.part),
                        "versions": {
                            t: {**v.to_doc(), "parts": v.label}
                            for (vr, vs, t), v in versions.items()
                            if (vr, vs) == (c.run, c.step)
                        },
                    }
                    for c in sorted(by_run.get(r.name, []), key=lambda c: (c.step, c.name))
                ],
                "quarantined": [q.to_dict() for q in quarantined if q.run == r.name],
            }
        )
    if as_json:
        emit_json({"runs": doc_runs, "quarantined": [q.to_dict() for q in quarantined]})
        return
    if not doc_runs and not quarantined:
        click.echo("no runs cataloged (run `ckptkeeper scan`, or start the daemon)")
        return
    for i, doc in enumerate(doc_runs):
        if i:
            click.echo()
        reason = f" ({doc['state_reason']})" if doc["state_reason"] else ""
        click.echo(wrap_text(f"run {doc['name']}: {doc['state']}{reason}", out_width()))
        rows = [
            (
                c["step"],
                c["state"],
                _layout_text(c["layout"], c["part"]),
                ",".join(
                    [
                        *(_tier_text(t, c["versions"].get(t)) for t in c["tiers"]),
                        *(f"{t}:DAMAGED" for t in sorted(c["damaged"])),
                    ]
                )
                or "-",
                human_bytes(c["bytes"]),
                format_metrics(c["metrics"]),
                "pinned" if c["pinned"] else "",
                c["name"],
            )
            for c in doc["checkpoints"]
        ]
        click.echo(
            table(
                ["STEP", "STATE", "LAYOUT", "TIERS", "SIZE", "METRICS", "PIN", "PATH"],
                rows,
                right=(0, 4),
                width=out_width(),
            )
        )
        if any(c["layout"] == "accelerate" for c in doc["checkpoints"]):
            click.echo(ACCELERATE_STEP_NOTE)
        for c in doc["checkpoints"]:
            if c["part"] is not None and not c["part"]["known"]:
                click.echo(wrap_text(f"step {c['step']}: {c['part']['note']}", out_width()))
            for tier, v in sorted(c["versions"].items()):
                for problem in v["problems"]:
                    click.echo(
                        wrap_text(f"step {c['step']} in {tier}: part record ignored: {problem}", out_width())
                    )
            for tier, problem in sorted(c["damaged"].items()):
                click.echo(
                    f"damaged copy of step {c['step']} in {tier} (the next prune copies it again): {problem}"
                )
        for q in doc["quarantined"]:
            click.echo(f"quarantined {q['kind']} {q['tier']}:{q['path']}: {q['reason']}")
    listed = {r["name"] for r in doc_runs}
    others = [q for q in quarantined if q.run not in listed]
    if others:
        if doc_runs:
            click.echo()
        for q in others:
            click.echo(f"quarantined {q.kind} {q.tier}:{q.path}: {q.reason}")


# -- status -------------------------------------------------------------------------------


def _status_doc(s: StatusSummary) -> dict[str, Any]:
    tiers = []
    for t in s.tiers:
        age = s.newest_age(t)
        tiers.append(
            {
                "name": t.name,
                "url": t.url,
                "ok": t.ok,
                "error": t.error,
                "checked_at": t.checked_at,
                "usage": {
                    "total_bytes": t.usage.total_bytes,
                    "used_bytes": t.usage.used_bytes,
                    "fraction": round(t.usage.fraction, 4),
                }
                if t.usage
                else None,
                "checkpoints": t.checkpoints,
                "bytes": t.bytes,
                "newest_checkpoint_age_seconds": None if age is None else round(age, 1),
            }
        )
    return {
        "tiers": tiers,
        "runs": dict(s.runs),
        "checkpoints": dict(s.checkpoints),
        "pinned": s.pinned,
        "reclaimed": {
            "total_bytes": s.reclaimed_bytes,
            "by_reason": {k: {"bytes": b, "count": n} for k, (b, n) in sorted(s.reclaimed.items())},
        },
        "trash": {t: {"bytes": b, "entries": n} for t, (b, n) in sorted(s.trash.items())},
        "jobs": {
            j.job: {"last_start": j.last_start, "last_success": j.last_success, "last_error": j.last_error}
            for j in s.jobs.values()
        },
        "pending": {"journal": s.journal_open},
        "deletes_held": s.deletes_held,
        "warnings": list(s.warnings),
        "policy_held": {
            t.tier: {"error": t.error, "checkpoints": t.checkpoints, "since": t.since}
            for t in s.policy_held.values()
        },
        "damaged_copies": s.damaged,
        "scrub": {
            "tiers": {
                t: {
                    "bytes": b,
                    "copies": n,
                    "bad": bad,
                    "oldest_check": s.scrub_oldest.get(t),
                }
                for t, (b, n, bad) in sorted(s.scrub.items())
            },
            "oldest_check": {t: s.scrub_oldest.get(t) for t in sorted(s.scrub_oldest)},
            "no_good_copy": [
                {"run": run, "step": step, "name": name, "damaged": dict(d)}
                for run, step, name, d in s.no_good_copy
            ],
        },
        "quarantined": [q.to_dict() for q in s.quarantined],
        "cost_per_month": _cost_doc(s),
        "headroom": _headroom_doc(s),
    }


def _headroom_doc(s: StatusSummary) -> dict[str, Any] | None:
    """The hot tier's free space against its active runs' next saves (None: usage unreadable)."""
    h = s.headroom
    if h is None:
        return None
    return {
        "tier": h.tier,
        "free_bytes": h.free_bytes,
        "needed_bytes": h.needed_bytes,
        "runs": dict(h.runs),
        "ok": h.ok,
        "enabled": h.enabled,
    }


def _cost_doc(s: StatusSummary) -> dict[str, Any] | None:
    """Storage cost per tier and per run (None: no tier has ``cost_per_gib_month``)."""
    if not s.cost_per_month:
        return None
    return {
        "tiers": dict(s.cost_per_month),
        "total": round(sum(s.cost_per_month.values()), 4),
        "runs": {
            run: {**tiers, "total": round(sum(tiers.values()), 4)}
            for run, tiers in s.run_cost_per_month.items()
        },
    }


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
    click.echo()
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


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(app: Context, as_json: bool) -> None:
    """Tiers with usage, counts, bytes reclaimed, last job runs, pending work."""
    from ckptkeeper.actions.status import summarize  # the index and config: not for --help

    with app.index() as ix:
        summary = summarize(app.settings, ix)
    shared = _shared_fs(app)
    from ckptkeeper.actions.job import job_summary  # scheduler hooks on this node (docs/slurm.md)

    jobs = job_summary(app.settings)
    if as_json:
        doc = _status_doc(summary)
        doc["scheduler_jobs"] = jobs
        if shared is not None:
            doc["shared_fs"] = shared
        emit_json(doc)
    else:
        _render_status(summary)
        if jobs is not None:
            last = jobs["last_end"]
            click.echo(
                f"scheduler hooks: {jobs['calls']} calls, {jobs['with_errors']} with errors"
                + (f"; last job end: {last['reason']}" if last else "")
            )
        for t in shared or []:
            lease = t.get("lease")
            held = (
                f"{lease['node']} holds the lease (expires in {human_age(lease['expires_in'])})"
                if lease and lease["live"]
                else "nobody holds the lease"
            )
            nodes = ", ".join(f"{n['node']} ({human_age(n['last_pass_age'])} ago)" for n in t["nodes"])
            click.echo(f"shared tier {t['tier']}: {held}; keepers: {nodes or 'none yet'}")


def _shared_fs(app: Context) -> list[dict[str, Any]] | None:
    """Shared filesystem tiers: heartbeats and lease (None when there is none; a read error is a row)."""
    if not any(t.shared and t.is_local for t in app.settings.tiers):
        return None
    from ckptkeeper.actions.sharedfs import shared_fs_status
    from ckptkeeper.storage import StorageError

    try:
        return shared_fs_status(app.settings)
    except StorageError as exc:
        return [
            {"tier": t.name, "error": str(exc), "nodes": [], "lease": None}
            for t in app.settings.tiers
            if t.shared and t.is_local
        ]


# -- pin / unpin --------------------------------------------------------------------------


def _set_pin(app: Context, run: str, step: int, pinned: bool, as_json: bool) -> None:
    from ckptkeeper.actions.pins import set_pin  # storage backends: not for --help

    with app.index() as ix:
        outcome = set_pin(app.settings, ix, run, step, pinned)
    if not outcome.names:
        fail(f"no checkpoint {run}@{step} in the index (try `ckptkeeper ls {run}`)", EXIT_USAGE)
    verb = "pin" if pinned else "unpin"
    if as_json:
        # What is true now, failure or not: an unpin that could not remove every pin object leaves
        # the checkpoint pinned (a pin object left in a tier would pin it again).
        emit_json(
            {
                "run": run,
                "step": step,
                "pinned": pinned or bool(outcome.failed),
                "checkpoints": outcome.changed,
                "failed": dict(sorted(outcome.failed.items())),
            }
        )
    if outcome.failed and not pinned:
        for tier, error in sorted(outcome.failed.items()):
            click.echo(f"ckptkeeper: tier {tier}: {error}", err=True)
        fail(
            f"{run}@{step} stays pinned: its pin object could not be removed from "
            f"{', '.join(sorted(outcome.failed))} (it would pin it again); run `ckptkeeper unpin` again",
            EXIT_ACTION_FAILED,
        )
    if not as_json:
        click.echo(f"{verb}ned {run}@{step}")
    if outcome.failed:
        for tier, error in sorted(outcome.failed.items()):
            click.echo(f"ckptkeeper: tier {tier}: {error}", err=True)
        fail(
            f"{run}@{step} is pinned in the index, but its pin object is missing from "
            f"{', '.join(sorted(outcome.failed))}: a lost index would lose this pin; run `ckptkeeper pin` again",
            EXIT_ACTION_FAILED,
        )


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


COMMANDS = (scan, ls_cmd, status, pin, unpin)
