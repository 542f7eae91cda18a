"""Realistic checkpoints of every layout ckptkeeper recognizes, complete or partial, for any test.

Written by the real library where it installs here — ``torch.save``, single-process
``torch.distributed.checkpoint.save``, ``safetensors`` — and otherwise as faithful fixtures: file
and directory names, marker files and their write order exactly as HF Trainer, DeepSpeed,
Megatron-LM, NeMo and Orbax produce them, with contents of a few bytes or KBs. A *partial*
checkpoint is the state a crash mid-save leaves behind (marker not yet written, temp name not yet
renamed, a shard missing, a file cut short), not an arbitrary mess.

Every ``make_*`` returns the checkpoint path. torch is imported inside the functions that need it,
so importing this module stays cheap.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

RUNS = ("hf", "lightning", "dcp", "deepspeed", "megatron", "nemo", "orbax", "safetensors")


# --------------------------------------------------------------------------------------------------
# Helpers


def torch_like_zip(path: Path, payload: bytes = b"\x80\x02}q\x00.") -> Path:
    """A small zip laid out like a ``torch.save`` archive, for frameworks whose ``.pt`` contents no
    recognizer reads (DeepSpeed, Megatron shards): real zip, no torch import."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.name.split(".")[0] or "archive"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{stem}/data.pkl", payload)
        zf.writestr(f"{stem}/byteorder", b"little")
        zf.writestr(f"{stem}/data/0", b"\0" * 64)
        zf.writestr(f"{stem}/version", b"3\n")
    return path


def truncate(path: Path, keep: float = 0.5) -> Path:
    """Cut a file short, as a crash mid-write leaves it."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(max(1, int(size * keep)))
    return path


def _write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))


def _safetensors_numpy(path: Path, seed: int = 0) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {"lm_head.weight": np.full((4, 4), seed, dtype=np.float32)}, str(path), metadata={"format": "pt"}
    )


def _dcp_save(directory: Path, step: int) -> None:
    """Single-process DCP save: works without init_process_group (torch warns, we know)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"model": {"w": torch.arange(8, dtype=torch.float32) + step}, "step": torch.tensor(step)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(directory)))


def _lightning_state(step: int, epoch: int) -> dict[str, Any]:
    import torch

    return {
        "epoch": epoch,
        "global_step": step,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {"layer.weight": torch.full((2, 2), float(step)), "layer.bias": torch.zeros(2)},
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": epoch}}}},
        "callbacks": {},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-3},
    }


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


# --------------------------------------------------------------------------------------------------
# One maker per layout


def make_hf(
    run_dir: Path,
    step: int,
    complete: bool = True,
    eval_loss: float | None = None,
    loss: float = 2.0,
    corrupt: bool = False,
    sharded: bool = False,
) -> Path:
    """HF Trainer ``checkpoint-N/`` as ``Trainer._save_checkpoint`` writes it: model, optimizer,
    scheduler, rng state, then ``trainer_state.json`` (absent when partial, cut short when corrupt).

    ``log_history`` holds an earlier entry with other numbers, so metric tests see the filtering.
    """
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    _write_json(ckpt / "config.json", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    _write_json(
        ckpt / "generation_config.json", {"_from_model_config": True, "transformers_version": "4.46.0"}
    )
    if sharded:
        make_safetensors_files(ckpt, shards=2)
    else:
        _safetensors_numpy(ckpt / "model.safetensors", seed=step)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        torch_like_zip(ckpt / name)
    if not complete and not corrupt:
        return ckpt
    epoch = step / 100
    history: list[dict[str, Any]] = [
        {"epoch": epoch / 2, "grad_norm": 3.5, "learning_rate": 5e-05, "loss": loss + 1.0, "step": step // 2},
        {"epoch": epoch, "grad_norm": 1.25, "learning_rate": 4e-05, "loss": loss, "step": step},
    ]
    if eval_loss is not None:
        history.append(
            {
                "epoch": epoch,
                "eval_loss": eval_loss,
                "eval_runtime": 0.5,
                "eval_samples_per_second": 200.0,
                "eval_steps_per_second": 25.0,
                "step": step,
            }
        )
    state = {
        "best_metric": eval_loss,
        "best_model_checkpoint": str(ckpt) if eval_loss is not None else None,
        "epoch": epoch,
        "eval_steps": step,
        "global_step": step,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": history,
        "logging_steps": 10,
        "max_steps": 10 * step,
        "num_input_tokens_seen": 0,
        "num_train_epochs": 3,
        "save_steps": step,
        "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}, "attributes": {}}},
        "total_flos": 1234.0,
        "train_batch_size": 8,
        "trial_name": None,
        "trial_params": None,
    }
    text = json.dumps(state, indent=2, sort_keys=True)
    (ckpt / "trainer_state.json").write_text(text[: len(text) // 2] if corrupt else text)
    return ckpt


def make_torch_file(
    run_dir: Path,
    step: int,
    complete: bool = True,
    epoch: int = 0,
    version: int | None = None,
    subdir: str = "checkpoints",
    name: str | None = None,
) -> Path:
    """Lightning ``ModelCheckpoint`` file ``<subdir>/epoch=E-step=S[-vN].ckpt`` via real
    ``torch.save``; partial = the same file cut in half (no end-of-central-directory)."""
    if name is None:
        name = f"epoch={epoch}-step={step}" + (f"-v{version}" if version else "") + ".ckpt"
    path = run_dir / subdir / name if subdir else run_dir / name
    _torch_save(_lightning_state(step, epoch), path)
    if not complete:
        truncate(path)
    return path


def make_dcp(run_dir: Path, step: int, complete: bool = True, name: str | None = None) -> Path:
    """torch DCP dir ``step_N/`` via real ``dcp.save``; partial = the moment before
    ``FileSystemWriter`` renames ``.metadata.tmp`` to ``.metadata``."""
    ckpt = run_dir / (name or f"step_{step}")
    _dcp_save(ckpt, step)
    if not complete:
        os.replace(ckpt / ".metadata", ckpt / ".metadata.tmp")
    return ckpt


def make_deepspeed(
    run_dir: Path,
    step: int,
    complete: bool = True,
    dp: int = 2,
    mp: int = 1,
    stage: int = 2,
    bf16: bool = False,
    write_latest: bool | None = None,
) -> Path:
    """DeepSpeed ``save_checkpoint(run_dir)``: ``global_stepN/`` with ``mp_rank_XX_model_states.pt``
    (ZeRO-3: ``zero_pp_rank_D_mp_rank_XX_model_states.pt``) and
    ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``, ``zero_to_fp32.py`` beside, then rank 0
    writes ``latest`` = tag. Partial: one straggler's optimizer shard (dp rank 0 of the last mp
    rank) never landed and ``latest`` still names the previous tag (``write_latest=True`` reproduces
    the early-``latest`` trap)."""
    tag = f"global_step{step}"
    ckpt = run_dir / tag
    ckpt.mkdir(parents=True, exist_ok=True)
    prefix = "bf16_" if bf16 else ""
    for m in range(mp):
        if stage < 3:
            torch_like_zip(ckpt / f"mp_rank_{m:02d}_model_states.pt")
        for d in range(dp):
            if stage >= 3:
                torch_like_zip(ckpt / f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt")
            straggler = m == mp - 1 and d == 0
            if complete or not straggler:
                torch_like_zip(ckpt / f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt")
    (run_dir / "zero_to_fp32.py").write_text("#!/usr/bin/env python\n# copied by DeepSpeed\n")
    if complete if write_latest is None else write_latest:
        (run_dir / "latest").write_text(tag)
    return ckpt


def make_lightning_deepspeed(
    run_dir: Path, step: int, complete: bool = True, epoch: int = 0, dp: int = 2, subdir: str = "checkpoints"
) -> Path:
    """Lightning ``DeepSpeedStrategy``: the ``.ckpt`` path is a directory, DeepSpeed's save dir,
    with ``tag="checkpoint"`` (``checkpoint/mp_rank_00_model_states.pt`` + ZeRO shards) and
    ``latest`` = ``checkpoint``. Partial: ``latest`` not written yet."""
    ckpt = run_dir / subdir / f"epoch={epoch}-step={step}.ckpt"
    torch_like_zip(ckpt / "checkpoint" / "mp_rank_00_model_states.pt")
    for d in range(dp):
        torch_like_zip(ckpt / "checkpoint" / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
    (ckpt / "zero_to_fp32.py").write_text("#!/usr/bin/env python\n# copied by DeepSpeed\n")
    if complete:
        (ckpt / "latest").write_text("checkpoint")
    return ckpt


def make_megatron(
    run_dir: Path,
    step: int,
    complete: bool = True,
    fmt: str = "legacy",
    tp: int = 1,
    pp: int = 1,
) -> Path:
    """Megatron-LM ``iter_NNNNNNN/``: legacy ``mp_rank_TT[_PPP]/model_optim_rng.pt`` or
    ``torch_dist`` (real DCP shards + ``.metadata``, ``common.pt``, ``metadata.json``); rank 0 then
    writes ``latest_checkpointed_iteration.txt``. Partial: tracker not advanced (and for torch_dist,
    ``metadata.json`` not yet written)."""
    ckpt = run_dir / f"iter_{step:07d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    if fmt == "torch_dist":
        _dcp_save(ckpt, step)
        torch_like_zip(ckpt / "common.pt")
        if complete:
            _write_json(
                ckpt / "metadata.json",
                {
                    "sharded_backend": "torch_dist",
                    "sharded_backend_version": 1,
                    "common_backend": "torch",
                    "common_backend_version": 1,
                },
            )
    else:
        for t in range(tp):
            for p in range(pp):
                rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
                torch_like_zip(ckpt / rank / "model_optim_rng.pt")
    if complete:
        tracker = run_dir / "latest_checkpointed_iteration.txt"
        current = int(tracker.read_text()) if tracker.exists() else -1
        tracker.write_text(str(max(current, step)))
    return ckpt


def nemo_name(step: int, val_loss: float = 1.23, last: bool = False) -> str:
    """NeMo's megatron filename ``megatron_gpt--{val_loss:.2f}-{step}-{consumed_samples}``."""
    return f"megatron_gpt--val_loss={val_loss:.2f}-step={step}-consumed_samples={step * 8}.0" + (
        "-last" if last else ""
    )


def make_nemo(
    run_dir: Path,
    step: int,
    complete: bool = True,
    val_loss: float = 1.23,
    dist: bool = False,
    last: bool = False,
    subdir: str = "checkpoints",
) -> Path:
    """NeMo ``NeMoModelCheckpoint``: creates ``<name>-unfinished``, saves ``<name>.ckpt`` (real
    ``torch.save``) or, with distributed checkpointing, the ``<name>/`` dir (real DCP +
    ``common.pt`` + ``metadata.json``), then removes the marker. Partial: the marker is still there."""
    base = nemo_name(step, val_loss, last)
    parent = run_dir / subdir
    parent.mkdir(parents=True, exist_ok=True)
    marker = parent / f"{base}-unfinished"
    marker.touch()
    if dist:
        path = parent / base
        _dcp_save(path, step)
        torch_like_zip(path / "common.pt")
        _write_json(path / "metadata.json", {"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    else:
        path = parent / f"{base}.ckpt"
        _torch_save(_lightning_state(step, 0), path)
    if complete:
        marker.unlink()
    return path


def make_nemo_orphan_marker(run_dir: Path, step: int, subdir: str = "checkpoints") -> Path:
    """An ``-unfinished`` marker whose checkpoint never appeared (crash right after creating it)."""
    marker = run_dir / subdir / f"{nemo_name(step)}-unfinished"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return marker


def make_orbax(
    run_dir: Path,
    step: int,
    complete: bool = True,
    metrics: dict[str, float] | None = None,
    tmp: bool = False,
    subdir: str = "checkpoints",
    item: str = "default",
) -> Path:
    """Orbax ``CheckpointManager`` step dir ``<subdir>/<step>/`` with an OCDBT item dir and
    ``_CHECKPOINT_METADATA``. Partial: ``tmp=True`` gives the in-flight
    ``<step>.orbax-checkpoint-tmp-<ts>`` dir (an artifact, never a candidate); otherwise the step
    dir without ``_CHECKPOINT_METADATA`` / ``commit_success.txt`` (commit not done)."""
    now_ns = time.time_ns()
    name = f"{step}.orbax-checkpoint-tmp-{now_ns // 1000}" if tmp else str(step)
    ckpt = run_dir / subdir / name
    items = ckpt / item
    (items / "d").mkdir(parents=True, exist_ok=True)
    (items / "ocdbt.process_0" / "d").mkdir(parents=True, exist_ok=True)
    _write_json(items / "_METADATA", {"tree_metadata": {"('w',)": {"key_metadata": [{"key": "w"}]}}})
    _write_json(items / "_sharding", {})
    (items / "manifest.ocdbt").write_bytes(b"OCDBT\x00" + bytes(32))
    (items / "d" / "6f1c0a2b3c4d5e6f").write_bytes(bytes(range(64)))
    (items / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"OCDBT\x01" + bytes(32))
    (items / "ocdbt.process_0" / "d" / "0a1b2c3d").write_bytes(bytes(128))
    if complete and not tmp:
        _write_json(
            ckpt / "_CHECKPOINT_METADATA",
            {
                "item_handlers": {
                    item: "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
                },
                "metrics": metrics or {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now_ns,
                "commit_timestamp_nsecs": now_ns + 1000,
                "custom_metadata": {},
            },
        )
    return ckpt


def make_safetensors_files(directory: Path, shards: int = 2, complete: bool = True) -> list[Path]:
    """HF-style sharded weights via real ``safetensors.torch.save_file`` plus the index JSON
    ``save_pretrained`` writes; partial = the last shard listed in the index is absent."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    paths = []
    for i in range(1, shards + 1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{i}.weight": torch.full((4, 4), float(i)), f"layers.{i}.bias": torch.zeros(4)}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        paths.append(directory / fname)
    _write_json(
        directory / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    if not complete:
        paths[-1].unlink()
    return paths


def make_safetensors(
    run_dir: Path, step: int, complete: bool = True, shards: int = 2, single: bool = False
) -> Path:
    """A ``step_N/`` dir of safetensors weights: sharded with an index (partial: a listed shard is
    absent) or a single ``model.safetensors`` (partial: cut short)."""
    ckpt = run_dir / f"step_{step}"
    if single:
        import torch
        from safetensors.torch import save_file

        ckpt.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.arange(64, dtype=torch.float32)}, str(ckpt / "model.safetensors"))
        if not complete:
            truncate(ckpt / "model.safetensors", 0.6)
    else:
        make_safetensors_files(ckpt, shards=shards, complete=complete)
    return ckpt


# --------------------------------------------------------------------------------------------------
# A whole hot tier


def make_campaign(hot_root: Path) -> dict[tuple[str, int], bool]:
    """One run dir per layout under ``hot_root``, each with one complete and one partial checkpoint.

    Returns the expected ``{(run, step): complete}`` for exactly the candidates a scan must find.
    """
    expected: dict[tuple[str, int], bool] = {}

    def run(name: str) -> Path:
        path = hot_root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    make_hf(run("hf"), 10, complete=True, eval_loss=1.5)
    make_hf(run("hf"), 20, complete=False)
    expected |= {("hf", 10): True, ("hf", 20): False}

    make_torch_file(run("lightning"), 10, complete=True)
    make_torch_file(run("lightning"), 20, complete=False, epoch=1)
    expected |= {("lightning", 10): True, ("lightning", 20): False}

    make_dcp(run("dcp"), 100, complete=True)
    make_dcp(run("dcp"), 200, complete=False)
    expected |= {("dcp", 100): True, ("dcp", 200): False}

    make_deepspeed(run("deepspeed"), 100, complete=True)
    make_deepspeed(run("deepspeed"), 200, complete=False)
    expected |= {("deepspeed", 100): True, ("deepspeed", 200): False}

    make_megatron(run("megatron"), 100, complete=True)
    make_megatron(run("megatron"), 200, complete=False)
    expected |= {("megatron", 100): True, ("megatron", 200): False}

    make_nemo(run("nemo"), 100, complete=True)
    make_nemo(run("nemo"), 200, complete=False)
    expected |= {("nemo", 100): True, ("nemo", 200): False}

    make_orbax(run("orbax"), 100, complete=True, metrics={"eval_loss": 0.5})
    make_orbax(run("orbax"), 200, complete=False)
    expected |= {("orbax", 100): True, ("orbax", 200): False}

    make_safetensors(run("safetensors"), 100, complete=True)
    make_safetensors(run("safetensors"), 200, complete=False)
    expected |= {("safetensors", 100): True, ("safetensors", 200): False}
    return expected
