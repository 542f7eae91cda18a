"""``ls``: runs and their checkpoints: step, state, tiers, size (and stored size where smaller),
metrics, pin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptkeeper.cli.context import EXIT_USAGE, Context, emit_json, fail, out_width, pass_ctx
from ckptkeeper.util.fmt import format_metrics, human_bytes, table, wrap_text

if TYPE_CHECKING:
    from ckptkeeper.actions.listing import Listing

ACCELERATE_STEP_NOTE = (
    "note: accelerate checkpoint_N: N counts saves (metric accelerate_save); STEP is the step the "
    "hook committed, else the step accelerate recorded in random_states_0.pkl (its accumulate() "
    "counter), else N when accelerate recorded 0"
)


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
    from ckptkeeper.actions.listing import list_catalog  # the index, storage: not for --help

    with app.index() as ix:
        listing = list_catalog(app.settings, ix, run)
    if run is not None and listing.empty:
        fail(f"no run named {run!r} in the index (try `ckptkeeper scan`)", EXIT_USAGE)
    if as_json:
        emit_json(listing.to_dict())
        return
    _render(listing)


def _layout_text(layout: str, part: dict[str, Any] | None) -> str:
    """``dcp part 1/2`` (part 1 of 2, numbered from 0 like GROUP_RANK); ``dcp part?`` when only
    the files' shape says so."""
    if part is None:
        return layout
    return f"{layout} part {part['index']}/{part['count']}" if part["known"] else f"{layout} part?"


def _tier_text(tier: str, version: dict[str, Any] | None) -> str:
    """``cold`` or, for a part of a version spanning nodes, ``cold(parts 1/2)``."""
    return tier if version is None else f"{tier}(parts {version['parts']})"


def _render(listing: Listing) -> None:
    doc_runs = listing.run_docs()
    quarantined = listing.quarantined
    if not doc_runs and not quarantined:
        click.echo("no runs cataloged (run `ckptkeeper scan`, or start the daemon)")
        return
    for i, doc in enumerate(doc_runs):
        if i:
            click.echo()
        _render_run(doc)
    listed = {r["name"] for r in doc_runs}
    others = [q for q in quarantined if q.run not in listed]
    if others:
        if doc_runs:
            click.echo()
        for q in others:
            click.echo(f"quarantined {q.kind} {q.tier}:{q.path}: {q.reason}")


def _stored_text(c: dict[str, Any]) -> str:
    """Where a copy is stored smaller than its raw bytes (compressed): ``cold: 1.2 MiB (-70.0 %)``
    per such tier, the saving against SIZE in brackets; empty when every copy is stored as it is."""
    return ", ".join(
        f"{tier}: {human_bytes(n)} (-{100.0 * (c['bytes'] - n) / max(1, c['bytes']):.1f} %)"
        for tier, n in c["stored_bytes"].items()
        if n < c["bytes"]
    )


def _render_run(doc: dict[str, Any]) -> None:
    reason = f" ({doc['state_reason']})" if doc["state_reason"] else ""
    click.echo(wrap_text(f"run {doc['name']}: {doc['state']}{reason}", out_width()))
    stored = [_stored_text(c) for c in doc["checkpoints"]]
    smaller = any(stored)  # the STORED column only where some copy of the run is stored smaller
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
            *([text] if smaller else []),
            format_metrics(c["metrics"]),
            "pinned" if c["pinned"] else "",
            c["name"],
        )
        for c, text in zip(doc["checkpoints"], stored, strict=True)
    ]
    headers = ["STEP", "STATE", "LAYOUT", "TIERS", "SIZE", *(["STORED"] if smaller else []), "METRICS"]
    click.echo(table([*headers, "PIN", "PATH"], rows, right=(0, 4), width=out_width()))
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


COMMANDS = (ls_cmd,)
