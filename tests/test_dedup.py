"""Dedup in a slower tier (docs/dedup.md), through the real CLI on a local warm tier, on moto S3
and on SeaweedFS.

A run saves the same weights again after a restart (identical model and optimizer files, a new
step): the dedup tier stores those bytes once, both checkpoints restore byte-identical, deleting
one keeps the other whole, and once nothing references the content this node's prune pass
collects it (after the grace period, judged by an injected store clock: no sleeps).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.storage import content, content_gc
from ckptkeeper.util.fmt import human_bytes

MODEL = 256 * 1024
OPTIM = 128 * 1024


def safetensors(payload: bytes) -> bytes:
    """A valid safetensors file of one F32 tensor holding ``payload``."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
    )
    return struct.pack("<Q", len(header)) + header.encode() + payload


def write_checkpoint(run_dir: Path, step: int, when: float, *, weights: bytes, optim: bytes) -> None:
    """An HF-style checkpoint: the big files given, a small trainer state naming the step."""
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(safetensors(weights))
    (ckpt / "optimizer.pt").write_bytes(optim)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Node:
    """hot (keep_last=1) -> warm (dedup); warm is a local directory or an S3 prefix on moto."""

    def __init__(
        self, tmp: Path, kind: str, s3: tuple[str, str] | None, *, prefix: str = "ckpt", **warm: Any
    ) -> None:
        self.tmp = tmp
        self.prefix = prefix
        self.kind = kind
        self.s3 = s3
        self.hot = tmp / "hot"
        self.hot.mkdir()
        self.warm_dir = tmp / "warm"
        self.warm_dir.mkdir()
        self.config = tmp / "config.toml"
        self.run_dir = self.hot / "run"
        self.originals = tmp / "originals"
        self.t0 = time.time() - 7200
        self.configure(**warm)

    def configure(
        self, hot: dict[str, Any] | None = None, reaper: dict[str, Any] | None = None, **warm: Any
    ) -> None:
        policy = {"keep_last": 10, "dedup": True, "dedup_grace": "1h", **warm}
        if self.kind == "s3":
            assert self.s3 is not None
            bucket, endpoint = self.s3
            warm_tier = s3_tier("warm", bucket, endpoint, prefix=self.prefix, **policy)
        else:
            warm_tier = local_tier("warm", self.warm_dir, **policy)
        write_config(
            self.config,
            index=self.tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            reaper=reaper,
            tiers=[local_tier("hot", self.hot, **(hot or {"keep_last": 1})), warm_tier],
        )

    def save(self, step: int, *, weights: bytes, optim: bytes) -> None:
        write_checkpoint(self.run_dir, step, self.t0 + step, weights=weights, optim=optim)
        shutil.copytree(self.run_dir / f"checkpoint-{step}", self.originals / f"checkpoint-{step}")

    def cli(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        result = CliRunner().invoke(
            main, ["--config", str(self.config), *args], catch_exceptions=False, env=env
        )
        return result.exit_code, result.stdout if "--json" in args else result.output

    def prune(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        code, out = self.cli("prune", "--json", env=env)
        assert code == 0, out
        doc: dict[str, Any] = json.loads(out)
        return doc

    def restore(self, step: int) -> dict[str, str]:
        dest = self.tmp / f"restored-{step}-{time.monotonic_ns()}"
        code, out = self.cli("restore", "run", "--step", str(step), "--to", str(dest))
        assert code == 0, out
        return tree(dest / f"checkpoint-{step}")

    def original(self, step: int) -> dict[str, str]:
        return tree(self.originals / f"checkpoint-{step}")


def seaweedfs_bucket(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(bucket, endpoint) of a fresh bucket on the SeaweedFS S3 gateway (tests/conftest.py)."""
    import uuid

    import boto3

    endpoint = request.getfixturevalue("seaweedfs")
    bucket = f"dedup-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    return bucket, endpoint


@pytest.fixture(params=["local", "s3", "seaweedfs"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Node:
    """The warm dedup tier: a local directory, a prefix on moto, or one on SeaweedFS."""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_reset")
        bucket = request.getfixturevalue("s3_bucket")
        return Node(tmp_path, "s3", (bucket, endpoint))
    if request.param == "seaweedfs":
        return Node(tmp_path, "s3", seaweedfs_bucket(request))
    return Node(tmp_path, "local", None)


def stored(node: Node) -> dict[str, int]:
    """Everything the warm tier stores: relative path -> size."""
    if node.kind == "local":
        return {
            str(p.relative_to(node.warm_dir)): p.stat().st_size
            for p in node.warm_dir.rglob("*")
            if p.is_file() and "clock" not in p.name
        }
    import boto3

    assert node.s3 is not None
    bucket, endpoint = node.s3
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    out = {}
    prefix = node.prefix + "/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) :]] = int(o["Size"])
    return out


def content_objects(node: Node) -> dict[str, int]:
    return {k: v for k, v in stored(node).items() if k.startswith(content.CONTENT_DIR + "/")}


def test_resave_is_stored_once_and_restores(node: Node) -> None:
    weights, optim = os.urandom(MODEL), os.urandom(OPTIM)
    node.save(100, weights=weights, optim=optim)
    node.save(200, weights=weights, optim=optim)  # the same weights saved again after a restart
    node.save(300, weights=os.urandom(MODEL), optim=os.urandom(OPTIM))
    doc = node.prune()
    objs = content_objects(node)
    # 100 and 200 went to warm (300 stays hot): their big files once, their two trainer states
    big = sorted(s for s in objs.values() if s >= OPTIM)
    assert big == [OPTIM, len(safetensors(weights))]
    assert len(objs) == 4
    rest = {k: v for k, v in stored(node).items() if k not in objs}
    assert all(k.endswith(".ckptkeeper-manifest.json") for k in rest), rest
    dedup = doc["dedup"]["tiers"]["warm"]
    assert dedup["deduped_bytes"] == len(safetensors(weights)) + OPTIM
    assert dedup["uploaded_bytes"] >= MODEL + OPTIM
    for step in (100, 200):
        assert node.restore(step) == node.original(step)
    code, out = node.cli("status", "--json")
    assert code == 0, out
    warm = next(t for t in json.loads(out)["tiers"] if t["name"] == "warm")
    assert warm["dedup"]["stored_bytes"] == sum(objs.values())
    assert warm["dedup"]["referenced_bytes"] == warm["bytes"] >= 2 * (len(safetensors(weights)) + OPTIM)
    code, out = node.cli("status")
    assert f"dedup warm: {human_bytes(sum(objs.values()))} stored for" in out


AHEAD = {content_gc.CLOCK_ENV: str(3 * 3600)}
"""The store's clock 3 h ahead: content written now is past the 1 h grace period."""


def saved_twice(node: Node) -> tuple[bytes, bytes]:
    """100 and 200 share their big files (a re-save); 300 (different) stays hot. One prune."""
    weights, optim = os.urandom(MODEL), os.urandom(OPTIM)
    node.save(100, weights=weights, optim=optim)
    node.save(200, weights=weights, optim=optim)
    node.save(300, weights=os.urandom(MODEL), optim=os.urandom(OPTIM))
    node.prune()
    assert len(content_objects(node)) == 4
    return weights, optim


def test_delete_of_one_keeps_the_other_and_collection_waits_for_the_last(node: Node) -> None:
    weights, _ = saved_twice(node)
    big = len(safetensors(weights))
    node.configure(keep_last=2)  # 300 (hot) and 200 stay; 100 expires from warm
    doc = node.prune()
    assert not any(k.startswith("run/checkpoint-100") for k in stored(node))
    # its trainer state is unreferenced now, but younger than the grace period: kept this pass
    assert doc["dedup"]["tiers"]["warm"]["collected"]["young"] == 1
    assert len(content_objects(node)) == 4
    assert node.restore(200) == node.original(200)
    doc = node.prune(env=AHEAD)
    collected = doc["dedup"]["tiers"]["warm"]["collected"]
    assert (collected["removed"], collected["referenced"]) == (1, 3)
    assert sorted(content_objects(node).values())[-2:] == [OPTIM, big]
    assert node.restore(200) == node.original(200)
    node.configure(keep_last=1)  # 200 expires too: nothing references the content any more
    node.prune(env=AHEAD)
    assert content_objects(node) == {}
    assert all(not k.startswith("run/") for k in stored(node))


CLOCKSHIFT = Path(__file__).parent / "clockshift"


def prune_skewed(node: Node, offset: float) -> tuple[int, dict[str, Any] | None]:
    """``prune --json`` in a process whose wall clock runs ``offset`` seconds off
    (tests/clockshift; file mtimes and the S3 server's clock stay real): its exit code and
    document."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    root = str(Path(__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join([str(CLOCKSHIFT), root, env.get("PYTHONPATH", "")])
    env["CKPT_TEST_CLOCK_OFFSET"] = repr(offset)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None


def test_a_node_whose_clock_runs_ahead_collects_nothing_young_by_the_stores_clock(
    node: Node, request: pytest.FixtureRequest
) -> None:
    """Content unreferenced a moment ago is older than ``dedup_grace`` (5 min) by the node's
    clock, 10 minutes or 3 days ahead, but young by the store's: it stays until the store's clock
    says otherwise. (A store that checks request signatures, SeaweedFS as S3, refuses a node
    3 days ahead outright: nothing collected, nothing deleted.)"""
    saved_twice(node)
    # 100 expires: its trainer state is referenced by nothing now. (The run is not reaped as
    # stale: this harness shifts the node's clock, not the kernel's mtimes of its own files.)
    node.configure(keep_last=2, dedup_grace="5m", reaper={"failed_after": "30d"})
    signed = request.node.callspec.params["node"] == "seaweedfs"  # moto ignores request times
    for offset in (600.0, 3 * 86400.0):
        code, doc = prune_skewed(node, offset)
        if signed and offset > 900:  # requests signed that far off are refused, as S3 does
            assert doc is None or doc["dedup"]["tiers"]["warm"]["collected"] is None, (code, doc)
            assert len(content_objects(node)) == 4
            continue
        assert code == 0 and doc is not None, (offset, code)
        collected = doc["dedup"]["tiers"]["warm"]["collected"]
        assert (collected["removed"], collected["young"]) == (0, 1), (offset, collected)
        assert len(content_objects(node)) == 4
    assert node.restore(200) == node.original(200)
    doc = node.prune(env=AHEAD)  # the store's clock past the grace period: collected
    assert doc["dedup"]["tiers"]["warm"]["collected"]["removed"] == 1
    assert set(content_objects(node)) == referenced(node)


def test_undelete_of_a_deduped_checkpoint_whose_content_is_shared(node: Node) -> None:
    saved_twice(node)
    node.configure(keep_last=2, undo_window="1d")
    node.prune(env=AHEAD)  # 100 into the trash; its content stays referenced by the trash entry
    assert len(content_objects(node)) == 4
    code, out = node.cli("undelete", "run", "100")
    assert code == 0, out
    assert node.restore(100) == node.original(100)
    assert node.restore(200) == node.original(200)


def test_forged_manifest_naming_another_node_is_refused(node: Node) -> None:
    saved_twice(node)
    key = "run/checkpoint-200.ckptkeeper-manifest.json"
    if node.kind == "local":
        path = node.warm_dir / key
        doc = json.loads(path.read_text())
        doc["node"] = "other-node"
        path.write_text(json.dumps(doc))
    else:
        import boto3

        assert node.s3 is not None
        client = boto3.client(
            "s3",
            endpoint_url=node.s3[1],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        doc = json.loads(client.get_object(Bucket=node.s3[0], Key=f"ckpt/{key}")["Body"].read())
        doc["node"] = "other-node"
        client.put_object(Bucket=node.s3[0], Key=f"ckpt/{key}", Body=json.dumps(doc).encode())
    dest = node.tmp / "forged"
    code, out = node.cli("restore", "run", "--step", "200", "--to", str(dest))
    assert code != 0
    assert "other-node's content store" in out
    assert not (dest / "checkpoint-200").exists()


@pytest.mark.parametrize(
    "entry",
    [
        {"location": "content", "hash": "../../../../etc/passwd"},
        {"location": "content", "hash": "0" * 31 + "/"},
        {"location": "../other/content"},
        {"location": "content", "hash": "AB" * 16},
        {"location": "content", "parts": [[1, "../" + "0" * 29]]},
        {"location": "content", "parts": [[2, "0" * 32]]},  # pieces longer than the file
        {"parts": [[1, "0" * 32]]},  # pieces of a file that is not in the content store
        {"location": "content", "parts": [[1]]},
    ],
)
def test_manifest_location_is_validated(entry: dict[str, str]) -> None:
    from ckptkeeper.core.model import Manifest

    doc = {
        "version": 1,
        "run": "run",
        "step": 1,
        "name": "checkpoint-1",
        "layout": "hf",
        "is_dir": True,
        "files": [{"path": "a", "size": 1, "hash": "0" * 32, **entry}],
    }
    with pytest.raises(ValueError, match=r"files\[0\]"):
        Manifest.from_json(json.dumps(doc))


def test_old_manifests_read_as_before_and_the_digest_ignores_where_bytes_are() -> None:
    from ckptkeeper.core.model import FileEntry, Manifest

    plain = Manifest(
        run="r", step=1, name="c", layout="hf", is_dir=True, files=(FileEntry("a", 1, "0" * 32),)
    )
    assert "location" not in plain.to_json()
    moved = content.referencing(plain)
    assert moved.digest == plain.digest
    assert Manifest.from_json(moved.to_json()) == moved
    assert content.plain(moved) == plain


# -- kill -9 at every crash point --------------------------------------------------------------


def prune_killed_at(node: Node, k: int, env: dict[str, str] | None = None) -> int:
    """``prune`` in its own process, SIGKILLed at crash point ``k``; its exit code."""
    full = {**os.environ, **(env or {}), "CKPTKEEPER_TEST_CRASH_AFTER": str(k)}
    full["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), full.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune"],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode


def referenced(node: Node) -> set[str]:
    """Content objects the warm tier's manifests (committed and trashed) reference."""
    from ckptkeeper.config import load_settings
    from ckptkeeper.storage import TierStorage

    spec = load_settings(node.config).tier_specs()[1]
    return {content.name_rel(TierStorage(spec), h) for h in content_gc.live_refs(TierStorage(spec))}


def assert_whole_and_tidy(node: Node, steps: tuple[int, ...]) -> None:
    """Every kept checkpoint restores byte-identical; after a pass past the grace period the
    content store holds exactly what manifests reference; no staging name is left."""
    for step in steps:
        assert node.restore(step) == node.original(step)
    node.prune(env=AHEAD)
    assert set(content_objects(node)) == referenced(node)
    assert not [k for k in stored(node) if ".ckptkeeper-tmp-" in k]


def sweep(make: Any, kill: Any, steps: tuple[int, ...]) -> int:
    """Kill at crash point 1, 2, … of a fresh node each time until a run passes them all."""
    for k in range(1, 200):
        node = make(k)
        if kill(node, k) != -9:
            assert_whole_and_tidy(node, steps)
            return k
        # right after the kill: every checkpoint still restores byte-identical from somewhere
        for step in steps:
            assert node.restore(step) == node.original(step), (k, step)
        node.prune()  # the restart finishes or undoes what the kill interrupted
        assert_whole_and_tidy(node, steps)
    raise AssertionError("crash points never ran out")


@pytest.fixture(params=["local", "s3"])
def make_node(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    s3 = None
    if request.param == "s3":
        s3 = (request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_reset"))
    weights, optim = os.urandom(MODEL), os.urandom(OPTIM)
    fresh, other = os.urandom(MODEL), os.urandom(OPTIM)

    def make(k: int, **warm: Any) -> Node:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        node = Node(base, request.param, s3, prefix=f"trial-{k}")
        node.save(100, weights=weights, optim=optim)
        node.save(200, weights=weights, optim=optim)
        node.save(300, weights=fresh, optim=other)
        return node

    return make


def test_kill9_at_every_crash_point_of_a_deduped_copy(make_node: Any) -> None:
    points = sweep(make_node, prune_killed_at, (100, 200, 300))
    assert points > 6  # the sweep went through the copies' content writes and commits


def test_kill9_at_every_crash_point_of_a_delete_and_collection(make_node: Any) -> None:
    def make(k: int) -> Node:
        node: Node = make_node(k)
        node.prune()
        node.configure(keep_last=2)
        return node

    points = sweep(make, lambda node, k: prune_killed_at(node, k, AHEAD), (200, 300))
    assert points > 2


def test_verify_and_scrub_hash_the_referenced_content(node: Node) -> None:
    weights, _ = saved_twice(node)
    code, out = node.cli("verify", "run")
    assert code == 0, out
    corrupt(node, len(safetensors(weights)))
    code, out = node.cli("verify", "run")
    assert code == 1
    assert "checkpoint-100/model.safetensors: hash" in out and "checkpoint-200/model.safetensors: hash" in out
    code, out = node.cli("scrub", "--json")
    assert code == 1, out


def corrupt(node: Node, size: int) -> None:
    """One byte of the content object of that size changes in place (same size)."""
    (rel,) = [k for k, got in content_objects(node).items() if got == size]
    if node.kind == "local":
        path = node.warm_dir / rel
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        import boto3

        assert node.s3 is not None
        client = boto3.client(
            "s3",
            endpoint_url=node.s3[1],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        key = f"{node.prefix}/{rel}"
        data = bytearray(client.get_object(Bucket=node.s3[0], Key=key)["Body"].read())
        data[-1] ^= 0xFF
        client.put_object(Bucket=node.s3[0], Key=key, Body=bytes(data))


def test_a_scrubbed_bad_content_object_is_written_again_from_a_good_copy(node: Node) -> None:
    weights, optim = os.urandom(MODEL), os.urandom(OPTIM)
    node.configure(hot={"keep_last": 3}, replicate=True)  # every checkpoint also stays hot
    node.save(100, weights=weights, optim=optim)
    node.save(200, weights=weights, optim=optim)
    node.prune()
    corrupt(node, len(safetensors(weights)))
    code, out = node.cli("scrub", "--json")
    assert code == 1, out
    node.prune()  # the damaged copies are copied again: the bad object is rewritten, not referenced
    code, out = node.cli("verify", "run")
    assert code == 0, out
    assert len(content_objects(node)) == 4


def test_restore_with_a_bad_content_object_fails_and_leaves_nothing(node: Node) -> None:
    weights, _ = saved_twice(node)
    corrupt(node, len(safetensors(weights)))
    dest = node.tmp / "bad"
    code, out = node.cli("restore", "run", "--step", "200", "--to", str(dest))
    assert code != 0
    assert "model.safetensors: hash" in out
    assert not dest.exists() or list(dest.iterdir()) == []


# -- tensor-level dedup ---------------------------------------------------------------------------


def multi_safetensors(tensors: list[bytes]) -> bytes:
    """A valid safetensors file of several F32 tensors, in order."""
    header: dict[str, Any] = {}
    offset = 0
    for i, t in enumerate(tensors):
        header[f"t{i}"] = {"dtype": "F32", "shape": [len(t) // 4], "data_offsets": [offset, offset + len(t)]}
        offset += len(t)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(tensors)


TENSOR = 256 * 1024


def test_tensor_dedup_stores_frozen_tensors_once_and_restores_whole_files(node: Node) -> None:
    node.configure(hot={"keep_last": 1}, dedup_tensors=True)
    frozen = [os.urandom(TENSOR) for _ in range(4)]
    steps = (100, 200, 300, 400)
    for step in steps:
        model = multi_safetensors([*frozen, *(os.urandom(TENSOR) for _ in range(4))])
        ckpt = node.run_dir / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(model)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        for p in [*ckpt.rglob("*"), ckpt]:
            os.utime(p, (node.t0 + step, node.t0 + step))
        shutil.copytree(ckpt, node.originals / f"checkpoint-{step}")
    doc = node.prune()  # 100, 200, 300 to warm; 400 stays hot
    objs = content_objects(node)
    big = [size for size in objs.values() if size == TENSOR]
    assert len(big) == 4 + 3 * 4  # the frozen half once, the trained half per save
    warm = doc["dedup"]["tiers"]["warm"]
    # the frozen tensors of 200 and 300, and their headers (same shapes, same offsets)
    assert 2 * 4 * TENSOR < warm["deduped_bytes"] < 2 * 4 * TENSOR + 4096
    for step in steps[:3]:
        assert node.restore(step) == node.original(step)
    code, out = node.cli("verify", "run")
    assert code == 0, out
    node.configure(hot={"keep_last": 1}, dedup_tensors=True, keep_last=2)  # 100 and 200 expire
    node.prune(env=AHEAD)
    assert len([s for s in content_objects(node).values() if s == TENSOR]) == 4 + 4
    assert node.restore(300) == node.original(300)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_kill9_at_every_crash_point_of_a_tensor_deduped_copy(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    s3 = None
    if kind == "s3":
        s3 = (request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_reset"))
    frozen = [os.urandom(TENSOR) for _ in range(4)]
    models = {step: multi_safetensors([*frozen, os.urandom(TENSOR)]) for step in (100, 200, 300)}

    def make(k: int) -> Node:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        node = Node(base, kind, s3, prefix=f"trial-{k}")
        node.configure(dedup_tensors=True)
        for step, model in models.items():
            ckpt = node.run_dir / f"checkpoint-{step}"
            ckpt.mkdir(parents=True)
            (ckpt / "model.safetensors").write_bytes(model)
            (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
            for p in [*ckpt.rglob("*"), ckpt]:
                os.utime(p, (node.t0 + step, node.t0 + step))
            shutil.copytree(ckpt, node.originals / f"checkpoint-{step}")
        return node

    points = sweep(make, prune_killed_at, (100, 200, 300))
    assert points > 10


@pytest.mark.parametrize(
    ("hot", "warm", "error"),
    [
        ({"dedup": True}, {}, "tiers[0].dedup: dedup applies to slower tiers only"),
        ({}, {"dedup": True, "shared": True}, "not available on a shared local tier"),
        ({}, {"dedup_tensors": True}, "tiers[1].dedup_tensors needs dedup = true"),
    ],
)
def test_dedup_settings_that_cannot_work_are_refused(
    tmp_path: Path, hot: dict[str, Any], warm: dict[str, Any], error: str
) -> None:
    config = tmp_path / "config.toml"
    write_config(
        config,
        index=tmp_path / "index.db",
        tiers=[local_tier("hot", tmp_path / "hot", **hot), local_tier("warm", tmp_path / "warm", **warm)],
    )
    (tmp_path / "hot").mkdir()
    (tmp_path / "warm").mkdir()
    result = CliRunner().invoke(main, ["--config", str(config), "status"])
    assert result.exit_code == 2
    assert error in result.output


def test_kill9_at_every_crash_point_of_a_collection(make_node: Any) -> None:
    def make(k: int) -> Node:
        node: Node = make_node(k)
        node.prune()
        node.configure(keep_last=1)  # 100 and 200 expire from warm; their content is young still
        node.prune()
        return node

    # the killed pass has nothing to execute: every crash point is a removal of a content object
    points = sweep(make, lambda node, k: prune_killed_at(node, k, AHEAD), (300,))
    assert points == 5  # the 4 objects 100 and 200 referenced, one kill before each removal
