"""Checkpoints spanning nodes: a node's part is never reaped as partial.

A real torch DCP save by a gloo process group of 4 processes split across 2 simulated nodes (2
ranks each, env vars as torchrun sets them), every rank saving to its own node's hot dir: node 1
holds ``__2_0.distcp``/``__3_0.distcp`` and no ``.metadata`` (rank 0 writes it on node 0). Each
node has its own config, index and ``node``. Without the hook, node 1's parts are kept with the
documented reason long after they would be "stale"; with the hook (the node's local rank 0
writes) they are complete parts naming the job. A real single-node save killed mid-write is still
reaped, and the recognizers' rule is pinned on the committed fixture shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.hook import protocol
from ckptkeeper.ingest.hookfiles import UNKNOWN_PART
from ckptkeeper.ingest.layouts import scan_run

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures"
JOB = "job-7"
STEPS = (100, 200)
RANKS_PER_NODE = 2
NODES = 2

# One process of the job: rank R of 4, on node R // 2, saving to that node's hot dir.
_RANK = r"""
import os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import ckptkeeper

base, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
dist.init_process_group("gloo")
node = int(os.environ["GROUP_RANK"])
rank = dist.get_rank()
hot = os.path.join(base, f"node{node}", "hot")
state = {f"r{rank}": torch.full((8,), float(rank)), "b": torch.arange(4.0)}  # r<k>: rank k's only
with ckptkeeper.track_run(os.path.join(hot, "hooked")) as run:  # every rank, as the README says
    for step in steps:
        for name in ("bare", "hooked"):
            path = os.path.join(hot, name, f"step-{step}")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
            if name == "hooked":
                run.commit(path, step=step, metrics={"loss": 1.0 / step})
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the 2-node job once: ``<base>/node{0,1}/hot/{bare,hooked}/step-{100,200}``."""
    base = tmp_path_factory.mktemp("job")
    port = _free_port()
    world = NODES * RANKS_PER_NODE
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CKPTKEEPER_", "SLURM_", "TORCHELASTIC_"))
        }
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank % RANKS_PER_NODE),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
            GROUP_RANK=str(rank // RANKS_PER_NODE),
            TORCHELASTIC_RUN_ID=JOB,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(base), ",".join(map(str, STEPS))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
    return base


def _node(job: Path, tmp_path: Path, k: int, *, age: float = 3 * 3600) -> tuple[Path, Path]:
    """Node ``k``'s hot dir copied for one test (every mtime ``age`` seconds ago), and its config:
    its own index and ``node``, reaper thresholds far below ``age``."""
    hot = tmp_path / f"node{k}" / "hot"
    shutil.copytree(job / f"node{k}" / "hot", hot)
    then = time.time() - age
    for p in sorted(hot.rglob("*"), reverse=True):
        os.utime(p, (then, then), follow_symlinks=False)
    config = write_config(
        tmp_path / f"node{k}" / "config.toml",
        index=tmp_path / f"node{k}" / "index.db",
        node=f"node{k}",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},  # the trees are back-dated with utime
        tiers=[local_tier("hot", hot)],
        reaper={"partial_after": "10m", "failed_after": "1h", "keep_last_of_failed": 1},
    )
    return hot, config


def cli(config: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) if "--json" in args else result.stdout


def _checkpoints(doc: dict[str, Any], run: str) -> list[dict[str, Any]]:
    return next(r for r in doc["runs"] if r["name"] == run)["checkpoints"]


def test_the_job_leaves_node_local_parts(job: Path) -> None:
    """What a 2-node DCP save leaves: rank 0's node holds .metadata, the other node only its shards."""
    for step in STEPS:
        node0 = sorted(p.name for p in (job / "node0/hot/bare" / f"step-{step}").iterdir())
        node1 = sorted(p.name for p in (job / "node1/hot/bare" / f"step-{step}").iterdir())
        assert node0 == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert node1 == ["__2_0.distcp", "__3_0.distcp"]
    # The two halves are one checkpoint: put together, dcp loads every rank's tensors.
    whole = job / "whole"
    if not whole.exists():
        shutil.copytree(job / "node0/hot/bare/step-200", whole)
        for shard in (job / "node1/hot/bare/step-200").iterdir():
            shutil.copy2(shard, whole / shard.name)
    import torch.distributed.checkpoint as dcp

    state = {f"r{rank}": torch.zeros(8) for rank in range(NODES * RANKS_PER_NODE)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(whole)), no_dist=True)
    assert {k: v.tolist() for k, v in state.items()} == {f"r{k}": [float(k)] * 8 for k in range(4)}


def test_without_the_hook_node1_keeps_its_parts_with_the_reason(job: Path, tmp_path: Path) -> None:
    hot, config = _node(job, tmp_path, 1)
    report = cli(config, "scan", "--json")
    assert report["parts"] == 4  # bare/ and hooked/, two steps each
    plan = cli(config, "prune", "--dry-run", "--json")
    assert [a for a in plan["actions"] if a["action"] == "reap"] == []
    keeps = {(k["run"], k["step"]): k["reasons"] for k in plan["keep"] if k["run"] == "bare"}
    assert set(keeps) == {("bare", s) for s in STEPS}
    for reasons in keeps.values():
        assert any(r.startswith(f"{UNKNOWN_PART}: ranks 2-3 without .metadata") for r in reasons), reasons

    doc = cli(config, "ls", "--json")
    run = next(r for r in doc["runs"] if r["name"] == "bare")
    assert run["state"] == "stale"  # the run is stale; its parts are still not reaped
    for c in run["checkpoints"]:
        assert c["state"] == "writing" and c["layout"] == "dcp"
        assert c["part"] == {
            "index": None,
            "count": None,
            "job": None,
            "known": False,
            "marker_elsewhere": True,
            "note": f"{UNKNOWN_PART}: ranks 2-3 without .metadata (rank 0 writes it, on another node)",
        }
    assert "dcp part?" in cli(config, "ls", "bare")
    warnings = cli(config, "status", "--json")["warnings"]
    assert [w for w in warnings if w.startswith("bare:")] == [
        "bare: 2 node-local part(s) of a multi-node checkpoint (steps 100, 200) kept, never reaped: no hook says "
        "which job they belong to (track_run on every rank). They are this node's share of those checkpoints: "
        "without them no node can restore them whole, so remove them only once the job and its checkpoints "
        "are no longer needed"
    ]

    cli(config, "prune", "--json")  # the real pass deletes nothing of them either
    assert sorted(p.name for p in (hot / "bare").iterdir()) == ["step-100", "step-200"]
    assert sorted(p.name for p in (hot / "bare/step-200").iterdir()) == ["__2_0.distcp", "__3_0.distcp"]


def test_with_the_hook_node1_parts_are_complete_and_name_the_job(job: Path, tmp_path: Path) -> None:
    info = protocol.read_run_dir(job / "node1/hot/hooked")
    assert info is not None and info.error is None and info.state == "finished"
    assert (info.job.job, info.job.part, info.job.parts) == (JOB, 1, 2) if info.job else False
    commits, errors = protocol.read_commits(job / "node1/hot/hooked")
    assert errors == [] and [(c.path, c.step, c.part, c.parts) for c in commits] == [
        (f"step-{s}", s, 1, 2) for s in STEPS
    ]  # once per node: local rank 0 only

    _, config = _node(job, tmp_path, 1)
    cli(config, "scan", "--json")
    doc = cli(config, "ls", "--json")
    for c in _checkpoints(doc, "hooked"):
        assert c["state"] == "complete", c
        assert c["part"]["index"] == 1 and c["part"]["count"] == 2 and c["part"]["job"] == JOB
        assert c["part"]["known"] and c["part"]["marker_elsewhere"]
    assert "dcp part 1/2" in cli(config, "ls", "hooked")
    plan = cli(config, "prune", "--dry-run", "--json")
    assert [a for a in plan["actions"] if a["action"] == "reap"] == []

    # Node 0: rank 0's node holds .metadata; its checkpoints are whole for the layout, parts by the hook.
    _, config0 = _node(job, tmp_path, 0)
    cli(config0, "scan", "--json")
    doc0 = cli(config0, "ls", "--json")
    assert [(c["state"], c["part"]) for c in _checkpoints(doc0, "bare")] == [("complete", None)] * 2
    hooked0 = _checkpoints(doc0, "hooked")
    assert [(c["state"], c["part"]["index"], c["part"]["marker_elsewhere"]) for c in hooked0] == [
        ("complete", 0, False)
    ] * 2


def test_a_killed_single_node_save_is_still_reaped(tmp_path: Path) -> None:
    """The real DCP save killed mid-write (``tests/fixtures/dcp/killed``: ``__0_0.distcp``, no
    ``.metadata``) holds rank 0's shard: not a node's part, reaped once quiet as before."""
    hot = tmp_path / "hot"
    shutil.copytree(FIXTURES / "dcp/killed/run", hot / "run")
    then = time.time() - 3 * 3600
    for p in sorted(hot.rglob("*"), reverse=True):
        os.utime(p, (then, then), follow_symlinks=False)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        tiers=[local_tier("hot", hot)],
        reaper={"partial_after": "10m", "failed_after": "1h", "keep_last_of_failed": 1},
    )
    assert cli(config, "scan", "--json")["parts"] == 0
    plan = cli(config, "prune", "--dry-run", "--json")
    assert [(a["path"], a["rule"]) for a in plan["actions"]] == [("run/step_100", "stale-run")]
    assert "partial checkpoint" in plan["actions"][0]["reason"]
    cli(config, "prune", "--json")
    assert not (hot / "run/step_100").exists()


# -- the recognizers' rule on the committed fixture shapes ------------------------------------------


def _copy(src: str, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(FIXTURES / src, dst)


def _dcp_node1(run: Path) -> str:
    for rank in (2, 3):
        _copy("dcp/complete/run/step_100/__0_0.distcp", run / "step_100" / f"__{rank}_0.distcp")
    return "step_100"


def _dcp_gap(run: Path) -> str:  # rank 0 and rank 2, no rank 1: a save cut short, not a node's part
    for rank in (0, 2):
        _copy("dcp/complete/run/step_100/__0_0.distcp", run / "step_100" / f"__{rank}_0.distcp")
    return "step_100"


def _dcp_node1_gap(run: Path) -> str:
    for rank in (2, 4):
        _copy("dcp/complete/run/step_100/__0_0.distcp", run / "step_100" / f"__{rank}_0.distcp")
    return "step_100"


def _dcp_metadata_tmp(run: Path) -> str:  # the coordinator is writing here: a save in progress
    _dcp_node1(run)
    _copy("dcp/complete/run/step_100/.metadata", run / "step_100" / ".metadata.tmp")
    return "step_100"


_DS = "deepspeed/complete/run/checkpoints/global_step1/mp_rank_00_model_states.pt"


def _deepspeed_node1(run: Path) -> str:
    for dp in (4, 5, 6, 7):
        for kind in ("optim", "model"):
            _copy(_DS, run / "checkpoints/global_step1" / f"zero_pp_rank_{dp}_mp_rank_00_{kind}_states.pt")
    return "checkpoints/global_step1"


def _deepspeed_killed_rank0(run: Path) -> str:  # dp rank 0's model states are here: rooted on this node
    _deepspeed_node1(run)
    _copy(_DS, run / "checkpoints/global_step1/mp_rank_00_model_states.pt")
    return "checkpoints/global_step1"


_MEG = "megatron/complete/run/checkpoints/iter_0000010/"


def _megatron_node1(run: Path) -> str:
    for rank in (4, 5):
        _copy(_MEG + "__0_0.distcp", run / "checkpoints/iter_0000010" / f"__{rank}_0.distcp")
    return "checkpoints/iter_0000010"


def _megatron_legacy_node1(run: Path) -> str:
    for rank in ("mp_rank_00_001", "mp_rank_01_001"):
        _copy(_MEG + "common.pt", run / "checkpoints/iter_0000010" / rank / "model_optim_rng.pt")
    return "checkpoints/iter_0000010"


_ORBAX = "orbax/complete/run/checkpoints/100/default/ocdbt.process_0/"


def _orbax_node1(run: Path) -> str:
    process = run / "checkpoints/100/default/ocdbt.process_1"
    _copy(_ORBAX + "manifest.ocdbt", process / "manifest.ocdbt")
    for blob in (FIXTURES / _ORBAX / "d").iterdir():
        _copy(_ORBAX + f"d/{blob.name}", process / "d" / blob.name)
    return "checkpoints/100"


SHAPES = {
    "dcp-node1": (_dcp_node1, "ranks 2-3 without .metadata (rank 0 writes it, on another node)"),
    "dcp-gap": (_dcp_gap, None),
    "dcp-node1-gap": (_dcp_node1_gap, None),
    "dcp-metadata-tmp": (_dcp_metadata_tmp, None),
    "deepspeed-node1": (
        _deepspeed_node1,
        "ZeRO dp ranks 4-7 without 'latest' (rank 0 writes it, on another node)",
    ),
    "deepspeed-rank0-here": (_deepspeed_killed_rank0, None),
    "megatron-torch_dist-node1": (
        _megatron_node1,
        "torch_dist ranks 4-5 without latest_checkpointed_iteration.txt (rank 0 writes it, on another node)",
    ),
    "megatron-legacy-node1": (
        _megatron_legacy_node1,
        "2 mp_rank dirs without mp_rank_00 or latest_checkpointed_iteration.txt (rank 0's, on another node)",
    ),
    "orbax-process1": (
        _orbax_node1,
        "process 1 without _CHECKPOINT_METADATA (process 0 writes it, on another host)",
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_recognizer_node_part_rule(shape: str, tmp_path: Path) -> None:
    build, expected = SHAPES[shape]
    run = tmp_path / "run"
    name = build(run)
    (cand,) = [c for c in scan_run(run, "run").candidates if c.name == name]
    assert not cand.complete
    assert cand.node_part == expected


@pytest.mark.parametrize("framework", ["dcp", "deepspeed", "megatron", "orbax", "hf", "nemo", "safetensors"])
@pytest.mark.parametrize("variant", ["complete", "killed"])
def test_real_fixtures_are_never_node_parts(framework: str, variant: str) -> None:
    """Every committed save of a real framework, complete or killed mid-write on one node, holds
    rank 0's files: none is a node's part, so the killed ones are reaped as before."""
    run = FIXTURES / framework / variant / "run"
    if not run.is_dir():
        pytest.skip("fixture not committed")
    assert [c.name for c in scan_run(run, "run").candidates if c.node_part is not None] == []


# -- the hook: which node, which part, who writes ---------------------------------------------------

TORCHRUN_NODE1 = {
    "RANK": "2",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RUN_ID": "j1",
}
DETECT = {
    "torchrun node 1, local rank 0 writes": (TORCHRUN_NODE1, {}, (True, ("j1", 1, 2))),
    "torchrun node 1, local rank 1 does not": (
        {**TORCHRUN_NODE1, "RANK": "3", "LOCAL_RANK": "1"},
        {},
        (False, ("j1", 1, 2)),
    ),
    "torchrun one node: rank 0 only, no part": (
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"},
        {},
        (True, None),
    ),
    "torchrun one node, rank 2": (
        {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
        {},
        (False, None),
    ),
    "no launcher at all": ({}, {}, (True, None)),
    "node index from RANK // LOCAL_WORLD_SIZE": (
        {"RANK": "6", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"},
        {},
        (True, (None, 3, 4)),
    ),
    "slurm": (
        {
            "SLURM_PROCID": "8",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "3",
            "SLURM_JOB_ID": "991",
        },
        {},
        (True, ("991", 1, 3)),
    ),
    "torchrun's default rendezvous id is no job id": (
        {**TORCHRUN_NODE1, "TORCHELASTIC_RUN_ID": "none"},
        {},
        (True, (None, 1, 2)),
    ),
    "explicit arguments win": (
        TORCHRUN_NODE1,
        {"job": "mine", "part": 0, "parts": 5},
        (True, ("mine", 0, 5)),
    ),
    "explicit, no launcher": ({}, {"part": 1, "parts": 2}, (True, (None, 1, 2))),
    "parts=1: a run dir all nodes share has one writer, global rank 0": (
        TORCHRUN_NODE1,
        {"parts": 1},
        (False, None),
    ),
    "a count of nodes without this node's index is no part": (
        {"RANK": "0", "SLURM_NNODES": "2"},
        {},
        (True, None),
    ),
    "malformed launcher values are unset": (
        {"RANK": "x", "WORLD_SIZE": "-4", "LOCAL_WORLD_SIZE": "2"},
        {},
        (True, None),
    ),
}


@pytest.mark.parametrize("case", sorted(DETECT))
def test_hook_detects_its_node_and_part(case: str) -> None:
    from ckptkeeper.hook.parts import detect

    env, kwargs, (writes, part) = DETECT[case]
    got_writes, got = detect(env, **kwargs)
    assert got_writes == writes
    assert (None if got is None else (got.job, got.part, got.parts)) == part


def test_hook_refuses_a_part_outside_its_parts() -> None:
    import ckptkeeper

    with pytest.raises(ValueError, match=r"part must be below parts \(2\), got 2"):
        ckptkeeper.track_run("/nonexistent-never-created", part=2, parts=2)
    with pytest.raises(TypeError, match="parts must be an int"):
        ckptkeeper.track_run("/nonexistent-never-created", part=0, parts="2")  # type: ignore[arg-type]


def test_run_json_job_is_validated_and_old_files_still_read(tmp_path: Path) -> None:
    state = tmp_path / protocol.STATE_DIR
    state.mkdir()
    base = {"version": 1, "name": "r", "state": "active", "host": "h", "pid": 1, "started": 1.0}
    (state / protocol.RUN_FILE).write_text(json.dumps(base))  # an older writer: no job
    info = protocol.read_run_dir(tmp_path)
    assert info is not None and info.error is None and info.job is None
    for job, problem in (
        ({"id": "j", "part": 2, "parts": 2}, "job.part: 2 is out of range [0, 1]"),
        ({"id": "j", "part": 0, "parts": 10**30}, "job.parts: an integer of 100 bits is out of range"),
        ({"id": 5, "part": 0, "parts": 2}, "job.id: 5 is not a string"),
        ("node-1", "job: 'node-1' is not an object"),
    ):
        (state / protocol.RUN_FILE).write_text(json.dumps({**base, "job": job}))
        info = protocol.read_run_dir(tmp_path)
        assert info is not None and info.job is None and info.state == "active"
        assert info.error is not None and problem in info.error, info.error
    lines = [
        {"path": "a", "step": 1, "metrics": {}, "time": 1.0, "part": 1, "parts": 2},
        {"path": "b", "step": 2, "metrics": {}, "time": 1.0, "part": 3, "parts": 2},
        {"path": "c", "step": 3, "metrics": {}, "time": 1.0},
    ]
    (state / protocol.COMMITS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    commits, errors = protocol.read_commits(tmp_path)
    assert [(c.path, c.part, c.parts) for c in commits] == [("a", 1, 2), ("b", None, None), ("c", None, None)]
    assert errors == ["commits.jsonl:2: job.part: 3 is out of range [0, 1]: part ignored"]


def test_a_part_copied_to_a_slower_tier_says_so_in_its_manifest(job: Path, tmp_path: Path) -> None:
    """A part copied down carries its job and part in the manifest beside the copy, so an index
    rebuilt from the tiers alone still knows it (the digest, the content's version, is unchanged)."""
    hot, _ = _node(job, tmp_path, 1)
    cold = tmp_path / "node1" / "cold"
    cold.mkdir()
    index = tmp_path / "node1" / "index.db"
    config = write_config(
        tmp_path / "node1" / "tiered.toml",
        index=index,
        node="node1",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("cold", cold, keep_last=5)],
        reaper={"partial_after": "10m", "failed_after": "1h", "keep_last_of_failed": 1},
    )
    cli(config, "scan", "--json")
    cli(config, "prune", "--json")
    manifest = json.loads((cold / "hooked" / "step-100.ckptkeeper-manifest.json").read_text())
    assert manifest["part"] == {
        "index": 1,
        "count": 2,
        "job": JOB,
        "marker_elsewhere": True,
        "note": f"part 1 of 2 of job {JOB} (hook): ranks 2-3 without .metadata (rank 0 writes it, on another node)",
    }
    assert sorted(f["path"] for f in manifest["files"]) == ["__2_0.distcp", "__3_0.distcp"]
    assert not (hot / "hooked" / "step-100").exists()  # demoted: its own copy is verified in cold
    assert not (cold / "bare").exists()  # an unknown part is never copied (nor deleted)

    index.unlink()  # lost: rebuilt from the tiers
    cli(config, "scan", "--json")
    (c100,) = [c for c in _checkpoints(cli(config, "ls", "--json"), "hooked") if c["step"] == 100]
    assert c100["tiers"] == ["cold"] and c100["part"]["index"] == 1 and c100["part"]["job"] == JOB


def test_with_the_hook_a_settled_part_is_complete_without_its_commit(job: Path, tmp_path: Path) -> None:
    """The hook's run.json names the part; a part the hook did not commit (the trainer commits on
    global rank 0 only, say) is complete once settled, like a checkpoint with its own marker, and
    a part being written (not settled) is not."""
    hot, config = _node(job, tmp_path, 1)
    (hot / "hooked" / protocol.STATE_DIR / protocol.COMMITS_FILE).write_text("")
    cli(config, "scan", "--json")
    doc = cli(config, "ls", "--json")
    assert [(c["state"], c["part"]["index"]) for c in _checkpoints(doc, "hooked")] == [("complete", 1)] * 2

    fresh = hot / "hooked" / "step-300"
    shutil.copytree(hot / "hooked" / "step-200", fresh, copy_function=shutil.copyfile)  # written just now
    cli(config, "scan", "--json")
    (c300,) = [c for c in _checkpoints(cli(config, "ls", "--json"), "hooked") if c["step"] == 300]
    assert c300["state"] == "writing" and c300["part"]["known"]
