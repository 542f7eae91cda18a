"""A checkpoint directory is atomic: nothing inside it is cataloged as a checkpoint of its own.

Files like ``shard-0.bin``, ``rank_0.pt`` or ``model-00001.bin`` carry a number that reads as a
step. Inside a directory the hook committed (``run.commit("<run>/step-3", step=3)``) or a layout
recognised (HF ``checkpoint-N``, DeepSpeed ``global_stepN``, Megatron ``iter_N``, DCP, Orbax),
each of them used to be cataloged as a checkpoint at step 0 or 1 too, and the reaper then deleted
it from inside the newest checkpoint of a failed run. Everything here goes through the real CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, manifest_of, s3_tier, write_config
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_fixtures import (
    make_dcp,
    make_deepspeed,
    make_hf,
    make_megatron,
    make_orbax,
    make_safetensors_files,
    torch_like_zip,
)

import ckptkeeper
from ckptkeeper.cli import main
from ckptkeeper.core.model import MANIFEST_SUFFIX

HOUR = 3600.0
NUMBERED = ("shard-0.bin", "model-00001.bin", "pytorch_model.bin", "rank_0.pt")
"""Files a save writes into its own directory whose names look like checkpoints at steps 0 and 1."""


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and ".ckptkeeper" not in p.parts
    }


def _age(root: Path, seconds: float) -> None:
    when = time.time() - seconds
    for p in [*root.rglob("*"), root]:
        os.utime(p, (when, when), follow_symlinks=False)


def _config(tmp: Path) -> Path:
    hot = tmp / "hot"
    hot.mkdir(exist_ok=True)
    return write_config(
        tmp / "config.toml",
        index=tmp / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        reaper={"failed_after": "1h", "partial_after": "1h", "keep_last_of_failed": 1},
        tiers=[local_tier("hot", hot)],
    )


def _cli(config: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
    return result.exit_code, result.output


def _cataloged(config: Path) -> dict[str, dict[str, int]]:
    """``scan``, then ``ls --json``: run -> {checkpoint name: step}."""
    code, out = _cli(config, "scan")
    assert code == 0, out
    code, out = _cli(config, "ls", "--json")
    assert code == 0, out
    return {r["name"]: {c["name"]: c["step"] for c in r["checkpoints"]} for r in json.loads(out)["runs"]}


def _write_parts(ckpt: Path, names: tuple[str, ...] = NUMBERED) -> Path:
    for name in names:
        path = ckpt / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".pt"):
            torch_like_zip(path, os.urandom(64))  # a complete torch.save zip: recognisable on its own
        else:
            path.write_bytes(os.urandom(4096))
    return ckpt


def _step_dir(run_dir: Path, step: int, names: tuple[str, ...] = NUMBERED) -> Path:
    return _write_parts(run_dir / f"step-{step}", names)


def _failed_hooked_run(run_dir: Path, names: tuple[str, ...] = NUMBERED) -> None:
    """Steps 1..3 committed as directories by the hook, then the run failed."""
    run = ckptkeeper.track_run(run_dir, heartbeat_interval=3600)
    for step in (1, 2, 3):
        run.commit(_step_dir(run_dir, step, names), step=step)
    run.fail("NCCL timeout")
    _age(run_dir, 2 * HOUR)


def test_prune_keeps_every_file_of_the_newest_committed_dir_of_a_failed_run(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "span-run"
    _failed_hooked_run(run_dir)
    newest = _digests(run_dir / "step-3")

    assert _cataloged(config) == {"span-run": {"step-1": 1, "step-2": 2, "step-3": 3}}
    code, out = _cli(config, "prune", "--dry-run")
    assert code == 0, out
    assert "step-3" not in out, out

    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(run_dir / "step-3") == newest
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == ["step-3"]
    assert _cataloged(config) == {"span-run": {"step-3": 3}}


def test_a_hookless_step_dir_of_numbered_parts_is_never_reaped_piecemeal(tmp_path: Path) -> None:
    """Without the hook no layout claims ``step-3/``: its numbered files are parts of it, not
    checkpoints at steps 0 and 1 to be reaped down to one once the run is stale."""
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "stale-run"
    for step in (1, 2, 3):
        _step_dir(run_dir, step)
    _age(run_dir, 5 * HOUR)
    before = _digests(run_dir)

    assert _cataloged(config).get("stale-run", {}) == {}
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(run_dir) == before


def test_numbered_files_in_a_stepless_framework_dir_are_its_parts(tmp_path: Path, torch_quiet: None) -> None:
    """An HF ``output_dir`` holds the final weights beside its ``checkpoint-N/``: the checkpoints
    below it still count, its own ``shard-0.bin`` / ``rank_0.pt`` never do."""
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "hf-out"
    out = run_dir / "out"
    make_safetensors_files(out)
    _write_parts(out)
    for step in (5, 10):
        make_hf(out, step)
    _age(run_dir, 5 * HOUR)
    before = _digests(out / "checkpoint-10")
    outer = {p: d for p, d in _digests(out).items() if "/" not in p}

    assert _cataloged(config)["hf-out"] == {"out/checkpoint-5": 5, "out/checkpoint-10": 10}
    code, out_text = _cli(config, "prune")
    assert code == 0, out_text
    assert _digests(out / "checkpoint-10") == before
    assert {p: d for p, d in _digests(out).items() if "/" not in p} == outer
    assert not (out / "checkpoint-5").exists()  # stale run: reaped down to its newest


def test_lightning_files_in_the_run_dir_and_a_checkpoints_dir_are_still_checkpoints(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "lit"
    for step in (10, 20):
        torch_like_zip(run_dir / f"epoch=0-step={step}.ckpt")
        torch_like_zip(run_dir / "checkpoints" / f"epoch=1-step={step + 100}.ckpt")
        torch_like_zip(run_dir / f"model_{step + 1000}.pt")
    _age(run_dir, 60)
    assert _cataloged(config)["lit"] == {
        "epoch=0-step=10.ckpt": 10,
        "epoch=0-step=20.ckpt": 20,
        "checkpoints/epoch=1-step=110.ckpt": 110,
        "checkpoints/epoch=1-step=120.ckpt": 120,
        "model_1010.pt": 1010,
        "model_1020.pt": 1020,
    }


FRAMEWORKS: dict[str, Callable[[Path, int], Path]] = {
    "hf": lambda run, step: make_hf(run, step),
    "deepspeed": lambda run, step: make_deepspeed(run, step),
    "megatron": lambda run, step: make_megatron(run, step),
    "dcp": lambda run, step: make_dcp(run, step),
    "orbax": lambda run, step: make_orbax(run, step, subdir="ckpts"),
}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("hooked", [False, True], ids=["hookless", "hooked"])
def test_framework_dirs_holding_numbered_files_are_one_checkpoint_each(
    tmp_path: Path, framework: str, hooked: bool, torch_quiet: None
) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "fw"
    run_dir.mkdir(parents=True)
    run = ckptkeeper.track_run(run_dir, heartbeat_interval=3600) if hooked else None
    dirs = {}
    for step in (1, 2, 3):
        ckpt = _write_parts(FRAMEWORKS[framework](run_dir, step), (*NUMBERED, "nested/shard-1.bin"))
        if run is not None:
            run.commit(ckpt, step=step)
        dirs[step] = ckpt.relative_to(run_dir).as_posix()
    if run is not None:
        run.fail("preempted")
    _age(run_dir, 5 * HOUR)
    newest = _digests(run_dir / dirs[3])

    assert _cataloged(config)["fw"] == {dirs[s]: s for s in (1, 2, 3)}
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(run_dir / dirs[3]) == newest
    assert _cataloged(config)["fw"] == {dirs[3]: 3}


_STEMS = st.sampled_from(
    ["shard", "model", "rank", "pytorch_model", "optim", "step", "iter", "global_step", "checkpoint"]
)
_NESTED = st.builds(
    lambda sub, stem, sep, n, ext: f"{sub}{stem}{sep}{n}{ext}",
    st.sampled_from(["", "model/", "optim/shards/", "checkpoint-7/", "global_step9/", "iter_0000005/"]),
    _STEMS,
    st.sampled_from(["-", "_", "=", ""]),
    st.integers(0, 99_999),
    st.sampled_from([".bin", ".pt", ".pth", ".ckpt", ".safetensors", ".npz", ".pkl", ".h5", ".msgpack"]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(_NESTED, min_size=1, max_size=4, unique=True))
def test_nothing_inside_a_committed_dir_is_cataloged_or_reaped(tmp_path: Path, names: list[str]) -> None:
    base = tmp_path / f"ex{time.monotonic_ns()}"
    base.mkdir()
    config = _config(base)
    run_dir = base / "hot" / "r"
    _failed_hooked_run(run_dir, tuple(names))
    newest = _digests(run_dir / "step-3")

    assert _cataloged(config) == {"r": {"step-1": 1, "step-2": 2, "step-3": 3}}
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(run_dir / "step-3") == newest
    assert _cataloged(config) == {"r": {"step-3": 3}}


def test_temps_inside_the_kept_committed_dir_never_take_a_file_of_it(tmp_path: Path) -> None:
    """Inside a checkpoint the hook committed, a temp-like name (``*.part``, ``.tmpXXXXXX``,
    ``.metadata.tmp``) is one of its files: in its manifest, never reaped on its own, however
    quiet; every file stays byte-identical (docs/concepts.md, "Completeness")."""
    config = _config(tmp_path)
    run_dir = tmp_path / "hot" / "span-run"
    _failed_hooked_run(run_dir, (*NUMBERED, ".metadata.tmp", "rank_1.pt.part", "opt/.tmpAbC123"))
    newest = _digests(run_dir / "step-3")

    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(run_dir / "step-3") == newest
    assert _cataloged(config) == {"span-run": {"step-3": 3}}


def test_a_copy_cataloged_inside_a_checkpoint_by_an_older_version_is_never_expired(
    tmp_path: Path, s3_client: Any, s3_bucket: str, s3_reset: str
) -> None:
    """Older versions tiered ``step-3/shard-0.bin`` as a checkpoint of its own: its copy lies
    inside the copy of ``step-3``. Cataloged, a cold ``keep_last = 1`` expired it (step 0) and so
    deleted an object of the step-3 copy; now it is quarantined and every object stays."""
    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        tiers=[local_tier("hot", tmp_path / "hot"), s3_tier("cold", s3_bucket, s3_reset, keep_last=1)],
    )
    stage = tmp_path / "stage"
    _step_dir(stage / "r", 3)
    for m in (
        manifest_of(stage, "r", 3, name="step-3", layout="committed"),
        manifest_of(stage, "r", 0, name="step-3/shard-0.bin", layout="file"),
    ):
        (stage / "r" / (m.name + MANIFEST_SUFFIX)).write_text(m.to_json())
    for path in sorted(stage.rglob("*")):
        if path.is_file():
            s3_client.put_object(
                Bucket=s3_bucket, Key=f"ckpt/{path.relative_to(stage)}", Body=path.read_bytes()
            )

    def objects() -> dict[str, str]:
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/r/step-3/").get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listed}

    before = objects()
    assert len(before) == len(NUMBERED) + 1, before
    assert _cataloged(config) == {"r": {"step-3": 3}}
    code, out = _cli(config, "ls", "--json")
    held = [q for q in json.loads(out)["quarantined"] if "shard-0.bin" in json.dumps(q)]
    assert held and "lies inside checkpoint 'step-3'" in json.dumps(held), out
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert objects() == before
