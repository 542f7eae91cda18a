"""Dedup in a slower tier (docs/dedup.md): bytes the tier stores per raw byte of checkpoints.

Each scenario writes HF Trainer-style checkpoints (``model.safetensors`` written by the
safetensors library, ``optimizer.pt`` by ``torch.save`` holding Adam's two moments per trainable
tensor, ``trainer_state.json``) of a Llama-shaped fp32 model (embedding + N blocks of four
projections) into a hot tier, and runs the real ``ckptkeeper prune`` (a subprocess) that copies
every checkpoint into a local warm tier with ``replicate = true``, once with ``dedup = false``
(the baseline) and once with ``dedup = true``. Bytes stored = every file under the warm root
(content objects and manifests).

* **re-save**: the same weights and optimizer saved again after a restart (a new step): stored
  once, the second copy costs its manifest and its trainer state.
* **half frozen**: 5 saves of a fine-tune with the embedding and half the blocks frozen: the
  model file changes every save (its other half does), so file-level dedup finds nothing. The
  informational row shows what tensor-level dedup would store (each tensor's bytes once, computed
  here from the tensors; not built).

Each scenario also runs with ``dedup_tensors`` and ``compression = "auto"`` on the same tier
(each tensor piece stored once, compressed with ZipNN or zstd): the issue's "tensor dedup +
ZipNN" column.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import Config, MiB, Row, python_env


def _model(blocks: int, dim: int, vocab: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(vocab, dim, generator=g)}
    for b in range(blocks):
        for proj in ("q", "k", "v", "o"):
            out[f"layers.{b}.{proj}.weight"] = torch.randn(dim, dim, generator=g)
    return out


def _save(ckpt: Path, step: int, model: dict[str, Any], trainable: list[str], seed: int, when: float) -> None:
    import torch
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True)
    save_file(model, str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    state = {
        i: {
            "exp_avg": torch.randn(model[n].shape, generator=g),
            "exp_avg_sq": torch.rand(model[n].shape, generator=g),
        }
        for i, n in enumerate(trainable)
    }
    torch.save(
        {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(len(trainable)))}]},
        ckpt / "optimizer.pt",
    )
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".clock" not in p.name)


def _tensor_unique_bytes(saves: list[tuple[dict[str, Any], dict[int, dict[str, Any]]]]) -> int:
    """Bytes a tensor-level dedup would store: each distinct tensor's bytes once."""
    seen: set[str] = set()
    total = 0
    for model, optim in saves:
        tensors = list(model.values()) + [t for s in optim.values() for t in s.values()]
        for t in tensors:
            data = t.contiguous().numpy().tobytes()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            if digest not in seen:
                seen.add(digest)
                total += len(data)
    return total


def _prune(root: Path, hot: Path, mode: str) -> int:
    """Copy every checkpoint of ``hot`` into a fresh warm tier (``mode``: plain, file or tensors
    dedup); bytes the warm tier then stores."""
    warm = root / f"warm-{mode}"
    warm.mkdir()
    config = root / f"config-{mode}.toml"
    dedup = {
        "plain": "",
        "file": "dedup = true\n",
        "tensors": "dedup = true\ndedup_tensors = true\n",
        "zipped": 'dedup = true\ndedup_tensors = true\ncompression = "auto"\n',
    }[mode]
    config.write_text(
        f'index = "{root}/index-{mode}.db"\n[daemon]\nsettle_seconds = "1s"\ntrust_mtimes = true\n'
        f'[[tiers]]\nname = "hot"\nurl = "{hot}"\nkeep_last = 100\n'
        f'[[tiers]]\nname = "warm"\nurl = "{warm}"\nkeep_last = 100\nreplicate = true\n{dedup}'
    )
    config.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune", "--json"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"prune exited {proc.returncode}: {proc.stderr[-2000:]}")
    return _tree_bytes(warm)


def _scenario(cfg: Config, root: Path, *, frozen: bool) -> tuple[int, int, int, int, int, int]:
    """(raw bytes, stored without dedup, with file dedup, with tensor dedup, tensor estimate,
    with tensor dedup and ``compression = "auto"``)."""
    import torch

    blocks, dim, vocab = cfg.pick((8, 512, 8192), (4, 256, 4096), (2, 64, 256))
    hot = root / "hot"
    run = hot / "run"
    saves = 5 if frozen else 2
    model = _model(blocks, dim, vocab, seed=1)
    names = list(model)
    trainable = (
        [n for n in names if n.startswith("layers.") and int(n.split(".")[1]) >= blocks // 2]
        if frozen
        else names
    )
    when = time.time() - 600  # settled, not stale (failed_after is 2 h)
    kept: list[tuple[dict[str, Any], dict[int, dict[str, Any]]]] = []
    for i in range(saves):
        step = 100 * (i + 1)
        if frozen and i:
            g = torch.Generator().manual_seed(100 + i)
            model = {
                n: (t + 1e-3 * torch.randn(t.shape, generator=g) if n in trainable else t)
                for n, t in model.items()
            }
        seed = 7 if not frozen else 10 + i  # a re-save writes the very same optimizer state
        _save(run / f"checkpoint-{step}", step, model, trainable, seed, when + i)
        optim = torch.load(run / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)["state"]
        kept.append((dict(model), optim))
    raw = _tree_bytes(run)
    plain = _prune(root, hot, "plain")
    deduped = _prune(root, hot, "file")
    tensors = _prune(root, hot, "tensors")
    zipped = _prune(root, hot, "zipped")
    return raw, plain, deduped, tensors, _tensor_unique_bytes(kept), zipped


def run(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    for frozen in (False, True):
        label = (
            "5 saves, embedding + half the layers frozen" if frozen else "a re-save (same weights, new step)"
        )
        with cfg.tempdir(cfg.disk_dir, "dedup") as root:
            raw, plain, deduped, split, tensors, zipped = _scenario(cfg, root, frozen=frozen)
        cfg.log(
            f"{label}: raw {raw / MiB:.1f} MiB, plain {plain / MiB:.1f} MiB, dedup {deduped / MiB:.1f} MiB"
        )
        rows.append(
            Row(
                metric=f"dedup: warm bytes per raw byte, {label}",
                baseline=round(100 * plain / raw, 3),
                ours=round(100 * deduped / raw, 3),
                unit="%",
                ratio=round(deduped / plain, 4),
                target="re-save: second copy < 1 % of raw" if not frozen else "informational",
                ok=(deduped - raw / 2) / (raw / 2) < 0.01 if not frozen else None,
                baseline_label="dedup = false",
                note=f"raw {raw} B over {'2' if not frozen else '5'} checkpoints; stored {plain} B plain, "
                f"{deduped} B deduped"
                + (
                    ""
                    if frozen
                    else f"; the re-save cost {deduped - plain // 2} B ({100 * (2 * deduped - plain) / plain:.4f} % of a copy)"
                ),
            )
        )
        rows.append(
            Row(
                metric=f"dedup_tensors: warm bytes per raw byte, {label}",
                baseline=round(100 * plain / raw, 3),
                ours=round(100 * split / raw, 3),
                unit="%",
                ratio=round(split / plain, 4),
                target="informational",
                ok=None,
                baseline_label="dedup = false",
                note=f"stored {split} B; each distinct tensor once (model and optimizer) would be "
                f"{100 * tensors / raw:.1f} % of raw: optimizer.pt (torch.save) is not split",
            )
        )
        rows.append(
            Row(
                metric=f'dedup_tensors + compression = "auto": warm bytes per raw byte, {label}',
                baseline=round(100 * plain / raw, 3),
                ours=round(100 * zipped / raw, 3),
                unit="%",
                ratio=round(zipped / plain, 4),
                target="informational",
                ok=None,
                baseline_label="dedup = false",
                note=f"stored {zipped} B; each tensor piece once, compressed (ZipNN / zstd); "
                f"{100 * split / raw:.1f} % with dedup_tensors alone",
            )
        )
    return rows
