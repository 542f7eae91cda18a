"""Framework callbacks in a job spanning nodes: each node's local rank 0 writes.

A real 4-process job (gloo, CPU) split across 2 simulated nodes, launched as torchrun launches it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``,
``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``/``MASTER_PORT``). Each node's two processes run in a mount
namespace of their own where the node's directory is bind-mounted on one shared path: every rank
saves to the same path, and each node's files land on that node's "disk", as with node-local NVMe.
Lightning needs that: ``ModelCheckpoint`` broadcasts rank 0's ``dirpath`` to every rank.

Lightning runs FSDP2 (``ModelParallelStrategy``, which runs on CPU; Lightning's ``FSDPStrategy``
refuses a CPU accelerator) with distributed checkpoints: each rank saves its shard, so node 1 holds
``__2_0.distcp`` and ``__3_0.distcp`` and node 0 the rest with ``.metadata``. Hugging Face runs DDP
as it comes: the world's process zero saves the checkpoint, every process its ``rng_state_<rank>.pth``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.hook import read_commits, read_run_dir
from ckptkeeper.hook.parts import JobPart

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
JOB = "job-42"
NODES = 2
PER_NODE = 2


def _namespaces_usable(tmp_path: Path) -> str | None:
    """None if ``unshare -m`` + ``mount --bind`` work here, else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "unshare/mount not installed"
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "--bind", str(a), str(b)],
        capture_output=True,
        text=True,
    )
    return (
        None if probe.returncode == 0 else f"cannot bind-mount in a mount namespace: {probe.stderr.strip()}"
    )


_NODE = textwrap.dedent(
    """
    # One simulated node: bind its disk on the shared path, start its ranks, wait for them.
    import json, os, subprocess, sys
    node_dir, shared, worker, node, port, framework = sys.argv[1:7]
    subprocess.run(["mount", "--bind", node_dir, shared], check=True)
    procs = []
    for local in range(%(per_node)d):
        rank = int(node) * %(per_node)d + local
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=node, NODE_RANK=node,
                   WORLD_SIZE=str(%(world)d), LOCAL_WORLD_SIZE=str(%(per_node)d), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, TORCHELASTIC_RUN_ID=%(job)r, OMP_NUM_THREADS="1")
        procs.append((rank, local, subprocess.Popen([sys.executable, worker, framework, shared], env=env)))
    pids = {}
    for rank, local, proc in procs:
        pids[rank] = {"pid": proc.pid, "local": local, "rc": proc.wait(timeout=600)}
    with open(os.path.join(node_dir, "ranks.json"), "w") as f:
        json.dump(pids, f)
    sys.exit(max(p["rc"] for p in pids.values()))
    """
) % {"per_node": PER_NODE, "world": NODES * PER_NODE, "job": JOB}


_WORKER = textwrap.dedent(
    """
    import os, sys, warnings
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    framework, shared = sys.argv[1:3]
    warnings.simplefilter("ignore")

    if framework == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from ckptkeeper.integrations.lightning import KeeperCallback

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = nn.functional.mse_loss(self.layer(x), y)
                self.log("train_loss", loss, sync_dist=True)
                return loss

            def configure_model(self):
                fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        trainer = pl.Trainer(
            accelerator="cpu", devices=%(per_node)d, num_nodes=%(nodes)d,
            strategy=ModelParallelStrategy(data_parallel_size=%(world)d, tensor_parallel_size=1,
                                           process_group_backend="gloo"),
            max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=os.path.join(shared, "pl-run"), save_top_k=-1),
                       KeeperCallback()],
        )
        trainer.fit(Tiny(), DataLoader(data, batch_size=16))
    else:
        import transformers
        from ckptkeeper.integrations.transformers import KeeperCallback

        class Tokens(torch.utils.data.Dataset):
            def __init__(self, n):
                self.rows = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(n))
            def __len__(self):
                return len(self.rows)
            def __getitem__(self, i):
                return {"input_ids": self.rows[i], "labels": self.rows[i]}

        config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
        args = transformers.TrainingArguments(
            output_dir=os.path.join(shared, "hf-run"), max_steps=4, per_device_train_batch_size=2,
            save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
            ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        )
        transformers.Trainer(
            model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(32),
            callbacks=[KeeperCallback()],
        ).train()
    """
) % {"per_node": PER_NODE, "nodes": NODES, "world": NODES * PER_NODE}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_job(tmp_path: Path, framework: str) -> list[Path]:
    """Run the job; each node's directory (its "disk"), with ``ranks.json``: rank -> pid, rc."""
    reason = _namespaces_usable(tmp_path)
    if reason:
        pytest.skip(reason)
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    shared = tmp_path / "nvme"
    shared.mkdir()
    nodes = [tmp_path / f"node{k}" for k in range(NODES)]
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    launched = []
    for k, node_dir in enumerate(nodes):
        node_dir.mkdir()
        cmd = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _NODE]
        cmd += [str(node_dir), str(shared), str(worker), str(k), port, framework]
        launched.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [proc.communicate(timeout=900)[0] for proc in launched]
    for proc, out in zip(launched, outputs, strict=True):
        assert proc.returncode == 0, out[-6000:]
    assert list(shared.iterdir()) == [], "every rank saved to its node's disk, none to the shared path"
    return nodes


def _ranks(node_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(rank): info for rank, info in json.loads((node_dir / "ranks.json").read_text()).items()}


def _check_node(node_dir: Path, run: str, k: int, steps: list[int]) -> list[str]:
    """The node's run dir speaks for part ``k`` of the job, written by its local rank 0 only;
    returns the committed paths."""
    run_dir = node_dir / run
    info = read_run_dir(run_dir)
    assert info is not None and info.error is None
    assert info.job == JobPart(job=JOB, part=k, parts=NODES)
    assert info.state == "finished"
    writer = next(r["pid"] for r in _ranks(node_dir).values() if r["local"] == 0)
    assert info.pid == writer, "the node's local rank 0 writes run.json"
    doc = json.loads((run_dir / ".ckptkeeper" / "run.json").read_text())
    assert doc["job"] == {"id": JOB, "part": k, "parts": NODES}
    commits, errors = read_commits(run_dir)
    assert errors == []
    # One line per checkpoint: a second writer on the node would have doubled them.
    assert [c.step for c in commits] == steps
    assert {(c.part, c.parts) for c in commits} == {(k, NODES)}
    return [c.path for c in commits]


def _node_view(node_dir: Path, run: str) -> list[dict[str, Any]]:
    """What node's daemon makes of the run: ``scan`` then ``ls --json``'s checkpoints, with its
    own config, index and ``node``; and ``prune --dry-run`` reaps nothing of it."""
    config = write_config(
        node_dir.parent / f"{node_dir.name}.toml",
        index=node_dir.parent / f"{node_dir.name}.db",
        node=node_dir.name,
        tiers=[local_tier("hot", node_dir)],
    )

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    cli("scan", "--json")
    plan = cli("prune", "--dry-run", "--json")
    assert [a for a in plan["actions"] if a["run"] == run and a["action"] in ("reap", "delete")] == []
    return next(r for r in cli("ls", "--json")["runs"] if r["name"] == run)["checkpoints"]


def test_lightning_fsdp2_across_two_nodes_each_node_writes_its_part(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    node0, node1 = _run_job(tmp_path, "lightning")
    paths = _check_node(node0, "pl-run", 0, [1, 2])
    assert _check_node(node1, "pl-run", 1, [1, 2]) == paths
    assert paths == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"]
    for path in paths:
        # FSDP2's distributed checkpoint: each node holds its ranks' shards; .metadata is on rank 0's node.
        on0 = sorted(p.name for p in (node0 / "pl-run" / path).iterdir())
        on1 = sorted(p.name for p in (node1 / "pl-run" / path).iterdir())
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(on0)
        assert on1 == ["__2_0.distcp", "__3_0.distcp"]
    # Node 1's daemon: its halves are complete parts of job-42, never partial saves to reap.
    for k, node_dir in enumerate((node0, node1)):
        seen = _node_view(node_dir, "pl-run")
        assert [(c["step"], c["state"]) for c in seen] == [(1, "complete"), (2, "complete")]
        for c in seen:
            assert (c["part"]["index"], c["part"]["count"], c["part"]["job"]) == (k, NODES, JOB)
            assert c["part"]["known"] and c["part"]["marker_elsewhere"] == (k == 1)


def test_transformers_across_two_nodes_each_node_writes_its_part(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    node0, node1 = _run_job(tmp_path, "transformers")
    assert _check_node(node0, "hf-run", 0, [2, 4]) == ["checkpoint-2", "checkpoint-4"]
    assert _check_node(node1, "hf-run", 1, [2, 4]) == ["checkpoint-2", "checkpoint-4"]
    # Only the world's process zero saves the model; node 1 holds what its own ranks wrote.
    assert (node0 / "hf-run" / "checkpoint-4" / "trainer_state.json").is_file()
    on1 = sorted(p.name for p in (node1 / "hf-run" / "checkpoint-4").iterdir())
    assert on1 == ["rng_state_2.pth", "rng_state_3.pth"]
    for k, node_dir in enumerate((node0, node1)):
        seen = _node_view(node_dir, "hf-run")
        assert [(c["step"], c["state"]) for c in seen] == [(2, "complete"), (4, "complete")]
        for c in seen:
            assert (c["part"]["index"], c["part"]["count"], c["part"]["job"], c["part"]["known"]) == (
                k,
                NODES,
                JOB,
                True,
            )


@pytest.mark.parametrize(
    ("env", "given", "expected"),
    [
        # The framework's rank and world size stand for RANK and WORLD_SIZE: node 1's local rank 0.
        ({"LOCAL_WORLD_SIZE": "2"}, {"rank": 2, "local_rank": 0, "world": 4}, (True, JobPart(None, 1, 2))),
        ({"LOCAL_WORLD_SIZE": "2"}, {"rank": 3, "local_rank": 1, "world": 4}, (False, JobPart(None, 1, 2))),
        # ... and win over the environment.
        (
            {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
            {"rank": 3, "local_rank": 1, "world": 4},
            (False, JobPart(None, 1, 2)),
        ),
        # Lightning's node index and count; one node: global rank 0 only, as before.
        ({}, {"rank": 2, "local_rank": 0, "part": 1, "parts": 2}, (True, JobPart(None, 1, 2))),
        ({}, {"rank": 2, "local_rank": 0, "part": None, "parts": 1}, (False, None)),
        ({}, {"rank": 0, "local_rank": 0, "parts": 1}, (True, None)),
        # No count of processes per node: one node, global rank 0 writes.
        ({}, {"rank": 1, "local_rank": 0, "world": 4}, (False, None)),
    ],
)
def test_detect_takes_the_frameworks_ranks(
    env: dict[str, str], given: dict[str, Any], expected: tuple[bool, JobPart | None]
) -> None:
    from ckptkeeper.hook.parts import detect

    assert detect(env, **given) == expected


@pytest.mark.parametrize("module", ["lightning", "transformers"])
def test_callbacks_refuse_a_bad_job_or_parts(module: str) -> None:
    pytest.importorskip("lightning.pytorch" if module == "lightning" else "transformers")
    import importlib

    KeeperCallback = importlib.import_module(f"ckptkeeper.integrations.{module}").KeeperCallback
    with pytest.raises(ValueError, match="parts must be in"):
        KeeperCallback(parts=0)
    with pytest.raises(ValueError, match="job must be"):
        KeeperCallback(job="")
    # parts=1: nodes sharing one run dir; only global rank 0 writes, and no part is recorded.
    keeper = KeeperCallback(parts=1)
    assert keeper._node_part(rank=2, local_rank=0, world=4, node=1, nodes=2) == (False, None)
    assert keeper._node_part(rank=0, local_rank=0, world=4, node=0, nodes=2) == (True, None)
