"""Checkpoints lost in the field by other tools, each a named regression test here.

* HF #25129, #11769, #27138 — rotation deleted the best or the newest checkpoint (ordered by name or
  mtime, or the best one rotated out);
* Lightning #11379 — a run deleted another run's checkpoints (shared directory, prefix matching);
* Orbax #394 — copies that lacked a marker were deleted as if they were temp dirs;
* restic #4612 — a failed listing read as "empty" (see ``test_faults_s3.py::
  test_failed_or_partial_listing_deletes_nothing_restic_4612``, with the fault proxy);
* fsspec #1559 — a move swallowed a copy error and removed the source;
* and our own: two checkpoints sharing a step (Lightning ``-v1``, NeMo ``-last``) used to crash
  every prune (the planner keys by step, the catalog by name).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from faultproxy import FaultProxy
from layout_fixtures import torch_like_zip

HOUR = 3600.0


def digest_tree(path: Path) -> dict[str, str]:
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def age(path: Path, when: float) -> None:
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        os.utime(p, (when, when), follow_symlinks=False)


def hf(run: Path, step: int, *, eval_loss: float | None = None, when: float | None = None) -> Path:
    ckpt = run / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    payload = os.urandom(20_000)
    header = json.dumps({"w": {"dtype": "F32", "shape": [5000], "data_offsets": [0, 20_000]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    history: list[dict[str, Any]] = [{"step": step, "loss": 1.0}]
    if eval_loss is not None:
        history.append({"step": step, "eval_loss": eval_loss})
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    age(ckpt, when if when is not None else time.time() - HOUR)
    return ckpt


class Node:
    def __init__(self, tmp: Path, hot: dict[str, Any], *more: dict[str, Any], **top: Any) -> None:
        """A hot tier with policy ``hot``, then the ``more`` tier tables (``local_tier``/``s3_tier``)."""
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir(exist_ok=True)
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot, **hot), *more],
            **top,
        )

    def cli(self, *args: str, wrapper: str | None = None) -> subprocess.CompletedProcess[str]:
        head = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "ckptkeeper.cli"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        return subprocess.run(
            [*head, "--config", str(self.config), *args], capture_output=True, text=True, timeout=120, env=env
        )

    def ls(self) -> dict[tuple[str, int, str], list[str]]:
        result = self.cli("ls", "--json")
        assert result.returncode == 0, result.stderr
        return {
            (r["name"], c["step"], c["name"]): c["tiers"]
            for r in json.loads(result.stdout)["runs"]
            for c in r["checkpoints"]
        }


# -- HF #25129 / #11769 / #27138 ------------------------------------------------------------------


@pytest.mark.parametrize("keep_last", [1, 0])
def test_hf_25129_11769_27138_rotation_never_deletes_the_best_or_the_newest(
    tmp_path: Path, keep_last: int
) -> None:
    """HF rotated by name/mtime: after a resume the newest step had an old mtime and was deleted,
    and with ``load_best_model_at_end`` the best checkpoint was rotated out. Here names sort the
    other way round from steps (``checkpoint-1000`` < ``checkpoint-999``), mtimes are reversed (a
    resumed run rewrote old steps last) and the best checkpoint is the oldest one."""
    node = Node(tmp_path, {"keep_last": keep_last, "keep_best": 1, "metric": "eval_loss", "mode": "min"})
    run = node.hot / "resumed"
    steps = [98, 99, 100, 999, 1000]
    now = time.time()
    originals = {}
    for i, step in enumerate(steps):
        # mtime decreasing with step: the newest step looks oldest on disk
        path = hf(run, step, eval_loss=0.1 if step == 98 else 2.0 - step / 1e4, when=now - HOUR - i * 600)
        originals[step] = digest_tree(path)
    result = node.cli("prune")
    assert result.returncode == 0, result.stdout + result.stderr
    kept = {p.name for p in run.iterdir() if not p.name.startswith(".")}
    assert "checkpoint-98" in kept, "the best checkpoint was deleted"
    assert "checkpoint-1000" in kept, "the newest checkpoint (by step) was deleted"
    if keep_last == 1:
        assert kept == {"checkpoint-98", "checkpoint-1000"}
    for name in kept:
        step = int(name.split("-")[1])
        assert digest_tree(run / name) == originals[step]


# -- Lightning #11379 -----------------------------------------------------------------------------


def test_lightning_11379_never_deletes_another_runs_checkpoints(
    tmp_path: Path, s3_bucket: str, s3_storage_options: dict[str, Any], s3_client: Any
) -> None:
    """Lightning's ModelCheckpoint removed files of another run sharing its directory. Here runs
    whose names are prefixes of each other (``exp``/``exp-2``/``exp2``) hold checkpoints whose names
    are prefixes of each other (``checkpoint-1``/``-10``/``-100``), in hot and in S3; then ``exp``
    fails and is reaped everywhere but its newest — ``exp-2`` and ``exp2`` come out untouched."""
    node = Node(
        tmp_path,
        {"keep_last": 3},
        s3_tier(
            "cold",
            s3_bucket,
            s3_storage_options["endpoint_url"],
            prefix="c",
            storage_options=s3_storage_options,
            replicate=True,
        ),
    )
    for run in ("exp", "exp-2", "exp2"):
        for step in (1, 10, 100):
            hf(node.hot / run, step)
    others = {run: digest_tree(node.hot / run) for run in ("exp-2", "exp2")}
    first = node.cli("prune")  # everything replicated to cold
    assert first.returncode == 0, first.stdout + first.stderr
    keys_before = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])}
    control = node.hot / "exp" / ".ckptkeeper"
    control.mkdir()
    (control / "run.json").write_text(
        json.dumps({"version": 1, "name": "exp", "state": "failed", "pid": None})
    )
    second = node.cli("prune")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "failed run" in second.stdout
    for run, before in others.items():
        assert digest_tree(node.hot / run) == before, run
    keys_after = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])}
    gone = keys_before - keys_after
    assert gone and all(
        k.startswith(
            ("c/exp/checkpoint-1/", "c/exp/checkpoint-1.", "c/exp/checkpoint-10/", "c/exp/checkpoint-10.")
        )
        for k in gone
    ), sorted(gone)
    assert any(k.startswith("c/exp/checkpoint-100/") for k in keys_after)  # the failed run keeps its newest
    assert sorted(p.name for p in (node.hot / "exp").iterdir() if not p.name.startswith(".")) == [
        "checkpoint-100"
    ]
    placement = node.ls()
    for run in ("exp-2", "exp2"):
        for step in (1, 10, 100):
            assert placement[(run, step, f"checkpoint-{step}")] == ["hot", "cold"], (run, step)


# -- Orbax #394 -----------------------------------------------------------------------------------


def test_orbax_394_copies_that_lack_a_marker_are_never_deleted(tmp_path: Path) -> None:
    """Orbax deleted finished checkpoints that lacked its commit marker, taking them for temp dirs.
    Here: a warm copy with no manifest beside it (put there by hand, or by another tool), an Orbax
    dir committed the older way (``commit_success.txt``, no ``_CHECKPOINT_METADATA``), an Orbax dir
    with no marker at all but fresh (still being written), and one with no marker at all that is
    old. Only the last may ever be reaped (docs/design.md, "Reaper"), and not before ``partial_after``."""
    warm = tmp_path / "warm"
    node = Node(tmp_path, {"keep_last": 1}, local_tier("warm", warm, keep_last=2))
    foreign = warm / "orbax-run" / "7"
    foreign.mkdir(parents=True)
    (foreign / "default").mkdir()
    (foreign / "default" / "_METADATA").write_bytes(b"{}")
    (foreign / "default" / "d.bin").write_bytes(os.urandom(5000))
    foreign_before = digest_tree(foreign)

    run = node.hot / "orbax-run"
    now = time.time()

    def orbax(step: int, marker: str | None, when: float) -> Path:
        ckpt = run / str(step)
        (ckpt / "default").mkdir(parents=True)
        (ckpt / "default" / "_METADATA").write_bytes(b'{"tree": {}}')
        (ckpt / "default" / "d.bin").write_bytes(os.urandom(5000))
        if marker:
            (ckpt / marker).write_text('{"commit_timestamp_nsecs": 1}' if marker.startswith("_") else "")
        age(ckpt, when)
        return ckpt

    old_style = orbax(100, "commit_success.txt", now - 3 * HOUR)
    newest = orbax(200, "_CHECKPOINT_METADATA", now - 2 * HOUR)
    fresh = orbax(300, None, now - 5)
    before = {p: digest_tree(p) for p in (old_style, newest, fresh)}
    result = node.cli("prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert digest_tree(foreign) == foreign_before  # no manifest: not ours, never touched
    assert digest_tree(fresh) == before[fresh]  # no marker yet but written just now: never reaped
    assert digest_tree(newest) == before[newest]
    # the commit_success.txt checkpoint counts as complete: moved to warm with its marker, intact
    moved = warm / "orbax-run" / "100"
    assert digest_tree(moved) == before[old_style]
    assert (moved / "commit_success.txt").exists()


# -- fsspec #1559 -----------------------------------------------------------------------------------

FAIL_LOCAL_COMMIT = """
import errno, os, sys
import ckptkeeper.storage.localfs as _localfs
def commit(self, manifest):
    raise OSError(errno.EIO, "Input/output error (injected at commit)")
_localfs._LocalSink.commit = commit
from ckptkeeper.cli import main
sys.exit(main())
"""


def test_fsspec_1559_a_failed_copy_never_removes_the_source(
    tmp_path: Path, s3_bucket: str, s3_storage_options: dict[str, Any], s3_reset: str
) -> None:
    """fsspec's ``mv`` swallowed a copy error and deleted the source anyway. Here every copy fails
    at its commit point — an I/O error on the local tier, a refused manifest PUT on S3 — and the
    moves that depended on them must keep their sources, byte for byte."""
    with FaultProxy(s3_reset, rate=0.0) as proxy:
        proxy.rules.append(
            lambda r: "denied" if r.method == "PUT" and r.path.endswith(".ckptkeeper-manifest.json") else None
        )
        warm = tmp_path / "warm"
        warm.mkdir()
        node = Node(
            tmp_path,
            {"keep_last": 1},
            local_tier("warm", warm, keep_last=2, replicate=True),
            s3_tier(  # two copies per move: never a same-filesystem rename
                "cold",
                s3_bucket,
                proxy.url,
                prefix="c",
                storage_options=s3_storage_options,
                keep_last=4,
                replicate=True,
            ),
        )
        run = node.hot / "r"
        originals = {s: digest_tree(hf(run, s)) for s in (1, 2, 3, 4)}
        result = node.cli("prune", wrapper=FAIL_LOCAL_COMMIT)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "Input/output error (injected at commit)" in result.stderr
        assert "cold: commit of r/checkpoint-1 uncertain" in result.stderr
        assert re.search(
            r"copy of r/checkpoint-1 from .hot. to .cold. failed|commit of r/checkpoint-1: .*(Denied|Forbidden|PermissionError)",
            result.stderr,
        ), result.stderr
        for step, digest in originals.items():
            assert digest_tree(run / f"checkpoint-{step}") == digest, f"source of step {step} lost"
        assert not [p for p in warm.rglob("*") if p.is_file()]  # rolled back, nothing half-there
        placement = node.ls()
        assert all(tiers == ["hot"] for tiers in placement.values()), placement


# -- one step, two checkpoints --------------------------------------------------------------------


def test_two_checkpoints_sharing_a_step_are_planned_one_at_a_time(tmp_path: Path) -> None:
    """Lightning writes ``epoch=0-step=20-v1.ckpt`` beside ``epoch=0-step=20.ckpt`` after a restart,
    NeMo ``…-last.ckpt`` beside its step checkpoint: both are cataloged (by name), but the planner
    keys by (run, step) and raised ``duplicate checkpoint`` — every prune and every daemon retention
    pass failed, so nothing was tiered until the disk filled. Now the planner gets the newest
    complete one per step and the other is left untouched (a note says so); both survive."""
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, {"keep_last": 1}, local_tier("warm", warm, keep_last=3))
    ckpts = node.hot / "lit" / "checkpoints"
    now = time.time()
    paths = {}
    for i, name in enumerate(
        [
            "epoch=0-step=10.ckpt",
            "epoch=0-step=20.ckpt",
            "epoch=0-step=20-v1.ckpt",
            "epoch=0-step=30.ckpt",
            "epoch=0-step=40.ckpt",
        ]
    ):
        path = torch_like_zip(ckpts / name, payload=os.urandom(2000))
        age(path, now - HOUR + i)
        paths[name] = digest_tree(path)
    dry = node.cli("prune", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "lit@20: 2 checkpoints share this step; planning checkpoints/epoch=0-step=20-v1.ckpt" in dry.stdout
    for _ in range(2):
        result = node.cli("prune")
        assert result.returncode == 0, result.stdout + result.stderr
    placement = node.ls()
    # step 20 is kept by warm's keep_last 3: the planned one moved, the other stayed, both intact
    assert placement[("lit", 20, "checkpoints/epoch=0-step=20-v1.ckpt")] == ["warm"]
    assert placement[("lit", 20, "checkpoints/epoch=0-step=20.ckpt")] == ["hot"]
    assert (
        digest_tree(warm / "lit" / "checkpoints" / "epoch=0-step=20-v1.ckpt")
        == paths["epoch=0-step=20-v1.ckpt"]
    )
    assert digest_tree(ckpts / "epoch=0-step=20.ckpt") == paths["epoch=0-step=20.ckpt"]
    assert ("lit", 10, "checkpoints/epoch=0-step=10.ckpt") not in placement  # expired as the policy says


def test_shared_step_selection_is_pure_and_prefers_complete_then_newest() -> None:
    from ckptkeeper.actions.prune import one_per_step
    from ckptkeeper.core.model import Checkpoint, CheckpointState, Snapshot

    def c(name: str, state: CheckpointState, last_write: float) -> Checkpoint:
        return Checkpoint(
            run="r", step=20, name=name, layout="torch", state=state, created_at=0, last_write=last_write
        )

    snap = Snapshot(
        runs=(),
        checkpoints=(
            c("a.ckpt", CheckpointState.COMPLETE, 10),
            c("a-v1.ckpt", CheckpointState.COMPLETE, 20),
            c("a-v2.ckpt", CheckpointState.WRITING, 30),
        ),
    )
    out, notes = one_per_step(snap)
    assert [x.name for x in out.checkpoints] == ["a-v1.ckpt"]
    assert notes == [
        "r@20: 3 checkpoints share this step; planning a-v1.ckpt, leaving a-v2.ckpt, a.ckpt untouched"
    ]
    alone = Snapshot(runs=(), checkpoints=(c("a.ckpt", CheckpointState.COMPLETE, 1),))
    assert one_per_step(alone) == (alone, [])
