"""Staging markers carry a heartbeat and a node (docs/design.md, "Many nodes"): nobody reaps another node's copy in
progress; uploads are matched to their marker by upload id, not by the store's start time (moto
reports a fixed one); a node never clears keys another node is copying to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, manifest_of, s3_tier, write_config

from ckptkeeper.core.model import Action, ActionKind, Artifact, TierPolicy, TierSpec
from ckptkeeper.core.ownership import without_others_litter
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage import LocalTierStorage, StorageError, TierStorage, s3_transfer

MiB = 2**20


def test_reaps_of_another_nodes_litter_are_dropped_with_a_note() -> None:
    arts = [
        Artifact("cold", "exp/c.ckptkeeper-tmp-1", "ckptkeeper-staging", 5, 0.0, "exp", node="node-a"),
        Artifact("cold", "exp/c/x", "multipart-upload", 5, 0.0, "exp", upload_id="u1", node="node-a"),
        Artifact("cold", "exp/d.ckptkeeper-tmp-2", "ckptkeeper-staging", 5, 0.0, "exp", node="node-b"),
        Artifact("cold", "exp/e.ckptkeeper-tmp-3", "ckptkeeper-staging", 5, 0.0, "exp"),
    ]
    reaps = [
        Action(ActionKind.REAP, "r", "exp", None, "cold", None, a.path, 5, a.kind, a.upload_id) for a in arts
    ]
    notes: list[str] = []
    kept = without_others_litter(reaps, arts, "node-b", notes)
    assert [a.path for a in kept] == ["exp/d.ckptkeeper-tmp-2", "exp/e.ckptkeeper-tmp-3"]
    assert len(notes) == 2 and all("of node node-a: not ours" in n for n in notes)


@pytest.fixture
def big_checkpoint(tmp_path: Path) -> tuple[LocalTierStorage, Any]:
    root = tmp_path / "hot"
    ckpt = root / "exp" / "checkpoint-100"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(os.urandom(12 * MiB))
    hot = LocalTierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True)
    return hot, manifest_of(root, "exp", 100)


def _cold(bucket: str, options: dict[str, Any], node: str) -> Any:
    tier = TierStorage(TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node=node))
    tier.part_size = 5 * MiB  # type: ignore[attr-defined]
    return tier


def _start_interrupted_copy(hot: LocalTierStorage, m: Any, cold: Any) -> Any:
    """A copy by ``cold``'s node that has sent two parts of a multipart upload and is still going."""
    sink = s3_transfer._S3Sink(cold, "exp/checkpoint-100", m, with_manifest=True)
    entry = m.files[0]
    reader = hot._open_read("exp/checkpoint-100", entry.path)
    writer = sink.open_file(entry, reader)
    writer.write(reader.read(11 * MiB))
    return sink, reader


def test_marker_records_its_uploads_and_the_upload_takes_the_markers_age(
    big_checkpoint: tuple[LocalTierStorage, Any],
    s3_bucket: str,
    s3_client: Any,
    s3_storage_options: dict[str, Any],
) -> None:
    hot, m = big_checkpoint
    cold = _cold(s3_bucket, s3_storage_options, "node-a")
    sink, reader = _start_interrupted_copy(hot, m, cold)
    try:
        upload_id = sink.writer.upload_id
        assert upload_id
        doc = json.loads(s3_client.get_object(Bucket=s3_bucket, Key=sink.marker)["Body"].read())
        assert doc["node"] == "node-a" and doc["uploads"] == [upload_id]
        marker_time = s3_client.head_object(Bucket=s3_bucket, Key=sink.marker)["LastModified"].timestamp()
        (upload,) = cold.list_multipart_uploads()
        assert upload.upload_id == upload_id and upload.node == "node-a"
        assert upload.last_write >= marker_time  # the marker's clock, whatever the store says of the upload
        (staging,) = cold.list_staging()
        assert staging.node == "node-a"
    finally:
        sink.writer.abort()
        sink.abort()
        reader.close()


def test_a_copy_refuses_keys_another_node_is_copying_to(
    big_checkpoint: tuple[LocalTierStorage, Any],
    s3_bucket: str,
    s3_client: Any,
    s3_storage_options: dict[str, Any],
) -> None:
    hot, m = big_checkpoint
    sink, reader = _start_interrupted_copy(hot, m, _cold(s3_bucket, s3_storage_options, "node-a"))
    try:
        before = s3_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
        with pytest.raises(StorageError, match="node node-a is copying to exp/checkpoint-100 too"):
            _cold(s3_bucket, s3_storage_options, "node-b").copy_from(hot, m)
        assert s3_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"] == before
        assert s3_client.head_object(Bucket=s3_bucket, Key=sink.marker)
    finally:
        sink.writer.abort()
        sink.abort()
        reader.close()


def test_another_node_with_a_short_partial_after_leaves_a_live_upload_alone(
    tmp_path: Path,
    big_checkpoint: tuple[LocalTierStorage, Any],
    s3_bucket: str,
    s3_client: Any,
    s3_reset: str,
    s3_storage_options: dict[str, Any],
) -> None:
    """The issue's case: node B (partial_after=1s) used to abort node A's multipart upload."""
    hot, m = big_checkpoint
    sink, reader = _start_interrupted_copy(hot, m, _cold(s3_bucket, s3_storage_options, "node-a"))
    try:
        home = tmp_path / "node-b"
        (home / "hot").mkdir(parents=True)
        cfg = write_config(
            home / "config.toml",
            index=home / "index.db",
            node="node-b",
            reaper={"partial_after": "1s"},
            tiers=[local_tier("hot", home / "hot"), s3_tier("cold", s3_bucket, s3_reset)],
        )
        time.sleep(1.5)  # A's marker is older than B's partial_after: B's reaper would take it
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        run = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(cfg), "prune", "--json"]
        dry = subprocess.run([*run, "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)
        assert plan["actions"] == []
        assert any("multipart-upload of node node-a: not ours" in n for n in plan["notes"]), plan["notes"]
        assert any("ckptkeeper-staging of node node-a: not ours" in n for n in plan["notes"]), plan["notes"]
        done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        assert [u["UploadId"] for u in uploads] == [sink.writer.upload_id]
        assert s3_client.head_object(Bucket=s3_bucket, Key=sink.marker)
        # and A's copy still completes
        sink.writer.write(reader.read())
        sink.writer.finish()
        sink.commit(m)
        assert STAGING_MARK not in json.dumps(
            [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
        )
    finally:
        sink.abort()
        reader.close()


@pytest.mark.parametrize(("heartbeat_ttl", "beat"), [("8s", 2.0), ("10m", 60.0), ("1h", 60.0)])
def test_a_copy_beats_several_times_within_the_ttl_others_judge_it_by(
    tmp_path: Path, s3_bucket: str, s3_reset: str, heartbeat_ttl: str, beat: float
) -> None:
    """A lease holder discards a marker silent for ``fleet.heartbeat_ttl``; the copy rewrites it
    every 60 s, so a TTL under a minute let the holder take a live copy for an abandoned one (the
    50-node stress ran with 5 s). The marker now beats at least four times per TTL."""
    from ckptkeeper.config import load_settings

    (tmp_path / "hot").mkdir()
    cfg = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        node="node-a",
        fleet={"heartbeat_ttl": heartbeat_ttl},
        tiers=[local_tier("hot", tmp_path / "hot"), {**s3_tier("cold", s3_bucket, s3_reset), "shared": True}],
    )
    settings = load_settings(str(cfg))
    cold = TierStorage(settings.tiers[1].to_spec())
    assert cold.marker_beat == beat  # type: ignore[attr-defined]
    ckpt = tmp_path / "hot" / "exp" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(os.urandom(1000))
    sink = s3_transfer._S3Sink(
        cold, "exp/checkpoint-1", manifest_of(tmp_path / "hot", "exp", 1), with_manifest=True
    )  # type: ignore[arg-type]
    try:
        assert sink.beat_every == beat <= settings.fleet.heartbeat_ttl / 4
    finally:
        sink.abort()
