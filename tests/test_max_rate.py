"""Per-tier ``max_rate`` (docs/bandwidth.md): every copy into or out of a capped tier takes its bytes
from one token bucket per tier per process. The throttle's accounting is asserted (the sleeps it
asks for, on an injected clock), never wall time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptkeeper.config import settings_from_mapping
from ckptkeeper.core import preflight as pf
from ckptkeeper.core.model import FileEntry, Manifest, TierPolicy, TierSpec
from ckptkeeper.storage import LocalTierStorage, ratelimit
from ckptkeeper.util.hashing import hash_file
from ckptkeeper.util.throttle import TokenBucket

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
QUICK_4MIB = ("--quick", "--size", "4MiB", "--every", "10m")


class FakeTime:
    """A clock that moves only when the throttle sleeps: what it asks for is all that passes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.sleeps.append(seconds)
            self.now += seconds


@pytest.fixture(autouse=True)
def _fresh_buckets() -> Iterator[None]:
    ratelimit.reset()
    yield
    ratelimit.reset()


def _tiers(
    tmp_path: Path, *, hot_rate: int | None, warm_rate: int | None
) -> tuple[LocalTierStorage, LocalTierStorage]:
    hot_root, warm_root = tmp_path / "hot", tmp_path / "warm"
    hot_root.mkdir()
    warm_root.mkdir()
    hot = LocalTierStorage(TierSpec("hot", str(hot_root), TierPolicy(), max_rate=hot_rate), hot=True)
    warm = LocalTierStorage(TierSpec("warm", str(warm_root), TierPolicy(), max_rate=warm_rate))
    return hot, warm


def _checkpoint(root: Path, name: str, sizes: dict[str, int]) -> Manifest:
    ckpt = root / "run" / name
    ckpt.mkdir(parents=True)
    entries = []
    for file, size in sizes.items():
        (ckpt / file).write_bytes(os.urandom(size))
        got, digest = hash_file(ckpt / file)
        entries.append(FileEntry(file, got, digest))
    return Manifest(run="run", step=1, name=name, layout="hf", is_dir=True, files=tuple(entries))


def test_a_capped_copy_moves_every_byte_and_sleeps_bytes_over_rate(tmp_path: Path) -> None:
    rate = 2 * MiB
    hot, warm = _tiers(tmp_path, hot_rate=None, warm_rate=rate)
    fake = FakeTime()
    bucket = TokenBucket(rate, clock=fake.clock, sleep=fake.sleep)
    ratelimit.install(warm.spec, bucket)
    manifest = _checkpoint(tmp_path / "hot", "ckpt-1", {"a.bin": 7 * MiB, "b.bin": 3 * MiB + 17})

    warm.copy_from(hot, manifest)

    total = manifest.total_bytes
    assert warm.verify(manifest) == []  # every byte, re-hashed
    assert bucket.consumed == total
    # The bucket starts full (one second's worth): the rest is paid for by sleeping.
    assert sum(fake.sleeps) == pytest.approx((total - rate) / rate)
    assert fake.now >= (total - rate) / rate  # as slow as the cap says, on the throttle's clock


def test_a_copy_between_two_capped_tiers_keeps_to_both(tmp_path: Path) -> None:
    hot, warm = _tiers(tmp_path, hot_rate=1 * MiB, warm_rate=4 * MiB)
    fake = FakeTime()
    slow = TokenBucket(1 * MiB, clock=fake.clock, sleep=fake.sleep)
    fast = TokenBucket(4 * MiB, clock=fake.clock, sleep=fake.sleep)
    ratelimit.install(hot.spec, slow)
    ratelimit.install(warm.spec, fast)
    manifest = _checkpoint(tmp_path / "hot", "ckpt-2", {"w.bin": 5 * MiB})

    warm.copy_from(hot, manifest)

    assert slow.consumed == fast.consumed == manifest.total_bytes
    assert fake.now == pytest.approx((manifest.total_bytes - 1 * MiB) / MiB)  # the lower cap rules
    assert warm.verify(manifest) == []


def test_threads_share_one_bucket_per_tier(tmp_path: Path) -> None:
    """Two copies into the same capped tier at once: together they keep to its rate."""
    rate = 1 * MiB
    hot, warm = _tiers(tmp_path, hot_rate=None, warm_rate=rate)
    assert ratelimit.tier_bucket(warm.spec) is ratelimit.tier_bucket(warm.spec)
    fake = FakeTime()
    bucket = TokenBucket(rate, clock=fake.clock, sleep=fake.sleep)
    ratelimit.install(warm.spec, bucket)
    manifests = [_checkpoint(tmp_path / "hot", f"ckpt-{i}", {"w.bin": 2 * MiB}) for i in range(2)]
    threads = [threading.Thread(target=warm.copy_from, args=(hot, m)) for m in manifests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(m.total_bytes for m in manifests)
    assert bucket.consumed == total
    assert bucket.slept == pytest.approx((total - rate) / rate)
    assert all(warm.verify(m) == [] for m in manifests)


def test_an_uncapped_tier_has_no_bucket(tmp_path: Path) -> None:
    hot, _ = _tiers(tmp_path, hot_rate=None, warm_rate=None)
    assert ratelimit.tier_bucket(hot.spec) is None


def test_max_rate_is_parsed_with_units() -> None:
    settings = settings_from_mapping(
        {
            "index": "/tmp/i.db",
            "tiers": [{"name": "hot", "url": "/x"}, {"name": "w", "url": "/y", "max_rate": "200MiB"}],
        }
    )
    assert settings.tier_specs()[1].max_rate == 200 * MiB
    assert settings.tier_specs()[0].max_rate is None


@pytest.mark.parametrize("bad", ["'fast'", "0", "'-5MiB'", "true", "'12 parsecs'"])
def test_a_bad_max_rate_exits_2_naming_the_key(tmp_path: Path, bad: str) -> None:
    cfg = tmp_path / "ckptkeeper.toml"
    cfg.write_text(
        f"index = '{tmp_path / 'index.db'}'\n[[tiers]]\nname='hot'\nurl='{tmp_path}'\n"
        f"[[tiers]]\nname='warm'\nurl='{tmp_path / 'w'}'\nmax_rate={bad}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(cfg), "ls"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "tiers[1].max_rate" in result.stderr
    assert "Traceback" not in result.stderr


def test_preflight_predicts_with_the_lower_of_measured_and_max_rate() -> None:
    measured = {"hot_write": 900.0, "warm_move": 500.0, "cold_upload": 300.0, "restore": None}
    got = pf.capped_rates(measured, {"warm_move": [None, 200], "cold_upload": [400, None], "restore": [10]})
    assert got == {"hot_write": 900.0, "warm_move": 200.0, "cold_upload": 300.0, "restore": None}


def test_preflight_reports_throughput_no_faster_than_max_rate(tmp_path: Path) -> None:
    """A 4 MiB sample fits in the cap's one-second burst and copies at disk speed; what a real save
    moves at, and what the preflight reports and predicts with, is the cap."""
    import json

    from builders import local_tier, write_config

    hot, warm, cold = tmp_path / "hot", tmp_path / "warm", tmp_path / "cold"
    for d in (hot, warm, cold):
        d.mkdir()
    cfg = write_config(
        tmp_path / "ckptkeeper.toml",
        index=tmp_path / "index.db",
        tiers=[
            local_tier("hot", hot, keep_last=1),
            local_tier("warm", warm, keep_last=4, max_rate="4MiB"),
            local_tier("cold", cold, keep_last=8, max_rate="6MiB"),
        ],
        daemon={"metrics_addr": ""},
    )
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(cfg), "preflight", "--json", *QUICK_4MIB],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode in (0, 5, 6), result.stderr
    doc = json.loads(result.stdout)
    assert doc["throughput"]["warm_move"] == 4 * MiB
    assert doc["throughput"]["cold_upload"] == 6 * MiB
    assert doc["throughput"]["restore"] > 0  # a restore is not capped: the job waits for it
    assert doc["rpo_seconds"] == pytest.approx(4 * MiB / (6 * MiB), abs=0.001)
