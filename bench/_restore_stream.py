"""``python -m bench._restore_stream ARGS``: ``ckptkeeper ARGS`` with the S3 restore path from
before ranged GETs (one streamed GET per object, 4 objects at a time: what the local tiers still
use), so that bench/restore_s3.py measures both in the same run."""

from __future__ import annotations

from ckptkeeper.cli import main
from ckptkeeper.storage.s3 import S3TierStorage
from ckptkeeper.storage.tier import TierStorage

S3TierStorage._fetch_files = TierStorage._fetch_files  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
