"""A DeepSpeed ZeRO checkpoint spanning 2 nodes is one version in a shared cold tier.

The committed fixture ``tests/fixtures/deepspeed_nodes`` is what the real engine wrote
(``generate.py`` beside it: ``deepspeed.initialize`` with ZeRO stage 1 on 2 gloo CPU ranks, one per
simulated node, each saving into its own node's hot dir, the hook on every rank). Node 0 holds
``mp_rank_00_model_states.pt`` and ZeRO shard 0 (and ``latest``), node 1 only
``zero_pp_rank_1_mp_rank_00_optim_states.pt``. Two node configs and a third, one moto bucket as a
``shared = true`` cold tier, the real CLI in subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, part_node, run_cli, write_config
from test_node_versions import _third_node, ck, keys

from ckptkeeper.core.versions import job_token

torch = pytest.importorskip("torch")

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed_nodes"
META = json.loads((FIXTURE / "FIXTURE.json").read_text())
RUN, JOB = META["run"], META["job"]
NODE_FILES = {
    0: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
    1: ["zero_pp_rank_1_mp_rank_00_optim_states.pt"],
}


def _node(base: Path, k: int, bucket: str, endpoint: str, *, cold_keep_last: int = 2) -> tuple[Path, Path]:
    """Node ``k``: the fixture's share of node ``k`` back-dated 3 h in its hot dir, and its config."""
    return part_node(base, k, FIXTURE / f"node{k}" / RUN, bucket, endpoint, cold_keep_last=cold_keep_last)


def _records(s3: Any, bucket: str, step: int) -> list[str]:
    base = f"ckpt/.ckptkeeper/versions/{job_token(JOB)}/{RUN}/{step}/"
    return [k[len(base) :] for k in keys(s3, bucket) if k.startswith(base)]


def _stored(s3: Any, bucket: str, step: int) -> list[str]:
    return [k for k in keys(s3, bucket) if f"/{RUN}/global_step{step}" in k and "/.ckptkeeper/" not in k]


class _Stub:
    """Stands for a DeepSpeed class (``LossScaler``, ``ZeroStageEnum``) when deepspeed is not
    installed: the ZeRO files pickle a few, and the tensors are what this test reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            return _Stub
        return super().find_class(module, name)


class _PickleModule:
    """``torch.load(pickle_module=...)``: torch's unpickler subclasses ours."""

    Unpickler = _Unpickler
    load = pickle.load
    __name__ = "ckptkeeper_test_pickle"


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False, pickle_module=_PickleModule)


def test_a_deepspeed_zero_version_spanning_two_nodes(
    tmp_path: Path, s3_reset: str, s3_client: Any, s3_bucket: str
) -> None:
    hot0, n0 = _node(tmp_path, 0, s3_bucket, s3_reset)
    hot1, n1 = _node(tmp_path, 1, s3_bucket, s3_reset)

    # Each node's share is recognised as part k of 2 of the job, complete, and never reaped.
    for k, config in ((0, n0), (1, n1)):
        assert ck(config, "scan", "--json")["parts"] == 2
        doc = ck(config, "ls", "--json")
        (run,) = doc["runs"]
        assert [
            (c["step"], c["state"], c["part"]["index"], c["part"]["count"], c["part"]["job"])
            for c in run["checkpoints"]
        ] == [
            (1, "complete", k, 2, JOB),
            (2, "complete", k, 2, JOB),
        ]
        plan = ck(config, "prune", "--dry-run", "--json")
        assert not [a for a in plan["actions"] if a["action"] == "reap"], plan["actions"]
    # Node 1's share without the hook (its .ckptkeeper/ gone): kept, never reaped, with the reason.
    bare = tmp_path / "bare"
    shutil.copytree(hot1 / RUN, bare / RUN, ignore=shutil.ignore_patterns(".ckptkeeper"))
    then = time.time() - 3 * 3600
    for p in bare.rglob("*"):
        os.utime(p, (then, then))
    nb = write_config(
        tmp_path / "bare.toml",
        index=tmp_path / "bare.db",
        node="node1",
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
        tiers=[local_tier("hot", bare, keep_last=1)],
        reaper={"partial_after": "10m", "failed_after": "1h", "keep_last_of_failed": 1},
    )
    ck(nb, "scan", "--json")
    plan = ck(nb, "prune", "--dry-run", "--json")
    assert plan["actions"] == []
    reasons = [r for k in plan["keep"] for r in k["reasons"] if "node-local part" in r]
    assert len(reasons) == 2 and "zero" in reasons[0].lower(), plan["keep"]

    # Both nodes prune (twice: a part's record is written at the end of the pass that copied it,
    # and a hot part goes only once its version is complete in cold).
    ck(n0, "prune", "--json")
    assert (hot0 / RUN / "global_step1").is_dir()  # node 1's part not in cold yet: held
    ck(n1, "prune", "--json")
    ck(n0, "prune", "--json")
    ck(n1, "prune", "--json")
    for step in META["steps"]:
        assert _records(s3_client, s3_bucket, step) == ["part-0.json", "part-1.json"]
    assert not (hot0 / RUN / "global_step1").exists() and not (hot1 / RUN / "global_step1").exists()
    assert (hot0 / RUN / "global_step2").is_dir() and (hot1 / RUN / "global_step2").is_dir()
    for config in (n0, n1):
        doc = ck(config, "ls", "--json")
        assert {c["step"]: c["versions"]["cold"]["parts"] for c in doc["runs"][0]["checkpoints"]} == {
            1: "2/2",
            2: "2/2",
        }
    assert _stored(s3_client, s3_bucket, 2) == sorted(
        [
            *(f"ckpt/node{k}/{RUN}/global_step2/{f}" for k in (0, 1) for f in NODE_FILES[k]),
            *(f"ckpt/node{k}/{RUN}/global_step2.ckptkeeper-manifest.json" for k in (0, 1)),
        ]
    )

    # A third node restores step 2 whole: the union of both nodes' files, byte-identical.
    n2 = _third_node(tmp_path, s3_bucket, s3_reset)
    for step in META["steps"]:
        out = ck(n2, "restore", RUN, "--step", str(step), "--to", str(tmp_path / "third"), "--json")
        whole = tmp_path / "third" / f"global_step{step}"
        assert out["path"] == str(whole) and out["count"] == 2
        assert [(p["part"], p["node"]) for p in out["parts"]] == [(0, "node0"), (1, "node1")]
        expected = {
            f: (FIXTURE / f"node{k}" / RUN / f"global_step{step}" / f).read_bytes()
            for k in (0, 1)
            for f in NODE_FILES[k]
        }
        assert {p.name: p.read_bytes() for p in whole.iterdir()} == expected

    # The gathered ZeRO files load: the two fp32 partitions, one per node, are the trained model.
    whole = tmp_path / "third" / "global_step2"
    params = {k: torch.tensor(v) for k, v in META["params"].items()}
    model = _load(whole / "mp_rank_00_model_states.pt")
    assert model["dp_world_size"] == 2
    assert all(torch.equal(model["module"][k], params[k]) for k in params)
    parts = [_load(whole / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)]
    flat = torch.cat([p["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] for p in parts])
    want = torch.cat([params[k].flatten() for k in model["module"]])
    assert torch.equal(flat[: want.numel()], want)
    if importlib.util.find_spec("deepspeed") is not None:  # the framework's own merge, where it runs
        import tqdm
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tqdm.tqdm.monitor_interval = 0  # its progress bar would leave a monitor thread running

        merged = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "third"), tag="global_step2")
        assert sorted(merged) == sorted(params) and all(torch.equal(merged[k], params[k]) for k in params)

    # --part 1: node 1's ZeRO shard only (what a replaced node 1 resumes from).
    proc = run_cli(n2, "restore", RUN, "--step", "2", "--to", str(tmp_path / "p1"), "--part", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "p1" / "global_step2").iterdir()) == NODE_FILES[1]


def _both_versions_in_cold(base: Path, bucket: str, endpoint: str, s3: Any) -> tuple[Path, Path]:
    n0, n1 = _node(base, 0, bucket, endpoint)[1], _node(base, 1, bucket, endpoint)[1]
    for config in (n0, n1, n0, n1):
        ck(config, "prune", "--json")
    for step in META["steps"]:
        assert _records(s3, bucket, step) == ["part-0.json", "part-1.json"]
    return n0, n1


def _deletes(plan: Any, step: int) -> list[tuple[str, str]]:
    return [
        (a["action"], a["tier"]) for a in plan["actions"] if a["step"] == step and a["action"] == "delete"
    ]


def test_a_pin_on_one_node_holds_every_part_of_the_version(
    tmp_path: Path, s3_reset: str, s3_client: Any, s3_bucket: str
) -> None:
    """``pin`` on node 0 writes a version pin beside the part records; node 1 keeps its part of
    that step through an expiry that would otherwise remove it, saying who pinned it. After
    ``unpin`` on node 0, each node expires its own part, each exactly once."""
    n0, n1 = _both_versions_in_cold(tmp_path, s3_bucket, s3_reset, s3_client)
    before = _stored(s3_client, s3_bucket, 1)
    assert len(before) == 5
    out = ck(n0, "pin", RUN, "1", "--json")
    assert out["pinned"] is True and out["failed"] == {}
    base = f"ckpt/.ckptkeeper/versions/{job_token(JOB)}/{RUN}/1/"
    assert [k for k in keys(s3_client, s3_bucket) if k.startswith(base)] == [
        base + "part-0.json",
        base + "part-1.json",
        base + "pin-node0.json",
    ]
    # Cold now keeps 1: step 1 would expire from cold on both nodes.
    for k in (0, 1):
        _node(tmp_path, k, s3_bucket, s3_reset, cold_keep_last=1)
    plan = ck(n1, "prune", "--dry-run", "--json")
    assert _deletes(plan, 1) == []
    assert [k["reasons"] for k in plan["keep"] if k["step"] == 1 and k["tier"] == "cold"] == [
        ["pinned on node0 (version pin)"]
    ]
    ck(n1, "prune", "--json")
    ck(n0, "prune", "--json")
    # Both parts and manifests still there (and node 0's own pin object beside its manifest).
    assert [k for k in _stored(s3_client, s3_bucket, 1) if not k.endswith(".ckptkeeper-pin.json")] == before
    assert _records(s3_client, s3_bucket, 1) == ["part-0.json", "part-1.json", "pin-node0.json"]
    # Without the version pin (the same pass, node 1 and a fresh config) it would have gone:
    s3_client.delete_object(Bucket=s3_bucket, Key=base + "pin-node0.json")
    assert _deletes(ck(n1, "prune", "--dry-run", "--json"), 1) == [("delete", "cold")]
    s3_client.put_object(Bucket=s3_bucket, Key=base + "pin-node0.json", Body=b"\x00 garbage")
    assert _deletes(ck(n1, "prune", "--dry-run", "--json"), 1) == []  # the key is the pin

    # unpin on node 0: the version pin is gone, and each node expires its own part exactly once.
    out = ck(n0, "unpin", RUN, "1", "--json")
    assert out["pinned"] is False and out["failed"] == {}
    assert [k for k in keys(s3_client, s3_bucket) if k.startswith(base)] == [
        base + "part-0.json",
        base + "part-1.json",
    ]
    done = []
    for config in (n0, n1, n0, n1):
        plan = ck(config, "prune", "--json")
        done += [(config.parent.name, *d) for d in _deletes(plan, 1)]
    assert sorted(done) == [("node0", "delete", "cold"), ("node1", "delete", "cold")]
    assert _stored(s3_client, s3_bucket, 1) == [] and _records(s3_client, s3_bucket, 1) == []
    assert len(_stored(s3_client, s3_bucket, 2)) == 5
