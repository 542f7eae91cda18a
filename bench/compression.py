"""Per-tier compression on checkpoints written here by real frameworks (docs/compression.md).

A small Llama-style stack (embedding, attention and MLP blocks, LM head) is trained for a few steps
with AdamW by torch, then saved as HF Trainer lays a checkpoint out (``model.safetensors`` through
safetensors, ``optimizer.pt``/``scheduler.pt``/``rng_state.pth`` through ``torch.save``,
``trainer_state.json``): fp32, pure bf16, and a half-frozen fine-tune (embedding and half the
layers frozen: no optimizer state for them); the fp32 one again through ``torch.distributed.
checkpoint.save`` (DCP, one process); and the fp32 save written again after a restart.

Each checkpoint is copied from a hot tier into a local slower tier with ``compression`` none, zstd
and auto (``TierStorage.copy_from``, what the prune pass runs) and restored (``fetch``). Printed:
cold bytes per raw byte, and client CPU per GiB uploaded and restored as a ratio to ``none`` in the
same run. ``python -m bench.compression [--params 3000000] [--steps 200]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "zstd", "auto")


def _model(params: int, dtype: Any) -> Any:
    import torch
    from torch import nn

    dim = 256
    layers = max(2, params // (12 * dim * dim))
    vocab = 4000

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(dim, 4 * dim, bias=False)  # q, k, v, o in one
            self.up = nn.Linear(dim, 4 * dim, bias=False)
            self.down = nn.Linear(4 * dim, dim, bias=False)
            self.norm = nn.LayerNorm(dim)

        def forward(self, x: Any) -> Any:
            h = self.norm(x)
            a = self.attn(h)[..., :dim]
            return x + a + self.down(torch.nn.functional.silu(self.up(h)))

    class Llamaish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Llamaish()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return model.to(dtype)


def _train(model: Any, frozen: bool, steps: int) -> Any:
    import torch

    if frozen:
        model.embed.requires_grad_(False)
        for layer in list(model.layers)[: len(model.layers) // 2]:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, 4000, (4, 64))
        loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _hf_save(model: Any, opt: Any, out: Path, step: int) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    torch.save(opt.state_dict(), out / "optimizer.pt")
    torch.save({"last_epoch": step}, out / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, out / "rng_state.pth")
    (out / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))


def _dcp_save(model: Any, opt: Any, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(out))


def write_checkpoints(root: Path, params: int, steps: int) -> dict[str, Path]:
    import torch

    out: dict[str, Path] = {}
    m = _model(params, torch.float32)
    o = _train(m, frozen=False, steps=steps)
    out["HF fp32 + Adam"] = root / "run" / "fp32"
    _hf_save(m, o, out["HF fp32 + Adam"], 8)
    out["DCP fp32 + Adam"] = root / "run" / "dcp"
    _dcp_save(m, o, out["DCP fp32 + Adam"])
    out["the same, saved again"] = root / "run" / "resave"
    _hf_save(m, o, out["the same, saved again"], 8)
    m = _model(params, torch.bfloat16)
    o = _train(m, frozen=False, steps=steps)
    out["HF pure bf16"] = root / "run" / "bf16"
    _hf_save(m, o, out["HF pure bf16"], 8)
    m = _model(params, torch.float32)
    o = _train(m, frozen=True, steps=steps)
    out["half frozen fp32"] = root / "run" / "frozen"
    _hf_save(m, o, out["half frozen fp32"], 8)
    return out


def _manifest(path: Path, name: str) -> Any:
    from ckptkeeper.core.model import FileEntry, Manifest
    from ckptkeeper.util import hashing

    files = []
    for p in sorted(path.rglob("*")):
        if p.is_file():
            size, digest = hashing.hash_file(p)
            files.append(FileEntry(str(p.relative_to(path)), size, digest))
    return Manifest(run="run", step=1, name=name, layout="bench", is_dir=True, files=tuple(files))


def measure(root: Path, ckpts: dict[str, Path]) -> list[dict[str, Any]]:
    from ckptkeeper.core.model import TierPolicy, TierSpec
    from ckptkeeper.storage import TierStorage

    hot = TierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True)
    rows = []
    first = next(iter(ckpts.values()))
    for mode in MODES:  # warm up: imports, codec tables, page cache; not measured
        warm_root = Path(tempfile.mkdtemp(prefix="warmup-", dir=root.parent))
        warm = TierStorage(TierSpec("warm", str(warm_root), TierPolicy(), compression=mode))
        warm.copy_from(hot, _manifest(first, first.name))
        shutil.rmtree(warm_root)
    for label, path in ckpts.items():
        manifest = _manifest(path, path.name)
        row: dict[str, Any] = {"checkpoint": label, "raw_bytes": manifest.total_bytes}
        for mode in MODES:
            warm_root = Path(tempfile.mkdtemp(prefix=f"warm-{mode}-", dir=root.parent))
            warm = TierStorage(TierSpec("warm", str(warm_root), TierPolicy(), compression=mode))
            t0 = time.process_time()
            warm.copy_from(hot, manifest)
            up = time.process_time() - t0
            stored = warm.read_manifest(f"run/{path.name}")
            assert stored is not None
            restore = Path(tempfile.mkdtemp(prefix="restore-", dir=root.parent))
            t0 = time.process_time()
            warm.fetch(manifest, restore)
            down = time.process_time() - t0
            row[mode] = {"stored_bytes": stored.stored_bytes, "cpu_up": up, "cpu_down": down}
            shutil.rmtree(warm_root)
            shutil.rmtree(restore)
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    gib = 2**30
    lines = [
        "| checkpoint | raw MiB | zstd % | auto % | CPU-s/GiB up none / zstd / auto | restore none / zstd / auto |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        raw = r["raw_bytes"]
        up = " / ".join(f"{r[m]['cpu_up'] * gib / raw:.2f}" for m in MODES)
        down = " / ".join(f"{r[m]['cpu_down'] * gib / raw:.2f}" for m in MODES)
        lines.append(
            f"| {r['checkpoint']} | {raw / 2**20:.1f} | {100 * r['zstd']['stored_bytes'] / raw:.1f} | "
            f"{100 * r['auto']['stored_bytes'] / raw:.1f} | {up} | {down} |"
        )
    tot = {m: sum(r[m]["cpu_up"] for r in rows) for m in MODES}
    tot_down = {m: sum(r[m]["cpu_down"] for r in rows) for m in MODES}
    lines.append("")
    lines.append(
        "client CPU against none, same run: upload zstd {:.1f}x auto {:.1f}x; restore zstd {:.1f}x auto {:.1f}x".format(
            tot["zstd"] / tot["none"],
            tot["auto"] / tot["none"],
            tot_down["zstd"] / tot_down["none"],
            tot_down["auto"] / tot_down["none"],
        )
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=3_000_000, help="model parameters (default 3M)")
    parser.add_argument("--steps", type=int, default=200, help="AdamW steps before the saves (default 200)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ckptkeeper-bench-compress-") as tmp:
        root = Path(tmp) / "hot"
        ckpts = write_checkpoints(root, args.params, args.steps)
        rows = measure(root, ckpts)
    print(json.dumps(rows, indent=1) if args.json else report(rows))


if __name__ == "__main__":
    main()
