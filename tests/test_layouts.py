"""Recognizers of docs/design.md, "Completeness" on checkpoints written by the real libraries (torch, DCP, safetensors)
or as faithful fixtures (HF, DeepSpeed, Megatron, NeMo, Orbax): complete and partial variants,
plus the traps — symlinks, temp names, shared steps, multi-matches, odd names."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import layout_fixtures as fx  # tests/ is on sys.path (rootdir-less test dir, pytest prepend mode)
import pytest

from ckptkeeper.ingest import layouts
from ckptkeeper.ingest.layouts import Candidate, RunScan, parse_step, recognize, scan_run


def scan(run_dir: Path, run: str = "run") -> RunScan:
    return scan_run(run_dir, run)


def only(result: RunScan) -> Candidate:
    assert len(result.candidates) == 1, result.candidates
    return result.candidates[0]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "hot" / "run"
    path.mkdir(parents=True)
    return path


# --------------------------------------------------------------------------------------------------
# Every layout: a complete and partial variants (table-driven)

Maker = Callable[[Path], Any]
NEMO = fx.nemo_name(100)
ST_ABSENT = "shard model-00002-of-00002.safetensors listed in model.safetensors.index.json but absent"


def case(id: str, maker: Maker, name: str, layout: str, complete: bool, problem: str | None = None) -> Any:
    return pytest.param(maker, name, layout, complete, problem, id=id)


CASES = [
    case("hf", lambda r: fx.make_hf(r, 100), "checkpoint-100", "hf", True),
    case(
        "hf-no-state",
        lambda r: fx.make_hf(r, 100, complete=False),
        "checkpoint-100",
        "hf",
        False,
        "trainer_state.json missing",
    ),
    case(
        "torch",
        lambda r: fx.make_torch_file(r, 40, epoch=3),
        "checkpoints/epoch=3-step=40.ckpt",
        "torch",
        True,
    ),
    case(
        "torch-truncated",
        lambda r: fx.make_torch_file(r, 40, complete=False),
        "checkpoints/epoch=0-step=40.ckpt",
        "torch",
        False,
        "zip end-of-central-directory unreadable",
    ),
    case(
        "torch-pt",
        lambda r: fx.make_torch_file(r, 7, subdir="", name="model_7.pt"),
        "model_7.pt",
        "torch",
        True,
    ),
    case("dcp", lambda r: fx.make_dcp(r, 200), "step_200", "dcp", True),
    case(
        "dcp-metadata-tmp",
        lambda r: fx.make_dcp(r, 200, complete=False),
        "step_200",
        "dcp",
        False,
        ".metadata missing (only .metadata.tmp",
    ),
    case("dcp-numeric-name", lambda r: fx.make_dcp(r, 300, name="300"), "300", "dcp", True),
    case("deepspeed", lambda r: fx.make_deepspeed(r, 100), "global_step100", "deepspeed", True),
    case(
        "deepspeed-zero3-bf16",
        lambda r: fx.make_deepspeed(r, 100, stage=3, bf16=True, dp=4, mp=2),
        "global_step100",
        "deepspeed",
        True,
    ),
    case(
        "deepspeed-no-latest",
        lambda r: fx.make_deepspeed(r, 100, complete=False),
        "global_step100",
        "deepspeed",
        False,
        "'latest' missing",
    ),
    case(
        "deepspeed-latest-early",
        lambda r: fx.make_deepspeed(r, 100, complete=False, write_latest=True),
        "global_step100",
        "deepspeed",
        False,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ),
    case(
        "deepspeed-straggler-mp",
        lambda r: fx.make_deepspeed(r, 100, complete=False, write_latest=True, mp=2),
        "global_step100",
        "deepspeed",
        False,
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ),
    case(
        "lightning-deepspeed",
        lambda r: fx.make_lightning_deepspeed(r, 30),
        "checkpoints/epoch=0-step=30.ckpt",
        "deepspeed",
        True,
    ),
    case(
        "lightning-deepspeed-no-latest",
        lambda r: fx.make_lightning_deepspeed(r, 30, complete=False),
        "checkpoints/epoch=0-step=30.ckpt",
        "deepspeed",
        False,
        "'latest' missing",
    ),
    case("megatron", lambda r: fx.make_megatron(r, 100, tp=2, pp=2), "iter_0000100", "megatron", True),
    case(
        "megatron-no-tracker",
        lambda r: fx.make_megatron(r, 100, complete=False),
        "iter_0000100",
        "megatron",
        False,
        "latest_checkpointed_iteration.txt missing",
    ),
    case(
        "megatron-torch-dist",
        lambda r: fx.make_megatron(r, 100, fmt="torch_dist"),
        "iter_0000100",
        "megatron",
        True,
    ),
    case(
        "megatron-torch-dist-partial",
        lambda r: fx.make_megatron(r, 100, complete=False, fmt="torch_dist"),
        "iter_0000100",
        "megatron",
        False,
        "metadata.json missing",
    ),
    case("nemo", lambda r: fx.make_nemo(r, 100), f"checkpoints/{NEMO}.ckpt", "nemo", True),
    case(
        "nemo-unfinished",
        lambda r: fx.make_nemo(r, 100, complete=False),
        f"checkpoints/{NEMO}.ckpt",
        "nemo",
        False,
        f"{NEMO}-unfinished present",
    ),
    case("nemo-dist", lambda r: fx.make_nemo(r, 100, dist=True), f"checkpoints/{NEMO}", "nemo", True),
    case(
        "nemo-dist-unfinished",
        lambda r: fx.make_nemo(r, 100, complete=False, dist=True),
        f"checkpoints/{NEMO}",
        "nemo",
        False,
        "save unfinished",
    ),
    case("orbax", lambda r: fx.make_orbax(r, 100), "checkpoints/100", "orbax", True),
    case(
        "orbax-uncommitted",
        lambda r: fx.make_orbax(r, 100, complete=False),
        "checkpoints/100",
        "orbax",
        False,
        "_CHECKPOINT_METADATA and commit_success.txt missing",
    ),
    case("safetensors", lambda r: fx.make_safetensors(r, 100), "step_100", "safetensors", True),
    case(
        "safetensors-missing-shard",
        lambda r: fx.make_safetensors(r, 100, complete=False),
        "step_100",
        "safetensors",
        False,
        ST_ABSENT,
    ),
    case(
        "safetensors-single",
        lambda r: fx.make_safetensors(r, 100, single=True),
        "step_100",
        "safetensors",
        True,
    ),
    case(
        "safetensors-single-truncated",
        lambda r: fx.make_safetensors(r, 100, complete=False, single=True),
        "step_100",
        "safetensors",
        False,
        "model.safetensors: truncated",
    ),
]


@pytest.mark.parametrize(("maker", "name", "layout", "complete", "problem"), CASES)
def test_layout(
    run_dir: Path, maker: Maker, name: str, layout: str, complete: bool, problem: str | None
) -> None:
    maker(run_dir)
    cand = only(scan(run_dir))
    assert (cand.name, cand.layout, cand.complete) == (name, layout, complete), cand.problem
    assert cand.corrupt is False
    if problem is None:
        assert cand.problem is None
    else:
        assert cand.problem is not None and problem in cand.problem
    # the watcher's single-path entry point agrees with the walk
    assert recognize(run_dir / name, run_dir, "run") == cand


def test_candidate_fields_for_a_directory(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 100)
    cand = only(scan(run_dir))
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert cand.files == tuple(files)
    assert "trainer_state.json" in cand.files and cand.is_dir and cand.run == "run" and cand.step == 100
    assert cand.bytes == sum((ckpt / f).stat().st_size for f in files)
    os.utime(ckpt / "optimizer.pt", (1e9, 2e9))
    assert only(scan(run_dir)).last_write == 2e9


def test_candidate_fields_for_a_file(run_dir: Path) -> None:
    path = fx.make_torch_file(run_dir, 40)
    cand = only(scan(run_dir))
    st = path.stat()
    assert (cand.files, cand.is_dir, cand.bytes, cand.last_write) == (("",), False, st.st_size, st.st_mtime)


def test_torch_file_that_is_not_a_zip_is_not_complete(run_dir: Path) -> None:
    (run_dir / "model_5.pt").write_bytes(b"\x80\x02legacy pickle, not a zip")
    cand = only(scan(run_dir))
    assert not cand.complete and "not a zip" in (cand.problem or "")


def test_generic_file_fallback(run_dir: Path) -> None:
    import numpy as np

    np.savez(run_dir / "weights_step300.npz", w=np.zeros(8))
    np.savez(run_dir / "weights_step400.npz", w=np.zeros(512))
    fx.truncate(run_dir / "weights_step400.npz")
    (run_dir / "params_500.msgpack").write_bytes(b"\x81\xa1w\x00")
    got = {(c.step, c.layout, c.complete) for c in scan(run_dir).candidates}
    assert got == {(300, "file", True), (400, "file", False), (500, "file", True)}


# --------------------------------------------------------------------------------------------------
# Metrics and corruption


def test_hf_metrics_come_from_log_history_entries_for_that_step(run_dir: Path) -> None:
    fx.make_hf(run_dir, 100, eval_loss=0.75, loss=1.5)
    metrics = only(scan(run_dir)).metrics
    assert metrics["eval_loss"] == 0.75 and metrics["loss"] == 1.5  # not the step-50 entry's 2.5
    assert metrics["grad_norm"] == 1.25 and "step" not in metrics


def test_hf_metrics_skip_non_numeric_and_non_finite(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 10)
    history = [{"step": 10, "loss": float("nan"), "note": "x", "flag": True, "eval_acc": 0.9}]
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": history}))
    assert only(scan(run_dir)).metrics == {"eval_acc": 0.9}


@pytest.mark.parametrize(
    "raw", [b'{"global_step": 10, "log_hist', b"[1, 2]", b'{"log_history": 3}', b"\xff\xfe"]
)
def test_malformed_trainer_state_is_corrupt(run_dir: Path, raw: bytes) -> None:
    ckpt = fx.make_hf(run_dir, 10)
    (ckpt / "trainer_state.json").write_bytes(raw)
    cand = only(scan(run_dir))
    assert cand.corrupt and not cand.complete and "trainer_state.json unparseable" in (cand.problem or "")


def test_truncated_trainer_state_from_fixture_is_corrupt(run_dir: Path) -> None:
    fx.make_hf(run_dir, 10, corrupt=True)
    assert only(scan(run_dir)).corrupt


def test_malformed_safetensors_index_is_corrupt(run_dir: Path) -> None:
    ckpt = fx.make_safetensors(run_dir, 100)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ')
    cand = only(scan(run_dir))
    assert cand.corrupt and not cand.complete


def test_index_pointing_outside_the_checkpoint_is_corrupt(run_dir: Path) -> None:
    ckpt = fx.make_safetensors(run_dir, 100)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    cand = only(scan(run_dir))
    assert cand.corrupt and "outside the checkpoint" in (cand.problem or "")


def test_name_metrics_for_lightning_and_nemo(run_dir: Path) -> None:
    fx.make_torch_file(run_dir, 20, epoch=1, name="epoch=1-step=20-val_loss=0.52-v1.ckpt")
    fx.make_nemo(run_dir, 100, val_loss=1.23)
    by_step = {c.step: c for c in scan(run_dir).candidates}
    assert by_step[20].metrics == {"epoch": 1.0, "val_loss": 0.52}
    assert by_step[100].metrics == {"val_loss": 1.23, "consumed_samples": 800.0}


def test_orbax_metrics_and_uncommitted_timestamp(run_dir: Path) -> None:
    ckpt = fx.make_orbax(run_dir, 100, metrics={"eval_loss": 0.5, "acc": 0.9})
    assert only(scan(run_dir)).metrics == {"eval_loss": 0.5, "acc": 0.9}
    doc = json.loads((ckpt / "_CHECKPOINT_METADATA").read_text())
    (ckpt / "_CHECKPOINT_METADATA").write_text(json.dumps(doc | {"commit_timestamp_nsecs": None}))
    assert not only(scan(run_dir)).complete
    (ckpt / "commit_success.txt").write_text("Checkpoint commit was successful to ...")
    assert only(scan(run_dir)).complete


# --------------------------------------------------------------------------------------------------
# Framework traps


def test_deepspeed_older_step_is_vouched_for_by_a_later_latest(run_dir: Path) -> None:
    fx.make_deepspeed(run_dir, 100)
    fx.make_deepspeed(run_dir, 200)
    fx.make_deepspeed(run_dir, 300, complete=False)  # latest still says global_step200
    got = {c.step: c.complete for c in scan(run_dir).candidates}
    assert got == {100: True, 200: True, 300: False}


def test_deepspeed_inconsistent_zero_shards(run_dir: Path) -> None:
    ckpt = fx.make_deepspeed(run_dir, 100, dp=4)
    (ckpt / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    cand = only(scan(run_dir))
    assert not cand.complete and "zero_pp_rank_2_mp_rank_00_optim_states.pt" in (cand.problem or "")


def test_deepspeed_missing_top_rank_everywhere_is_invisible_to_names(run_dir: Path) -> None:
    """Known limit: the dp world size is inside the pickles; from names, ranks 0..D-2 of a D-rank
    save look like a whole (D-1)-rank save. ``latest`` plus settling is the guard there."""
    ckpt = fx.make_deepspeed(run_dir, 100, dp=4)
    (ckpt / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    assert only(scan(run_dir)).complete


def test_megatron_tracker_behind_and_release(run_dir: Path) -> None:
    fx.make_megatron(run_dir, 100)
    fx.make_megatron(run_dir, 200, complete=False)
    assert {c.step: c.complete for c in scan(run_dir).candidates} == {100: True, 200: False}
    (run_dir / "latest_checkpointed_iteration.txt").write_text("release")
    assert {c.step: c.complete for c in scan(run_dir).candidates} == {100: True, 200: True}
    (run_dir / "latest_checkpointed_iteration.txt").write_text("")  # being rewritten
    assert all(not c.complete and not c.corrupt for c in scan(run_dir).candidates)


def test_megatron_missing_rank_file(run_dir: Path) -> None:
    ckpt = fx.make_megatron(run_dir, 100, tp=2)
    (ckpt / "mp_rank_01" / "model_optim_rng.pt").unlink()
    assert "mp_rank_01/model_optim_rng.pt missing" in (only(scan(run_dir)).problem or "")


def test_megatron_non_persistent_is_ignored(run_dir: Path) -> None:
    fx.make_megatron(run_dir / "non_persistent", 50)
    fx.make_megatron(run_dir, 100)
    assert [c.name for c in scan(run_dir).candidates] == ["iter_0000100"]


def test_dcp_reused_dir_with_newer_shard(run_dir: Path) -> None:
    ckpt = fx.make_dcp(run_dir, 200)
    old = time.time() - 3600
    os.utime(ckpt / ".metadata", (old, old))
    cand = only(scan(run_dir))
    assert not cand.complete and "newer than .metadata" in (cand.problem or "")


def test_dcp_metadata_tmp_beside_old_metadata(run_dir: Path) -> None:
    ckpt = fx.make_dcp(run_dir, 200)
    (ckpt / ".metadata.tmp").write_bytes(b"partial")
    result = scan(run_dir)
    assert not only(result).complete and "re-save in progress" in (only(result).problem or "")
    assert result.artifacts == ()  # the partial candidate is what gets reaped, not also the file


def test_nemo_mp_rank_layout_marker_lives_above_rank_dir(run_dir: Path) -> None:
    ckpts = run_dir / "checkpoints"
    path = fx.make_torch_file(ckpts, 100, subdir="mp_rank_00", name=f"{fx.nemo_name(100)}.ckpt")
    (ckpts / f"{fx.nemo_name(100)}-unfinished").touch()
    result = scan(run_dir)
    cand = only(result)
    assert cand.name == f"checkpoints/mp_rank_00/{path.name}" and cand.layout == "nemo" and not cand.complete
    assert result.artifacts == ()  # the marker has its checkpoint: not an orphan


def test_nemo_last_and_regular_share_a_step(run_dir: Path) -> None:
    fx.make_nemo(run_dir, 100)
    fx.make_nemo(run_dir, 100, last=True)
    assert [(c.step, c.complete) for c in scan(run_dir).candidates] == [(100, True), (100, True)]


def test_lightning_version_suffix_keeps_both_candidates_ordered(run_dir: Path) -> None:
    fx.make_torch_file(run_dir, 10, version=1)
    fx.make_torch_file(run_dir, 10)
    fx.make_torch_file(run_dir, 9)
    names = [(c.step, c.name) for c in scan(run_dir).candidates]
    assert names == [
        (9, "checkpoints/epoch=0-step=9.ckpt"),
        (10, "checkpoints/epoch=0-step=10-v1.ckpt"),
        (10, "checkpoints/epoch=0-step=10.ckpt"),
    ]


def test_steps_order_numerically_not_by_name(run_dir: Path) -> None:
    for step in (1000, 200, 30):
        fx.make_hf(run_dir, step)
    assert [c.step for c in scan(run_dir).candidates] == [30, 200, 1000]


def test_huge_step_is_an_int(run_dir: Path) -> None:
    fx.make_torch_file(run_dir, 1, subdir="", name="step=123456789012345678901234567890.ckpt")
    assert only(scan(run_dir)).step == 123456789012345678901234567890


# --------------------------------------------------------------------------------------------------
# Multi-match: one candidate, most specific layout, complete only if every marker agrees


def test_hf_with_sharded_safetensors_missing_shard(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 100, sharded=True)
    assert only(scan(run_dir)).complete
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    cand = only(scan(run_dir))
    assert (cand.layout, cand.complete) == ("hf", False)
    assert "model-00002-of-00002.safetensors" in (cand.problem or "")


def test_hf_partial_and_safetensors_partial_report_both_problems(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 100, complete=False)
    fx.truncate(ckpt / "model.safetensors", 0.9)
    problem = only(scan(run_dir)).problem or ""
    assert problem.index("trainer_state.json missing") < problem.index("model.safetensors: truncated")


def test_dcp_inside_orbax_step_dir(run_dir: Path) -> None:
    ckpt = fx.make_orbax(run_dir, 200)
    fx.make_dcp(ckpt.parent, 200, name="200", complete=False)
    cand = only(scan(run_dir))
    assert (cand.layout, cand.complete) == ("orbax", False) and ".metadata missing" in (cand.problem or "")
    os.replace(ckpt / ".metadata.tmp", ckpt / ".metadata")
    assert only(scan(run_dir)).complete


def test_walk_stops_at_recognized_dir(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 100)
    fx.make_deepspeed(ckpt, 100)  # HF + DeepSpeed writes checkpoint-100/global_step100 + latest
    fx.make_torch_file(ckpt, 5, subdir="inner")
    cand = only(scan(run_dir))
    assert cand.name == "checkpoint-100" and "global_step100/mp_rank_00_model_states.pt" in cand.files


def test_precedence_order_is_documented() -> None:
    assert layouts.LAYOUTS == (
        "hf", "accelerate", "megatron", "deepspeed", "nemo", "orbax", "dcp", "safetensors", "torch", "file",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# What is skipped: symlinks, control dir, mount points, shards, names without a step


def test_last_ckpt_symlink_is_not_followed(run_dir: Path) -> None:
    path = fx.make_torch_file(run_dir, 10)
    (path.parent / "last.ckpt").symlink_to(path.name)
    result = scan(run_dir)
    assert [c.name for c in result.candidates] == [
        "checkpoints/epoch=0-step=10.ckpt"
    ] and result.artifacts == ()
    assert recognize(path.parent / "last.ckpt", run_dir, "run") is None


def test_last_ckpt_copy_without_step_is_ignored(run_dir: Path) -> None:
    fx.make_torch_file(run_dir, 10, name="last.ckpt")
    fx.make_torch_file(run_dir, 10, name="last-v1.ckpt")
    assert scan(run_dir).candidates == ()


def test_symlink_to_outside_dir_is_not_followed(tmp_path: Path, run_dir: Path) -> None:
    outside = tmp_path / "outside"
    fx.make_hf(outside, 5)
    fx.make_torch_file(outside, 6, subdir="")
    (outside / "junk.tmp").write_text("x")
    (run_dir / "ext").symlink_to(outside, target_is_directory=True)
    (run_dir / "checkpoint-7").symlink_to(outside / "checkpoint-5", target_is_directory=True)
    result = scan(run_dir)
    assert result.candidates == () and result.artifacts == ()
    assert recognize(run_dir / "ext" / "checkpoint-5", run_dir, "run") is None
    assert recognize(run_dir / "checkpoint-7", run_dir, "run") is None


def test_symlinked_marker_does_not_count(tmp_path: Path, run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 5, complete=False)
    (tmp_path / "state.json").write_text(json.dumps({"log_history": []}))
    (ckpt / "trainer_state.json").symlink_to(tmp_path / "state.json")
    cand = only(scan(run_dir))
    assert not cand.complete and "trainer_state.json" not in cand.files


def test_control_dir_is_ignored(run_dir: Path) -> None:
    control = run_dir / ".ckptkeeper"
    control.mkdir()
    (control / "commits.jsonl").write_text("{}\n")
    fx.make_torch_file(control, 3, subdir="")
    (control / "run.json.tmp").write_text("{}")
    fx.make_hf(run_dir, 10)
    result = scan(run_dir)
    assert [c.name for c in result.candidates] == ["checkpoint-10"] and result.artifacts == ()
    assert recognize(control / "epoch=0-step=3.ckpt", run_dir, "run") is None


def test_weight_shards_and_stepless_files_are_not_checkpoints(run_dir: Path) -> None:
    # HF trainer.save_model(output_dir) at the end of training writes the final model into the run dir
    fx.make_safetensors_files(run_dir, shards=2)
    fx.torch_like_zip(run_dir / "training_args.bin")
    fx.torch_like_zip(run_dir / "pytorch_model-00001-of-00002.bin")
    (run_dir / "config.json").write_text("{}")
    (run_dir / "notes_2024.txt").write_text("not a checkpoint extension")
    assert scan(run_dir).candidates == ()


def test_shard_named_by_a_sibling_index_is_not_a_checkpoint(run_dir: Path) -> None:
    fx.make_safetensors_files(run_dir, shards=1)
    os.replace(run_dir / "model-00001-of-00001.safetensors", run_dir / "weights_1.safetensors")
    index = run_dir / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    index.write_text(json.dumps({"weight_map": dict.fromkeys(doc["weight_map"], "weights_1.safetensors")}))
    assert scan(run_dir).candidates == ()


def test_non_utf8_name_is_tolerated(run_dir: Path) -> None:
    raw = os.fsencode(run_dir) + b"/epoch=0-step=7-\xff\xfe.ckpt"
    good = fx.make_torch_file(run_dir, 7, subdir="", name="tmp.ckpt")
    os.rename(os.fsencode(good), raw)
    os.mkdir(os.fsencode(run_dir) + b"/\xff-dir")
    with open(os.fsencode(run_dir) + b"/\xff-dir/x.part", "wb") as f:
        f.write(b"abc")
    result = scan(run_dir)
    cand = only(result)
    assert cand.step == 7 and cand.complete and os.fsencode(cand.name) == b"epoch=0-step=7-\xff\xfe.ckpt"
    assert [os.fsencode(a.path) for a in result.artifacts] == [b"run/\xff-dir/x.part"]
    assert recognize(Path(os.fsdecode(raw)), run_dir, "run") == cand


def test_run_dir_problems_raise_instead_of_reading_as_empty(tmp_path: Path, run_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        scan_run(tmp_path / "missing", "missing")
    (tmp_path / "link").symlink_to(run_dir, target_is_directory=True)
    with pytest.raises(NotADirectoryError):
        scan_run(tmp_path / "link", "link")


def test_unreadable_subtree_is_an_error_not_an_absence(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fx.make_hf(run_dir, 10)
    locked = run_dir / "locked"
    fx.make_hf(locked, 20)
    real_scandir = os.scandir

    def scandir(path: str) -> Any:  # chmod 000 is no obstacle to root, so refuse by hand
        if os.path.basename(path) == "locked":
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    result = scan(run_dir)
    assert [c.step for c in result.candidates] == [10]
    assert len(result.errors) == 1 and result.errors[0].startswith("locked")
    with pytest.raises(OSError):
        recognize(locked / "checkpoint-20", run_dir, "run")
    with pytest.raises(PermissionError):
        scan_run(locked, "locked")


@pytest.mark.parametrize(
    ("maker", "unreadable"),
    [
        (lambda r: fx.make_hf(r, 10), "trainer_state.json"),
        (lambda r: fx.make_torch_file(r, 10, subdir=""), "epoch=0-step=10.ckpt"),
        (lambda r: fx.make_safetensors(r, 10), "model-00001-of-00002.safetensors"),
        (lambda r: fx.make_deepspeed(r, 10), "latest"),
        (lambda r: fx.make_megatron(r, 10), "latest_checkpointed_iteration.txt"),
    ],
    ids=["hf", "torch", "safetensors", "deepspeed", "megatron"],
)
def test_unreadable_marker_is_an_error_not_a_partial(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, maker: Maker, unreadable: str
) -> None:
    """A partial checkpoint gets reaped; one we may not read must stay unknown instead."""
    maker(run_dir)
    real_open = os.open

    def deny(path: str, flags: int, mode: int = 0o777) -> int:
        if os.path.basename(path) == unreadable:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", deny)
    result = scan(run_dir)
    assert result.candidates == () and len(result.errors) == 1


def test_other_filesystem_is_not_entered(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fx.make_hf(run_dir / "mnt", 10)
    real_lstat_dev = os.lstat(run_dir).st_dev
    real_scandir = os.scandir

    class Entry:
        def __init__(self, entry: os.DirEntry[str]) -> None:
            self._entry, self.name, self.path = entry, entry.name, entry.path

        def stat(self, follow_symlinks: bool = True) -> os.stat_result:
            st = self._entry.stat(follow_symlinks=follow_symlinks)
            if self.name == "mnt":  # pretend it is a mount point
                fields = list(st)
                fields[2] = real_lstat_dev + 1
                return os.stat_result(fields)
            return st

    class Scandir:
        def __init__(self, path: str) -> None:
            with real_scandir(path) as it:
                self._entries = [Entry(e) for e in it]

        def __enter__(self) -> Scandir:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def __iter__(self) -> Iterator[Entry]:
            return iter(self._entries)

    monkeypatch.setattr(os, "scandir", Scandir)
    assert scan(run_dir).candidates == ()


# --------------------------------------------------------------------------------------------------
# Temp artifacts


def test_artifacts_of_every_kind(run_dir: Path) -> None:
    tmp_orbax = fx.make_orbax(run_dir, 300, complete=False, tmp=True)
    hf_tmp = run_dir / "tmp-checkpoint-40"
    hf_tmp.mkdir()
    (hf_tmp / "model.safetensors").write_bytes(b"x" * 100)
    dcp_nostep = run_dir / "dcp_latest"
    dcp_nostep.mkdir()
    (dcp_nostep / "__0_0.distcp").write_bytes(b"d" * 10)
    (dcp_nostep / ".metadata.tmp").write_bytes(b"m" * 7)
    marker = fx.make_nemo_orphan_marker(run_dir, 500)
    (run_dir / "download.part").write_bytes(b"p" * 5)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "events.tmp").write_bytes(b"t" * 3)
    staging = run_dir / "checkpoint-9.ckptkeeper-tmp-1a2b"
    fx.make_hf(staging, 9)
    os.replace(staging / "checkpoint-9", run_dir / "checkpoint-9.ckptkeeper-tmp-inner")

    result = scan(run_dir)
    assert result.candidates == ()
    kinds = {a.path: a.kind for a in result.artifacts}
    assert kinds == {
        f"run/checkpoints/{tmp_orbax.name}": "orbax-tmp",
        "run/tmp-checkpoint-40": "tmp-checkpoint",
        "run/dcp_latest/.metadata.tmp": "metadata-tmp",
        f"run/checkpoints/{marker.name}": "nemo-unfinished",
        "run/download.part": "tmp-file",
        "run/logs/events.tmp": "tmp-file",
        "run/checkpoint-9.ckptkeeper-tmp-1a2b": "ckptkeeper-staging",
        "run/checkpoint-9.ckptkeeper-tmp-inner": "ckptkeeper-staging",
    }
    by_path = {a.path: a for a in result.artifacts}
    assert by_path["run/tmp-checkpoint-40"].bytes == 100
    assert by_path["run/dcp_latest/.metadata.tmp"].bytes == 7
    orbax_bytes = sum(p.stat().st_size for p in tmp_orbax.rglob("*") if p.is_file())
    assert by_path[f"run/checkpoints/{tmp_orbax.name}"].bytes == orbax_bytes
    assert all(a.tier == "hot" and a.run == "run" for a in result.artifacts)
    os.utime(hf_tmp / "model.safetensors", (1e9, 4e9))
    assert {a.path: a for a in scan(run_dir).artifacts}["run/tmp-checkpoint-40"].last_write == 4e9
    assert recognize(tmp_orbax, run_dir, "run") is None
    assert recognize(hf_tmp / "model.safetensors", run_dir, "run") is None


def test_run_name_with_depth_prefixes_artifact_paths(tmp_path: Path) -> None:
    run_dir = tmp_path / "team" / "exp1"
    run_dir.mkdir(parents=True)
    (run_dir / "x.part").write_text("x")
    assert [a.path for a in scan_run(run_dir, "team/exp1").artifacts] == ["team/exp1/x.part"]


# --------------------------------------------------------------------------------------------------
# recognize() for single watcher events


def test_recognize_maps_inner_paths_to_their_checkpoint(run_dir: Path) -> None:
    ckpt = fx.make_hf(run_dir, 100)
    whole = only(scan(run_dir))
    assert recognize(ckpt / "trainer_state.json", run_dir, "run") == whole
    assert recognize(ckpt, run_dir, "run") == whole
    assert recognize(run_dir, run_dir, "run") is None
    assert recognize(run_dir / "nope", run_dir, "run") is None
    assert recognize(run_dir.parent / "other" / "checkpoint-1", run_dir, "run") is None


def test_is_shared_marker() -> None:
    assert layouts.is_shared_marker("/x/latest")
    assert layouts.is_shared_marker(Path("/x/latest_checkpointed_iteration.txt"))
    assert layouts.is_shared_marker(f"/x/{fx.nemo_name(1)}-unfinished")
    assert not layouts.is_shared_marker("/x/checkpoint-1/trainer_state.json")


# --------------------------------------------------------------------------------------------------
# Step parsing (pure)

STEPS: list[tuple[str, int | None]] = [
    ("step=123", 123), ("epoch=3-step=40", 40), ("epoch=1-step=20-v1", 20), ("x-step123", 123),
    ("global_step40", 40), ("step_200", 200), ("iter_0000100", 100), ("200", 200), ("checkpoint_1000", 1000),
    ("model-00100", 100), ("ckpt.1000", 1000), (fx.nemo_name(100), 100), ("last", None), ("last-v1", None),
    ("epoch=3", None), ("epoch_3", None), ("val_loss=1.23", None), ("gpt2", None), ("resnet50", None),
    ("step=-5", None), ("step=1.5", None), ("timestep=5", None), ("1.5", None), ("9" * 5000, None),
]  # fmt: skip


@pytest.mark.parametrize(("stem", "step"), STEPS, ids=[s[:30] for s, _ in STEPS])
def test_parse_step(stem: str, step: int | None) -> None:
    assert parse_step(stem) == step


# --------------------------------------------------------------------------------------------------
# A whole hot tier


def test_campaign(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    expected = fx.make_campaign(hot)
    got: dict[tuple[str, int], bool] = {}
    layouts_seen = set()
    for run in sorted(os.listdir(hot)):
        result = scan_run(hot / run, run)
        assert result.errors == ()
        for cand in result.candidates:
            got[(cand.run, cand.step)] = cand.complete
            layouts_seen.add(cand.layout)
            assert cand.complete == (cand.problem is None)
    assert got == expected
    assert layouts_seen == {"hf", "torch", "dcp", "deepspeed", "megatron", "nemo", "orbax", "safetensors"}
