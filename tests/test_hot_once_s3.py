"""A prune to S3 reads each hot byte once: a checkpoint that ``prune`` sees for the first time and
uploads is hashed from the bytes the upload sends (the catalog's fingerprints vouch for them), not
hashed by the catalog and read again by the upload (docs/uploads.md).

Hot is on tmpfs (``/dev/shm``), cold is an S3 tier on the moto server; the real CLI runs as a
subprocess. The large file is a multipart upload (16 MiB parts), the small ones single PUTs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_hot_once
from builders import local_tier, s3_tier, write_config
from test_hot_once import (
    NEW,
    OLD,
    REWRITE_WRAPPER,
    RUN,
    _cli,
    _cli_rchar,
    _env,
    _index_versions,
    _new_checkpoints,
)

from ckptkeeper.core.model import Manifest
from ckptkeeper.util.hashing import new_hasher

shm = test_hot_once.shm  # the fixture: hot on tmpfs

PREFIX = "ckpt"


def _node(shm: Path, tmp_path: Path, bucket: str, endpoint: str, **cold: Any) -> tuple[Path, Path]:
    """(config, hot): hot on tmpfs, cold in S3; an index that exists already."""
    hot = shm / "hot"
    hot.mkdir()
    config = write_config(
        tmp_path / "ckptkeeper.toml",
        index=tmp_path / "index.db",
        tiers=[
            local_tier("hot", hot, keep_last=1),
            s3_tier("cold", bucket, endpoint, prefix=PREFIX, keep_last=10, **cold),
        ],
        daemon={"metrics_addr": "", "trust_mtimes": True},  # back-dated checkpoints: settled
    )
    assert _cli(config, "scan").returncode == 0
    return config, hot


def _objects(s3: Any, bucket: str) -> dict[str, bytes]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _assert_uploaded_exactly(
    tmp_path: Path, hot: Path, s3: Any, bucket: str, digests: dict[str, str]
) -> None:
    """The old checkpoint is in S3 only, byte for byte; its manifest's hashes are those of the
    bytes stored, and its version is what the index records for the cold copy; no staging left."""
    objects = _objects(s3, bucket)
    assert not (hot / RUN / OLD).exists()
    base = f"{PREFIX}/{RUN}/{OLD}"
    stored = {k[len(base) + 1 :]: v for k, v in objects.items() if k.startswith(base + "/")}
    assert {name: hashlib.sha256(body).hexdigest() for name, body in stored.items()} == digests
    manifest = Manifest.from_json(objects[f"{base}.ckptkeeper-manifest.json"].decode())
    for entry in manifest.files:
        hasher = new_hasher()
        hasher.update(stored[entry.path])
        assert (len(stored[entry.path]), hasher.hexdigest()) == (entry.size, entry.hash)
    version, locations = _index_versions(tmp_path)[OLD]
    assert version == manifest.digest and locations == {"cold": manifest.digest}
    assert [k for k in objects if ".ckptkeeper-tmp" in k] == []
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_prune_to_s3_reads_each_hot_byte_once_and_records_exact_hashes(
    shm: Path, tmp_path: Path, s3_client: Any, s3_bucket: str, s3_reset: str
) -> None:
    config, hot = _node(shm, tmp_path, s3_bucket, s3_reset)
    rc, idle, err = _cli_rchar(config, "prune", "--json")  # what a pass reads besides checkpoints
    assert rc == 0, err
    digests = _new_checkpoints(hot, 40 << 20)  # 40 MiB of weights: 3 parts; the rest one PUT each
    moved = sum(p.stat().st_size for p in (hot / RUN / OLD).iterdir())

    rc, rchar, err = _cli_rchar(config, "prune", "--json")

    assert rc == 0, err
    _assert_uploaded_exactly(tmp_path, hot, s3_client, s3_bucket, digests)
    # Before: the catalog hashed every byte, the copy read it again, and each part was read a
    # third time while it was sent (3x).
    assert rchar - idle <= 1.1 * moved, (rchar, idle, moved)
    verify = _cli(config, "verify")  # re-hashes every copy against its manifest
    assert verify.returncode == 0, verify.stdout + verify.stderr
    restored = tmp_path / "restored"
    got = _cli(config, "restore", RUN, "--step", "100", "--to", str(restored), "--no-daemon")
    assert got.returncode == 0, got.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (restored / OLD).iterdir()} == digests


@pytest.mark.parametrize("mode", ["same-size", "other-size"])
@pytest.mark.parametrize("at", ["copy-journaled", "copy-progress"])
def test_a_file_rewritten_after_the_catalog_saw_it_fails_its_upload(
    shm: Path, tmp_path: Path, s3_client: Any, s3_bucket: str, s3_reset: str, mode: str, at: str
) -> None:
    """Rewritten before the upload read it (``copy-journaled``) or while it is uploaded (after its
    first chunk): no copy is committed in S3 and nothing of it is left there; the checkpoint stays
    in hot with its new bytes."""
    config, hot = _node(shm, tmp_path, s3_bucket, s3_reset)
    _new_checkpoints(hot, 20 << 20)  # weights of 2 parts: the rewrite lands after parts were sent
    target = hot / RUN / OLD / "model.safetensors"
    env = {**_env(), "REWRITE_FILE": str(target), "REWRITE_MODE": mode, "REWRITE_AT": at}
    proc = subprocess.run(
        [sys.executable, "-c", REWRITE_WRAPPER, "--config", str(config), "prune", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "changed since cataloged" in proc.stderr
    assert target.exists()
    keys = list(_objects(s3_client, s3_bucket))
    assert not [k for k in keys if k.startswith(f"{PREFIX}/{RUN}/{OLD}")], keys
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert _cli(config, "scan").returncode == 0
    _, locations = _index_versions(tmp_path)[OLD]
    assert "cold" not in locations


@pytest.mark.parametrize("cold", [{"compression": "zstd"}, {"dedup": True}])
def test_a_prune_to_a_compressing_or_dedup_s3_tier_keeps_exact_hashes(
    shm: Path, tmp_path: Path, s3_bucket: str, s3_reset: str, cold: dict[str, Any]
) -> None:
    """Those tiers are hashed first (a dedup store is keyed by hash; a compressing upload sends
    frames, not the bytes read): the move restores byte for byte and verifies."""
    config, hot = _node(shm, tmp_path, s3_bucket, s3_reset, **cold)
    digests = _new_checkpoints(hot, 2 << 20)

    got = _cli(config, "prune", "--json")

    assert got.returncode == 0, got.stderr
    assert not (hot / RUN / OLD).exists() and (hot / RUN / NEW).exists()
    assert _cli(config, "verify").returncode == 0
    restored = tmp_path / "restored"
    back = _cli(config, "restore", RUN, "--step", "100", "--to", str(restored), "--no-daemon")
    assert back.returncode == 0, back.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (restored / OLD).iterdir()} == digests
    assert json.loads(got.stdout)


def test_tiny_bench_measures_a_prune_to_s3_and_a_resume_of_several_files(tmp_path: Path) -> None:
    """bench/upload_resume.py: a whole `ckptkeeper prune` to SeaweedFS, the bytes it read per byte
    moved (rchar) against hashing first; and a checkpoint of 4 files killed in its third."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", "--tiny", "--only", "upload_resume", "--json", str(out)]
    proc = subprocess.run(
        [*argv, "--disk-dir", str(tmp_path)],
        cwd=test_hot_once.ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed, still a table
    doc = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    rows = {row["metric"]: row for row in doc["rows"]}
    reads = rows[
        "prune to S3 (SeaweedFS), 24 MiB new checkpoint from tmpfs: bytes read per byte moved (rchar of the process)"
    ]
    assert reads["baseline"] > reads["ours"] > 0 and "net of the" in reads["note"]
    several = rows["finish a 4 x 6 MiB upload killed at 62 % (bytes sent)"]
    assert several["ours"] < several["baseline"]


def _prehashed(config: Path, hot: Path) -> tuple[int, dict[str, str], int]:
    """(rchar of an idle pass, file -> sha256, bytes to move) after two new checkpoints were
    created and cataloged (hashed) by a ``scan``: what the daemon does as each one settles."""
    rc, idle, err = _cli_rchar(config, "prune", "--json")
    assert rc == 0, err
    digests = _new_checkpoints(hot, 40 << 20)  # 40 MiB of weights: 3 parts; the rest one PUT each
    assert _cli(config, "scan").returncode == 0
    versions = _index_versions(config.parent)
    assert versions[OLD][1] == {"hot": versions[OLD][0]}  # hashed and recorded, in hot only
    moved = sum(p.stat().st_size for p in (hot / RUN / OLD).iterdir())
    return idle, digests, moved


def test_a_checkpoint_hashed_before_the_pass_uploads_reading_each_byte_once(
    shm: Path, tmp_path: Path, s3_client: Any, s3_bucket: str, s3_reset: str
) -> None:
    """A checkpoint the catalog hashed in an earlier pass (or the daemon as it settled) is
    uploaded from the very buffers the copy reads and checks against the catalog's hashes."""
    config, hot = _node(shm, tmp_path, s3_bucket, s3_reset)
    idle, digests, moved = _prehashed(config, hot)

    rc, rchar, err = _cli_rchar(config, "prune", "--json")

    assert rc == 0, err
    _assert_uploaded_exactly(tmp_path, hot, s3_client, s3_bucket, digests)
    # Before: the copy read and hashed every byte, and each part was read again while it was sent (2x).
    assert rchar - idle <= 1.1 * moved, (rchar, idle, moved)
    restored = tmp_path / "restored"
    got = _cli(config, "restore", RUN, "--step", "100", "--to", str(restored), "--no-daemon")
    assert got.returncode == 0, got.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (restored / OLD).iterdir()} == digests


@pytest.mark.parametrize(
    ("mode", "at"),
    [("same-size", "copy-journaled"), ("other-size", "copy-progress"), ("same-size", "copy-progress")],
)
def test_a_file_rewritten_after_it_was_hashed_fails_its_upload(
    shm: Path, tmp_path: Path, s3_client: Any, s3_bucket: str, s3_reset: str, mode: str, at: str
) -> None:
    """A checkpoint hashed before the pass, one file rewritten before the upload read it
    (``copy-journaled``) or while it is uploaded (after its first chunk, parts already sent): its
    hash or size is not the catalog's, the upload is aborted, nothing of it is left in S3 and the
    checkpoint stays in hot with its new bytes."""
    config, hot = _node(shm, tmp_path, s3_bucket, s3_reset)
    _new_checkpoints(hot, 40 << 20)  # weights of 3 parts: the rewrite lands after parts were sent
    assert _cli(config, "scan").returncode == 0
    target = hot / RUN / OLD / "model.safetensors"
    env = {**_env(), "REWRITE_FILE": str(target), "REWRITE_MODE": mode, "REWRITE_AT": at}
    proc = subprocess.run(
        [sys.executable, "-c", REWRITE_WRAPPER, "--config", str(config), "prune", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "changed since cataloged" in proc.stderr
    assert target.exists()
    keys = list(_objects(s3_client, s3_bucket))
    assert not [k for k in keys if k.startswith(f"{PREFIX}/{RUN}/{OLD}")], keys
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert _cli(config, "scan").returncode == 0  # cataloged again, from its new bytes, in hot only
    _, locations = _index_versions(tmp_path)[OLD]
    assert "cold" not in locations
