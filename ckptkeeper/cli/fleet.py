"""``ckptkeeper fleet``: every node seen in the shared tiers, its last pass and RPO, and the lease."""

from __future__ import annotations

import click

from ckptkeeper.cli.context import EXIT_ACTION_FAILED, EXIT_USAGE, Context, emit_json, fail, pass_ctx
from ckptkeeper.util.fmt import human_age, table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def fleet(app: Context, as_json: bool) -> None:
    """Nodes sharing this node's shared tiers: last pass, RPO, runs held, the lease holder."""
    from ckptkeeper.actions.fleet import fleet_status  # storage, fsspec: not for --help
    from ckptkeeper.actions.sharedfs import shared_fs_status
    from ckptkeeper.storage import StorageError

    settings = app.settings
    if not any(t.shared for t in settings.tiers):
        fail("no tier has shared = true: there is no fleet to show", EXIT_USAGE)
    try:
        doc = fleet_status(settings)
        doc["tiers"] += shared_fs_status(settings)  # shared filesystem tiers (hot or warm)
    except StorageError as exc:
        fail(str(exc), EXIT_ACTION_FAILED)
    if as_json:
        emit_json(doc)
        return
    for t in doc["tiers"]:
        lease = t["lease"]
        if lease is None:
            held = "nobody"
        elif lease["live"]:
            held = f"{lease['node']} (pid {lease['pid']}), expires in {human_age(lease['expires_in'])}"
        else:
            held = f"nobody (last: {lease['node']}, expired {human_age(-lease['expires_in'])} ago)"
        click.echo(f"tier {t['tier']}: lease held by {held}")
        rows = [
            [
                n["node"] + (" (this node)" if n["node"] == doc["node"] else ""),
                "-" if n["last_pass_age"] is None else f"{human_age(n['last_pass_age'])} ago",
                "-" if n["rpo_seconds"] is None else human_age(n["rpo_seconds"]),
                "-" if n["runs_held"] is None else str(n["runs_held"]),
                "-" if n["checkpoints_held"] is None else str(n["checkpoints_held"]),
                "gone" if n["gone"] else "ok",
            ]
            for n in t["nodes"]
        ]
        click.echo(table(["NODE", "LAST PASS", "RPO", "RUNS", "CHECKPOINTS", "STATE"], rows))
        if t["prefixes_without_heartbeat"]:
            click.echo(
                "prefixes without a heartbeat (older nodes or runs of the single-node layout): "
                + ", ".join(t["prefixes_without_heartbeat"])
            )


COMMANDS = (fleet,)
