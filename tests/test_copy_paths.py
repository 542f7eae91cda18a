"""The local copy loop's fast paths (bench/, issue 8) keep the copy exact and durable.

``copy_from`` reads into one reused buffer, starts writeback every ``WRITEBACK_WINDOW`` bytes and
fsyncs files at commit, at most ``_MAX_UNSYNCED_FILES`` pending at once: these tests cross each
of those boundaries and compare the copy byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from builders import manifest_of, tier

from ckptkeeper.storage import S3TierStorage, TierStorage, VerificationError, localfs
from ckptkeeper.util import hashing


def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, TierStorage, Path, TierStorage]:
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    warm.mkdir()
    return (
        hot,
        TierStorage(tier("hot", str(hot)), hot=True),
        warm,
        TierStorage(tier("warm", str(warm))),
    )


def test_many_files_more_than_the_unsynced_limit(tiers: tuple[Path, TierStorage, Path, TierStorage]) -> None:
    hot, hot_tier, warm, warm_tier = tiers
    ckpt = hot / "run" / "ckpt"
    for i in range(localfs._MAX_UNSYNCED_FILES * 2 + 3):
        (ckpt / f"d{i % 5}").mkdir(parents=True, exist_ok=True)
        (ckpt / f"d{i % 5}" / f"shard-{i}.distcp").write_bytes(os.urandom(i * 97))
    manifest = manifest_of(hot, "run", 1, name="ckpt", layout="test")
    fds_before = len(os.listdir("/proc/self/fd"))
    warm_tier.copy_from(hot_tier, manifest)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every descriptor closed
    assert _tree(warm / "run" / "ckpt") == _tree(ckpt)
    assert warm_tier.verify(manifest) == []


def test_large_file_crosses_writeback_windows_and_chunks(
    tiers: tuple[Path, TierStorage, Path, TierStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    hot, hot_tier, warm, warm_tier = tiers
    monkeypatch.setattr(localfs, "WRITEBACK_WINDOW", 3 * hashing.CHUNK_SIZE + 1)
    ckpt = hot / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(10 * hashing.CHUNK_SIZE + 12345))
    (ckpt / "config.json").write_text("{}")
    manifest = manifest_of(hot, "run", 1, name="ckpt", layout="test")
    restored = hot_tier.fetch(manifest, warm / "restore")  # fetch shares the loop
    warm_tier.copy_from(hot_tier, manifest)
    assert _tree(warm / "run" / "ckpt") == _tree(ckpt) == _tree(restored)


def test_a_changed_source_still_aborts_with_pending_files(
    tiers: tuple[Path, TierStorage, Path, TierStorage],
) -> None:
    hot, hot_tier, warm, warm_tier = tiers
    ckpt = hot / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    for i in range(5):
        (ckpt / f"a{i}.bin").write_bytes(os.urandom(1000))
    manifest = manifest_of(hot, "run", 1, name="ckpt", layout="test")
    (ckpt / "a4.bin").write_bytes(os.urandom(1000))  # same size, other content
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(VerificationError):
        warm_tier.copy_from(hot_tier, manifest)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert not (warm / "run" / "ckpt").exists()
    assert warm_tier.list_staging() == []


def test_s3_parts_reuse_buffers_across_files_and_stay_exact(
    tiers: tuple[Path, TierStorage, Path, TierStorage], s3_bucket: str, s3_reset: str, tmp_path: Path
) -> None:
    """Part buffers come from one pool per copy: reused across parts and files, never mixed up."""
    hot, hot_tier, _, _ = tiers
    ckpt = hot / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    MiB = 2**20
    for i, size in enumerate((11 * MiB + 7, 5 * MiB, 3, 0, 10 * MiB)):  # multipart, exact part, tiny, empty
        (ckpt / f"shard-{i}.pt").write_bytes(os.urandom(size))
    manifest = manifest_of(hot, "run", 1, name="ckpt", layout="test")
    cold = TierStorage(tier("cold", f"s3://{s3_bucket}/cold", storage_options={"endpoint_url": s3_reset}))
    assert isinstance(cold, S3TierStorage)
    cold.part_size = 5 * MiB
    cold.max_inflight = 2
    cold.copy_from(hot_tier, manifest)
    assert cold.verify(manifest) == []
    restored = cold.fetch(manifest, tmp_path / "restore")
    assert _tree(restored) == _tree(ckpt)
