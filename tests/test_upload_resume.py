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

    def prune(
        self, rule: Callable[[Request], str | None], pid: list[int]
    ) -> subprocess.CompletedProcess[str]:
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
        s3.get_object(Bucket=node.bucket, Key="ckpt/run-a/checkpoint-1.ckptkeeper-manifest.json")[
            "Body"
        ].read()
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


# -- the records an interrupted copy leaves, read back by recovery, the reaper and the next copy --


def _interrupted(s3: Any, bucket: str, node: str, **record: Any) -> tuple[str, str]:
    """An upload of ``cold/run/ck/w.bin`` with one stored part, and a copy marker of ``node``
    naming it with ``record`` over a well-formed resume record; returns (upload id, marker key)."""
    key = "cold/run/ck/w.bin"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * PART)
    good = {"upload": upload, "key": key, "size": 2 * PART, "hash": "abc", "part_size": PART}
    doc = {
        "op": "copy",
        "target": "run/ck",
        "node": node,
        "uploads": [upload],
        "resume": [{**good, **record}],
    }
    marker = "cold/run/ck.ckptkeeper-tmp-0123456789ab"
    s3.put_object(Bucket=bucket, Key=marker, Body=json.dumps(doc).encode())
    return upload, marker


def _cold(bucket: str, endpoint: str) -> Any:
    """The S3 tier of an unnamed node (markers of node "" are its own)."""
    from builders import tier

    from ckptkeeper.storage import TierStorage

    return TierStorage(tier("cold", f"s3://{bucket}/cold", storage_options={"endpoint_url": endpoint}))


def _uploads(s3: Any, bucket: str) -> list[str]:
    return [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_recovery_keeps_the_upload_once_then_the_reaper_aborts_it(
    moto_store: tuple[str, dict[str, Any]],
) -> None:
    """Discarding the interrupted copy keeps its resumable upload under a fresh resume marker;
    discarding that marker (the reaper, once it is stale) aborts the upload and leaves nothing."""
    bucket, options = moto_store
    s3 = client(options)
    upload, marker = _interrupted(s3, bucket, "")
    cold = _cold(bucket, options["endpoint_url"])
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)
    assert _uploads(s3, bucket) == [upload]
    doc = json.loads(s3.get_object(Bucket=bucket, Key=marker)["Body"].read())
    assert (doc["op"], doc["uploads"]) == ("resume", [upload])
    assert [(a.upload_id, a.node) for a in cold.list_multipart_uploads()] == [(upload, "")]
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)
    assert _uploads(s3, bucket) == []
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


@pytest.mark.parametrize(
    ("node", "record"),
    [
        ("other", {}),  # another node's copy
        ("", {"key": "cold/run/elsewhere.bin"}),  # an object outside the checkpoint
        ("", {"size": "10485760"}),  # not a number
        ("", {"part_size": 0}),
        ("", {"hash": ""}),
    ],
)
def test_an_upload_not_recorded_as_resumable_by_this_node_is_aborted(
    moto_store: tuple[str, dict[str, Any]], node: str, record: dict[str, Any]
) -> None:
    bucket, options = moto_store
    s3 = client(options)
    _interrupted(s3, bucket, node, **record)
    cold = _cold(bucket, options["endpoint_url"])
    assert cold._resumable_uploads("cold/run/ck")[0] == {}
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)
    assert _uploads(s3, bucket) == []
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


# -- objects the killed copy had finished: kept, not sent again --

FIRST = "a-first.bin"
FIRST_SIZE = 2 * PART + 4321
"""The first file copied (names sort before ``model.bin``): a multipart upload of 3 parts."""


def _killed_in_second_file(node: Node) -> tuple[subprocess.CompletedProcess[str], int]:
    """``prune`` SIGKILLed at the 4th part of the second file, the first one completed; returns
    it and how many requests sent the first file's bytes."""
    seen, first = [0], [0]
    pid: list[int] = []

    def rule(request: Request) -> str | None:
        if request.method == "PUT" and request.path.endswith("/" + FIRST):
            first[0] += 1
        if not is_part(request) or not request.path.endswith("/model.bin"):
            return None
        seen[0] += 1
        if seen[0] >= 4:
            os.kill(pid[0], signal.SIGKILL)
            return "reset_before"
        return None

    return node.prune(rule, pid), first[0]


def _counted_by_file(node: Node) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """``prune``, counting the requests that send bytes (PUT of an object or part, and
    CreateMultipartUpload) per file name."""
    sent: dict[str, int] = {}

    def rule(request: Request) -> str | None:
        name = request.path.rsplit("/", 1)[-1]
        if (request.method == "PUT" and ".ckptkeeper-" not in name) or request.query.startswith("uploads"):
            sent[name] = sent.get(name, 0) + 1
        return None

    return node.prune(rule, []), sent


@pytest.mark.parametrize("hashed_first", [False, True], ids=["hashed-on-the-way", "hashed-by-scan"])
def test_a_file_the_killed_copy_finished_is_not_sent_again(
    tmp_path: Path, moto_store: tuple[str, dict[str, Any]], hashed_first: bool
) -> None:
    """Killed after the first file's upload completed and in the middle of the second's: the next
    prune sends nothing of the first file (the store holds it, as the marker records), resumes
    the second, and commits a copy identical to the source, with nothing left in staging."""
    bucket, options = moto_store
    node = Node(tmp_path, bucket, options)
    first = os.urandom(FIRST_SIZE)
    path = node.source.parent / FIRST
    path.write_bytes(first)
    when = node.source.stat().st_mtime
    os.utime(path, (when, when))
    os.utime(path.parent, (when, when))
    content = node.source.read_bytes()
    s3 = client(options)
    if hashed_first:
        write_config(
            node.config,
            index=tmp_path / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", node.hot, keep_last=1)],
        )
        assert (
            subprocess.run(
                [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "scan"], check=False
            ).returncode
            == 0
        )

    killed, first_requests = _killed_in_second_file(node)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert first_requests == 3  # its parts, sent once
    assert (
        s3.head_object(Bucket=bucket, Key=f"ckpt/run-a/checkpoint-1/{FIRST}")["ContentLength"] == FIRST_SIZE
    )
    landed = stored_parts(s3, bucket)

    again, sent = _counted_by_file(node)

    assert again.returncode == 0, again.stdout + again.stderr
    assert sent.get(FIRST, 0) == 0, sent
    assert sent["model.bin"] == PARTS - len(landed)
    assert_committed(node, s3, content)
    assert s3.get_object(Bucket=bucket, Key=f"ckpt/run-a/checkpoint-1/{FIRST}")["Body"].read() == first


def _finished(s3: Any, bucket: str, node: str, **record: Any) -> str:
    """An object ``cold/run/ck/w.bin`` stored by multipart upload and a copy marker of ``node``
    recording it as finished with ``record`` over a true record; returns the object's key."""
    from ckptkeeper.util import hashing

    key = "cold/run/ck/w.bin"
    body = os.urandom(PART + 10)
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")["UploadId"]
    parts = []
    for n, chunk in enumerate((body[:PART], body[PART:]), 1):
        got = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=chunk, ChecksumAlgorithm="CRC32"
        )
        parts.append({"PartNumber": n, "ETag": got["ETag"], "ChecksumCRC32": got["ChecksumCRC32"]})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    hasher = hashing.new_hasher()
    hasher.update(body)
    true = {
        "key": key,
        "size": len(body),
        "hash": hasher.hexdigest(),
        "digest": hasher.hexdigest(),
        "etag": head["ETag"],
        "crc": head["ChecksumCRC32"],
        "part_size": PART,
    }
    doc = {"op": "copy", "target": "run/ck", "node": node, "uploads": [], "done": [{**true, **record}]}
    s3.put_object(Bucket=bucket, Key="cold/run/ck.ckptkeeper-tmp-0123456789ab", Body=json.dumps(doc).encode())
    return key


def test_recovery_keeps_a_finished_object_once_then_the_reaper_removes_it(
    moto_store: tuple[str, dict[str, Any]],
) -> None:
    bucket, options = moto_store
    s3 = client(options)
    key = _finished(s3, bucket, "")
    cold = _cold(bucket, options["endpoint_url"])
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert key in keys
    assert cold._interrupted_copies("cold/run/ck")[1].keys() == {key}
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)  # the resume marker, stale: everything goes
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


@pytest.mark.parametrize(
    ("node", "record"),
    [
        ("other", {}),  # another node's copy
        ("", {"key": "cold/run/elsewhere.bin"}),  # an object outside the checkpoint
        ("", {"size": "5242890"}),  # not a number
        ("", {"etag": '"0123456789abcdef0123456789abcdef"'}),  # not the object the store holds
        ("", {"crc": "AAAAAA==-2"}),  # not its checksum
        ("", {"digest": ""}),
    ],
)
def test_an_object_not_recorded_as_finished_by_this_node_is_not_kept(
    moto_store: tuple[str, dict[str, Any]], node: str, record: dict[str, Any]
) -> None:
    bucket, options = moto_store
    s3 = client(options)
    _finished(s3, bucket, node, **record)
    cold = _cold(bucket, options["endpoint_url"])
    _, done, _ = cold._interrupted_copies("cold/run/ck")
    assert cold._still_finished(done.values()) == {}
    (staging,) = cold.list_staging()
    cold.discard_staging(staging)
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []
