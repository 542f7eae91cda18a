"""A checkpoint spanning nodes is one version in a shared slower tier.

The real 2-node torch DCP job of ``test_node_parts`` (4 gloo processes, 2 per simulated node, the
hook on every rank): each node gets its own config, hot dir, index and ``node``, all sharing one
moto bucket as a ``shared = true`` cold tier. Real CLI subprocesses run each node's ``prune``:

* a node's hot part stays until the whole version is complete in cold (the other node's part is
  verified there too), with the reason in ``prune --dry-run``; a node killed (SIGKILL) mid-upload
  leaves the other node's hot part in place until its next prune completes the version;
* ``ls`` shows ``parts k/N``; a third node restores the version whole (``dcp.load`` reads it back
  into a fresh state with identical tensors) or one part (``--part``);
* expiring a step removes every part and every part record, and keeps the newer version whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import fleet_node, part_node, run_cli
from test_node_parts import JOB, NODES, RANKS_PER_NODE, STEPS, job  # noqa: F401  (job: the fixture)

from ckptkeeper.core.versions import job_token

torch = pytest.importorskip("torch")

RUN = "hooked"


def _node(
    job_dir: Path, base: Path, k: int, bucket: str, endpoint: str, *, cold_keep_last: int = 2
) -> tuple[Path, Path]:
    """Node ``k`` of the job: its ``hooked`` run back-dated 3 h in its hot dir, and its config."""
    return part_node(
        base, k, job_dir / f"node{k}" / "hot" / RUN, bucket, endpoint, cold_keep_last=cold_keep_last
    )


def ck(config: Path, *args: str, code: int = 0, env: dict[str, str] | None = None) -> Any:
    """The real CLI in a subprocess; parsed JSON with ``--json``."""
    if env:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
            capture_output=True,
            text=True,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}, **env},
            timeout=180,
        )
    else:
        proc = run_cli(config, *args)
    assert proc.returncode == code, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else proc.stdout


def keys(s3: Any, bucket: str) -> list[str]:
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def part_files(s3: Any, bucket: str, step: int) -> list[str]:
    """Every stored object of ``step``'s parts, both nodes: the shards and their manifests."""
    return [k for k in keys(s3, bucket) if f"/{RUN}/step-{step}" in k and "/.ckptkeeper/" not in k]


def records(s3: Any, bucket: str, step: int) -> list[str]:
    base = f"ckpt/.ckptkeeper/versions/{job_token(JOB)}/{RUN}/{step}/"
    return [k[len(base) :] for k in keys(s3, bucket) if k.startswith(base)]


def held_reasons(config: Path, step: int) -> list[str]:
    plan = ck(config, "prune", "--dry-run", "--json")
    assert not [
        a for a in plan["actions"] if a["action"] == "delete" and a["step"] == step and a["tier"] == "hot"
    ]
    return [r for k in plan["keep"] if k["step"] == step and k["tier"] == "hot" for r in k["reasons"]]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load(no_dist=True), on purpose
def test_a_version_spanning_nodes_goes_to_cold_whole(
    job: Path,  # noqa: F811
    tmp_path: Path,
    s3_reset: str,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    hot0, n0 = _node(job, tmp_path, 0, s3_bucket, s3_reset)
    hot1, n1 = _node(job, tmp_path, 1, s3_bucket, s3_reset)

    # Node 0 alone: its parts are copied and recorded; its hot part of step 100 (hot keeps 1) stays,
    # because node 1's part is not in cold yet.
    ck(n0, "prune", "--json")
    assert records(s3_client, s3_bucket, 100) == ["part-0.json"]
    assert (hot0 / RUN / "step-100" / ".metadata").is_file()
    assert held_reasons(n0, 100) == ["part 0 of 2: version incomplete in cold (1/2 parts)"]
    doc = ck(n0, "ls", "--json")
    (c100,) = [c for c in doc["runs"][0]["checkpoints"] if c["step"] == 100]
    assert c100["versions"]["cold"]["parts"] == "1/2" and c100["versions"]["cold"]["complete"] is False
    assert "cold(parts 1/2)" in ck(n0, "ls", RUN)

    # A third node cannot restore the version whole yet, and says why.
    n2 = _third_node(tmp_path, s3_bucket, s3_reset)
    proc = run_cli(n2, "restore", RUN, "--step", "100", "--to", str(tmp_path / "early"))
    assert proc.returncode == 1 and "step 100 in cold: 1/2 parts verified (missing part 1)" in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "early" / "step-100").exists()

    # Node 1 is killed (SIGKILL) mid-upload of its first part: nothing of it is recorded, and
    # node 0's hot part is still held, with the reason.
    ck(n1, "prune", code=-9, env={"CKPTKEEPER_TEST_CRASH_AFTER": "2"})
    assert records(s3_client, s3_bucket, 100) == ["part-0.json"]
    ck(n0, "prune", "--json")
    assert (hot0 / RUN / "step-100" / ".metadata").is_file()
    assert held_reasons(n0, 100) == ["part 0 of 2: version incomplete in cold (1/2 parts)"]

    # Node 1's next prune completes both versions; then each node may let its hot part of step 100 go.
    ck(n1, "prune", "--json")
    for step in STEPS:
        assert records(s3_client, s3_bucket, step) == ["part-0.json", "part-1.json"]
    assert (hot1 / RUN / "step-100").is_dir()  # planned before its own record existed: held this pass
    ck(n0, "prune", "--json")
    ck(n1, "prune", "--json")
    assert not (hot0 / RUN / "step-100").exists() and not (hot1 / RUN / "step-100").exists()
    assert (hot0 / RUN / "step-200").is_dir() and (hot1 / RUN / "step-200").is_dir()
    for config in (n0, n1):
        doc = ck(config, "ls", "--json")
        assert {c["step"]: c["versions"]["cold"]["parts"] for c in doc["runs"][0]["checkpoints"]} == {
            100: "2/2",
            200: "2/2",
        }
    assert part_files(s3_client, s3_bucket, 100) == sorted(
        [
            *(f"ckpt/node0/{RUN}/step-100/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp")),
            f"ckpt/node0/{RUN}/step-100.ckptkeeper-manifest.json",
            *(f"ckpt/node1/{RUN}/step-100/{f}" for f in ("__2_0.distcp", "__3_0.distcp")),
            f"ckpt/node1/{RUN}/step-100.ckptkeeper-manifest.json",
        ]
    )

    # A third node (not in the job) restores step 200 whole: byte-identical to what each node
    # saved, and torch's own dcp.load reads it into a fresh state.
    restored = ck(n2, "restore", RUN, "--step", "200", "--to", str(tmp_path / "third"), "--json")
    whole = tmp_path / "third" / "step-200"
    assert restored["path"] == str(whole) and restored["count"] == 2
    assert [(p["part"], p["node"]) for p in restored["parts"]] == [(0, "node0"), (1, "node1")]
    expected = {}
    for k in range(NODES):
        for f in (job / f"node{k}" / "hot" / RUN / "step-200").iterdir():
            expected[f.name] = f.read_bytes()
    assert {f.name: f.read_bytes() for f in whole.iterdir()} == expected
    import torch.distributed.checkpoint as dcp

    state = {f"r{rank}": torch.zeros(8) for rank in range(NODES * RANKS_PER_NODE)}
    state["b"] = torch.zeros(4)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(whole)), no_dist=True)
    assert {k: v.tolist() for k, v in state.items()} == {
        **{f"r{k}": [float(k)] * 8 for k in range(4)},
        "b": [0.0, 1.0, 2.0, 3.0],
    }
    # --part 1: node 1's shards only (what a replaced node 1 resumes from).
    one = ck(n2, "restore", RUN, "--step", "200", "--to", str(tmp_path / "p1"), "--part", "1", "--json")
    assert sorted(p.name for p in (tmp_path / "p1" / "step-200").iterdir()) == [
        "__2_0.distcp",
        "__3_0.distcp",
    ]
    assert [p["part"] for p in one["parts"]] == [1]
    # The Python API takes the same part= (and gathers every part without it).
    import ckptkeeper

    p0 = ckptkeeper.restore(RUN, 200, to=tmp_path / "api0", config=n2, part=0)
    assert sorted(p.name for p in p0.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(
        p.name for p in ckptkeeper.restore(RUN, 200, to=tmp_path / "api", config=n2).iterdir()
    ) == sorted(expected)
    # Node 0, whose own hot part of step 100 is gone, gets the whole version back too.
    ck(n0, "restore", RUN, "--step", "100", "--to", str(tmp_path / "n0"))
    assert sorted(p.name for p in (tmp_path / "n0" / "step-100").iterdir()) == sorted(expected)

    # Expiry: cold now keeps 1. Each node expires its own part of step 100; every object and every
    # part record of step 100 is gone from the store, and step 200 stays whole.
    assert len(part_files(s3_client, s3_bucket, 100)) == 7
    for k in range(NODES):
        _node(job, tmp_path, k, s3_bucket, s3_reset, cold_keep_last=1)
    ck(n0, "prune", "--json")
    assert [k for k in part_files(s3_client, s3_bucket, 100) if "/node0/" in k] == []
    assert len(part_files(s3_client, s3_bucket, 100)) == 3 and records(s3_client, s3_bucket, 100) == [
        "part-1.json"
    ]
    ck(n1, "prune", "--json")
    assert part_files(s3_client, s3_bucket, 100) == [] and records(s3_client, s3_bucket, 100) == []
    assert records(s3_client, s3_bucket, 200) == ["part-0.json", "part-1.json"]
    assert len(part_files(s3_client, s3_bucket, 200)) == 7
    for config in (n0, n1):
        doc = ck(config, "ls", "--json")
        assert {c["step"]: c["versions"]["cold"]["parts"] for c in doc["runs"][0]["checkpoints"]} == {
            200: "2/2"
        }


def _third_node(base: Path, bucket: str, endpoint: str) -> Path:
    """A node outside the job: its own empty hot dir and index, the same shared cold tier."""
    return fleet_node(base, "node2", bucket, endpoint, cold_keep_last=2)


def test_an_expired_step_waits_for_the_newer_version_to_be_complete(
    job: Path,  # noqa: F811
    tmp_path: Path,
    s3_reset: str,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    """Retention counts complete versions only: with cold keeping 1, step 100 expires, but no node
    lets its part of step 100 go while step 200 is not complete in cold; then both do."""
    hot0, n0 = _node(job, tmp_path, 0, s3_bucket, s3_reset, cold_keep_last=1)
    hot1, n1 = _node(job, tmp_path, 1, s3_bucket, s3_reset, cold_keep_last=1)
    ck(n0, "prune", "--json")
    assert (hot0 / RUN / "step-100").is_dir() and part_files(s3_client, s3_bucket, 100) == []
    assert held_reasons(n0, 100) == [
        "part 0 of 2: expiry waits: newer version step 200 incomplete in cold (1/2 parts)"
    ]
    ck(n1, "prune", "--json")
    assert (hot1 / RUN / "step-100").is_dir()  # planned while its own part of 200 was not there yet
    ck(n0, "prune", "--json")
    ck(n1, "prune", "--json")
    assert not (hot0 / RUN / "step-100").exists() and not (hot1 / RUN / "step-100").exists()
    assert records(s3_client, s3_bucket, 200) == ["part-0.json", "part-1.json"]
    assert part_files(s3_client, s3_bucket, 100) == [] and records(s3_client, s3_bucket, 100) == []


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (
            lambda rec: {**rec, "node": "node1", "part": 1, "manifest": f"node1/{RUN}/step-100"},
            f"no readable manifest at node1/{RUN}/step-100",
        ),
        (  # node 0 naming a key under node 1's prefix
            lambda rec: {**rec, "part": 1, "manifest": f"node1/{RUN}/step-100"},
            f"bad record: manifest: 'node1/{RUN}/step-100' is not under node0/{RUN}/",
        ),
        (lambda rec: b"\x00{ not json", "bad record: malformed part record"),
        (  # node 0's own part-0 manifest, claimed as part 1: retention and restore refuse it alike
            lambda rec: {**rec, "part": 1},
            f"manifest at node0/{RUN}/step-100 is part 0 of 2, not part 1 of 2",
        ),
    ],
    ids=["missing-manifest", "not-under-its-node", "garbage", "another-parts-manifest"],
)
def test_a_forged_part_record_never_completes_a_version(
    job: Path,  # noqa: F811
    tmp_path: Path,
    s3_reset: str,
    s3_client: Any,
    s3_bucket: str,
    body: Any,
    problem: str,
) -> None:
    """A record another node (or a bug, or an attacker) put in the bucket is untrusted: one that
    does not parse, or points at no verified copy, is ignored with its reason; node 0's hot part
    stays held and nothing crashes."""
    hot0, n0 = _node(job, tmp_path, 0, s3_bucket, s3_reset)
    ck(n0, "prune", "--json")
    base = f"ckpt/.ckptkeeper/versions/{job_token(JOB)}/{RUN}/100/"
    mine = json.loads(s3_client.get_object(Bucket=s3_bucket, Key=base + "part-0.json")["Body"].read())
    forged = body(mine)
    data = forged if isinstance(forged, bytes) else json.dumps(forged).encode()
    s3_client.put_object(Bucket=s3_bucket, Key=base + "part-1.json", Body=data)
    plan = ck(n0, "prune", "--dry-run", "--json")
    assert [r for k in plan["keep"] if k["step"] == 100 and k["tier"] == "hot" for r in k["reasons"]] == [
        "part 0 of 2: version incomplete in cold (1/2 parts)"
    ]
    assert any(
        n.startswith("cold: hooked@100: part record ignored: ") and problem in n for n in plan["notes"]
    )
    doc = ck(n0, "ls", "--json")
    (c100,) = [c for c in doc["runs"][0]["checkpoints"] if c["step"] == 100]
    assert c100["versions"]["cold"]["parts"] == "1/2" and problem in c100["versions"]["cold"]["problems"][0]
    assert "part record ignored" in ck(n0, "ls", RUN)
    ck(n0, "prune", "--json")
    assert (hot0 / RUN / "step-100" / ".metadata").is_file()
    assert records(s3_client, s3_bucket, 100) == ["part-0.json", "part-1.json"]  # not ours: left alone
