"""One S3 transfer in its own process, so its CPU time and peak RSS are its own.

``python -m bench._s3_worker`` reads a JSON job on stdin and prints one JSON line:
``{"wall": s, "cpu": s, "maxrss": bytes, "bytes": n}``. ``cpu`` is user + system time of the whole
process (every thread) during the transfer only, imports and client setup excluded; ``maxrss``
is the peak of the process's life (imports included: that is what a node would see).

Jobs (``client`` x ``op``):

* ``boto3`` ``upload``: ``client.upload_file`` per file, default ``TransferConfig``;
* ``boto3`` ``download``: ``client.download_file`` per file, default ``TransferConfig``;
* ``ckptkeeper`` ``upload``: ``S3TierStorage.copy_from`` of the checkpoint from a local hot tier
  (one pass: read, xxh3 for the manifest, CRC32 per part, multipart, HEAD-verified, committed);
* ``ckptkeeper`` ``download``: ``S3TierStorage.fetch`` (restore: streamed, re-hashed, verified,
  fsync-ed, renamed into place).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


_SETUP_RSS = [0]


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _boto3(job: dict[str, Any]) -> tuple[float, float, int]:
    import boto3

    client = boto3.client("s3", endpoint_url=job["endpoint"], region_name="us-east-1")
    files: list[str] = job["files"]
    root = Path(job["root"])
    total = 0
    if job["op"] == "upload":
        client.head_bucket(Bucket=job["bucket"])  # connection + credentials outside the timing
        _SETUP_RSS[0] = _rss()
        cpu0, t0 = _cpu(), time.perf_counter()
        for rel in files:
            client.upload_file(str(root / rel), job["bucket"], f"{job['prefix']}/{rel}")
            total += (root / rel).stat().st_size
    else:
        dest = Path(job["dest"])
        client.head_bucket(Bucket=job["bucket"])
        cpu0, t0 = _cpu(), time.perf_counter()
        for rel in files:
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(job["bucket"], f"{job['prefix']}/{rel}", str(out))
            total += out.stat().st_size
    return time.perf_counter() - t0, _cpu() - cpu0, total


def _ckptkeeper(job: dict[str, Any]) -> tuple[float, float, int]:
    from ckptkeeper.core.model import Manifest, TierPolicy, TierSpec
    from ckptkeeper.storage import TierStorage

    manifest = Manifest.from_json(job["manifest"])
    cold = TierStorage(
        TierSpec(
            "cold",
            job["url"],
            TierPolicy(),
            storage_options={"endpoint_url": job["endpoint"], **job.get("storage_options", {})},
        )
    )
    for key, value in job.get("tune", {}).items():
        setattr(cold, key, value)
    cold.fs.ls(job["bucket"])  # s3fs session + connection outside the timing, as for boto3
    if job["op"] == "upload":
        hot = TierStorage(TierSpec("hot", job["hot_root"], TierPolicy()), hot=True)
        _SETUP_RSS[0] = _rss()
        cpu0, t0 = _cpu(), time.perf_counter()
        cold.copy_from(hot, manifest)
    else:
        cpu0, t0 = _cpu(), time.perf_counter()
        cold.fetch(manifest, Path(job["dest"]))
    return time.perf_counter() - t0, _cpu() - cpu0, manifest.total_bytes


def main() -> None:
    job = json.loads(sys.stdin.read())
    for name, value in job.get("env", {}).items():
        os.environ[name] = value
    wall, cpu, total = (_boto3 if job["client"] == "boto3" else _ckptkeeper)(job)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps({"wall": wall, "cpu": cpu, "maxrss": maxrss, "bytes": total, "setup_rss": _SETUP_RSS[0]})
    )


if __name__ == "__main__":
    main()
