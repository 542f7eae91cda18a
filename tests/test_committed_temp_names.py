"""In a directory the hook committed, a file named like a temp is still one of its files.

``run.commit("<run>/step-3", step=3)`` says the directory is complete. A ``model.part`` or
``notes.tmp`` inside it used to be left out of the checkpoint's manifest (a temp name is only a
guess): tiering never copied it, a restore lacked it, and the reaper deleted it from hot. A hookless
framework checkpoint keeps the old rule: a stray safetensors ``.tmpXXXXXX`` there is framework
litter, reaped on its own. Everything goes through the real CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner
from layout_fixtures import make_hf

import ckptkeeper
from ckptkeeper.cli import main
from ckptkeeper.ingest import hookfiles
from ckptkeeper.ingest.layouts import temps

HOUR = 3600.0
TEMP_NAMED = ("model.part", "notes.tmp")


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and ".ckptkeeper" not in p.as_posix()
    }


def _age(root: Path, seconds: float) -> None:
    when = time.time() - seconds
    for p in [*root.rglob("*"), root]:
        os.utime(p, (when, when), follow_symlinks=False)


def _config(tmp: Path, *, hot_keep: int, replicate: bool = False) -> Path:
    for name in ("hot", "warm"):
        (tmp / name).mkdir(exist_ok=True)
    return write_config(
        tmp / "config.toml",
        index=tmp / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        reaper={"failed_after": "1h", "partial_after": "1h", "keep_last_of_failed": 1},
        tiers=[
            local_tier("hot", tmp / "hot", keep_last=hot_keep),
            local_tier("warm", tmp / "warm", keep_last=5, replicate=replicate),
        ],
    )


def _cli(config: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
    return result.exit_code, result.output


def _tiers(config: Path, run: str) -> dict[int, list[str]]:
    code, out = _cli(config, "ls", "--json")
    assert code == 0, out
    (doc,) = [r for r in json.loads(out)["runs"] if r["name"] == run]
    return {c["step"]: c["tiers"] for c in doc["checkpoints"]}


def _hooked_run(run_dir: Path, steps: tuple[int, ...] = (3, 4)) -> dict[int, dict[str, str]]:
    """Each step a directory the hook committed, holding normal files and temp-named user files;
    returns each step's digests as written."""
    run = ckptkeeper.track_run(run_dir, heartbeat_interval=3600)
    for step in steps:
        ckpt = run_dir / f"step-{step}"
        (ckpt / "shards").mkdir(parents=True)
        (ckpt / "weights.bin").write_bytes(os.urandom(4096))
        (ckpt / "shards" / "rank0.bin").write_bytes(os.urandom(2048))
        (ckpt / "config.json").write_text(json.dumps({"step": step}))
        for name in TEMP_NAMED:
            (ckpt / name).write_bytes(os.urandom(1024))
        run.commit(ckpt, step=step)
    run.finish()
    return {step: _digests(run_dir / f"step-{step}") for step in steps}


def test_a_committed_dir_moves_and_restores_with_its_temp_named_files(tmp_path: Path) -> None:
    config = _config(tmp_path, hot_keep=1)
    hot_run = tmp_path / "hot" / "hooked"
    written = _hooked_run(hot_run)
    assert set(TEMP_NAMED) <= written[3].keys()
    # A hookless HF checkpoint with the temp a killed safetensors write leaves: framework litter.
    hf = make_hf(tmp_path / "hot" / "hf-run", 100)
    (hf / ".tmpabc123").write_bytes(os.urandom(512))
    hf_files = _digests(hf)
    _age(tmp_path / "hot", 2 * HOUR)

    code, out = _cli(config, "scan")
    assert code == 0, out
    code, out = _cli(config, "prune")
    assert code == 0, out

    # step-3 moved hot -> warm whole; step-4 (kept in hot) lost nothing to the reaper.
    assert _tiers(config, "hooked") == {3: ["warm"], 4: ["hot"]}
    assert not (hot_run / "step-3").exists()
    assert _digests(tmp_path / "warm" / "hooked" / "step-3") == written[3]
    assert _digests(hot_run / "step-4") == written[4]
    code, out = _cli(config, "restore", "hooked", "--step", "3", "--to", str(tmp_path / "restored"))
    assert code == 0, out
    assert _digests(Path(out.strip().splitlines()[-1])) == written[3]
    # The hookless framework checkpoint: its stray temp is reaped on its own, nothing else.
    assert not (hf / ".tmpabc123").exists()
    assert _digests(hf) == {k: v for k, v in hf_files.items() if k != ".tmpabc123"}

    code, out = _cli(config, "prune")  # a second pass is a fixed point: still nothing reaped
    assert code == 0, out
    assert _digests(hot_run / "step-4") == written[4]


def test_a_committed_framework_checkpoint_moves_with_its_temp_named_files(tmp_path: Path) -> None:
    """An HF ``checkpoint-N`` the hook committed: a layout recognises it, the commit makes it whole."""
    config = _config(tmp_path, hot_keep=1)
    run_dir = tmp_path / "hot" / "hf-hooked"
    run = ckptkeeper.track_run(run_dir, heartbeat_interval=3600)
    written = {}
    for step in (10, 20):
        ckpt = make_hf(run_dir, step)
        for name in (*TEMP_NAMED, ".tmpabc123"):
            (ckpt / name).write_bytes(os.urandom(1024))
        run.commit(ckpt, step=step)
        written[step] = _digests(ckpt)
    run.finish()
    _age(run_dir, 2 * HOUR)

    assert _cli(config, "scan")[0] == 0
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _tiers(config, "hf-hooked") == {10: ["warm"], 20: ["hot"]}
    assert _digests(tmp_path / "warm" / "hf-hooked" / "checkpoint-10") == written[10]
    assert _digests(run_dir / "checkpoint-20") == written[20]


def test_committed_temp_names_in_a_failed_runs_kept_checkpoint_are_never_reaped(tmp_path: Path) -> None:
    config = _config(tmp_path, hot_keep=5)
    run_dir = tmp_path / "hot" / "failed"
    run = ckptkeeper.track_run(run_dir, heartbeat_interval=3600)
    ckpt = run_dir / "step-3"
    ckpt.mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(os.urandom(4096))
    (ckpt / "weights.tmp").write_bytes(os.urandom(1024))
    (ckpt / ".tmpQx7Zp2").write_bytes(os.urandom(1024))  # the user's file, whatever its name
    run.commit(ckpt, step=3)
    run.fail("NCCL timeout")
    _age(run_dir, 5 * HOUR)
    before = _digests(ckpt)

    code, out = _cli(config, "scan")
    assert code == 0, out
    code, out = _cli(config, "prune", "--dry-run", "--json")
    assert code == 0, out
    assert [a for a in json.loads(out)["actions"] if a.get("path", "").startswith("failed/")] == []
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _digests(ckpt) == before


def _old_listing(path: Path) -> tuple[tuple[str, ...], int, float, float]:
    """The listing a committed directory got before this rule: temp names left out."""
    assert hookfiles_every_file is not None
    files, _, newest, changed = hookfiles_every_file(path)
    kept = tuple(
        f
        for f in files
        if all(temps.dir_kind(p) is None for p in f.split("/")[:-1])
        and temps.file_kind(f.rsplit("/", 1)[-1], in_candidate=True) is None
    )
    return kept, sum((path / f).stat().st_size for f in kept), newest, changed


hookfiles_every_file = getattr(hookfiles, "_every_file", None)


def test_a_warm_copy_cataloged_before_the_rule_is_kept_and_hot_is_never_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index and a warm copy made by the old catalog (manifest without the temp-named files):
    the rescan gives a new version. The old warm copy is neither counted nor deleted, the hot copy
    is never let go for it, and the refused copy says what to do; once that copy is removed by
    hand, the next prune copies the checkpoint whole."""
    config = _config(tmp_path, hot_keep=5, replicate=True)
    run_dir = tmp_path / "hot" / "hooked"
    written = _hooked_run(run_dir, steps=(3,))[3]
    _age(run_dir, 2 * HOUR)
    warm_copy = tmp_path / "warm" / "hooked" / "step-3"
    old_files = {k: v for k, v in written.items() if k not in TEMP_NAMED}

    with monkeypatch.context() as old:  # the catalog as it was: temp names outside the manifest
        old.setattr(hookfiles, "_every_file", _old_listing, raising=False)
        old.setattr(hookfiles, "whole_checkpoint", lambda _run_dir, cand: cand, raising=False)
        old.setattr(hookfiles, "outside_commits", lambda _run, arts, _names: list(arts), raising=False)
        assert _cli(config, "scan")[0] == 0
        code, out = _cli(config, "prune")
        assert code == 0, out
    assert _tiers(config, "hooked") == {3: ["hot", "warm"]}
    assert _digests(warm_copy) == old_files

    code, out = _cli(config, "scan")
    assert code == 0, out
    assert _tiers(config, "hooked") == {3: ["hot"]}  # the old copy is not this version
    for _ in range(2):
        code, out = _cli(config, "prune")
        assert code == 1, out
        assert "holds an older listing of hooked/step-3" in out, out
        assert "without model.part, notes.tmp" in out, out
        assert _digests(warm_copy) == old_files  # nothing deleted it
        assert _digests(run_dir / "step-3") == written

    shutil.rmtree(warm_copy)
    (warm_copy.parent / "step-3.ckptkeeper-manifest.json").unlink()
    assert _cli(config, "scan")[0] == 0
    code, out = _cli(config, "prune")
    assert code == 0, out
    assert _tiers(config, "hooked") == {3: ["hot", "warm"]}
    assert _digests(warm_copy) == written
    code, out = _cli(config, "verify")
    assert code == 0, out
