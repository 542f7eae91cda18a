"""What real frameworks leave on disk (issue 16): for each framework, a complete save and a save
killed with SIGKILL mid-write, as committed under ``tests/fixtures/<framework>/`` by
``tests/fixtures/generate.py`` (framework versions in each tree's ``FIXTURE.json``).

Each tree is recognized right (step, state, through ``scan`` and ``ls``), and after ``prune`` the
killed save's leftovers are gone whole — temp dirs with everything in them, temp files, the partial
checkpoint dir itself — while every complete checkpoint is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.ingest.layouts import scan_run
from ckptkeeper.ingest.layouts.temps import ORBAX_TMP, SAFETENSORS_TMP

FIXTURES = Path(__file__).parent / "fixtures"
RUN = "run"

# (name, step, state) of every checkpoint the catalog lists after `scan`.
EXPECTED: dict[tuple[str, str], list[tuple[str, int, str]]] = {
    ("hf", "complete"): [("checkpoint-2", 2, "complete"), ("checkpoint-4", 4, "complete")],
    ("hf", "killed"): [("checkpoint-2", 2, "writing")],
    ("accelerate", "complete"): [
        # checkpoint_N counts saves; the step is the one accelerate recorded (3 accumulate() calls per save)
        ("checkpoints/checkpoint_0", 3, "complete"),
        ("checkpoints/checkpoint_1", 6, "complete"),
    ],
    ("accelerate", "killed"): [("checkpoints/checkpoint_0", 0, "writing")],
    ("lightning", "complete"): [
        ("checkpoints/epoch=0-step=2.ckpt", 2, "complete"),
        ("checkpoints/epoch=1-step=4.ckpt", 4, "complete"),
    ],
    # Killed mid-training right after its first checkpoint landed: Lightning's _atomic_save stages the
    # file outside the run dir (fsspec transaction) and moves it in, so a kill mid-save leaves no part.
    ("lightning", "killed"): [("checkpoints/epoch=0-step=2.ckpt", 2, "complete")],
    ("safetensors", "complete"): [("step_100", 100, "complete")],
    ("safetensors", "killed"): [("step_100", 100, "writing")],
    ("dcp", "complete"): [("step_100", 100, "complete")],
    ("dcp", "killed"): [("step_100", 100, "writing")],
    ("orbax", "complete"): [("checkpoints/100", 100, "complete"), ("checkpoints/200", 200, "complete")],
    ("orbax", "killed"): [],  # only the temp dir: never a checkpoint (once read as step 0)
    ("deepspeed", "complete"): [
        ("checkpoints/global_step1", 1, "complete"),
        ("checkpoints/global_step2", 2, "complete"),
    ],
    ("deepspeed", "killed"): [("checkpoints/global_step1", 1, "writing")],
    ("megatron", "complete"): [
        ("checkpoints/iter_0000010", 10, "complete"),
        ("checkpoints/iter_0000020", 20, "complete"),
    ],
    ("megatron", "killed"): [("checkpoints/iter_0000010", 10, "writing")],
    ("nemo", "complete"): [
        ("checkpoints/megatron_gpt--val_loss=1.50-step=100-consumed_samples=800.0.ckpt", 100, "complete"),
        ("checkpoints/megatron_gpt--val_loss=1.00-step=200-consumed_samples=1600.0.ckpt", 200, "complete"),
    ],
    ("nemo", "killed"): [
        ("checkpoints/megatron_gpt--val_loss=1.50-step=100-consumed_samples=800.0.ckpt", 100, "writing")
    ],
}
PRESENT = sorted(k for k in EXPECTED if (FIXTURES / k[0] / k[1] / RUN).is_dir())


def load(framework: str, variant: str, tmp_path: Path) -> tuple[Path, Path]:
    """The committed tree copied into a hot root, every mtime set to two hours ago (git keeps none:
    one uniform time, so "a shard newer than its marker" means nothing here); returns (config, hot)."""
    hot = tmp_path / "hot"
    shutil.copytree(FIXTURES / framework / variant / RUN, hot / RUN, symlinks=True)
    for keep in hot.rglob(".keep-empty-dir"):
        keep.unlink()
    then = time.time() - 2 * 3600
    for p in sorted(hot.rglob("*"), reverse=True):
        os.utime(p, (then, then), follow_symlinks=False)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},  # the tree is back-dated with utime
        tiers=[local_tier("hot", hot)],
        reaper={"partial_after": "1h", "failed_after": "30d", "keep_last_of_failed": 1},
    )
    return config, hot


def cli(config: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) if "--json" in args else result.stdout


def listed(config: Path) -> list[tuple[str, int, str]]:
    doc = cli(config, "ls", "--json")
    return sorted((c["name"], c["step"], c["state"]) for r in doc["runs"] for c in r["checkpoints"])


def files_of(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_every_framework_has_committed_fixtures() -> None:
    missing = sorted(set(EXPECTED) - set(PRESENT))
    # Lightning leaves nothing in the run dir when killed mid-save (see generate.child_lightning):
    # its killed tree is a run killed mid-training.
    assert missing in ([], [("lightning", "killed")]), (
        f"regenerate with tests/fixtures/generate.py: {missing}"
    )
    for framework, variant in PRESENT:
        doc = json.loads((FIXTURES / framework / variant / "FIXTURE.json").read_text())
        assert doc["framework"] == framework and doc["variant"] == variant
        assert all(v != "not installed" for v in doc["versions"].values()) or doc["source"] == "naming"


@pytest.mark.parametrize(("framework", "variant"), PRESENT, ids=[f"{f}-{v}" for f, v in PRESENT])
def test_recognized_and_leftovers_reaped_whole(framework: str, variant: str, tmp_path: Path) -> None:
    config, hot = load(framework, variant, tmp_path)
    run_dir = hot / RUN
    scan = scan_run(run_dir, RUN)
    steps_from_tmp = [c for c in scan.candidates if ORBAX_TMP in c.name or "/.tmp" in c.name]
    assert steps_from_tmp == [], "a temp dir's contents must never become a checkpoint"

    cli(config, "scan", "--json")
    assert listed(config) == sorted(EXPECTED[(framework, variant)])
    complete = [name for name, _, state in EXPECTED[(framework, variant)] if state == "complete"]
    kept_before = {
        name: files_of(run_dir / name) if (run_dir / name).is_dir() else (run_dir / name).stat().st_size
        for name in complete
    }

    for _ in range(2):  # NeMo: the marker of a reaped partial is orphaned, reaped by the next prune
        cli(config, "prune", "--json")
        cli(config, "scan", "--json")

    after = scan_run(run_dir, RUN)
    assert after.artifacts == ()
    assert [c.name for c in after.candidates if not c.complete] == []
    assert listed(config) == sorted(e for e in EXPECTED[(framework, variant)] if e[2] == "complete")
    leftovers = sorted(
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if ORBAX_TMP in p.name
        or SAFETENSORS_TMP.match(p.name)
        or p.name.endswith(("-unfinished", ".tmp", ".part"))
    )
    assert leftovers == []
    for name, before in kept_before.items():
        now = files_of(run_dir / name) if (run_dir / name).is_dir() else (run_dir / name).stat().st_size
        assert now == before, f"complete checkpoint {name} changed"
    for name, _, state in EXPECTED[(framework, variant)]:
        if state != "complete":
            assert not (run_dir / name).exists(), f"partial {name} left behind"


def test_orbax_012_killed_tmp_dir_is_reaped_whole(tmp_path: Path) -> None:
    """Orbax 0.12 names its temp dir ``<step>.orbax-checkpoint-tmp`` (no timestamp) with nested
    ``default.orbax-checkpoint-tmp`` and ``ocdbt.process_N``; nothing of it may survive a prune."""
    if ("orbax", "killed") not in PRESENT:
        pytest.skip("no orbax killed fixture")
    config, hot = load("orbax", "killed", tmp_path)
    tmp_dirs = [p for p in (hot / RUN / "checkpoints").iterdir() if p.name.endswith(ORBAX_TMP)]
    assert tmp_dirs, "Orbax 0.12 temp name"
    assert any(ORBAX_TMP in p.name for p in tmp_dirs[0].rglob("*")) or any(
        p.name.startswith("ocdbt.process_") for p in tmp_dirs[0].rglob("*")
    )
    plan = cli(config, "prune", "--dry-run", "--json")
    reaps = [(a["path"], a["rule"]) for a in plan["actions"]]
    assert reaps == [(f"{RUN}/checkpoints/{tmp_dirs[0].name}", "orbax-tmp")]
    cli(config, "prune", "--json")
    assert not tmp_dirs[0].exists()


def test_accelerate_ls_says_which_step_it_shows(tmp_path: Path) -> None:
    config, _ = load("accelerate", "complete", tmp_path)
    cli(config, "scan", "--json")
    out = cli(config, "ls")
    assert "accelerate_save=1" in out and "N counts saves" in out


# -- restore(step="best") with no tier metric ----------------------------------------------------


def test_hf_best_without_tier_metric_uses_trainer_state(tmp_path: Path) -> None:
    import ckptkeeper

    config, hot = load("hf", "complete", tmp_path)
    cli(config, "scan", "--json")
    # What transformers recorded: best_model_checkpoint in the newest trainer_state.json.
    assert ckptkeeper.restore(RUN, "best", config=config) == hot / RUN / "checkpoint-4"
    by_max = ckptkeeper.restore(RUN, "best", config=config, metric="eval_loss", mode="max")
    assert by_max == hot / RUN / "checkpoint-2"

    # The record decides, not recency: HF names the best by an absolute path of its output dir.
    state_file = hot / RUN / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["best_model_checkpoint"] = "/elsewhere/output/checkpoint-2"
    state_file.write_text(json.dumps(state))
    os.utime(state_file, (time.time() - 7200, time.time() - 7200))
    cli(config, "scan", "--json")
    assert ckptkeeper.restore(RUN, "best", config=config) == hot / RUN / "checkpoint-2"


def test_cli_restore_best_metric_and_mode(tmp_path: Path) -> None:
    config, _hot = load("hf", "complete", tmp_path)
    cli(config, "scan", "--json")
    out = cli(
        config,
        "restore",
        RUN,
        "--step",
        "best",
        "--metric",
        "eval_loss",
        "--mode",
        "max",
        "--to",
        str(tmp_path / "r"),
    )
    assert out.strip() == str(tmp_path / "r" / "checkpoint-2")
    result = CliRunner().invoke(
        main,
        [
            "--config",
            str(config),
            "restore",
            RUN,
            "--step",
            "2",
            "--metric",
            "eval_loss",
            "--to",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code == 2 and "--metric and --mode only apply to --step best" in result.output
    result = CliRunner().invoke(
        main,
        [
            "--config",
            str(config),
            "restore",
            RUN,
            "--step",
            "best",
            "--metric",
            "nope",
            "--to",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code == 1 and "reports 'nope'" in result.output and "eval_loss" in result.output


def test_best_without_any_record_names_the_options(tmp_path: Path) -> None:
    import ckptkeeper

    config, _ = load("dcp", "complete", tmp_path)
    cli(config, "scan", "--json")
    with pytest.raises(LookupError) as err:
        ckptkeeper.restore(RUN, "best", config=config)
    assert "metric=" in str(err.value) and "--metric" in str(err.value) and "tier" in str(err.value)


def test_hf_run_without_hook_is_warned_in_ls_and_status(tmp_path: Path) -> None:
    config, _ = load("hf", "complete", tmp_path)
    cli(config, "scan", "--json")
    (run,) = cli(config, "ls", "--json")["runs"]
    assert "WARNING: no .ckptkeeper/ hook" in run["state_reason"]
    assert "WARNING: no .ckptkeeper/ hook" in cli(config, "ls")
    status = cli(config, "status", "--json")
    assert [w.split(":")[0] for w in status["warnings"]] == [RUN]
    assert f"WARNING run {RUN}: no .ckptkeeper/ hook" in cli(config, "status")


def test_lightning_nested_hook_binds_to_the_run(tmp_path: Path) -> None:
    """Written by real Lightning with ``ModelCheckpoint(dirpath=<run>/checkpoints)`` + KeeperCallback."""
    config, hot = load("lightning", "complete", tmp_path)
    assert (hot / RUN / "checkpoints" / ".ckptkeeper" / "run.json").is_file()
    cli(config, "scan", "--json")
    (run,) = cli(config, "ls", "--json")["runs"]
    assert run["state"] == "finished" and "WARNING" not in run["state_reason"]
    assert all("val_loss" in c["metrics"] for c in run["checkpoints"])
