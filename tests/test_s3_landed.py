"""An S3 copy checks that its objects landed, at their sizes, before its manifest commits it:
with one listing of the checkpoint's prefix instead of a HEAD per object (bench/prune_e2e.py,
issue 17), and without trusting a listing that lags the writes. Real moto server over HTTP."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from builders import manifest_of
from builders import tier as spec
from faultproxy import FaultProxy, Request

from ckptkeeper import storage
from ckptkeeper.core.model import Manifest
from ckptkeeper.storage import TierStorage, VerificationError, s3_transfer


@dataclass
class Hot:
    tier: TierStorage
    ckpt_dir: Manifest


@pytest.fixture
def hot(tmp_path: Path) -> Hot:
    """A hot tier with one directory checkpoint of four small files (each one PUT)."""
    root = tmp_path / "hot"
    d = root / "run1" / "checkpoint-100"
    (d / "sub" / "optim").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(300 * 1024))
    (d / "trainer_state.json").write_text('{"global_step": 100}')
    (d / "empty.bin").write_bytes(b"")
    (d / "sub" / "optim" / "shard-0.pt").write_bytes(os.urandom(4096))
    manifest = manifest_of(root, "run1", 100, layout="test", created_at=1_700_000_000.0, node="test-node")
    return Hot(TierStorage(spec("hot", str(root)), hot=True), manifest)


@dataclass
class Cold:
    tier: storage.S3TierStorage
    raw: S3Raw


class S3Raw:
    """The bucket under the tier's prefix, through a plain boto3 client (behind the tier's back)."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def put(self, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + rel, Body=data)

    def remove(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + rel)

    def keys(self) -> list[str]:
        resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix)
        return sorted(o["Key"][len(self.prefix) :] for o in resp.get("Contents", []))


@pytest.fixture
def cold_raw(s3_bucket: str, s3_storage_options: dict[str, Any], s3_client: Any) -> Cold:
    tier = TierStorage(spec("cold", f"s3://{s3_bucket}/cold/ckpt", storage_options=s3_storage_options))
    assert isinstance(tier, storage.S3TierStorage)
    return Cold(tier, S3Raw(s3_client, s3_bucket, "cold/ckpt/"))


def _lose_before_commit(monkeypatch: pytest.MonkeyPatch, damage: Any) -> None:
    """Run ``damage()`` after every file was uploaded and before the copy's own check + commit:
    an object lost or replaced behind the copy's back in that window."""
    original = s3_transfer._S3Sink._check_landed

    def check_landed(self: Any) -> None:
        damage()
        original(self)

    monkeypatch.setattr(s3_transfer._S3Sink, "_check_landed", check_landed)


def test_s3_object_lost_before_the_commit_fails_the_copy(
    cold_raw: Cold, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lose_before_commit(monkeypatch, lambda: cold_raw.raw.remove("run1/checkpoint-100/sub/optim/shard-0.pt"))
    with pytest.raises(VerificationError, match=r"shard-0\.pt: object missing right after upload"):
        cold_raw.tier.copy_from(hot.tier, hot.ckpt_dir)
    assert cold_raw.tier.list_manifests() == []  # never committed ...
    assert cold_raw.raw.keys() == []  # ... and the copy's own objects and marker cleaned up


def test_s3_object_of_another_size_before_the_commit_fails_the_copy(
    cold_raw: Cold, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lose_before_commit(
        monkeypatch, lambda: cold_raw.raw.put("run1/checkpoint-100/trainer_state.json", b"{}")
    )
    with pytest.raises(VerificationError, match=r"trainer_state\.json: store holds 2 bytes, expected"):
        cold_raw.tier.copy_from(hot.tier, hot.ckpt_dir)
    assert cold_raw.tier.list_manifests() == []


def test_s3_copy_checks_its_objects_with_one_listing_and_trusts_no_lagging_listing(
    cold_raw: Cold, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = cold_raw.tier
    assert isinstance(cold, storage.S3TierStorage)
    calls: list[tuple[str, str]] = []
    real_call = cold._call

    def recording_call(method: str, **kwargs: Any) -> Any:
        calls.append((method, kwargs.get("Key", kwargs.get("Prefix", ""))))
        return real_call(method, **kwargs)

    monkeypatch.setattr(cold, "_call", recording_call)
    cold.copy_from(hot.tier, hot.ckpt_dir)
    data = [f"cold/ckpt/run1/checkpoint-100/{e.path}" for e in hot.ckpt_dir.files]
    assert not [c for c in calls if c[0] == "head_object" and c[1] in data]  # no HEAD per object
    assert ("list_objects_v2", "cold/ckpt/run1/checkpoint-100/") in calls
    assert cold.recheck(hot.ckpt_dir) == [] and cold.verify(hot.ckpt_dir) == []

    # A store whose listing lags its writes: each object is then asked about on its own.
    cold.delete("run1/checkpoint-100")
    calls.clear()
    real_list = cold._list_objects
    monkeypatch.setattr(
        cold, "_list_objects", lambda prefix: [] if prefix.endswith("checkpoint-100/") else real_list(prefix)
    )
    cold.copy_from(hot.tier, hot.ckpt_dir)
    assert sorted(c[1] for c in calls if c[0] == "head_object" and c[1] in data) == sorted(data)
    monkeypatch.setattr(cold, "_list_objects", real_list)
    assert cold.recheck(hot.ckpt_dir) == [] and cold.verify(hot.ckpt_dir) == []


# --------------------------------------------------------------------------------------------
# one S3 client per tier in a process (a prune opened four before): never a stale view


def test_storages_of_one_tier_share_a_client_and_never_see_a_stale_listing(
    cold_raw: Cold,
    hot: Hot,
    s3_bucket: str,
    s3_storage_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = TierStorage(spec("cold", f"s3://{s3_bucket}/cold/ckpt", storage_options=s3_storage_options))
    assert isinstance(other, storage.S3TierStorage)
    assert other.fs is cold_raw.tier.fs
    assert other.list_manifests() == []
    cold_raw.tier.copy_from(hot.tier, hot.ckpt_dir)
    assert [rel for rel, _, _ in other.list_manifests()] == ["run1/checkpoint-100"]
    cold_raw.raw.remove("run1/checkpoint-100.ckptkeeper-manifest.json")  # behind both tiers' back
    assert other.list_manifests() == []

    # another tier name, other options or another AWS environment: a client of its own
    renamed = TierStorage(spec("cold2", f"s3://{s3_bucket}/cold/ckpt", storage_options=s3_storage_options))
    assert isinstance(renamed, storage.S3TierStorage) and renamed.fs is not cold_raw.tier.fs
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    fresh = TierStorage(spec("cold", f"s3://{s3_bucket}/cold/ckpt", storage_options=s3_storage_options))
    assert isinstance(fresh, storage.S3TierStorage) and fresh.fs is not cold_raw.tier.fs
    assert fresh.list_manifests() == []


# --------------------------------------------------------------------------------------------
# the survivor re-check before a delete: the manifest and one listing, HEADs only for what the
# listing does not show as expected


@pytest.fixture
def proxied_cold(s3_reset: str, s3_bucket: str, s3_client: Any) -> Iterator[tuple[Cold, FaultProxy]]:
    """The cold tier through a fault proxy (no random faults: rules only), to see and bend requests."""
    with FaultProxy(s3_reset, rate=0.0) as proxy:
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        tier = TierStorage(spec("cold", f"s3://{s3_bucket}/cold/ckpt", storage_options=options))
        assert isinstance(tier, storage.S3TierStorage)
        yield Cold(tier, S3Raw(s3_client, s3_bucket, "cold/ckpt/")), proxy


def _recording(seen: list[tuple[str, str]]) -> Any:
    def rule(request: Request) -> None:
        seen.append((request.method, request.target))
        return None

    return rule


def _hiding_every_other_entry(request: Request) -> Any:
    """A listing that lags the writes: half its entries missing, no error, no truncation flag."""
    if request.method != "GET" or "list-type=2" not in request.query:
        return None

    def cut(body: bytes) -> bytes:
        for entry in re.findall(rb"<Contents>.*?</Contents>", body, re.S)[::2]:
            body = body.replace(entry, b"")
        return body

    return cut


def test_s3_recheck_is_one_get_and_one_listing_and_heads_only_what_a_listing_hides(
    proxied_cold: tuple[Cold, FaultProxy], hot: Hot
) -> None:
    cold, proxy = proxied_cold
    cold.tier.copy_from(hot.tier, hot.ckpt_dir)
    seen: list[tuple[str, str]] = []
    proxy.rules.append(_recording(seen))
    assert cold.tier.recheck(hot.ckpt_dir) == []
    assert sorted(m for m, _ in seen) == ["GET", "GET"]  # the manifest, one listing
    assert [t for m, t in seen if "list-type=2" in t and "checkpoint-100%2F" in t]
    assert not [m for m, _ in seen if m == "HEAD"]

    # A lagging listing: each object it does not show is asked about on its own; no false verdict.
    seen.clear()
    proxy.rules.insert(0, _hiding_every_other_entry)
    assert cold.tier.recheck(hot.ckpt_dir) == []
    heads = sorted(t.split("?")[0] for m, t in seen if m == "HEAD")
    assert len(heads) == 2 and all("/cold/ckpt/run1/checkpoint-100/" in h for h in heads)


@pytest.mark.parametrize("hide", [False, True], ids=["listed", "listing-lags"])
def test_s3_recheck_reports_an_object_gone_or_of_another_size(
    proxied_cold: tuple[Cold, FaultProxy], hot: Hot, hide: bool
) -> None:
    cold, proxy = proxied_cold
    cold.tier.copy_from(hot.tier, hot.ckpt_dir)
    if hide:
        proxy.rules.append(_hiding_every_other_entry)
    cold.raw.remove("run1/checkpoint-100/sub/optim/shard-0.pt")
    cold.raw.put("run1/checkpoint-100/model.safetensors", b"short")
    problems = cold.tier.recheck(hot.ckpt_dir)
    assert any("sub/optim/shard-0.pt" in p and "missing" in p for p in problems), problems
    assert any("model.safetensors: size 5 != " in p for p in problems), problems
    cold.raw.remove("run1/checkpoint-100.ckptkeeper-manifest.json")
    assert cold.tier.recheck(hot.ckpt_dir) == ["run1/checkpoint-100: no committed copy (manifest missing)"]


def test_s3_listing_times_are_those_boto3_reads(cold_raw: Cold, hot: Hot) -> None:
    cold_raw.tier.copy_from(hot.tier, hot.ckpt_dir)
    ours = {k: when for k, _, when in cold_raw.tier._target_objects("cold/ckpt/run1/checkpoint-100")}
    resp = cold_raw.raw.client.list_objects_v2(Bucket=cold_raw.raw.bucket, Prefix="cold/ckpt/run1/")
    theirs = {o["Key"]: o["LastModified"].timestamp() for o in resp["Contents"] if o["Key"] in ours}
    assert ours == theirs and len(ours) == len(hot.ckpt_dir.files)
