"""One node's pass in a crowded shared bucket (docs/design.md, "Many nodes": cost grows with what a node owns).

A moto S3 server on 127.0.0.1 holds ``nodes`` x ``per_node`` checkpoints in a ``shared`` tier
(each node under ``<prefix>/<node>/``, a tiny manifest + data object each, plus every node's
heartbeat). One node's pass over the tier — what the catalog reads of it (manifests, staging,
uploads) and the fleet step (heartbeat, probe, lease) — is measured in S3 requests and wall time,
against the same pass with the node alone in another bucket (same run, alternating A/B).
Target: within 1.2x. Also the lease's own requests (acquire + release) per pass, with one lease
handle kept across passes as the daemon keeps it: target <= 2 (the first pass of a process: 3).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench._harness import Config, Row, alternate, median


def _populate(client: Any, bucket: str, nodes: list[str], per_node: int) -> None:
    from ckptkeeper.core.model import MANIFEST_SUFFIX, FileEntry, Manifest

    def one(node: str, i: int) -> None:
        rel = f"run-{i // 100:03d}/checkpoint-{i}"
        m = Manifest(
            run=rel.split("/")[0], step=i, name=rel.split("/")[1], layout="hf", is_dir=True,
            files=(FileEntry("model.bin", 8, "0" * 32),), node=node,
        )  # fmt: skip
        client.put_object(Bucket=bucket, Key=f"ckpt/{node}/{rel}/model.bin", Body=b"12345678")
        client.put_object(Bucket=bucket, Key=f"ckpt/{node}/{rel}{MANIFEST_SUFFIX}", Body=m.to_json().encode())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda a: one(*a), [(n, i) for n in nodes for i in range(per_node)]))
    for n in nodes:
        beat = {"node": n, "last_pass": time.time(), "runs_held": 1, "checkpoints_held": per_node}
        client.put_object(
            Bucket=bucket, Key=f"ckpt/.ckptkeeper/nodes/{n}.json", Body=json.dumps(beat).encode()
        )


def _counted(tier: Any) -> Callable[[], int]:
    """Start counting the S3 requests ``tier``'s client sends; returns a reader of the count."""
    count = [0]

    def hook(**_: Any) -> None:
        count[0] += 1

    tier.fs.s3.meta.events.register("before-send.s3", hook)
    return lambda: count[0]


_LEASES: dict[str, Any] = {}
"""bucket -> node-0's lease handle, kept across passes like the daemon's."""


def _pass(endpoint: str, bucket: str) -> tuple[float, int, int]:
    """(seconds, requests, lease requests) of node-0's pass over the tier in ``bucket``."""
    from ckptkeeper.actions.fleet import conditional_writes
    from ckptkeeper.core.model import TierPolicy, TierSpec
    from ckptkeeper.fleet.lease import Lease
    from ckptkeeper.fleet.nodes import NODES_DIR, write_beat
    from ckptkeeper.storage import TierStorage

    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    tier: Any = TierStorage(
        TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node="node-0", shared=True)
    )
    requests = _counted(tier)
    t0 = time.perf_counter()
    listed = tier.list_manifests()
    tier.list_staging()
    tier.list_multipart_uploads()
    write_beat(tier, "node-0", runs_held=1, checkpoints_held=len(listed), newest_verified=None)
    conditional_writes(tier, "node-0")
    tier.list_fleet_objects(NODES_DIR)  # as after_pass: one listing, GETs only of stale heartbeats
    before_lease = requests()
    # one handle per store across passes, as the daemon keeps it (actions.fleet._lease)
    lease = _LEASES.setdefault(bucket, Lease(tier, "node-0", 60))
    lease.tier = tier
    if not lease.acquire():
        raise RuntimeError("node-0 could not take the lease of a bucket nobody else uses")
    lease.release()
    lease_requests = requests() - before_lease
    return time.perf_counter() - t0, requests(), lease_requests


def run(cfg: Config) -> list[Row]:
    import boto3
    from moto.server import ThreadedMotoServer

    nodes, per_node = cfg.pick((50, 1000), (20, 200), (3, 10))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
            region_name="us-east-1",
        )  # fmt: skip
        for b in ("crowded", "alone"):
            client.create_bucket(Bucket=b)
        t0 = time.monotonic()
        _populate(client, "crowded", [f"node-{i}" for i in range(nodes)], per_node)
        _populate(client, "alone", ["node-0"], per_node)
        cfg.log(f"populated {nodes} x {per_node} in {time.monotonic() - t0:.0f}s")
        stats: dict[str, list[tuple[float, int, int]]] = {"alone": [], "crowded": []}

        def measure(bucket: str) -> Callable[[], float]:
            def go() -> float:
                result = _pass(endpoint, bucket)
                stats[bucket].append(result)
                return result[0]

            return go

        alone_t, crowded_t = alternate(measure("alone"), measure("crowded"), cfg.pick(5, 3, 2), log=cfg.log)
    finally:
        server.stop()
    req_alone = median([r for _, r, _ in stats["alone"]])
    req_crowded = median([r for _, r, _ in stats["crowded"]])
    lease_all = [x for _, _, x in stats["crowded"]]
    lease = median(lease_all[1:] or lease_all)  # the first pass of a process reads the lease first
    t_ratio = median(crowded_t) / median(alone_t)
    r_ratio = req_crowded / req_alone
    label = f"node alone, {per_node} checkpoints"
    return [
        Row(
            f"fleet: one node's pass, {nodes} nodes x {per_node} checkpoints in the bucket (wall)",
            median(alone_t), median(crowded_t), "s", "<= 1.2x", t_ratio <= 1.2, ratio=t_ratio,
            baseline_label=label,
        ),
        Row(
            f"fleet: one node's pass, {nodes} nodes x {per_node} checkpoints (S3 requests)",
            req_alone, req_crowded, "requests", "<= 1.2x", r_ratio <= 1.2, ratio=r_ratio,
            baseline_label=label, note="the crowded side lists the other nodes' heartbeats (one page)",
        ),
        Row(
            "fleet: lease acquire + release per pass (after the first)", None, lease, "requests", "<= 2",
            lease <= 2, note=f"first pass of a process: {lease_all[0]} (the lease is read once)",
        ),
    ]  # fmt: skip
