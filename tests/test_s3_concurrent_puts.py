"""A checkpoint's one-PUT objects go out several at a time (issue 17: 200 small files were 200
sequential round trips). A failure among PUTs in flight must still fail the copy before its
commit, and the abort must leave only what it cannot prove is not its own. Real moto over HTTP,
behind the fault proxy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import manifest_of
from builders import tier as spec
from faultproxy import FaultProxy, Request

from ckptkeeper import storage
from ckptkeeper.core.model import Manifest
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage import StorageError, TierStorage

FILES = 24


@pytest.fixture
def hot(tmp_path: Path) -> tuple[TierStorage, Manifest, Path]:
    """A directory checkpoint of 24 small files in two subdirectories."""
    root = tmp_path / "hot"
    ckpt = root / "run1" / "checkpoint-100"
    for k in range(FILES):
        sub = ckpt / f"shard-{k % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"part-{k:02d}.bin").write_bytes(os.urandom(1024 + 997 * k))
    manifest = manifest_of(root, "run1", 100, layout="test", created_at=1_700_000_000.0, node="test-node")
    return TierStorage(spec("hot", str(root)), hot=True), manifest, ckpt


@pytest.fixture
def cold(s3_reset: str, s3_bucket: str) -> Iterator[tuple[storage.S3TierStorage, FaultProxy]]:
    with FaultProxy(s3_reset, rate=0.0) as proxy:
        options = {
            "endpoint_url": proxy.url,
            "key": "testing",
            "secret": "testing",
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}},
        }
        tier = TierStorage(spec("cold", f"s3://{s3_bucket}/cold", storage_options=options))
        assert isinstance(tier, storage.S3TierStorage)
        yield tier, proxy


def _keys(client: Any, bucket: str) -> list[str]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix="cold/")
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _open_files() -> set[str]:
    """What this process's descriptors point at, sockets left out (the client's pool varies)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/"):
            out.add(f"{fd}:{target}")
    return out


def _put_of(name: str, fault: str) -> Any:
    def rule(request: Request) -> str | None:
        return fault if request.method == "PUT" and request.path.endswith(name) else None

    return rule


def test_many_small_files_arrive_whole(
    cold: tuple[storage.S3TierStorage, FaultProxy],
    hot: tuple[TierStorage, Manifest, Path],
    s3_client: Any,
    s3_bucket: str,
) -> None:
    tier, _ = cold
    hot_tier, manifest, ckpt = hot
    tier.copy_from(hot_tier, manifest)
    assert [(m.digest if m else None, err) for _, m, err in tier.list_manifests()] == [
        (manifest.digest, None)
    ]
    for path in sorted(ckpt.rglob("*.bin")):
        key = f"cold/run1/checkpoint-100/{path.relative_to(ckpt)}"
        assert s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == path.read_bytes()
    assert not [k for k in _keys(s3_client, s3_bucket) if STAGING_MARK in k]
    assert tier.recheck(manifest) == [] and tier.verify(manifest) == []


def test_a_put_refused_among_those_in_flight_fails_the_copy_and_leaves_nothing(
    cold: tuple[storage.S3TierStorage, FaultProxy],
    hot: tuple[TierStorage, Manifest, Path],
    s3_client: Any,
    s3_bucket: str,
) -> None:
    tier, proxy = cold
    hot_tier, manifest, _ = hot
    proxy.rules.append(_put_of("part-09.bin", "denied"))
    tier.list_manifests()  # the client and its connections exist before the count
    fds = _open_files()
    with pytest.raises(StorageError, match=r"part-09\.bin"):
        tier.copy_from(hot_tier, manifest)
    assert tier.list_manifests() == []
    assert _keys(s3_client, s3_bucket) == []  # the others' objects and the marker cleaned up
    assert _open_files() <= fds  # no source file left open by a PUT that failed in flight
    proxy.rules.clear()
    tier.copy_from(hot_tier, manifest)  # and the next attempt succeeds
    assert tier.recheck(manifest) == [] and tier.verify(manifest) == []


def test_a_put_whose_answer_is_always_lost_leaves_its_object_and_marker_to_the_reaper(
    cold: tuple[storage.S3TierStorage, FaultProxy],
    hot: tuple[TierStorage, Manifest, Path],
    s3_client: Any,
    s3_bucket: str,
) -> None:
    """The store took the PUT every time and the client never heard: the object may be this copy's.
    The copy fails uncommitted; the objects it knows are its own are deleted; the one it cannot
    know about stays with the marker, which the reaper's staging listing reports."""
    tier, proxy = cold
    hot_tier, manifest, _ = hot
    proxy.rules.append(_put_of("part-05.bin", "reset_after"))
    with pytest.raises(StorageError, match=r"part-05\.bin"):
        tier.copy_from(hot_tier, manifest)
    assert tier.list_manifests() == []
    left = _keys(s3_client, s3_bucket)
    assert [k for k in left if STAGING_MARK not in k] == ["cold/run1/checkpoint-100/shard-1/part-05.bin"]
    assert len([k for k in left if STAGING_MARK in k]) == 1
    staging = [a.path for a in tier.list_staging()]
    assert len(staging) == 1 and staging[0].startswith("run1/checkpoint-100" + STAGING_MARK), staging
    proxy.rules.clear()
    tier.copy_from(hot_tier, manifest)  # a later copy replaces the uncommitted leftovers and commits
    assert tier.recheck(manifest) == [] and tier.verify(manifest) == []
    # only the failed attempt's marker is left, for the reaper once it is stale
    assert [k for k in _keys(s3_client, s3_bucket) if STAGING_MARK in k] == [
        k for k in left if STAGING_MARK in k
    ]


def test_a_file_changed_after_it_was_hashed_stores_the_bytes_hashed(
    cold: tuple[storage.S3TierStorage, FaultProxy],
    hot: tuple[TierStorage, Manifest, Path],
    s3_client: Any,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each byte is read once: a PUT sends the buffer the copy loop read and hashed, not the file
    read again. A file rewritten after its bytes were hashed (and checked against the manifest)
    cannot put other bytes under the manifest's hash: the object stored is the bytes hashed."""
    from ckptkeeper.storage import s3_upload

    tier, _ = cold
    hot_tier, manifest, ckpt = hot
    victim = ckpt / "shard-0" / "part-04.bin"
    hashed = victim.read_bytes()
    original = s3_upload._S3FileWriter.finish

    def finish_then_rewrite(self: Any) -> None:
        if self.key.endswith("part-04.bin"):
            data = bytearray(hashed)
            data[0] ^= 0xFF
            victim.write_bytes(bytes(data))  # same size, other bytes, before the PUT is sent
        original(self)

    monkeypatch.setattr(s3_upload._S3FileWriter, "finish", finish_then_rewrite)
    tier.copy_from(hot_tier, manifest)
    assert victim.read_bytes() != hashed
    key = next(k for k in _keys(s3_client, s3_bucket) if k.endswith("shard-0/part-04.bin"))
    assert s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == hashed
    assert tier.verify(manifest) == []
