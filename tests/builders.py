"""One builder per concept the tests make over and over: model values and config files.

Values (pure, no files): ``checkpoint``, ``run``, ``snapshot``, ``tier``, ``manifest``; and
``manifest_of`` / ``file_entries`` which hash what is on disk as the catalog would.
Config files: ``write_config`` renders a TOML config from plain values (mode 0600, replaced
atomically, as the daemon expects), ``config_text`` is the same text, ``s3_tier`` a cold tier table
on a moto endpoint, ``fleet_node`` the config of one node of a fleet sharing a bucket, ``part_node``
one node of a job whose checkpoints span nodes (its share of the run in its hot dir, and its config).
On disk and in processes: ``hf_checkpoint`` (a settled HF-style checkpoint), ``index_checkpoint``
(a row in an :class:`~ckptkeeper.index.Index`), ``start_cli`` / ``run_cli`` (the real CLI in a
subprocess, without the test environment's ``CKPTKEEPER_*`` variables).

Argument order is the same everywhere: what identifies the thing first (``run, step``, ``name,
url``), positionally; everything else by keyword, with the model's own field names (except
``nbytes`` for ``Checkpoint.bytes``, which would shadow the builtin). Defaults are the model's,
so a test states only what it depends on. Clock conventions (``NOW - age``, ``T0 + step * 36``)
belong to the test module: it wraps these builders in a one-line helper when it has one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptkeeper.core.model import (
    Artifact,
    Checkpoint,
    CheckpointState,
    FileEntry,
    Manifest,
    Run,
    RunState,
    Snapshot,
    TierPolicy,
    TierSpec,
)
from ckptkeeper.util import hashing

COMPLETE = CheckpointState.COMPLETE

# --------------------------------------------------------------------------------------------
# model values


def checkpoint(
    run: str,
    step: int,
    *,
    state: CheckpointState = COMPLETE,
    created_at: float = 0.0,
    name: str | None = None,
    layout: str = "hf",
    nbytes: int = 0,
    metrics: Mapping[str, float] | None = None,
    pinned: bool = False,
    version: str | None = None,
    tiers: Iterable[str] = (),
    last_write: float = 0.0,
    committed: bool = False,
) -> Checkpoint:
    """A ``Checkpoint``; ``name`` defaults to HF's ``checkpoint-{step}``."""
    return Checkpoint(
        run=run,
        step=step,
        name=f"checkpoint-{step}" if name is None else name,
        layout=layout,
        state=state,
        created_at=created_at,
        bytes=nbytes,
        metrics=dict(metrics or {}),
        pinned=pinned,
        version=version,
        tiers=frozenset(tiers),
        last_write=last_write,
        committed=committed,
    )


def run(
    name: str,
    state: RunState = RunState.FINISHED,
    *,
    last_seen: float = 0.0,
    parent: tuple[str, int] | None = None,
) -> Run:
    return Run(name=name, state=state, last_seen=last_seen, parent=parent)


def snapshot(
    *checkpoints: Checkpoint,
    runs: Sequence[Run] = (),
    artifacts: Sequence[Artifact] = (),
    unknown: Iterable[str] = (),
    implicit_runs: RunState | None = None,
    last_seen: float = 0.0,
) -> Snapshot:
    """A ``Snapshot`` of ``checkpoints`` and ``runs``.

    ``implicit_runs``: a state to give every run a checkpoint names but ``runs`` does not list
    (a ``Run`` per name, sorted, seen at ``last_seen``); ``None`` (the default) adds none.
    """
    all_runs = tuple(runs)
    if implicit_runs is not None:
        missing = sorted({c.run for c in checkpoints} - {r.name for r in runs})
        all_runs += tuple(Run(n, implicit_runs, last_seen) for n in missing)
    return Snapshot(
        runs=all_runs,
        checkpoints=tuple(checkpoints),
        artifacts=tuple(artifacts),
        unknown_tiers=frozenset(unknown),
    )


def tier(
    name: str, url: str | None = None, *, storage_options: Mapping[str, Any] | None = None, **policy: Any
) -> TierSpec:
    """A ``TierSpec``; ``url`` defaults to ``/tiers/{name}``; keywords are ``TierPolicy`` fields."""
    return TierSpec(
        name=name,
        url=f"/tiers/{name}" if url is None else str(url),
        policy=TierPolicy(**policy),
        storage_options=dict(storage_options or {}),
    )


def manifest(
    run: str,
    step: int,
    files: Iterable[FileEntry] = (),
    *,
    name: str | None = None,
    layout: str = "hf",
    is_dir: bool = True,
    metrics: Mapping[str, float] | None = None,
    created_at: float = 0.0,
    node: str = "",
) -> Manifest:
    """A ``Manifest``; ``name`` defaults to HF's ``checkpoint-{step}``."""
    return Manifest(
        run=run,
        step=step,
        name=f"checkpoint-{step}" if name is None else name,
        layout=layout,
        is_dir=is_dir,
        files=tuple(files),
        metrics=dict(metrics or {}),
        created_at=created_at,
        node=node,
    )


def file_entries(path: Path) -> tuple[FileEntry, ...]:
    """What the catalog records for ``path``: every regular file below a directory (symlinks
    skipped, sorted by relative path), or ``("", size, hash)`` for a single file."""
    if not path.is_dir():
        return (FileEntry("", *hashing.hash_file(path)),)
    files = sorted(
        p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and not p.is_symlink()
    )
    return tuple(FileEntry(rel, *hashing.hash_file(path / rel)) for rel in files)


def manifest_of(root: Path, run: str, step: int, *, name: str | None = None, **fields: Any) -> Manifest:
    """The manifest of the checkpoint at ``root/run/name``, its files hashed from disk."""
    name = f"checkpoint-{step}" if name is None else name
    path = root / run / name
    return manifest(run, step, file_entries(path), name=name, is_dir=path.is_dir(), **fields)


# --------------------------------------------------------------------------------------------
# config files

FAST_DAEMON = {
    "settle_seconds": "1s",
    "trust_mtimes": True,  # tests back-date trees with utime to mean "settled"
    "retention_interval": "1s",
    "reap_interval": "1s",
    "rescan_interval": "1h",
    "metrics_addr": "",
}
"""A ``[daemon]`` table for tests of the running daemon: every pass each second, no /metrics."""

S3_CREDENTIALS = {"key": "testing", "secret": "testing"}
"""moto's fake credentials (conftest sets the same in the environment)."""


def local_tier(name: str, url: str | Path, **policy: Any) -> dict[str, Any]:
    """A ``[[tiers]]`` table of a local-directory tier; keywords are policy keys (``keep_last`` …)."""
    return {"name": name, "url": url, **policy}


def s3_tier(
    name: str,
    bucket: str,
    endpoint: str,
    *,
    prefix: str = "ckpt",
    storage_options: Mapping[str, Any] | None = None,
    **policy: Any,
) -> dict[str, Any]:
    """A ``[[tiers]]`` table of an S3 tier at ``s3://bucket/prefix`` reached through ``endpoint``
    (which wins over an ``endpoint_url`` in ``storage_options``); moto's fake credentials unless
    ``storage_options`` gives others."""
    options = {**(S3_CREDENTIALS if storage_options is None else storage_options), "endpoint_url": endpoint}
    return {"name": name, "url": f"s3://{bucket}/{prefix}", "storage_options": options, **policy}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | os.PathLike):
        return json.dumps(os.fspath(value))  # JSON's string escapes are TOML's basic-string escapes
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def _toml_lines(doc: Mapping[str, Any]) -> list[str]:
    return [f"{k} = {_toml_value(v)}" for k, v in doc.items() if v is not None]


def config_text(
    *,
    index: str | Path,
    tiers: Sequence[Mapping[str, Any]],
    daemon: Mapping[str, Any] | None = None,
    reaper: Mapping[str, Any] | None = None,
    **top: Any,
) -> str:
    """A ckptkeeper config: top-level keys (``index``, ``max_delete``, ``log_level`` …), then the
    ``[daemon]`` table, one ``[[tiers]]`` table per mapping, and ``[reaper]``. A value of ``None``
    leaves its key out; a mapping inside a tier (``storage_options``) is an inline table."""
    lines = _toml_lines({"index": index, **top})
    if daemon is not None:
        lines += ["", "[daemon]", *_toml_lines(daemon)]
    for t in tiers:
        lines += ["", "[[tiers]]", *_toml_lines(t)]
    if reaper is not None:
        lines += ["", "[reaper]", *_toml_lines(reaper)]
    return "\n".join(lines) + "\n"


def write_text_config(path: Path, text: str) -> Path:
    """Write config ``text`` to ``path`` as the daemon requires it (0600), replacing it atomically
    (a running daemon that reloads never reads half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def write_config(
    path: Path,
    *,
    index: str | Path,
    tiers: Sequence[Mapping[str, Any]],
    daemon: Mapping[str, Any] | None = None,
    reaper: Mapping[str, Any] | None = None,
    **top: Any,
) -> Path:
    """``config_text(...)`` written to ``path`` (0600, atomically); returns ``path``."""
    return write_text_config(path, config_text(index=index, tiers=tiers, daemon=daemon, reaper=reaper, **top))


def fleet_node(
    base: Path,
    name: str,
    bucket: str,
    endpoint: str,
    *,
    hot_keep_last: int = 1,
    cold_keep_last: int | None = 10,
    shared: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    reaper: Mapping[str, Any] | None = None,
) -> Path:
    """The config of node ``name`` of a fleet (``base/name/``: its own hot dir, index and
    ``node``), with a ``replicate`` cold tier in ``bucket`` (``shared`` unless told otherwise),
    and a ``[reaper]`` table if given. Tests back-date checkpoints to mean "settled", hence
    ``trust_mtimes``."""
    home = base / name
    (home / "hot").mkdir(parents=True, exist_ok=True)
    cold = s3_tier(
        "cold", bucket, endpoint, storage_options=storage_options, replicate=True, keep_last=cold_keep_last
    )
    if shared:
        cold["shared"] = True
    return write_config(
        home / "config.toml",
        index=home / "index.db",
        node=name,
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
        tiers=[local_tier("hot", home / "hot", keep_last=hot_keep_last), cold],
        reaper=reaper,
    )


PART_NODE_REAPER = {"partial_after": "10m", "failed_after": "1h", "keep_last_of_failed": 1}
"""The reaper of a :func:`part_node`: thresholds far below its runs' 3 h age."""


def part_node(
    base: Path,
    k: int,
    run_dir: Path,
    bucket: str,
    endpoint: str,
    *,
    cold_keep_last: int = 2,
    age: float = 3 * 3600,
) -> tuple[Path, Path]:
    """Node ``k`` of a job whose checkpoints span nodes: its hot dir and :func:`fleet_node` config
    (``base/node{k}/``, hot keeps 1, the shared bucket keeps ``cold_keep_last``,
    :data:`PART_NODE_REAPER`). The first call copies ``run_dir`` (the node's share of the run) to
    ``hot/<run_dir.name>`` with every mtime ``age`` seconds ago; called again, it only rewrites
    the config. Returns ``(hot, config)``."""
    name = f"node{k}"
    hot = base / name / "hot"
    if not hot.exists():
        hot.mkdir(parents=True)
        shutil.copytree(run_dir, hot / run_dir.name)
        then = time.time() - age
        for p in sorted(hot.rglob("*"), reverse=True):
            os.utime(p, (then, then), follow_symlinks=False)
    config = fleet_node(base, name, bucket, endpoint, cold_keep_last=cold_keep_last, reaper=PART_NODE_REAPER)
    return hot, config


def hf_checkpoint(run_dir: Path, step: int, payload: bytes, *, age: float = 3600.0) -> Path:
    """``run_dir/checkpoint-<step>`` as the HF Trainer leaves it (weights + ``trainer_state.json``),
    every mtime ``age - step`` seconds ago: settled, and newer steps newer."""
    when = time.time() - age + step
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(payload)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))
    return ckpt


def index_checkpoint(index: Any, run: str, step: int, *, version: str | None = None, nbytes: int = 1) -> int:
    """Catalog a complete ``checkpoint-<step>`` of ``run`` in ``index`` (an open
    :class:`~ckptkeeper.index.Index`); returns its id. ``version`` defaults to ``v<step>``."""
    return int(
        index.upsert_checkpoint(
            run=run,
            name=f"checkpoint-{step}",
            step=step,
            layout="hf",
            state=COMPLETE,
            created_at=0.0,
            last_write=0.0,
            bytes=nbytes,
            metrics={},
            committed=False,
            version=f"v{step}" if version is None else version,
            manifest_json=None,
            problem=None,
        )
    )


def start_cli(config: Path, *args: str) -> subprocess.Popen[str]:
    """``ckptkeeper --config CONFIG ARGS`` in a subprocess (text pipes), without ``CKPTKEEPER_*``
    variables of the test environment (crash points, overrides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.Popen(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_cli(config: Path, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """:func:`start_cli` to the end."""
    proc = start_cli(config, *args)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
