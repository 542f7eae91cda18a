"""Per-tier bandwidth caps (``max_rate``, docs/bandwidth.md): one token bucket per tier per process.

Every copy into or out of a capped tier takes its bytes from the tier's bucket, whatever thread
makes it, so that a move (or several at once) never takes more than the tier's share of the
disk or the network the training job also needs. A copy between two capped tiers keeps to the
lower cap: it takes from both buckets.
"""

from __future__ import annotations

import threading

from ckptkeeper.core.model import TierSpec
from ckptkeeper.util.throttle import TokenBucket

__all__ = ["install", "reset", "tier_bucket"]

_lock = threading.Lock()
_buckets: dict[tuple[str, str], TokenBucket] = {}


def tier_bucket(spec: TierSpec) -> TokenBucket | None:
    """The bucket shared by every copy of this process into or out of ``spec``'s tier (None: no
    cap). A changed ``max_rate`` (a reloaded config) starts a new bucket at the new rate."""
    if spec.max_rate is None:
        return None
    key = (spec.name, spec.url)
    with _lock:
        bucket = _buckets.get(key)
        if bucket is None or bucket.rate != float(spec.max_rate):
            bucket = _buckets[key] = TokenBucket(spec.max_rate)
        return bucket


def install(spec: TierSpec, bucket: TokenBucket) -> None:
    """Use ``bucket`` for ``spec``'s tier from now on (tests: a bucket on an injected clock)."""
    with _lock:
        _buckets[(spec.name, spec.url)] = bucket


def reset() -> None:
    """Forget every bucket (tests)."""
    with _lock:
        _buckets.clear()
