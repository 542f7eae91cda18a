"""`ckptkeeper preflight`: the checks as pure functions (table-driven), and the command as a user
runs it — a subprocess with a config file — on local tiers and on moto, through a fault proxy
that drops conditional-write headers or throttles uploads, and killed with SIGKILL mid-run.

Every end-to-end test also asserts that the scratch run is gone from every tier afterwards and
that the user's runs are untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from faultproxy import FaultProxy, Request
from hypothesis import given
from hypothesis import strategies as st
from layout_fixtures import make_hf

from ckptkeeper.core import preflight as pf
from ckptkeeper.core.model import TierPolicy

# --------------------------------------------------------------------------------------------
# pure decisions


def test_scratch_names_round_trip_and_only_dead_ones_of_this_node_are_stale() -> None:
    run = pf.scratch_run("gpu-node-7.cluster", 4242)
    assert run == ".ckptkeeper-preflight-gpu-node-7.cluster-4242"
    assert pf.is_scratch_run(run) and pf.is_scratch_run(run + "/preflight-1")
    assert pf.scratch_owner(run) == ("gpu-node-7.cluster", 4242)
    assert pf.stale_scratch(run, "gpu-node-7.cluster", 1)
    assert not pf.stale_scratch(run, "gpu-node-7.cluster", 4242)  # our own, running
    assert not pf.stale_scratch(run, "gpu-node-8", 1)  # another node's: theirs to sweep
    for user_run in ("my-run", ".ckptkeeper", "ckptkeeper-preflight-x-1", ".ckptkeeper-preflight-x-y"):
        assert not pf.stale_scratch(user_run, "x", 1)
    assert not pf.is_scratch_run("my-run")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("4KiB", 4096),
        ("512M", 512 << 20),
        ("1.5g", 3 << 29),
        ("2TiB", 2 << 40),
        ("10 GB", 10 << 30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert pf.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "0", "1XB", "lots", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        pf.parse_size(text)


@given(st.integers(min_value=1, max_value=1 << 40))
def test_synthetic_shape_adds_up_to_the_save_size(size: int) -> None:
    shape = pf.synthetic_shape(size)
    assert sum(n for _, n in shape) == size
    assert len({name for name, _ in shape}) == len(shape)
    assert all(n >= 0 for _, n in shape)


@pytest.mark.parametrize(
    ("size", "rate", "every", "status"),
    [
        (100, 10.0, 60.0, "pass"),  # 10 s of 60
        (100, 2.0, 60.0, "warn"),  # 50 s: over 80 %
        (100, 1.0, 60.0, "fail"),  # 100 s > 60 s
        (100, 0.0, 60.0, "fail"),
    ],
)
def test_rpo(size: int, rate: float, every: float, status: str) -> None:
    check, rpo = pf.check_rpo(size, rate, every, "tiers[2].url")
    assert check.status == status
    assert rpo == (size / rate if rate else float("inf"))
    if status == "fail":
        assert "tiers[2].url" in check.detail and "--every" in check.detail


def test_rpo_without_a_slower_tier_warns() -> None:
    check, rpo = pf.check_rpo(100, None, 60.0, "tiers[1].url")
    assert (check.status, rpo) == ("warn", None)


@pytest.mark.parametrize(
    ("kept", "total", "other", "hw", "free", "status"),
    [
        (2, 1000, 0, None, None, "pass"),  # 300 of 1000
        (2, 1000, 0, 0.3, None, "warn"),  # 300 of 300: no margin
        (2, 1000, 0, 0.25, None, "fail"),  # 300 > 250
        (2, 1000, 800, None, None, "fail"),  # others fill the disk
        (2, 1000, 0, None, 250, "fail"),  # the free space is what counts
        (None, 1000, 0, 0.8, None, "pass"),  # keep all, bounded by watermarks
        (None, 1000, 0, None, None, "warn"),  # keep all, unbounded
        (2, None, 0, None, None, "fail"),  # unreadable
    ],
)
def test_hot_capacity(
    kept: int | None, total: int | None, other: int, hw: float | None, free: int | None, status: str
) -> None:
    check = pf.check_hot_capacity(100, kept, total, other, hw, free)
    assert check.status == status, check.detail
    if status == "fail" and total is not None:
        assert "tiers[0].keep_last" in check.detail


def test_kept_saves_counts_the_policy() -> None:
    assert pf.kept_saves(TierPolicy(keep_last=2, keep_best=1, metric="loss"), 60.0) == 3
    assert pf.kept_saves(TierPolicy(keep_within=600.0), 60.0) == 10
    assert pf.kept_saves(TierPolicy(), 60.0) is None
    assert pf.kept_saves(TierPolicy(keep_daily=7), 60.0) == 7


@pytest.mark.parametrize(
    ("watches", "queued", "polling", "status"),
    [
        (100_000, 16384, False, "pass"),
        (2_000, 16384, False, "warn"),
        (1_000, 16384, False, "fail"),
        (100_000, 8192, False, "warn"),
        (100_000, 10, False, "fail"),
        (None, None, False, "warn"),
        (10, 10, True, "pass"),
    ],
)
def test_inotify(watches: int | None, queued: int | None, polling: bool, status: str) -> None:
    check = pf.check_inotify(watches, queued, 100, 8, polling)
    assert check.status == status, check.detail


@pytest.mark.parametrize(
    ("second", "error", "status"), [(412, None, "pass"), (200, None, "warn"), (None, "boom", "warn")]
)
def test_conditional_writes(second: int | None, error: str | None, status: str) -> None:
    assert pf.check_conditional_writes("cold", 2, second, error).status == status


@pytest.mark.parametrize(
    ("skew", "status"), [(0.0, "pass"), (-45.0, "warn"), (400.0, "fail"), (None, "warn")]
)
def test_clock_skew(skew: float | None, status: str) -> None:
    assert pf.check_clock_skew("cold", skew).status == status


def test_credentials_name_what_was_denied() -> None:
    assert pf.check_credentials("cold", 1, []).status == "pass"
    check = pf.check_credentials("cold", 1, ["delete (DeleteObjects: AccessDenied)"])
    assert check.status == "fail" and "delete" in check.detail and "tiers[1].storage_options" in check.detail


@pytest.mark.parametrize(
    ("series", "status"),
    [
        ({"hot_write": [100.0]}, "pass"),
        ({"hot_write": [100.0, 90.0, 80.0]}, "pass"),
        ({"hot_write": [100.0, 90.0, 50.0], "restore": [10.0, 10.0, 10.0]}, "warn"),
        ({"hot_write": [100.0, 120.0], "cold_upload": [100.0, 60.0]}, "warn"),
    ],
)
def test_throughput_drop(series: dict[str, list[float]], status: str) -> None:
    check = pf.check_throughput_drop(series, 0.3)
    assert check.status == status
    if status == "warn":
        assert "fell" in check.detail


def test_median_interval() -> None:
    assert pf.median_interval([0.0, 60.0, 120.0, 300.0]) == 60.0
    assert pf.median_interval([5.0]) is None


def test_verdict_is_the_worst_status() -> None:
    p, w, f = (pf.Check("x", s, "") for s in ("pass", "warn", "fail"))  # type: ignore[arg-type]
    assert pf.verdict([p, p]) == "pass"
    assert pf.verdict([p, w]) == "warn"
    assert pf.verdict([w, f, p]) == "fail"


# --------------------------------------------------------------------------------------------
# the command


def _cli(
    config: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _scratch_on_disk(*roots: Path) -> list[str]:
    return [str(p) for root in roots for p in root.rglob("*") if pf.SCRATCH_PREFIX in str(p)]


def _scratch_in_bucket(client: Any, bucket: str) -> list[str]:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return [k for k in keys + uploads if pf.SCRATCH_PREFIX in k]


class Node:
    """A node's tiers and config, with one user run already cataloged."""

    def __init__(
        self, tmp: Path, *, slower: list[dict[str, Any]], hot_policy: dict[str, Any] | None = None
    ) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir()
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "0s", "polling": True},  # inotify limits: unit-tested above
            tiers=[local_tier("hot", self.hot, **(hot_policy or {"keep_last": 2})), *slower],
        )
        make_hf(self.hot / "user-run", 10, eval_loss=1.0)
        assert _cli(self.config, "scan").returncode == 0
        self.user_before = _tree(self.hot / "user-run")

    def preflight(self, *args: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        result = _cli(self.config, "preflight", "--json", *args, **kw)
        assert result.returncode in (0, 5, 6), result.stderr
        return result.returncode, json.loads(result.stdout)

    def assert_untouched(self) -> None:
        assert _tree(self.hot / "user-run") == self.user_before
        ls = json.loads(_cli(self.config, "ls", "--json").stdout)
        assert [r["name"] for r in ls["runs"]] == ["user-run"]


def _checks(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in doc["checks"]}


def test_quick_on_local_tiers_passes_and_leaves_nothing(tmp_path: Path) -> None:
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    warm.mkdir()
    cold.mkdir()
    node = Node(
        tmp_path, slower=[local_tier("warm", warm, keep_last=4), local_tier("cold", cold, keep_last=8)]
    )
    code, doc = node.preflight("--quick", "--size", "8MiB", "--every", "10m")
    assert code == 0, doc["checks"]
    assert doc["sustainable"] is True
    assert set(doc["throughput"]) >= {"hot_write", "warm_move", "cold_upload", "restore"}
    assert all(doc["throughput"][k] > 0 for k in ("hot_write", "warm_move", "cold_upload", "restore"))
    # rpo_seconds is rounded to the millisecond in the JSON: a fast disk makes it a few ms
    expected_rpo = (8 << 20) / doc["throughput"]["cold_upload"]
    assert doc["rpo_seconds"] == pytest.approx(expected_rpo, rel=0.01, abs=0.0005)
    assert {"pipeline", "rpo", "hot_capacity", "warm_room", "cold_room", "inotify"} <= set(_checks(doc))
    assert all(c["status"] == "pass" for c in doc["checks"])
    assert _scratch_on_disk(node.hot, warm, cold) == []
    assert list(warm.iterdir()) == [] and list(cold.iterdir()) == []
    node.assert_untouched()


def test_text_output_is_a_table_with_the_verdict(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    result = _cli(node.config, "preflight", "--quick", "--size", "1MiB", "--every", "1h")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upload to cold" in result.stdout and "hot_capacity" in result.stdout
    assert "result  sustainable (exit 0)" in result.stdout


def test_hot_tier_too_small_for_the_policy_fails_naming_the_key(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)], hot_policy={"keep_last": 3})
    code, doc = node.preflight("--quick", "--size", "64TiB", "--every", "1h")
    assert code == 6
    assert doc["sustainable"] is False
    hot = _checks(doc)["hot_capacity"]
    assert hot["status"] == "fail"
    assert "tiers[0].keep_last" in hot["detail"] and "4 x 64.0 TiB" in hot["detail"]
    assert _checks(doc)["pipeline"]["status"] == "pass"  # measured on a sample, not 64 TiB
    assert _scratch_on_disk(node.hot, cold) == []
    node.assert_untouched()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    node = Node(tmp_path, slower=[])
    for args in (["--size", "lots"], ["--every", "soon"], ["--quick", "--duration", "1m"]):
        result = _cli(node.config, "preflight", *args)
        assert result.returncode == 2, (args, result.stderr)


@pytest.fixture
def proxies(s3_reset: str) -> Iterator[Callable[..., FaultProxy]]:
    started: list[FaultProxy] = []

    def make(**kw: Any) -> FaultProxy:
        proxy = FaultProxy(s3_reset, rate=0.0, **kw)
        proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


def _s3_node(tmp_path: Path, bucket: str, endpoint: str) -> Node:
    warm = tmp_path / "warm"
    warm.mkdir()
    return Node(
        tmp_path,
        slower=[local_tier("warm", warm, keep_last=4), s3_tier("cold", bucket, endpoint, keep_last=8)],
    )


def test_quick_on_moto_passes_every_store_check(
    tmp_path: Path, s3_bucket: str, s3_reset: str, s3_client: Any
) -> None:
    node = _s3_node(tmp_path, s3_bucket, s3_reset)
    code, doc = node.preflight("--quick", "--size", "8MiB", "--every", "10m")
    checks = _checks(doc)
    assert code == 0, doc["checks"]
    for name in ("cold_credentials", "cold_conditional_writes", "cold_list_multipart", "cold_clock_skew"):
        assert checks[name]["status"] == "pass", checks[name]
    assert "412" in checks["cold_conditional_writes"]["detail"]
    assert doc["throughput"]["cold_upload"] > 0 and doc["rpo_seconds"] > 0
    assert _scratch_in_bucket(s3_client, s3_bucket) == []
    assert _scratch_on_disk(node.hot, tmp_path / "warm") == []
    node.assert_untouched()


def test_store_ignoring_conditional_writes_warns(
    tmp_path: Path, s3_bucket: str, s3_client: Any, proxies: Callable[..., FaultProxy]
) -> None:
    proxy = proxies(drop_headers=("If-None-Match",))
    node = _s3_node(tmp_path, s3_bucket, proxy.url)
    code, doc = node.preflight("--quick", "--size", "4MiB", "--every", "10m")
    check = _checks(doc)["cold_conditional_writes"]
    assert code == 5, doc["checks"]
    assert check["status"] == "warn" and "not 412" in check["detail"] and "tiers[2].url" in check["detail"]
    assert doc["sustainable"] is True
    assert _scratch_in_bucket(s3_client, s3_bucket) == []
    node.assert_untouched()


def test_cold_too_slow_for_the_interval_fails_with_the_rpo(
    tmp_path: Path, s3_bucket: str, s3_client: Any, proxies: Callable[..., FaultProxy]
) -> None:
    def throttle(request: Request) -> Callable[[bytes], bytes] | None:
        if request.method != "PUT" or "/preflight-" not in request.target:
            return None  # only the synthetic save's upload is slow

        def slowly(data: bytes) -> bytes:
            time.sleep(1.0)  # a lower bound on the upload time: more load only makes it slower
            return data

        return slowly

    proxy = proxies(rules=[throttle])
    node = _s3_node(tmp_path, s3_bucket, proxy.url)
    code, doc = node.preflight("--quick", "--size", "4MiB", "--every", "1s")
    rpo = _checks(doc)["rpo"]
    assert code == 6, doc["checks"]
    assert rpo["status"] == "fail" and "longer than the 1.0s interval" in rpo["detail"]
    assert doc["rpo_seconds"] > 1.0 and doc["sustainable"] is False
    assert _scratch_in_bucket(s3_client, s3_bucket) == []
    assert _scratch_on_disk(node.hot, tmp_path / "warm") == []
    node.assert_untouched()


@pytest.mark.parametrize("crash_after", [2, 5])
def test_kill_9_mid_preflight_then_one_prune_leaves_no_scratch(
    tmp_path: Path, s3_bucket: str, s3_reset: str, s3_client: Any, crash_after: int
) -> None:
    node = _s3_node(tmp_path, s3_bucket, s3_reset)
    killed = _cli(
        node.config,
        "preflight",
        "--quick",
        "--size",
        "20MiB",
        "--every",
        "10m",
        extra_env={"CKPTKEEPER_TEST_CRASH_AFTER": str(crash_after)},
    )
    assert killed.returncode == -9, killed.stderr
    left = _scratch_on_disk(node.hot, tmp_path / "warm") + _scratch_in_bucket(s3_client, s3_bucket)
    assert left, "the crash point was reached before anything was written"
    if crash_after == 5:  # killed mid-upload: the store holds a staging marker and partial data
        assert _scratch_in_bucket(s3_client, s3_bucket)
    pruned = _cli(node.config, "prune")
    assert pruned.returncode == 0, pruned.stderr
    assert _scratch_on_disk(node.hot, tmp_path / "warm") == []
    assert _scratch_in_bucket(s3_client, s3_bucket) == []
    node.assert_untouched()


def test_a_later_preflight_sweeps_a_dead_ones_scratch(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    killed = _cli(
        node.config, "preflight", "--quick", "--size", "4MiB", extra_env={"CKPTKEEPER_TEST_CRASH_AFTER": "2"}
    )
    assert killed.returncode == -9
    assert _scratch_on_disk(node.hot, cold)
    code, doc = node.preflight("--quick", "--size", "4MiB", "--every", "1h")
    assert code == 0, doc["checks"]
    assert _scratch_on_disk(node.hot, cold) == []
    node.assert_untouched()


def test_size_and_interval_default_from_the_newest_run(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    ls = json.loads(_cli(node.config, "ls", "--json").stdout)
    newest = ls["runs"][0]["checkpoints"][-1]["bytes"]
    code, doc = node.preflight("--quick")
    assert (doc["size"], doc["every"]) == (newest, pf.DEFAULT_EVERY)  # one save: no interval yet
    assert doc["sample_bytes"] == newest
    assert code == 0, doc["checks"]
    assert _scratch_on_disk(node.hot, cold) == []


def test_duration_repeats_the_pipeline_and_watches_throughput(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    code, doc = node.preflight("--size", "1MiB", "--every", "1h", "--duration", "2s")
    assert len(doc["rounds"]) >= 2
    assert all(r["hot_write"] > 0 and r["cold_upload"] > 0 and r["restore"] > 0 for r in doc["rounds"])
    stability = _checks(doc)["throughput_stability"]
    assert f"{len(doc['rounds'])} rounds" in stability["detail"]
    assert code in (0, 5)  # a drop on a loaded box is a warning, never a failure
    assert _scratch_on_disk(node.hot, cold) == []
    node.assert_untouched()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("120", 120.0),
        ("5min", 300.0),
        ("1h 30s", 3630.0),
        ("90s", 90.0),
        ("500ms", 0.5),
        ("infinity", None),
        ("", None),
        ("soon", None),
    ],
)
def test_parse_timespan(text: str, seconds: float | None) -> None:
    assert pf.parse_timespan(text) == seconds


@pytest.mark.parametrize(
    ("stop", "step", "status"),
    [(120.0, 60.0, "pass"), (120.0, 600.0, "warn"), (None, 1e6, "pass"), (120.0, None, "pass")],
)
def test_systemd_stop_timeout_vs_the_longest_step(
    stop: float | None, step: float | None, status: str
) -> None:
    check = pf.check_service({"WatchdogSec": 60.0, "TimeoutStopSec": stop}, True, step)
    assert check.status == status, check.detail
    if status == "warn":
        assert "TimeoutStopSec=" in check.detail and "10.0m" in check.detail


def test_throughput_drop_says_when_stages_were_too_quick_to_watch() -> None:
    check = pf.check_throughput_drop({}, 0.3, rounds=5)
    assert check.status == "pass" and "5 rounds" in check.detail and "too quick" in check.detail


def test_a_dead_preflights_committed_copy_is_never_cataloged(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    # one 1 KiB file: crash points 1 journaled, 2 progress, 3 committed -> killed with the cold copy
    # committed (manifest beside it) but not yet recorded or removed
    killed = _cli(
        node.config, "preflight", "--quick", "--size", "1KiB", extra_env={"CKPTKEEPER_TEST_CRASH_AFTER": "3"}
    )
    assert killed.returncode == -9
    manifests = [p for p in cold.rglob("*.ckptkeeper-manifest.json") if pf.SCRATCH_PREFIX in str(p)]
    assert manifests, "expected a committed scratch copy in the cold tier"
    assert _cli(node.config, "scan").returncode == 0
    node.assert_untouched()  # ls shows the user's run only
    status = json.loads(_cli(node.config, "status", "--json").stdout)
    assert {t["name"]: t["checkpoints"] for t in status["tiers"]}["cold"] == 0
    assert _cli(node.config, "prune").returncode == 0
    assert _scratch_on_disk(node.hot, cold) == []


def test_a_dead_preflights_copy_is_no_proof_of_a_lost_index(tmp_path: Path) -> None:
    """A missing index over tiers holding this node's copies is rebuilt with deletes held; a dead
    preflight's scratch copy is not such a copy (it is swept), so a first start stays a first start."""
    cold = tmp_path / "cold"
    cold.mkdir()
    node = Node(tmp_path, slower=[local_tier("cold", cold, keep_last=8)])
    killed = _cli(
        node.config, "preflight", "--quick", "--size", "1KiB", extra_env={"CKPTKEEPER_TEST_CRASH_AFTER": "3"}
    )
    assert killed.returncode == -9
    assert [p for p in cold.rglob("*.ckptkeeper-manifest.json") if pf.SCRATCH_PREFIX in str(p)]
    for p in tmp_path.glob("index.db*"):
        p.unlink()
    result = _cli(node.config, "prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "new index built from the tiers" in result.stderr  # a first start: nothing was lost
    assert "deletes held" not in result.stderr
    assert not list(tmp_path.glob("index.db*.deletes-held"))
    assert _scratch_on_disk(node.hot, cold) == []
    node.assert_untouched()


# --------------------------------------------------------------------------------------------
# room: the sample never takes the active runs' headroom


@pytest.mark.parametrize(
    ("sample", "free", "headroom", "copies", "status"),
    [
        (10 << 20, 100 << 20, 30 << 20, 2, "pass"),  # 2 x 10 + 4 slack <= 100 - 30
        (40 << 20, 100 << 20, 30 << 20, 2, "fail"),  # 80 + 4 > 70
        (10 << 20, 40 << 20, 0, 3, "pass"),  # 30 + 4 <= 40
        (13 << 20, 40 << 20, 0, 3, "fail"),  # 39 + 4 > 40
        (1, 0, 0, 2, "fail"),
        (1, None, 0, 2, "fail"),
    ],
)
def test_sample_room_decision(sample: int, free: int | None, headroom: int, copies: int, status: str) -> None:
    check = pf.check_sample_room(sample, free, headroom, 1, copies)
    assert check.status == status, check
    room = pf.sample_room(free, headroom, copies)
    if free is not None:
        assert (sample <= (room or 0)) == (status == "pass")
        assert copies * (room or 0) + headroom + pf.SAMPLE_SLACK <= max(free, headroom + pf.SAMPLE_SLACK)


def test_refused_sample_names_the_room_and_a_fitting_alternative() -> None:
    check = pf.check_sample_room(1 << 30, 1 << 30, 100 << 20, 2, 2)
    assert check.status == "fail"
    assert "refused, no synthetic save written" in check.detail
    assert "kept free for the next save of 2 active run(s)" in check.detail
    assert "--quick" in check.detail


@pytest.fixture
def small_hot(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs as the hot tier: a real filesystem that fills up."""
    hot = tmp_path / "hot"
    hot.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(hot)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield hot
    finally:
        subprocess.run(["umount", "-l", str(hot)], check=False)


def test_preflight_leaves_the_active_runs_next_save_its_room(tmp_path: Path, small_hot: Path) -> None:
    """An active run's 8 MiB saves on a 40 MiB hot tmpfs: a 12 MiB sample (and its restore) would
    leave less than the next save needs, and a training save failed with ENOSPC while preflight
    ran. Refused before any byte is written; a sample that fits runs."""
    warm = tmp_path / "warm"
    warm.mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "0s", "polling": True},
        tiers=[local_tier("hot", small_hot, keep_last=2), local_tier("warm", warm, keep_last=4)],
    )
    ckpt = small_hot / "train" / "checkpoint-100"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(8 << 20))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 100, "log_history": []}))
    assert _cli(config, "scan").returncode == 0
    before = _tree(small_hot / "train")

    refused = _cli(config, "preflight", "--json", "--quick", "--size", "12MiB")
    doc = json.loads(refused.stdout)
    assert doc["rounds"] == [] and doc["throughput"]["hot_write"] is None  # not a byte written
    assert refused.returncode == 6, refused.stderr
    room = _checks(doc)["sample_room"]
    assert room["status"] == "fail" and "refused, no synthetic save written" in room["detail"], room
    assert "8.0 MiB kept free for the next save of 1 active run(s)" in room["detail"], room
    assert _checks(doc)["pipeline"]["status"] == "fail"
    assert _scratch_on_disk(small_hot, warm) == []
    assert _tree(small_hot / "train") == before

    fits = _cli(config, "preflight", "--json", "--quick", "--size", "4MiB")
    doc = json.loads(fits.stdout)
    assert _checks(doc)["sample_room"]["status"] == "pass", doc
    assert _checks(doc)["pipeline"]["status"] == "pass", doc
    assert doc["throughput"]["hot_write"] is not None
    assert _scratch_on_disk(small_hot, warm) == []
    assert _tree(small_hot / "train") == before
