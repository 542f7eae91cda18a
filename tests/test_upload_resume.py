"""Resumable uploads (docs/uploads.md): ``prune`` killed with SIGKILL in the middle of a multipart
upload to S3 resumes it on the next run, sending only the parts the store does not hold.

The real CLI runs as a subprocess through a counting proxy (tests/faultproxy.py) in front of the S3
server; the proxy SIGKILLs it when the K-th UploadPart request arrives, and counts the UploadPart
requests of the next run. Parts are 5 MiB (S3's minimum) so that a 41 MiB file has 9 of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import hf_checkpoint, local_tier, s3_tier, write_config
from faultproxy import FaultProxy, Request

MiB = 2**20
PART = 5 * MiB
SIZE = 8 * PART + MiB + 123
PARTS = 9
KILL_AT = 6
"""The UploadPart request that finds the process killed: with 3 parts in flight, at least 3 landed."""

RUN = """
import os, sys
from ckptkeeper.storage.s3 import S3TierStorage
S3TierStorage.part_size = int(os.environ["RESUME_TEST_PART_SIZE"])
from ckptkeeper.cli import main
sys.exit(main())
"""
"""``ckptkeeper`` with 5 MiB parts (the default 16 MiB would need a 150 MiB file for 9 parts)."""

KEY = "ckpt/run-a/checkpoint-1/model.bin"


def is_part(request: Request) -> bool:
    return request.method == "PUT" and "partNumber=" in request.query


class Node:
    """A hot tier with two checkpoints of ``run-a`` and a cold S3 tier; ``prune`` moves the older
    one (its ``model.bin`` is ``SIZE`` bytes) to S3."""

    def __init__(self, tmp: Path, bucket: str, options: dict[str, Any]) -> None:
        self.tmp = tmp
        self.bucket = bucket
        self.options = options
        self.upstream = str(options["endpoint_url"])
        self.hot = tmp / "hot"
        run = self.hot / "run-a"
        self.source = hf_checkpoint(run, 1, os.urandom(SIZE)) / "model.bin"
        hf_checkpoint(run, 2, b"small")
        self.config = tmp / "config.toml"

    def prune(self, rule: Callable[[Request], str | None], pid: list[int]) -> subprocess.CompletedProcess[str]:
        """``prune`` through a proxy applying ``rule`` to every request (``pid`` gets the process id)."""
        with FaultProxy(self.upstream, rate=0.0, rules=[rule]) as proxy:
            options = {k: v for k, v in self.options.items() if k != "endpoint_url"}
            write_config(
                self.config,
                index=self.tmp / "index.db",
                daemon={"settle_seconds": "1s", "trust_mtimes": True},
                tiers=[
                    local_tier("hot", self.hot, keep_last=1),
                    s3_tier("cold", self.bucket, proxy.url, storage_options=options, keep_last=5),
                ],
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
            env["RESUME_TEST_PART_SIZE"] = str(PART)
            proc = subprocess.Popen(
                [sys.executable, "-c", RUN, "--config", str(self.config), "prune"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            pid.append(proc.pid)
            out, err = proc.communicate(timeout=300)
        # the proxy is stopped: every request it forwarded is answered, none is still landing
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def killed_at_part(self, k: int) -> subprocess.CompletedProcess[str]:
        seen = [0]
        pid: list[int] = []

        def rule(request: Request) -> str | None:
            if not is_part(request):
                return None
            seen[0] += 1
            if seen[0] >= k:
                os.kill(pid[0], signal.SIGKILL)
                return "reset_before"
            return None

        return self.prune(rule, pid)

    def counted(self) -> tuple[subprocess.CompletedProcess[str], int]:
        sent = [0]

        def rule(request: Request) -> str | None:
            sent[0] += is_part(request)
            return None

        result = self.prune(rule, [])
        return result, sent[0]


def client(options: dict[str, Any]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def stored_parts(s3: Any, bucket: str) -> list[int]:
    (upload,) = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert upload["Key"] == KEY
    parts = s3.list_parts(Bucket=bucket, Key=KEY, UploadId=upload["UploadId"]).get("Parts", [])
    return [int(p["Size"]) for p in parts]


def assert_committed(node: Node, s3: Any, content: bytes) -> None:
    assert s3.get_object(Bucket=node.bucket, Key=KEY)["Body"].read() == content
    manifest = json.loads(
        s3.get_object(Bucket=node.bucket, Key="ckpt/run-a/checkpoint-1.ckptkeeper-manifest.json")["Body"].read()
    )
    assert {f["path"]: f["size"] for f in manifest["files"]}["model.bin"] == SIZE
    assert s3.list_multipart_uploads(Bucket=node.bucket).get("Uploads", []) == []
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=node.bucket).get("Contents", [])]
    assert [k for k in keys if ".ckptkeeper-tmp" in k] == []
    assert not node.source.exists()  # moved: the copy in S3 is the checkpoint's only one now


@pytest.fixture
def moto_store(s3_reset: str) -> tuple[str, dict[str, Any]]:
    options = {"key": "testing", "secret": "testing", "endpoint_url": s3_reset}
    client(options).create_bucket(Bucket="resume")
    return "resume", options


def test_a_killed_upload_resumes_sending_only_the_missing_parts(
    tmp_path: Path, store: tuple[str, dict[str, Any]]
) -> None:
    bucket, options = store
    node = Node(tmp_path, bucket, options)
    content = node.source.read_bytes()
    s3 = client(options)

    killed = node.killed_at_part(KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    landed = stored_parts(s3, bucket)
    assert landed and len(landed) < PARTS and set(landed) == {PART}

    again, sent = node.counted()
    assert again.returncode == 0, again.stdout + again.stderr
    assert sent == PARTS - len(landed)
    assert_committed(node, s3, content)


def test_a_source_changed_since_the_kill_is_uploaded_again_whole(
    tmp_path: Path, moto_store: tuple[str, dict[str, Any]]
) -> None:
    bucket, options = moto_store
    node = Node(tmp_path, bucket, options)
    s3 = client(options)
    killed = node.killed_at_part(KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert stored_parts(s3, bucket)
    (old_upload,) = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]

    content = os.urandom(SIZE)  # other bytes, same size: the catalog sees a new mtime and hashes it
    node.source.write_bytes(content)
    when = node.source.stat().st_mtime - 1800
    os.utime(node.source, (when, when))
    os.utime(node.source.parent, (when, when))

    total = 0
    for _ in range(3):  # the pass that notices the change rescans it; a later one moves it
        result, sent = node.counted()
        assert result.returncode == 0, result.stdout + result.stderr
        total += sent
        if not node.source.exists():
            break
    assert total == PARTS  # nothing of the old content reused
    uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert old_upload["UploadId"] not in {u["UploadId"] for u in uploads}
    assert_committed(node, s3, content)
