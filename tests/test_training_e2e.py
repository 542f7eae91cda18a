"""Two lines in a Lightning script: checkpoints cataloged with metrics, tiered, failed runs reaped,
and ``ckptkeeper.restore(run, "best")`` working after the best one was demoted to a slower tier."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner

import ckptkeeper
from ckptkeeper.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_quiet")]

VAL_LOSS_BY_EPOCH = [0.5, 2.0, 1.0]  # the best checkpoint is the oldest: retention must not lose it


def train(run_dir: Path, crash_epoch: int | None = None, *, dirpath: Path | None = None) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ckptkeeper.integrations.lightning import KeeperCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if crash_epoch is not None and self.current_epoch == crash_epoch:
                raise RuntimeError("NCCL watchdog timeout")
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            real = nn.functional.mse_loss(self.layer(x), y)
            self.log("val_loss", real * 0 + VAL_LOSS_BY_EPOCH[self.current_epoch])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            pl.callbacks.ModelCheckpoint(dirpath=dirpath or run_dir, save_top_k=-1, monitor="val_loss"),
            KeeperCallback(),  # <- the line a user adds (plus the import)
        ],
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lightning_run_cataloged_tiered_reaped_and_best_restored(tmp_path: Path) -> None:
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    config = tmp_path / "config.toml"
    write_config(
        config,
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1h"},  # only the hook's commits make these complete
        tiers=[
            local_tier("hot", hot, keep_last=1, metric="val_loss", mode="min"),
            local_tier("warm", warm),
        ],
    )

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    train(hot / "good-run")
    with pytest.raises(RuntimeError, match="NCCL"):
        train(hot / "bad-run", crash_epoch=2)
    originals = {p.name: digest(p) for p in (hot / "good-run").glob("*.ckpt")}

    assert cli("scan")[0] == 0
    doc = json.loads(cli("ls", "--json")[1])
    runs = {r["name"]: r for r in doc["runs"]}
    assert runs["good-run"]["state"] == "finished"
    assert runs["bad-run"]["state"] == "failed"
    good = runs["good-run"]["checkpoints"]
    assert [c["step"] for c in good] == [2, 4, 6]
    assert [c["state"] for c in good] == ["complete"] * 3
    assert [c["metrics"]["val_loss"] for c in good] == pytest.approx(VAL_LOSS_BY_EPOCH)

    code, out = cli("prune")
    assert code == 0, out
    doc = json.loads(cli("ls", "--json")[1])
    runs = {r["name"]: r for r in doc["runs"]}
    assert {c["step"]: c["tiers"] for c in runs["good-run"]["checkpoints"]} == {
        2: ["warm"],
        4: ["warm"],
        6: ["hot"],
    }
    # The failed run keeps its newest complete checkpoint only.
    assert [c["step"] for c in runs["bad-run"]["checkpoints"]] == [4]
    assert sorted(p.name for p in (hot / "bad-run").glob("*.ckpt")) == ["epoch=1-step=4.ckpt"]

    best = ckptkeeper.restore("good-run", "best", to=tmp_path / "resume", config=config)
    assert best.name == "epoch=0-step=2.ckpt"
    assert digest(best) == originals[best.name]
    latest = ckptkeeper.latest("good-run", config=config)
    assert latest == hot / "good-run" / "epoch=2-step=6.ckpt"

    # With no ``to``, a checkpoint that lives only in warm comes back into the run's hot directory.
    shutil.rmtree(tmp_path / "resume")
    restored = ckptkeeper.restore("good-run", 4, config=config)
    assert restored == hot / "good-run" / "epoch=1-step=4.ckpt"
    assert digest(restored) == originals[restored.name]
    import torch

    state = torch.load(restored, weights_only=False)
    assert state["global_step"] == 4


def test_readme_lightning_snippet_with_nested_dirpath_gives_a_finished_run_with_val_loss(
    tmp_path: Path,
) -> None:
    """README: ``ModelCheckpoint(dirpath=<run>/checkpoints)`` (Lightning's usual layout) puts the hook's
    ``.ckptkeeper/`` one level below the run dir; it still speaks for the run (issue 16)."""
    hot = tmp_path / "hot"
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1h"},  # only the hook's commits make these complete
        tiers=[local_tier("hot", hot)],  # no tier names a metric
    )
    train(hot / "nested-run", dirpath=hot / "nested-run" / "checkpoints")
    assert (hot / "nested-run" / "checkpoints" / ".ckptkeeper" / "run.json").is_file()

    result = CliRunner().invoke(main, ["--config", str(config), "scan"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["--config", str(config), "ls", "--json"], catch_exceptions=False)
    (run,) = json.loads(result.output)["runs"]
    assert (run["name"], run["state"]) == ("nested-run", "finished")
    assert "WARNING" not in (run["state_reason"] or "")
    assert [(c["name"], c["state"]) for c in run["checkpoints"]] == [
        (f"checkpoints/epoch={e}-step={2 * (e + 1)}.ckpt", "complete") for e in range(3)
    ]
    assert [c["metrics"]["val_loss"] for c in run["checkpoints"]] == pytest.approx(VAL_LOSS_BY_EPOCH)
    # "best" with no tier metric: Lightning's own best_model_path (min val_loss: epoch 0).
    best = ckptkeeper.restore("nested-run", "best", config=config)
    assert best == hot / "nested-run" / "checkpoints" / "epoch=0-step=2.ckpt"
    by_max = ckptkeeper.restore("nested-run", "best", config=config, metric="val_loss", mode="max")
    assert by_max.name == "epoch=1-step=4.ckpt"
