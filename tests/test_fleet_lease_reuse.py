"""One lease handle across passes (issue 17): after its own release, the next acquire is one
conditional PUT on the etag of that release, so a pass that takes and releases the lease costs 2
requests instead of 3 — and the lease contract (README "Many nodes, one bucket": at most one
holder, If-Match on the version read, released every pass) still holds, against moto over HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.fleet.lease import Lease, read_lease
from ckptkeeper.storage import TierStorage


def _shared(bucket: str, options: dict[str, Any], node: str) -> Any:
    return TierStorage(TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node=node, shared=True))


def _counter(tier: Any) -> Callable[[], int]:
    count = [0]

    def hook(**_: Any) -> None:
        count[0] += 1

    tier.fs.s3.meta.events.register("before-send.s3", hook)
    return lambda: count[0]


def test_a_kept_handle_acquires_and_releases_in_two_requests(
    s3_bucket: str, s3_storage_options: dict[str, Any]
) -> None:
    lease = Lease(_shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60)
    sent = _counter(lease.tier)
    assert lease.acquire()
    lease.release()
    first = sent()
    assert first == 3  # read (none there) + create + release
    for _ in range(3):  # the daemon's next passes
        before = sent()
        assert lease.acquire() and lease.held
        info, _ = read_lease(lease.tier)
        assert info is not None and info.node == "node-a" and info.expires > time.time()
        lease.release()
        assert sent() - before - 1 == 2  # acquire + release (minus the read_lease check above)
    info, _ = read_lease(lease.tier)
    assert info is not None and info.expires == 0.0  # released: nobody need wait out the TTL


def test_a_kept_handle_never_takes_a_lease_another_node_wrote_since(
    s3_bucket: str, s3_storage_options: dict[str, Any]
) -> None:
    a = Lease(_shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60)
    b = Lease(_shared(s3_bucket, s3_storage_options, "node-b"), "node-b", 60)
    assert a.acquire()
    a.release()
    assert b.acquire()  # takes A's released lease over (If-Match on what it read)
    assert not a.acquire() and not a.held  # A's remembered etag is stale: 412, then B's live lease
    info, _ = read_lease(a.tier)
    assert info is not None and info.node == "node-b"
    b.release()
    assert a.acquire() and a.held  # B released: A reads it and takes it
    assert not b.acquire()  # B's remembered release is stale too: A holds it now
    info, _ = read_lease(a.tier)
    assert info is not None and info.node == "node-a"


def test_a_kept_handle_recovers_when_the_lease_object_is_gone(
    s3_bucket: str, s3_storage_options: dict[str, Any], s3_client: Any
) -> None:
    """An operator deleted the lease object: the conditional PUT on the old etag fails and the
    full path creates it again (If-None-Match: *)."""
    a = Lease(_shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60)
    assert a.acquire()
    a.release()
    s3_client.delete_object(Bucket=s3_bucket, Key="ckpt/.ckptkeeper/lease")
    assert a.acquire() and a.held
    info, _ = read_lease(a.tier)
    assert info is not None and info.node == "node-a" and info.expires > time.time()
