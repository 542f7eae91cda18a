"""Per-tier compression on checkpoints written here by real frameworks (docs/compression.md).

A Llama-style model (embedding, RMSNorm, causal self-attention, SwiGLU MLP blocks, an untied LM
head) is trained for a few AdamW steps by torch on tokens drawn from part of its vocabulary (the
rest keeps zero Adam moments, as in a fine-tune whose text never holds those tokens), then saved
as HF Trainer lays a checkpoint out (``model.safetensors`` through safetensors,
``optimizer.pt``/``scheduler.pt``/``rng_state.pth`` through ``torch.save``,
``trainer_state.json``): fp32, pure bf16, a half-frozen fine-tune (embedding and half the layers
frozen: no optimizer state for them), a LoRA fine-tune of the fp32 model (PEFT's file names); the
fp32 one again through ``torch.distributed.checkpoint.save`` (DCP, one process), and written again
after a restart.

Each checkpoint is compressed whole by the plain tools (zstd-3, ZipNN at its dtype), copied from a
hot tier into a local slower tier with ``compression`` none, zstd and auto (``TierStorage.
copy_from``, what the prune pass runs) and restored (``fetch``). Printed: cold bytes per raw byte
(plain tools and ours), and client CPU per GiB uploaded and restored as a ratio to ``none`` in
the same run. ``python -m bench.compression [--vocab 32000] [--dim 256] [--layers 4] [--steps 40]
[--unused-vocab 0.3]``.

In ``python -m bench`` (``--only compression``) the same rows go into the harness's table, and the
fp32 checkpoint is also pruned to a SeaweedFS S3 tier by the whole ``ckptkeeper prune`` (a process)
with ``compression`` "auto", "zstd" and "none", against a boto3 ``upload_file`` of the same files
(raw), in alternating rounds: wall time and client CPU per raw GiB of each, straight to the store
(SeaweedFS runs on the same cores as the client: the client's CPU is the bound) and through a
bandwidth-limited link (``bench/_link.py``: the link is the bound).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._harness import Config, GiB, MiB, Row, median, python_env

MODES = ("none", "zstd", "auto")
FULL_SHAPE = (32000, 256, 4)
"""Vocabulary-heavy as a real LM's: the frozen embedding and half the blocks are about a quarter
of the half-frozen checkpoint's bytes (the trained half carries two Adam moments), as in a 42M
Llama-style model."""
FULL_STEPS = 40
UNUSED_VOCAB = 0.3
"""Share of the vocabulary the fine-tune's text never holds. The reference figures (a 42M
Llama-style model trained by HF Trainer) store 6-9 points less for a full fine-tune than for a
half-frozen one, whose embedding has no Adam state: about 30 % of the embedding rows kept zero
moments there. With 0, every row has been trained."""


def _model(shape: tuple[int, int, int], dtype: Any) -> Any:
    """A Llama-style stack of ``(vocab, dim, layers)``: embedding, blocks (RMSNorm, causal
    self-attention with q/k/v/o projections, a SwiGLU MLP), an untied LM head."""
    import torch
    from torch import nn

    vocab, dim, layers = shape
    heads = max(1, dim // 64)
    hidden = 64 * max(1, round(8 * dim / 3 / 64))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = nn.RMSNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.o = nn.Linear(dim, dim, bias=False)
            self.mlp_norm = nn.RMSNorm(dim)
            self.gate = nn.Linear(dim, hidden, bias=False)
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = (
                y.view(b, t, heads, dim // heads).transpose(1, 2)
                for y in self.qkv(self.attn_norm(x)).split(dim, dim=-1)
            )
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, dim))
            h = self.mlp_norm(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    class Llamaish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.RMSNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = Llamaish()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return model.to(dtype)


def _train(model: Any, frozen: bool, steps: int, unused_vocab: float) -> Any:
    """AdamW for ``steps`` steps on token ids drawn from the first ``1 - unused_vocab`` of the
    vocabulary: the rest are tokens the fine-tune's text never holds (a multilingual tokenizer's
    other scripts, byte fallbacks), whose embedding rows get no gradient and keep zero Adam
    moments, as in a real run. Every used row gets a gradient (a small L2 term on the used rows):
    over a real corpus a fine-tune sees its vocabulary, which 40 steps of 64 tokens would not."""
    import torch

    vocab = model.embed.num_embeddings
    used = max(2, round(vocab * (1 - unused_vocab)))
    if frozen:
        model.embed.requires_grad_(False)
        for layer in list(model.layers)[: len(model.layers) // 2]:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, used, (2, 32), generator=gen)
        logits = model(ids[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        if model.embed.weight.requires_grad:
            loss = loss + 1e-6 * model.embed.weight[:used].float().pow(2).sum()
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


def write_checkpoints(
    root: Path, shape: tuple[int, int, int], steps: int, unused_vocab: float = 0.0
) -> tuple[dict[str, Path], int]:
    """Every checkpoint under ``root/run/``, and the bytes of the half-frozen one's frozen tensors."""
    import torch

    out: dict[str, Path] = {}
    m = _model(shape, torch.float32)
    o = _train(m, frozen=False, steps=steps, unused_vocab=unused_vocab)
    out["HF fp32 + Adam"] = root / "run" / "fp32"
    _hf_save(m, o, out["HF fp32 + Adam"], 8)
    out["DCP fp32 + Adam"] = root / "run" / "dcp"
    _dcp_save(m, o, out["DCP fp32 + Adam"])
    out["the same, saved again"] = root / "run" / "resave"
    _hf_save(m, o, out["the same, saved again"], 8)
    m = _model(shape, torch.bfloat16)
    o = _train(m, frozen=False, steps=steps, unused_vocab=unused_vocab)
    out["HF pure bf16"] = root / "run" / "bf16"
    _hf_save(m, o, out["HF pure bf16"], 8)
    m = _model(shape, torch.float32)
    o = _train(m, frozen=True, steps=steps, unused_vocab=unused_vocab)
    out["half frozen fp32"] = root / "run" / "frozen"
    _hf_save(m, o, out["half frozen fp32"], 8)
    frozen = sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
    out["LoRA adapter"] = root / "run" / "lora"
    _lora_save(m, steps, unused_vocab, out["LoRA adapter"])
    return out, frozen


LORA_RANK = 16


def _lora_save(base: Any, steps: int, unused_vocab: float, out: Path) -> None:
    """A LoRA fine-tune of ``base`` (frozen) as PEFT under HF Trainer saves one: rank-16 adapters
    on every projection of every block (A Kaiming-uniform, B zero at the start, as PEFT inits
    them), trained ``steps`` AdamW steps; ``adapter_model.safetensors``, ``adapter_config.json``
    and the Trainer's files (the optimizer holds the adapters' state only)."""
    import math

    import torch
    from safetensors.torch import save_file
    from torch import nn

    base.requires_grad_(False)
    adapters: dict[str, Any] = {}
    hooks = []
    for i, layer in enumerate(base.layers):
        for name in ("qkv", "o", "gate", "up", "down"):
            lin = getattr(layer, name)
            a = nn.Parameter(torch.empty(LORA_RANK, lin.in_features))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            b = nn.Parameter(torch.zeros(lin.out_features, LORA_RANK))
            key = f"base_model.model.layers.{i}.{name}"
            adapters[f"{key}.lora_A.weight"], adapters[f"{key}.lora_B.weight"] = a, b

            def lora(_: Any, inp: Any, res: Any, a: Any = a, b: Any = b) -> Any:
                return res + 2.0 * (inp[0] @ a.t() @ b.t())  # lora_alpha / r = 2

            hooks.append(lin.register_forward_hook(lora))
    vocab = base.embed.num_embeddings
    used = max(2, round(vocab * (1 - unused_vocab)))
    opt = torch.optim.AdamW(list(adapters.values()), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        ids = torch.randint(0, used, (2, 32), generator=gen)
        loss = torch.nn.functional.cross_entropy(base(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    out.mkdir(parents=True)
    save_file(
        {k: v.detach().contiguous() for k, v in adapters.items()}, str(out / "adapter_model.safetensors")
    )
    config = {
        "peft_type": "LORA",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "target_modules": ["qkv", "o", "gate", "up", "down"],
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    torch.save(opt.state_dict(), out / "optimizer.pt")
    torch.save({"last_epoch": 8}, out / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, out / "rng_state.pth")
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 8, "log_history": []}))


def _manifest(path: Path, name: str) -> Any:
    from ckptkeeper.core.model import FileEntry, Manifest
    from ckptkeeper.util import hashing

    files = []
    for p in sorted(path.rglob("*")):
        if p.is_file():
            size, digest = hashing.hash_file(p)
            files.append(FileEntry(str(p.relative_to(path)), size, digest))
    return Manifest(run="run", step=1, name=name, layout="bench", is_dir=True, files=tuple(files))


def plain_tools(path: Path) -> dict[str, int]:
    """Bytes of each file of ``path`` compressed whole by the plain tools, as the reference
    figures were taken: zstd level 3, and ZipNN at the checkpoint's float dtype (bfloat16 for the
    pure-bf16 checkpoint, float32 for the rest; a length not a multiple of 4 loses its tail to
    ZipNN, counted raw). Files under 4 KiB go to zstd for both."""
    import zipnn
    import zstandard

    dtype = "bfloat16" if path.name == "bf16" else "float32"
    zc = zstandard.ZstdCompressor(level=3)
    out = {"zstd": 0, "zipnn": 0}
    for p in sorted(path.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        out["zstd"] += len(zc.compress(data))
        if len(data) < 4096:
            out["zipnn"] += len(zc.compress(data))
            continue
        whole = len(data) // 4 * 4
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
        out["zipnn"] += len(z.compress(bytearray(data[:whole]))) + len(data) - whole
    return out


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
        row["plain"] = plain_tools(path)
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
        "| checkpoint | raw MiB | plain zstd-3 % | plain ZipNN % | zstd % | auto % "
        "| CPU-s/GiB up none / zstd / auto | restore none / zstd / auto |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        raw = r["raw_bytes"]
        up = " / ".join(f"{r[m]['cpu_up'] * gib / raw:.2f}" for m in MODES)
        down = " / ".join(f"{r[m]['cpu_down'] * gib / raw:.2f}" for m in MODES)
        lines.append(
            f"| {r['checkpoint']} | {raw / 2**20:.1f} | {100 * r['plain']['zstd'] / raw:.1f} | "
            f"{100 * r['plain']['zipnn'] / raw:.1f} | {100 * r['zstd']['stored_bytes'] / raw:.1f} | "
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


def _local_rows(rows: list[dict[str, Any]], frozen_share: float) -> list[Row]:
    """Cold bytes per raw byte of each checkpoint (auto against zstd), and the client CPU per GiB
    over all of them against ``none``."""
    out = []
    for r in rows:
        raw = r["raw_bytes"]
        zstd, auto = (100 * r[m]["stored_bytes"] / raw for m in ("zstd", "auto"))
        plain = r["plain"]
        note = (
            f"raw {raw / MiB:.1f} MiB; plain tools on the same files: zstd-3 "
            f"{100 * plain['zstd'] / raw:.1f} %, ZipNN {100 * plain['zipnn'] / raw:.1f} %"
        )
        if r["checkpoint"] == "half frozen fp32":
            note += f"; frozen tensors are {100 * frozen_share:.1f} % of its bytes"
        out.append(
            Row(
                metric=f"compression: cold bytes per raw byte, {r['checkpoint']}",
                baseline=round(zstd, 2),
                ours=round(auto, 2),
                unit="%",
                ratio=round(auto / zstd, 4),
                target="informational",
                ok=None,
                baseline_label="zstd",
                note=note,
            )
        )
    raw_gib = sum(r["raw_bytes"] for r in rows) / GiB
    for key, what in (("cpu_up", "copied into a slower tier"), ("cpu_down", "restored")):
        cpu = {m: sum(r[m][key] for r in rows) / raw_gib for m in MODES}
        out.append(
            Row(
                metric=f"compression auto: client CPU per raw GiB {what} (all checkpoints, in process)",
                baseline=cpu["none"],
                ours=cpu["auto"],
                unit="cpu-s/GiB",
                ratio=cpu["auto"] / cpu["none"],
                target="informational",
                ok=None,
                baseline_label="none",
                note=f"zstd {cpu['zstd']:.2f} CPU-s/GiB",
            )
        )
    return out


LINK_RATE = 25 * MiB
"""The link of the store-bound rows: 25 MiB/s (200 Mbit/s), under what boto3 reaches unthrottled
against SeaweedFS on this box (about 65 MiB/s), so the link is the bound."""


def _s3_rows(cfg: Config, ckpt: Path, reps: int) -> list[Row]:
    """``ckptkeeper prune`` of ``ckpt`` to SeaweedFS with each compression mode against boto3
    (raw), in alternating rounds, straight to the store and through a :data:`LINK_RATE` link;
    wall time and client CPU per raw GiB."""
    from bench._link import Link
    from bench.prune_e2e import Usage
    from bench.prune_e2e import measure as measure_process
    from bench.restore_s3 import BUCKET, RUN, STEP, _delete_prefix, _prune_once, seaweedfs_server
    from bench.s3_transfer import _AWS_ENV

    env = {**python_env(), **_AWS_ENV}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    sides = ("boto3", "none", "zstd", "auto")
    links: tuple[float | None, ...] = (None, LINK_RATE)
    results: dict[tuple[float | None, str], list[Usage]] = {(k, s): [] for k in links for s in sides}
    with (
        cfg.tempdir(cfg.disk_dir, "compress-weed") as data,
        seaweedfs_server(data) as store,
        cfg.tempdir(cfg.fast_dir, "compress-up") as home,
    ):
        src = home / "pristine" / RUN / f"checkpoint-{STEP}"
        shutil.copytree(ckpt, src)
        when = time.time() - 3600
        for p in [*src.rglob("*"), src]:
            os.utime(p, (when, when))
        total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        for i in range(reps):
            for link in links:
                with Link(store, link) if link else contextlib.nullcontext(store) as endpoint:
                    boto3_job = [sys.executable, "-m", "bench._boto3_job", "upload", endpoint, BUCKET]
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        prefix = f"up-{side}-{i}"
                        if side == "boto3":
                            usage = measure_process([*boto3_job, prefix, str(src)], env)
                        else:
                            extra: dict[str, object] = {"compression": side}
                            usage = _prune_once(
                                home / f"home-{i}", home / "pristine", endpoint, prefix, env, extra
                            )
                        results[link, side].append(usage)
                        _delete_prefix(store, prefix)
            cfg.log(f"compression prune to S3: round {i + 1} of {reps}")
    rows = []
    for link in links:
        rows += _s3_link_rows(results, link, total, reps)
    return rows


def _s3_link_rows(
    results: dict[tuple[float | None, str], list[Any]], link: float | None, total: int, reps: int
) -> list[Row]:
    gib = total / GiB
    wall = {s: median([u.wall for u in results[link, s]]) for s in ("boto3", "none", "zstd", "auto")}
    cpu = {s: median([u.cpu / gib for u in results[link, s]]) for s in ("boto3", "none", "zstd", "auto")}
    where = "" if link is None else f" through a {link / MiB:.0f} MiB/s link"
    target = (
        ">= 1.0x where the store is the bound (info here: the client's CPU is)"
        if link is None
        else ">= 1.0x (the link is the bound)"
    )
    note = (
        f"median of {reps}; SeaweedFS shares this box's {os.cpu_count()} cores with the client"
        if link is None
        else f"median of {reps}; both sides through the same token-bucket TCP relay"
    )
    rows = []
    for side in ("auto", "zstd", "none"):
        rows.append(
            Row(
                metric=f'prune to S3 (SeaweedFS){where}, compression = "{side}", HF fp32 checkpoint, '
                f"{total / MiB:.0f} MiB (wall, whole process)",
                baseline=wall["boto3"],
                ours=wall[side],
                unit="s",
                ratio=wall["boto3"] / wall[side],
                target=target,
                ok=None if link is None else wall["boto3"] / wall[side] >= 1.0,
                baseline_label="boto3 upload_file, raw",
                note=note,
                samples={
                    "baseline": [u.wall for u in results[link, "boto3"]],
                    "ckptkeeper": [u.wall for u in results[link, side]],
                },
            )
        )
        rows.append(
            Row(
                metric="  same, client CPU per raw GiB" + ("" if link is None else " (link)"),
                baseline=cpu["boto3"],
                ours=cpu[side],
                unit="cpu-s/GiB",
                ratio=cpu[side] / cpu["boto3"],
                target="informational",
                ok=None,
                baseline_label="boto3",
                samples={
                    "baseline": [u.cpu / gib for u in results[link, "boto3"]],
                    "ckptkeeper": [u.cpu / gib for u in results[link, side]],
                },
            )
        )
    return rows


def run(cfg: Config) -> list[Row]:
    shape = cfg.pick(FULL_SHAPE, (8000, 128, 4), (300, 32, 2))
    steps = cfg.pick(FULL_STEPS, 10, 2)
    reps = cfg.pick(cfg.reps, 3, 3)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with cfg.tempdir(cfg.disk_dir, "compress") as tmp:
        root = tmp / "hot"
        ckpts, frozen = write_checkpoints(root, shape, steps, UNUSED_VOCAB)
        cfg.log(f"compression: wrote {len(ckpts)} checkpoints of a {shape} model")
        rows = measure(root, ckpts)
        frozen_raw = next(r["raw_bytes"] for r in rows if r["checkpoint"] == "half frozen fp32")
        out = _local_rows(rows, frozen / frozen_raw)
        out += _s3_rows(cfg, ckpts["HF fp32 + Adam"], reps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=FULL_SHAPE[0], help="vocabulary (default 32000)")
    parser.add_argument("--dim", type=int, default=FULL_SHAPE[1], help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=FULL_SHAPE[2], help="blocks (default 4)")
    parser.add_argument("--steps", type=int, default=FULL_STEPS, help="AdamW steps before the saves")
    parser.add_argument(
        "--unused-vocab",
        type=float,
        default=UNUSED_VOCAB,
        help=f"share of the vocabulary no training token uses (default {UNUSED_VOCAB})",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ckptkeeper-bench-compress-") as tmp:
        root = Path(tmp) / "hot"
        shape = (args.vocab, args.dim, args.layers)
        ckpts, _ = write_checkpoints(root, shape, args.steps, args.unused_vocab)
        rows = measure(root, ckpts)
    print(json.dumps(rows, indent=1) if args.json else report(rows))


if __name__ == "__main__":
    main()
