"""Framework callbacks driven by real (tiny, CPU) training: Lightning and Hugging Face Trainer."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckptkeeper.hook import read_commits, read_run_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_quiet")]


def test_integrations_package_is_cheap() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ckptkeeper.integrations
        import ckptkeeper.integrations.lightning
        import ckptkeeper.integrations.transformers
        print(sorted(m for m in sys.modules if m.split('.')[0] in
              {'torch', 'lightning', 'pytorch_lightning', 'transformers'}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- Lightning -----------------------------------------------------------------------------------------


def _lightning_parts() -> tuple[Any, Any]:
    pl = pytest.importorskip("lightning.pytorch")
    keeper = importlib.import_module("ckptkeeper.integrations.lightning")
    return pl, keeper.KeeperCallback


def _tiny_module(pl: Any, crash_epoch: int | None = None) -> Any:
    import torch
    from torch import nn

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if crash_epoch is not None and self.current_epoch == crash_epoch:
                raise RuntimeError(f"loss exploded in epoch {self.current_epoch}")
            x, y = batch
            loss = nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Tiny()


def _loaders() -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    return DataLoader(data, batch_size=16), DataLoader(data, batch_size=32)


def _trainer(pl: Any, callbacks: list[Any], max_epochs: int = 3, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


def test_lightning_commits_every_checkpoint(tmp_path: Path) -> None:
    pl, KeeperCallback = _lightning_parts()
    run_dir = tmp_path / "pl-run"
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=run_dir, save_top_k=-1, monitor="val_loss", save_last=True
    )
    trainer = _trainer(pl, [checkpoint, KeeperCallback(heartbeat_interval=0.2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_tiny_module(pl), *_loaders())
    assert not [w for w in caught if "ckptkeeper" in str(w.message)]

    commits, errors = read_commits(run_dir)
    assert errors == []
    on_disk = sorted(p.name for p in run_dir.glob("*.ckpt") if p.name != "last.ckpt")
    assert sorted(c.path for c in commits) == on_disk and len(on_disk) == 3
    assert [c.step for c in commits] == [4, 8, 12]  # 4 batches per epoch, committed in order
    for commit in commits:
        assert f"step={commit.step}" in commit.path
        assert set(commit.metrics) >= {"val_loss", "train_loss"}
        assert commit.metrics["val_loss"] == pytest.approx(
            checkpoint.best_k_models[str(run_dir / commit.path)].item()
        )
    info = read_run_dir(run_dir)
    assert info is not None and info.error is None
    assert info.state == "finished" and info.name == "pl-run"
    assert "_save_checkpoint" not in vars(checkpoint), "the save observer must be removed after fit"


def test_lightning_polling_fallback(tmp_path: Path) -> None:
    """Were ModelCheckpoint's private save method gone, polling what it reports still commits every file."""
    pl, KeeperCallback = _lightning_parts()
    run_dir = tmp_path / "pl-poll"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=run_dir, save_top_k=-1, monitor="val_loss")
    keeper = KeeperCallback()
    keeper._observe = lambda cb, trainer: keeper._polled.append(cb)
    _trainer(pl, [checkpoint, keeper]).fit(_tiny_module(pl), *_loaders())
    commits, errors = read_commits(run_dir)
    assert errors == []
    assert sorted((c.step, c.path) for c in commits) == sorted(
        (int(p.stem.split("step=")[1]), p.name) for p in run_dir.glob("*.ckpt")
    )
    assert all("val_loss" in c.metrics for c in commits) and len(commits) == 3
    info = read_run_dir(run_dir)
    assert info is not None and info.state == "finished"


def test_lightning_crash_marks_failed(tmp_path: Path) -> None:
    pl, KeeperCallback = _lightning_parts()
    run_dir = tmp_path / "pl-crash"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=run_dir, save_top_k=-1, monitor="val_loss")
    trainer = _trainer(pl, [checkpoint, KeeperCallback()])
    with pytest.raises(RuntimeError, match="loss exploded in epoch 2"):
        trainer.fit(_tiny_module(pl, crash_epoch=2), *_loaders())
    info = read_run_dir(run_dir)
    assert info is not None
    assert info.state == "failed"
    assert info.reason == "RuntimeError: loss exploded in epoch 2"
    commits, errors = read_commits(run_dir)
    assert errors == [] and [c.step for c in commits] == [4, 8]
    assert all("val_loss" in c.metrics for c in commits)


def test_lightning_save_on_exception_commits_late_checkpoint(tmp_path: Path) -> None:
    pl, KeeperCallback = _lightning_parts()
    run_dir = tmp_path / "pl-exc"
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=run_dir, save_top_k=-1, every_n_train_steps=3, save_on_exception=True
    )
    trainer = _trainer(pl, [checkpoint, KeeperCallback()])
    with pytest.raises(RuntimeError):
        trainer.fit(_tiny_module(pl, crash_epoch=1), *_loaders())
    info = read_run_dir(run_dir)
    assert info is not None and info.state == "failed"
    commits, _ = read_commits(run_dir)
    on_disk = sorted(p.name for p in run_dir.glob("*.ckpt"))
    assert sorted(c.path for c in commits) == on_disk
    assert [c.step for c in commits] == [3, 4]  # every 3 steps, then the one saved on the exception


def test_lightning_warns_on_rotation_and_records_resume(tmp_path: Path) -> None:
    pl, KeeperCallback = _lightning_parts()
    first = tmp_path / "hot" / "base"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=first, save_top_k=2, monitor="val_loss")
    keeper = KeeperCallback()
    with pytest.warns(UserWarning, match=r"save_top_k=2") as record:
        _trainer(pl, [checkpoint, keeper], max_epochs=2).fit(_tiny_module(pl), *_loaders())
    assert len([w for w in record if "ckptkeeper" in str(w.message)]) == 1
    (resume_from,) = first.glob("*step=8*.ckpt")

    second = tmp_path / "hot" / "fork"
    fork_ckpt = pl.callbacks.ModelCheckpoint(dirpath=second, save_top_k=-1, monitor="val_loss")
    _trainer(pl, [fork_ckpt, KeeperCallback()], max_epochs=3).fit(
        _tiny_module(pl), *_loaders(), ckpt_path=str(resume_from)
    )
    info = read_run_dir(second)
    assert info is not None and info.state == "finished"
    assert info.parent == ("base", 8) and info.parent_path == str(resume_from)
    assert [c.step for c in read_commits(second)[0]] == [12]


def test_lightning_default_checkpoint_dir(tmp_path: Path) -> None:
    """No dirpath: the run dir is where Lightning puts the files (…/version_0/checkpoints)."""
    pl, KeeperCallback = _lightning_parts()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[KeeperCallback()],
    )
    with pytest.warns(UserWarning, match="save_top_k=1"):
        trainer.fit(_tiny_module(pl), *_loaders())
    run_dir = Path(trainer.checkpoint_callback.dirpath)
    assert run_dir.name == "checkpoints" and run_dir.is_relative_to(tmp_path)
    commits, _ = read_commits(run_dir)
    assert [c.path for c in commits] == [p.name for p in run_dir.glob("*.ckpt")]
    info = read_run_dir(run_dir)
    assert info is not None and info.state == "finished"


def test_pytorch_lightning_flavour(tmp_path: Path) -> None:
    """A user with only ``pytorch_lightning`` imported gets a callback its Trainer accepts."""
    pytest.importorskip("pytorch_lightning")
    script = f"""
        import sys, torch
        torch.set_num_threads(1)
        import pytorch_lightning as pl
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from ckptkeeper.integrations.lightning import KeeperCallback
        assert "lightning.pytorch" not in sys.modules

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(4, 1)
            def training_step(self, batch, idx):
                loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
                self.log("loss", loss)
                return loss
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
        ckpt = pl.callbacks.ModelCheckpoint(dirpath={str(tmp_path / "run")!r}, save_top_k=-1)
        pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[ckpt, KeeperCallback()]).fit(Tiny(), data)
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, capture_output=True)
    commits, errors = read_commits(tmp_path / "run")
    assert errors == [] and [c.step for c in commits] == [2, 4]
    info = read_run_dir(tmp_path / "run")
    assert info is not None and info.state == "finished"


# -- Hugging Face Trainer ------------------------------------------------------------------------------


class _Tokens:
    """A tiny language-modelling dataset of random token ids (no downloads, no tokenizer)."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64) -> None:
        import torch

        generator = torch.Generator().manual_seed(n)
        self.rows = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _hf_trainer(output_dir: Path, callbacks: list[Any], max_steps: int = 6, **kwargs: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        **kwargs,
    )
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=_Tokens(32),
        eval_dataset=_Tokens(8),
        callbacks=callbacks,
    )


def _hf_keeper() -> Any:
    pytest.importorskip("transformers")
    return importlib.import_module("ckptkeeper.integrations.transformers").KeeperCallback


def test_transformers_commits_every_checkpoint(tmp_path: Path) -> None:
    KeeperCallback = _hf_keeper()
    run_dir = tmp_path / "hf-run"
    trainer = _hf_trainer(run_dir, [KeeperCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "ckptkeeper" in str(w.message)]
    commits, errors = read_commits(run_dir)
    assert errors == []
    assert [(c.path, c.step) for c in commits] == [
        ("checkpoint-2", 2),
        ("checkpoint-4", 4),
        ("checkpoint-6", 6),
    ]
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    for commit in commits:
        assert commit.metrics["eval_loss"] == pytest.approx(evals[commit.step])
        assert "loss" in commit.metrics
        assert (run_dir / commit.path / "trainer_state.json").exists()
    info = read_run_dir(run_dir)
    assert info is not None and info.state == "finished" and info.parent is None

    # Resume in the same run dir: lineage recorded, rotation warned about once.
    keeper = KeeperCallback()
    resumed = _hf_trainer(run_dir, [keeper], max_steps=8, save_total_limit=3)
    with pytest.warns(UserWarning, match="save_total_limit=3"):
        resumed.train(resume_from_checkpoint=True)
    info = read_run_dir(run_dir)
    assert info is not None and info.state == "finished"
    assert info.parent == ("hf-run", 6) and info.parent_path == str(run_dir / "checkpoint-6")
    steps = [c.step for c in read_commits(run_dir)[0]]
    assert steps == [2, 4, 6, 8]


def test_transformers_failure_via_context_manager(tmp_path: Path) -> None:
    KeeperCallback = _hf_keeper()
    callback_base: Any = pytest.importorskip("transformers").TrainerCallback

    class Explode(callback_base):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("CUDA error at step 3")

    keeper = KeeperCallback()
    trainer = _hf_trainer(tmp_path / "hf-crash", [keeper, Explode()])
    with pytest.raises(RuntimeError, match="CUDA error"), keeper:
        trainer.train()
    info = read_run_dir(tmp_path / "hf-crash")
    assert info is not None and info.state == "failed" and info.reason == "RuntimeError: CUDA error at step 3"
    assert [c.step for c in read_commits(tmp_path / "hf-crash")[0]] == [2]


def test_transformers_script_crash_marks_failed(tmp_path: Path) -> None:
    """No ``with``: a script dying of an exception is marked failed by the hook's atexit handler."""
    pytest.importorskip("transformers")
    script = f"""
        import sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import transformers
        from test_integrations import _hf_trainer
        from ckptkeeper.integrations.transformers import KeeperCallback

        class Explode(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    raise RuntimeError("out of memory at step 3")

        _hf_trainer({str(tmp_path / "hf-script")!r}, [KeeperCallback(), Explode()]).train()
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    info = read_run_dir(tmp_path / "hf-script")
    assert (
        info is not None and info.state == "failed" and info.reason == "RuntimeError: out of memory at step 3"
    )
