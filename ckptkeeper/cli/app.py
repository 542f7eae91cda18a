"""The ``ckptkeeper`` command line: argument parsing and presentation only.

Each command loads the config, opens the index and calls into the core; the formatting of what
comes back lives here. Heavy modules (s3fs, watchdog, apscheduler) are imported inside commands so
``ckptkeeper --help`` stays fast.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from ckptkeeper import __version__
from ckptkeeper.util.fmt import format_metrics, human_age, human_bytes, table

EXIT_OK = 0
EXIT_ACTION_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_LOCKED = 11

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:
    from ckptkeeper.config import Settings


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"ckptkeeper: {message}", err=True)
    sys.exit(code)


class Context:
    """Lazily loaded settings and index shared by the commands of one invocation."""

    def __init__(self, config_path: str | None) -> None:
        self.config_path = config_path
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            from ckptkeeper.config import ConfigError, load_settings  # pydantic: ~0.5 s, not for --help

            try:
                self._settings = load_settings(self.config_path)
            except ConfigError as exc:
                for line in exc.problems:
                    click.echo(f"config error: {line}", err=True)
                sys.exit(EXIT_USAGE)
            from ckptkeeper.util import logs

            logs.configure(self._settings.log_level)
        return self._settings

    @contextmanager
    def index(self, *, rebuild: bool = False) -> Iterator[Any]:
        """``rebuild`` (scan, prune): check the index and rebuild a corrupt one from the tiers."""
        from ckptkeeper.actions.prune import IndexUnusable, Locked, open_index

        try:
            ix = open_index(self.settings, check=rebuild, rebuild=rebuild)
        except IndexUnusable as exc:
            fail(str(exc), EXIT_ACTION_FAILED)
        except Locked as exc:
            fail(f"{exc}; try again later", EXIT_LOCKED)
        except Exception as exc:  # sqlite3 errors carry the reason; the path is what users need
            fail(f"cannot open index {self.settings.index}: {exc}", EXIT_ACTION_FAILED)
        try:
            yield ix
        finally:
            ix.close()


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Config file (default: $CKPTKEEPER_CONFIG, else /etc/ckptkeeper/config.toml).",
)
@click.version_option(__version__, prog_name="ckptkeeper")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """Catalog, tier and reap ML training checkpoints on this node."""
    ctx.obj = Context(config_path)


def _emit_json(doc: object) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


# -- scan ---------------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the reconcile report as JSON.")
@pass_ctx
def scan(app: Context, as_json: bool) -> None:
    """Reconcile the index with every tier now."""
    from ckptkeeper.ingest.catalog import Catalog

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
    }
    if as_json:
        _emit_json(doc)
    else:
        click.echo(
            f"scanned {report.runs} runs: {report.new} new, {report.new_versions} rewritten, "
            f"{report.unchanged} unchanged, {report.removed} removed, {report.partial} partial, "
            f"{report.corrupt} corrupt; hashed {human_bytes(report.hashed_bytes)}"
        )
        for tier, error in report.tiers_failed.items():
            click.echo(
                f"tier {tier} unavailable (treated as unknown, nothing deleted from it): {error}", err=True
            )
    if report.tiers_failed:
        sys.exit(EXIT_ACTION_FAILED)


# -- ls -----------------------------------------------------------------------------------


def _tier_order(settings: Settings) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(settings.tiers)}


@main.command(name="ls")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def ls_cmd(app: Context, run: str | None, as_json: bool) -> None:
    """List runs and their checkpoints: step, state, tiers, size, metrics, pin."""
    order = _tier_order(app.settings)
    with app.index() as ix:
        runs = [r for r in ix.runs() if run is None or r.name == run]
        checkpoints = ix.checkpoints(run)
    if run is not None and not runs and not checkpoints:
        fail(f"no run named {run!r} in the index (try `ckptkeeper scan`)", EXIT_USAGE)
    by_run: dict[str, list[Any]] = {}
    for c in checkpoints:
        by_run.setdefault(c.run, []).append(c)
    doc_runs = []
    for r in runs:
        doc_runs.append(
            {
                "name": r.name,
                "state": r.state.value,
                "state_reason": r.state_reason,
                "last_seen": r.last_seen,
                "parent": {"run": r.parent[0], "step": r.parent[1]} if r.parent else None,
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
                    }
                    for c in sorted(by_run.get(r.name, []), key=lambda c: (c.step, c.name))
                ],
            }
        )
    if as_json:
        _emit_json({"runs": doc_runs})
        return
    if not doc_runs:
        click.echo("no runs cataloged (run `ckptkeeper scan`, or start the daemon)")
        return
    for i, r in enumerate(doc_runs):
        if i:
            click.echo()
        reason = f" ({r['state_reason']})" if r["state_reason"] else ""
        click.echo(f"run {r['name']}: {r['state']}{reason}")
        rows = [
            (
                c["step"],
                c["state"],
                c["layout"],
                ",".join(c["tiers"]) or "-",
                human_bytes(c["bytes"]),
                format_metrics(c["metrics"]),
                "pinned" if c["pinned"] else "",
                c["name"],
            )
            for c in r["checkpoints"]
        ]
        click.echo(
            table(["STEP", "STATE", "LAYOUT", "TIERS", "SIZE", "METRICS", "PIN", "PATH"], rows, right=(0, 4))
        )


# -- status -------------------------------------------------------------------------------


def _local_usage(path: Path) -> dict[str, Any] | None:
    try:
        du = shutil.disk_usage(path)
    except OSError:
        return None
    return {
        "total_bytes": du.total,
        "used_bytes": du.used,
        "fraction": round(du.used / du.total, 4) if du.total else 0,
    }


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(app: Context, as_json: bool) -> None:
    """Tiers with usage, counts, bytes reclaimed, last job runs, pending work."""
    from ckptkeeper.actions.prune import deletes_held

    settings = app.settings
    with app.index() as ix:
        runs = ix.runs()
        checkpoints = ix.checkpoints()
        statuses = ix.tier_statuses()
        reclaimed = ix.reclaimed()
        jobs = ix.job_runs()
        journal_open = ix.journal_open()
    now = time.time()
    tiers: list[dict[str, Any]] = []
    for t in settings.tiers:
        held = [c for c in checkpoints if t.name in c.verified_tiers]
        st = statuses.get(t.name)
        newest = max((c.created_at for c in held), default=None)
        tiers.append(
            {
                "name": t.name,
                "url": t.url,
                "ok": st.ok if st else None,
                "error": st.error if st else "never listed",
                "checked_at": st.checked_at if st else None,
                "usage": _local_usage(t.local_path) if t.is_local else None,
                "checkpoints": len(held),
                "bytes": sum(c.bytes for c in held),
                "newest_checkpoint_age_seconds": round(now - newest, 1) if newest else None,
            }
        )
    run_states: dict[str, int] = {}
    for r in runs:
        run_states[r.state.value] = run_states.get(r.state.value, 0) + 1
    ckpt_states: dict[str, int] = {}
    for c in checkpoints:
        ckpt_states[c.state.value] = ckpt_states.get(c.state.value, 0) + 1
    doc = {
        "tiers": tiers,
        "runs": run_states,
        "checkpoints": ckpt_states,
        "pinned": sum(1 for c in checkpoints if c.pinned),
        "reclaimed": {
            "total_bytes": sum(b for b, _ in reclaimed.values()),
            "by_reason": {k: {"bytes": b, "count": n} for k, (b, n) in sorted(reclaimed.items())},
        },
        "jobs": {
            j.job: {"last_start": j.last_start, "last_success": j.last_success, "last_error": j.last_error}
            for j in jobs.values()
        },
        "pending": {"journal": len(journal_open)},
        "deletes_held": deletes_held(settings),
    }
    if as_json:
        _emit_json(doc)
        return
    rows = []
    for td in tiers:
        usage = td["usage"]
        used = (
            f"{human_bytes(usage['used_bytes'])}/{human_bytes(usage['total_bytes'])} ({usage['fraction']:.0%})"
            if usage
            else "-"
        )
        health = "ok" if td["ok"] else ("unknown" if td["ok"] is None else "FAILING")
        age = (
            human_age(td["newest_checkpoint_age_seconds"])
            if td["newest_checkpoint_age_seconds"] is not None
            else "-"
        )
        rows.append((td["name"], health, td["checkpoints"], human_bytes(td["bytes"]), used, age, td["url"]))
    click.echo(table(["TIER", "HEALTH", "CKPTS", "BYTES", "DISK", "NEWEST", "URL"], rows, right=(2, 3)))
    click.echo()
    click.echo("runs: " + (", ".join(f"{n} {s}" for s, n in sorted(run_states.items())) or "none"))
    click.echo("checkpoints: " + (", ".join(f"{n} {s}" for s, n in sorted(ckpt_states.items())) or "none"))
    total = doc["reclaimed"]["total_bytes"]  # type: ignore[index]
    click.echo(f"reclaimed so far: {human_bytes(total)}")
    for reason, (b, n) in sorted(reclaimed.items()):
        click.echo(f"  {reason}: {human_bytes(b)} ({n} items)")
    for j in sorted(jobs.values(), key=lambda j: j.job):
        ok = f"ok {human_age(now - j.last_success)} ago" if j.last_success else "never succeeded"
        err = (
            f"; last error {human_age(now - j.last_error_at)} ago: {j.last_error}"
            if j.last_error and j.last_error_at
            else ""
        )
        click.echo(f"job {j.job}: {ok}{err}")
    if journal_open:
        click.echo(
            f"pending: {len(journal_open)} interrupted step(s) will be finished or undone by the next prune/daemon start"
        )
    if doc["deletes_held"]:
        click.echo(f"deletes held: {doc['deletes_held']}")


# -- pin / unpin --------------------------------------------------------------------------


def _set_pin(app: Context, run: str, step: int, pinned: bool) -> None:
    with app.index() as ix:
        changed = ix.set_pinned(run, step, pinned)
    if not changed:
        fail(f"no checkpoint {run}@{step} in the index (try `ckptkeeper ls {run}`)", EXIT_USAGE)
    click.echo(f"{'pinned' if pinned else 'unpinned'} {run}@{step}")


@main.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@pass_ctx
def pin(app: Context, run: str, step: int) -> None:
    """Protect a checkpoint from retention and reaping."""
    _set_pin(app, run, step, True)


@main.command()
@click.argument("run")
@click.argument("step", type=click.IntRange(min=0))
@pass_ctx
def unpin(app: Context, run: str, step: int) -> None:
    """Release a pinned checkpoint back to its tier policies."""
    _set_pin(app, run, step, False)


def _register_late_commands() -> None:
    """Commands living in their own modules (they import heavier parts of the core)."""
    from ckptkeeper.cli import commands as cli_commands

    cli_commands.register(main)


_register_late_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
